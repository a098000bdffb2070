"""Sampling parity on an Instruct-shaped model: the real vLLM CPU engine samples the policy the trainer scores.

The model is shaped like Qwen2.5-Instruct (tied embeddings, a chat template, generation_config.json with
top_k 20, top_p 0.8, repetition_penalty 1.05). At equal weights version the engine's behaviour logprobs
(pi_behave) must equal the trainer's own `response_logprobs` (pi_prox) at temperature 0.7: behaviour
weight pi_prox / pi_behave = 1, nothing masked by the cap. Then again after weight updates published by
the trainer's code (export_weights in the engine's dtype, TrainerBusIO.publish_weights) and loaded by the
real RolloutAgent, through each sync mode: disk and the bus object store (a real nats-server); also for a version
written in shards (weightSync.bucketMB smaller than the model).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import pytest
import pytest_asyncio
import torch

from kuberl.api.v1alpha1 import RLExperiment
from kuberl.runtime.bus import Bus
from kuberl.runtime.bus.names import KEY_WEIGHTS
from kuberl.runtime.inference.base import GenerateRequest
from kuberl.runtime.inference.main import engine_dtype
from kuberl.runtime.inference.vllm import NEUTRAL_SAMPLING, VLLMEngine
from kuberl.runtime.rollout.agent import RolloutAgent
from kuberl.runtime.trainer import dist as D
from kuberl.runtime.trainer.batch import response_logprobs
from kuberl.runtime.trainer.bus_io import TrainerBusIO
from kuberl.runtime.trainer.weights import INDEX_FILE, export_model_weights, export_weights

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

T = 0.7  # != 1: a trainer that ignored temperature would fail
CAP = 5.0  # algorithm.behaviorWeightCap's default (mask mode: tokens with w > CAP are dropped)
TOL_MEAN = 1e-4  # token-mean |log pi_prox - log pi_behave|; measured ~2e-7 (float32 both sides; bf16 weights: ~2e-3)
TOL_MAX = 1e-3
PROMPTS = ["Repeat the digit 7.", "What is 3 + 4?", "Repeat the digit 2.", "Natalia sold 48 clips in April."]


def experiment(name: str, mode: str) -> RLExperiment:
    return RLExperiment.model_validate({
        "apiVersion": "kuberl.io/v1alpha1", "kind": "RLExperiment", "metadata": {"name": name},
        "spec": {
            "model": {"builtin": "tiny-qwen2-instruct"},  # dtype: the default bfloat16, as a user would leave it
            "dataset": {"builtin": "repeat-digit", "size": 8},
            "algorithm": {"samplesPerPrompt": 4, "maxNewTokens": 24, "batchSize": 2, "temperature": T},
            "rollout": {"engine": "vllm", "concurrency": 2, "accelerator": {"type": "cpu"}},
            "weightSync": {"mode": mode},
            "training": {"totalSteps": 1},
        },
    })


@dataclass
class Sample:
    prompt: list[int]
    output: list[int]
    behave: list[float]


@dataclass
class Parity:
    tokens: int
    mean_abs: float
    max_abs: float
    mean_weight: float
    masked: int

    def holds(self) -> bool:
        return self.tokens > 0 and self.mean_abs < TOL_MEAN and self.max_abs < TOL_MAX and self.masked == 0


@pytest_asyncio.fixture(loop_scope="function")
async def engine(vllm_instruct_server):
    e = VLLMEngine(url=vllm_instruct_server.url)
    await e.start()
    yield e
    await e.close()


@pytest.fixture
def tok(vllm_instruct_server):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(vllm_instruct_server.model_dir)


def trainer_model(path) -> torch.nn.Module:
    """The policy as the trainer holds it: float32 master weights, tied head (eval: no dropout)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def chat_ids(tok, text: str) -> list[int]:
    chat = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
    return tok(chat, add_special_tokens=False)["input_ids"]


async def sample(engine: VLLMEngine, tok, n: int = 4, payload_filter=None) -> list[Sample]:
    """n completions per prompt with the manifest's settings (temperature T, topP 1), as the workflows request them."""
    out = []
    for i, text in enumerate(PROMPTS):
        prompt = chat_ids(tok, text)
        for j in range(n):
            req = GenerateRequest(prompt, max_new_tokens=24, temperature=T, top_p=1.0, stop_token_ids=[tok.eos_token_id], seed=100 * i + j)
            if payload_filter is None:
                res = await engine.generate(req)
            else:  # a hand-made body (what a client that leaves fields out sends)
                res = engine.parse_generate(await engine._post(engine.generate_path, json=payload_filter(engine.generate_payload(req))), engine.version)
            out.append(Sample(prompt, res.output_ids, res.logprobs))
    return out


@torch.no_grad()
def parity(model: torch.nn.Module, samples: list[Sample]) -> Parity:
    """pi_prox from the trainer's own response_logprobs against the engine's pi_behave, token by token."""
    width = max(len(s.output) for s in samples)
    prox = response_logprobs(model, [s.prompt for s in samples], [s.output for s in samples], width, temperature=T)
    deltas = [float(prox[i, t]) - s.behave[t] for i, s in enumerate(samples) for t in range(len(s.output))]
    weights = [math.exp(d) for d in deltas]
    return Parity(tokens=len(deltas), mean_abs=sum(map(abs, deltas)) / len(deltas), max_abs=max(map(abs, deltas)),
                  mean_weight=sum(weights) / len(weights), masked=sum(w > CAP for w in weights))


@torch.no_grad()
def train_like_update(model: torch.nn.Module, seed: int, scale: float = 0.01) -> None:
    """Move every weight (the tied embedding/head included) off its old value and off the bf16 grid."""
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.add_(torch.randn(p.shape, generator=g) * scale)


async def load(engine: VLLMEngine, path, version: int) -> None:
    await engine.pause()
    try:
        await engine.update_weights_from_disk(str(path), version)
    finally:
        await engine.resume()


async def test_the_engine_samples_the_trained_policy_at_temperature_07_on_an_instruct_shaped_model(engine, tok, vllm_instruct_server):
    await load(engine, vllm_instruct_server.model_dir, 0)
    model = trainer_model(vllm_instruct_server.model_dir)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied, like Qwen2.5-0.5B..3B
    got = parity(model, await sample(engine, tok))
    print(f"\nparity v0: {got}")
    assert got.holds(), got
    assert abs(got.mean_weight - 1.0) < 1e-2


async def test_the_server_ignores_the_models_generation_config_even_when_a_request_leaves_fields_out(engine, tok, vllm_instruct_server):
    """--generation-config vllm on its own: a body without top_k/min_p/penalties still samples the plain policy."""
    await load(engine, vllm_instruct_server.model_dir, 0)

    def strip(body: dict) -> dict:
        return {**body, "sampling_params": {k: v for k, v in body["sampling_params"].items() if k not in NEUTRAL_SAMPLING}}

    got = parity(trainer_model(vllm_instruct_server.model_dir), await sample(engine, tok, n=2, payload_filter=strip))
    assert got.holds(), got


@pytest.mark.parametrize("mode", ["disk", "bus"])
async def test_parity_holds_after_every_weight_update_through_each_sync_mode(mode, engine, tok, vllm_instruct_server, nats_server, experiment_name, tmp_path):
    exp = experiment(experiment_name, mode)
    assert engine_dtype(exp.spec) == "float32"  # CPU engine: the trainer exports float32, not model.dtype's bf16
    bus = await Bus.connect(nats_server.url, experiment_name)
    try:
        trainer_io = TrainerBusIO(bus)
        agent = RolloutAgent(exp, bus, engine, None, [], workdir=tmp_path / "agent", agent_id="parity-agent")
        await load(engine, vllm_instruct_server.model_dir, 0)
        model = trainer_model(vllm_instruct_server.model_dir)
        for version in (1, 2, 3):
            before = copy.deepcopy(model)
            train_like_update(model, seed=version)
            # What Trainer.stage_publish_weights does: full state dict -> weights/v{N} in the engine's dtype -> publish.
            path = export_weights(model.state_dict(), tmp_path / "weights", version, source_dir=vllm_instruct_server.model_dir,
                                  dtype=getattr(torch, engine_dtype(exp.spec)), keep=3)
            await trainer_io.publish_weights(version, path, mode=mode)
            w = await bus.get_state(KEY_WEIGHTS)
            assert w["version"] == version and w["mode"] == mode and (w["object"] is not None) == (mode == "bus")
            await agent.apply_weights(w)  # bus: downloads from the object store into the agent's cache first
            assert engine.version == version
            samples = await sample(engine, tok, n=3)
            got = parity(model, samples)
            print(f"\nparity {mode} v{version}: {got}")
            assert got.holds(), f"v{version} via {mode}: {got}"
            stale = parity(before, samples)
            assert stale.mean_abs > 20 * TOL_MEAN, f"the update barely moved the policy, the check proves little: {stale}"
    finally:
        await load(engine, vllm_instruct_server.model_dir, 0)
        await bus.close()


async def test_each_reload_checks_the_tied_head_and_the_parity_check_would_catch_a_stale_one(engine, tok, vllm_instruct_server, tmp_path):
    """A stale tied head = the new body with the old embeddings as LM head: the check must tell them apart.

    vLLM 0.32's reload re-packs the tied head itself (refreshed 0); the worker extension checks it every time.
    """
    await load(engine, vllm_instruct_server.model_dir, 0)
    old = trainer_model(vllm_instruct_server.model_dir)
    new = copy.deepcopy(old)
    train_like_update(new, seed=7)
    path = export_weights(new.state_dict(), tmp_path / "weights", 1, source_dir=vllm_instruct_server.model_dir, dtype=torch.float32)
    try:
        await load(engine, path, 1)
        assert engine.last_reload == [{"tied_layers": 2, "refreshed": 0}]  # embed_tokens + lm_head, checked, current
        samples = await sample(engine, tok, n=2)
    finally:
        await load(engine, vllm_instruct_server.model_dir, 0)
    assert parity(new, samples).holds()
    hybrid = copy.deepcopy(new)  # what an engine with a stale tied head computes
    hybrid.lm_head.weight = torch.nn.Parameter(old.model.embed_tokens.weight.detach().clone())
    stale = parity(hybrid, samples)
    print(f"\nstale-head parity: {stale}")
    assert not stale.holds() and stale.mean_abs > 20 * TOL_MEAN, stale


@pytest.mark.parametrize("mode", ["disk", "bus"])
async def test_a_version_in_shards_loads_into_the_engine_through_each_sync_mode(mode, engine, tok, vllm_instruct_server, nats_server, experiment_name,
                                                                                 tmp_path):
    """weightSync.bucketMB 1 < the tied model's 2.4 MB: the trainer's export (export_model_weights, as stage_publish_weights
    calls it) writes 3 shards and an index; the engine loads them (disk: the folder; bus: the agent's copy from the object store)."""
    exp = experiment(experiment_name, mode)
    exp.spec.weight_sync.bucket_mb = 1
    bus = await Bus.connect(nats_server.url, experiment_name)
    try:
        agent = RolloutAgent(exp, bus, engine, None, [], workdir=tmp_path / "agent", agent_id="shards-agent")
        await load(engine, vllm_instruct_server.model_dir, 0)
        model = trainer_model(vllm_instruct_server.model_dir)
        before = copy.deepcopy(model)
        train_like_update(model, seed=11)
        stats: dict = {}
        path = export_model_weights(model, D.DistInfo(0, 1, 0, torch.device("cpu")), tmp_path / "weights", 1, shard_bytes=exp.spec.weight_sync.bucket_mb << 20,
                                    source_dir=vllm_instruct_server.model_dir, dtype=getattr(torch, engine_dtype(exp.spec)), stats=stats)
        assert sorted(p.name for p in path.glob("model*")) == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)] + [INDEX_FILE]
        assert stats["peak_bytes"] <= 1 << 20 < stats["total_bytes"]
        await TrainerBusIO(bus).publish_weights(1, path, mode=mode)
        await agent.apply_weights(await bus.get_state(KEY_WEIGHTS))
        assert engine.version == 1 and engine.last_reload == [{"tied_layers": 2, "refreshed": 0}]
        samples = await sample(engine, tok, n=3)
        got = parity(model, samples)
        print(f"\nparity {mode} in {stats['shards']} shards: {got}")
        assert got.holds(), f"{mode}, {stats['shards']} shards: {got}"
        stale = parity(before, samples)
        assert stale.mean_abs > 20 * TOL_MEAN, f"the update barely moved the policy, the check proves little: {stale}"
    finally:
        await load(engine, vllm_instruct_server.model_dir, 0)
        await bus.close()
