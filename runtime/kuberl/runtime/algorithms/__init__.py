"""Algorithms as configurations of one advantage/loss pipeline: GRPO, Dr.GRPO, DAPO, GSPO, RLOO, REINFORCE++, LitePPO.

Called by the trainer (runtime/trainer). `resolve_algorithm` and `AlgorithmConfig` load without torch; the
tensor functions import torch on first use (AReaL's lazy `areal/api/__init__.py` pattern).

The API the trainer codes against:

    cfg = resolve_algorithm(exp.spec.algorithm)        # AlgorithmConfig, frozen; ValueError names the field
    for note in cfg.notes: log.info(note)              # what the preset changed (e.g. DAPO's clip 0.2/0.28)

    # Rollout side or trainer: DAPO dynamic sampling (cfg.dynamic_sampling) on one group's raw rewards [n]
    keep = dynamic_sampling_keep(group_rewards)        # False -> reject the group, give its ticket back

    r = shape_rewards(raw [G, n], lengths [G, n] | None, cfg)   # (r + overlong(len) + bias) * scaling
    adv_seq = compute_advantages(r, cfg)               # [G, n], per cfg.baseline / cfg.std_norm
    adv_tok = broadcast_to_tokens(adv_seq.flatten(), loss_mask [N, T])           # rows in group-major order
    #   or, in one call that also covers reinforce++ with the KL in the reward (cfg.kl_in_reward):
    adv_tok = compute_token_advantages(r, loss_mask, cfg, kl=logp_old - ref_logp if cfg.kl_in_reward else None)

    D = loss_denominator(minibatch_loss_mask, cfg)     # once per minibatch, shared by its micro-batches
    loss, stats = ppo_actor_loss(logp, proximal_logp, behavior_logp, adv_tok, loss_mask, cfg,
                                 seq_ids=None, ref_logp=ref_logp if cfg.kl_in_loss else None, denominator=D)
    loss.backward()                                    # micro-batch losses sum to the minibatch loss

Presets (resolve_algorithm):
| name        | advantage                         | loss aggregation        | ratio    | extras                                  |
|-------------|-----------------------------------|-------------------------|----------|-----------------------------------------|
| grpo        | (r - group mean) / group std      | token-mean              | token    | KL (k3) in the loss when klCoef > 0     |
| drgrpo      | r - group mean (no std)           | seq-mean-token-sum-norm | token    | normalizer = sequences * maxNewTokens   |
| dapo        | as grpo                           | token-mean              | token    | clip 0.2/0.28, dynamic sampling, overlong penalty |
| gspo        | as grpo                           | seq-mean-token-mean     | sequence | clip 3e-4/4e-4                          |
| rloo        | r - mean of the other n-1         | token-mean              | token    | no std                                  |
| reinforce++ | (r - batch mean) / batch std      | token-mean              | token    | KL (k1) in the per-token reward         |
| liteppo     | (r - group mean) / batch std      | token-mean              | token    | "Tricks or Traps" (Liu et al. 2025)     |
| ppo         | GAE with a critic: `advantages.gae` exists, but resolve_algorithm refuses ppo (no critic in the trainer yet) |
Preset numbers fill only fields left at their API default; AReaL's reward bias/scaling (-0.5, x10), the
decoupled objective and the behaviour-weight cap apply to all. Advantages are in shaped-reward units where
no std divides them: rewardScaling scales drgrpo and rloo advantages (and so the step; set rewardScaling 1
for the papers' scale). REINFORCE++'s KL-in-reward is scaled like the reward, so klCoef trades KL against
the raw reward whatever rewardScaling is. algorithm.batchAdvantageNorm whitens the resulting token
advantages over the batch after any estimator (AReaL's adv_norm batch/batch, on in examples/gsm8k-grpo.yaml).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from kuberl.runtime.algorithms.config import AlgorithmConfig, resolve_algorithm

_LAZY = {
    "shape_rewards": "advantages",
    "overlong_penalty": "advantages",
    "compute_advantages": "advantages",
    "compute_token_advantages": "advantages",
    "broadcast_to_tokens": "advantages",
    "discounted_token_returns": "advantages",
    "dynamic_sampling_keep": "advantages",
    "group_rewards": "advantages",
    "gae": "advantages",
    "ppo_actor_loss": "losses",
    "kl_penalty": "losses",
    "loss_denominator": "losses",
}

__all__ = [
    "AlgorithmConfig",
    "broadcast_to_tokens",
    "compute_advantages",
    "compute_token_advantages",
    "discounted_token_returns",
    "dynamic_sampling_keep",
    "gae",
    "group_rewards",
    "kl_penalty",
    "loss_denominator",
    "overlong_penalty",
    "ppo_actor_loss",
    "resolve_algorithm",
    "shape_rewards",
]

if TYPE_CHECKING:
    from kuberl.runtime.algorithms.advantages import (
        broadcast_to_tokens,
        compute_advantages,
        compute_token_advantages,
        discounted_token_returns,
        dynamic_sampling_keep,
        gae,
        group_rewards,
        overlong_penalty,
        shape_rewards,
    )
    from kuberl.runtime.algorithms.losses import (
        kl_penalty,
        loss_denominator,
        ppo_actor_loss,
    )


def __getattr__(name: str):
    if name in _LAZY:
        module = importlib.import_module(f"kuberl.runtime.algorithms.{_LAZY[name]}")
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
