"""What the operator observed about one RLExperiment, and what keeps it from running.

`ObservedChildren` is what the handlers read from the API (children, pods, Secrets, PVCs); the pure
functions here turn pods into problems (image pulls, crash loops, unschedulable placement), find
configuration errors (a role exited 2, contracts.md) and explain why a spec cannot run. Used by
kuberl.operator.status (conditions and phase) and kuberl.operator.lifecycle.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kuberl.api.v1alpha1 import RLExperiment
from kuberl.operator.builders.rollout import AGENT_CONTAINER, ENGINE_CONTAINER
from kuberl.operator.builders.trainer import CONFIG_ERROR_EXIT_CODE, TRAINER_CONTAINER
from kuberl.operator.labels import ROLE_LABEL, Reason, Role

# kubelet "waiting" reasons that mean the image cannot be had (never fixes itself without a change).
IMAGE_PULL_REASONS = frozenset({"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull"})
# Reason of the Ready/Failed conditions and of the Warning event when a role exited with
# CONFIG_ERROR_EXIT_CODE: the spec cannot run, and no restart can change that.
CONFIGURATION_ERROR = Reason.CONFIGURATION_ERROR.value
# The Job controller's reason on the Failed condition of a Job that a podFailurePolicy FailJob rule
# ended (the trainer's only such rule is its exit code 2).
POD_FAILURE_POLICY = "PodFailurePolicy"
# Labels the Job controller puts on its pods (current names first, then the legacy ones).
JOB_NAME_LABELS = ("batch.kubernetes.io/job-name", "job-name")
JOB_UID_LABELS = ("batch.kubernetes.io/controller-uid", "controller-uid")


@dataclass(frozen=True)
class PodProblem:
    """Something a pod cannot get past, as the kubelet or the scheduler reported it."""

    pod: str
    reason: str  # kubelet waiting reason (ErrImagePull, CrashLoopBackOff, ...) or "Unschedulable"
    message: str = ""
    container: str | None = None
    image: str | None = None


@dataclass(frozen=True)
class ConfigurationFailure:
    """A role stopped on a configuration error (exit code 2): what the container said, and where."""

    role: str  # "trainer" or "rollout"
    message: str  # the container's termination message (the runtime's one-line reason), or the Job's
    pod: str | None = None
    container: str | None = None

    def describe(self) -> str:
        """The condition and event message: where it happened, then the reason as the role gave it."""
        where = f"the {self.role}" + (f" (pod {self.pod}, container {self.container})" if self.pod else "")
        return f"{where} stopped on a configuration error (exit code {CONFIG_ERROR_EXIT_CODE}): {self.message or 'no reason given'}"


@dataclass(frozen=True)
class ObservedChildren:
    """What the handlers read from the API for one experiment. Objects are passed whole, as read."""

    bus: Mapping[str, Any] | None = None  # the bus StatefulSet (None: not there yet, or external bus)
    rollout: Mapping[str, Any] | None = None  # the rollout StatefulSet
    trainer: Mapping[str, Any] | None = None  # the trainer Job
    missing_secrets: frozenset[str] = frozenset()  # referenced Secrets (referenced_secrets) not found
    missing_secret_keys: frozenset[tuple[str, str]] = frozenset()  # (secret, key) found without that key
    missing_claims: frozenset[str] = frozenset()  # referenced PVCs (referenced_claims) not found
    pending_volumes: tuple[str, ...] = ()  # why PVCs of ours stay Pending (pending_volume_problem), one message each
    pod_problems: tuple[PodProblem, ...] = ()  # from pod_problems() over the experiment's pods
    # Advisory notes that never block pod creation (kuberl.operator.capacity: no current Node offers a
    # role's accelerators; a scale-from-zero pool starts for pending pods): an event and a message.
    advisories: tuple[Problem, ...] = ()
    validation_errors: tuple[str, ...] = ()  # e.g. a builder's ValueError on this spec
    # Problems the handlers found themselves, as (reason, message), e.g. from their own Secret/PVC
    # checks; reasons should be labels.Reason values.
    blockers: tuple[tuple[str, str], ...] = ()
    # How many times the handlers re-created the trainer Job; None = take status.restarts.
    trainer_restarts: int | None = None
    # A role that exited 2 (configuration_error() over the trainer Job and the pods): fail, do not restart.
    configuration_error: ConfigurationFailure | None = None

    @classmethod
    def from_objects(
        cls,
        *,
        rollout: Mapping[str, Any] | None = None,
        job: Mapping[str, Any] | None = None,
        bus: Mapping[str, Any] | None = None,
        pod_problems: Iterable[PodProblem | tuple[str, str, str]] = (),
        blockers: Iterable[tuple[str, str]] = (),
        **more: Any,
    ) -> ObservedChildren:
        """Build from objects as read; pod problems may be (pod, reason, message) tuples."""
        problems = tuple(p if isinstance(p, PodProblem) else PodProblem(*p) for p in pod_problems)
        return cls(bus=bus, rollout=rollout, trainer=job, pod_problems=problems, blockers=tuple(tuple(b) for b in blockers), **more)


@dataclass(frozen=True)
class Problem:
    """Why the experiment cannot run as it stands: a condition reason and a message naming the field."""

    reason: Reason | str  # a Reason; a handler's own CamelCase reason passes through as it is
    message: str


# --- what the spec refers to -------------------------------------------------------------------
def referenced_secrets(exp: RLExperiment) -> list[tuple[str, str, str]]:
    """(field path, Secret name, key) of every Secret the pods need from the user."""
    out = []
    if exp.spec.model.hub_token_secret is not None:
        ref = exp.spec.model.hub_token_secret
        out.append(("spec.model.hubTokenSecret", ref.name, ref.key))
    ext = exp.spec.bus.external
    if ext is not None and ext.credentials_secret is not None:
        out.append(("spec.bus.external.credentialsSecret", ext.credentials_secret.name, ext.credentials_secret.key))
    if ext is not None and ext.account_signing_key_secret is not None:  # read by the operator only, never by a pod
        out.append(("spec.bus.external.accountSigningKeySecret", ext.account_signing_key_secret.name, ext.account_signing_key_secret.key))
    return out


def referenced_claims(exp: RLExperiment) -> list[tuple[str, str]]:
    """(field path, PVC name) of every PVC the user must provide."""
    out = []
    if exp.spec.checkpoint.existing_claim:
        out.append(("spec.checkpoint.existingClaim", exp.spec.checkpoint.existing_claim))
    if exp.spec.model.volume is not None:
        out.append(("spec.model.volume.claimName", exp.spec.model.volume.claim_name))
    if exp.spec.dataset.volume is not None:
        out.append(("spec.dataset.volume.claimName", exp.spec.dataset.volume.claim_name))
    return out


def pod_problems(pod: Mapping[str, Any]) -> list[PodProblem]:
    """Image pull errors, config errors, crash loops and unschedulable placement of one pod (as read)."""
    name = pod.get("metadata", {}).get("name", "?")
    status = pod.get("status") or {}
    out = []
    for cond in status.get("conditions") or []:
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False" and cond.get("reason") == "Unschedulable":
            out.append(PodProblem(name, "Unschedulable", cond.get("message", "")))
    images = {c.get("name"): c.get("image") for c in (pod.get("spec") or {}).get("containers", [])}
    for cs in [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]:
        waiting = (cs.get("state") or {}).get("waiting") or {}
        reason = waiting.get("reason")
        if reason in IMAGE_PULL_REASONS or reason in ("CreateContainerConfigError", "CrashLoopBackOff"):
            out.append(PodProblem(name, reason, waiting.get("message", ""), cs.get("name"), cs.get("image") or images.get(cs.get("name"))))
    return out


# --- configuration errors (exit code 2) ---------------------------------------------------------
def _labels(obj: Mapping[str, Any]) -> Mapping[str, str]:
    return (obj.get("metadata") or {}).get("labels") or {}


def job_pods(job: Mapping[str, Any] | None, pods: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The pods of this Job (not of an earlier Job of the same name), found by the Job's labels: its
    selector's matchLabels (the API server sets the controller uid there), else the job-name label,
    and a pod that carries a controller-uid label must carry this Job's uid."""
    if not job:
        return []
    meta = job.get("metadata") or {}
    uid = meta.get("uid")
    match = dict((((job.get("spec") or {}).get("selector") or {}).get("matchLabels")) or {})
    out = []
    for pod in pods:
        labels = _labels(pod)
        if match:
            mine = all(labels.get(k) == v for k, v in match.items())
        else:
            mine = any(labels.get(k) == meta.get("name") for k in JOB_NAME_LABELS)
        pod_uid = next((labels[k] for k in JOB_UID_LABELS if k in labels), None)
        if mine and (pod_uid is None or uid is None or pod_uid == uid):
            out.append(pod)
    return out


def _terminated_with_config_error(pod: Mapping[str, Any], containers: Iterable[str]) -> tuple[str, str] | None:
    """(container, termination message) of the first of `containers` whose current or last
    termination had exit code 2."""
    wanted = set(containers)
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        if cs.get("name") not in wanted:
            continue
        for key in ("state", "lastState"):
            terminated = (cs.get(key) or {}).get("terminated") or {}
            if terminated.get("exitCode") == CONFIG_ERROR_EXIT_CODE:
                return cs["name"], str(terminated.get("message") or "").strip()
    return None


def configuration_error(trainer: Mapping[str, Any] | None, pods: Iterable[Mapping[str, Any]]) -> ConfigurationFailure | None:
    """The configuration error a role stopped on, from the objects as read; None when there is none.

    Trainer: a pod of the current Job whose trainer container terminated with exit code 2 (message:
    its termination message), or, the pod being gone, the Job's Failed (or FailureTarget) condition
    with reason PodFailurePolicy (message: the Job controller's). Rollout: an engine or agent
    container whose current or last termination had exit code 2 (a StatefulSet has no
    podFailurePolicy: the kubelet would restart it in CrashLoopBackOff forever).
    """
    pods = list(pods)
    for pod in job_pods(trainer, pods):
        found = _terminated_with_config_error(pod, [TRAINER_CONTAINER])
        if found:
            return ConfigurationFailure("trainer", found[1], (pod.get("metadata") or {}).get("name"), found[0])
    for kind in ("Failed", "FailureTarget"):
        cond = _job_condition(trainer, kind)
        if cond and cond.get("reason") == POD_FAILURE_POLICY:
            return ConfigurationFailure("trainer", str(cond.get("message") or ""))
    for pod in pods:
        if _labels(pod).get(ROLE_LABEL) != Role.ROLLOUT.value:
            continue
        found = _terminated_with_config_error(pod, [ENGINE_CONTAINER, AGENT_CONTAINER])
        if found:
            return ConfigurationFailure("rollout", found[1], (pod.get("metadata") or {}).get("name"), found[0])
    return None


# --- unrunnable ---------------------------------------------------------------------------------
def explain_unrunnable(exp: RLExperiment, observed: ObservedChildren) -> list[Problem]:
    """Problems that keep the experiment from running until the user (or an admin) acts.

    Missing Secrets or keys (hub token, external bus credentials), missing PVCs, image pull and
    container config errors and unschedulable pods (accelerator capacity is only advisory:
    ObservedChildren.advisories). Each message names the field and the value; the handlers set it as a condition and an event.
    """
    ns = exp.namespace
    problems = [Problem(Reason.VALIDATION_FAILED, e) for e in observed.validation_errors]
    for reason, message in observed.blockers:
        problems.append(Problem(Reason(reason) if reason in Reason._value2member_map_ else reason, message))
    for path, name, key in referenced_secrets(exp):
        if name in observed.missing_secrets:
            problems.append(Problem(Reason.SECRET_NOT_FOUND, f"{path}: Secret {name!r} not found in namespace {ns!r}"))
        elif (name, key) in observed.missing_secret_keys:
            problems.append(Problem(Reason.SECRET_NOT_FOUND, f"{path}: Secret {name!r} has no key {key!r}"))
    for path, claim in referenced_claims(exp):
        if claim in observed.missing_claims:
            problems.append(Problem(Reason.CLAIM_NOT_FOUND, f"{path}: PersistentVolumeClaim {claim!r} not found in namespace {ns!r}"))
    problems += [Problem(Reason.VOLUME_PENDING, message) for message in observed.pending_volumes]
    for p in observed.pod_problems:
        where = f"pod {p.pod}" + (f" container {p.container}" if p.container else "")
        if p.reason in IMAGE_PULL_REASONS:
            problems.append(Problem(Reason.IMAGE_PULL_FAILED, f"{where}: cannot pull image {p.image!r} ({p.reason}): {p.message}".rstrip(": ")))
        elif p.reason == "CreateContainerConfigError":
            problems.append(Problem(Reason.CONTAINER_CONFIG_ERROR, f"{where}: {p.message}"))
        elif p.reason == "Unschedulable":
            problems.append(Problem(Reason.UNSCHEDULABLE, f"{where}: {p.message}"))
    return problems


DEFAULT_CLASS_ANNOTATION = "storageclass.kubernetes.io/is-default-class"


def pending_volume_problem(field: str, pvc: Mapping[str, Any] | None, classes: Mapping[str, Mapping[str, Any]]) -> str | None:
    """Why a PVC the operator made stays Pending, when the spec or the cluster says so: the StorageClass it names does
    not exist, or it names none and the cluster has no default one (EKS since 1.30 ships none), so nothing will ever
    provision it. None when it is bound, or its class exists (provisioning, or WaitForFirstConsumer binding: the
    scheduler's business, shown by the pods). `classes`: the cluster's StorageClasses by name."""
    if pvc is None or (pvc.get("status") or {}).get("phase") != "Pending":
        return None
    name, wanted = pvc["metadata"]["name"], (pvc.get("spec") or {}).get("storageClassName")
    if wanted:
        if wanted in classes:
            return None
        return (f"{field}: PersistentVolumeClaim {name!r} is Pending: StorageClass {wanted!r} does not exist "
                f"(`kubectl get storageclass` lists the cluster's)")
    if wanted == "" or any((c.get("metadata", {}).get("annotations") or {}).get(DEFAULT_CLASS_ANNOTATION) == "true" for c in classes.values()):
        return None  # "": bound by hand to a pre-made volume; else the default class provisions it
    return (f"{field}: PersistentVolumeClaim {name!r} is Pending: it names no StorageClass and the cluster has no default "
            f"one; set {field} (`kubectl get storageclass` lists the cluster's)")


def _job_condition(job: Mapping[str, Any] | None, type_: str) -> Mapping[str, Any] | None:
    for cond in ((job or {}).get("status") or {}).get("conditions") or []:
        if cond.get("type") == type_ and cond.get("status") == "True":
            return cond
    return None


def job_failure(job: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """The Job's Failed condition, or its FailureTarget: the Job controller has judged it failed and is terminating
    its other pods (Failed follows once they are gone, which a long grace period or a stuck node can delay for
    minutes). Either one is the failure the operator reacts to."""
    return _job_condition(job, "Failed") or _job_condition(job, "FailureTarget")
