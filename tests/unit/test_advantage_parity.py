"""AReaL parity of the advantage pipeline, each checked against a reference written out here in plain Python.

- algorithm.batchAdvantageNorm: group-normalised rewards, then advantages whitened over every loss token
  of the batch (AReaL's gsm8k_grpo.yaml: reward_norm group/group, adv_norm batch/batch).
- REINFORCE++'s KL-in-reward trades KL against the raw reward whatever rewardScaling is.
- Dr.GRPO and RLOO advantages are in shaped-reward units, as documented: rewardScaling * (r - baseline).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import yaml

from kuberl.api.v1alpha1 import AlgorithmSpec, RLExperiment
from kuberl.runtime.algorithms import compute_token_advantages, resolve_algorithm, shape_rewards

EPS = 1e-6
RAW = [[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]]  # 3 groups of 4
LENGTHS = [[3, 5, 2, 4], [1, 6, 3, 2], [4, 4, 1, 5]]  # loss tokens per response


def mask_of(lengths) -> torch.Tensor:
    flat = [n for row in lengths for n in row]
    m = torch.zeros(len(flat), max(flat))
    for i, n in enumerate(flat):
        m[i, :n] = 1
    return m


def cfg(**spec):
    return resolve_algorithm(AlgorithmSpec(**{"samplesPerPrompt": 4, "batchSize": 3, **spec}))


def mean(xs):
    return sum(xs) / len(xs)


def pstd(xs):
    m = mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs))


class TestBatchAdvantageNormalisation:
    def reference(self, raw, lengths, scaling=10.0, bias=-0.5):
        # 1. group-level reward normalisation (GRPO), per response
        seq = []
        for row in raw:
            shaped = [(r + bias) * scaling for r in row]
            m, s = mean(shaped), pstd(shaped)
            seq.append([0.0 if max(shaped) == min(shaped) else (x - m) / (s + EPS) for x in shaped])
        # 2. every loss token carries its response's advantage; whiten over all tokens of the batch
        tokens = [a for row, lens in zip(seq, lengths) for a, n in zip(row, lens) for _ in range(n)]
        m, s = mean(tokens), pstd(tokens)
        return [[(a - m) / (s + EPS)] * n for row, lens in zip(seq, lengths) for a, n in zip(row, lens)]

    def test_advantages_are_whitened_over_every_loss_token_of_the_batch(self):
        c = cfg(batchAdvantageNorm=True)
        adv = compute_token_advantages(shape_rewards(torch.tensor(RAW), None, c), mask_of(LENGTHS), c)
        want = self.reference(RAW, LENGTHS)
        for i, row in enumerate(want):
            assert adv[i, : len(row)].tolist() == pytest.approx(row, abs=1e-5)
            assert adv[i, len(row):].abs().sum() == 0
        valid = adv[mask_of(LENGTHS).bool()]
        assert float(valid.mean()) == pytest.approx(0.0, abs=1e-5) and float(valid.std(unbiased=False)) == pytest.approx(1.0, abs=1e-4)

    def test_off_by_default_the_group_normalised_advantages_are_left_as_they_are(self):
        c = cfg()
        assert c.batch_adv_norm is False
        adv = compute_token_advantages(shape_rewards(torch.tensor(RAW), None, c), mask_of(LENGTHS), c)
        first = [(r - 0.5) * 10 for r in RAW[0]]
        assert adv[0, 0].item() == pytest.approx((first[0] - mean(first)) / (pstd(first) + EPS), abs=1e-5)

    def test_the_gsm8k_example_that_claims_areal_parity_turns_it_on(self):
        doc = yaml.safe_load((Path(__file__).parents[2] / "examples" / "gsm8k-grpo.yaml").read_text())
        exp = RLExperiment.model_validate(doc)
        assert resolve_algorithm(exp.spec.algorithm).batch_adv_norm is True


class TestReinforcePlusPlusKL:
    KL = [[0.3, -0.1, 0.2], [0.0, 0.5, 0.1]]

    def reference(self, raw, kl, lengths, beta, scaling, bias, gamma=1.0):
        returns = []
        for r, k, n in zip(raw, kl, lengths):
            tok = [-scaling * beta * k[t] for t in range(n)]  # the KL in raw-reward units, scaled like the reward
            tok[n - 1] += (r + bias) * scaling
            g, out = 0.0, [0.0] * n
            for t in range(n - 1, -1, -1):
                g = tok[t] + gamma * g
                out[t] = g
            returns.append(out)
        flat = [x for row in returns for x in row]
        m, s = mean(flat), pstd(flat)
        return [[(x - m) / (s + EPS) for x in row] for row in returns]

    def advantages(self, scaling, beta=0.2):
        c = cfg(name="reinforce++", samplesPerPrompt=2, batchSize=1, klCoef=beta, rewardScaling=scaling)
        assert c.kl_in_reward
        lengths = [[3, 2]]
        mask = mask_of(lengths)
        kl = torch.tensor(self.KL) * mask
        return compute_token_advantages(shape_rewards(torch.tensor([[1.0, 0.0]]), None, c), mask, c, kl=kl), lengths

    def test_matches_the_reference_with_the_kl_in_raw_reward_units(self):
        adv, lengths = self.advantages(scaling=10.0)
        want = self.reference([1.0, 0.0], self.KL, [3, 2], beta=0.2, scaling=10.0, bias=-0.5)
        assert adv[0, :3].tolist() == pytest.approx(want[0], abs=1e-5)
        assert adv[1, :2].tolist() == pytest.approx(want[1], abs=1e-5)

    def test_reward_scaling_does_not_change_the_kl_trade_off(self):
        one, _ = self.advantages(scaling=1.0)
        ten, _ = self.advantages(scaling=10.0)
        assert torch.allclose(one, ten, atol=1e-5), "rewardScaling rescaled the effective KL coefficient"


class TestDrGRPOAndRLOOScale:
    """Neither divides by a std, so rewardScaling scales their advantages (and the step): documented, checked."""

    def test_drgrpo_is_scaling_times_reward_minus_group_mean(self):
        c = cfg(name="drgrpo", rewardScaling=10.0, rewardBias=-0.5)
        adv = compute_token_advantages(shape_rewards(torch.tensor(RAW), None, c), mask_of(LENGTHS), c)
        for g, row in enumerate(RAW):
            for i, r in enumerate(row):
                assert adv[g * 4 + i, 0].item() == pytest.approx(10.0 * (r - mean(row)), abs=1e-5)

    def test_rloo_is_scaling_times_reward_minus_the_mean_of_the_others(self):
        c = cfg(name="rloo", rewardScaling=10.0, rewardBias=-0.5)
        adv = compute_token_advantages(shape_rewards(torch.tensor(RAW), None, c), mask_of(LENGTHS), c)
        for g, row in enumerate(RAW):
            for i, r in enumerate(row):
                others = row[:i] + row[i + 1:]
                assert adv[g * 4 + i, 0].item() == pytest.approx(10.0 * (r - mean(others)), abs=1e-5)

    def test_the_algorithm_table_says_so(self):
        import kuberl.runtime.algorithms as algorithms

        assert "rewardScaling scales drgrpo and rloo advantages" in algorithms.__doc__
