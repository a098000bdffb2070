"""The kopf handlers of the RLExperiment operator: thin glue between kopf, the pure builders and the API.

`on_reconcile` (create/resume/spec update) validates, builds the children (kuberl.operator.builders),
adopts and server-side-applies them; the `monitor` timer observes children and bus progress, runs the
lifecycle (suspend with checkpoint, resume, completion, TTL, trainer restarts) and the autoscaler, and
patches status only when it changed. All API calls go through kuberl.operator.kube; bus reads through
kuberl.operator.progress. Loaded by kuberl.operator.main; handler ids are persisted: keep them stable.
"""

from __future__ import annotations

import base64
import datetime as dt
import logging
import os
import secrets
from dataclasses import dataclass, field
from typing import Any

import kopf
from pydantic import ValidationError

from kuberl.api.v1alpha1 import GROUP, PLURAL, VERSION, Phase, RLExperiment, RLExperimentStatus
from kuberl.operator import metrics, naming
from kuberl.operator.kube import KubeClient, KubeError
from kuberl.operator.labels import EventReason
from kuberl.operator.progress import BusReader

RES = (GROUP, VERSION, PLURAL)
log = logging.getLogger("kuberl.operator")


@dataclass
class OperatorConfig:
    """Process-wide knobs (environment variables so tests can shorten them)."""

    interval: float = float(os.environ.get("KUBERL_OPERATOR_INTERVAL", "5"))  # monitor timer period, s
    checkpoint_timeout: float = float(os.environ.get("KUBERL_CHECKPOINT_TIMEOUT", "120"))  # suspend waits this long
    retry_delay: float = float(os.environ.get("KUBERL_OPERATOR_RETRY", "15"))  # recheck of a missing Secret/PVC
    kube: KubeClient | None = None
    bus: BusReader = field(default_factory=BusReader)


CONFIG = OperatorConfig()


def kube() -> KubeClient:
    if CONFIG.kube is None:
        CONFIG.kube = KubeClient.from_environment()
    return CONFIG.kube


# ---------------------------------------------------------------------------------------------
# Pure helpers (unit-tested in tests/unit/test_handlers.py)
# ---------------------------------------------------------------------------------------------


def parse_experiment(body: Any) -> RLExperiment:
    """The RLExperiment model of a kopf body (spec and identity only; status is ours to write)."""
    meta = body.get("metadata") or {}
    manifest = {
        "apiVersion": body.get("apiVersion"), "kind": body.get("kind"),
        "metadata": {"name": meta.get("name"), "namespace": meta.get("namespace") or "default",
                     "labels": dict(meta.get("labels") or {}), "annotations": dict(meta.get("annotations") or {})},
        "spec": dict(body.get("spec") or {}),
    }
    exp = RLExperiment.model_validate(manifest)
    try:  # the last status helps compute_status keep lastTransitionTime; a malformed one is ignored
        exp.status = RLExperimentStatus.model_validate(body.get("status") or {})
    except ValidationError:
        exp.status = None
    return exp


def describe_validation_error(exc: ValidationError) -> str:
    """One line per problem, naming the field path (spec.rollout.replicas: ...) and the bad value."""
    lines = []
    for err in exc.errors():
        path = ".".join(str(p) for p in err.get("loc", ()) if p != "__root__") or "spec"
        value = err.get("input")
        shown = "" if isinstance(value, dict | list) or value is None else f" (got {value!r})"
        lines.append(f"{path}: {err.get('msg', 'invalid')}{shown}")
    return "; ".join(lines)


def parse_time(text: str | None) -> dt.datetime | None:
    if not text:
        return None
    try:
        return dt.datetime.fromisoformat(str(text).replace("Z", "+00:00"))
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


def restart_due(restarts: int, backoff_seconds: float, failed_at: dt.datetime | None, now: dt.datetime) -> bool:
    """Failure policy: restart n waits backoff * 2**n after the failure (30 s, 60 s, 120 s, ...)."""
    if failed_at is None:
        return True
    return (now - failed_at).total_seconds() >= backoff_seconds * (2 ** restarts)


def checkpoint_answered(progress: dict[str, Any] | None, requested_at: float) -> bool:
    """Did the trainer write a checkpoint after we asked (progress.checkpoint.time >= request time)?"""
    ckpt = (progress or {}).get("checkpoint") or {}
    try:
        return float(ckpt.get("time") or 0) >= requested_at
    except (TypeError, ValueError):
        return False


def ttl_expired(spec_ttl: int | None, completion_time: str | None, now: dt.datetime) -> bool:
    done = parse_time(completion_time)
    return spec_ttl is not None and done is not None and (now - done).total_seconds() >= spec_ttl


def phase_event(old: str | None, new: str) -> tuple[str, str] | None:
    """(event type, reason) for a phase transition, None when the phase did not change."""
    if old == new:
        return None
    return ("Warning" if new == Phase.FAILED else "Normal", f"Phase{new}")


def running_copy(exp: RLExperiment) -> RLExperiment:
    """The experiment as if spec.suspend were false: what stays applied until the checkpoint is taken."""
    return exp.model_copy(update={"spec": exp.spec.model_copy(update={"suspend": False})})


def validation_failed_status(old: dict[str, Any], message: str, generation: int | None, at: dt.datetime) -> dict[str, Any]:
    """Status for a spec the models reject: phase Failed, Validated=False/ValidationFailed naming the field."""
    conditions = [c for c in old.get("conditions") or [] if c.get("type") not in ("Validated", "Ready", "Failed")]
    stamp = {"lastTransitionTime": rfc3339(at), "observedGeneration": generation}
    conditions += [
        {"type": "Validated", "status": "False", "reason": "ValidationFailed", "message": message, **stamp},
        {"type": "Ready", "status": "False", "reason": "ValidationFailed", "message": message, **stamp},
        {"type": "Failed", "status": "True", "reason": "ValidationFailed", "message": message, **stamp},
    ]
    return {"phase": Phase.FAILED.value, "conditions": conditions, "observedGeneration": generation}


def merge_patch_for(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """A merge patch turning `old` status into `new` (top-level keys that disappear become null)."""
    return {**{k: None for k in old if k not in new}, **new}


def decode_secret_value(secret: dict[str, Any] | None, key: str) -> str | None:
    if not secret:
        return None
    if key in (secret.get("data") or {}):
        return base64.b64decode(secret["data"][key]).decode()
    return (secret.get("stringData") or {}).get(key)


# ---------------------------------------------------------------------------------------------
# Reading the world (all API calls via kube(), bus via CONFIG.bus)
# ---------------------------------------------------------------------------------------------


async def bus_endpoint(exp: RLExperiment) -> tuple[str, str | None]:
    """URL and token the operator uses to read this experiment's bus KV."""
    ns = exp.namespace
    if exp.spec.bus.external is not None:
        ref = exp.spec.bus.external.credentials_secret
        token = decode_secret_value(await kube().get("Secret", ns, ref.name), ref.key) if ref else None
        return exp.spec.bus.external.url, token
    secret = await kube().get("Secret", ns, naming.bus_secret_name(exp))
    return naming.bus_url(exp), decode_secret_value(secret, "token")


async def bus_token_for_children(exp: RLExperiment) -> str | None:
    """The embedded bus token: the one already in the Secret, else a new random one (generated once)."""
    if exp.spec.bus.external is not None:
        return None
    secret = await kube().get("Secret", exp.namespace, naming.bus_secret_name(exp))
    return decode_secret_value(secret, "token") or secrets.token_urlsafe(32)


async def find_blockers(exp: RLExperiment) -> list[tuple[str, str]]:
    """What the user must fix before pods can start, as (reason, message): Secrets, PVCs, accelerators."""
    from kuberl.api.v1alpha1 import ACCELERATOR_RESOURCE

    ns, out = exp.namespace, []
    secret_refs = [("spec.model.hubTokenSecret", exp.spec.model.hub_token_secret)]
    if exp.spec.bus.external is not None:
        secret_refs.append(("spec.bus.external.credentialsSecret", exp.spec.bus.external.credentials_secret))
    for where, ref in secret_refs:
        if ref is not None:
            missing = await kube().secret_has_key(ns, ref.name, ref.key)
            if missing:
                out.append((EventReason.SECRET_NOT_FOUND.value, f"{where}: {missing}"))
    claims = [("spec.checkpoint.existingClaim", exp.spec.checkpoint.existing_claim),
              ("spec.model.volume.claimName", exp.spec.model.volume.claim_name if exp.spec.model.volume else None),
              ("spec.dataset.volume.claimName", exp.spec.dataset.volume.claim_name if exp.spec.dataset.volume else None)]
    for where, claim in claims:
        if claim and not await kube().pvc_exists(ns, claim):
            out.append((EventReason.CLAIM_NOT_FOUND.value, f'{where}: PersistentVolumeClaim "{claim}" not found in namespace {ns}'))
    for role, spec in (("rollout", exp.spec.rollout), ("trainer", exp.spec.trainer)):
        resource = ACCELERATOR_RESOURCE.get(spec.accelerator.type)
        if resource and spec.accelerator.count > 0:
            per_node = await kube().node_accelerators(resource)
            if max(per_node, default=0) < spec.accelerator.count:
                out.append((EventReason.INSUFFICIENT_ACCELERATORS.value,
                            f"spec.{role}.accelerator.count: {spec.accelerator.count} {resource} per pod, but the most any "
                            f"node has is {max(per_node, default=0)} ({len(per_node)} nodes)"))
    return out


async def event(body: Any, type_: str, reason: str, message: str) -> None:
    await kube().emit_event(dict(body), type_, reason, message)


# ---------------------------------------------------------------------------------------------
# Applying children
# ---------------------------------------------------------------------------------------------


async def apply_child(body: Any, child: dict[str, Any]) -> bool:
    """Adopt and server-side-apply one child; a Job whose immutable template changed is re-created.
    Returns True when the child did not exist before."""
    kopf.adopt(child, owner=dict(body))
    kind, name, ns = child["kind"], child["metadata"]["name"], child["metadata"]["namespace"]
    live = await kube().get(kind, ns, name)
    try:
        await kube().apply(child)
    except KubeError as exc:
        if not (exc.status == 422 and kind == "Job" and live is not None):
            raise
        await recreate_job(body, child, "its pod template changed (immutable in a Job)")
    return live is None


async def recreate_job(body: Any, job: dict[str, Any], why: str) -> None:
    import asyncio

    ns, name = job["metadata"]["namespace"], job["metadata"]["name"]
    await kube().delete("Job", ns, name, propagation="Background")
    for _ in range(120):  # the API removes it promptly; pods go through the garbage collector
        if await kube().get("Job", ns, name) is None:
            break
        await asyncio.sleep(0.5)
    await kube().apply(job)
    await event(body, "Normal", EventReason.RECREATED.value, f"Job {name} re-created: {why}")


async def apply_children(body: Any, exp: RLExperiment, status: dict[str, Any], memo: Any) -> None:
    """Apply every child built from the spec, minding the lifecycle: a suspend waits for the
    checkpoint (the running shape stays applied), a finished experiment keeps rollout at 0."""
    from kuberl.operator.builders import build_children, build_rollout_statefulset

    phase = status.get("phase")
    effective = exp
    if exp.spec.suspend and phase != Phase.SUSPENDED and not memo.get("suspend_applied"):
        effective = running_copy(exp)
    finished = phase in (Phase.SUCCEEDED, Phase.FAILED)
    created = []
    for child in build_children(effective, bus_token=await bus_token_for_children(exp)):
        if finished and child["kind"] == "Job":
            continue  # a finished trainer is not started again
        if finished and child["kind"] == "StatefulSet" and child["metadata"]["name"] == naming.rollout_name(exp):
            child = build_rollout_statefulset(effective, replicas=0)
        if await apply_child(body, child):
            created.append(f"{child['kind']}/{child['metadata']['name']}")
    if created:
        await event(body, "Normal", EventReason.CREATED.value, f"Created {', '.join(created)}")


# ---------------------------------------------------------------------------------------------
# kopf handlers
# ---------------------------------------------------------------------------------------------


@kopf.on.startup(id="kuberl-clients")
async def on_startup(logger: logging.Logger, **_: Any) -> None:
    kube()  # fail at start-up, with a clear message, when no credentials can be found
    logger.info("API at %s; monitor every %.1fs", kube().host, CONFIG.interval)


@kopf.on.cleanup(id="kuberl-cleanup")
async def on_cleanup(**_: Any) -> None:
    await CONFIG.bus.close()
    if CONFIG.kube is not None:
        await CONFIG.kube.close()


async def validated(body: Any, status: dict[str, Any]) -> RLExperiment:
    """The model of the body; an invalid spec sets Validated=False + Failed, posts an event, and stops
    kopf from retrying (PermanentError): a new spec (update) is validated afresh."""
    try:
        return parse_experiment(body)
    except (ValidationError, ValueError) as exc:
        message = describe_validation_error(exc) if isinstance(exc, ValidationError) else str(exc)
        meta = body["metadata"]
        metrics.record_error("reconcile", "ValidationFailed")
        await kube().patch_status("RLExperiment", meta["namespace"], meta["name"],
                                  validation_failed_status(dict(status or {}), message, meta.get("generation"), now()))
        await event(body, "Warning", EventReason.VALIDATION_FAILED.value, message)
        raise kopf.PermanentError(f"invalid spec: {message}") from None


def now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


@kopf.on.resume(*RES, id="reconcile")
@kopf.on.create(*RES, id="reconcile")
@kopf.on.update(*RES, id="reconcile", field="spec")
async def on_reconcile(body: Any, status: Any, memo: Any, logger: logging.Logger, **_: Any) -> None:
    """Validate, check prerequisites, apply children, refresh status."""
    metrics.record_reconcile("reconcile")
    status = dict(status or {})
    exp = await validated(body, status)
    blockers = await find_blockers(exp)
    if blockers:
        await refresh(body, exp, status, memo, blockers=blockers)
        for reason, message in blockers:
            await event(body, "Warning", reason, message)
        metrics.record_error("reconcile", blockers[0][0])
        raise kopf.TemporaryError("; ".join(m for _, m in blockers), delay=CONFIG.retry_delay)
    if not exp.spec.suspend:
        memo.pop("suspend_applied", None)
        memo.pop("ckpt_requested_at", None)
    try:
        await apply_children(body, exp, status, memo)
    except KubeError as exc:
        metrics.record_error("reconcile", exc.reason or str(exc.status))
        await event(body, "Warning", "ApplyFailed", str(exc))
        if exc.status in (400, 422):
            raise kopf.PermanentError(str(exc)) from exc  # the cluster rejects what we built: retrying cannot help
        raise kopf.TemporaryError(str(exc), delay=CONFIG.retry_delay) from exc
    await refresh(body, exp, status, memo)


@kopf.timer(*RES, id="monitor", interval=CONFIG.interval, initial_delay=CONFIG.interval)
async def monitor(body: Any, status: Any, memo: Any, logger: logging.Logger, **_: Any) -> None:
    """Observe children and bus progress; lifecycle, autoscaler, status."""
    metrics.record_reconcile("monitor")
    try:
        exp = parse_experiment(body)
    except (ValidationError, ValueError):
        return  # on_reconcile reported it; nothing runs
    try:
        await refresh(body, exp, dict(status or {}), memo)
    except KubeError as exc:
        metrics.record_error("monitor", exc.reason or str(exc.status))
        logger.warning("monitor: %s", exc)


@kopf.on.delete(*RES, id="forget", optional=True)
async def on_delete(body: Any, **_: Any) -> None:
    """Children go with the ownerReferences; only the metrics forget the experiment."""
    meta = body["metadata"]
    metrics.record_phase(f"{meta['namespace']}/{meta['name']}", None)


# ---------------------------------------------------------------------------------------------
# The monitor: observe, lifecycle, autoscale, status
# ---------------------------------------------------------------------------------------------


async def observe(exp: RLExperiment, blockers: list[tuple[str, str]] | None = None) -> Any:
    """What the API says about the children (O1's ObservedChildren)."""
    from kuberl.operator import status as st

    ns = exp.namespace
    rollout = await kube().get("StatefulSet", ns, naming.rollout_name(exp))
    job = await kube().get("Job", ns, naming.trainer_name(exp))
    bus = None if exp.spec.bus.external is not None else await kube().get("StatefulSet", ns, naming.bus_name(exp))
    problems = await kube().pod_problems(ns, f"kuberl.io/experiment={exp.name}")
    return st.ObservedChildren.from_objects(rollout=rollout, job=job, bus=bus, pod_problems=problems,
                                            blockers=blockers or [])


async def refresh(body: Any, exp: RLExperiment, status: dict[str, Any], memo: Any,
                  blockers: list[tuple[str, str]] | None = None) -> None:
    from kuberl.operator.status import compute_status, status_changed

    t = now()
    ns, name = exp.namespace, exp.name
    observed = await observe(exp, blockers)
    url, token = await bus_endpoint(exp)
    progress = await CONFIG.bus.read(url, token, name)
    owned: dict[str, Any] = {k: status[k] for k in ("restarts", "lastScaleTime", "completionTime", "startTime") if k in status}
    if not blockers:
        owned |= await lifecycle(body, exp, status, memo, observed, progress, url, token, t)
    new = compute_status(exp, observed, progress, t) | owned
    if new.get("phase") in (Phase.SUCCEEDED, Phase.FAILED) and not new.get("completionTime"):
        new["completionTime"] = rfc3339(t)
    if status_changed(status, new):
        await kube().patch_status("RLExperiment", ns, name, merge_patch_for(status, new))
    transition = phase_event(status.get("phase"), new["phase"])
    if transition:
        message = next((c.get("message") for c in new.get("conditions", []) if c.get("type") == "Ready"), "") or new["phase"]
        await event(body, transition[0], transition[1], message)
        if status.get("phase") == Phase.SUSPENDED:
            await event(body, "Normal", EventReason.RESUMED.value, "resumed: the trainer continues from its last checkpoint")
    metrics.record_phase(f"{ns}/{name}", new["phase"])
    await report_pod_problems(body, observed_problems(observed), memo)
    if ttl_expired(exp.spec.ttl_seconds_after_finished, new.get("completionTime"), t):
        await event(body, "Normal", "Deleted", f"ttlSecondsAfterFinished={exp.spec.ttl_seconds_after_finished} passed: deleting")
        await kube().delete("RLExperiment", ns, name)


def observed_problems(observed: Any) -> list[tuple[str, str, str]]:
    return list(getattr(observed, "pod_problems", None) or [])


async def report_pod_problems(body: Any, problems: list[tuple[str, str, str]], memo: Any) -> None:
    """One Warning event per new (pod, reason): image pulls, config errors, crash loops, unschedulable."""
    reported = memo.setdefault("reported_problems", set())
    for pod, reason, message in problems:
        if (pod, reason) not in reported:
            reported.add((pod, reason))
            kind = EventReason.IMAGE_PULL_FAILED.value if reason in ("ImagePullBackOff", "ErrImagePull", "InvalidImageName") else reason
            await event(body, "Warning", kind, f"pod {pod}: {reason}: {message}".strip())


async def lifecycle(body: Any, exp: RLExperiment, status: dict[str, Any], memo: Any, observed: Any,
                    progress: dict[str, Any] | None, url: str, token: str | None, t: dt.datetime) -> dict[str, Any]:
    """Suspend (checkpoint first), completion (rollout to 0), trainer restarts, autoscaling.
    Returns the status fields the operator owns (restarts, lastScaleTime)."""
    import time

    from kuberl.operator.builders import build_rollout_statefulset, build_trainer_job

    ns, name, out = exp.namespace, exp.name, {}
    phase = status.get("phase")
    job = await kube().get("Job", ns, naming.trainer_name(exp))
    # Suspend: ask for a checkpoint, wait (bounded), then apply the suspended shape.
    if exp.spec.suspend and phase != Phase.SUSPENDED and not memo.get("suspend_applied"):
        if "ckpt_requested_at" not in memo:
            memo["ckpt_requested_at"] = time.time()
            memo["ckpt_asked"] = await CONFIG.bus.request_checkpoint(url, token, name, f"suspend-{body['metadata'].get('generation')}")
            await event(body, "Normal", EventReason.CHECKPOINT_REQUESTED.value,
                        "asked the trainer for a checkpoint before suspending" if memo["ckpt_asked"]
                        else "the bus is unreachable: suspending without a fresh checkpoint")
        answered = checkpoint_answered(progress, memo["ckpt_requested_at"])
        trainer_active = bool(((job or {}).get("status") or {}).get("active"))
        waited = time.time() - memo["ckpt_requested_at"]
        if answered or not memo["ckpt_asked"] or not trainer_active or waited > CONFIG.checkpoint_timeout:
            if answered:
                ckpt = progress["checkpoint"]
                await event(body, "Normal", EventReason.CHECKPOINT_SAVED.value, f"checkpoint at step {ckpt.get('step')}: {ckpt.get('path')}")
            elif memo["ckpt_asked"] and trainer_active:
                await event(body, "Warning", EventReason.SUSPENDED.value, f"no checkpoint within {CONFIG.checkpoint_timeout:.0f}s: suspending anyway")
            memo["suspend_applied"] = True
            await apply_children(body, exp, status, memo)
            await event(body, "Normal", EventReason.SUSPENDED.value, "trainer Job suspended, rollout scaled to 0")
        return out
    if exp.spec.suspend:
        return out
    # Completion: the trainer Job is Complete -> nothing left to roll out.
    if job_condition(job, "Complete"):
        rollout = await kube().get("StatefulSet", ns, naming.rollout_name(exp))
        if rollout and (rollout.get("spec") or {}).get("replicas", 0) > 0:
            await apply_child(body, build_rollout_statefulset(exp, replicas=0))
            await event(body, "Normal", EventReason.SUCCEEDED.value, "training complete: rollout scaled to 0")
        return out
    # Failure policy: restart the trainer from its checkpoint, with doubling backoff, up to maxRestarts.
    failed = job_condition(job, "Failed")
    if failed:
        restarts = int(status.get("restarts") or 0)
        policy = exp.spec.failure_policy
        if restarts < policy.max_restarts and restart_due(restarts, policy.backoff_seconds, parse_time(failed.get("lastTransitionTime")), t):
            trainer = build_trainer_job(exp)
            kopf.adopt(trainer, owner=dict(body))
            await recreate_job(body, trainer, f"the trainer failed ({failed.get('reason')}: {failed.get('message', '')}); restart {restarts + 1}/{policy.max_restarts}")
            await event(body, "Warning", EventReason.TRAINER_RESTARTED.value,
                        f"trainer restarted from its last checkpoint ({restarts + 1}/{policy.max_restarts})")
            out["restarts"] = restarts + 1
        elif restarts >= policy.max_restarts and phase != Phase.FAILED:
            await event(body, "Warning", EventReason.FAILED.value, f"the trainer failed after {restarts} restarts (failurePolicy.maxRestarts={policy.max_restarts})")
        return out
    # Autoscaling: only while running, through the /scale subresource (so spec.rollout.replicas stays the truth).
    auto = exp.spec.rollout.autoscaling
    if auto.enabled and phase == Phase.RUNNING and progress:
        from kuberl.operator.autoscaler import ScaleSignals, decide_replicas

        current = exp.spec.rollout.replicas
        decision = decide_replicas(auto, current, ScaleSignals.from_progress(progress, exp), parse_time(status.get("lastScaleTime")), t)
        if decision.replicas != current:
            await kube().patch("RLExperiment", ns, name, {"spec": {"replicas": decision.replicas}}, subresource="scale")
            reason = EventReason.SCALED_UP if decision.replicas > current else EventReason.SCALED_DOWN
            await event(body, "Normal", reason.value, f"rollout replicas {current} -> {decision.replicas}: {decision.message}")
            metrics.record_scale(current, decision.replicas)
            out["lastScaleTime"] = rfc3339(t)
    return out
