"""kuberl.net: a free port, and a port held for a server across its restarts."""

from __future__ import annotations

import socket

import pytest

from kuberl.net import free_port, reserve_port


def listen_on(port: int) -> socket.socket:
    """What vLLM, uvicorn and nats-server do: SO_REUSEADDR, bind, listen."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", port))
    s.listen()
    return s


def test_a_reserved_port_is_nobody_elses_but_its_server_binds_it_again_and_again():
    with reserve_port() as held:
        port = held.getsockname()[1]
        assert port not in {free_port() for _ in range(500)}
        with socket.socket() as other, pytest.raises(OSError, match="Address already in use"):
            other.bind(("127.0.0.1", port))
        for _ in range(2):
            with listen_on(port) as server, socket.create_connection(("127.0.0.1", port), timeout=5):
                server.accept()[0].close()
        # With no server on it, a client is refused at once (the reservation does not listen).
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=5)


def test_closing_the_reservation_frees_the_port():
    with reserve_port() as held:
        port = held.getsockname()[1]
        listen_on(port).close()
    with socket.socket() as other:
        other.bind(("127.0.0.1", port))


def test_the_reservation_is_not_inherited_by_child_processes():
    with reserve_port() as held:
        assert not held.get_inheritable()
