"""The operator at scale (issue 11), against the real control plane: observedGeneration never lags or moves backwards,
a monitor tick of a running experiment reads the watch caches (no API call), progress reaches status at most every
30 s, and finished experiments cost nothing.

The kopf handlers run in the test process (tests/integration/inprocess.py) with a client that counts every request
they make; the StatefulSet and Job controllers bring the workloads up (KWOK's pods) and a trainer pod's exit ends the
Job, as on a cluster. Pure rules (the write throttle, at_rest, the bus reader, the watches' filters) are unit tests
in tests/unit/test_operator_scale.py.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

import kopf
import pytest

from kuberl.operator import handlers
from kuberl.operator import lifecycle as h
from kuberl.operator.cache import Children, slim_pod, slim_workload
from kuberl.operator.kube import KubeClient
from kuberl.operator.rules import at_rest
from tests.integration import inprocess as ip
from tests.unit.operator_run import run

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
NS = "inproc-api-cost"
LOG = logging.getLogger("test")
cluster = ip.namespace_fixture(NS)


class CountingBus:
    """The operator's bus reader: progress with a step that grows on every read; counts reads."""

    def __init__(self) -> None:
        self.reads = 0

    async def read(self, url, token, experiment, key="progress", *, run=""):
        self.reads += 1
        return {"step": self.reads, "total_steps": 1000, "epoch": 0, "policy_version": self.reads, "time": time.time()}

    async def request_checkpoint(self, *args: Any, **kwargs: Any) -> bool:
        return False

    async def close(self) -> None:
        return None


class CountingClient(KubeClient):
    """The operator's client, recording (method, path) of every request it sends."""

    def __init__(self, inner: KubeClient) -> None:
        super().__init__(inner.host, ssl_context=inner._ssl, refresh=inner._refresh)
        self.made: list[tuple[str, str]] = []

    async def request(self, method: str, path: str, **kwargs: Any) -> Any:
        if not kwargs.get("_retried"):
            self.made.append((method.upper(), path))
        return await super().request(method, path, **kwargs)


@pytest.fixture
def operator(cluster: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[CountingBus]:
    bus = CountingBus()
    ip.own_them(monkeypatch)
    monkeypatch.setattr(h.CONFIG, "kube", CountingClient(ip.client_for(cluster)))
    monkeypatch.setattr(h.CONFIG, "bus", bus)
    monkeypatch.setattr(h.CONFIG, "cache", None)
    monkeypatch.setattr(h.CONFIG, "status_interval", 30.0)
    yield bus
    ip.close_client()


def made() -> list[tuple[str, str]]:
    return list(h.CONFIG.kube.made)


def manifest(name: str, **spec: Any) -> dict[str, Any]:
    base = {"model": {"builtin": "tiny-qwen2"}, "dataset": {"builtin": "repeat-digit"},
            "rollout": {"replicas": 1, "accelerator": {"type": "cpu", "count": 0}},
            "trainer": {"accelerator": {"type": "cpu", "count": 1}}, "training": {"totalSteps": 1000}}
    for key, value in spec.items():
        base[key] = {**base[key], **value} if isinstance(base.get(key), dict) and isinstance(value, dict) else value
    return ip.experiment(name, NS, base)


def get(kind: str, name: str) -> dict[str, Any]:
    return run(h.kube().get(kind, NS, name))


def reconcile(name: str, memo: Any, body: dict[str, Any] | None = None) -> None:
    body = body or get("RLExperiment", name)
    run(handlers.on_reconcile(body=body, status=body.get("status") or {}, memo=memo, logger=LOG))


def tick(body: dict[str, Any], memo: Any, **kwargs: Any) -> None:
    run(handlers.monitor(body=body, status=body.get("status") or {}, memo=memo, logger=LOG, **kwargs))


def wait_running(name: str) -> None:
    """The controllers bring every workload of the experiment up (KWOK runs the pods)."""
    def up() -> bool:
        sts = [get("StatefulSet", n) for n in (f"{name}-bus", f"{name}-rollout")]
        job = get("Job", f"{name}-trainer")
        return (all((s.get("status") or {}).get("readyReplicas") == s["spec"]["replicas"] for s in sts)
                and (job.get("status") or {}).get("ready") == 1)
    ip.wait_for(f"{name}'s workloads up", up)


def cache_of(name: str) -> Children:
    """The watch caches as kopf's indexes would hold them for this experiment (key -> store of values)."""
    pods = {(NS, name): [slim_pod(p) for p in run(h.kube().list("Pod", NS, f"kuberl.io/experiment={name}"))]}
    sts = {(NS, n): [slim_workload(get("StatefulSet", n))] for n in (f"{name}-bus", f"{name}-rollout")}
    jobs = {(NS, f"{name}-trainer"): [slim_workload(get("Job", f"{name}-trainer"))]}
    return Children(pods, sts, jobs)


class TestObservedGeneration:
    def test_the_operators_own_replicas_write_is_the_generation_it_reconciles(self, operator) -> None:
        """The reconcile writes spec.rollout.replicas (allocation's d) itself, which bumps the generation:
        observedGeneration names that generation at once (it used to stay one behind)."""
        m = manifest("og1", allocation="vllm:d2+fsdp:d4", rollout={"accelerator": {"type": "nvidia"}},
                     trainer={"accelerator": {"type": "nvidia", "count": 4}})
        del m["spec"]["rollout"]["replicas"]
        ip.create(m)
        reconcile("og1", kopf.Memo())
        exp = get("RLExperiment", "og1")
        assert exp["spec"]["rollout"]["replicas"] == 2
        assert exp["status"]["observedGeneration"] == exp["metadata"]["generation"] == 2

    def test_a_monitor_tick_that_started_before_a_reconcile_never_moves_observed_generation_back(self, operator) -> None:
        """The timer's status is a snapshot from when kopf called it; its write must not put back the
        observedGeneration the reconcile has moved on since (the module-run failure of test_operator)."""
        ip.create(manifest("og2"))
        memo = kopf.Memo()
        reconcile("og2", memo)
        stale = get("RLExperiment", "og2")
        assert stale["status"]["observedGeneration"] == 1
        run(h.kube().patch("RLExperiment", NS, "og2", {"spec": {"rollout": {"replicas": 2}}}))
        reconcile("og2", memo)
        assert get("RLExperiment", "og2")["status"]["observedGeneration"] == 2
        wait_running("og2")  # so the stale tick has something to write
        tick(stale, memo)
        exp = get("RLExperiment", "og2")
        assert exp["status"]["phase"] == "Running", exp["status"]
        assert exp["status"]["observedGeneration"] == 2 == exp["metadata"]["generation"]
        reconciled = next(c for c in exp["status"]["conditions"] if c["type"] == "Reconciled")
        assert reconciled["observedGeneration"] == 2 and reconciled["status"] == "True"


class TestSteadyState:
    def test_a_running_experiment_reads_no_api_on_a_tick_and_writes_progress_at_most_every_30s(self, operator) -> None:
        ip.create(manifest("ss1"))
        memo = kopf.Memo()
        reconcile("ss1", memo)
        wait_running("ss1")
        h.CONFIG.cache = cache_of("ss1")
        body = get("RLExperiment", "ss1")
        tick(body, memo)  # the phase changes to Running: written at once
        assert get("RLExperiment", "ss1")["status"]["phase"] == "Running"
        before = len(made())
        for _ in range(10):  # progress changes on every tick
            tick(body, memo)
        assert operator.reads >= 11
        assert made()[before:] == [], f"a steady tick made API requests: {made()[before:]}"
        memo["status_written_at"] -= 31  # 30 s later
        tick(body, memo)
        writes = made()[before:]
        assert [m for m, _ in writes] == ["PATCH"] and writes[0][1].endswith("/ss1/status"), writes
        assert get("RLExperiment", "ss1")["status"]["progress"]["step"] == operator.reads


class TestAtRest:
    def succeeded(self, cluster: Any, name: str, memo: Any) -> dict[str, Any]:
        """An experiment whose trainer exited 0: the Job controller marks the Job Complete, a tick says Succeeded."""
        ip.create(manifest(name))
        reconcile(name, memo)
        wait_running(name)
        job = get("Job", f"{name}-trainer")
        pods = run(h.kube().list("Pod", NS, f"batch.kubernetes.io/controller-uid={job['metadata']['uid']}"))
        cluster.control_plane.exit(NS, [p["metadata"]["name"] for p in pods], 0)
        ip.wait_for("the Job Complete", lambda: any(c["type"] == "Complete" and c["status"] == "True"
                                                    for c in (get("Job", f"{name}-trainer").get("status") or {}).get("conditions", [])))
        tick(get("RLExperiment", name), memo)
        body = get("RLExperiment", name)
        assert body["status"]["phase"] == "Succeeded", body["status"]
        return body

    def test_a_finished_experiment_costs_no_api_call_no_bus_read_and_no_status_write(self, cluster, operator) -> None:
        memo = kopf.Memo()
        body = self.succeeded(cluster, "fin1", memo)
        assert at_rest(body, body["status"])
        before, reads = len(made()), operator.reads
        for _ in range(5):
            tick(body, memo)
        assert made()[before:] == [] and operator.reads == reads

    def test_a_finished_experiment_is_still_deleted_after_its_ttl(self, cluster, operator) -> None:
        memo = kopf.Memo()
        body = self.succeeded(cluster, "fin2", memo)
        body["spec"]["ttlSecondsAfterFinished"] = 1
        memo["status"] = {**memo["status"], "completionTime": "2026-01-01T00:00:00Z"}  # long ago
        tick(body, memo)
        gone = run(h.kube().get("RLExperiment", NS, "fin2"))
        assert gone is None or gone["metadata"].get("deletionTimestamp")


class TestCaches:
    def test_the_cached_values_keep_what_status_reads_and_drop_the_templates(self, operator) -> None:
        ip.create(manifest("c1"))
        reconcile("c1", kopf.Memo())
        job = get("Job", "c1-trainer")
        slim = slim_workload(job)
        assert slim["spec"] == {k: v for k, v in job["spec"].items() if k != "template"} and "parallelism" in slim["spec"]
        assert slim["metadata"]["uid"] == job["metadata"]["uid"] and "managedFields" not in slim["metadata"]
