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
        lens = [50, 5, 5, 5, 5]
        shards = [shard_micro_batches(lens, range(5), 20, r, 2) for r in range(2)]
        assert len(shards[0]) == len(shards[1])
        real = sorted(r for s in shards for mb in s if mb is not None for r in mb)
        assert real == list(range(5))
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
