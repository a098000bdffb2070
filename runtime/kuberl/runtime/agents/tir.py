"""Tool-integrated reasoning for math (AReaL's TIR): the model may call a `python` tool mid-answer.

Each tool call runs in the sandbox (runtime/kuberl/runtime/rollout/sandbox.py: own process, no network,
CPU/memory/time limits from workflow.sandbox; with workflow.sandbox.placement pod, on the sandbox server,
sandbox_server.py, through ctx.sandbox_client) and its output, or a clear error, goes back to the
model as the tool's message; the conversation goes on until the model answers without a tool call
or MAX_TOOL_CALLS is reached. The final answer is scored by workflow.reward (e.g. math). An episode
that ends on a failed tool call (timeout, exception) with no answer after it scores 0.
Used by examples/tir-math.yaml as `kuberl.runtime.agents.tir:math_with_python`.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from kuberl.runtime.rollout.sandbox import SandboxResult, run_python
from kuberl.runtime.rollout.sandbox_server import SandboxClient

log = logging.getLogger(__name__)

MAX_TOOL_CALLS = 4
SYSTEM = ("Solve the problem step by step. You can run Python code with the `python` tool; print what you need to see. "
          "Give the final answer after ####.")
PYTHON_TOOL = {
    "type": "function",
    "function": {
        "name": "python",
        "description": "Run Python 3 code in a sandbox (no network, a few seconds of CPU) and return what it prints.",
        "parameters": {"type": "object", "properties": {"code": {"type": "string", "description": "The code to run."}},
                       "required": ["code"]},
    },
}


def tool_code(arguments: str) -> str | None:
    """The `code` argument of a python tool call, or None if the model wrote no usable arguments."""
    try:
        args = json.loads(arguments) if arguments else {}
    except json.JSONDecodeError:
        return None
    code = args.get("code") if isinstance(args, dict) else None
    return code if isinstance(code, str) and code.strip() else None


async def run_tool(name: str, arguments: str, sandbox: Any, client: SandboxClient | None = None) -> SandboxResult | str:
    """Execute one tool call, on the sandbox server when `client` is given (placement pod), else in a local subprocess;
    a str is an error about the call itself (unknown tool, bad arguments)."""
    if name != "python":
        return f"Error: unknown tool {name!r}; the only tool is python"
    code = tool_code(arguments)
    if code is None:
        return 'Error: the python tool needs arguments {"code": "<python source>"}'
    if client is not None:
        return await client.run(code, sandbox)
    return await run_python(code, sandbox)


async def math_with_python(client: Any, item: Any, ctx: Any = None) -> float | None:
    """One TIR episode; returns 0.0 if it ended on a failed tool call, else None (workflow.reward scores the answer)."""
    sandbox = getattr(ctx, "sandbox", None)
    sandbox_client = getattr(ctx, "sandbox_client", None)  # placement pod: the sandbox server
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": item.prompt}]
    last_failed = False
    for _ in range(MAX_TOOL_CALLS + 1):
        r = await client.chat.completions.create(model="policy", messages=messages, tools=[PYTHON_TOOL])
        msg = r.choices[0].message
        messages.append(msg.model_dump(exclude_none=True))
        if not msg.tool_calls:
            return None
        last_failed = False
        for call in msg.tool_calls:
            result = await run_tool(call.function.name, call.function.arguments, sandbox, sandbox_client)
            if isinstance(result, str):
                text, failed = result, True
            else:
                text, failed = result.observation(), not result.ok
                if failed:
                    log.info("tir: tool call failed: %s", result.error)
            last_failed = last_failed or failed
            messages.append({"role": "tool", "tool_call_id": call.id, "content": text})
    return 0.0 if last_failed else None
