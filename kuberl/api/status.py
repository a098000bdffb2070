"""The RLExperiment's status: phase, conditions, training progress, role and checkpoint status."""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

from pydantic import Field

from kuberl.api.base import KubeModel
from kuberl.api.evaluation import EvalProgress


class Phase(StrEnum):
    PENDING = "Pending"
    INITIALIZING = "Initializing"
    RUNNING = "Running"
    SUSPENDED = "Suspended"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"


class ConditionType(StrEnum):
    READY = "Ready"  # every role is up and training progresses
    PROGRESSING = "Progressing"  # children being created, or training steps advancing
    SUSPENDED = "Suspended"
    DEGRADED = "Degraded"  # running with fewer replicas than desired, or a recoverable error
    COMPLETE = "Complete"
    FAILED = "Failed"
    VALIDATED = "Validated"  # False with reason ValidationFailed when the spec cannot run
    RECONCILED = "Reconciled"  # False with reason ApplyFailed when a child could not take the spec (the message names the field)


class Condition(KubeModel):
    """metav1.Condition."""

    type: str = Field(description="Condition type, e.g. Ready.")
    status: Literal["True", "False", "Unknown"] = Field(description="True, False or Unknown.")
    reason: str = Field(description="CamelCase reason.", pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")
    message: str = Field("", description="Human-readable detail.")
    last_transition_time: str | None = Field(None, description="RFC 3339 time of the last status change.")
    observed_generation: int | None = Field(None, ge=0, description="metadata.generation this condition was set for.")


class TrainingProgress(KubeModel):
    step: int = Field(0, ge=0, description="Training steps done.")
    total_steps: int | None = Field(None, ge=0, description="Training steps planned.")
    steps: str | None = Field(None, description="step/total, for printing.")
    epoch: int = Field(0, ge=0, description="Current epoch.")
    policy_version: int = Field(0, ge=0, description="Version of the weights the engines serve.")
    reward: float | None = Field(None, description="Mean raw reward of the last step.")
    reward_text: str | None = Field(None, description="Reward formatted for printing.")
    samples_per_second: float | None = Field(None, ge=0, description="Trained samples per second (recent).")
    staleness_mean: float | None = Field(None, ge=0, description="Mean of v - (head version) over the last batch.")
    staleness_max: int | None = Field(None, ge=0, description="Largest staleness in the last batch.")
    dropped_stale: int = Field(0, ge=0, description="Groups dropped for exceeding maxHeadOffpolicyness (staleness.dropStaleGroups), all time.")
    over_stale: int | None = Field(
        None, ge=0, description="Groups trained although their oldest token was older than v - maxHeadOffpolicyness (stragglers; "
        "the behaviour-weight cap corrects them), all time. Always 0 with staleness.dropStaleGroups, which drops them.")
    failed_groups: int | None = Field(None, ge=0, description="Tickets that failed on every delivery (rollout.maxTicketAttempts), all time.")
    last_failure: str | None = Field(None, max_length=500, description=(
        "The latest failed group's reason (`item N: ...`), as the trainer reported it when it failed; each rollout agent's "
        "log has every failure."))
    entropy: float | None = Field(None, ge=0, description="Policy entropy of the last step (token mean over trained tokens, at the sampling temperature).")
    eval: EvalProgress | None = Field(None, description="The last finished held-out evaluation (spec.evaluation).")
    updated_at: str | None = Field(None, description="When the trainer last reported.")


class RoleStatus(KubeModel):
    desired: int = Field(0, ge=0, description="Pods wanted.")
    ready: int = Field(0, ge=0, description="Pods ready.")
    ready_text: str | None = Field(None, description="ready/desired, for printing.")


class CheckpointStatus(KubeModel):
    step: int = Field(ge=0, description="Training step of the checkpoint.")
    policy_version: int = Field(0, ge=0, description="Policy version saved.")
    path: str = Field(description="Where it lies on the checkpoint volume.")
    time: str | None = Field(None, description="When it was written.")


class RLExperimentStatus(KubeModel):
    phase: Phase = Field(Phase.PENDING, description="Pending, Initializing, Running, Suspended, Succeeded or Failed.")
    conditions: list[Condition] = Field(default_factory=list, description="Latest observations (metav1.Condition).")
    observed_generation: int | None = Field(None, description="The metadata.generation last reconciled.")
    progress: TrainingProgress = Field(default_factory=TrainingProgress, description="Training progress, read from the bus.")
    rollout: RoleStatus = Field(default_factory=RoleStatus, description="Inference replicas.")
    trainer: RoleStatus = Field(default_factory=RoleStatus, description="Trainer pods.")
    bus: RoleStatus = Field(default_factory=RoleStatus, description="NATS servers (embedded bus).")
    replicas: int = Field(0, ge=0, description="Rollout replicas now (for the /scale subresource).")
    selector: str | None = Field(None, description="Label selector of the rollout pods (for the /scale subresource).")
    last_checkpoint: CheckpointStatus | None = Field(None, description="Most recent checkpoint.")
    restarts: int = Field(0, ge=0, description="Trainer restarts so far.")
    start_time: str | None = Field(None, description="When training started.")
    completion_time: str | None = Field(None, description="When it succeeded or failed.")
    last_scale_time: str | None = Field(None, description="When the autoscaler last changed replicas.")


# ---------------------------------------------------------------------------------------------
# The object
# ---------------------------------------------------------------------------------------------

