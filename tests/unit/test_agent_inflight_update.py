"""weightSync.inFlight: abort pauses the engine around a load (AReaL's interruptible rollout); keep loads with no
pause or abort (PipelineRL's in-flight update). The engine's side of keep runs on real vLLM in
tests/integration/test_vllm.py; this checks what the agent asks of its engine."""

from __future__ import annotations

import asyncio

from kuberl.api import RLExperiment
from kuberl.runtime.rollout.agent import RolloutAgent


class Recorder:
    version = 0

    def __init__(self) -> None:
        self.calls: list[str] = []

    async def pause(self) -> None:
        self.calls.append("pause")

    async def resume(self) -> None:
        self.calls.append("resume")

    async def update_weights_from_disk(self, path: str, version: int) -> None:
        self.calls.append(f"load v{version} {path}")
        self.version = version


def experiment(in_flight: str | None, **spec) -> RLExperiment:
    weight_sync = {"inFlight": in_flight} if in_flight else {}
    return RLExperiment.model_validate({"apiVersion": "kuberl.io/v1alpha1", "kind": "RLExperiment", "metadata": {"name": "t"}, "spec": {
        "model": {"builtin": "tiny-qwen2"}, "dataset": {"builtin": "repeat-digit"}, "training": {"totalSteps": 3},
        "weightSync": weight_sync | spec.pop("weightSync", {}), **spec}})


def calls(in_flight: str | None, tmp_path) -> list[str]:
    engine = Recorder()
    agent = RolloutAgent(experiment(in_flight), None, engine, None, [], workdir=tmp_path)
    asyncio.run(agent.apply_weights({"version": 3, "mode": "disk", "path": "/w/v3"}))
    assert engine.version == 3 and agent.stats.weight_updates == 1
    return engine.calls


def test_abort_pauses_the_engine_around_the_load(tmp_path):
    assert calls("abort", tmp_path) == ["pause", "load v3 /w/v3", "resume"]


def test_keep_loads_without_pausing(tmp_path):
    assert calls("keep", tmp_path) == ["load v3 /w/v3"]


def test_unset_it_keeps_where_the_engine_implements_keep_and_aborts_elsewhere(tmp_path):
    """The default is the faster path where it is correct: keep on vLLM with full weights through disk or the bus
    (on the TRL comparison task ~1.0x TRL's samples/s against ~0.6x with abort), abort where keep is refused."""
    assert calls(None, tmp_path) == ["load v3 /w/v3"]  # the default experiment: vLLM, disk
    assert experiment(None).spec.in_flight == "keep"
    assert experiment(None, weightSync={"mode": "bus"}).spec.in_flight == "keep"
    assert experiment(None, rollout={"engine": "sglang"}).spec.in_flight == "abort"
    assert experiment(None, allocation="sglang:d1+fsdp:d1").spec.in_flight == "abort"
    assert experiment(None, weightSync={"mode": "broadcast"}).spec.in_flight == "abort"
    assert experiment(None, algorithm={"lora": {"rank": 8, "alpha": 16}}).spec.in_flight == "abort"
    assert experiment("abort").spec.in_flight == "abort"  # what the manifest says wins


def test_an_engine_restarted_behind_the_agents_back_counts_as_lost(tmp_path):
    """A ticket that failed with EngineRestarted (the engine answers, with its initial weights) sends the agent to wait
    for the engine and reload the current weights, even though the engine's health check passes."""
    from kuberl.runtime.inference.base import EngineRestarted

    class Healthy(Recorder):
        async def health(self) -> bool:
            return True

    class Lease:
        delivered = 1
        value = type("T", (), {"ticket_id": "t-1"})()

        async def nak(self, delay=None) -> None:
            pass

    agent = RolloutAgent(experiment("keep"), None, Healthy(), None, [], workdir=tmp_path)
    asyncio.run(agent._give_back(Lease(), RuntimeError("a prompt the engine refused")))
    assert not agent.engine_down  # healthy engine, ordinary failure: just give the ticket back
    asyncio.run(agent._give_back(Lease(), EngineRestarted("vLLM restarted")))
    assert agent.engine_down
