"""The RLExperiment API (kuberl.io/v1alpha1): pydantic models of spec and status.

The single source of truth: the CRD (`kuberl crd`), `kuberl validate`, the operator's builders and
every runtime role derive from these classes. Field names are the manifest's camelCase; Python code
uses the snake_case attributes. Cross-field rules are declared twice on purpose, in the same words:
as CEL (`x-kubernetes-validations`, enforced by the API server at admission) and as pydantic
validators (enforced by `kuberl run`, which has no API server). `tests/unit/test_api.py` keeps the
two in step.

The classes live in modules by part (base, pods, workflow, algorithm, roles, infra, status; tracking and
evaluation in their own); this module assembles RLExperimentSpec and RLExperiment from them and
re-exports every name, so `from kuberl.api.v1alpha1 import X` keeps working.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kuberl.api.algorithm import (
    LORA_NEEDS_VLLM,
    PPO_UNSUPPORTED,
    TOP_P_UNSUPPORTED,
    AlgorithmName,
    AlgorithmSpec,
    OptimizerSpec,
    OverlongPenaltySpec,
    StalenessSpec,
)
from kuberl.api.base import (
    ACCELERATOR_RESOURCE,
    ALLOCATION_PATTERN,
    API_VERSION,
    CATEGORIES,
    DNS1035_LABEL,
    DNS1123_LABEL,
    GROUP,
    KIND,
    PLURAL,
    QUANTITY_PATTERN,
    SHORT_NAMES,
    SINGULAR,
    VERSION,
    AcceleratorSpec,
    AcceleratorType,
    FieldError,
    KubeModel,
    Quantity,
    ResourceRequirements,
    SecretKeyRef,
    VolumeRef,
    _cel,
    _or,
)
from kuberl.api.evaluation import EvalProgress, EvaluationSpec
from kuberl.api.infra import (
    BROADCAST_NEEDS_VLLM,
    BROADCAST_NO_LORA,
    KEEP_NEEDS_VLLM_FILES,
    BusSpec,
    CheckpointSpec,
    EmbeddedBusSpec,
    ExternalBusSpec,
    FailurePolicySpec,
    TrainingSpec,
    WeightSyncSpec,
)
from kuberl.api.pods import (
    FABRIC_CAPABILITIES,
    OVERRIDE_ENV_MESSAGE,
    OVERRIDE_LABEL_MESSAGE,
    OVERRIDE_VOLUME_MESSAGE,
    RESERVED_ENV_PREFIX,
    RESERVED_LABEL_PREFIXES,
    RESERVED_VOLUMES,
    EnvVar,
    LocalObjectReference,
    PodTemplateOverride,
    SchedulingSpec,
    Sidecar,
)
from kuberl.api.roles import (
    ALLOCATION_CONTEXT_EXPERT,
    ALLOCATION_DIM_TWICE,
    ALLOCATION_DIM_ZERO,
    ALLOCATION_EXPERT_DIVIDE,
    ALLOCATION_EXPERT_NEED_MEGATRON,
    ALLOCATION_EXPERT_TENSOR,
    ALLOCATION_FSDP_ONLY_D,
    ALLOCATION_NODE_SPLIT,
    ALLOCATION_REPLICAS_RANGE,
    ASCEND_IMAGE_MESSAGE,
    ASCEND_IMAGE_RULE,
    ATTENTION_CONTEXT,
    ATTENTION_MEGATRON,
    CONTEXT_DIVIDE,
    EXPERT_NEED_MEGATRON,
    KUEUE_QUEUE_LABEL,
    MEGATRON_ASYNC_CHECKPOINT,
    MEGATRON_CONTEXT_EXPERT,
    MEGATRON_EXPERT_DIVIDE,
    MEGATRON_EXPERT_TENSOR,
    MEGATRON_FULL_WEIGHTS,
    MEGATRON_ON_ASCEND,
    MEGATRON_TP_PP_DIVIDE,
    TOPOLOGY_NEEDS_QUEUE,
    TOPOLOGY_ONE,
    TPE_NEED_MEGATRON,
    AutoscalingSpec,
    EngineName,
    ParallelismSpec,
    RolloutSpec,
    TopologyRequest,
    TrainerSpec,
    allocation_disagrees,
)
from kuberl.api.status import CheckpointStatus, Condition, ConditionType, Phase, RLExperimentStatus, RoleStatus, TrainingProgress
from kuberl.api.tracking import TrackingSpec
from kuberl.api.workflow import (
    PROMPT_SYSTEM_CHAT,
    AgentExportStyle,
    DatasetSpec,
    ExternalAgentSpec,
    ModelSpec,
    PromptSpec,
    SandboxPlacement,
    SandboxSpec,
    WorkflowSpec,
    WorkflowType,
)

__all__ = [
    "ACCELERATOR_RESOURCE",
    "ALLOCATION_CONTEXT_EXPERT",
    "ALLOCATION_EXPERT_DIVIDE",
    "ALLOCATION_EXPERT_NEED_MEGATRON",
    "ALLOCATION_EXPERT_TENSOR",
    "ALLOCATION_DIM_TWICE",
    "ALLOCATION_DIM_ZERO",
    "ALLOCATION_FSDP_ONLY_D",
    "ALLOCATION_NODE_SPLIT",
    "ALLOCATION_REPLICAS_RANGE",
    "allocation_disagrees",
    "ALLOCATION_PATTERN",
    "API_VERSION",
    "ASCEND_IMAGE_MESSAGE",
    "ASCEND_IMAGE_RULE",
    "AcceleratorSpec",
    "AcceleratorType",
    "AgentExportStyle",
    "AlgorithmName",
    "AlgorithmSpec",
    "AutoscalingSpec",
    "BusSpec",
    "CATEGORIES",
    "CONTEXT_DIVIDE",
    "KUEUE_QUEUE_LABEL",
    "CheckpointSpec",
    "CheckpointStatus",
    "Condition",
    "ConditionType",
    "DNS1123_LABEL",
    "DatasetSpec",
    "EmbeddedBusSpec",
    "EngineName",
    "EnvVar",
    "EvalProgress",
    "EvaluationSpec",
    "ExternalBusSpec",
    "FailurePolicySpec",
    "FieldError",
    "GROUP",
    "KIND",
    "KubeModel",
    "LocalObjectReference",
    "EXPERT_NEED_MEGATRON",
    "MEGATRON_CONTEXT_EXPERT",
    "MEGATRON_EXPERT_DIVIDE",
    "MEGATRON_EXPERT_TENSOR",
    "MEGATRON_FULL_WEIGHTS",
    "MEGATRON_ASYNC_CHECKPOINT",
    "MEGATRON_ON_ASCEND",
    "MEGATRON_TP_PP_DIVIDE",
    "ModelSpec",
    "OVERRIDE_ENV_MESSAGE",
    "OVERRIDE_LABEL_MESSAGE",
    "OVERRIDE_VOLUME_MESSAGE",
    "ObjectMeta",
    "OptimizerSpec",
    "OverlongPenaltySpec",
    "PLURAL",
    "PPO_UNSUPPORTED",
    "ParallelismSpec",
    "Phase",
    "PodTemplateOverride",
    "Sidecar",
    "FABRIC_CAPABILITIES",
    "QUANTITY_PATTERN",
    "Quantity",
    "RESERVED_ENV_PREFIX",
    "RESERVED_LABEL_PREFIXES",
    "RESERVED_VOLUMES",
    "RLExperiment",
    "RLExperimentSpec",
    "RLExperimentStatus",
    "ResourceRequirements",
    "RoleStatus",
    "RolloutSpec",
    "SHORT_NAMES",
    "SINGULAR",
    "PromptSpec",
    "SandboxPlacement",
    "SandboxSpec",
    "ExternalAgentSpec",
    "SchedulingSpec",
    "SecretKeyRef",
    "StalenessSpec",
    "TOP_P_UNSUPPORTED",
    "TOPOLOGY_NEEDS_QUEUE",
    "TOPOLOGY_ONE",
    "TPE_NEED_MEGATRON",
    "TrackingSpec",
    "TopologyRequest",
    "TrainerSpec",
    "TrainingProgress",
    "TrainingSpec",
    "VERSION",
    "VolumeRef",
    "WeightSyncSpec",
    "WorkflowSpec",
    "WorkflowType",
]


_RP = "self.rollout"
_TP = "self.trainer.parallelism"
_WORLD = ("(has(self.trainer.nodes) ? self.trainer.nodes : 1) * "
          "(has(self.trainer.accelerator.count) && self.trainer.accelerator.count > 0 ? self.trainer.accelerator.count : 1)")


# The allocation shorthand read in CEL (issue #36): a dimension's number is found with the regex library's find() (the
# rollout half is anchored at the start, the trainer half after the '+'; digits never follow a letter of an engine or
# backend name), then int(); an absent dimension is 1. allocation has a maxLength, so the estimated cost stays small.
def _dim(half: str, key: str) -> str:
    pattern = ("^[a-z]+:" if half == "rollout" else "[+][a-z]+:") + f"[a-z0-9]*{key}[0-9]+"
    return f"(self.allocation.find('{pattern}') == '' ? 1 : int(self.allocation.find('{pattern}').find('[0-9]+$')))"


_AW = "(" + " * ".join(_dim("trainer", k) for k in "dtpc") + ")"  # the trainer's world size d*t*p*c
_TC = "self.trainer.accelerator.count"


def _agrees(path: str, value: str) -> tuple[str, str, str]:
    """A field the shorthand fills, set in the manifest too: the two must agree (the model's check in apply_allocation)."""
    field = f"self.{path}"
    return (f"!has(self.allocation) || !has({field}) || {field} == {value}",
            allocation_disagrees(path), f".{path}")



class RLExperimentSpec(KubeModel):
    """What to train, on what, with which algorithm, and where: one manifest for `kubectl apply` and `kuberl run`."""

    # Rules over fields that `allocation` may fill: without `allocation`, unset fields take the models'
    # defaults, exactly as the pydantic side does; with it, the shorthand's own rules below read its numbers
    # (find() and int()) and refuse a field that contradicts it, as apply_allocation does after expansion.
    model_config = _cel(
        ((f"has(self.allocation) || {_RP}.accelerator.type == 'cpu' || !has({_RP}.accelerator.count) || "
          f"{_RP}.accelerator.count == {_or(_RP + '.tensorParallelSize', 1)} * {_or(_RP + '.pipelineParallelSize', 1)}"),
         "rollout.accelerator.count must equal tensorParallelSize * pipelineParallelSize", ".rollout.accelerator.count"),
        ((f"has(self.allocation) || !has({_TP}.data) || {_TP}.data * {_or(_TP + '.tensor', 1)} * {_or(_TP + '.pipeline', 1)} * {_or(_TP + '.context', 1)} == "
          f"{_or('self.trainer.nodes', 1)} * (has(self.trainer.accelerator.count) && self.trainer.accelerator.count > 0 ? self.trainer.accelerator.count : 1)"),
         "trainer.parallelism data*tensor*pipeline*context must equal nodes * accelerator.count", ".trainer.parallelism"),
        ((f"has(self.allocation) || {_or('self.trainer.backend', 'fsdp')} == 'megatron' || "
          f"({_or(_TP + '.tensor', 1)} == 1 && {_or(_TP + '.pipeline', 1)} == 1)"),
         TPE_NEED_MEGATRON, ".trainer.backend"),
        ((f"has(self.allocation) || {_or('self.trainer.backend', 'fsdp')} != 'megatron' || "
          f"({_or('self.trainer.nodes', 1)} * (has(self.trainer.accelerator.count) && self.trainer.accelerator.count > 0 ? "
          f"self.trainer.accelerator.count : 1)) % ({_or(_TP + '.tensor', 1)} * {_or(_TP + '.pipeline', 1)} * {_or(_TP + '.context', 1)}) == 0"),
         MEGATRON_TP_PP_DIVIDE, ".trainer.parallelism"),
        (f"has(self.allocation) || {_or(_TP + '.expert', 1)} == 1 || {_or('self.trainer.backend', 'fsdp')} == 'megatron'",
         EXPERT_NEED_MEGATRON, ".trainer.parallelism.expert"),
        # Megatron's experts (tensor 1: MoE under tensor parallelism needs sequence parallelism) are cut over data-parallel
        # ranks: expert divides world / pipeline. Both only where tensor x pipeline divides the world (else that rule speaks).
        ((f"has(self.allocation) || {_or(_TP + '.expert', 1)} == 1 || {_or('self.trainer.backend', 'fsdp')} != 'megatron' || "
          f"{_WORLD} % ({_or(_TP + '.tensor', 1)} * {_or(_TP + '.pipeline', 1)}) != 0 || {_or(_TP + '.tensor', 1)} == 1"),
         MEGATRON_EXPERT_TENSOR, ".trainer.parallelism.expert"),
        ((f"has(self.allocation) || {_or(_TP + '.expert', 1)} == 1 || {_or('self.trainer.backend', 'fsdp')} != 'megatron' || "
          f"{_WORLD} % ({_or(_TP + '.tensor', 1)} * {_or(_TP + '.pipeline', 1)}) != 0 || {_or(_TP + '.tensor', 1)} != 1 || "
          f"({_WORLD} / {_or(_TP + '.pipeline', 1)}) % {_or(_TP + '.expert', 1)} == 0"),
         MEGATRON_EXPERT_DIVIDE, ".trainer.parallelism.expert"),
        # Context parallel: fsdp (Ulysses; consecutive ranks form a CP group, so context divides the world: the data rule above
        # speaks where data is set) and megatron (tensor*pipeline*context divides the world, the rule above; not with experts).
        (f"has(self.allocation) || {_or(_TP + '.context', 1)} == 1 || {_or(_TP + '.expert', 1)} == 1 || "
         f"{_or('self.trainer.backend', 'fsdp')} != 'megatron'", MEGATRON_CONTEXT_EXPERT, ".trainer.parallelism.context"),
        (f"has(self.allocation) || has({_TP}.data) || {_or('self.trainer.backend', 'fsdp')} == 'megatron' || "
         f"{_WORLD} % {_or(_TP + '.context', 1)} == 0", CONTEXT_DIVIDE, ".trainer.parallelism.context"),
        # The shorthand itself, read with find() and int() (see _dim): the checks of parse_allocation and apply_allocation.
        ("!has(self.allocation) || !self.allocation.matches('[a-z]0+([^0-9]|$)')", ALLOCATION_DIM_ZERO, ".allocation"),
        ("!has(self.allocation) || (!self.allocation.matches('^[a-z]+:[a-z0-9]*(d[a-z0-9]*d|t[a-z0-9]*t|p[a-z0-9]*p)') && "
         "!self.allocation.matches('[+][a-z]+:[a-z0-9]*(d[a-z0-9]*d|t[a-z0-9]*t|p[a-z0-9]*p|c[a-z0-9]*c|e[a-z0-9]*e)'))",
         ALLOCATION_DIM_TWICE, ".allocation"),
        ("!has(self.allocation) || !self.allocation.matches('[+]fsdp:[a-z0-9]*[tp]0*([2-9]|[1-9][0-9]+)')",
         ALLOCATION_FSDP_ONLY_D, ".allocation"),
        ("!has(self.allocation) || !has(self.rollout.engine) || self.allocation.startsWith(self.rollout.engine + ':')",
         allocation_disagrees("rollout.engine"), ".rollout.engine"),
        ("!has(self.allocation) || !has(self.trainer.backend) || self.allocation.contains('+' + self.trainer.backend + ':')",
         allocation_disagrees("trainer.backend"), ".trainer.backend"),
        _agrees("rollout.tensorParallelSize", _dim("rollout", "t")),
        _agrees("rollout.pipelineParallelSize", _dim("rollout", "p")),
        _agrees("rollout.accelerator.count", f"{_dim('rollout', 't')} * {_dim('rollout', 'p')}"),
        *(_agrees(f"trainer.parallelism.{name}", _dim("trainer", key))
          for name, key in (("data", "d"), ("tensor", "t"), ("pipeline", "p"), ("context", "c"), ("expert", "e"))),
        # The trainer's d*t*p*c accelerators in nodes of trainer.accelerator.count (unset: one node up to 8, else nodes of 8).
        (f"!has(self.allocation) || (has({_TC}) ? {_TC} != 0 && {_AW} % {_TC} == 0 : {_AW} <= 8 || {_AW} % 8 == 0)",
         ALLOCATION_NODE_SPLIT, ".trainer.accelerator.count"),
        (f"!has(self.allocation) || !has(self.trainer.nodes) || (has({_TC}) ? {_TC} == 0 || {_AW} % {_TC} != 0 || "
         f"self.trainer.nodes * {_TC} == {_AW} : ({_AW} <= 8 ? self.trainer.nodes == 1 : {_AW} % 8 != 0 || self.trainer.nodes * 8 == {_AW}))",
         allocation_disagrees("trainer.nodes"), ".trainer.nodes"),
        # rollout d is the replica count only where rollout.replicas is unset (the RolloutSpec rule checks an explicit one)
        ("!has(self.allocation) || has(self.rollout.replicas) || !self.rollout.autoscaling.enabled || "
         f"({_or('self.rollout.autoscaling.minReplicas', 1)} <= {_dim('rollout', 'd')} && "
         f"{_dim('rollout', 'd')} <= {_or('self.rollout.autoscaling.maxReplicas', 1)})",
         ALLOCATION_REPLICAS_RANGE, ".rollout.replicas"),
        ("!has(self.allocation) || !self.allocation.matches('c0*([2-9]|[1-9][0-9]+)') || !self.allocation.matches('e0*([2-9]|[1-9][0-9]+)')",
         ALLOCATION_CONTEXT_EXPERT, ".allocation"),
        (f"!has(self.allocation) || {_dim('trainer', 'e')} == 0 || {_dim('trainer', 'd')} % {_dim('trainer', 'e')} == 0",
         ALLOCATION_EXPERT_DIVIDE, ".allocation"),
        ("!has(self.allocation) || !self.allocation.matches('e0*([2-9]|[1-9][0-9]+)') || self.allocation.contains('+megatron:')",
         ALLOCATION_EXPERT_NEED_MEGATRON, ".allocation"),
        ("!has(self.allocation) || !self.allocation.matches('e0*([2-9]|[1-9][0-9]+)') || "
         "!self.allocation.matches('megatron:[a-z0-9]*t0*([2-9]|[1-9][0-9]+)')", ALLOCATION_EXPERT_TENSOR, ".allocation"),
        # trainer.attention: megatron and context parallel run their own attention (either may come from `allocation`).
        ("!has(self.trainer.attention) || self.trainer.attention == 'auto' || "
         f"!(has(self.allocation) ? self.allocation.contains('+megatron:') : {_or('self.trainer.backend', 'fsdp')} == 'megatron')",
         ATTENTION_MEGATRON, ".trainer.attention"),
        ("!has(self.trainer.attention) || self.trainer.attention in ['auto', 'sdpa'] || "
         f"(has(self.allocation) ? {_dim('trainer', 'c')} : (has(self.trainer.parallelism) && has(self.trainer.parallelism.context) ? "
         "self.trainer.parallelism.context : 1)) <= 1", ATTENTION_CONTEXT, ".trainer.attention"),
        # The megatron trainer (with or without the shorthand): full weights through disk or the bus.
        ((f"!(has(self.allocation) ? self.allocation.contains('+megatron:') : {_or('self.trainer.backend', 'fsdp')} == 'megatron') || "
          f"(!has(self.algorithm.lora) && (!has(self.weightSync) || {_or('self.weightSync.mode', 'disk')} != 'broadcast'))"),
         MEGATRON_FULL_WEIGHTS, ".trainer.backend"),
        ((f"!(has(self.allocation) ? self.allocation.contains('+megatron:') : {_or('self.trainer.backend', 'fsdp')} == 'megatron') || "
          f"{_or('self.trainer.accelerator.type', 'nvidia')} != 'ascend'"),
         MEGATRON_ON_ASCEND, ".trainer.backend"),
        ((f"!(has(self.allocation) ? self.allocation.contains('+megatron:') : {_or('self.trainer.backend', 'fsdp')} == 'megatron') || "
          f"!has(self.checkpoint) || {_or('self.checkpoint.asyncSave', 'auto')} != 'on'"),
         MEGATRON_ASYNC_CHECKPOINT, ".checkpoint.asyncSave"),
        # LoRA: adapters hot-loaded by vLLM only (the shorthand names the engine first). Only the fsdp trainer wraps
        # the model with PEFT; the megatron backend refuses LoRA above.
        (f"!has(self.algorithm.lora) || (has(self.allocation) ? self.allocation.startsWith('vllm:') : {_or(_RP + '.engine', 'vllm')} == 'vllm')",
         LORA_NEEDS_VLLM, ".algorithm.lora"),
        # weightSync.mode broadcast: engines receive through the vLLM worker extension; full weights only (no LoRA).
        (f"!has(self.weightSync) || {_or('self.weightSync.mode', 'disk')} != 'broadcast' || "
         f"(has(self.allocation) ? self.allocation.startsWith('vllm:') : {_or(_RP + '.engine', 'vllm')} == 'vllm')",
         BROADCAST_NEEDS_VLLM, ".weightSync.mode"),
        (f"!has(self.weightSync) || {_or('self.weightSync.mode', 'disk')} != 'broadcast' || !has(self.algorithm.lora)",
         BROADCAST_NO_LORA, ".weightSync.mode"),
        (f"!has(self.weightSync) || {_or('self.weightSync.inFlight', 'abort')} != 'keep' || "
         f"({_or('self.weightSync.mode', 'disk')} != 'broadcast' && !has(self.algorithm.lora) && "
         f"(has(self.allocation) ? self.allocation.startsWith('vllm:') : {_or(_RP + '.engine', 'vllm')} == 'vllm'))",
         KEEP_NEEDS_VLLM_FILES, ".weightSync.inFlight"),
        # A system message needs the chat template, which only the builtin single/multi-turn workflows apply.
        ("!has(self.dataset.prompt) || !has(self.dataset.prompt.system) || !has(self.workflow) || "
         "((has(self.workflow.useChatTemplate) ? self.workflow.useChatTemplate : true) && "
         f"{_or('self.workflow.type', 'rlvr')} in ['rlvr', 'multi-turn'])", PROMPT_SYSTEM_CHAT, ".dataset.prompt.system"),
    )

    model: ModelSpec = Field(description="The policy model.")
    dataset: DatasetSpec = Field(description="Prompts and reference answers.")
    workflow: WorkflowSpec = Field(default_factory=WorkflowSpec, description="How one item becomes a trajectory group.")
    algorithm: AlgorithmSpec = Field(default_factory=AlgorithmSpec, description="Advantages and loss.")
    staleness: StalenessSpec = Field(default_factory=StalenessSpec, description="Bounded off-policyness.")
    rollout: RolloutSpec = Field(default_factory=RolloutSpec, description="Inference engines and rollout agents.")
    trainer: TrainerSpec = Field(default_factory=TrainerSpec, description="The trainer.")
    allocation: str | None = Field(
        None,
        description="AReaL allocation shorthand, e.g. sglang:d4+fsdp:d4 or vllm:d2t2+megatron:d2p2t2; "
                    "expands into rollout and trainer fields and is rejected when it contradicts them.",
        pattern=ALLOCATION_PATTERN,
        max_length=64,
    )
    weight_sync: WeightSyncSpec = Field(default_factory=WeightSyncSpec, description="How new weights reach the engines.")
    bus: BusSpec = Field(default_factory=lambda: BusSpec(embedded=EmbeddedBusSpec()), description="The trajectory bus.")
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec, description="Checkpoints.")
    training: TrainingSpec = Field(default_factory=lambda: TrainingSpec(epochs=1), description="Training length.")
    suspend: bool = Field(False, description="Checkpoint and scale everything to zero; false again resumes from the checkpoint.")
    ttl_seconds_after_finished: int | None = Field(None, ge=0, description="Delete the experiment this long after it succeeds or fails.")
    failure_policy: FailurePolicySpec = Field(default_factory=FailurePolicySpec, description="Restarts and backoff.")
    tracking: TrackingSpec | None = Field(None, description="Experiment trackers (TensorBoard, W&B, MLflow) for every step's metrics; "
                                          "unset: metrics.jsonl only.")
    evaluation: EvaluationSpec | None = Field(None, description="Held-out evaluation every N steps (reward, greedy and sampled pass@k); unset: none.")
    seed: int = Field(1, ge=0, description="Random seed (data order, sampling, init).")
    managed_by: str | None = Field(
        None, max_length=63, pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[-a-zA-Z0-9._]+$",
        description="The controller that runs this experiment; unset or kuberl.io/operator: the KubeRL operator. Any other value "
        "(e.g. kueue.x-k8s.io/multikueue) leaves it alone: no children, no status writes. Set it at creation.",
    )

    @model_validator(mode="after")
    def _expand_allocation(self) -> RLExperimentSpec:
        r = self.rollout
        if self.allocation is not None:
            from kuberl.api.allocation import apply_allocation

            apply_allocation(self)
        elif "count" not in r.accelerator.model_fields_set:
            object.__setattr__(r.accelerator, "count", r.tensor_parallel_size * r.pipeline_parallel_size)
        if r.accelerator.type != AcceleratorType.CPU and r.accelerator.count != r.tensor_parallel_size * r.pipeline_parallel_size:
            raise FieldError("spec.rollout.accelerator.count", r.accelerator.count,
                             "rollout.accelerator.count must equal tensorParallelSize * pipelineParallelSize")
        self.trainer.check()
        if self.trainer.backend == "megatron" and (self.algorithm.lora is not None or self.weight_sync.mode == "broadcast"):
            raise FieldError("spec.trainer.backend", "megatron", MEGATRON_FULL_WEIGHTS)
        if self.trainer.backend == "megatron" and self.trainer.accelerator.type == AcceleratorType.ASCEND:
            raise FieldError("spec.trainer.backend", "megatron", MEGATRON_ON_ASCEND)
        if self.trainer.backend == "megatron" and self.checkpoint.async_save == "on":
            raise FieldError("spec.checkpoint.asyncSave", "on", MEGATRON_ASYNC_CHECKPOINT)
        if self.algorithm.lora is not None and r.engine != "vllm":
            raise FieldError("spec.algorithm.lora", "set", LORA_NEEDS_VLLM)
        if self.weight_sync.mode == "broadcast" and r.engine != "vllm":
            raise FieldError("spec.weightSync.mode", "broadcast", BROADCAST_NEEDS_VLLM)
        if self.weight_sync.mode == "broadcast" and self.algorithm.lora is not None:
            raise FieldError("spec.weightSync.mode", "broadcast", BROADCAST_NO_LORA)
        if self.weight_sync.in_flight == "keep" and (r.engine != "vllm" or self.weight_sync.mode == "broadcast" or self.algorithm.lora is not None):
            raise FieldError("spec.weightSync.inFlight", "keep", KEEP_NEEDS_VLLM_FILES)
        prompt, w = self.dataset.prompt, self.workflow
        if prompt is not None and prompt.system is not None and (not w.use_chat_template or w.type not in (WorkflowType.RLVR, WorkflowType.MULTI_TURN)):
            raise FieldError("spec.dataset.prompt.system", "set", PROMPT_SYSTEM_CHAT)
        return self

    @property
    def in_flight(self) -> Literal["abort", "keep"]:
        """What a weight update does to generations in flight: weightSync.inFlight, or when unset the faster of the two
        where the engine implements it (keep: vLLM with full weights through disk or the bus), else abort."""
        if self.weight_sync.in_flight is not None:
            return self.weight_sync.in_flight
        keep = self.rollout.engine == "vllm" and self.weight_sync.mode != "broadcast" and self.algorithm.lora is None
        return "keep" if keep else "abort"


# ---------------------------------------------------------------------------------------------
# Status
# ---------------------------------------------------------------------------------------------

class ObjectMeta(BaseModel):
    """The part of metav1.ObjectMeta KubeRL reads; everything else is kept as it is."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)
    # 52: room for "-rollout-NN" child names; DNS-1035 (a letter first): its Services are named after it
    name: str = Field(min_length=1, max_length=52, pattern=DNS1035_LABEL)
    namespace: str = "default"
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)


class RLExperiment(BaseModel):
    """An RLExperiment: the whole run in one object."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    api_version: Literal["kuberl.io/v1alpha1"] = Field(API_VERSION, alias="apiVersion")
    kind: Literal["RLExperiment"] = KIND
    metadata: ObjectMeta
    spec: RLExperimentSpec
    status: RLExperimentStatus | None = None

    @property
    def name(self) -> str:
        return self.metadata.name

    @property
    def namespace(self) -> str:
        return self.metadata.namespace

    def to_manifest(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")

    @model_validator(mode="after")
    def _topology_needs_kueue(self) -> RLExperiment:
        """Topology-aware scheduling is Kueue's: without the queue label nothing would honour it (CEL cannot read labels)."""
        if self.spec.trainer.topology_request is not None and not self.metadata.labels.get(KUEUE_QUEUE_LABEL):
            raise FieldError("spec.trainer.topologyRequest", "set", TOPOLOGY_NEEDS_QUEUE)
        return self
