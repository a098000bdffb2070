"""Every pod the operator renders, for every example and role, passes the Pod Security Standards
"restricted" profile (checked by the small checker below, which follows
kubernetes.io/docs/concepts/security/pod-security-standards at v1.32), every child passes
kubernetes-validate strict, and the NetworkPolicies admit only this experiment's pods (issue 11:
S2, S3, S5, the trainer's PodDisruptionBudget and grace period)."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest

from kuberl.api import load_experiment
from kuberl.api.v1alpha1 import RLExperiment
from kuberl.operator import labels as L
from kuberl.operator.builders import build_children, network

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
K8S_VERSION = "1.32"
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected", "secret"}
SAFE_SYSCTLS = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
                "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
                "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
                "net.ipv4.tcp_keepalive_probes"}


def restricted_violations(pod: dict) -> list[str]:
    """What keeps a pod spec from the "restricted" Pod Security level (baseline rules included)."""
    out = []
    psc = pod.get("securityContext") or {}
    containers = [*(pod.get("initContainers") or []), *(pod.get("containers") or []), *(pod.get("ephemeralContainers") or [])]
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(field):
            out.append(f"{field} is set")
    for v in pod.get("volumes") or []:
        kind = next(k for k in v if k != "name")
        if kind not in RESTRICTED_VOLUMES:
            out.append(f"volume {v['name']}: type {kind} is not allowed")
    for s in psc.get("sysctls") or []:
        if s["name"] not in SAFE_SYSCTLS:
            out.append(f"sysctl {s['name']}")
    if (psc.get("seLinuxOptions") or {}).get("user") or (psc.get("seLinuxOptions") or {}).get("role"):
        out.append("pod seLinuxOptions user/role")
    if psc.get("runAsUser") == 0:
        out.append("pod runAsUser 0")
    for c in containers:
        csc = c.get("securityContext") or {}
        name = c["name"]
        if csc.get("privileged"):
            out.append(f"{name}: privileged")
        if csc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{name}: allowPrivilegeEscalation is not false")
        if not (csc.get("runAsNonRoot") is True or (psc.get("runAsNonRoot") is True and csc.get("runAsNonRoot") is not False)):
            out.append(f"{name}: runAsNonRoot is not true")
        if csc.get("runAsUser") == 0:
            out.append(f"{name}: runAsUser 0")
        seccomp = (csc.get("seccompProfile") or psc.get("seccompProfile") or {}).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            out.append(f"{name}: seccompProfile {seccomp!r}")
        caps = csc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            out.append(f"{name}: capabilities do not drop ALL")
        if set(caps.get("add") or []) - {"NET_BIND_SERVICE"}:
            out.append(f"{name}: adds capabilities {caps['add']}")
        if any(p.get("hostPort") for p in c.get("ports") or []):
            out.append(f"{name}: hostPort")
        if csc.get("procMount") not in (None, "Default"):
            out.append(f"{name}: procMount")
    return out


def experiments() -> dict[str, RLExperiment]:
    out = {p.stem: load_experiment(p) for p in EXAMPLES}
    base = out["quickstart-cpu"].model_dump(by_alias=True, exclude_none=True)
    base["metadata"]["uid"] = "0f0e0d0c-0b0a-0908-0706-050403020100"
    base["spec"]["bus"] = {"embedded": {"replicas": 3}}
    out["three-nats"] = RLExperiment.model_validate(base)
    return out


EXPERIMENTS = experiments()


def pod_templates(children: list[dict]) -> dict[str, dict]:
    return {c["metadata"]["name"]: c["spec"]["template"] for c in children if c["kind"] in ("StatefulSet", "Job")}


@pytest.mark.parametrize("name", EXPERIMENTS, ids=list(EXPERIMENTS))
def test_every_role_passes_pod_security_restricted(name: str) -> None:
    templates = pod_templates(build_children(EXPERIMENTS[name], bus_token="t0ken"))
    assert templates
    for workload, template in templates.items():
        expected = FABRIC_TRAINER_VIOLATIONS.get(name, []) if workload.endswith("-trainer") else []
        assert sorted(restricted_violations(template["spec"])) == sorted(expected), workload


# The multi-node fabric examples' trainers ask, through podTemplate, for what "restricted" forbids (an administrator's
# kuberl.io/fabric namespace label admits it); every other container of theirs stays restricted.
FABRIC_TRAINER_VIOLATIONS = {
    "gke-a3-tcpxo": [*(f"volume {v}: type hostPath is not allowed" for v in ("nvidia", "sys", "proc-sys", "aperture-devices")),
                     "tcpxo-daemon: runAsNonRoot is not true", "tcpxo-daemon: runAsUser 0",
                     "tcpxo-daemon: adds capabilities ['NET_ADMIN', 'NET_BIND_SERVICE']", "trainer: adds capabilities ['IPC_LOCK']"],
    "eks-p5-efa": ["trainer: adds capabilities ['IPC_LOCK']"],
}


def test_the_checker_catches_what_restricted_forbids() -> None:
    ok = {"securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
          "containers": [{"name": "c", "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}}]}
    assert restricted_violations(ok) == []
    ascend_before_the_fix = {**ok, "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}}}
    assert restricted_violations(ascend_before_the_fix) == ["c: runAsNonRoot is not true"]
    assert restricted_violations({**ok, "volumes": [{"name": "d", "hostPath": {"path": "/dev"}}]})
    assert restricted_violations({**ok, "hostNetwork": True})


@pytest.mark.parametrize("name", EXPERIMENTS, ids=list(EXPERIMENTS))
def test_every_child_passes_strict_kubernetes_validation(name: str) -> None:
    for child in build_children(EXPERIMENTS[name], bus_token="t0ken"):
        kubernetes_validate.validate(child, K8S_VERSION, strict=True)


def by_kind(exp: RLExperiment, kind: str) -> dict[str, dict]:
    return {c["metadata"]["name"]: c for c in build_children(exp, bus_token="t0ken") if c["kind"] == kind}


def selects(selector: dict, labels: dict) -> bool:
    return selector.get("matchLabels", {}).items() <= labels.items()


class TestNetworkPolicies:
    exp = EXPERIMENTS["gsm8k-grpo"]

    def policies(self) -> dict[str, dict]:
        return by_kind(self.exp, "NetworkPolicy")

    def test_every_role_is_guarded(self) -> None:
        templates = pod_templates(build_children(self.exp, bus_token="t0ken"))
        for workload, template in templates.items():
            guards = [p for p in self.policies().values() if selects(p["spec"]["podSelector"], template["metadata"]["labels"])]
            assert len(guards) == 1, workload

    def test_engines_admit_only_this_experiments_pods_on_their_port(self) -> None:
        [rule, scrape] = self.policies()[f"{self.exp.name}-rollout"]["spec"]["ingress"]
        assert rule["ports"] == [{"protocol": "TCP", "port": 8000}]
        assert rule["from"] == [{"podSelector": {"matchLabels": {L.EXPERIMENT_LABEL: self.exp.name}}}]
        # Prometheus: the agent's probe port (/metrics) only, never the engine's (tests/unit/test_prom.py).
        assert scrape["ports"] == [{"protocol": "TCP", "port": 8001}]

    def test_trainer_admits_only_its_own_ranks(self) -> None:
        [rule, scrape] = self.policies()[f"{self.exp.name}-trainer"]["spec"]["ingress"]
        assert rule["from"] == [{"podSelector": {"matchLabels": {L.EXPERIMENT_LABEL: self.exp.name, L.ROLE_LABEL: "trainer"}}}]
        assert scrape["ports"] == [{"protocol": "TCP", "port": 9400}]  # Prometheus: the metrics port only

    def test_another_experiments_pods_are_not_admitted_anywhere(self) -> None:
        other = {L.EXPERIMENT_LABEL: "someone-else", L.ROLE_LABEL: "rollout", L.APP_NAME_LABEL: "kuberl"}
        for policy in self.policies().values():
            for rule in policy["spec"]["ingress"]:
                for peer in rule["from"]:
                    assert "namespaceSelector" in peer or not selects(peer["podSelector"], other), policy["metadata"]["name"]

    def test_the_bus_admits_the_operator_from_its_own_namespace_only(self) -> None:
        try:
            network.configure_operator_namespace("kuberl-system")
            bus = self.policies()[f"{self.exp.name}-bus"]
        finally:
            network.configure_operator_namespace(None)
        operator_peers = [p for r in bus["spec"]["ingress"] for p in r["from"] if "namespaceSelector" in p]
        assert operator_peers
        for peer in operator_peers:
            assert peer["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": "kuberl-system"}}
            assert peer["podSelector"] == {"matchLabels": dict(L.OPERATOR_POD_LABELS)}

    def test_the_operators_pods_carry_the_labels_the_bus_policy_admits(self) -> None:
        from test_chart import one, render

        pod_labels = one(render(), "Deployment")["spec"]["template"]["metadata"]["labels"]
        assert L.OPERATOR_POD_LABELS.items() <= pod_labels.items()


class TestTrainerDisruption:
    exp = EXPERIMENTS["gsm8k-grpo"]

    def test_a_pdb_forbids_evicting_a_trainer_pod(self) -> None:
        [pdb] = by_kind(self.exp, "PodDisruptionBudget").values()
        job = next(iter(by_kind(self.exp, "Job").values()))
        # every pod of the Job must stay: a count (a Job has no scale subresource for maxUnavailable to read)
        assert "maxUnavailable" not in pdb["spec"] and pdb["spec"]["minAvailable"] == job["spec"]["parallelism"]
        assert selects(pdb["spec"]["selector"], job["spec"]["template"]["metadata"]["labels"])

    def test_the_trainer_gets_time_to_checkpoint_on_sigterm(self) -> None:
        job = next(iter(by_kind(self.exp, "Job").values()))
        assert job["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= 300


def test_volumes_are_reowned_only_when_their_root_is_not_ours_yet() -> None:
    """fsGroupChangePolicy OnRootMismatch: no walk over every file of a big checkpoint volume per pod start."""
    for child in build_children(EXPERIMENTS["gsm8k-grpo"], bus_token="t0ken"):
        if child["kind"] in ("StatefulSet", "Job"):
            assert child["spec"]["template"]["spec"]["securityContext"]["fsGroupChangePolicy"] == "OnRootMismatch"
