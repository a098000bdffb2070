"""workflow.exportStyle individual: one sample per agent call, exactly what the engine generated, sharing the
episode reward with the turn discount applied backwards from the last call.

The real `openai` client talks to the proxy in front of a scripted engine (tests/unit/test_agent_workflow.py),
so each sample can be compared with the engine's (request, result) pairs token for token; the real vLLM path
is tests/integration/test_agent.py.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from kuberl.runtime.agents.repeat_tools import CHECK_TOOL, tool_agent
from kuberl.runtime.data import Item
from kuberl.runtime.rewards import exact_match_reward
from kuberl.runtime.rollout.agent_workflow import AgentWorkflow, individual_samples
from kuberl.runtime.rollout.openai_proxy import CallRecord
from kuberl.runtime.rollout.registry import WorkflowError
from kuberl.runtime.rollout.workflows import EpisodeContext
from tests.unit.test_agent_workflow import ScriptedEngine, sampling

ITEM = Item(3, "Repeat 4 4 4", "444")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from kuberl.runtime.models import build_tiny_model

    return AutoTokenizer.from_pretrained(build_tiny_model(tmp_path_factory.mktemp("tiny")))


def test_a_three_call_episode_becomes_three_samples_with_rewards_discounted_from_the_last_call():
    calls = [CallRecord("chat", [1, 2], [3, 4], [-0.1, -0.2], [5, 5], "stop", "a"),
             CallRecord("chat", [1, 2, 3, 4, 9], [6], [-0.3], [6], "stop", "b", parent=0),
             CallRecord("chat", [7], [8, 8, 8], [-0.4, -0.5, -0.6], [6, 7, 7], "length", "c")]
    s = individual_samples(calls, 2.0, turn_discount=0.5)
    assert [x.reward for x in s] == [0.5, 1.0, 2.0]  # 2 * 0.5^2, 2 * 0.5, 2
    assert [x.input_ids for x in s] == [[1, 2], [1, 2, 3, 4, 9], [7]]
    assert [x.output_ids for x in s] == [[3, 4], [6], [8, 8, 8]]
    assert [x.logprobs for x in s] == [[-0.1, -0.2], [-0.3], [-0.4, -0.5, -0.6]]
    assert [x.versions for x in s] == [[5, 5], [6], [6, 7, 7]]
    assert [x.loss_mask for x in s] == [[1, 1], [1], [1, 1, 1]]
    assert [x.finish_reason for x in s] == ["stop", "stop", "length"]
    assert [x.reward for x in individual_samples(calls, 2.0)] == [2.0, 2.0, 2.0]  # no discount: the episode reward each


def run_episodes(tok, engine, agent, *, n, turn_discount=1.0, export_style="individual"):
    wf = AgentWorkflow(agent, tok, sampling(tok, n), exact_match_reward, reward_name="exact-match", name="test-agent",
                       export_style=export_style, turn_discount=turn_discount)

    async def go():
        try:
            return await wf.arun_episode(engine, ITEM, EpisodeContext(ticket_id="t1"))
        finally:
            await wf.aclose()

    return wf, asyncio.run(go())


class TestThroughTheProxy:
    def test_each_call_is_one_sample_token_for_token_with_tool_output_only_in_later_prompts(self, tokenizer):
        engine = ScriptedEngine(tokenizer, lambda ids: "4 4", version=3)

        async def agent(client, item):
            return await tool_agent(client, item, rounds=2)  # 3 calls: draft, draft, final

        _, samples = run_episodes(tokenizer, engine, agent, n=1, turn_discount=0.9)
        assert len(samples) == 3 == len(engine.calls)
        for s, (req, res) in zip(samples, engine.calls):
            assert s.input_ids == req.input_ids  # the call's whole context
            assert s.output_ids == res.output_ids and s.logprobs == res.logprobs  # exactly what the engine generated
            assert s.versions == [3] * len(res.output_ids) and s.loss_mask == [1] * len(res.output_ids)
            assert "right. Final answer" not in tokenizer.decode(s.output_ids)  # the tool's output is never an output
        # The tool's result reaches the later calls as context (the tool turn), with the tools in the prompt.
        assert "right. Final answer" not in tokenizer.decode(samples[0].input_ids)
        assert all("right. Final answer" in tokenizer.decode(s.input_ids) for s in samples[1:])
        assert json.dumps(CHECK_TOOL) in tokenizer.decode(samples[0].input_ids)
        # "4 4" is not "444": repeat_digit scores it by its digits; every call gets it, discounted from the last call.
        r = samples[2].reward
        assert r > 0
        assert [s.reward for s in samples] == pytest.approx([r * 0.81, r * 0.9, r])

    def test_episodes_with_different_call_counts_make_one_ragged_group(self, tokenizer):
        engine = ScriptedEngine(tokenizer, lambda ids: "444")

        async def agent(client, item, ctx):
            rounds = 1 + int(ctx.episode.endswith("/1"))  # episode 1 checks twice
            await tool_agent(client, item, rounds=rounds)
            return float(rounds)

        _, samples = run_episodes(tokenizer, engine, agent, n=3)
        assert len(samples) == 2 + 3 + 2  # in episode order
        assert [s.reward for s in samples] == [1.0, 1.0, 2.0, 2.0, 2.0, 1.0, 1.0]

    def test_concat_still_makes_one_sample_per_episode(self, tokenizer):
        engine = ScriptedEngine(tokenizer, lambda ids: "444")

        async def agent(client, item):
            return await tool_agent(client, item, rounds=1)

        wf, samples = run_episodes(tokenizer, engine, agent, n=2, export_style="concat")
        assert len(samples) == 2 and len(engine.calls) == 4
        # The loop's own tool call is not what the model generated: the draft's call cannot share the final call's
        # sequence, so it is left out (and counted) rather than trained on under a context it never saw.
        assert wf.stats.calls_outside_sample == 2
        assert all("right. Final answer" in tokenizer.decode(s.input_ids) for s in samples)  # each: the final call alone


@pytest.mark.parametrize("kwargs, message", [({"export_style": "bogus"}, "workflow.exportStyle: 'bogus' is not concat or individual"),
                                             ({"turn_discount": 0.0}, r"workflow.turnDiscount: 0.0 is not in \(0, 1\]")])
def test_bad_export_settings_are_refused(tokenizer, kwargs, message):
    async def agent(client, item):
        return 1.0

    with pytest.raises(WorkflowError, match=message):
        AgentWorkflow(agent, tokenizer, sampling(tokenizer), exact_match_reward, **kwargs)
