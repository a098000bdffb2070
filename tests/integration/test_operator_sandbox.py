"""workflow.sandbox.placement pod on the real control plane (test_operator.py's: kube-apiserver, etcd, the controller
manager, KWOK's nodes, the chart installed with helm and the operator running under the chart's ServiceAccount).

The API server refuses a runtimeClassName without placement pod (the CRD's CEL rule); with placement pod the operator,
with only the chart's RBAC, creates the sandbox Deployment, Service and NetworkPolicy (owned by the experiment, taken
as they are by the API server), the Deployment controller and the scheduler put its pod on a KWOK node under the
RuntimeClass, which KWOK runs; the rollout agent is given the Service's URL; the sandbox stops with the rollout when
training completes; deleting the experiment takes them along. A sandbox pod that crash-loops or cannot pull its image
shows in the experiment's conditions and events as the roles' pods do.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from tests.integration.test_operator import NS, RLX, Api, manifest, owned_by

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]
RUNTIME_CLASS = "kuberl-test-gvisor"
TIR = {"type": "agent", "agent": "kuberl.runtime.agents.tir:math_with_python", "reward": "repeat-digit"}


@pytest.fixture(scope="module")
def api(kuberl_installed: Any) -> Iterator[Api]:
    if not kuberl_installed.local:
        pytest.skip("reads the operator's children and KWOK's pods on the local control plane (KUBECONFIG unset)")
    yield Api(kuberl_installed.control_plane, kuberl_installed.operator)


def test_admission_refuses_a_runtime_class_without_placement_pod(api: Api, experiment_name: str) -> None:
    for sandbox in ({"runtimeClassName": "gvisor"}, {"placement": "process", "runtimeClassName": "gvisor"}):
        refused = api.call("POST", RLX, manifest(experiment_name, workflow={**TIR, "sandbox": sandbox}), ok=(422,))
        text = json.dumps(refused)
        assert "workflow.sandbox.runtimeClassName needs workflow.sandbox.placement pod" in text, text
        assert "spec.workflow.sandbox.runtimeClassName" in text, text
    assert api.experiment(experiment_name) is None


def test_placement_pod_runs_the_sandbox_in_its_own_locked_down_pod(api: Api, experiment_name: str) -> None:
    e = experiment_name
    # The RuntimeClass the sandbox names must exist: the API server's RuntimeClass admission refuses pods otherwise.
    api.call("POST", "/apis/node.k8s.io/v1/runtimeclasses",
             {"apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass", "metadata": {"name": RUNTIME_CLASS}, "handler": "runsc"}, ok=(201, 409))
    sandbox = {"placement": "pod", "runtimeClassName": RUNTIME_CLASS, "replicas": 1, "resources": {"requests": {"cpu": "100m", "memory": "64Mi"}}}
    uid = api.call("POST", RLX, manifest(e, workflow={**TIR, "sandbox": sandbox}))["metadata"]["uid"]
    name = f"{e}-sandbox"
    deployment = api.wait("the sandbox Deployment", lambda: api.get(f"/apis/apps/v1/namespaces/{NS}/deployments/{name}"))
    service = api.wait("the sandbox Service", lambda: api.get(f"/api/v1/namespaces/{NS}/services/{name}"))
    policy = api.wait("the sandbox NetworkPolicy", lambda: api.get(f"/apis/networking.k8s.io/v1/namespaces/{NS}/networkpolicies/{name}"))
    for obj in (deployment, service, policy):
        assert owned_by(obj, uid), obj["metadata"]

    pod = deployment["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False and pod["runtimeClassName"] == RUNTIME_CLASS
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    [container] = pod["containers"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert "secretKeyRef" not in json.dumps(deployment) and "envFrom" not in container
    assert all(v.get("emptyDir") is not None for v in pod["volumes"])

    spec = policy["spec"]
    assert sorted(spec["policyTypes"]) == ["Egress", "Ingress"] and not spec.get("egress")  # no egress rule: none allowed
    [rule] = spec["ingress"]
    assert rule["from"] == [{"podSelector": {"matchLabels": {"kuberl.io/experiment": e, "kuberl.io/role": "rollout"}}}]
    assert rule["ports"] == [{"protocol": "TCP", "port": 8003}]
    assert spec["podSelector"] == {"matchLabels": {"kuberl.io/sandbox": e}}
    assert service["spec"]["selector"] == {"kuberl.io/sandbox": e} and service["spec"]["clusterIP"] not in (None, "None")

    def running() -> list[dict[str, Any]] | None:
        pods = [p for p in api.pods(f"kuberl.io/sandbox={e}") if p["status"].get("phase") == "Running"
                and any(c.get("type") == "Ready" and c.get("status") == "True" for c in p["status"].get("conditions") or [])]
        return pods or None

    [sandbox_pod] = api.wait("the sandbox pod Running and Ready on a KWOK node", running, timeout=120)
    assert sandbox_pod["spec"]["runtimeClassName"] == RUNTIME_CLASS and sandbox_pod["spec"].get("nodeName")
    assert "kuberl.io/experiment" not in sandbox_pod["metadata"]["labels"]  # not a peer the bus and engine policies admit
    assert not any(v.get("projected") or v.get("secret") for v in sandbox_pod["spec"].get("volumes") or [])  # no token was mounted

    sts = api.wait("the rollout StatefulSet", lambda: api.sts(f"{e}-rollout"))
    agent = next(c for c in sts["spec"]["template"]["spec"]["containers"] if c["name"] == "rollout-agent")
    assert {"name": "KUBERL_SANDBOX_URL", "value": f"http://{name}.{NS}.svc:8003"} in agent["env"]

    # Training complete: the operator scales the rollout to 0, and the sandbox with it (its pods hold CPU for nothing).
    api.finish_job(e)
    api.wait("the sandbox Deployment scaled to 0 with the rollout",
             lambda: (api.get(f"/apis/apps/v1/namespaces/{NS}/deployments/{name}") or {}).get("spec", {}).get("replicas") == 0
             and (api.sts(f"{e}-rollout") or {}).get("spec", {}).get("replicas") == 0, timeout=120)
    api.wait("the sandbox pod gone", lambda: not api.pods(f"kuberl.io/sandbox={e}"), timeout=120)

    api.call("DELETE", f"{RLX}/{e}", ok=(200, 202))
    api.wait("the sandbox Deployment and Service gone with the experiment (garbage collector)",
             lambda: api.get(f"/apis/apps/v1/namespaces/{NS}/deployments/{name}") is None
             and api.get(f"/api/v1/namespaces/{NS}/services/{name}") is None, timeout=120)


def test_a_sandbox_pod_that_cannot_start_shows_in_the_experiments_conditions_and_events(api: Api, experiment_name: str) -> None:
    """The sandbox's pods carry kuberl.io/sandbox, not kuberl.io/experiment (the bus and engine policies must not admit
    them), yet the operator watches them too: a crash loop makes the experiment Degraded, an image it cannot pull is a
    condition and a Warning event, each naming the sandbox pod, as for the roles' pods."""
    e = experiment_name
    sandbox = {"placement": "pod", "replicas": 1, "resources": {"requests": {"cpu": "100m", "memory": "64Mi"}}}
    api.call("POST", RLX, manifest(e, workflow={**TIR, "sandbox": sandbox}))
    name = f"{e}-sandbox"

    def ready_pods() -> list[str] | None:
        pods = [p["metadata"]["name"] for p in api.pods(f"kuberl.io/sandbox={e}") if p["status"].get("phase") == "Running"
                and any(c.get("type") == "Ready" and c.get("status") == "True" for c in p["status"].get("conditions") or [])]
        return pods or None

    [crashing] = api.wait("the sandbox pod Running and Ready", ready_pods, timeout=120)
    # The server dies at once each time it starts: exit 1, and the kubelet backs off restarting it (KWOK's pod-exit stage).
    api.cp.exit(NS, [crashing], 1, "sandbox server died on purpose")

    def condition(kind: str, reason: str, pod: str) -> dict[str, Any] | None:
        conditions = ((api.experiment(e) or {}).get("status") or {}).get("conditions") or []
        return next((c for c in conditions if c["type"] == kind and c["reason"] == reason and pod in (c.get("message") or "")), None)

    degraded = api.wait("Degraded: the sandbox pod keeps crashing", lambda: condition("Degraded", "CrashLoopBackOff", crashing))
    assert degraded["status"] == "True", degraded

    # A new image that cannot be pulled (its pods told so through the template's annotations, which KWOK reads; the
    # operator's server-side apply leaves another manager's annotations alone): the new pod waits in ImagePullBackOff.
    api.merge(f"/apis/apps/v1/namespaces/{NS}/deployments/{name}", {"spec": {"template": {"metadata": {"annotations": {
        "kwok.kuberl.io/waiting-reason": "ImagePullBackOff", "kwok.kuberl.io/message": "Back-off pulling image"}}}}})
    events = api.wait("an ImagePullFailed event naming a sandbox pod",
                      lambda: [x for x in api.events(e) if x["reason"] == "ImagePullFailed" and f"pod {name}-" in x["message"]], timeout=90)
    assert "container sandbox" in events[0]["message"], events[0]
    pulling = events[0]["message"].split()[1]
    assert pulling != crashing and pulling.startswith(f"{name}-")
    ready = api.wait("the Ready condition naming the sandbox pod's image", lambda: condition("Ready", "ImagePullFailed", pulling))
    assert ready["status"] == "False", ready
    api.call("DELETE", f"{RLX}/{e}", ok=(200, 202))
