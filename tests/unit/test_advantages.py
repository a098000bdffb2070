"""Advantage estimators and reward shaping, each checked against a reference written here with plain Python
or numpy (never by calling the module's own helpers), grouped by algorithm."""

import math

import numpy as np
import pytest
import torch

from kuberl.api.v1alpha1 import AlgorithmSpec, OverlongPenaltySpec
from kuberl.runtime.algorithms import resolve_algorithm
from kuberl.runtime.algorithms.advantages import (
    ADV_EPS,
    broadcast_to_tokens,
    compute_advantages,
    compute_token_advantages,
    dynamic_sampling_keep,
    gae,
    group_rewards,
    overlong_penalty,
    shape_rewards,
)

REWARDS = [[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 0.0, 1.0], [0.3, 0.3, 0.3, 0.3]]


def cfg_for(name="grpo", **kw):
    return resolve_algorithm(AlgorithmSpec(name=name, **kw))


def ref_std(xs):
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs))


class TestGRPO:
    def test_advantage_is_reward_minus_group_mean_over_group_std(self):
        adv = compute_advantages(torch.tensor(REWARDS), cfg_for("grpo"))
        for g, row in enumerate(REWARDS[:2]):
            mean, std = sum(row) / len(row), ref_std(row)
            for i, r in enumerate(row):
                assert adv[g, i].item() == pytest.approx((r - mean) / (std + ADV_EPS), rel=1e-5)

    def test_group_with_all_equal_rewards_gets_exactly_zero_advantages(self):
        adv = compute_advantages(torch.tensor(REWARDS), cfg_for("grpo"))
        assert adv[2].tolist() == [0.0, 0.0, 0.0, 0.0]

    def test_normalize_advantages_false_only_centres(self):
        adv = compute_advantages(torch.tensor(REWARDS), cfg_for("grpo", normalize_advantages=False))
        np.testing.assert_allclose(adv.numpy(), np.array(REWARDS) - np.array(REWARDS).mean(axis=1, keepdims=True), atol=1e-6)

    def test_advantages_of_each_group_sum_to_zero(self):
        adv = compute_advantages(torch.randn(5, 8), cfg_for("grpo"))
        assert torch.allclose(adv.sum(dim=1), torch.zeros(5), atol=1e-5)

    def test_dapo_and_gspo_use_grpo_advantages(self):
        r = torch.tensor(REWARDS)
        base = compute_advantages(r, cfg_for("grpo"))
        assert torch.equal(compute_advantages(r, cfg_for("dapo")), base)
        assert torch.equal(compute_advantages(r, cfg_for("gspo")), base)


class TestDrGRPO:
    def test_advantage_is_reward_minus_group_mean_without_std_division(self):
        rewards = [[2.0, 0.0, 0.0, 0.0], [5.0, 1.0, 3.0, 3.0]]
        adv = compute_advantages(torch.tensor(rewards), cfg_for("drgrpo"))
        expected = [[1.5, -0.5, -0.5, -0.5], [2.0, -2.0, 0.0, 0.0]]
        assert adv.tolist() == expected

    def test_scaling_rewards_scales_advantages_because_nothing_divides(self):
        r = torch.tensor(REWARDS)
        assert torch.allclose(compute_advantages(3 * r, cfg_for("drgrpo")), 3 * compute_advantages(r, cfg_for("drgrpo")))


class TestRLOO:
    def test_leave_one_out_exact_values(self):
        adv = compute_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0], [3.0, 0.0, 0.0, 0.0]]), cfg_for("rloo"))
        # 1 - (0+0+1)/3 = 2/3 ; 0 - (1+0+1)/3 = -2/3 ; 3 - 0 = 3 ; 0 - 3/3 = -1
        expected = [[2 / 3, -2 / 3, -2 / 3, 2 / 3], [3.0, -1.0, -1.0, -1.0]]
        np.testing.assert_allclose(adv.numpy(), expected, rtol=1e-6)

    def test_matches_a_loop_over_the_others(self):
        rng = np.random.default_rng(0)
        r = rng.normal(size=(4, 6))
        adv = compute_advantages(torch.tensor(r, dtype=torch.float32), cfg_for("rloo"))
        for g in range(4):
            for i in range(6):
                others = [r[g, j] for j in range(6) if j != i]
                assert adv[g, i].item() == pytest.approx(r[g, i] - sum(others) / len(others), abs=1e-5)

    def test_all_equal_group_is_zero(self):
        assert compute_advantages(torch.full((1, 4), 7.0), cfg_for("rloo")).tolist() == [[0.0] * 4]


class TestReinforcePlusPlus:
    def test_advantage_is_reward_minus_batch_mean_over_batch_std(self):
        adv = compute_advantages(torch.tensor(REWARDS), cfg_for("reinforce++"))
        flat = [x for row in REWARDS for x in row]
        mean, std = sum(flat) / len(flat), ref_std(flat)
        for g, row in enumerate(REWARDS):
            for i, r in enumerate(row):
                assert adv[g, i].item() == pytest.approx((r - mean) / (std + ADV_EPS), rel=1e-5)

    def test_an_all_equal_group_keeps_a_nonzero_advantage_against_the_batch(self):
        adv = compute_advantages(torch.tensor(REWARDS), cfg_for("reinforce++"))
        assert (adv[2] != 0).all()

    def test_works_with_one_sample_per_prompt(self):
        adv = compute_advantages(torch.tensor([[1.0], [0.0], [0.0], [1.0]]), cfg_for("reinforce++", samples_per_prompt=1))
        assert adv.flatten().tolist() == pytest.approx([1.0, -1.0, -1.0, 1.0], rel=1e-5)

    def test_kl_in_the_reward_gives_token_level_discounted_returns_whitened_over_tokens(self):
        cfg = cfg_for("reinforce++", samples_per_prompt=1, kl_coef=0.5, gamma=0.9, reward_bias=0.0, reward_scaling=1.0)
        rewards = [[1.0], [0.0]]
        mask = [[1, 1, 1, 0], [1, 0, 1, 1]]  # row 1: a tool token at t=1
        kl = [[0.2, -0.1, 0.4, 9.9], [0.1, 9.9, 0.3, 0.2]]
        # reference: per-token reward -beta*kl, sequence reward on the last loss token, discounted return
        returns = [[0.0] * 4 for _ in range(2)]
        for row in range(2):
            toks = [t for t in range(4) if mask[row][t]]
            running = 0.0
            for k, t in enumerate(reversed(toks)):
                rt = -0.5 * kl[row][t] + (rewards[row][0] if k == 0 else 0.0)
                running = rt + 0.9 * running
                returns[row][t] = running
        valid = [returns[r][t] for r in range(2) for t in range(4) if mask[r][t]]
        mean, std = sum(valid) / len(valid), ref_std(valid)
        adv = compute_token_advantages(torch.tensor(rewards), torch.tensor(mask), cfg, kl=torch.tensor(kl))
        for r in range(2):
            for t in range(4):
                want = (returns[r][t] - mean) / (std + ADV_EPS) if mask[r][t] else 0.0
                assert adv[r, t].item() == pytest.approx(want, abs=1e-5)

    def test_kl_in_the_reward_without_kl_values_is_an_error(self):
        cfg = cfg_for("reinforce++", kl_coef=0.1)
        with pytest.raises(ValueError, match="kl"):
            compute_token_advantages(torch.ones(2, 4), torch.ones(8, 3), cfg)


class TestLitePPO:
    def test_advantage_is_reward_minus_group_mean_over_batch_std(self):
        adv = compute_advantages(torch.tensor(REWARDS), cfg_for("liteppo"))
        flat = [x for row in REWARDS for x in row]
        std = ref_std(flat)
        for g, row in enumerate(REWARDS):
            mean = sum(row) / len(row)
            for i, r in enumerate(row):
                assert adv[g, i].item() == pytest.approx((r - mean) / (std + ADV_EPS), abs=1e-6)


class TestRewardShaping:
    def test_bias_then_scaling(self):
        cfg = cfg_for("grpo", reward_bias=-0.5, reward_scaling=10.0)
        assert shape_rewards(torch.tensor([[1.0, 0.0]]), None, cfg).tolist() == [[5.0, -5.0]]

    def test_overlong_penalty_ramp_values(self):
        cfg = cfg_for("grpo", max_new_tokens=10, overlong_penalty=OverlongPenaltySpec(enabled=True, buffer_tokens=4, penalty=2.0))
        lengths = list(range(13))
        got = overlong_penalty(torch.tensor(lengths), cfg).tolist()
        # DAPO: 0 up to L_max - L_cache = 6, then ((6 - len) / 4) * p, and -p from L_max = 10 on
        expected = [0.0] * 7 + [-0.5, -1.0, -1.5, -2.0, -2.0, -2.0]
        assert got == pytest.approx(expected)

    def test_overlong_penalty_is_added_before_bias_and_scaling(self):
        cfg = cfg_for("grpo", max_new_tokens=10, reward_bias=-0.5, reward_scaling=10.0,
                      overlong_penalty=OverlongPenaltySpec(enabled=True, buffer_tokens=4, penalty=1.0))
        got = shape_rewards(torch.tensor([1.0, 1.0, 1.0]), torch.tensor([3, 8, 10]), cfg).tolist()
        assert got == pytest.approx([(1.0 + 0 - 0.5) * 10, (1.0 - 0.5 - 0.5) * 10, (1.0 - 1.0 - 0.5) * 10])

    def test_dapo_turns_the_overlong_penalty_on(self):
        cfg = cfg_for("dapo", max_new_tokens=100)
        assert cfg.overlong_penalty
        with pytest.raises(ValueError, match="lengths"):
            shape_rewards(torch.ones(2, 2), None, cfg)

    def test_overlong_penalty_off_ignores_lengths(self):
        cfg = cfg_for("grpo", reward_bias=0.0, reward_scaling=1.0)
        assert shape_rewards(torch.ones(2), torch.tensor([10_000, 10_000]), cfg).tolist() == [1.0, 1.0]

    def test_non_finite_rewards_are_rejected_by_name(self):
        with pytest.raises(ValueError, match="rewards: holds non-finite"):
            shape_rewards(torch.tensor([1.0, float("nan")]), None, cfg_for())

    def test_length_shape_mismatch_is_rejected(self):
        cfg = cfg_for("dapo")
        with pytest.raises(ValueError, match="lengths: shape"):
            shape_rewards(torch.ones(2, 2), torch.ones(4), cfg)


class TestDynamicSampling:
    @pytest.mark.parametrize("rewards,keep", [([1, 1, 1, 1], False), ([0, 0, 0], False), ([0, 1, 0, 0], True), ([0.5, 0.5000001], True)])
    def test_groups_with_all_equal_rewards_are_rejected(self, rewards, keep):
        assert dynamic_sampling_keep(rewards) is keep

    def test_accepts_tensors(self):
        assert dynamic_sampling_keep(torch.tensor([1.0, 0.0])) is True

    def test_empty_group_is_an_error(self):
        with pytest.raises(ValueError, match="empty group"):
            dynamic_sampling_keep([])


class TestTokenBroadcast:
    def test_padded_rows_get_their_sequence_value_on_loss_tokens_only(self):
        mask = torch.tensor([[1, 1, 0], [0, 1, 1]])
        assert broadcast_to_tokens(torch.tensor([2.0, -1.0]), mask).tolist() == [[2.0, 2.0, 0.0], [0.0, -1.0, -1.0]]

    def test_packed_tokens_use_seq_ids(self):
        mask = torch.tensor([1, 1, 0, 1, 1])
        ids = torch.tensor([0, 0, 1, 1, 2])
        assert broadcast_to_tokens(torch.tensor([2.0, -1.0, 4.0]), mask, ids).tolist() == [2.0, 2.0, 0.0, -1.0, 4.0]

    def test_row_count_mismatch_is_an_error(self):
        with pytest.raises(ValueError, match="loss_mask"):
            broadcast_to_tokens(torch.tensor([1.0, 2.0, 3.0]), torch.ones(2, 4))

    def test_seq_id_out_of_range_is_an_error(self):
        with pytest.raises(ValueError, match="seq_ids"):
            broadcast_to_tokens(torch.tensor([1.0]), torch.ones(2), torch.tensor([0, 1]))

    def test_compute_token_advantages_is_the_broadcast_of_sequence_advantages_for_grpo(self):
        cfg = cfg_for("grpo")
        r = torch.tensor(REWARDS)
        mask = torch.ones(12, 5)
        mask[::2, 3:] = 0
        # GRPO by hand (never the module's compute_advantages): the constant third group gets 0.
        seq = [(x - sum(row) / len(row)) / (ref_std(row) + ADV_EPS) if ref_std(row) > 0 else 0.0 for row in REWARDS for x in row]
        tok = compute_token_advantages(r, mask, cfg)
        for row in range(12):
            for t in range(5):
                assert tok[row, t].item() == (pytest.approx(seq[row], rel=1e-5) if mask[row, t] else 0.0)


class TestGAE:
    def test_matches_a_reference_recursion(self):
        rewards = [[0.0, 0.0, 1.0, 0.0], [0.5, -0.2, 0.0, 0.3]]
        values = [[0.1, 0.2, 0.3, 9.0], [0.0, 0.4, 0.1, -0.1]]
        mask = [[1, 1, 1, 0], [1, 1, 1, 1]]
        gamma, lam = 0.9, 0.8
        adv, ret = gae(torch.tensor(rewards), torch.tensor(values), torch.tensor(mask), gamma, lam)
        for row in range(2):
            n = sum(mask[row])
            expected = [0.0] * n
            for t in range(n):
                total = 0.0
                for k in range(t, n):
                    v_next = values[row][k + 1] if k + 1 < n else 0.0
                    delta = rewards[row][k] + gamma * v_next - values[row][k]
                    total += (gamma * lam) ** (k - t) * delta
                expected[t] = total
            for t in range(4):
                want = expected[t] if t < n else 0.0
                assert adv[row, t].item() == pytest.approx(want, abs=1e-6)
                assert ret[row, t].item() == pytest.approx(want + values[row][t] if t < n else 0.0, abs=1e-6)


class TestInputErrors:
    def test_one_dimensional_rewards_are_rejected_with_the_expected_shape(self):
        with pytest.raises(ValueError, match=r"\[groups, samples_per_prompt\]"):
            compute_advantages(torch.ones(4), cfg_for())

    def test_group_relative_estimator_rejects_groups_of_one(self):
        with pytest.raises(ValueError, match=">= 2 responses"):
            compute_advantages(torch.ones(4, 1), cfg_for())

    def test_unequal_groups_are_rejected(self):
        with pytest.raises(ValueError, match="different sizes"):
            group_rewards([[1, 0], [1, 0, 1]])
