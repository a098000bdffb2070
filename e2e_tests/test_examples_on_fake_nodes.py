"""Every RLExperiment in examples/ on the local control plane: admitted by the real API server, reconciled by the
operator under the chart's RBAC, its pods scheduled onto KWOK's nodes (GPU, L4, Ascend pools, the storage classes
the examples name) and the experiment Running, with its whole spec applied (Reconciled=True, observedGeneration at
its generation: a server-defaulted field is no change) and no Warning event. The Secrets and claims an example
refers to are made first, as its user would. Pods run no containers here, so Running is the phase they reach.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kuberl.api.loading import load_documents
from kuberl.api.v1alpha1 import RLExperiment
from kuberl.operator.observed import referenced_claims, referenced_secrets
from kuberl.testing.examples import experiment_files

Cluster = Any  # the `cluster` fixture of e2e_tests/conftest.py

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]
ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = [(path, doc) for path in experiment_files() for doc in load_documents(path)
            if doc.get("kind") == "RLExperiment"]


def needs_fabric(exp: RLExperiment) -> bool:
    """Capabilities, sidecars or hostPath volumes (examples/gke-a3-tcpxo.yaml, eks-p5-efa.yaml): the chart's admission
    policy admits them where an administrator labelled the namespace kuberl.io/fabric=allowed, as the guides do."""
    templates = [r.pod_template for r in (exp.spec.rollout, exp.spec.trainer) if r.pod_template]
    return any(t.capabilities or t.sidecars or any("hostPath" in v for v in t.volumes) for t in templates)


def needs(cluster: Cluster, exp: RLExperiment) -> list[dict[str, Any]]:
    """The Secrets and PVCs the example expects its user to have made."""
    out: list[dict[str, Any]] = []
    for _path, name, key in referenced_secrets(exp):
        out.append({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name}, "stringData": {key: "not-a-real-secret"}})
    for _path, claim in referenced_claims(exp):
        out.append({"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": claim},
                    "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "1Gi"}}}})
    return out


@pytest.mark.parametrize("path, doc", EXAMPLES, ids=[f"{p.stem}/{d['metadata']['name']}" for p, d in EXAMPLES])
def test_the_example_runs_on_fake_nodes_with_its_whole_spec_applied(cluster: Cluster, path: Path, doc: dict[str, Any]) -> None:
    if not cluster.fake_pods:
        pytest.skip("every example at once needs its GPUs: runs on the local control plane's fake nodes (KUBECONFIG unset)")
    doc = json.loads(json.dumps(doc))
    doc["metadata"].pop("namespace", None)  # the tests' namespace
    name = doc["metadata"]["name"]
    exp_model = RLExperiment.model_validate(doc)
    extra = needs(cluster, exp_model)
    fabric = needs_fabric(exp_model)
    try:
        if fabric:
            cluster.kubectl("label", "namespace", cluster.namespace, "kuberl.io/fabric=allowed", "--overwrite", namespaced=False)
        if extra:
            cluster.kubectl("apply", "-f", "-", stdin=json.dumps({"apiVersion": "v1", "kind": "List", "items": extra}))
        cluster.kubectl("apply", "-f", "-", stdin=json.dumps(doc))

        last: dict[str, Any] = {}

        def running() -> dict[str, Any] | None:
            exp = last["exp"] = cluster.json("get", "rlx", name)
            status = exp.get("status") or {}
            reconciled = next((c for c in status.get("conditions", []) if c["type"] == "Reconciled"), {})
            ok = (status.get("phase") == "Running" and reconciled.get("status") == "True"
                  and status.get("observedGeneration") == exp["metadata"]["generation"])
            return exp if ok else None

        try:
                exp = cluster.wait(f"{path.name}: phase Running, Reconciled and observedGeneration current", running)
        except AssertionError as exc:
            exp = last.get("exp") or {}
            raise AssertionError(f"generation {exp.get('metadata', {}).get('generation')}, status {json.dumps(exp.get('status'))}") from exc
        uid = exp["metadata"]["uid"]  # not the events of an earlier experiment of the same name
        warnings = [f"{e['reason']}: {e['message']}" for e in cluster.json("get", "events", "--field-selector",
                                                                           f"involvedObject.uid={uid},type=Warning")["items"]]
        assert warnings == [], f"{path.name}: {warnings}"
    finally:
        if fabric:
            cluster.kubectl("label", "namespace", cluster.namespace, "kuberl.io/fabric-", check=False, namespaced=False)
        cluster.kubectl("delete", "rlx", name, "--ignore-not-found", "--wait=true", "--timeout=120s", check=False)
        # Names repeat across examples (three are gsm8k-grpo): the next one must not meet this one's children.
        cluster.wait(f"{name}'s children gone", lambda: not cluster.kubectl(
            "get", "statefulsets,jobs,pods", "-l", f"kuberl.io/experiment={name}", "-o", "name").stdout.strip(), timeout=120)
        # The checkpoint PVC outlives its experiment (checkpoint.retainPolicy Retain): deleted here as its user would, or
        # the next example of the same name would find it (in another StorageClass: an immutable field, ApplyFailed).
        for kind, obj_name in [*((o["kind"].lower(), o["metadata"]["name"]) for o in extra), ("pvc", f"{name}-checkpoints")]:
            cluster.kubectl("delete", kind, obj_name, "--ignore-not-found", "--wait=true", "--timeout=60s", check=False)
