"""The Bus against a real nats-server: tickets as a work queue, groups with dedupe and chunking,
trainer consumer reset, KV state and weights in the object store."""

from __future__ import annotations

import asyncio
import os
import random

import pytest
import pytest_asyncio

from kuberl.runtime.bus import (
    Bus,
    BusError,
    BusFullError,
    GroupTooLargeError,
    Sample,
    Ticket,
    TrajectoryGroup,
)
from kuberl.runtime.bus.messages import encode

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def ticket(i: int, epoch: int = 0) -> Ticket:
    return Ticket(ticket_id=f"e{epoch}-i{i}-{i}", index=i, epoch=epoch, issued_version=0)


def group(i: int, *, samples: int = 2, tokens: int = 8, version: int = 0, seed: int = 0) -> TrajectoryGroup:
    rng = random.Random(seed * 7919 + i)
    t = ticket(i)
    ss = [
        Sample(
            input_ids=[rng.randrange(50_000) for _ in range(6)],
            output_ids=[rng.randrange(50_000) for _ in range(tokens)],
            logprobs=[-rng.random() * 5 for _ in range(tokens)],
            versions=[version] * tokens,
            loss_mask=[1] * tokens,
            reward=float(rng.random()),
        )
        for _ in range(samples)
    ]
    return TrajectoryGroup(group_id=t.ticket_id, ticket=t, samples=ss, agent="agent-0", created_at=1000.0 + i)


# Function loop scope: the client must live on the test's own event loop.
@pytest_asyncio.fixture(loop_scope="function")
async def bus(nats_server, experiment_name):
    b = await Bus.connect(nats_server.url, experiment_name, ticket_ack_wait=1.0)
    yield b
    await b.close()


class TestTickets:
    async def test_two_agents_never_get_the_same_ticket(self, nats_server, experiment_name, bus):
        assert await bus.publish_tickets([ticket(i) for i in range(40)]) == 40
        a = await Bus.connect(nats_server.url, experiment_name)
        b = await Bus.connect(nats_server.url, experiment_name)

        async def drain(agent: Bus) -> list[str]:
            got = []
            while (lease := await agent.pull_ticket(timeout=0.5)) is not None:
                got.append(lease.value.ticket_id)
                await lease.ack()
            return got

        try:
            got_a, got_b = await asyncio.gather(drain(a), drain(b))
        finally:
            await a.close()
            await b.close()
        assert not set(got_a) & set(got_b)
        assert sorted(got_a + got_b) == sorted(ticket(i).ticket_id for i in range(40))
        assert (await bus.stream_info())["tickets_pending"] == 0

    async def test_concurrent_pulls_in_one_agent_get_distinct_tickets(self, bus):
        await bus.publish_tickets([ticket(i) for i in range(10)])
        leases = await asyncio.gather(*(bus.pull_ticket(timeout=2) for _ in range(10)))
        assert sorted(lease.value.index for lease in leases) == list(range(10))

    async def test_an_unacked_ticket_is_redelivered_after_ack_wait(self, nats_server, experiment_name, bus):
        await bus.publish_tickets([ticket(0)])
        first = await bus.pull_ticket(timeout=2)
        assert first is not None and first.delivered == 1
        other = await Bus.connect(nats_server.url, experiment_name)
        try:
            assert await other.pull_ticket(timeout=0.3) is None  # still leased
            again = await other.pull_ticket(timeout=3)  # ack_wait is 1 s
        finally:
            await other.close()
        assert again is not None and again.value == first.value and again.delivered == 2

    async def test_in_progress_keeps_the_lease_past_ack_wait(self, bus):
        await bus.publish_tickets([ticket(0)])
        lease = await bus.pull_ticket(timeout=2)
        for _ in range(5):
            await asyncio.sleep(0.4)
            await lease.in_progress()
        assert await bus.pull_ticket(timeout=0.3) is None
        await lease.ack()

    async def test_nak_gives_the_ticket_back_at_once(self, bus):
        await bus.publish_tickets([ticket(0)])
        lease = await bus.pull_ticket(timeout=2)
        await lease.nak()
        again = await bus.pull_ticket(timeout=0.5)
        assert again is not None and again.value.ticket_id == "e0-i0-0"

    async def test_reissuing_the_same_tickets_is_deduplicated(self, bus):
        assert await bus.publish_tickets([ticket(i) for i in range(5)]) == 5
        assert await bus.publish_tickets([ticket(i) for i in range(7)]) == 2
        assert (await bus.stream_info())["tickets_pending"] == 7

    async def test_an_undecodable_ticket_is_dropped_and_counted(self, bus):
        await bus.js.publish(bus.names.tickets_subject, b"{not json")
        await bus.publish_tickets([ticket(1)])
        lease = await bus.pull_ticket(timeout=2)
        assert lease.value.index == 1 and bus.bad_messages == 1


class TestGroups:
    async def test_a_group_round_trips_with_its_head_version(self, bus):
        g = group(1, version=3)
        assert await bus.publish_group(g)
        [lease] = await bus.pull_groups(1, timeout=2)
        assert lease.value == g and lease.value.head_version == 3
        await lease.ack()
        assert (await bus.stream_info())["groups_pending"] == 0

    async def test_the_same_group_id_is_stored_once(self, bus):
        assert await bus.publish_group(group(1))
        assert not await bus.publish_group(group(1, seed=5))  # same id, other content
        leases = await bus.pull_groups(5, timeout=0.5)
        assert [lease.value for lease in leases] == [group(1)]

    async def test_a_rejected_group_travels_without_samples(self, bus):
        t = ticket(4)
        await bus.publish_group(TrajectoryGroup(group_id=t.ticket_id, ticket=t, rejected=True))
        [lease] = await bus.pull_groups(1, timeout=2)
        assert lease.value.rejected and lease.value.samples == []

    async def test_a_group_over_max_payload_is_chunked_and_reassembled(self, nats_server, experiment_name):
        bus = await Bus.connect(nats_server.url, experiment_name, max_payload="64KB")
        try:
            big = group(7, samples=4, tokens=6000)  # random tokens: ~5x 64 KB even compressed
            size = len(encode(big))
            assert size > 3 * bus.chunk_size
            assert await bus.publish_group(big)
            assert await bus.publish_group(group(8))
            info = await bus.js.stream_info(bus.names.traj_stream)
            assert info.state.messages == -(-size // bus.chunk_size) + 2  # chunks + head + small group
            leases = await bus.pull_groups(2, timeout=3)
            assert [lease.value for lease in leases] == [big, group(8)]
            for lease in leases:
                await lease.ack()
            info = await bus.js.stream_info(bus.names.traj_stream)
            assert info.state.messages == 0  # chunks were acked with their group
        finally:
            await bus.close()

    async def test_republishing_a_chunked_group_leaves_no_orphan_chunks(self, nats_server, experiment_name):
        bus = await Bus.connect(nats_server.url, experiment_name, max_payload="64KB")
        try:
            big = group(7, samples=4, tokens=6000)
            assert await bus.publish_group(big)
            before = (await bus.js.stream_info(bus.names.traj_stream)).state.messages
            assert not await bus.publish_group(big)
            assert (await bus.js.stream_info(bus.names.traj_stream)).state.messages == before
        finally:
            await bus.close()

    async def test_a_group_that_can_never_fit_is_refused_clearly(self, nats_server, experiment_name):
        bus = await Bus.connect(nats_server.url, experiment_name, max_payload="64KB", max_bytes="200KB")
        try:
            with pytest.raises(GroupTooLargeError, match=r"group e0-i7-7 is \d+ bytes"):
                await bus.publish_group(group(7, samples=8, tokens=6000))
            assert (await bus.js.stream_info(bus.names.traj_stream)).state.messages == 0
        finally:
            await bus.close()

    async def test_a_full_stream_refuses_groups_loudly_and_takes_them_again_once_drained(self, nats_server, experiment_name):
        bus = await Bus.connect(nats_server.url, experiment_name, max_bytes="60KB")
        try:
            published = 0
            with pytest.raises(BusFullError, match="the stream is full"):
                for i in range(100):
                    await bus.publish_group(group(i, tokens=1500))
                    published += 1
            assert 0 < published < 100
            assert (await bus.stream_info())["groups_pending"] == published
            for lease in await bus.pull_groups(published, timeout=2):
                await lease.ack()
            assert await bus.publish_group(group(published, tokens=1500))
        finally:
            await bus.close()

    async def test_reset_trainer_consumer_redelivers_unacked_groups_at_once(self, bus):
        for i in range(3):
            await bus.publish_group(group(i))
        first = await bus.pull_groups(3, timeout=2)
        await first[0].ack()
        assert await bus.pull_groups(3, timeout=0.3) == []  # the other two are leased
        await bus.reset_trainer_consumer()
        await first[1].ack()  # a lease from before the reset is void
        again = await bus.pull_groups(3, timeout=1)
        assert sorted(lease.value.group_id for lease in again) == ["e0-i1-1", "e0-i2-2"]

    async def test_pull_groups_waits_for_groups_published_later(self, bus):
        async def later():
            await asyncio.sleep(0.3)
            await bus.publish_group(group(1))

        task = asyncio.create_task(later())
        leases = await bus.pull_groups(1, timeout=3)
        await task
        assert [lease.value.group_id for lease in leases] == ["e0-i1-1"]

    async def test_stream_info_counts_groups_not_chunks(self, nats_server, experiment_name):
        bus = await Bus.connect(nats_server.url, experiment_name, max_payload="64KB")
        try:
            await bus.publish_group(group(7, samples=4, tokens=6000))
            await bus.publish_group(group(8))
            assert (await bus.stream_info())["groups_pending"] == 2
        finally:
            await bus.close()


class TestState:
    async def test_state_round_trips_and_unset_keys_are_none(self, bus):
        assert await bus.get_state("policy_version") is None
        await bus.put_state("policy_version", {"version": 4})
        assert await bus.get_state("policy_version") == {"version": 4}

    async def test_a_watch_sees_the_current_value_then_every_update(self, bus):
        await bus.put_state("weights", {"version": 1})
        seen = []
        started = asyncio.Event()

        async def watch():
            async for value in bus.watch_state("weights"):
                seen.append(value["version"])
                started.set()
                if len(seen) == 3:
                    return

        task = asyncio.create_task(watch())
        await asyncio.wait_for(started.wait(), 5)  # the value set before the watch began
        await bus.put_state("weights", {"version": 2})
        await bus.put_state("weights", {"version": 1})  # a restarted trainer may go back
        await asyncio.wait_for(task, 5)
        assert seen == [1, 2, 1]

    async def test_bad_keys_and_values_are_refused(self, bus):
        with pytest.raises(ValueError, match="KV key 'a b'"):
            await bus.put_state("a b", {})
        with pytest.raises(TypeError, match="must be a dict"):
            await bus.put_state("progress", [1, 2])


class TestWeights:
    async def test_weights_round_trip_through_the_object_store(self, bus, tmp_path):
        src = tmp_path / "v3"
        (src / "sub").mkdir(parents=True)
        blob = os.urandom(3_000_000)
        (src / "model.safetensors").write_bytes(blob)
        (src / "config.json").write_text('{"a": 1}')
        (src / "sub" / "tok.json").write_text("{}")
        prefix = await bus.put_weights(3, src)
        assert prefix == "v3" and await bus.list_weights() == ["v3"]
        out = await bus.get_weights(prefix, tmp_path / "out")
        assert (tmp_path / "out" / "model.safetensors").read_bytes() == blob
        assert sorted(p.name for p in (tmp_path / "out").rglob("*")) == ["config.json", "model.safetensors", "sub", "tok.json"]
        assert out == str(tmp_path / "out")
        assert await bus.delete_weights(prefix) == 3
        assert await bus.list_weights() == []
        with pytest.raises(FileNotFoundError, match="weights 'v3' are not in the object store"):
            await bus.get_weights(prefix, tmp_path / "again")

    async def test_an_empty_weights_folder_is_refused(self, bus, tmp_path):
        with pytest.raises(FileNotFoundError, match="holds no files"):
            await bus.put_weights(1, tmp_path)


class TestConnecting:
    async def test_an_unreachable_server_gives_a_clear_error(self, experiment_name):
        from kuberl.net import reserve_port

        with reserve_port() as held, pytest.raises(BusError, match=r"cannot reach the bus at nats://127.0.0.1:\d+ within 1s"):
            await Bus.connect(f"nats://127.0.0.1:{held.getsockname()[1]}", experiment_name, connect_timeout=1)

    async def test_binding_to_an_experiment_that_does_not_exist_names_it(self, nats_server, experiment_name):
        with pytest.raises(BusError, match=f"experiment '{experiment_name}' do not exist"):
            await Bus.connect(nats_server.url, experiment_name, create=False)

    async def test_binding_after_creation_works(self, nats_server, experiment_name, bus):
        await bus.publish_tickets([ticket(0)])
        other = await Bus.connect(nats_server.url, experiment_name, create=False)
        try:
            assert (await other.pull_ticket(timeout=2)).value == ticket(0)
        finally:
            await other.close()

    async def test_a_bad_experiment_name_is_refused(self, nats_server):
        with pytest.raises(ValueError, match="'My_Exp' is not a DNS-1123 label"):
            await Bus.connect(nats_server.url, "My_Exp")

    async def test_the_url_comes_from_the_environment(self, nats_server, experiment_name, monkeypatch):
        monkeypatch.setenv("KUBERL_BUS_URL", nats_server.url)
        bus = await Bus.connect(None, experiment_name)
        await bus.close()
        monkeypatch.delenv("KUBERL_BUS_URL")
        with pytest.raises(BusError, match="KUBERL_BUS_URL"):
            await Bus.connect(None, experiment_name)


class TestLeaseHelpers:
    async def test_keep_alive_holds_a_ticket_while_work_runs(self, bus):
        await bus.publish_tickets([ticket(0)])
        lease = await bus.pull_ticket(timeout=2)
        async with lease.keep_alive(interval=0.3):
            await asyncio.sleep(2.0)  # twice the ack_wait of 1 s
            assert await bus.pull_ticket(timeout=0.2) is None
        await lease.ack()
        assert (await bus.stream_info())["tickets_pending"] == 0

    async def test_pull_tickets_takes_several_at_once(self, bus):
        await bus.publish_tickets([ticket(i) for i in range(5)])
        leases = await bus.pull_tickets(3, timeout=2)
        assert [lease.value.index for lease in leases] == [0, 1, 2]


class TestConsumerRecovery:
    async def test_a_deleted_agents_consumer_is_recreated_by_the_next_pull(self, bus):
        await bus.publish_tickets([ticket(0)])
        assert await bus.pull_ticket(timeout=0.5) is not None
        await bus.js.delete_consumer(bus.names.tickets_stream, "agents")
        lease = await bus.pull_ticket(timeout=5)
        assert lease is not None and lease.value.index == 0  # unacked, so it comes again

    async def test_a_deleted_trainer_consumer_is_recreated_and_old_leases_are_void(self, bus):
        await bus.publish_group(group(1))
        [old] = await bus.pull_groups(1, timeout=2)
        await bus.js.delete_consumer(bus.names.traj_stream, "trainer")
        [new] = await bus.pull_groups(1, timeout=5)
        await old.ack()  # void: must not remove the message
        assert new.value.group_id == "e0-i1-1" and (await bus.stream_info())["groups_pending"] == 1
        await new.ack()
        assert (await bus.stream_info())["groups_pending"] == 0


class TestFreshStart:
    async def test_reset_experiment_forgets_messages_state_and_dedupe_ids(self, nats_server, experiment_name, bus):
        agent = await Bus.connect(nats_server.url, experiment_name)
        try:
            await bus.publish_tickets([ticket(0), ticket(1)])
            assert (await agent.pull_ticket(timeout=2)).value.index == 0
            await bus.publish_group(group(0))
            await bus.put_state("progress", {"step": 3})
            await bus.reset_experiment()
            assert await bus.get_state("progress") is None
            assert await bus.stream_info() == dict.fromkeys(
                ["tickets_pending", "tickets_waiting", "tickets_in_flight", "groups_pending", "groups_waiting", "groups_unacked", "traj_bytes"], 0)
            assert await bus.publish_tickets([ticket(0)]) == 1  # the old id is not deduplicated any more
            assert (await agent.pull_ticket(timeout=5)).value.index == 0  # the agent re-binds by itself
            assert await agent.publish_group(group(0))
        finally:
            await agent.close()

    async def test_a_state_watch_survives_reset_experiment(self, nats_server, experiment_name, bus, monkeypatch):
        from kuberl.runtime.bus import state

        monkeypatch.setattr(state, "WATCH_CHECK_SECONDS", 1.0)
        agent = await Bus.connect(nats_server.url, experiment_name)
        seen: list[int] = []
        started = asyncio.Event()

        async def watch():
            async for value in agent.watch_state("weights"):
                seen.append(value["version"])
                started.set()
                if len(seen) == 2:
                    return

        try:
            await bus.put_state("weights", {"version": 5})
            task = asyncio.create_task(watch())
            await asyncio.wait_for(started.wait(), 5)
            await bus.reset_experiment()
            await bus.put_state("weights", {"version": 0})  # revision 1 again in the new bucket
            await asyncio.wait_for(task, 15)
            assert seen == [5, 0]
        finally:
            await agent.close()


class TestRobustness:
    async def test_many_roles_connecting_at_once_share_one_set_of_objects(self, nats_server, experiment_name):
        buses = await asyncio.gather(*(Bus.connect(nats_server.url, experiment_name) for _ in range(6)))
        try:
            await buses[0].publish_tickets([ticket(0)])
            assert (await buses[5].pull_ticket(timeout=2)).value == ticket(0)
        finally:
            await asyncio.gather(*(b.close() for b in buses))

    async def test_chunks_of_a_publisher_that_died_are_removed_once_the_stream_moves_on(self, nats_server, experiment_name):
        from kuberl.runtime.bus.names import (
            H_ATTEMPT,
            H_CHUNK,
            H_CHUNKS,
            H_GROUP,
            H_MSG_ID,
        )

        bus = await Bus.connect(nats_server.url, experiment_name)
        try:
            bus._assembler.grace = 0.5  # instead of 120 s
            for i in range(2):  # 2 of 3 chunks, then the publisher "dies"
                headers = {H_MSG_ID: f"dead.a.{i}", H_GROUP: "dead", H_ATTEMPT: "a", H_CHUNK: str(i), H_CHUNKS: "3"}
                await bus.js.publish(bus.names.chunk_subject, b"x" * 100, headers=headers)
            await asyncio.sleep(1.0)
            await bus.publish_group(group(1))
            [lease] = await bus.pull_groups(1, timeout=3)
            await lease.ack()
            assert lease.value.group_id == "e0-i1-1" and bus.bad_messages == 2
            assert (await bus.js.stream_info(bus.names.traj_stream)).state.messages == 0
        finally:
            await bus.close()


class TestStoreCreation:
    """nats-server may answer "error creating store for stream" (500, err_code 10049) while a stream that
    reset_experiment just deleted is still being removed from its disk (CI, 2026-11-28): the bus tries again."""

    @staticmethod
    def failing(bus: Bus, monkeypatch, times: int) -> list[str]:
        import nats.js.errors

        real, calls = bus.js.add_stream, []

        async def add_stream(config=None, **kw):
            calls.append(config.name)
            if len(calls) <= times:
                raise nats.js.errors.ServerError(code=500, err_code=10049, description="error creating store for stream")
            return await real(config, **kw)

        monkeypatch.setattr(bus.js, "add_stream", add_stream)
        return calls

    async def test_a_store_the_server_cannot_create_at_first_is_created_on_a_later_attempt(self, bus, monkeypatch):
        calls = self.failing(bus, monkeypatch, times=2)
        await bus.reset_experiment()
        assert calls[:3] == [calls[0]] * 3  # the first stream, tried three times
        assert await bus.publish_tickets([ticket(0)]) == 1
        assert (await bus.pull_ticket(timeout=2)).value.ticket_id == ticket(0).ticket_id

    async def test_a_store_that_never_comes_is_a_bus_error_naming_it(self, bus, monkeypatch):
        self.failing(bus, monkeypatch, times=100)
        with pytest.raises(BusError, match=r"cannot create stream \S+_TICKETS on nats://.*error creating store for stream \(5 attempts\)"):
            await bus.reset_experiment()
