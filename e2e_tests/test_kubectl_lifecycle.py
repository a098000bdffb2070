"""The user's journey with kubectl only: install the CRD, apply the CPU quickstart, watch it run in
`kubectl get rlx`, scale it, suspend it, delete it. The tests run in order and share one experiment;
they touch the cluster only through kubectl and KUBECONFIG (see conftest.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

Cluster = Any  # the `cluster` fixture of e2e_tests/conftest.py (kubectl, wait)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]
ROOT = Path(__file__).resolve().parents[1]
CRD_NAME = "rlexperiments.kuberl.io"
QUICKSTART = ROOT / "examples" / "quickstart-cpu.yaml"
FALLBACK = Path(__file__).parent / "manifests" / "quickstart-cpu.yaml"
MANIFEST = QUICKSTART if QUICKSTART.exists() else FALLBACK
NAME = yaml.safe_load(MANIFEST.read_text())["metadata"]["name"]
COLUMNS = ["NAME", "PHASE", "REASON", "STEP", "VERSION", "REWARD", "ROLLOUT", "AGE"]


def phase(c: Cluster) -> str:
    return c.kubectl("get", "rlx", NAME, "-o", "jsonpath={.status.phase}").stdout.strip()


def test_the_crd_applies_and_is_established(cluster: Cluster) -> None:
    out = cluster.kubectl("apply", "-f", str(ROOT / "crds")).stdout
    assert CRD_NAME in out
    cluster.kubectl("wait", "--for=condition=Established", f"crd/{CRD_NAME}", "--timeout=60s")
    resources = cluster.kubectl("api-resources", "--api-group=kuberl.io").stdout
    assert "rlx" in resources and "RLExperiment" in resources


def test_applying_the_quickstart_creates_an_experiment_kubectl_get_shows_with_printer_columns(cluster: Cluster) -> None:
    out = cluster.kubectl("apply", "-f", str(MANIFEST)).stdout
    assert f"rlexperiment.kuberl.io/{NAME}" in out
    table = cluster.kubectl("get", "rlx").stdout.splitlines()
    assert table[0].split() == COLUMNS, table[0]
    assert any(line.split()[0] == NAME for line in table[1:])


def test_the_operator_creates_the_children_and_the_experiment_reaches_running(cluster: Cluster) -> None:
    cluster.wait("the rollout StatefulSet", lambda: cluster.kubectl("get", "statefulset", f"{NAME}-rollout", check=False).returncode == 0)
    cluster.wait("the trainer Job", lambda: cluster.kubectl("get", "job", f"{NAME}-trainer", check=False).returncode == 0)
    owners = cluster.json("get", "statefulset", f"{NAME}-rollout")["metadata"]["ownerReferences"]
    assert owners[0]["kind"] == "RLExperiment" and owners[0]["name"] == NAME

    def running() -> bool:
        return phase(cluster) == "Running"

    cluster.wait("phase Running", running)
    row = next(line for line in cluster.kubectl("get", "rlx", NAME).stdout.splitlines()[1:] if line.startswith(NAME))
    assert "Running" in row.split() and "1/1" in row.split(), row  # PHASE and ROLLOUT ready/desired


def test_kubectl_scale_changes_the_rollout_replicas(cluster: Cluster) -> None:
    cluster.kubectl("scale", f"rlx/{NAME}", "--replicas", "2")
    assert cluster.json("get", "rlx", NAME)["spec"]["rollout"]["replicas"] == 2
    cluster.wait("rollout StatefulSet at 2 replicas", lambda: cluster.kubectl(
        "get", "statefulset", f"{NAME}-rollout", "-o", "jsonpath={.spec.replicas}").stdout.strip() == "2")

    def two_wanted() -> bool:
        text = cluster.kubectl("get", "rlx", NAME, "-o", "jsonpath={.status.rollout.readyText}").stdout.strip()
        # A real cluster may lack room for a second CPU engine: the status must still say 2 are wanted.
        return text == "2/2" if cluster.fake_pods else text.endswith("/2")

    cluster.wait("status.rollout showing 2 replicas", two_wanted)


def test_kubectl_patch_suspend_suspends_the_trainer_and_scales_rollout_to_zero(cluster: Cluster) -> None:
    cluster.kubectl("patch", "rlx", NAME, "--type=merge", "-p", json.dumps({"spec": {"suspend": True}}))
    # The operator first asks the trainer for a checkpoint (bounded wait), then suspends.
    cluster.wait("the trainer Job suspended", lambda: cluster.kubectl(
        "get", "job", f"{NAME}-trainer", "-o", "jsonpath={.spec.suspend}").stdout.strip() == "true")
    cluster.wait("rollout scaled to 0", lambda: cluster.kubectl(
        "get", "statefulset", f"{NAME}-rollout", "-o", "jsonpath={.spec.replicas}").stdout.strip() == "0")

    def all_stopped() -> bool:
        reason = cluster.kubectl("get", "rlx", NAME, "-o", 'jsonpath={.status.conditions[?(@.type=="Suspended")].reason}').stdout.strip()
        return phase(cluster) == "Suspended" and reason == "Suspended"

    cluster.wait("phase Suspended with every pod stopped", all_stopped)
    reasons = cluster.kubectl("get", "events", "--field-selector", f"involvedObject.name={NAME}",
                              "-o", "jsonpath={.items[*].reason}").stdout.split()
    assert "CheckpointRequested" in reasons and "Suspended" in reasons, reasons


def test_kubectl_delete_removes_the_experiment_and_its_children(cluster: Cluster) -> None:
    cluster.kubectl("delete", "-f", str(MANIFEST), "--wait=true", "--timeout=120s")
    assert cluster.kubectl("get", "rlx", NAME, check=False).returncode != 0
    cluster.wait("children garbage-collected", lambda: not cluster.kubectl(
        "get", "statefulsets,jobs,configmaps,services", "-l", f"kuberl.io/experiment={NAME}", "-o", "name").stdout.strip(), timeout=120)
