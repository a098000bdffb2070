"""How the trainer gets pi_prox: one no-grad eval-mode forward, or none where the update's forward is the same.

World size 1 (one process, gloo): the model is the plain module, not FSDP-wrapped (nothing to shard).
A model with dropout must be scored in eval mode (the same numbers every time); one PPO minibatch on a
model without dropout takes pi_prox from the update's own forward (one forward per micro-batch, not two)
and gives the same pi_prox the separate forward would.
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
def models(tmp_path_factory) -> dict[str, Path]:
    from kuberl.runtime.models import build_tiny_model

    root = tmp_path_factory.mktemp("prox")
    return {"plain": build_tiny_model(root / "plain", seed=0), "dropout": build_tiny_model(root / "dropout", seed=0, attention_dropout=0.5)}


def make(tmp_path: Path, model: Path, **algorithm) -> Trainer:
    exp = RLExperiment.model_validate({
        "apiVersion": "kuberl.io/v1alpha1", "kind": "RLExperiment", "metadata": {"name": "prox"},
        "spec": {"model": {"path": str(model), "dtype": "float32"}, "dataset": {"builtin": "repeat-digit", "size": 8},
                 "algorithm": {"name": "grpo", "samplesPerPrompt": N, "batchSize": 2, "learningRate": 3e-3, **algorithm},
                 "trainer": {"microBatchTokens": 64}, "training": {"totalSteps": 10}},
    })
    t = Trainer(exp, bus_url="nats://unused:4222", workdir=tmp_path, handle_sigterm=False)
    t.setup()
    return t


def groups() -> list[dict]:
    out = []
    for g in range(2):
        prompt = [5 + g, 40, 41, 42, 43, 44, 45, 46]  # long enough for attention dropout to matter
        samples = [{"input_ids": prompt, "output_ids": [10 + k, 20 + g, 30, 31, 32], "logprobs": [-1.0] * 5, "versions": [0] * 5,
                    "loss_mask": [1] * 5, "reward": float(k == 0)} for k in range(N)]
        out.append({"group_id": f"g{g}", "samples": samples})
    return out


@pytest.fixture
def cleanup():
    yield
    D.shutdown()


def count_forwards(model: torch.nn.Module) -> list[int]:
    calls = [0]
    model.register_forward_hook(lambda *a: calls.__setitem__(0, calls[0] + 1))
    return calls


def test_one_rank_trains_the_plain_module_not_an_fsdp_wrapper(tmp_path, models, cleanup):
    t = make(tmp_path, models["plain"])
    assert type(t.model).__name__ == "Qwen2ForCausalLM"  # FSDP2 would make it FSDPQwen2ForCausalLM
    assert not any(hasattr(p, "full_tensor") for p in t.model.parameters())  # no DTensor parameters


def test_pi_prox_of_a_model_with_dropout_is_taken_in_eval_mode_without_grad(tmp_path, models, cleanup):
    t = make(tmp_path, models["dropout"])
    assert not t.prox_in_update()  # train-mode logits differ: pi_prox needs its own forward
    t.model.train()  # as after any update
    a, b = build_batch(groups(), N), build_batch(groups(), N)
    t.stage_prox_logp(a)
    t.stage_prox_logp(b)
    assert not a.prox_logp.requires_grad
    assert torch.equal(a.prox_logp, b.prox_logp), "dropout was on: pi_prox changes from one call to the next"
    with torch.no_grad():
        t.model.eval()
        expected = response_logprobs(t.model, a.prompts, a.outputs, a.loss_mask.shape[1])
    assert torch.allclose(a.prox_logp, expected, atol=1e-6)
    t.model.train()
    t.stage_prox_logp(build_batch(groups(), N))
    assert t.model.training, "stage_prox_logp must give the model back in the mode it found it"


def test_one_minibatch_takes_pi_prox_from_the_update_forward_with_the_same_numbers(tmp_path, models, cleanup):
    t = make(tmp_path, models["plain"], ppoMinibatches=1)
    assert t.prox_in_update()
    batch = build_batch(groups(), N)
    with torch.no_grad():  # pi_prox as a separate forward at the pre-update weights would give it
        expected = response_logprobs(t.model.eval(), batch.prompts, batch.outputs, batch.loss_mask.shape[1])
    t.model.train()
    calls = count_forwards(t.model)
    with torch.no_grad():  # model calls of one log-prob pass (2 when the groups' prompts run once, then the responses)
        response_logprobs(t.model, batch.prompts, batch.outputs, batch.loss_mask.shape[1])
    one_pass, calls[0] = calls[0], 0
    t.stage_prox_logp(batch)
    t.stage_advantages(batch)
    t.stage_ppo_update(batch)
    assert calls[0] == one_pass, f"{calls[0]} model calls for one micro-batch ({one_pass} a pass): pi_prox should come from the update's"
    assert torch.allclose(batch.prox_logp, expected, atol=1e-5)


def test_several_minibatches_compute_pi_prox_before_the_update(tmp_path, models, cleanup):
    t = make(tmp_path, models["plain"], ppoMinibatches=2)
    assert not t.prox_in_update()  # the second minibatch runs after an optimizer step: pi_theta != pi_prox there
    batch = build_batch(groups(), N)
    with torch.no_grad():
        expected = response_logprobs(t.model.eval(), batch.prompts, batch.outputs, batch.loss_mask.shape[1])
    t.stage_prox_logp(batch)
    assert torch.allclose(batch.prox_logp, expected, atol=1e-5)
    before = batch.prox_logp.clone()
    t.stage_advantages(batch)
    t.stage_ppo_update(batch)
    assert torch.equal(batch.prox_logp, before)  # the update does not overwrite the pre-update pi_prox
