"""Label and annotation keys, roles, condition reasons and event reasons: documented constants (KubeRay constant.go).

The builders stamp these labels on every child; the kopf handlers (O2) select children with
`selector_labels` and emit events with `EventReason`; status.py sets conditions with `Reason`.
"""

from __future__ import annotations

from enum import StrEnum

from kuberl.operator.naming import BUS_RUN_ANNOTATION, ExperimentRef, experiment_name

# --- label keys -------------------------------------------------------------------------------
# kuberl.io/experiment: name of the owning RLExperiment. On every child; pods of one experiment are
# found (and admitted by the bus NetworkPolicy) by this label alone.
EXPERIMENT_LABEL = "kuberl.io/experiment"
# kuberl.io/role: bus | rollout | trainer, on pods and the objects that select them.
ROLE_LABEL = "kuberl.io/role"
# kuberl.io/sandbox: name of the RLExperiment, on its sandbox pods (workflow.sandbox.placement pod) *instead of*
# kuberl.io/experiment: the policies that admit "this experiment's pods" (the bus, the engines) must not admit tool code.
SANDBOX_LABEL = "kuberl.io/sandbox"
# Recommended labels (kubernetes.io/docs/concepts/overview/working-with-objects/common-labels).
APP_NAME_LABEL = "app.kubernetes.io/name"
APP_INSTANCE_LABEL = "app.kubernetes.io/instance"
APP_COMPONENT_LABEL = "app.kubernetes.io/component"
APP_MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
APP_PART_OF_LABEL = "app.kubernetes.io/part-of"

APP_NAME = "kuberl"
MANAGED_BY = "kuberl-operator"
PART_OF = "kuberl"

# Labels the operator's own pods carry (the Helm chart must set them): the bus NetworkPolicy admits
# them so the operator can read training progress from the bus KV.
OPERATOR_POD_LABELS = {APP_NAME_LABEL: APP_NAME, APP_COMPONENT_LABEL: "operator"}

# --- annotation keys --------------------------------------------------------------------------
# kuberl.io/spec-hash: sha256 (16 hex) of the child as built, without this annotation. The handlers
# compare it with the live object's to tell whether a child needs an update (or, for the trainer Job
# whose pod template is immutable, a re-creation) without diffing server-defaulted fields.
SPEC_HASH_ANNOTATION = "kuberl.io/spec-hash"
# kuberl.io/config-hash: on pod templates; hash of experiment.yaml so a config change rolls the pods
# that read it (ConfigMap mounts update in place, the processes would not notice).
CONFIG_HASH_ANNOTATION = "kuberl.io/config-hash"
# kuberl.io/bus-config-hash: on the NATS pod template; hash of nats.conf (which holds no secret).
BUS_CONFIG_HASH_ANNOTATION = "kuberl.io/bus-config-hash"
# Ask kubectl to open this container by default in `kubectl logs/exec`.
DEFAULT_CONTAINER_ANNOTATION = "kubectl.kubernetes.io/default-container"

# --- pins: what an experiment keeps for its lifetime (kuberl.operator.builders.pinning) ----------
# On the RLExperiment, written by the operator when it first reconciles it (the user may edit the
# first two to move a running experiment to other runtime images: an explicit opt-in):
# the tag and repository of the default runtime images, and the bus run (BUS_RUN_ANNOTATION, from
# naming: docs/design/contracts.md).
RUNTIME_VERSION_ANNOTATION = "kuberl.io/runtime-version"
RUNTIME_REPOSITORY_ANNOTATION = "kuberl.io/runtime-repository"
PIN_ANNOTATIONS = (RUNTIME_VERSION_ANNOTATION, RUNTIME_REPOSITORY_ANNOTATION, BUS_RUN_ANNOTATION)
# On the pinned children (workloads, the ConfigMap and the bus Secret): the metadata.generation and
# the hash of the user's spec they were rendered for. A new operator version keeps a child's pod
# template until the user's own spec changes (or a pin annotation above does).
TEMPLATE_GENERATION_ANNOTATION = "kuberl.io/template-generation"
TEMPLATE_INPUTS_ANNOTATION = "kuberl.io/template-inputs"


class Role(StrEnum):
    """Value of kuberl.io/role: which part of the experiment a pod (or the object selecting it) serves."""

    BUS = "bus"  # NATS JetStream servers
    ROLLOUT = "rollout"  # inference engine + rollout agent pods
    TRAINER = "trainer"  # torchrun trainer pods


class Component(StrEnum):
    """Value of app.kubernetes.io/component: the roles, plus the children that are not pods."""

    BUS = "bus"
    ROLLOUT = "rollout"
    TRAINER = "trainer"
    CONFIG = "config"  # the experiment ConfigMap
    STORAGE = "storage"  # the checkpoint PVC
    RBAC = "rbac"  # ServiceAccount, Role, RoleBinding
    NETWORK = "network"  # NetworkPolicy
    SANDBOX = "sandbox"  # the sandbox server's Deployment and Service (workflow.sandbox.placement pod)


def selector_labels(exp: ExperimentRef, role: Role | str) -> dict[str, str]:
    """The immutable selector of a role's pods (StatefulSet/Service selectors): experiment + role."""
    return {EXPERIMENT_LABEL: experiment_name(exp), ROLE_LABEL: str(Role(role))}


def selector_string(exp: ExperimentRef, role: Role | str) -> str:
    """`selector_labels` as a label-selector string (status.selector for the /scale subresource)."""
    return ",".join(f"{k}={v}" for k, v in selector_labels(exp, role).items())


def sandbox_selector(exp: ExperimentRef) -> dict[str, str]:
    """Selects an experiment's sandbox pods (which carry no kuberl.io/experiment label: SANDBOX_LABEL)."""
    return {SANDBOX_LABEL: experiment_name(exp)}


def sandbox_pod_labels(exp: ExperimentRef) -> dict[str, str]:
    """The sandbox pods' labels: the recommended ones and SANDBOX_LABEL, without kuberl.io/experiment."""
    labels = {k: v for k, v in child_labels(exp, Component.SANDBOX).items() if k != EXPERIMENT_LABEL}
    return {**labels, **sandbox_selector(exp)}


def experiment_labels(exp: ExperimentRef) -> dict[str, str]:
    """Selects every child of one experiment."""
    return {EXPERIMENT_LABEL: experiment_name(exp)}


def child_labels(exp: ExperimentRef, component: Component | str) -> dict[str, str]:
    """All labels of a child: recommended app.kubernetes.io/* plus kuberl.io/experiment (and role for pods)."""
    component = Component(component)
    labels = {
        APP_NAME_LABEL: APP_NAME,
        APP_INSTANCE_LABEL: experiment_name(exp),
        APP_COMPONENT_LABEL: str(component),
        APP_MANAGED_BY_LABEL: MANAGED_BY,
        APP_PART_OF_LABEL: PART_OF,
        EXPERIMENT_LABEL: experiment_name(exp),
    }
    if component.value in {r.value for r in Role}:
        labels[ROLE_LABEL] = component.value
    return labels


# --- spec.managedBy ---------------------------------------------------------------------------
# The value that means "this operator"; an experiment managed by another controller (MultiKueue's
# kueue.x-k8s.io/multikueue on a manager cluster) is skipped entirely, as the Job controller does.
MANAGED_BY_OPERATOR = "kuberl.io/operator"


def managed_elsewhere(body: object) -> str | None:
    """The foreign spec.managedBy of a kopf body (or manifest), None when this operator manages it."""
    spec = (body.get("spec") if hasattr(body, "get") else None) or {}
    value = spec.get("managedBy")
    return value if value and value != MANAGED_BY_OPERATOR else None


# --- condition reasons (metav1.Condition.reason, CamelCase) -----------------------------------
class Reason(StrEnum):
    """Why a condition has its status. Condition types and phases live in kuberl.api.v1alpha1."""

    # Validated
    SPEC_VALID = "SpecValid"  # the spec passed the models' checks
    VALIDATION_FAILED = "ValidationFailed"  # the spec cannot run; the message names the field
    # Waiting for something the user must provide (Ready=False, Progressing=False)
    SECRET_NOT_FOUND = "SecretNotFound"  # hub token or external bus credentials Secret (or its key) is missing
    CLAIM_NOT_FOUND = "ClaimNotFound"  # checkpoint.existingClaim / model or dataset volume PVC is missing
    VOLUME_PENDING = "VolumePending"  # a PVC of ours cannot bind: its StorageClass is missing, or none is named and none is default
    IMAGE_PULL_FAILED = "ImagePullFailed"  # a pod cannot pull its image (ErrImagePull, ImagePullBackOff, InvalidImageName)
    INSUFFICIENT_ACCELERATORS = "InsufficientAccelerators"  # a pod asks for more accelerators than any node has
    UNSCHEDULABLE = "Unschedulable"  # the scheduler cannot place a pod (message from PodScheduled)
    CONTAINER_CONFIG_ERROR = "ContainerConfigError"  # kubelet CreateContainerConfigError (e.g. a Secret key missing)
    NAMESPACE_NOT_PERMITTED = "NamespaceNotPermitted"  # no RoleBinding lets the operator write in the experiment's namespace
    # Lifecycle
    CREATING = "Creating"  # children are being created
    WAITING_FOR_BUS = "WaitingForBus"  # NATS servers not ready yet
    WAITING_FOR_ROLLOUT = "WaitingForRollout"  # no inference replica ready yet
    WAITING_FOR_TRAINER = "WaitingForTrainer"  # trainer pods not running yet
    TRAINING = "Training"  # all roles up, the trainer reports progress
    ALL_REPLICAS_READY = "AllReplicasReady"  # Degraded=False: every role at its desired count
    REPLICAS_NOT_READY = "ReplicasNotReady"  # Degraded=True: fewer rollout or bus pods ready than desired
    CRASH_LOOP = "CrashLoopBackOff"  # Degraded=True: a container keeps crashing
    TRAINER_RESTARTING = "TrainerRestarting"  # the trainer failed; the operator restarts it from the last checkpoint
    SUSPENDED = "Suspended"  # spec.suspend is true and the pods are gone
    SUSPENDING = "Suspending"  # spec.suspend is true, pods still stopping
    NOT_SUSPENDED = "NotSuspended"
    TRAINING_COMPLETE = "TrainingComplete"  # the trainer finished every step
    NOT_COMPLETE = "NotComplete"
    TRAINER_FAILED = "TrainerFailed"  # the trainer reported a failure after it reported done (failing while running is retried)
    MAX_RESTARTS_EXCEEDED = "MaxRestartsExceeded"  # failurePolicy.maxRestarts trainer restarts used up
    CONFIGURATION_ERROR = "ConfigurationError"  # a role exited 2: the spec cannot run (message: its termination message)
    NO_FAILURE = "NoFailure"
    AS_EXPECTED = "AsExpected"  # Degraded=False: nothing wrong
    # Reconciled
    APPLIED = "Applied"  # every child took the spec of metadata.generation (status.observedGeneration)
    APPLY_FAILED = "ApplyFailed"  # a child could not take the spec (an immutable field, a rejected value); the message names it


# --- event reasons (core/v1 Event.reason) ------------------------------------------------------
class EventReason(StrEnum):
    """Reasons of the Events the operator emits on an RLExperiment."""

    CREATED = "Created"  # a child was created
    UPDATED = "Updated"  # a child was changed to match the spec
    RECREATED = "Recreated"  # a child with immutable fields (trainer Job) was replaced
    SCALED_UP = "ScaledUp"  # the autoscaler added rollout replicas (message: why)
    SCALED_DOWN = "ScaledDown"  # the autoscaler removed rollout replicas (message: why)
    CHECKPOINT_REQUESTED = "CheckpointRequested"  # asked the trainer for a checkpoint (before suspending)
    CHECKPOINT_SAVED = "CheckpointSaved"
    SUSPENDED = "Suspended"
    RESUMED = "Resumed"
    TRAINER_RESTARTED = "TrainerRestarted"  # the trainer Job was re-created after a failure
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    STOPPED = "Stopped"  # after a configuration error: rollout scaled to 0, no trainer left running
    CHECKPOINT_RETAINED = "CheckpointRetained"  # the run is over; the checkpoint PVC outlives the experiment (retainPolicy Retain)
    BUS_STOPPED = "BusStopped"  # the experiment is over: its embedded bus servers stopped (after a success, volumes deleted)
    # Unrunnable specs: the same words as the condition reasons, so events and conditions match.
    VALIDATION_FAILED = Reason.VALIDATION_FAILED.value
    CONFIGURATION_ERROR = Reason.CONFIGURATION_ERROR.value
    SECRET_NOT_FOUND = Reason.SECRET_NOT_FOUND.value
    CLAIM_NOT_FOUND = Reason.CLAIM_NOT_FOUND.value
    VOLUME_PENDING = Reason.VOLUME_PENDING.value
    IMAGE_PULL_FAILED = Reason.IMAGE_PULL_FAILED.value
    INSUFFICIENT_ACCELERATORS = Reason.INSUFFICIENT_ACCELERATORS.value
    UNSCHEDULABLE = Reason.UNSCHEDULABLE.value
    APPLY_FAILED = Reason.APPLY_FAILED.value
