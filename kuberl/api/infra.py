"""What connects and keeps a run: weight sync, the bus, checkpoints, training length and the failure policy."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from kuberl.api.base import KubeModel, Quantity, ResourceRequirements, SecretKeyRef, _cel, _check_quantity

BROADCAST_NEEDS_VLLM = ("weightSync.mode broadcast needs rollout.engine vllm: the engines receive through a vLLM worker extension "
                        "(SGLang's update_weights_from_distributed is not wired up)")
BROADCAST_NO_LORA = "weightSync.mode broadcast sends full weights: with algorithm.lora use weightSync.mode disk or bus (adapters are hot-loaded from files)"
KEEP_NEEDS_VLLM_FILES = ("weightSync.inFlight keep is implemented for rollout.engine vllm with weightSync.mode disk or bus and full weights: "
                         "use inFlight abort with SGLang, broadcast or algorithm.lora")


class WeightSyncSpec(KubeModel):
    mode: Literal["disk", "bus", "broadcast"] = Field(
        "disk", description="disk: safetensors on the shared checkpoint volume (ReadWriteMany); bus: through a NATS object store; "
        "broadcast: the trainer streams the parameters bucket by bucket over a torch.distributed group to every engine "
        "(NCCL on GPU, gloo on CPU; no shared volume, no object store; vLLM only).")
    bucket_mb: int = Field(256, ge=1, le=65536, alias="bucketMB",
                           description="broadcast: MiB of parameters sent per collective (bigger: fewer round trips, more memory). "
                           "disk/bus: the shard size of a weights version (model-0000i-of-0000N.safetensors; one model.safetensors when "
                           "the model fits): the trainer's rank 0 holds at most one shard of full tensors while it writes.")
    port: int = Field(29600, ge=1024, le=65535, description="broadcast: the trainer's rendezvous port the engines connect to (TCPStore).")
    join_timeout_seconds: int = Field(
        10, ge=1, le=3600, description="broadcast: how long an update waits for the engines of the previous update to register; "
        "later ones get the weights at the next step or as soon as the trainer waits for groups.")
    timeout_seconds: int = Field(
        300, ge=5, le=86400, description="broadcast: limit on each collective; a receiver that dies fails that update (it asks again); the trainer goes on.")
    in_flight: Literal["abort", "keep"] | None = Field(
        None, alias="inFlight",
        description="What a weight update does to generations in flight. abort (AReaL's interruptible rollout): the engine pauses, "
        "aborts them, loads, and each continues from its tokens so far on the new weights, its KV recomputed; every token "
        "carries the version that produced it. keep (PipelineRL's in-flight update): the engine loads between two decoding "
        "steps without pausing; generations go on with the KV cache they have (computed by the earlier weights), and "
        "each token carries the version that sampled it (vLLM's weight-version spans; the label follows each load by "
        "one call, so a token sampled just after it may carry the previous version: staleness is over-counted, never "
        "under). Either way each token's behaviour logprob is the probability it was sampled with. "
        "keep: vLLM, weightSync.mode disk or bus, no LoRA. Unset: keep where it is implemented (the faster: no pause, no "
        "KV recomputation), else abort.")


class EmbeddedBusSpec(KubeModel):
    replicas: Literal[1, 3, 5] = Field(1, description="NATS servers (JetStream clusters need an odd count).")
    storage: Quantity = Field("10Gi", description="JetStream file storage per server.")
    storage_class_name: str | None = Field(None, description="StorageClass of the JetStream volumes.")
    image: str | None = Field(None, description="NATS image; default nats:2.15-alpine.")
    resources: ResourceRequirements = Field(default_factory=ResourceRequirements, description="NATS container resources.")
    after_success: Literal["Delete", "Keep"] = Field(
        "Delete", description="What becomes of the bus once the experiment succeeds. Delete: its servers stop and their JetStream "
        "volumes are deleted (what is left on them is surplus: the trained weights and checkpoints are on the checkpoint "
        "volume). Keep: the servers keep running with their volumes (to read the metrics stream after the run) until "
        "the experiment is deleted. A failed experiment's servers stop and keep their volumes either way.")


class ExternalBusSpec(KubeModel):
    model_config = _cel(
        ("!(has(self.credentialsSecret) && has(self.accountSigningKeySecret))",
         "set bus.external.credentialsSecret (one token for every role) or bus.external.accountSigningKeySecret (a user per role), not both"),
        ("!has(self.account) || has(self.accountSigningKeySecret)",
         "bus.external.account names the account of bus.external.accountSigningKeySecret: set that too"),
    )
    # RE2's \S spelled out: pydantic's (Rust) \S is Unicode, and the operator refused a URL the API server had admitted
    url: str = Field(description="NATS URL, e.g. nats://nats.nats.svc:4222.", pattern=r"^(nats|tls|ws|wss)://[^\t\n\f\r ]+$")
    credentials_secret: SecretKeyRef | None = Field(None, description="Secret with the NATS token every role of this experiment uses (key default: token).")
    account_signing_key_secret: SecretKeyRef | None = Field(
        None, description="Secret with a signing key seed (SA...) of the NATS account this experiment uses, on a NATS run in JWT mode "
        "(operator/accounts, as nsc sets up). The operator mints each role (trainer, rollout) its own user, allowed only this "
        "experiment's subjects, streams and replies, and gives each pod its role's credentials only. Read by the operator only.")
    account: str | None = Field(
        None, pattern=r"^A[A-Z2-7]{55}$",
        description="Public key (A...) of the account when accountSigningKeySecret holds one of its signing keys rather than the account's own key.")

    @model_validator(mode="after")
    def _one_way_in(self) -> ExternalBusSpec:
        if self.credentials_secret is not None and self.account_signing_key_secret is not None:
            raise ValueError("set bus.external.credentialsSecret (one token for every role) or bus.external.accountSigningKeySecret "
                             "(a user per role), not both")
        if self.account is not None and self.account_signing_key_secret is None:
            raise ValueError("bus.external.account names the account of bus.external.accountSigningKeySecret: set that too")
        return self


class BusSpec(KubeModel):
    """The trajectory bus: NATS JetStream, run by the operator (embedded) or yours (external)."""

    model_config = _cel(("!(has(self.embedded) && has(self.external))", "set bus.embedded or bus.external, not both"))
    embedded: EmbeddedBusSpec | None = Field(None, description="Run a NATS JetStream StatefulSet for this experiment (the default).")
    external: ExternalBusSpec | None = Field(None, description="Use an existing NATS with JetStream.")
    max_payload: Quantity = Field("8Mi", description="Largest message; trajectory groups above it are chunked.")

    @model_validator(mode="after")
    def _one(self) -> BusSpec:
        if self.embedded is not None and self.external is not None:
            raise ValueError("set bus.embedded or bus.external, not both")
        if self.embedded is None and self.external is None:
            self.embedded = EmbeddedBusSpec()  # documented: embedded is the default bus
        _check_quantity(self.max_payload, "bus.maxPayload")
        if self.embedded is not None:
            _check_quantity(self.embedded.storage, "bus.embedded.storage")
        return self


class CheckpointSpec(KubeModel):
    model_config = _cel(("!has(self.existingClaim) || !has(self.storageClassName)", "checkpoint.storageClassName has no effect with checkpoint.existingClaim"))
    size: Quantity = Field("50Gi", description="Size of the checkpoint PVC.")
    storage_class_name: str | None = Field(None, description="StorageClass of the checkpoint PVC (ReadWriteMany for weight sync over disk).")
    existing_claim: str | None = Field(None, description="Use this PVC instead of creating one.")
    every_steps: int = Field(10, ge=1, le=1_000_000, description="Checkpoint every N training steps.")
    keep: int = Field(3, ge=1, le=1000, description="Checkpoints kept (oldest deleted first).")
    async_save: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Write checkpoints in the background. on: each rank copies its model and optimizer state to host memory "
        "(as much memory again as that state, until the write ends), training goes on, and the checkpoint is committed, and the "
        "groups it covers acknowledged, once every rank's write is done; a crash before that resumes from the checkpoint before. "
        "off: training waits for every write. auto: on for trainer.backend fsdp on NVIDIA GPUs when host memory has room for "
        "the copy, else off. on needs trainer.backend fsdp.",
    )
    retain_policy: Literal["Retain", "Delete"] = Field(
        "Retain",
        description="Retain: the checkpoint PVC the operator creates outlives the experiment (not owned by it), so a re-created "
        "experiment of the same name resumes from it; Delete: it is garbage-collected with the experiment.",
    )

    @model_validator(mode="after")
    def _rules(self) -> CheckpointSpec:
        _check_quantity(self.size, "checkpoint.size")
        if self.existing_claim is not None and self.storage_class_name is not None:
            raise ValueError("checkpoint.storageClassName has no effect with checkpoint.existingClaim")
        return self


class TrainingSpec(KubeModel):
    model_config = _cel(("has(self.totalSteps) || has(self.epochs)", "set training.totalSteps or training.epochs"))
    total_steps: int | None = Field(None, ge=1, le=100_000_000, description="Stop after this many training steps (wins over epochs).")
    epochs: int | None = Field(None, ge=1, le=100_000, description="Stop after this many passes over the data set.")

    @model_validator(mode="after")
    def _one(self) -> TrainingSpec:
        if self.total_steps is None and self.epochs is None:
            raise ValueError("set training.totalSteps or training.epochs")
        return self


class FailurePolicySpec(KubeModel):
    max_restarts: int = Field(3, ge=0, le=1000, description="Trainer restarts (from the last checkpoint) before the experiment fails.")
    backoff_seconds: int = Field(30, ge=0, le=86400, description="Wait before a restart; doubles each time.")

