"""Names of every child object of an RLExperiment: the only place that names them (KubeRay association.go).

Called by the builders, by status/autoscaler code and by the kopf handlers (O2). Every function takes the
experiment (an RLExperiment, a kopf body/manifest mapping, or just its name) and is pure.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

from kuberl.api.v1alpha1 import RLExperiment

BUS_CLIENT_PORT = 4222
BUS_CLUSTER_PORT = 6222
BUS_MONITOR_PORT = 8222
ENGINE_PORT = 8000
AGENT_HEALTH_PORT = 8001  # the rollout agent's probe endpoints (/healthz, /readyz) and its Prometheus /metrics
EPISODE_PORT = 8002  # workflow.external: the rollout agent's episode API and the proxy its external agents call
SANDBOX_PORT = 8003  # workflow.sandbox.placement pod: the sandbox server (runtime/rollout/sandbox_server.py)
TRAINER_MASTER_PORT = 29500

# Length limits that bind child names. A StatefulSet's pods carry the label
# controller-revision-hash = "<name>-<10 chars>", and label values stop at 63, so StatefulSet names
# must stay <= 52 (kubernetes/kubernetes#64023). Services are DNS-1035 labels (<= 63). An indexed Job's
# pod hostname is "<job>-<index>" (<= 63), and trainer.nodes <= 1024 gives at most 4 index digits.
STATEFULSET_NAME_MAX = 52
SERVICE_NAME_MAX = 63
JOB_NAME_MAX = 58
OBJECT_NAME_MAX = 253

ExperimentRef = RLExperiment | Mapping[str, Any] | str


def experiment_name(exp: ExperimentRef) -> str:
    """The experiment's metadata.name, from a model, a manifest/kopf body, or a plain name."""
    if isinstance(exp, str):
        return exp
    if isinstance(exp, RLExperiment):
        return exp.metadata.name
    try:
        return str(exp["metadata"]["name"])
    except (KeyError, TypeError) as exc:
        raise ValueError(f"cannot tell the experiment's name from {type(exp).__name__}: no metadata.name") from exc


def experiment_namespace(exp: RLExperiment | Mapping[str, Any]) -> str:
    if isinstance(exp, RLExperiment):
        return exp.metadata.namespace
    return str(exp.get("metadata", {}).get("namespace") or "default")


def _child(exp: ExperimentRef, suffix: str, limit: int) -> str:
    """`{exp}-{suffix}`; when that is longer than `limit`, the experiment part is cut and a stable
    5-character hash of the full name keeps distinct experiments apart (same input, same name)."""
    name = experiment_name(exp)
    full = f"{name}-{suffix}"
    if len(full) <= limit:
        return full
    digest = hashlib.sha256(name.encode()).hexdigest()[:5]
    keep = limit - len(suffix) - len(digest) - 2
    return f"{name[:keep].rstrip('-')}-{digest}-{suffix}"


def config_map_name(exp: ExperimentRef) -> str:
    """ConfigMap holding `experiment.yaml`, mounted at /etc/kuberl."""
    return _child(exp, "config", OBJECT_NAME_MAX)


def bus_name(exp: ExperimentRef) -> str:
    """NATS StatefulSet and its client Service."""
    return _child(exp, "bus", STATEFULSET_NAME_MAX)


def bus_headless_name(exp: ExperimentRef) -> str:
    """Headless Service that gives each NATS pod a DNS name for cluster routes."""
    return _child(exp, "bus-headless", SERVICE_NAME_MAX)


def bus_secret_name(exp: ExperimentRef) -> str:
    """Secret with keys `token`, `{role}-password` per bus user (builders.bus_auth) and `nats.conf`."""
    return _child(exp, "bus-credentials", OBJECT_NAME_MAX)


def bus_users_secret_name(exp: ExperimentRef) -> str:
    """Secret with keys `trainer.creds` and `rollout.creds`: the users the operator minted for this experiment
    on a shared NATS (spec.bus.external.accountSigningKeySecret; builders.bus_auth)."""
    return _child(exp, "bus-users", OBJECT_NAME_MAX)


def engine_secret_name(exp: ExperimentRef) -> str:
    """Secret with key `apiKey`: the engines' API key (engines require it, agents send it)."""
    return _child(exp, "engine-credentials", OBJECT_NAME_MAX)


def episode_secret_name(exp: ExperimentRef) -> str:
    """Secret with key `apiKey`: the experiment's episode key (workflow.external: external agents open episodes with it)."""
    return _child(exp, "episode-api", OBJECT_NAME_MAX)


def rollout_name(exp: ExperimentRef) -> str:
    """Rollout StatefulSet (engine + agent pods) and its headless Service."""
    return _child(exp, "rollout", STATEFULSET_NAME_MAX)


def trainer_name(exp: ExperimentRef) -> str:
    """Trainer indexed Job and the headless Service its pods use for torchrun rendezvous."""
    return _child(exp, "trainer", JOB_NAME_MAX)


def checkpoint_pvc_name(exp: ExperimentRef) -> str:
    """The checkpoint PVC the operator creates (when spec.checkpoint.existingClaim is unset)."""
    return _child(exp, "checkpoints", OBJECT_NAME_MAX)


def checkpoint_claim_name(exp: RLExperiment) -> str:
    """The PVC the pods mount at /checkpoints: the user's existingClaim, else ours."""
    return exp.spec.checkpoint.existing_claim or checkpoint_pvc_name(exp)


def service_account_name(exp: ExperimentRef) -> str:
    """ServiceAccount (and Role, RoleBinding) of the runtime pods."""
    return _child(exp, "runtime", OBJECT_NAME_MAX)


def network_policy_name(exp: ExperimentRef) -> str:
    """NetworkPolicy guarding the embedded bus."""
    return _child(exp, "bus", OBJECT_NAME_MAX)


def rollout_network_policy_name(exp: ExperimentRef) -> str:
    """NetworkPolicy guarding the engines."""
    return _child(exp, "rollout", OBJECT_NAME_MAX)


def trainer_network_policy_name(exp: ExperimentRef) -> str:
    """NetworkPolicy guarding the trainer pods (and the PodDisruptionBudget of the trainer)."""
    return _child(exp, "trainer", OBJECT_NAME_MAX)


def sandbox_name(exp: ExperimentRef) -> str:
    """workflow.sandbox.placement pod: the sandbox Deployment, its Service and its NetworkPolicy."""
    return _child(exp, "sandbox", SERVICE_NAME_MAX)


def sandbox_url(exp: RLExperiment | Mapping[str, Any]) -> str:
    """The sandbox server's URL the rollout agents call: its Service, `http://{exp}-sandbox.{ns}.svc:8003`."""
    return f"http://{sandbox_name(exp)}.{experiment_namespace(exp)}.svc:{SANDBOX_PORT}"


BUS_RUN_ANNOTATION = "kuberl.io/bus-run"  # labels.BUS_RUN_ANNOTATION (labels imports this module)


def default_bus_run(exp: RLExperiment) -> str:
    """`<namespace>.<first 12 hex of metadata.uid>`, or "" without a uid (an offline render)."""
    uid = str((exp.metadata.model_extra or {}).get("uid") or "").replace("-", "").lower()
    return f"{exp.namespace}.{uid[:12]}" if uid else ""


def bus_run(exp: RLExperiment) -> str:
    """The run that scopes this experiment's bus names (kuberl.runtime.bus.names, $KUBERL_BUS_RUN):
    the pinned annotation kuberl.io/bus-run when set ("" there = an experiment created before runs
    existed, which keeps the plain names), else `default_bus_run`."""
    annotations = exp.metadata.annotations or {}
    if BUS_RUN_ANNOTATION in annotations:
        return annotations[BUS_RUN_ANNOTATION]
    return default_bus_run(exp)


def bus_pod_names(exp: RLExperiment) -> list[str]:
    """Pod names of the embedded NATS StatefulSet, in ordinal order."""
    replicas = exp.spec.bus.embedded.replicas if exp.spec.bus.embedded else 0
    return [f"{bus_name(exp)}-{i}" for i in range(replicas)]


def trainer_master_address(exp: ExperimentRef) -> str:
    """DNS name of trainer rank 0: `{job}-0.{service}` (the Job pods' hostname and subdomain)."""
    return f"{trainer_name(exp)}-0.{trainer_name(exp)}"


def bus_url(exp: RLExperiment | Mapping[str, Any] | str, namespace: str | None = None) -> str:
    """NATS URL the pods and the operator use.

    An RLExperiment with `spec.bus.external` gives the external URL; otherwise the embedded bus's
    client Service, `nats://{exp}-bus.{ns}.svc:4222`. A plain name needs `namespace`.
    """
    if isinstance(exp, RLExperiment) and exp.spec.bus.external is not None:
        return exp.spec.bus.external.url
    if isinstance(exp, Mapping):
        external = (exp.get("spec") or {}).get("bus", {}).get("external")
        if external:
            return str(external["url"])
    if namespace is None:
        if isinstance(exp, str):
            raise ValueError(f"bus_url({exp!r}): a plain experiment name needs namespace=")
        namespace = experiment_namespace(exp)
    return f"nats://{bus_name(exp)}.{namespace}.svc:{BUS_CLIENT_PORT}"
