"""Agents written with the OpenAI Agents SDK and with LangChain, as their users write them, for the repeat-digit task.

Each is an ordinary `workflow.type: agent` function (client, item): the framework gets the episode's base URL and
key from the client it is handed, and nothing else changes. tests/unit/test_framework_agents.py runs them against
the proxy in front of a scripted engine; tests/integration/test_framework_agents_run.py trains each with
`kuberl run` on the builtin tiny model (loaded as `framework_agents:<function>`). Each episode has two model calls
at least: the answer, then (after the model's own `check` tool call, or the user's follow-up when it made none)
the final answer, which workflow.reward scores (the agents return None).
"""

from __future__ import annotations

from typing import Any

from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIProvider, RunConfig, Runner, function_tool
from langchain_core.messages import HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI

MAX_TOKENS = 8  # per call: the tiny model's answers are short, and a concat episode shares maxNewTokens
# Short: the builtin tiny model's context is 512 tokens, its tokenizer spends about a token a character, and the tool's
# JSON schema reaches every prompt.
INSTRUCTIONS = "Repeat the digit."
FOLLOW_UP = "Once more, digits only."


def check_result(answer: str, target: str) -> str:
    """What the `check` tool tells the model: how many leading characters are right."""
    right = sum(1 for a, b in zip(answer, target) if a == b)
    return f"{right} of {len(target)} right."


def sdk_check_tool(item: Any) -> Any:
    """The Agents SDK function tool for this item (the SDK builds its JSON schema from the signature)."""

    @function_tool
    def check(answer: str) -> str:
        """Check a draft."""
        return check_result(answer, item.answer)

    return check


async def sdk_responses_agent(client: Any, item: Any) -> None:
    """OpenAI Agents SDK with its default model (the Responses API), the follow-up through previous_response_id."""
    run_config = RunConfig(model_provider=OpenAIProvider(openai_client=client), tracing_disabled=True)
    agent = Agent(name="repeater", instructions=INSTRUCTIONS, model="policy", tools=[sdk_check_tool(item)],
                  model_settings=ModelSettings(max_tokens=MAX_TOKENS))
    first = await Runner.run(agent, item.prompt, run_config=run_config, max_turns=3)
    await Runner.run(agent, FOLLOW_UP, previous_response_id=first.last_response_id, run_config=run_config, max_turns=3)
    return None


async def sdk_chat_agent(client: Any, item: Any) -> None:
    """OpenAI Agents SDK with OpenAIChatCompletionsModel, the follow-up replaying the conversation (to_input_list)."""
    agent = Agent(name="repeater", instructions=INSTRUCTIONS, tools=[sdk_check_tool(item)],
                  model=OpenAIChatCompletionsModel(model="policy", openai_client=client),
                  model_settings=ModelSettings(max_tokens=MAX_TOKENS))
    run_config = RunConfig(tracing_disabled=True)
    first = await Runner.run(agent, item.prompt, run_config=run_config, max_turns=3)
    await Runner.run(agent, first.to_input_list() + [{"role": "user", "content": FOLLOW_UP}], run_config=run_config, max_turns=3)
    return None


async def langchain_agent(client: Any, item: Any, use_responses_api: bool | None = None) -> None:
    """LangChain's ChatOpenAI with bind_tools: a tool round when the model calls `check`, else the user's follow-up.
    `use_responses_api`: ChatOpenAI's own switch (None, its default: chat completions for these calls)."""

    @tool
    def check(answer: str) -> str:
        """Check a draft."""
        return check_result(answer, item.answer)

    llm = ChatOpenAI(model="policy", base_url=str(client.base_url), api_key=client.api_key, max_tokens=MAX_TOKENS, max_retries=0,
                     use_responses_api=use_responses_api)
    bound = llm.bind_tools([check])
    messages: list[Any] = [HumanMessage(item.prompt)]
    for _ in range(3):
        reply = await bound.ainvoke(messages)
        messages.append(reply)
        if reply.tool_calls:
            messages += [ToolMessage(check.invoke(call["args"]), tool_call_id=call["id"]) for call in reply.tool_calls]
        elif len(messages) == 2:
            messages.append(HumanMessage(FOLLOW_UP))
        else:
            break
    return None
