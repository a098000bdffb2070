"""kuberl.operator.kueue_status as pure functions: the PodsReady transitions Kueue's jobframework writes, the flavour
placement merged into a child's pod template, the priority in each Workload version. The same behaviour against
Kueue's real manager: tests/integration/test_operator_kueue_real.py."""

from __future__ import annotations

from typing import Any

import pytest

from kuberl.operator import kueue_status as ks


def workload(*conditions: tuple[str, str, str]) -> dict[str, Any]:
    return {"metadata": {"name": "w", "namespace": "ns", "generation": 2},
            "status": {"conditions": [{"type": t, "status": s, "reason": r} for t, s, r in conditions]}}


def pod(ready: bool = True, phase: str = "Running", deleted: bool = False) -> dict[str, Any]:
    meta = {"deletionTimestamp": "2026-01-01T00:00:00Z"} if deleted else {}
    return {"metadata": meta, "status": {"phase": phase, "conditions": [{"type": "Ready", "status": str(ready)}]}}


def test_pods_ready_counts_ready_and_succeeded_pods_never_deleted_ones() -> None:
    assert ks.pods_ready([pod(), pod(False, "Succeeded")], 2)
    assert not ks.pods_ready([pod(), pod(False)], 2)
    assert not ks.pods_ready([pod(), pod(deleted=True)], 2)
    assert not ks.pods_ready([], 0)


@pytest.mark.parametrize(("current", "admitted", "ready", "want"), [
    ((), True, True, ("True", "Started")),
    ((), True, False, ("False", "WaitForStart")),
    (("PodsReady", "True", "Started"), True, False, ("False", "WaitForRecovery")),
    (("PodsReady", "False", "WaitForRecovery"), True, True, ("True", "Recovered")),
    (("PodsReady", "True", "Started"), False, True, ("False", "WaitForStart")),
    (("PodsReady", "True", "Started"), True, True, None),  # already said: no write
])
def test_pods_ready_condition_follows_jobframework(current: tuple[str, ...], admitted: bool, ready: bool, want: Any) -> None:
    cond = ks.pods_ready_condition(workload(*([current] if current else [])), admitted, ready)
    assert (cond and (cond["status"], cond["reason"])) == want
    if cond:
        assert cond["observedGeneration"] == 2 and cond["lastTransitionTime"]


def test_finished_only_once_and_only_when_over() -> None:
    assert ks.finished_condition(workload(), "Running") is None
    assert ks.finished_condition(workload(), "Failed")["reason"] == "Failed"
    assert ks.finished_condition(workload(("Finished", "True", "Succeeded")), "Succeeded") is None


def test_priority_in_each_versions_shape() -> None:
    assert ks.with_priority({}, "kueue.x-k8s.io/v1beta2", "high", 1000) == {
        "priorityClassRef": {"group": "kueue.x-k8s.io", "kind": "WorkloadPriorityClass", "name": "high"}, "priority": 1000}
    assert ks.with_priority({}, "kueue.x-k8s.io/v1beta1", "high") == {
        "priorityClassName": "high", "priorityClassSource": "kueue.x-k8s.io/workloadpriorityclass"}


def test_place_child_merges_the_flavour_without_overriding_the_spec(monkeypatch: pytest.MonkeyPatch) -> None:
    toleration = {"key": "pool", "operator": "Exists", "effect": "NoSchedule"}
    monkeypatch.setitem(ks.PLACEMENT, ("ns", "exp"), {"trainer": {"nodeSelector": {"pool": "a", "zone": "z"}, "tolerations": [toleration]}})
    job = {"kind": "Job", "metadata": {"name": "exp-trainer", "namespace": "ns"}, "spec": {"template": {
        "metadata": {"labels": {"kuberl.io/experiment": "exp", "kuberl.io/role": "trainer"}},
        "spec": {"nodeSelector": {"pool": "mine"}, "tolerations": [toleration]}}}}
    spec = ks.place_child(job)["spec"]["template"]["spec"]
    assert job["spec"]["template"]["spec"]["nodeSelector"] == {"pool": "mine"}, "the built child is left as it was"
    assert spec["nodeSelector"] == {"pool": "mine", "zone": "z"} and spec["tolerations"] == [toleration]
    other = {**job, "metadata": {"name": "x", "namespace": "other"}}
    assert "zone" not in ks.place_child(other)["spec"]["template"]["spec"]["nodeSelector"]
