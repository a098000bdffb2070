"""Queued experiments against Kueue's real manager (the root conftest.py's `kueue`: Kueue v0.17's CRDs, webhooks and
controllers, waitForPodsReady on) and the real operator with the chart's RBAC (`kuberl_installed`). Nothing here writes
a Workload's status: Kueue admits, evicts and preempts; the operator reports PodsReady and Finished and gives the quota
back after an eviction, as Kueue's own job integrations do.

Each test makes its own ClusterQueue (quota sized from the experiment's own Workload: room for one experiment), its
LocalQueue and namespace, so the tests share one Kueue manager and nothing else.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from kubernetes.utils.quantity import parse_quantity

from kuberl.api.v1alpha1 import RLExperiment
from kuberl.operator import kueue as operator_kueue
from kuberl.testing.kueue import MANAGED_LABEL, PODS_READY_TIMEOUT, Kueue

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]
V = "kueue.x-k8s.io/v1beta2"
FLAVOR = {"apiVersion": V, "kind": "ResourceFlavor", "metadata": {"name": "kuberl-cpu-pool"},
          "spec": {"nodeLabels": {"kuberl.test/pool": "cpu"},
                   "tolerations": [{"key": "kuberl.test/dedicated", "operator": "Equal", "value": "rl", "effect": "NoSchedule"}]}}
PRIORITIES = [{"apiVersion": V, "kind": "WorkloadPriorityClass", "metadata": {"name": n}, "value": v} for n, v in (("rl-low", 100), ("rl-high", 1000))]


def manifest(name: str, namespace: str, queue: str, priority: str | None = None, sandbox: dict[str, Any] | None = None) -> dict[str, Any]:
    labels = {"kueue.x-k8s.io/queue-name": queue, **({"kueue.x-k8s.io/priority-class": priority} if priority else {})}
    spec = {"model": {"builtin": "tiny-qwen2"}, "dataset": {"builtin": "repeat-digit"},
            "rollout": {"replicas": 1, "accelerator": {"type": "cpu", "count": 0}},
            "trainer": {"accelerator": {"type": "cpu", "count": 1}, "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}}},
            "checkpoint": {"size": "1Gi"}}
    if sandbox:
        spec["workflow"] = {"reward": "repeat-digit", "sandbox": sandbox}
    return {"apiVersion": "kuberl.io/v1alpha1", "kind": "RLExperiment", "metadata": {"name": name, "namespace": namespace, "labels": labels},
            "spec": spec}


def one_experiment_quota(namespace: str, sandbox: dict[str, Any] | None = None) -> dict[str, int]:
    """What one experiment's Workload asks for, per resource (millicores / bytes): the queue holds one, not two."""
    built = operator_kueue.build_workload(RLExperiment.model_validate(manifest("sizing", namespace, "q", sandbox=sandbox)))
    total: dict[str, int] = {}
    for ps in built["spec"]["podSets"]:
        for c in ps["template"]["spec"]["containers"] + ps["template"]["spec"].get("initContainers", []):
            for res, qty in ((c.get("resources") or {}).get("requests") or {}).items():
                total[res] = total.get(res, 0) + ps["count"] * int(parse_quantity(qty) * (1000 if res == "cpu" else 1))
    return total


class Api:
    def __init__(self, kube: Any, kq: Kueue, namespace: str):
        self.cp, self.op, self.kq, self.ns, self.http = kube.control_plane, kube.operator, kq, namespace, kube.control_plane.session()

    def call(self, method: str, path: str, body: Any = None, ctype: str = "application/json") -> Any:
        r = self.http.request(method, self.cp.server + path, data=None if body is None else json.dumps(body), headers={"Content-Type": ctype})
        assert r.status_code in (200, 201), f"{method} {path}: {r.status_code} {r.text[:500]}"
        return r.json()

    def get(self, path: str) -> Any:
        r = self.http.get(self.cp.server + path)
        return r.json() if r.status_code == 200 else None

    def until(self, what: str, fn: Callable[[], Any], timeout: float = 90) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = fn()
            if value:
                return value
            assert self.op.alive, f"the operator died:\n{self.op.log_tail()}"
            assert self.kq.alive, f"Kueue's manager died:\n{self.kq.log_tail()}"
            time.sleep(0.5)
        raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}\n--- operator ---\n{self.op.log_tail()}\n"
                             f"--- kueue ---\n{self.kq.log_tail(15)}")

    def create(self, name: str, queue: str, priority: str | None = None, sandbox: dict[str, Any] | None = None) -> None:
        self.call("POST", f"/apis/kuberl.io/v1alpha1/namespaces/{self.ns}/rlexperiments", manifest(name, self.ns, queue, priority, sandbox))

    def workload(self, exp: str) -> Any:
        return self.get(f"/apis/{V}/namespaces/{self.ns}/workloads/{exp}-workload")

    def condition(self, exp: str, kind: str) -> dict[str, Any]:
        return next((c for c in ((self.workload(exp) or {}).get("status") or {}).get("conditions") or [] if c["type"] == kind), {})

    def admitted(self, exp: str) -> bool:
        return self.condition(exp, "Admitted").get("status") == "True" and self.condition(exp, "Evicted").get("status") != "True"

    def job(self, exp: str) -> Any:
        return self.get(f"/apis/batch/v1/namespaces/{self.ns}/jobs/{exp}-trainer")

    def trainer_running(self, exp: str) -> bool:
        job = self.job(exp)
        return bool(job) and job["spec"].get("suspend") is False and bool((job.get("status") or {}).get("ready"))

    def trainer_pods(self, exp: str) -> list[dict[str, Any]]:
        sel = f"kuberl.io/experiment={exp},kuberl.io/role=trainer"
        return [p for p in self.get(f"/api/v1/namespaces/{self.ns}/pods?labelSelector={sel}")["items"] if not p["metadata"].get("deletionTimestamp")]

    def phase(self, exp: str) -> str | None:
        return ((self.get(f"/apis/kuberl.io/v1alpha1/namespaces/{self.ns}/rlexperiments/{exp}") or {}).get("status") or {}).get("phase")


@pytest.fixture(scope="module")
def setup(kuberl_installed: Any, kueue: Kueue) -> Kueue:
    kuberl_installed.control_plane.apply(FLAVOR, *PRIORITIES)
    return kueue


def queue(kube: Any, kq: Kueue, name: str, *, managed: bool = False, slots: float = 1.5) -> Api:
    """A namespace `name` with a LocalQueue `name` of a ClusterQueue `name` holding `slots` experiments' requests
    (preemption of lower priorities within it)."""
    cp = kube.control_plane
    labels = {MANAGED_LABEL: "true"} if managed else {}
    cp.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels}})
    kube.allow_operator(name)  # the operator writes only where a RoleBinding lets it (chart tenantNamespaces)
    cp.apply(cluster_queue(name, one_experiment_quota(name), slots),
             {"apiVersion": V, "kind": "LocalQueue", "metadata": {"name": name, "namespace": name}, "spec": {"clusterQueue": name}})
    return Api(kube, kq, name)


def cluster_queue(name: str, quota: dict[str, int], slots: float) -> dict[str, Any]:
    """The ClusterQueue `name` (for the namespace `name`) holding `slots` times `quota`, on the test flavour."""
    resources = [{"name": r, "nominalQuota": f"{int(v * slots)}m" if r == "cpu" else str(int(v * slots))} for r, v in sorted(quota.items())]
    return {"apiVersion": V, "kind": "ClusterQueue", "metadata": {"name": name},
            "spec": {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": name}},
                     "preemption": {"withinClusterQueue": "LowerPriority"},
                     "resourceGroups": [{"coveredResources": sorted(quota), "flavors": [{"name": FLAVOR["metadata"]["name"], "resources": resources}]}]}}


@pytest.fixture
def api(request: pytest.FixtureRequest, kuberl_installed: Any, setup: Kueue) -> Iterator[Api]:
    name = "kq-" + request.node.name.removeprefix("test_").replace("_", "-")[:40].rstrip("-")
    yield queue(kuberl_installed, setup, name, managed="without_queue_name" in request.node.name)


def test_admitted_by_kueue_runs_reports_pods_ready_and_is_not_evicted_by_wait_for_pods_ready(api: Api) -> None:
    api.create("first", api.ns)
    api.until("Kueue admitting the Workload", lambda: api.admitted("first"))
    api.until("the admitted experiment's trainer running", lambda: api.trainer_running("first"))
    time.sleep(float(PODS_READY_TIMEOUT.removesuffix("s")) + 5)  # past waitForPodsReady's timeout
    assert api.condition("first", "Evicted").get("status") != "True", api.workload("first")["status"]
    assert not (api.workload("first")["status"].get("requeueState")), "Kueue requeued the running experiment"
    assert api.trainer_running("first")
    ready = api.condition("first", "PodsReady")
    assert (ready.get("status"), ready.get("reason")) == ("True", "Started"), ready


def test_a_second_experiment_waits_for_quota_and_is_admitted_when_the_first_finishes_or_is_deleted(api: Api) -> None:
    api.create("one", api.ns)
    api.until("the first admitted and running", lambda: api.admitted("one") and api.trainer_running("one"))
    api.create("two", api.ns)
    api.until("the second's Workload pending in its queue", lambda: api.condition("two", "QuotaReserved").get("reason") == "Pending")
    time.sleep(3)
    assert not api.admitted("two") and (api.job("two") or {}).get("spec", {}).get("suspend") is not False
    api.cp.exit(api.ns, [p["metadata"]["name"] for p in api.trainer_pods("one")], 0)  # the trainer completes
    api.until("the first experiment Succeeded", lambda: api.phase("one") == "Succeeded")
    api.until("the first Workload Finished", lambda: api.condition("one", "Finished").get("status") == "True")
    api.until("the second admitted and running", lambda: api.admitted("two") and api.trainer_running("two"))
    api.create("three", api.ns)
    api.until("the third pending", lambda: api.condition("three", "QuotaReserved").get("reason") == "Pending")
    api.call("DELETE", f"/apis/kuberl.io/v1alpha1/namespaces/{api.ns}/rlexperiments/two")
    api.until("the third admitted and running once the second is deleted", lambda: api.admitted("three") and api.trainer_running("three"), 90)


def test_a_higher_priority_preempts_the_experiment_suspends_then_resumes(api: Api) -> None:
    api.create("low", api.ns, "rl-low")
    api.until("the low-priority one running", lambda: api.admitted("low") and api.trainer_running("low"))
    api.create("high", api.ns, "rl-high")
    evicted = api.until("Kueue evicting the low-priority one",
                        lambda: api.condition("low", "Evicted").get("status") == "True" and api.condition("low", "Evicted"))
    assert evicted["reason"] == "Preempted"
    api.until("the low-priority experiment suspended (checkpoint first)", lambda: (api.job("low") or {}).get("spec", {}).get("suspend") is True)
    api.until("the high-priority one admitted and running", lambda: api.admitted("high") and api.trainer_running("high"), 90)
    assert not api.admitted("low")
    api.call("DELETE", f"/apis/kuberl.io/v1alpha1/namespaces/{api.ns}/rlexperiments/high")
    api.until("the low-priority one admitted again and resumed", lambda: api.admitted("low") and api.trainer_running("low"), 90)


def test_pods_go_to_the_admitted_flavours_nodes(api: Api) -> None:
    api.create("placed", api.ns)
    api.until("admitted and running", lambda: api.admitted("placed") and api.trainer_running("placed"))
    toleration = FLAVOR["spec"]["tolerations"][0]
    stss = [api.get(f"/apis/apps/v1/namespaces/{api.ns}/statefulsets/placed-{role}") for role in ("rollout", "bus")]
    for template in (api.job("placed")["spec"]["template"], *(sts["spec"]["template"] for sts in stss)):
        assert template["spec"].get("nodeSelector", {}).get("kuberl.test/pool") == "cpu", template["spec"].get("nodeSelector")
        assert toleration in template["spec"].get("tolerations", [])
    assert all(p["spec"]["nodeName"].startswith("cpu-") for p in api.trainer_pods("placed"))


def test_without_queue_name_managed_namespace_the_trainer_job_is_no_workload_of_its_own(api: Api) -> None:
    """manageJobsWithoutQueueName in this namespace: Kueue's Job webhook and reconciler would suspend and queue every Job
    without a queue label; the trainer Job, controlled by the experiment (an external framework), is left to it."""
    api.create("child", api.ns)
    api.until("admitted and running", lambda: api.admitted("child") and api.trainer_running("child"))
    time.sleep(5)  # Kueue's Job reconciler has seen the Job by now
    workloads = [w["metadata"]["name"] for w in api.get(f"/apis/{V}/namespaces/{api.ns}/workloads")["items"]]
    assert workloads == ["child-workload"], workloads
    assert api.trainer_running("child"), api.job("child")


def test_the_operator_uses_the_workload_version_kueue_stores(api: Api) -> None:
    api.create("versioned", api.ns)
    api.until("admitted", lambda: api.admitted("versioned"))
    versions = {(e.get("objectRef") or {}).get("apiVersion") for e in api.cp.audit_events()
                if (e.get("objectRef") or {}).get("resource") == "workloads" and (e.get("objectRef") or {}).get("namespace") == api.ns
                and e["user"]["username"].startswith("system:serviceaccount:kuberl-system:")}
    assert versions == {"v1beta2"}, versions


def test_the_sandbox_pods_are_counted_held_back_until_admitted_and_placed_on_the_flavours_nodes(api: Api) -> None:
    """workflow.sandbox.placement pod: the sandbox's pods are a PodSet of the Workload. A queue with room for 1.5
    experiments without a sandbox has none for this one with its 1-CPU sandbox (counted, it does not fit: Kueue keeps it
    pending, and no sandbox pod runs meanwhile); grown to fit it, Kueue admits it, the sandbox pod runs on the admitted
    flavour's nodes, and PodsReady counts it."""
    sandbox = {"placement": "pod", "replicas": 1}  # the default resources: 1 CPU, 1Gi
    api.create("boxed", api.ns, sandbox=sandbox)
    api.until("the Workload pending: with its sandbox the experiment does not fit", lambda: api.condition("boxed", "QuotaReserved").get("reason") == "Pending")
    assert {ps["name"]: ps["count"] for ps in api.workload("boxed")["spec"]["podSets"]} == {"bus": 1, "rollout": 1, "trainer": 1, "sandbox": 1}
    deployment = api.until("the sandbox Deployment", lambda: api.get(f"/apis/apps/v1/namespaces/{api.ns}/deployments/boxed-sandbox"))
    time.sleep(3)
    assert not api.admitted("boxed") and deployment["spec"]["replicas"] == 0
    assert not api.get(f"/api/v1/namespaces/{api.ns}/pods?labelSelector=kuberl.io/sandbox=boxed")["items"]

    api.cp.apply(cluster_queue(api.ns, one_experiment_quota(api.ns, sandbox), 1.5))
    api.until("admitted and running once the queue has room", lambda: api.admitted("boxed") and api.trainer_running("boxed"), 90)
    deployment = api.until("the sandbox Deployment scaled up", lambda: (d := api.get(f"/apis/apps/v1/namespaces/{api.ns}/deployments/boxed-sandbox"))
                           and d["spec"]["replicas"] == 1 and d)
    template = deployment["spec"]["template"]["spec"]
    assert template.get("nodeSelector", {}).get("kuberl.test/pool") == "cpu", template.get("nodeSelector")
    assert FLAVOR["spec"]["tolerations"][0] in template.get("tolerations", [])

    def running_sandbox() -> list[dict[str, Any]] | None:
        pods = api.get(f"/api/v1/namespaces/{api.ns}/pods?labelSelector=kuberl.io/sandbox=boxed")["items"]
        return [p for p in pods if p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")] or None

    [pod] = api.until("the sandbox pod running", running_sandbox)
    assert pod["spec"]["nodeName"].startswith("cpu-"), pod["spec"]["nodeName"]
    ready = api.until("PodsReady True, the sandbox pod counted", lambda: api.condition("boxed", "PodsReady").get("status") == "True"
                      and api.condition("boxed", "PodsReady"))
    assert ready["reason"] == "Started", ready
    assert api.condition("boxed", "Evicted").get("status") != "True"
