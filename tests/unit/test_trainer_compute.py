"""The Trainer's compute stages in one process (world size 1, FSDP2 over gloo), on in-memory groups.

prox_logp -> advantages -> ppo_update on a tiny Qwen2: the proximal logprobs of self-generated data match
the behaviour logprobs, updates raise the likelihood of rewarded responses, and the KL path runs.
TestDecoupledWiring feeds a batch whose behaviour log-probs differ from the proximal ones, at a temperature
other than 1, and checks pi_prox, the advantages, the loss and the gradient against the decoupled objective
computed in the test by hand from the model's logits (scripts/mutation-check.py relies on it).
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


def likelihoods(trainer: Trainer, batch) -> torch.Tensor:
    """Summed log-probs of every response under the trainer's current weights, [groups, N]."""
    with torch.no_grad():
        lp = trainer._logprobs_all_rows(trainer.model, batch, list(range(batch.num_samples)), batch.loss_mask.shape[1])
    return (lp * batch.loss_mask).sum(1).reshape(-1, N)


# Two minibatches: pi_prox needs a forward of its own before the update (one minibatch may take it from the update's).
@pytest.mark.parametrize("trainer", [{"ppoMinibatches": 2}], indirect=True)
def test_proximal_logprobs_of_self_generated_data_equal_the_behaviour_logprobs(trainer, tiny):
    batch = build_batch(groups_from(reference_copy(tiny)), N)
    trainer.stage_prox_logp(batch)
    assert torch.allclose(batch.prox_logp * batch.loss_mask, batch.behave_logp, atol=1e-4)


def test_ppo_updates_raise_the_likelihood_of_rewarded_responses(trainer, tiny):
    groups = groups_from(reference_copy(tiny))
    before = None
    for _ in range(4):
        batch = build_batch(groups, N)
        before = likelihoods(trainer, batch) if before is None else before
        trainer.stage_prox_logp(batch)
        trainer.stage_advantages(batch)
        stats = trainer.stage_ppo_update(batch)
    gain = likelihoods(trainer, build_batch(groups, N)) - before
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
    # The first minibatch is trained at the reference weights (KL exactly 0); the second after one optimizer
    # step, so its policy has left the frozen reference: a KL that stays 0 means no reference is used.
    assert stats["kl"] > 1e-9
    assert trainer.scheduler.last_epoch == 2  # two minibatches, two optimizer steps
    again = build_batch(groups_from(reference_copy(tiny)), N)
    trainer.stage_prox_logp(again)
    assert torch.allclose(again.ref_logp, batch.ref_logp) and not torch.allclose(again.prox_logp, batch.prox_logp)


T = 0.7  # sampling temperature of the wiring tests: the trainer must score softmax(logits / T)
# Offsets d = log pi_prox - log pi_behave per response token, cycled: behaviour weights e^d from 0.45 to 2.2,
# beyond the clip range [0.6, 1.4] both ways, under the cap (5).
OFFSETS = [0.8, -0.8, 0.3, -0.3, 0.0, 0.5, -0.6]


def logprobs_by_hand(model: torch.nn.Module, prompt: list[int], response: list[int], temperature: float) -> torch.Tensor:
    """log softmax(logits / T) at each response token, from the model's raw logits (not the trainer's code)."""
    logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1:-1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


@pytest.fixture
def off_policy(tiny):
    """Groups sampled at temperature T whose behaviour log-probs are pi_prox's minus OFFSETS (an engine that
    sampled from another policy), plus the by-hand pi_prox, weights and advantages of every response token."""
    model = reference_copy(tiny)
    torch.manual_seed(1)
    groups, prox, weights, advantages = [], [], [], []
    k = 0
    for g in range(2):
        prompt = [7 + g, 40, 41, 42]
        samples = []
        for i in range(N):
            with torch.no_grad():
                ids = model.generate(torch.tensor([prompt]), max_new_tokens=5, do_sample=True, top_k=0, temperature=T,
                                     pad_token_id=0, eos_token_id=None)
                resp = ids[0, len(prompt):].tolist()
                lp = logprobs_by_hand(model, prompt, resp, T)
            d = torch.tensor([OFFSETS[(k + t) % len(OFFSETS)] for t in range(len(resp))])
            k += len(resp)
            samples.append({"input_ids": prompt, "output_ids": resp, "logprobs": (lp - d).tolist(), "versions": [0] * len(resp),
                            "loss_mask": [1] * len(resp), "reward": 1.0 if i == 0 else 0.0})
            prox.append(lp)
            weights.append(torch.exp(d))
            # GRPO by hand, rewards (1, 0): mean 0.5, population std 0.5.
            advantages.append(torch.full((len(resp),), (0.5 if i == 0 else -0.5) / (0.5 + 1e-6)))
        groups.append({"group_id": f"off{g}", "samples": samples})
    return {"groups": groups, "prox": prox, "weights": weights, "advantages": advantages, "model": model}


class TestDecoupledWiring:
    # Two minibatches: stage_prox_logp runs a forward of its own for pi_prox.
    @pytest.mark.parametrize("trainer", [{"temperature": T, "ppoMinibatches": 2}], indirect=True)
    def test_pi_prox_is_recomputed_by_the_trainers_model_at_the_sampling_temperature(self, trainer, off_policy):
        batch = build_batch(off_policy["groups"], N)
        trainer.stage_prox_logp(batch)
        for row, expected in enumerate(off_policy["prox"]):
            assert torch.allclose(batch.prox_logp[row, :len(expected)], expected, atol=1e-4), row
        assert not torch.allclose(batch.prox_logp * batch.loss_mask, batch.behave_logp, atol=1e-2), "behaviour differs"

    # One minibatch: pi_theta = pi_prox throughout the update (and the trainer may take pi_prox from its forward).
    @pytest.mark.parametrize("trainer", [{"temperature": T, "ppoMinibatches": 1}], indirect=True)
    def test_the_update_weights_each_token_by_pi_prox_over_pi_behave_and_clips_against_pi_prox(self, trainer, off_policy):
        """One minibatch, so pi_theta = pi_prox when the loss is taken: every ratio is 1 (nothing clipped) and
        loss = sum_t w_t * (-A_t) / tokens with w = pi_prox / pi_behave; its gradient sum_t w_t (-A_t) grad log pi / tokens.
        Plain PPO against pi_behave would see ratios e^d, clip the tokens beyond [0.6, 1.4] and weigh none."""
        batch = build_batch(off_policy["groups"], N)
        trainer.stage_prox_logp(batch)
        trainer.stage_advantages(batch)
        for row, expected in enumerate(off_policy["advantages"]):
            assert torch.allclose(batch.advantages[row, :len(expected)], expected, atol=1e-4), row
        w, adv = torch.cat(off_policy["weights"]), torch.cat(off_policy["advantages"])
        tokens = len(w)

        # The gradient the objective asks for, by hand on an unsharded copy of the same initial weights.
        model = off_policy["model"]
        model.zero_grad()
        logp = torch.cat([logprobs_by_hand(model, s["input_ids"], s["output_ids"], T)
                          for g in off_policy["groups"] for s in g["samples"]])
        (torch.sum(w * -adv * logp) / tokens).backward()
        expected_grad = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

        seen: dict[str, torch.Tensor] = {}

        def capture(optimizer, args, kwargs):  # the gradient as the optimizer gets it (after clip_grad_norm_)
            for n, p in trainer.model.named_parameters():
                if p.grad is not None:
                    g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                    seen[n] = g.detach().clone()

        trainer.optimizer.register_step_pre_hook(capture)
        stats = trainer.stage_ppo_update(batch)

        for row, expected in enumerate(off_policy["prox"]):  # pi_prox as the loss used it, whichever forward gave it
            assert torch.allclose(batch.prox_logp[row, :len(expected)], expected, atol=1e-4), row
        assert stats["loss"] == pytest.approx(float(torch.sum(w * -adv)) / tokens, rel=1e-4, abs=1e-6)
        assert stats["behavior_weight_mean"] == pytest.approx(float(w.mean()), rel=1e-4)
        assert stats["ratio_mean"] == pytest.approx(1.0, abs=1e-4) and stats["clip_fraction"] == 0.0
        norm = torch.sqrt(sum(g.pow(2).sum() for g in expected_grad.values()))
        assert stats["grad_norm"] == pytest.approx(float(norm), rel=1e-3)
        assert set(seen) == set(expected_grad)
        got = torch.cat([seen[n].flatten() for n in sorted(seen)])
        want = torch.cat([expected_grad[n].flatten() for n in sorted(seen)])
        cosine = float(torch.nn.functional.cosine_similarity(got, want, dim=0))
        assert cosine > 0.9999, f"the update's gradient points elsewhere than the decoupled objective's (cosine {cosine:.6f})"
