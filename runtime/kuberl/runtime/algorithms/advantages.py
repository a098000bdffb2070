"""Reward shaping and advantage estimators: pure functions on tensors, configured by an AlgorithmConfig.

The trainer calls, per step: `shape_rewards` (bias, scaling, DAPO overlong penalty) -> `compute_advantages`
([G, n] sequence advantages) -> `broadcast_to_tokens` (or `compute_token_advantages`, which does both and
handles REINFORCE++ with the KL in the reward). Rollout agents or the trainer call `dynamic_sampling_keep`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kuberl.runtime.algorithms.config import AlgorithmConfig

ADV_EPS = 1e-6
"""Added to the std before dividing, so a near-constant group or batch cannot blow up."""


def _as_tensor(x, name: str) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x
    try:
        return torch.as_tensor(x, dtype=torch.float32)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{name}: cannot be read as a tensor of numbers ({e})") from None


def _check_finite(x: torch.Tensor, name: str) -> None:
    if not torch.isfinite(x).all():
        bad = x[~torch.isfinite(x)].flatten()[:3].tolist()
        raise ValueError(f"{name}: holds non-finite values, e.g. {bad}")


# ---------------------------------------------------------------------------------------------
# Rewards
# ---------------------------------------------------------------------------------------------


def overlong_penalty(lengths: torch.Tensor, cfg: AlgorithmConfig) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), times `overlong_penalty_factor` p.

    With L_max = max_new_tokens, L_cache = overlong_buffer and |y| the generated length:
        R_len(y) = 0                               if |y| <= L_max - L_cache
                 = p * ((L_max - L_cache) - |y|) / L_cache   if L_max - L_cache < |y| <= L_max
                 = -p                              if |y| > L_max
    """
    lengths = _as_tensor(lengths, "lengths").to(torch.float64)
    if (lengths < 0).any():
        raise ValueError(f"lengths: negative generated length {int(lengths.min())}")
    start = cfg.max_new_tokens - cfg.overlong_buffer
    ramp = (start - lengths) / cfg.overlong_buffer
    penalty = torch.clamp(ramp, min=-1.0, max=0.0)  # 0 before the buffer, -1 at and beyond L_max
    return penalty * cfg.overlong_penalty_factor


def shape_rewards(rewards, lengths, cfg: AlgorithmConfig) -> torch.Tensor:
    """r' = (r + R_len(|y|) + reward_bias) * reward_scaling, elementwise (any shape, e.g. [G, n]).

    `lengths` = generated tokens per response (same shape as `rewards`); needed only with the overlong
    penalty on, else may be None. The penalty is added in the raw reward's units (as DAPO adds it to its
    +-1 accuracy reward), before bias and scaling. Returns float32.
    """
    r = _as_tensor(rewards, "rewards").to(torch.float64)
    _check_finite(r, "rewards")
    if cfg.overlong_penalty:
        if lengths is None:
            raise ValueError("lengths: needed because algorithm.overlongPenalty is enabled")
        lengths = _as_tensor(lengths, "lengths")
        if lengths.shape != r.shape:
            raise ValueError(f"lengths: shape {tuple(lengths.shape)} differs from rewards {tuple(r.shape)}")
        r = r + overlong_penalty(lengths, cfg)
    return ((r + cfg.reward_bias) * cfg.reward_scaling).to(torch.float32)


def dynamic_sampling_keep(rewards) -> bool:
    """DAPO dynamic sampling: keep a group only if its rewards are not all equal (0 < accuracy < 1).

    A group whose n rewards are equal has zero group-relative advantage for every response, so it adds
    no gradient and only dilutes the batch. `rewards`: [n] (list or tensor) of one group's raw rewards.
    """
    r = _as_tensor(rewards, "rewards").flatten().to(torch.float64)
    if r.numel() == 0:
        raise ValueError("rewards: an empty group cannot be judged by dynamic sampling")
    _check_finite(r, "rewards")
    return bool((r.max() - r.min()) > 1e-9 * max(1.0, float(r.abs().max())))


# ---------------------------------------------------------------------------------------------
# Sequence-level advantages
# ---------------------------------------------------------------------------------------------


def compute_advantages(rewards: torch.Tensor, cfg: AlgorithmConfig, group_sizes: Sequence[int] | None = None) -> torch.Tensor:
    """Sequence advantages A[g, i] for shaped rewards r[g, i] ([G groups, n responses]).

    Ragged groups (the agent workflow's exportStyle individual: one sample per model call, so groups of
    varying size): `rewards` flat [N] in group-major order and `group_sizes` [G] (summing to N); the same
    table applies with mean, std and n taken over each group's own samples; returns [N]. With [G, n]
    rewards, `group_sizes` (if given) must all be n.

    baseline (cfg.baseline)        std (cfg.std_norm)           algorithms
      group:  r - mean_i r[g]       group: / (std_i r[g] + eps)   grpo, dapo, gspo
      group                          none                         drgrpo (Liu et al. 2025)
      loo:    r - sum_{j!=i} r[g,j] / (n - 1)   none              rloo (Ahmadian et al. 2024)
      batch:  r - mean_{g,i} r       batch: / (std_{g,i} r + eps)   reinforce++ (Hu 2025)
      group                          batch: / (std_{g,i} r + eps)   liteppo (Liu et al. 2025, "Tricks or Traps")
    std is the population std (ddof 0); eps = ADV_EPS. Groups whose rewards are all equal get exactly 0
    under the group and loo baselines. Computed in float64, returned as float32.
    """
    r = _as_tensor(rewards, "rewards")
    if r.dim() == 1:
        return _ragged_advantages(r, cfg, group_sizes)
    if r.dim() != 2:
        raise ValueError(f"rewards: expected shape [groups, samples_per_prompt], got {tuple(r.shape)}")
    if group_sizes is not None and (len(group_sizes) != r.shape[0] or any(k != r.shape[1] for k in group_sizes)):
        raise ValueError(f"group_sizes: {list(group_sizes)} do not match rewards of shape {tuple(r.shape)}")
    if r.numel() == 0:
        raise ValueError(f"rewards: empty batch {tuple(r.shape)}")
    _check_finite(r, "rewards")
    r = r.to(torch.float64)
    n = r.shape[1]
    if cfg.baseline in ("group", "loo") and n < 2:
        raise ValueError(f"rewards: {cfg.name} needs >= 2 responses per group, got shape {tuple(r.shape)}")

    if cfg.baseline == "group":
        centred = r - r.mean(dim=1, keepdim=True)
    elif cfg.baseline == "loo":
        loo_mean = (r.sum(dim=1, keepdim=True) - r) / (n - 1)
        centred = r - loo_mean
    elif cfg.baseline == "batch":
        centred = r - r.mean()
    elif cfg.baseline == "none":
        centred = r.clone()
    else:
        raise ValueError(f"advantage baseline {cfg.baseline!r} is not group, loo, batch or none")

    if cfg.baseline in ("group", "loo"):
        # Exact zeros for constant groups: mean() of equal floats can round off by an ulp.
        constant = (r.max(dim=1, keepdim=True).values - r.min(dim=1, keepdim=True).values) == 0
        centred = torch.where(constant, torch.zeros_like(centred), centred)

    if cfg.std_norm == "group":
        centred = centred / (r.std(dim=1, keepdim=True, unbiased=False) + ADV_EPS)
    elif cfg.std_norm == "batch":
        centred = centred / (r.std(unbiased=False) + ADV_EPS)
    elif cfg.std_norm != "none":
        raise ValueError(f"advantage std normalization {cfg.std_norm!r} is not group, batch or none")
    return centred.to(torch.float32)


def _ragged_advantages(r: torch.Tensor, cfg: AlgorithmConfig, group_sizes: Sequence[int] | None) -> torch.Tensor:
    """compute_advantages over groups of varying size: r [N] flat (group-major), group_sizes [G]."""
    if group_sizes is None:
        raise ValueError(f"rewards: expected shape [groups, samples_per_prompt], got {tuple(r.shape)}; "
                         "flat rewards need group_sizes (samples per group, group-major)")
    sizes = torch.as_tensor(list(group_sizes), dtype=torch.long)
    if sizes.numel() == 0 or (sizes < 1).any() or int(sizes.sum()) != r.numel():
        raise ValueError(f"group_sizes: {sizes.tolist()} must be >= 1 each and sum to the {r.numel()} rewards")
    _check_finite(r, "rewards")
    if cfg.baseline in ("group", "loo") and (sizes < 2).any():
        raise ValueError(f"rewards: {cfg.name} needs >= 2 samples per group, got group sizes {sizes.tolist()}")
    r = r.to(torch.float64)
    gid = torch.repeat_interleave(torch.arange(sizes.numel()), sizes)  # [N]: each sample's group
    n = sizes.to(torch.float64)
    sums = torch.zeros(sizes.numel(), dtype=torch.float64).index_add_(0, gid, r)
    mean = (sums / n)[gid]

    if cfg.baseline == "group":
        centred = r - mean
    elif cfg.baseline == "loo":
        centred = r - (sums[gid] - r) / (n[gid] - 1)
    elif cfg.baseline == "batch":
        centred = r - r.mean()
    elif cfg.baseline == "none":
        centred = r.clone()
    else:
        raise ValueError(f"advantage baseline {cfg.baseline!r} is not group, loo, batch or none")

    if cfg.baseline in ("group", "loo"):  # exact zeros for constant groups, as in the [G, n] path
        big = torch.full((sizes.numel(),), -torch.inf, dtype=torch.float64).scatter_reduce(0, gid, r, "amax")
        small = torch.full((sizes.numel(),), torch.inf, dtype=torch.float64).scatter_reduce(0, gid, r, "amin")
        centred = torch.where((big == small)[gid], torch.zeros_like(centred), centred)

    if cfg.std_norm == "group":
        var = torch.zeros_like(sums).index_add_(0, gid, (r - mean) ** 2) / n  # population variance per group
        centred = centred / (var.sqrt()[gid] + ADV_EPS)
    elif cfg.std_norm == "batch":
        centred = centred / (r.std(unbiased=False) + ADV_EPS)
    elif cfg.std_norm != "none":
        raise ValueError(f"advantage std normalization {cfg.std_norm!r} is not group, batch or none")
    return centred.to(torch.float32)


# ---------------------------------------------------------------------------------------------
# Token level
# ---------------------------------------------------------------------------------------------


def broadcast_to_tokens(seq_values, loss_mask: torch.Tensor, seq_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Give every loss token its sequence's value: out[i, t] = v[i] * mask[i, t].

    Padded batch: loss_mask [N, T], seq_values [N] (e.g. compute_advantages(...).flatten(), in the same
    order as the rows). Packed batch: loss_mask [L] with seq_ids [L] (sequence index 0..N-1 per token).
    """
    v = _as_tensor(seq_values, "seq_values").flatten()
    mask = loss_mask.bool()
    if seq_ids is None:
        if mask.dim() != 2 or mask.shape[0] != v.shape[0]:
            raise ValueError(f"loss_mask: expected [N={v.shape[0]}, T] for {v.shape[0]} sequence values, got {tuple(mask.shape)}")
        return torch.where(mask, v[:, None].to(mask.device), torch.zeros((), dtype=v.dtype, device=mask.device))
    if seq_ids.shape != mask.shape or mask.dim() != 1:
        raise ValueError(f"seq_ids: shape {tuple(seq_ids.shape)} must equal the packed loss_mask shape {tuple(mask.shape)}")
    if seq_ids.numel() and (seq_ids.min() < 0 or seq_ids.max() >= v.shape[0]):
        raise ValueError(f"seq_ids: values must lie in 0..{v.shape[0] - 1}, got {int(seq_ids.min())}..{int(seq_ids.max())}")
    return torch.where(mask, v.to(mask.device)[seq_ids.long()], torch.zeros((), dtype=v.dtype, device=mask.device))


def discounted_token_returns(token_rewards: torch.Tensor, loss_mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = sum_{s >= t, mask_s} gamma^(k(s) - k(t)) r_s over the loss tokens of each row ([N, T]).

    k counts loss tokens only, so tool/feedback tokens (mask 0) neither discount nor earn.
    """
    mask = loss_mask.bool()
    out = torch.zeros_like(token_rewards, dtype=torch.float64)
    running = torch.zeros(token_rewards.shape[0], dtype=torch.float64, device=token_rewards.device)
    for t in range(token_rewards.shape[1] - 1, -1, -1):
        m = mask[:, t]
        running = torch.where(m, token_rewards[:, t].to(torch.float64) + gamma * running, running)
        out[:, t] = torch.where(m, running, torch.zeros_like(running))
    return out


def compute_token_advantages(
    rewards: torch.Tensor, loss_mask: torch.Tensor, cfg: AlgorithmConfig, *, kl: torch.Tensor | None = None,
    group_sizes: Sequence[int] | None = None,
) -> torch.Tensor:
    """Token advantages [N, T] for shaped rewards [G, n]; rows of loss_mask in group-major order (g*n + i).
    Ragged groups: rewards flat [N] with `group_sizes` (see compute_advantages).

    Every estimator but reinforce++ with per-token terms is `broadcast_to_tokens(compute_advantages(r))`.
    reinforce++ with the KL in the reward (cfg.kl_in_reward; `kl` = per-token log pi_old - log pi_ref,
    [N, T]) or gamma < 1 (REINFORCE++, Hu 2025):
        r_t = -reward_scaling * kl_coef * kl_t,  plus the sequence reward at the last loss token;
        G_t = discounted return;  A_t = (G_t - mean(G)) / (std(G) + eps), over all loss tokens of the batch.
    The KL term is in raw-reward units (scaled like the reward), so kl_coef trades KL against the raw
    reward whatever algorithm.rewardScaling is.
    Then, with cfg.batch_adv_norm (AReaL's adv_norm {mean_level: batch, std_level: batch}):
        A_t = (A_t - mean(A)) / (std(A) + eps), mean and population std over all loss tokens of the batch.
    """
    adv = _token_advantages(rewards, loss_mask, cfg, kl=kl, group_sizes=group_sizes)
    if cfg.batch_adv_norm:
        adv = batch_normalize_advantages(adv, loss_mask)
    return adv


def batch_normalize_advantages(advantages: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """(A - mean) / (std + eps) over the loss tokens of the whole batch (token-weighted, population std);
    0 where loss_mask is 0. Computed in float64, returned as float32."""
    mask = loss_mask.bool()
    if advantages.shape != mask.shape:
        raise ValueError(f"advantages: shape {tuple(advantages.shape)} differs from loss_mask {tuple(mask.shape)}")
    a = advantages.to(torch.float64)
    valid = a[mask]
    if valid.numel() == 0:
        return torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    out = (a - valid.mean()) / (valid.std(unbiased=False) + ADV_EPS)
    return torch.where(mask, out, 0.0).to(torch.float32)


def _token_advantages(
    rewards: torch.Tensor, loss_mask: torch.Tensor, cfg: AlgorithmConfig, *, kl: torch.Tensor | None = None,
    group_sizes: Sequence[int] | None = None,
) -> torch.Tensor:
    r = _as_tensor(rewards, "rewards")
    mask = loss_mask.bool()
    if mask.dim() != 2 or mask.shape[0] != r.numel():
        raise ValueError(f"loss_mask: expected [N={r.numel()}, T] rows in group-major order, got {tuple(mask.shape)}")
    token_level = cfg.estimator == "reinforce++" and (cfg.kl_in_reward or cfg.gamma < 1.0)
    if not token_level:
        return broadcast_to_tokens(compute_advantages(r, cfg, group_sizes).flatten(), mask)

    if cfg.kl_in_reward and kl is None:
        raise ValueError("kl: reinforce++ with algorithm.klCoef > 0 puts the KL in the reward; pass per-token kl")
    _check_finite(r, "rewards")
    token_rewards = torch.zeros(mask.shape, dtype=torch.float64, device=mask.device)
    if cfg.kl_in_reward:
        if kl.shape != mask.shape:
            raise ValueError(f"kl: shape {tuple(kl.shape)} differs from loss_mask {tuple(mask.shape)}")
        # In the reward's units: the shaped reward is scaled by reward_scaling, so is its KL penalty.
        token_rewards -= cfg.reward_scaling * cfg.kl_coef * torch.where(mask, kl.detach().to(torch.float64), 0.0)
    # The sequence reward lands on each row's last loss token.
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(mask, positions, -1).max(dim=1).values
    rows = torch.nonzero(last >= 0).flatten()
    token_rewards[rows, last[rows]] += r.flatten().to(torch.float64).to(mask.device)[rows]
    returns = discounted_token_returns(token_rewards, mask, cfg.gamma)
    valid = returns[mask]
    if valid.numel() == 0:
        return torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    adv = returns - valid.mean()
    if cfg.std_norm != "none":
        adv = adv / (valid.std(unbiased=False) + ADV_EPS)
    return torch.where(mask, adv, 0.0).to(torch.float32)


def gae(
    rewards: torch.Tensor, values: torch.Tensor, loss_mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation (Schulman et al. 2016) over the loss tokens of each row ([N, T]).

    delta_t = r_t + gamma * V_{t'} - V_t   (t' = the next loss token, V = 0 after the last one)
    A_t = delta_t + gamma * lam * A_{t'};  returns_t = A_t + V_t.  Zero where loss_mask is 0.
    Ready for `ppo` once the trainer has a critic; resolve_algorithm refuses ppo until then.
    """
    if not (rewards.shape == values.shape == loss_mask.shape) or rewards.dim() != 2:
        raise ValueError(f"gae: rewards {tuple(rewards.shape)}, values {tuple(values.shape)} and loss_mask {tuple(loss_mask.shape)} "
                         "must share one [N, T] shape")
    mask = loss_mask.bool()
    r, v = rewards.detach().to(torch.float64), values.detach().to(torch.float64)
    adv = torch.zeros_like(r)
    next_value = torch.zeros(r.shape[0], dtype=torch.float64, device=r.device)
    last_gae = torch.zeros_like(next_value)
    for t in range(r.shape[1] - 1, -1, -1):
        m = mask[:, t]
        delta = r[:, t] + gamma * next_value - v[:, t]
        candidate = delta + gamma * lam * last_gae
        last_gae = torch.where(m, candidate, last_gae)
        next_value = torch.where(m, v[:, t], next_value)
        adv[:, t] = torch.where(m, candidate, torch.zeros_like(candidate))
    returns = torch.where(mask, adv + v, 0.0)
    return adv.to(rewards.dtype), returns.to(rewards.dtype)


def group_rewards(rewards: Sequence[Sequence[float]]) -> torch.Tensor:
    """[G, n] float32 tensor from per-group reward lists; every group must have the same size."""
    sizes = {len(g) for g in rewards}
    if len(sizes) > 1:
        raise ValueError(f"rewards: groups have different sizes {sorted(sizes)}; advantages need equal groups")
    return torch.tensor([list(map(float, g)) for g in rewards], dtype=torch.float32)
