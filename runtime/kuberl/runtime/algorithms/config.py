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
    # `ppo` (with a value critic) never gets here: AlgorithmSpec refuses it (PPO_UNSUPPORTED); gae() in
    # advantages.py is ready for when the trainer has a critic.
    p = _Preset.of(spec)
    preset = _PRESETS.get(AlgorithmName(name))
    if preset is not None:
        preset(spec, p)
    _fit_overlong_buffer(spec, p)

    cfg = AlgorithmConfig(
        name=name,
        group_size=spec.samples_per_prompt,
        reward_bias=spec.reward_bias,
        reward_scaling=spec.reward_scaling,
        overlong_penalty=p.overlong.enabled,
        overlong_buffer=p.overlong.buffer_tokens,
        overlong_penalty_factor=p.overlong.penalty,
        max_new_tokens=spec.max_new_tokens,
        estimator=p.estimator,
        baseline=p.baseline,
        std_norm=p.std_norm,
        gamma=spec.gamma,
        batch_adv_norm=spec.batch_advantage_norm,
        aggregation=p.aggregation,
        ratio_level=p.ratio_level,
        eps_low=p.eps_low,
        eps_high=p.eps_high,
        decoupled=spec.decoupled_loss,
        behavior_weight_cap=spec.behavior_weight_cap,
        behavior_weight_mode=spec.behavior_weight_mode,
        kl_coef=spec.kl_coef,
        kl_in_reward=p.kl_in_reward,
        kl_kind=p.kl_kind,
        dynamic_sampling=p.dynamic,
        notes=tuple(p.notes),
    )
    _check(cfg)
    return cfg


@dataclass
class _Preset:
    """The fields a named algorithm may set, starting from the spec (GRPO's settings where it says nothing)."""

    eps_low: float
    eps_high: float
    dynamic: bool
    overlong: OverlongPenaltySpec
    std_norm: StdNorm
    estimator: Estimator = "grpo"
    baseline: Baseline = "group"
    aggregation: Aggregation = "token-mean"
    ratio_level: RatioLevel = "token"
    kl_in_reward: bool = False
    kl_kind: KLKind = "k3"
    notes: list[str] = field(default_factory=list)

    @classmethod
    def of(cls, spec: AlgorithmSpec) -> _Preset:
        eps_low = spec.eps_clip if spec.eps_clip is not None else PPO_EPS
        return cls(
            eps_low=eps_low,
            eps_high=spec.eps_clip_high if spec.eps_clip_high is not None else eps_low,
            dynamic=bool(spec.dynamic_sampling),
            overlong=spec.overlong_penalty.model_copy(update={"enabled": bool(spec.overlong_penalty.enabled)}),
            std_norm="group" if spec.normalize_advantages else "none",
        )


def _drgrpo(spec: AlgorithmSpec, p: _Preset) -> None:
    p.estimator, p.std_norm, p.aggregation = "drgrpo", "none", "seq-mean-token-sum-norm"
    if spec.normalize_advantages:
        p.notes.append("drgrpo: advantages are not divided by the group std (algorithm.normalizeAdvantages ignored)")


def _dapo(spec: AlgorithmSpec, p: _Preset) -> None:
    if spec.eps_clip is None:
        p.eps_low = DAPO_EPS_LOW
    if spec.eps_clip_high is None:
        p.eps_high = DAPO_EPS_HIGH if spec.eps_clip is None else p.eps_low * DAPO_EPS_HIGH / DAPO_EPS_LOW
    p.notes.append(f"dapo: clip-higher epsClip={p.eps_low:g}, epsClipHigh={p.eps_high:g} (unset values: DAPO's 0.2 and 0.28, or epsClip * 1.4)")
    if spec.dynamic_sampling is None:
        p.dynamic = True
        p.notes.append("dapo: dynamic sampling on (set algorithm.dynamicSampling false to turn it off)")
    if spec.overlong_penalty.enabled is None:
        p.overlong = p.overlong.model_copy(update={"enabled": True})
        p.notes.append(f"dapo: overlong penalty on (buffer {p.overlong.buffer_tokens} tokens, penalty {p.overlong.penalty})")


def _gspo(spec: AlgorithmSpec, p: _Preset) -> None:
    p.ratio_level, p.aggregation = "sequence", "seq-mean-token-mean"
    if spec.eps_clip is None:
        p.eps_low = GSPO_EPS_LOW
    if spec.eps_clip_high is None:
        p.eps_high = GSPO_EPS_HIGH if spec.eps_clip is None else p.eps_low
    p.notes.append(f"gspo: sequence-ratio clip epsClip={p.eps_low:g}, epsClipHigh={p.eps_high:g}")


def _rloo(spec: AlgorithmSpec, p: _Preset) -> None:
    p.estimator, p.baseline, p.std_norm = "rloo", "loo", "none"
    if spec.normalize_advantages:
        p.notes.append("rloo: leave-one-out advantages are not divided by a std (algorithm.normalizeAdvantages ignored)")


def _reinforce_pp(spec: AlgorithmSpec, p: _Preset) -> None:
    p.estimator, p.baseline = "reinforce++", "batch"
    p.std_norm = "batch" if spec.normalize_advantages else "none"
    if spec.kl_coef > 0:
        p.kl_in_reward, p.kl_kind = True, "k1"


def _liteppo(spec: AlgorithmSpec, p: _Preset) -> None:
    p.estimator, p.baseline = "liteppo", "group"
    p.std_norm = "batch" if spec.normalize_advantages else "none"


# What each named algorithm changes; grpo is the spec as it stands.
_PRESETS = {
    AlgorithmName.DRGRPO: _drgrpo,
    AlgorithmName.DAPO: _dapo,
    AlgorithmName.GSPO: _gspo,
    AlgorithmName.RLOO: _rloo,
    AlgorithmName.REINFORCE_PP: _reinforce_pp,
    AlgorithmName.LITEPPO: _liteppo,
}


def _fit_overlong_buffer(spec: AlgorithmSpec, p: _Preset) -> None:
    overlong = p.overlong
    if overlong.enabled and overlong.buffer_tokens > spec.max_new_tokens and overlong.buffer_tokens == OverlongPenaltySpec().buffer_tokens:
        # The default ramp (64 tokens) does not fit short generations; keep DAPO's proportion L_cache = L_max / 5.
        p.overlong = overlong.model_copy(update={"buffer_tokens": max(1, spec.max_new_tokens // 5)})
        p.notes.append(f"overlong penalty: bufferTokens {p.overlong.buffer_tokens} (maxNewTokens / 5; the default 64 exceeds maxNewTokens)")


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
