"""The trainer against a real nats-server: real tiny model, real optimizer steps, real weight files.

The test plays the rollout agent: it takes the trainer's tickets, samples responses with the tiny model
(behaviour logprobs from the same model), scores them, and publishes trajectory groups. The trainer runs
as `kuberl trainer` subprocesses (and under torchrun for two ranks), as it does in a pod.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from kuberl.runtime.bus import Bus, Sample, Ticket, TrajectoryGroup
from kuberl.runtime.trainer.batch import response_logprobs
from kuberl.runtime.trainer.weights import load_weights

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

B, N = 2, 2  # groups per step, samples per group


@pytest.fixture(scope="module")
def bus_url(request) -> str:
    """B's session nats-server when its fixture exists, else one for this module."""
    try:
        return request.getfixturevalue("nats_server").url
    except pytest.FixtureLookupError:
        from kuberl.runtime.bus import start_nats_server

        server = start_nats_server()
        request.addfinalizer(server.stop)
        return server.url


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from kuberl.runtime.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("model") / "tiny", seed=0)


def write_manifest(path: Path, name: str, model: Path, *, steps: int, eta: int = 1, every: int = 1, world: int = 1, mode: str = "disk") -> Path:
    doc = {
        "apiVersion": "kuberl.io/v1alpha1", "kind": "RLExperiment", "metadata": {"name": name},
        "spec": {
            "model": {"path": str(model), "dtype": "float32"},
            "dataset": {"builtin": "repeat-digit", "size": 32},
            "algorithm": {"name": "grpo", "samplesPerPrompt": N, "batchSize": B, "maxNewTokens": 6, "learningRate": 1e-2,
                          "ppoMinibatches": 2},
            "staleness": {"maxHeadOffpolicyness": eta},
            "rollout": {"engine": "vllm", "accelerator": {"type": "cpu", "count": 0}},
            "trainer": {"accelerator": {"type": "cpu", "count": world}, "microBatchTokens": 64},
            "weightSync": {"mode": mode},
            "checkpoint": {"everySteps": every, "keep": 2},
            "training": {"totalSteps": steps},
        },
    }
    path.write_text(yaml.safe_dump(doc))
    return path


class FakeAgent:
    """Turns tickets into trajectory groups with the tiny model (what the rollout agent and engine do)."""

    def __init__(self, bus: Bus, model_dir: Path):
        from transformers import AutoModelForCausalLM

        self.bus = bus
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.published: list[str] = []
        self.stale_next = 0  # publish this many groups tagged with version 0 (to be dropped)

    async def version(self) -> int:
        return ((await self.bus.get_state("policy_version")) or {}).get("version", 0)

    def sample(self, ticket: Ticket, version: int) -> TrajectoryGroup:
        gen = torch.Generator().manual_seed(hash(ticket.ticket_id) % 2**31)
        prompt = [int(x) for x in torch.randint(3, 200, (5,), generator=gen)]
        samples = []
        for k in range(N):
            with torch.no_grad():
                ids = self.model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=True, top_k=0,
                                          pad_token_id=0, eos_token_id=None)
            out = ids[0, len(prompt):].tolist()
            with torch.no_grad():
                lp = response_logprobs(self.model, [prompt], [out], len(out))[0].tolist()
            # A reward with in-group variance: the first sample wins.
            samples.append(Sample(input_ids=prompt, output_ids=out, logprobs=lp, versions=[version] * len(out),
                                  loss_mask=[1] * len(out), reward=1.0 if k == 0 else 0.0))
        return TrajectoryGroup(group_id=ticket.ticket_id, ticket=ticket, samples=samples, agent="fake")

    async def serve(self, limit: int | None = None, paused: asyncio.Event | None = None) -> None:
        """Answer tickets until cancelled (or `limit` groups)."""
        while limit is None or len(self.published) < limit:
            if paused is not None and paused.is_set():
                await asyncio.sleep(0.2)
                continue
            lease = await self.bus.pull_ticket(timeout=0.5)
            if lease is None:
                continue
            version = await self.version()
            if self.stale_next > 0:
                self.stale_next -= 1
                version = 0
            group = self.sample(lease.value, version)
            await self.bus.publish_group(group)
            await lease.ack()
            self.published.append(group.group_id)


def start_trainer(manifest: Path, bus_url: str, workdir: Path, log: Path, world: int = 1) -> subprocess.Popen:
    env = {**os.environ, "KUBERL_BUS_URL": bus_url, "KUBERL_WORKDIR": str(workdir), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "kuberl.cli", "trainer", "--config", str(manifest)]
    if world > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}", "-m", "kuberl.cli",
               "trainer", "--config", str(manifest)]
    return subprocess.Popen(cmd, env=env, stdout=open(log, "ab"), stderr=subprocess.STDOUT, start_new_session=True)


async def wait_for(pred, timeout: float, what: str, proc: subprocess.Popen | None = None, log: Path | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = await pred()
        if got:
            return got
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"trainer exited with {proc.returncode} while waiting for {what}:\n{log.read_text()[-4000:] if log else ''}")
        await asyncio.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}:\n{log.read_text()[-4000:] if log else ''}")


def finish(proc: subprocess.Popen, log: Path, timeout: float = 120) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise AssertionError(f"trainer did not finish:\n{log.read_text()[-4000:]}")


def metrics(workdir: Path) -> list[dict]:
    return [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines() if x.strip()]


async def test_the_trainer_trains_on_groups_from_the_bus_publishes_new_weights_and_acks(tmp_path, bus_url, tiny_model):
    name = "tr-basic"
    manifest = write_manifest(tmp_path / "exp.yaml", name, tiny_model, steps=2, eta=0)
    workdir, log = tmp_path / "work", tmp_path / "trainer.log"
    bus = await Bus.connect(bus_url, name)
    proc = start_trainer(manifest, bus_url, workdir, log)
    try:
        # eta = 0 at version 0: exactly B tickets, no more, before any group comes back.
        tickets = await wait_for(lambda: bus.get_state("tickets"), 90, "the ticket book", proc, log)
        await asyncio.sleep(1.0)
        assert (await bus.stream_info())["tickets_pending"] == B
        assert (await bus.get_state("tickets"))["issued"] == B, tickets
        agent = FakeAgent(bus, tiny_model)
        task = asyncio.create_task(agent.serve())
        code = await asyncio.to_thread(finish, proc, log)
        task.cancel()
        assert code == 0, log.read_text()[-4000:]
        progress = await bus.get_state("progress")
        assert progress["done"] is True and progress["step"] == 2 and progress["failed"] is None
        assert progress["policy_version"] == 2 and progress["checkpoint"]["step"] == 2
        for field in ("reward_mean", "samples_per_second", "staleness_mean", "staleness_max", "dropped_stale",
                      "trainer_wait_fraction", "groups_buffered", "epoch", "total_steps", "time"):
            assert field in progress, field
        weights = await bus.get_state("weights")
        assert weights["version"] == 2 and weights["mode"] == "disk" and weights["path"] == str(workdir / "weights" / "v2")
        assert (await bus.get_state("policy_version")) == {"version": 2}
        v0, v2 = load_weights(workdir / "weights" / "v0"), load_weights(workdir / "weights" / "v2")
        changed = [k for k in v0 if not torch.equal(v0[k], v2[k])]
        assert len(changed) > len(v0) // 2, f"only {changed} changed"
        from transformers import AutoModelForCausalLM

        AutoModelForCausalLM.from_pretrained(workdir / "weights" / "v2")  # an engine can load it
        # Every trained group was acknowledged once the final checkpoint covered it.
        info = await bus.stream_info()
        assert info["groups_pending"] == 0 and info["groups_unacked"] == 0, info
        rows = metrics(workdir)
        assert [r["step"] for r in rows] == [1, 2] and all(r["samples"] == B * N for r in rows)
        assert all(r["staleness_max"] == 0 for r in rows)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        await bus.close()
