"""End-to-end fixtures: a cluster that kubectl talks to, through KUBECONFIG only.

KUBECONFIG set: that cluster is used as it is (the operator installed, e.g. by the Helm chart); a
missing CRD fails the session with a clear message instead of skipping. KUBECONFIG unset: the strict
kmock emulator and the real operator (a subprocess) start here, and a kubeconfig is written for them.
The tests themselves only run kubectl, so they run unchanged against kind or any real cluster.

Both ways the tests work in a namespace of their own ($KUBERL_E2E_NAMESPACE, default kuberl-e2e),
created here if missing and deleted at the end (with everything in it) when this session created
it; KUBERL_E2E_KEEP_ON_FAILURE=1 keeps it, and the failing experiment, for inspection.

Tests marked `real_pods` need containers that really run (a trainer that reports steps): against
the emulator they are skipped with the reason, against a real cluster they run and can fail.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
CRD_NAME = "rlexperiments.kuberl.io"
NAMESPACE = os.environ.get("KUBERL_E2E_NAMESPACE", "kuberl-e2e")
# The chart's operator pods (charts/kuberl/templates/_helpers.tpl kuberl.selectorLabels).
OPERATOR_SELECTOR = "app.kubernetes.io/name=kuberl,app.kubernetes.io/component=operator"
EMULATOR_SKIP_REASON = ("needs pods that really run (a trainer reporting steps): the emulated API server runs no "
                        "containers. Set KUBECONFIG to a cluster with KubeRL installed, e.g. kind via scripts/e2e-kind.sh")


def emulated() -> bool:
    """Whether this session runs against the emulator: the `cluster` fixture starts one exactly when KUBECONFIG is unset."""
    return not os.environ.get("KUBECONFIG")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "real_pods: needs a real cluster whose pods run; skipped against the emulator")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not emulated():
        return
    skip = pytest.mark.skip(reason=EMULATOR_SKIP_REASON)
    for item in items:
        if item.get_closest_marker("real_pods"):
            item.add_marker(skip)


@dataclass
class Cluster:
    """kubectl against the cluster under test, in `namespace`; `emulated` tells whether pods really run."""

    kubeconfig: str
    emulated: bool
    timeout: float  # for things real pods must do (start, become ready)
    namespace: str = NAMESPACE
    # KUBERL_E2E_KEEP_ON_FAILURE=1: a failing test leaves its experiment (and the namespace) for inspection.
    keep_on_failure: bool = os.environ.get("KUBERL_E2E_KEEP_ON_FAILURE", "").lower() in ("1", "true", "yes")
    operator_log: Callable[[], str] = lambda: ""
    kill_local_operator: Callable[[], None] | None = None  # the emulator's operator subprocess: kill -9 and start again

    def restart_operator(self) -> None:
        """kill -9 the operator and wait until a new one is up: on the emulator its subprocess; on a real
        cluster the chart's operator pods (force-deleted, as a node loss would), replaced by their Deployment."""
        if self.kill_local_operator is not None:
            self.kill_local_operator()
            return
        pods = self.json("get", "pods", "--all-namespaces", "-l", OPERATOR_SELECTOR)["items"]
        assert pods, f"no operator pod ({OPERATOR_SELECTOR}) to kill"
        for pod in pods:
            meta = pod["metadata"]
            self.kubectl("delete", "pod", meta["name"], "--namespace", meta["namespace"], "--grace-period=0", "--force",
                         "--wait=false", namespaced=False)
        old = {p["metadata"]["uid"] for p in pods}

        def replaced() -> bool:
            now = self.json("get", "pods", "--all-namespaces", "-l", OPERATOR_SELECTOR)["items"]
            return any(p["metadata"]["uid"] not in old and any(c.get("type") == "Ready" and c.get("status") == "True"
                                                                 for c in p.get("status", {}).get("conditions", []))
                       for p in now)

        self.wait("a new operator pod Ready", replaced)

    def kubectl(self, *args: str, check: bool = True, stdin: str | None = None, timeout: float = 120,
                namespaced: bool = True) -> subprocess.CompletedProcess[str]:
        """`kubectl [--namespace NS] ARGS` (kubectl ignores the namespace for cluster-scoped objects)."""
        cmd = ["kubectl", *([f"--namespace={self.namespace}"] if namespaced else []), *args]
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
        raise AssertionError(f"timed out waiting for {what} (last: {last!r})\n{self.diagnostics()}")

    def diagnostics(self, experiment: str | None = None, tail: int = 40) -> str:
        """What a failure report needs: on the emulator the operator's log; on a real cluster the
        experiments, pods and events of the namespace, the last log lines of the experiment's pods
        (or of every pod in the namespace) and of the operator. Never raises."""
        if self.emulated:
            return self.operator_log()
        parts: list[str] = []

        def add(title: str, *args: str, namespaced: bool = True) -> None:
            try:
                out = self.kubectl(*args, check=False, timeout=60, namespaced=namespaced)
                parts.append(f"--- {title} ---\n{out.stdout}{out.stderr}")
            except Exception as exc:  # noqa: BLE001 - a report must not hide the failure it reports
                parts.append(f"--- {title}: {exc!r}")

        selector = f"kuberl.io/experiment={experiment}" if experiment else None
        add("experiments", "get", "rlexperiments", "-o", "wide")
        add("pods", "get", "pods", "-o", "wide")
        add("events", "get", "events", "--sort-by=.lastTimestamp")
        try:
            pods = self.json("get", "pods", *(["-l", selector] if selector else []))["items"]
        except Exception:  # noqa: BLE001
            pods = []
        for pod in pods:
            name = pod["metadata"]["name"]
            add(f"logs of pod {name}", "logs", name, "--all-containers", "--prefix", f"--tail={tail}")
        try:  # the operator's pods, wherever the chart put them (kubectl logs has no --all-namespaces)
            operators = self.json("get", "pods", "--all-namespaces", "-l", OPERATOR_SELECTOR)["items"]
        except Exception:  # noqa: BLE001
            operators = []
        for pod in operators:
            meta = pod["metadata"]
            add(f"operator log ({meta['namespace']}/{meta['name']})", "logs", "--namespace", meta["namespace"], meta["name"],
                "--tail=60", namespaced=False)
        return "\n".join(parts)

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


@contextmanager
def _test_namespace(c: Cluster, session: pytest.Session) -> Iterator[None]:
    """The tests' namespace: created if missing, deleted at the end (and waited for, so that the
    next user of the cluster finds its CPUs free) when created here, kept on failure if asked."""
    def ns_phase() -> str | None:
        got = c.kubectl("get", "namespace", c.namespace, "-o", "jsonpath={.status.phase}", check=False, namespaced=False)
        return got.stdout.strip() if got.returncode == 0 else None

    if ns_phase() == "Terminating":  # left by an earlier session: wait until it is gone
        c.wait(f"namespace {c.namespace} (terminating) to go", lambda: ns_phase() is None, timeout=600)
    created = ns_phase() is None
    if created:
        # From a manifest (not `kubectl create namespace`, whose typed client speaks protobuf: the emulator reads JSON only).
        c.kubectl("create", "-f", "-", namespaced=False,
                  stdin=json.dumps({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": c.namespace}}))
    yield
    if not created:
        return
    if session.testsfailed and c.keep_on_failure:
        print(f"\nKUBERL_E2E_KEEP_ON_FAILURE: namespace {c.namespace} kept; `kubectl delete namespace {c.namespace}` removes it")
        return
    gone = c.kubectl("delete", "namespace", c.namespace, "--wait=true", "--timeout=600s", check=False, namespaced=False, timeout=660)
    if gone.returncode != 0:  # the tests' verdict stands; the leftover is worth a warning, not a failure
        warnings.warn(f"namespace {c.namespace} was not deleted: {gone.stderr.strip()}", stacklevel=1)


@pytest.fixture(scope="session")
def cluster(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    if shutil.which("kubectl") is None:
        pytest.fail("e2e tests need kubectl on PATH")
    existing = os.environ.get("KUBECONFIG")
    if existing:
        c = Cluster(existing, emulated=False, timeout=float(os.environ.get("KUBERL_E2E_TIMEOUT", "900")))
        found = c.kubectl("get", "crd", CRD_NAME, check=False, namespaced=False)
        if found.returncode != 0:
            pytest.fail(f"KUBECONFIG={existing}: CRD {CRD_NAME} is not installed ({found.stderr.strip()}). "
                        "Install the operator first, e.g. `helm install kuberl charts/kuberl`.")
        with _test_namespace(c, request.session):
            yield c
        return

    from kuberl.testing.kmock_strict import EmulatorServer
    from kuberl.testing.operator_process import OperatorProcess

    tmp = tmp_path_factory.mktemp("e2e")
    with EmulatorServer(crds=[]) as emu:
        kubeconfig = str(emu.write_kubeconfig(tmp / "kubeconfig"))
        c = Cluster(kubeconfig, emulated=True, timeout=90)
        # As an installation would: the CRD first, then the operator.
        c.kubectl("apply", "-f", str(ROOT / "crds"), namespaced=False)
        with OperatorProcess(kubeconfig, tmp / "operator.log", interval=1.0, checkpoint_timeout=5.0) as op:
            c.operator_log = lambda: "--- operator log ---\n" + op.log_tail()
            c.kill_local_operator = op.restart
            with _test_namespace(c, request.session):
                yield c
            assert op.alive, f"the operator died during the e2e tests:\n{op.log_tail()}"
