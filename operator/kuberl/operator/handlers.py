"""The kopf handlers of the RLExperiment operator: thin glue between kopf and kuberl.operator.lifecycle.

`on_reconcile` (create/resume/spec update) validates the spec, writes the resolved replica count into
spec.rollout.replicas once (for /scale), refuses to create pods while a Secret or PVC is missing
(condition + event + a later retry, never a crash loop; node capacity never blocks), then applies what
each child can take and reports the rest (Reconciled=False/ApplyFailed); the `monitor` timer runs the
lifecycle, autoscaler and status on every tick. Loaded by
kuberl.operator.main. Handler ids are persisted in annotations by kopf: keep them stable.

No KubeRL finalizer: all state outside the cluster (bus connections, metrics) is the operator's own
and disposable, and children go with their ownerReferences. kopf adds its own finalizer only because
the monitor timer must stop before the object disappears (kopf does this for every timer).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import kopf
from pydantic import ValidationError

from kuberl.api.v1alpha1 import GROUP, PLURAL, VERSION, RLExperiment, RLExperimentStatus
from kuberl.operator import cache, kueue, metrics
from kuberl.operator import status as st
from kuberl.operator.kube import KubeError
from kuberl.operator.labels import EventReason, managed_elsewhere
from kuberl.operator.lifecycle import CONFIG, apply_children, event, kube, latest_status, now, refresh, status_model
from kuberl.operator.pins import ensure_pins
from kuberl.operator.rules import at_rest, replicas_to_write, ttl_expired

RES = (GROUP, VERSION, PLURAL)
log = logging.getLogger("kuberl.operator")


def parse_experiment(body: Any) -> RLExperiment:
    """The RLExperiment model of a kopf body; its last status is kept when it is well-formed."""
    meta = body.get("metadata") or {}
    manifest = {
        "apiVersion": body.get("apiVersion"), "kind": body.get("kind"),
        "metadata": {"name": meta.get("name"), "namespace": meta.get("namespace") or "default",
                     "labels": dict(meta.get("labels") or {}), "generation": meta.get("generation"),
                     # uid and annotations: the pins (runtime image, bus run; builders.pinning)
                     "uid": meta.get("uid"), "annotations": dict(meta.get("annotations") or {})},
        "spec": dict(body.get("spec") or {}),
    }
    exp = RLExperiment.model_validate(manifest)
    try:  # the last status lets compute_status keep lastTransitionTime; a malformed one is ignored
        exp.status = RLExperimentStatus.model_validate(dict(body.get("status") or {}))
    except ValidationError:
        exp.status = None
    return exp


def describe_validation_error(exc: ValidationError) -> list[str]:
    """One message per problem, naming the field path (spec.rollout.replicas: ...) and the bad value."""
    lines = []
    for err in exc.errors():
        path = ".".join(str(p) for p in err.get("loc", ()) if p != "__root__") or "spec"
        value = err.get("input")
        shown = "" if isinstance(value, dict | list) or value is None else f" (got {value!r})"
        lines.append(f"{path}: {err.get('msg', 'invalid')}{shown}")
    return lines


def object_lock(memo: Any) -> asyncio.Lock:
    """One lock per experiment: the reconcile and the monitor timer (kopf runs them as concurrent
    tasks) never interleave their observe/apply/status writes."""
    lock = memo.get("lock")
    if lock is None:
        lock = memo["lock"] = asyncio.Lock()
    return lock


_slots: dict[Any, asyncio.Semaphore] = {}


def reconcile_slots() -> asyncio.Semaphore:
    """At most CONFIG.max_reconciles reconciles apply children at once (per event loop): when the
    operator starts with 1,000 experiments, their ~30 requests each queue here instead of all at once
    in the HTTP pool, where they ran into the 60 s request timeout and kopf's retries (measured
    against the emulated API server the project used then, with bench/bench_operator_scale.py --n 1000)."""
    loop = asyncio.get_running_loop()
    if loop not in _slots:
        _slots.clear()
        _slots[loop] = asyncio.Semaphore(CONFIG.max_reconciles)
    return _slots[loop]


def with_generation(exp: RLExperiment, generation: int) -> RLExperiment:
    meta = exp.metadata.model_copy(update={})
    meta.model_extra["generation"] = generation  # type: ignore[index]
    return exp.model_copy(update={"metadata": meta})


async def validated(body: Any, status: dict[str, Any], memo: Any = None) -> RLExperiment:
    """The model of the body. An invalid spec sets phase Failed with Validated=False/ValidationFailed,
    posts an event, and stops kopf's retries (PermanentError): the next spec edit is validated afresh."""
    try:
        return parse_experiment(body)
    except (ValidationError, ValueError) as exc:
        errors = describe_validation_error(exc) if isinstance(exc, ValidationError) else [str(exc)]
        meta = body["metadata"]
        metrics.record_error("reconcile", "ValidationFailed")
        invalid = st.invalid_status(status, meta.get("generation"), errors, now())
        await kube().patch_status("RLExperiment", meta["namespace"], meta["name"], invalid)
        if memo is not None:  # the freshest status for a monitor tick that started before this write
            memo["status"] = {**status, **invalid}
        await event(body, "Warning", EventReason.VALIDATION_FAILED.value, "; ".join(errors))
        raise kopf.PermanentError(f"invalid spec: {'; '.join(errors)}") from None


@kopf.on.startup(id="kuberl-clients")
async def on_startup(logger: logging.Logger, **_: Any) -> None:
    kube()  # fail at start-up, with a clear message, when no credentials can be found
    logger.info("API at %s; monitor every %.1fs", kube().host, CONFIG.interval)


@kopf.on.cleanup(id="kuberl-cleanup")
async def on_cleanup(**_: Any) -> None:
    await CONFIG.bus.close()
    if CONFIG.kube is not None:
        await CONFIG.kube.close()


@kopf.on.resume(*RES, id="reconcile")
@kopf.on.create(*RES, id="reconcile")
@kopf.on.update(*RES, id="reconcile", field="spec")
async def on_reconcile(body: Any, status: Any, memo: Any, logger: logging.Logger, **kwargs: Any) -> None:
    """Validate, write the resolved replica count, check prerequisites, apply children, refresh status."""
    metrics.record_reconcile("reconcile")
    cache.bind(CONFIG, kwargs)
    if managed_elsewhere(body):  # spec.managedBy: another controller (e.g. MultiKueue) runs it
        logger.info("spec.managedBy is %r: left alone", managed_elsewhere(body))
        return
    async with reconcile_slots(), object_lock(memo):
        await _reconcile(body, latest_status(status, memo), memo, logger)


async def _reconcile(body: Any, status: dict[str, Any], memo: Any, logger: logging.Logger) -> None:
    exp = await ensure_pins(body, await validated(body, status, memo))  # before the first bus read: the run it uses
    exp = await kueue.gate(body, exp, status, memo)  # queued: suspended until admitted
    meta = body["metadata"]
    generation = meta.get("generation")
    write = replicas_to_write(body, exp)
    if write is not None:  # /scale (kubectl scale, an HPA) reads spec.rollout.replicas: never leave it unset
        patched = await kube().patch("RLExperiment", exp.namespace, exp.name, write[1])
        logger.info("spec.rollout.replicas set to the resolved %d (allocation %r)", write[0], exp.spec.allocation)
        generation = _generation_applied(patched, exp, generation)
        exp = with_generation(exp, generation) if generation is not None else exp
    seen = await refresh(body, exp, status, memo, act=False)
    if seen.blocking:
        metrics.record_error("reconcile", str(seen.blocking[0].reason))
        raise kopf.TemporaryError("; ".join(p.message for p in seen.blocking), delay=CONFIG.retry_delay)
    try:  # with the refreshed status: "finished" is never a stale phase (e.g. an invalid spec's Failed)
        failures = await apply_children(body, exp, seen.status, memo, seen.progress)
    except ValueError as exc:  # a builder refusing this spec: the user must edit it
        await event(body, "Warning", EventReason.VALIDATION_FAILED.value, str(exc))
        raise kopf.PermanentError(str(exc)) from exc
    except KubeError as exc:  # apply_children reports what the cluster refuses; this is the API being unwell
        metrics.record_error("reconcile", exc.reason or str(exc.status))
        raise kopf.TemporaryError(str(exc), delay=CONFIG.retry_delay) from exc
    if failures:
        metrics.record_error("reconcile", EventReason.APPLY_FAILED.value)
    # observedGeneration and Reconciled move only now, after the apply (Reconciled=False names what failed).
    exp = exp.model_copy(update={"status": status_model(seen.status)})
    await refresh(body, exp, seen.status, memo, act=False, applied=st.Applied(generation, tuple(failures)), recheck=False)


def _generation_applied(patched: Any, exp: RLExperiment, generation: int | None) -> int | None:
    """The generation whose spec this reconcile applies after its own spec.rollout.replicas write: the
    write bumps metadata.generation, and the spec of that new generation is exactly what is applied
    (the resolved count is already in `exp`), so observedGeneration names it. Were the patched spec
    to differ from `exp` in anything else (a concurrent edit), the old generation is kept: the update
    handler applies the newer one next."""
    new = ((patched or {}).get("metadata") or {}).get("generation")
    if new is None:
        return generation
    try:
        same = parse_experiment(patched).spec == exp.spec
    except (ValidationError, ValueError):
        same = False
    return new if same else generation


@kopf.timer(*RES, id="monitor", interval=CONFIG.interval, initial_delay=CONFIG.interval)
async def monitor(body: Any, status: Any, memo: Any, logger: logging.Logger, **kwargs: Any) -> None:
    """Observe children (watch caches) and bus progress; lifecycle, autoscaler, status. An experiment
    at rest (finished or fully suspended, its spec reconciled) costs no API or bus call."""
    cache.bind(CONFIG, kwargs)
    if managed_elsewhere(body):
        return
    async with object_lock(memo):
        current = latest_status(status, memo)
        if at_rest(body, current):
            await kueue.finish(body, current, memo)  # a queued experiment that finished frees its Kueue quota
            await _expire(body, current, memo)
            return
        metrics.record_reconcile("monitor")
        try:
            exp = parse_experiment(body)
        except (ValidationError, ValueError):
            return  # on_reconcile reported it; nothing runs
        try:
            exp = await kueue.gate(body, exp, current, memo)  # queued: suspended until admitted
            await refresh(body, exp, current, memo)
        except KubeError as exc:
            metrics.record_error("monitor", exc.reason or str(exc.status))
            logger.warning("monitor: %s", exc)


async def _expire(body: Any, status: dict[str, Any], memo: Any) -> None:
    """spec.ttlSecondsAfterFinished of a finished experiment, checked without reading the API."""
    ttl = (body.get("spec") or {}).get("ttlSecondsAfterFinished")
    if memo.get("ttl_deleted") or not ttl_expired(ttl, status.get("completionTime"), now()):
        return
    meta = body["metadata"]
    try:
        await event(body, "Normal", "Deleted", f"ttlSecondsAfterFinished={ttl} passed: deleting")
        await kube().delete("RLExperiment", meta["namespace"], meta["name"])
        memo["ttl_deleted"] = True
    except KubeError as exc:
        metrics.record_error("monitor", exc.reason or str(exc.status))


@kopf.on.delete(*RES, id="forget", optional=True)
async def on_delete(body: Any, **_: Any) -> None:
    """Children go with their ownerReferences; only the metrics forget the experiment."""
    meta = body["metadata"]
    metrics.record_phase(f"{meta['namespace']}/{meta['name']}", None)
