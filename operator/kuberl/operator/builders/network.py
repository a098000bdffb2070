"""NetworkPolicies: only this experiment's pods reach its bus, its engines and its trainer.

Called by builders.build_children and the kopf handlers (O2). Three policies, by role:
- bus (embedded only): 4222 from this experiment's pods and the operator, 8222 from the operator,
  6222 between the bus pods. The operator is admitted from its own namespace only
  (`kubernetes.io/metadata.name`, set by the API server, cannot be forged by a pod's labels).
- rollout: the engine port from this experiment's pods only. The engines serve vLLM's development
  endpoints (/collective_rpc, /pause, weight reload), behind the engine API key as well (rollout.py,
  runtime/inference/engine_auth.py); the agent beside them uses 127.0.0.1, which no policy filters,
  and kubelet probes (the engine's /health, the agent's probe port) are admitted by the CNIs that
  enforce policies, so the agent's probe port is not listed.
- trainer: from this experiment's trainer pods only, every port (torchrun's rendezvous store and
  the NCCL/gloo ports, which are chosen at run time).
Policies select ingress only: egress (the bus, a model hub, an external NATS) stays open.
"""

from __future__ import annotations

from kuberl.api.v1alpha1 import RLExperiment
from kuberl.operator import labels as L
from kuberl.operator import naming
from kuberl.operator.builders.common import Obj, metadata, with_spec_hash

# The namespace the operator's pods run in; `kuberl operator` sets it once at start-up from
# $POD_NAMESPACE (the chart passes it) through configure_operator_namespace(). Unset (an operator
# running outside the cluster, which no policy can admit anyway): the experiment's own namespace.
OPERATOR_NAMESPACE: str | None = None
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"


def configure_operator_namespace(namespace: str | None) -> str | None:
    global OPERATOR_NAMESPACE
    OPERATOR_NAMESPACE = namespace.strip() if namespace and namespace.strip() else None
    return OPERATOR_NAMESPACE


def _port(n: int) -> Obj:
    return {"protocol": "TCP", "port": n}


def _policy(exp: RLExperiment, name: str, role: L.Role, ingress: list[Obj]) -> Obj:
    return with_spec_hash(
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": metadata(exp, name, L.Component.NETWORK),
            "spec": {"podSelector": {"matchLabels": L.selector_labels(exp, role)}, "policyTypes": ["Ingress"], "ingress": ingress},
        }
    )


def operator_peer(exp: RLExperiment) -> Obj:
    """The operator's pods: their labels, in the operator's namespace only."""
    namespace = OPERATOR_NAMESPACE or exp.namespace
    return {"namespaceSelector": {"matchLabels": {NAMESPACE_NAME_LABEL: namespace}},
            "podSelector": {"matchLabels": dict(L.OPERATOR_POD_LABELS)}}


def build_network_policy(exp: RLExperiment) -> Obj | None:
    """Ingress to the bus pods (see the module docstring); None with an external bus."""
    if exp.spec.bus.external is not None:
        return None
    experiment_pods = {"podSelector": {"matchLabels": L.experiment_labels(exp)}}
    bus_pods = {"podSelector": {"matchLabels": L.selector_labels(exp, L.Role.BUS)}}
    operator = operator_peer(exp)
    return _policy(exp, naming.network_policy_name(exp), L.Role.BUS, [
        {"from": [experiment_pods, operator], "ports": [_port(naming.BUS_CLIENT_PORT)]},
        {"from": [operator], "ports": [_port(naming.BUS_MONITOR_PORT)]},
        {"from": [bus_pods], "ports": [_port(naming.BUS_CLUSTER_PORT)]},
    ])


def build_rollout_network_policy(exp: RLExperiment) -> Obj:
    """Ingress to the engines: their port, from this experiment's pods only."""
    return _policy(exp, naming.rollout_network_policy_name(exp), L.Role.ROLLOUT, [
        {"from": [{"podSelector": {"matchLabels": L.experiment_labels(exp)}}], "ports": [_port(naming.ENGINE_PORT)]},
    ])


def build_trainer_network_policy(exp: RLExperiment) -> Obj:
    """Ingress to the trainer pods: from this experiment's trainer pods only, on any port."""
    return _policy(exp, naming.trainer_network_policy_name(exp), L.Role.TRAINER, [
        {"from": [{"podSelector": {"matchLabels": L.selector_labels(exp, L.Role.TRAINER)}}]},
    ])
