"""Pure rules of the operator's lifecycle: restarts and their backoff, checkpoints, TTL, suspend shapes,
what counts as finished, and the replica count the operator writes into spec.rollout.replicas.

No I/O: kuberl.operator.lifecycle reads the world and calls these (tests/unit/test_handlers.py).
"""

from __future__ import annotations

import base64
import datetime as dt
from typing import Any

from kuberl.api.v1alpha1 import FailurePolicySpec, Phase, RLExperiment
from kuberl.operator import status as st


def parse_time(text: str | None) -> dt.datetime | None:
    if not text:
        return None
    try:
        return dt.datetime.fromisoformat(str(text))
    except ValueError:
        return None


def rfc3339(t: dt.datetime) -> str:
    return t.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def job_condition(job: dict[str, Any] | None, kind: str) -> dict[str, Any] | None:
    """The Job's condition of this type (Complete, Failed, Suspended) when it is True."""
    for cond in ((job or {}).get("status") or {}).get("conditions") or []:
        if cond.get("type") == kind and cond.get("status") == "True":
            return cond
    return None


def restart_due(restarts: int, backoff_seconds: float, failed_at: dt.datetime | None, t: dt.datetime) -> bool:
    """Failure policy: restart n waits backoff * 2**n after the failure (30 s, 60 s, 120 s, ...)."""
    if failed_at is None:
        return True
    return (t - failed_at).total_seconds() >= backoff_seconds * (2 ** restarts)


def restart_trainer(observed: st.ObservedChildren, policy: FailurePolicySpec, t: dt.datetime) -> bool:
    """Whether to re-create the trainer Job now: it failed, restarts are left and their backoff has
    passed; never after a configuration error (exit code 2: the same spec fails the same way)."""
    failed = st.job_failure(observed.trainer)
    if failed is None or observed.configuration_error is not None:
        return False
    restarts = observed.trainer_restarts or 0
    return restarts < policy.max_restarts and restart_due(restarts, policy.backoff_seconds, parse_time(failed.get("lastTransitionTime")), t)


def checkpoint_answered(progress: dict[str, Any] | None, requested_at: float) -> bool:
    """Did the trainer write a checkpoint after we asked (progress.checkpoint.time >= request time)?"""
    ckpt = (progress or {}).get("checkpoint") or {}
    try:
        return float(ckpt.get("time") or 0) >= requested_at
    except (TypeError, ValueError):
        return False


def ttl_expired(spec_ttl: int | None, completion_time: str | None, t: dt.datetime) -> bool:
    done = parse_time(completion_time)
    return spec_ttl is not None and done is not None and (t - done).total_seconds() >= spec_ttl


def phase_event(old: str | None, new: str) -> tuple[str, str] | None:
    """(event type, reason) for a phase transition, None when the phase did not change."""
    if old == new:
        return None
    return ("Warning" if new == Phase.FAILED else "Normal", f"Phase{new}")


def running_copy(exp: RLExperiment) -> RLExperiment:
    """The experiment as if spec.suspend were false: what stays applied until the checkpoint is taken."""
    return exp.model_copy(update={"spec": exp.spec.model_copy(update={"suspend": False})})


def merge_patch_for(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """A merge patch turning `old` status into `new` (top-level keys that disappear become null)."""
    return {**{k: None for k in old if k not in new}, **new}


def decode_secret_value(secret: dict[str, Any] | None, key: str) -> str | None:
    if not secret:
        return None
    if key in (secret.get("data") or {}):
        return base64.b64decode(secret["data"][key]).decode()
    return (secret.get("stringData") or {}).get(key)


def configuration_error_event_due(status: dict[str, Any], message: str, memo: Any) -> bool:
    """Whether the ConfigurationError event is still to be posted: once per message, also across
    operator restarts (the status's Failed condition already carrying it means it was posted)."""
    if memo.get("configuration_error_reported") == message:
        return False
    failed = next((c for c in status.get("conditions") or [] if c.get("type") == "Failed" and c.get("status") == "True"), None)
    return not (failed and failed.get("reason") == st.CONFIGURATION_ERROR and failed.get("message") == message)


def trainer_running(job: dict[str, Any] | None) -> bool:
    """A trainer Job that still has (or will get) pods: not finished, not suspended."""
    if not job or ((job.get("spec") or {}).get("suspend")):
        return False
    return not any(job_condition(job, kind) for kind in ("Complete", "Failed", "FailureTarget"))


def stopped_copy(exp: RLExperiment) -> RLExperiment:
    """The experiment as if spec.suspend were true: its trainer Job built suspended (no pods)."""
    return exp.model_copy(update={"spec": exp.spec.model_copy(update={"suspend": True})})


def suspend_applied(exp: RLExperiment, job: dict[str, Any] | None, memo: Any) -> bool:
    """Whether the suspended shape is (or may be) applied: after the checkpoint, or already in the
    cluster (the live Job is suspended), which also survives an operator restart."""
    return bool(memo.get("suspend_applied") or ((job or {}).get("spec") or {}).get("suspend"))


def finished(status: dict[str, Any], job: dict[str, Any] | None, progress: dict[str, Any] | None) -> bool:
    """Whether the run is over, so no trainer is started and rollout stays at 0: decided from the
    refreshed status (Succeeded, or Failed for a reason other than an invalid spec) and from the
    trainer's own completion (its Job Complete, or the bus `done`). A Failed phase an invalid spec
    left behind is never terminal: fixing the spec starts the run."""
    if job_condition(job, "Complete") or (progress or {}).get("done"):
        return True
    phase = status.get("phase")
    if phase == Phase.SUCCEEDED:
        return True
    if phase != Phase.FAILED:
        return False
    failed = next((c for c in status.get("conditions") or [] if c.get("type") == "Failed" and c.get("status") == "True"), None)
    return not (failed and failed.get("reason") == st.Reason.VALIDATION_FAILED)


# The allocation the operator took spec.rollout.replicas from (so that a later allocation edit moves it).
REPLICAS_FROM_ANNOTATION = "kuberl.io/replicas-from-allocation"


def replicas_to_write(body: Any, exp: RLExperiment) -> tuple[int, dict[str, Any]] | None:
    """(replicas, merge patch) that writes the resolved replica count into spec.rollout.replicas, or None.

    The /scale subresource reads spec.rollout.replicas; unset (an `allocation` or autoscaling default),
    apiextensions reads 0 and an HPA takes 0 as "scaling disabled". So the operator writes the count
    the models resolved, once. When it came from `allocation` and the allocation changes later while
    the count still equals the old shorthand's d, the new d is written (nobody scaled it since).
    """
    spec = dict(body.get("spec") or {})
    annotations = ((body.get("metadata") or {}).get("annotations")) or {}
    explicit = "replicas" in (spec.get("rollout") or {})
    resolved = exp.spec.rollout.replicas
    source = exp.spec.allocation or ""
    written_from = annotations.get(REPLICAS_FROM_ANNOTATION)
    if explicit and not (written_from and exp.spec.allocation and written_from != source):
        return None
    if explicit:  # the allocation changed since the operator wrote its d
        from kuberl.api.allocation import parse_allocation

        try:
            old_d = parse_allocation(written_from).rollout["d"]
        except ValueError:
            return None
        new_d = parse_allocation(source).rollout["d"]
        if resolved != old_d or new_d == old_d:
            return None
        resolved = new_d
    meta = {"annotations": {REPLICAS_FROM_ANNOTATION: source}} if source else {}
    return resolved, {"metadata": meta, "spec": {"rollout": {"replicas": resolved}}} if meta else {"spec": {"rollout": {"replicas": resolved}}}


# Status fields that change with every training step: written at most every status_interval.
PROGRESS_FIELDS = frozenset({"progress", "lastCheckpoint"})


def status_write_due(old: dict[str, Any], new: dict[str, Any], last_write: float | None, now: float, interval: float) -> bool:
    """Whether to patch `new` over `old` now: something changed, and either more than training
    progress changed (phase, conditions, replicas, observedGeneration: at once) or the last write
    (monotonic seconds; None: none yet) is at least `interval` seconds old."""
    if not st.status_changed(old, new):
        return False
    if last_write is None or now - last_write >= interval:
        return True
    rest = {k: v for k, v in new.items() if k not in PROGRESS_FIELDS}
    return st.status_changed({k: v for k, v in old.items() if k not in PROGRESS_FIELDS}, rest)


def at_rest(body: Any, status: dict[str, Any]) -> bool:
    """Whether the monitor has nothing to watch: the spec of the current generation is reconciled and
    the run is over (Succeeded, or Failed for any reason but an invalid spec) or fully suspended (all
    pods stopped). Then no API read, bus read or status write happens until the spec changes."""
    generation = ((body.get("metadata") or {}).get("generation"))
    if generation is None or status.get("observedGeneration") != generation:
        return False
    conditions = {c.get("type"): c for c in status.get("conditions") or [] if isinstance(c, dict)}
    phase = status.get("phase")
    if phase == Phase.SUCCEEDED:
        return True
    if phase == Phase.FAILED:
        return (conditions.get("Failed") or {}).get("reason") != st.Reason.VALIDATION_FAILED
    if phase == Phase.SUSPENDED:
        suspended = conditions.get("Suspended") or {}
        return bool((body.get("spec") or {}).get("suspend")) and suspended.get("status") == "True" and suspended.get("reason") == st.Reason.SUSPENDED
    return False
