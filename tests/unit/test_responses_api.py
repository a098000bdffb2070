"""POST /v1/responses on the agent proxy (runtime/kuberl/runtime/rollout/responses_api.py).

The translation is checked alone (no engine), then through the proxy with the real `openai` client and the scripted
engine of tests/unit/test_agent_workflow.py: one conversation sent through Chat Completions and through Responses
(replayed input, or previous_response_id) must give the same engine requests and the same training sample, token
for token; streaming must parse with the client's own Responses stream helpers; refusals are 400s naming the field.
"""

from __future__ import annotations

import asyncio
import json

import openai
import pytest

from kuberl.runtime.data import Item
from kuberl.runtime.rewards import exact_match_reward
from kuberl.runtime.rollout import responses_api as R
from kuberl.runtime.rollout.agent_workflow import AgentWorkflow
from kuberl.runtime.rollout.openai_proxy import OpenAIProxy
from kuberl.runtime.rollout.proxy_fields import FieldRefused
from tests.unit.test_agent_workflow import ADD_TOOL, ScriptedEngine, episode_of, proxy_call, sampling

FLAT_ADD = {"type": "function", "name": "add", "description": "a + b", "parameters": ADD_TOOL["function"]["parameters"]}
ITEM = Item(0, "What is 2 + 3?", "5")
TOOL_CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from kuberl.runtime.models import build_tiny_model

    return AutoTokenizer.from_pretrained(build_tiny_model(tmp_path_factory.mktemp("tiny")))


def no_warn(name, message):
    raise AssertionError(f"unexpected warning for {name}: {message}")


def to_chat(body, stored=None, warn=no_warn):
    return R.to_chat(body, stored or {}, warn)


class TestTheTranslation:
    def test_a_string_input_is_a_user_message_after_the_instructions(self):
        req = to_chat({"input": "hi", "instructions": "Be brief."})
        assert req.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
        assert req.history == [{"role": "user", "content": "hi"}]  # what previous_response_id carries: no instructions

    def test_an_assistant_message_and_its_function_calls_are_one_turn_and_outputs_are_tool_messages(self):
        items = [{"role": "user", "content": [{"type": "input_text", "text": "2+3?"}]},
                 {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "add"}]},
                 {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Adding.", "annotations": []}]},
                 {"type": "function_call", "call_id": "c1", "name": "add", "arguments": '{"a": 2}'},
                 {"type": "function_call", "call_id": "c2", "name": "add", "arguments": '{"b": 3}'},
                 {"type": "function_call_output", "call_id": "c1", "output": "2"},
                 {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "3"}]},
                 {"role": "developer", "content": "Answer now."}]
        assert R.input_messages(items) == [
            {"role": "user", "content": "2+3?"},
            {"role": "assistant", "content": "Adding.", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2}'}},
                {"id": "c2", "type": "function", "function": {"name": "add", "arguments": '{"b": 3}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "2"},
            {"role": "tool", "tool_call_id": "c2", "content": "3"},
            {"role": "system", "content": "Answer now."},
        ]

    def test_a_function_call_with_no_assistant_text_before_it_opens_its_own_turn(self):
        items = [{"role": "user", "content": "q"}, {"type": "function_call", "call_id": "c", "name": "add", "arguments": "{}"}]
        assert R.input_messages(items)[1] == {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "add", "arguments": "{}"}}]}

    def test_flat_function_tools_become_chat_tools_and_the_chat_fields_carry_over(self):
        req = to_chat({"input": "q", "tools": [dict(FLAT_ADD, strict=True)], "tool_choice": "none", "parallel_tool_calls": False,
                       "max_output_tokens": 7, "store": False, "metadata": {"k": "v"}})
        assert req.body == {"tools": [{"type": "function", "function": dict(ADD_TOOL["function"], strict=True)}],
                            "tool_choice": "none", "parallel_tool_calls": False, "max_tokens": 7}
        assert list(req.body["tools"][0]["function"]) == ["name", "description", "parameters", "strict"]  # as a chat client writes it

    @pytest.mark.parametrize(("body", "named"), [
        ({"tools": [{"type": "web_search"}]}, "tools[0] of type 'web_search'"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {}}}}, "text.format 'json_schema'"),
        ({"background": True}, "background true"),
        ({"conversation": "conv_1"}, "conversation is not supported"),
        ({"top_logprobs": 3}, "top_logprobs is not supported"),
        ({"truncation": "auto"}, "truncation 'auto'"),
        ({"previous_response_id": "resp_x"}, "previous_response_id 'resp_x' is not a response of this episode"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]}, "input[0].content[0] of type 'input_image'"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0] of type 'item_reference'"),
    ])
    def test_what_cannot_be_honoured_is_refused_naming_the_field(self, body, named):
        with pytest.raises(FieldRefused, match=named.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")):
            to_chat({"input": "q", **body})

    def test_ignored_fields_that_ask_for_something_are_warned_about(self):
        seen = {}
        to_chat({"input": "q", "include": ["message.output_text.logprobs"], "reasoning": {"effort": "high"},
                 "text": {"format": {"type": "text"}, "verbosity": "low"}}, warn=seen.__setitem__)
        assert set(seen) == {"include", "reasoning", "text.verbosity"}
        to_chat({"input": "q", "include": [], "store": True, "user": "u"})  # nothing asked: no warning

    def test_previous_response_id_continues_its_conversation_without_its_instructions(self):
        stored = {"resp_1": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
        req = to_chat({"previous_response_id": "resp_1", "input": "more", "instructions": "New rules."}, stored)
        assert req.messages == [{"role": "system", "content": "New rules."}, *stored["resp_1"], {"role": "user", "content": "more"}]

    def test_an_answer_becomes_reasoning_message_and_function_call_items(self):
        choice = {"finish_reason": "tool_calls", "message": {"role": "assistant", "content": "Adding.", "reasoning_content": "2+3",
                                                             "tool_calls": [{"id": "call_1", "function": {"name": "add", "arguments": "{}"}}]}}
        items = R.output_items(choice)
        assert [i["type"] for i in items] == ["reasoning", "message", "function_call"]
        assert items[0]["content"][0]["text"] == "2+3" and items[1]["content"][0]["text"] == "Adding."
        assert (items[2]["call_id"], items[2]["name"], items[2]["arguments"]) == ("call_1", "add", "{}")

    def test_an_answer_cut_at_its_limit_is_completed_with_the_reason_in_incomplete_details(self):
        req = to_chat({"input": "q"})
        usage = {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
        cut = R.response_object({}, req, {"finish_reason": "length", "message": {"content": "abcd"}}, usage, (1.0, 1.0))
        assert cut["status"] == "completed" and cut["incomplete_details"] == {"reason": "max_output_tokens"}
        assert cut["output"][0]["status"] == "incomplete" and cut["usage"]["output_tokens"] == 4
        whole = R.response_object({}, req, {"finish_reason": "stop", "message": {"content": "ab"}}, usage, (1.0, 1.0))
        assert whole["incomplete_details"] is None and whole["output"][0]["status"] == "completed"

    def test_the_event_sequence_opens_each_item_then_fills_and_closes_it(self):
        choice = {"finish_reason": "tool_calls", "message": {"content": "Adding.", "tool_calls": [{"id": "c", "function": {"name": "add", "arguments": "{}"}}]}}
        resp = R.response_object({}, to_chat({"input": "q"}), choice, {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}, (1.0, 1.0))
        assert [kind for kind, _ in R.stream_events(resp)] == [
            "response.created", "response.in_progress",
            "response.output_item.added", "response.content_part.added", "response.output_text.delta", "response.output_text.done",
            "response.content_part.done", "response.output_item.done",
            "response.output_item.added", "response.function_call_arguments.delta", "response.function_call_arguments.done",
            "response.output_item.done", "response.completed"]
        frames = [json.loads(chunk.decode().split("data: ", 1)[1]) for chunk in R.sse(R.stream_events(resp))]
        assert [f["sequence_number"] for f in frames] == list(range(len(frames)))


# ---------------------------------------------------------------------------------------------
# Through the proxy, with the openai client
# ---------------------------------------------------------------------------------------------


def add_engine(tok):
    """Reasons, calls add, then answers 5 once the tool's result is in the prompt."""
    return ScriptedEngine(tok, lambda ids: "5" if "result 5" in tok.decode(ids) else "<think>2 plus 3</think>" + TOOL_CALL, version=3)


async def chat_agent(client, item):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": item.prompt}]
    first = await client.chat.completions.create(model="policy", messages=messages, tools=[ADD_TOOL])
    msg = first.choices[0].message
    messages += [msg.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "result 5"}]
    second = await client.chat.completions.create(model="policy", messages=messages, tools=[ADD_TOOL])
    return float(second.choices[0].message.content == "5")


async def responses_replay_agent(client, item):
    items = [{"role": "user", "content": item.prompt}]
    first = await client.responses.create(model="policy", instructions="Be brief.", input=items, tools=[FLAT_ADD])
    call = next(o for o in first.output if o.type == "function_call")
    items += [o.model_dump(exclude_none=True) for o in first.output] + [{"type": "function_call_output", "call_id": call.call_id, "output": "result 5"}]
    second = await client.responses.create(model="policy", instructions="Be brief.", input=items, tools=[FLAT_ADD])
    return float(second.output_text == "5")


async def responses_previous_id_agent(client, item):
    first = await client.responses.create(model="policy", instructions="Be brief.", input=item.prompt, tools=[FLAT_ADD], store=True)
    call = next(o for o in first.output if o.type == "function_call")
    second = await client.responses.create(model="policy", instructions="Be brief.", previous_response_id=first.id, tools=[FLAT_ADD],
                                           input=[{"type": "function_call_output", "call_id": call.call_id, "output": "result 5"}])
    return float(second.output_text == "5")


async def responses_stream_agent(client, item):
    """The same episode through the client's streaming helper (responses.stream), which checks the event sequence."""
    async with client.responses.stream(model="policy", instructions="Be brief.", input=item.prompt, tools=[FLAT_ADD]) as stream:
        first = await stream.get_final_response()
    call = next(o for o in first.output if o.type == "function_call")
    kinds = []
    second = await client.responses.create(model="policy", instructions="Be brief.", previous_response_id=first.id, tools=[FLAT_ADD], stream=True,
                                           input=[{"type": "function_call_output", "call_id": call.call_id, "output": "result 5"}])
    async for event in second:
        kinds.append(event.type)
        if event.type == "response.output_text.delta":
            text = event.delta
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    return float(text == "5")


def episode(tok, agent):
    engine = add_engine(tok)
    wf = AgentWorkflow(agent, tok, sampling(tok), exact_match_reward, reward_name="exact-match", timeout_seconds=30.0, name="t")
    (sample,) = episode_of(wf, engine, ITEM)
    return engine, sample


@pytest.mark.parametrize("agent", [responses_replay_agent, responses_previous_id_agent, responses_stream_agent])
def test_one_conversation_through_chat_and_through_responses_gives_the_same_training_sample(tokenizer, agent):
    chat_engine, chat_sample = episode(tokenizer, chat_agent)
    engine, sample = episode(tokenizer, agent)
    assert [req.input_ids for req, _ in engine.calls] == [req.input_ids for req, _ in chat_engine.calls]
    assert sample == chat_sample and sample.reward == 1.0 and sample.num_turns == 2
    # ...and that sample is the engine's answers where it generated them, the tool turn between them (not trained).
    (req1, res1), (req2, res2) = engine.calls
    assert sample.input_ids == req1.input_ids and sample.input_ids + sample.output_ids == req2.input_ids + res2.output_ids
    assert [t for t, m in zip(sample.output_ids, sample.loss_mask) if m] == res1.output_ids + res2.output_ids
    assert [v for v, m in zip(sample.versions, sample.loss_mask) if m] == [3] * (len(res1.output_ids) + len(res2.output_ids))
    assert "2 plus 3" in tokenizer.decode(res1.output_ids)  # the reasoning was generated, so it is trained


def call(tok, reply, **kwargs):
    """One /v1/responses call against a fresh proxy: (engine, the Response or the error, the session)."""
    return proxy_call(tok, reply, lambda client: client.responses.create(model="policy", **kwargs))


def test_max_output_tokens_caps_the_generation_and_the_cut_answer_is_recorded(tokenizer):
    engine, out, session = call(tokenizer, lambda ids: "a long answer", input="q", max_output_tokens=3)
    req, res = engine.calls[0]
    assert req.max_new_tokens == 3 and len(res.output_ids) == 3
    assert out.status == "completed" and out.incomplete_details.reason == "max_output_tokens"
    assert session.calls[0].output_ids == res.output_ids and out.usage.output_tokens == 3


def test_a_refused_field_is_a_400_the_client_raises_with_the_fields_name(tokenizer):
    engine, out, session = call(tokenizer, lambda ids: "x", input="q", tools=[FLAT_ADD], tool_choice="required")
    assert isinstance(out, openai.BadRequestError) and "tool_choice 'required' cannot be enforced" in str(out)
    _, out, _ = call(tokenizer, lambda ids: "x", input="q", text={"format": {"type": "json_object"}})
    assert isinstance(out, openai.BadRequestError) and "text.format 'json_object' is not supported" in str(out)
    assert engine.calls == [] and session.calls == []


def test_temperature_is_the_manifests_whatever_the_agent_asks(tokenizer, caplog):
    engine, out, _ = call(tokenizer, lambda ids: "x", input="q", temperature=0.1)
    assert engine.calls[0][0].temperature == 1.0 and out.temperature == 1.0
    assert any("temperature=0.1 ignored" in r.message for r in caplog.records)


def test_an_episode_cannot_continue_another_episodes_response(tokenizer):
    engine = ScriptedEngine(tokenizer, lambda ids: "x")

    async def go():
        proxy = OpenAIProxy(engine, tokenizer, sampling(tokenizer))
        await proxy.start()
        try:
            a, b = proxy.open_session(), proxy.open_session()
            ca = openai.AsyncOpenAI(base_url=proxy.base_url(a), api_key=a.key, max_retries=0)
            cb = openai.AsyncOpenAI(base_url=proxy.base_url(b), api_key=b.key, max_retries=0)
            first = await ca.responses.create(model="policy", input="q")
            with pytest.raises(openai.BadRequestError, match="is not a response of this episode"):
                await cb.responses.create(model="policy", input="more", previous_response_id=first.id)
            await ca.close()
            await cb.close()
        finally:
            await proxy.stop()

    asyncio.run(go())
