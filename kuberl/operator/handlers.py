"""The kopf handlers of the RLExperiment operator: thin glue between kopf and kuberl.operator.lifecycle.

`on_reconcile` (create/resume/spec update) validates the spec, refuses to create pods while a Secret,
PVC or accelerator is missing (condition + event + a later retry, never a crash loop), then applies
the children; the `monitor` timer runs the lifecycle, autoscaler and status on every tick. Loaded by
kuberl.operator.main. Handler ids are persisted in annotations by kopf: keep them stable.

No KubeRL finalizer: all state outside the cluster (bus connections, metrics) is the operator's own
and disposable, and children go with their ownerReferences. kopf adds its own finalizer only because
the monitor timer must stop before the object disappears (kopf does this for every timer).
"""

from __future__ import annotations

import logging
from typing import Any

import kopf
from kuberl.operator import metrics
from kuberl.operator import status as st
from kuberl.operator.kube import KubeError
from kuberl.operator.labels import EventReason
from kuberl.operator.lifecycle import CONFIG, apply_children, event, kube, now, refresh
from pydantic import ValidationError

from kuberl.api.v1alpha1 import GROUP, PLURAL, VERSION, RLExperiment, RLExperimentStatus

RES = (GROUP, VERSION, PLURAL)
log = logging.getLogger("kuberl.operator")


def parse_experiment(body: Any) -> RLExperiment:
    """The RLExperiment model of a kopf body; its last status is kept when it is well-formed."""
    meta = body.get("metadata") or {}
    manifest = {
        "apiVersion": body.get("apiVersion"), "kind": body.get("kind"),
        "metadata": {"name": meta.get("name"), "namespace": meta.get("namespace") or "default",
                     "labels": dict(meta.get("labels") or {}), "generation": meta.get("generation")},
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


async def validated(body: Any, status: dict[str, Any]) -> RLExperiment:
    """The model of the body. An invalid spec sets phase Failed with Validated=False/ValidationFailed,
    posts an event, and stops kopf's retries (PermanentError): the next spec edit is validated afresh."""
    try:
        return parse_experiment(body)
    except (ValidationError, ValueError) as exc:
        errors = describe_validation_error(exc) if isinstance(exc, ValidationError) else [str(exc)]
        meta = body["metadata"]
        metrics.record_error("reconcile", "ValidationFailed")
        await kube().patch_status("RLExperiment", meta["namespace"], meta["name"],
                                  st.invalid_status(status, meta.get("generation"), errors, now()))
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
async def on_reconcile(body: Any, status: Any, memo: Any, **_: Any) -> None:
    """Validate, check prerequisites, apply children, refresh status."""
    metrics.record_reconcile("reconcile")
    status = dict(status or {})
    exp = await validated(body, status)
    blocking = await refresh(body, exp, status, memo, act=False)
    if blocking:
        metrics.record_error("reconcile", str(blocking[0].reason))
        raise kopf.TemporaryError("; ".join(p.message for p in blocking), delay=CONFIG.retry_delay)
    try:
        await apply_children(body, exp, status, memo)
    except ValueError as exc:  # a builder refusing this spec: the user must edit it
        await event(body, "Warning", EventReason.VALIDATION_FAILED.value, str(exc))
        raise kopf.PermanentError(str(exc)) from exc
    except KubeError as exc:
        metrics.record_error("reconcile", exc.reason or str(exc.status))
        await event(body, "Warning", "ApplyFailed", str(exc))
        if exc.status in (400, 422):
            raise kopf.PermanentError(str(exc)) from exc  # the cluster rejects what we built: retrying cannot help
        raise kopf.TemporaryError(str(exc), delay=CONFIG.retry_delay) from exc


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
    """Children go with their ownerReferences; only the metrics forget the experiment."""
    meta = body["metadata"]
    metrics.record_phase(f"{meta['namespace']}/{meta['name']}", None)
