"""workflow.sandbox.placement pod, offline: the API rule, the operator's sandbox objects, the rollout agent's URL, RBAC
and `kuberl run`'s sandbox process plan.

The objects the builders render for placement pod: a Deployment whose pods hold no token, no Secret and no capability,
on a read-only root file system with only /tmp writable, under the optional runtimeClassName; a Service; a
NetworkPolicy admitting the server port from the experiment's rollout pods only and allowing no egress. The sandbox pods
carry no kuberl.io/experiment label, so the bus and engine policies that admit "this experiment's pods" do not admit
them. The real server process is tests/unit/test_sandbox_server.py; the real control plane
tests/integration/test_operator_sandbox.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from pydantic import ValidationError

from kuberl.api.validation import validate_manifest
from kuberl.api.workflow import SANDBOX_RUNTIME_CLASS
from kuberl.operator import access, naming
from kuberl.operator import labels as L
from kuberl.operator.builders import build_children, build_rollout_statefulset
from kuberl.operator.builders.network import build_network_policy, build_rollout_network_policy
from kuberl.operator.builders.rollout import AGENT_CONTAINER
from kuberl.operator.builders.sandbox import (
    SANDBOX_CONTAINER,
    SANDBOX_URL_ENV,
    build_sandbox_deployment,
    build_sandbox_network_policy,
    build_sandbox_service,
)
from kuberl.runtime.launcher import LocalRun
from kuberl.runtime.rollout import sandbox_server
from tests.unit.test_builders import ENGINE_KEY, K8S_VERSION, TOKEN, containers, env_of, make_experiment

ROOT = Path(__file__).resolve().parents[2]
POD = {"placement": "pod"}
SECRET_HUB = {"name": "hf", "key": "token"}


def in_pods(**sandbox: Any):
    return make_experiment(workflow__sandbox={**POD, **sandbox}, model__hub_token_secret=SECRET_HUB)


def pod_spec(deployment: dict) -> dict:
    return deployment["spec"]["template"]["spec"]


def sandbox_objects(exp) -> dict[str, dict]:
    children = build_children(exp, bus_token=TOKEN, engine_api_key=ENGINE_KEY)
    return {c["kind"]: c for c in children if c["metadata"]["name"] == naming.sandbox_name(exp)}


# --- the API ----------------------------------------------------------------------------------


def manifest(sandbox: dict) -> dict:
    return {"apiVersion": "kuberl.io/v1alpha1", "kind": "RLExperiment", "metadata": {"name": "sb"},
            "spec": {"model": {"builtin": "tiny-qwen2"}, "dataset": {"builtin": "add-small"},
                     "workflow": {"type": "agent", "agent": "kuberl.runtime.agents.tir:math_with_python", "sandbox": sandbox}}}


@pytest.mark.parametrize("sandbox", [{"runtimeClassName": "gvisor"}, {"placement": "process", "runtimeClassName": "gvisor"}])
def test_a_runtime_class_without_placement_pod_is_refused_by_the_model_and_by_kuberl_validate(sandbox: dict) -> None:
    with pytest.raises(ValidationError, match="runtimeClassName needs workflow.sandbox.placement pod"):
        make_experiment(workflow__sandbox=sandbox)
    errors = validate_manifest(manifest(sandbox))
    assert [e.message for e in errors] == [SANDBOX_RUNTIME_CLASS], errors  # the CRD's CEL rule, once
    assert errors[0].path == "spec.workflow.sandbox.runtimeClassName"


def test_kuberl_validate_names_the_rule_and_exits_1(tmp_path: Path) -> None:
    path = tmp_path / "sb.yaml"
    path.write_text(yaml.safe_dump(manifest({"runtimeClassName": "gvisor"})))
    out = subprocess.run([sys.executable, "-m", "kuberl.cli", "validate", str(path)], capture_output=True, text=True, timeout=120,
                         check=False)
    assert out.returncode == 1, out
    assert "spec.workflow.sandbox.runtimeClassName" in out.stdout + out.stderr and SANDBOX_RUNTIME_CLASS in out.stdout + out.stderr
    path.write_text(yaml.safe_dump(manifest({"placement": "pod", "runtimeClassName": "gvisor", "replicas": 2})))
    ok = subprocess.run([sys.executable, "-m", "kuberl.cli", "validate", str(path)], capture_output=True, text=True, timeout=120,
                        check=False)
    assert ok.returncode == 0, ok


def test_placement_defaults_to_process_and_the_pod_fields_to_one_replica() -> None:
    spec = make_experiment().spec.workflow.sandbox
    assert (spec.placement, spec.runtime_class_name, spec.replicas) == ("process", None, 1)
    assert validate_manifest(manifest({"placement": "pod", "resources": {"limits": {"memory": "2Gi"}}})) == []
    assert validate_manifest(manifest({"placement": "vm"}))  # not an enum value


# --- the builders -------------------------------------------------------------------------------


def test_placement_process_builds_no_sandbox_objects_and_no_url() -> None:
    exp = make_experiment()
    assert sandbox_objects(exp) == {}
    assert SANDBOX_URL_ENV not in env_of(containers(build_rollout_statefulset(exp))[AGENT_CONTAINER])


def test_placement_pod_builds_a_policy_a_service_and_a_deployment_before_the_rollout_pods() -> None:
    exp = in_pods()
    children = build_children(exp, bus_token=TOKEN, engine_api_key=ENGINE_KEY)
    names = [(c["kind"], c["metadata"]["name"]) for c in children]
    name = naming.sandbox_name(exp)
    at = [names.index((k, name)) for k in ("NetworkPolicy", "Service", "Deployment")]
    assert at == sorted(at) and at[-1] < names.index(("StatefulSet", naming.rollout_name(exp)))
    for child in children:
        if child["metadata"]["name"] == name:
            kubernetes_validate.validate(child, K8S_VERSION, strict=True)
            assert child["metadata"]["labels"][L.EXPERIMENT_LABEL] == "exp"  # the objects are the experiment's children


def test_the_rollout_agent_gets_the_services_url() -> None:
    exp = in_pods()
    agent = containers(build_rollout_statefulset(exp))[AGENT_CONTAINER]
    assert env_of(agent)[SANDBOX_URL_ENV] == f"http://exp-sandbox.team-a.svc:{naming.SANDBOX_PORT}"
    service = build_sandbox_service(exp)
    assert service["spec"]["selector"] == {L.SANDBOX_LABEL: "exp"}
    assert service["spec"]["ports"] == [{"name": "sandbox", "port": naming.SANDBOX_PORT, "targetPort": "sandbox", "protocol": "TCP"}]
    assert SANDBOX_URL_ENV == sandbox_server.SANDBOX_URL_ENV  # the operator's name is the one the runtime reads


def test_the_sandbox_pod_is_locked_down() -> None:
    exp = in_pods()
    deployment = build_sandbox_deployment(exp)
    pod = pod_spec(deployment)
    assert pod["automountServiceAccountToken"] is False and pod["enableServiceLinks"] is False
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    [container] = pod["containers"]
    assert container["name"] == SANDBOX_CONTAINER
    ctx = container["securityContext"]
    assert ctx["readOnlyRootFilesystem"] is True and ctx["allowPrivilegeEscalation"] is False
    assert ctx["capabilities"] == {"drop": ["ALL"]}
    assert [m["mountPath"] for m in container["volumeMounts"]] == ["/tmp"]
    assert [v for v in pod["volumes"] if v["name"] == "tmp"][0]["emptyDir"]
    assert all(set(v) <= {"name", "emptyDir"} for v in pod["volumes"])  # no Secret, ConfigMap, PVC or projected token
    assert "runtimeClassName" not in pod
    assert container["image"] == containers(build_rollout_statefulset(exp))[AGENT_CONTAINER]["image"]
    assert container["command"][:3] == ["python", "-m", "kuberl.runtime.rollout.sandbox_server"]
    assert {"name": "sandbox", "containerPort": naming.SANDBOX_PORT, "protocol": "TCP"} in container["ports"]


def test_the_sandbox_pod_passes_pod_security_restricted() -> None:
    from tests.unit.test_pod_security import restricted_violations

    for exp in (in_pods(), in_pods(runtimeClassName="gvisor")):
        assert restricted_violations(pod_spec(build_sandbox_deployment(exp))) == []


def test_no_env_of_the_sandbox_comes_from_a_secret_or_names_the_experiments() -> None:
    exp = in_pods()  # with a hub token Secret the rollout pods read
    [container] = pod_spec(build_sandbox_deployment(exp))["containers"]
    assert "envFrom" not in container
    assert all(set(e) == {"name", "value"} for e in container["env"]), container["env"]  # plain values only
    text = json.dumps(build_sandbox_deployment(exp))
    for leak in ("secretKeyRef", "secretRef", SECRET_HUB["name"] + '"', "KUBERL_BUS", "HF_TOKEN", "KUBERL_ENGINE", TOKEN, ENGINE_KEY):
        assert leak not in text, leak
    rollout_env = env_of(containers(build_rollout_statefulset(exp))[AGENT_CONTAINER])
    assert "HF_TOKEN" in rollout_env  # (the rollout pod does read it: the comparison above means something)


def test_runtime_class_replicas_and_resources_reach_the_deployment() -> None:
    exp = in_pods(runtimeClassName="gvisor", replicas=3, resources={"requests": {"cpu": "2"}, "limits": {"memory": "4Gi"}})
    deployment = build_sandbox_deployment(exp)
    assert pod_spec(deployment)["runtimeClassName"] == "gvisor"
    assert deployment["spec"]["replicas"] == 3
    assert pod_spec(deployment)["containers"][0]["resources"] == {"requests": {"cpu": "2"}, "limits": {"memory": "4Gi"}}
    command = pod_spec(deployment)["containers"][0]["command"]
    assert command[command.index("--concurrency") + 1] == "2"  # one run per requested core, not per core of the node
    limited = build_sandbox_deployment(in_pods(resources={"requests": {"cpu": "500m"}, "limits": {"cpu": "2500m"}}))
    assert pod_spec(limited)["containers"][0]["command"][-1] == "3"
    assert pod_spec(build_sandbox_deployment(in_pods()))["containers"][0]["resources"] == {"requests": {"cpu": "1", "memory": "1Gi"}}


def test_the_sandbox_stops_with_the_rollout() -> None:
    assert build_sandbox_deployment(in_pods(replicas=2), stopped=True)["spec"]["replicas"] == 0
    suspended = make_experiment(workflow__sandbox={**POD, "replicas": 2}, suspend=True)
    assert build_sandbox_deployment(suspended)["spec"]["replicas"] == 0


def test_the_network_policy_admits_the_rollout_pods_on_the_server_port_and_allows_no_egress() -> None:
    exp = in_pods()
    policy = build_sandbox_network_policy(exp)
    spec = policy["spec"]
    assert spec["podSelector"] == {"matchLabels": {L.SANDBOX_LABEL: "exp"}}
    assert sorted(spec["policyTypes"]) == ["Egress", "Ingress"]
    assert spec["egress"] == []
    assert spec["ingress"] == [{"from": [{"podSelector": {"matchLabels": L.selector_labels(exp, L.Role.ROLLOUT)}}],
                                "ports": [{"protocol": "TCP", "port": naming.SANDBOX_PORT}]}]
    kubernetes_validate.validate(policy, K8S_VERSION, strict=True)


def selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in (selector.get("matchLabels") or {}).items())


def test_the_bus_and_engine_policies_do_not_admit_the_sandbox_pods() -> None:
    exp = in_pods()
    labels = build_sandbox_deployment(exp)["spec"]["template"]["metadata"]["labels"]
    assert L.EXPERIMENT_LABEL not in labels and L.ROLE_LABEL not in labels
    assert selects(build_sandbox_deployment(exp)["spec"]["selector"], labels)
    bus, rollout = build_network_policy(exp), build_rollout_network_policy(exp)
    assert bus is not None
    for policy in (bus, rollout):
        for rule in policy["spec"]["ingress"]:
            for peer in rule.get("from", []):
                if "namespaceSelector" in peer:  # the scrapers' namespaces (metrics ports only) and the operator's
                    continue
                assert not selects(peer["podSelector"], labels), (policy["metadata"]["name"], peer)
    rollout_pod_labels = build_rollout_statefulset(exp)["spec"]["template"]["metadata"]["labels"]
    assert selects(build_sandbox_network_policy(exp)["spec"]["ingress"][0]["from"][0]["podSelector"], rollout_pod_labels)


def test_the_operator_may_write_deployments_and_the_chart_grants_it() -> None:
    assert {("apps", "deployments", v) for v in ("get", "create", "patch")} <= set(access.WRITES)
    from kuberl.operator import kube

    assert kube.KINDS["Deployment"] == ("apps/v1", "deployments", True)


# --- the operator watching the sandbox's pods, and what it needs in a namespace -----------------------------------------
CPU = {"rollout__accelerator": {"type": "cpu", "count": 0}, "trainer__accelerator": {"type": "cpu", "count": 1}}


def on_cpu(**sandbox: Any):
    return make_experiment(workflow__sandbox=sandbox, **CPU) if sandbox else make_experiment(**CPU)


def selected(selector: str, labels: dict) -> bool:
    """Whether a label selector of `key` and `key=value` terms (what the operator's watches and LISTs use) selects `labels`."""
    for term in selector.split(","):
        key, eq, value = term.partition("=")
        if (labels.get(key) != value) if eq else (key not in labels):
            return False
    return True


def sandbox_pod(exp, waiting: str | None = None, *, unschedulable: bool = False) -> dict:
    status: dict[str, Any] = {"phase": "Pending", "conditions": []}
    if waiting:
        status["containerStatuses"] = [{"name": SANDBOX_CONTAINER, "image": "ghcr.io/kuberl/runtime-cpu:0",
                                        "state": {"waiting": {"reason": waiting, "message": f"{waiting} on purpose"}}}]
    if unschedulable:
        status["conditions"] = [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                 "message": "0/3 nodes are available: 3 Insufficient cpu."}]
    template = build_sandbox_deployment(exp)["spec"]["template"]
    return {"metadata": {"name": "exp-sandbox-5d8f9-abcde", "namespace": exp.namespace, "labels": template["metadata"]["labels"]},
            "spec": {"containers": [{"name": c["name"], "image": c["image"]} for c in template["spec"]["containers"]]}, "status": status}


RUNNING = {"StatefulSet": {"spec": {"replicas": 1}, "status": {"replicas": 1, "readyReplicas": 1, "availableReplicas": 1}},
           "Job": {"spec": {"parallelism": 1}, "status": {"active": 1, "ready": 1}}}


class ListingKube:
    """The API as observe reads it for these experiments (no user Secret or PVC referenced): the roles' StatefulSets and
    trainer Job up, the pods given; every LIST is recorded."""

    def __init__(self, pods: list[dict]):
        self.pods, self.lists = pods, []

    async def get(self, kind: str, namespace: Any, name: str, subresource: Any = None) -> dict | None:
        return {"kind": kind, "metadata": {"name": name, "namespace": namespace}, **RUNNING[kind]} if kind in RUNNING else None

    async def list(self, kind: str, namespace: Any = None, label_selector: str | None = None) -> list[dict]:
        self.lists.append((kind, label_selector))
        return [p for p in self.pods if kind == "Pod" and selected(label_selector or "", p["metadata"]["labels"])]

    async def pvc_exists(self, namespace: str, name: str) -> bool:
        return True


@pytest.fixture
def permitted(monkeypatch: pytest.MonkeyPatch):
    """observe's namespace check answers from `denied` (what a SelfSubjectRulesReview would leave uncovered)."""
    denied: list[tuple[str, str, str]] = []

    async def review(namespace: str) -> tuple:
        return tuple(denied)

    async def identity() -> str:
        return "system:serviceaccount:kuberl-system:kuberl"

    monkeypatch.setattr(access, "_review", review)
    monkeypatch.setattr(access, "_checked", {})
    monkeypatch.setattr(access, "operator_identity", identity)
    return denied


def observed_status(monkeypatch: pytest.MonkeyPatch, exp, api: ListingKube, cache: Any = None) -> tuple[Any, dict]:
    import asyncio
    import datetime as dt

    from kuberl.operator import observe
    from kuberl.operator.context import CONFIG
    from kuberl.operator.status import compute_status

    monkeypatch.setattr(CONFIG, "kube", api)
    monkeypatch.setattr(CONFIG, "cache", cache)
    observed = asyncio.run(observe.observe(exp, 0))
    status = compute_status(exp, observed, None, dt.datetime(2026, 12, 1, tzinfo=dt.UTC))
    return observed, {c["type"]: c for c in status["conditions"]}


@pytest.mark.parametrize("failing, condition, reason", [
    ({"waiting": "ImagePullBackOff"}, "Ready", "ImagePullFailed"),
    ({"waiting": "CreateContainerConfigError"}, "Ready", "ContainerConfigError"),
    ({"waiting": "CrashLoopBackOff"}, "Degraded", "CrashLoopBackOff"),
    ({"unschedulable": True}, "Progressing", "Unschedulable"),
])
@pytest.mark.parametrize("source", ["api", "watch cache"])
def test_a_sandbox_pod_that_cannot_start_shows_in_the_experiments_conditions(
        monkeypatch: pytest.MonkeyPatch, permitted: list, failing: dict, condition: str, reason: str, source: str) -> None:
    import asyncio

    from kuberl.operator.cache import Children

    exp = on_cpu(placement="pod")
    pod = sandbox_pod(exp, **failing)
    api = ListingKube([pod])
    cache = None
    if source == "watch cache":
        up = {(exp.namespace, n): [asyncio.run(api.get(k, exp.namespace, n))] for k, n in (
            ("StatefulSet", naming.bus_name(exp)), ("StatefulSet", naming.rollout_name(exp)), ("Job", naming.trainer_name(exp)))}
        cache = Children({}, up, up, sandbox_pods={(exp.namespace, "exp"): [pod]})
    observed, conditions = observed_status(monkeypatch, exp, api, cache)
    assert [p.pod for p in observed.pod_problems] == [pod["metadata"]["name"]]
    assert conditions[condition]["reason"] == reason, conditions[condition]
    assert pod["metadata"]["name"] in conditions[condition]["message"]
    assert conditions["Ready"]["status"] == "False"
    sandbox_lists = [sel for kind, sel in api.lists if kind == "Pod" and L.SANDBOX_LABEL in (sel or "")]
    assert sandbox_lists == ([] if cache else [f"{L.SANDBOX_LABEL}=exp"])  # the watch cache reads no API


def test_placement_process_reads_no_sandbox_pods(monkeypatch: pytest.MonkeyPatch, permitted: list) -> None:
    exp = on_cpu()
    api = ListingKube([sandbox_pod(on_cpu(placement="pod"), "ImagePullBackOff")])  # a stray pod of that name: not this one's
    observed, _ = observed_status(monkeypatch, exp, api)
    assert observed.pod_problems == ()
    assert not [sel for _, sel in api.lists if L.SANDBOX_LABEL in (sel or "")]


def test_the_pod_watch_brings_the_sandbox_pods_and_their_index_keys_them_by_their_own_label() -> None:
    from kuberl.operator import cache

    exp = in_pods()
    sandbox = build_sandbox_deployment(exp)["spec"]["template"]["metadata"]["labels"]
    roles = [c["spec"]["template"]["metadata"]["labels"] for c in build_children(exp, bus_token=TOKEN) if c["kind"] in ("StatefulSet", "Job")]
    assert len(roles) == 3
    for labels in (sandbox, *roles):  # kopf runs one watch per resource: one server-side selector for every pod the operator makes
        assert selected(cache.WATCHED["pods"], labels), labels
    assert not set(cache._LABELLED) & set(sandbox)  # kuberl_pods (the roles' index, kuberl.io/experiment) leaves them out
    assert set(cache._SANDBOXED) <= set(sandbox) and not any(set(cache._SANDBOXED) & set(r) for r in roles)
    pod = {"metadata": {"name": "exp-sandbox-x", "namespace": "team-a", "labels": sandbox}, "spec": {}, "status": {"phase": "Running"}}
    assert cache.kuberl_sandbox_pods(namespace="team-a", labels=sandbox, body=pod) == {("team-a", "exp"): cache.slim_pod(pod)}


def test_deployments_are_needed_only_by_an_experiment_that_runs_its_sandbox_in_pods(monkeypatch: pytest.MonkeyPatch, permitted: list) -> None:
    """A namespace whose hand-written Role grants everything but Deployments: the process-placement experiment runs, the
    pod-placement one is held back naming deployments.apps."""
    permitted.extend(sorted(access.SANDBOX_WRITES))
    assert access.needed_by(on_cpu(), permitted) == ()
    assert set(access.needed_by(on_cpu(placement="pod"), permitted)) == access.SANDBOX_WRITES
    other = [("", "secrets", "create"), *permitted]
    assert access.needed_by(on_cpu(), other) == (("", "secrets", "create"),)  # what every experiment needs still blocks
    observed, _ = observed_status(monkeypatch, on_cpu(), ListingKube([]))
    assert observed.blockers == ()
    observed, conditions = observed_status(monkeypatch, on_cpu(placement="pod"), ListingKube([]))
    [(reason, message)] = observed.blockers
    assert reason == L.Reason.NAMESPACE_NOT_PERMITTED.value and "deployments.apps refused" in message, message
    assert conditions["Ready"]["reason"] == L.Reason.NAMESPACE_NOT_PERMITTED.value


# --- `kuberl run` -------------------------------------------------------------------------------


def test_kuberl_run_plans_a_sandbox_process_with_a_bare_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.unit.test_launcher import make_experiment as run_experiment

    monkeypatch.setenv("HF_TOKEN", "hub-secret")
    cpu = {"rollout": {"engine": "vllm", "replicas": 2, "accelerator": {"type": "cpu", "count": 0}},
           "trainer": {"accelerator": {"type": "cpu", "count": 1}}}
    exp = run_experiment(workflow={"sandbox": POD}, **cpu)
    run = LocalRun(exp, tmp_path / "e.yaml", tmp_path, "nats://127.0.0.1:1")
    run.plan(gpus=0)
    run.add_sandbox()
    sandbox = next(r for r in run.roles if r.name == "sandbox")
    port = sandbox.argv[sandbox.argv.index("--port") + 1]
    assert sandbox.argv[sandbox.argv.index("--host") + 1] == "127.0.0.1"
    urls = {r.env.get(SANDBOX_URL_ENV) for r in run.roles if r.name.startswith("rollout-")}
    assert urls == {f"http://127.0.0.1:{port}"}
    assert "hub-secret" not in json.dumps(sandbox.env) and "KUBERL_BUS_URL" not in sandbox.env
    assert int(port) in [s.getsockname()[1] for s in run.ports]  # held for the run, released by stop_all
    run.stop_all(grace=0.1)  # nothing started: closes the held ports; the sandbox has a place in the stop order
    process = LocalRun(run_experiment(**cpu), tmp_path / "p.yaml", tmp_path, "nats://127.0.0.1:1")
    process.plan(gpus=0)
    process.add_sandbox()
    assert "sandbox" not in [r.name for r in process.roles]
