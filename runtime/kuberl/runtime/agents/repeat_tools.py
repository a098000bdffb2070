"""A tool-calling agent for the builtin repeat-digit task: draft, run the `check` tool on it, answer; only the final answer is scored.

Written as an ordinary OpenAI-client agent loop: the drafting calls pass `tools=[CHECK_TOOL]` (the answer
step offers none, as loops asking for a final answer do); when the model
calls the tool, its call is run and echoed back as returned; when it does not (the builtin tiny model
rarely writes a valid `<tool_call>`), the loop calls the tool on the draft itself, as agents that force a
tool step do: it appends the assistant turn with that tool call, then the tool's result as a
`role: "tool"` message. With workflow.exportStyle individual each call is one sample whose output is
exactly what the engine generated; the tool call markup and the tool's result are only ever context
(prompt tokens, never trained). Used by tests/integration/test_agent_run.py.
"""

from __future__ import annotations

import json
from typing import Any

from kuberl.runtime.agents.repeat import FINAL_TOKENS, FIRST_TOKENS, check
from kuberl.runtime.rewards import repeat_digit_reward

# Kept short: the builtin tiny model's tokenizer spends about a token a character on JSON, and tools reach
# the prompt of every call.
CHECK_TOOL = {"type": "function", "function": {"name": "check", "parameters": {"type": "object", "properties": {"answer": {"type": "string"}}}}}


def _answer_of(arguments: str) -> str:
    try:
        args = json.loads(arguments or "{}")
    except json.JSONDecodeError:
        return ""
    return str(args.get("answer", "")) if isinstance(args, dict) else ""


async def tool_agent(client: Any, item: Any, rounds: int = 1) -> float:
    """`rounds` drafts, each checked with the tool, then the final answer: rounds + 1 model calls."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": item.prompt}]
    for r in range(rounds):
        resp = await client.chat.completions.create(model="policy", messages=messages, tools=[CHECK_TOOL], max_tokens=FIRST_TOKENS)
        msg = resp.choices[0].message
        if msg.tool_calls:  # the model called the tool: run its call, keep its turn as returned
            call_id, answer = msg.tool_calls[0].id, _answer_of(msg.tool_calls[0].function.arguments)
            messages.append(msg.model_dump(exclude_none=True))
        else:  # no call: the loop runs the tool on the draft itself
            call_id, answer = f"call_{r}", msg.content or ""
            messages.append({"role": "assistant", "content": answer, "tool_calls": [
                {"id": call_id, "type": "function", "function": {"name": "check", "arguments": json.dumps({"answer": answer}, ensure_ascii=False)}}]})
        messages.append({"role": "tool", "tool_call_id": call_id, "content": check(answer, item.answer)})
    final = await client.chat.completions.create(model="policy", messages=messages, max_tokens=FINAL_TOKENS)
    return repeat_digit_reward(item.prompt, final.choices[0].message.content or "", item.answer)
