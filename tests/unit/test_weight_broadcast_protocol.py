"""weightSync.mode broadcast without vLLM: buckets, packing, and a trainer sender serving receiver threads over real gloo groups."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from kuberl.runtime.weight_sync import broadcast as B
from kuberl.runtime.weight_sync.sender import BroadcastSender, model_parameters

INFO = SimpleNamespace(rank=0, world_size=1, is_main=True, device=torch.device("cpu"))


def test_plan_buckets_respects_size_and_order():
    entries = [B.Entry(f"p{i}", (10,), "float32") for i in range(5)]  # 40 bytes -> 48 aligned
    buckets = B.plan_buckets(entries, 100)
    assert [[e.name for e in b] for b in buckets] == [["p0", "p1"], ["p2", "p3"], ["p4"]]
    big = B.plan_buckets([B.Entry("big", (1000,), "float32"), B.Entry("s", (1,), "float32")], 100)
    assert [[e.name for e in b] for b in big] == [["big"], ["s"]]  # bigger than a bucket: alone
    with pytest.raises(ValueError, match="bucketMB"):
        B.plan_buckets(entries, 0)


def test_a_store_that_refuses_connections_fails_at_once_and_a_live_one_connects():
    """A killed trainer's store refuses connections: the engine must not sit out torch's whole connect timeout on it."""
    import datetime
    import time

    import torch.distributed as dist

    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=10))
    port = master.port
    client = B.connect_store("127.0.0.1", port, 10.0)
    client.set("k", "v")
    assert master.get("k") == b"v"
    del client, master  # the trainer is gone: nothing listens on its port any more
    started = time.monotonic()
    with pytest.raises(ConnectionError, match=f"weight store at 127.0.0.1:{port} refuses connections"):
        B.connect_store("127.0.0.1", port, 30.0)
    assert time.monotonic() - started < B.REFUSED_GRACE_S + 2.0


def test_pack_unpack_roundtrip_mixed_dtypes():
    ts = [torch.randn(3, 5), torch.arange(7, dtype=torch.int64), torch.randn(2, dtype=torch.float64)]
    bucket = B.entries_for([("a", ts[0]), ("b", ts[1]), ("c", ts[2])], torch.bfloat16)
    assert [e.dtype for e in bucket] == ["bfloat16", "int64", "bfloat16"]  # floating ones cast, integers kept
    out = dict(B.unpack(bucket, B.pack(bucket, ts)))
    assert torch.equal(out["a"], ts[0].to(torch.bfloat16)) and torch.equal(out["b"], ts[1])
    assert out["c"].dtype == torch.bfloat16 and out["a"].shape == (3, 5)
    assert B.parse_manifest(B.manifest_json([bucket])) == [bucket]
    with pytest.raises(ValueError, match="shape"):
        B.pack(bucket, [torch.randn(5, 3), ts[1], ts[2]])
    with pytest.raises(ValueError, match="not a torch dtype"):
        B.dtype_of("floaty")
    with pytest.raises(ValueError, match="host:port"):
        B.parse_rendezvous("nohost")


class Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(50, 8)
        self.mid = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 50, bias=False)
        self.head.weight = self.embed.weight


def _receiver(record, agent, out, bucket_counts):
    i = B.file_request(record, agent, workers=1)
    assign = B.wait_assignment(record, i, 30)
    stats: dict = {}
    got = {n: t.clone() for n, t in B.receive_weights(assign, local_rank=0, device="cpu", stats=stats)}
    out[agent] = (assign, got, stats)


def test_sender_serves_every_requesting_engine_and_ties_once():
    torch.manual_seed(0)
    model = Tied()
    names = [n for n, _ in model_parameters(model)]
    assert names == ["embed.weight", "mid.weight", "mid.bias"]  # the tied head once, under the first name
    sender = BroadcastSender(rank=0, world_size=1, bucket_mb=1, join_timeout_s=5, timeout_s=20, backend="gloo")
    sender.bucket_bytes = 400  # several buckets for this tiny model
    sender.start()
    record = sender.record()
    out: dict = {}
    threads = [threading.Thread(target=_receiver, args=(record, f"agent-{k}", out, None)) for k in range(2)]
    for t in threads:
        t.start()
    while int(sender.store.add(B.REQ_COUNT, 0)) < 2:
        pass
    assert sender.pending()
    stats = sender.serve(model, 7, torch.float32, new_version=False, info=INFO)
    for t in threads:
        t.join(30)
    assert stats["members"] == 2 and stats["failed"] is None and stats["buckets"] > 1
    assert not sender.pending()
    want = dict(model_parameters(model))
    ranks = set()
    for agent in ("agent-0", "agent-1"):
        assign, got, rstats = out[agent]
        ranks.add(assign["rank"])
        assert assign["version"] == 7 and assign["world"] == 3 and rstats["complete"]
        assert set(got) == set(want)
        for n in want:
            assert torch.equal(got[n], want[n].detach()), n
    assert ranks == {1, 2}
    # Nobody asks: a new version goes to nobody after the short grace, without error.
    assert sender.serve(model, 8, torch.float32, new_version=True, info=INFO)["members"] in (0,)


def test_an_engine_with_several_workers_gets_a_rank_for_each_and_the_engines_dtype():
    """A tensor-parallel engine joins with one rank per worker (its assignment's rank + the worker's local rank), so the next
    engine's ranks start after all of them; every tensor arrives in the dtype the sender was given (the engine's: bf16 for a
    float32 trainer)."""
    torch.manual_seed(0)
    model = Tied()
    sender = BroadcastSender(rank=0, world_size=1, bucket_mb=1, join_timeout_s=5, timeout_s=10, backend="gloo")
    sender.bucket_bytes = 400
    sender.start()
    record = sender.record()
    out: dict = {}

    def engine(agent, workers):
        i = B.file_request(record, agent, workers=workers)
        assign = B.wait_assignment(record, i, 30)

        def worker(local):
            stats: dict = {}
            out[(agent, local)] = (assign, {n: t.clone() for n, t in B.receive_weights(assign, local_rank=local, device="cpu", stats=stats)},
                                   stats)

        threads = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)

    tp = threading.Thread(target=engine, args=("tp2", 2), daemon=True)
    tp.start()
    while int(sender.store.add(B.REQ_COUNT, 0)) < 1:  # the two-worker engine asks first
        pass
    single = threading.Thread(target=engine, args=("single", 1), daemon=True)
    single.start()
    while int(sender.store.add(B.REQ_COUNT, 0)) < 2:
        pass
    stats = sender.serve(model, 5, torch.bfloat16, new_version=False, info=INFO)
    tp.join(30)
    single.join(30)
    assert stats["members"] == 2 and stats["failed"] is None, stats
    assert {k: (a["rank"], a["world"]) for k, (a, _, _) in out.items()} == {("tp2", 0): (1, 4), ("tp2", 1): (1, 4), ("single", 0): (3, 4)}
    want = dict(model_parameters(model))
    for key, (_, got, rstats) in out.items():
        assert rstats["complete"] and set(got) == set(want), key
        for n, p in want.items():
            assert got[n].dtype == torch.bfloat16 and torch.equal(got[n], p.detach().to(torch.bfloat16)), (key, n)


def test_receiver_that_never_joins_does_not_hang_the_sender():
    model = Tied()
    sender = BroadcastSender(rank=0, world_size=1, bucket_mb=1, join_timeout_s=1, timeout_s=5, backend="gloo")
    sender.start()
    B.file_request(sender.record(), "ghost", workers=1)  # asks, then never joins the group
    stats = sender.serve(model, 3, torch.float32, new_version=False, info=INFO)
    assert stats["members"] == 1 and stats["failed"] is not None and stats["bytes"] == 0
    assert sender.usual == set()  # a failed update: nobody is waited for next time


def test_a_member_that_never_joins_is_given_up_on_after_the_rendezvous_limit_not_the_op_timeout(monkeypatch):
    import time

    monkeypatch.setattr(B, "PAUSE_GRACE_S", 1.0)
    sender = BroadcastSender(rank=0, world_size=1, bucket_mb=1, join_timeout_s=1, timeout_s=300, backend="gloo")
    sender.start()
    i = B.file_request(sender.record(), "killed-after-assignment", workers=1)
    started = time.monotonic()
    stats = sender.serve(Tied(), 2, torch.float32, new_version=False, info=INFO)
    assert stats["failed"] and stats["failed"].startswith("group:")
    assert time.monotonic() - started < 30  # ~2 s (join 1 s + grace 1 s), not timeoutSeconds (300 s)
    assert B.wait_assignment(sender.record(), i, 1)["rendezvous_timeout"] == 2.0


def test_wait_assignment_times_out_with_none():
    sender = BroadcastSender(rank=0, world_size=1, bucket_mb=1, join_timeout_s=1, timeout_s=5, backend="gloo")
    sender.start()
    i = B.file_request(sender.record(), "a", workers=1)
    assert B.wait_assignment(sender.record(), i, 0.3) is None


# -- the agent's side: ask, pause, receive, resume; a failed receive keeps the engine paused and asks again ----------


class FakeEngine:
    workers = 1

    def __init__(self, fail_first: int):
        self.fail_first, self.events, self.version = fail_first, [], 0

    async def pause(self):
        self.events.append("pause")

    async def resume(self):
        self.events.append("resume")

    async def health(self):
        return True

    async def update_weights_broadcast(self, assign):
        from kuberl.runtime.inference.base import EngineError

        self.events.append(("update", assign["rank"]))
        if len([e for e in self.events if isinstance(e, tuple)]) <= self.fail_first:
            raise EngineError("gloo timeout")
        self.version = assign["version"]


async def _serve_assignments(sender, version, n):
    import asyncio
    import json

    served = 0
    while served < n:
        count = int(sender.store.add(B.REQ_COUNT, 0))
        for i in range(served + 1, count + 1):
            sender.store.set(B.assign_key(i), json.dumps({"update": f"u{i}", "rank": i, "world": 2, "version": version}))
        served = count
        await asyncio.sleep(0.01)


async def test_agent_keeps_the_engine_paused_and_asks_again_after_a_failed_receive(monkeypatch):
    import asyncio

    from kuberl.runtime.weight_sync import agent_side

    monkeypatch.setattr(agent_side, "RETRY_SECONDS", 0.01)
    sender = BroadcastSender(rank=0, world_size=1, bucket_mb=1, join_timeout_s=1, timeout_s=5, backend="gloo")
    sender.start()
    record = {**sender.record(), "version": 4, "mode": "broadcast"}

    async def get_state(key):
        return record

    engine = FakeEngine(fail_first=1)
    agent = SimpleNamespace(engine=engine, bus=SimpleNamespace(get_state=get_state), agent_id="a1", _progressed=lambda: None)
    serving = asyncio.create_task(_serve_assignments(sender, 4, 2))
    assert await asyncio.wait_for(agent_side.receive_broadcast(agent, record), 20) == 4
    await serving
    # one pause, two receives (the first failed: the engine stayed paused, the agent filed a second request), one resume
    assert engine.events == ["pause", ("update", 1), ("update", 2), "resume"]
    assert engine.version == 4


async def test_agent_gives_up_when_the_engine_is_gone_and_resumes(monkeypatch):
    import asyncio

    from kuberl.runtime.inference.base import EngineError
    from kuberl.runtime.weight_sync import agent_side

    sender = BroadcastSender(rank=0, world_size=1, bucket_mb=1, join_timeout_s=1, timeout_s=5, backend="gloo")
    sender.start()
    record = {**sender.record(), "version": 2, "mode": "broadcast"}

    async def get_state(key):
        return record

    engine = FakeEngine(fail_first=5)

    async def dead():
        return False

    engine.health = dead
    agent = SimpleNamespace(engine=engine, bus=SimpleNamespace(get_state=get_state), agent_id="a1", _progressed=lambda: None)
    serving = asyncio.create_task(_serve_assignments(sender, 2, 1))
    with pytest.raises(EngineError):
        await asyncio.wait_for(agent_side.receive_broadcast(agent, record), 20)
    await serving
    assert engine.events == ["pause", ("update", 1), "resume"]


def test_a_receiver_dying_mid_broadcast_fails_the_update_quickly_for_everyone():
    import time

    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(6)])  # 1 MiB weights: one bucket each
    sender = BroadcastSender(rank=0, world_size=1, bucket_mb=1, join_timeout_s=1, timeout_s=10, backend="gloo")
    sender.start()
    ended: dict = {}

    def receiver(agent, die_after):
        i = B.file_request(sender.record(), agent, workers=1)
        assign = B.wait_assignment(sender.record(), i, 30)
        stats: dict = {}
        try:
            for _ in B.receive_weights(assign, local_rank=0, device="cpu", stats=stats):
                if die_after and stats["buckets"] >= die_after:
                    raise SystemExit("killed")  # the engine dies after its first bucket
        except BaseException as exc:  # noqa: BLE001
            ended[agent] = (type(exc).__name__, stats)
            return
        ended[agent] = ("done", stats)

    threads = [threading.Thread(target=receiver, args=("dies", 1)), threading.Thread(target=receiver, args=("lives", 0))]
    for t in threads:
        t.start()
    while int(sender.store.add(B.REQ_COUNT, 0)) < 2:
        time.sleep(0.01)
    started = time.monotonic()
    stats = sender.serve(model, 1, torch.float32, new_version=False, info=INFO)
    for t in threads:
        t.join(30)
    assert time.monotonic() - started < 10  # well within timeoutSeconds: the lost peer is seen at once
    assert stats["failed"] and stats["failed"].startswith("bucket ") and sender.usual == set()
    assert ended["dies"][0] == "SystemExit"
    assert ended["lives"][0] != "done" and not ended["lives"][1]["complete"]  # it stops with an error, never hangs or half-loads silently


async def test_an_agent_waiting_on_a_dead_trainer_follows_the_restarted_one(monkeypatch):
    import asyncio

    from kuberl.runtime.weight_sync import agent_side

    monkeypatch.setattr(agent_side, "ASSIGN_POLL_SECONDS", 0.2)
    old = BroadcastSender(rank=0, world_size=1, bucket_mb=1, join_timeout_s=1, timeout_s=5, backend="gloo")
    old.start()
    new = BroadcastSender(rank=0, world_size=1, bucket_mb=1, join_timeout_s=1, timeout_s=5, backend="gloo")
    new.start()
    records = {"current": {**old.record(), "version": 1, "mode": "broadcast"}}

    async def get_state(key):
        return records["current"]

    engine = FakeEngine(fail_first=0)
    agent = SimpleNamespace(engine=engine, bus=SimpleNamespace(get_state=get_state), agent_id="a1", _progressed=lambda: None)
    receiving = asyncio.create_task(agent_side.receive_broadcast(agent, records["current"]))
    while int(old.store.add(B.REQ_COUNT, 0)) < 1:
        await asyncio.sleep(0.01)
    old.store = None  # the trainer dies (its store closes) before serving the request
    await asyncio.sleep(0.5)
    records["current"] = {**new.record(), "version": 3, "mode": "broadcast"}  # the restarted trainer's record
    serving = asyncio.create_task(_serve_assignments(new, 3, 1))
    assert await asyncio.wait_for(receiving, 20) == 3
    await serving
    assert engine.events == ["pause", ("update", 1), "resume"]
