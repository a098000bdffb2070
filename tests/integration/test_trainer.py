"""The trainer against a real nats-server, the real vLLM CPU engine and the real rollout agent.

The trainer runs as `kuberl trainer` subprocesses (and under torchrun for two ranks), as it does in a pod;
the rollout agent (RolloutAgent, what `kuberl rollout` runs) answers its tickets in this process with the
session's vLLM server, loading each weight version the trainer publishes. So the behaviour log-probs, the
version stamps and the staleness the tests check are the engine's own, never computed or stamped by the test.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import torch
import yaml

from kuberl.api import load_experiment
from kuberl.runtime.bus import Bus, TrajectoryGroup
from kuberl.runtime.trainer.weights import INDEX_FILE, load_weights

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
def tiny_model(vllm_server) -> Path:
    """The model the session's vLLM server serves: the trainer starts from the same weights (v0)."""
    return vllm_server.model_dir


def write_manifest(path: Path, name: str, model: Path, *, steps: int, eta: int = 1, every: int = 1, world: int = 1, mode: str = "disk",
                   temperature: float = 1.0, bucket_mb: int | None = None, async_save: str = "auto", drop_stale: bool = False) -> Path:
    doc = {
        "apiVersion": "kuberl.io/v1alpha1", "kind": "RLExperiment", "metadata": {"name": name},
        "spec": {
            "model": {"path": str(model), "dtype": "float32"},
            "dataset": {"builtin": "repeat-digit", "size": 32},
            "workflow": {"reward": "repeat-digit"},
            "algorithm": {"name": "grpo", "samplesPerPrompt": N, "batchSize": B, "maxNewTokens": 6, "learningRate": 1e-2,
                          "ppoMinibatches": 2, "temperature": temperature},
            "staleness": {"maxHeadOffpolicyness": eta, "dropStaleGroups": drop_stale},
            "rollout": {"engine": "vllm", "concurrency": 4, "accelerator": {"type": "cpu", "count": 0}},
            "trainer": {"accelerator": {"type": "cpu", "count": world}, "microBatchTokens": 64},
            "weightSync": {"mode": mode, **({"bucketMB": bucket_mb} if bucket_mb else {})},
            "checkpoint": {"everySteps": every, "keep": 2, "asyncSave": async_save},
            "training": {"totalSteps": steps},
        },
    }
    path.write_text(yaml.safe_dump(doc))
    return path


class RecordingBus:
    """The agent's real Bus, recording every group it publishes. With `hold` > 0 it keeps that many groups
    back until `release()`: an agent whose delivery stalls (the group was generated, its ticket acked)."""

    def __init__(self, bus: Bus):
        self._bus = bus
        self.published: list[TrajectoryGroup] = []
        self.held: list[TrajectoryGroup] = []
        self.hold = 0

    def __getattr__(self, name):
        return getattr(self._bus, name)

    async def publish_group(self, group: TrajectoryGroup) -> None:
        if self.hold > 0:
            self.hold -= 1
            self.held.append(group)
            return
        await self._bus.publish_group(group)
        self.published.append(group)

    async def release(self) -> None:
        held, self.held = self.held, []
        for group in held:
            await self._bus.publish_group(group)
            self.published.append(group)

    def by_id(self) -> dict[str, TrajectoryGroup]:
        return {g.group_id: g for g in self.published + self.held}


@asynccontextmanager
async def rollout_agent(manifest: Path, bus: Bus, vllm_server, workdir: Path, agent_id: str = "agent"):
    """The real rollout agent of `kuberl rollout` on the session's vLLM server: yields (agent, its RecordingBus)."""
    from transformers import AutoTokenizer

    from kuberl.runtime.data import load_items
    from kuberl.runtime.inference.vllm import VLLMEngine
    from kuberl.runtime.rollout.agent import RolloutAgent
    from kuberl.runtime.rollout.workflows import make_workflow

    exp = load_experiment(manifest)
    engine = VLLMEngine(url=vllm_server.url)
    await engine.start()
    recorder = RecordingBus(bus)
    workflow = make_workflow(exp.spec, AutoTokenizer.from_pretrained(vllm_server.model_dir), max_total_tokens=512)
    agent = RolloutAgent(exp, recorder, engine, workflow, load_items(exp.spec.dataset, seed=exp.spec.seed), workdir=workdir,
                         agent_id=agent_id, weights_cache=workdir / f"cache-{agent_id}", log_every=5)
    try:
        yield agent, recorder
    finally:
        await engine.close()


async def stop(task: asyncio.Task) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def start_trainer(manifest: Path, bus_url: str, workdir: Path, log: Path, world: int = 1, termination_log: Path | None = None,
                  hold_writes: Path | None = None) -> subprocess.Popen:
    env = {**os.environ, "KUBERL_BUS_URL": bus_url, "KUBERL_WORKDIR": str(workdir), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    if hold_writes is not None:  # DCP's shard writes wait while this file exists (held_checkpoint_writes/sitecustomize.py)
        env["KUBERL_TEST_HOLD_DCP_WRITES"] = str(hold_writes)
        env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent / "held_checkpoint_writes"), env.get("PYTHONPATH", "")])
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
        raise AssertionError(f"trainer did not finish:\n{log.read_text()[-4000:]}") from None


def metrics(workdir: Path) -> list[dict]:
    return [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines() if x.strip()]


_MODELS: dict[Path, torch.nn.Module] = {}


def logprobs_at(weights: Path, prompt: list[int], response: list[int], temperature: float) -> torch.Tensor:
    """log softmax(logits / T) of each response token under the weights in `weights`, by hand with transformers."""
    from transformers import AutoModelForCausalLM

    if weights not in _MODELS:
        _MODELS[weights] = AutoModelForCausalLM.from_pretrained(weights, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = _MODELS[weights](torch.tensor([prompt + response])).logits[0, len(prompt) - 1:-1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


def trained(rows: list[dict], groups: dict[str, TrajectoryGroup]) -> list[tuple[dict, list[TrajectoryGroup]]]:
    """Each metrics row with the groups (as the agent published them) that its step trained on."""
    return [(r, [groups[g] for g in r["group_ids"]]) for r in rows]


async def test_the_trainer_trains_on_the_agents_groups_publishes_new_weights_and_acks(tmp_path, bus_url, tiny_model, vllm_server):
    """eta = 0 at temperature 0.7: every trained group was generated by the engine with the weights of the very
    version it is trained at, so pi_prox (recomputed by the trainer) equals pi_behave (reported by vLLM)."""
    name = "tr-basic"
    manifest = write_manifest(tmp_path / "exp.yaml", name, tiny_model, steps=2, eta=0, temperature=0.7)
    workdir, log = tmp_path / "work", tmp_path / "trainer.log"
    bus = await Bus.connect(bus_url, name)
    proc = start_trainer(manifest, bus_url, workdir, log)
    try:
        # eta = 0 at version 0: exactly B tickets, no more, before any group comes back.
        tickets = await wait_for(lambda: bus.get_state("tickets"), 90, "the ticket book", proc, log)
        await asyncio.sleep(1.0)
        assert (await bus.stream_info())["tickets_pending"] == B
        assert (await bus.get_state("tickets"))["issued"] == B, tickets
        async with rollout_agent(manifest, bus, vllm_server, tmp_path) as (agent, recorder):
            task = asyncio.create_task(agent.run())
            code = await asyncio.to_thread(finish, proc, log)
            await wait_for(lambda: _true(agent.engine.version == 2), 30, "the agent to load v2")
            await stop(task)
        assert code == 0, log.read_text()[-4000:]
        progress = await bus.get_state("progress")
        assert progress["done"] is True and progress["step"] == 2 and progress["failed"] is None
        assert progress["policy_version"] == 2 and progress["checkpoint"]["step"] == 2
        assert 0.0 <= progress["trainer_wait_fraction"] <= 1.0 and progress["samples_per_second"] > 0
        for field in ("reward_mean", "samples_per_second", "staleness_mean", "staleness_max", "dropped_stale",
                      "trainer_wait_fraction", "groups_buffered", "epoch", "total_steps", "time"):
            assert field in progress, field
        weights = await bus.get_state("weights")
        assert weights["version"] == 2 and weights["mode"] == "disk" and weights["path"] == str(workdir / "weights" / "v2")
        assert (await bus.get_state("policy_version")) == {"version": 2}
        assert agent.stats.weight_updates == 3, "the agent served v0, v1 and v2 in turn"
        v0, v2 = load_weights(workdir / "weights" / "v0"), load_weights(workdir / "weights" / "v2")
        changed = [k for k in v0 if not torch.equal(v0[k], v2[k])]
        assert len(changed) > len(v0) // 2, f"only {changed} changed"
        # Every trained (or dropped) group was acknowledged once the final checkpoint covered it.
        info = await bus.stream_info()
        assert info["groups_pending"] == 0 and info["groups_unacked"] == 0, info

        rows = metrics(workdir)
        assert [r["step"] for r in rows] == [1, 2] and all(r["samples"] == B * N for r in rows)
        assert {"train.collect", "train.prox_logp", "train.ppo_update", "train.publish_weights"} <= set(rows[0]["timings"])
        for row, groups in trained(rows, recorder.by_id()):
            # The engine's own version stamps: step s trains at version s - 1, generated by exactly that version.
            assert {v for g in groups for s in g.samples for v in s.versions} == {row["step"] - 1}, row["step"]
            assert row["staleness_max"] == 0
            rewards = [s.reward for g in groups for s in g.samples]
            assert row["reward_mean"] == pytest.approx(sum(rewards) / len(rewards))
            # Same weights, same temperature: the engine's log-probs and the trainer's agree token for token
            # (fp32 on both sides, |delta| ~1e-7), so the behaviour weight is 1 and nothing is masked. (A mean
            # importance weight is ~1 in expectation for any two policies: only a tight bound says anything;
            # measured here with the trainer at temperature 1 instead of 0.7: 1.009.)
            assert row["behavior_weight_mean"] == pytest.approx(1.0, abs=1e-3), row
            assert row["behavior_masked_fraction"] == 0.0
            # The version stamps are true: each token's engine log-prob is the published weights' at that version.
            for g in groups:
                for s in g.samples:
                    expected = logprobs_at(workdir / "weights" / f"v{s.versions[0]}", s.input_ids, s.output_ids, 0.7)
                    assert torch.allclose(torch.tensor(s.logprobs), expected, atol=1e-3), (g.group_id, s.logprobs, expected.tolist())
        assert progress["reward_mean"] == rows[-1]["reward_mean"], "the final report keeps the last step's numbers"
        # The agent starts each ticket on weights >= its issued_version, so at eta = 0 no group is generated on
        # older weights and none is dropped: every ticket issued was trained (no batch wasted per step).
        assert agent.stats.started_behind == 0
        book = await bus.get_state("tickets")
        assert progress["dropped_stale"] == book["dropped"] == 0 and book["rejected"] == 0
        assert book["issued"] == book["consumed"] == len(recorder.published) == 2 * B
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        await bus.close()


async def test_a_group_older_than_the_staleness_bound_is_dropped_counted_and_replaced(tmp_path, bus_url, tiny_model, vllm_server):
    """staleness.dropStaleGroups on, eta = 1, three steps of B groups. One agent generates a group for the first v0
    ticket on the real engine and its delivery stalls until the trainer reached version 2: its head version 0 is then
    older than 2 - 1, so the trainer drops it, counts it, and issues a ticket to replace it; the run still trains
    three steps."""
    name = "tr-stale"
    manifest = write_manifest(tmp_path / "exp.yaml", name, tiny_model, steps=3, eta=1, every=3, drop_stale=True)
    workdir, log = tmp_path / "work", tmp_path / "trainer.log"
    bus = await Bus.connect(bus_url, name)
    proc = start_trainer(manifest, bus_url, workdir, log)
    try:
        late, recorder = await deliver_a_v0_group_after_step_2(manifest, bus, proc, log, vllm_server, tmp_path)
        text = log.read_text()
        assert f"dropped group {late.group_id}: head version 0 < " in text, text[-3000:]
        assert "staleness.dropStaleGroups is on" in text, "the trainer warns at start that the drop biases training"
        progress = await bus.get_state("progress")
        assert progress["done"] and progress["step"] == 3 and progress["dropped_stale"] >= 1 and progress["over_stale"] == 0
        book = await bus.get_state("tickets")
        # Every dropped group gave its slot back: a ticket was issued in its place (3 B trained in the end).
        assert book["dropped"] == progress["dropped_stale"] and book["consumed"] == 3 * B
        assert book["issued"] == 3 * B + book["dropped"] + book["rejected"]
        rows = metrics(workdir)
        groups = {**recorder.by_id(), late.group_id: late}
        assert all(late.group_id not in r["group_ids"] for r in rows)
        for row, used in trained(rows, groups):
            heads = [g.head_version for g in used]
            trained_at = row["policy_version"] - 1
            assert all(trained_at - 1 <= h <= trained_at for h in heads), (row["step"], heads)  # within eta = 1
            assert row["staleness_max"] == max(trained_at - h for h in heads)
        info = await bus.stream_info()
        assert info["groups_pending"] == 0, "the dropped group is acknowledged with the checkpoint too"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        await bus.close()


async def test_by_default_a_group_older_than_the_staleness_bound_is_trained_and_counted(tmp_path, bus_url, tiny_model, vllm_server):
    """The same late v0 group with the default (staleness.dropStaleGroups off, as AReaL): the trainer trains it at
    version 2, counts it in over_stale and issues no replacement; its staleness (2 > eta = 1) shows in the step."""
    name = "tr-over-stale"
    manifest = write_manifest(tmp_path / "exp.yaml", name, tiny_model, steps=3, eta=1, every=3)
    workdir, log = tmp_path / "work", tmp_path / "trainer.log"
    bus = await Bus.connect(bus_url, name)
    proc = start_trainer(manifest, bus_url, workdir, log)
    try:
        late, _ = await deliver_a_v0_group_after_step_2(manifest, bus, proc, log, vllm_server, tmp_path)
        text = log.read_text()
        assert f"training group {late.group_id} over the staleness bound: head version 0 < 2 - 1" in text, text[-3000:]
        assert "dropStaleGroups is on" not in text and "dropped group" not in text
        progress = await bus.get_state("progress")
        assert progress["done"] and progress["step"] == 3 and progress["dropped_stale"] == 0 and progress["over_stale"] == 1
        book = await bus.get_state("tickets")
        assert book["dropped"] == 0 and book["consumed"] == 3 * B and book["issued"] == 3 * B + book["rejected"]
        rows = metrics(workdir)
        assert late.group_id in rows[-1]["group_ids"] and rows[-1]["staleness_max"] == 2
        assert [r["over_stale"] for r in rows] == [0, 0, 1]
        assert (await bus.stream_info())["groups_pending"] == 0, "the late group is acknowledged with the checkpoint"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        await bus.close()


async def deliver_a_v0_group_after_step_2(manifest: Path, bus: Bus, proc: subprocess.Popen, log: Path, vllm_server,
                                          tmp_path: Path) -> tuple[TrajectoryGroup, RecordingBus]:
    """One agent generates a group for the first v0 ticket on the real engine; its delivery stalls until the trainer
    reached step 2 (version 2) while a second agent answers the rest. Returns (the late group, the second agent's
    recorder) once the trainer has exited 0."""
    await wait_for(lambda: bus.get_state("tickets"), 90, "the ticket book", proc, log)
    async with rollout_agent(manifest, bus, vllm_server, tmp_path, "slow-agent") as (slow, stalled):
        stalled.hold = 1
        await asyncio.wait_for(slow.run(max_tickets=1), 120)
    [late] = stalled.held
    assert late.head_version == 0 and {v for s in late.samples for v in s.versions} == {0}
    async with rollout_agent(manifest, bus, vllm_server, tmp_path) as (agent, recorder):
        task = asyncio.create_task(agent.run())
        await wait_for(lambda: _at_step(bus, 2), 120, "step 2", proc, log)
        await stalled.release()
        code = await asyncio.to_thread(finish, proc, log)
        await stop(task)
    assert code == 0, log.read_text()[-4000:]
    return late, recorder


async def _true(value: bool) -> bool:
    return value


async def _at_step(bus: Bus, step: int) -> bool:
    p = await bus.get_state("progress")
    return bool(p and p["step"] >= step)


async def test_two_ranks_with_fsdp2_train_and_end_with_identical_full_weights(tmp_path, bus_url, tiny_model, vllm_server):
    name = "tr-two-ranks"
    # bucketMB 1 < the model's 2.4 MB: every version is published in shards, rank 0 holding one at a time (issue #14 item 2).
    manifest = write_manifest(tmp_path / "exp.yaml", name, tiny_model, steps=2, eta=1, every=2, world=2, bucket_mb=1)
    workdir, log = tmp_path / "work", tmp_path / "trainer.log"
    bus = await Bus.connect(bus_url, name)
    proc = start_trainer(manifest, bus_url, workdir, log, world=2)
    try:
        async with rollout_agent(manifest, bus, vllm_server, tmp_path) as (agent, _):
            task = asyncio.create_task(agent.run())
            code = await asyncio.to_thread(finish, proc, log, 180)
            await wait_for(lambda: _true(agent.engine.version == 2), 30, "the agent to load v2 (in shards)")
            await stop(task)
        text = log.read_text()
        assert code == 0, text[-4000:]
        digests = {line.split("[trainer rank ")[1][0]: line.rsplit(" ", 1)[1] for line in text.splitlines() if "final weights sha256" in line}
        assert set(digests) == {"0", "1"}, text[-4000:]
        assert digests["0"] == digests["1"]
        # ... and they are the weights that were published.
        from kuberl.runtime.trainer.weights import digest_state

        assert digest_state(load_weights(workdir / "weights" / "v2")) == digests["0"]
        assert len(json.loads((workdir / "weights" / "v2" / INDEX_FILE).read_text())["weight_map"]) == 27  # in model-0000i-of-00003 files
        assert (await bus.get_state("progress"))["step"] == 2
        v0 = load_weights(workdir / "weights" / "v0")
        assert digest_state(v0) != digests["0"]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        await bus.close()


async def test_two_ranks_write_checkpoints_behind_training_each_holding_its_steps_published_weights(tmp_path, bus_url, tiny_model, vllm_server):
    """checkpoint.asyncSave on, FSDP2 over two ranks: DCP's writes and their collectives run in a thread (on a gloo group
    of their own) while the ranks train on. Each committed checkpoint holds the weights published at its step, and
    every group is acknowledged by the end."""
    from kuberl.runtime.trainer import checkpoint as ck
    from kuberl.runtime.trainer.weights import digest_state

    name = "tr-async-ckpt"
    manifest = write_manifest(tmp_path / "exp.yaml", name, tiny_model, steps=4, eta=1, every=1, world=2, async_save="on")
    workdir, log = tmp_path / "work", tmp_path / "trainer.log"
    bus = await Bus.connect(bus_url, name)
    proc = start_trainer(manifest, bus_url, workdir, log, world=2)
    try:
        async with rollout_agent(manifest, bus, vllm_server, tmp_path) as (agent, _):
            task = asyncio.create_task(agent.run())
            code = await asyncio.to_thread(finish, proc, log, 180)
            await stop(task)
        text = log.read_text()
        assert code == 0, text[-4000:]
        assert "checkpoints written behind training (checkpoint.asyncSave on)" in text
        assert text.count("written behind training, committed") >= 3, "steps 1-3 at least were committed from the background"
        kept = ck.list_checkpoints(workdir / "checkpoints")
        assert [c.step for c in kept] == [3, 4]  # keep 2
        for c in kept:
            assert digest_state(ck.read_model_state(c.path)) == digest_state(load_weights(workdir / "weights" / f"v{c.step}")), c
        assert not list((workdir / "checkpoints").glob(".tmp-*")), "no write left uncommitted"
        progress = await bus.get_state("progress")
        assert progress["done"] and progress["checkpoint"]["step"] == 4
        assert (await bus.stream_info())["groups_pending"] == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        await bus.close()


async def test_a_trainer_killed_while_a_checkpoint_is_written_behind_it_resumes_from_the_one_before_and_loses_no_group(
        tmp_path, bus_url, tiny_model, vllm_server):
    """checkpoint.asyncSave on. Step 2's checkpoint is committed; step 4's write is held (a slow volume) while the trainer
    trains step 5, and the trainer is killed. Nothing of step 4's checkpoint may count: the restart resumes from step 2,
    the groups of steps 3-5 (never acknowledged) come back, and the run finishes with every group trained once."""
    name = "tr-async-kill"
    manifest = write_manifest(tmp_path / "exp.yaml", name, tiny_model, steps=6, eta=1, every=2, async_save="on")
    workdir, log, hold = tmp_path / "work", tmp_path / "trainer.log", tmp_path / "hold-writes"
    bus = await Bus.connect(bus_url, name)
    proc = start_trainer(manifest, bus_url, workdir, log, hold_writes=hold)

    async def checkpoint_step():
        p = await bus.get_state("progress")
        return (p or {}).get("checkpoint") and p["checkpoint"]["step"]

    try:
        async with rollout_agent(manifest, bus, vllm_server, tmp_path, "agent-1") as (agent, first):
            await asyncio.wait_for(agent.run(max_tickets=3 * B), 120)
            await wait_for(lambda: _at_step(bus, 3), 120, "step 3", proc, log)
            assert await wait_for(checkpoint_step, 30, "step 2's checkpoint committed", proc, log) == 2
            hold.touch()  # from now on the shard writes wait
            await asyncio.wait_for(agent.run(max_tickets=2 * B), 120)
            await wait_for(lambda: _at_step(bus, 5), 120, "step 5", proc, log)
        assert await checkpoint_step() == 2, "step 4's checkpoint is still being written: not committed"
        assert (workdir / "checkpoints" / ".tmp-step-00000004").is_dir()
        assert (await bus.stream_info())["groups_pending"] >= 3 * B, "the groups of steps 3-5 wait for a checkpoint"
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        hold.unlink()

        proc = start_trainer(manifest, bus_url, workdir, log)
        async with rollout_agent(manifest, bus, vllm_server, tmp_path, "agent-2") as (agent, second):
            task = asyncio.create_task(agent.run())
            code = await asyncio.to_thread(finish, proc, log, 180)
            await stop(task)
        text = log.read_text()
        assert code == 0, text[-4000:]
        assert "step 2, policy version 2" in text, "resumed from step 2, the last committed checkpoint"
        # The killed run's rows of steps 3-5 stay (as after any kill between checkpoints); the re-trained steps follow.
        assert [r["step"] for r in metrics(workdir)] == [1, 2, 3, 4, 5, 3, 4, 5, 6]
        progress = await bus.get_state("progress")
        assert progress["done"] and progress["step"] == 6 and progress["checkpoint"]["step"] == 6
        assert (await bus.get_state("tickets"))["consumed"] == 6 * B
        published = [g.group_id for g in first.published + second.published]
        assert len(published) == len(set(published)), "no group rolled out twice: steps 3-5 trained on the redelivered ones"
        assert (await bus.stream_info())["groups_pending"] == 0
        assert not list((workdir / "checkpoints").glob(".tmp-*"))
    finally:
        hold.unlink(missing_ok=True)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        await bus.close()


async def test_a_killed_trainer_resumes_from_its_checkpoint_and_finishes(tmp_path, bus_url, tiny_model, vllm_server):
    name = "tr-restart"
    manifest = write_manifest(tmp_path / "exp.yaml", name, tiny_model, steps=4, eta=1, every=2, mode="bus")
    workdir, log = tmp_path / "work", tmp_path / "trainer.log"
    bus = await Bus.connect(bus_url, name)
    proc = start_trainer(manifest, bus_url, workdir, log)
    try:
        # The agent answers exactly three steps' worth of tickets, so the trainer waits at step 4 (it
        # cannot run ahead to its final checkpoint before the kill); step 3 is trained but not
        # checkpointed (every 2 steps) when the trainer dies.
        async with rollout_agent(manifest, bus, vllm_server, tmp_path, "agent-1") as (agent, before):
            first = asyncio.create_task(agent.run(max_tickets=3 * B))
            await wait_for(lambda: _at_step(bus, 3), 120, "step 3", proc, log)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            await asyncio.wait_for(first, 60)
        assert (await bus.get_state("progress"))["checkpoint"]["step"] == 2
        unacked = (await bus.stream_info())["groups_pending"]
        assert unacked >= B, "the groups of step 3 were not acknowledged: no checkpoint covers them"
        # Make it a kill right after step 2's checkpoint, before its report: metrics.jsonl then ends at step 1
        # (and a row cut short). The checkpoint kept step 2's row; the restarted trainer writes it.
        before_kill = metrics(workdir)
        assert [r["step"] for r in before_kill] == [1, 2, 3]
        (workdir / "metrics.jsonl").write_text(json.dumps(before_kill[0]) + "\n" + '{"step": 2, "ti')

        proc = start_trainer(manifest, bus_url, workdir, log)
        async with rollout_agent(manifest, bus, vllm_server, tmp_path, "agent-2") as (agent, after):
            task = asyncio.create_task(agent.run())
            code = await asyncio.to_thread(finish, proc, log, 180)
            await stop(task)
        text = log.read_text()
        assert code == 0, text[-4000:]
        assert "resumed from" in text and "step 2, policy version 2" in text
        rows = metrics(workdir)
        assert [r["step"] for r in rows] == [1, 2, 3, 4], "step 2's row from the checkpoint, then step 3 re-trained; nothing repeats"
        assert "writing the one the checkpoint kept" in text and "ends in a row cut short" in text
        restored = {k: v for k, v in before_kill[1].items() if k not in ("timings", "step_seconds", "samples_per_second", "time")}
        assert {k: rows[1][k] for k in restored} == restored  # the row the killed trainer would have written
        # Same weights, optimizer state and redelivered groups: the re-trained step computes the same loss.
        assert rows[2]["loss"] == pytest.approx(before_kill[2]["loss"], rel=1e-4, abs=1e-6)
        assert rows[2]["policy_version"] == before_kill[2]["policy_version"] == 3
        progress = await bus.get_state("progress")
        assert progress["done"] and progress["step"] == 4 and progress["policy_version"] == 4
        weights = await bus.get_state("weights")
        assert weights["mode"] == "bus" and weights["object"] == "v4" and weights["path"] is None
        assert "v4" in await bus.list_weights()
        book = await bus.get_state("tickets")
        assert book["consumed"] == 4 * B
        # Tickets issued before the crash were not issued again (catch-up): no group was rolled out twice.
        published = [g.group_id for g in before.published + after.published]
        assert len(published) == len(set(published))
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
async def test_a_checkpoint_request_is_answered_between_steps_and_sigterm_checkpoints_and_exits(tmp_path, bus_url, tiny_model, vllm_server,
                                                                                               world):
    name = f"tr-control-{world}"
    manifest = write_manifest(tmp_path / "exp.yaml", name, tiny_model, steps=50, eta=0, every=100, world=world)
    workdir, log = tmp_path / "work", tmp_path / "trainer.log"
    bus = await Bus.connect(bus_url, name)
    proc = start_trainer(manifest, bus_url, workdir, log, world=world)
    try:
        async with rollout_agent(manifest, bus, vllm_server, tmp_path) as (agent, _):
            await asyncio.wait_for(agent.run(max_tickets=B), 120)  # one step's worth, then the trainer waits
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
        # torchrun reports its own code for a signalled run; the ranks' own exit is what the log shows.
        assert code == 143 if world == 1 else code != 0, log.read_text()[-3000:]
        progress = await bus.get_state("progress")
        assert progress["done"] is False and progress["failed"] is None and progress["step"] == 1
        assert "stopped (SIGTERM)" in log.read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        await bus.close()
