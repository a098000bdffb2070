"""Status of an RLExperiment, computed from what the handlers observed and the trainer's bus progress.

Pure: the kopf handlers (O2) read the children, pods, Secrets, PVCs and node capacity, pass them in as
`ObservedChildren`, patch the dict `compute_status` returns (manifest camelCase) only when
`status_changed` says so, and turn `explain_unrunnable` problems into events. Phases and condition
types come from kuberl.api.v1alpha1; reasons from kuberl.operator.labels.

Configuration errors (contracts.md: a role exits 2 and writes the reason to its termination message)
are read from the trainer Job and the pods by `configuration_error`: the experiment fails at once with
reason ConfigurationError and that message, and the handlers do not restart anything.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from kuberl.api.evaluation import eval_status
from kuberl.api.v1alpha1 import ConditionType, Phase, RLExperiment, RLExperimentStatus
from kuberl.operator.builders.rollout import rollout_replicas
from kuberl.operator.labels import EventReason, Reason, Role, selector_string
from kuberl.operator.observed import (
    CONFIGURATION_ERROR,
    IMAGE_PULL_REASONS,
    ConfigurationFailure,
    ObservedChildren,
    PodProblem,
    Problem,
    _job_condition,
    configuration_error,
    explain_unrunnable,
    job_failure,
    job_pods,
    pending_volume_problem,
    pod_problems,
    referenced_claims,
    referenced_secrets,
)

__all__ = [
    "CONFIGURATION_ERROR",
    "Applied",
    "IMAGE_PULL_REASONS",
    "ConfigurationFailure",
    "EventReason",
    "ObservedChildren",
    "PodProblem",
    "Problem",
    "Reason",
    "compute_status",
    "configuration_error",
    "explain_unrunnable",
    "invalid_status",
    "job_failure",
    "job_pods",
    "pending_volume_problem",
    "pod_problems",
    "referenced_claims",
    "referenced_secrets",
    "status_changed",
]

TERMINAL_PHASES = frozenset({Phase.SUCCEEDED, Phase.FAILED})


@dataclass(frozen=True)
class Applied:
    """What one apply of the children did: the generation applied and one message per field or child
    that the cluster could not take (empty: everything applied)."""

    generation: int | None
    failures: tuple[str, ...] = ()


@dataclass
class _Roles:
    bus: tuple[int, int] = (0, 0)  # (ready, desired)
    rollout: tuple[int, int] = (0, 0)
    rollout_wanted: int = 0  # what the spec asks for (0 when suspended)
    trainer: tuple[int, int] = (0, 0)
    waiting: list[tuple[Reason, str]] = field(default_factory=list)




# --- conditions ---------------------------------------------------------------------------------
def _rfc3339(when: datetime) -> str:
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return when.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _condition(old: Mapping[str, Mapping[str, Any]], type_: ConditionType, true: bool, reason: Reason | str, message: str,
               generation: int | None, now: str) -> dict[str, Any]:
    """A metav1.Condition; lastTransitionTime kept while the status (True/False) stays the same."""
    status = "True" if true else "False"
    prev = old.get(type_.value)
    since = prev.get("lastTransitionTime") if prev and prev.get("status") == status and prev.get("lastTransitionTime") else now
    cond: dict[str, Any] = {"type": type_.value, "status": status, "reason": str(reason), "message": message, "lastTransitionTime": since}
    if generation is not None:
        cond["observedGeneration"] = generation
    return cond


def _restarts(observed: ObservedChildren, old: Mapping[str, Any]) -> int:
    return observed.trainer_restarts if observed.trainer_restarts is not None else _int(old.get("restarts"))


def _generation(exp: RLExperiment) -> int | None:
    gen = (exp.metadata.model_extra or {}).get("generation")
    return int(gen) if gen is not None else None


def _old_status(exp: RLExperiment) -> dict[str, Any]:
    return exp.status.to_manifest() if exp.status is not None else {}


# --- children -----------------------------------------------------------------------------------
def _int(value: Any) -> int:
    try:
        return max(int(value or 0), 0)
    except (TypeError, ValueError):
        return 0


def _roles(exp: RLExperiment, observed: ObservedChildren) -> _Roles:
    roles = _Roles()
    embedded = exp.spec.bus.embedded
    if embedded is not None:
        sts = observed.bus
        desired = _int(sts["spec"].get("replicas")) if sts else (0 if exp.spec.suspend else embedded.replicas)
        ready = _int((sts or {}).get("status", {}).get("readyReplicas"))
        roles.bus = (ready, desired)
        if ready < desired:
            roles.waiting.append((Reason.WAITING_FOR_BUS, f"bus {ready}/{desired} NATS servers ready"))
    sts = observed.rollout
    roles.rollout_wanted = rollout_replicas(exp)
    desired = _int(sts["spec"].get("replicas")) if sts else roles.rollout_wanted
    ready = _int((sts or {}).get("status", {}).get("readyReplicas"))
    roles.rollout = (ready, desired)
    if sts and desired != roles.rollout_wanted:  # e.g. a scale not applied yet: never "ready" at the wrong count
        roles.waiting.append((Reason.WAITING_FOR_ROLLOUT, f"rollout StatefulSet at {desired} replicas, spec.rollout.replicas asks for {roles.rollout_wanted}"))
    if ready < desired:
        roles.waiting.append((Reason.WAITING_FOR_ROLLOUT, f"rollout {ready}/{desired} inference replicas ready"))
    job = observed.trainer
    nodes = exp.spec.trainer.nodes
    if job is not None:
        suspended = bool(job.get("spec", {}).get("suspend"))
        desired = 0 if suspended else _int(job.get("spec", {}).get("parallelism", nodes))
        st = job.get("status") or {}
        ready = _int(st.get("ready", st.get("active")))
    else:
        desired, ready = (0 if exp.spec.suspend else nodes), 0
    roles.trainer = (min(ready, desired), desired)
    if ready < desired:
        roles.waiting.append((Reason.WAITING_FOR_TRAINER, f"trainer {ready}/{desired} pods running"))
    return roles


def _role_status(ready_desired: tuple[int, int]) -> dict[str, Any]:
    ready, desired = ready_desired
    return {"desired": desired, "ready": ready, "readyText": f"{ready}/{desired}"}


# --- progress from the bus ----------------------------------------------------------------------
def _float(value: Any) -> float | None:
    try:
        return None if value is None or isinstance(value, bool) else float(value)
    except (TypeError, ValueError):
        return None


def _time_text(value: Any) -> str | None:
    """The trainer writes epoch seconds; tolerate an RFC 3339 string too."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return _rfc3339(datetime.fromtimestamp(value, UTC))
    return value if isinstance(value, str) and value else None


def _progress(exp: RLExperiment, progress: Mapping[str, Any] | None, old: Mapping[str, Any]) -> dict[str, Any]:
    """status.progress from the bus `progress` key (contracts.md); the old one when the bus said nothing."""
    if progress is None:
        return dict(old.get("progress") or {"step": 0, "epoch": 0, "policyVersion": 0, "droppedStale": 0})
    step = _int(progress.get("step"))
    total = progress.get("total_steps") if progress.get("total_steps") is not None else exp.spec.training.total_steps
    total = _int(total) if total is not None else None
    reward = _float(progress.get("reward_mean"))
    out: dict[str, Any] = {
        "step": step,
        "steps": f"{step}/{total}" if total else str(step),
        "epoch": _int(progress.get("epoch")),
        "policyVersion": _int(progress.get("policy_version")),
        "droppedStale": _int(progress.get("dropped_stale")),
    }
    optional = {
        "totalSteps": total,
        "reward": reward,
        "rewardText": f"{reward:.2f}" if reward is not None else None,
        "samplesPerSecond": _float(progress.get("samples_per_second")),
        "stalenessMean": _float(progress.get("staleness_mean")),
        "stalenessMax": _int(progress["staleness_max"]) if progress.get("staleness_max") is not None else None,
        "failedGroups": _int(progress["failed_groups"]) if progress.get("failed_groups") is not None else None,
        "lastFailure": str(progress["last_failure"])[:500] if progress.get("last_failure") else None,
        "overStale": _int(progress["over_stale"]) if progress.get("over_stale") is not None else None,
        "entropy": _float(progress.get("entropy")),
        "updatedAt": _time_text(progress.get("time")),
        "eval": eval_status(progress.get("eval"), _time_text),  # spec.evaluation's last round
    }
    out.update({k: v for k, v in optional.items() if v is not None and not (isinstance(v, float) and v < 0 and k != "reward")})
    return out


def _last_checkpoint(progress: Mapping[str, Any] | None, old: Mapping[str, Any]) -> dict[str, Any] | None:
    ckpt = (progress or {}).get("checkpoint")
    if isinstance(ckpt, Mapping) and ckpt.get("path"):
        out = {"step": _int(ckpt.get("step")), "policyVersion": _int(ckpt.get("policy_version")), "path": str(ckpt["path"])}
        if _time_text(ckpt.get("time")):
            out["time"] = _time_text(ckpt.get("time"))
        return out
    return old.get("lastCheckpoint")


# --- the phase machine --------------------------------------------------------------------------
@dataclass
class _Verdict:
    phase: Phase
    reason: Reason | str  # reason of Ready (and of Progressing when it is False)
    message: str
    progressing: bool
    degraded: tuple[Reason | str, str] | None = None
    failed: tuple[Reason | str, str] | None = None
    complete: bool = False
    suspended: tuple[Reason, str] | None = None


def _verdict(exp: RLExperiment, observed: ObservedChildren, progress: Mapping[str, Any] | None, old: Mapping[str, Any], roles: _Roles) -> _Verdict:
    """Pending -> Initializing -> Running -> Succeeded | Failed, and Suspended: the first rule that holds wins."""
    problems = explain_unrunnable(exp, observed)
    return (_failed_verdict(exp, observed, progress, old, problems)
            or _finished_verdict(exp, observed, progress, old)
            or _suspended_verdict(exp, observed, roles)
            or _running_verdict(exp, observed, progress, old, roles, problems))


def _failed_verdict(exp: RLExperiment, observed: ObservedChildren, progress: Mapping[str, Any] | None, old: Mapping[str, Any],
                    problems: list[Problem]) -> _Verdict | None:
    """Rules 1-2: failed now (an invalid spec, a configuration error, the trainer failed for good)."""
    job = observed.trainer
    max_restarts = exp.spec.failure_policy.max_restarts
    restarts = _restarts(observed, old)
    job_failed = job_failure(job)
    invalid = [p for p in problems if p.reason == Reason.VALIDATION_FAILED]
    # 1. A spec that cannot be built fails until it is edited.
    if invalid:
        msg = "; ".join(p.message for p in invalid)
        return _Verdict(Phase.FAILED, Reason.VALIDATION_FAILED, msg, False, failed=(Reason.VALIDATION_FAILED, msg))
    # 2. A role stopped on a configuration error (exit code 2): failed now, no restart can help.
    #    Before the trainer's own progress.failed, which says the same less precisely.
    if observed.configuration_error is not None:
        msg = observed.configuration_error.describe()
        return _Verdict(Phase.FAILED, CONFIGURATION_ERROR, msg, False, failed=(CONFIGURATION_ERROR, msg))
    #    The trainer failed for good: its Job failed with every restart used, or it reported a failure after done.
    #    A failure it reports while running exits 1, retryable (contracts.md): rule 8 until its Job has failed.
    reported = (progress or {}).get("failed")
    if reported and (progress or {}).get("done"):
        msg = f"the trainer reported: {reported}"
        return _Verdict(Phase.FAILED, Reason.TRAINER_FAILED, msg, False, failed=(Reason.TRAINER_FAILED, msg))
    if job_failed and restarts >= max_restarts:
        msg = (f"trainer Job failed ({job_failed.get('reason', 'Failed')}: {job_failed.get('message', '')}) "
               f"after {restarts} of failurePolicy.maxRestarts={max_restarts} restarts" + (f"; the trainer reported: {reported}" if reported else ""))
        return _Verdict(Phase.FAILED, Reason.MAX_RESTARTS_EXCEEDED, msg, False, failed=(Reason.MAX_RESTARTS_EXCEEDED, msg))
    return None


def _finished_verdict(exp: RLExperiment, observed: ObservedChildren, progress: Mapping[str, Any] | None, old: Mapping[str, Any]) -> _Verdict | None:
    """Rules 3-4: training finished now, or a finished phase that stays finished."""
    generation = _generation(exp)
    job = observed.trainer
    # 3. Training finished.
    if _job_condition(job, "Complete") or (progress and progress.get("done")):
        return _Verdict(Phase.SUCCEEDED, Reason.TRAINING_COMPLETE, "training finished", False, complete=True)
    # 4. Finished phases stay finished while the spec is unchanged (the pods may be gone by now);
    #    without a known generation they stay finished (the handlers never restart a finished run).
    old_phase = old.get("phase")
    #    A ValidationFailed "Failed" is never kept: the spec is valid now (it parsed), so the run starts.
    failed_cond = next((c for c in old.get("conditions", []) if c.get("type") == ConditionType.FAILED and c.get("status") == "True"), None)
    invalid_before = bool(failed_cond and failed_cond.get("reason") == Reason.VALIDATION_FAILED)
    if old_phase in TERMINAL_PHASES and not invalid_before and (generation is None or old.get("observedGeneration") in (None, generation)):
        if old_phase == Phase.SUCCEEDED:
            return _Verdict(Phase.SUCCEEDED, Reason.TRAINING_COMPLETE, "training finished", False, complete=True)
        kept = failed_cond.get("reason") if failed_cond else None
        reason = CONFIGURATION_ERROR if kept == CONFIGURATION_ERROR else Reason(kept) if kept in Reason._value2member_map_ else Reason.TRAINER_FAILED
        msg = failed_cond.get("message", "") if failed_cond else "the experiment failed"
        return _Verdict(Phase.FAILED, reason, msg, False, failed=(reason, msg))
    return None


def _suspended_verdict(exp: RLExperiment, observed: ObservedChildren, roles: _Roles) -> _Verdict | None:
    """Rule 5: spec.suspend."""
    job = observed.trainer
    # 5. Suspended: Suspending while pods still stop.
    if exp.spec.suspend:
        running = roles.rollout[0] + roles.trainer[0] + roles.bus[0] + _int(((job or {}).get("status") or {}).get("active"))
        if running:
            return _Verdict(Phase.SUSPENDED, Reason.SUSPENDING, f"{running} pods still stopping", False,
                            suspended=(Reason.SUSPENDING, f"{running} pods still stopping"))
        return _Verdict(Phase.SUSPENDED, Reason.SUSPENDED, "spec.suspend is true: all pods stopped, training resumes from the last checkpoint", False,
                        suspended=(Reason.SUSPENDED, "spec.suspend is true"))
    return None


def _running_verdict(exp: RLExperiment, observed: ObservedChildren, progress: Mapping[str, Any] | None, old: Mapping[str, Any], roles: _Roles,
                     problems: list[Problem]) -> _Verdict:
    """Rules 6-9: pending on the user or on children, restarting the trainer, or up (or on the way)."""
    job = observed.trainer
    max_restarts = exp.spec.failure_policy.max_restarts
    restarts = _restarts(observed, old)
    job_failed = job_failure(job)
    started = bool(old.get("startTime"))
    crash = next((p for p in observed.pod_problems if p.reason == "CrashLoopBackOff"), None)
    degraded = (Reason.CRASH_LOOP, f"pod {crash.pod} container {crash.container} keeps crashing: {crash.message}".rstrip(": ")) if crash else None
    # 6. Something only the user can fix.
    fixes = [p for p in problems if p.reason != Reason.UNSCHEDULABLE]
    if fixes:
        first = fixes[0]
        msg = "; ".join(p.message for p in problems)
        return _Verdict(Phase.RUNNING if started else Phase.PENDING, first.reason, msg, False, degraded=(first.reason, msg) if started else degraded)
    # 6b. Pods the scheduler cannot place yet: a cluster autoscaler may add the node (a pool that scales from zero
    #     starts only for pending pods), so this is progress, not Degraded; the scheduler's words and the capacity note.
    if problems:
        msg = "; ".join([*(p.message for p in problems), *(p.message for p in observed.advisories)])
        return _Verdict(Phase.RUNNING if started else Phase.PENDING, Reason.UNSCHEDULABLE, msg, True, degraded=degraded)
    # 7. Children not created yet.
    missing = [k for k, v in (("bus", observed.bus if exp.spec.bus.embedded else True), ("rollout", observed.rollout), ("trainer", job)) if v is None]
    if missing and not started:
        return _Verdict(Phase.PENDING, Reason.CREATING, f"creating {', '.join(missing)}", True)
    # 8. The trainer failed and the handlers restart it: its Job failed, or it reported the failure and is exiting 1
    #    (until the restarted trainer reports again, the last report still names the failure).
    reported = (progress or {}).get("failed")
    if job_failed or reported:
        msg = (f"trainer failed{f' ({reported})' if reported else ''}; restart {restarts + 1} of {max_restarts} from the last checkpoint"
               if job_failed else f"the trainer reported a failure ({reported})")
        return _Verdict(Phase.RUNNING if started else Phase.INITIALIZING, Reason.TRAINER_RESTARTING, msg, True, degraded=(Reason.TRAINER_RESTARTING, msg))
    # 9. Up, or on the way.
    trainer_up = roles.trainer[0] >= roles.trainer[1] or (progress is not None and not progress.get("done"))
    bus_up = roles.bus[0] >= roles.bus[1]
    # Rollout counts as up with one engine serving, or when the spec itself asks for none; a
    # StatefulSet left at 0 while the spec wants engines is not up (nothing generates).
    rollout_up = roles.rollout[0] >= 1 or (roles.rollout_wanted == 0 and roles.rollout[1] == 0)
    # Engines loading a model or pods of a scale-up are normal progress, not Degraded (Argo CD would
    # flip the app to Degraded on every scale); Degraded is for crash loops, restarts and user fixes.
    note = "; ".join(p.message for p in observed.advisories)
    if trainer_up and bus_up and rollout_up:
        short = [msg for reason, msg in roles.waiting if reason != Reason.WAITING_FOR_TRAINER or progress is None]
        if short:
            return _Verdict(Phase.RUNNING, Reason.REPLICAS_NOT_READY, "; ".join([*short, *([note] if note else [])]), True, degraded=degraded)
        return _Verdict(Phase.RUNNING, Reason.TRAINING, "all roles ready", True, degraded=degraded)
    reason, _ = roles.waiting[0] if roles.waiting else (Reason.WAITING_FOR_TRAINER, "")
    msg = "; ".join([*(m for _, m in roles.waiting), *([note] if note else [])]) or "waiting for the trainer's first report"
    return _Verdict(Phase.RUNNING if started else Phase.INITIALIZING, reason, msg, True, degraded=degraded)


def compute_status(exp: RLExperiment, observed: ObservedChildren, progress: Mapping[str, Any] | None, now: datetime,
                   applied: Applied | None = None) -> dict[str, Any]:
    """The whole status (manifest camelCase) for `exp` (its current status is the previous one).

    `progress` is the bus KV `progress` value (contracts.md) or None when it could not be read (then
    the previous progress is kept). Conditions keep their lastTransitionTime while their status holds.
    `applied`: the handlers just applied the children (the generation and what could not be applied);
    only then do observedGeneration and the Reconciled condition move (API conventions: observedGeneration
    says the spec of that generation reached the cluster). None keeps both as they were.
    """
    old = _old_status(exp)
    generation = _generation(exp)
    stamp = _rfc3339(now)
    roles = _roles(exp, observed)
    v = _verdict(exp, observed, progress, old, roles)
    prev = {c["type"]: c for c in old.get("conditions", [])}
    ready = v.phase == Phase.RUNNING and v.degraded is None and v.reason == Reason.TRAINING

    def cond(type_: ConditionType, true: bool, reason: Reason, message: str) -> dict[str, Any]:
        return _condition(prev, type_, true, reason, message, generation, stamp)

    validation = v.failed if v.failed and v.failed[0] == Reason.VALIDATION_FAILED else None
    conditions = [
        cond(ConditionType.READY, ready, v.reason, v.message),
        cond(ConditionType.PROGRESSING, v.progressing, v.reason, v.message),
        cond(ConditionType.DEGRADED, v.degraded is not None, *(v.degraded or (Reason.AS_EXPECTED, ""))),
        cond(ConditionType.SUSPENDED, v.suspended is not None, *(v.suspended or (Reason.NOT_SUSPENDED, ""))),
        cond(ConditionType.COMPLETE, v.complete, Reason.TRAINING_COMPLETE if v.complete else Reason.NOT_COMPLETE, "training finished" if v.complete else ""),
        cond(ConditionType.FAILED, v.failed is not None, *(v.failed or (Reason.NO_FAILURE, ""))),
        cond(ConditionType.VALIDATED, validation is None, *(validation or (Reason.SPEC_VALID, ""))),
    ]
    observed_generation = old.get("observedGeneration")
    if applied is not None:
        failures = "; ".join(applied.failures)
        conditions.append(_condition(prev, ConditionType.RECONCILED, not failures, Reason.APPLY_FAILED if failures else Reason.APPLIED,
                                     failures or f"the spec of generation {applied.generation} is applied", applied.generation, stamp))
        if not failures:
            observed_generation = applied.generation
    elif ConditionType.RECONCILED.value in prev:
        conditions.append(dict(prev[ConditionType.RECONCILED.value]))
    status: dict[str, Any] = {
        "phase": v.phase.value,
        "conditions": conditions,
        "progress": _progress(exp, progress, old),
        "bus": _role_status(roles.bus),
        "rollout": _role_status(roles.rollout),
        "trainer": _role_status(roles.trainer),
        "replicas": _int(((observed.rollout or {}).get("status") or {}).get("replicas")),
        "selector": selector_string(exp, Role.ROLLOUT),
        "restarts": _restarts(observed, old),
    }
    if observed_generation is not None:
        status["observedGeneration"] = observed_generation
    checkpoint = _last_checkpoint(progress, old)
    if checkpoint:
        status["lastCheckpoint"] = checkpoint
    start = old.get("startTime") or (stamp if v.phase == Phase.RUNNING else None)
    if start:
        status["startTime"] = start
    if v.phase in TERMINAL_PHASES:
        status["completionTime"] = old.get("completionTime") if old.get("phase") == v.phase.value and old.get("completionTime") else stamp
    if old.get("lastScaleTime"):
        status["lastScaleTime"] = old["lastScaleTime"]
    # Round-trip through the model: what we patch always fits the CRD's status schema.
    return RLExperimentStatus.model_validate(status).to_manifest()


def invalid_status(old_status: Mapping[str, Any] | None, generation: int | None, errors: Iterable[str], now: datetime) -> dict[str, Any]:
    """Status for a manifest the models reject (no RLExperiment can be built from it): Failed with
    Validated=False, reason ValidationFailed, the errors (each naming its field) as the message."""
    old = dict(old_status or {})
    prev = {c["type"]: c for c in old.get("conditions", []) if isinstance(c, Mapping) and "type" in c}
    stamp = _rfc3339(now)
    msg = "; ".join(errors) or "the spec is invalid"
    failed = (Reason.VALIDATION_FAILED, msg)
    conditions = [
        _condition(prev, ConditionType.READY, False, *failed, generation, stamp),
        _condition(prev, ConditionType.PROGRESSING, False, *failed, generation, stamp),
        _condition(prev, ConditionType.FAILED, True, *failed, generation, stamp),
        _condition(prev, ConditionType.VALIDATED, False, *failed, generation, stamp),
    ]
    status: dict[str, Any] = {"phase": Phase.FAILED.value, "conditions": conditions}
    if generation is not None:
        status["observedGeneration"] = generation
    return status


def _comparable(status: Mapping[str, Any] | None) -> dict[str, Any]:
    out = dict(status or {})
    if isinstance(out.get("conditions"), list):
        out["conditions"] = [{k: v for k, v in c.items() if k != "lastTransitionTime"} for c in out["conditions"] if isinstance(c, Mapping)]
    return out


def status_changed(old: Mapping[str, Any] | None, new: Mapping[str, Any]) -> bool:
    """Whether patching `new` over `old` would change anything that matters: fields of `new` only
    (other writers' fields, such as kopf's, are ignored) and not lastTransitionTime alone."""
    a, b = _comparable(old), _comparable(new)
    return any(a.get(key) != value for key, value in b.items())
