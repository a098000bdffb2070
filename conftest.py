"""The Kubernetes cluster every test that talks to Kubernetes uses (e2e_tests, tests/integration/test_operator*.py).

`kube` (session scope): with KUBECONFIG unset, a real control plane built from the upstream Go modules
(kuberl.testing.control_plane: etcd, kube-apiserver, controller manager, scheduler, KWOK nodes) started once per
test run on loopback ports; with KUBECONFIG set, that cluster as it is. `kuberl_installed` (session scope): on the
local control plane, the Helm chart installed as a user installs it (CRDs included; replicaCount 0) and the
operator run here as a subprocess with a token of the chart's ServiceAccount, so the chart's RBAC is what the
operator may do. On a cluster named by KUBECONFIG the operator must be installed already (e.g. by the chart).

tests/conftest.py puts every test that uses these fixtures in one pytest-xdist group, so one worker starts them.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kuberl.testing.control_plane import SESSION_STOPS, STOPPED_EARLY, stop_session_services
from kuberl.testing.kueue_fixtures import kueue  # noqa: F401  (Kueue's real manager, once per session)
from kuberl.testing.module_cleanup import ModuleExperiments

ROOT = Path(__file__).resolve().parent
RELEASE, OPERATOR_NAMESPACE = "kuberl", "kuberl-system"


@dataclass
class Kube:
    """A cluster: its admin kubeconfig, and the local control plane when this session started one."""

    kubeconfig: str
    control_plane: Any = None  # kuberl.testing.control_plane.ControlPlane, or None for $KUBECONFIG's cluster
    operator: Any = None  # kuberl.testing.operator_process.OperatorProcess once kuberl_installed started it
    operator_kubeconfig: str = ""  # its ServiceAccount's kubeconfig (a second replica uses it too)
    env: dict[str, str] = field(default_factory=dict)  # KUBECONFIG, and PATH with the built kubectl and helm first

    @property
    def local(self) -> bool:
        return self.control_plane is not None

    def allow_operator(self, namespace: str) -> None:
        """Open a namespace to the chart's operator as an administrator does (charts/kuberl values.yaml tenantNamespaces):
        a RoleBinding to its namespaced ClusterRole. Only where that ClusterRole exists (the chart is installed)."""
        if self.run("kubectl", "get", "clusterrole", f"{RELEASE}-namespaced", check=False).returncode != 0:
            return
        made = self.run("kubectl", "create", "rolebinding", f"{RELEASE}-operator", "-n", namespace, f"--clusterrole={RELEASE}-namespaced",
                        f"--serviceaccount={OPERATOR_NAMESPACE}:{RELEASE}", check=False)
        assert made.returncode == 0 or "AlreadyExists" in made.stderr, made.stderr

    def run(self, *cmd: str, stdin: str | None = None, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        out = subprocess.run(list(cmd), env=self.env, input=stdin, capture_output=True, text=True, timeout=timeout, check=False)
        if check and out.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
        return out


@pytest.fixture(scope="session")
def kube(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Kube]:
    existing = os.environ.get("KUBECONFIG")
    if existing:
        yield Kube(existing, env=dict(os.environ))
        return
    from kuberl.testing.control_plane import ControlPlane

    with ControlPlane(tmp_path_factory.mktemp("control-plane")) as cp:
        SESSION_STOPS.append(cp.stop)
        env = {**os.environ, "KUBECONFIG": cp.kubeconfig, "PATH": f"{cp.bin}{os.pathsep}{os.environ.get('PATH', '')}",
               "HELM_CACHE_HOME": str(cp.dir / "helm-cache"), "HELM_CONFIG_HOME": str(cp.dir / "helm-config"),
               "HELM_DATA_HOME": str(cp.dir / "helm-data")}
        MODULE_EXPERIMENTS.kube = Kube(cp.kubeconfig, cp, env=env)
        yield MODULE_EXPERIMENTS.kube
        MODULE_EXPERIMENTS.kube = None


@pytest.fixture(scope="session")
def kuberl_installed(kube: Kube, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Kube]:
    """KubeRL installed on `kube`: locally through `helm install` and an operator with the chart's ServiceAccount."""
    if not kube.local:
        yield kube
        return
    from kuberl.testing.operator_process import OperatorProcess

    cp = kube.control_plane
    kube.run("helm", "install", RELEASE, str(ROOT / "charts" / "kuberl"), "--namespace", OPERATOR_NAMESPACE, "--create-namespace",
             "--set", "replicaCount=0", "--wait", "--timeout", "2m")
    tmp = tmp_path_factory.mktemp("operator")
    sa = kube.run("kubectl", "get", "deployment", RELEASE, "-n", OPERATOR_NAMESPACE, "-o",
                  "jsonpath={.spec.template.spec.serviceAccountName}").stdout.strip()
    operator_kubeconfig = cp.kubeconfig_for(sa, OPERATOR_NAMESPACE, tmp / "operator.kubeconfig")
    # The chart's Deployment environment (POD_NAMESPACE: the bus NetworkPolicies admit the operator from there).
    env = {"POD_NAME": f"{RELEASE}-local-0", "POD_NAMESPACE": OPERATOR_NAMESPACE}
    # As the chart's Deployment runs it: --leader-election (the Lease in its namespace, under the chart's Role).
    with OperatorProcess(operator_kubeconfig, tmp / "operator.log", interval=1.0, checkpoint_timeout=5.0,
                         standalone=False, leader_election=True, extra_env=env) as op:
        kube.operator = op
        kube.operator_kubeconfig = operator_kubeconfig
        SESSION_STOPS.append(op.__exit__)
        yield kube
        assert op.alive or STOPPED_EARLY, f"the operator died during the tests:\n{op.log_tail()}"
    kube.operator = None


MODULE_EXPERIMENTS = ModuleExperiments()


def _in_kube_group(item: pytest.Item | None) -> bool:
    return item is not None and item.nodeid.endswith("@kube")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    if _in_kube_group(item):
        MODULE_EXPERIMENTS.module_starts(item)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Under xdist's loadgroup every test of the control-plane group runs on one worker, one after another: after the
    last of them (its own teardown done) stop Kueue, the operator and the control plane rather than at the end of
    the session. Without loadgroup (a developer's run of some files) they stay up until the session ends. After the
    last test of each module of the group, the experiments that module left are deleted (ModuleExperiments)."""
    yield
    if not _in_kube_group(item):
        return
    if SESSION_STOPS and not _in_kube_group(nextitem):
        stop_session_services()
    elif nextitem is None or nextitem.path != item.path:
        MODULE_EXPERIMENTS.module_ends()
