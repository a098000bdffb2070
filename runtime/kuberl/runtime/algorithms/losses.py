"""The decoupled PPO actor loss (AReaL) and the KL penalty: pure functions on tensors.

The trainer calls `ppo_actor_loss` once per micro-batch, with `denominator=loss_denominator(...)` of the whole
minibatch so the micro-batch losses add up to the minibatch loss. Notation: pi_theta = the policy being
trained (logp), pi_prox = the pre-update policy (proximal_logp), pi_behave = the engine that sampled (behavior_logp).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kuberl.runtime.algorithms.config import AlgorithmConfig

_MAX_LOG_RATIO = 20.0  # exp(20) ~ 5e8: keeps exp finite for garbage log-probs without touching real ones


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi_theta || pi_ref) (Schulman's estimators), zero where mask is 0.

    With d = log pi_ref - log pi_theta:  k1 = -d,  k2 = d^2 / 2,  k3 = exp(d) - d - 1 (unbiased, >= 0).
    Gradients flow through logp only.
    """
    if logp.shape != ref_logp.shape or logp.shape != mask.shape:
        raise ValueError(f"kl_penalty: logp {tuple(logp.shape)}, ref_logp {tuple(ref_logp.shape)} and mask {tuple(mask.shape)} must share one shape")
    m = mask.bool()
    d = torch.where(m, ref_logp.detach() - logp, torch.zeros((), dtype=logp.dtype, device=logp.device))
    d = d.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    if kind == "k1":
        kl = -d
    elif kind == "k2":
        kl = 0.5 * d * d
    elif kind == "k3":
        kl = torch.exp(d) - d - 1.0
    else:
        raise ValueError(f"kl_penalty: kind {kind!r} is not k1, k2 or k3")
    return torch.where(m, kl, torch.zeros((), dtype=kl.dtype, device=kl.device))


def _flatten(loss_mask: torch.Tensor, seq_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Token mask [L] and dense sequence index [L] for a padded [N, T] or packed [L] (+ seq_ids) batch."""
    mask = loss_mask.bool()
    if seq_ids is None:
        if mask.dim() != 2:
            raise ValueError(f"loss_mask: a packed ({mask.dim()}-d) batch needs seq_ids; a padded one is [N, T], got {tuple(mask.shape)}")
        n = mask.shape[0]
        ids = torch.arange(n, device=mask.device)[:, None].expand_as(mask)
        return mask.reshape(-1), ids.reshape(-1), n
    if seq_ids.shape != mask.shape:
        raise ValueError(f"seq_ids: shape {tuple(seq_ids.shape)} must equal loss_mask {tuple(mask.shape)}")
    uniq, dense = torch.unique(seq_ids.reshape(-1), return_inverse=True)
    return mask.reshape(-1), dense, int(uniq.numel())


def _segment_sum(x: torch.Tensor, ids: torch.Tensor, n: int) -> torch.Tensor:
    return torch.zeros(n, dtype=x.dtype, device=x.device).index_add(0, ids, x)


def loss_denominator(loss_mask: torch.Tensor, cfg: AlgorithmConfig, seq_ids: torch.Tensor | None = None) -> float:
    """The divisor of the aggregated loss for this (mini)batch, per cfg.aggregation:

    token-mean: number of loss tokens;  seq-mean-token-sum / seq-mean-token-mean: number of sequences with
    at least one loss token;  seq-mean-token-sum-norm (Dr.GRPO): that number * max_new_tokens (a constant,
    so long and short answers weigh the same per token). Never below 1.
    """
    mask, ids, n = _flatten(loss_mask, seq_ids)
    if cfg.aggregation == "token-mean":
        d = float(mask.sum())
    else:
        seqs = float((_segment_sum(mask.to(torch.int64), ids, n) > 0).sum())
        d = seqs * cfg.max_new_tokens if cfg.aggregation == "seq-mean-token-sum-norm" else seqs
    return max(d, 1.0)


def ppo_actor_loss(
    logp: torch.Tensor,
    proximal_logp: torch.Tensor | None,
    behavior_logp: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    cfg: AlgorithmConfig,
    *,
    seq_ids: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
    denominator: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Decoupled PPO loss (AReaL, Fu et al. 2025, eq. 5) over the tokens where loss_mask is 1.

    Per loss token t (token ratio level):
        r_t   = pi_theta(t) / pi_prox(t) = exp(logp - proximal_logp)
        w_t   = pi_prox(t) / pi_behave(t) = exp(proximal_logp - behavior_logp)      (behaviour weight)
        w_t  <- 0 if w_t > cap (mode "mask", AReaL's default)  |  min(w_t, cap) (mode "cap")  |  w_t (no cap)
        l_t   = w_t * max(-A_t * r_t, -A_t * clip(r_t, 1 - eps_low, 1 + eps_high))
              (+ kl_coef * KL_t(pi_theta || pi_ref) when the KL goes into the loss)
    GSPO (ratio_level "sequence"): r_t = s_i = exp(mean_{t in i}(logp - proximal_logp)) for every token of
    sequence i, and w_t = exp(mean_{t in i}(proximal_logp - behavior_logp)), capped per sequence.
    Decoupled off (cfg.decoupled False): pi_prox := pi_behave, so w = 1 and this is standard PPO-clip;
    proximal_logp may then be None.
    Aggregation (D = `denominator`, default loss_denominator(loss_mask, cfg, seq_ids)):
        token-mean, seq-mean-token-sum(-norm): sum_t l_t / D;   seq-mean-token-mean: sum_i mean_{t in i} l_t / D.
    Tokens dropped by the behaviour mask still count in D (as in AReaL).

    Shapes: all inputs [N, T] (rows = sequences), or packed [L] with seq_ids [L]. Gradients flow only through
    logp: proximal, behaviour and reference log-probs are detached. Returns (scalar loss, stats) where stats
    holds floats: loss, clip_fraction, ratio_mean, ratio_max, behavior_weight_mean, behavior_weight_max,
    behavior_masked_fraction (share of loss tokens over the cap: dropped or capped), approx_kl
    (k3 estimate of KL(pi_prox || pi_theta)), kl (when in the loss), advantage_mean,
    tokens, sequences.
    """
    _check_shapes(logp, proximal_logp, behavior_logp, advantages, loss_mask, ref_logp, cfg)
    f = _flat_tokens(logp, proximal_logp, behavior_logp, advantages, loss_mask, seq_ids, cfg)
    log_ratio, behave_log_w = _log_ratios(f, cfg)
    ratio = torch.exp(log_ratio)
    pg, clip_mask = _clipped_pg(f, ratio, cfg)
    weight = torch.exp(behave_log_w)
    pg, dropped = _behaviour_weighted(pg, weight, f, cfg)

    kl = None
    if cfg.kl_in_loss:
        kl = kl_penalty(f.lp, ref_logp.reshape(-1), f.mask, cfg.kl_kind)
        pg = pg + cfg.kl_coef * kl

    pg = torch.where(f.mask, pg, f.zero)
    if denominator is None:
        denominator = loss_denominator(loss_mask, cfg, seq_ids)
    elif denominator <= 0:
        raise ValueError(f"denominator: must be > 0, got {denominator}")
    if cfg.aggregation == "seq-mean-token-mean":
        per_seq = _segment_sum(pg, f.ids, f.n_seq) / f.tokens_per_seq.clamp(min=1.0)
        loss = per_seq.sum() / denominator
    else:
        loss = pg.sum() / denominator

    with torch.no_grad():
        stats = _loss_stats(loss, f, log_ratio, ratio, weight, dropped, clip_mask, kl, cfg)
    return loss, stats


@dataclass(frozen=True)
class _Tokens:
    """ppo_actor_loss's inputs flattened to the tokens [L]; only lp carries gradients."""

    mask: torch.Tensor  # bool, the loss tokens
    ids: torch.Tensor  # dense sequence index of each token
    n_seq: int
    lp: torch.Tensor  # log pi_theta
    behave: torch.Tensor  # log pi_behave
    prox: torch.Tensor  # log pi_prox (= behave when the loss is not decoupled)
    adv: torch.Tensor
    zero: torch.Tensor
    maskf: torch.Tensor  # mask as lp's dtype
    tokens_per_seq: torch.Tensor


def _check_shapes(logp: torch.Tensor, proximal_logp: torch.Tensor | None, behavior_logp: torch.Tensor, advantages: torch.Tensor,
                  loss_mask: torch.Tensor, ref_logp: torch.Tensor | None, cfg: AlgorithmConfig) -> None:
    shapes = {"logp": logp, "behavior_logp": behavior_logp, "advantages": advantages, "loss_mask": loss_mask}
    if cfg.decoupled:
        if proximal_logp is None:
            raise ValueError("proximal_logp: required with algorithm.decoupledLoss true (recompute it with the pre-update weights)")
        shapes["proximal_logp"] = proximal_logp
    if cfg.kl_in_loss:
        if ref_logp is None:
            raise ValueError(f"ref_logp: required because algorithm.klCoef is {cfg.kl_coef} (the KL penalty goes into the loss)")
        shapes["ref_logp"] = ref_logp
    for name, t in shapes.items():
        if t.shape != logp.shape:
            raise ValueError(f"{name}: shape {tuple(t.shape)} differs from logp {tuple(logp.shape)}")


def _flat_tokens(logp: torch.Tensor, proximal_logp: torch.Tensor | None, behavior_logp: torch.Tensor, advantages: torch.Tensor,
                 loss_mask: torch.Tensor, seq_ids: torch.Tensor | None, cfg: AlgorithmConfig) -> _Tokens:
    mask, ids, n_seq = _flatten(loss_mask, seq_ids)
    lp = logp.reshape(-1)
    behave = behavior_logp.detach().reshape(-1)
    prox = proximal_logp.detach().reshape(-1) if cfg.decoupled else behave
    adv = advantages.detach().reshape(-1).to(lp.dtype)
    zero = torch.zeros((), dtype=lp.dtype, device=lp.device)
    maskf = mask.to(lp.dtype)
    tokens_per_seq = _segment_sum(maskf, ids, n_seq)
    return _Tokens(mask=mask, ids=ids, n_seq=n_seq, lp=lp, behave=behave, prox=prox, adv=adv, zero=zero, maskf=maskf,
                   tokens_per_seq=tokens_per_seq)


def _log_ratios(f: _Tokens, cfg: AlgorithmConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """log r_t = log pi_theta/pi_prox and log w_t = log pi_prox/pi_behave per token (GSPO: their sequence means)."""
    mask, lp, prox, behave, zero = f.mask, f.lp, f.prox, f.behave, f.zero
    # Masked positions get log-ratio 0 so padding garbage can never produce inf/nan (even times 0).
    log_ratio = torch.where(mask, lp - prox, zero).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    behave_log_w = torch.where(mask, prox - behave, zero).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    if cfg.ratio_level == "sequence":
        count = f.tokens_per_seq.clamp(min=1.0)
        log_ratio = (_segment_sum(log_ratio, f.ids, f.n_seq) / count)[f.ids]
        behave_log_w = (_segment_sum(behave_log_w, f.ids, f.n_seq) / count)[f.ids]
    return log_ratio, behave_log_w


def _clipped_pg(f: _Tokens, ratio: torch.Tensor, cfg: AlgorithmConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)) per token, and where the clipped term won."""
    adv, mask = f.adv, f.mask
    clipped = ratio.clamp(1.0 - cfg.eps_low, 1.0 + cfg.eps_high)
    pg_unclipped = -adv * ratio
    pg_clipped = -adv * clipped
    pg = torch.maximum(pg_unclipped, pg_clipped)
    clip_mask = (pg_clipped.detach() > pg_unclipped.detach()) & mask
    return pg, clip_mask


def _behaviour_weighted(pg: torch.Tensor, weight: torch.Tensor, f: _Tokens, cfg: AlgorithmConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """pg times the behaviour weight (masked or capped over cfg.behavior_weight_cap), and the tokens over the cap."""
    mask, zero = f.mask, f.zero
    dropped = torch.zeros_like(mask)
    if cfg.decoupled:
        cap = cfg.behavior_weight_cap
        applied = weight
        if cap is not None:
            dropped = (weight > cap) & mask
            applied = torch.where(dropped, zero, weight) if cfg.behavior_weight_mode == "mask" else weight.clamp(max=cap)
        pg = pg * applied
    return pg, dropped


def _loss_stats(loss: torch.Tensor, f: _Tokens, log_ratio: torch.Tensor, ratio: torch.Tensor, weight: torch.Tensor, dropped: torch.Tensor,
                clip_mask: torch.Tensor, kl: torch.Tensor | None, cfg: AlgorithmConfig) -> dict[str, float]:
    mask, maskf, zero, adv = f.mask, f.maskf, f.zero, f.adv
    # One device-to-host copy for all stats (on a GPU each float() would be a sync).
    d = log_ratio.detach()
    raw = {
        "loss": loss.detach().to(torch.float64),
        "clip_sum": clip_mask.sum(),
        "ratio_sum": (ratio.detach() * maskf).sum(),
        "ratio_max": torch.where(mask, ratio.detach(), zero).max() if mask.numel() else zero,
        "weight_sum": (weight * maskf).sum(),
        "weight_max": torch.where(mask, weight, zero).max() if mask.numel() else zero,
        "dropped_sum": dropped.sum(),
        "kl3_sum": ((torch.exp(d) - d - 1.0) * maskf).sum(),
        "adv_sum": (adv * maskf).sum(),
        "tokens": mask.sum(),
        "sequences": (f.tokens_per_seq > 0).sum(),
        "kl_sum": kl.sum() if kl is not None else zero,
    }
    v = dict(zip(raw, torch.stack([x.to(torch.float64) for x in raw.values()]).tolist()))
    safe = max(v["tokens"], 1.0)
    stats = {
        "loss": v["loss"],
        "clip_fraction": v["clip_sum"] / safe,
        "ratio_mean": v["ratio_sum"] / safe,
        "ratio_max": v["ratio_max"] if v["tokens"] else 0.0,
        "behavior_weight_mean": v["weight_sum"] / safe if cfg.decoupled else 1.0,
        "behavior_weight_max": v["weight_max"] if cfg.decoupled and v["tokens"] else 1.0,
        "behavior_masked_fraction": v["dropped_sum"] / safe,
        "approx_kl": v["kl3_sum"] / safe,
        "advantage_mean": v["adv_sum"] / safe,
        "tokens": v["tokens"],
        "sequences": v["sequences"],
    }
    if kl is not None:
        stats["kl"] = v["kl_sum"] / safe
    return stats
