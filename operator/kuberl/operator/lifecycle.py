"""The operator's reconcile logic behind the kopf handlers: observe, apply children, lifecycle, status.

Called by kuberl.operator.handlers (which only parses, filters and maps errors). It reads the world
through kuberl.operator.kube and kuberl.operator.progress, decides with O1's pure code (builders,
status, autoscaler), and writes back: children by server-side apply, status only when it changed,
events for every phase transition, problem and lifecycle action. Small rules are pure functions
at the top (tests/unit/test_handlers.py); per-experiment state lives in kopf's per-object `memo`.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import os
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from kuberl.api.v1alpha1 import Phase, RLExperiment
from kuberl.env import env_seconds
from kuberl.operator import metrics, naming
from kuberl.operator import status as st
from kuberl.operator.builders import (
    build_children,
    build_rollout_statefulset,
    build_trainer_job,
    bus_auth,
)
from kuberl.operator.builders.common import accelerator_resource
from kuberl.operator.builders.immutable import keep_immutable_fields
from kuberl.operator.builders.pinning import keep_pinned
from kuberl.operator.builders.rollout import ENGINE_API_KEY_KEY
from kuberl.operator.capacity import capacity_advisories
from kuberl.operator.kube import KubeClient, own_child
from kuberl.operator.labels import EventReason, Reason
from kuberl.operator.pins import checkpoint_before_recreate, ensure_pins
from kuberl.operator.progress import BusReader
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
# Problems that keep the operator from creating pods at all (the rest show up once pods exist). Node
# capacity is never one: a scale-from-zero pool starts only for pending pods (kuberl.operator.capacity).
BLOCKING = {Reason.SECRET_NOT_FOUND, Reason.CLAIM_NOT_FOUND}


def env_count(name: str, default: int) -> int:
    """A positive integer from the environment; anything else is a clear error at start-up."""
    text = os.environ.get(name)
    if text is None or text == "":
        return default
    if not text.strip().isdigit() or int(text) < 1:
        raise ValueError(f"{name} must be a positive integer, got {text!r}")
    return int(text)


@dataclass
class OperatorConfig:
    """Process-wide knobs (environment variables, so tests can shorten them)."""

    interval: float = field(default_factory=lambda: env_seconds("KUBERL_OPERATOR_INTERVAL", 5.0))  # monitor period
    checkpoint_timeout: float = field(default_factory=lambda: env_seconds("KUBERL_CHECKPOINT_TIMEOUT", 120.0))  # suspend waits
    retry_delay: float = field(default_factory=lambda: env_seconds("KUBERL_OPERATOR_RETRY", 15.0))  # recheck of a missing Secret/PVC
    node_cache_seconds: float = 60.0  # Node capacity changes slowly; do not list Nodes every tick
    # A status change that is only training progress is written at most this often per experiment
    # (phase, conditions, replicas and observedGeneration are written at once).
    status_interval: float = field(default_factory=lambda: env_seconds("KUBERL_STATUS_INTERVAL", 30.0))
    prerequisite_interval: float = 60.0  # the monitor re-reads the user's Secrets/PVCs this often (a reconcile always)
    token_cache_seconds: float = 300.0  # the bus token (Secret) is re-read this often
    max_reconciles: int = field(default_factory=lambda: env_count("KUBERL_OPERATOR_MAX_RECONCILES", 16))  # concurrent child applies
    kube: KubeClient | None = None
    bus: BusReader = field(default_factory=BusReader)
    nodes: tuple[float, list[dict[str, Any]]] | None = None
    cache: Any = None  # kuberl.operator.cache.Children once kopf's indexes are bound; None: read the API


CONFIG = OperatorConfig()


def kube() -> KubeClient:
    if CONFIG.kube is None:
        CONFIG.kube = KubeClient.from_environment()
    return CONFIG.kube


def now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


# ---------------------------------------------------------------------------------------------
# Reading the world
# ---------------------------------------------------------------------------------------------


async def bus_endpoint(exp: RLExperiment, memo: Any = None) -> tuple[str, str | None]:
    """URL and token the operator uses to read this experiment's bus KV; with `memo`, the token read
    from its Secret is kept for CONFIG.token_cache_seconds (no Secret GET per tick)."""
    if memo is None:
        return await _bus_endpoint(exp)
    cached = memo.get("bus_endpoint")
    which = (exp.spec.bus.external.url if exp.spec.bus.external else None, naming.bus_run(exp))
    if cached is not None and cached[0] == which and time.monotonic() - cached[1] < CONFIG.token_cache_seconds:
        return cached[2]
    found = await _bus_endpoint(exp)
    memo["bus_endpoint"] = (which, time.monotonic(), found)
    return found


async def _bus_endpoint(exp: RLExperiment) -> tuple[str, str | None]:
    if exp.spec.bus.external is not None:
        ref = exp.spec.bus.external.credentials_secret
        token = decode_secret_value(await kube().get("Secret", exp.namespace, ref.name), ref.key) if ref else None
        return exp.spec.bus.external.url, token
    secret = await kube().get("Secret", exp.namespace, naming.bus_secret_name(exp))
    password = decode_secret_value(secret, bus_auth.password_key(bus_auth.OPERATOR))  # absent: a Secret from before bus users
    return naming.bus_url(exp), (bus_auth.OPERATOR, password) if password else decode_secret_value(secret, "token")


async def current_nodes() -> list[dict[str, Any]]:
    """The Nodes as listed (cached for node_cache_seconds); only for the advisory capacity note."""
    if CONFIG.nodes is None or time.monotonic() - CONFIG.nodes[0] > CONFIG.node_cache_seconds:
        CONFIG.nodes = (time.monotonic(), await kube().list("Node"))
    return CONFIG.nodes[1]


async def capacity_notes(exp: RLExperiment) -> tuple[st.Problem, ...]:
    """Advisory InsufficientAccelerators notes over the pod templates the builders render."""
    if not any(accelerator_resource(a) for a in (exp.spec.rollout.accelerator, exp.spec.trainer.accelerator)):
        return ()
    pods = {"rollout": build_rollout_statefulset(exp)["spec"]["template"]["spec"],
            "trainer": build_trainer_job(exp)["spec"]["template"]["spec"]}
    return tuple(capacity_advisories(exp, pods, await current_nodes()))


async def prerequisites(exp: RLExperiment, memo: Any = None, *, recheck: bool = True) -> tuple[frozenset, frozenset, frozenset]:
    """(missing Secrets, missing (Secret, key)s, missing PVCs) the spec refers to. Read from the API
    when `recheck` or older than CONFIG.prerequisite_interval, else as last read (kept in `memo`)."""
    refs = (tuple(st.referenced_secrets(exp)), tuple(st.referenced_claims(exp)))
    cached = (memo or {}).get("prerequisites")
    if not recheck and cached is not None and cached[0] == refs and time.monotonic() - cached[1] < CONFIG.prerequisite_interval:
        return cached[2]
    ns = exp.namespace
    missing_secrets, missing_keys, missing_claims = set(), set(), set()
    for _, secret_name, key in refs[0]:
        secret = await kube().get("Secret", ns, secret_name)
        if secret is None:
            missing_secrets.add(secret_name)
        elif key not in (secret.get("data") or {}) and key not in (secret.get("stringData") or {}):
            missing_keys.add((secret_name, key))
    for _, claim in refs[1]:
        if not await kube().pvc_exists(ns, claim):
            missing_claims.add(claim)
    found = (frozenset(missing_secrets), frozenset(missing_keys), frozenset(missing_claims))
    if memo is not None:
        memo["prerequisites"] = (refs, time.monotonic(), found)
    return found


async def children(exp: RLExperiment) -> tuple[list[dict[str, Any]], Any, Any, Any]:
    """(pods, trainer Job, bus StatefulSet, rollout StatefulSet): from the watch caches when bound, else the API."""
    ns, name = exp.namespace, exp.name
    external = exp.spec.bus.external is not None
    cache = CONFIG.cache
    if cache is not None:
        return (cache.pods(ns, naming.experiment_name(exp)), cache.job(ns, naming.trainer_name(exp)),
                None if external else cache.statefulset(ns, naming.bus_name(exp)), cache.statefulset(ns, naming.rollout_name(exp)))
    pods = await kube().list("Pod", ns, f"kuberl.io/experiment={name}")
    trainer = await kube().get("Job", ns, naming.trainer_name(exp))
    bus = None if external else await kube().get("StatefulSet", ns, naming.bus_name(exp))
    return pods, trainer, bus, await kube().get("StatefulSet", ns, naming.rollout_name(exp))


async def observe(exp: RLExperiment, restarts: int, memo: Any = None, *, recheck: bool = True) -> st.ObservedChildren:
    """Everything O1's status code needs: children from the watch caches, the user's Secrets/PVCs
    from the API (`recheck`) or as last read (prerequisites)."""
    missing_secrets, missing_keys, missing_claims = await prerequisites(exp, memo, recheck=recheck)
    pods, trainer, bus, rollout = await children(exp)
    return st.ObservedChildren(
        bus=bus,
        rollout=rollout,
        trainer=trainer,
        missing_secrets=missing_secrets, missing_secret_keys=missing_keys, missing_claims=missing_claims,
        pod_problems=tuple(p for pod in pods for p in st.pod_problems(pod)),
        advisories=await capacity_notes(exp), trainer_restarts=restarts,
        # The trainer's pods carry the experiment label too (the Job's template): one list serves both.
        configuration_error=st.configuration_error(trainer, pods))


def blockers(exp: RLExperiment, observed: st.ObservedChildren) -> list[st.Problem]:
    return [p for p in st.explain_unrunnable(exp, observed) if p.reason in BLOCKING]


async def event(body: Any, type_: str, reason: str, message: str) -> None:
    await kube().emit_event(dict(body), type_, reason, message)


# ---------------------------------------------------------------------------------------------
# Applying children
# ---------------------------------------------------------------------------------------------


_UNREAD: Any = object()


async def apply_child(body: Any, child: dict[str, Any], *, own: bool = True, live: Any = _UNREAD) -> bool:
    """Adopt and server-side-apply one child; a Job whose immutable template changed is re-created.
    `own=False` leaves out the ownerReference (a retained checkpoint PVC outlives the experiment).
    Returns True when the child did not exist before; raises KubeError when the cluster refuses it."""
    from kuberl.operator.kube import KubeError

    own_child(child, body)  # ownerReference only, no owner labels (kube.own_child)
    if not own:
        child["metadata"].pop("ownerReferences", None)
    kind, name, ns = child["kind"], child["metadata"]["name"], child["metadata"]["namespace"]
    if live is _UNREAD:
        live = await kube().get(kind, ns, name)
    child = keep_pinned(child, live)  # an operator upgrade alone rolls nothing (builders.pinning)
    try:
        await kube().apply(child)
    except KubeError as exc:
        if not (exc.status == 422 and kind == "Job" and live is not None):
            raise
        why = "its pod template changed (immutable in a Job)"
        await checkpoint_before_recreate(body, live, why)
        await recreate_job(body, child, why)
    return live is None


async def apply_kept(body: Any, child: dict[str, Any], *, own: bool = True) -> tuple[bool, list[str]]:
    """Apply what can change of one child: immutable fields (StatefulSet volumeClaimTemplates, PVC
    accessModes, storageClassName, a smaller size) are kept from the live object and reported.
    The cluster refusing the rest (422 Invalid, 403 e.g. a PVC grow on a non-expandable class)
    is reported too, never raised: the other children still get the spec.
    Returns (created, one message per field or child not applied)."""
    from kuberl.operator.kube import KubeError

    kind, name = child["kind"], child["metadata"]["name"]
    live = await kube().get(kind, child["metadata"].get("namespace"), name)
    kept, notes = keep_immutable_fields(child, live)
    try:
        created = await apply_child(body, kept, own=own, live=live)
    except KubeError as exc:
        if exc.status not in (400, 403, 422):
            raise
        return False, [*notes, f"{kind}/{name}: {exc.message or exc.reason}"]
    return created, notes


async def recreate_job(body: Any, job: dict[str, Any], why: str) -> None:
    ns, name = job["metadata"]["namespace"], job["metadata"]["name"]
    await kube().delete("Job", ns, name, propagation="Background")
    for _ in range(120):  # the API removes it promptly; its pods go through the garbage collector
        if await kube().get("Job", ns, name) is None:
            break
        await asyncio.sleep(0.5)
    own_child(job, body)
    await kube().apply(job)
    await event(body, "Normal", EventReason.RECREATED.value, f"Job {name} re-created: {why}")


async def bus_token_for_children(exp: RLExperiment) -> str | None:
    """The embedded bus token: the one already in the Secret, else a new random one (generated once)."""
    if exp.spec.bus.external is not None:
        return None
    secret = await kube().get("Secret", exp.namespace, naming.bus_secret_name(exp))
    return decode_secret_value(secret, "token") or secrets.token_urlsafe(32)


async def engine_key_for_children(exp: RLExperiment) -> str:
    """The engines' API key: the one already in the engine Secret, else a new random one (generated once)."""
    secret = await kube().get("Secret", exp.namespace, naming.engine_secret_name(exp))
    return decode_secret_value(secret, ENGINE_API_KEY_KEY) or secrets.token_urlsafe(32)


async def apply_children(body: Any, exp: RLExperiment, status: dict[str, Any], memo: Any,
                         progress: dict[str, Any] | None = None) -> list[str]:
    """Apply every child built from the spec, minding the lifecycle: a suspend waits for the
    checkpoint (the running shape stays applied), a finished experiment keeps rollout at 0 (finished:
    from the refreshed `status` and the trainer's completion, never an invalid spec's Failed phase).
    Returns one message per field or child the cluster did not take (empty: all applied)."""
    exp = await ensure_pins(body, exp)  # runtime image and bus run, kept for the experiment's lifetime
    job = await kube().get("Job", exp.namespace, naming.trainer_name(exp))
    effective = exp
    if exp.spec.suspend and not suspend_applied(exp, job, memo) and job is not None:
        effective = running_copy(exp)
    done = finished(status, job, progress)
    retained = exp.spec.checkpoint.retain_policy == "Retain"
    created, failures = [], []
    for child in build_children(effective, bus_token=await bus_token_for_children(exp),
                                engine_api_key=await engine_key_for_children(exp)):
        if done and child["kind"] == "Job":
            continue  # a finished trainer is not started again
        if done and child["kind"] == "StatefulSet" and child["metadata"]["name"] == naming.rollout_name(exp):
            child = build_rollout_statefulset(effective, replicas=0)
        own = not (retained and child["kind"] == "PersistentVolumeClaim" and child["metadata"]["name"] == naming.checkpoint_pvc_name(exp))
        new, notes = await apply_kept(body, child, own=own)
        failures.extend(notes)
        if new:
            created.append(f"{child['kind']}/{child['metadata']['name']}")
    if created:
        await event(body, "Normal", EventReason.CREATED.value, f"Created {', '.join(created)}")
    reported = memo.setdefault("reported_apply_failures", set())
    for message in failures:
        if message not in reported:
            reported.add(message)
            await event(body, "Warning", EventReason.APPLY_FAILED.value, message)
    return failures


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
    url, token = await bus_endpoint(exp, memo)
    quiet = bus_quiet(exp, observed, memo)
    progress = None if quiet else await CONFIG.bus.read(url, token, name, run=naming.bus_run(exp))
    blocking = blockers(exp, observed)
    extra: dict[str, Any] = {}
    if act and not blocking:
        extra, changed = await lifecycle(body, exp, status, memo, observed, progress, url, token, t)
        if changed:  # what we just did (restart, suspend, scale) must show in this status
            observed = await observe(exp, int(extra.get("restarts", restarts)), memo, recheck=False)
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
        return {}, await scale_rollout_to_zero(body, exp, observed, EventReason.SUCCEEDED, "training complete: rollout scaled to 0")
    failed = job_condition(job, "Failed")
    if failed:
        restarts, policy = observed.trainer_restarts or 0, exp.spec.failure_policy
        if restart_trainer(observed, policy, t):
            why = f"the trainer failed ({failed.get('reason')}); restart {restarts + 1}/{policy.max_restarts} from the last checkpoint"
            await recreate_job(body, build_trainer_job(exp), why)
            await event(body, "Warning", EventReason.TRAINER_RESTARTED.value, why)
            return {"restarts": restarts + 1}, True
        if restarts >= policy.max_restarts:  # failed for good: free the engines' accelerators
            return {}, await scale_rollout_to_zero(body, exp, observed, EventReason.STOPPED, f"the trainer failed and failurePolicy.maxRestarts "
                                                   f"({policy.max_restarts}) is used up: rollout scaled to 0")
        return {}, False
    return await autoscale(body, exp, status, progress, t)


async def scale_rollout_to_zero(body: Any, exp: RLExperiment, observed: st.ObservedChildren,
                                reason: EventReason | None = None, why: str = "") -> bool:
    """Rollout to 0 replicas (the StatefulSet stays, as for any finished experiment), with a Normal event
    `reason` saying why; True if it changed."""
    rollout = observed.rollout
    if not rollout or not ((rollout.get("spec") or {}).get("replicas") or 0):
        return False
    await apply_child(body, build_rollout_statefulset(exp, replicas=0))
    if reason is not None:
        await event(body, "Normal", reason.value, why)
    return True


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
