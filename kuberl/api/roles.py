"""The two roles' specs: rollout (engines with agents, autoscaling) and trainer (backend, parallelism)."""

from __future__ import annotations

from enum import StrEnum
from typing import Any, Literal

from pydantic import Field, model_validator

from kuberl.api.base import AcceleratorSpec, AcceleratorType, FieldError, KubeModel, _cel, _or
from kuberl.api.pods import HUGEPAGES_MESSAGE, HUGEPAGES_RULE, SchedulingSpec


class AutoscalingSpec(KubeModel):
    # _or: the API server also checks the rule on the CRD's default `autoscaling: {}`, before its fields' defaults apply
    model_config = _cel((f"{_or('self.minReplicas', 1)} <= {_or('self.maxReplicas', 1)}", "rollout.autoscaling.minReplicas must be <= maxReplicas"))
    enabled: bool = Field(False, description="Let the operator scale rollout replicas from bus signals.")
    min_replicas: int = Field(1, ge=0, le=1024, description="Lower bound.")
    max_replicas: int = Field(1, ge=1, le=1024, description="Upper bound.")
    cooldown_seconds: int = Field(120, ge=0, le=86400, description="Minimum time between two scaling decisions.")

    @model_validator(mode="after")
    def _bounds(self) -> AutoscalingSpec:
        if self.min_replicas > self.max_replicas:
            raise ValueError("rollout.autoscaling.minReplicas must be <= maxReplicas")
        return self


class EngineName(StrEnum):
    SGLANG = "sglang"
    VLLM = "vllm"


# The runtime-npu image carries torch_npu but no inference engine: an Ascend rollout must name an
# image that has one (e.g. a vllm-ascend build with the KubeRL runtime installed).
ASCEND_IMAGE_RULE = "!has(self.accelerator) || !has(self.accelerator.type) || self.accelerator.type != 'ascend' || has(self.image)"
ASCEND_IMAGE_MESSAGE = ("rollout.image is required with rollout.accelerator.type ascend: the default runtime-npu image has no "
                        "inference engine; use an image with vllm-ascend and the KubeRL runtime (see docs/guides/ascend.md)")


class RolloutSpec(SchedulingSpec):
    """Inference: a StatefulSet of engine + rollout-agent pods."""

    # Only an explicit replicas is checked here: unset, it comes from `allocation` (checked there)
    # or starts at minReplicas. The accelerator-count rule lives on the spec, which sees `allocation`.
    model_config = _cel(
        ("!self.autoscaling.enabled || !has(self.replicas) || (self.replicas >= self.autoscaling.minReplicas && self.replicas <= self.autoscaling.maxReplicas)",
         "rollout.replicas must lie within rollout.autoscaling.minReplicas..maxReplicas", ".replicas"),
        (ASCEND_IMAGE_RULE, ASCEND_IMAGE_MESSAGE, ".image"),
        (HUGEPAGES_RULE, HUGEPAGES_MESSAGE, ".podTemplate.extendedResources"),
    )
    engine: EngineName = Field(
        EngineName.VLLM,
        description="Inference engine: vllm or sglang. Default: from `allocation` when set, else vllm (the engine KubeRL tests run for real).",
    )
    replicas: int = Field(
        1, ge=0, le=1024,
        description="Engine replicas (pods); the /scale subresource sets this. Default: from `allocation` when set, "
                    "else autoscaling.minReplicas when autoscaling is on, else 1.",
    )
    autoscaling: AutoscalingSpec = Field(default_factory=AutoscalingSpec, description="Elastic rollout capacity.")
    tensor_parallel_size: int = Field(1, ge=1, le=64, description="Tensor parallelism inside one engine. Default: from `allocation` when set, else 1.")
    pipeline_parallel_size: int = Field(1, ge=1, le=64, description="Pipeline parallelism inside one engine. Default: from `allocation` when set, else 1.")
    accelerator: AcceleratorSpec = Field(default_factory=AcceleratorSpec, description="Accelerators per replica.")
    engine_args: list[str] = Field(default_factory=list, max_length=64, description="Extra command-line arguments for the engine server.")
    concurrency: int = Field(32, ge=1, le=4096, description="Groups one agent generates at once.")
    max_ticket_attempts: int = Field(
        3, ge=1, le=100,
        description="Deliveries of one ticket whose workflow or reward raises before it becomes a failed group "
        "(counted in status.progress.failedGroups, its slot given back) instead of being retried forever.",
    )

    @model_validator(mode="after")
    def _rules(self) -> RolloutSpec:
        a = self.autoscaling
        if a.enabled and "replicas" in self.model_fields_set and not (a.min_replicas <= self.replicas <= a.max_replicas):
            raise ValueError("rollout.replicas must lie within rollout.autoscaling.minReplicas..maxReplicas")
        if a.enabled and "replicas" not in self.model_fields_set:
            # Left unset on purpose (not in model_fields_set) so that `allocation` may still fill it.
            object.__setattr__(self, "replicas", a.min_replicas)
        if self.accelerator.type == AcceleratorType.ASCEND and not self.image:
            raise ValueError(ASCEND_IMAGE_MESSAGE)
        return self


# Admission refuses what no trainer implements yet (issue #13), naming the field and what to use instead;
# the trainer's own exit-2 refusals (runtime/kuberl/runtime/trainer/megatron/backend.py) stay as a second line of defence.
MEGATRON_CONTEXT_EXPERT = ("trainer.parallelism.context > 1 with expert > 1: context parallel of a mixture-of-experts model is not implemented "
                           "for trainer.backend megatron (use context 1 or expert 1)")
CONTEXT_DIVIDE = ("trainer.parallelism.context must divide nodes * accelerator.count (trainer.backend fsdp: consecutive ranks form a "
                  "context-parallel group, data parallel over the groups)")
EXPERT_NEED_MEGATRON = ("trainer.parallelism.expert > 1 (expert parallel, MoE) needs trainer.backend megatron: set trainer.backend megatron, "
                        "or use expert 1 (fsdp trains data parallel only)")
MEGATRON_EXPERT_DIVIDE = ("trainer.parallelism.expert must divide the data-parallel size, nodes * accelerator.count / (tensor * pipeline) "
                          "(trainer.backend megatron cuts the experts over data-parallel ranks)")
ALLOCATION_CONTEXT_EXPERT = ("allocation: context parallel (c > 1) with expert parallel (e > 1) is not implemented (the megatron backend "
                             "does not run a mixture-of-experts model context parallel), e.g. vllm:d1+megatron:d1c2 or vllm:d2+megatron:d2e2")
ALLOCATION_EXPERT_NEED_MEGATRON = "allocation: expert parallel (e > 1) needs the megatron backend (e.g. vllm:d2+megatron:d2e2)"
ALLOCATION_EXPERT_DIVIDE = "allocation: e (expert parallel) must divide d (data parallel), e.g. vllm:d2+megatron:d4e2"
def allocation_disagrees(path: str) -> str:
    """A field the allocation shorthand fills, set in the manifest to something else (CEL rule and apply_allocation)."""
    return f"allocation sets {path}, but the spec says otherwise (leave {path} unset or make the two agree)"


ALLOCATION_DIM_ZERO = "allocation: every dimension must be at least 1 (d0, t0, p0, c0 and e0 are refused)"
ALLOCATION_DIM_TWICE = "allocation: a dimension appears twice in the rollout or the trainer dims (e.g. d2d4)"
ALLOCATION_FSDP_ONLY_D = "allocation: fsdp takes only d (data parallel); t and p need the megatron backend (e.g. vllm:d2+megatron:d2t2)"
ALLOCATION_NODE_SPLIT = ("allocation: the trainer's d*t*p*c accelerators do not split into nodes of trainer.accelerator.count "
                         "(unset: one node of up to 8, else nodes of 8)")
ALLOCATION_REPLICAS_RANGE = ("rollout.replicas must lie within rollout.autoscaling.minReplicas..maxReplicas (the allocation's rollout d "
                             "sets it where rollout.replicas is unset)")
MEGATRON_EXPERT_TENSOR = ("trainer.parallelism.expert > 1 needs trainer.parallelism.tensor 1: megatron-core trains MoE layers under tensor "
                          "parallelism only with sequence parallelism, which trainer.backend megatron does not implement (use pipeline, expert "
                          "and data parallel)")
ALLOCATION_EXPERT_TENSOR = ("allocation: expert parallel (e > 1) needs t1 in the megatron dims (MoE layers under tensor parallelism need "
                            "sequence parallelism, not implemented), e.g. vllm:d2+megatron:d4e2")
TPE_NEED_MEGATRON = ("tensor and pipeline parallelism need trainer.backend megatron: set trainer.backend megatron, "
                     "or use trainer.parallelism.data only")
MEGATRON_TP_PP_DIVIDE = ("trainer.parallelism tensor*pipeline*context must divide nodes * accelerator.count (trainer.backend megatron: data "
                         "parallel over the rest)")
MEGATRON_ON_ASCEND = ("trainer.backend megatron on Ascend NPUs is not implemented (megatron-core runs there only through MindSpeed, "
                      "which KubeRL does not integrate): use trainer.backend fsdp with trainer.accelerator.type ascend")
MEGATRON_FULL_WEIGHTS = ("trainer.backend megatron trains full weights, published through weightSync.mode disk or bus: algorithm.lora and "
                         "weightSync.mode broadcast need trainer.backend fsdp")


MEGATRON_ASYNC_CHECKPOINT = ("checkpoint.asyncSave on needs trainer.backend fsdp: the megatron trainer writes its checkpoints in its own "
                             "per-rank format, synchronously; use asyncSave auto or off")


class ParallelismSpec(KubeModel):
    """Trainer parallel dims; each defaults to `allocation` when set, else 1."""

    data: int | None = Field(None, ge=1, le=4096, description="Data-parallel (FSDP shard) size; unset = what the other dims leave.")
    tensor: int = Field(1, ge=1, le=64, description="Tensor parallel size (trainer.backend megatron).")
    pipeline: int = Field(1, ge=1, le=64, description="Pipeline parallel size (trainer.backend megatron).")
    context: int = Field(1, ge=1, le=64, description=(
        "Context (sequence) parallel size; must divide nodes * accelerator.count. trainer.backend fsdp (Ulysses): each packed row is "
        "split over `context` consecutive ranks, attention heads over the same ranks (both head counts must divide by it). "
        "trainer.backend megatron: megatron-core's context-parallel groups and sequence layout (2 x context chunks per sequence), "
        "keys and values all-gathered over the group (no head constraint; tensor*pipeline*context must divide the processes; "
        "not with expert > 1)."))
    expert: int = Field(1, ge=1, le=256, description=(
        "Expert parallel size (MoE models, trainer.backend megatron): each expert lives on one of `expert` data-parallel ranks; "
        "must divide the data-parallel size. Not a factor of the world size."))


ATTENTION_FLASH_CPU = ("trainer.attention flash_attention_2 needs GPUs (the flash_attn package runs on CUDA only): use sdpa or auto "
                       "with trainer.accelerator.type cpu")
ATTENTION_MEGATRON = ("trainer.attention applies to trainer.backend fsdp (transformers models); trainer.backend megatron runs "
                      "megatron-core's own attention: leave trainer.attention auto")
ATTENTION_CONTEXT = ("trainer.attention: trainer.parallelism.context > 1 runs its own attention (sdpa over each rank's share of the "
                     "heads): use auto or sdpa")


KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
"""The label that queues an experiment in Kueue (kuberl.operator.kueue)."""
TOPOLOGY_ONE = "trainer.topologyRequest: set exactly one of required, preferred or unconstrained: true"
TOPOLOGY_NEEDS_QUEUE = ("trainer.topologyRequest is Kueue's topology-aware scheduling: queue the experiment in Kueue (the label "
                        "kueue.x-k8s.io/queue-name, a LocalQueue whose ClusterQueue has a ResourceFlavor with a topologyName)")


class TopologyRequest(KubeModel):
    """Gang placement of the trainer's ranks by Kueue's topology-aware scheduling (TAS), Kueue's PodSet topologyRequest:
    Kueue admits the experiment only once every rank fits on free nodes (not only within quota) and assigns each rank
    its node; a multi-node trainer never holds some ranks' GPUs while the others wait Pending."""

    model_config = _cel(("(has(self.required) ? 1 : 0) + (has(self.preferred) ? 1 : 0) + "
                         "(has(self.unconstrained) && self.unconstrained ? 1 : 0) == 1", TOPOLOGY_ONE))
    required: str | None = Field(None, min_length=1, max_length=317, description=(
        "A node label of the Topology's levels (e.g. cloud.google.com/gce-topology-block): every rank in one domain of that "
        "level, or the experiment waits in its queue."))
    preferred: str | None = Field(None, min_length=1, max_length=317, description=(
        "As required, but the ranks may spread over several domains of that level when one has no room for all."))
    unconstrained: bool | None = Field(None, description="true: the ranks on any nodes of the flavour, still all of them or none.")

    @model_validator(mode="after")
    def _exactly_one(self) -> TopologyRequest:
        if (self.required is not None) + (self.preferred is not None) + bool(self.unconstrained) != 1:
            raise ValueError(TOPOLOGY_ONE)
        return self

    def kueue(self) -> dict[str, Any]:
        """The PodSet topologyRequest (Kueue v1beta1 and v1beta2 alike), each rank matched to its assigned node by its
        Job completion index."""
        req: dict[str, Any] = {"podIndexLabel": "batch.kubernetes.io/job-completion-index"}
        if self.required is not None:
            req["required"] = self.required
        elif self.preferred is not None:
            req["preferred"] = self.preferred
        else:
            req["unconstrained"] = True
        return req


class TrainerSpec(SchedulingSpec):
    """Training: an indexed Job, one pod per node, torchrun over a headless Service."""

    # Its cross-field rules live on RLExperimentSpec: they must know whether `allocation` fills these fields. The
    # attention rules below read only explicit fields; check() also sees what `allocation` filled.
    model_config = _cel(
        ("!has(self.attention) || self.attention != 'flash_attention_2' || !has(self.accelerator) || "
         "!has(self.accelerator.type) || self.accelerator.type != 'cpu'", ATTENTION_FLASH_CPU, ".attention"),
        (HUGEPAGES_RULE, HUGEPAGES_MESSAGE, ".podTemplate.extendedResources"),
    )  # the megatron and context-parallel attention rules are RLExperimentSpec's: `allocation` may set either
    backend: Literal["fsdp", "megatron"] = Field(
        "fsdp", description=("fsdp (FSDP2, data parallel) or megatron (megatron-core: tensor, pipeline, expert and data parallel; full weights, "
                             "weightSync disk or bus). Default: from `allocation` when set, else fsdp."))
    nodes: int = Field(1, ge=1, le=1024, description="Trainer pods (one per node). Default: from `allocation` when set, else 1.")
    accelerator: AcceleratorSpec = Field(default_factory=AcceleratorSpec, description="Accelerators per node; for cpu, processes per node.")
    parallelism: ParallelismSpec = Field(default_factory=ParallelismSpec, description="Parallel dims.")
    micro_batch_tokens: int = Field(16384, ge=64, description=(
        "Tokens per forward/backward micro-batch: real tokens when packed, rows x longest sequence when padded (trainer.packing)."))
    packing: Literal["auto", "on", "off"] = Field("auto", description=(
        "Padding-free packing: each micro-batch's sequences back to back, position_ids restarting per sequence (flash-attn "
        "varlen on GPU; on sdpa/eager, rows as long as the longest sequence). on, off (pad to the longest; GRPO groups then "
        "share their prompt's forward when not FSDP), or auto: pack when the unpacked path would feed at least 1.1x the "
        "packed token slots (bench/bench_packing.py)."))
    gradient_checkpointing: bool | None = Field(None, description=(
        "Recompute activations in the backward instead of keeping them: less memory (a Qwen2.5-1.5B step on one GPU: "
        "92 -> 33 GiB), ~19% slower. Unset: chosen at start, on when the step without it is estimated above 85% of the "
        "accelerator's memory (from the model's size, microBatchTokens and the trainer's ranks), else off; off on CPU. "
        "trainer.backend megatron recomputes every transformer layer (megatron's recompute_granularity full, method "
        "uniform). The trainer logs what it chose."))
    attention: Literal["auto", "sdpa", "flash_attention_2", "eager"] = Field("auto", description=(
        "The transformers attention kernel the fsdp trainer runs. flash_attention_2: flash-attn (GPU, model.dtype bfloat16 or "
        "float16; the flash_attn package must import, as it does in the GPU images); packed micro-batches then run as one "
        "row through its varlen kernel, at the cost of their real tokens. sdpa: torch's scaled_dot_product_attention (a "
        "packed row carries a dense block-diagonal mask). eager: plain matmul and softmax (slowest; for debugging). auto: "
        "flash_attention_2 on CUDA when flash_attn imports and model.dtype is bfloat16 or float16, else sdpa. A choice "
        "that cannot run is refused (exit 2), never replaced; trainer.parallelism.context > 1 runs its own sdpa "
        "attention (auto or sdpa). The trainer logs what it chose."))
    topology_request: TopologyRequest | None = Field(None, description=(
        "Kueue topology-aware scheduling of the ranks (needs the experiment queued in Kueue on a flavour with a topologyName): "
        "admitted only when all of them fit on free nodes, each rank placed on the node Kueue assigns. Unset: on such a "
        "flavour Kueue still places them (unconstrained); elsewhere the scheduler places them one by one."))

    @property
    def world_size(self) -> int:
        return self.nodes * max(self.accelerator.count, 1)

    def check(self) -> None:
        """Cross-field rules; RLExperimentSpec calls this once `allocation` has filled the fields."""
        p = self.parallelism
        if p.data is not None and p.data * p.tensor * p.pipeline * p.context != self.world_size:
            raise ValueError("trainer.parallelism data*tensor*pipeline*context must equal nodes * accelerator.count")
        if self.backend != "megatron" and (p.tensor, p.pipeline) != (1, 1):
            raise ValueError(TPE_NEED_MEGATRON)
        if p.context != 1 and p.expert != 1 and self.backend == "megatron":
            raise FieldError("spec.trainer.parallelism.context", p.context, MEGATRON_CONTEXT_EXPERT)
        if self.backend == "megatron" and self.world_size % (p.tensor * p.pipeline * p.context):
            raise FieldError("spec.trainer.parallelism", f"tensor {p.tensor} x pipeline {p.pipeline} x context {p.context}", MEGATRON_TP_PP_DIVIDE)
        if p.expert != 1 and self.backend != "megatron":
            raise FieldError("spec.trainer.parallelism.expert", p.expert, EXPERT_NEED_MEGATRON)
        if p.expert != 1 and self.backend == "megatron" and not self.world_size % (p.tensor * p.pipeline):
            if p.tensor != 1:
                raise FieldError("spec.trainer.parallelism.expert", p.expert, MEGATRON_EXPERT_TENSOR)
            if (self.world_size // p.pipeline) % p.expert:
                raise FieldError("spec.trainer.parallelism.expert", p.expert, MEGATRON_EXPERT_DIVIDE)
        if p.context != 1 and p.data is None and self.backend != "megatron" and self.world_size % p.context:
            raise FieldError("spec.trainer.parallelism.context", p.context, CONTEXT_DIVIDE)
        self._check_attention()

    def _check_attention(self) -> None:
        """trainer.attention against the fields that decide whether it runs (the CRD's rules, here with `allocation` applied)."""
        if self.attention == "flash_attention_2" and self.accelerator.type == AcceleratorType.CPU:
            raise FieldError("spec.trainer.attention", self.attention, ATTENTION_FLASH_CPU)
        if self.attention != "auto" and self.backend == "megatron":
            raise FieldError("spec.trainer.attention", self.attention, ATTENTION_MEGATRON)
        if self.attention not in ("auto", "sdpa") and self.parallelism.context != 1:
            raise FieldError("spec.trainer.attention", self.attention, ATTENTION_CONTEXT)


# ---------------------------------------------------------------------------------------------
# Infrastructure: weight sync, bus, checkpoint, lifecycle
# ---------------------------------------------------------------------------------------------

