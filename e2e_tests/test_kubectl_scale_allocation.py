"""`kubectl scale` on an experiment that uses the `allocation` shorthand (every GPU example does), on a
cluster with no GPU node: scale-from-zero. The operator must still create the pods (the autoscaler reacts
to pending pods), write the resolved replica count so /scale reads it, and follow kubectl scale up and
down without failing the spec. Only kubectl touches the cluster; no pod needs to run (real_pods not set),
so this runs unchanged against the local control plane and against kind or any real cluster.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

Cluster = Any  # the `cluster` fixture of e2e_tests/conftest.py

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]
ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "gsm8k-grpo.yaml"  # allocation: vllm:d4+fsdp:d4, 8 GPUs in all
NAME = "e2e-allocation-scale"


def manifest() -> str:
    doc = yaml.safe_load(EXAMPLE.read_text())
    assert doc["spec"]["allocation"].startswith("vllm:d4+"), "this test scales from the example's d4"
    assert "replicas" not in (doc["spec"].get("rollout") or {}), "the example leaves the count to the allocation"
    doc["metadata"]["name"] = NAME
    return yaml.safe_dump(doc)


def sts_replicas(c: Cluster) -> str:
    return c.kubectl("get", "statefulset", f"{NAME}-rollout", "-o", "jsonpath={.spec.replicas}", check=False).stdout.strip()


def scale_replicas(c: Cluster) -> int:
    """What an HPA or `kubectl scale` reads: the /scale subresource of the experiment."""
    path = f"/apis/kuberl.io/v1alpha1/namespaces/{c.namespace}/rlexperiments/{NAME}/scale"
    return int(json.loads(c.kubectl("get", "--raw", path).stdout)["spec"].get("replicas") or 0)


def validated(c: Cluster) -> tuple[str, str]:
    conds = (c.json("get", "rlx", NAME).get("status") or {}).get("conditions") or []
    cond = next((x for x in conds if x["type"] == "Validated"), {})
    return cond.get("status", ""), cond.get("message", "")


def test_an_allocation_example_gets_its_pods_and_a_scale_that_reads_its_replicas(cluster: Cluster) -> None:
    cluster.kubectl("apply", "-f", str(ROOT / "crds"), namespaced=False)
    cluster.kubectl("apply", "-f", "-", stdin=manifest())
    # No node here offers 8 GPUs (or any): the pods are created anyway (B1).
    cluster.wait("the rollout StatefulSet at the allocation's 4", lambda: sts_replicas(cluster) == "4")
    cluster.wait("the trainer Job", lambda: cluster.kubectl("get", "job", f"{NAME}-trainer", check=False).returncode == 0)
    cluster.wait("spec.rollout.replicas written by the operator, so /scale reads 4", lambda: scale_replicas(cluster) == 4)
    header = cluster.kubectl("get", "rlx", NAME).stdout.splitlines()[0].split()
    assert header[:3] == ["NAME", "PHASE", "REASON"], header


def test_kubectl_scale_up_and_down_moves_the_engines_and_keeps_the_spec_valid(cluster: Cluster) -> None:
    for replicas in (6, 2):
        cluster.kubectl("scale", f"rlx/{NAME}", "--replicas", str(replicas))
        cluster.wait(f"rollout StatefulSet at {replicas}", lambda r=replicas: sts_replicas(cluster) == str(r))
        assert scale_replicas(cluster) == replicas
        status, message = cluster.wait("the Validated condition", lambda: (v := validated(cluster))[0] and v)
        assert status == "True", f"kubectl scale to {replicas} must not fail the allocation spec: {message}"
        assert cluster.kubectl("get", "rlx", NAME, "-o", "jsonpath={.status.phase}").stdout.strip() != "Failed"


def test_deleting_the_scaled_experiment(cluster: Cluster) -> None:
    cluster.kubectl("delete", "rlx", NAME, "--wait=true", "--timeout=120s")
    cluster.wait("children garbage-collected", lambda: not cluster.kubectl(
        "get", "statefulsets,jobs", "-l", f"kuberl.io/experiment={NAME}", "-o", "name").stdout.strip(), timeout=120)
