"""The OpenAI request fields the agent proxy (openai_proxy.py) honours, ignores with a log, or refuses (pure).

Agent frameworks send more than messages: ReAct loops send `stop`, some clients a fixed `seed`, tool-calling
frameworks `tool_choice` and `parallel_tool_calls`, structured-output code `response_format`. Each is either
honoured, ignored with one warning (where honouring it would change the policy the trainer scores), or refused with
a 400 that names the field, never silently changed. docs/agents.md has the table.

| field | handling |
|---|---|
| `stop` (string or list) | honoured: generation ends at the first, the returned text stops before it, the trained tokens keep it |
| `n` | honoured: n answers sampled independently, each recorded as its own call |
| `seed` | ignored, logged once: a fixed seed would make every episode of a group the same answer (no advantage) |
| `temperature`, `top_p` | ignored, logged once: the engine samples with the manifest's (the policy the trainer scores) |
| `tool_choice` | `auto` honoured; `none` honoured (the tools are left out of the prompt); `required` or a named function refused |
| `parallel_tool_calls` | `true` honoured; `false`: the first tool call is returned, the others logged |
| `response_format` | `text` honoured; `json_object`, `json_schema` refused (no constrained decoding on the token path) |
| `max_tokens`, `max_completion_tokens` | honoured, capped by maxNewTokens (and the episode's budget with exportStyle concat) |
| NO_OP's fields (`logprobs`, `logit_bias`, the penalties...) | refused unless at their no-op value: each changes what is sampled or returned |
| the rest of KNOWN_FIELDS (`model`, `user`, `metadata`, `store`...) | accepted: nothing sampled changes |
| any other field | ignored, logged once, naming it |
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

MAX_N = 16
MAX_STOP = 16
_THINK = re.compile(r"^\s*(?:<think>)?(.*?)</think>\s*", re.DOTALL)


class FieldRefused(ValueError):
    """A request field the proxy cannot honour; the message names it (a 400 for the agent)."""


@dataclass
class CallOptions:
    """What one request asks of the proxy beyond its messages or prompt."""

    stop: list[str] = field(default_factory=list)
    n: int = 1
    tools_enabled: bool = True  # tool_choice none: the tools are left out of the prompt
    first_tool_call_only: bool = False  # parallel_tool_calls false


def call_options(body: dict[str, Any], warn: Callable[[str, str], None]) -> CallOptions:
    """The request's options; FieldRefused for a value the proxy cannot honour. `warn(field, message)` is called for a
    field that is ignored (the caller logs each field once)."""
    opts = CallOptions(stop=_stop(body.get("stop")))
    n = body.get("n", 1)
    if n is None:
        n = 1
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_N:
        raise FieldRefused(f"n must be an integer from 1 to {MAX_N}, got {n!r}")
    opts.n = n
    if body.get("seed") is not None:
        warn("seed", f"seed={body['seed']!r} ignored: every episode of a group would sample the same answer, and the "
                     "group's advantages would all be zero")
    choice = body.get("tool_choice")
    if choice in (None, "auto"):
        pass
    elif choice == "none":
        opts.tools_enabled = False
    else:
        shown = choice if isinstance(choice, str) else "a named function"
        raise FieldRefused(f"tool_choice {shown!r} cannot be enforced: the rollout engine samples freely (no constrained "
                           "decoding on its token path); send tool_choice auto or none")
    parallel = body.get("parallel_tool_calls")
    if parallel is False:
        opts.first_tool_call_only = True
    elif parallel not in (None, True):
        raise FieldRefused(f"parallel_tool_calls must be true or false, got {parallel!r}")
    fmt = body.get("response_format")
    kind = fmt.get("type") if isinstance(fmt, dict) else fmt
    if fmt is not None and kind != "text":
        raise FieldRefused(f"response_format {kind!r} is not supported: the rollout engine's token path has no constrained "
                           "decoding; ask for JSON in the prompt and parse the text")
    _sampling_fields(body)
    for name in sorted(set(body) - KNOWN_FIELDS - set(NO_OP)):
        warn(name, f"{name} is not a field the agent proxy knows; ignored")
    return opts


# Fields that change what is sampled or returned, with their no-op values: anything else is refused, naming the field.
NO_OP: dict[str, tuple[Any, ...]] = {
    "logprobs": (None, False), "top_logprobs": (None, 0), "logit_bias": (None, {}), "frequency_penalty": (None, 0, 0.0),
    "presence_penalty": (None, 0, 0.0), "echo": (None, False), "best_of": (None, 1), "suffix": (None, ""),
    "functions": (None, []), "function_call": (None, "none", "auto"), "prediction": (None,), "audio": (None,),
    "modalities": (None, ["text"]),
}
# Fields the proxy reads (call_options, the chat and completions handlers) or that change nothing the engine samples.
KNOWN_FIELDS = frozenset({
    "model", "messages", "prompt", "tools", "stream", "stream_options", "max_tokens", "max_completion_tokens", "stop", "n",
    "seed", "temperature", "top_p", "tool_choice", "parallel_tool_calls", "response_format", "user", "metadata", "store",
    "service_tier", "reasoning_effort",
})


def _sampling_fields(body: dict[str, Any]) -> None:
    for name, no_op in NO_OP.items():
        if name in body and body[name] not in no_op:
            raise FieldRefused(f"{name}={body[name]!r} is not supported by the agent proxy: the rollout engine samples with the "
                               "manifest's settings and returns the sampled text and tool calls only; leave it unset")


def _stop(value: Any) -> list[str]:
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOP:
        raise FieldRefused(f"stop must be a non-empty string or a list of at most {MAX_STOP} non-empty strings, got {value!r}")
    return stops


def visible_text(text: str, stops: list[str]) -> str:
    """The answer as OpenAI returns it: cut before the first stop string it contains (the engine ends generation with
    the token that completes one; the trained tokens keep it)."""
    cut = min((i for s in stops if (i := text.find(s)) >= 0), default=-1)
    return text if cut < 0 else text[:cut]


def split_reasoning(text: str) -> tuple[str | None, str]:
    """(reasoning, answer) of a reasoning model's output: what precedes `</think>` (a leading `<think>` dropped) is the
    reasoning, as vLLM's reasoning parsers return it in `reasoning_content`; no `</think>`: (None, text)."""
    m = _THINK.match(text)
    if m is None:
        return None, text
    return m.group(1).strip(), text[m.end():]
