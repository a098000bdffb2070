"""LoRA in the trainer (algorithm.lora): PEFT adapters on a tiny Qwen2, world size 1, in-memory groups.

Only the adapters train (requires_grad, the optimizer's parameters, the base weights bit-identical after
updates); a published version is a PEFT adapter folder that PeftModel.from_pretrained loads into the same
policy; a checkpoint holds the trained adapters and their optimizer state, and a restarted trainer resumes them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kuberl.api import RLExperiment
from kuberl.runtime.errors import ConfigError
from kuberl.runtime.trainer import dist as D
from kuberl.runtime.trainer.batch import build_batch, response_logprobs
from kuberl.runtime.trainer.trainer import Trainer
from kuberl.runtime.trainer.weights import ADAPTER_CONFIG, ADAPTER_FILE, is_adapter

N = 2
LORA = {"rank": 4, "alpha": 8, "targetModules": ["q_proj", "v_proj", "down_proj"]}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from kuberl.runtime.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("m") / "tiny", seed=0)


def make_trainer(workdir: Path, tiny: Path, lora: dict = LORA, trainer: dict | None = None, **algorithm) -> Trainer:
    exp = RLExperiment.model_validate({
        "apiVersion": "kuberl.io/v1alpha1", "kind": "RLExperiment", "metadata": {"name": "lora"},
        "spec": {"model": {"path": str(tiny), "dtype": "float32"}, "dataset": {"builtin": "repeat-digit", "size": 8},
                 "algorithm": {"name": "grpo", "samplesPerPrompt": N, "batchSize": 2, "learningRate": 2e-2, "rewardBias": 0.0,
                               "rewardScaling": 1.0, "lora": lora, **algorithm},
                 "trainer": {"microBatchTokens": 64, **(trainer or {})}, "training": {"totalSteps": 10}},
    })
    t = Trainer(exp, bus_url="nats://unused:4222", workdir=workdir, handle_sigterm=False)
    t.setup()
    return t


@pytest.fixture
def trainer(tmp_path, tiny):
    t = make_trainer(tmp_path, tiny)
    yield t
    D.shutdown()


class FakeBus:
    """What stage_publish_weights and stage_checkpoint call on the trainer's bus."""

    groups_buffered = 0

    def __init__(self) -> None:
        self.published: list[tuple[int, Path, str]] = []

    async def publish_weights(self, version, path, *, mode):
        self.published.append((version, Path(path), mode))

    async def ack(self, leases):
        pass

    async def put_progress(self, progress):
        pass


def groups_from(model: torch.nn.Module, count: int = 2) -> list[dict]:
    """Groups sampled by the model itself; sample 0 of each group is the rewarded one."""
    torch.manual_seed(0)
    out = []
    for g in range(count):
        prompt = [5 + g, 40, 41, 42]
        samples = []
        for k in range(N):
            with torch.no_grad():
                ids = model.generate(torch.tensor([prompt]), max_new_tokens=5, do_sample=True, top_k=0, pad_token_id=0, eos_token_id=None)
                resp = ids[0, len(prompt):].tolist()
                lp = response_logprobs(model, [prompt], [resp], len(resp))[0].tolist()
            samples.append({"input_ids": prompt, "output_ids": resp, "logprobs": lp, "versions": [0] * len(resp),
                            "loss_mask": [1] * len(resp), "reward": 1.0 if k == 0 else 0.0})
        out.append({"group_id": f"g{g}", "samples": samples})
    return out


def base_model(tiny: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()


def train_steps(t: Trainer, groups: list[dict], steps: int) -> dict:
    stats = {}
    for _ in range(steps):
        batch = build_batch(groups, N)
        t.stage_prox_logp(batch)
        t.stage_advantages(batch)
        stats = t.stage_ppo_update(batch)
    return stats


def adapter_params(t: Trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in t.model.named_parameters() if "lora_" in n}


def test_only_the_adapters_require_grad_and_reach_the_optimizer(trainer):
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    # q_proj, v_proj and down_proj of each layer, A and B each: nothing else got an adapter
    layers = trainer.model.get_base_model().config.num_hidden_layers
    assert len(trainable) == layers * 3 * 2
    assert all(any(f".{m}.lora_" in n for m in LORA["targetModules"]) for n in trainable)
    in_optimizer = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert in_optimizer == {id(p) for p in trainer.model.parameters() if p.requires_grad}
    # B starts at zero: before any update the adapted model is the base model
    assert all(p.abs().sum() == 0 for n, p in trainer.model.named_parameters() if ".lora_B." in n)


def test_updates_change_the_adapters_only_and_raise_the_rewarded_likelihood(trainer, tiny):
    frozen = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if not p.requires_grad}
    groups = groups_from(base_model(tiny))
    batch = build_batch(groups, N)
    with torch.no_grad():
        before = (trainer._logprobs_all_rows(trainer.model, batch, list(range(batch.num_samples)), batch.loss_mask.shape[1]) * batch.loss_mask).sum(1)
    stats = train_steps(trainer, groups, 4)
    assert stats["grad_norm"] > 0
    for n, p in trainer.model.named_parameters():
        if not p.requires_grad:
            assert torch.equal(p, frozen[n]), f"frozen {n} changed"
    assert any(p.abs().sum() > 0 for n, p in trainer.model.named_parameters() if ".lora_B." in n)
    with torch.no_grad():
        after = (trainer._logprobs_all_rows(trainer.model, batch, list(range(batch.num_samples)), batch.loss_mask.shape[1]) * batch.loss_mask).sum(1)
    gain = (after - before).reshape(-1, N)
    assert (gain[:, 0] > gain[:, 1]).all(), f"rewarded {gain[:, 0].tolist()} vs unrewarded {gain[:, 1].tolist()}"


async def test_a_published_version_is_a_peft_adapter_that_loads_into_the_same_policy(tmp_path, tiny):
    from peft import PeftModel

    trainer = make_trainer(tmp_path, tiny)
    train_steps(trainer, groups_from(base_model(tiny)), 2)
    trainer.bus = FakeBus()
    trainer.version = 3
    await trainer.stage_publish_weights()
    [(version, path, mode)] = trainer.bus.published
    assert (version, mode) == (3, "disk") and path == trainer.weights_root / "v3"
    assert is_adapter(path) and sorted(p.name for p in path.iterdir()) == [ADAPTER_CONFIG, ADAPTER_FILE]
    tensors = load_file(str(path / ADAPTER_FILE))
    assert tensors and all(k.endswith((".lora_A.weight", ".lora_B.weight")) for k in tensors), list(tensors)  # PEFT's names: no adapter name
    loaded = PeftModel.from_pretrained(base_model(tiny), str(path)).eval()
    ids = torch.tensor([[5, 40, 41, 42, 7, 8, 9]])
    trainer.model.eval()
    with torch.no_grad():
        want, got, base = trainer.model(ids).logits, loaded(ids).logits, base_model(tiny)(ids).logits
    assert torch.allclose(got, want, atol=1e-5)
    assert (got - base).abs().max() > 1e-3  # the adapter is trained, not the identity
    merged = loaded.merge_and_unload()  # what a user deploys: the base with the adapter folded in
    with torch.no_grad():
        assert torch.allclose(merged(ids).logits, want, atol=1e-4)
    # adapters only, never a frozen base matrix
    assert sum(t.numel() for t in tensors.values()) == sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    D.shutdown()


async def test_a_checkpoint_holds_the_adapters_and_their_optimizer_state_and_resumes_them(tmp_path, tiny):
    t = make_trainer(tmp_path, tiny)
    t.bus = FakeBus()
    train_steps(t, groups_from(base_model(tiny)), 2)
    trained = adapter_params(t)
    exp_avg = {n: t.optimizer.state[p]["exp_avg"].clone() for n, p in t.model.named_parameters() if p.requires_grad}
    t.step, t.version = 2, 2
    await t.stage_checkpoint()
    assert all(p.abs().sum() > 0 for n, p in trained.items() if ".lora_B." in n)
    from kuberl.runtime.trainer import checkpoint as ck

    saved = ck.read_model_state(ck.latest_checkpoint(t.ckpt_root).path)  # adapters only: the frozen base comes from spec.model
    assert saved and all("lora_" in k for k in saved), sorted(k for k in saved if "lora_" not in k)[:3]
    assert sum(v.numel() for v in saved.values()) == sum(p.numel() for p in t.model.parameters() if p.requires_grad)

    again = make_trainer(tmp_path, tiny)  # a restarted trainer: fresh (zero-B) adapters, then _resume
    assert again.resumed_from is not None and again.step == 2
    resumed = adapter_params(again)
    assert resumed.keys() == trained.keys()
    for n in trained:
        assert torch.equal(resumed[n], trained[n]), n
    for n, p in again.model.named_parameters():
        if p.requires_grad:
            assert torch.equal(again.optimizer.state[p]["exp_avg"], exp_avg[n]), n
    assert {id(p) for g in again.optimizer.param_groups for p in g["params"]} == {id(p) for p in again.model.parameters() if p.requires_grad}
    D.shutdown()


def test_gradient_checkpointing_still_trains_the_adapters(tmp_path, tiny):
    # The embeddings are frozen: without enable_input_require_grads, re-entrant checkpointing would give
    # the adapters inside checkpointed layers no gradient at all.
    t = make_trainer(tmp_path, tiny, trainer={"gradientCheckpointing": True})
    assert t.model.get_base_model().is_gradient_checkpointing
    t.model.train()
    ids = torch.tensor([[5, 40, 41, 42, 7, 8, 9]])
    t.model(ids).logits.float().pow(2).mean().backward()
    grads_b = [p.grad for n, p in t.model.named_parameters() if ".lora_B." in n]  # B = 0 at the start: only B gets a gradient
    assert grads_b and all(g is not None and g.abs().sum() > 0 for g in grads_b)
    D.shutdown()


def test_a_target_module_the_model_lacks_is_a_config_error(tmp_path, tiny):
    try:
        with pytest.raises(ConfigError, match="algorithm.lora.targetModules.*no_such_proj"):
            make_trainer(tmp_path, tiny, lora={**LORA, "targetModules": ["no_such_proj"]})
    finally:
        D.shutdown()
