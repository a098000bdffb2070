"""Where generation stops: a model's stop token ids, and the manifest's stop strings.

The engines run with their own end-of-sequence handling off (vllm.py: ignore_eos) and stop only where a request
says, so this set is the whole definition of "the model ended its answer". Computed once per run by the rollout
workflows (workflows.make_workflow) and evaluation (evaluation.Evaluator); the agent's OpenAI proxy takes it from
the workflow's SamplingConfig. AReaL likewise stops at the tokenizer's pad and eos (areal/api/cli_args.py).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

_MARKER = "\x00KUBERL-ANSWER\x00"  # stands for an assistant reply while rendering the chat template
_logged: set[tuple] = set()  # stop sets already logged by this process (workflows and evaluation share one)


@dataclass(frozen=True)
class StopSet:
    """Stop token ids, each with where it came from (in the order found), and stop strings."""

    token_ids: dict[int, tuple[str, ...]] = field(default_factory=dict)
    strings: tuple[str, ...] = ()

    @property
    def ids(self) -> list[int]:
        return list(self.token_ids)

    def describe(self, tokenizer: Any) -> str:
        """One log line: each id with its text and sources, then the strings."""
        parts = [f"{i} {tokenizer.decode([i], skip_special_tokens=False)!r} ({', '.join(src)})" for i, src in self.token_ids.items()]
        text = "stop tokens: " + ("; ".join(parts) or "none")
        return text + (f"; stop strings: {list(self.strings)!r}" if self.strings else "")


def _ids(value: Any) -> list[int]:
    """An eos_token_id field as a list: absent, one int, or a list of ints."""
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def generation_config_eos(model_dir: str | Path | None) -> list[int]:
    """generation_config.json's eos_token_id (Qwen2.5: [151645, 151643]); [] when the folder has none."""
    if model_dir is None or not (Path(model_dir) / "generation_config.json").is_file():
        return []
    from transformers import GenerationConfig

    try:
        return _ids(GenerationConfig.from_pretrained(str(model_dir)).eos_token_id)
    except (OSError, ValueError, TypeError) as exc:
        raise ValueError(f"the model's generation_config.json cannot be read: {exc}") from exc


def config_eos(model_dir: str | Path | None) -> list[int]:
    """config.json's eos_token_id: SGLang also stops there on its own, so the set must hold it to describe the engine."""
    path = None if model_dir is None else Path(model_dir) / "config.json"
    if path is None or not path.is_file():
        return []
    try:
        return _ids(json.loads(path.read_text()).get("eos_token_id"))
    except (ValueError, TypeError) as exc:
        raise ValueError(f"the model's config.json has an unreadable eos_token_id: {exc}") from exc


def _special_tokens(tokenizer: Any) -> set[str]:
    specials = set(getattr(tokenizer, "all_special_tokens", None) or [])
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return specials | {t.content for t in decoder.values() if getattr(t, "special", False)}


def end_of_turn_token(tokenizer: Any) -> str | None:
    """The special token the chat template closes an assistant turn with (<|im_end|>, <|eot_id|>, <end_of_turn>).

    A base model served under a chat template learns to end its turn there, and its eos is elsewhere
    (Qwen2.5 base: eos <|endoftext|>). Found by rendering one assistant reply and reading what follows it.
    None without a template, or when no special token follows the reply.
    """
    if not getattr(tokenizer, "chat_template", None):
        return None
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": _MARKER}]
    try:
        text = tokenizer.apply_chat_template(msgs, tokenize=False)
    except Exception as exc:  # noqa: BLE001  a template that cannot render this shape has no end of turn to find
        log.warning("chat template end-of-turn token not found: the template cannot render a reply (%s: %s)", type(exc).__name__, exc)
        return None
    at = text.find(_MARKER)
    if at < 0:
        return None
    after = text[at + len(_MARKER):]
    matches = [t for t in _special_tokens(tokenizer) if t and after.startswith(t)]
    return max(matches, key=len) if matches else None


def compute_stop_set(tokenizer: Any, model_dir: str | Path | None = None, *, use_chat_template: bool,
                     extra_ids: Iterable[int] = (), stop: Iterable[str] = ()) -> StopSet:
    """The stop set of a model: the tokenizer's eos, config.json's and generation_config.json's eos_token_id, the
    pad token, the chat template's end-of-turn token (when prompts use the template), then `extra_ids`
    (algorithm.stopTokenIds). `model_dir` defaults to the folder the tokenizer was loaded from.
    Raises ValueError for an extra id outside the tokenizer's vocabulary."""
    loaded_from = getattr(tokenizer, "name_or_path", None)
    if model_dir is None and loaded_from and Path(loaded_from).is_dir():
        model_dir = loaded_from
    found: dict[int, list[str]] = {}

    def add(ids: Iterable[int | None], source: str) -> None:
        for i in ids:
            if i is not None:
                found.setdefault(int(i), []).append(source)

    add([tokenizer.eos_token_id], "eos")
    add(config_eos(model_dir), "config.json")
    add(generation_config_eos(model_dir), "generation_config.json")
    add([getattr(tokenizer, "pad_token_id", None)], "pad")
    if use_chat_template and (turn_end := end_of_turn_token(tokenizer)) is not None:
        add([tokenizer.convert_tokens_to_ids(turn_end)], "chat template end of turn")
    extra = list(extra_ids)
    if extra and (bad := [i for i in extra if not 0 <= i < len(tokenizer)]):
        raise ValueError(f"algorithm.stopTokenIds: {bad} outside the tokenizer's vocabulary (ids 0 to {len(tokenizer) - 1})")
    add(extra, "algorithm.stopTokenIds")
    return StopSet({i: tuple(src) for i, src in found.items()}, tuple(dict.fromkeys(stop)))


def stop_set_for(spec: Any, tokenizer: Any, model_dir: str | Path | None = None) -> StopSet:
    """The stop set of an RLExperimentSpec's run, logged the first time this process computes it.

    The chat template's end of turn counts when workflow.useChatTemplate, and for agent workflows (the proxy
    renders chat requests with the template)."""
    wf, a = spec.workflow, spec.algorithm
    chat = bool(wf.use_chat_template) or str(wf.type) == "agent"
    stops = compute_stop_set(tokenizer, model_dir, use_chat_template=chat, extra_ids=a.stop_token_ids, stop=a.stop)
    key = (tuple(stops.token_ids), stops.strings)
    if key not in _logged:
        _logged.add(key)
        log.info("%s", stops.describe(tokenizer))
    return stops
