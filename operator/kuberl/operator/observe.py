"""The operator reading the world for one experiment: its bus endpoint, the user's Secrets and PVCs, its
children (from the watch caches or the API) and Node capacity, gathered into O1's ObservedChildren.

Called by kuberl.operator.lifecycle (and kuberl.operator.pins for the bus endpoint); writes nothing but memo.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from kuberl.api.v1alpha1 import RLExperiment
from kuberl.operator import access, bus_users, naming
from kuberl.operator import status as st
from kuberl.operator.builders import build_rollout_statefulset, build_trainer_job, bus_auth
from kuberl.operator.builders.common import accelerator_resource
from kuberl.operator.builders.sandbox import sandbox_in_pods
from kuberl.operator.capacity import capacity_advisories
from kuberl.operator.context import CONFIG, kube
from kuberl.operator.labels import SANDBOX_LABEL, Reason
from kuberl.operator.progress import Credentials
from kuberl.operator.rules import decode_secret_value

log = logging.getLogger("kuberl.operator")

# Problems that keep the operator from creating pods at all (the rest show up once pods exist). Node
# capacity is never one: a scale-from-zero pool starts only for pending pods (kuberl.operator.capacity).
BLOCKING = {Reason.SECRET_NOT_FOUND, Reason.CLAIM_NOT_FOUND, Reason.NAMESPACE_NOT_PERMITTED}




async def bus_endpoint(exp: RLExperiment, memo: Any = None) -> tuple[str, Credentials]:
    """URL and token the operator uses to read this experiment's bus KV; with `memo`, the token read
    from its Secret is kept for CONFIG.token_cache_seconds (no Secret GET per tick)."""
    if memo is None:
        return await _bus_endpoint(exp)
    cached = memo.get("bus_endpoint")
    which = (exp.spec.bus.external.url if exp.spec.bus.external else None, naming.bus_run(exp))
    if cached is not None and cached[0] == which and time.monotonic() - cached[1] < CONFIG.token_cache_seconds:
        return cached[2]
    found = await _bus_endpoint(exp)
    if found[1] is not None:  # not yet readable (the Secret or signing key not created yet): asked again next tick,
        memo["bus_endpoint"] = (which, time.monotonic(), found)  # not left without credentials for the cache's 5 min
    else:
        memo.pop("bus_endpoint", None)
    return found


async def _bus_endpoint(exp: RLExperiment) -> tuple[str, Credentials]:
    if bus_users.minting(exp):  # a shared NATS: the operator's own user of the account (None: no key yet)
        seed = await bus_users.signing_key(exp)
        try:
            return exp.spec.bus.external.url, bus_users.operator_user(exp, seed) if seed else None  # type: ignore[union-attr]
        except bus_users.BusUsersError as exc:  # reported by apply_children (ApplyFailed); progress stays unread
            log.debug("%s", exc)
            return exp.spec.bus.external.url, None  # type: ignore[union-attr]
    if exp.spec.bus.external is not None:
        ref = exp.spec.bus.external.credentials_secret
        token = decode_secret_value(await kube().get("Secret", exp.namespace, ref.name), ref.key) if ref else None
        return exp.spec.bus.external.url, token
    secret = await kube().get("Secret", exp.namespace, naming.bus_secret_name(exp))
    password = decode_secret_value(secret, bus_auth.password_key(bus_auth.OPERATOR))  # absent: a Secret from before bus users
    return naming.bus_url(exp), (bus_auth.OPERATOR, password) if password else decode_secret_value(secret, "token")


async def current_nodes() -> list[dict[str, Any]]:
    """The Nodes: from the operator's Node watch (cache.kuberl_nodes); without one bound (unit tests driving the
    lifecycle), as listed, cached for node_cache_seconds. Only for the advisory capacity note."""
    watched = CONFIG.cache.nodes() if CONFIG.cache is not None else None
    if watched is not None:
        return watched
    if CONFIG.nodes is None or time.monotonic() - CONFIG.nodes[0] > CONFIG.node_cache_seconds:
        CONFIG.nodes = (time.monotonic(), await kube().list("Node"))
    return CONFIG.nodes[1]


def _placement(exp: RLExperiment, memo: Any) -> dict[str, Any]:
    """The rollout and trainer pod specs the capacity note checks, built once per spec and pins (memo): they change
    only when the experiment does, and a GPU experiment's monitor tick used to build both templates every 5 s."""
    key = (exp.metadata.generation, exp.spec.model_dump_json(), tuple(sorted((exp.metadata.annotations or {}).items())))
    cached = memo.get("capacity_pods") if memo is not None else None
    if cached is not None and cached[0] == key:
        return cached[1]
    pods = {"rollout": build_rollout_statefulset(exp)["spec"]["template"]["spec"],
            "trainer": build_trainer_job(exp)["spec"]["template"]["spec"]}
    if memo is not None:
        memo["capacity_pods"] = (key, pods)
    return pods


async def capacity_notes(exp: RLExperiment, memo: Any = None) -> tuple[st.Problem, ...]:
    """Advisory InsufficientAccelerators notes over the pod templates the builders render."""
    if not any(accelerator_resource(a) for a in (exp.spec.rollout.accelerator, exp.spec.trainer.accelerator)):
        return ()
    return tuple(capacity_advisories(exp, _placement(exp, memo), await current_nodes()))


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


async def sandbox_pods(exp: RLExperiment) -> list[dict[str, Any]]:
    """The tool sandbox's pods (workflow.sandbox.placement pod), found by kuberl.io/sandbox (they carry no
    kuberl.io/experiment: the bus and engine NetworkPolicies must not admit them): from the watch cache when bound, else
    listed; none (and nothing read) with placement process."""
    if not sandbox_in_pods(exp):
        return []
    cached = CONFIG.cache.sandbox_pods(exp.namespace, naming.experiment_name(exp)) if CONFIG.cache is not None else None
    if cached is not None:
        return cached
    return await kube().list("Pod", exp.namespace, f"{SANDBOX_LABEL}={naming.experiment_name(exp)}")


async def observe(exp: RLExperiment, restarts: int, memo: Any = None, *, recheck: bool = True) -> st.ObservedChildren:
    """Everything O1's status code needs: children from the watch caches, the user's Secrets/PVCs
    from the API (`recheck`) or as last read (prerequisites). In a namespace where the operator may not write
    (kuberl.operator.access), that is the one blocker, and nothing else is read there (the reads would be refused)."""
    denied = access.needed_by(exp, await access.denied_writes(exp.namespace, recheck=recheck))
    if denied:
        message = access.not_permitted_message(exp.namespace, denied, await access.operator_identity())
        return st.ObservedChildren(blockers=((Reason.NAMESPACE_NOT_PERMITTED.value, message),), trainer_restarts=restarts)
    missing_secrets, missing_keys, missing_claims = await prerequisites(exp, memo, recheck=recheck)
    pods, trainer, bus, rollout = await children(exp)
    # The sandbox's pods fail as the roles' do (an image it cannot pull, a crash loop, no node): the same conditions.
    pod_problems = tuple(p for pod in [*pods, *await sandbox_pods(exp)] for p in st.pod_problems(pod))
    # A volume that cannot bind shows first as pods the scheduler cannot place: only then are the PVCs read.
    unschedulable = any(p.reason == "Unschedulable" for p in pod_problems)
    return st.ObservedChildren(
        bus=bus,
        rollout=rollout,
        trainer=trainer,
        missing_secrets=missing_secrets, missing_secret_keys=missing_keys, missing_claims=missing_claims,
        pending_volumes=await volume_problems(exp) if unschedulable else (),
        pod_problems=pod_problems,
        advisories=await capacity_notes(exp, memo), trainer_restarts=restarts,
        # The trainer's pods carry the experiment label too (the Job's template): one list serves both.
        configuration_error=st.configuration_error(trainer, pods))


async def volume_problems(exp: RLExperiment) -> tuple[str, ...]:
    """Why the checkpoint PVC or the bus's volumes stay Pending (observed.pending_volume_problem); read when pods are
    unschedulable, the StorageClasses only when a PVC is Pending."""
    ns, claims = exp.namespace, []
    if exp.spec.checkpoint.existing_claim is None:
        claims.append(("spec.checkpoint.storageClassName", naming.checkpoint_pvc_name(exp)))
    if exp.spec.bus.external is None:
        claims += [("spec.bus.embedded.storageClassName", f"data-{naming.bus_name(exp)}-{i}") for i in range(exp.spec.bus.embedded.replicas)]
    pending = [(field, pvc) for field, name in claims
               if (pvc := await kube().get("PersistentVolumeClaim", ns, name)) and (pvc.get("status") or {}).get("phase") == "Pending"]
    if not pending:
        return ()
    classes = {c["metadata"]["name"]: c for c in await kube().list("StorageClass")}
    return tuple(m for field, pvc in pending if (m := st.pending_volume_problem(field, pvc, classes)))


def blockers(exp: RLExperiment, observed: st.ObservedChildren) -> list[st.Problem]:
    return [p for p in st.explain_unrunnable(exp, observed) if p.reason in BLOCKING]


def namespace_not_permitted(observed: st.ObservedChildren) -> bool:
    """The operator may not write in the experiment's namespace (observe): its bus Secret is unreadable too."""
    return any(reason == Reason.NAMESPACE_NOT_PERMITTED.value for reason, _ in observed.blockers)
