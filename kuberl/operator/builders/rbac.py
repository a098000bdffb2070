"""ServiceAccount, Role and RoleBinding of the runtime pods: least privilege, which here is none.

Called by builders.build_children and the kopf handlers (O2). The runtime (engines, agents, trainer,
NATS) talks only to the bus, the engines and its volumes, never to the Kubernetes API, so the Role
grants nothing and the pods do not even mount a token (automountServiceAccountToken: false). The Role
exists, empty, as the one named place a cluster admin would extend; binding an empty Role also needs
no escalation rights from the operator.
"""

from __future__ import annotations

from kuberl.operator import labels as L
from kuberl.operator import naming
from kuberl.operator.builders.common import Obj, metadata, with_spec_hash

from kuberl.api.v1alpha1 import RLExperiment


def build_rbac(exp: RLExperiment) -> list[Obj]:
    """[ServiceAccount, Role, RoleBinding], all named `{exp}-runtime`."""
    name = naming.service_account_name(exp)
    account = {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": metadata(exp, name, L.Component.RBAC),
        "automountServiceAccountToken": False,
    }
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": metadata(exp, name, L.Component.RBAC),
        "rules": [],
    }
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": metadata(exp, name, L.Component.RBAC),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": exp.namespace}],
    }
    return [with_spec_hash(account), with_spec_hash(role), with_spec_hash(binding)]
