"""The RLExperiment API (kuberl.io/v1alpha1): pydantic models of spec and status.

The single source of truth: the CRD (`kuberl crd`), `kuberl validate`, the operator's builders and
every runtime role derive from these classes. Field names are the manifest's camelCase; Python code
uses the snake_case attributes. Cross-field rules are declared twice on purpose, in the same words:
as CEL (`x-kubernetes-validations`, enforced by the API server at admission) and as pydantic
validators (enforced by `kuberl run`, which has no API server). `tests/unit/test_api.py` keeps the
two in step.
"""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel

GROUP = "kuberl.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "RLExperiment"
PLURAL = "rlexperiments"
SINGULAR = "rlexperiment"
SHORT_NAMES = ["rlx"]
CATEGORIES = ["kuberl"]

# Kubernetes resource.Quantity, as the API server parses it (apimachinery/pkg/api/resource).
QUANTITY_PATTERN = r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
# AReaL's allocation grammar: "<engine>:<dims>+<backend>:<dims>", dims like d4, d2t2, d2p2t2c1e1.
ALLOCATION_PATTERN = r"^(sglang|vllm):([dtp][0-9]+)+\+(fsdp|megatron):([dtpce][0-9]+)+$"
DNS1123_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"

Quantity = Annotated[
    int | str,
    Field(
        json_schema_extra={"x-kubernetes-int-or-string": True, "pattern": QUANTITY_PATTERN},
        union_mode="left_to_right",
    ),
]


class FieldError(ValueError):
    """A rejected value with the manifest path it sits at (`spec.rollout.replicas`), for error reports."""

    def __init__(self, path: str, value: Any, message: str) -> None:
        super().__init__(message)
        self.path = path
        self.value = value


def _check_quantity(value: int | str, path: str) -> None:
    if isinstance(value, str) and not re.match(QUANTITY_PATTERN, value):
        raise ValueError(f"{path}: {value!r} is not a Kubernetes quantity (e.g. 10Gi, 500m, 2)")


class KubeModel(BaseModel):
    """Base of every API model: camelCase in manifests, unknown fields rejected (as admission does)."""

    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", use_enum_values=True
    )

    def to_manifest(self) -> dict[str, Any]:
        """The manifest form: camelCase keys, unset optional fields left out."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


def _cel(*rules: tuple[str, str] | tuple[str, str, str]) -> ConfigDict:
    """Attach CEL rules (rule, message[, fieldPath]) to a model's schema as x-kubernetes-validations.

    fieldPath (relative to the model, e.g. `.rollout.accelerator.count`) is where the API server
    reports a failure; rules that need fields of several blocks live on the parent and point down.
    """
    out = []
    for rule, msg, *field_path in rules:
        out.append({"rule": rule, "message": msg} | ({"fieldPath": field_path[0]} if field_path else {}))
    return ConfigDict(json_schema_extra={"x-kubernetes-validations": out})


def _or(path: str, default: int | str) -> str:
    """CEL for `path` or its default when absent (fields the allocation shorthand fills have no CRD default)."""
    fallback = f"'{default}'" if isinstance(default, str) else str(default)
    return f"(has({path}) ? {path} : {fallback})"


# ---------------------------------------------------------------------------------------------
# Shared pieces
# ---------------------------------------------------------------------------------------------


class SecretKeyRef(KubeModel):
    """A key of a Secret in the experiment's namespace. Its value never lands in a ConfigMap."""

    name: str = Field(description="Name of the Secret.", min_length=1, pattern=DNS1123_LABEL.replace("[-a-z0-9]", "[-.a-z0-9]"))
    key: str = Field("token", description="Key inside the Secret.", min_length=1)


class VolumeRef(KubeModel):
    """A PersistentVolumeClaim that holds a model or a data set, mounted read-only."""

    claim_name: str = Field(description="Name of an existing PersistentVolumeClaim.", min_length=1)
    sub_path: str = Field("", description="Folder inside the claim to mount (empty = the root).")


class ResourceRequirements(KubeModel):
    """Container resources, as in a Pod spec (accelerators are set by `accelerator`, not here)."""

    requests: dict[str, Quantity] = Field(default_factory=dict, max_length=16, description="Minimum resources, e.g. {cpu: 4, memory: 32Gi}.")
    limits: dict[str, Quantity] = Field(default_factory=dict, max_length=16, description="Maximum resources.")

    @model_validator(mode="after")
    def _quantities(self) -> ResourceRequirements:
        for part in ("requests", "limits"):
            for name, value in getattr(self, part).items():
                _check_quantity(value, f"{part}.{name}")
        return self


class AcceleratorType(StrEnum):
    """Which accelerator a pod asks for; the operator maps it to a resource name."""

    NVIDIA = "nvidia"  # nvidia.com/gpu
    ASCEND = "ascend"  # huawei.com/Ascend910, with the NPU image
    CPU = "cpu"  # no device: count = processes (trainer) or nothing (rollout)


ACCELERATOR_RESOURCE = {AcceleratorType.NVIDIA: "nvidia.com/gpu", AcceleratorType.ASCEND: "huawei.com/Ascend910"}


class AcceleratorSpec(KubeModel):
    type: AcceleratorType = Field(AcceleratorType.NVIDIA, description="nvidia (nvidia.com/gpu), ascend (huawei.com/Ascend910) or cpu.")
    count: int = Field(
        1, ge=0, le=64,
        description="Accelerators per pod (rollout replica or trainer node). Default: from `allocation` when set, "
                    "else rollout tensorParallelSize * pipelineParallelSize, trainer 1.",
    )


# Pod template overrides: label and annotation keys, env names and volume names the operator owns.
RESERVED_LABEL_PREFIXES = ("kuberl.io/", "app.kubernetes.io/")
RESERVED_ENV_PREFIX = "KUBERL_"
RESERVED_VOLUMES = ("config", "dshm", "cache", "workdir", "checkpoints", "model", "dataset")
OVERRIDE_LABEL_MESSAGE = ("podTemplate.labels and podTemplate.annotations must not use the kuberl.io/ or app.kubernetes.io/ prefixes "
                          "(the operator's selectors and bookkeeping)")
OVERRIDE_ENV_MESSAGE = "podTemplate.env must not set KUBERL_* variables (the operator sets them from the spec)"
OVERRIDE_VOLUME_MESSAGE = "podTemplate.volumes must not reuse the names config, dshm, cache, workdir, checkpoints, model or dataset"
_FREE_FORM_ITEMS = {"items": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}}


class EnvVar(KubeModel):
    """An environment variable (core/v1 EnvVar): a value, or valueFrom (secretKeyRef, configMapKeyRef, fieldRef, ...)."""

    name: str = Field(description="Variable name.", min_length=1, max_length=256, pattern=r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
    value: str | None = Field(None, description="Value.")
    value_from: dict[str, Any] | None = Field(
        None, description="Source of the value (core/v1 EnvVarSource).", json_schema_extra={"x-kubernetes-preserve-unknown-fields": True}
    )


class LocalObjectReference(KubeModel):
    name: str = Field(description="Name of an object in the experiment's namespace.", min_length=1, max_length=253)


class PodTemplateOverride(KubeModel):
    """Additions to a role's pods, merged into what the operator renders (like KubeRay's and Kubeflow
    Trainer's podTemplateOverrides): labels, annotations and env merge by key or name (yours win),
    volumes and mounts are added, the pod fields replace the operator's. Every runtime container of the
    role gets the env and the mounts."""

    model_config = _cel(
        ("(!has(self.labels) || self.labels.all(k, !k.startsWith('kuberl.io/') && !k.startsWith('app.kubernetes.io/'))) && "
         "(!has(self.annotations) || self.annotations.all(k, !k.startsWith('kuberl.io/') && !k.startsWith('app.kubernetes.io/')))",
         OVERRIDE_LABEL_MESSAGE, ".labels"),
        ("!has(self.env) || self.env.all(e, !e.name.startsWith('KUBERL_'))", OVERRIDE_ENV_MESSAGE, ".env"),
        ("!has(self.volumes) || self.volumes.all(v, !has(v.name) || !(v.name in ['config', 'dshm', 'cache', 'workdir', 'checkpoints', 'model', 'dataset']))",
         OVERRIDE_VOLUME_MESSAGE, ".volumes"),
    )
    labels: dict[str, str] = Field(default_factory=dict, max_length=64, description="Pod labels, e.g. sidecar.istio.io/inject or a Kueue pod-group label.")
    annotations: dict[str, str] = Field(default_factory=dict, max_length=64,
                                        description="Pod annotations, e.g. cluster-autoscaler.kubernetes.io/safe-to-evict.")
    env: list[EnvVar] = Field(default_factory=list, max_length=64,
                              description="Environment of every runtime container of the role (NCCL_*, HTTP(S)_PROXY, HF_*).")
    volumes: list[dict[str, Any]] = Field(
        default_factory=list, max_length=32, description="Extra pod volumes (core/v1 Volume), each with a name.", json_schema_extra=_FREE_FORM_ITEMS
    )
    volume_mounts: list[dict[str, Any]] = Field(
        default_factory=list, max_length=32, description="Mounts of the extra volumes in every runtime container of the role (core/v1 VolumeMount).",
        json_schema_extra=_FREE_FORM_ITEMS,
    )
    image_pull_secrets: list[LocalObjectReference] = Field(default_factory=list, max_length=16, description="Secrets to pull a private image with.")
    service_account_name: str | None = Field(
        None, min_length=1, max_length=253,
        description="Run as this ServiceAccount (GKE Workload Identity, EKS IRSA/Pod Identity) instead of {experiment}-runtime."
    )
    runtime_class_name: str | None = Field(None, min_length=1, max_length=253, description="RuntimeClass, e.g. nvidia (GPU Operator clusters).")
    scheduler_name: str | None = Field(None, min_length=1, max_length=253, description="Scheduler, e.g. volcano for gang scheduling.")
    topology_spread_constraints: list[dict[str, Any]] = Field(
        default_factory=list, max_length=16, description="core/v1 TopologySpreadConstraints of the pods.", json_schema_extra=_FREE_FORM_ITEMS
    )
    termination_grace_period_seconds: int | None = Field(
        None, ge=0, le=86400, description="Seconds between SIGTERM and SIGKILL (default: 600 for the trainer, which checkpoints on SIGTERM; 30 otherwise)."
    )

    @model_validator(mode="after")
    def _rules(self) -> PodTemplateOverride:
        if any(k.startswith(RESERVED_LABEL_PREFIXES) for k in (*self.labels, *self.annotations)):
            raise ValueError(OVERRIDE_LABEL_MESSAGE)
        if any(e.name.startswith(RESERVED_ENV_PREFIX) for e in self.env):
            raise ValueError(OVERRIDE_ENV_MESSAGE)
        for kind, items in (("volumes", self.volumes), ("volumeMounts", self.volume_mounts)):
            for item in items:
                if not isinstance(item.get("name"), str) or not item["name"]:
                    raise ValueError(f"podTemplate.{kind}: every item needs a name")
        if any(v["name"] in RESERVED_VOLUMES for v in self.volumes):
            raise ValueError(OVERRIDE_VOLUME_MESSAGE)
        return self


class SchedulingSpec(KubeModel):
    """Pod placement and resources shared by the rollout and trainer blocks."""

    image: str | None = Field(None, description="Container image; default: the KubeRL runtime image for the engine and accelerator.")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = Field(None, description="Image pull policy.")
    resources: ResourceRequirements = Field(default_factory=ResourceRequirements, description="CPU and memory requests/limits.")
    node_selector: dict[str, str] = Field(default_factory=dict, max_length=64, description="Node labels the pods must match.")
    tolerations: list[dict[str, Any]] = Field(
        default_factory=list,
        max_length=64,
        description="Pod tolerations (core/v1 Toleration objects).",
        json_schema_extra={"items": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}},
    )
    affinity: dict[str, Any] | None = Field(
        None, description="Pod affinity (core/v1 Affinity).", json_schema_extra={"x-kubernetes-preserve-unknown-fields": True}
    )
    priority_class_name: str | None = Field(None, description="PriorityClass of the pods.")
    pod_template: PodTemplateOverride | None = Field(
        None, description="Additions to the pods (env, labels, volumes, service account, ...), merged into the operator's.")


# ---------------------------------------------------------------------------------------------
# Model, data set, workflow
# ---------------------------------------------------------------------------------------------


class ModelSpec(KubeModel):
    """The policy model: a Hugging Face id, a path (on a PVC or the local disk), or a builtin test model."""

    model_config = _cel(
        ("[has(self.id), has(self.path), has(self.builtin)].filter(x, x).size() == 1", "set exactly one of model.id, model.path or model.builtin"),
        ("!has(self.volume) || has(self.path)", "model.volume needs model.path (the folder inside the claim)"),
    )
    id: str | None = Field(None, description="Hugging Face model id, e.g. Qwen/Qwen2.5-1.5B-Instruct.", min_length=1)
    path: str | None = Field(None, description="Folder with config.json and safetensors: inside `volume` if set, else a local path.", min_length=1)
    volume: VolumeRef | None = Field(None, description="PVC that holds the model; `path` is relative to it.")
    builtin: Literal["tiny-qwen2", "tiny-qwen2-instruct"] | None = Field(
        None, description="A tiny Qwen2 built locally (random init, locally trained tokenizer): for tests and the quickstart. "
        "tiny-qwen2-instruct is shaped like Qwen2.5-Instruct (tied embeddings, its generation_config sampling defaults).",
    )
    revision: str = Field("main", description="Hub revision (branch, tag or commit) when `id` is set.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("bfloat16", description="Weights dtype for training and inference.")
    hub_token_secret: SecretKeyRef | None = Field(None, description="Secret with a Hugging Face token, for gated or private models.")

    @model_validator(mode="after")
    def _one_source(self) -> ModelSpec:
        if sum(x is not None for x in (self.id, self.path, self.builtin)) != 1:
            raise ValueError("set exactly one of model.id, model.path or model.builtin")
        if self.volume is not None and self.path is None:
            raise ValueError("model.volume needs model.path (the folder inside the claim)")
        return self


class DatasetSpec(KubeModel):
    """Prompts and reference answers: a Hugging Face data set, files on a path, or a builtin synthetic task."""

    model_config = _cel(
        ("[has(self.id), has(self.path), has(self.builtin)].filter(x, x).size() == 1", "set exactly one of dataset.id, dataset.path or dataset.builtin"),
        ("!has(self.volume) || has(self.path)", "dataset.volume needs dataset.path"),
    )
    id: str | None = Field(None, description="Hugging Face data set id, e.g. openai/gsm8k.", min_length=1)
    config: str | None = Field(None, description="Data set configuration name, e.g. main.")
    split: str = Field("train", description="Split to train on.")
    path: str | None = Field(None, description="A .jsonl/.json/.parquet file or a saved data set folder (inside `volume` if set).", min_length=1)
    volume: VolumeRef | None = Field(None, description="PVC that holds the data set; `path` is relative to it.")
    builtin: Literal["repeat-digit", "add-small"] | None = Field(
        None, description="A synthetic verifiable task generated locally (no download): repeat-digit, add-small."
    )
    size: int | None = Field(None, ge=1, le=10_000_000, description="Use at most this many items (builtin: generate this many).")
    prompt_field: str = Field("question", description="Field holding the prompt.", min_length=1)
    answer_field: str = Field("answer", description="Field holding the reference answer.", min_length=1)
    shuffle: bool = Field(True, description="Shuffle items each epoch (seeded by spec.seed).")

    @model_validator(mode="after")
    def _one_source(self) -> DatasetSpec:
        if sum(x is not None for x in (self.id, self.path, self.builtin)) != 1:
            raise ValueError("set exactly one of dataset.id, dataset.path or dataset.builtin")
        if self.volume is not None and self.path is None:
            raise ValueError("dataset.volume needs dataset.path")
        return self


class WorkflowType(StrEnum):
    RLVR = "rlvr"  # single turn: prompt -> answer -> verifiable reward
    MULTI_TURN = "multi-turn"  # retry with feedback until correct or maxTurns; reward discounted per turn
    CUSTOM = "custom"  # a user class with one async method per episode (workflow.class)
    AGENT = "agent"  # a user agent function driving an OpenAI client against the agent's local proxy (workflow.agent)


class AgentExportStyle(StrEnum):
    CONCAT = "concat"  # one sequence per episode: calls that extend each other share one prefix
    INDIVIDUAL = "individual"  # one sample per call (needs groups of varying size: not implemented yet)


_IMPORT_PATH = r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$"
AGENT_INDIVIDUAL_UNSUPPORTED = (
    "workflow.exportStyle individual (one sample per call) is not implemented yet: the trainer trains groups of "
    "exactly samplesPerPrompt sequences; use concat (one sequence per episode)"
)


class SandboxSpec(KubeModel):
    """Limits of the sandboxed Python tool (tool-integrated reasoning): one process per call, no network."""

    timeout_seconds: float = Field(5.0, gt=0.0, le=300.0, description="Wall-clock limit per code run; the process is killed past it.")
    cpu_seconds: int = Field(5, ge=1, le=300, description="CPU-time limit per code run (RLIMIT_CPU).")
    memory_mib: int = Field(512, ge=32, le=65536, description="Address-space limit per code run, MiB (RLIMIT_AS).")
    max_output_chars: int = Field(2000, ge=64, le=100000, description="Characters of stdout/stderr fed back to the model.")


class WorkflowSpec(KubeModel):
    """How a rollout agent turns one data set item into a trajectory group (AReaL's RolloutWorkflow)."""

    model_config = _cel(
        ("self.type == 'multi-turn' || self.maxTurns == 1", "workflow.maxTurns > 1 needs workflow.type multi-turn"),
        ("self.type != 'custom' || has(self.class)", "workflow.type custom needs workflow.class (package.module:Class)"),
        ("!has(self.class) || self.type == 'custom'", "workflow.class needs workflow.type custom"),
        ("self.type != 'agent' || has(self.agent)", "workflow.type agent needs workflow.agent (package.module:function)"),
        ("!has(self.agent) || self.type == 'agent'", "workflow.agent needs workflow.type agent"),
        ("!has(self.exportStyle) || self.exportStyle == 'concat'", AGENT_INDIVIDUAL_UNSUPPORTED),
    )
    type: WorkflowType = Field(WorkflowType.RLVR, description="rlvr (single turn), multi-turn, custom (workflow.class) or agent (workflow.agent).")
    max_turns: int = Field(1, ge=1, le=32, description="Turns per episode (multi-turn).")
    turn_discount: float = Field(1.0, gt=0.0, le=1.0, description="Reward multiplier per extra turn (multi-turn), e.g. 0.9.")
    reward: str = Field(
        "math",
        description="Reward function: a registered name (math, exact-match, repeat-digit) or an import path `package.module:function`.",
        pattern=r"^([a-z0-9][-a-z0-9]*|[A-Za-z_][\w.]*:[A-Za-z_]\w*)$",
    )
    use_chat_template: bool = Field(True, description="Wrap prompts in the tokenizer's chat template.")
    workflow_class: str | None = Field(
        None, alias="class", pattern=_IMPORT_PATH,
        description="custom: `package.module:Class` with `async arun_episode(engine, item, ctx)` (docs/agents.md); "
                    "its code comes from the runtime image or rollout.image.",
    )
    agent: str | None = Field(
        None, pattern=_IMPORT_PATH,
        description="agent: `package.module:function(client, item)` run once per episode with an OpenAI client pointed at "
                    "the agent's local proxy; returns a reward, or None to let workflow.reward score the final answer.",
    )
    export_style: AgentExportStyle | None = Field(
        None, description="agent: how an episode's calls become samples; concat (the default) = one sequence per episode.",
    )
    episode_timeout_seconds: float = Field(
        600.0, gt=0.0, le=86400.0,
        description="agent/custom: an episode running longer fails (its reason logged and counted) and frees its slot.",
    )
    sandbox: SandboxSpec = Field(default_factory=SandboxSpec, description="Limits of the sandboxed Python tool (agent workflows that run code).")

    @model_validator(mode="after")
    def _turns(self) -> WorkflowSpec:
        if self.type != WorkflowType.MULTI_TURN and self.max_turns != 1:
            raise ValueError("workflow.maxTurns > 1 needs workflow.type multi-turn")
        if self.type == WorkflowType.CUSTOM and self.workflow_class is None:
            raise ValueError("workflow.type custom needs workflow.class (package.module:Class)")
        if self.workflow_class is not None and self.type != WorkflowType.CUSTOM:
            raise ValueError("workflow.class needs workflow.type custom")
        if self.type == WorkflowType.AGENT and self.agent is None:
            raise ValueError("workflow.type agent needs workflow.agent (package.module:function)")
        if self.agent is not None and self.type != WorkflowType.AGENT:
            raise ValueError("workflow.agent needs workflow.type agent")
        if self.export_style not in (None, AgentExportStyle.CONCAT):
            raise ValueError(AGENT_INDIVIDUAL_UNSUPPORTED)
        return self


# ---------------------------------------------------------------------------------------------
# Algorithm and staleness
# ---------------------------------------------------------------------------------------------


class AlgorithmName(StrEnum):
    GRPO = "grpo"
    DRGRPO = "drgrpo"
    DAPO = "dapo"
    GSPO = "gspo"
    RLOO = "rloo"
    REINFORCE_PP = "reinforce++"
    LITEPPO = "liteppo"
    PPO = "ppo"


class OptimizerSpec(KubeModel):
    type: Literal["adamw", "adam", "sgd"] = Field("adamw", description="Optimizer.")
    beta1: float = Field(0.9, ge=0.0, lt=1.0, description="Adam beta1.")
    beta2: float = Field(0.999, ge=0.0, lt=1.0, description="Adam beta2.")
    eps: float = Field(1e-8, gt=0.0, description="Adam epsilon.")
    weight_decay: float = Field(0.017, ge=0.0, description="Decoupled weight decay (AReaL GSM8K: 0.017).")
    grad_clip: float = Field(1.0, gt=0.0, description="Max global gradient norm.")
    lr_scheduler: Literal["constant", "linear", "cosine"] = Field("constant", description="Learning-rate schedule over training.")
    warmup_steps: int = Field(0, ge=0, description="Linear warm-up steps.")


class OverlongPenaltySpec(KubeModel):
    """DAPO's soft overlong punishment: a linear penalty over the last `bufferTokens` before maxNewTokens."""

    enabled: bool | None = Field(
        None, description="Penalize responses that approach maxNewTokens; unset = the algorithm's choice (on for dapo, off otherwise).")
    buffer_tokens: int = Field(64, ge=1, description="Length of the penalty ramp, in tokens.")
    penalty: float = Field(1.0, ge=0.0, description="Penalty at maxNewTokens.")


PPO_UNSUPPORTED = (
    "algorithm.name ppo (PPO with a value critic) is not supported yet: the trainer has no critic model; "
    "use liteppo (critic-free PPO) or another algorithm"
)
TOP_P_UNSUPPORTED = (
    "algorithm.topP must be 1: the trainer scores softmax(logits / temperature) over the whole vocabulary, "
    "so a nucleus-truncated sampler would not be the policy it trains (lower algorithm.temperature to sharpen sampling)"
)


class AlgorithmSpec(KubeModel):
    """One advantage/loss pipeline; each named algorithm is a preset of it (defaults: AReaL's GSM8K GRPO)."""

    model_config = _cel(
        ("!has(self.epsClipHigh) || !has(self.epsClip) || self.epsClipHigh >= self.epsClip", "algorithm.epsClipHigh must be >= algorithm.epsClip"),
        ("!(self.name in ['grpo', 'drgrpo', 'dapo', 'gspo', 'rloo']) || self.samplesPerPrompt >= 2",
         "group-relative algorithms need algorithm.samplesPerPrompt >= 2"),
        ("self.name != 'ppo'", PPO_UNSUPPORTED),
        ("!has(self.topP) || self.topP == 1.0", TOP_P_UNSUPPORTED, ".topP"),
    )
    name: AlgorithmName = Field(
        AlgorithmName.GRPO,
        description="grpo, drgrpo, dapo, gspo, rloo, reinforce++ or liteppo (ppo, with a value critic, is reserved and refused for now).")
    samples_per_prompt: int = Field(4, ge=1, le=256, description="Responses sampled per prompt (group size n).")
    batch_size: int = Field(256, ge=1, le=65536, description="Prompts (groups) per training step, B.")
    max_new_tokens: int = Field(
        1024, ge=1, le=131072,
        description="Generation length limit per response; a multi-turn episode shares it across its turns (each turn gets what "
        "the earlier ones left), so the overlong penalty and Dr.GRPO's normaliser measure against it.",
    )
    temperature: float = Field(1.0, gt=0.0, le=2.0, description="Sampling temperature.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling; must stay 1 (the trainer scores the untruncated policy).")
    learning_rate: float = Field(1.7e-5, gt=0.0, le=1.0, description="Learning rate.")
    optimizer: OptimizerSpec = Field(default_factory=OptimizerSpec, description="Optimizer settings.")
    ppo_minibatches: int = Field(1, ge=1, le=64, description="Optimizer steps per training step (minibatches of the batch).")
    eps_clip: float | None = Field(
        None, gt=0.0, le=10.0,
        description="PPO ratio clip, low side: r >= 1 - epsClip; unset = the algorithm's choice (0.4 as AReaL's GSM8K GRPO; dapo 0.2; gspo 3e-4).",
    )
    eps_clip_high: float | None = Field(None, gt=0.0, le=10.0, description="Clip-higher (DAPO): r <= 1 + epsClipHigh; unset = epsClip.")
    kl_coef: float = Field(0.0, ge=0.0, description="KL penalty against the reference (initial) policy; 0 = none.")
    decoupled_loss: bool = Field(True, description="Decoupled PPO objective (AReaL): clip against the proximal policy, weight by pi_prox/pi_behave.")
    behavior_weight_cap: float | None = Field(5.0, gt=1.0, description="Cap (or mask, see behaviorWeightMode) on pi_prox/pi_behave; unset = no cap.")
    behavior_weight_mode: Literal["cap", "mask"] = Field("mask", description="Tokens over the cap are masked out (AReaL) or clipped to it.")
    reward_scaling: float = Field(10.0, gt=0.0, description="reward' = (reward + rewardBias) * rewardScaling.")
    reward_bias: float = Field(-0.5, description="Added to rewards before scaling.")
    normalize_advantages: bool = Field(True, description="Divide advantages by their std (group std for GRPO, batch std for REINFORCE++/LitePPO).")
    batch_advantage_norm: bool = Field(
        False,
        description="After the algorithm's own (e.g. group-level) normalisation, whiten the advantages over every loss token of the batch: "
        "(A - mean) / (std + eps), AReaL's adv_norm {mean_level: batch, std_level: batch} as in its GSM8K GRPO recipe.",
    )
    dynamic_sampling: bool | None = Field(
        None, description="Reject groups whose rewards are all equal (DAPO); their ticket is given back. Unset = the algorithm's choice (on for dapo)."
    )
    overlong_penalty: OverlongPenaltySpec = Field(default_factory=OverlongPenaltySpec, description="DAPO overlong reward shaping.")
    gamma: float = Field(1.0, ge=0.0, le=1.0, description="Discount (ppo, reinforce++).")
    gae_lambda: float = Field(1.0, ge=0.0, le=1.0, description="GAE lambda (ppo).")

    @model_validator(mode="after")
    def _rules(self) -> AlgorithmSpec:
        if self.eps_clip_high is not None and self.eps_clip is not None and self.eps_clip_high < self.eps_clip:
            raise ValueError("algorithm.epsClipHigh must be >= algorithm.epsClip")
        group = {AlgorithmName.GRPO, AlgorithmName.DRGRPO, AlgorithmName.DAPO, AlgorithmName.GSPO, AlgorithmName.RLOO}
        if self.name in group and self.samples_per_prompt < 2:
            raise ValueError("group-relative algorithms need algorithm.samplesPerPrompt >= 2")
        if self.name == AlgorithmName.PPO:
            raise ValueError(PPO_UNSUPPORTED)
        if self.top_p != 1.0:
            raise ValueError(TOP_P_UNSUPPORTED)
        return self


class StalenessSpec(KubeModel):
    """Bounded staleness (AReaL): at policy version v at most (maxHeadOffpolicyness + v + 1) * batchSize groups start."""

    max_head_offpolicyness: int = Field(2, ge=0, le=1000, description="eta: how many versions a trained sample may lag; 0 = synchronous RL.")
    max_concurrent_rollouts: int | None = Field(
        None, ge=1, le=1_000_000,
        description="Groups being generated at once, all agents together (a group frees its slot when it arrives on the bus, as AReaL's "
        "max_concurrent_rollouts); unset = only the staleness bound.",
    )


# ---------------------------------------------------------------------------------------------
# Roles: rollout, trainer
# ---------------------------------------------------------------------------------------------


class AutoscalingSpec(KubeModel):
    model_config = _cel(("self.minReplicas <= self.maxReplicas", "rollout.autoscaling.minReplicas must be <= maxReplicas"))
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
# the trainer's own exit-2 refusal (runtime/kuberl/runtime/trainer/trainer.py) stays as a second line of defence.
MEGATRON_UNSUPPORTED = ("trainer.backend megatron is not implemented yet: use trainer.backend fsdp (FSDP2, data parallel); "
                        "tensor, pipeline and expert parallel come with the megatron backend (README: support table)")
CONTEXT_UNSUPPORTED = ("trainer.parallelism.context > 1 (context parallel) is not implemented yet: use context 1; "
                       "FSDP2 trains data parallel over nodes * accelerator.count")
ALLOCATION_MEGATRON_UNSUPPORTED = "allocation: the megatron backend is not implemented yet: use fsdp:d<N> (e.g. vllm:d2+fsdp:d4)"
ALLOCATION_CONTEXT_UNSUPPORTED = "allocation: context parallel (c > 1) is not implemented yet: use fsdp:d<N> without c (e.g. vllm:d2+fsdp:d4)"
TPE_NEED_MEGATRON = ("tensor, pipeline and expert parallelism need trainer.backend megatron, which is not implemented yet: "
                     "use trainer.parallelism.data only")


class ParallelismSpec(KubeModel):
    """Trainer parallel dims; each defaults to `allocation` when set, else 1."""

    data: int | None = Field(None, ge=1, le=4096, description="Data-parallel (FSDP shard) size; unset = what the other dims leave.")
    tensor: int = Field(1, ge=1, le=64, description="Tensor parallel size (megatron).")
    pipeline: int = Field(1, ge=1, le=64, description="Pipeline parallel size (megatron).")
    context: int = Field(1, ge=1, le=64, description="Context (sequence) parallel size; above 1 is refused (not implemented yet).")
    expert: int = Field(1, ge=1, le=256, description="Expert parallel size (MoE, megatron).")


class TrainerSpec(SchedulingSpec):
    """Training: an indexed Job, one pod per node, torchrun over a headless Service."""

    # Its cross-field rules live on RLExperimentSpec: they must know whether `allocation` fills these fields.
    backend: Literal["fsdp", "megatron"] = Field(
        "fsdp", description="fsdp (FSDP2). megatron (megatron-core) is refused: not implemented yet. Default: from `allocation` when set, else fsdp.")
    nodes: int = Field(1, ge=1, le=1024, description="Trainer pods (one per node). Default: from `allocation` when set, else 1.")
    accelerator: AcceleratorSpec = Field(default_factory=AcceleratorSpec, description="Accelerators per node; for cpu, processes per node.")
    parallelism: ParallelismSpec = Field(default_factory=ParallelismSpec, description="Parallel dims.")
    micro_batch_tokens: int = Field(16384, ge=64, description="Tokens per forward/backward micro-batch (packed).")
    gradient_checkpointing: bool = Field(False, description="Recompute activations to save memory.")

    @property
    def world_size(self) -> int:
        return self.nodes * max(self.accelerator.count, 1)

    def check(self) -> None:
        """Cross-field rules; RLExperimentSpec calls this once `allocation` has filled the fields."""
        p = self.parallelism
        if p.data is not None and p.data * p.tensor * p.pipeline * p.context != self.world_size:
            raise ValueError("trainer.parallelism data*tensor*pipeline*context must equal nodes * accelerator.count")
        if self.backend != "megatron" and (p.tensor, p.pipeline, p.expert) != (1, 1, 1):
            raise ValueError(TPE_NEED_MEGATRON)
        if self.backend == "megatron":
            raise FieldError("spec.trainer.backend", self.backend, MEGATRON_UNSUPPORTED)
        if p.context != 1:
            raise FieldError("spec.trainer.parallelism.context", p.context, CONTEXT_UNSUPPORTED)


# ---------------------------------------------------------------------------------------------
# Infrastructure: weight sync, bus, checkpoint, lifecycle
# ---------------------------------------------------------------------------------------------


class WeightSyncSpec(KubeModel):
    mode: Literal["disk", "bus"] = Field(
        "disk", description="disk: safetensors on the shared checkpoint volume (ReadWriteMany); bus: through a NATS object store.")


class EmbeddedBusSpec(KubeModel):
    replicas: Literal[1, 3, 5] = Field(1, description="NATS servers (JetStream clusters need an odd count).")
    storage: Quantity = Field("10Gi", description="JetStream file storage per server.")
    storage_class_name: str | None = Field(None, description="StorageClass of the JetStream volumes.")
    image: str | None = Field(None, description="NATS image; default nats:2.15-alpine.")
    resources: ResourceRequirements = Field(default_factory=ResourceRequirements, description="NATS container resources.")


class ExternalBusSpec(KubeModel):
    url: str = Field(description="NATS URL, e.g. nats://nats.nats.svc:4222.", pattern=r"^(nats|tls|ws|wss)://\S+$")
    credentials_secret: SecretKeyRef | None = Field(None, description="Secret with a NATS credentials file (key default: token).")


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


_RP = "self.rollout"
_TP = "self.trainer.parallelism"

# spec.tracking lives in its own module, built on the pieces above (imported here, not at the top, for that reason).
from kuberl.api.evaluation import EvalProgress, EvaluationSpec  # noqa: E402
from kuberl.api.tracking import TrackingSpec  # noqa: E402


class RLExperimentSpec(KubeModel):
    """What to train, on what, with which algorithm, and where: one manifest for `kubectl apply` and `kuberl run`."""

    # Rules over fields that `allocation` may fill: with `allocation` set, the model checks them
    # after expansion (admission cannot parse the shorthand); without it, unset fields take the
    # models' defaults, exactly as the pydantic side does.
    model_config = _cel(
        ((f"has(self.allocation) || {_RP}.accelerator.type == 'cpu' || !has({_RP}.accelerator.count) || "
          f"{_RP}.accelerator.count == {_or(_RP + '.tensorParallelSize', 1)} * {_or(_RP + '.pipelineParallelSize', 1)}"),
         "rollout.accelerator.count must equal tensorParallelSize * pipelineParallelSize", ".rollout.accelerator.count"),
        ((f"has(self.allocation) || !has({_TP}.data) || {_TP}.data * {_or(_TP + '.tensor', 1)} * {_or(_TP + '.pipeline', 1)} * {_or(_TP + '.context', 1)} == "
          f"{_or('self.trainer.nodes', 1)} * (has(self.trainer.accelerator.count) && self.trainer.accelerator.count > 0 ? self.trainer.accelerator.count : 1)"),
         "trainer.parallelism data*tensor*pipeline*context must equal nodes * accelerator.count", ".trainer.parallelism"),
        ((f"has(self.allocation) || {_or('self.trainer.backend', 'fsdp')} == 'megatron' || "
          f"({_or(_TP + '.tensor', 1)} == 1 && {_or(_TP + '.pipeline', 1)} == 1 && {_or(_TP + '.expert', 1)} == 1)"),
         TPE_NEED_MEGATRON, ".trainer.backend"),
        (f"has(self.allocation) || {_or('self.trainer.backend', 'fsdp')} != 'megatron'", MEGATRON_UNSUPPORTED, ".trainer.backend"),
        (f"has(self.allocation) || {_or(_TP + '.context', 1)} == 1", CONTEXT_UNSUPPORTED, ".trainer.parallelism.context"),
        # The shorthand itself: CEL cannot expand it, but can see a megatron backend or a context dim above 1.
        ("!has(self.allocation) || !self.allocation.contains('+megatron:')", ALLOCATION_MEGATRON_UNSUPPORTED, ".allocation"),
        ("!has(self.allocation) || !self.allocation.matches('c0*([2-9]|[1-9][0-9]+)')", ALLOCATION_CONTEXT_UNSUPPORTED, ".allocation"),
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
        return self


# ---------------------------------------------------------------------------------------------
# Status
# ---------------------------------------------------------------------------------------------


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
    dropped_stale: int = Field(0, ge=0, description="Groups dropped for exceeding maxHeadOffpolicyness, all time.")
    failed_groups: int | None = Field(None, ge=0, description="Tickets that failed on every delivery (rollout.maxTicketAttempts), all time.")
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


class ObjectMeta(BaseModel):
    """The part of metav1.ObjectMeta KubeRL reads; everything else is kept as it is."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)
    name: str = Field(min_length=1, max_length=52, pattern=DNS1123_LABEL)  # 52: room for "-rollout-NN" child names
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
