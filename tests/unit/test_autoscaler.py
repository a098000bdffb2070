"""Specification of the rollout autoscaler: one class per rule of kuberl.operator.autoscaler."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from kuberl.api import RLExperiment
from kuberl.api.v1alpha1 import AutoscalingSpec
from kuberl.operator.autoscaler import (
    ScaleDecision,
    ScalePolicy,
    ScaleReason,
    ScaleSignals,
    decide_replicas,
    signals_from_progress,
)

NOW = datetime(2026, 11, 21, 20, 0, tzinfo=UTC)
AUTO = AutoscalingSpec(enabled=True, min_replicas=1, max_replicas=8, cooldown_seconds=120)
B, ETA = 32, 2  # usable groups = (2 + 1) * 32 = 96


def signals(wait: float | None = 0.1, buffered: int | None = 40, age: float | None = None) -> ScaleSignals:
    return ScaleSignals(trainer_wait_fraction=wait, groups_buffered=buffered, batch_size=B, max_head_offpolicyness=ETA, age_seconds=age)


def decide(current: int = 4, sig: ScaleSignals | None = None, auto: AutoscalingSpec = AUTO, last: datetime | None = None) -> ScaleDecision:
    return decide_replicas(auto, current, sig or signals(), last, NOW)


class TestDisabled:
    def test_a_disabled_autoscaler_never_changes_replicas(self) -> None:
        d = decide(3, signals(wait=0.9, buffered=0), auto=AutoscalingSpec(enabled=False))
        assert d.replicas == 3 and not d.changed and d.reason == ScaleReason.DISABLED


class TestBounds:
    def test_below_min_is_raised_to_min_at_once_even_in_cooldown(self) -> None:
        d = decide(0, auto=AutoscalingSpec(enabled=True, min_replicas=2, max_replicas=4), last=NOW - timedelta(seconds=1))
        assert d.replicas == 2 and d.reason == ScaleReason.SCALED_UP and "outside" in d.message

    def test_above_max_is_lowered_to_max(self) -> None:
        d = decide(9)
        assert d.replicas == 8 and d.reason == ScaleReason.SCALED_DOWN

    def test_a_negative_current_count_is_refused(self) -> None:
        with pytest.raises(ValueError, match="current replicas"):
            decide(-1)


class TestNoSignal:
    @pytest.mark.parametrize("sig", [signals(wait=None), signals(buffered=None)], ids=["no wait fraction", "no buffer count"])
    def test_missing_signals_hold(self, sig: ScaleSignals) -> None:
        d = decide(4, sig)
        assert not d.changed and d.reason == ScaleReason.NO_SIGNAL

    def test_a_stale_report_holds(self) -> None:
        d = decide(4, signals(wait=0.9, buffered=0, age=3600))
        assert not d.changed and d.reason == ScaleReason.NO_SIGNAL and "3600 s old" in d.message


class TestCooldown:
    def test_no_change_within_cooldown_of_the_last_one(self) -> None:
        d = decide(4, signals(wait=0.9, buffered=0), last=NOW - timedelta(seconds=60))
        assert not d.changed and d.reason == ScaleReason.COOLDOWN and "cooldownSeconds is 120" in d.message

    def test_after_the_cooldown_it_acts_again(self) -> None:
        assert decide(4, signals(wait=0.9, buffered=0), last=NOW - timedelta(seconds=121)).changed

    def test_naive_times_count_as_utc(self) -> None:
        d = decide_replicas(AUTO, 4, signals(wait=0.9, buffered=0), datetime(2026, 11, 21, 19, 59, 30), NOW)
        assert d.reason == ScaleReason.COOLDOWN


class TestScaleDownWhenRolloutOutpacesTraining:
    def test_more_buffered_groups_than_the_staleness_bound_can_use_removes_one_replica(self) -> None:
        d = decide(4, signals(wait=0.0, buffered=97))
        assert d.replicas == 3 and d.reason == ScaleReason.SCALED_DOWN
        assert "96 = (maxHeadOffpolicyness 2 + 1) x batchSize 32" in d.message

    def test_exactly_the_usable_amount_is_not_too_much(self) -> None:
        assert not decide(4, signals(wait=0.0, buffered=96)).changed

    def test_it_never_goes_below_min(self) -> None:
        d = decide(1, signals(wait=0.0, buffered=500))
        assert d.replicas == 1 and d.reason == ScaleReason.AT_MINIMUM

    def test_a_waiting_trainer_blocks_scaling_down(self) -> None:
        assert not decide(4, signals(wait=0.3, buffered=500)).changed


class TestScaleUpWhenTheTrainerStarves:
    def test_a_trainer_waiting_half_the_time_doubles_generation(self) -> None:
        d = decide(2, signals(wait=0.5, buffered=3))
        assert d.replicas == 4 and d.reason == ScaleReason.SCALED_UP and "waits 50%" in d.message

    def test_a_small_wait_adds_at_least_one_replica(self) -> None:
        assert decide(4, signals(wait=0.2, buffered=0)).replicas == 5

    def test_a_huge_wait_at_most_doubles(self) -> None:
        assert decide(3, signals(wait=0.99, buffered=0)).replicas == 6

    def test_it_never_exceeds_max(self) -> None:
        assert decide(6, signals(wait=0.9, buffered=0)).replicas == 8
        d = decide(8, signals(wait=0.9, buffered=0))
        assert not d.changed and d.reason == ScaleReason.AT_MAXIMUM

    def test_from_zero_it_starts_one(self) -> None:
        assert decide(0, signals(wait=0.9, buffered=0), auto=AutoscalingSpec(enabled=True, min_replicas=0, max_replicas=4)).replicas == 1

    def test_a_full_batch_waiting_means_the_wait_is_not_rollouts_fault(self) -> None:
        assert not decide(4, signals(wait=0.5, buffered=B)).changed

    def test_the_threshold_is_a_policy(self) -> None:
        assert not decide_replicas(AUTO, 4, signals(wait=0.2, buffered=0), None, NOW, ScalePolicy(up_wait_fraction=0.3)).changed


class TestBalanced:
    def test_a_modest_wait_and_buffer_hold(self) -> None:
        d = decide(4, signals(wait=0.1, buffered=40))
        assert not d.changed and d.reason == ScaleReason.BALANCED


class TestSignalsFromProgress:
    def make(self) -> RLExperiment:
        return RLExperiment.model_validate({
            "metadata": {"name": "e"},
            "spec": {"model": {"builtin": "tiny-qwen2"}, "dataset": {"builtin": "add-small"}, "algorithm": {"batchSize": 16},
                     "staleness": {"maxHeadOffpolicyness": 1}},
        })  # fmt: skip

    def test_signals_come_from_the_progress_key_and_the_spec(self) -> None:
        sig = signals_from_progress(self.make(), {"trainer_wait_fraction": 0.4, "groups_buffered": 7, "time": NOW.timestamp() - 30}, NOW)
        assert (sig.trainer_wait_fraction, sig.groups_buffered, sig.usable_groups) == (0.4, 7, 32)
        assert sig.age_seconds == pytest.approx(30)

    def test_missing_or_malformed_fields_become_no_signal(self) -> None:
        sig = ScaleSignals.from_progress({"trainer_wait_fraction": "lots", "groups_buffered": True}, self.make())
        assert sig.trainer_wait_fraction is None and sig.groups_buffered is None and sig.age_seconds is None
        assert decide_replicas(AUTO, 3, sig, None, NOW).reason == ScaleReason.NO_SIGNAL
        assert ScaleSignals.from_progress(None, self.make()).groups_buffered is None
