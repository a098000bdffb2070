"""NetworkPolicy of the embedded bus: only this experiment's pods (and the operator) reach NATS.

Called by builders.build_children and the kopf handlers (O2); none with spec.bus.external.
"""

from __future__ import annotations

from kuberl.operator import labels as L
from kuberl.operator import naming
from kuberl.operator.builders.common import Obj, metadata, with_spec_hash

from kuberl.api.v1alpha1 import RLExperiment


def build_network_policy(exp: RLExperiment) -> Obj | None:
    """Ingress to the bus pods: 4222 from pods labelled with this experiment and from the operator
    (any namespace, labels OPERATOR_POD_LABELS, which reads progress and serves metrics), 8222 from
    the operator, 6222 between the bus pods. None with an external bus."""
    if exp.spec.bus.external is not None:
        return None
    bus_pods = {"podSelector": {"matchLabels": L.selector_labels(exp, L.Role.BUS)}}
    operator = {"namespaceSelector": {}, "podSelector": {"matchLabels": dict(L.OPERATOR_POD_LABELS)}}

    def port(n: int) -> dict:
        return {"protocol": "TCP", "port": n}

    return with_spec_hash(
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": metadata(exp, naming.network_policy_name(exp), L.Component.NETWORK),
            "spec": {
                "podSelector": {"matchLabels": L.selector_labels(exp, L.Role.BUS)},
                "policyTypes": ["Ingress"],
                "ingress": [
                    {
                        "from": [{"podSelector": {"matchLabels": L.experiment_labels(exp)}}, operator],
                        "ports": [port(naming.BUS_CLIENT_PORT)],
                    },
                    {"from": [operator], "ports": [port(naming.BUS_MONITOR_PORT)]},
                    {"from": [bus_pods], "ports": [port(naming.BUS_CLUSTER_PORT)]},
                ],
            },
        }
    )
