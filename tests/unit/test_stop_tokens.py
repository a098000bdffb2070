"""Where generation stops (kuberl.runtime.stop_tokens): the stop set of a model, the manifest's stop tokens and strings
in every engine request, and where a stopped generation ends the trained sample. The engines are scripted here;
tests/integration/test_vllm.py shows a real vLLM stopping at a stop token id and a stop string."""

from __future__ import annotations

import asyncio
import json
import logging
import shutil

import pytest

from kuberl.api.v1alpha1 import RLExperimentSpec
from kuberl.runtime.data import Item
from kuberl.runtime.inference import sglang, vllm
from kuberl.runtime.inference.base import GenerateRequest, GenerateResult
from kuberl.runtime.models import build_tiny_model
from kuberl.runtime.rollout.workflows import EpisodeContext, MultiTurnWorkflow, make_workflow
from kuberl.runtime.stop_tokens import compute_stop_set, end_of_turn_token, stop_set_for

EOT, EOM, PAD = "<|im_end|>", "<|eom|>", "<|pad|>"


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    """A tiny model shaped like a base model used under a chat template (Qwen2.5 base): eos <|endoftext|>, the template
    ends turns with <|im_end|> (special, not eos), a pad token of its own, and a generation_config.json listing two eos
    ids, <|endoftext|> and a secondary <|eom|>."""
    from transformers import AutoTokenizer, GenerationConfig

    d = build_tiny_model(tmp_path_factory.mktemp("base"))
    tok = AutoTokenizer.from_pretrained(d)
    tok.add_tokens([EOM], special_tokens=True)
    tok.add_special_tokens({"pad_token": PAD})
    tok.eos_token = "<|endoftext|>"
    tok.save_pretrained(d)
    GenerationConfig(eos_token_id=[tok.eos_token_id, tok.convert_tokens_to_ids(EOM)], pad_token_id=tok.pad_token_id).save_pretrained(d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "eos_token_id": tok.eos_token_id, "vocab_size": len(tok)}))
    return d


@pytest.fixture(scope="module")
def tok(base_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(base_dir)


def ids(tok, *tokens):
    return [tok.convert_tokens_to_ids(t) for t in tokens]


def spec(workflow: dict | None = None, evaluation: dict | None = None, **algorithm) -> RLExperimentSpec:
    return RLExperimentSpec.model_validate({
        "model": {"builtin": "tiny-qwen2"}, "dataset": {"builtin": "repeat-digit"},
        "workflow": {"reward": "repeat-digit", **(workflow or {})},
        "algorithm": {"samplesPerPrompt": 2, "maxNewTokens": 12, **algorithm},
    } | ({"evaluation": evaluation} if evaluation else {}))


class TestTheStopSet:
    def test_a_base_model_under_a_chat_template_stops_at_its_eos_every_generation_config_eos_its_pad_and_the_end_of_turn(self, tok):
        stops = compute_stop_set(tok, use_chat_template=True)
        assert stops.ids == ids(tok, "<|endoftext|>", EOM, PAD, EOT)
        assert stops.token_ids[tok.eos_token_id] == ("eos", "config.json", "generation_config.json")
        assert stops.token_ids[ids(tok, EOT)[0]] == ("chat template end of turn",)

    def test_without_the_chat_template_its_end_of_turn_does_not_stop(self, tok):
        assert compute_stop_set(tok, use_chat_template=False).ids == ids(tok, "<|endoftext|>", EOM, PAD)

    def test_the_manifest_adds_ids_and_strings(self, tok):
        stops = compute_stop_set(tok, use_chat_template=False, extra_ids=[5, tok.eos_token_id], stop=["</a>", "\n\n"])
        assert stops.ids == ids(tok, "<|endoftext|>", EOM, PAD) + [5] and stops.strings == ("</a>", "\n\n")

    def test_a_folder_without_generation_config_json_stops_at_what_tokenizer_and_config_say(self, base_dir, tmp_path):
        from transformers import AutoTokenizer

        bare = shutil.copytree(base_dir, tmp_path / "bare")
        (bare / "generation_config.json").unlink()
        t = AutoTokenizer.from_pretrained(bare)
        assert compute_stop_set(t, use_chat_template=False).ids == ids(t, "<|endoftext|>", PAD)

    def test_a_broken_generation_config_is_an_error_not_a_silent_default(self, base_dir, tmp_path):
        from transformers import AutoTokenizer

        broken = shutil.copytree(base_dir, tmp_path / "broken")
        (broken / "generation_config.json").write_text("{not json")
        with pytest.raises(ValueError, match="generation_config.json cannot be read"):
            compute_stop_set(AutoTokenizer.from_pretrained(broken), use_chat_template=False)

    def test_a_manifest_id_outside_the_vocabulary_is_refused_with_the_field_and_the_range(self, tok):
        with pytest.raises(ValueError, match=rf"algorithm.stopTokenIds: \[{len(tok)}\] outside the tokenizer's vocabulary \(ids 0 to {len(tok) - 1}\)"):
            compute_stop_set(tok, use_chat_template=False, extra_ids=[3, len(tok)])

    def test_the_end_of_turn_is_whatever_special_token_the_template_closes_a_reply_with(self, tok):
        llama = tok.__class__.from_pretrained(tok.name_or_path)
        llama.add_tokens(["<|eot_id|>"], special_tokens=True)
        llama.chat_template = "{% for m in messages %}<|start|>{{ m['role'] }}\n{{ m['content'] }}<|eot_id|>{% endfor %}"
        assert end_of_turn_token(llama) == "<|eot_id|>"
        llama.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"  # closes with no special token
        assert end_of_turn_token(llama) is None

    def test_the_run_logs_its_stop_set_once_with_ids_and_their_text(self, tok, caplog):
        s = spec(stopTokenIds=[7], stop=["####"])
        with caplog.at_level(logging.INFO, logger="kuberl.runtime.stop_tokens"):
            stop_set_for(s, tok)
            stop_set_for(s, tok)  # evaluation computes it again: not logged twice
        lines = [r.getMessage() for r in caplog.records if r.name == "kuberl.runtime.stop_tokens"]
        assert len(lines) == 1
        assert f"{ids(tok, EOM)[0]} '{EOM}' (generation_config.json)" in lines[0]
        assert f"{ids(tok, EOT)[0]} '{EOT}' (chat template end of turn)" in lines[0] and "stop strings: ['####']" in lines[0]


class ScriptedEngine:
    """Says `script` token by token and stops as an engine does: after a token in the request's stop_token_ids, or
    after the token whose text completes a stop string (vLLM and SGLang keep that token); records each request."""

    def __init__(self, tok, script: list[int]) -> None:
        self.tok, self.script, self.requests = tok, script, []

    async def generate(self, req: GenerateRequest) -> GenerateResult:
        self.requests.append(req)
        out: list[int] = []
        for t in self.script[: req.max_new_tokens]:
            out.append(t)
            text = self.tok.decode(out, skip_special_tokens=False)
            if t in req.stop_token_ids or any(s in text for s in req.stop):
                return GenerateResult(out, [-0.5] * len(out), "stop")
        return GenerateResult(out, [-0.5] * len(out), "length")


def episode(wf, engine, answer="7") -> list:
    return asyncio.run(wf.arun_episode(engine, Item(index=0, prompt="Repeat 7", answer=answer), EpisodeContext()))


class TestEveryRequestCarriesTheSet:
    def test_single_and_multi_turn_rollouts_send_the_models_ids_and_the_manifests_ids_and_strings(self, tok):
        for workflow in ({}, {"type": "multi-turn", "maxTurns": 2}):
            engine = ScriptedEngine(tok, [40, 41, 42])
            episode(make_workflow(spec(workflow, stopTokenIds=[5], stop=["</a>"]), tok), engine)
            assert engine.requests and all(r.stop_token_ids == ids(tok, "<|endoftext|>", EOM, PAD, EOT) + [5] for r in engine.requests)
            assert all(r.stop == ["</a>"] for r in engine.requests)

    def test_evaluation_stops_where_training_does(self, tok):
        from kuberl.runtime.evaluation import Evaluator

        ev = Evaluator.from_experiment(spec(evaluation={"split": "test", "size": 2, "samplesPerPrompt": 2}, stop=["</a>"]), tok)
        for wf in (ev.sampled, ev.greedy):
            assert wf.sampling.stop_token_ids == ids(tok, "<|endoftext|>", EOM, PAD, EOT) and wf.sampling.stop == ["</a>"]

    def test_the_agents_proxy_sends_the_set_and_the_strings(self, tok):
        from kuberl.runtime.rollout.openai_proxy import OpenAIProxy
        from kuberl.runtime.rollout.proxy_fields import CallOptions

        wf = make_workflow(spec(stop=["</a>"]), tok)
        engine = ScriptedEngine(tok, [40, 41])
        proxy = OpenAIProxy(engine, tok, wf.sampling)
        asyncio.run(proxy._generate(proxy.open_session(), [1, 2, 3], {}, CallOptions(stop=["Observation:"])))
        assert engine.requests[0].stop_token_ids == wf.sampling.stop_token_ids
        assert engine.requests[0].stop == ["</a>", "Observation:"]  # the manifest's strings, then the request's

    def test_a_continuation_after_an_abort_keeps_ids_and_strings(self, tok):
        from kuberl.runtime.rollout.workflows import PartialGeneration

        gen = PartialGeneration([1], GenerateRequest([1], 8, stop_token_ids=[9], stop=["</a>"]))
        gen.add(GenerateResult([4], [-0.1], "abort"))
        nxt = gen.next_request()
        assert (nxt.stop_token_ids, nxt.stop) == ([9], ["</a>"])


REQ = GenerateRequest([1, 2], max_new_tokens=4, stop_token_ids=[0, 320], stop=["</a>", "\n\n"])


class TestEnginePayloads:
    def test_vllm_detokenizes_only_for_stop_strings_and_its_own_request_model_accepts_them(self):
        from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateRequest as VGenerateRequest

        sp = VGenerateRequest(**vllm.VLLMEngine.generate_payload(REQ)).sampling_params
        assert sp.stop == ["</a>", "\n\n"] and sp.detokenize is True and sp.stop_token_ids == [0, 320] and sp.ignore_eos is True
        plain = vllm.VLLMEngine.generate_payload(GenerateRequest([1, 2], 4, stop_token_ids=[0]))["sampling_params"]
        assert plain["detokenize"] is False and "stop" not in plain  # tokens only, as before, when no string is asked for

    def test_sglang_gets_the_strings_and_honours_stop_ids(self):
        sp = sglang.generate_payload(REQ)["sampling_params"]
        assert sp["stop"] == ["</a>", "\n\n"] and sp["stop_token_ids"] == [0, 320]
        assert sp["ignore_eos"] is False and sp["no_stop_trim"] is True  # ignore_eos would skip stop_token_ids too


class TestWhereTheTrainedSampleEnds:
    def test_a_generation_stopped_at_a_secondary_eos_ends_the_trained_sample_there(self, tok):
        eom = ids(tok, EOM)[0]
        engine = ScriptedEngine(tok, [40, 41, eom, 42, 43])
        samples = episode(make_workflow(spec(), tok), engine)
        for s in samples:
            assert s.output_ids == [40, 41, eom] and s.loss_mask == [1, 1, 1] and s.finish_reason == "stop"

    def test_a_stop_string_ends_the_sample_with_the_token_that_completes_it(self, tok):
        script = list(tok("12</a>34", add_special_tokens=False)["input_ids"])
        samples = episode(make_workflow(spec(stop=["</a>"]), tok), ScriptedEngine(tok, script))
        for s in samples:
            assert tok.decode(s.output_ids).endswith("</a>") and s.output_ids == script[: len(s.output_ids)]
            assert len(s.loss_mask) == len(s.logprobs) == len(s.output_ids) < len(script)

    def test_a_turn_ended_at_the_templates_end_of_turn_is_closed_once_before_the_feedback(self, tok):
        eot = ids(tok, EOT)[0]
        wf = make_workflow(spec({"type": "multi-turn", "maxTurns": 2}), tok)
        assert isinstance(wf, MultiTurnWorkflow)
        s = episode(wf, ScriptedEngine(tok, [40, eot, 41]), answer="no such digit")[0]  # wrong: a second turn comes
        text = tok.decode(s.output_ids, skip_special_tokens=False)
        # The base model's turn ended at <|im_end|>, not at its eos: the template's closing is not repeated.
        assert text.count(EOT) == 3 and f"{EOT}\n<|im_start|>user\n" in text and EOT + EOT not in text
