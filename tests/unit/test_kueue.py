"""Kueue's pure rules (issue 11, citizenship): a suspended queued experiment asks for no quota. Queueing, admission,
eviction, preemption and PodsReady run against Kueue's real manager on the real control plane
(tests/integration/test_operator_kueue_real.py), what a queued experiment's tick costs the API server and the
queue-label and managedBy rules in tests/integration/test_operator_kueue_ticks.py."""

from __future__ import annotations

from kuberl.api.v1alpha1 import RLExperiment
from kuberl.operator import kueue


def test_a_suspended_queued_experiment_asks_for_no_quota() -> None:
    exp = RLExperiment.model_validate({"apiVersion": "kuberl.io/v1alpha1", "kind": "RLExperiment",
                                       "metadata": {"name": "q3", "labels": {kueue.QUEUE_LABEL: "q"}},
                                       "spec": {"model": {"builtin": "tiny-qwen2"}, "dataset": {"builtin": "repeat-digit"}, "suspend": True}})
    assert kueue.build_workload(exp)["spec"]["active"] is False
    assert kueue.gated(exp, None) is exp
