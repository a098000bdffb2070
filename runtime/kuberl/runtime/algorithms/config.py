"""AlgorithmConfig: an `AlgorithmSpec` with its algorithm's preset applied, ready for the tensor functions.

`resolve_algorithm(spec)` is called once by the trainer (and by `kuberl run`'s checks); the result is a
frozen dataclass that `advantages.py` and `losses.py` read. Imports neither torch nor kopf.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

from kuberl.api.v1alpha1 import AlgorithmName, AlgorithmSpec, OverlongPenaltySpec

Estimator = Literal["grpo", "drgrpo", "rloo", "reinforce++", "liteppo"]
Baseline = Literal["group", "loo", "batch", "none"]
StdNorm = Literal["group", "batch", "none"]
Aggregation = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
RatioLevel = Literal["token", "sequence"]
KLKind = Literal["k1", "k2", "k3"]

AGGREGATIONS: tuple[str, ...] = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")

# Presets from the papers, used where the spec leaves a field at its API default.
PPO_EPS = 0.4  # AReaL's GSM8K GRPO example (eps_clip 0.4): the default of every other algorithm
DAPO_EPS_LOW, DAPO_EPS_HIGH = 0.2, 0.28  # DAPO (Yu et al. 2025), section 3.1
GSPO_EPS_LOW, GSPO_EPS_HIGH = 3e-4, 4e-4  # GSPO (Zheng et al. 2025), section 5.1


@dataclass(frozen=True)
class AlgorithmConfig:
    """Everything the advantage and loss functions need; every algorithm is one setting of these fields."""

    name: str
    """The algorithm this was resolved from (grpo, drgrpo, dapo, gspo, rloo, reinforce++, liteppo)."""
    group_size: int
    """Responses per prompt, n (algorithm.samplesPerPrompt)."""
    # --- rewards -----------------------------------------------------------------------------
    reward_bias: float
    reward_scaling: float
    """Shaped reward r' = (r + overlong(len) + bias) * scaling."""
    overlong_penalty: bool
    overlong_buffer: int
    overlong_penalty_factor: float
    max_new_tokens: int
    """L_max of the overlong ramp and the constant of Dr.GRPO's normalizer."""
    # --- advantages --------------------------------------------------------------------------
    estimator: Estimator
    baseline: Baseline
    """What is subtracted: group mean, leave-one-out mean, batch mean, or nothing."""
    std_norm: StdNorm
    """What the centred rewards are divided by: group std, batch std, or nothing."""
    gamma: float
    """Discount over tokens for returns built from per-token rewards (reinforce++ with KL in the reward)."""
    batch_adv_norm: bool
    """After the estimator: whiten the token advantages over all loss tokens of the batch (AReaL adv_norm batch/batch)."""
    # --- loss --------------------------------------------------------------------------------
    aggregation: Aggregation
    ratio_level: RatioLevel
    eps_low: float
    eps_high: float
    decoupled: bool
    """Clip against pi_prox and weight by pi_prox/pi_behave (AReaL); off: pi_prox = pi_behave (standard PPO)."""
    behavior_weight_cap: float | None
    behavior_weight_mode: Literal["cap", "mask"]
    kl_coef: float
    kl_in_reward: bool
    """reinforce++: the KL to the reference goes into the per-token reward (k1), not into the loss."""
    kl_kind: KLKind
    # --- sampling ----------------------------------------------------------------------------
    dynamic_sampling: bool
    """Reject groups whose rewards are all equal (DAPO); they carry no learning signal."""
    notes: tuple[str, ...] = field(default=())
    """What the preset changed relative to the spec, for the trainer to log once."""

    @property
    def kl_in_loss(self) -> bool:
        return self.kl_coef > 0 and not self.kl_in_reward

    def replace(self, **changes) -> AlgorithmConfig:
        """A copy with some fields changed, checked like a resolved config (tests, ablations)."""
        new = dataclasses.replace(self, **changes)
        _check(new)
        return new


def resolve_algorithm(spec: AlgorithmSpec) -> AlgorithmConfig:
    """Apply the named algorithm's preset to the spec.

    Presets only fill fields the manifest leaves unset (epsClip, epsClipHigh, dynamicSampling,
    overlongPenalty.enabled: e.g. DAPO's clip 0.2/0.28), so an explicit value always wins, except where a
    setting *is* the algorithm (Dr.GRPO and RLOO never divide by a std; GSPO's ratio is per sequence).
    Raises ValueError naming the field for combinations that cannot run.
    """
    if not isinstance(spec, AlgorithmSpec):
        raise TypeError(f"resolve_algorithm needs an AlgorithmSpec, got {type(spec).__name__}")
    name = AlgorithmName(spec.name).value
    notes: list[str] = []
    # `ppo` (with a value critic) never gets here: AlgorithmSpec refuses it (PPO_UNSUPPORTED); gae() in
    # advantages.py is ready for when the trainer has a critic.

    eps_low = spec.eps_clip if spec.eps_clip is not None else PPO_EPS
    eps_high = spec.eps_clip_high if spec.eps_clip_high is not None else eps_low
    estimator: Estimator = "grpo"
    baseline: Baseline = "group"
    std_norm: StdNorm = "group" if spec.normalize_advantages else "none"
    aggregation: Aggregation = "token-mean"
    ratio_level: RatioLevel = "token"
    dynamic = bool(spec.dynamic_sampling)
    overlong: OverlongPenaltySpec = spec.overlong_penalty.model_copy(update={"enabled": bool(spec.overlong_penalty.enabled)})
    kl_in_reward = False
    kl_kind: KLKind = "k3"

    if name == AlgorithmName.DRGRPO:
        estimator, std_norm, aggregation = "drgrpo", "none", "seq-mean-token-sum-norm"
        if spec.normalize_advantages:
            notes.append("drgrpo: advantages are not divided by the group std (algorithm.normalizeAdvantages ignored)")
    elif name == AlgorithmName.DAPO:
        if spec.eps_clip is None:
            eps_low = DAPO_EPS_LOW
        if spec.eps_clip_high is None:
            eps_high = DAPO_EPS_HIGH if spec.eps_clip is None else eps_low * DAPO_EPS_HIGH / DAPO_EPS_LOW
        notes.append(f"dapo: clip-higher epsClip={eps_low:g}, epsClipHigh={eps_high:g} (unset values: DAPO's 0.2 and 0.28, or epsClip * 1.4)")
        if spec.dynamic_sampling is None:
            dynamic = True
            notes.append("dapo: dynamic sampling on (set algorithm.dynamicSampling false to turn it off)")
        if spec.overlong_penalty.enabled is None:
            overlong = overlong.model_copy(update={"enabled": True})
            notes.append(f"dapo: overlong penalty on (buffer {overlong.buffer_tokens} tokens, penalty {overlong.penalty})")
    elif name == AlgorithmName.GSPO:
        ratio_level, aggregation = "sequence", "seq-mean-token-mean"
        if spec.eps_clip is None:
            eps_low = GSPO_EPS_LOW
        if spec.eps_clip_high is None:
            eps_high = GSPO_EPS_HIGH if spec.eps_clip is None else eps_low
        notes.append(f"gspo: sequence-ratio clip epsClip={eps_low:g}, epsClipHigh={eps_high:g}")
    elif name == AlgorithmName.RLOO:
        estimator, baseline, std_norm = "rloo", "loo", "none"
        if spec.normalize_advantages:
            notes.append("rloo: leave-one-out advantages are not divided by a std (algorithm.normalizeAdvantages ignored)")
    elif name == AlgorithmName.REINFORCE_PP:
        estimator, baseline = "reinforce++", "batch"
        std_norm = "batch" if spec.normalize_advantages else "none"
        if spec.kl_coef > 0:
            kl_in_reward, kl_kind = True, "k1"
    elif name == AlgorithmName.LITEPPO:
        estimator, baseline = "liteppo", "group"
        std_norm = "batch" if spec.normalize_advantages else "none"

    if overlong.enabled and overlong.buffer_tokens > spec.max_new_tokens and overlong.buffer_tokens == OverlongPenaltySpec().buffer_tokens:
        # The default ramp (64 tokens) does not fit short generations; keep DAPO's proportion L_cache = L_max / 5.
        overlong = overlong.model_copy(update={"buffer_tokens": max(1, spec.max_new_tokens // 5)})
        notes.append(f"overlong penalty: bufferTokens {overlong.buffer_tokens} (maxNewTokens / 5; the default 64 exceeds maxNewTokens)")

    cfg = AlgorithmConfig(
        name=name,
        group_size=spec.samples_per_prompt,
        reward_bias=spec.reward_bias,
        reward_scaling=spec.reward_scaling,
        overlong_penalty=overlong.enabled,
        overlong_buffer=overlong.buffer_tokens,
        overlong_penalty_factor=overlong.penalty,
        max_new_tokens=spec.max_new_tokens,
        estimator=estimator,
        baseline=baseline,
        std_norm=std_norm,
        gamma=spec.gamma,
        batch_adv_norm=spec.batch_advantage_norm,
        aggregation=aggregation,
        ratio_level=ratio_level,
        eps_low=eps_low,
        eps_high=eps_high,
        decoupled=spec.decoupled_loss,
        behavior_weight_cap=spec.behavior_weight_cap,
        behavior_weight_mode=spec.behavior_weight_mode,
        kl_coef=spec.kl_coef,
        kl_in_reward=kl_in_reward,
        kl_kind=kl_kind,
        dynamic_sampling=dynamic,
        notes=tuple(notes),
    )
    _check(cfg)
    return cfg


def _check(cfg: AlgorithmConfig) -> None:
    """Cross-field rules of a resolved config; errors name the manifest field."""
    if cfg.aggregation not in AGGREGATIONS:
        raise ValueError(f"loss aggregation {cfg.aggregation!r} is not one of {', '.join(AGGREGATIONS)}")
    if cfg.ratio_level not in ("token", "sequence"):
        raise ValueError(f"ratio level {cfg.ratio_level!r} is not token or sequence")
    if cfg.estimator in ("grpo", "drgrpo", "rloo", "liteppo") and cfg.group_size < 2:
        raise ValueError(f"algorithm.samplesPerPrompt {cfg.group_size}: {cfg.name} compares responses within a group, needs >= 2")
    if cfg.baseline == "loo" and cfg.group_size < 2:
        raise ValueError(f"algorithm.samplesPerPrompt {cfg.group_size}: leave-one-out needs >= 2")
    if cfg.eps_low <= 0 or cfg.eps_high < cfg.eps_low:
        raise ValueError(f"algorithm.epsClipHigh {cfg.eps_high} must be >= algorithm.epsClip {cfg.eps_low} > 0")
    if cfg.behavior_weight_cap is not None and cfg.behavior_weight_cap <= 1:
        raise ValueError(f"algorithm.behaviorWeightCap {cfg.behavior_weight_cap} must be > 1")
    if cfg.behavior_weight_mode not in ("cap", "mask"):
        raise ValueError(f"algorithm.behaviorWeightMode {cfg.behavior_weight_mode!r} is not cap or mask")
    if cfg.overlong_penalty and cfg.overlong_buffer > cfg.max_new_tokens:
        raise ValueError(
            f"algorithm.overlongPenalty.bufferTokens {cfg.overlong_buffer} exceeds algorithm.maxNewTokens {cfg.max_new_tokens}"
        )
    if cfg.kl_kind not in ("k1", "k2", "k3"):
        raise ValueError(f"KL estimator {cfg.kl_kind!r} is not k1, k2 or k3")
    if not 0.0 <= cfg.gamma <= 1.0:
        raise ValueError(f"algorithm.gamma {cfg.gamma} must lie in [0, 1]")
