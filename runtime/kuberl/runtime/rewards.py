"""Reward functions: a registry name (or an import path `package.module:function`) -> reward(prompt, completion, answer).

The rollout workflows call `resolve_reward(spec.workflow.reward)` once and then the function per
sample. Every reward returns a float in [0, 1]; the algorithm's rewardBias/rewardScaling shape it later.
"""

from __future__ import annotations

import importlib
import math
import re
import threading
from collections.abc import Callable

from kuberl.runtime.data import REPEAT_LEN

RewardFn = Callable[[str, str, str], float]

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


class RewardError(ValueError):
    """workflow.reward names no usable function."""


def _gsm8k_final(text: str) -> str:
    """GSM8K marks the final answer with '####'; keep what follows it (else the whole text)."""
    if "####" in text:
        return text.rsplit("####", 1)[1].strip()
    return text


def math_reward(prompt: str, completion: str, answer: str) -> float:
    """1 if the completion's final answer equals the reference (math-verify: numbers, fractions, LaTeX)."""
    from math_verify import parse, verify

    # math-verify's timeouts use SIGALRM, which only the main thread may set.
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    gold = parse(_gsm8k_final(answer), parsing_timeout=timeout)
    pred = parse(_gsm8k_final(completion), parsing_timeout=timeout)
    if not gold or not pred:
        return 0.0
    return 1.0 if verify(gold, pred, timeout_seconds=timeout) else 0.0


def exact_match_reward(prompt: str, completion: str, answer: str) -> float:
    """1 if the completion equals the answer after trimming whitespace."""
    return 1.0 if completion.strip() == answer.strip() else 0.0


def repeat_digit_reward(prompt: str, completion: str, answer: str) -> float:
    """Fraction of the first len(answer) characters that match the answer (dense partial credit).

    The answer is the prompt's digit repeated REPEAT_LEN times; a random policy over the tiny model's
    vocabulary scores near 0, a policy that learned the task scores 1.
    """
    k = len(answer) or REPEAT_LEN
    return sum(1 for a, c in zip(answer, completion[:k]) if a == c) / k


def add_small_reward(prompt: str, completion: str, answer: str) -> float:
    """1 if the first number in the completion equals the sum."""
    m = _NUMBER.search(completion)
    return 1.0 if m is not None and m.group().replace(",", "") == answer.strip() else 0.0


REWARDS: dict[str, RewardFn] = {
    "math": math_reward,
    "exact-match": exact_match_reward,
    "repeat-digit": repeat_digit_reward,
    "add-small": add_small_reward,
}


def resolve_reward(name: str) -> RewardFn:
    """The reward function for workflow.reward: a registry name or `package.module:function`."""
    if ":" not in name:
        if name not in REWARDS:
            raise RewardError(f"workflow.reward: unknown reward {name!r} (registered: {', '.join(sorted(REWARDS))}; or give package.module:function)")
        return REWARDS[name]
    module_name, _, func_name = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise RewardError(f"workflow.reward: cannot import module {module_name!r} of {name!r}: {exc}") from exc
    fn = getattr(module, func_name, None)
    if fn is None:
        raise RewardError(f"workflow.reward: module {module_name!r} has no attribute {func_name!r}")
    if not callable(fn):
        raise RewardError(f"workflow.reward: {name!r} is a {type(fn).__name__}, not a function")
    return fn


def score(fn: RewardFn, prompt: str, completion: str, answer: str, *, name: str = "reward") -> float:
    """Call a reward and check its result is a number in [0, 1] (user functions included)."""
    value = fn(prompt, completion, answer)
    if isinstance(value, bool):
        value = float(value)
    if not isinstance(value, (int, float)) or math.isnan(value):
        raise RewardError(f"workflow.reward {name}: returned {value!r}; expected a float in [0, 1]")
    if not 0.0 <= value <= 1.0:
        raise RewardError(f"workflow.reward {name}: returned {value!r}, outside [0, 1]")
    return float(value)
