"""How it is trained: the RL algorithm, its optimizer, penalties and the staleness bound."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Literal

from pydantic import Field, model_validator

from kuberl.api.base import KubeModel, _cel, _or


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


# The projections of a Qwen2/Llama-style decoder that vLLM serves LoRA adapters on.
LORA_DEFAULT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# vLLM's --max-lora-rank takes only these values (vllm/config/lora.py MaxLoRARanks).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


# vLLM 0.32 loads adapters on a decoder's linear projections only: an adapter on the vocabulary layers fails to load
# ("expected target modules in {q_proj, ...} but received ['lm_head', ...]", measured on the tiny Qwen2).
LORA_UNSERVED_TARGETS = ("lm_head", "embed_tokens")
LORA_TARGET_UNSERVED = ("algorithm.lora.targetModules: vLLM serves LoRA adapters on the linear projections only (q_proj ... down_proj), "
                        "not on lm_head or embed_tokens")


class LoRASpec(KubeModel):
    """Low-rank adapters (PEFT LoRA): the trainer trains only the adapters and publishes them; engines hot-load them."""

    model_config = _cel(
        ("!has(self.targetModules) || !self.targetModules.exists(m, m.endsWith('lm_head') || m.endsWith('embed_tokens'))", LORA_TARGET_UNSERVED),
    )

    rank: int = Field(ge=1, le=max(VLLM_LORA_RANKS), description="Adapter rank r (vLLM serves ranks up to 512).")
    alpha: float = Field(gt=0.0, description="LoRA alpha: the adapter's update is scaled by alpha / rank.")
    target_modules: list[Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.]+$")]] = Field(
        default_factory=lambda: list(LORA_DEFAULT_TARGETS), min_length=1, max_length=64,
        description="Module names (suffixes) that get an adapter; default: every attention and MLP projection of a Qwen2/Llama-style model.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the adapter input during the update (0: trains exactly the sampled policy).")

    @model_validator(mode="after")
    def _served(self) -> LoRASpec:
        if any(m.endswith(LORA_UNSERVED_TARGETS) for m in self.target_modules):
            raise ValueError(LORA_TARGET_UNSERVED)
        return self


LORA_NEEDS_VLLM = ("algorithm.lora needs rollout.engine vllm: KubeRL hot-loads adapters through vLLM's LoRA endpoints only "
                   "(SGLang adapter loading is not implemented)")


PPO_UNSUPPORTED = (
    "algorithm.name ppo (PPO with a value critic) is not supported yet: the trainer has no critic model; "
    "use liteppo (critic-free PPO) or another algorithm"
)
# Stop conditions (algorithm.stopTokenIds, algorithm.stop): token ids are int32 in every tokenizer; engines check each
# stop string after every token, so a few short ones (OpenAI allows 4).
MAX_TOKEN_ID = 2**31 - 1
MAX_STOP_TOKEN_IDS = 64
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
TOP_P_UNSUPPORTED = (
    "algorithm.topP must be 1: the trainer scores softmax(logits / temperature) over the whole vocabulary, "
    "so a nucleus-truncated sampler would not be the policy it trains (lower algorithm.temperature to sharpen sampling)"
)


class AlgorithmSpec(KubeModel):
    """One advantage/loss pipeline; each named algorithm is a preset of it (defaults: AReaL's GSM8K GRPO)."""

    model_config = _cel(
        ("!has(self.epsClipHigh) || !has(self.epsClip) || self.epsClipHigh >= self.epsClip", "algorithm.epsClipHigh must be >= algorithm.epsClip"),
        # name and samplesPerPrompt through _or: the API server also checks these rules on the CRD's default `algorithm: {}`
        # (before the nested defaults apply), where a bare `self.name` fails with "no such key" and the CRD is refused.
        (f"!({_or('self.name', 'grpo')} in ['grpo', 'drgrpo', 'dapo', 'gspo', 'rloo']) || {_or('self.samplesPerPrompt', 4)} >= 2",
         "group-relative algorithms need algorithm.samplesPerPrompt >= 2"),
        (f"{_or('self.name', 'grpo')} != 'ppo'", PPO_UNSUPPORTED),
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
    stop_token_ids: list[Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]] = Field(
        default_factory=list, max_length=MAX_STOP_TOKEN_IDS,
        description="Token ids that also end a response, added to the model's own: the tokenizer's eos, the eos_token_id of "
        "config.json and generation_config.json (one id or a list), the pad token, and the chat template's end-of-turn token "
        "(e.g. <|im_end|>) when prompts use the template. The stop token stays in the response and is trained on; "
        "an id outside the tokenizer's vocabulary fails the rollout at start.",
    )
    stop: list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]] = Field(
        default_factory=list, max_length=MAX_STOP_STRINGS,
        description="Strings that end a response (OpenAI's and vLLM's `stop`), e.g. [\"</answer>\"]: generation stops at the token "
        "that completes one, and the response trained on ends with that token (the string is kept, not cut off).",
    )
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
    lora: LoRASpec | None = Field(
        None, description="Train LoRA adapters instead of every weight (vLLM engines, fsdp trainer); unset: full fine-tuning.")
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
    """Bounded staleness (AReaL): at policy version v at most (maxHeadOffpolicyness + v + 1) * batchSize groups start.

    The bound is enforced at admission (tickets); every group that comes back is trained, as in AReaL. A straggler
    older than v - eta is counted (status.progress.overStale) and left to the decoupled loss's behaviour-weight cap;
    dropStaleGroups drops it instead, at the price of a bias toward short answers.
    """

    max_head_offpolicyness: int = Field(2, ge=0, le=1000, description="eta: how many versions a trained sample may lag; 0 = synchronous RL.")
    drop_stale_groups: bool = Field(
        False,
        description="Drop (and re-issue) a group whose oldest token is older than v - maxHeadOffpolicyness instead of training on "
        "it. Off (the default, as AReaL): the ticket gate bounds staleness when a group starts, every group that comes back is "
        "trained, the decoupled loss's behaviour weight (algorithm.behaviorWeightCap) corrects for the old policy, and such "
        "groups are counted in status.progress.overStale. On: the groups overtaken are those still generating their longest "
        "answers, so training is biased toward shorter, easier answers than were sampled (the trainer warns at start).",
    )
    max_concurrent_rollouts: int | None = Field(
        None, ge=1, le=1_000_000,
        description="Groups being generated at once, all agents together (a group frees its slot when it arrives on the bus, as AReaL's "
        "max_concurrent_rollouts); unset = only the staleness bound.",
    )


# ---------------------------------------------------------------------------------------------
# Roles: rollout, trainer
# ---------------------------------------------------------------------------------------------

