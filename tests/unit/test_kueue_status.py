"""kuberl.operator.kueue_status as pure functions: the PodsReady transitions Kueue's jobframework writes, the flavour
placement merged into a child's pod template, the priority in each Workload version. The same behaviour against
Kueue's real manager: tests/integration/test_operator_kueue_real.py."""

from __future__ import annotations

import asyncio
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


class Flavours:
    """ResourceFlavors by name, as kube().get answers them."""

    def __init__(self, **flavours: dict[str, Any]):
        self.flavours = flavours

    async def get(self, kind: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        assert kind == "ResourceFlavor" and namespace is None
        return self.flavours.get(name)


def tas_workload(trainer_request: dict[str, Any] | None) -> dict[str, Any]:
    """A Workload admitted on a flavour with a topologyName: Kueue gave both PodSets a topologyAssignment."""
    assignment = {"levels": ["kubernetes.io/hostname"], "domains": [{"values": ["gpu-0"], "count": 2}]}
    return {"metadata": {"name": "exp-workload", "namespace": "ns"},
            "spec": {"podSets": [{"name": "trainer", "count": 2, **({"topologyRequest": trainer_request} if trainer_request else {})},
                                 {"name": "rollout", "count": 1}]},
            "status": {"admission": {"podSetAssignments": [
                {"name": "trainer", "flavors": {"nvidia.com/gpu": "tas"}, "topologyAssignment": assignment},
                {"name": "rollout", "flavors": {"cpu": "plain"}}]}}}


def test_a_topology_placed_pod_set_gets_what_kueues_topology_ungater_needs(monkeypatch: pytest.MonkeyPatch) -> None:
    """What jobframework puts on the pods of a PodSet with a topologyAssignment (podset.FromAssignment and
    getPodSetsInfoFromStatus): the topology scheduling gate, the Workload annotation, the PodSet label; the
    unconstrained annotation only where the PodSet asked for no topology (implicit TAS). Other PodSets: flavours only."""
    flavours = Flavours(tas={"spec": {"nodeLabels": {"pool": "tas"}, "topologyName": "t"}}, plain={"spec": {"nodeLabels": {"pool": "cpu"}}})
    explicit = asyncio.run(ks.placement(flavours, tas_workload({"required": "block", "podIndexLabel": "x"})))
    assert explicit["trainer"]["topology"] == {"annotations": {ks.WORKLOAD_ANNOTATION: "exp-workload"}, "labels": {ks.POD_SET_LABEL: "trainer"}}
    assert explicit["rollout"]["topology"] is None and explicit["rollout"]["nodeSelector"] == {"pool": "cpu"}
    implicit = asyncio.run(ks.placement(flavours, tas_workload(None)))
    assert implicit["trainer"]["topology"]["annotations"][ks.UNCONSTRAINED_ANNOTATION] == "true"

    monkeypatch.setitem(ks.PLACEMENT, ("ns", "exp"), explicit)
    job = {"kind": "Job", "metadata": {"name": "exp-trainer", "namespace": "ns"}, "spec": {"template": {
        "metadata": {"labels": {"kuberl.io/experiment": "exp", "kuberl.io/role": "trainer"}}, "spec": {}}}}
    placed = ks.place_child(job)["spec"]["template"]
    assert placed["spec"]["schedulingGates"] == [{"name": "kueue.x-k8s.io/topology"}] and placed["spec"]["nodeSelector"] == {"pool": "tas"}
    assert placed["metadata"]["labels"] == {"kuberl.io/experiment": "exp", "kuberl.io/role": "trainer", "kueue.x-k8s.io/podset": "trainer"}
    assert placed["metadata"]["annotations"] == {"kueue.x-k8s.io/workload": "exp-workload"}
    assert ks.place_child(ks.place_child(job))["spec"]["template"]["spec"]["schedulingGates"] == [{"name": "kueue.x-k8s.io/topology"}], "placed twice, one gate"
    sts = {"kind": "StatefulSet", "metadata": {"name": "exp-rollout", "namespace": "ns"}, "spec": {"template": {
        "metadata": {"labels": {"kuberl.io/experiment": "exp", "kuberl.io/role": "rollout"}}, "spec": {}}}}
    assert "schedulingGates" not in ks.place_child(sts)["spec"]["template"]["spec"], "a PodSet without a topologyAssignment has no gate"
