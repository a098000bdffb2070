"""Kueue: an RLExperiment labelled `kueue.x-k8s.io/queue-name` is queued as one Kueue Workload.

Called by kuberl.operator.handlers (`gate` on every reconcile and monitor tick, `finish` when it is at rest). The
Workload is read from the operator's watch cache (kuberl.operator.cache), so a queued experiment's tick reads no API;
it is applied when it is missing, changed, or still waits for quota (then at most every 30 s). KubeRL is the Workload's
job integration, as Kueue's own Job or KubeRay's RayJob integrations are (Kueue's configuration names it an external
framework, `RLExperiment.v1alpha1.kuberl.io`): it creates a Workload, in the version the installed Kueue serves, with
one PodSet per role (bus servers, rollout replicas, trainer nodes, and with workflow.sandbox.placement pod the tool
sandbox's replicas, each with its pod template so Kueue counts their requests; the trainer's ranks are one PodSet,
admitted all together; with trainer.topologyRequest, Kueue's topology-aware scheduling admits them only once they all
fit on free nodes and assigns each its node), owned by the experiment, and keeps the experiment suspended (`spec.suspend` semantics: no pods,
the sandbox's Deployment at 0 too, checkpoint first) until Kueue admits the Workload.
Admitted: the children are applied as for a resume, placed on the admitted flavours' nodes, and the Workload's
PodsReady condition follows the pods (kuberl.operator.kueue_status). Evicted (preemption, waitForPodsReady, a lost
admission check): the experiment suspends (checkpoint first), and once its pods are gone the quota reservation is
released so Kueue can queue it again. Finished: the Workload is marked Finished and Kueue frees the quota. Children
never carry the queue label themselves (kube.own_child): the experiment is their controller, so Kueue sees the trainer
Job as the child of a managed parent and makes no Workload of its own for it (under manageJobsWithoutQueueName too).
Not covered: autoscaling beyond the admitted rollout count is not requested from Kueue (docs/operations.md).
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from kuberl.api.v1alpha1 import KUEUE_QUEUE_LABEL, RLExperiment
from kuberl.operator import kueue_status as ks
from kuberl.operator import labels as L
from kuberl.operator import naming
from kuberl.operator.builders import build_children
from kuberl.operator.builders.common import Obj

log = logging.getLogger("kuberl.operator.kueue")
QUEUE_LABEL = KUEUE_QUEUE_LABEL
PRIORITY_CLASS_LABEL = "kueue.x-k8s.io/priority-class"
WORKLOAD_API_VERSION = "kueue.x-k8s.io/v1beta1"  # the oldest served; gate uses the one the cluster serves (kueue_status)
WORKLOAD_NAME_MAX = 253


def queue_name(exp: RLExperiment) -> str | None:
    return (exp.metadata.labels or {}).get(QUEUE_LABEL) or None


def workload_name(exp: naming.ExperimentRef) -> str:
    return naming._child(exp, "workload", WORKLOAD_NAME_MAX)


def build_workload(exp: RLExperiment, api_version: str = WORKLOAD_API_VERSION, priority_value: int | None = None) -> Obj:
    """The Workload of a queued experiment: one PodSet per role with the pods it runs when admitted.
    `active` follows spec.suspend (a suspended experiment asks for no quota); `priority_value` is the value of the
    WorkloadPriorityClass its label names (Kueue's API requires it beside the reference)."""
    running = exp.model_copy(update={"spec": exp.spec.model_copy(update={"suspend": False})})
    pod_sets = []
    for child in build_children(running, bus_token="counted-not-used"):
        if child["kind"] == "StatefulSet":
            role, count = child["spec"]["template"]["metadata"]["labels"][L.ROLE_LABEL], child["spec"]["replicas"]
        elif child["kind"] == "Job":
            role, count = L.Role.TRAINER.value, child["spec"]["parallelism"]
        elif child["kind"] == "Deployment":  # the tool sandbox's pods (workflow.sandbox.placement pod)
            role, count = ks.SANDBOX_POD_SET, child["spec"]["replicas"]
        else:
            continue
        if count:
            pod_sets.append({"name": role, "count": count, "template": child["spec"]["template"]})
            if role == L.Role.TRAINER.value and exp.spec.trainer.topology_request is not None:
                pod_sets[-1]["topologyRequest"] = exp.spec.trainer.topology_request.kueue()
    spec: Obj = {"queueName": queue_name(exp), "active": not exp.spec.suspend, "podSets": pod_sets}
    priority = (exp.metadata.labels or {}).get(PRIORITY_CLASS_LABEL)
    if priority:
        spec = ks.with_priority(spec, api_version, priority, priority_value)
    meta = {"name": workload_name(exp), "namespace": exp.namespace,
            "labels": {**L.experiment_labels(exp), L.APP_MANAGED_BY_LABEL: L.MANAGED_BY}}
    return {"apiVersion": api_version, "kind": "Workload", "metadata": meta, "spec": spec}


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
    once the job's pods are gone, jobframework's UnsetQuotaReservationWithCondition): no admission,
    QuotaReserved and Admitted False. The patch names the resourceVersion it was computed from, so a
    Workload Kueue changed meanwhile answers 409 and is released on the next tick."""
    reason = next((c.get("message") for c in workload["status"]["conditions"] if c.get("type") == "Evicted"), "") or "evicted"
    conditions = []
    for c in workload["status"]["conditions"]:
        if c.get("type") in ("QuotaReserved", "Admitted") and c.get("status") == "True":
            c = {**c, "status": "False", "reason": "Pending", "message": f"the experiment stopped: {reason}"[:1024]}
        conditions.append(c)
    return {"metadata": {"resourceVersion": workload["metadata"].get("resourceVersion")},
            "status": {"admission": None, "conditions": conditions}}


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
    admitted it (placed on the admitted flavours' nodes), give the quota back once an evicted one has stopped,
    report PodsReady; returns `gated(exp, workload)`."""
    if queue_name(exp) is None:
        return exp
    from kuberl.operator.kube import KubeError, own_child
    from kuberl.operator.lifecycle import apply_children, kube

    name = workload_name(exp)
    workload = await current_workload(exp.namespace, name, memo)
    version = await ks.api_version(kube())
    built = own_child(build_workload(exp, version, await priority_value(exp, memo)), body)
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
    await place_on_flavours(exp, workload, memo)
    now_admitted = admitted(workload)
    if now_admitted and memo.get("kueue_admitted") is False:
        await apply_children(body, out, dict(status or {}), memo)  # resume: Kueue let it in
    await release_if_stopped(exp, out, workload, memo)
    if (status or {}).get("phase") not in ("Succeeded", "Failed"):  # a finished run's pods stop: Finished follows, not a recovery
        await report_pods_ready(exp, workload, built, now_admitted, memo)
    memo["kueue_admitted"] = now_admitted
    return out


async def priority_value(exp: RLExperiment, memo: Any) -> int | None:
    """The value of the WorkloadPriorityClass the experiment's `kueue.x-k8s.io/priority-class` label names (as Kueue's
    jobframework reads it), read once per class name; None without the label, or when the class does not exist (the
    Workload then names it alone and Kueue's webhook refuses it: the warning says why)."""
    from kuberl.operator.lifecycle import kube

    name = (exp.metadata.labels or {}).get(PRIORITY_CLASS_LABEL)
    if not name:
        return None
    cached = memo.get("kueue_priority")
    if cached is None or cached[0] != name:
        found = await kube().get("WorkloadPriorityClass", None, name)
        cached = (name, (found or {}).get("value"))
        memo["kueue_priority"] = cached
    return cached[1]


async def place_on_flavours(exp: RLExperiment, workload: Obj | None, memo: Any) -> None:
    """Put the experiment's pods on the flavours of its Workload's admission (kueue_status.place_child), for as long as
    it holds one (also while evicted, so the trainer Job's template does not change under a running trainer); the
    ResourceFlavors are read once per admission."""
    from kuberl.operator.lifecycle import kube

    key = ks.assignment_key(workload)
    if key is None:
        ks.PLACEMENT.pop((exp.namespace, exp.name), None)
        return
    cached = memo.get("kueue_placement")
    if cached is None or cached[0] != key:
        cached = (key, await ks.placement(kube(), workload))
        memo["kueue_placement"] = cached
    ks.PLACEMENT[(exp.namespace, exp.name)] = cached[1]


async def release_if_stopped(exp: RLExperiment, out: RLExperiment, workload: Obj | None, memo: Any) -> None:
    """An evicted Workload whose experiment has stopped (the suspended shape applied, no trainer pod active) gives its
    quota back."""
    from kuberl.operator.kube import KubeError
    from kuberl.operator.lifecycle import CONFIG, kube
    from kuberl.operator.rules import suspend_applied

    if not (condition(workload, "Evicted") and condition(workload, "QuotaReserved")):
        return
    cache = CONFIG.cache
    job = (cache.job(exp.namespace, naming.trainer_name(exp)) if cache is not None
           else await kube().get("Job", exp.namespace, naming.trainer_name(exp)))
    if suspend_applied(out, job, memo) and not ((job or {}).get("status") or {}).get("active"):
        try:
            await kube().patch("Workload", exp.namespace, workload["metadata"]["name"], released(workload), subresource="status")
        except KubeError as exc:
            if exc.status != 409:
                raise
            log.info("%s/%s: the Workload changed meanwhile; released next tick", exp.namespace, exp.name)


async def report_pods_ready(exp: RLExperiment, workload: Obj | None, built: Obj, now_admitted: bool, memo: Any) -> None:
    """The Workload's PodsReady condition (jobframework's rules, kueue_status.pods_ready_condition), written when it
    changes: with Kueue's waitForPodsReady, an admitted Workload that never says PodsReady is evicted at the timeout."""
    from kuberl.operator.lifecycle import CONFIG, kube

    if workload is None or (not now_admitted and ks.condition_of(workload, "PodsReady") is None):
        return
    from kuberl.operator.observe import sandbox_pods

    cache = CONFIG.cache
    pods = (cache.pods(exp.namespace, exp.name) if cache is not None
            else await kube().list("Pod", exp.namespace, label_selector=f"{L.EXPERIMENT_LABEL}={exp.name}"))
    pods = [*pods, *await sandbox_pods(exp)]  # the sandbox PodSet's pods carry kuberl.io/sandbox instead
    expected = sum(ps["count"] for ps in built["spec"]["podSets"])
    cond = ks.pods_ready_condition(workload, now_admitted, ks.pods_ready(pods, expected))
    said = (cond["status"], cond["reason"]) if cond else None
    if cond is None or memo.get("kueue_pods_ready") == said:
        return  # already on the Workload, or written moments ago (the watch has not brought it back yet)
    await ks.write_condition(kube(), workload, cond)
    memo["kueue_pods_ready"] = said


async def finish(body: Any, status: dict[str, Any], memo: Any) -> None:
    """A queued experiment at rest after Succeeded or Failed marks its Workload Finished, once: Kueue frees the quota."""
    from kuberl.operator.lifecycle import kube

    labels = (body.get("metadata") or {}).get("labels") or {}
    if not labels.get(QUEUE_LABEL) or memo.get("kueue_finished"):
        return
    ks.PLACEMENT.pop((body["metadata"]["namespace"], body["metadata"]["name"]), None)
    workload = await current_workload(body["metadata"]["namespace"], workload_name(body), memo)
    cond = ks.finished_condition(workload, status.get("phase")) if workload else None
    if cond is not None:
        await ks.api_version(kube())
        await ks.write_condition(kube(), workload, cond)
    memo["kueue_finished"] = workload is not None
