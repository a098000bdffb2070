"""A Bus rides out a nats-server kill -9 and restart (same port, same store): calls made while the
server is down complete once it is back, acked data stays acked, unacked data is redelivered, and a
watch carries on. Each test owns its server (the session one must not die); no engine, no lock needed.
"""

from __future__ import annotations

import asyncio
import shutil
import time
import uuid

import pytest

from kuberl.runtime.bus import Bus, BusError, Ticket, TrajectoryGroup
from kuberl.runtime.bus.outage import OUTAGE_ENV
from kuberl.runtime.bus.server import start_nats_server

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


@pytest.fixture
def server(tmp_path):
    holder = {"s": start_nats_server(store_dir=str(tmp_path / "store"))}
    yield holder
    holder["s"].stop()


async def restart_after(holder: dict, delay: float) -> None:
    """kill -9 now; after `delay` seconds a new server on the same port and store."""
    holder["s"].kill()
    await asyncio.sleep(delay)
    holder["s"] = await asyncio.to_thread(holder["s"].respawn)


def group(gid: str) -> TrajectoryGroup:
    ticket = Ticket(ticket_id=gid, index=0, epoch=0, issued_version=0)
    return TrajectoryGroup(group_id=gid, ticket=ticket, samples=[], agent="t", rejected=True)


# nats-server writes a consumer's state (what it delivered, what was acked) 10 ms after a change: a
# kill -9 sooner loses it. The tests that need it kept wait this long before killing; the next one
# shows what happens when it is lost.
STATE_WRITTEN = 0.5


def name() -> str:
    return f"outage-{uuid.uuid4().hex[:8]}"


def test_calls_made_while_the_server_is_down_complete_after_it_restarts(server):
    async def main():
        bus = await Bus.connect(server["s"].url, name(), publish_timeout=5.0)
        try:
            await bus.put_state("progress", {"step": 1})
            down = asyncio.create_task(restart_after(server, 8.0))  # longer than publish_timeout
            await asyncio.sleep(0.5)
            t0 = time.monotonic()
            await bus.put_state("progress", {"step": 2})
            assert await bus.publish_group(group("g-during"))
            waited = time.monotonic() - t0
            await down
            assert waited > 5.0, "the calls should have waited for the restarted server"
            assert await bus.get_state("progress") == {"step": 2}
            got = await bus.pull_groups(1, timeout=10)
            assert [lease.value.group_id for lease in got] == ["g-during"]
        finally:
            await bus.close()

    asyncio.run(main())


def test_acked_data_stays_acked_and_unacked_data_is_redelivered_after_a_restart(server):
    async def main():
        bus = await Bus.connect(server["s"].url, name(), ticket_ack_wait=3.0)
        try:
            await bus.publish_tickets([Ticket(ticket_id=f"t{i}", index=i, epoch=0, issued_version=0) for i in range(3)])
            first = await bus.pull_tickets(3, timeout=5)
            assert len(first) == 3
            assert await first[0].ack()
            await asyncio.sleep(STATE_WRITTEN)
            await restart_after(server, 1.0)
            assert await first[1].ack()  # an ack after the restart still counts
            # t2 was never acked: it comes again after ack_wait; t0 and t1 never do.
            again = []
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and not again:
                again = await bus.pull_tickets(3, timeout=1)
            assert [lease.value.ticket_id for lease in again] == ["t2"]
            await again[0].ack()
            assert await bus.pull_tickets(3, timeout=4) == []
            assert (await bus.stream_info())["tickets_pending"] == 0
        finally:
            await bus.close()

    asyncio.run(main())


def test_an_ack_of_a_delivery_the_restarted_server_forgot_returns_false_and_the_message_comes_again(server, tmp_path):
    """A kill -9 in the 10 ms before nats-server writes its consumer's state: the restarted server has not
    delivered the message as far as it knows, and JetStream never answers an ack above its delivered
    pointer. The ack must not wait out the bus's timeout (and fail the agent or the trainer): it returns
    False, and the message comes again. Made certain by restarting on the store as it was before the pull."""
    store, before = server["s"].store_dir, tmp_path / "store-before-the-pull"

    async def main():
        bus = await Bus.connect(server["s"].url, name(), ticket_ack_wait=3.0, publish_timeout=4.0)
        try:
            await bus.publish_tickets([Ticket(ticket_id=f"t{i}", index=i, epoch=0, issued_version=0) for i in range(3)])
            server["s"].stop(remove_store=False)  # SIGTERM: the server writes everything down
            shutil.copytree(store, before)
            server["s"] = await asyncio.to_thread(server["s"].respawn)
            await bus.put_state("progress", {"step": 1})  # rides out the restart: connected again
            first = await bus.pull_tickets(3, timeout=5)
            assert [lease.value.ticket_id for lease in first] == ["t0", "t1", "t2"]
            server["s"].kill()
            shutil.rmtree(store)
            shutil.copytree(before, store)
            server["s"] = await asyncio.to_thread(server["s"].respawn)
            t0 = time.monotonic()
            assert await first[1].ack() is False
            assert time.monotonic() - t0 < 15, "the ack waited out more than one unanswered try"
            again = await bus.pull_tickets(3, timeout=5)
            assert sorted(lease.value.ticket_id for lease in again) == ["t0", "t1", "t2"]
            assert all([await lease.ack() for lease in again])
            assert (await bus.stream_info())["tickets_pending"] == 0
        finally:
            await bus.close()

    asyncio.run(main())


def test_an_ack_sent_while_the_server_is_down_is_delivered_when_it_is_back(server):
    async def main():
        # publish_timeout: what the restarted server gets to answer once the client is back. JetStream
        # recovers its store after the port opens; on a loaded 2-core machine that took more than 3 s.
        bus = await Bus.connect(server["s"].url, name(), publish_timeout=10.0)
        try:
            await bus.publish_tickets([Ticket(ticket_id="t0", index=0, epoch=0, issued_version=0)])
            (lease,) = await bus.pull_tickets(1, timeout=5)
            await asyncio.sleep(STATE_WRITTEN)
            down = asyncio.create_task(restart_after(server, 16.0))  # longer than any single ack timeout
            await asyncio.sleep(0.5)
            assert await lease.ack()
            await down
            assert (await bus.stream_info())["tickets_pending"] == 0
        finally:
            await bus.close()

    asyncio.run(main())


def test_a_state_watch_carries_on_across_a_restart(server):
    async def main():
        bus = await Bus.connect(server["s"].url, name())
        seen: list[int] = []

        async def follow():
            async for value in bus.watch_state("weights"):
                seen.append(value["version"])

        try:
            await bus.put_state("weights", {"version": 1})
            watcher = asyncio.create_task(follow())
            await asyncio.sleep(1.0)
            await restart_after(server, 2.0)
            await bus.put_state("weights", {"version": 2})
            deadline = time.monotonic() + 20
            while 2 not in seen and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
            watcher.cancel()
            assert seen == [1, 2]
        finally:
            await bus.close()

    asyncio.run(main())


def test_a_bus_that_stays_away_fails_with_an_error_naming_the_outage(server, monkeypatch):
    monkeypatch.setenv(OUTAGE_ENV, "3")

    async def main():
        bus = await Bus.connect(server["s"].url, name(), publish_timeout=1.0)
        try:
            server["s"].kill()
            with pytest.raises(BusError, match=rf"disconnected for more than 3s \(\${OUTAGE_ENV}\)"):
                await bus.put_state("progress", {"step": 1})
        finally:
            await bus.close()

    asyncio.run(main())


def test_weights_uploaded_and_downloaded_across_a_restart_arrive_whole(server, tmp_path):
    """weightSync.mode bus: a kill -9 of the server mid-upload (or mid-download) costs a retry, not the
    trainer (or the agent): the call completes once the server is back and the files arrive byte for byte."""
    import os

    src = tmp_path / "v3"
    src.mkdir()
    blobs = {f"model-{i}.safetensors": os.urandom(6_000_000) for i in range(4)}  # 24 MB in 2 MB chunks
    for rel, data in blobs.items():
        (src / rel).write_bytes(data)
    (src / "config.json").write_text("{}")

    async def main():
        bus = await Bus.connect(server["s"].url, name(), publish_timeout=5.0)
        try:
            upload = asyncio.create_task(bus.put_weights(3, src))
            await asyncio.sleep(0.05)  # mid-upload
            assert not upload.done(), "the upload finished before the kill: make the blobs bigger"
            await restart_after(server, 3.0)
            assert await asyncio.wait_for(upload, 60) == "v3"
            assert await bus.list_weights() == ["v3"]
            download = asyncio.create_task(bus.get_weights("v3", tmp_path / "got"))
            await asyncio.sleep(0.05)  # mid-download
            await restart_after(server, 3.0)
            dest = await asyncio.wait_for(download, 60)
        finally:
            await bus.close()
        for rel, data in blobs.items():
            assert (tmp_path / "got" / rel).read_bytes() == data
        assert sorted(p.name for p in (tmp_path / "got").iterdir()) == sorted([*blobs, "config.json"])
        assert dest == str(tmp_path / "got")
        assert not [p for p in tmp_path.iterdir() if p.name.startswith(".got.tmp-")], "a half-downloaded folder was left"

    asyncio.run(main())
