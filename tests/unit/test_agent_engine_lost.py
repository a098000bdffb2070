"""The rollout agent when its engine dies mid-generation: the ticket goes back, no ticket is taken while
the engine is away, the restarted engine gets the trainer's current weights before any generation, and
no group mixes tokens from both engine lives. A real nats-server; a scripted engine that can "die"."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from kuberl.api import RLExperiment
from kuberl.runtime.bus import Bus, Ticket
from kuberl.runtime.bus.messages import Sample
from kuberl.runtime.bus.names import KEY_WEIGHTS
from kuberl.runtime.bus.server import start_nats_server
from kuberl.runtime.data import Item
from kuberl.runtime.inference.base import EngineError, GenerateRequest, GenerateResult
from kuberl.runtime.rollout import agent as agent_mod
from kuberl.runtime.rollout.agent import RolloutAgent


class DyingEngine:
    """Answers like an engine; `die()` makes every call fail and health() say so until `restart()`
    (which, like a real restart, serves the initial model again)."""

    url = "http://scripted-engine"

    def __init__(self) -> None:
        self.alive = True
        self.version = 0
        self.loaded: list[int] = []
        self.generated_on: list[int] = []
        self.in_generate = asyncio.Event()
        self.hold = asyncio.Event()
        self.hold.set()

    def set_version(self, v: int) -> None:
        self.version = v

    def die(self) -> None:
        self.alive = False
        self.hold.set()

    def restart(self) -> None:
        self.alive, self.version = True, 0

    async def health(self) -> bool:
        return self.alive

    def _check(self) -> None:
        if not self.alive:
            raise EngineError("vLLM /generate at http://scripted-engine: Cannot connect to host")

    async def generate(self, req: GenerateRequest) -> GenerateResult:
        self._check()
        self.in_generate.set()
        await self.hold.wait()
        self._check()
        self.generated_on.append(self.version)
        return GenerateResult(output_ids=[5, 6], logprobs=[-1.0, -1.0], finish_reason="stop", version=self.version)

    async def pause(self) -> None:
        self._check()

    async def resume(self) -> None:
        self._check()

    async def update_weights_from_disk(self, path: str, version: int) -> None:
        self._check()
        self.loaded.append(version)
        self.version = version


class OneShotWorkflow:
    async def arun_episode(self, engine, item, ctx):
        samples = []
        for reward in (0.0, 1.0):
            res = await engine.generate(GenerateRequest(input_ids=[1, 2], max_new_tokens=2))
            samples.append(Sample(input_ids=[1, 2], output_ids=res.output_ids, logprobs=res.logprobs,
                                  versions=[res.version] * 2, loss_mask=[1, 1], reward=reward))
        return samples


def experiment() -> RLExperiment:
    return RLExperiment.model_validate({"apiVersion": "kuberl.io/v1alpha1", "kind": "RLExperiment", "metadata": {"name": "t"}, "spec": {
        "model": {"builtin": "tiny-qwen2"}, "dataset": {"builtin": "repeat-digit"}, "training": {"totalSteps": 3},
        "algorithm": {"samplesPerPrompt": 2}, "rollout": {"concurrency": 1}}})


@pytest.fixture
def bus_url(tmp_path):
    server = start_nats_server(store_dir=str(tmp_path / "store"))
    yield server.url
    server.stop()


def test_an_engine_that_dies_mid_generation_gets_the_current_weights_before_the_ticket_runs_again(bus_url, tmp_path, monkeypatch):
    monkeypatch.setattr(agent_mod, "NAK_DELAY_SECONDS", 0.5)

    async def main():
        bus = await Bus.connect(bus_url, f"lost-{uuid.uuid4().hex[:8]}")
        engine = DyingEngine()
        agent = RolloutAgent(experiment(), bus, engine, OneShotWorkflow(), [Item(index=0, prompt="p", answer="a")], workdir=tmp_path)
        try:
            await bus.put_state(KEY_WEIGHTS, {"version": 4, "mode": "disk", "path": str(tmp_path / "w4")})
            engine.hold.clear()
            await bus.publish_tickets([Ticket(ticket_id="t0", index=0, epoch=0, issued_version=4)])
            runner = asyncio.create_task(agent.run())
            await asyncio.wait_for(engine.in_generate.wait(), 30)
            assert engine.version == 4  # the initial load
            engine.die()  # kill -9 mid-generation
            await asyncio.sleep(3.0)
            assert agent.stats.failed == 1  # given back once; no ticket taken while the engine is away
            # The probes (rollout/health.py): not ready while the engine is away, and waiting for it is progress.
            assert agent.engine_down and time.monotonic() - agent.last_progress < 2.5
            # The trainer moves on meanwhile; the engine comes back with the initial model.
            await bus.put_state(KEY_WEIGHTS, {"version": 5, "mode": "disk", "path": str(tmp_path / "w5")})
            engine.restart()
            got = []
            for _ in range(60):
                got = await bus.pull_groups(1, timeout=0.5)
                if got:
                    break
            runner.cancel()
            await asyncio.gather(runner, return_exceptions=True)
            assert len(got) == 1 and not agent.engine_down
            group = got[0].value
            assert not group.rejected
            # Every token of the published group came from the reloaded weights, never from the fresh engine's v0.
            assert {v for s in group.samples for v in s.versions} == {5}
            assert 0 not in engine.generated_on and engine.loaded[-1] == 5
        finally:
            await bus.close()

    asyncio.run(main())
