"""What is trained on: the model, the data set and the rollout workflow (rlvr, multi-turn, custom, agent)."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Literal

from pydantic import Field, model_validator

from kuberl.api.base import DNS1123_LABEL, KubeModel, ResourceRequirements, SecretKeyRef, VolumeRef, _cel, _or


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


PROMPT_ONE_FORM = "set at most one of dataset.prompt.instruction and dataset.prompt.template (a template places its instruction itself)"
PROMPT_PLACEHOLDER = "dataset.prompt.template needs the placeholder {prompt} where the item's prompt goes"
PROMPT_SYSTEM_CHAT = ("dataset.prompt.system needs workflow.useChatTemplate true and workflow.type rlvr or multi-turn "
                      "(raw prompts have no system role; agent and custom workflows build their own messages)")


class PromptSpec(KubeModel):
    """How an item's prompt becomes the user message (AReaL's dataset recipes; TRL's system prompt), the same in training
    and evaluation. The chat template itself is workflow.useChatTemplate."""

    model_config = _cel(
        ("!has(self.instruction) || !has(self.template)", PROMPT_ONE_FORM),
        ("!has(self.template) || self.template.contains('{prompt}')", PROMPT_PLACEHOLDER, ".template"),
    )
    system: str | None = Field(
        None, min_length=1, max_length=16384,
        description="System message before the user message, through the tokenizer's chat template "
                    "(needs workflow.useChatTemplate true and workflow.type rlvr or multi-turn).",
    )
    instruction: str | None = Field(
        None, min_length=1, max_length=16384,
        description="Appended to every prompt after a newline, e.g. AReaL's GSM8K recipe: "
                    "'Please put your final answer within \\boxed{}.' (the math reward reads the last \\boxed{}).",
    )
    template: str | None = Field(
        None, min_length=1, max_length=16384,
        description="The whole user message with {prompt} where the item's prompt goes, e.g. 'Question: {prompt}\\nAnswer:' "
                    "for a base model; every other character, braces included, is kept as written. Not with instruction.",
    )

    @model_validator(mode="after")
    def _one_form(self) -> PromptSpec:
        if self.instruction is not None and self.template is not None:
            raise ValueError(PROMPT_ONE_FORM)
        if self.template is not None and "{prompt}" not in self.template:
            raise ValueError(PROMPT_PLACEHOLDER)
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
    prompt: PromptSpec | None = Field(
        None, description="System message, instruction or template applied to every prompt, in training and evaluation "
                          "(and the text reward functions receive); unset: the prompt field as it is.",
    )

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
    AGENT = "agent"  # an agent driving an OpenAI client against the rollout agent's proxy: workflow.agent (in-pod) or workflow.external


class AgentExportStyle(StrEnum):
    CONCAT = "concat"  # one sequence per episode: calls that extend each other share one prefix
    INDIVIDUAL = "individual"  # one sample per call, sharing the episode reward (groups of varying size)


# Classes spelled out, not \w: the API server's (RE2) \w is ASCII, pydantic's (Rust) Unicode (`kuberl run` took pkg.modé:fn).
_IMPORT_PATH = r"^[A-Za-z_][A-Za-z0-9_.]*:[A-Za-z_][A-Za-z0-9_]*$"
_TYPE = _or("self.type", "rlvr")


SANDBOX_RUNTIME_CLASS = "workflow.sandbox.runtimeClassName needs workflow.sandbox.placement pod (it is the sandbox pods' runtime class)"
# A RuntimeClass name is a DNS-1123 subdomain.
_DNS1123_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"


class SandboxPlacement(StrEnum):
    PROCESS = "process"  # a confined subprocess of the rollout agent, in the rollout pod
    POD = "pod"  # on a cluster: pods of their own ({experiment}-sandbox), reached over HTTP; `kuberl run`: a server process of its own


class SandboxSpec(KubeModel):
    """Limits of the sandboxed Python tool (tool-integrated reasoning): one process per call, no network. Where it runs:
    placement process (a confined subprocess of the rollout agent) or pod (a sandbox server in pods of its own, which
    runs each call in the same confined subprocess; docs/agents.md#where-the-sandbox-runs)."""

    model_config = _cel(
        (f"!has(self.runtimeClassName) || {_or('self.placement', 'process')} == 'pod'", SANDBOX_RUNTIME_CLASS, ".runtimeClassName"),
    )
    timeout_seconds: float = Field(5.0, gt=0.0, le=300.0, description="Wall-clock limit per code run; the process is killed past it.")
    cpu_seconds: int = Field(5, ge=1, le=300, description="CPU-time limit per code run (RLIMIT_CPU).")
    memory_mib: int = Field(512, ge=32, le=65536, description="Address-space limit per code run, MiB (RLIMIT_AS).")
    max_output_chars: int = Field(2000, ge=64, le=100000, description="Characters of stdout/stderr fed back to the model.")
    placement: SandboxPlacement = Field(
        SandboxPlacement.PROCESS,
        description="process: a confined subprocess of the rollout agent, in the rollout pod. pod: on a cluster, a Deployment "
                    "`{name}-sandbox` of its own (no service-account token, no Secret, no egress; only the rollout pods may call it) "
                    "that runs each call in the same confined subprocess; with `kuberl run`, a sandbox server process of its own.",
    )
    runtime_class_name: str | None = Field(
        None, min_length=1, max_length=253, pattern=_DNS1123_SUBDOMAIN,
        description="placement pod: the sandbox pods' RuntimeClass, e.g. gvisor (a RuntimeClass the cluster has, "
                    "handler runsc): a user-space kernel between tool code and the node's.",
    )
    replicas: int = Field(1, ge=1, le=256, description="placement pod: sandbox server pods (the rollout agents' calls are spread over them).")
    resources: ResourceRequirements = Field(
        default_factory=ResourceRequirements,
        description="placement pod: CPU and memory requests/limits of a sandbox pod (default: requests cpu 1, memory 1Gi).",
    )

    @model_validator(mode="after")
    def _placement(self) -> SandboxSpec:
        if self.runtime_class_name is not None and self.placement != SandboxPlacement.POD:
            raise ValueError(SANDBOX_RUNTIME_CLASS)
        return self


AGENT_NEEDS_ENTRY = "workflow.type agent needs workflow.agent (package.module:function) or workflow.external (agents in their own processes)"
AGENT_ONE_ENTRY = "set workflow.agent (an in-pod function) or workflow.external (agents in their own processes), not both"


class ExternalAgentSpec(KubeModel):
    """Agents that run in their own processes (another container, service or machine) and take episodes from the rollout
    agents' episode API: each opens an episode (its prompt, a base URL and an API key scoped to it), runs against that URL,
    and closes it with a reward or asks workflow.reward to score it (docs/agents.md). Opening needs the experiment's episode
    key: the Secret `{name}-episode-api` (key apiKey) on a cluster, `episode-api.key` in the workdir with `kuberl run`."""

    claim_timeout_seconds: float = Field(
        600.0, gt=0.0, le=86400.0,
        description="How long an episode waits for an external agent to open it; past it the episode fails like one that ran "
                    "past workflow.episodeTimeoutSeconds (its group is retried, then counted as a failed group with the reason).",
    )
    namespaces: list[Annotated[str, Field(pattern=DNS1123_LABEL, min_length=1, max_length=63)]] | None = Field(
        None, max_length=32,
        description="On a cluster: namespaces whose pods may reach the episode API port (8002) of the rollout pods, besides the "
                    "experiment's own namespace (the rollout NetworkPolicy). Agents elsewhere: kubectl port-forward to a rollout pod.",
    )


class WorkflowSpec(KubeModel):
    """How a rollout agent turns one data set item into a trajectory group (AReaL's RolloutWorkflow)."""

    # type and maxTurns through _or: the API server also checks these rules on the CRD's default `workflow: {}`, before
    # the nested defaults apply (a bare `self.type` fails there with "no such key", and the CRD is refused).
    model_config = _cel(
        (f"{_TYPE} == 'multi-turn' || {_or('self.maxTurns', 1)} == 1", "workflow.maxTurns > 1 needs workflow.type multi-turn"),
        (f"{_TYPE} != 'custom' || has(self.class)", "workflow.type custom needs workflow.class (package.module:Class)"),
        (f"!has(self.class) || {_TYPE} == 'custom'", "workflow.class needs workflow.type custom"),
        (f"{_TYPE} != 'agent' || has(self.agent) || has(self.external)", AGENT_NEEDS_ENTRY),
        ("!has(self.agent) || !has(self.external)", AGENT_ONE_ENTRY),
        (f"!has(self.external) || {_TYPE} == 'agent'", "workflow.external needs workflow.type agent"),
        (f"!has(self.agent) || {_TYPE} == 'agent'", "workflow.agent needs workflow.type agent"),
        (f"!has(self.exportStyle) || {_TYPE} == 'agent'", "workflow.exportStyle needs workflow.type agent"),
    )
    type: WorkflowType = Field(WorkflowType.RLVR, description="rlvr (single turn), multi-turn, custom (workflow.class) or agent (workflow.agent).")
    max_turns: int = Field(1, ge=1, le=32, description="Turns per episode (multi-turn).")
    turn_discount: float = Field(
        1.0, gt=0.0, le=1.0,
        description="Reward multiplier per extra turn (multi-turn), e.g. 0.9; agent with exportStyle individual: per call before the last.",
    )
    reward: str = Field(
        "math",
        description="Reward function: a registered name (math, exact-match, repeat-digit, add-small) or an import path "
                    "`package.module:function(prompt, completion, answer)` returning a finite number (any range: 0/1, +-1, a reward "
                    "model's score); NaN or infinity rejects the item's group, its reason logged.",
        pattern=r"^([a-z0-9][-a-z0-9]*|[A-Za-z_][A-Za-z0-9_.]*:[A-Za-z_][A-Za-z0-9_]*)$",
    )
    reward_timeout_seconds: float = Field(
        15.0, gt=0.0, le=3600.0,
        description="Limit per scored response (AReaL's default 15 s); past it the reward is 0, the response is logged with its "
                    "item and counted (kuberl_agent_reward_timeouts_total), and the stuck worker process is replaced.",
    )
    reward_workers: int = Field(
        4, ge=1, le=256,
        description="Worker processes per rollout agent that score responses in parallel, off the agent's event loop "
                    "(a reward that cannot be sent to a process, e.g. a lambda, runs on as many threads).",
    )
    use_chat_template: bool = Field(
        True, description="Wrap prompts in the tokenizer's chat template, with dataset.prompt.system as the system message "
                          "(refused when the tokenizer has none); false: the prompt text as it is, for base models.",
    )
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
    external: ExternalAgentSpec | None = Field(
        None, description="agent: episodes are taken by agents in their own processes through the rollout agents' episode API "
                          "(instead of workflow.agent); set {} for the defaults.",
    )
    export_style: AgentExportStyle | None = Field(
        None, description="agent: how an episode's calls become samples; concat (the default) = one sequence per episode; "
                          "individual = one sample per call, each with the episode reward (times turnDiscount per later call).",
    )
    episode_timeout_seconds: float = Field(
        600.0, gt=0.0, le=86400.0,
        description="agent/custom: an episode running longer fails (its reason logged and counted) and frees its slot; "
                    "workflow.external: counted from when an external agent opens the episode until it closes it.",
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
        if self.type == WorkflowType.AGENT and self.agent is None and self.external is None:
            raise ValueError(AGENT_NEEDS_ENTRY)
        if self.agent is not None and self.external is not None:
            raise ValueError(AGENT_ONE_ENTRY)
        if self.external is not None and self.type != WorkflowType.AGENT:
            raise ValueError("workflow.external needs workflow.type agent")
        if self.agent is not None and self.type != WorkflowType.AGENT:
            raise ValueError("workflow.agent needs workflow.type agent")
        if self.export_style is not None and self.type != WorkflowType.AGENT:
            raise ValueError("workflow.exportStyle needs workflow.type agent")
        return self


# ---------------------------------------------------------------------------------------------
# Algorithm and staleness
# ---------------------------------------------------------------------------------------------

