"""What a queued experiment costs the API server, and the queue-label and managedBy rules, against the real control
plane with Kueue's real CRDs and manager (the root conftest.py's `kueue`).

The kopf handlers run in the test process (tests/integration/inprocess.py) with a client that counts what they ask:
a queued experiment's tick reads the Workload from the watch cache, never from the API; a Workload that disappears
is applied again at once, one that stays pending at most every 30 s. The queue named here has no LocalQueue, so Kueue
keeps the Workload pending (the admit, evict and preempt paths run through the chart's operator and Kueue's
scheduler in test_operator_kueue_real.py).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest

from kuberl.operator import handlers, kueue
from kuberl.operator import lifecycle as h
from kuberl.operator.cache import Children, slim_kueue_workload, slim_workload
from tests.integration import inprocess as ip
from tests.integration.test_operator_api_cost import CountingBus, CountingClient
from tests.unit.operator_run import run

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]
NS = "inproc-kueue-ticks"
QUEUE = "no-such-local-queue"  # Kueue keeps a Workload of a queue that does not exist pending
LOG = logging.getLogger("test")
cluster = ip.namespace_fixture(NS)


@pytest.fixture
def operator(cluster: Any, kueue: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    ip.own_them(monkeypatch)
    monkeypatch.setattr(h.CONFIG, "kube", CountingClient(ip.client_for(cluster)))
    monkeypatch.setattr(h.CONFIG, "bus", CountingBus())
    monkeypatch.setattr(h.CONFIG, "cache", None)
    yield
    ip.close_client()


def create(name: str, queued: bool = True, managed_by: str = ip.MANAGED_BY) -> None:
    base = {"model": {"builtin": "tiny-qwen2"}, "dataset": {"builtin": "repeat-digit"},
            "rollout": {"replicas": 1, "accelerator": {"type": "cpu", "count": 0}},
            "trainer": {"accelerator": {"type": "cpu", "count": 1}}}
    manifest = ip.experiment(name, NS, base, labels={kueue.QUEUE_LABEL: QUEUE} if queued else None)
    manifest["spec"]["managedBy"] = managed_by
    ip.create(manifest)


def get(kind: str, name: str) -> dict[str, Any] | None:
    return run(h.kube().get(kind, NS, name))


def reconcile(name: str, memo: dict) -> None:
    body = get("RLExperiment", name)
    run(handlers.on_reconcile(body=body, status=body.get("status") or {}, memo=memo, logger=LOG))


def tick(name: str, memo: dict) -> list[tuple[str, str]]:
    """One monitor tick; the API requests it made."""
    body = get("RLExperiment", name)
    before = len(h.CONFIG.kube.made)
    run(handlers.monitor(body=body, status=body.get("status") or {}, memo=memo, logger=LOG))
    return h.CONFIG.kube.made[before:]


def watch_caches(name: str) -> Children:
    """The operator's watch caches (kopf indexes: key -> store of values) as kopf would hold them now."""
    def one(kind: str, child: str, slim: Any) -> dict:
        obj = get(kind, child)
        return {(NS, child): [slim(obj)]} if obj is not None else {}

    return Children({(NS, name): []}, {**one("StatefulSet", f"{name}-bus", slim_workload), **one("StatefulSet", f"{name}-rollout", slim_workload)},
                    one("Job", f"{name}-trainer", slim_workload), one("Workload", f"{name}-workload", slim_kueue_workload))


def running(name: str) -> tuple[bool, int, int]:
    """(trainer Job unsuspended, rollout replicas, bus replicas)."""
    job, rollout, bus = get("Job", f"{name}-trainer"), get("StatefulSet", f"{name}-rollout"), get("StatefulSet", f"{name}-bus")
    return (bool(job) and not job["spec"]["suspend"], (rollout or {}).get("spec", {}).get("replicas", 0),
            (bus or {}).get("spec", {}).get("replicas", 0))


def test_a_queued_experiment_asks_kueue_for_its_pods_and_runs_none_while_pending(operator) -> None:
    create("queued")
    memo: dict = {}
    reconcile("queued", memo)
    workload = ip.wait_for("the Workload", lambda: get("Workload", "queued-workload"))
    assert workload["apiVersion"] == "kueue.x-k8s.io/v1beta2"  # the version Kueue stores
    assert workload["spec"]["queueName"] == QUEUE and workload["spec"]["active"] is True
    assert [(p["name"], p["count"]) for p in workload["spec"]["podSets"]] == [("bus", 1), ("rollout", 1), ("trainer", 1)]
    assert workload["metadata"]["ownerReferences"][0]["uid"] == get("RLExperiment", "queued")["metadata"]["uid"]
    pending = ip.wait_for("Kueue's verdict", lambda: next((c for c in (get("Workload", "queued-workload").get("status") or {}).get("conditions", [])
                                                         if c["type"] == "QuotaReserved"), None))
    assert pending["status"] == "False", pending
    assert running("queued") == (False, 0, 0)


def test_a_queued_experiments_tick_reads_no_api(operator) -> None:
    create("cached")
    memo: dict = {}
    reconcile("cached", memo)
    ip.wait_for("the Workload", lambda: get("Workload", "cached-workload"))
    h.CONFIG.cache = watch_caches("cached")
    tick("cached", memo)  # status settles (Suspended while queued)
    made = [call for _ in range(5) for call in tick("cached", memo)]
    assert made == [], f"a queued experiment's ticks asked the API server: {made}"
    assert running("cached") == (False, 0, 0)


def test_a_missing_workload_is_applied_at_once_and_a_pending_one_at_most_every_30s(operator, monkeypatch) -> None:
    create("reapplied")
    memo: dict = {}
    reconcile("reapplied", memo)
    run(h.kube().delete("Workload", NS, "reapplied-workload"))  # e.g. deleted by hand
    ip.wait_for("the Workload gone", lambda: get("Workload", "reapplied-workload") is None)
    h.CONFIG.cache = watch_caches("reapplied")
    assert h.CONFIG.cache.workload(NS, "reapplied-workload") is None
    memo.pop("kueue_applied", None)  # the operator restarted: nothing applied lately
    tick("reapplied", memo)
    assert get("Workload", "reapplied-workload") is not None
    h.CONFIG.cache = watch_caches("reapplied")
    assert not [p for _, p in tick("reapplied", memo) if "/workloads" in p]
    clock = kueue.time.monotonic() + kueue.REAPPLY_AFTER + 1
    monkeypatch.setattr(kueue.time, "monotonic", lambda: clock)
    # still pending 30 s later: applied again (it may have been changed behind the operator's back)
    assert [m for m, p in tick("reapplied", memo) if "/workloads" in p] == ["PATCH"]


def test_an_experiment_without_a_queue_label_gets_no_workload_and_runs(operator) -> None:
    create("unqueued", queued=False)
    reconcile("unqueued", {})
    assert get("Workload", "unqueued-workload") is None
    assert running("unqueued") == (True, 1, 1)


def test_an_experiment_managed_by_another_controller_is_left_alone(operator) -> None:
    create("elsewhere", queued=False, managed_by="kueue.x-k8s.io/multikueue")
    memo: dict = {}
    reconcile("elsewhere", memo)
    run(handlers.monitor(body=get("RLExperiment", "elsewhere"), status={}, memo=memo, logger=LOG))
    assert get("Job", "elsewhere-trainer") is None and get("ConfigMap", "elsewhere-config") is None
    assert not (get("RLExperiment", "elsewhere").get("status") or {})

