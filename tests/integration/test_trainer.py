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
        self.stale_next = 0  # publish this many groups tagged with version 0 (to be dropped) ...
        self.stale_from = 0  # ... once the policy version is at least this (decided here, so no race with the test)

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
            if self.stale_next > 0 and version >= self.stale_from:
                self.stale_next -= 1
                version = 0
            group = self.sample(lease.value, version)
            await self.bus.publish_group(group)
            await lease.ack()
            self.published.append(group.group_id)


def start_trainer(manifest: Path, bus_url: str, workdir: Path, log: Path, world: int = 1, termination_log: Path | None = None) -> subprocess.Popen:
    env = {**os.environ, "KUBERL_BUS_URL": bus_url, "KUBERL_WORKDIR": str(workdir), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    if termination_log is not None:
        env["KUBERL_TERMINATION_LOG"] = str(termination_log)
    cmd = [sys.executable, "-m", "kuberl.cli", "trainer", "--config", str(manifest)]
    if world > 1:  # torchrun as the trainer pod runs it: through the wrapper that passes exit code 2 on
        cmd = [sys.executable, "-m", "kuberl.runtime.trainer.torchrun", "--standalone", f"--nproc-per-node={world}", "-m", "kuberl.cli",
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
        assert progress["reward_mean"] == 0.5, "the final report keeps the last step's numbers"
        assert 0.0 <= progress["trainer_wait_fraction"] <= 1.0 and progress["samples_per_second"] > 0
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
        assert {"train.collect", "train.prox_logp", "train.ppo_update", "train.publish_weights"} <= set(rows[0]["timings"])
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        await bus.close()


async def test_groups_older_than_the_staleness_bound_are_dropped_counted_and_replaced(tmp_path, bus_url, tiny_model):
    name = "tr-stale"
    manifest = write_manifest(tmp_path / "exp.yaml", name, tiny_model, steps=2, eta=0, every=2)
    workdir, log = tmp_path / "work", tmp_path / "trainer.log"
    bus = await Bus.connect(bus_url, name)
    proc = start_trainer(manifest, bus_url, workdir, log)
    agent = FakeAgent(bus, tiny_model)
    # At version 1 with eta 0, a group generated by version 0 is too stale to train on: the first group
    # the agent answers at version >= 1 claims version 0.
    agent.stale_next, agent.stale_from = 1, 1
    try:
        task = asyncio.create_task(agent.serve())
        await wait_for(lambda: _at_step(bus, 1), 90, "step 1", proc, log)
        code = await asyncio.to_thread(finish, proc, log)
        task.cancel()
        assert code == 0, log.read_text()[-4000:]
        progress = await bus.get_state("progress")
        assert progress["done"] and progress["step"] == 2 and progress["dropped_stale"] == 1
        book = await bus.get_state("tickets")
        # The dropped group gave its slot back: one extra ticket was issued to replace it.
        assert book["dropped"] == 1 and book["issued"] == 2 * B + 1 and book["consumed"] == 2 * B
        assert len(agent.published) == 2 * B + 1
        rows = metrics(workdir)
        assert rows[-1]["dropped_stale"] == 1 and rows[-1]["staleness_max"] == 0
        info = await bus.stream_info()
        assert info["groups_pending"] == 0, "the dropped group is acknowledged with the checkpoint too"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        await bus.close()


async def _at_step(bus: Bus, step: int) -> bool:
    p = await bus.get_state("progress")
    return bool(p and p["step"] >= step)


async def test_two_ranks_with_fsdp2_train_and_end_with_identical_full_weights(tmp_path, bus_url, tiny_model):
    name = "tr-two-ranks"
    manifest = write_manifest(tmp_path / "exp.yaml", name, tiny_model, steps=2, eta=1, every=2, world=2)
    workdir, log = tmp_path / "work", tmp_path / "trainer.log"
    bus = await Bus.connect(bus_url, name)
    proc = start_trainer(manifest, bus_url, workdir, log, world=2)
    agent = FakeAgent(bus, tiny_model)
    try:
        task = asyncio.create_task(agent.serve())
        code = await asyncio.to_thread(finish, proc, log, 180)
        task.cancel()
        text = log.read_text()
        assert code == 0, text[-4000:]
        digests = {line.split("[trainer rank ")[1][0]: line.rsplit(" ", 1)[1] for line in text.splitlines() if "final weights sha256" in line}
        assert set(digests) == {"0", "1"}, text[-4000:]
        assert digests["0"] == digests["1"]
        # ... and they are the weights that were published.
        from kuberl.runtime.trainer.weights import digest_state

        assert digest_state(load_weights(workdir / "weights" / "v2")) == digests["0"]
        assert (await bus.get_state("progress"))["step"] == 2
        v0 = load_weights(workdir / "weights" / "v0")
        assert digest_state(v0) != digests["0"]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        await bus.close()


async def test_a_killed_trainer_resumes_from_its_checkpoint_and_finishes(tmp_path, bus_url, tiny_model):
    name = "tr-restart"
    manifest = write_manifest(tmp_path / "exp.yaml", name, tiny_model, steps=4, eta=1, every=2, mode="bus")
    workdir, log = tmp_path / "work", tmp_path / "trainer.log"
    bus = await Bus.connect(bus_url, name)
    agent = FakeAgent(bus, tiny_model)
    proc = start_trainer(manifest, bus_url, workdir, log)
    try:
        # The agent answers exactly three steps' worth of tickets, so the trainer waits at step 4 (it
        # cannot run ahead to its final checkpoint before the kill); step 3 is trained but not
        # checkpointed (every 2 steps) when the trainer dies.
        first = asyncio.create_task(agent.serve(limit=3 * B))
        await wait_for(lambda: _at_step(bus, 3), 120, "step 3", proc, log)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        await first
        task = asyncio.create_task(agent.serve())
        assert (await bus.get_state("progress"))["checkpoint"]["step"] == 2
        unacked = (await bus.stream_info())["groups_pending"]
        assert unacked >= B, "the groups of step 3 were not acknowledged: no checkpoint covers them"

        proc = start_trainer(manifest, bus_url, workdir, log)
        code = await asyncio.to_thread(finish, proc, log, 180)
        task.cancel()
        text = log.read_text()
        assert code == 0, text[-4000:]
        assert "resumed from" in text and "step 2, policy version 2" in text
        rows = metrics(workdir)
        assert [r["step"] for r in rows] == [1, 2, 3, 3, 4], "step 3 is re-trained once from the checkpoint; nothing else repeats"
        # Same weights, optimizer state and redelivered groups: the re-trained step computes the same loss.
        assert rows[3]["loss"] == pytest.approx(rows[2]["loss"], rel=1e-4, abs=1e-6)
        assert rows[3]["policy_version"] == rows[2]["policy_version"] == 3
        progress = await bus.get_state("progress")
        assert progress["done"] and progress["step"] == 4 and progress["policy_version"] == 4
        weights = await bus.get_state("weights")
        assert weights["mode"] == "bus" and weights["object"] == "v4" and weights["path"] is None
        assert "v4" in await bus.list_weights()
        book = await bus.get_state("tickets")
        assert book["consumed"] == 4 * B
        # Tickets issued before the crash were not issued again (catch-up): no group was rolled out twice.
        assert len(agent.published) == len(set(agent.published))
        assert (await bus.stream_info())["groups_pending"] == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        await bus.close()


@pytest.mark.parametrize("world", [1, 2])
async def test_a_model_path_that_is_no_model_is_a_configuration_error_reported_in_progress_and_the_termination_message(tmp_path, bus_url, world):
    """Exit code 2 (not retried), the reason in progress.failed and in the termination message; with two
    ranks through the torchrun wrapper too (plain torchrun would exit 1)."""
    name = f"tr-fails-{world}"
    empty = tmp_path / "no-model"
    empty.mkdir()
    manifest = write_manifest(tmp_path / "exp.yaml", name, empty, steps=1, world=world)
    workdir, log, termination = tmp_path / "work", tmp_path / "trainer.log", tmp_path / "termination-log"
    bus = await Bus.connect(bus_url, name)
    try:
        proc = start_trainer(manifest, bus_url, workdir, log, world=world, termination_log=termination)
        code = await asyncio.to_thread(finish, proc, log, 120)
        assert code == 2, log.read_text()[-3000:]
        progress = await bus.get_state("progress")
        assert progress["done"] is False
        assert "model.path" in progress["failed"] and "has no config.json" in progress["failed"], progress["failed"]
        assert termination.read_text() == f"model.path: {str(empty)!r} has no config.json (expected a Hugging Face model folder)\n"
        assert "Traceback" not in log.read_text()  # a configuration error is a message, not a crash
    finally:
        await bus.close()


@pytest.mark.parametrize("world", [1, 2])
async def test_a_checkpoint_request_is_answered_between_steps_and_sigterm_checkpoints_and_exits(tmp_path, bus_url, tiny_model, world):
    name = f"tr-control-{world}"
    manifest = write_manifest(tmp_path / "exp.yaml", name, tiny_model, steps=50, eta=0, every=100, world=world)
    workdir, log = tmp_path / "work", tmp_path / "trainer.log"
    bus = await Bus.connect(bus_url, name)
    agent = FakeAgent(bus, tiny_model)
    proc = start_trainer(manifest, bus_url, workdir, log, world=world)
    try:
        task = asyncio.create_task(agent.serve(limit=B))  # one step's worth, then the trainer waits
        await wait_for(lambda: _at_step(bus, 1), 90, "step 1", proc, log)
        assert (await bus.get_state("progress"))["checkpoint"] is None
        # The operator asks for a checkpoint (before suspending): it comes without waiting for a full batch.
        await bus.put_state("control", {"checkpoint_request": "suspend-1", "stop": False})

        async def checkpointed():
            p = await bus.get_state("progress")
            return p["checkpoint"] if p and p["checkpoint"] else None

        ckpt = await wait_for(checkpointed, 60, "the requested checkpoint", proc, log)
        assert ckpt["step"] == 1 and ckpt["policy_version"] == 1 and Path(ckpt["path"]).is_dir()
        assert (await bus.stream_info())["groups_pending"] == 0, "the trained groups are acknowledged with it"

        os.killpg(proc.pid, signal.SIGTERM)  # what Kubernetes and `kuberl run` send
        code = await asyncio.to_thread(finish, proc, log, 60)
        task.cancel()
        # torchrun reports its own code for a signalled run; the ranks' own exit is what the log shows.
        assert code == 143 if world == 1 else code != 0, log.read_text()[-3000:]
        progress = await bus.get_state("progress")
        assert progress["done"] is False and progress["failed"] is None and progress["step"] == 1
        assert "stopped (SIGTERM)" in log.read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        await bus.close()
