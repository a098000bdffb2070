"""Padding-free packing (trainer.packing): the same log-probs, entropies and gradients as the padded path,
position_ids restarting at every sequence, the LM head only where a token is scored, and micro-batches
planned by real tokens."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from kuberl.runtime.trainer import packing
from kuberl.runtime.trainer.batch import plan_micro_batches, response_logprobs, shard_micro_batches
from tests.unit.torchrun import torchrun


@pytest.fixture(scope="module", params=["untied", "tied"])
def model(request):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=60, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, tie_word_embeddings=request.param == "tied")
    m = Qwen2ForCausalLM(cfg).float().train()
    if cfg.tie_word_embeddings:
        m.tie_weights()
        assert m.lm_head.weight is m.get_input_embeddings().weight
    return m


@pytest.fixture(params=["rows", "one-row"])
def layout(request, monkeypatch):
    """rows: sdpa's layout (rows as long as the longest sequence); one-row: flash-attn varlen's (the whole micro-batch)."""
    monkeypatch.setattr(packing, "varlen_attention", lambda m: request.param == "one-row")
    return request.param


def ragged_rows(groups: int = 5, n: int = 3) -> tuple[list[list[int]], list[list[int]]]:
    """Groups sharing a prompt (1..9 tokens), responses of 0..14 tokens (an empty one too)."""
    g = torch.Generator().manual_seed(3)
    prompts, outputs = [], []
    for k in range(groups):
        p = torch.randint(3, 60, (1 + (k * 4) % 9,), generator=g).tolist()
        for j in range(n):
            prompts.append(p)
            outputs.append(torch.randint(3, 60, ((k * 5 + j * 7) % 15,), generator=g).tolist())
    assert min(len(o) for o in outputs) == 0 and len({len(o) for o in outputs}) > 4
    return prompts, outputs


def run(model, prompts, outputs, width, **kw):
    """log-probs, entropies and every parameter's gradient of a weighted sum of the log-probs."""
    weights = torch.randn(len(prompts), width, generator=torch.Generator().manual_seed(4))
    model.zero_grad(set_to_none=True)
    lp, ent = response_logprobs(model, prompts, outputs, width, temperature=0.7, entropy=True, **kw)
    (lp * weights).sum().backward()
    return lp.detach(), ent, {n: p.grad.clone() for n, p in model.named_parameters()}



def two_ragged_groups() -> list[dict]:
    """Two groups of 3 samples with prompts of 2 and 4 tokens and answers of 1, 4 and 7: micro-batches of 64 tokens
    pack and pad them differently (also used by tests/unit/test_trainer_attention.py)."""
    out = []
    for g in range(2):
        prompt = [5 + g, 40, 41, 42][: 2 + 2 * g]
        samples = [{"input_ids": prompt, "output_ids": [10 + k, 20 + g, 30, 31, 32, 33, 34, 35][: 1 + 3 * k], "logprobs": [-1.0] * (1 + 3 * k),
                    "versions": [0] * (1 + 3 * k), "loss_mask": [1] * (1 + 3 * k), "reward": float(k == 0)} for k in range(3)]
        out.append({"group_id": f"g{g}", "samples": samples})
    return out

class TestPackedEqualsPadded:
    @pytest.mark.parametrize("width_cut", [0, 5])
    def test_logprobs_entropies_and_gradients(self, model, layout, width_cut):
        prompts, outputs = ragged_rows()
        width = max(len(o) for o in outputs) - width_cut  # width_cut: responses longer than width are cut
        want_lp, want_ent, want_grad = run(model, prompts, outputs, width, share_prompts=False)
        lp, ent, grad = run(model, prompts, outputs, width, packed=True)
        assert torch.allclose(lp, want_lp, atol=1e-5, rtol=0) and torch.allclose(ent, want_ent, atol=1e-5, rtol=0)
        assert grad.keys() == want_grad.keys()
        for name, g in grad.items():
            assert torch.allclose(g, want_grad[name], atol=1e-5, rtol=1e-5), name
        assert float(want_lp.abs().sum()) > 0 and all(float(g.abs().sum()) > 0 for g in want_grad.values())
        assert (lp[[i for i, o in enumerate(outputs) if not o]] == 0).all()  # an empty response scores nothing

    def test_packed_equals_the_shared_prompt_path_too(self, model, layout):
        prompts, outputs = ragged_rows()
        width = max(len(o) for o in outputs)
        with torch.no_grad():
            shared = response_logprobs(model, prompts, outputs, width, share_prompts=True)
            packed = response_logprobs(model, prompts, outputs, width, packed=True)
        assert torch.allclose(packed, shared, atol=1e-5, rtol=0)


def capture_forward(model):
    seen = []
    handle = model.register_forward_pre_hook(lambda m, args, kwargs: seen.append(kwargs), with_kwargs=True)
    return seen, handle


class TestPackedInputs:
    def test_position_ids_restart_at_every_sequence_and_no_attention_mask(self, model, layout):
        prompts, outputs = [[5, 6, 7], [8], [9, 10]], [[11, 12], [13, 14, 15], [16]]
        seen, handle = capture_forward(model)
        try:
            with torch.no_grad():
                response_logprobs(model, prompts, outputs, 3, packed=True)
        finally:
            handle.remove()
        (kw,) = seen
        assert kw.get("attention_mask") is None and not kw.get("use_cache")
        ids, pos = kw["input_ids"], kw["position_ids"]
        fed = {(5, 6, 7, 11), (8, 13, 14), (9, 10)}  # prompt + response without its last token
        found = set()
        for r in range(ids.shape[0]):
            starts = [c for c in range(ids.shape[1]) if pos[r, c] == 0] + [ids.shape[1]]
            for a, b in zip(starts, starts[1:]):
                assert pos[r, a:b].tolist() == list(range(b - a))
                found.add(tuple(ids[r, a:b].tolist()))
        assert fed <= found
        if layout == "one-row":
            assert ids.shape == (1, 9)
        else:  # rows as long as the longest sequence (4): [5 6 7 11], [8 13 14 pad], [9 10 pad pad] -> first-fit: 3 rows
            assert ids.shape[1] == 4 and ids.shape[0] <= 3

    def test_the_lm_head_runs_only_where_a_token_is_scored(self, model, monkeypatch):
        monkeypatch.setattr(packing, "varlen_attention", lambda m: True)
        prompts, outputs = ragged_rows()
        width = 10
        headed = []
        handle = model.lm_head.register_forward_hook(lambda m, a, out: headed.append(a[0].shape[0] * a[0].shape[1]))
        try:
            with torch.no_grad():
                response_logprobs(model, prompts, outputs, width, packed=True)
        finally:
            handle.remove()
        assert headed == [sum(min(len(o), width) for o in outputs)]

    def test_positions_that_do_not_restart_change_the_logprobs(self, model, monkeypatch):
        """The check above is not vacuous: one position stream across the row (no restart) gives other numbers."""
        prompts, outputs = ragged_rows()
        width = max(len(o) for o in outputs)
        monkeypatch.setattr(packing, "varlen_attention", lambda m: True)
        with torch.no_grad():
            want = response_logprobs(model, prompts, outputs, width, share_prompts=False)
            real_forward = model.forward

            def no_restart(*args, **kwargs):
                pos = kwargs["position_ids"]
                kwargs["position_ids"] = torch.arange(pos.shape[1])[None, :].expand_as(pos)
                return real_forward(*args, **kwargs)

            monkeypatch.setattr(model, "forward", no_restart)
            broken = response_logprobs(model, prompts, outputs, width, packed=True)
        assert not torch.allclose(broken, want, atol=1e-3)


class TestPlanning:
    LENS = [10, 10, 30, 5, 5, 5, 40, 3, 64, 7]

    def test_packed_micro_batches_count_real_tokens(self):
        plans = plan_micro_batches(self.LENS, range(len(self.LENS)), 40, packed=True)
        assert sorted(r for p in plans for r in p) == list(range(len(self.LENS)))  # every row exactly once
        assert [r for p in plans for r in p] == list(range(len(self.LENS)))  # in order
        for p in plans:
            assert len(p) == 1 or sum(self.LENS[r] for r in p) <= 40
        assert [64] in [[self.LENS[r] for r in p] for p in plans]  # longer than the budget: alone
        # The padded plan counts rows x longest: 30 + 5 + 5 fits 40 real tokens, not 3 x 30 slots.
        assert plan_micro_batches([30, 5, 5], range(3), 40, packed=True) == [[0, 1, 2]]
        assert plan_micro_batches([30, 5, 5], range(3), 40) == [[0], [1, 2]]

    def test_rows_of_a_packed_plan_fill_the_budget(self):
        assert plan_micro_batches([4, 4, 4, 4], range(4), 8, packed=True) == [[0, 1], [2, 3]]
        assert plan_micro_batches([4, 4, 4, 4], range(4), 7, packed=True) == [[0], [1], [2], [3]]
        assert plan_micro_batches([100, 3], [0, 1], 16, packed=True) == [[0], [1]]

    def test_every_rank_runs_the_same_number_of_packed_micro_batches(self):
        shards = [shard_micro_batches(self.LENS, range(len(self.LENS)), 40, r, 3, packed=True) for r in range(3)]
        assert len({len(s) for s in shards}) == 1
        assert sorted(r for s in shards for mb in s if mb is not None for r in mb) == list(range(len(self.LENS)))

    def test_pack_rows_respects_the_capacity_and_places_every_sequence_once(self):
        rows = packing.pack_rows(self.LENS, 40)
        assert sorted(i for r in rows for i in r) == list(range(len(self.LENS)))
        for r in rows:
            assert len(r) == 1 or sum(self.LENS[i] for i in r) <= 40
        assert rows == [[8], [6], [2, 0], [1, 9, 3, 4, 5, 7]]  # first-fit decreasing: 64 | 40 | 30+10 | 10+7+5+5+5+3
        assert packing.pack_rows([3, 1, 2], None) == [[0, 2, 1]]


class TestChoosing:
    def test_auto_packs_ragged_batches_and_pads_even_ones(self, model):
        def rows(out_lens, prompt_len=15, shared=False):
            prompts = [[7] * prompt_len if shared else [i, 7] + [7] * (prompt_len - 2) for i in range(len(out_lens))]
            return prompts, [[9] * n for n in out_lens]

        ragged = [5] * 60 + [200] * 4  # padding (or the shared prompt's padded responses) would feed ~4x the tokens
        assert packing.use_packing("auto", *rows(ragged), model) is True
        assert packing.use_packing("auto", *rows(ragged, shared=True), model) is True
        even = [15, 13, 16, 14] * 16
        assert packing.use_packing("auto", *rows(even), model) is False
        # Rows x longest (64 x 28) feed 1.33x the packed slots (48 rows of 28: the 13-token sequences pair up), but
        # where one prompt is shared the shared path feeds 12 + 64 x 16 = 1036 < 1.1 x 1344: it wins.
        two = [1, 16] * 32
        assert packing.packed_slots([12 + n for n in two], varlen=False) == 1344
        assert packing.use_packing("auto", *rows(two, prompt_len=12), model) is True
        assert packing.use_packing("auto", *rows(two, prompt_len=12, shared=True), model) is False
        assert packing.use_packing("on", *rows([3] * 4), model) is True and packing.use_packing("off", *rows([1, 200]), model) is False

    def test_slots(self):
        prompts, outputs = [[1, 2], [1, 2], [3]], [[5] * 4, [5], [5] * 2]
        assert packing.padded_slots(prompts, outputs, share_prompts=False) == 3 * 6
        assert packing.padded_slots(prompts, outputs) == 2 * 2 + 3 * 4  # two distinct prompts, responses to the longest
        assert packing.packed_slots([6, 3, 3], varlen=True) == 12 and packing.packed_slots([6, 3, 3], varlen=False) == 12
        assert packing.packed_slots([6, 4, 3], varlen=False) == 18

    def test_a_bad_mode_is_named(self, model):
        with pytest.raises(ValueError, match="trainer.packing must be one of auto, on, off, got 'yes'"):
            packing.use_packing("yes", [[1]], [[2]], model)

    def test_the_spec_field_refuses_other_values(self):
        from kuberl.api.roles import TrainerSpec

        assert TrainerSpec().packing == "auto" and TrainerSpec.model_validate({"packing": "on"}).packing == "on"
        with pytest.raises(ValidationError, match="packing"):
            TrainerSpec.model_validate({"packing": "sometimes"})

    def test_the_crd_lists_the_modes(self):
        from kuberl.api.crd import build_crd

        schema = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
        field = schema["properties"]["spec"]["properties"]["trainer"]["properties"]["packing"]
        assert field["enum"] == ["auto", "on", "off"] and field["default"] == "auto"


class TestTrainerPacking:
    """trainer.packing reaches the trainer's stages: on and off give the same pi_prox and the same update."""

    def make(self, tmp_path, model_dir, mode: str):
        from kuberl.api import RLExperiment
        from kuberl.runtime.trainer.trainer import Trainer

        exp = RLExperiment.model_validate({
            "apiVersion": "kuberl.io/v1alpha1", "kind": "RLExperiment", "metadata": {"name": f"pack-{mode}"},
            "spec": {"model": {"path": str(model_dir), "dtype": "float32"}, "dataset": {"builtin": "repeat-digit", "size": 8},
                     "algorithm": {"name": "grpo", "samplesPerPrompt": 3, "batchSize": 2, "learningRate": 3e-3, "ppoMinibatches": 2},
                     "trainer": {"microBatchTokens": 64, "packing": mode}, "training": {"totalSteps": 10}},
        })
        t = Trainer(exp, bus_url="nats://unused:4222", workdir=tmp_path / mode, handle_sigterm=False)
        t.setup()
        return t

    def test_on_and_off_train_alike(self, tmp_path):
        from kuberl.runtime.models import build_tiny_model
        from kuberl.runtime.trainer import dist as D
        from kuberl.runtime.trainer.batch import build_batch

        model_dir = build_tiny_model(tmp_path / "model", seed=0)
        results = []
        try:
            for mode in ("off", "on"):
                t = self.make(tmp_path, model_dir, mode)
                seen, handle = capture_forward(t.model)
                batch = build_batch(two_ragged_groups(), 3)
                t.stage_prox_logp(batch)
                t.stage_advantages(batch)
                stats = t.stage_ppo_update(batch)
                handle.remove()
                packed_calls = [kw for kw in seen if kw.get("attention_mask") is None and kw.get("position_ids") is not None]
                assert bool(packed_calls) == (mode == "on") and (mode == "off" or len(packed_calls) == len(seen))
                results.append((batch.prox_logp, stats, {n: p.detach().clone() for n, p in t.model.named_parameters()}))
                D.shutdown()
        finally:
            D.shutdown()
        (prox_off, st_off, w_off), (prox_on, st_on, w_on) = results
        assert torch.allclose(prox_on, prox_off, atol=1e-5, rtol=0)
        assert st_on["tokens"] == st_off["tokens"] and st_on["loss"] == pytest.approx(st_off["loss"], abs=1e-5)
        # Two AdamW steps at lr 3e-3 move every weight by ~3e-3 whatever its gradient's size: where a gradient is ~0 (embedding
        # rows of unseen tokens), float32 summation order alone moves the step by a few 1e-5 (3.3e-5 seen on an AVX-512 Xeon).
        assert all(torch.allclose(w_on[n], w_off[n], atol=1e-4) for n in w_off)


FSDP_WORKER = '''
import os, sys
import torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from transformers import Qwen2Config, Qwen2ForCausalLM
from kuberl.runtime.trainer.batch import response_logprobs
from kuberl.runtime.trainer.packing import is_fsdp

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
cfg = Qwen2Config(vocab_size=60, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, tie_word_embeddings=True)
model = Qwen2ForCausalLM(cfg).float()
for layer in model.model.layers:
    fully_shard(layer)
fully_shard(model)
assert is_fsdp(model)
g = torch.Generator().manual_seed(3 + rank)  # each rank its own rows, as the trainer shards them
prompts = [torch.randint(3, 60, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g).tolist() for _ in range(6)]
outputs = [torch.randint(3, 60, (int(torch.randint(0, 14, (1,), generator=g)),), generator=g).tolist() for _ in range(6)]
width = max(len(o) for o in outputs)
res = []
for packed in (False, True):
    model.zero_grad(set_to_none=True)
    lp, ent = response_logprobs(model, prompts, outputs, width, entropy=True, packed=packed)
    (lp * torch.linspace(-1, 1, lp.numel()).view_as(lp)).sum().backward()
    res.append((lp.detach(), ent, {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}))
(a, ea, ga), (b, eb, gb) = res
d = max((a - b).abs().max().item(), (ea - eb).abs().max().item(), max((ga[k] - gb[k]).abs().max().item() for k in ga))
print(f"rank {rank} max diff {d:.3e} grad sum {sum(float(v.abs().sum()) for v in ga.values()):.3e}", flush=True)
dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)  # as the trainer does (kuberl.runtime.trainer.main): torch 2.13's CPU teardown at interpreter exit aborts
# one run in four here ("terminate called without an active exception", SIGABRT) after every result is printed
'''


def test_packed_equals_padded_under_fsdp2_on_two_gloo_ranks(tmp_path):
    """FSDP2 (what trainer ranks run; no shared-prompt path there): packed rows give the padded path's log-probs,
    entropies and full (all-reduced) gradients on every rank."""
    import re

    script = tmp_path / "fsdp_packing_worker.py"
    script.write_text(FSDP_WORKER)
    proc = torchrun(str(script), timeout=240, cwd=tmp_path)
    # The two ranks share stdout and their lines can run together ("...e+03rank 1 ..."): match the numbers exactly.
    num = r"([0-9.]+e[+-]\d+)"
    diffs = re.findall(rf"rank (\d) max diff {num} grad sum {num}", proc.stdout)
    assert sorted(r for r, _, _ in diffs) == ["0", "1"], proc.stdout
    for _, d, gsum in diffs:
        assert float(d) < 1e-5 and float(gsum) > 0
