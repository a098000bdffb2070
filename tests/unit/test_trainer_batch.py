"""Batches: groups -> [N, T] tensors, micro-batch plans, token logprobs aligned with the response."""

from __future__ import annotations

import pytest
import torch

from kuberl.runtime.trainer.batch import (
    BatchError,
    build_batch,
    minibatch_rows,
    plan_micro_batches,
    response_logprobs,
    shard_micro_batches,
)
from kuberl.runtime.trainer.optim import lr_factor


def sample(out_len: int, reward: float = 1.0, version: int = 0, prompt=(5, 6, 7)) -> dict:
    return {"input_ids": list(prompt), "output_ids": list(range(10, 10 + out_len)), "logprobs": [-1.0] * out_len,
            "versions": [version] * out_len, "loss_mask": [1] * out_len, "reward": reward}


def group(gid: str, *samples: dict) -> dict:
    return {"group_id": gid, "samples": list(samples)}


class TestBuildBatch:
    def test_rows_are_group_major_and_padded_to_the_longest_response(self):
        b = build_batch([group("a", sample(2, 1.0), sample(3, 0.0)), group("b", sample(1, 0.5, version=2), sample(2, 0.0, version=3))], 2)
        assert b.loss_mask.shape == (4, 3) and b.rewards.tolist() == [[1.0, 0.0], [0.5, 0.0]]
        assert b.loss_mask.tolist() == [[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0]]
        assert b.versions[0].tolist() == [0, 0, -1] and b.head_versions == [0, 2]
        assert b.response_lengths().tolist() == [[2.0, 3.0], [1.0, 2.0]]

    def test_a_group_of_the_wrong_size_is_named(self):
        with pytest.raises(BatchError, match="group a: has 1 samples, algorithm.samplesPerPrompt is 2"):
            build_batch([group("a", sample(2))], 2)

    def test_misaligned_per_token_fields_are_named(self):
        bad = sample(3)
        bad["logprobs"] = [-1.0]
        with pytest.raises(BatchError, match="group g sample 1: logprobs has 1 entries for 3 output_ids"):
            build_batch([group("g", sample(3), bad)], 2)


class TestMicroBatches:
    def test_padded_size_stays_within_the_token_budget(self):
        lens = [10, 10, 30, 5, 5, 5, 40]
        plans = plan_micro_batches(lens, range(7), 40)
        assert [r for p in plans for r in p] == list(range(7))
        for p in plans:
            assert len(p) == 1 or max(lens[r] for r in p) * len(p) <= 40

    def test_a_sequence_longer_than_the_budget_gets_its_own_micro_batch(self):
        assert plan_micro_batches([100, 3], [0, 1], 16) == [[0], [1]]

    def test_every_rank_runs_the_same_number_of_micro_batches(self):
        lens = [50, 50, 5]  # dealt by length: rank 0 gets row 0, rank 1 rows 1 and 2 (each its own micro-batch)
        shards = [shard_micro_batches(lens, range(3), 20, r, 2) for r in range(2)]
        assert len(shards[0]) == len(shards[1])
        real = sorted(r for s in shards for mb in s if mb is not None for r in mb)
        assert real == list(range(3))
        assert None in shards[0] + shards[1]  # the rank with less work runs a filler

    def test_minibatches_split_whole_groups(self):
        assert minibatch_rows(3, 2, 2) == [[0, 1], [2, 3, 4, 5]] or minibatch_rows(3, 2, 2) == [[0, 1, 2, 3], [4, 5]]
        assert minibatch_rows(2, 4, 5) == [[0, 1, 2, 3], [4, 5, 6, 7]]  # never more minibatches than groups


@pytest.fixture(scope="module")
def model():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, tie_word_embeddings=False)
    return Qwen2ForCausalLM(cfg).eval()


class TestLogprobs:
    def test_each_response_token_gets_the_log_probability_the_model_gives_it(self, model):
        prompt, out = [3, 4, 5], [6, 7]
        got = response_logprobs(model, [prompt], [out], 4)
        logits = model(input_ids=torch.tensor([prompt + out])).logits[0].float()
        want = [torch.log_softmax(logits[2], -1)[6], torch.log_softmax(logits[3], -1)[7]]
        assert torch.allclose(got[0, :2], torch.stack(want), atol=1e-5)
        assert got[0, 2:].tolist() == [0.0, 0.0]

    def test_padding_rows_together_changes_nothing(self, model):
        rows = [([1, 2], [3, 4, 5, 6]), ([7, 8, 9, 10], [11]), ([12], [13, 14])]
        together = response_logprobs(model, [p for p, _ in rows], [o for _, o in rows], 4)
        for i, (p, o) in enumerate(rows):
            alone = response_logprobs(model, [p], [o], 4)
            assert torch.allclose(together[i], alone[0], atol=1e-5)

    def test_temperature_divides_the_logits(self, model):
        hot = response_logprobs(model, [[1, 2]], [[3]], 1, temperature=2.0)
        logits = model(input_ids=torch.tensor([[1, 2, 3]])).logits[0, 1].float() / 2.0
        assert torch.allclose(hot[0, 0], torch.log_softmax(logits, -1)[3], atol=1e-5)


class TestLearningRate:
    def test_warmup_then_schedule(self):
        from kuberl.api.v1alpha1 import OptimizerSpec

        spec = OptimizerSpec(warmup_steps=2, lr_scheduler="linear")
        assert [round(lr_factor(s, 6, spec), 3) for s in range(7)] == [0.5, 1.0, 1.0, 0.75, 0.5, 0.25, 0.0]
        cos = OptimizerSpec(lr_scheduler="cosine")
        assert lr_factor(0, 10, cos) == 1.0 and lr_factor(5, 10, cos) == pytest.approx(0.5) and lr_factor(10, 10, cos) == pytest.approx(0.0)
        assert lr_factor(99, 10, OptimizerSpec()) == 1.0


@pytest.fixture(scope="module", params=["tiny-qwen2", "tiny-qwen2-instruct"])
def builtin(request, tmp_path_factory):
    """A builtin tiny model (untied, and the tied instruct variant), in train mode as the update runs it."""
    from transformers import AutoModelForCausalLM

    from kuberl.runtime.models import build_tiny_model

    path = build_tiny_model(tmp_path_factory.mktemp(request.param), variant=request.param)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).train()
    assert model.config.tie_word_embeddings == (request.param == "tiny-qwen2-instruct")
    return model


def grouped_rows(n: int = 4, prompt_lens=(5, 9, 3)) -> tuple[list[list[int]], list[list[int]]]:
    """Group-major rows: each group's n samples share a prompt; prompt lengths differ across groups,
    response lengths within a group (one empty)."""
    g = torch.Generator().manual_seed(1)
    prompts, outputs = [], []
    for plen in prompt_lens:
        p = torch.randint(3, 300, (plen,), generator=g).tolist()
        for k in range(n):
            prompts.append(p)
            outputs.append(torch.randint(3, 300, ((k * 3 + plen) % 7,), generator=g).tolist())
    return prompts, outputs


def reference_logprobs(model, prompts, outputs, width, temperature):
    """The straightforward path: each row alone, the LM head over the whole sequence, log_softmax."""
    ents = torch.zeros(len(prompts), width)
    rows_lp = []
    for i, (p, o) in enumerate(zip(prompts, outputs)):
        logp = torch.log_softmax(model(input_ids=torch.tensor([p + o])).logits[0].float() / temperature, -1)
        row = [logp[len(p) - 1 + t, tok] for t, tok in enumerate(o)]
        rows_lp.append(torch.stack(row + [torch.zeros(())] * (width - len(row))))
        for t in range(len(o)):
            ents[i, t] = -(logp[len(p) - 1 + t].exp() * logp[len(p) - 1 + t]).sum().detach()
    return torch.stack(rows_lp), ents


class TestFastLogprobs:
    """The update's path (LM head only at response positions, each group's prompt run once) gives the
    same log-probs, entropies and gradients as the straightforward full-sequence path."""

    @pytest.mark.parametrize("share", [True, False])
    def test_logprobs_entropy_and_gradients_equal_the_full_sequence_path(self, builtin, share):
        prompts, outputs = grouped_rows()
        width = max(len(o) for o in outputs) + 1
        weights = torch.randn(len(prompts), width, generator=torch.Generator().manual_seed(2))
        results = []
        for fn in (lambda: reference_logprobs(builtin, prompts, outputs, width, 0.7),
                   lambda: response_logprobs(builtin, prompts, outputs, width, temperature=0.7, entropy=True, share_prompts=share)):
            builtin.zero_grad(set_to_none=True)
            logp, ent = fn()
            (logp * weights).sum().backward()
            results.append((logp.detach(), ent, {n: p.grad.clone() for n, p in builtin.named_parameters()}))
        (want_lp, want_ent, want_grad), (lp, ent, grad) = results
        assert torch.allclose(lp, want_lp, atol=1e-5, rtol=0) and torch.allclose(ent, want_ent, atol=1e-5, rtol=0)
        assert grad.keys() == want_grad.keys()
        for name, g in grad.items():
            assert torch.allclose(g, want_grad[name], atol=1e-5, rtol=1e-5), name
        assert float(want_lp.abs().sum()) > 0 and all(float(g.abs().sum()) > 0 for g in want_grad.values())

    def test_each_prompt_runs_once_and_the_head_only_where_a_token_is_scored(self, builtin):
        prompts, outputs = grouped_rows(n=4)
        width = max(len(o) for o in outputs)
        embedded, headed = [], []
        hooks = [builtin.get_input_embeddings().register_forward_hook(lambda m, a, out: embedded.append(tuple(a[0].shape))),
                 builtin.lm_head.register_forward_hook(lambda m, a, out: headed.append(a[0].shape[0] * a[0].shape[1]))]
        try:
            response_logprobs(builtin, prompts, outputs, width)
        finally:
            for h in hooks:
                h.remove()
        # Prompt pass: 3 distinct prompts x the longest (9); response pass: 12 rows x (width - 1) tokens.
        assert embedded == [(3, 9), (12, width - 1)]
        assert sum(headed) <= 3 * 3 + 12 * (width - 1)  # never rows x (prompt + response) positions

    def test_rows_without_a_shared_prompt_take_one_forward(self, builtin):
        prompts, outputs = grouped_rows(n=1)
        embedded, headed = [], []
        hooks = [builtin.get_input_embeddings().register_forward_hook(lambda m, a, out: embedded.append(tuple(a[0].shape))),
                 builtin.lm_head.register_forward_hook(lambda m, a, out: headed.append(tuple(a[0].shape[:2])))]
        try:
            response_logprobs(builtin, prompts, outputs, 6)
        finally:
            for h in hooks:
                h.remove()
        L = max(len(p) + len(o) for p, o in zip(prompts, outputs))
        assert embedded == [(3, L - 1)]  # the last token predicts nothing that is scored
        # The head starts at the shortest prompt's last position, not at position 0.
        assert headed == [(3, L - 1 - (min(len(p) for p in prompts) - 1))]


class TestGradientCheckpointing:
    """trainer.gradientCheckpointing on one rank (no FSDP): in training mode transformers turns the KV cache off, so
    the shared-prompt path cannot run; the update falls back to a path without a cache, with the same numbers."""

    def test_the_update_path_under_checkpointing_gives_the_same_logprobs_and_gradients(self, tmp_path):
        from transformers import AutoModelForCausalLM

        from kuberl.runtime.models import build_tiny_model
        from kuberl.runtime.trainer.packing import can_share_prompts, use_packing

        path = build_tiny_model(tmp_path / "m", seed=0)
        prompts, outputs = grouped_rows()
        width = max(len(o) for o in outputs)
        weights = torch.randn(len(prompts), width, generator=torch.Generator().manual_seed(3))
        results = []
        for checkpointing in (False, True):
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).train()
            if checkpointing:
                model.gradient_checkpointing_enable()
            packed = use_packing("auto", prompts, outputs, model)
            logp, _ = response_logprobs(model, prompts, outputs, width, entropy=True, packed=packed)
            (logp * weights).sum().backward()
            assert can_share_prompts(model) is not checkpointing
            results.append((logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
            model.eval()  # the pi_prox forward: no grad, the cache is back, so prompts are shared again
            assert can_share_prompts(model)
        (want_lp, want_grad), (lp, grad) = results
        assert torch.allclose(lp, want_lp, atol=1e-5, rtol=0)
        for name, g in grad.items():
            assert torch.allclose(g, want_grad[name], atol=1e-5, rtol=1e-5), name
