"""The operator applying one experiment's children: server-side apply with adoption, pinned and immutable
fields kept from the live objects, a Job re-created when its template changed, the generated bus token
and engine API key kept once made, and the lifecycle's shapes (suspended, finished).

Called by kuberl.operator.lifecycle, the handlers and kuberl.operator.kueue.
"""

from __future__ import annotations

import asyncio
import secrets
from typing import Any

from kuberl.api.v1alpha1 import Phase, RLExperiment
from kuberl.operator import bus_users, naming
from kuberl.operator.builders import build_bus_statefulset, build_children, build_rollout_statefulset, build_sandbox_deployment
from kuberl.operator.builders.immutable import keep_immutable_fields
from kuberl.operator.builders.pinning import keep_pinned
from kuberl.operator.builders.rollout import ENGINE_API_KEY_KEY
from kuberl.operator.context import event, kube
from kuberl.operator.kube import own_child
from kuberl.operator.kueue_status import place_child
from kuberl.operator.labels import EventReason
from kuberl.operator.pins import checkpoint_before_recreate, ensure_pins
from kuberl.operator.rules import decode_secret_value, finished, running_copy, suspend_applied

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
    child = place_child(child)  # on the flavours Kueue admitted it to (kuberl.operator.kueue_status)
    if kind == "Job" and live is not None and being_deleted(live):
        return False  # the old trainer's pods are still terminating: the new Job is created once they are gone
    try:
        await kube().apply(child)
    except KubeError as exc:
        if not (exc.status == 422 and kind == "Job" and live is not None and await only_the_template_is_immutable(exc, child)):
            raise  # a refused edit (a typo, an invalid volume) is reported; the running trainer stays
        why = "its pod template changed (immutable in a Job)"
        await checkpoint_before_recreate(body, live, why)
        await recreate_job(body, child, why)
    return live is None


def being_deleted(obj: dict[str, Any] | None) -> bool:
    return bool(((obj or {}).get("metadata") or {}).get("deletionTimestamp"))


async def only_the_template_is_immutable(exc: Any, job: dict[str, Any]) -> bool:
    """Whether a 422 on a Job apply means only "spec.template is immutable" (re-creating the Job applies the change)
    and not an invalid Job (re-creating would delete a healthy trainer and then fail to create the new one): every
    cause is the immutable template, and a dry-run create of the new Job passes validation and admission (409
    AlreadyExists, its name being taken, comes after both)."""
    from kuberl.operator.kube import KubeError

    causes = list(getattr(exc, "causes", None) or [])
    if not causes or any(not str(c.get("field", "")).startswith("spec.template") or "immutable" not in str(c.get("message", ""))
                         for c in causes):
        return False
    try:
        await kube().create(job, dry_run=True)
    except KubeError as dry:
        return dry.status == 409
    return True  # the name was free after all (deleted meanwhile): the new Job is valid


async def apply_kept(body: Any, child: dict[str, Any], *, own: bool = True) -> tuple[bool, list[str]]:
    """Apply what can change of one child: immutable fields (StatefulSet volumeClaimTemplates, PVC
    accessModes, storageClassName, a smaller size) are kept from the live object and reported.
    The cluster refusing the rest (422 Invalid, 403 e.g. a PVC grow on a non-expandable class, a field its schema
    does not declare: KubeError.refused) is reported too, never raised: the other children still get the spec.
    Returns (created, one message per field or child not applied)."""
    from kuberl.operator.kube import KubeError

    kind, name = child["kind"], child["metadata"]["name"]
    live = await kube().get(kind, child["metadata"].get("namespace"), name)
    kept, notes = keep_immutable_fields(child, live)
    try:
        created = await apply_child(body, kept, own=own, live=live)
    except KubeError as exc:
        if not exc.refused:  # a server fault: kopf retries the reconcile
            raise
        return False, [*notes, f"{kind}/{name}: {exc.message or exc.reason}"]
    return created, notes


RECREATE_WAIT_SECONDS = 30.0
"""How long re-creating the trainer Job waits for the old one's pods; after that the next reconcile creates it."""


async def recreate_job(body: Any, job: dict[str, Any], why: str) -> bool:
    """Delete the trainer Job in the foreground (the Job object stays until each of its pods is gone) and create it
    anew once it is: an old pod, still terminating, must never answer the new rank 0's name (the Service selects the
    Job's pods by name). Returns False when the old pods outlive RECREATE_WAIT_SECONDS: apply_children then creates
    the Job on a later reconcile, once they are gone (the lifecycle leaves a Job being deleted alone)."""
    ns, name = job["metadata"]["namespace"], job["metadata"]["name"]
    await kube().delete("Job", ns, name, propagation="Foreground")
    deadline = asyncio.get_running_loop().time() + RECREATE_WAIT_SECONDS
    while await kube().get("Job", ns, name) is not None:
        if asyncio.get_running_loop().time() > deadline:
            await event(body, "Normal", EventReason.RECREATED.value,
                        f"Job {name} deleted ({why}); it is created again once its pods have terminated")
            return False
        await asyncio.sleep(0.5)
    own_child(job, body)
    await kube().apply(job)
    await event(body, "Normal", EventReason.RECREATED.value, f"Job {name} re-created: {why}")
    return True


async def bus_token_for_children(exp: RLExperiment) -> str | None:
    """The embedded bus token: the one already in the Secret, else a new random one (generated once)."""
    if exp.spec.bus.external is not None:
        return None
    secret = await kube().get("Secret", exp.namespace, naming.bus_secret_name(exp))
    return decode_secret_value(secret, "token") or secrets.token_urlsafe(32)


async def _kept_key(namespace: str, secret_name: str) -> str:
    """The API key already in that Secret, else a new random one: generated once, then kept."""
    secret = await kube().get("Secret", namespace, secret_name)
    return decode_secret_value(secret, ENGINE_API_KEY_KEY) or secrets.token_urlsafe(32)


async def engine_key_for_children(exp: RLExperiment) -> str:
    """The engines' API key (the engine Secret's)."""
    return await _kept_key(exp.namespace, naming.engine_secret_name(exp))


async def episode_key_for_children(exp: RLExperiment) -> str | None:
    """workflow.external: the episode key (the episode Secret's)."""
    return None if exp.spec.workflow.external is None else await _kept_key(exp.namespace, naming.episode_secret_name(exp))


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
    try:
        users = await bus_users.users_for_children(exp)
    except bus_users.BusUsersError as exc:  # a bad signing key: an ApplyFailed condition and event, no users Secret
        users, failures = None, [str(exc)]
    for child in build_children(effective, bus_token=await bus_token_for_children(exp),
                                engine_api_key=await engine_key_for_children(exp), bus_users=users,
                                episode_api_key=await episode_key_for_children(exp)):
        if done and child["kind"] == "Job":
            continue  # a finished trainer is not started again
        if done and child["kind"] == "StatefulSet" and child["metadata"]["name"] == naming.rollout_name(exp):
            child = build_rollout_statefulset(effective, replicas=0)
        if done and child["kind"] == "Deployment" and child["metadata"]["name"] == naming.sandbox_name(exp):
            child = build_sandbox_deployment(effective, stopped=True)  # the tool sandbox follows the rollout
        if done and child["kind"] == "StatefulSet" and child["metadata"]["name"] == naming.bus_name(exp):
            child = build_bus_statefulset(effective, finished="Failed" if status.get("phase") == Phase.FAILED else "Succeeded")
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
