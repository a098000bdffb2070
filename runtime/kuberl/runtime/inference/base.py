"""The narrow inference-engine interface (AReaL's InferenceEngine) and the engine registry.

The rollout workflows and agent talk to an engine only through `InferenceEngine`; `vllm.py` and
`sglang.py` implement it over each server's HTTP API. Requests and results are plain dataclasses.
Add an engine: one module with a class implementing the protocol, plus one line in `ENGINES`.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

FinishReason = Literal["stop", "length", "abort"]


@dataclass
class GenerateRequest:
    """One sequence to generate from token ids (the workflows apply chat templates themselves).

    Generation stops only at `stop_token_ids` (the stop token is kept in the output), at a `stop` string (the
    output ends with the token that completes it: the string is kept, never cut out of the token ids), or after
    max_new_tokens; the model's own eos is not implied (stop_tokens.py computes the set). temperature 0 = greedy.
    A stop string split by a pause (an aborted piece ends inside it) is not seen by the continuation: the engine
    matches the text it generated itself.
    """

    input_ids: list[int]
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    seed: int | None = None


@dataclass
class GenerateResult:
    """Generated token ids, each one's logprob under the engine's sampling policy, and why it stopped.

    `finish_reason == "abort"` means a pause (weight update) cut the generation short: the tokens so far
    are valid and the caller may continue from input_ids + output_ids. `version` is the engine's
    weights version when the request started (with a pausing update all tokens of one result come from
    it, because a pause aborts every in-flight request before weights change). `versions`, where the
    engine reports it (vLLM's weight-version spans), is each token's own version: with an in-flight update
    (weightSync.inFlight keep) one result spans several.
    """

    output_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    version: int = 0
    versions: list[int] | None = None

    def __post_init__(self) -> None:
        if len(self.output_ids) != len(self.logprobs):
            raise ValueError(f"engine returned {len(self.output_ids)} tokens but {len(self.logprobs)} logprobs")
        if self.versions is not None and len(self.versions) != len(self.output_ids):
            raise ValueError(f"engine returned {len(self.output_ids)} tokens but {len(self.versions)} token versions")

    def token_versions(self) -> list[int]:
        """Each token's weights version: the engine's own where it reported them, else the request's."""
        return list(self.versions) if self.versions is not None else [self.version] * len(self.output_ids)


class EngineError(RuntimeError):
    """The engine server refused a request or is unreachable; the message says which endpoint.

    `status` is the HTTP status when the server answered: 4xx means this request can never succeed
    (e.g. a prompt longer than the context), anything else may succeed on retry.
    """

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status

    @property
    def permanent(self) -> bool:
        return self.status is not None and 400 <= self.status < 500


class EngineRestarted(EngineError):
    """The engine answers, but serves the weights it started with, not the ones the agent loaded: it was restarted
    (a container restart the agent did not see fail). The agent reloads the current weights before going on."""


@runtime_checkable
class InferenceEngine(Protocol):
    """What a rollout agent needs from an inference engine."""

    @property
    def version(self) -> int:
        """Policy version of the weights being served."""
        ...

    def set_version(self, version: int) -> None: ...

    async def start(self) -> None:
        """Launch the server (or attach to a running one) and wait until it is healthy."""

    async def stop(self) -> None:
        """Stop a server this object launched; close connections."""

    async def health(self) -> bool: ...

    async def generate(self, req: GenerateRequest) -> GenerateResult: ...

    async def pause(self) -> None:
        """Abort in-flight generations (they return finish_reason abort) and hold new ones."""

    async def resume(self) -> None: ...

    async def update_weights_from_disk(self, path: str, version: int) -> None:
        """Load Hugging Face safetensors from `path` in place (no restart); afterwards `version` == version."""


# Engines that take `weightSync.mode: broadcast` also have `workers` (ranks they join with) and
# `async update_weights_broadcast(assign)` (vllm.py); admission refuses broadcast for the others.


# name -> "module:Class", imported lazily so the SGLang client never loads vLLM and vice versa.
ENGINES: dict[str, str] = {
    "vllm": "kuberl.runtime.inference.vllm:VLLMEngine",
    "sglang": "kuberl.runtime.inference.sglang:SGLangEngine",
}


def engine_class(name: str) -> type:
    """The engine class registered under `name` (spec.rollout.engine)."""
    if name not in ENGINES:
        raise ValueError(f"rollout.engine: unknown engine {name!r} (known: {', '.join(sorted(ENGINES))})")
    module_name, _, cls_name = ENGINES[name].partition(":")
    return getattr(importlib.import_module(module_name), cls_name)
