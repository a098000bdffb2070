"""The decoupled PPO loss and the KL penalty, checked against references written here in plain Python
(math.exp over lists), never by calling the module's own helpers."""

import math

import pytest
import torch

from kuberl.api.v1alpha1 import AlgorithmSpec
from kuberl.runtime.algorithms import resolve_algorithm
from kuberl.runtime.algorithms.losses import (
    kl_penalty,
    loss_denominator,
    ppo_actor_loss,
)

# Two sequences of 4 tokens, the second padded after 3.
LOGP = [[-1.0, -0.5, -2.0, -0.1], [-0.3, -1.2, -0.7, -5.0]]
PROX = [[-1.1, -0.9, -1.6, -0.2], [-0.3, -0.8, -1.0, -3.0]]
BEHAVE = [[-1.2, -0.9, -3.5, -0.2], [-0.5, -0.8, -1.1, -3.0]]
ADV = [[1.0, 1.0, 1.0, 1.0], [-2.0, -2.0, -2.0, 0.0]]
MASK = [[1, 1, 1, 1], [1, 1, 1, 0]]


def cfg_for(name="grpo", **kw):
    return resolve_algorithm(AlgorithmSpec(name=name, **kw))


def t(x, grad=False):
    return torch.tensor(x, dtype=torch.float64, requires_grad=grad)


def ref_token_losses(logp, prox, behave, adv, mask, eps_low, eps_high, cap=None, mode="mask", decoupled=True):
    """Per-token decoupled PPO loss, one token at a time."""
    out = []
    for row in range(len(logp)):
        out_row = []
        for k in range(len(logp[row])):
            if not mask[row][k]:
                out_row.append(0.0)
                continue
            base = prox[row][k] if decoupled else behave[row][k]
            r = math.exp(logp[row][k] - base)
            a = adv[row][k]
            loss = max(-a * r, -a * min(max(r, 1 - eps_low), 1 + eps_high))
            if decoupled:
                w = math.exp(prox[row][k] - behave[row][k])
                if cap is not None and w > cap:
                    w = 0.0 if mode == "mask" else cap
                loss *= w
            out_row.append(loss)
        out.append(out_row)
    return out


def run(cfg, **kw):
    args = {"logp": t(LOGP, grad=True), "proximal_logp": t(PROX), "behavior_logp": t(BEHAVE), "advantages": t(ADV), "loss_mask": torch.tensor(MASK)}
    args.update(kw)
    return ppo_actor_loss(args["logp"], args["proximal_logp"], args["behavior_logp"], args["advantages"], args["loss_mask"], cfg,
                          **{k: v for k, v in kw.items() if k in ("seq_ids", "ref_logp", "denominator")})


class TestDecoupledPPO:
    def test_token_mean_loss_matches_the_reference_formula(self):
        cfg = cfg_for("grpo", eps_clip=0.2, behavior_weight_cap=None)
        loss, _ = run(cfg)
        ref = ref_token_losses(LOGP, PROX, BEHAVE, ADV, MASK, 0.2, 0.2)
        assert loss.item() == pytest.approx(sum(map(sum, ref)) / 7, rel=1e-9)

    def test_behaviour_weight_over_the_cap_masks_the_token_out(self):
        # token (0, 2): pi_prox/pi_behave = exp(1.9) ~ 6.7 > 5
        cfg = cfg_for("grpo", eps_clip=0.2, behavior_weight_cap=5.0, behavior_weight_mode="mask")
        loss, stats = run(cfg)
        ref = ref_token_losses(LOGP, PROX, BEHAVE, ADV, MASK, 0.2, 0.2, cap=5.0, mode="mask")
        assert ref[0][2] == 0.0
        assert loss.item() == pytest.approx(sum(map(sum, ref)) / 7, rel=1e-9)  # masked token still counts in D
        assert stats["behavior_masked_fraction"] == pytest.approx(1 / 7)
        assert stats["behavior_weight_max"] == pytest.approx(math.exp(1.9), rel=1e-6)

    def test_behaviour_weight_over_the_cap_is_clipped_to_it_in_cap_mode(self):
        cfg = cfg_for("grpo", eps_clip=0.2, behavior_weight_cap=5.0, behavior_weight_mode="cap")
        loss, _ = run(cfg)
        ref = ref_token_losses(LOGP, PROX, BEHAVE, ADV, MASK, 0.2, 0.2, cap=5.0, mode="cap")
        assert ref[0][2] != 0.0
        assert loss.item() == pytest.approx(sum(map(sum, ref)) / 7, rel=1e-9)

    def test_masking_and_capping_give_different_losses(self):
        masked, _ = run(cfg_for("grpo", behavior_weight_mode="mask"))
        capped, _ = run(cfg_for("grpo", behavior_weight_mode="cap"))
        assert masked.item() != pytest.approx(capped.item())

    def test_decoupled_off_is_standard_ppo_against_the_behaviour_policy(self):
        cfg = cfg_for("grpo", eps_clip=0.2, decoupled_loss=False)
        loss, stats = run(cfg, proximal_logp=None)
        ref = ref_token_losses(LOGP, PROX, BEHAVE, ADV, MASK, 0.2, 0.2, decoupled=False)
        assert loss.item() == pytest.approx(sum(map(sum, ref)) / 7, rel=1e-9)
        assert stats["behavior_weight_mean"] == 1.0

    def test_decoupled_with_proximal_equal_to_behaviour_reduces_to_standard_ppo(self):
        on, _ = run(cfg_for("grpo", behavior_weight_cap=None), proximal_logp=t(BEHAVE))
        off, _ = run(cfg_for("grpo", decoupled_loss=False), proximal_logp=None)
        assert on.item() == pytest.approx(off.item(), rel=1e-12)

    def test_decoupled_needs_proximal_logp(self):
        with pytest.raises(ValueError, match="proximal_logp: required"):
            run(cfg_for("grpo"), proximal_logp=None)

    def test_gradient_flows_only_through_logp(self):
        logp, prox, behave, adv = t(LOGP, True), t(PROX, True), t(BEHAVE, True), t(ADV, True)
        ref = t(PROX, True)
        loss, _ = ppo_actor_loss(logp, prox, behave, adv, torch.tensor(MASK), cfg_for("grpo", kl_coef=0.1), ref_logp=ref)
        loss.backward()
        assert logp.grad is not None and logp.grad.abs().sum() > 0
        assert prox.grad is None and behave.grad is None and adv.grad is None and ref.grad is None
        assert logp.grad[1, 3] == 0  # padding gets no gradient

    def test_gradient_matches_the_unclipped_surrogate_where_nothing_clips(self):
        # d/dlogp of -A * w * exp(logp - prox) / D = -A * w * r / D
        cfg = cfg_for("grpo", eps_clip=5.0, eps_clip_high=5.0, behavior_weight_cap=None)
        logp = t(LOGP, True)
        loss, _ = ppo_actor_loss(logp, t(PROX), t(BEHAVE), t(ADV), torch.tensor(MASK), cfg)
        loss.backward()
        for row in range(2):
            for k in range(4):
                want = 0.0
                if MASK[row][k]:
                    r = math.exp(LOGP[row][k] - PROX[row][k])
                    w = math.exp(PROX[row][k] - BEHAVE[row][k])
                    want = -ADV[row][k] * w * r / 7
                assert logp.grad[row, k].item() == pytest.approx(want, rel=1e-9, abs=1e-12)

    def test_padding_garbage_cannot_make_the_loss_nan(self):
        logp = t([[-1.0, float("-inf")]], True)
        loss, _ = ppo_actor_loss(logp, t([[-1.0, 0.0]]), t([[-1.0, float("nan")]]), t([[1.0, 1.0]]), torch.tensor([[1, 0]]), cfg_for())
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()


class TestClipHigher:
    def test_clipping_is_asymmetric(self):
        cfg = cfg_for("grpo", eps_clip=0.2, eps_clip_high=0.28, behavior_weight_cap=None)
        # ratios: 1.35 (A > 0: capped at 1.28), 0.75 (A < 0: floored at 0.8), 1.25 (A > 0: inside, not clipped)
        ratios, advs = [1.35, 0.75, 1.25], [1.0, -1.0, 1.0]
        logp = t([[math.log(r) for r in ratios]], True)
        zeros = t([[0.0, 0.0, 0.0]])
        loss, stats = ppo_actor_loss(logp, zeros, zeros, t([advs]), torch.tensor([[1, 1, 1]]), cfg)
        assert loss.item() == pytest.approx((-1.28 + 0.8 - 1.25) / 3, rel=1e-9)
        assert stats["clip_fraction"] == pytest.approx(2 / 3)
        loss.backward()
        assert logp.grad[0, :2].tolist() == [0.0, 0.0]  # clipped tokens push no gradient
        assert logp.grad[0, 2].item() == pytest.approx(-1.25 / 3)

    def test_a_symmetric_clip_would_cap_the_same_token_lower(self):
        cfg = cfg_for("grpo", eps_clip=0.2, behavior_weight_cap=None)
        zeros = t([[0.0]])
        loss, _ = ppo_actor_loss(t([[math.log(1.35)]], True), zeros, zeros, t([[1.0]]), torch.tensor([[1]]), cfg)
        assert loss.item() == pytest.approx(-1.2)

    def test_dapo_preset_clips_at_0_2_and_0_28(self):
        cfg = cfg_for("dapo")
        assert (cfg.eps_low, cfg.eps_high) == (0.2, 0.28)


class TestGSPO:
    def test_sequence_ratio_is_the_exp_of_the_mean_token_log_ratio(self):
        cfg = cfg_for("gspo", eps_clip=0.5, eps_clip_high=0.5, behavior_weight_cap=None, decoupled_loss=False)
        seq_adv = [1.0, -2.0]
        adv = [[seq_adv[0]] * 4, [seq_adv[1]] * 3 + [0.0]]
        loss, stats = run(cfg, proximal_logp=None, advantages=t(adv))
        per_seq = []
        for row in range(2):
            toks = [k for k in range(4) if MASK[row][k]]
            s = math.exp(sum(LOGP[row][k] - BEHAVE[row][k] for k in toks) / len(toks))
            a = seq_adv[row]
            per_seq.append(max(-a * s, -a * min(max(s, 0.5), 1.5)))
        assert loss.item() == pytest.approx(sum(per_seq) / 2, rel=1e-9)
        assert stats["ratio_max"] > 1.0

    def test_sequence_ratio_differs_from_token_ratio(self):
        spec = {"eps_clip": 0.5, "eps_clip_high": 0.5, "behavior_weight_cap": None}
        seq, _ = run(cfg_for("gspo", **spec))
        tok, _ = run(cfg_for("grpo", **spec).replace(aggregation="seq-mean-token-mean"))
        assert seq.item() != pytest.approx(tok.item())

    def test_whole_sequence_is_clipped_together(self):
        cfg = cfg_for("gspo")  # 3e-4 / 4e-4
        # sequence 0: mean log-ratio +0.05 -> s = 1.051 > 1 + 4e-4, A > 0: all 4 tokens clipped together,
        # though alone their ratios range from 0.67 to 1.49; sequence 1: s = 0.967 < 1 - 3e-4, A > 0: none clipped
        _, stats = run(cfg, advantages=t([[1.0] * 4, [1.0] * 4]))
        assert stats["clip_fraction"] == pytest.approx(4 / 7)

    def test_gspo_behaviour_weight_is_per_sequence(self):
        cfg = cfg_for("gspo", eps_clip=0.5, eps_clip_high=0.5, behavior_weight_cap=None)
        adv = [[1.0] * 4, [-2.0] * 3 + [0.0]]
        loss, _ = run(cfg, advantages=t(adv))
        per_seq = []
        for row in range(2):
            toks = [k for k in range(4) if MASK[row][k]]
            s = math.exp(sum(LOGP[row][k] - PROX[row][k] for k in toks) / len(toks))
            w = math.exp(sum(PROX[row][k] - BEHAVE[row][k] for k in toks) / len(toks))
            a = adv[row][0]
            per_seq.append(w * max(-a * s, -a * min(max(s, 0.5), 1.5)))
        assert loss.item() == pytest.approx(sum(per_seq) / 2, rel=1e-9)


class TestAggregation:
    CFG = {"eps_clip": 0.2, "behavior_weight_cap": None}  # noqa: RUF012 (read only)

    def ref(self):
        return ref_token_losses(LOGP, PROX, BEHAVE, ADV, MASK, 0.2, 0.2)

    def test_token_mean_divides_by_all_loss_tokens(self):
        loss, _ = run(cfg_for("grpo", **self.CFG))
        assert loss.item() == pytest.approx(sum(map(sum, self.ref())) / 7)

    def test_seq_mean_token_mean_averages_each_sequence_first(self):
        loss, _ = run(cfg_for("grpo", **self.CFG).replace(aggregation="seq-mean-token-mean"))
        ref = self.ref()
        assert loss.item() == pytest.approx((sum(ref[0]) / 4 + sum(ref[1]) / 3) / 2)

    def test_seq_mean_token_sum_sums_each_sequence(self):
        loss, _ = run(cfg_for("grpo", **self.CFG).replace(aggregation="seq-mean-token-sum"))
        assert loss.item() == pytest.approx((sum(self.ref()[0]) + sum(self.ref()[1])) / 2)

    def test_token_mean_and_sequence_mean_differ_for_unequal_lengths(self):
        a, _ = run(cfg_for("grpo", **self.CFG))
        b, _ = run(cfg_for("grpo", **self.CFG).replace(aggregation="seq-mean-token-mean"))
        assert a.item() != pytest.approx(b.item())

    def test_drgrpo_divides_by_a_constant_sequences_times_max_new_tokens(self):
        cfg = cfg_for("drgrpo", max_new_tokens=16, **self.CFG)
        assert cfg.aggregation == "seq-mean-token-sum-norm"
        loss, _ = run(cfg)
        assert loss.item() == pytest.approx(sum(map(sum, self.ref())) / (2 * 16))

    def test_drgrpo_normalizer_does_not_depend_on_response_length(self):
        cfg = cfg_for("drgrpo", max_new_tokens=16)
        assert loss_denominator(torch.tensor([[1, 0, 0], [1, 0, 0]]), cfg) == loss_denominator(torch.ones(2, 3), cfg) == 32

    def test_micro_batch_losses_with_the_minibatch_denominator_add_up_to_the_minibatch_loss(self):
        for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"):
            cfg = cfg_for("grpo").replace(aggregation=agg)
            full, _ = run(cfg)
            d = loss_denominator(torch.tensor(MASK), cfg)
            parts = [
                ppo_actor_loss(t([LOGP[i]]), t([PROX[i]]), t([BEHAVE[i]]), t([ADV[i]]), torch.tensor([MASK[i]]), cfg, denominator=d)[0]
                for i in range(2)
            ]
            assert (parts[0] + parts[1]).item() == pytest.approx(full.item(), rel=1e-12), agg

    def test_packed_batch_with_seq_ids_equals_the_padded_batch(self):
        for name in ("grpo", "gspo", "drgrpo"):
            cfg = cfg_for(name)
            padded, _ = run(cfg)
            keep = [(r, k) for r in range(2) for k in range(4) if MASK[r][k]]

            def pack(x, keep=keep):
                return t([x[r][k] for r, k in keep])

            ids = torch.tensor([r + 7 for r, _ in keep])  # arbitrary ids are fine
            packed, _ = ppo_actor_loss(pack(LOGP), pack(PROX), pack(BEHAVE), pack(ADV), torch.ones(len(keep)), cfg, seq_ids=ids)
            assert packed.item() == pytest.approx(padded.item(), rel=1e-12), name

    def test_packed_batch_without_seq_ids_is_an_error(self):
        with pytest.raises(ValueError, match="needs seq_ids"):
            ppo_actor_loss(t([0.0]), t([0.0]), t([0.0]), t([1.0]), torch.ones(1), cfg_for())

    def test_bad_denominator_is_rejected(self):
        with pytest.raises(ValueError, match="denominator"):
            run(cfg_for(), denominator=0.0)


class TestKL:
    def test_estimators_match_their_formulas(self):
        logp, ref = [-1.0, -0.2, -3.0], [-1.5, -0.2, -2.0]
        for kind, f in {
            "k1": lambda lp, rf: lp - rf,
            "k2": lambda lp, rf: 0.5 * (lp - rf) ** 2,
            "k3": lambda lp, rf: math.exp(rf - lp) - (rf - lp) - 1,
        }.items():
            got = kl_penalty(t(logp), t(ref), torch.ones(3), kind).tolist()
            assert got == pytest.approx([f(a, b) for a, b in zip(logp, ref)]), kind

    def test_zero_outside_the_mask_and_k3_is_never_negative(self):
        kl = kl_penalty(torch.randn(4, 5), torch.randn(4, 5), torch.tensor([[1, 1, 1, 0, 0]] * 4))
        assert (kl[:, 3:] == 0).all() and (kl >= 0).all()

    def test_unknown_kind_is_rejected(self):
        with pytest.raises(ValueError, match="kind 'k9'"):
            kl_penalty(torch.zeros(2), torch.zeros(2), torch.ones(2), "k9")

    def test_kl_in_the_loss_adds_coef_times_k3_per_token(self):
        ref_logp = [[-1.0, -1.0, -1.0, -1.0], [-0.5, -0.5, -0.5, -0.5]]
        base, _ = run(cfg_for("grpo", behavior_weight_cap=None))
        with_kl, stats = run(cfg_for("grpo", behavior_weight_cap=None, kl_coef=0.3), ref_logp=t(ref_logp))
        k3 = sum(math.exp(ref_logp[r][k] - LOGP[r][k]) - (ref_logp[r][k] - LOGP[r][k]) - 1 for r in range(2) for k in range(4) if MASK[r][k])
        assert with_kl.item() == pytest.approx(base.item() + 0.3 * k3 / 7, rel=1e-9)
        assert stats["kl"] == pytest.approx(k3 / 7)

    def test_the_kl_term_pulls_each_token_toward_the_reference(self):
        """d(coef * k3)/d log pi_theta = coef * (1 - pi_ref / pi_theta) per loss token, over the denominator (7 tokens): the
        value test above passes a KL term whose gradient is missing (log pi_theta detached in it) too."""
        ref_logp = [[-1.0, -1.0, -1.0, -1.0], [-0.5, -0.5, -0.5, -0.5]]
        lp_base, lp_kl = t(LOGP, grad=True), t(LOGP, grad=True)
        run(cfg_for("grpo", behavior_weight_cap=None), logp=lp_base)[0].backward()
        run(cfg_for("grpo", behavior_weight_cap=None, kl_coef=0.3), logp=lp_kl, ref_logp=t(ref_logp))[0].backward()
        want = [[0.3 * (1 - math.exp(ref_logp[r][k] - LOGP[r][k])) / 7 if MASK[r][k] else 0.0 for k in range(4)] for r in range(2)]
        got = (lp_kl.grad - lp_base.grad).tolist()
        for r in range(2):
            assert got[r] == pytest.approx(want[r], abs=1e-12), r

    def test_kl_in_the_loss_needs_ref_logp(self):
        with pytest.raises(ValueError, match="ref_logp: required"):
            run(cfg_for("grpo", kl_coef=0.1))

    def test_reinforce_pp_keeps_the_kl_out_of_the_loss(self):
        cfg = cfg_for("reinforce++", kl_coef=0.1)
        assert cfg.kl_in_reward and not cfg.kl_in_loss
        run(cfg)  # no ref_logp needed


class TestStatsAndShapes:
    def test_stats_report_ratio_and_counts(self):
        cfg = cfg_for("grpo", behavior_weight_cap=None)
        _, stats = run(cfg)
        ratios = [math.exp(LOGP[r][k] - PROX[r][k]) for r in range(2) for k in range(4) if MASK[r][k]]
        assert stats["ratio_mean"] == pytest.approx(sum(ratios) / 7)
        assert stats["tokens"] == 7 and stats["sequences"] == 2
        assert stats["approx_kl"] > 0

    def test_shape_mismatch_names_the_input(self):
        with pytest.raises(ValueError, match="advantages: shape"):
            run(cfg_for(), advantages=torch.ones(3, 4))

    def test_a_batch_without_loss_tokens_gives_zero_loss_and_zero_gradient(self):
        logp = t(LOGP, True)
        loss, stats = ppo_actor_loss(logp, t(PROX), t(BEHAVE), t(ADV), torch.zeros(2, 4), cfg_for())
        loss.backward()
        assert loss.item() == 0.0 and stats["tokens"] == 0 and (logp.grad == 0).all()
