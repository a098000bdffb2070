"""Advisory accelerator capacity: would any current Node take a role's pods? Never blocks pod creation.

A node pool that scales from zero (GKE/EKS min 0, Karpenter, NAP, Autopilot) has no Node advertising
GPUs until a pod is pending: only the scheduler and the cluster autoscaler can decide. So the operator
always creates the pods and, when no current Node that matches a role's nodeSelector and tolerates its
taints offers enough of the accelerator, says so in an InsufficientAccelerators event and in the
conditions' message. Pure functions over the rendered pod templates and the Nodes as read.

A pod that requests an extended resource counts as tolerating NoSchedule taints keyed on it (`nvidia.com/gpu`,
GKE's GPU taint): the ExtendedResourceToleration admission plugin (on in GKE) adds exactly that toleration to such
pods, and where it is off the taint is the user's to tolerate (spec.*.tolerations), which the scheduler's own
Unschedulable message then names.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from kuberl.api.v1alpha1 import RLExperiment
from kuberl.operator.builders.common import accelerator_resource
from kuberl.operator.labels import Reason
from kuberl.operator.observed import Problem

# Taint effects that keep a pod off a node (PreferNoSchedule only discourages).
REPELLING_EFFECTS = frozenset({"NoSchedule", "NoExecute"})


def tolerates(tolerations: Iterable[Mapping[str, Any]], taint: Mapping[str, Any]) -> bool:
    """core/v1 toleration matching: key (empty key with Exists matches every key), operator
    Equal (value must match) or Exists, effect (empty matches every effect)."""
    for tol in tolerations:
        if tol.get("effect") and tol.get("effect") != taint.get("effect"):
            continue
        op = tol.get("operator") or "Equal"
        if not tol.get("key"):
            if op == "Exists":
                return True
            continue
        if tol.get("key") != taint.get("key"):
            continue
        if op == "Exists" or (tol.get("value") or "") == (taint.get("value") or ""):
            return True
    return False


def node_accepts(node: Mapping[str, Any], pod_spec: Mapping[str, Any]) -> bool:
    """Whether `pod_spec`'s nodeSelector matches the node's labels and it tolerates the node's taints."""
    labels = (node.get("metadata") or {}).get("labels") or {}
    if any(labels.get(k) != v for k, v in (pod_spec.get("nodeSelector") or {}).items()):
        return False
    if (node.get("spec") or {}).get("unschedulable"):
        return False
    taints = [t for t in (node.get("spec") or {}).get("taints") or [] if t.get("effect") in REPELLING_EFFECTS]
    return all(tolerates(pod_spec.get("tolerations") or [], t) for t in taints)


def allocatable(node: Mapping[str, Any], resource: str) -> int:
    try:
        return int(str(((node.get("status") or {}).get("allocatable") or {}).get(resource, 0)))
    except ValueError:
        return 0


def capacity_advisories(exp: RLExperiment, pod_specs: Mapping[str, Mapping[str, Any]], nodes: Iterable[Mapping[str, Any]]) -> list[Problem]:
    """One InsufficientAccelerators note per role whose pods no current Node can take.

    `pod_specs` maps "rollout"/"trainer" to the pod template spec the builders render (so the
    nodeSelector and tolerations are exactly what the scheduler sees). The notes are advisory.
    """
    nodes = list(nodes)
    out = []
    for role, path, accel in (("rollout", "spec.rollout.accelerator", exp.spec.rollout.accelerator),
                              ("trainer", "spec.trainer.accelerator", exp.spec.trainer.accelerator)):
        resource = accelerator_resource(accel)
        pod_spec = pod_specs.get(role)
        if resource is None or pod_spec is None:
            continue
        admitted = {**pod_spec, "tolerations": [*(pod_spec.get("tolerations") or []),
                                                {"key": resource, "operator": "Exists", "effect": "NoSchedule"}]}
        eligible = [n for n in nodes if node_accepts(n, admitted)]
        largest = max((allocatable(n, resource) for n in eligible), default=0)
        if accel.count <= largest:
            continue
        scope = "no current node" if not nodes else f"none of the {len(nodes)} current nodes"
        selector = " matching the pods' nodeSelector and tolerations" if (pod_spec.get("nodeSelector") or pod_spec.get("tolerations")) else ""
        out.append(Problem(
            Reason.INSUFFICIENT_ACCELERATORS,
            f"{path}.count: each {role} pod asks for {accel.count} {resource}, but {scope}{selector} offers that many "
            f"(largest: {largest}); the pods are created anyway and wait for the scheduler or a cluster autoscaler "
            "(a node pool that scales from zero starts only for pending pods)"))
    return out
