"""Workflow bookkeeping (kuberl.runtime.rollout.workflows): partial-rollout continuation, version stamping,
multi-turn feedback tokens, workflow selection. The engine-facing behaviour is in tests/integration/test_rollout.py."""

from __future__ import annotations

import asyncio

import pytest

from kuberl.api.v1alpha1 import RLExperimentSpec
from kuberl.runtime.inference.base import GenerateRequest, GenerateResult
from kuberl.runtime.rollout.agent import RolloutAgent
from kuberl.runtime.rollout.workflows import (
    MultiTurnWorkflow,
    PartialGeneration,
    RLVRWorkflow,
    SamplingConfig,
    generate_group,
    make_workflow,
)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from kuberl.runtime.models import build_tiny_model

    return AutoTokenizer.from_pretrained(build_tiny_model(tmp_path_factory.mktemp("tiny")))


def base(max_new=10, seed=None):
    return GenerateRequest(input_ids=[1, 2, 3], max_new_tokens=max_new, temperature=0.9, top_p=0.8, stop_token_ids=[7], seed=seed)


class TestPartialGeneration:
    def test_an_aborted_piece_is_continued_from_prompt_plus_tokens_so_far_with_the_remaining_budget(self):
        gen = PartialGeneration([1, 2, 3], base(10, seed=5))
        gen.add(GenerateResult([11, 12, 13], [-0.1, -0.2, -0.3], "abort", version=4))
        assert not gen.done
        nxt = gen.next_request()
        assert nxt.input_ids == [1, 2, 3, 11, 12, 13] and nxt.max_new_tokens == 7
        assert (nxt.temperature, nxt.top_p, nxt.stop_token_ids) == (0.9, 0.8, [7])
        assert nxt.seed != 5  # a fresh seed per piece: a continuation is not a replay

    def test_each_token_carries_the_version_of_the_piece_that_produced_it(self):
        gen = PartialGeneration([1], base(10))
        gen.add(GenerateResult([11, 12], [-0.1, -0.2], "abort", version=4))
        gen.add(GenerateResult([], [], "abort", version=5))  # aborted again before any token
        gen.add(GenerateResult([13, 7], [-0.3, -0.4], "stop", version=6))
        assert gen.done and gen.finish_reason == "stop" and gen.pieces == 3
        assert gen.output_ids == [11, 12, 13, 7]
        assert gen.versions == [4, 4, 6, 6]
        assert gen.logprobs == [-0.1, -0.2, -0.3, -0.4]

    def test_the_engines_own_token_versions_are_kept_through_a_continuation(self):
        """An in-flight update (weightSync.inFlight keep) changes the weights in the middle of a piece: vLLM reports each
        token's version, and those (not the version the piece started on) are what staleness and the behaviour weight read."""
        gen = PartialGeneration([1], base(10))
        gen.add(GenerateResult([11, 12, 13], [-0.1, -0.2, -0.3], "abort", version=4, versions=[4, 5, 5]))
        gen.add(GenerateResult([14, 7], [-0.4, -0.5], "stop", version=5, versions=[5, 6]))
        assert gen.output_ids == [11, 12, 13, 14, 7]
        assert gen.versions == [4, 5, 5, 5, 6]

    def test_an_abort_that_used_the_whole_budget_finishes_with_length(self):
        gen = PartialGeneration([1], base(2))
        gen.add(GenerateResult([11, 12], [-0.1, -0.2], "abort", version=0))
        assert gen.done and gen.finish_reason == "length"
        with pytest.raises(RuntimeError, match="already finished"):
            gen.next_request()

    def test_an_engine_returning_more_tokens_than_asked_is_an_error(self):
        gen = PartialGeneration([1], base(2))
        with pytest.raises(ValueError, match="more than the 2 asked for"):
            gen.add(GenerateResult([1, 2, 3], [0, 0, 0], "length"))

    def test_a_result_must_have_one_logprob_per_token(self):
        with pytest.raises(ValueError, match="2 tokens but 1 logprobs"):
            GenerateResult([1, 2], [-0.1], "stop")


class GroupEngine:
    """A scripted engine: generate_n answers a group with pieces that each stop or were aborted; generate continues one."""

    def __init__(self, with_n: bool) -> None:
        self.calls: list[tuple[str, int]] = []
        if not with_n:
            self.generate_n = None  # an engine without n-sample requests: n plain requests instead

    async def generate_n(self, req, n):
        self.calls.append(("n", n))
        return [GenerateResult([20 + i], [-0.5], "abort" if i % 2 else "stop", version=3) for i in range(n)]

    async def generate(self, req):
        self.calls.append(("one", len(req.input_ids)))
        return GenerateResult([30], [-0.7], "stop", version=4)


class TestGroupRequests:
    def test_one_n_sample_request_then_each_aborted_sample_continues_alone(self):
        eng = GroupEngine(with_n=True)
        gens = asyncio.run(generate_group(eng, [1, 2, 3], base(10), 4))
        assert eng.calls == [("n", 4), ("one", 4), ("one", 4)]  # samples 1 and 3 were aborted: prompt + their token
        assert [g.output_ids for g in gens] == [[20], [21, 30], [22], [23, 30]]
        assert [g.versions for g in gens] == [[3], [3, 4], [3], [3, 4]]
        assert all(g.done for g in gens)

    def test_an_engine_without_n_sample_requests_gets_n_requests(self):
        eng = GroupEngine(with_n=False)
        eng.generate_n = None
        gens = asyncio.run(generate_group(eng, [1, 2, 3], base(10), 3))
        assert eng.calls == [("one", 3)] * 3 and all(g.output_ids == [30] for g in gens)

    def test_single_turn_unseeded_episodes_ask_once_per_group_multi_turn_ones_per_sample(self, tokenizer):
        from kuberl.runtime.rollout.workflows import EpisodeContext, Item

        for cls, kw, expected in ((RLVRWorkflow, {}, "n"), (MultiTurnWorkflow, {"max_turns": 2, "turn_discount": 1.0}, "one")):
            eng = GroupEngine(with_n=True)
            wf = cls(tokenizer, lambda p, c, a: 1.0, SamplingConfig(n=4, max_new_tokens=4), **kw)
            samples = asyncio.run(wf.arun_episode(eng, Item(index=0, prompt="hi", answer="x"), EpisodeContext()))
            assert len(samples) == 4 and eng.calls[0][0] == expected


class TestMultiTurnFeedback:
    def test_feedback_closes_the_assistant_turn_and_opens_the_next_one(self, tokenizer):
        wf = MultiTurnWorkflow(tokenizer, lambda p, c, a: 0.0, SamplingConfig(), max_turns=3, turn_discount=0.9)
        text = tokenizer.decode(wf.feedback_ids(ended_with_eos=False))
        assert text == f"<|im_end|>\n<|im_start|>user\n{wf.feedback}<|im_end|>\n<|im_start|>assistant\n"
        # When the model already said <|im_end|>, it is not repeated.
        assert tokenizer.decode(wf.feedback_ids(ended_with_eos=True)) == text.removeprefix("<|im_end|>")

    def test_without_the_chat_template_feedback_is_plain_text(self, tokenizer):
        wf = MultiTurnWorkflow(tokenizer, lambda p, c, a: 0.0, SamplingConfig(), max_turns=2, turn_discount=1.0, use_chat_template=False)
        assert tokenizer.decode(wf.feedback_ids(ended_with_eos=False)) == f"\n{wf.feedback}\n"


class TestMakeWorkflow:
    def spec(self, **workflow):
        return RLExperimentSpec.model_validate({
            "model": {"builtin": "tiny-qwen2"}, "dataset": {"builtin": "repeat-digit"},
            "workflow": {"reward": "repeat-digit", **workflow},
            "algorithm": {"samplesPerPrompt": 6, "maxNewTokens": 12, "temperature": 0.8, "topP": 1.0},  # topP < 1 is refused
        })

    def test_rlvr_takes_its_sampling_from_the_algorithm_and_stops_at_eos_and_pad(self, tokenizer):
        wf = make_workflow(self.spec(), tokenizer, max_total_tokens=512)
        assert type(wf) is RLVRWorkflow
        s = wf.sampling
        assert (s.n, s.max_new_tokens, s.temperature, s.top_p, s.max_total_tokens) == (6, 12, 0.8, 1.0, 512)
        # The tiny model's eos is its end of turn <|im_end|>; its pad <|endoftext|> also stops (as AReaL); no strings.
        assert s.stop_token_ids == [tokenizer.eos_token_id, tokenizer.pad_token_id] and s.stop == []

    def test_multi_turn_gets_its_turns_and_discount(self, tokenizer):
        wf = make_workflow(self.spec(type="multi-turn", maxTurns=3, turnDiscount=0.5), tokenizer)
        assert isinstance(wf, MultiTurnWorkflow) and (wf.max_turns, wf.turn_discount) == (3, 0.5)

    def test_a_prompt_that_fills_the_context_is_refused_with_the_numbers(self, tokenizer):
        wf = RLVRWorkflow(tokenizer, lambda p, c, a: 0.0, SamplingConfig(max_new_tokens=8, max_total_tokens=20))
        with pytest.raises(ValueError, match="prompt of 20 tokens leaves no room under the engine's 20-token context"):
            wf._request(list(range(20)), 8, None)
        assert wf._request(list(range(15)), 8, None).max_new_tokens == 5


def test_dynamic_sampling_rejects_only_groups_whose_rewards_are_all_equal():
    assert RolloutAgent.all_rewards_equal([0.5, 0.5, 0.5])
    assert not RolloutAgent.all_rewards_equal([0.5, 0.5, 0.625])
    assert not RolloutAgent.all_rewards_equal([])
