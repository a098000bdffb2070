"""Groups of varying size (workflow.exportStyle individual: one sample per agent call): advantages checked against
a hand computation, batches and minibatches that keep whole groups, and one trainer step on such a batch."""

from __future__ import annotations

import math

import pytest
import torch

from kuberl.api import RLExperiment
from kuberl.runtime.algorithms.advantages import ADV_EPS, compute_advantages, compute_token_advantages
from kuberl.runtime.trainer import dist as D
from kuberl.runtime.trainer.batch import BatchError, build_batch, group_size_error, minibatch_rows
from tests.unit.test_advantages import cfg_for
from tests.unit.test_trainer_batch import group, sample

SIZES = [3, 2, 4]
FLAT = [1.0, 0.0, 0.5, 2.0, 2.0, 0.0, 1.0, 1.0, 0.0]
S6 = math.sqrt(1 / 6)  # population std of (1, 0, 0.5)


class TestRaggedAdvantages:
    """By hand: group 0 = (1, 0, 0.5), mean 0.5, std sqrt(1/6); group 1 = (2, 2), constant; group 2 = (0, 1, 1, 0), mean 0.5, std 0.5."""

    def adv(self, name):
        return compute_advantages(torch.tensor(FLAT), cfg_for(name), SIZES).tolist()

    def test_grpo_subtracts_each_groups_own_mean_and_divides_by_its_own_std(self):
        want = [0.5 / (S6 + ADV_EPS), -0.5 / (S6 + ADV_EPS), 0.0, 0.0, 0.0, -0.5 / (0.5 + ADV_EPS), 0.5 / (0.5 + ADV_EPS),
                0.5 / (0.5 + ADV_EPS), -0.5 / (0.5 + ADV_EPS)]
        assert self.adv("grpo") == pytest.approx(want, abs=1e-6)

    def test_drgrpo_subtracts_the_group_mean_only(self):
        assert self.adv("drgrpo") == pytest.approx([0.5, -0.5, 0.0, 0.0, 0.0, -0.5, 0.5, 0.5, -0.5], abs=1e-7)

    def test_rloo_leaves_each_sample_out_of_its_own_groups_mean(self):
        # group 0: 1 - (0 + 0.5) / 2, 0 - (1 + 0.5) / 2, 0.5 - (1 + 0) / 2; group 2: 0 - 2/3, 1 - 1/3, ...
        want = [0.75, -0.75, 0.0, 0.0, 0.0, -2 / 3, 2 / 3, 2 / 3, -2 / 3]
        assert self.adv("rloo") == pytest.approx(want, abs=1e-6)

    def test_reinforce_pp_uses_the_whole_batch(self):
        mean = sum(FLAT) / len(FLAT)
        std = math.sqrt(sum((x - mean) ** 2 for x in FLAT) / len(FLAT))
        assert self.adv("reinforce++") == pytest.approx([(x - mean) / (std + ADV_EPS) for x in FLAT], abs=1e-6)

    @pytest.mark.parametrize("name", ["grpo", "drgrpo", "rloo", "reinforce++", "liteppo", "dapo"])
    def test_equal_sized_groups_give_what_the_fixed_size_path_gives(self, name):
        r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 0.0, 1.0], [0.3, 0.3, 0.3, 0.3]])
        fixed = compute_advantages(r, cfg_for(name)).flatten()
        ragged = compute_advantages(r.flatten(), cfg_for(name), [4, 4, 4])
        assert torch.allclose(fixed, ragged, atol=1e-6)

    def test_token_advantages_broadcast_each_samples_value(self):
        mask = torch.ones(len(FLAT), 2)
        tok = compute_token_advantages(torch.tensor(FLAT), mask, cfg_for("drgrpo"), group_sizes=SIZES)
        assert tok[:, 0].tolist() == pytest.approx([0.5, -0.5, 0.0, 0.0, 0.0, -0.5, 0.5, 0.5, -0.5], abs=1e-7)
        assert torch.equal(tok[:, 0], tok[:, 1])

    @pytest.mark.parametrize("sizes, message", [(None, "flat rewards need group_sizes"), ([3, 2, 3], "must be >= 1 each and sum to the 9"),
                                                ([9, 0], "must be >= 1 each"), ([4, 1, 4], "grpo needs >= 2 samples per group")])
    def test_bad_group_sizes_are_refused(self, sizes, message):
        with pytest.raises(ValueError, match=message):
            compute_advantages(torch.tensor(FLAT), cfg_for("grpo"), sizes)

    def test_fixed_size_rewards_with_sizes_that_disagree_are_refused(self):
        with pytest.raises(ValueError, match="do not match rewards of shape"):
            compute_advantages(torch.ones(2, 3), cfg_for("grpo"), [3, 2])


class TestRaggedBatches:
    def groups(self):
        return [group("a", sample(2, 1.0), sample(3, 0.0), sample(1, 0.5)), group("b", sample(2, 2.0), sample(2, 2.0)),
                group("c", sample(1, 0.0), sample(4, 1.0), sample(2, 1.0), sample(1, 0.0))]

    def test_rows_stay_group_major_with_flat_rewards_and_each_groups_size(self):
        b = build_batch(self.groups(), 2, ragged=True)
        assert b.num_groups == 3 and b.num_samples == 9 and b.group_sizes == SIZES
        assert b.rewards.tolist() == FLAT and b.response_lengths().tolist() == [2, 3, 1, 2, 2, 1, 4, 2, 1]

    def test_without_ragged_a_group_of_another_size_is_refused(self):
        with pytest.raises(BatchError, match="group a: has 3 samples, algorithm.samplesPerPrompt is 2"):
            build_batch(self.groups(), 2)

    def test_a_ragged_group_smaller_than_its_episode_count_is_refused(self):
        with pytest.raises(BatchError, match="group b: has 2 samples, fewer than its algorithm.samplesPerPrompt=3 episodes"):
            build_batch(self.groups(), 3, ragged=True)
        assert group_size_error(5, 3, True) is None and group_size_error(3, 3, False) is None

    def test_equal_groups_keep_the_fixed_size_layout(self):
        b = build_batch([group("a", sample(2), sample(1)), group("b", sample(1), sample(1))], 2, ragged=True)
        assert b.rewards.shape == (2, 2) and b.group_sizes == [2, 2]

    def test_minibatches_hold_whole_ragged_groups(self):
        assert minibatch_rows(3, SIZES, 2) in ([[0, 1, 2], [3, 4, 5, 6, 7, 8]], [[0, 1, 2, 3, 4], [5, 6, 7, 8]])
        assert minibatch_rows(3, SIZES, 3) == [[0, 1, 2], [3, 4], [5, 6, 7, 8]]
        assert minibatch_rows(2, [2, 2], 2) == minibatch_rows(2, 2, 2)  # the same rows as the fixed-size form
        with pytest.raises(BatchError, match="2 group sizes for 3 groups"):
            minibatch_rows(3, [2, 2], 1)


@pytest.fixture
def cleanup():
    yield
    D.shutdown()


def test_the_trainer_trains_one_step_on_ragged_groups(tmp_path, cleanup):
    from kuberl.runtime.models import build_tiny_model
    from kuberl.runtime.trainer.trainer import Trainer

    exp = RLExperiment.model_validate({
        "apiVersion": "kuberl.io/v1alpha1", "kind": "RLExperiment", "metadata": {"name": "ragged"},
        "spec": {"model": {"path": str(build_tiny_model(tmp_path / "m", seed=0)), "dtype": "float32"},
                 "dataset": {"builtin": "repeat-digit", "size": 8},
                 "workflow": {"type": "agent", "agent": "kuberl.runtime.agents.repeat_tools:tool_agent", "exportStyle": "individual"},
                 "algorithm": {"name": "grpo", "samplesPerPrompt": 2, "batchSize": 3, "learningRate": 3e-3, "ppoMinibatches": 2},
                 "trainer": {"microBatchTokens": 64}, "training": {"totalSteps": 10}},
    })
    t = Trainer(exp, bus_url="nats://unused:4222", workdir=tmp_path / "w", handle_sigterm=False)
    t.setup()
    assert t.ragged
    batch = build_batch(TestRaggedBatches().groups(), t.n, ragged=t.ragged)
    before = [p.detach().clone() for p in t.model.parameters()]
    t.stage_prox_logp(batch)
    t.stage_advantages(batch)
    want = compute_advantages(torch.tensor(FLAT), t.cfg, SIZES)
    assert torch.allclose(batch.advantages[:, 0], want, atol=1e-6)  # every sample's first token carries its own advantage
    stats = t.stage_ppo_update(batch)
    assert stats["tokens"] == float(sum([2, 3, 1, 2, 2, 1, 4, 2, 1]))
    assert any(not torch.equal(a, p) for a, p in zip(before, t.model.parameters()))
