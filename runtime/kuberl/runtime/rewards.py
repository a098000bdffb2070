"""Reward functions: a registry name (or an import path `package.module:function`) -> reward(prompt, completion, answer).

The rollout workflows resolve `spec.workflow.reward` once and score each response through a reward
pool (reward_pool.py: worker processes, a timeout per response). A reward is any finite number (0/1,
+-1, a reward model's score); `check_reward` refuses NaN, infinity and non-numbers with RewardRefused.
The algorithm's rewardBias/rewardScaling shape it later.
"""

from __future__ import annotations

import importlib
import math
import numbers
import re
import threading
from collections.abc import Callable

from kuberl.runtime.data import REPEAT_LEN

RewardFn = Callable[[str, str, str], float]

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


class RewardError(ValueError):
    """workflow.reward names no usable function, or the function failed on a response."""


class RewardRefused(RewardError):
    """A reward function returned something that is not a finite number: its group is rejected, the reason logged."""


_BOXED = "\\boxed"


def last_boxed(text: str) -> str | None:
    """The content of the last complete `\\boxed{...}` in `text` (nested braces kept), or None.

    AReaL's math prompts ask for the answer in \\boxed{}; a reasoning that goes on after it ("Step 3: check
    5 apples") must not replace it. A box cut off by the token limit (no closing brace) is skipped.
    """
    start = text.rfind(_BOXED)
    while start != -1:
        i = start + len(_BOXED)
        while i < len(text) and text[i].isspace():
            i += 1
        if i < len(text) and text[i] == "{":
            depth = 0
            for j in range(i, len(text)):
                depth += {"{": 1, "}": -1}.get(text[j], 0)
                if depth == 0:
                    return text[i + 1 : j]
        start = text.rfind(_BOXED, 0, start)
    return None


def _gsm8k_final(text: str) -> str:
    """GSM8K marks the final answer with '####'; keep what follows it (else the whole text)."""
    if "####" in text:
        return text.rsplit("####", 1)[1].strip()
    return text


def math_final(completion: str) -> str:
    """The part of a response math-verify reads: the last \\boxed{} alone, else after '####', else the whole text."""
    boxed = last_boxed(completion)
    if boxed is not None:
        return _BOXED + "{" + boxed + "}"  # re-boxed: math-verify's own boxed handling ($, \\text, units) applies
    return _gsm8k_final(completion)


def math_reward(prompt: str, completion: str, answer: str) -> float:
    """1 if the completion's final answer equals the reference (math-verify: numbers, fractions, LaTeX)."""
    from math_verify import parse, verify

    # math-verify's timeouts use SIGALRM, which only the main thread may set (a reward worker process's calls run there).
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    gold = parse(_gsm8k_final(answer), parsing_timeout=timeout)
    pred = parse(math_final(completion), parsing_timeout=timeout)
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

# Modules a reward worker process imports before it takes its first response, so their import time
# (math-verify loads sympy: seconds) is not counted against workflow.rewardTimeoutSeconds.
PRELOAD: dict[str, tuple[str, ...]] = {"math": ("math_verify",)}


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


def check_reward(value: object, *, name: str = "reward") -> float:
    """A reward function's result as a float: any finite real number (bool counts as 0/1).

    NaN, infinity and non-numbers raise RewardRefused: they would poison the group's advantages.
    """
    if isinstance(value, bool):
        return float(value)
    if not isinstance(value, numbers.Real):
        raise RewardRefused(f"workflow.reward {name}: returned {value!r} ({type(value).__name__}); expected a finite number")
    out = float(value)
    if not math.isfinite(out):
        raise RewardRefused(f"workflow.reward {name}: returned {value!r}; expected a finite number")
    return out


def score(fn: RewardFn, prompt: str, completion: str, answer: str, *, name: str = "reward") -> float:
    """Call a reward in this thread and check its result (check_reward); the workflows use a RewardPool instead."""
    return check_reward(fn(prompt, completion, answer), name=name)
