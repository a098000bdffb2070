"""Gang placement of a multi-node trainer by Kueue's topology-aware scheduling (trainer.topologyRequest), against Kueue's
real manager, scheduler and KWOK GPU nodes of their own (the root conftest.py's `kueue` and `kuberl_installed`).

Quota alone does not keep a multi-node trainer whole: Kueue admits by quota, the kube-scheduler places the ranks one by
one, and when the nodes have room for only some of them those ranks hold their GPUs while the rest wait Pending. The
first test shows that on a plain flavour; the second shows that with a topologyRequest on a flavour with a topology,
Kueue admits the experiment only once every rank fits in one domain of the requested level, and the ranks then run on
the nodes Kueue assigned (its topology ungater lifts the gate the operator put on the pods and sets their node).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from test_operator_kueue_real import Api

from kuberl.testing.control_plane import GPU_TAINT
from kuberl.testing.kueue import Kueue

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
V = "kueue.x-k8s.io/v1beta2"
POOL = {"kuberl.test/pool": "tas"}
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
ALLOCATABLE = {"cpu": "64", "memory": "512Gi", "ephemeral-storage": "1Ti", "pods": "110", "nvidia.com/gpu": "8"}
BLOCK = "kuberl.test/block"
TOPOLOGY = {"apiVersion": V, "kind": "Topology", "metadata": {"name": "kuberl-tas"},
            "spec": {"levels": [{"nodeLabel": BLOCK}, {"nodeLabel": "kubernetes.io/hostname"}]}}


def nodes(block: str, count: int) -> dict[str, Any]:
    """A pool `tas-<block>` of `count` GPU nodes (tas-<block>-0...), 8 GPUs each, in topology block `block`."""
    return {f"tas-{block}": (count, {**POOL, BLOCK: block, "nvidia.com/gpu.present": "true"}, [GPU_TAINT], ALLOCATABLE)}


def flavor(name: str, topology: bool) -> dict[str, Any]:
    spec = {"nodeLabels": POOL, "tolerations": [GPU_TOLERATION], **({"topologyName": TOPOLOGY["metadata"]["name"]} if topology else {})}
    return {"apiVersion": V, "kind": "ResourceFlavor", "metadata": {"name": name}, "spec": spec}


def gang(name: str, namespace: str, topology_request: dict[str, Any] | None) -> dict[str, Any]:
    """An experiment whose trainer is 3 nodes of 8 GPUs, queued in the namespace's LocalQueue."""
    trainer = {"nodes": 3, "accelerator": {"type": "nvidia", "count": 8}, "resources": {"requests": {"cpu": "4", "memory": "16Gi"}}}
    if topology_request:
        trainer["topologyRequest"] = topology_request
    return {"apiVersion": "kuberl.io/v1alpha1", "kind": "RLExperiment",
            "metadata": {"name": name, "namespace": namespace, "labels": {"kueue.x-k8s.io/queue-name": namespace}},
            "spec": {"model": {"builtin": "tiny-qwen2"}, "dataset": {"builtin": "repeat-digit"},
                     "rollout": {"replicas": 1, "accelerator": {"type": "cpu", "count": 0}}, "trainer": trainer,
                     "checkpoint": {"size": "1Gi"}}}


def queue(kube: Any, kq: Kueue, name: str, flavour: str) -> Api:
    """Namespace, LocalQueue and ClusterQueue `name` on `flavour`, with quota for the whole experiment (room by quota)."""
    cp = kube.control_plane
    cp.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
    kube.allow_operator(name)
    quota = {"cpu": "100", "memory": "1Ti", "nvidia.com/gpu": "64"}
    cp.apply({"apiVersion": V, "kind": "ClusterQueue", "metadata": {"name": name},
              "spec": {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": name}},
                       "resourceGroups": [{"coveredResources": sorted(quota), "flavors": [
                           {"name": flavour, "resources": [{"name": r, "nominalQuota": q} for r, q in sorted(quota.items())]}]}]}},
             {"apiVersion": V, "kind": "LocalQueue", "metadata": {"name": name, "namespace": name}, "spec": {"clusterQueue": name}})
    return Api(kube, kq, name)


@pytest.fixture(scope="module")
def tas(kuberl_installed: Any, kueue: Kueue) -> Iterator[Any]:
    """Two GPU nodes in block b1 (room for two of the three ranks), the Topology and both flavours; the nodes the tests
    add are deleted at the end."""
    cp = kuberl_installed.control_plane
    cp.add_nodes(nodes("b1", 2))
    cp.apply(TOPOLOGY, flavor("kuberl-tas-plain", False), flavor("kuberl-tas", True))
    yield kuberl_installed
    cp.kubectl("delete", "nodes", "-l", "kuberl.test/pool=tas", "--wait=false", check=False)


def pods(api: Api, exp: str, role: str = "trainer") -> list[dict[str, Any]]:
    sel = f"kuberl.io/experiment={exp},kuberl.io/role={role}"
    return [p for p in api.get(f"/api/v1/namespaces/{api.ns}/pods?labelSelector={sel}")["items"] if not p["metadata"].get("deletionTimestamp")]


def running(api: Api, exp: str) -> list[dict[str, Any]]:
    return [p for p in pods(api, exp) if p["status"].get("phase") == "Running"]


def test_by_quota_alone_a_three_node_trainer_on_two_free_nodes_holds_two_nodes_gpus_while_its_third_rank_waits(tas: Any, kueue: Kueue) -> None:
    api = queue(tas, kueue, "tas-plain", "kuberl-tas-plain")
    api.call("POST", f"/apis/kuberl.io/v1alpha1/namespaces/{api.ns}/rlexperiments", gang("half", api.ns, None))
    api.until("Kueue admitting it by quota", lambda: api.admitted("half"))
    api.until("two ranks running", lambda: len(running(api, "half")) == 2)
    api.until("the third rank unschedulable", lambda: any(
        c.get("reason") == "Unschedulable" for p in pods(api, "half") for c in p["status"].get("conditions") or []))
    assert len(pods(api, "half")) == 3 and {p["spec"]["nodeName"] for p in running(api, "half")} == {"tas-b1-0", "tas-b1-1"}
    api.call("DELETE", f"/apis/kuberl.io/v1alpha1/namespaces/{api.ns}/rlexperiments/half")
    api.until("its pods gone", lambda: not api.get(f"/api/v1/namespaces/{api.ns}/pods")["items"], 120)


def test_with_a_topology_request_kueue_admits_the_trainer_only_when_every_rank_fits_in_one_block(tas: Any, kueue: Kueue) -> None:
    api = queue(tas, kueue, "tas-gang", "kuberl-tas")
    cp = tas.control_plane
    api.call("POST", f"/apis/kuberl.io/v1alpha1/namespaces/{api.ns}/rlexperiments", gang("gang", api.ns, {"required": BLOCK}))
    api.until("the Workload pending: two free nodes in block b1 for three ranks", lambda: api.condition("gang", "QuotaReserved").get("reason") == "Pending")

    cp.add_nodes(nodes("b2", 1))  # three free nodes now, but not in one block
    time.sleep(8)
    assert not api.admitted("gang") and not pods(api, "gang"), api.condition("gang", "QuotaReserved")

    cp.add_nodes(nodes("b1", 3))  # a third node in block b1
    api.until("Kueue admitting it once the block has room for every rank", lambda: api.admitted("gang"), 120)
    api.until("every rank running", lambda: len(running(api, "gang")) == 3, 120)
    assignment = next(a for a in api.workload("gang")["status"]["admission"]["podSetAssignments"] if a["name"] == "trainer")
    assert assignment.get("topologyAssignment"), assignment
    ranks = running(api, "gang")
    assert {p["spec"]["nodeName"] for p in ranks} == {"tas-b1-0", "tas-b1-1", "tas-b1-2"}
    for p in ranks:  # placed by Kueue's topology ungater: gate lifted, the assigned node in the pod's selector
        assert not p["spec"].get("schedulingGates"), p["spec"].get("schedulingGates")
        assert p["spec"]["nodeSelector"].get("kubernetes.io/hostname") == p["spec"]["nodeName"], p["spec"]["nodeSelector"]
        assert p["metadata"]["labels"]["kueue.x-k8s.io/podset"] == "trainer"
        assert p["metadata"]["annotations"]["kueue.x-k8s.io/workload"] == "gang-workload"
    api.until("PodsReady True", lambda: api.condition("gang", "PodsReady").get("status") == "True")
    [trainer] = [ps for ps in api.workload("gang")["spec"]["podSets"] if ps["name"] == "trainer"]
    assert trainer["topologyRequest"] == {"required": BLOCK, "podIndexLabel": "batch.kubernetes.io/job-completion-index"}


def test_a_topology_request_without_a_queue_is_admitted_by_the_api_server_and_refused_by_the_operator_naming_the_label(tas: Any, kueue: Kueue) -> None:
    """CEL cannot read labels, so the API server takes it; the operator fails it at once (ValidationFailed, with an
    event) instead of running a trainer whose topology request nothing honours."""
    api = queue(tas, kueue, "tas-unqueued", "kuberl-tas")
    manifest = gang("loose", api.ns, {"unconstrained": True})
    del manifest["metadata"]["labels"]
    api.call("POST", f"/apis/kuberl.io/v1alpha1/namespaces/{api.ns}/rlexperiments", manifest)
    api.until("phase Failed", lambda: api.phase("loose") == "Failed")
    status = api.get(f"/apis/kuberl.io/v1alpha1/namespaces/{api.ns}/rlexperiments/loose")["status"]
    [cond] = [c for c in status["conditions"] if c["type"] == "Validated"]
    assert cond["reason"] == "ValidationFailed" and "kueue.x-k8s.io/queue-name" in cond["message"], cond
    assert not api.get(f"/apis/batch/v1/namespaces/{api.ns}/jobs")["items"]
