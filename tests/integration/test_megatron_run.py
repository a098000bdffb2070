"""trainer.backend megatron end to end: `kuberl trainer` under torchrun (2 CPU ranks, gloo) against a real nats-server.

A scripted agent in this process answers every ticket with a group that depends only on the ticket's data set
item (tokens, rewards, and behaviour log-probs from the initial model), so two trainers given the same manifest
train on the same batches. The same steps run once with trainer.backend fsdp on one rank (the reference) and
with megatron at tensor 2, pipeline 2, data 2 and context 2: the published weights/v{N} of each step must match
the reference's. The optimizer is plain SGD without clipping, so a wrong loss scale or a missing gradient
reduction moves the weights by a different amount (Adam, or a clipped gradient, would hide a scale error).
A megatron run killed after its checkpoint resumes, re-trains the lost step and ends on the same weights. `kuberl run`
of the quickstart with the megatron trainer (real launcher, vLLM CPU engine) is in test_kuberl_run_backends.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from kuberl.runtime.bus import Bus, Sample, TrajectoryGroup
from kuberl.runtime.trainer.megatron.convert_moe import checkpoint_names
from kuberl.runtime.trainer.weights import load_weights

pytestmark = [pytest.mark.integration, pytest.mark.megatron, pytest.mark.timeout(300)]

B, N, STEPS = 2, 3, 3  # groups per step, samples per group, steps
# Plain SGD, no clipping (the bound is never reached): the update is lr x the gradient itself.
SGD = {"type": "sgd", "beta1": 0.0, "weightDecay": 0.0, "gradClip": 1e6}
# AdamW (megatron-core's distributed optimizer); eps 1e-3 keeps the update a smooth function of the gradient.
ADAMW = {"type": "adamw", "beta1": 0.9, "beta2": 0.99, "eps": 1e-3, "weightDecay": 0.01, "gradClip": 1e6}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """The builtin tiny Qwen2 (4 heads, untied), built locally."""
    from kuberl.runtime.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


def write_manifest(path: Path, name: str, model: Path, *, backend: str, world: int, tensor: int = 1, pipeline: int = 1,
                   expert: int = 1, context: int = 1, minibatches: int = 1, kl: float = 0.0, every: int = 1, optimizer: dict = SGD,
                   lr: float = 0.1) -> Path:
    trainer = {"backend": backend, "accelerator": {"type": "cpu", "count": world}, "microBatchTokens": 64}
    if backend == "megatron":
        trainer["parallelism"] = {"tensor": tensor, "pipeline": pipeline, "expert": expert, "context": context}
    doc = {
        "apiVersion": "kuberl.io/v1alpha1", "kind": "RLExperiment", "metadata": {"name": name},
        "spec": {
            "model": {"path": str(model), "dtype": "float32"},
            "dataset": {"builtin": "repeat-digit", "size": 32},
            "workflow": {"reward": "repeat-digit"},
            "algorithm": {"name": "grpo", "samplesPerPrompt": N, "batchSize": B, "maxNewTokens": 8, "learningRate": lr,
                          "ppoMinibatches": minibatches, "klCoef": kl, "optimizer": optimizer},
            "staleness": {"maxHeadOffpolicyness": 0},
            "rollout": {"engine": "vllm", "concurrency": 4, "accelerator": {"type": "cpu", "count": 0}},
            "trainer": trainer,
            "checkpoint": {"everySteps": every, "keep": 3},
            "training": {"totalSteps": STEPS},
        },
    }
    path.write_text(yaml.safe_dump(doc))
    return path


class ScriptedAgent:
    """Answers tickets with groups that depend only on the ticket's item: prompts and responses of 8-20 tokens,
    rewards 0/1 within each group, behaviour log-probs of the initial model (close to the trainer's pi_prox)."""

    def __init__(self, model_dir: Path):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def group(self, ticket) -> TrajectoryGroup:
        rng = random.Random(ticket.index)
        samples = []
        for k in range(N):
            prompt = [rng.randrange(10, 300) for _ in range(rng.randint(4, 12))]
            out = [rng.randrange(10, 300) for _ in range(rng.randint(2, 8))]
            with torch.no_grad():
                logits = self.model(torch.tensor([prompt + out])).logits[0, len(prompt) - 1:-1]
            logp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(out)[:, None]).squeeze(-1).tolist()
            mask = [1] * len(out)
            mask[0] = 0 if k == 1 else 1  # a token the policy did not generate
            samples.append(Sample(input_ids=prompt, output_ids=out, logprobs=logp, versions=[ticket.issued_version] * len(out),
                                  loss_mask=mask, reward=float((k + ticket.index) % 2)))
        return TrajectoryGroup(group_id=ticket.ticket_id, ticket=ticket, samples=samples, agent="scripted")

    async def run(self, bus: Bus, max_tickets: int | None = None) -> None:
        answered = 0
        while max_tickets is None or answered < max_tickets:
            lease = await bus.pull_ticket(timeout=0.5)
            if lease is None:
                continue
            await bus.publish_group(self.group(lease.value))
            await lease.ack()
            answered += 1


def start_trainer(manifest: Path, bus_url: str, workdir: Path, log: Path, world: int) -> subprocess.Popen:
    env = {**os.environ, "KUBERL_BUS_URL": bus_url, "KUBERL_WORKDIR": str(workdir), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "kuberl.cli", "trainer", "--config", str(manifest)]
    if world > 1:
        cmd = [sys.executable, "-m", "kuberl.runtime.trainer.torchrun", "--standalone", f"--nproc-per-node={world}", *cmd[1:]]
    return subprocess.Popen(cmd, env=env, stdout=open(log, "ab"), stderr=subprocess.STDOUT, start_new_session=True)


def kill(proc: subprocess.Popen) -> None:
    """SIGKILL the trainer and its torchrun workers (which torchrun starts in sessions of their own)."""
    import psutil

    try:
        workers = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        workers = []
    for p in workers:
        p.kill()
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    psutil.wait_procs(workers, timeout=30)


def finish(proc: subprocess.Popen, log: Path, timeout: float = 200) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill(proc)
        raise AssertionError(f"trainer did not finish:\n{log.read_text()[-4000:]}") from None


def metrics(workdir: Path) -> list[dict]:
    return [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines() if x.strip()]


async def train(tmp: Path, name: str, bus_url: str, model_dir: Path, agent: ScriptedAgent, **manifest) -> Path:
    """One whole run of `kuberl trainer`; returns its workdir."""
    path = write_manifest(tmp / f"{name}.yaml", name, model_dir, **manifest)
    workdir, log = tmp / name, tmp / f"{name}.log"
    bus = await Bus.connect(bus_url, name)
    proc = start_trainer(path, bus_url, workdir, log, manifest["world"])
    task = asyncio.create_task(agent.run(bus))
    try:
        code = await asyncio.to_thread(finish, proc, log)
        assert code == 0, log.read_text()[-6000:]
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        if proc.poll() is None:
            kill(proc)
        await bus.close()
    return workdir


_REFS: dict[tuple, Path] = {}


async def reference(tmp_path_factory, bus_url: str, model_dir: Path, agent: ScriptedAgent, minibatches: int, kl: float,
                    **optimizer) -> Path:
    """The FSDP trainer on one rank, same batches (cached per model and algorithm variant; `optimizer`: write_manifest's)."""
    key = (str(model_dir), minibatches, kl, repr(optimizer))
    if key not in _REFS:
        name = f"ref-{model_dir.name}-mb{minibatches}-kl{int(kl * 100)}" + ("-" + optimizer["optimizer"]["type"] if optimizer else "")
        _REFS[key] = await train(tmp_path_factory.mktemp(name), name, bus_url, model_dir, agent, backend="fsdp", world=1,
                                 minibatches=minibatches, kl=kl, **optimizer)
    return _REFS[key]


def max_diff(a: dict, b: dict) -> float:
    """Max |a - b| over the same names (a MoE model's fused in-memory experts, as the FSDP path publishes them,
    compared under their per-expert checkpoint names)."""
    a, b = checkpoint_names(a), checkpoint_names(b)
    assert sorted(a) == sorted(b)
    return max((a[k] - b[k]).abs().max().item() for k in a)


def assert_same_training(got: Path, want: Path, model_dir: Path) -> None:
    """Every published version's weights, and each step's loss and gradient norm, equal the reference's."""
    rows, ref_rows = metrics(got), metrics(want)
    assert [r["step"] for r in rows] == [r["step"] for r in ref_rows] == list(range(1, STEPS + 1))
    assert set(rows[0]) == set(ref_rows[0]), set(rows[0]) ^ set(ref_rows[0])
    for r, ref in zip(rows, ref_rows):
        assert sorted(r["group_ids"]) == sorted(ref["group_ids"])  # the same batches
        assert r["loss"] == pytest.approx(ref["loss"], rel=1e-4, abs=1e-6), (r["step"], r["loss"], ref["loss"])
        assert r["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4), (r["step"], r["grad_norm"], ref["grad_norm"])
        for k in ("entropy", "clip_fraction", "behavior_weight_mean", "tokens", "reward_mean"):
            assert r[k] == pytest.approx(ref[k], rel=1e-4, abs=1e-6), (k, r[k], ref[k])
    v0 = load_weights(model_dir)  # the initial weights (weights/ keeps the last 3 versions)
    for v in range(1, STEPS + 1):
        mine, theirs = load_weights(got / "weights" / f"v{v}"), load_weights(want / "weights" / f"v{v}")
        moved, d = max_diff(theirs, v0), max_diff(mine, theirs)
        print(f"v{v}: max |megatron - fsdp| {d:.2e}, the reference moved weights by up to {moved:.2e}")
        assert moved > 1e-3 and d < 1e-5, (v, d, moved)


LAYOUTS = {  # name -> (processes, tensor, pipeline, context, ppoMinibatches, klCoef); data = processes / (tensor * pipeline * context)
    "tp2": (2, 2, 1, 1, 1, 0.0),  # pi_prox from the update's own forward
    "pp2": (2, 1, 2, 1, 2, 0.0),  # pi_prox from a forward of its own, two optimizer steps per step
    "dp2": (2, 1, 1, 1, 2, 0.05),  # each DP rank trains half the rows; a reference model for the KL term
    "cp2": (2, 1, 1, 2, 2, 0.05),  # each rank half of every sequence (context.py); pi_prox and the reference's forwards too
    "pp2cp2": (4, 1, 2, 2, 1, 0.0),  # CP rank 1 of the last stage must leave publishing to CP rank 0 (it would send its weights too)
}
# the last checkpoint's files: the CP ranks hold the same weights, written once
SHARDS = {"tp2": ["megatron-tp0-pp0.pt", "megatron-tp1-pp0.pt"], "cp2": ["megatron-tp0-pp0.pt"], "pp2cp2": ["megatron-tp0-pp0.pt", "megatron-tp0-pp1.pt"]}


@pytest.mark.parametrize("layout", list(LAYOUTS))
async def test_megatron_trains_the_same_weights_as_fsdp_on_the_same_batches(tmp_path, tmp_path_factory, nats_server, model_dir, layout):
    world, tensor, pipeline, context, minibatches, kl = LAYOUTS[layout]
    agent = ScriptedAgent(model_dir)
    ref = await reference(tmp_path_factory, nats_server.url, model_dir, agent, minibatches, kl)
    t0 = time.monotonic()
    got = await train(tmp_path, f"mg-{layout}", nats_server.url, model_dir, agent, backend="megatron", world=world, tensor=tensor,
                      pipeline=pipeline, context=context, minibatches=minibatches, kl=kl)
    print(f"megatron {layout}: {time.monotonic() - t0:.1f}s")
    data = world // (tensor * pipeline * context)  # the layout megatron's groups were built with, as the trainer logs it
    assert f"megatron: tensor {tensor} x pipeline {pipeline} x context {context} x data {data} (expert 1) over {world} processes" in \
        (tmp_path / f"mg-{layout}.log").read_text()
    assert_same_training(got, ref, model_dir)
    if layout == "tp2":  # what vLLM loads: a transformers model directory
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(got / "weights" / f"v{STEPS}")
        assert sorted(model.state_dict()) == sorted(load_weights(got / "weights" / f"v{STEPS}"))
    if layout in SHARDS:  # the last checkpoint (step 3, per-rank files) read back as one HF state dict: the weights published after step 3
        from kuberl.runtime.trainer import checkpoint as ck

        latest = ck.latest_checkpoint(got / "checkpoints")
        assert sorted(x.name for x in latest.path.glob("megatron-*.pt")) == SHARDS[layout]
        assert latest.step == STEPS and max_diff(ck.read_model_state(latest.path), load_weights(got / "weights" / f"v{STEPS}")) == 0


@pytest.fixture(scope="module")
def tied_model_dir(tmp_path_factory) -> Path:
    """The builtin Instruct-shaped tiny Qwen2: tied word embeddings, as Qwen2.5-0.5B/1.5B-Instruct have."""
    from kuberl.runtime.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("model") / "tied", variant="tiny-qwen2-instruct")


async def test_megatron_publishes_a_tied_model_as_fsdp_does_its_head_once_under_the_embeddings_name(tmp_path, tmp_path_factory,
                                                                                                      nats_server, tied_model_dir):
    """Pipeline 2: the last stage holds its own copy of the tied embedding as its output layer. Each published version
    has the FSDP reference's names and weights, the LM head not written a second time (weights.written_entries), and
    transformers loads it back tied."""
    agent = ScriptedAgent(tied_model_dir)
    ref = await reference(tmp_path_factory, nats_server.url, tied_model_dir, agent, 1, 0.0)
    got = await train(tmp_path, "mg-tied-pp2", nats_server.url, tied_model_dir, agent, backend="megatron", world=2, pipeline=2)
    assert_same_training(got, ref, tied_model_dir)  # the same names as the reference's versions, and the same values
    last = got / "weights" / f"v{STEPS}"
    assert "lm_head.weight" not in load_weights(last) and "model.embed_tokens.weight" in load_weights(last)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(last, dtype=torch.float32)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert torch.equal(model.lm_head.weight, load_weights(last)["model.embed_tokens.weight"])


async def kill_after_checkpoint_and_resume(path: Path, nats_url: str, workdir: Path, agent: ScriptedAgent, ref: Path, shards: list[str]) -> None:
    """A 2-rank trainer of `path` (checkpoints every 2 steps) killed while it waits for step 3's groups, its step-2
    checkpoint holding exactly `shards`; restarted, it must resume at step 2, train step 3 and publish the reference's v3."""
    log = workdir.parent / "trainer.log"
    bus = await Bus.connect(nats_url, yaml.safe_load(path.read_text())["metadata"]["name"])
    proc = start_trainer(path, nats_url, workdir, log, 2)
    try:
        await asyncio.wait_for(agent.run(bus, max_tickets=2 * B), 150)  # steps 1 and 2 only
        deadline = time.monotonic() + 120
        # The trainer commits step 2's checkpoint (and says so in `progress`) before it writes step 2's metrics.jsonl line:
        # wait for both, else a kill in between loses the line (seen in CI under load: steps [1, 3]).
        while not ((p := await bus.get_state("progress")) and (p.get("checkpoint") or {}).get("step") == 2
                   and (workdir / "metrics.jsonl").is_file() and [r["step"] for r in metrics(workdir)] == [1, 2]):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
            await asyncio.sleep(0.2)
        kill(proc)
        got = sorted(x.name for x in (workdir / "checkpoints" / "step-00000002").glob("megatron-*.pt"))
        assert got == shards, got

        proc = start_trainer(path, nats_url, workdir, log, 2)
        task = asyncio.create_task(agent.run(bus))
        code = await asyncio.to_thread(finish, proc, log)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        text = log.read_text()
        assert code == 0, text[-4000:]
        assert "resumed from" in text and "step 2, policy version 2" in text
        assert [r["step"] for r in metrics(workdir)] == [1, 2, 3]
        d = max_diff(load_weights(workdir / "weights" / f"v{STEPS}"), load_weights(ref / "weights" / f"v{STEPS}"))
        assert d < 1e-5, d
    finally:
        if proc.poll() is None:
            kill(proc)
        await bus.close()


@pytest.mark.parametrize("layout", ["tensor", "context"])
async def test_a_killed_megatron_trainer_resumes_from_its_checkpoint_and_ends_on_the_same_weights(tmp_path, tmp_path_factory, nats_server,
                                                                                                     model_dir, layout):
    """tensor 2 (or context 2), checkpoints every 2 steps: killed while waiting for step 3's groups (step 2 is checkpointed), it
    resumes at step 2 with its shards and optimizer state (at context 2 both CP ranks read CP rank 0's one shard), trains step 3
    and publishes the reference's v3."""
    agent = ScriptedAgent(model_dir)
    ref = await reference(tmp_path_factory, nats_server.url, model_dir, agent, 1, 0.0)
    path = write_manifest(tmp_path / "exp.yaml", f"mg-resume-{layout}", model_dir, backend="megatron", world=2, every=2, **{layout: 2})
    shards = ["megatron-tp0-pp0.pt", "megatron-tp1-pp0.pt"] if layout == "tensor" else ["megatron-tp0-pp0.pt"]
    await kill_after_checkpoint_and_resume(path, nats_server.url, tmp_path / "work", agent, ref, shards)


async def test_megatron_distributed_adamw_resumes_from_every_ranks_optimizer_slice(tmp_path, tmp_path_factory, nats_server, model_dir):
    """data 2 with AdamW: megatron-core's distributed optimizer (each rank steps and checkpoints half of the Adam state);
    killed after its step-2 checkpoint it resumes from both ranks' slices and publishes the FSDP + AdamW reference's v3."""
    agent = ScriptedAgent(model_dir)
    adamw = {"optimizer": ADAMW, "lr": 0.01}
    ref = await reference(tmp_path_factory, nats_server.url, model_dir, agent, 1, 0.0, **adamw)
    path = write_manifest(tmp_path / "exp.yaml", "mg-resume-adamw", model_dir, backend="megatron", world=2, every=2, **adamw)
    await kill_after_checkpoint_and_resume(path, nats_server.url, tmp_path / "work", agent, ref, ["megatron-tp0-pp0.pt"])
    step2 = sorted(x.name for x in (tmp_path / "work" / "checkpoints" / "step-00000002").glob("optimizer-megatron-*.pt"))
    assert step2 == ["optimizer-megatron-rank0.pt", "optimizer-megatron-rank1.pt"]


def test_resuming_with_another_tensor_or_expert_parallel_size_is_refused(tmp_path):
    """The checkpoint's layout is checked before any shard is read: a clear ConfigError naming both layouts."""
    from types import SimpleNamespace

    from kuberl.runtime.errors import ConfigError
    from kuberl.runtime.trainer.megatron.backend import MegatronMixin

    t = MegatronMixin()
    t.spec = SimpleNamespace(trainer=SimpleNamespace(parallelism=SimpleNamespace(tensor=2, pipeline=1, expert=1)))
    with pytest.raises(ConfigError, match="tensor 1, pipeline 2, expert 1; this trainer runs tensor 2, pipeline 1, expert 1"):
        t.megatron_read_state(tmp_path, {"tensor": 1, "pipeline": 2})  # written before expert parallelism: expert 1
    t.spec.trainer.parallelism = SimpleNamespace(tensor=1, pipeline=1, expert=2)
    with pytest.raises(ConfigError, match="tensor 1, pipeline 1, expert 1; this trainer runs tensor 1, pipeline 1, expert 2"):
        t.megatron_read_state(tmp_path, {"tensor": 1, "pipeline": 1, "expert": 1})
    with pytest.raises(ConfigError, match="written by trainer.backend fsdp"):
        t.megatron_read_state(tmp_path, None)
