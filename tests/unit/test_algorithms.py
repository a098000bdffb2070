"""resolve_algorithm's presets and errors, and one small "it learns" test: a toy categorical policy trained with
the real advantage and loss functions on a bandit improves its expected reward (seconds, CPU)."""

import dataclasses
import math
import subprocess
import sys

import pytest
import torch

from kuberl.api.v1alpha1 import AlgorithmSpec, OverlongPenaltySpec, RLExperimentSpec
from kuberl.runtime.algorithms import (
    AlgorithmConfig,
    compute_advantages,
    compute_token_advantages,
    dynamic_sampling_keep,
    kl_penalty,
    loss_denominator,
    ppo_actor_loss,
    resolve_algorithm,
    shape_rewards,
)

NAMES = ["grpo", "drgrpo", "dapo", "gspo", "rloo", "reinforce++", "liteppo"]


def resolve(name="grpo", **kw):
    return resolve_algorithm(AlgorithmSpec(name=name, **kw))


class TestPresets:
    @pytest.mark.parametrize(
        "name,baseline,std,aggregation,ratio",
        [
            ("grpo", "group", "group", "token-mean", "token"),
            ("drgrpo", "group", "none", "seq-mean-token-sum-norm", "token"),
            ("dapo", "group", "group", "token-mean", "token"),
            ("gspo", "group", "group", "seq-mean-token-mean", "sequence"),
            ("rloo", "loo", "none", "token-mean", "token"),
            ("reinforce++", "batch", "batch", "token-mean", "token"),
            ("liteppo", "group", "batch", "token-mean", "token"),
        ],
    )
    def test_each_algorithm_is_a_setting_of_one_pipeline(self, name, baseline, std, aggregation, ratio):
        cfg = resolve(name)
        assert (cfg.baseline, cfg.std_norm, cfg.aggregation, cfg.ratio_level) == (baseline, std, aggregation, ratio)
        assert cfg.name == name

    def test_an_explicit_setting_wins_over_the_dapo_preset(self):
        spec = AlgorithmSpec(name="dapo", epsClip=0.4, dynamicSampling=False, overlongPenalty={"enabled": False}, maxNewTokens=64)
        cfg = resolve_algorithm(spec)
        assert (cfg.eps_low, cfg.eps_high) == (0.4, pytest.approx(0.56))  # clip-higher keeps DAPO's 1.4 ratio
        assert cfg.dynamic_sampling is False and cfg.overlong_penalty is False

    def test_the_dapo_preset_fills_only_what_the_manifest_leaves_unset(self):
        cfg = resolve_algorithm(AlgorithmSpec(name="dapo", maxNewTokens=64))
        assert (cfg.eps_low, cfg.eps_high, cfg.dynamic_sampling, cfg.overlong_penalty) == (0.2, 0.28, True, True)
        assert resolve_algorithm(AlgorithmSpec(name="grpo")).dynamic_sampling is False

    def test_a_clip_high_below_the_presets_clip_low_is_refused(self):
        with pytest.raises(ValueError, match="epsClipHigh 0.1 must be >= algorithm.epsClip 0.2"):
            resolve_algorithm(AlgorithmSpec(name="dapo", epsClipHigh=0.1))

    def test_grpo_defaults_are_areal_gsm8k(self):
        cfg = resolve("grpo")
        assert (cfg.eps_low, cfg.eps_high, cfg.reward_bias, cfg.reward_scaling) == (0.4, 0.4, -0.5, 10.0)
        assert cfg.decoupled and cfg.behavior_weight_cap == 5.0 and cfg.behavior_weight_mode == "mask"
        assert not cfg.dynamic_sampling and not cfg.overlong_penalty and cfg.notes == ()

    def test_dapo_turns_on_clip_higher_dynamic_sampling_and_overlong_penalty(self):
        cfg = resolve("dapo")
        assert (cfg.eps_low, cfg.eps_high) == (0.2, 0.28)
        assert cfg.dynamic_sampling and cfg.overlong_penalty
        assert len(cfg.notes) == 3

    def test_dapo_keeps_clip_values_the_user_set(self):
        assert (resolve("dapo", eps_clip=0.1, eps_clip_high=0.3).eps_low, resolve("dapo", eps_clip=0.1, eps_clip_high=0.3).eps_high) == (0.1, 0.3)
        cfg = resolve("dapo", eps_clip=0.1)
        assert cfg.eps_low == 0.1 and cfg.eps_high == pytest.approx(0.14)

    def test_dapo_keeps_the_users_overlong_buffer(self):
        cfg = resolve("dapo", overlong_penalty=OverlongPenaltySpec(buffer_tokens=16, penalty=0.5))
        assert (cfg.overlong_penalty, cfg.overlong_buffer, cfg.overlong_penalty_factor) == (True, 16, 0.5)

    def test_gspo_uses_tiny_sequence_level_clip_unless_set(self):
        assert (resolve("gspo").eps_low, resolve("gspo").eps_high) == (3e-4, 4e-4)
        assert resolve("gspo", eps_clip=0.01).eps_low == 0.01

    def test_presets_survive_a_round_trip_through_the_manifest(self):
        # The operator writes every field into the ConfigMap; the preset must still apply.
        spec = RLExperimentSpec.model_validate(
            {"model": {"builtin": "tiny-qwen2"}, "dataset": {"builtin": "add-small"}, "algorithm": {"name": "dapo"}}
        )
        again = RLExperimentSpec.model_validate(spec.to_manifest())
        assert resolve_algorithm(again.algorithm) == resolve_algorithm(spec.algorithm)

    def test_reinforce_pp_puts_the_kl_in_the_reward_with_k1(self):
        cfg = resolve("reinforce++", kl_coef=0.05)
        assert cfg.kl_in_reward and not cfg.kl_in_loss and cfg.kl_kind == "k1"
        assert resolve("grpo", kl_coef=0.05).kl_in_loss

    def test_normalize_advantages_false_turns_std_off_where_the_algorithm_has_one(self):
        assert resolve("grpo", normalize_advantages=False).std_norm == "none"
        assert resolve("liteppo", normalize_advantages=False).std_norm == "none"
        assert resolve("reinforce++", normalize_advantages=False).std_norm == "none"

    def test_config_is_frozen(self):
        with pytest.raises(dataclasses.FrozenInstanceError):
            resolve().eps_low = 0.1

    def test_every_exported_name_resolves(self):
        import kuberl.runtime.algorithms as package

        for name in package.__all__:
            assert callable(getattr(package, name)), name
        with pytest.raises(AttributeError, match="no attribute 'nope'"):
            package.nope  # noqa: B018

    def test_loading_the_config_does_not_import_torch(self):
        code = (
            "import sys; from kuberl.api.v1alpha1 import AlgorithmSpec; "
            "from kuberl.runtime.algorithms import resolve_algorithm; resolve_algorithm(AlgorithmSpec(name='dapo')); "
            "sys.exit('torch' in sys.modules)"
        )
        assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


class TestErrors:
    def test_ppo_with_a_critic_is_refused_by_the_spec_with_a_fix(self):
        # The API model refuses it (so `kuberl validate`, `kubectl apply` via CEL, the operator and the
        # trainer all agree); no AlgorithmSpec named ppo reaches resolve_algorithm.
        with pytest.raises(ValueError, match=r"algorithm.name ppo \(PPO with a value critic\) is not supported yet.*liteppo"):
            resolve("ppo")

    def test_buffer_longer_than_max_new_tokens_names_both_fields(self):
        with pytest.raises(ValueError, match="bufferTokens 40 exceeds algorithm.maxNewTokens 32"):
            resolve("dapo", max_new_tokens=32, overlong_penalty=OverlongPenaltySpec(buffer_tokens=40))

    def test_the_default_buffer_shrinks_to_a_fifth_of_short_generations(self):
        cfg = resolve("dapo", max_new_tokens=8)
        assert cfg.overlong_buffer == 1 and any("bufferTokens 1" in n for n in cfg.notes)
        assert resolve("dapo", max_new_tokens=100).overlong_buffer == 64

    def test_liteppo_with_one_sample_per_prompt_is_refused(self):
        with pytest.raises(ValueError, match="algorithm.samplesPerPrompt 1"):
            resolve("liteppo", samples_per_prompt=1)

    def test_unknown_aggregation_is_refused(self):
        with pytest.raises(ValueError, match="loss aggregation 'sum'"):
            resolve().replace(aggregation="sum")

    def test_not_a_spec_is_refused(self):
        with pytest.raises(TypeError, match="needs an AlgorithmSpec"):
            resolve_algorithm({"name": "grpo"})

    def test_unknown_name_never_reaches_resolve(self):
        with pytest.raises(ValueError, match="name"):
            AlgorithmSpec(name="a2c")


# ---------------------------------------------------------------------------------------------
# It learns
# ---------------------------------------------------------------------------------------------

ARM_REWARD = torch.tensor([0.0, 0.2, 1.0, 0.0, 0.3])  # arm 2 pays 1, the others little


def expected_reward(logits: torch.Tensor) -> float:
    return float((torch.softmax(logits, -1) * ARM_REWARD).sum())


def train_bandit(cfg: AlgorithmConfig, steps=60, groups=8, seed=0) -> tuple[float, float]:
    """One-token episodes: sample from a one-step-stale behaviour policy, recompute proximal logp,
    compute advantages and take 2 minibatch steps of the decoupled loss, as the async trainer does.
    A smoke test of every preset: it still learns with the behaviour weight, the clip or the baseline
    broken (the bandit is too easy); the classes after TestItLearns are the ones that catch those."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.zeros(5, requires_grad=True)
    opt = torch.optim.Adam([logits], lr=0.05)
    behaviour = logits.detach().clone()
    ref = logits.detach().clone()
    start = expected_reward(logits.detach())
    n = cfg.group_size
    for _ in range(steps):
        probs = torch.softmax(behaviour, -1)
        actions = torch.multinomial(probs.expand(groups * n, 5), 1, generator=g)  # [N, 1]
        raw = (ARM_REWARD[actions.squeeze(1)] + 0.1 * torch.randn(groups * n, generator=g)).clamp(0, 1)
        raw = raw.view(groups, n)
        keep = [i for i in range(groups) if not cfg.dynamic_sampling or dynamic_sampling_keep(raw[i])]
        if not keep:
            continue
        raw, actions = raw[keep], actions.view(groups, n)[keep].reshape(-1, 1)
        lengths = torch.ones_like(raw)
        rewards = shape_rewards(raw, lengths, cfg)
        mask = torch.ones_like(actions, dtype=torch.bool)
        behave_logp = torch.log_softmax(behaviour, -1)[actions]
        prox_logp = torch.log_softmax(logits.detach(), -1)[actions]
        kl = (prox_logp - torch.log_softmax(ref, -1)[actions]) if cfg.kl_in_reward else None
        adv = compute_token_advantages(rewards, mask, cfg, kl=kl)
        behaviour = logits.detach().clone()  # the engine gets the new weights one step late
        rows = torch.randperm(actions.shape[0], generator=g).chunk(2)
        for idx in rows:
            logp = torch.log_softmax(logits, -1)[actions[idx]]
            ref_logp = torch.log_softmax(ref, -1)[actions[idx]] if cfg.kl_in_loss else None
            loss, stats = ppo_actor_loss(
                logp, prox_logp[idx], behave_logp[idx], adv[idx], mask[idx], cfg,
                ref_logp=ref_logp, denominator=loss_denominator(mask[idx], cfg),
            )
            opt.zero_grad()
            loss.backward()
            opt.step()
            assert all(math.isfinite(v) for v in stats.values())
    return start, expected_reward(logits.detach())


class TestItLearns:
    @pytest.mark.parametrize("name", NAMES)
    def test_a_categorical_policy_learns_the_best_arm_of_a_bandit(self, name):
        extra = {"max_new_tokens": 64} if name == "dapo" else {}
        if name == "gspo":
            extra = {"eps_clip": 0.2}  # GSPO's 3e-4 clip suits long sequences, not one-token episodes
        cfg = resolve(name, samples_per_prompt=8, kl_coef=0.001, **extra)
        start, end = train_bandit(cfg)
        assert start == pytest.approx(0.3, abs=1e-6)
        assert end > 0.8, f"{name}: expected reward went {start:.3f} -> {end:.3f}"

    def test_a_zero_advantage_batch_leaves_the_policy_unchanged(self):
        cfg = resolve("grpo")
        logits = torch.zeros(5, requires_grad=True)
        rewards = torch.ones(2, 4)  # all-equal groups
        mask = torch.ones(8, 1, dtype=torch.bool)
        adv = compute_token_advantages(shape_rewards(rewards, None, cfg), mask, cfg)
        logp = torch.log_softmax(logits, -1)[torch.tensor([[0], [1], [2], [3], [4], [0], [1], [2]])]
        loss, _ = ppo_actor_loss(logp, logp.detach(), logp.detach(), adv, mask, cfg)
        loss.backward()
        assert torch.count_nonzero(logits.grad) == 0

    def test_kl_penalty_alone_pulls_the_policy_back_to_the_reference(self):
        ref = torch.log_softmax(torch.tensor([2.0, 0.0, 0.0]), -1)
        logits = torch.zeros(3, requires_grad=True)
        opt = torch.optim.SGD([logits], lr=0.5)
        for _ in range(200):
            logp = torch.log_softmax(logits, -1)
            # exact KL(pi || ref) = sum_a pi(a) * k1(a); the estimator's expectation under pi
            kl = (logp.exp() * kl_penalty(logp, ref, torch.ones(3), "k1")).sum()
            opt.zero_grad()
            kl.backward()
            opt.step()
        assert torch.allclose(torch.log_softmax(logits.detach(), -1), ref, atol=1e-2)

    def test_compute_advantages_orders_responses_by_reward(self):
        for name in NAMES:
            cfg = resolve(name)
            adv = compute_advantages(torch.tensor([[0.0, 1.0, 0.5, 0.25]]), cfg)
            assert torch.argsort(adv[0]).tolist() == [0, 3, 2, 1], name


# ---------------------------------------------------------------------------------------------
# Tests that fail when the decoupled objective is broken (scripts/mutation-check.py plants each bug)
# ---------------------------------------------------------------------------------------------

# Rewards of a bandit whose best arm (0) is rare under the behaviour policy, and whose second best (1) is common.
OFF_REWARD = torch.tensor([1.0, 0.6, 0.0, 0.0, 0.2])
OFF_BEHAVIOUR = torch.tensor([0.04, 0.5, 0.3, 0.1, 0.06])


def learn_from_a_stale_behaviour_policy(cfg: AlgorithmConfig, steps=150, groups=8, seed=0) -> torch.Tensor:
    """Every batch is sampled by one fixed old policy (OFF_BEHAVIOUR: the engine never catches up), the
    proximal policy is the learner itself; one plain SGD step per batch. Returns the learnt probabilities.

    Only the behaviour weight pi_prox/pi_behave turns this into an estimate of the learner's own policy
    gradient. Without it the expected step on logit k is ~ mu(k) * (r(k) - mean_mu r): a constant direction
    in which the common second-best arm grows five times faster than the rare best one, so an unweighted
    learner converges to arm 1 (reward 0.6), an inverted weight even more surely, and a ratio taken against
    pi_behave clips the rare arm's gradient away after its first few steps."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.zeros(5, requires_grad=True)
    opt = torch.optim.SGD([logits], lr=1.0)
    n = cfg.group_size
    for _ in range(steps):
        actions = torch.multinomial(OFF_BEHAVIOUR.expand(groups * n, 5), 1, generator=g)
        raw = OFF_REWARD[actions.squeeze(1)].view(groups, n)
        mask = torch.ones_like(actions, dtype=torch.bool)
        adv = compute_token_advantages(shape_rewards(raw, torch.ones_like(raw), cfg), mask, cfg)
        loss, _ = ppo_actor_loss(torch.log_softmax(logits, -1)[actions], torch.log_softmax(logits.detach(), -1)[actions],
                                 OFF_BEHAVIOUR.log()[actions], adv, mask, cfg)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return torch.softmax(logits.detach(), -1)


class TestOffPolicyLearning:
    @pytest.mark.parametrize("name", NAMES)
    def test_the_behaviour_weight_finds_the_best_arm_that_the_stale_engine_rarely_samples(self, name):
        extra = {"eps_clip": 0.2} if name == "gspo" else {}
        if name in ("drgrpo", "dapo"):
            extra["max_new_tokens"] = 1  # Dr.GRPO divides by maxNewTokens: one-token episodes
        # No cap: the learner moves far from the behaviour policy, which is what is tested here.
        cfg = resolve(name, samples_per_prompt=8, behavior_weight_cap=None, **extra)
        probs = learn_from_a_stale_behaviour_policy(cfg)
        reward = float((probs * OFF_REWARD).sum())
        assert probs[0] > 0.95 and reward > 0.95, f"{name}: learnt {probs.tolist()} (expected reward {reward:.3f})"


class TestClipIsATrustRegion:
    @pytest.mark.parametrize("eps", [0.1, 0.2, 0.3])
    def test_many_epochs_on_one_batch_move_no_token_much_beyond_the_clip_range(self, eps):
        """PPO's clip removes a token's gradient once its ratio leaves [1 - eps, 1 + eps] in the direction its
        advantage pushes it: 200 small SGD epochs on one batch keep every ratio within 1 +- 2 eps (only other
        tokens' gradients move it past 1 +- eps, through the softmax; measured: about 1 +- 1.6 eps). Unclipped,
        the surrogate is linear in the ratio and the best sampled arm's ratio runs off."""
        cfg = resolve("grpo", samples_per_prompt=8, eps_clip=eps)
        g = torch.Generator().manual_seed(0)
        logits = torch.zeros(5, requires_grad=True)
        opt = torch.optim.SGD([logits], lr=0.05)
        actions = torch.multinomial(torch.full((16, 5), 0.2), 1, generator=g)
        raw = OFF_REWARD[actions.squeeze(1)].view(2, 8)
        mask = torch.ones_like(actions, dtype=torch.bool)
        adv = compute_token_advantages(shape_rewards(raw, None, cfg), mask, cfg)
        prox = torch.log_softmax(logits.detach(), -1)[actions]
        for _ in range(200):
            loss, stats = ppo_actor_loss(torch.log_softmax(logits, -1)[actions], prox, prox, adv, mask, cfg)
            opt.zero_grad()
            loss.backward()
            opt.step()
        ratio = torch.exp(torch.log_softmax(logits.detach(), -1)[actions] - prox)
        assert stats["clip_fraction"] > 0.5, "the batch was trained until most tokens were clipped"
        assert float(ratio.max()) < 1 + 2 * eps and float(ratio.min()) > 1 - 2 * eps, ratio.flatten().tolist()


class TestBehaviourWeightCap:
    def test_a_weight_exactly_at_the_cap_is_kept_and_one_above_it_is_masked(self):
        """AReaL keeps tokens with pi_prox/pi_behave <= cap (mask mode) and drops those above it."""
        prox = torch.tensor([[0.0, 0.0]])
        behave = torch.tensor([[-1.0, -1.5]])  # weights e^1 (exactly the cap below) and e^1.5
        cap = float(torch.exp(torch.tensor(1.0)))  # the float32 value the loss computes for e^1
        cfg = resolve("grpo", behavior_weight_cap=cap)
        logp = prox.clone().requires_grad_(True)
        adv = torch.tensor([[1.0, 1.0]])
        loss, stats = ppo_actor_loss(logp, prox, behave, adv, torch.ones(1, 2), cfg)
        loss.backward()
        assert stats["behavior_masked_fraction"] == 0.5
        # d loss / d logp_t = -w_t * A_t * r_t / tokens, with r = 1: the kept token has weight e, the masked one 0.
        assert logp.grad[0].tolist() == pytest.approx([-cap / 2, 0.0])


class TestBaseline:
    @pytest.mark.parametrize("name", NAMES)
    def test_when_every_answer_is_rewarded_the_worse_ones_are_still_pushed_down(self, name):
        """The baseline (group mean, leave-one-out or batch mean) makes advantages relative: in a batch where
        every reward is positive, answers below their baseline get negative advantages."""
        cfg = resolve(name)
        rewards = torch.tensor([[0.9, 0.5, 0.7, 0.5], [0.8, 0.6, 0.6, 0.6]])
        adv = compute_advantages(rewards, cfg)
        assert (adv[rewards == 0.5] < 0).all() and (adv[0, 0] > 0), f"{name}: {adv.tolist()}"

    def test_grpo_advantages_are_reward_minus_group_mean_over_group_std(self):
        cfg = resolve("grpo", reward_bias=0.0, reward_scaling=1.0)
        rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
        # By hand: mean 0.25, population std sqrt(3/16) = 0.4330127.
        expected = torch.tensor([[0.75, -0.25, -0.25, -0.25]]) / (0.4330127 + 1e-6)
        assert torch.allclose(compute_advantages(rewards, cfg), expected, atol=1e-5)
