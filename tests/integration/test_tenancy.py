"""Least privilege on a shared cluster (issue #38.1), on the real control plane with the chart installed by helm and
the operator running under the chart's RBAC (the root conftest.py's `kuberl_installed`; its defaults: the operator
may write in `default` only, tenant roles aggregated, the admission policy on).

- The operator may not write in a namespace no RoleBinding opens: the experiment says so (condition, event, the
  command that fixes it), nothing is created there, and the command it prints makes it run.
- A user bound to the built-in `edit` ClusterRole may create RLExperiments in that namespace; one bound to `view' may
  list them and not create one (the chart's aggregated ClusterRoles; users are impersonated with kubectl --as).
- The API server refuses what an administrator has not allowed (hostPath, a ServiceAccount, an image outside the
  allowed registries) at admission, naming the field and the chart value.
"""

from __future__ import annotations

import json
import shlex
import subprocess
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kuberl.testing.control_plane import ROOT, ControlPlane
from kuberl.testing.examples import experiment_files

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]
FABRIC_EXAMPLES = ("gke-a3-tcpxo.yaml", "eks-p5-efa.yaml")  # capabilities, root sidecars, hostPath: the kuberl.io/fabric label


def manifest(name: str, namespace: str, **roles: Any) -> dict[str, Any]:
    spec = {"model": {"builtin": "tiny-qwen2", "dtype": "float32"}, "dataset": {"builtin": "repeat-digit", "size": 100},
            "workflow": {"reward": "repeat-digit"}, "algorithm": {"samplesPerPrompt": 2, "batchSize": 2, "maxNewTokens": 4},
            "rollout": {"engine": "vllm", "replicas": 1, "accelerator": {"type": "cpu", "count": 0}},
            "trainer": {"accelerator": {"type": "cpu", "count": 1}}, "checkpoint": {"size": "1Gi"}, "training": {"totalSteps": 10}}
    for key, extra in roles.items():
        spec[key] = {**spec.get(key, {}), **extra}
    return {"apiVersion": "kuberl.io/v1alpha1", "kind": "RLExperiment", "metadata": {"name": name, "namespace": namespace}, "spec": spec}


class Cluster:
    """kubectl as the admin, or as a user (impersonated), and waits that fail with the operator's log."""

    def __init__(self, kube: Any):
        self.kube, self.cp, self.op = kube, kube.control_plane, kube.operator
        self.cp: ControlPlane

    def kubectl(self, *args: str, stdin: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self.cp.kubectl(*args, stdin=stdin, check=check)

    def create(self, obj: dict[str, Any], as_user: str | None = None, dry_run: bool = False) -> subprocess.CompletedProcess[str]:
        """`kubectl create` (as `as_user`); `dry_run`: through admission, not stored."""
        flags = [*([f"--as={as_user}"] if as_user else []), *(["--dry-run=server"] if dry_run else [])]
        return self.kubectl("create", "-f", "-", *flags, stdin=json.dumps(obj), check=False)

    def get(self, *args: str) -> Any:
        out = self.kubectl("get", *args, "-o", "json", check=False)
        return json.loads(out.stdout) if out.returncode == 0 else None

    def namespace(self, name: str) -> str:
        self.kubectl("create", "namespace", name)
        return name

    def wait(self, what: str, fn: Callable[[], Any], timeout: float = 60) -> Any:
        return self.op.wait(what, fn, timeout, period=0.5)


@pytest.fixture(scope="module")
def cluster(kuberl_installed: Any) -> Iterator[Cluster]:
    if not kuberl_installed.local:
        pytest.skip("creates namespaces, RoleBindings and an admission policy: runs on the local control plane (KUBECONFIG unset)")
    yield Cluster(kuberl_installed)


def ready_condition(c: Cluster, ns: str, name: str) -> dict[str, Any] | None:
    exp = c.get("rlexperiment", name, "-n", ns) or {}
    return next((x for x in (exp.get("status") or {}).get("conditions", []) if x["type"] == "Ready"), None)


def test_where_the_operator_may_not_write_the_experiment_says_so_and_the_printed_command_makes_it_run(cluster: Cluster) -> None:
    c = cluster
    ns = c.namespace("closed-team")
    assert c.create(manifest("blocked", ns)).returncode == 0
    cond = c.wait("Ready=False NamespaceNotPermitted",
                  lambda: (x := ready_condition(c, ns, "blocked")) and x["reason"] == "NamespaceNotPermitted" and x)
    assert cond["status"] == "False" and "namespace 'closed-team'" in cond["message"] and "secrets" in cond["message"], cond
    events = c.wait("a NamespaceNotPermitted event", lambda: [e for e in c.get("events", "-n", ns)["items"] if e["reason"] == "NamespaceNotPermitted"])
    assert events[0]["type"] == "Warning" and events[0]["involvedObject"]["name"] == "blocked"
    # Nothing was made there: the operator held no right to (the chart's default RBAC), and it did not try.
    for kind in ("secrets", "configmaps", "statefulsets", "jobs", "serviceaccounts"):
        assert not [o for o in c.get(kind, "-n", ns)["items"] if o["metadata"]["name"].startswith("blocked")], kind
    assert c.kubectl("auth", "can-i", "create", "secrets", "-n", ns, "--as=system:serviceaccount:kuberl-system:kuberl",
                     check=False).stdout.strip() == "no"
    # The fix, exactly as the condition prints it (an administrator's command), lets the experiment run.
    command = cond["message"].split("`")[1]
    assert command == f"kubectl create rolebinding kuberl-operator -n {ns} --clusterrole=kuberl-namespaced --serviceaccount=kuberl-system:kuberl"
    c.kubectl(*shlex.split(command)[1:])
    job = c.wait("the trainer Job once the namespace is open", lambda: c.get("job", "blocked-trainer", "-n", ns), timeout=90)
    assert job["metadata"]["ownerReferences"][0]["name"] == "blocked"
    assert c.wait("Ready no longer NamespaceNotPermitted", lambda: (x := ready_condition(c, ns, "blocked")) and x["reason"] != "NamespaceNotPermitted")
    assert c.op.alive


def test_a_user_bound_to_edit_creates_experiments_and_one_bound_to_view_only_reads_them(cluster: Cluster) -> None:
    c = cluster
    ns = c.namespace("tenant-roles")
    c.kubectl("create", "rolebinding", "alice-edit", "-n", ns, "--clusterrole=edit", "--user=alice")
    c.kubectl("create", "rolebinding", "bob-view", "-n", ns, "--clusterrole=view", "--user=bob")

    def can(user: str, verb: str, subresource: str = "") -> bool:
        sub = [f"--subresource={subresource}"] if subresource else []
        return c.kubectl("auth", "can-i", verb, "rlexperiments.kuberl.io", *sub, "-n", ns, f"--as={user}", check=False).stdout.strip() == "yes"

    c.wait("the controller manager aggregating the chart's roles into edit and view", lambda: can("alice", "create") and can("bob", "list"))
    made = c.create(manifest("by-alice", ns), as_user="alice")
    assert made.returncode == 0, made.stderr
    assert c.kubectl("get", "rlx", "by-alice", "-n", ns, "--as=alice", check=False).returncode == 0  # edit also reads
    assert c.kubectl("scale", "rlx", "by-alice", "-n", ns, "--replicas=2", "--as=alice", check=False).returncode == 0
    listed = c.kubectl("get", "rlexperiments", "-n", ns, "--as=bob", "-o", "name", check=False)
    assert listed.returncode == 0 and "by-alice" in listed.stdout, listed.stderr
    refused = c.create(manifest("by-bob", ns), as_user="bob")
    assert refused.returncode != 0 and "forbidden" in refused.stderr.lower(), refused.stderr
    assert not can("bob", "patch") and not can("alice", "patch", "status") and can("alice", "patch", "scale")
    # only in this namespace:
    assert c.kubectl("auth", "can-i", "create", "rlexperiments.kuberl.io", "-n", "default", "--as=alice", check=False).stdout.strip() == "no"


def test_the_api_server_refuses_what_the_administrator_has_not_allowed_naming_the_field_and_the_setting(cluster: Cluster) -> None:
    c = cluster
    ns = c.namespace("tenant-policy")
    c.kubectl("create", "rolebinding", "carol-edit", "-n", ns, "--clusterrole=edit", "--user=carol")
    c.wait("edit aggregated", lambda: c.kubectl("auth", "can-i", "create", "rlexperiments.kuberl.io", "-n", ns, "--as=carol",
                                                check=False).stdout.strip() == "yes")
    host = manifest("host-path", ns, trainer={"podTemplate": {"volumes": [{"name": "node-root", "hostPath": {"path": "/"}},
                                                                            {"name": "scratch", "emptyDir": {}}]}})
    refused = c.create(host, as_user="carol")
    assert refused.returncode != 0, refused.stdout
    assert "spec.trainer.podTemplate.volumes: node-root is hostPath: not an allowed volume type" in refused.stderr, refused.stderr
    assert "admissionPolicy.allowedVolumeTypes" in refused.stderr and "scratch" not in refused.stderr.split("admissionPolicy")[0]
    sa = manifest("own-account", ns, rollout={"podTemplate": {"serviceAccountName": "builder"}})
    refused = c.create(sa, as_user="carol")
    assert "spec.rollout.podTemplate.serviceAccountName: ServiceAccount builder is not allowed" in refused.stderr, refused.stderr
    assert "admissionPolicy.allowedServiceAccounts (now: none)" in refused.stderr
    fine = c.create(manifest("scratch-only", ns, trainer={"podTemplate": {"volumes": [{"name": "scratch", "emptyDir": {}}]}}), as_user="carol")
    assert fine.returncode == 0, fine.stderr
    for example in experiment_files():  # docs/operations.md: every example passes the defaults
        checked = c.kubectl("create", "--dry-run=server", "-n", ns, "--as=carol", "-f", str(example), check=False)
        if example.name in FABRIC_EXAMPLES:  # but the fabric ones, which need an administrator's label (next test)
            assert "kuberl.io/fabric=allowed" in checked.stderr, (example.name, checked.stderr)
            continue
        assert "ValidatingAdmissionPolicy" not in checked.stderr, (example.name, checked.stderr)
    # An edit is checked too: a tenant cannot add later what creation would have refused.
    patched = c.kubectl("patch", "rlx", "scratch-only", "-n", ns, "--as=carol", "--type=merge", "-p",
                        json.dumps({"spec": {"rollout": {"podTemplate": {"volumes": [{"name": "docker", "hostPath": {"path": "/var/run/docker.sock"}}]}}}}),
                        check=False)
    assert patched.returncode != 0 and "spec.rollout.podTemplate.volumes: docker is hostPath" in patched.stderr, patched.stderr


def test_fabric_needs_are_refused_until_an_administrator_labels_the_namespace(cluster: Cluster) -> None:
    """Capabilities, root sidecars and hostPath (what EFA and GPUDirect-TCPXO ask for) pass the chart's default policy only in
    a namespace labelled kuberl.io/fabric=allowed, which a tenant (edit) cannot label; the CRD refuses SYS_ADMIN everywhere."""
    c = cluster
    ns = c.namespace("tenant-fabric")
    c.kubectl("create", "rolebinding", "dana-edit", "-n", ns, "--clusterrole=edit", "--user=dana")
    c.wait("edit aggregated", lambda: c.kubectl("auth", "can-i", "create", "rlexperiments.kuberl.io", "-n", ns, "--as=dana",
                                                check=False).stdout.strip() == "yes")
    efa = manifest("efa", ns, trainer={"resources": {"requests": {"memory": "1Gi"}}, "podTemplate": {
        "capabilities": ["IPC_LOCK"], "extendedResources": {"vpc.amazonaws.com/efa": 4, "hugepages-2Mi": "64Mi"}}})
    daemon = manifest("daemon", ns, trainer={"podTemplate": {"sidecars": [
        {"name": "rxdm", "image": "us-docker.pkg.dev/gce-ai-infra/gpudirect-tcpxo/tcpgpudmarxd-dev:v1.0.9", "capabilities": ["NET_ADMIN"], "runAsUser": 0}]}})
    root_only = manifest("root-only", ns, rollout={"podTemplate": {"sidecars": [{"name": "helper", "image": "busybox:1", "runAsUser": 0}]}})
    message = c.create(efa, as_user="dana", dry_run=True).stderr
    assert f"spec.trainer.podTemplate: capabilities IPC_LOCK are not allowed in namespace {ns}" in message, message
    assert "admissionPolicy.allowedCapabilities (now: none)" in message and "kuberl.io/fabric=allowed" in message
    assert "capabilities NET_ADMIN are not allowed" in c.create(daemon, as_user="dana", dry_run=True).stderr
    message = c.create(root_only, as_user="dana", dry_run=True).stderr
    assert "spec.rollout.podTemplate.sidecars: helper would run as root" in message, message
    labelled = c.kubectl("label", "namespace", ns, "kuberl.io/fabric=allowed", "--as=dana", check=False)
    assert labelled.returncode != 0 and "forbidden" in labelled.stderr.lower(), labelled.stderr
    c.kubectl("label", "namespace", ns, "kuberl.io/fabric=allowed")  # the administrator
    c.wait("the label in force", lambda: c.create(efa, as_user="dana", dry_run=True).returncode == 0)
    for obj in (daemon, root_only):
        made = c.create(obj, as_user="dana", dry_run=True)
        assert made.returncode == 0, made.stderr
    for example in FABRIC_EXAMPLES:
        checked = c.kubectl("create", "--dry-run=server", "-n", ns, "--as=dana", "-f", str(ROOT / "examples" / example), check=False)
        assert checked.returncode == 0, (example, checked.stderr)
    # What no fabric needs stays refused, label or not: by the CRD, for everyone.
    sys_admin = c.create(manifest("sys-admin", ns, trainer={"podTemplate": {"capabilities": ["SYS_ADMIN"]}}), dry_run=True)
    assert "SYS_ADMIN and every other capability are refused" in sys_admin.stderr, sys_admin.stderr


def test_an_administrator_s_registries_and_service_accounts_are_the_only_ones_admitted(cluster: Cluster, tmp_path: Any) -> None:
    """The chart's policy rendered with other values (a second release's, so the installed one stays as it is)."""
    c = cluster
    ns = c.namespace("tenant-registry")
    rendered = c.kube.run("helm", "template", "strict", str(ROOT / "charts" / "kuberl"), "-n", "kuberl-system", "--kube-version", "1.35.0",
                          "--show-only", "templates/admission-policy.yaml",
                          "--set", "admissionPolicy.allowedImagePrefixes={registry.corp.example/ml/}",
                          "--set", "admissionPolicy.allowedServiceAccounts={trainer-wi}", "--set", "admissionPolicy.allowedVolumeTypes={*}").stdout
    (tmp_path / "policy.yaml").write_text(rendered)
    c.kubectl("apply", "-f", str(tmp_path / "policy.yaml"))
    try:
        def refused_for(name: str, **roles: Any) -> str:
            return c.create(manifest(name, ns, **roles), dry_run=True).stderr

        c.wait("the stricter policy in force", lambda: "strict-kuberl-rlexperiment-restrictions" in refused_for("probe", rollout={"image": "docker.io/x/y:1"}))
        message = refused_for("hub-image", trainer={"image": "docker.io/someone/trainer:latest"})
        assert "spec.trainer.image: docker.io/someone/trainer:latest is not from an allowed registry" in message, message
        assert "admissionPolicy.allowedImagePrefixes (now: registry.corp.example/ml/)" in message
        assert "registry.corp.example/ml/" in refused_for("bus-image", bus={"embedded": {"image": "nats:2.15-alpine"}})
        ok = c.create(manifest("corp", ns, trainer={"image": "registry.corp.example/ml/runtime-vllm:0.1.0",
                                                    "podTemplate": {"serviceAccountName": "trainer-wi",
                                                                    "volumes": [{"name": "node", "hostPath": {"path": "/mnt"}}]}}))
        # allowed by the strict policy (hostPath too: "*"); the installed default policy still refuses the hostPath and the account
        assert "strict-kuberl" not in ok.stderr and "kuberl-rlexperiment-restrictions' with binding" in ok.stderr, ok.stderr
    finally:
        c.kubectl("delete", "-f", str(tmp_path / "policy.yaml"), check=False)
