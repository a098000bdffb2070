"""Policy entropy: computed in the PPO update's own forward pass, logged per step.

The reference here is written out by hand: softmax(logits / T) of a separate forward at each response
position, -sum p log p, averaged over the loss tokens.
"""

from __future__ import annotations

import math

import pytest
import torch

from kuberl.runtime.trainer.batch import build_batch, response_logprobs
from tests.unit.test_trainer_compute import groups_from, reference_copy, tiny, trainer  # noqa: F401  (fixtures)

T = 0.7


def reference_entropy(model, prompt, output, temperature) -> list[float]:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([list(prompt) + list(output)])).logits[0].double()
    out = []
    for t in range(len(output)):
        p = torch.softmax(logits[len(prompt) - 1 + t] / temperature, dim=-1).tolist()
        out.append(-sum(x * math.log(x) for x in p if x > 0))
    return out


def test_response_logprobs_gives_the_entropy_of_the_tempered_policy_at_each_output_token(tiny):
    model = reference_copy(tiny)
    prompts, outputs = [[5, 40, 41], [7, 8]], [[12, 13, 14, 15], [20]]
    logp, ent = response_logprobs(model, prompts, outputs, 4, temperature=T, entropy=True)
    assert torch.equal(logp, response_logprobs(model, prompts, outputs, 4, temperature=T))  # the log-probs are unchanged
    for i, (p, o) in enumerate(zip(prompts, outputs)):
        assert ent[i, : len(o)].tolist() == pytest.approx(reference_entropy(model, p, o, T), abs=1e-4)
        assert ent[i, len(o):].abs().sum() == 0


def test_the_update_reports_the_token_mean_entropy_over_loss_tokens(trainer, tiny):
    trainer.spec.algorithm.temperature = T
    groups = groups_from(reference_copy(tiny))
    groups[0]["samples"][1]["loss_mask"][-2:] = [0, 0]  # masked tokens do not count
    batch = build_batch(groups, 2)
    trainer.stage_prox_logp(batch)
    trainer.stage_advantages(batch)
    model = reference_copy(tiny)  # the pre-update weights, which the single minibatch's forward uses
    want, n = 0.0, 0
    for i in range(batch.num_samples):
        ent = reference_entropy(model, batch.prompts[i], batch.outputs[i], T)
        for t, m in enumerate(batch.loss_mask[i, : len(batch.outputs[i])].tolist()):
            want += ent[t] * m
            n += int(m)
    stats = trainer.stage_ppo_update(batch)
    assert stats["entropy"] == pytest.approx(want / n, rel=1e-4)
    assert 0 < stats["entropy"] < math.log(trainer.model.config.vocab_size)
