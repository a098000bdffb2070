"""A two-call agent for the builtin repeat-digit task: answer, get checked, answer again; the second answer is scored.

The reward depends only on the later call, so learning it needs the episode's calls trained as one
sequence (the first answer and the checker's message stay in the context; the checker's tokens are
never trained on). Used by examples/agent-cpu.yaml and tests/integration/test_agent.py.
"""

from __future__ import annotations

from typing import Any

from kuberl.runtime.rewards import repeat_digit_reward

FIRST_TOKENS = 4
FINAL_TOKENS = 8


def check(answer: str, target: str) -> str:
    """The 'tool' the agent runs on the first answer: how many leading characters are right."""
    right = sum(1 for a, b in zip(answer, target) if a == b)
    return f"{right} of {len(target)} right. Final answer:"


async def two_call_agent(client: Any, item: Any) -> float:
    messages = [{"role": "user", "content": item.prompt}]
    first = await client.chat.completions.create(model="policy", messages=messages, max_tokens=FIRST_TOKENS)
    draft = first.choices[0].message.content or ""
    messages += [{"role": "assistant", "content": draft}, {"role": "user", "content": check(draft, item.answer)}]
    final = await client.chat.completions.create(model="policy", messages=messages, max_tokens=FINAL_TOKENS)
    return repeat_digit_reward(item.prompt, final.choices[0].message.content or "", item.answer)
