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

from kuberl.operator.builders.common import accelerator_resource
from kuberl.operator.builders.rollout import AGENT_CONTAINER, ENGINE_CONTAINER, rollout_replicas
from kuberl.operator.builders.trainer import CONFIG_ERROR_EXIT_CODE, TRAINER_CONTAINER
from kuberl.operator.labels import ROLE_LABEL, EventReason, Reason, Role, selector_string

from kuberl.api.v1alpha1 import ConditionType, Phase, RLExperiment, RLExperimentStatus

__all__ = [
    "CONFIGURATION_ERROR",
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
    "job_pods",
    "pod_problems",
    "referenced_claims",
    "referenced_secrets",
    "status_changed",
]

# kubelet "waiting" reasons that mean the image cannot be had (never fixes itself without a change).
IMAGE_PULL_REASONS = frozenset({"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull"})
TERMINAL_PHASES = frozenset({Phase.SUCCEEDED, Phase.FAILED})
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
    pod_problems: tuple[PodProblem, ...] = ()  # from pod_problems() over the experiment's pods
    # Largest allocatable amount of each accelerator resource on any one node, e.g.
    # {"nvidia.com/gpu": 8}; None when unknown (then no accelerator check is made).
    accelerators_per_node: Mapping[str, int] | None = None
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


@dataclass
class _Roles:
    bus: tuple[int, int] = (0, 0)  # (ready, desired)
    rollout: tuple[int, int] = (0, 0)
    trainer: tuple[int, int] = (0, 0)
    waiting: list[tuple[Reason, str]] = field(default_factory=list)


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
    container config errors, unschedulable pods, and pods asking for more accelerators than any node
    has. Each message names the field and the value; the handlers set it as a condition and an event.
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
    if observed.accelerators_per_node is not None:
        for path, role, accel in (("spec.rollout.accelerator", "rollout", exp.spec.rollout.accelerator), ("spec.trainer.accelerator", "trainer", exp.spec.trainer.accelerator)):
            resource = accelerator_resource(accel)
            if resource is None:
                continue
            largest = int(observed.accelerators_per_node.get(resource, 0))
            if accel.count > largest:
                problems.append(
                    Problem(
                        Reason.INSUFFICIENT_ACCELERATORS,
                        f"{path}.count: each {role} pod asks for {accel.count} {resource}, but the largest node offers {largest}",
                    )
                )
    for p in observed.pod_problems:
        where = f"pod {p.pod}" + (f" container {p.container}" if p.container else "")
        if p.reason in IMAGE_PULL_REASONS:
            problems.append(Problem(Reason.IMAGE_PULL_FAILED, f"{where}: cannot pull image {p.image!r} ({p.reason}): {p.message}".rstrip(": ")))
        elif p.reason == "CreateContainerConfigError":
            problems.append(Problem(Reason.CONTAINER_CONFIG_ERROR, f"{where}: {p.message}"))
        elif p.reason == "Unschedulable":
            problems.append(Problem(Reason.UNSCHEDULABLE, f"{where}: {p.message}"))
    return problems


# --- conditions ---------------------------------------------------------------------------------
def _rfc3339(when: datetime) -> str:
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return when.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _condition(old: Mapping[str, Mapping[str, Any]], type_: ConditionType, true: bool, reason: Reason | str, message: str, generation: int | None, now: str) -> dict[str, Any]:
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


def _job_condition(job: Mapping[str, Any] | None, type_: str) -> Mapping[str, Any] | None:
    for cond in ((job or {}).get("status") or {}).get("conditions") or []:
        if cond.get("type") == type_ and cond.get("status") == "True":
            return cond
    return None


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
    desired = _int(sts["spec"].get("replicas")) if sts else rollout_replicas(exp)
    ready = _int((sts or {}).get("status", {}).get("readyReplicas"))
    roles.rollout = (ready, desired)
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
        "entropy": _float(progress.get("entropy")),
        "updatedAt": _time_text(progress.get("time")),
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
    generation = _generation(exp)
    job = observed.trainer
    max_restarts = exp.spec.failure_policy.max_restarts
    restarts = _restarts(observed, old)
    job_failed = _job_condition(job, "Failed")
    problems = explain_unrunnable(exp, observed)
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
    #    The trainer failed for good: it said so, or its Job failed with every restart used.
    if progress and progress.get("failed"):
        msg = f"the trainer reported: {progress['failed']}"
        return _Verdict(Phase.FAILED, Reason.TRAINER_FAILED, msg, False, failed=(Reason.TRAINER_FAILED, msg))
    if job_failed and restarts >= max_restarts:
        msg = f"trainer Job failed ({job_failed.get('reason', 'Failed')}: {job_failed.get('message', '')}) after {restarts} of failurePolicy.maxRestarts={max_restarts} restarts"
        return _Verdict(Phase.FAILED, Reason.MAX_RESTARTS_EXCEEDED, msg, False, failed=(Reason.MAX_RESTARTS_EXCEEDED, msg))
    # 3. Training finished.
    if _job_condition(job, "Complete") or (progress and progress.get("done")):
        return _Verdict(Phase.SUCCEEDED, Reason.TRAINING_COMPLETE, "training finished", False, complete=True)
    # 4. Finished phases stay finished while the spec is unchanged (the pods may be gone by now);
    #    without a known generation they stay finished (the handlers never restart a finished run).
    old_phase = old.get("phase")
    if old_phase in TERMINAL_PHASES and (generation is None or old.get("observedGeneration") in (None, generation)):
        failed_cond = next((c for c in old.get("conditions", []) if c.get("type") == ConditionType.FAILED and c.get("status") == "True"), None)
        if old_phase == Phase.SUCCEEDED:
            return _Verdict(Phase.SUCCEEDED, Reason.TRAINING_COMPLETE, "training finished", False, complete=True)
        kept = failed_cond.get("reason") if failed_cond else None
        reason = CONFIGURATION_ERROR if kept == CONFIGURATION_ERROR else Reason(kept) if kept in Reason._value2member_map_ else Reason.TRAINER_FAILED
        msg = failed_cond.get("message", "") if failed_cond else "the experiment failed"
        return _Verdict(Phase.FAILED, reason, msg, False, failed=(reason, msg))
    # 5. Suspended: Suspending while pods still stop.
    if exp.spec.suspend:
        running = roles.rollout[0] + roles.trainer[0] + roles.bus[0] + _int(((job or {}).get("status") or {}).get("active"))
        if running:
            return _Verdict(Phase.SUSPENDED, Reason.SUSPENDING, f"{running} pods still stopping", False, suspended=(Reason.SUSPENDING, f"{running} pods still stopping"))
        return _Verdict(Phase.SUSPENDED, Reason.SUSPENDED, "spec.suspend is true: all pods stopped, training resumes from the last checkpoint", False, suspended=(Reason.SUSPENDED, "spec.suspend is true"))
    started = bool(old.get("startTime"))
    crash = next((p for p in observed.pod_problems if p.reason == "CrashLoopBackOff"), None)
    degraded = (Reason.CRASH_LOOP, f"pod {crash.pod} container {crash.container} keeps crashing: {crash.message}".rstrip(": ")) if crash else None
    # 6. Something only the user can fix.
    if problems:
        first = problems[0]
        msg = "; ".join(p.message for p in problems)
        return _Verdict(Phase.RUNNING if started else Phase.PENDING, first.reason, msg, False, degraded=(first.reason, msg) if started else degraded)
    # 7. Children not created yet.
    missing = [k for k, v in (("bus", observed.bus if exp.spec.bus.embedded else True), ("rollout", observed.rollout), ("trainer", job)) if v is None]
    if missing and not started:
        return _Verdict(Phase.PENDING, Reason.CREATING, f"creating {', '.join(missing)}", True)
    # 8. The trainer failed and the handlers restart it.
    if job_failed:
        msg = f"trainer failed; restart {restarts + 1} of {max_restarts} from the last checkpoint"
        return _Verdict(Phase.RUNNING if started else Phase.INITIALIZING, Reason.TRAINER_RESTARTING, msg, True, degraded=(Reason.TRAINER_RESTARTING, msg))
    # 9. Up, or on the way.
    trainer_up = roles.trainer[0] >= roles.trainer[1] or (progress is not None and not progress.get("done"))
    bus_up = roles.bus[0] >= roles.bus[1]
    rollout_up = roles.rollout[0] >= 1 or roles.rollout[1] == 0
    if trainer_up and bus_up and rollout_up:
        short = [msg for reason, msg in roles.waiting if reason != Reason.WAITING_FOR_TRAINER or progress is None]
        if short:
            return _Verdict(Phase.RUNNING, Reason.REPLICAS_NOT_READY, "; ".join(short), True, degraded=(Reason.REPLICAS_NOT_READY, "; ".join(short)))
        return _Verdict(Phase.RUNNING, Reason.TRAINING, "all roles ready", True, degraded=degraded)
    reason, _ = roles.waiting[0] if roles.waiting else (Reason.WAITING_FOR_TRAINER, "")
    msg = "; ".join(m for _, m in roles.waiting) or "waiting for the trainer's first report"
    if started:
        return _Verdict(Phase.RUNNING, reason, msg, True, degraded=degraded or (Reason.REPLICAS_NOT_READY, msg))
    return _Verdict(Phase.INITIALIZING, reason, msg, True, degraded=degraded)


def compute_status(exp: RLExperiment, observed: ObservedChildren, progress: Mapping[str, Any] | None, now: datetime) -> dict[str, Any]:
    """The whole status (manifest camelCase) for `exp` (its current status is the previous one).

    `progress` is the bus KV `progress` value (contracts.md) or None when it could not be read (then
    the previous progress is kept). Conditions keep their lastTransitionTime while their status holds.
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
    if generation is not None:
        status["observedGeneration"] = generation
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
