"""NetworkPolicies: only this experiment's pods reach its bus, its engines and its trainer.

Called by builders.build_children and the kopf handlers (O2). Three policies, by role:
- bus (embedded only): 4222 from this experiment's pods and the operator, 8222 from the operator,
  6222 between the bus pods. The operator is admitted from its own namespace only
  (`kubernetes.io/metadata.name`, set by the API server, cannot be forged by a pod's labels).
- rollout: the engine port from this experiment's pods only. The engines serve vLLM's development
  endpoints (/collective_rpc, /pause, weight reload), behind the engine API key as well (rollout.py,
  runtime/inference/engine_auth.py); the agent beside them uses 127.0.0.1, which no policy filters,
  and kubelet probes (the engine's /health, the agent's probe port) are admitted by the CNIs that
  enforce policies. The agent's probe port also serves /metrics (Prometheus): it is admitted from
  the scrapers' namespaces (below).
  workflow.external: the episode port (the episode API, and the proxy its agents call) from every pod of the
  experiment's namespace and of workflow.external.namespaces; each request also needs the experiment's episode key (to
  open an episode) or that episode's own key (to call the model or close it). kubectl port-forward reaches it too (it
  enters the pod from inside, which no policy filters): the way in for an agent outside the cluster.
- trainer: from this experiment's trainer pods only, every port (torchrun's rendezvous store and
  the NCCL/gloo ports, which are chosen at run time); its metrics port from the scrapers' namespaces.
weightSync.mode broadcast: trainer and rollout pods admit each other on every port (the weight-broadcast
group's peers connect both ways on ports chosen at run time; the store is weightSync.port on trainer rank 0).
Scrapers: the metrics ports only (read-only counters, no other port), from the namespaces named in
$KUBERL_METRICS_NAMESPACES (comma-separated, read when the policies are built; set it with the chart's
extraEnv), or from every namespace when it is unset.
Policies select ingress only: egress (the bus, a model hub, an external NATS) stays open.
"""

from __future__ import annotations

import os
import re

from kuberl.api.v1alpha1 import RLExperiment
from kuberl.operator import labels as L
from kuberl.operator import naming
from kuberl.operator.builders.common import Obj, metadata, with_spec_hash
from kuberl.operator.builders.trainer import METRICS_PORT as TRAINER_METRICS_PORT

# The namespace the operator's pods run in; `kuberl operator` sets it once at start-up from
# $POD_NAMESPACE (the chart passes it) through configure_operator_namespace(). Unset (an operator
# running outside the cluster, which no policy can admit anyway): the experiment's own namespace.
OPERATOR_NAMESPACE: str | None = None
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"
METRICS_NAMESPACES_ENV = "KUBERL_METRICS_NAMESPACES"
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


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


def metrics_namespaces() -> list[str] | None:
    """$KUBERL_METRICS_NAMESPACES as namespace names; None (every namespace) when unset or empty."""
    raw = os.environ.get(METRICS_NAMESPACES_ENV, "")
    names = [n.strip() for n in raw.split(",") if n.strip()]
    bad = [n for n in names if not _DNS_LABEL.match(n)]
    if bad:
        raise ValueError(f"${METRICS_NAMESPACES_ENV} must be comma-separated namespace names, got {', '.join(map(repr, bad))}")
    return names or None


def metrics_scrape_rule(ports: list[int]) -> Obj:
    """Ingress on the metrics ports only, from the scrapers' namespaces (module docstring)."""
    names = metrics_namespaces()
    if names is None:
        peers = [{"namespaceSelector": {}}]
    else:
        peers = [{"namespaceSelector": {"matchExpressions": [{"key": NAMESPACE_NAME_LABEL, "operator": "In", "values": names}]}}]
    return {"from": peers, "ports": [_port(p) for p in ports]}


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


def _broadcast_rule(exp: RLExperiment) -> list[Obj]:
    """weightSync.mode broadcast: the trainer and the engines form gloo/NCCL groups, whose peers connect both ways
    on ports chosen at run time: every port between this experiment's trainer and rollout pods."""
    if exp.spec.weight_sync.mode != "broadcast":
        return []
    return [{"from": [{"podSelector": {"matchLabels": L.selector_labels(exp, L.Role.TRAINER)}},
                      {"podSelector": {"matchLabels": L.selector_labels(exp, L.Role.ROLLOUT)}}]}]


def _episode_rule(exp: RLExperiment) -> list[Obj]:
    """workflow.external: the episode port from the pods of the experiment's namespace and of workflow.external.namespaces."""
    external = exp.spec.workflow.external
    if external is None:
        return []
    peers: list[Obj] = [{"podSelector": {}}]  # every pod of the policy's (the experiment's) namespace
    others = sorted(set(external.namespaces or []) - {exp.namespace})
    if others:
        peers.append({"namespaceSelector": {"matchExpressions": [{"key": NAMESPACE_NAME_LABEL, "operator": "In", "values": others}]}})
    return [{"from": peers, "ports": [_port(naming.EPISODE_PORT)]}]


def build_rollout_network_policy(exp: RLExperiment) -> Obj:
    """Ingress to the rollout pods: the engine port from this experiment's pods only; the agent's probe port (/metrics) from the scrapers;
    workflow.external: the episode port (module docstring); weightSync.mode broadcast: every port from the trainer and rollout pods."""
    return _policy(exp, naming.rollout_network_policy_name(exp), L.Role.ROLLOUT, [
        {"from": [{"podSelector": {"matchLabels": L.experiment_labels(exp)}}], "ports": [_port(naming.ENGINE_PORT)]},
        metrics_scrape_rule([naming.AGENT_HEALTH_PORT]),
        *_episode_rule(exp),
        *_broadcast_rule(exp),
    ])


def build_trainer_network_policy(exp: RLExperiment) -> Obj:
    """Ingress to the trainer pods: from this experiment's trainer pods on any port; the metrics port from the scrapers;
    weightSync.mode broadcast: every port from the rollout pods too."""
    return _policy(exp, naming.trainer_network_policy_name(exp), L.Role.TRAINER, [
        {"from": [{"podSelector": {"matchLabels": L.selector_labels(exp, L.Role.TRAINER)}}]},
        metrics_scrape_rule([TRAINER_METRICS_PORT]),
        *_broadcast_rule(exp),
    ])
