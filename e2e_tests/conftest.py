"""End-to-end fixtures: a cluster that kubectl talks to, through KUBECONFIG only.

KUBECONFIG set: that cluster is used as it is (the operator installed, e.g. by the Helm chart); a
missing CRD fails the session with a clear message instead of skipping. KUBECONFIG unset: the strict
kmock emulator and the real operator (a subprocess) start here, and a kubeconfig is written for them.
The tests themselves only run kubectl, so they run unchanged against kind or any real cluster.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
CRD_NAME = "rlexperiments.kuberl.io"


@dataclass
class Cluster:
    """kubectl against the cluster under test; `emulated` tells whether pods really run."""

    kubeconfig: str
    emulated: bool
    timeout: float  # for things real pods must do (start, become ready)
    operator_log: Callable[[], str] = lambda: ""

    def kubectl(self, *args: str, check: bool = True, stdin: str | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        cmd = ["kubectl", *args]
        result = subprocess.run(cmd, env={**os.environ, "KUBECONFIG": self.kubeconfig}, capture_output=True, text=True,
                                input=stdin, timeout=timeout, check=False)
        if check and result.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
        return result

    def json(self, *args: str) -> Any:
        return json.loads(self.kubectl(*args, "-o", "json").stdout)

    def wait(self, what: str, fn: Callable[[], Any], timeout: float | None = None) -> Any:
        deadline = time.monotonic() + (timeout or self.timeout)
        last: Any = None
        while time.monotonic() < deadline:
            try:
                last = fn()
            except AssertionError as exc:  # a transient kubectl failure while objects appear
                last = exc
            else:
                if last:
                    return last
            time.sleep(1.0 if self.emulated else 5.0)
        raise AssertionError(f"timed out waiting for {what} (last: {last!r})\n{self.operator_log()}")

    def play_controllers(self, experiment: str) -> None:
        """On the emulator only: report the experiment's StatefulSets and Job as the kubelet and the
        controllers would once the pods run. A real cluster's pods become ready by themselves."""
        if not self.emulated:
            return
        for sts in self.json("get", "statefulsets", "-l", f"kuberl.io/experiment={experiment}")["items"]:
            n = sts["spec"].get("replicas", 1)
            status = {"replicas": n, "readyReplicas": n, "availableReplicas": n, "currentReplicas": n,
                      "updatedReplicas": n, "observedGeneration": sts["metadata"]["generation"]}
            self.kubectl("patch", "statefulset", sts["metadata"]["name"], "--subresource=status", "--type=merge",
                         "-p", json.dumps({"status": status}))
        for job in self.json("get", "jobs", "-l", f"kuberl.io/experiment={experiment}")["items"]:
            suspended = bool(job["spec"].get("suspend"))
            n = 0 if suspended else job["spec"].get("parallelism", 1)
            conds = [{"type": "Suspended", "status": "True", "reason": "JobSuspended", "message": "",
                      "lastProbeTime": _now(), "lastTransitionTime": _now()}] if suspended else None
            self.kubectl("patch", "job", job["metadata"]["name"], "--subresource=status", "--type=merge",
                         "-p", json.dumps({"status": {"active": n, "ready": n, "startTime": _now(), "conditions": conds}}))


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    if shutil.which("kubectl") is None:
        pytest.fail("e2e tests need kubectl on PATH")
    existing = os.environ.get("KUBECONFIG")
    if existing:
        c = Cluster(existing, emulated=False, timeout=float(os.environ.get("KUBERL_E2E_TIMEOUT", "900")))
        found = c.kubectl("get", "crd", CRD_NAME, check=False)
        if found.returncode != 0:
            pytest.fail(f"KUBECONFIG={existing}: CRD {CRD_NAME} is not installed ({found.stderr.strip()}). "
                        "Install the operator first, e.g. `helm install kuberl charts/kuberl`.")
        yield c
        return

    from kuberl.testing.kmock_strict import EmulatorServer
    from kuberl.testing.operator_process import OperatorProcess

    tmp = tmp_path_factory.mktemp("e2e")
    with EmulatorServer(crds=[]) as emu:
        kubeconfig = str(emu.write_kubeconfig(tmp / "kubeconfig"))
        c = Cluster(kubeconfig, emulated=True, timeout=90)
        # As an installation would: the CRD first, then the operator.
        c.kubectl("apply", "-f", str(ROOT / "crds"))
        with OperatorProcess(kubeconfig, tmp / "operator.log", interval=1.0, checkpoint_timeout=5.0) as op:
            c.operator_log = lambda: "--- operator log ---\n" + op.log_tail()
            yield c
            assert op.alive, f"the operator died during the e2e tests:\n{op.log_tail()}"
