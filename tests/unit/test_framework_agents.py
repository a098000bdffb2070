"""Agents written with the OpenAI Agents SDK and LangChain (tests/integration/framework_agents.py) through the proxy.

Each runs as `workflow.type: agent` runs it (AgentWorkflow, the real openai client the framework is given) against the
scripted engine of tests/unit/test_agent_workflow.py, which first calls the `check` tool and then answers: the
episode must be the framework's calls recorded token for token (each generated run exactly what the engine returned,
the sample the concatenation of the last prompt and its answer), and the SDK's default model must really go through
/v1/responses. tests/integration/test_framework_agents_run.py trains them with `kuberl run` on the tiny model.
"""

from __future__ import annotations

import pytest
from agents import Agent, ModelSettings, OpenAIProvider, RunConfig, Runner

from kuberl.runtime.data import Item
from kuberl.runtime.rewards import repeat_digit_reward
from kuberl.runtime.rollout import responses_api
from kuberl.runtime.rollout.agent_workflow import AgentWorkflow
from tests.integration import framework_agents as fa
from tests.unit.test_agent_workflow import ScriptedEngine, episode_of, generated_segments, sampling

ITEM = Item(0, "Repeat the digit 4: 44444", "444")
CHECK_CALL = '<tool_call>{"name": "check", "arguments": {"answer": "44"}}</tool_call>'


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from kuberl.runtime.models import build_tiny_model

    return AutoTokenizer.from_pretrained(build_tiny_model(tmp_path_factory.mktemp("tiny")))


@pytest.fixture
def long_answers(monkeypatch):
    """Room for the scripted tool call (the agents ask max_tokens 8 of the tiny model)."""
    monkeypatch.setattr(fa, "MAX_TOKENS", 128)


@pytest.fixture
def routes(monkeypatch):
    """How many calls went through /v1/responses."""
    seen = {"responses": 0}
    serve = responses_api.serve

    async def counting(*args, **kwargs):
        seen["responses"] += 1
        return await serve(*args, **kwargs)

    monkeypatch.setattr(responses_api, "serve", counting)
    return seen


def checking_engine(tok):
    """Calls check on its first turn, answers 444 once the tool's result is in the prompt."""
    return ScriptedEngine(tok, lambda ids: "444" if "of 3 right" in tok.decode(ids) else CHECK_CALL, version=2)


def run(tok, engine, agent):
    wf = AgentWorkflow(agent, tok, sampling(tok), repeat_digit_reward, reward_name="repeat-digit", timeout_seconds=60.0, name=agent.__name__)
    (sample,) = episode_of(wf, engine, ITEM)
    return wf, sample


def assert_recorded_token_for_token(sample, engine):
    """The sample is the first prompt, then each call's answer exactly as the engine returned it (trained, with its
    log-probs and version) and the tokens between calls (never trained); it ends with the last call's answer."""
    requests, results = [req for req, _ in engine.calls], [res for _, res in engine.calls]
    assert sample.input_ids == requests[0].input_ids
    assert sample.input_ids + sample.output_ids == requests[-1].input_ids + results[-1].output_ids
    assert [seg for _, seg in generated_segments(sample)] == [r.output_ids for r in results]
    assert [lp for lp, m in zip(sample.logprobs, sample.loss_mask) if m] == [lp for r in results for lp in r.logprobs]
    assert {v for v, m in zip(sample.versions, sample.loss_mask) if m} == {2}
    assert sample.num_turns == len(engine.calls)


async def langchain_responses_agent(client, item):
    """The LangChain agent with ChatOpenAI(use_responses_api=True)."""
    return await fa.langchain_agent(client, item, use_responses_api=True)


@pytest.mark.parametrize(("agent", "calls", "through_responses"), [
    (fa.sdk_responses_agent, 3, 3),  # the tool round, then the follow-up through previous_response_id
    (fa.sdk_chat_agent, 3, 0),  # the same through chat completions, the follow-up replaying to_input_list()
    (fa.langchain_agent, 2, 0),  # the tool round; its answer ends the loop
    (langchain_responses_agent, 2, 2),  # the same through the Responses API
])
def test_a_framework_agents_tool_round_is_recorded_token_for_token(tokenizer, long_answers, routes, agent, calls, through_responses):
    engine = checking_engine(tokenizer)
    wf, sample = run(tokenizer, engine, agent)
    assert len(engine.calls) == calls and routes["responses"] == through_responses
    assert "2 of 3 right." in tokenizer.decode(engine.calls[1][0].input_ids)  # the framework ran the tool the model called
    assert_recorded_token_for_token(sample, engine)
    assert sample.reward == 1.0 and wf.stats.calls_outside_sample == 0


def test_the_sdks_responses_and_chat_models_give_the_same_training_sample(tokenizer, long_answers):
    _, through_responses = run(tokenizer, checking_engine(tokenizer), fa.sdk_responses_agent)
    _, through_chat = run(tokenizer, checking_engine(tokenizer), fa.sdk_chat_agent)
    assert through_responses == through_chat


async def sdk_streamed_agent(client, item, use_responses=True):
    """The SDK's default (Responses) model, streamed: the SDK parses the proxy's SSE events (or its chat model's chunks)."""
    run_config = RunConfig(model_provider=OpenAIProvider(openai_client=client, use_responses=use_responses), tracing_disabled=True)
    agent = Agent(name="repeater", instructions=fa.INSTRUCTIONS, model="policy", tools=[fa.sdk_check_tool(item)],
                  model_settings=ModelSettings(max_tokens=fa.MAX_TOKENS))
    result = Runner.run_streamed(agent, item.prompt, run_config=run_config, max_turns=3)
    kinds = [event.type async for event in result.stream_events()]
    assert "raw_response_event" in kinds and result.final_output == "444"
    return None


async def sdk_streamed_chat_agent(client, item):
    return await sdk_streamed_agent(client, item, use_responses=False)


@pytest.mark.parametrize(("agent", "through_responses"), [(sdk_streamed_agent, 2), (sdk_streamed_chat_agent, 0)])
def test_the_sdk_streams_a_tool_round(tokenizer, long_answers, routes, agent, through_responses):
    engine = checking_engine(tokenizer)
    _, sample = run(tokenizer, engine, agent)
    assert len(engine.calls) == 2 and routes["responses"] == through_responses
    assert_recorded_token_for_token(sample, engine)


def test_answers_cut_at_max_tokens_do_not_fail_the_sdks_episode(tokenizer, routes):
    """The tiny model's answers run to max_tokens: OpenAI's status 'incomplete' would make the SDK raise and fail every
    episode; the proxy returns them completed (incomplete_details says why), so the episode trains."""
    engine = ScriptedEngine(tokenizer, lambda ids: "4 4 4 4 4 4 4 4 4 4 4 4", version=2)
    wf, sample = run(tokenizer, engine, fa.sdk_responses_agent)
    assert [res.finish_reason for _, res in engine.calls] == ["length", "length"] and routes["responses"] == 2
    assert_recorded_token_for_token(sample, engine)
    assert not wf.stats.failed


def test_langchains_chat_and_responses_paths_give_the_same_training_sample(tokenizer, long_answers):
    _, through_chat = run(tokenizer, checking_engine(tokenizer), fa.langchain_agent)
    _, through_responses = run(tokenizer, checking_engine(tokenizer), langchain_responses_agent)
    assert through_responses == through_chat
