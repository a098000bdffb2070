"""End-to-end fixtures: a cluster that kubectl talks to, through KUBECONFIG only.

KUBECONFIG set: that cluster is used as it is (the operator installed, e.g. by the Helm chart); a
missing CRD fails the session with a clear message instead of skipping. KUBECONFIG unset: a real control
plane (kube-apiserver, etcd, controller manager, scheduler) with KWOK's fake nodes starts here, the chart
is installed with helm and the operator runs with the chart's ServiceAccount (the root conftest.py).
The tests themselves only run kubectl, so they run unchanged against kind or any real cluster.

Both ways the tests work in a namespace of their own ($KUBERL_E2E_NAMESPACE, default kuberl-e2e),
created here if missing and deleted at the end (with everything in it) when this session created
it; KUBERL_E2E_KEEP_ON_FAILURE=1 keeps it, and the failing experiment, for inspection.

Tests marked `real_pods` need containers that really run (a trainer that reports steps): on KWOK's
fake nodes (pods reach Running, Succeeded and Failed, but no container runs) they are skipped with the
reason, against a real cluster they run and can fail.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kuberl.testing.control_plane import STOPPED_EARLY

ROOT = Path(__file__).resolve().parents[1]
CRD_NAME = "rlexperiments.kuberl.io"
NAMESPACE = os.environ.get("KUBERL_E2E_NAMESPACE", "kuberl-e2e")
# The chart's operator pods (charts/kuberl/templates/_helpers.tpl kuberl.selectorLabels).
OPERATOR_SELECTOR = "app.kubernetes.io/name=kuberl,app.kubernetes.io/component=operator"
FAKE_PODS_SKIP_REASON = ("needs pods that really run (a trainer reporting steps): KWOK's fake nodes run no containers. "
                         "Set KUBECONFIG to a cluster with KubeRL installed, e.g. kind via scripts/e2e-kind.sh")


def fake_pods() -> bool:
    """Whether this session's pods are KWOK's: the local control plane starts exactly when KUBECONFIG is unset."""
    return not os.environ.get("KUBECONFIG")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "real_pods: needs a real cluster whose pods run; skipped on KWOK's fake nodes")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not fake_pods():
        return
    skip = pytest.mark.skip(reason=FAKE_PODS_SKIP_REASON)
    for item in items:
        if item.get_closest_marker("real_pods"):
            item.add_marker(skip)


@dataclass
class Cluster:
    """kubectl against the cluster under test, in `namespace`; `fake_pods` tells whether pods are KWOK's (no containers)."""

    kubeconfig: str
    fake_pods: bool
    timeout: float  # for things real pods must do (start, become ready)
    env: dict[str, str] = field(default_factory=dict)  # the environment of kubectl (PATH with the built kubectl first)
    namespace: str = NAMESPACE
    # KUBERL_E2E_KEEP_ON_FAILURE=1: a failing test leaves its experiment (and the namespace) for inspection.
    keep_on_failure: bool = os.environ.get("KUBERL_E2E_KEEP_ON_FAILURE", "").lower() in ("1", "true", "yes")
    operator_log: Callable[[], str] = lambda: ""
    kill_local_operator: Callable[[], None] | None = None  # the local operator subprocess: kill -9 and start again

    def restart_operator(self) -> None:
        """kill -9 the operator and wait until a new one is up: on the local control plane its subprocess; on a real
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
        result = subprocess.run(cmd, env={**(self.env or os.environ), "KUBECONFIG": self.kubeconfig}, capture_output=True, text=True,
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
            time.sleep(1.0 if self.fake_pods else 5.0)
        raise AssertionError(f"timed out waiting for {what} (last: {last!r})\n{self.diagnostics()}")

    def diagnostics(self, experiment: str | None = None, tail: int = 40) -> str:
        """What a failure report needs: the experiments, pods and events of the namespace; on the local control
        plane the operator's log, on a real cluster the last log lines of the experiment's pods (or of every
        pod in the namespace) and of the operator. Never raises."""
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
        if self.fake_pods:  # KWOK's pods have no logs
            return "\n".join([*parts, self.operator_log()])
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


@contextmanager
def _test_namespace(c: Cluster, session: pytest.Session, discarded: Callable[[], bool] = lambda: False) -> Iterator[None]:
    """The tests' namespace: created if missing, deleted at the end (and waited for, so that the
    next user of the cluster finds its CPUs free) when created here, kept on failure if asked; left alone when
    `discarded()` says the whole cluster is gone already (the local control plane, stopped after its tests)."""
    def ns_phase() -> str | None:
        got = c.kubectl("get", "namespace", c.namespace, "-o", "jsonpath={.status.phase}", check=False, namespaced=False)
        return got.stdout.strip() if got.returncode == 0 else None

    if ns_phase() == "Terminating":  # left by an earlier session: wait until it is gone
        c.wait(f"namespace {c.namespace} (terminating) to go", lambda: ns_phase() is None, timeout=600)
    created = ns_phase() is None
    if created:
        c.kubectl("create", "namespace", c.namespace, namespaced=False)
    yield
    if not created or discarded():
        return
    if session.testsfailed and c.keep_on_failure:
        print(f"\nKUBERL_E2E_KEEP_ON_FAILURE: namespace {c.namespace} kept; `kubectl delete namespace {c.namespace}` removes it")
        return
    gone = c.kubectl("delete", "namespace", c.namespace, "--wait=true", "--timeout=600s", check=False, namespaced=False, timeout=660)
    if gone.returncode != 0:  # the tests' verdict stands; the leftover is worth a warning, not a failure
        warnings.warn(f"namespace {c.namespace} was not deleted: {gone.stderr.strip()}", stacklevel=1)


@pytest.fixture(scope="session")
def cluster(request: pytest.FixtureRequest, kuberl_installed: Any) -> Iterator[Cluster]:
    """kubectl against `kuberl_installed` (conftest.py): the local control plane with the chart installed and the
    operator running under the chart's ServiceAccount, or the cluster KUBECONFIG names (KubeRL installed there)."""
    kube = kuberl_installed
    if kube.local:
        c = Cluster(kube.kubeconfig, fake_pods=True, timeout=120, env=kube.env)
        op = kube.operator
        c.operator_log = lambda: "--- operator log ---\n" + op.log_tail()
        c.kill_local_operator = op.restart
        with _test_namespace(c, request.session, discarded=lambda: bool(STOPPED_EARLY)):
            kube.allow_operator(c.namespace)  # as an admin opens a tenant namespace (the chart's tenantNamespaces)
            yield c
        # STOPPED_EARLY: the root conftest.py stopped the operator (and the control plane) after the group's last test
        assert op.alive or STOPPED_EARLY, f"the operator died during the e2e tests:\n{op.log_tail()}"
        return
    c = Cluster(kube.kubeconfig, fake_pods=False, timeout=float(os.environ.get("KUBERL_E2E_TIMEOUT", "900")), env=kube.env)
    found = c.kubectl("get", "crd", CRD_NAME, check=False, namespaced=False)
    if found.returncode != 0:
        pytest.fail(f"KUBECONFIG={kube.kubeconfig}: CRD {CRD_NAME} is not installed ({found.stderr.strip()}). "
                    "Install the operator first, e.g. `helm install kuberl charts/kuberl`.")
    with _test_namespace(c, request.session):
        kube.allow_operator(c.namespace)
        yield c
