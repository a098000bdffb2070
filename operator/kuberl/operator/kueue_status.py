"""What a Kueue job integration reports on its Workload and takes from it, done for RLExperiments as Kueue's own
integrations (jobframework) do it. Called by kuberl.operator.kueue.gate.

- The API version: the Workload version the installed Kueue serves, newest first (`v1beta2`, stored since Kueue
  v0.15; `v1beta1` before), read once per API client from the group's discovery document.
- PodsReady: the Workload's `PodsReady` condition, True once every pod its PodSets count is Ready (or Succeeded), so
  that Kueue's `waitForPodsReady` does not evict and requeue a running experiment at every timeout. Reasons as
  jobframework's `generatePodsReadyCondition`: Started, WaitForStart, WaitForRecovery, Recovered.
- Finished: a Succeeded or Failed experiment marks its Workload Finished (Kueue then releases its quota and admits the
  next one), as jobframework does when a Job completes.
- Placement: the admitted flavours (`status.admission.podSetAssignments`) -> each ResourceFlavor's `nodeLabels` and
  `tolerations`, merged into each role's pod template (bus, rollout, trainer, and the tool sandbox's Deployment with
  workflow.sandbox.placement pod: Kueue's podset merge) wherever a child is applied, so quota and placement agree; for
  a PodSet placed by topology-aware scheduling also the scheduling gate, Workload annotation and PodSet label that let
  Kueue's topology ungater put each pod on the node it assigned.
Status writes are server-side applies of the one condition (the Workload's conditions are a map keyed by type), so
Kueue's own conditions are never overwritten.
"""

from __future__ import annotations

import copy
import datetime as dt
import json
from typing import Any

from kuberl.operator import labels as L
from kuberl.operator.builders.common import Obj, with_spec_hash

GROUP = "kueue.x-k8s.io"
VERSIONS = ("v1beta2", "v1beta1")  # newest first: the first the cluster serves is used
# The PodSet of the tool sandbox's pods (workflow.sandbox.placement pod); the other PodSets are named by their role.
SANDBOX_POD_SET = L.Component.SANDBOX.value
# Topology-aware scheduling (Kueue's kueue.x-k8s.io/v1beta2 topology_types.go and constants.go)
TOPOLOGY_GATE = "kueue.x-k8s.io/topology"
WORKLOAD_ANNOTATION = "kueue.x-k8s.io/workload"
UNCONSTRAINED_ANNOTATION = "kueue.x-k8s.io/podset-unconstrained-topology"
POD_SET_LABEL = "kueue.x-k8s.io/podset"


async def api_version(client: Any) -> str:
    """`kueue.x-k8s.io/<version>` of the Workloads the installed Kueue serves (v1beta2 first), discovered once per client
    and written into kube.KINDS (Workload, ResourceFlavor, WorkloadPriorityClass); v1beta1 when Kueue is not installed (nothing is served)."""
    from kuberl.operator.kube import KINDS, KubeError

    cached = getattr(client, "_kueue_api_version", None)
    if cached:
        return cached
    try:
        group = await client.request("GET", f"/apis/{GROUP}")
    except KubeError as exc:
        if exc.status != 404:
            raise
        return f"{GROUP}/v1beta1"  # not installed (yet): not remembered, asked again next time
    served = {v.get("version") for v in group.get("versions") or []}
    version = f"{GROUP}/{next((v for v in VERSIONS if v in served), VERSIONS[-1])}"
    KINDS["Workload"] = (version, "workloads", True)
    KINDS["ResourceFlavor"] = (version, "resourceflavors", False)
    KINDS["WorkloadPriorityClass"] = (version, "workloadpriorityclasses", False)
    client._kueue_api_version = version
    return version


def with_priority(spec: Obj, api_version: str, priority: str, value: int | None = None) -> Obj:
    """The WorkloadPriorityClass reference in the version's own shape (v1beta2's priorityClassRef), with its value
    (`spec.priority`, which Kueue's validation requires beside the reference)."""
    if api_version.endswith("/v1beta1"):
        spec = {**spec, "priorityClassName": priority, "priorityClassSource": f"{GROUP}/workloadpriorityclass"}
    else:
        spec = {**spec, "priorityClassRef": {"group": GROUP, "kind": "WorkloadPriorityClass", "name": priority}}
    return {**spec, "priority": value} if value is not None else spec


def condition_of(workload: Obj | None, kind: str) -> Obj | None:
    return next((c for c in ((workload or {}).get("status") or {}).get("conditions") or [] if c.get("type") == kind), None)


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def pods_ready(pods: list[Obj], expected: int) -> bool:
    """Every pod the Workload's PodSets count is up: Ready, or Succeeded (a finished trainer rank), none deleted."""
    def up(pod: Obj) -> bool:
        status = pod.get("status") or {}
        ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
        return not (pod.get("metadata") or {}).get("deletionTimestamp") and (ready or status.get("phase") == "Succeeded")
    return expected > 0 and sum(1 for p in pods if up(p)) >= expected


def pods_ready_condition(workload: Obj, admitted: bool, ready: bool) -> Obj | None:
    """The PodsReady condition to write (jobframework's rules), or None when the current one already says it."""
    current = condition_of(workload, "PodsReady") or {}
    if not admitted:
        status, reason, message = "False", "WaitForStart", "Not all pods are ready or succeeded"
    elif ready:
        recovering = current.get("reason") in ("WaitForRecovery", "Recovered")
        status, reason, message = "True", "Recovered" if recovering else "Started", "All pods reached readiness and the workload is running"
    elif current.get("status") == "True" or current.get("reason") == "WaitForRecovery":
        status, reason, message = "False", "WaitForRecovery", "At least one pod has failed, waiting for recovery"
    else:
        status, reason, message = "False", "WaitForStart", "Not all pods are ready or succeeded"
    if current.get("status") == status and current.get("reason") == reason:
        return None
    return {"type": "PodsReady", "status": status, "reason": reason, "message": message, "lastTransitionTime": _now(),
            "observedGeneration": (workload.get("metadata") or {}).get("generation", 0)}


def finished_condition(workload: Obj, phase: str | None) -> Obj | None:
    """Finished=True for a Succeeded or Failed experiment (Kueue releases the quota), None when not over or said."""
    if phase not in ("Succeeded", "Failed") or (condition_of(workload, "Finished") or {}).get("status") == "True":
        return None
    message = "The experiment succeeded" if phase == "Succeeded" else "The experiment failed"
    return {"type": "Finished", "status": "True", "reason": phase, "message": message, "lastTransitionTime": _now(),
            "observedGeneration": (workload.get("metadata") or {}).get("generation", 0)}


async def write_condition(client: Any, workload: Obj, condition: Obj) -> None:
    """Server-side apply of one condition on the Workload's status (field manager kuberl-operator)."""
    from kuberl.operator.kube import FIELD_MANAGER, path_for

    meta = workload["metadata"]
    body = {"apiVersion": workload["apiVersion"], "kind": "Workload",
            "metadata": {"name": meta["name"], "namespace": meta["namespace"]}, "status": {"conditions": [condition]}}
    await client.request("PATCH", path_for("Workload", meta["namespace"], meta["name"], "status", api_version=workload["apiVersion"]),
                         params={"fieldManager": FIELD_MANAGER, "force": "true"}, body=body, content_type="application/apply-patch+yaml")


def assignment_key(workload: Obj | None) -> str | None:
    admission = ((workload or {}).get("status") or {}).get("admission")
    return json.dumps(admission.get("podSetAssignments") or [], sort_keys=True) if admission else None


async def placement(client: Any, workload: Obj | None) -> dict[str, Obj]:
    """Role -> {nodeSelector, tolerations, topology} from the flavours of the Workload's admission (empty when it has
    none). `topology`: for a PodSet Kueue placed by topology-aware scheduling (its assignment has a
    topologyAssignment), what jobframework puts on such pods (podset.FromAssignment): the scheduling gate Kueue's
    topology ungater lifts once it has set each pod's node selector, the Workload and PodSet it finds them by, and for a
    PodSet that asked for no topology (a flavour with a topologyName places every PodSet) the unconstrained annotation;
    else None."""
    admission = ((workload or {}).get("status") or {}).get("admission") or {}
    requested = {ps.get("name"): ps.get("topologyRequest") for ps in ((workload or {}).get("spec") or {}).get("podSets") or []}
    out: dict[str, Obj] = {}
    for assignment in admission.get("podSetAssignments") or []:
        selector: dict[str, str] = {}
        tolerations: list[Obj] = []
        for name in sorted(set((assignment.get("flavors") or {}).values())):
            flavor = await client.get("ResourceFlavor", None, name) or {}
            selector.update((flavor.get("spec") or {}).get("nodeLabels") or {})
            tolerations += [t for t in (flavor.get("spec") or {}).get("tolerations") or [] if t not in tolerations]
        pod_set = assignment.get("name", "")
        topology = None
        if assignment.get("topologyAssignment"):
            request = requested.get(pod_set) or {}
            explicit = any(k in request for k in ("required", "preferred", "unconstrained"))
            topology = {"annotations": {WORKLOAD_ANNOTATION: workload["metadata"]["name"],
                                        **({} if explicit else {UNCONSTRAINED_ANNOTATION: "true"})},
                        "labels": {POD_SET_LABEL: pod_set}}
        out[pod_set] = {"nodeSelector": selector, "tolerations": tolerations, "topology": topology}
    return out


# (namespace, experiment) -> role -> {nodeSelector, tolerations}: the placement of each admitted experiment, set by
# kueue.gate on every tick, read by place_child wherever a child is applied (apply.apply_child).
PLACEMENT: dict[tuple[str, str], dict[str, Obj]] = {}


def pod_set_of(template_labels: dict[str, str]) -> tuple[str, str]:
    """(experiment, PodSet name) of a pod template: a role's pods carry kuberl.io/experiment and kuberl.io/role; the
    sandbox's pods carry kuberl.io/sandbox instead (never kuberl.io/experiment: builders.sandbox)."""
    if L.EXPERIMENT_LABEL in template_labels:
        return template_labels[L.EXPERIMENT_LABEL], template_labels.get(L.ROLE_LABEL, "")
    if L.SANDBOX_LABEL in template_labels:
        return template_labels[L.SANDBOX_LABEL], SANDBOX_POD_SET
    return "", ""


def place_child(child: Obj) -> Obj:
    """A StatefulSet, Job or (the sandbox's) Deployment with its experiment's admitted flavours merged into its pod
    template's nodeSelector and tolerations (the spec's own win on a conflicting key, as Kueue's podset merge refuses to
    override them), and, for a PodSet placed by topology-aware scheduling, the gate, labels and annotations Kueue's
    topology ungater needs (`placement`). Applied after pinning (builders.pinning keeps a live template as it is): the
    flavours Kueue assigns are where the pods must run whatever template they keep."""
    if child.get("kind") not in ("StatefulSet", "Job", "Deployment"):
        return child
    template = child["spec"]["template"]
    experiment, pod_set = pod_set_of((template.get("metadata") or {}).get("labels") or {})
    where = PLACEMENT.get((child["metadata"].get("namespace", ""), experiment), {}).get(pod_set)
    if not where or not (where["nodeSelector"] or where["tolerations"] or where.get("topology")):
        return child
    child = copy.deepcopy(child)
    meta = child["spec"]["template"].setdefault("metadata", {})
    spec = child["spec"]["template"]["spec"]
    spec["nodeSelector"] = {**where["nodeSelector"], **(spec.get("nodeSelector") or {})}
    tolerations = list(spec.get("tolerations") or [])
    spec["tolerations"] = tolerations + [t for t in where["tolerations"] if t not in tolerations]
    if where.get("topology"):
        meta["labels"] = {**(meta.get("labels") or {}), **where["topology"]["labels"]}
        meta["annotations"] = {**(meta.get("annotations") or {}), **where["topology"]["annotations"]}
        gates = list(spec.get("schedulingGates") or [])
        spec["schedulingGates"] = gates + ([{"name": TOPOLOGY_GATE}] if {"name": TOPOLOGY_GATE} not in gates else [])
    return with_spec_hash(child)
