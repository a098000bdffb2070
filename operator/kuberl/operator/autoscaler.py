"""Rollout autoscaling decisions from the trainer's bus signals: pure, one rule after another.

The kopf timer (O2) reads the bus `progress` key, calls `decide_replicas`, applies
`build_rollout_statefulset(exp, replicas=decision.replicas)` when `decision.changed`, sets
status.lastScaleTime, and emits `decision.reason` / `decision.message` as the event.

Rules, in order (the first that holds decides):
1. disabled -> keep the current count;
2. current outside [minReplicas, maxReplicas] -> clamp at once (no cooldown: the spec demands it);
3. no fresh signal from the trainer -> hold;
4. within cooldownSeconds of the last change -> hold;
5. rollout outpaces training: more ready groups wait than the staleness bound lets the trainer use,
   groups_buffered > (eta + 1) * B, and the trainer hardly waits -> remove one replica;
6. the trainer starves: trainer_wait_fraction >= up_wait_fraction and fewer than B groups wait ->
   add replicas so generation covers the waiting time: ceil(current / (1 - w)), at least +1, at most x2;
7. otherwise hold.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from kuberl.api.v1alpha1 import AutoscalingSpec, RLExperiment


class ScaleReason(StrEnum):
    """Reason of a decision; ScaledUp/ScaledDown are also the event reasons (labels.EventReason)."""

    SCALED_UP = "ScaledUp"
    SCALED_DOWN = "ScaledDown"
    DISABLED = "AutoscalingDisabled"
    OUT_OF_BOUNDS = "OutOfBounds"  # clamped into [min, max]
    NO_SIGNAL = "NoSignal"  # no (fresh) progress from the trainer
    COOLDOWN = "Cooldown"
    AT_MAXIMUM = "AtMaximum"  # would scale up, already at maxReplicas
    AT_MINIMUM = "AtMinimum"  # would scale down, already at minReplicas
    BALANCED = "Balanced"


@dataclass(frozen=True)
class ScalePolicy:
    """Thresholds of the rules (defaults suit most runs)."""

    up_wait_fraction: float = 0.2  # trainer idle this share of the time waiting for groups -> more rollout
    down_wait_fraction: float = 0.05  # scale down only while the trainer waits less than this
    max_signal_age_seconds: float = 300.0  # progress older than this is no signal
    max_up_factor: float = 2.0  # at most double per decision


@dataclass(frozen=True)
class ScaleSignals:
    """What the trainer reports on the bus (`progress`), plus the staleness settings that bound it."""

    trainer_wait_fraction: float | None  # share of recent wall time the trainer waited for groups
    groups_buffered: int | None  # ready trajectory groups waiting in the stream
    batch_size: int  # B, groups per training step
    max_head_offpolicyness: int  # eta
    age_seconds: float | None = None  # how old the report is; None = unknown (taken as fresh)

    @classmethod
    def from_progress(cls, progress: Mapping[str, Any] | None, exp: RLExperiment, now: datetime | None = None) -> ScaleSignals:
        """Signals from the bus `progress` value (contracts.md); missing fields become None. With
        `now`, the report's age is known (from progress.time) and a stale report counts as no signal."""
        p = progress or {}
        wait = p.get("trainer_wait_fraction")
        buffered = p.get("groups_buffered")
        age = None
        if now is not None and isinstance(p.get("time"), (int, float)):
            age = _aware(now).timestamp() - float(p["time"])
        return cls(
            trainer_wait_fraction=float(wait) if isinstance(wait, (int, float)) and not isinstance(wait, bool) else None,
            groups_buffered=int(buffered) if isinstance(buffered, (int, float)) and not isinstance(buffered, bool) else None,
            batch_size=exp.spec.algorithm.batch_size,
            max_head_offpolicyness=exp.spec.staleness.max_head_offpolicyness,
            age_seconds=age,
        )

    @property
    def usable_groups(self) -> int:
        """(eta + 1) * B: the most groups the staleness bound lets the trainer use before newer ones are needed."""
        return (self.max_head_offpolicyness + 1) * self.batch_size


@dataclass(frozen=True)
class ScaleDecision:
    replicas: int
    reason: ScaleReason
    message: str  # explains the decision for the event
    current: int

    @property
    def changed(self) -> bool:
        return self.replicas != self.current


def _aware(when: datetime) -> datetime:
    return when if when.tzinfo is not None else when.replace(tzinfo=UTC)


def decide_replicas(
    spec_autoscaling: AutoscalingSpec,
    current: int,
    signals: ScaleSignals,
    last_scale_time: datetime | None,
    now: datetime,
    policy: ScalePolicy = ScalePolicy(),
) -> ScaleDecision:
    """How many rollout replicas to run now (module docstring: the rules)."""
    a = spec_autoscaling
    if current < 0:
        raise ValueError(f"current replicas must be >= 0, got {current}")

    def keep(reason: ScaleReason, message: str) -> ScaleDecision:
        return ScaleDecision(current, reason, message, current)

    if not a.enabled:
        return keep(ScaleReason.DISABLED, "rollout.autoscaling.enabled is false")
    if not a.min_replicas <= current <= a.max_replicas:
        target = min(max(current, a.min_replicas), a.max_replicas)
        reason = ScaleReason.SCALED_UP if target > current else ScaleReason.SCALED_DOWN
        return ScaleDecision(target, reason,
                             f"{current} replicas lie outside rollout.autoscaling {a.min_replicas}..{a.max_replicas}: scaled to {target}", current)
    w, buffered = signals.trainer_wait_fraction, signals.groups_buffered
    if w is None or buffered is None:
        return keep(ScaleReason.NO_SIGNAL, "the trainer has not reported trainer_wait_fraction and groups_buffered yet")
    if signals.age_seconds is not None and signals.age_seconds > policy.max_signal_age_seconds:
        return keep(ScaleReason.NO_SIGNAL, f"the trainer's last report is {signals.age_seconds:.0f} s old (limit {policy.max_signal_age_seconds:.0f} s)")
    if last_scale_time is not None:
        since = (_aware(now) - _aware(last_scale_time)).total_seconds()
        if since < a.cooldown_seconds:
            return keep(ScaleReason.COOLDOWN, f"last scaled {since:.0f} s ago; cooldownSeconds is {a.cooldown_seconds}")
    usable = signals.usable_groups
    state = f"trainer waits {w:.0%} of the time, {buffered} groups buffered"
    if buffered > usable and w < policy.down_wait_fraction:
        why = (f"{state}: more than the {usable} = (maxHeadOffpolicyness {signals.max_head_offpolicyness} + 1) x batchSize {signals.batch_size} "
               "the staleness bound lets the trainer use, so rollout outpaces training")
        if current <= a.min_replicas:
            return keep(ScaleReason.AT_MINIMUM, f"{why}; already at minReplicas {a.min_replicas}")
        return ScaleDecision(current - 1, ScaleReason.SCALED_DOWN, f"{why}: {current} -> {current - 1} replicas", current)
    if w >= policy.up_wait_fraction and buffered < signals.batch_size:
        why = f"{state} (fewer than one batch of {signals.batch_size}), so training starves for rollouts"
        if current >= a.max_replicas:
            return keep(ScaleReason.AT_MAXIMUM, f"{why}; already at maxReplicas {a.max_replicas}")
        # Generation must shrink the waiting share w to ~0: throughput x 1/(1 - w).
        wanted = math.ceil(current / max(1.0 - w, 1.0 / policy.max_up_factor)) if current else 1
        target = min(max(wanted, current + 1), math.ceil(max(current, 1) * policy.max_up_factor), a.max_replicas)
        return ScaleDecision(target, ScaleReason.SCALED_UP, f"{why}: {current} -> {target} replicas", current)
    return keep(ScaleReason.BALANCED, f"{state}: no change")


def signals_from_progress(exp: RLExperiment, progress: Mapping[str, Any] | None, now: datetime | None = None) -> ScaleSignals:
    """`ScaleSignals.from_progress`, experiment first (the handlers' spelling)."""
    return ScaleSignals.from_progress(progress, exp, now)
