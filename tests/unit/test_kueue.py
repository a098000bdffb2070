"""Kueue and spec.managedBy (issue 11, citizenship). The handlers run against the strict API emulator,
and the test plays Kueue: it admits the experiment's Workload, then evicts it, by writing the
Workload's status as Kueue's controllers do. A queued experiment runs no pod before admission, runs
when admitted, suspends (checkpoint first) when evicted and then gives its quota back; its children
never carry the queue label, so the trainer Job is no Kueue workload of its own."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest

from kuberl.api.v1alpha1 import RLExperiment
from kuberl.operator import handlers, kueue
from kuberl.operator import lifecycle as h
from kuberl.operator.builders import common
from kuberl.operator.cache import Children, slim_kueue_workload, slim_workload
from kuberl.operator.kube import KubeClient
from kuberl.testing.emulator_server import EmulatorServer, default_crds
from tests.unit.operator_run import run

NS = "team-k"
LOG = logging.getLogger("test")
WORKLOAD_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
    "metadata": {"name": "workloads.kueue.x-k8s.io"},
    "spec": {"group": "kueue.x-k8s.io", "scope": "Namespaced",
             "names": {"plural": "workloads", "singular": "workload", "kind": "Workload", "listKind": "WorkloadList"},
             "versions": [{"name": "v1beta1", "served": True, "storage": True, "subresources": {"status": {}},
                           "schema": {"openAPIV3Schema": {"type": "object", "properties": {
                               "spec": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
                               "status": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}}}}}]},
}


class QuietBus:
    """The bus reader of an experiment whose bus is not up (the emulator runs no pods)."""

    async def read(self, *args: Any, **kwargs: Any) -> None:
        return None

    async def request_checkpoint(self, *args: Any, **kwargs: Any) -> bool:
        return False

    async def close(self) -> None:
        return None


@pytest.fixture(scope="module")
def emu() -> Iterator[EmulatorServer]:
    with EmulatorServer([*default_crds(), WORKLOAD_CRD], namespaces=("default", NS)) as server:
        yield server


@pytest.fixture
def operator(emu: EmulatorServer, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(h.CONFIG, "kube", KubeClient(emu.url))
    monkeypatch.setattr(h.CONFIG, "bus", QuietBus())
    monkeypatch.setattr(h.CONFIG, "cache", None)
    common.configure_images(None)
    yield



def create(name: str, labels: dict[str, str] | None = None, **spec: Any) -> None:
    body = {"apiVersion": "kuberl.io/v1alpha1", "kind": "RLExperiment", "metadata": {"name": name, "namespace": NS, "labels": labels or {}},
            "spec": {"model": {"builtin": "tiny-qwen2"}, "dataset": {"builtin": "repeat-digit"},
                     "rollout": {"replicas": 2, "accelerator": {"type": "cpu", "count": 0}},
                     "trainer": {"accelerator": {"type": "cpu", "count": 1}}, "weightSync": {"mode": "bus"}, **spec}}
    run(h.kube().request("POST", f"/apis/kuberl.io/v1alpha1/namespaces/{NS}/rlexperiments", body=body))


def get(kind: str, name: str) -> dict | None:
    return run(h.kube().get(kind, NS, name))


def reconcile(name: str, memo: dict) -> None:
    body = get("RLExperiment", name)
    run(handlers.on_reconcile(body=body, status=body.get("status"), memo=memo, logger=LOG))


def tick(name: str, memo: dict) -> None:
    body = get("RLExperiment", name)
    run(handlers.monitor(body=body, status=body.get("status"), memo=memo, logger=LOG))


def kueue_sets(name: str, *conditions: str, admission: bool = True) -> None:
    """What Kueue's controllers write when they reserve quota, admit, or evict."""
    status = {"conditions": [{"type": c, "status": "True", "reason": c, "message": f"kueue: {c}",
                              "lastTransitionTime": "2026-01-01T00:00:00Z"} for c in conditions]}
    if admission:
        status["admission"] = {"clusterQueue": "cq", "podSetAssignments": []}
    run(h.kube().patch("Workload", NS, f"{name}-workload", {"status": status}, subresource="status"))


def running(name: str) -> tuple[bool, int, int]:
    """(trainer Job unsuspended, rollout replicas, bus replicas)."""
    job = get("Job", f"{name}-trainer")
    return (not job["spec"]["suspend"], get("StatefulSet", f"{name}-rollout")["spec"]["replicas"],
            get("StatefulSet", f"{name}-bus")["spec"]["replicas"])


class TestQueuedExperiment:
    def test_queued_admitted_evicted_and_released(self, operator) -> None:
        create("q1", labels={kueue.QUEUE_LABEL: "team-k-queue"})
        memo: dict = {}
        reconcile("q1", memo)
        workload = get("Workload", "q1-workload")
        assert workload["spec"]["queueName"] == "team-k-queue" and workload["spec"]["active"] is True
        assert [(p["name"], p["count"]) for p in workload["spec"]["podSets"]] == [("bus", 1), ("rollout", 2), ("trainer", 1)]
        assert workload["metadata"]["ownerReferences"][0]["uid"] == get("RLExperiment", "q1")["metadata"]["uid"]
        assert running("q1") == (False, 0, 0)  # queued: no pod until Kueue admits it
        tick("q1", memo)
        assert running("q1") == (False, 0, 0)

        kueue_sets("q1", "QuotaReserved", "Admitted")
        tick("q1", memo)
        assert running("q1") == (True, 2, 1)
        for kind, child in (("Job", "q1-trainer"), ("StatefulSet", "q1-rollout"), ("StatefulSet", "q1-bus")):
            assert kueue.QUEUE_LABEL not in get(kind, child)["metadata"]["labels"]

        kueue_sets("q1", "QuotaReserved", "Admitted", "Evicted")
        tick("q1", memo)  # suspends (no bus: without a checkpoint) and stops the pods
        assert running("q1") == (False, 0, 0)
        tick("q1", memo)  # the pods are gone: the quota goes back to the queue
        status = get("Workload", "q1-workload")["status"]
        assert status.get("admission") is None
        assert {c["type"]: c["status"] for c in status["conditions"]} == {"QuotaReserved": "False", "Admitted": "False", "Evicted": "True"}

    def test_an_experiment_without_a_queue_label_gets_no_workload(self, operator) -> None:
        create("q2")
        reconcile("q2", {})
        assert get("Workload", "q2-workload") is None
        assert running("q2") == (True, 2, 1)

    def test_a_suspended_queued_experiment_asks_for_no_quota(self) -> None:
        exp = RLExperiment.model_validate({"apiVersion": "kuberl.io/v1alpha1", "kind": "RLExperiment",
                                           "metadata": {"name": "q3", "labels": {kueue.QUEUE_LABEL: "q"}},
                                           "spec": {"model": {"builtin": "tiny-qwen2"}, "dataset": {"builtin": "repeat-digit"}, "suspend": True}})
        assert kueue.build_workload(exp)["spec"]["active"] is False
        assert kueue.gated(exp, None) is exp


def requests(emu: EmulatorServer) -> list[tuple[str, str]]:
    return emu.call(lambda e: [(str(getattr(r.method, "value", r.method)).upper(), r.url.path) for r in e._requests])


def watch_caches(name: str) -> Children:
    """The operator's watch caches (kopf indexes: key -> store of values) as kopf would hold them now."""
    def one(kind: str, child: str, slim: Any) -> dict:
        obj = get(kind, child)
        return {(NS, child): [slim(obj)]} if obj is not None else {}

    return Children({(NS, name): []}, {**one("StatefulSet", f"{name}-bus", slim_workload), **one("StatefulSet", f"{name}-rollout", slim_workload)},
                    one("Job", f"{name}-trainer", slim_workload), one("Workload", f"{name}-workload", slim_kueue_workload))


def counted_tick(emu: EmulatorServer, name: str, memo: dict) -> list[tuple[str, str]]:
    """One monitor tick; the API requests it made."""
    body = get("RLExperiment", name)
    before = len(requests(emu))
    run(handlers.monitor(body=body, status=body.get("status"), memo=memo, logger=LOG))
    return requests(emu)[before:]


class TestWatchCache:
    """gate() reads the Workload from the watch cache: a queued experiment's tick costs no API request
    (it used to GET the Workload on every tick, 0.2 requests/s per queued experiment, and to re-apply it
    on every tick while Kueue had not reserved quota)."""

    def test_a_queued_experiment_reads_no_api_per_tick_and_still_runs_when_admitted_and_stops_when_evicted(self, emu, operator) -> None:
        create("c1", labels={kueue.QUEUE_LABEL: "team-k-queue"})
        memo: dict = {}
        reconcile("c1", memo)
        assert get("Workload", "c1-workload")["spec"]["active"] is True
        h.CONFIG.cache = watch_caches("c1")
        tick("c1", memo)  # status settles (Suspended while queued)
        made = []
        for _ in range(5):  # pending in its queue: no quota reserved yet
            made += counted_tick(emu, "c1", memo)
        assert made == [], f"queued ticks made API requests: {made}"
        assert running("c1") == (False, 0, 0)

        kueue_sets("c1", "QuotaReserved", "Admitted")
        h.CONFIG.cache = watch_caches("c1")  # the watch brings the admission
        made = counted_tick(emu, "c1", memo)
        assert running("c1") == (True, 2, 1)

        kueue_sets("c1", "QuotaReserved", "Admitted", "Evicted")
        h.CONFIG.cache = watch_caches("c1")
        made += counted_tick(emu, "c1", memo)  # suspends and stops the pods
        assert running("c1") == (False, 0, 0)
        h.CONFIG.cache = watch_caches("c1")
        last = counted_tick(emu, "c1", memo)  # the (cached) Job is suspended and has no active pod: the quota goes back
        status = get("Workload", "c1-workload")["status"]
        assert status.get("admission") is None
        assert {c["type"]: c["status"] for c in status["conditions"]} == {"QuotaReserved": "False", "Admitted": "False", "Evicted": "True"}
        assert [m for m, _ in last] == ["PATCH", "PATCH"], last  # the Workload's status and the experiment's: no read
        reads = [p for m, p in made if m == "GET" and "/workloads" in p]
        assert reads == [], f"the admit/evict ticks read the Workload from the API: {reads}"

    def test_a_missing_workload_is_applied_at_once_and_a_pending_one_at_most_every_30s(self, emu, operator, monkeypatch) -> None:
        create("c2", labels={kueue.QUEUE_LABEL: "team-k-queue"})
        memo: dict = {}
        reconcile("c2", memo)
        run(h.kube().delete("Workload", NS, "c2-workload"))  # e.g. deleted by hand
        h.CONFIG.cache = watch_caches("c2")
        assert h.CONFIG.cache.workload(NS, "c2-workload") is None
        memo.pop("kueue_applied", None)  # the operator restarted: nothing applied lately
        tick("c2", memo)
        assert get("Workload", "c2-workload") is not None
        h.CONFIG.cache = watch_caches("c2")
        assert not [p for _, p in counted_tick(emu, "c2", memo) if "/workloads" in p]
        clock = kueue.time.monotonic() + kueue.REAPPLY_AFTER + 1
        monkeypatch.setattr(kueue.time, "monotonic", lambda: clock)
        # still pending 30 s later: applied again (it may have been changed behind the operator's back)
        assert [m for m, p in counted_tick(emu, "c2", memo) if "/workloads" in p] == ["PATCH"]


class TestManagedBy:
    def test_an_experiment_managed_by_another_controller_is_left_alone(self, operator) -> None:
        create("mb1", managedBy="kueue.x-k8s.io/multikueue")
        memo: dict = {}
        reconcile("mb1", memo)
        tick("mb1", memo)
        assert get("Job", "mb1-trainer") is None and get("ConfigMap", "mb1-config") is None
        assert not (get("RLExperiment", "mb1").get("status") or {})

    def test_the_operators_own_value_is_managed_here(self, operator) -> None:
        create("mb2", managedBy="kuberl.io/operator")
        reconcile("mb2", {})
        assert get("Job", "mb2-trainer") is not None
