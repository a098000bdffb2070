"""The Trainer's compute stages in one process (world size 1, FSDP2 over gloo), on in-memory groups.

prox_logp -> advantages -> ppo_update on a tiny Qwen2: the proximal logprobs of self-generated data match
the behaviour logprobs, updates raise the likelihood of rewarded responses, and the KL path runs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kuberl.api import RLExperiment
from kuberl.runtime.trainer import dist as D
from kuberl.runtime.trainer.batch import build_batch, response_logprobs
from kuberl.runtime.trainer.trainer import Trainer

N = 2


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from kuberl.runtime.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("m") / "tiny", seed=0)


@pytest.fixture
def trainer(tmp_path, tiny, request):
    overrides = getattr(request, "param", {})
    exp = RLExperiment.model_validate({
        "apiVersion": "kuberl.io/v1alpha1", "kind": "RLExperiment", "metadata": {"name": "compute"},
        "spec": {"model": {"path": str(tiny), "dtype": "float32"}, "dataset": {"builtin": "repeat-digit", "size": 8},
                 "algorithm": {"name": "grpo", "samplesPerPrompt": N, "batchSize": 2, "learningRate": 3e-3, "rewardBias": 0.0,
                               "rewardScaling": 1.0, **overrides},
                 "trainer": {"microBatchTokens": 64}, "training": {"totalSteps": 10}},
    })
    t = Trainer(exp, bus_url="nats://unused:4222", workdir=tmp_path, handle_sigterm=False)
    t.setup()
    yield t
    D.shutdown()


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


def reference_copy(tiny: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()


def test_proximal_logprobs_of_self_generated_data_equal_the_behaviour_logprobs(trainer, tiny):
    batch = build_batch(groups_from(reference_copy(tiny)), N)
    trainer.stage_prox_logp(batch)
    assert torch.allclose(batch.prox_logp * batch.loss_mask, batch.behave_logp, atol=1e-4)


def test_ppo_updates_raise_the_likelihood_of_rewarded_responses(trainer, tiny):
    groups = groups_from(reference_copy(tiny))
    before = None
    for _ in range(4):
        batch = build_batch(groups, N)
        trainer.stage_prox_logp(batch)
        seq = (batch.prox_logp * batch.loss_mask).sum(1).reshape(-1, N)
        before = seq if before is None else before
        trainer.stage_advantages(batch)
        stats = trainer.stage_ppo_update(batch)
    batch = build_batch(groups, N)
    trainer.stage_prox_logp(batch)
    after = (batch.prox_logp * batch.loss_mask).sum(1).reshape(-1, N)
    gain = after - before
    assert (gain[:, 0] > gain[:, 1]).all(), f"rewarded {gain[:, 0].tolist()} vs unrewarded {gain[:, 1].tolist()}"
    assert stats["grad_norm"] > 0 and stats["tokens"] == batch.loss_mask.sum()
    assert trainer.scheduler.last_epoch == 4  # one optimizer step per ppoMinibatch (1) per call


@pytest.mark.parametrize("trainer", [{"klCoef": 0.5, "ppoMinibatches": 2}], indirect=True)
def test_a_kl_coefficient_loads_a_frozen_reference_and_reports_the_kl(trainer, tiny):
    assert trainer.ref_model is not None and not any(p.requires_grad for p in trainer.ref_model.parameters())
    batch = build_batch(groups_from(reference_copy(tiny)), N)
    trainer.stage_prox_logp(batch)
    assert torch.allclose(batch.ref_logp, batch.prox_logp)  # nothing trained yet: reference = policy
    trainer.stage_advantages(batch)
    stats = trainer.stage_ppo_update(batch)
    assert "kl" in stats and stats["kl"] >= 0
    assert trainer.scheduler.last_epoch == 2  # two minibatches, two optimizer steps
