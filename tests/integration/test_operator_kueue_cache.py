"""The operator's Kueue Workload cache with the real operator (kopf) on the real control plane (the root conftest.py's
`kuberl_installed`: the chart's RBAC applies; the API server's audit log tells what the operator asked of it).

Without Kueue's CRDs (`workloads.kueue.x-k8s.io` absent from discovery) kopf must start, serve every
experiment (its Workload index must not hold the handlers back) and stay up; a queued experiment waits.
Then Kueue is installed (the session's `kueue` fixture: its real CRDs, webhooks and manager) and kopf starts the
Workload watch by itself: the queued experiment's Workload is created, Kueue admits it, the admission reaches the
operator through the watch, and the experiment runs, all without the operator ever GETting the Workload (it used to
read it on every monitor tick, 0.2 requests/s per queued experiment). This file runs before the other real-Kueue tests
(test_operator_kueue_real.py, in file order on the control plane's xdist worker), so Kueue is not installed yet.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest

from kuberl.testing.control_plane import ControlPlane
from kuberl.testing.operator_process import OperatorProcess

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
NS = "kueue-cache"
RLX = f"/apis/kuberl.io/v1alpha1/namespaces/{NS}/rlexperiments"
WORKLOADS = f"/apis/kueue.x-k8s.io/v1beta2/namespaces/{NS}/workloads"
V = "kueue.x-k8s.io/v1beta2"
QUEUE = [{"apiVersion": V, "kind": "ResourceFlavor", "metadata": {"name": "kueue-cache-flavor"}},
         {"apiVersion": V, "kind": "ClusterQueue", "metadata": {"name": "kueue-cache"},
          "spec": {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": NS}},
                   "resourceGroups": [{"coveredResources": ["cpu", "memory"], "flavors": [{"name": "kueue-cache-flavor", "resources": [
                       {"name": "cpu", "nominalQuota": "100"}, {"name": "memory", "nominalQuota": "1000Gi"}]}]}]}},
         {"apiVersion": V, "kind": "LocalQueue", "metadata": {"name": "team-queue", "namespace": NS}, "spec": {"clusterQueue": "kueue-cache"}}]


class Api:
    def __init__(self, cp: ControlPlane, op: OperatorProcess):
        self.cp, self.op, self.http = cp, op, cp.session()

    def call(self, method: str, path: str, body: Any = None, ctype: str = "application/json") -> Any:
        r = self.http.request(method, self.cp.server + path, data=None if body is None else json.dumps(body), headers={"Content-Type": ctype})
        assert r.status_code in (200, 201), f"{method} {path}: {r.status_code} {r.text[:500]}"
        return r.json()

    def get(self, path: str) -> Any:
        r = self.http.get(self.cp.server + path)
        return r.json() if r.status_code == 200 else None

    def until(self, what: str, fn: Any, timeout: float) -> Any:
        return self.op.wait(what, fn, timeout, period=0.5)

    def operator_requests(self, resource: str) -> list[str]:
        """The verbs of the operator's requests on Workloads (the API server's audit log; the operator is the chart's
        ServiceAccount in kuberl-system)."""
        return [e["verb"] for e in self.cp.audit_events()
                if (e.get("objectRef") or {}).get("resource") == resource and (e.get("objectRef") or {}).get("namespace") in (NS, None)
                and e["user"]["username"].startswith("system:serviceaccount:kuberl-system:")]


@pytest.fixture(scope="module")
def api(kuberl_installed: Any) -> Iterator[Api]:
    if not kuberl_installed.local:
        pytest.skip("installs a Workload CRD and reads the API server's audit log: runs on the local control plane (KUBECONFIG unset)")
    cp = kuberl_installed.control_plane
    if cp.kubectl("get", "crd", "workloads.kueue.x-k8s.io", check=False).returncode == 0:
        pytest.fail("the Workload CRD is installed already: this test must see the operator start without it")
    cp.kubectl("create", "namespace", NS)
    kuberl_installed.allow_operator(NS)  # the operator writes only where a RoleBinding lets it (chart tenantNamespaces)
    yield Api(cp, kuberl_installed.operator)


def manifest(name: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {"apiVersion": "kuberl.io/v1alpha1", "kind": "RLExperiment", "metadata": {"name": name, "namespace": NS, "labels": labels or {}},
            "spec": {"model": {"builtin": "tiny-qwen2"}, "dataset": {"builtin": "repeat-digit"},
                     "rollout": {"replicas": 1, "accelerator": {"type": "cpu", "count": 0}},
                     "trainer": {"accelerator": {"type": "cpu", "count": 1}}}}


def test_without_the_kueue_crd_the_operator_serves_and_once_installed_queues_through_the_watch(api: Api, request: pytest.FixtureRequest) -> None:
    api.call("POST", RLX, manifest("plain"))
    api.call("POST", RLX, manifest("queued", {"kueue.x-k8s.io/queue-name": "team-queue"}))
    # kopf is not held back by the index of a resource the cluster does not serve
    job = api.until("the plain experiment's trainer Job", lambda: api.get(f"/apis/batch/v1/namespaces/{NS}/jobs/plain-trainer"), 60)
    assert job["spec"].get("suspend") is not True
    queued = api.until("the queued experiment's (suspended) trainer Job", lambda: api.get(f"/apis/batch/v1/namespaces/{NS}/jobs/queued-trainer"), 60)
    assert queued["spec"]["suspend"] is True
    time.sleep(3)  # a few monitor ticks without Kueue
    assert api.op.alive

    request.getfixturevalue("kueue")  # Kueue's CRDs, webhooks and manager, installed now
    api.cp.apply(*QUEUE)
    # kopf's CRD watch starts the Workload watch; the operator applies the missing Workload (at most 30 s after its failed try)
    api.until("the queued experiment's Workload", lambda: api.get(f"{WORKLOADS}/queued-workload"), 90)
    assert api.get(f"{WORKLOADS}/plain-workload") is None
    api.until("the admitted experiment's trainer Job running",
              lambda: api.get(f"/apis/batch/v1/namespaces/{NS}/jobs/queued-trainer")["spec"].get("suspend") is False, 60)
    time.sleep(3)
    verbs = api.operator_requests("workloads")
    assert "get" not in verbs, f"the operator read Workloads from the API instead of its watch cache: {verbs}"
    assert "watch" in verbs and "list" in verbs, f"kopf never listed and watched the Workloads: {verbs}"
    assert "create" in verbs or "patch" in verbs, f"the operator never applied the Workload: {verbs}"
