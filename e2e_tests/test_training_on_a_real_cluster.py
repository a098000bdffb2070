"""The CPU quickstart really trains on a cluster: pods start from the runtime-cpu image, the engine
generates, the trainer takes steps, and the operator reports them in `.status.progress.step`.

Only a cluster whose pods run can pass it (kind with the chart and the images loaded:
scripts/e2e-kind.sh, .github/workflows/e2e-kind.yml); on KWOK's fake nodes it is skipped (conftest.py,
marker `real_pods`). It runs after test_kubectl_lifecycle.py, in the same namespace."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

Cluster = Any  # the `cluster` fixture of e2e_tests/conftest.py

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "examples" / "quickstart-cpu.yaml"
FALLBACK = Path(__file__).parent / "manifests" / "quickstart-cpu.yaml"
NAME = "e2e-train-cpu"
STEPS = int(os.environ.get("KUBERL_E2E_TRAIN_STEPS", "2"))  # progress.step to reach
# Image start, vLLM CPU start-up and the first steps on a 4-core CI runner; generous, and bounded.
TRAIN_TIMEOUT = float(os.environ.get("KUBERL_E2E_TRAIN_TIMEOUT", "1500"))

pytestmark = [pytest.mark.e2e]


def experiment() -> dict[str, Any]:
    """The CPU quickstart under another name, with smaller CPU requests (the engine and the trainer
    still use what the node has free; requests only reserve it) and fewer steps."""
    manifest = yaml.safe_load((QUICKSTART if QUICKSTART.exists() else FALLBACK).read_text())
    manifest["metadata"] = {"name": NAME}
    spec = manifest["spec"]
    spec["rollout"]["resources"] = {"requests": {"cpu": "500m", "memory": "2Gi"}}
    spec["trainer"]["resources"] = {"requests": {"cpu": "500m", "memory": "2Gi"}}
    spec["training"] = {"totalSteps": max(20, STEPS + 5)}
    spec["checkpoint"]["everySteps"] = 10
    return manifest


def test_the_experiment_manifest_is_valid() -> None:
    """The manifest this module applies passes `kuberl validate`'s checks (here, before any cluster)."""
    validation = pytest.importorskip("kuberl.api.validation", reason="kuberl is not installed")
    assert validation.validate_manifest(experiment()) == []


def pods_gone(cluster: Cluster, selector: str) -> bool:
    return not cluster.kubectl("get", "pods", "-l", selector, "-o", "name").stdout.strip()


@pytest.mark.real_pods
@pytest.mark.timeout(TRAIN_TIMEOUT + 900)
def test_quickstart_cpu_trains_on_a_real_cluster(cluster: Cluster) -> None:
    # A run of this test kept from an earlier session (KUBERL_E2E_KEEP_ON_FAILURE) goes: this one starts afresh.
    cluster.kubectl("delete", "rlexperiment", NAME, "--ignore-not-found", "--wait=true", "--timeout=300s", timeout=330)
    # Other experiments left in the namespace (a failed lifecycle test) would hold the node's CPUs:
    # deleted, or with KUBERL_E2E_KEEP_ON_FAILURE suspended (kept, with their status and events).
    if cluster.keep_on_failure:
        for name in cluster.kubectl("get", "rlexperiments", "-o", "name").stdout.split():
            cluster.kubectl("patch", name, "--type=merge", "-p", json.dumps({"spec": {"suspend": True}}))
    else:
        cluster.kubectl("delete", "rlexperiments", "--all", "--wait=true", "--timeout=300s", timeout=330)
    cluster.wait("pods of earlier experiments to stop", lambda: pods_gone(cluster, "kuberl.io/experiment"), timeout=600)

    cluster.kubectl("apply", "-f", "-", stdin=json.dumps(experiment()))
    deadline = time.monotonic() + TRAIN_TIMEOUT
    history: list[str] = []
    status: dict[str, Any] = {}
    passed = False
    try:
        while True:
            status = cluster.json("get", "rlexperiment", NAME).get("status") or {}
            progress = status.get("progress") or {}
            step = int(progress.get("step") or 0)
            line = (f"{time.strftime('%H:%M:%S')} phase={status.get('phase')} step={step} "
                    f"version={progress.get('policyVersion')} reward={progress.get('rewardText')} "
                    f"rollout={(status.get('rollout') or {}).get('readyText')}")
            if not history or history[-1].split(" ", 1)[1] != line.split(" ", 1)[1]:
                history.append(line)
                print(line, flush=True)
            assert status.get("phase") != "Failed", (
                f"experiment {NAME} failed: {json.dumps(status.get('conditions'), indent=1)}\n{cluster.diagnostics(NAME)}")
            if step >= STEPS:
                break
            assert time.monotonic() < deadline, (
                f"progress.step stayed below {STEPS} for {TRAIN_TIMEOUT:.0f} s\n" + "\n".join(history)
                + f"\n{cluster.diagnostics(NAME)}")
            time.sleep(10)
        assert status.get("phase") in ("Running", "Succeeded"), status
        # The STEP printer column (.status.progress.steps, "step/total") shows it too.
        row = next(line for line in cluster.kubectl("get", "rlx", NAME).stdout.splitlines()[1:] if line.startswith(NAME))
        assert int(row.split()[2].split("/")[0]) >= STEPS, row
        passed = True
    finally:
        if passed or not cluster.keep_on_failure:
            # Deleted and its pods gone: whatever runs next on the cluster finds the CPUs free.
            cluster.kubectl("delete", "rlexperiment", NAME, "--ignore-not-found", "--wait=true", "--timeout=300s", timeout=330)
            cluster.wait(f"pods of {NAME} to stop", lambda: pods_gone(cluster, f"kuberl.io/experiment={NAME}"), timeout=600)
