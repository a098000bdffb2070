"""Prompt templates (dataset.prompt, workflow.useChatTemplate): the user message (instruction or template, data.py), the
system message and the chat template (rollout/workflows.py), the same in training and held-out evaluation."""

from __future__ import annotations

import json

import pytest

from kuberl.api.v1alpha1 import DatasetSpec, PromptSpec, RLExperimentSpec
from kuberl.runtime.bus.messages import EvalTicket
from kuberl.runtime.data import Item, format_prompt, load_eval_items, load_items
from kuberl.runtime.evaluation import Evaluator
from kuberl.runtime.inference.base import GenerateResult
from kuberl.runtime.rollout.workflows import PromptError, RLVRWorkflow, SamplingConfig, make_workflow, prompt_text

BOXED = "Please put your final answer within \\boxed{}."
SYSTEM = "You are a careful mathematician."


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from kuberl.runtime.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def fresh_tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def chat(tok, *messages: tuple[str, str]) -> str:
    return tok.apply_chat_template([{"role": r, "content": c} for r, c in messages], tokenize=False, add_generation_prompt=True)


def ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


class TestTheManifest:
    def spec(self, prompt, **workflow):
        return RLExperimentSpec.model_validate({"model": {"builtin": "tiny-qwen2"}, "dataset": {"builtin": "add-small", "prompt": prompt},
                                                "workflow": workflow})

    def test_system_instruction_and_template_are_read(self):
        assert self.spec({"system": SYSTEM, "instruction": BOXED}).dataset.prompt == PromptSpec(system=SYSTEM, instruction=BOXED)
        assert self.spec({"template": "Q: {prompt}\nA:"}, useChatTemplate=False).dataset.prompt.template == "Q: {prompt}\nA:"

    @pytest.mark.parametrize(("prompt", "workflow", "message"), [
        ({"instruction": BOXED, "template": "{prompt}"}, {}, "set at most one of dataset.prompt.instruction and dataset.prompt.template"),
        ({"template": "Question: {question}"}, {}, "dataset.prompt.template needs the placeholder {prompt}"),
        ({"system": SYSTEM}, {"useChatTemplate": False}, "dataset.prompt.system needs workflow.useChatTemplate true"),
        ({"system": SYSTEM}, {"type": "agent", "agent": "my.agent:run"}, "workflow.type rlvr or multi-turn"),
    ])
    def test_prompts_that_cannot_be_built_are_refused_at_admission(self, prompt, workflow, message):
        with pytest.raises(ValueError, match=message.replace("{", r"\{").replace("}", r"\}")):
            self.spec(prompt, **workflow)


class TestTheUserMessage:
    def test_no_prompt_spec_keeps_the_text(self):
        assert format_prompt("What is 2 + 2?", None) == "What is 2 + 2?"
        assert format_prompt("What is 2 + 2?", PromptSpec(system=SYSTEM)) == "What is 2 + 2?"

    def test_the_instruction_follows_the_question_on_a_new_line(self):
        assert format_prompt("What is 2 + 2?", PromptSpec(instruction=BOXED)) == f"What is 2 + 2?\n{BOXED}"

    def test_a_template_places_the_question_and_keeps_every_other_brace(self):
        template = "Question: {prompt}\nAnswer in \\boxed{} (see {notes}):"
        assert format_prompt("What is 2 + 2?", PromptSpec(template=template)) == \
            "Question: What is 2 + 2?\nAnswer in \\boxed{} (see {notes}):"

    def test_training_items_of_every_source_carry_the_instruction(self, tmp_path):
        f = tmp_path / "d.jsonl"
        f.write_text(json.dumps({"question": "What is 2 + 2?", "answer": "4"}) + "\n")
        assert load_items(DatasetSpec(path=str(f), prompt=PromptSpec(instruction=BOXED)))[0].prompt == f"What is 2 + 2?\n{BOXED}"
        plain = load_items(DatasetSpec(builtin="add-small", size=3))
        boxed = load_items(DatasetSpec(builtin="add-small", size=3, prompt=PromptSpec(instruction=BOXED)))
        assert [b.prompt for b in boxed] == [f"{p.prompt}\n{BOXED}" for p in plain]
        assert [b.answer for b in boxed] == [p.answer for p in plain]


class TestTheTokenizedPrompt:
    def test_without_the_chat_template_the_prompt_is_the_raw_text(self, tokenizer):
        assert prompt_text(tokenizer, "Q: 1 + 1?\nA:", False) == "Q: 1 + 1?\nA:"
        wf = RLVRWorkflow(tokenizer, lambda p, c, a: 0.0, SamplingConfig(), use_chat_template=False)
        assert wf.prompt_ids(item("Q: 1 + 1?\nA:")) == ids(tokenizer, "Q: 1 + 1?\nA:")

    def test_with_the_chat_template_the_question_is_the_user_turn(self, tokenizer):
        wf = RLVRWorkflow(tokenizer, lambda p, c, a: 0.0, SamplingConfig())
        assert wf.prompt_ids(item("What is 2 + 2?")) == ids(tokenizer, chat(tokenizer, ("user", "What is 2 + 2?")))
        assert "system" not in tokenizer.decode(wf.prompt_ids(item("What is 2 + 2?")))

    def test_the_system_message_comes_first_through_the_template(self, tokenizer):
        wf = RLVRWorkflow(tokenizer, lambda p, c, a: 0.0, SamplingConfig(), system=SYSTEM)
        text = tokenizer.decode(wf.prompt_ids(item("What is 2 + 2?")))
        assert text == chat(tokenizer, ("system", SYSTEM), ("user", "What is 2 + 2?"))
        assert text.startswith(f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\nWhat is 2 + 2?<|im_end|>")

    def test_a_tokenizer_without_a_chat_template_is_refused_when_the_template_is_on(self, model_dir):
        tok = fresh_tokenizer(model_dir)
        tok.chat_template = None
        with pytest.raises(PromptError, match="has no chat template .* set workflow.useChatTemplate false"):
            RLVRWorkflow(tok, lambda p, c, a: 0.0, SamplingConfig())
        assert RLVRWorkflow(tok, lambda p, c, a: 0.0, SamplingConfig(), use_chat_template=False).prompt_ids(item("x")) == ids(tok, "x")

    def test_a_chat_template_that_refuses_the_system_role_is_refused_at_start(self, model_dir):
        tok = fresh_tokenizer(model_dir)
        tok.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
                             "{% endif %}{{ m['content'] }}{% endfor %}")
        RLVRWorkflow(tok, lambda p, c, a: 0.0, SamplingConfig())  # without a system message it builds prompts
        with pytest.raises(PromptError, match="cannot build a prompt with a system message: .*System role not supported"):
            RLVRWorkflow(tok, lambda p, c, a: 0.0, SamplingConfig(), system=SYSTEM)

    def test_a_system_message_without_the_chat_template_is_refused(self, tokenizer):
        with pytest.raises(PromptError, match="needs workflow.useChatTemplate true"):
            RLVRWorkflow(tokenizer, lambda p, c, a: 0.0, SamplingConfig(), use_chat_template=False, system=SYSTEM)


def item(prompt: str) -> Item:
    return Item(0, prompt, "4")


class Recorder:
    """A scripted engine that keeps each request: every response is one eos token."""

    version = 0

    def __init__(self, eos: int) -> None:
        self.eos, self.requests = eos, []

    async def generate(self, req):
        self.requests.append(req)
        return GenerateResult([self.eos], [-0.1], "stop", version=self.version)


async def test_evaluation_prompts_are_built_as_training_prompts(tmp_path, tokenizer):
    train, held_out = tmp_path / "train.jsonl", tmp_path / "test.jsonl"
    train.write_text(json.dumps({"question": "What is 2 + 2?", "answer": "4"}) + "\n")
    held_out.write_text(json.dumps({"question": "What is 3 + 5?", "answer": "8"}) + "\n")
    spec = RLExperimentSpec.model_validate({
        "model": {"builtin": "tiny-qwen2"},
        "dataset": {"path": str(train), "prompt": {"system": SYSTEM, "instruction": BOXED}},
        "workflow": {"reward": "exact-match"},
        "algorithm": {"samplesPerPrompt": 2, "batchSize": 2},
        "evaluation": {"path": str(held_out), "samplesPerPrompt": 2, "passAtK": [1, 2]},
    })
    trained = make_workflow(spec, tokenizer).prompt_ids(load_items(spec.dataset)[0])
    assert trained == ids(tokenizer, chat(tokenizer, ("system", SYSTEM), ("user", f"What is 2 + 2?\n{BOXED}")))
    assert load_eval_items(spec)[0].prompt == f"What is 3 + 5?\n{BOXED}"

    engine = Recorder(tokenizer.eos_token_id)
    result = await Evaluator.from_experiment(spec, tokenizer).run(engine, EvalTicket(eval_id="s1-i0", step=1, index=0, version=0,
                                                                                     samples=2, greedy=True), "agent-0")
    want = ids(tokenizer, chat(tokenizer, ("system", SYSTEM), ("user", f"What is 3 + 5?\n{BOXED}")))
    assert len(engine.requests) == 3 and all(r.input_ids == want for r in engine.requests), "sampled and greedy: the training format"
    assert result.rewards == [0.0, 0.0] and result.greedy_reward == 0.0
