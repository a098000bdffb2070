"""LoRA end to end on the real vLLM CPU engine: the hot-loaded adapter samples exactly the policy the trainer scores.

A vLLM server started as `kuberl engine` starts it for a manifest with algorithm.lora (--enable-lora,
VLLM_ALLOW_RUNTIME_LORA_UPDATING=1) serves the tiny Qwen2. A real Trainer with PEFT adapters trains one step
on groups the engine sampled, publishes its adapter (stage_publish_weights: adapter_config.json +
adapter_model.safetensors) through each sync mode (disk, and the bus object store of a real nats-server);
the real RolloutAgent hot-loads it (kuberl-v1). The engine's behaviour log-probs must then equal the
trainer's own pi_prox (abs 2e-3 per token; measured ~1e-6), and differ clearly from the base model's.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import pytest_asyncio
import torch

from kuberl.api.v1alpha1 import ModelSpec, RLExperiment
from kuberl.runtime.bus import Bus
from kuberl.runtime.bus.names import KEY_WEIGHTS
from kuberl.runtime.inference.base import GenerateRequest
from kuberl.runtime.inference.vllm import VLLMEngine
from kuberl.runtime.models import resolve_model
from kuberl.runtime.rollout.agent import RolloutAgent
from kuberl.runtime.trainer import dist as D
from kuberl.runtime.trainer.batch import build_batch, response_logprobs
from kuberl.runtime.trainer.bus_io import TrainerBusIO
from kuberl.runtime.trainer.trainer import Trainer
from kuberl.runtime.trainer.weights import ADAPTER_CONFIG, ADAPTER_FILE

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

T = 0.7  # != 1: a trainer or an engine that ignored temperature would fail
N = 4
TOL = 2e-3  # per token |log pi_prox - log pi_behave|
PROMPTS = [[5, 40, 41, 42], [9, 17, 33, 8, 60], [12, 13, 14], [70, 71, 72, 73, 74, 75]]
LORA = {"rank": 8, "alpha": 16}


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory):
    """A vLLM CPU server with LoRA enabled (rank 8), as `kuberl engine` starts it for a lora manifest."""
    workdir = tmp_path_factory.mktemp("lora-engine")
    model_dir = Path(resolve_model(ModelSpec(builtin="tiny-qwen2"), workdir))
    log_path = workdir / "vllm.log"
    engine = VLLMEngine(str(model_dir), max_model_len=512, max_num_seqs=16, lora_rank=LORA["rank"], log_path=log_path, startup_timeout=300)

    async def start() -> None:
        await engine.start()
        await engine.close()

    try:
        asyncio.run(start())
    except Exception:  # noqa: BLE001  show the server's log whatever went wrong
        asyncio.run(engine.stop())
        pytest.fail("vLLM with --enable-lora did not start; log tail:\n" + (log_path.read_text()[-3000:] if log_path.exists() else "(no log)"))
    try:
        yield engine.url, model_dir
    finally:
        asyncio.run(engine.stop())


@pytest_asyncio.fixture(loop_scope="function")
async def engine(lora_server):
    e = VLLMEngine(url=lora_server[0])
    await e.start()
    yield e
    await e.close()


def experiment(name: str, model_dir: Path, mode: str) -> RLExperiment:
    return RLExperiment.model_validate({
        "apiVersion": "kuberl.io/v1alpha1", "kind": "RLExperiment", "metadata": {"name": name},
        "spec": {"model": {"path": str(model_dir), "dtype": "float32"}, "dataset": {"builtin": "repeat-digit", "size": 8},
                 "algorithm": {"name": "grpo", "samplesPerPrompt": N, "batchSize": len(PROMPTS), "maxNewTokens": 12, "temperature": T,
                               "learningRate": 3e-2, "rewardBias": 0.0, "rewardScaling": 1.0, "lora": LORA},
                 "rollout": {"engine": "vllm", "accelerator": {"type": "cpu"}}, "weightSync": {"mode": mode},
                 "trainer": {"microBatchTokens": 256}, "training": {"totalSteps": 2}},
    })


async def sample(engine: VLLMEngine, seed: int) -> list[tuple[list[int], list[int], list[float]]]:
    out = []
    for i, prompt in enumerate(PROMPTS):
        for j in range(N):
            res = await engine.generate(GenerateRequest(prompt, max_new_tokens=12, temperature=T, top_p=1.0, seed=seed + 100 * i + j))
            out.append((prompt, res.output_ids, res.logprobs))
    return out


@torch.no_grad()
def max_gap(model: torch.nn.Module, samples) -> tuple[float, float]:
    """(max, mean) over response tokens of |trainer log-prob - engine log-prob|, at temperature T."""
    model.eval()
    width = max(len(s[1]) for s in samples)
    prox = response_logprobs(model, [s[0] for s in samples], [s[1] for s in samples], width, temperature=T)
    gaps = [abs(float(prox[i, t]) - s[2][t]) for i, s in enumerate(samples) for t in range(len(s[1]))]
    return max(gaps), sum(gaps) / len(gaps)


def groups(samples) -> list[dict]:
    """The engine's samples as trajectory groups; every other response rewarded (any advantage moves the adapter)."""
    out = []
    for g in range(len(PROMPTS)):
        rows = samples[g * N:(g + 1) * N]
        out.append({"group_id": f"g{g}", "samples": [
            {"input_ids": p, "output_ids": o, "logprobs": lp, "versions": [0] * len(o), "loss_mask": [1] * len(o),
             "reward": float(k % 2 == 0)} for k, (p, o, lp) in enumerate(rows)]})
    return out


@pytest.mark.parametrize("mode", ["disk", "bus"])
async def test_the_hot_loaded_adapter_samples_the_policy_the_trainer_scores(mode, engine, lora_server, nats_server, experiment_name, tmp_path):
    url, model_dir = lora_server
    exp = experiment(experiment_name, model_dir, mode)
    trainer = Trainer(exp, bus_url=nats_server.url, workdir=tmp_path / "trainer", handle_sigterm=False)
    trainer.setup()
    bus = await Bus.connect(nats_server.url, experiment_name)
    try:
        agent = RolloutAgent(exp, bus, engine, None, [], workdir=tmp_path / "agent", agent_id="lora-agent")
        base = await sample(engine, seed=1)
        assert engine.served_model == "policy"
        assert max_gap(trainer.model, base)[0] < TOL  # zero adapters: the trainer's policy is the base the engine serves

        batch = build_batch(groups(base), N)
        trainer.stage_prox_logp(batch)
        trainer.stage_advantages(batch)
        stats = trainer.stage_ppo_update(batch)
        assert stats["grad_norm"] > 0
        trainer.bus, trainer.version = TrainerBusIO(bus), 1
        await trainer.stage_publish_weights()
        w = await bus.get_state(KEY_WEIGHTS)
        assert (w["version"], w["mode"]) == (1, mode) and (w["object"] is not None) == (mode == "bus")
        await agent.apply_weights(w)  # bus: downloaded into the agent's cache, then hot-loaded from there
        assert engine.served_model == "kuberl-v1" and engine.version == 1
        assert {p.name for p in Path(await agent._weights_dir(w)).iterdir()} == {ADAPTER_CONFIG, ADAPTER_FILE}

        trained = await sample(engine, seed=2)
        worst, mean = max_gap(trainer.model, trained)
        print(f"\nLoRA parity via {mode}: max {worst:.2e}, mean {mean:.2e} over {sum(len(s[1]) for s in trained)} tokens")
        assert worst < TOL, f"engine vs trainer log-probs after the adapter update via {mode}: max {worst}, mean {mean}"
        from transformers import AutoModelForCausalLM

        stale_worst, stale_mean = max_gap(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), trained)
        assert stale_mean > 20 * mean and stale_worst > 10 * TOL, f"the adapter barely moved the policy: base gap {stale_mean}"
    finally:
        await bus.close()
        D.shutdown()
