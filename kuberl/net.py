"""Network helpers shared by the roles, the launcher and the test support (no role imports another)."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on `host` right now (the OS picks it; another process may take it later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def reserve_port(host: str = "127.0.0.1") -> socket.socket:
    """A port held for a server of ours, across its start-up and its restarts, until the socket is closed.

    The socket is bound (the OS picks the port: `.getsockname()[1]`) with SO_REUSEADDR and never listens. Linux
    then lets a server that also sets SO_REUSEADDR bind and listen on the port (vLLM, uvicorn, asyncio servers and
    Go's nats-server all do), while nobody else gets it: not bind(0), nor the ephemeral port of an outgoing
    connection, nor a plain bind. With free_port alone, the port is free only until the probe closes, and a server
    restarted on "its" port can find it taken. Not inherited by child processes (PEP 446). Linux semantics (where
    `kuberl run` runs: it pins roles with sched_setaffinity); BSD/macOS would refuse the server's own bind.
    """
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, 0))
    except OSError:
        s.close()
        raise
    return s
