"""workflow.sandbox.placement pod: the tool sandbox in pods of its own (a Deployment, its Service, its NetworkPolicy).

Called by builders.build_children (and so by the kopf handlers and `kuberl render`). The rollout agents post each
tool call to the Service (builders.rollout sets $KUBERL_SANDBOX_URL, the string runtime/rollout/sandbox_server.py
reads); the server runs it in the same confined subprocess as placement process does (rlimits, Landlock, seccomp, no
capabilities), now inside a pod that holds nothing worth stealing and can reach nothing:
- no service-account token (automountServiceAccountToken false), no env from a Secret, no Secret or PVC mounted, no
  Service links; the experiment's ConfigMap is not mounted either (the limits come with each request);
- non-root (uid 1000), readOnlyRootFilesystem, every capability dropped, no privilege escalation, seccomp
  RuntimeDefault; one emptyDir at /tmp (the runs' directories);
- workflow.sandbox.runtimeClassName where set (e.g. gvisor: a user-space kernel between tool code and the node's);
- its pods carry `kuberl.io/sandbox: <experiment>` instead of `kuberl.io/experiment`, so that the bus and engine
  policies, which admit "this experiment's pods", do not admit them; its own NetworkPolicy admits the server port from
  this experiment's rollout pods only and allows no egress at all (a CNI that enforces NetworkPolicy is needed for
  either to hold; docs/security.md).
The image is the rollout's (the runtime image, or rollout.image), without the GPU: the server needs only Python and
KubeRL. Replicas follow the rollout's life: 0 when the experiment is suspended or stopped, else workflow.sandbox.replicas.
"""

from __future__ import annotations

import math

from kubernetes.utils.quantity import parse_quantity

from kuberl.api.v1alpha1 import RLExperiment
from kuberl.operator import labels as L
from kuberl.operator import naming
from kuberl.operator.builders import pinning
from kuberl.operator.builders.common import RUNTIME_UID, Obj, image_of, metadata, pull_policy, with_spec_hash

SANDBOX_URL_ENV = "KUBERL_SANDBOX_URL"  # kuberl.runtime.rollout.sandbox_server.SANDBOX_URL_ENV (the operator never imports the runtime)
SANDBOX_CONTAINER = "sandbox"
SANDBOX_PORT_NAME = "sandbox"
SANDBOX_MODULE = "kuberl.runtime.rollout.sandbox_server"
# A run takes one core at most (RLIMIT_CPU, OMP_NUM_THREADS 1) and workflow.sandbox.memoryMib of address space.
SANDBOX_RESOURCES = {"requests": {"cpu": "1", "memory": "1Gi"}}
TMP_DIR = "/tmp"
TMP_SIZE_LIMIT = "1Gi"  # the runs' directories (16 MiB per file, sandbox.FILE_SIZE_LIMIT)


def sandbox_in_pods(exp: RLExperiment) -> bool:
    return exp.spec.workflow.sandbox.placement == "pod"


def sandbox_replicas(exp: RLExperiment, stopped: bool = False) -> int:
    """0 when suspended or `stopped` (the rollout at 0: finished, failed), else workflow.sandbox.replicas."""
    return 0 if exp.spec.suspend or stopped else exp.spec.workflow.sandbox.replicas


def sandbox_env(exp: RLExperiment) -> list[Obj]:
    """The rollout agent's $KUBERL_SANDBOX_URL (placement pod), else nothing."""
    return [{"name": SANDBOX_URL_ENV, "value": naming.sandbox_url(exp)}] if sandbox_in_pods(exp) else []


def _resources(exp: RLExperiment) -> Obj:
    res = exp.spec.workflow.sandbox.resources
    requests = {k: str(v) for k, v in res.requests.items()}
    limits = {k: str(v) for k, v in res.limits.items()}
    if not requests and not limits:
        return {k: dict(v) for k, v in SANDBOX_RESOURCES.items()}
    return {**({"requests": requests} if requests else {}), **({"limits": limits} if limits else {})}


def concurrency(resources: Obj) -> int:
    """Runs a sandbox pod takes at once: its CPU limit, else its CPU request, in whole cores (at least 1). A pod sees
    every core of its node; without this it would run as many codes at once as the node has cores on one core's request."""
    cpu = (resources.get("limits") or {}).get("cpu") or (resources.get("requests") or {}).get("cpu") or "1"
    return max(1, math.ceil(float(parse_quantity(cpu))))


def build_sandbox_deployment(exp: RLExperiment, *, stopped: bool = False) -> Obj:
    """Deployment `{exp}-sandbox`: the sandbox server pods (module docstring)."""
    rollout = exp.spec.rollout
    sandbox = exp.spec.workflow.sandbox
    resources = _resources(exp)

    def probe(period: int, failures: int) -> Obj:
        return {"httpGet": {"path": "/healthz", "port": SANDBOX_PORT_NAME}, "timeoutSeconds": 5, "periodSeconds": period,
                "failureThreshold": failures}

    container: Obj = {
        "name": SANDBOX_CONTAINER,
        "image": image_of(exp, rollout, rollout.accelerator),
        **pull_policy(rollout),
        "command": ["python", "-m", SANDBOX_MODULE, "--host", "0.0.0.0", "--port", str(naming.SANDBOX_PORT),
                    "--concurrency", str(concurrency(resources))],
        # Plain values only: nothing from a Secret, nothing of the experiment's.
        "env": [
            {"name": "HOME", "value": TMP_DIR},
            {"name": "TMPDIR", "value": TMP_DIR},
            {"name": "PYTHONUNBUFFERED", "value": "1"},
            {"name": "PYTHONDONTWRITEBYTECODE", "value": "1"},
        ],
        "ports": [{"name": SANDBOX_PORT_NAME, "containerPort": naming.SANDBOX_PORT, "protocol": "TCP"}],
        "startupProbe": probe(2, 60),
        "readinessProbe": probe(10, 3),
        "livenessProbe": probe(30, 3),
        "resources": resources,
        "volumeMounts": [{"name": "tmp", "mountPath": TMP_DIR}],
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": True,
            "capabilities": {"drop": ["ALL"]},
        },
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    pod: Obj = {
        "serviceAccountName": naming.service_account_name(exp),  # no Role bound, and no token mounted
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": {"runAsNonRoot": True, "runAsUser": RUNTIME_UID, "runAsGroup": RUNTIME_UID,
                            "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [container],
        "volumes": [{"name": "tmp", "emptyDir": {"sizeLimit": TMP_SIZE_LIMIT}}],
        "terminationGracePeriodSeconds": 10,
    }
    if sandbox.runtime_class_name:
        pod["runtimeClassName"] = sandbox.runtime_class_name
    pulls = rollout.pod_template.image_pull_secrets if rollout.pod_template is not None else []
    if pulls:  # the rollout's image may be private: the kubelet's pull credentials (never seen by the container)
        pod["imagePullSecrets"] = [{"name": ref.name} for ref in pulls]
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(exp, naming.sandbox_name(exp), L.Component.SANDBOX),
        "spec": {
            "replicas": sandbox_replicas(exp, stopped),
            "selector": {"matchLabels": L.sandbox_selector(exp)},
            "template": {"metadata": {"labels": L.sandbox_pod_labels(exp)}, "spec": pod},
        },
    }
    return with_spec_hash(pinning.stamp(deployment, exp))


def build_sandbox_service(exp: RLExperiment) -> Obj:
    """Service `{exp}-sandbox` (ClusterIP: the rollout agents' calls spread over the sandbox pods)."""
    return with_spec_hash({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(exp, naming.sandbox_name(exp), L.Component.SANDBOX),
        "spec": {
            "selector": L.sandbox_selector(exp),
            "ports": [{"name": SANDBOX_PORT_NAME, "port": naming.SANDBOX_PORT, "targetPort": SANDBOX_PORT_NAME, "protocol": "TCP"}],
        },
    })


def build_sandbox_network_policy(exp: RLExperiment) -> Obj:
    """NetworkPolicy `{exp}-sandbox`: ingress on the server port from this experiment's rollout pods only; no egress."""
    return with_spec_hash({
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata(exp, naming.sandbox_name(exp), L.Component.NETWORK),
        "spec": {
            "podSelector": {"matchLabels": L.sandbox_selector(exp)},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [{"from": [{"podSelector": {"matchLabels": L.selector_labels(exp, L.Role.ROLLOUT)}}],
                         "ports": [{"protocol": "TCP", "port": naming.SANDBOX_PORT}]}],
            "egress": [],  # none: not DNS, not the bus, not the engines, not the internet
        },
    })


def build_sandbox_children(exp: RLExperiment) -> list[Obj]:
    """The sandbox's NetworkPolicy, Service and Deployment (policy first), with placement pod; else none."""
    if not sandbox_in_pods(exp):
        return []
    return [build_sandbox_network_policy(exp), build_sandbox_service(exp), build_sandbox_deployment(exp)]
