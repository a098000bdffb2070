"""The operator's reconcile logic behind the kopf handlers: observe, apply children, lifecycle, status.

Called by kuberl.operator.handlers (which only parses, filters and maps errors). It reads the world
through kuberl.operator.observe (kube and progress underneath), applies children through
kuberl.operator.apply, decides with O1's pure code (builders, status, autoscaler), and writes back:
status only when it changed, events for every phase transition, problem and lifecycle action. Small
rules are pure functions in kuberl.operator.rules (tests/unit/test_handlers.py); process-wide settings
are kuberl.operator.context.CONFIG; per-experiment state lives in kopf's per-object `memo`. The names
of those modules that the handlers and tests use are re-exported here.
"""

from __future__ import annotations

import datetime as dt
import logging
import time
from dataclasses import dataclass, replace
from typing import Any

from kuberl.api.v1alpha1 import Phase, RLExperiment
from kuberl.env import env_seconds  # noqa: F401  (re-exported: tests use it from here)
from kuberl.operator import metrics, naming
from kuberl.operator import status as st
from kuberl.operator.apply import (  # noqa: F401  (re-exported: the handlers, kueue and tests use them from here)
    apply_child,
    apply_children,
    apply_kept,
    being_deleted,
    bus_token_for_children,
    engine_key_for_children,
    recreate_job,
)
from kuberl.operator.builders import build_bus_statefulset, build_rollout_statefulset, build_sandbox_deployment, build_trainer_job
from kuberl.operator.builders.sandbox import sandbox_in_pods
from kuberl.operator.context import CONFIG, OperatorConfig, env_count, event, kube, now  # noqa: F401  (re-exported)
from kuberl.operator.labels import EventReason
from kuberl.operator.observe import (  # noqa: F401  (re-exported: pins and tests use them from here)
    BLOCKING,
    blockers,
    bus_endpoint,
    capacity_notes,
    children,
    current_nodes,
    namespace_not_permitted,
    observe,
    prerequisites,
)
from kuberl.operator.rules import (  # noqa: F401  (re-exported: the handlers and tests use them from here)
    REPLICAS_FROM_ANNOTATION,
    checkpoint_answered,
    configuration_error_event_due,
    decode_secret_value,
    finished,
    job_condition,
    merge_patch_for,
    parse_time,
    phase_event,
    replicas_to_write,
    restart_due,
    restart_trainer,
    rfc3339,
    running_copy,
    status_write_due,
    stopped_copy,
    suspend_applied,
    trainer_running,
    ttl_expired,
)

log = logging.getLogger("kuberl.operator")


# ---------------------------------------------------------------------------------------------
# The monitor: lifecycle, autoscaler, status
# ---------------------------------------------------------------------------------------------


@dataclass
class Refreshed:
    blocking: list[st.Problem]  # problems that keep the operator from creating pods
    status: dict[str, Any]  # the status as it now is (what refresh patched over the old one)
    progress: dict[str, Any] | None  # the bus progress read (None: unreachable)


def latest_status(status: Any, memo: Any) -> dict[str, Any]:
    """The freshest status known: the one this operator last wrote (memo), else the body's. A handler's
    `status` is a snapshot from when kopf called it; a write computed over it must never put back an
    older observedGeneration or Reconciled condition that another handler has moved on since."""
    written = memo.get("status") if memo is not None else None
    return dict(written) if written is not None else dict(status or {})


def status_model(status: dict[str, Any]) -> Any:
    from pydantic import ValidationError

    from kuberl.api.v1alpha1 import RLExperimentStatus

    try:
        return RLExperimentStatus.model_validate(status)
    except ValidationError:
        return None


async def write_status(exp: RLExperiment, old: dict[str, Any], new: dict[str, Any], memo: Any, *, force: bool = False) -> bool:
    """Patch `new` over `old` when status_write_due says so (progress alone: at most every
    CONFIG.status_interval); remember what was written. True when it was written."""
    last = memo.get("status_written_at") if memo is not None else None
    if not (force and st.status_changed(old, new)) and not status_write_due(old, new, last, time.monotonic(), CONFIG.status_interval):
        return False
    await kube().patch_status("RLExperiment", exp.namespace, exp.name, merge_patch_for(old, new))
    metrics.record_status_write()
    if memo is not None:
        memo["status"] = new
        memo["status_written_at"] = time.monotonic()
    return True


def bus_quiet(exp: RLExperiment, observed: st.ObservedChildren, memo: Any) -> bool:
    """No bus read: a suspended experiment whose suspended shape is applied (its bus is scaled to 0)."""
    return bool(exp.spec.suspend and suspend_applied(exp, dict(observed.trainer) if observed.trainer else None, memo or {}))


async def refresh(body: Any, exp: RLExperiment, status: dict[str, Any], memo: Any, *, act: bool = True,
                  applied: st.Applied | None = None, recheck: bool | None = None) -> Refreshed:
    """Observe, run the lifecycle (when `act`), patch status if it changed, post events.
    `applied`: the children were just applied (observedGeneration and Reconciled move only then).
    `recheck`: read the user's Secrets/PVCs from the API now (default: when not `act`, i.e. a reconcile).
    Returns the problems that block pod creation, the status now (as patched) and the bus progress."""
    t = now()
    ns, name = exp.namespace, exp.name
    status = latest_status(status, memo)
    exp = exp.model_copy(update={"status": status_model(status)})  # compute_status's "old" is the same status
    restarts = int(status.get("restarts") or 0)
    observed = await observe(exp, restarts, memo, recheck=(not act) if recheck is None else recheck)
    blocked = namespace_not_permitted(observed)  # the bus Secret is unreadable there, and no bus runs
    url, token = ("", None) if blocked else await bus_endpoint(exp, memo)
    quiet = blocked or bus_quiet(exp, observed, memo)
    progress = None if quiet else await CONFIG.bus.read(url, token, name, run=naming.bus_run(exp))
    blocking = blockers(exp, observed)
    extra: dict[str, Any] = {}
    if act and not blocking:
        extra, changed = await lifecycle(body, exp, status, memo, observed, progress, url, token, t)
        if changed:  # what we just did (restart, suspend, scale) must show in this status
            again = await observe(exp, int(extra.get("restarts", restarts)), memo, recheck=False)
            # A configuration error stopped the roles: the pods that showed it may already be gone (the StatefulSet
            # controller deletes them at once), and this status must still say Failed (it stays terminal after).
            observed = again if again.configuration_error or not observed.configuration_error else replace(
                again, configuration_error=observed.configuration_error)
    new = st.compute_status(exp, observed, progress, t, applied) | extra
    await write_status(exp, status, new, memo, force=applied is not None)
    transition = phase_event(status.get("phase"), new["phase"])
    if transition:
        message = next((c.get("message") for c in new.get("conditions", []) if c.get("type") == "Ready"), "") or new["phase"]
        await event(body, transition[0], transition[1], message)
        if status.get("phase") == Phase.SUSPENDED and new["phase"] != Phase.SUSPENDED:
            await event(body, "Normal", EventReason.RESUMED.value, "resumed: the trainer continues from its last checkpoint")
    metrics.record_phase(f"{ns}/{name}", new["phase"])
    reported = memo.setdefault("reported_problems", set())
    for problem in [*st.explain_unrunnable(exp, observed), *observed.advisories]:
        if (problem.reason, problem.message) not in reported:
            reported.add((problem.reason, problem.message))
            await event(body, "Warning", str(problem.reason), problem.message)
    if ttl_expired(exp.spec.ttl_seconds_after_finished, new.get("completionTime"), t):
        await event(body, "Normal", "Deleted", f"ttlSecondsAfterFinished={exp.spec.ttl_seconds_after_finished} passed: deleting")
        await kube().delete("RLExperiment", ns, name)
    return Refreshed(blocking, new, progress)


async def lifecycle(body: Any, exp: RLExperiment, status: dict[str, Any], memo: Any, observed: st.ObservedChildren,
                    progress: dict[str, Any] | None, url: str, token: str | None, t: dt.datetime) -> tuple[dict[str, Any], bool]:
    """Suspend (checkpoint first), completion (rollout to 0), trainer restarts, autoscaling.
    Returns (status fields the operator owns, whether children changed)."""
    job = dict(observed.trainer) if observed.trainer else None
    if exp.spec.suspend:
        return {}, await suspend(body, exp, status, memo, job, progress, url, token)
    memo.pop("suspend_applied", None)
    memo.pop("ckpt_requested_at", None)
    if observed.configuration_error is not None:  # before restarts: exit code 2 is never restarted
        return await stop_on_configuration_error(body, exp, status, memo, observed)
    if job_condition(job, "Complete") or (progress or {}).get("done"):
        scaled = await scale_rollout_to_zero(body, exp, observed, EventReason.SUCCEEDED, "training complete: rollout scaled to 0")
        if scaled:
            await note_retained_checkpoints(body, exp)
        return {}, await release_bus(body, exp, observed, "Succeeded") or scaled
    if being_deleted(job):
        return {}, False  # being re-created: its pods are terminating; the new Job comes after them (below)
    if job is None and observed.rollout is not None and not finished(status, job, progress):
        # A re-created trainer whose old pods outlived recreate_job's wait (or a Job deleted by hand): its old pods
        # are gone now, so the Job is created again, in the shape the lifecycle asks (suspended, gated by Kueue...).
        await apply_children(body, exp, status, memo, progress)
        return {}, True
    failed = st.job_failure(job)
    if failed:
        restarts, policy = observed.trainer_restarts or 0, exp.spec.failure_policy
        if restart_trainer(observed, policy, t):
            why = f"the trainer failed ({failed.get('reason')}); restart {restarts + 1}/{policy.max_restarts} from the last checkpoint"
            await recreate_job(body, build_trainer_job(exp), why)
            await event(body, "Warning", EventReason.TRAINER_RESTARTED.value, why)
            return {"restarts": restarts + 1}, True
        if restarts >= policy.max_restarts:  # failed for good: free the engines' accelerators
            scaled = await scale_rollout_to_zero(body, exp, observed, EventReason.STOPPED, f"the trainer failed and failurePolicy.maxRestarts "
                                                 f"({policy.max_restarts}) is used up: rollout scaled to 0")
            return {}, await release_bus(body, exp, observed, "Failed") or scaled
        return {}, False
    return await autoscale(body, exp, status, progress, t)


async def scale_rollout_to_zero(body: Any, exp: RLExperiment, observed: st.ObservedChildren,
                                reason: EventReason | None = None, why: str = "") -> bool:
    """Rollout to 0 replicas (the StatefulSet stays, as for any finished experiment), and the tool sandbox's Deployment
    with it (workflow.sandbox.placement pod), with a Normal event `reason` saying why; True if it changed."""
    rollout = observed.rollout
    if not rollout or not ((rollout.get("spec") or {}).get("replicas") or 0):
        return False
    await apply_child(body, build_rollout_statefulset(exp, replicas=0))
    if sandbox_in_pods(exp):
        await apply_child(body, build_sandbox_deployment(exp, stopped=True))
    if reason is not None:
        await event(body, "Normal", reason.value, why)
    return True


async def release_bus(body: Any, exp: RLExperiment, observed: st.ObservedChildren, outcome: str) -> bool:
    """The experiment is over (`outcome` Succeeded or Failed): its embedded bus servers stop, and after a success
    (bus.embedded.afterSuccess Delete) their JetStream volumes go too (build_bus_statefulset), so a finished
    experiment holds no bus pod and, once it succeeded, no 10Gi volume. A Normal event says which. True if it changed."""
    bus = observed.bus
    if exp.spec.bus.external is not None or not bus:
        return False
    want = build_bus_statefulset(exp, finished=outcome)
    spec = bus.get("spec") or {}
    if (spec.get("replicas") == want["spec"]["replicas"]
            and spec.get("persistentVolumeClaimRetentionPolicy") == want["spec"]["persistentVolumeClaimRetentionPolicy"]):
        return False
    await apply_child(body, want)
    if want["spec"]["replicas"]:
        return True  # afterSuccess Keep: the servers stay
    volumes = ("and their JetStream volumes are deleted (bus.embedded.afterSuccess Delete)" if outcome == "Succeeded"
               else "(their JetStream volumes stay until the experiment is deleted)")
    await event(body, "Normal", EventReason.BUS_STOPPED.value, f"the experiment {outcome.lower()}: the bus servers stopped {volumes}")
    return True


async def note_retained_checkpoints(body: Any, exp: RLExperiment) -> None:
    """Say, once the run is over, that the checkpoint volume the operator made outlives the experiment and bills until
    someone deletes it (checkpoint.retainPolicy Retain, the default; a Filestore or EFS volume bills by its size)."""
    ckpt = exp.spec.checkpoint
    if ckpt.retain_policy != "Retain" or ckpt.existing_claim is not None:
        return
    pvc = naming.checkpoint_pvc_name(exp)
    await event(body, "Normal", EventReason.CHECKPOINT_RETAINED.value,
                f"the checkpoint volume {pvc} ({ckpt.size}) outlives this experiment (checkpoint.retainPolicy Retain) and is billed "
                f"until deleted: kubectl delete pvc {pvc} -n {exp.namespace}")


async def stop_on_configuration_error(body: Any, exp: RLExperiment, status: dict[str, Any], memo: Any,
                                      observed: st.ObservedChildren) -> tuple[dict[str, Any], bool]:
    """A role exited 2: the status goes Failed (compute_status); post the reason once as a Warning
    event, restart nothing, and release the accelerators the experiment still holds.

    Rollout goes to 0 rather than staying in CrashLoopBackOff: an engine or agent that exits 2 exits
    2 on every restart, and each crash-looping pod keeps its GPUs (and a trainer Job that failed on its
    configuration leaves the engines idle forever). The reason survives the pods: it is in the
    condition and the event; the StatefulSet stays (at 0, as for any finished experiment, which
    apply_children keeps at 0). A trainer that still runs (the error was the rollout's) would wait for
    trajectories forever: its Job is suspended (the trainer checkpoints on SIGTERM), not deleted, so
    the Job stays to be described. A trainer Job that failed by the podFailurePolicy has no pods left.
    """
    failure = observed.configuration_error
    assert failure is not None
    message = failure.describe()
    if configuration_error_event_due(status, message, memo):
        await event(body, "Warning", EventReason.CONFIGURATION_ERROR.value, message)
        memo["configuration_error_reported"] = message
    changed = await scale_rollout_to_zero(body, exp, observed)  # one event for both changes, below
    changed = await release_bus(body, exp, observed, "Failed") or changed
    job = dict(observed.trainer) if observed.trainer else None
    if failure.role != "trainer" and trainer_running(job):  # a failing trainer Job ends by itself (FailJob)
        await apply_child(body, build_trainer_job(stopped_copy(exp)))
        changed = True
    if changed:
        await event(body, "Normal", EventReason.STOPPED.value, "configuration error: rollout scaled to 0 and no trainer left running; "
                    "fix the spec, then delete and re-apply the experiment")
    return {}, changed


async def suspend(body: Any, exp: RLExperiment, status: dict[str, Any], memo: Any, job: dict[str, Any] | None,
                  progress: dict[str, Any] | None, url: str, token: str | None) -> bool:
    """Ask the trainer for a checkpoint, wait for it (bounded), then apply the suspended shape."""
    if suspend_applied(exp, job, memo):
        return False
    if "ckpt_requested_at" not in memo:
        memo["ckpt_requested_at"] = time.time()
        memo["ckpt_asked"] = await CONFIG.bus.request_checkpoint(url, token, exp.name, f"suspend-{body['metadata'].get('generation')}",
                                                          run=naming.bus_run(exp))
        await event(body, "Normal", EventReason.CHECKPOINT_REQUESTED.value,
                    "asked the trainer for a checkpoint before suspending" if memo["ckpt_asked"]
                    else "the bus is unreachable: suspending without a fresh checkpoint")
    answered = checkpoint_answered(progress, memo["ckpt_requested_at"])
    trainer_active = bool(((job or {}).get("status") or {}).get("active"))
    waited = time.time() - memo["ckpt_requested_at"]
    if not (answered or not memo["ckpt_asked"] or not trainer_active or waited > CONFIG.checkpoint_timeout):
        return False
    if answered:
        ckpt = (progress or {}).get("checkpoint") or {}
        await event(body, "Normal", EventReason.CHECKPOINT_SAVED.value, f"checkpoint at step {ckpt.get('step')}: {ckpt.get('path')}")
    elif memo["ckpt_asked"] and trainer_active:
        await event(body, "Warning", EventReason.SUSPENDED.value, f"no checkpoint within {CONFIG.checkpoint_timeout:.0f}s: suspending anyway")
    memo["suspend_applied"] = True
    await apply_children(body, exp, status, memo, progress)
    await event(body, "Normal", EventReason.SUSPENDED.value, "trainer Job suspended, rollout scaled to 0")
    return True


async def autoscale(body: Any, exp: RLExperiment, status: dict[str, Any], progress: dict[str, Any] | None,
                    t: dt.datetime) -> tuple[dict[str, Any], bool]:
    """Scale rollout through the /scale subresource (spec.rollout.replicas stays the one truth)."""
    auto = exp.spec.rollout.autoscaling
    if not (auto.enabled and status.get("phase") == Phase.RUNNING and progress):
        return {}, False
    from kuberl.operator.autoscaler import decide_replicas, signals_from_progress

    current = exp.spec.rollout.replicas
    decision = decide_replicas(auto, current, signals_from_progress(exp, progress, t), parse_time(status.get("lastScaleTime")), t)
    if decision.replicas == current:
        return {}, False
    await kube().patch("RLExperiment", exp.namespace, exp.name, {"spec": {"replicas": decision.replicas}}, subresource="scale")
    reason = EventReason.SCALED_UP if decision.replicas > current else EventReason.SCALED_DOWN
    await event(body, "Normal", reason.value, f"rollout replicas {current} -> {decision.replicas}: {decision.message}")
    metrics.record_scale(current, decision.replicas)
    return {"lastScaleTime": rfc3339(t)}, True
