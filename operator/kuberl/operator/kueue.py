"""Kueue: an RLExperiment labelled `kueue.x-k8s.io/queue-name` is queued as one Kueue Workload.

Called by kuberl.operator.handlers (`gate` on every reconcile and monitor tick). The Workload is read
from the operator's watch cache (kuberl.operator.cache), so a queued experiment's tick reads no API;
it is applied when it is missing, changed, or still waits for quota (then at most every 30 s). KubeRL is the
Workload's job integration, as Kueue's own Job or KubeRay's RayJob integrations are: it creates a
Workload with one PodSet per role (bus servers, rollout replicas, trainer nodes, each with its pod
template so Kueue counts their requests), owned by the experiment, and keeps the experiment
suspended (`spec.suspend` semantics: no pods, checkpoint first) until Kueue admits the Workload.
Admitted: the children are applied as for a resume. Evicted (preemption, a lost admission check):
the experiment suspends (checkpoint first), and once its pods are gone the quota reservation is
released so Kueue can queue it again. Children never carry the queue label themselves
(kube.own_child), so the trainer Job and the StatefulSets are no Kueue workloads of their own.
Not covered: Kueue's flavour assignment (podSetAssignments' nodeSelectors) is not copied into the
pods, and autoscaling beyond the admitted rollout count is not requested from Kueue (docs/operations.md).
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from kuberl.api.v1alpha1 import RLExperiment
from kuberl.operator import labels as L
from kuberl.operator import naming
from kuberl.operator.builders import build_children
from kuberl.operator.builders.common import Obj

log = logging.getLogger("kuberl.operator.kueue")
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
PRIORITY_CLASS_LABEL = "kueue.x-k8s.io/priority-class"
WORKLOAD_API_VERSION = "kueue.x-k8s.io/v1beta1"
WORKLOAD_NAME_MAX = 253


def queue_name(exp: RLExperiment) -> str | None:
    return (exp.metadata.labels or {}).get(QUEUE_LABEL) or None


def workload_name(exp: RLExperiment) -> str:
    return naming._child(exp, "workload", WORKLOAD_NAME_MAX)


def build_workload(exp: RLExperiment) -> Obj:
    """The Workload of a queued experiment: one PodSet per role with the pods it runs when admitted.
    `active` follows spec.suspend (a suspended experiment asks for no quota)."""
    running = exp.model_copy(update={"spec": exp.spec.model_copy(update={"suspend": False})})
    pod_sets = []
    for child in build_children(running, bus_token="counted-not-used"):
        if child["kind"] == "StatefulSet":
            role, count = child["spec"]["template"]["metadata"]["labels"][L.ROLE_LABEL], child["spec"]["replicas"]
        elif child["kind"] == "Job":
            role, count = L.Role.TRAINER.value, child["spec"]["parallelism"]
        else:
            continue
        if count:
            pod_sets.append({"name": role, "count": count, "template": child["spec"]["template"]})
    spec: Obj = {"queueName": queue_name(exp), "active": not exp.spec.suspend, "podSets": pod_sets}
    priority = (exp.metadata.labels or {}).get(PRIORITY_CLASS_LABEL)
    if priority:
        spec["priorityClassName"] = priority
        spec["priorityClassSource"] = "kueue.x-k8s.io/workloadpriorityclass"
    meta = {"name": workload_name(exp), "namespace": exp.namespace,
            "labels": {**L.experiment_labels(exp), L.APP_MANAGED_BY_LABEL: L.MANAGED_BY}}
    return {"apiVersion": WORKLOAD_API_VERSION, "kind": "Workload", "metadata": meta, "spec": spec}


def condition(workload: Obj | None, kind: str) -> bool:
    return any(c.get("type") == kind and c.get("status") == "True" for c in ((workload or {}).get("status") or {}).get("conditions") or [])


def admitted(workload: Obj | None) -> bool:
    """Kueue admitted it (quota reserved and every admission check passed) and did not evict it since."""
    return condition(workload, "Admitted") and not condition(workload, "Evicted")


def gated(exp: RLExperiment, workload: Obj | None) -> RLExperiment:
    """The experiment as the operator must run it: suspended while a queued one is not admitted."""
    if queue_name(exp) is None or exp.spec.suspend or admitted(workload):
        return exp
    return exp.model_copy(update={"spec": exp.spec.model_copy(update={"suspend": True})})


def released(workload: Obj) -> Obj:
    """The status patch that gives an evicted Workload's quota back (what Kueue's job integrations do
    once the job's pods are gone): no admission, QuotaReserved and Admitted False."""
    reason = next((c.get("message") for c in workload["status"]["conditions"] if c.get("type") == "Evicted"), "") or "evicted"
    conditions = []
    for c in workload["status"]["conditions"]:
        if c.get("type") in ("QuotaReserved", "Admitted") and c.get("status") == "True":
            c = {**c, "status": "False", "reason": "Pending", "message": f"the experiment stopped: {reason}"[:1024]}
        conditions.append(c)
    return {"admission": None, "conditions": conditions}


# How long a Workload just applied is not applied again while the watch cache does not show it yet, or
# shows it without quota reserved (pending in its queue): one apply per 30 s at most, not one per tick.
REAPPLY_AFTER = 30.0


def _applied_key(built: Obj) -> str:
    return json.dumps([built["metadata"], built["spec"]], sort_keys=True, default=str)


def applied_recently(memo: Any, built: Obj) -> bool:
    """Whether this very Workload (same metadata and spec) was applied less than REAPPLY_AFTER seconds ago."""
    last = memo.get("kueue_applied")
    return last is not None and last[0] == _applied_key(built) and time.monotonic() - last[1] < REAPPLY_AFTER


async def current_workload(namespace: str, name: str, memo: Any) -> Obj | None:
    """The experiment's Workload from the watch cache (kuberl.operator.cache, no API read), or from the
    API where no Workload index is bound (unit tests driving the handlers without kopf)."""
    from kuberl.operator.lifecycle import CONFIG, kube

    cache = CONFIG.cache
    if cache is not None and cache.has_workloads:
        return cache.workload(namespace, name)
    return await kube().get("Workload", namespace, name)


async def gate(body: Any, exp: RLExperiment, status: Any, memo: Any) -> RLExperiment:
    """For a queued experiment: make sure its Workload exists, apply the children when Kueue has just
    admitted it, give the quota back once an evicted one has stopped; returns `gated(exp, workload)`."""
    if queue_name(exp) is None:
        return exp
    from kuberl.operator.kube import KubeError, own_child
    from kuberl.operator.lifecycle import CONFIG, apply_children, kube
    from kuberl.operator.rules import suspend_applied

    name = workload_name(exp)
    workload = await current_workload(exp.namespace, name, memo)
    built = own_child(build_workload(exp), body)
    stale = workload is None or workload["spec"].get("active") != built["spec"]["active"] or not condition(workload, "QuotaReserved")
    if stale and applied_recently(memo, built):
        stale = False  # applied moments ago: the watch has not brought it back yet (or Kueue has not reserved quota)
    if stale:
        try:  # podSets are immutable once Kueue reserved quota: only a pending Workload is re-applied
            workload = await kube().apply(built)
        except KubeError as exc:
            log.warning("%s/%s: Workload %s not applied: %s", exp.namespace, exp.name, name, exc)
        memo["kueue_applied"] = (_applied_key(built), time.monotonic())
    out = gated(exp, workload)
    now_admitted = admitted(workload)
    if now_admitted and memo.get("kueue_admitted") is False:
        await apply_children(body, out, dict(status or {}), memo)  # resume: Kueue let it in
    if condition(workload, "Evicted") and condition(workload, "QuotaReserved"):
        cache = CONFIG.cache
        job = (cache.job(exp.namespace, naming.trainer_name(exp)) if cache is not None
               else await kube().get("Job", exp.namespace, naming.trainer_name(exp)))
        if suspend_applied(out, job, memo) and not ((job or {}).get("status") or {}).get("active"):
            await kube().patch("Workload", exp.namespace, name, {"status": released(workload)}, subresource="status")
    memo["kueue_admitted"] = now_admitted
    return out
