"""The operator killed mid-reconcile (issue 16, point 3): while creating an experiment's children, during a
suspend, during a scale. When a new operator comes back it converges to the right state: one of each child,
the same trainer Job (a re-created Job is a restarted training run), the suspend and the scale carried out,
the status not lost. kill -9 is the local operator subprocess (on the local control plane), or the chart's operator pods on a real
cluster (Cluster.restart_operator); the tests only use kubectl, so they run unchanged against either.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

Cluster = Any  # the `cluster` fixture of e2e_tests/conftest.py

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]
ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "examples" / "quickstart-cpu.yaml"
NAME = "e2e-operator-restarts"
LABEL = f"kuberl.io/experiment={NAME}"
KINDS = "statefulsets,jobs,services,configmaps,secrets,persistentvolumeclaims"


def manifest() -> str:
    doc = yaml.safe_load(QUICKSTART.read_text())
    doc["metadata"]["name"] = NAME
    return yaml.safe_dump(doc)


def children(c: Cluster) -> list[str]:
    """kind/name of every object labelled with the experiment (duplicates would show as extra names)."""
    return sorted(c.kubectl("get", KINDS, "-l", LABEL, "-o", "name").stdout.split())


def trainer_uid(c: Cluster) -> str:
    return c.kubectl("get", "job", f"{NAME}-trainer", "-o", "jsonpath={.metadata.uid}", check=False).stdout.strip()


def status(c: Cluster) -> dict:
    return c.json("get", "rlx", NAME).get("status") or {}


def running(c: Cluster) -> bool:
    return status(c).get("phase") == "Running"


def kill_when(c: Cluster, what: str, seen) -> None:
    """kill -9 the operator as soon as `seen()` holds (it has started the work), or after 10 s."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not seen():
        time.sleep(0.05)
    c.restart_operator()


@pytest.fixture(scope="module")
def experiment(cluster: Cluster):
    cluster.kubectl("apply", "-f", str(ROOT / "crds"), namespaced=False)
    yield
    cluster.kubectl("delete", "rlx", NAME, "--ignore-not-found", "--wait=true", "--timeout=120s", check=False)


def test_killed_while_creating_the_children_it_converges_with_one_of_each(cluster: Cluster, experiment) -> None:
    cluster.kubectl("apply", "-f", "-", stdin=manifest())
    # Dies after the first child exists, before (most of) the rest: the new operator must finish the job.
    kill_when(cluster, "the first child", lambda: bool(children(cluster)))
    cluster.wait("phase Running after the restart", lambda: running(cluster))
    names = children(cluster)
    assert len(names) == len(set(names))
    for kind, name in (("statefulset", f"{NAME}-rollout"), ("job", f"{NAME}-trainer")):
        assert f"{'statefulset.apps' if kind == 'statefulset' else 'job.batch'}/{name}" in names, names
    jobs = cluster.kubectl("get", "jobs", "-l", LABEL, "-o", "name").stdout.split()
    assert jobs == [f"job.batch/{NAME}-trainer"], jobs
    # A second restart with nothing to do changes nothing: same children, same trainer, same phase.
    before, uid = names, trainer_uid(cluster)
    cluster.restart_operator()
    time.sleep(3)
    assert children(cluster) == before and trainer_uid(cluster) == uid
    assert status(cluster).get("phase") == "Running"


def test_killed_during_a_scale_it_applies_the_scale_and_keeps_the_trainer(cluster: Cluster, experiment) -> None:
    uid = trainer_uid(cluster)
    assert uid, "the experiment of the first test is gone"
    cluster.kubectl("scale", f"rlx/{NAME}", "--replicas", "2")
    cluster.restart_operator()  # at once: before (or while) the operator resizes the StatefulSet
    cluster.wait("rollout StatefulSet at 2 replicas", lambda: cluster.kubectl(
        "get", "statefulset", f"{NAME}-rollout", "-o", "jsonpath={.spec.replicas}").stdout.strip() == "2")

    def two_ready() -> bool:
        text = (status(cluster).get("rollout") or {}).get("readyText", "")
        return text == "2/2" if cluster.fake_pods else text.endswith("/2")

    cluster.wait("status.rollout showing 2 replicas", two_ready)
    assert trainer_uid(cluster) == uid, "the trainer Job was re-created: the training run restarted"
    cluster.wait("observedGeneration caught up with the scale",
                 lambda: status(cluster).get("observedGeneration") == cluster.json("get", "rlx", NAME)["metadata"]["generation"])


def test_killed_during_a_suspend_it_finishes_the_suspend_and_resume_keeps_the_trainer(cluster: Cluster, experiment) -> None:
    uid = trainer_uid(cluster)
    assert uid, "the experiment of the first test is gone"
    cluster.kubectl("patch", "rlx", NAME, "--type=merge", "-p", json.dumps({"spec": {"suspend": True}}))
    # Dies while it asks the trainer for a checkpoint before suspending (a bounded wait), or just after.
    kill_when(cluster, "the suspend under way", lambda: "CheckpointRequested" in cluster.kubectl(
        "get", "events", "--field-selector", f"involvedObject.name={NAME}", "-o", "jsonpath={.items[*].reason}").stdout)
    cluster.wait("the trainer Job suspended", lambda: cluster.kubectl(
        "get", "job", f"{NAME}-trainer", "-o", "jsonpath={.spec.suspend}").stdout.strip() == "true")

    def suspended() -> bool:
        return status(cluster).get("phase") == "Suspended"

    cluster.wait("phase Suspended", suspended)
    assert cluster.kubectl("get", "statefulset", f"{NAME}-rollout", "-o", "jsonpath={.spec.replicas}").stdout.strip() == "0"
    cluster.kubectl("patch", "rlx", NAME, "--type=merge", "-p", json.dumps({"spec": {"suspend": False}}))
    cluster.restart_operator()
    cluster.wait("the trainer Job resumed", lambda: cluster.kubectl(
        "get", "job", f"{NAME}-trainer", "-o", "jsonpath={.spec.suspend}").stdout.strip() in ("false", ""))
    cluster.wait("phase Running again", lambda: running(cluster))
    assert trainer_uid(cluster) == uid, "the trainer Job was re-created: the training run restarted"
