"""ServiceAccount of the runtime pods: least privilege, which here is none.

Called by builders.build_children and the kopf handlers (O2). The runtime (engines, agents, trainer,
NATS) talks only to the bus, the engines and its volumes, never to the Kubernetes API, so the pods
do not even mount a token (automountServiceAccountToken: false) and there is no Role: a cluster admin
who needs one (e.g. for a custom agent) binds it to this ServiceAccount. Without Roles to create, the
operator itself holds no rbac.authorization.k8s.io rights (charts/kuberl/templates/clusterrole.yaml).
The account is also where GKE Workload Identity or EKS IRSA annotations would go
(spec.<role>.podTemplate.serviceAccountName names another one).
"""

from __future__ import annotations

from kuberl.api.v1alpha1 import RLExperiment
from kuberl.operator import labels as L
from kuberl.operator import naming
from kuberl.operator.builders.common import Obj, metadata, with_spec_hash


def build_rbac(exp: RLExperiment) -> list[Obj]:
    """[ServiceAccount `{exp}-runtime`], token not mounted."""
    account = {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": metadata(exp, naming.service_account_name(exp), L.Component.RBAC),
        "automountServiceAccountToken": False,
    }
    return [with_spec_hash(account)]
