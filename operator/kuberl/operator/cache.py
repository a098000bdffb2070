"""Watch-backed caches of the experiments' workloads, pods and Kueue Workloads (kopf indexes), so a monitor tick reads no API.

kopf keeps each index current from one watch per resource (server-side filtered on the
kuberl.io/experiment label: main.configure_settings; pods on `app.kubernetes.io/managed-by: kuberl-operator`, which
the roles' pods and the tool sandbox's pods all carry) and invokes no resource handler before every
index is filled, so a cache never reads "absent" for a child that exists when the operator starts.
The sandbox's pods (workflow.sandbox.placement pod) carry `kuberl.io/sandbox` instead of `kuberl.io/experiment`
(the bus and engine NetworkPolicies admit the latter): they have an index of their own, keyed by that label, read
where the operator reports pod problems (observe) and the Workload's PodsReady (kueue).
Values are trimmed to what kuberl.operator.observed and status read (no pod templates, no managedFields):
the memory per experiment stays a few kB. `bind` hands the index objects (kopf passes them to every
handler as keyword arguments) to `CONFIG.cache`; lifecycle.observe reads them there, and falls back to
GET/LIST when no cache is bound (unit tests driving the lifecycle directly).

A cache can lag the operator's own write by one watch event: status computed right after an apply may
still show the old child. The next tick (and a phase change is written at once) corrects it.

Kueue Workloads (kuberl.operator.kueue) are indexed the same way. Without Kueue's CRD kopf finds no
`workloads.kueue.x-k8s.io` in discovery: it starts no watch for it, logs that the resource is not
served, and does not wait for that index (kopf only waits for indexes of resources it watches), so the
index is simply empty; should the CRD be installed later, kopf's CRD watch starts the Workload watch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import kopf

from kuberl.operator.labels import APP_MANAGED_BY_LABEL, EXPERIMENT_LABEL, MANAGED_BY, SANDBOX_LABEL

POD_INDEX, STATEFULSET_INDEX, JOB_INDEX = "kuberl_pods", "kuberl_statefulsets", "kuberl_jobs"
SANDBOX_POD_INDEX = "kuberl_sandbox_pods"
NODE_INDEX = "kuberl_nodes"
WORKLOAD_INDEX = "kuberl_kueue_workloads"
# Server-side label selector of the watches (kopf settings.watching.label_selectors). kopf runs one watch per resource,
# so the pods' selector must match both kinds of pods the operator makes: the roles' (kuberl.io/experiment) and the
# tool sandbox's (kuberl.io/sandbox, no kuberl.io/experiment); both carry the managed-by label (labels.child_labels).
WATCHED = {"pods": f"{APP_MANAGED_BY_LABEL}={MANAGED_BY}", ("apps", "statefulsets"): EXPERIMENT_LABEL,
           ("batch", "jobs"): EXPERIMENT_LABEL, ("kueue.x-k8s.io", "workloads"): EXPERIMENT_LABEL}
_LABELLED = {EXPERIMENT_LABEL: kopf.PRESENT}
_SANDBOXED = {SANDBOX_LABEL: kopf.PRESENT}
_META_KEYS = ("name", "namespace", "uid", "labels", "generation", "resourceVersion", "deletionTimestamp")  # a Job being re-created


def _meta(body: Mapping[str, Any]) -> dict[str, Any]:
    meta = body.get("metadata") or {}
    return {k: meta[k] for k in _META_KEYS if k in meta}


def slim_pod(body: Mapping[str, Any]) -> dict[str, Any]:
    """What observed.pod_problems and configuration_error read: labels, container names/images, status."""
    containers = [{"name": c.get("name"), "image": c.get("image")} for c in ((body.get("spec") or {}).get("containers") or [])]
    return {"metadata": _meta(body), "spec": {"containers": containers}, "status": dict(body.get("status") or {})}


def slim_workload(body: Mapping[str, Any]) -> dict[str, Any]:
    """A StatefulSet or Job without its pod template: replicas, suspend, parallelism, selector, status."""
    spec = {k: v for k, v in (body.get("spec") or {}).items() if k not in ("template", "volumeClaimTemplates")}
    return {"apiVersion": body.get("apiVersion"), "kind": body.get("kind"), "metadata": _meta(body),
            "spec": spec, "status": dict(body.get("status") or {})}


def slim_kueue_workload(body: Mapping[str, Any]) -> dict[str, Any]:
    """A Kueue Workload as kuberl.operator.kueue.gate reads it: spec.active and queueName, the status
    (conditions, admission); no pod templates."""
    spec = {k: v for k, v in (body.get("spec") or {}).items() if k != "podSets"}
    return {"apiVersion": body.get("apiVersion"), "kind": body.get("kind"), "metadata": _meta(body),
            "spec": spec, "status": dict(body.get("status") or {})}


def slim_node(body: Mapping[str, Any]) -> dict[str, Any]:
    """What capacity.capacity_advisories reads of a Node: its name and labels, unschedulable and taints, allocatable.
    A Node as the API returns it carries its images and conditions (kilobytes each on a GPU node): none of that is kept."""
    meta, spec = body.get("metadata") or {}, body.get("spec") or {}
    return {"metadata": {"name": meta.get("name"), "labels": dict(meta.get("labels") or {})},
            "spec": {k: spec[k] for k in ("unschedulable", "taints") if k in spec},
            "status": {"allocatable": dict((body.get("status") or {}).get("allocatable") or {})}}


@kopf.index("nodes", id=NODE_INDEX)
def kuberl_nodes(name: str, body: Any, **_: Any) -> dict[str, dict[str, Any]]:
    """Every Node, slim: the accelerator capacity advisory reads them here instead of listing the Nodes (unpaginated)
    every minute; a Node that joins or leaves shows at the next tick."""
    return {name: slim_node(body)}


@kopf.index("pods", labels=_LABELLED, id=POD_INDEX)
def kuberl_pods(namespace: str, labels: Mapping[str, str], body: Any, **_: Any) -> dict[tuple[str, str], dict[str, Any]]:
    return {(namespace, labels[EXPERIMENT_LABEL]): slim_pod(body)}


@kopf.index("pods", labels=_SANDBOXED, id=SANDBOX_POD_INDEX)
def kuberl_sandbox_pods(namespace: str, labels: Mapping[str, str], body: Any, **_: Any) -> dict[tuple[str, str], dict[str, Any]]:
    """The tool sandbox's pods (workflow.sandbox.placement pod), by (namespace, experiment) from kuberl.io/sandbox."""
    return {(namespace, labels[SANDBOX_LABEL]): slim_pod(body)}


@kopf.index("apps", "v1", "statefulsets", labels=_LABELLED, id=STATEFULSET_INDEX)
def kuberl_statefulsets(namespace: str, name: str, body: Any, **_: Any) -> dict[tuple[str, str], dict[str, Any]]:
    return {(namespace, name): slim_workload(body)}


@kopf.index("batch", "v1", "jobs", labels=_LABELLED, id=JOB_INDEX)
def kuberl_jobs(namespace: str, name: str, body: Any, **_: Any) -> dict[tuple[str, str], dict[str, Any]]:
    return {(namespace, name): slim_workload(body)}


@kopf.index("kueue.x-k8s.io", "workloads", labels=_LABELLED, id=WORKLOAD_INDEX)  # the preferred (newest) version Kueue serves
def kuberl_kueue_workloads(namespace: str, name: str, body: Any, **_: Any) -> dict[tuple[str, str], dict[str, Any]]:
    return {(namespace, name): slim_kueue_workload(body)}


class Children:
    """Read access to the indexes (kopf.Index: key -> a store of values). `workloads` is None where no
    Workload index is bound (then kueue.gate reads the API); `sandbox_pods` None where no sandbox pod index is bound
    (then observe lists them)."""

    def __init__(self, pods: Any, statefulsets: Any, jobs: Any, workloads: Any = None, nodes: Any = None, sandbox_pods: Any = None):
        self._pods, self._sts, self._jobs, self._workloads, self._nodes = pods, statefulsets, jobs, workloads, nodes
        self._sandbox_pods = sandbox_pods

    def nodes(self) -> list[dict[str, Any]] | None:
        """Every Node (slim_node), or None where no Node index is bound (then observe lists them)."""
        return None if self._nodes is None else [node for store in self._nodes.values() for node in store]

    @staticmethod
    def _one(index: Any, key: tuple[str, str]) -> dict[str, Any] | None:
        store = index.get(key)
        return next(iter(store), None) if store is not None else None

    def pods(self, namespace: str, experiment: str) -> list[dict[str, Any]]:
        store = self._pods.get((namespace, experiment))
        return list(store) if store is not None else []

    def sandbox_pods(self, namespace: str, experiment: str) -> list[dict[str, Any]] | None:
        """The experiment's tool sandbox pods (kuberl.io/sandbox), or None where no sandbox pod index is bound."""
        if self._sandbox_pods is None:
            return None
        store = self._sandbox_pods.get((namespace, experiment))
        return list(store) if store is not None else []

    def statefulset(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self._one(self._sts, (namespace, name))

    def job(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self._one(self._jobs, (namespace, name))

    @property
    def has_workloads(self) -> bool:
        return self._workloads is not None

    def workload(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The cached Kueue Workload (None when absent, or when no Workload index is bound)."""
        return None if self._workloads is None else self._one(self._workloads, (namespace, name))


def bind(config: Any, kwargs: Mapping[str, Any]) -> None:
    """Point `config.cache` at kopf's indexes (passed to every handler as keyword arguments), once."""
    if config.cache is None and all(k in kwargs for k in (POD_INDEX, STATEFULSET_INDEX, JOB_INDEX)):
        config.cache = Children(kwargs[POD_INDEX], kwargs[STATEFULSET_INDEX], kwargs[JOB_INDEX], kwargs.get(WORKLOAD_INDEX),
                                kwargs.get(NODE_INDEX), kwargs.get(SANDBOX_POD_INDEX))
