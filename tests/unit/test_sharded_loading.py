"""FSDP ranks load the model at its sharded size (issue #37 point 7): dist.load_sharded builds on the meta device, each
rank allocates its shard only, and rank 0 alone reads the checkpoint and broadcasts it.

Four CPU ranks (gloo) load a 16-layer Qwen2 of about 260 MB: every rank but 0 may add at most half the model to its
peak memory (its quarter plus one layer's tensors in flight), where loading the whole model and then sharding it
added 0.93x on each (measured 2026-12-02 on the 2-core VM: 88-95 MB against 194-251 MB). The loaded shards must be
the checkpoint exactly, tied and untied, buffers (the rotary table) included, and the forward pass must match the
model transformers loads. Stand-in: CPU ranks and gloo for GPUs and NCCL; the claim is host memory here and GPU
memory there (to_empty allocates the shard on the rank's device; the whole model never reaches it).

With LoRA (algorithm.lora, `wrap=` wrap_lora) the same holds for the PEFT model: every rank's base weights and adapters,
its own shard and the gathered tensors, equal a full load wrapped by wrap_lora under the same seed (rank 0 draws the
adapters' initial values and broadcasts them; no rank draws its own), and exactly the adapters require grad. Ranks
1-3 added 92-105 MB (measured 2026-12-02, 2-core VM), against 198-255 MB when every rank loaded the whole model,
wrapped it and sharded the base (the path before).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.unit.torchrun import torchrun

pytestmark = pytest.mark.timeout(300)

WORKER = r'''
import json, resource, sys
from pathlib import Path
import torch
import transformers.models.qwen2.modeling_qwen2  # imported before the baseline: only the load is measured
from transformers import AutoModelForCausalLM
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from kuberl.runtime.trainer import dist as D

out, model_dir = Path(sys.argv[1]), sys.argv[2]
info = D.init_distributed()
peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
before = peak()
model = D.load_sharded(model_dir, info, None)
added = peak() - before
result = {"added": added, "sharded": all(type(p).__name__ == "DTensor" for p in model.parameters())}
full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
x = torch.arange(12).unsqueeze(0) * 7 % model.config.vocab_size
logits = model(x).logits.detach()
if info.rank == 0:
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    want = ref.state_dict()
    result["same_keys"] = sorted(full) == sorted(want)
    result["max_diff"] = max((full[k] - want[k]).abs().max().item() for k in want)
    result["buffers_diff"] = max((b - dict(ref.named_buffers())[n]).abs().max().item() for n, b in model.named_buffers())
    result["logits_diff"] = (logits - ref(x).logits).abs().max().item()
    result["tied"] = model.lm_head.weight is model.model.embed_tokens.weight
(out / f"rank{info.rank}.json").write_text(json.dumps(result))
D.shutdown()
'''


def save_model(path: Path, *, layers: int, tied: bool) -> int:
    """A Qwen2 of random weights (no tokenizer: loading reads only config and weights); returns its float32 bytes."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=4096, hidden_size=512, intermediate_size=2048, num_hidden_layers=layers, num_attention_heads=8,
                      num_key_value_heads=2, tie_word_embeddings=tied)
    model = Qwen2ForCausalLM(cfg)
    model.save_pretrained(path)
    return sum(p.numel() for p in model.parameters()) * 4


def run(tmp_path: Path, name: str, layers: int, tied: bool, ranks: int, worker: str = WORKER) -> tuple[int, list[dict]]:
    size = save_model(tmp_path / name, layers=layers, tied=tied)
    out = tmp_path / f"out-{name}"
    out.mkdir()
    script = tmp_path / "load_worker.py"
    script.write_text(worker)
    torchrun(script, out, tmp_path / name, ranks=ranks, timeout=240, cwd=tmp_path)
    return size, [json.loads((out / f"rank{r}.json").read_text()) for r in range(ranks)]


def test_each_rank_but_the_first_adds_at_most_half_the_model_and_gets_the_checkpoint_exactly(tmp_path: Path) -> None:
    size, ranks = run(tmp_path, "untied16", layers=16, tied=False, ranks=4)
    assert all(r["sharded"] for r in ranks)
    for rank, r in enumerate(ranks[1:], start=1):
        assert r["added"] < 0.5 * size, f"rank {rank} added {r['added'] / 1e6:.0f} MB loading a {size / 1e6:.0f} MB model in 4 shards"
    first = ranks[0]
    assert first["same_keys"] and first["max_diff"] == 0.0 and first["buffers_diff"] == 0.0, first
    assert first["logits_diff"] < 1e-5, first


def test_tied_embeddings_stay_tied_and_load_exactly(tmp_path: Path) -> None:
    _, ranks = run(tmp_path, "tied2", layers=2, tied=True, ranks=2)
    first = ranks[0]
    assert first["tied"] and first["same_keys"] and first["max_diff"] == 0.0 and first["logits_diff"] < 1e-5, first


LORA_WORKER = r'''
import json, resource, sys
from pathlib import Path
import torch
import transformers.models.qwen2.modeling_qwen2, peft  # imported before the baseline: only the load is measured
from transformers import AutoModelForCausalLM
from torch.distributed.tensor import DTensor, distribute_tensor
from kuberl.api.algorithm import LoRASpec
from kuberl.runtime.trainer import dist as D
from kuberl.runtime.trainer.setup_model import wrap_lora

out, model_dir = Path(sys.argv[1]), sys.argv[2]
lora = LoRASpec.model_validate({"rank": 8, "alpha": 16, "targetModules": ["q_proj", "v_proj", "down_proj"]})
info = D.init_distributed()
peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
before = peak()
torch.manual_seed(1234)  # as Trainer.setup seeds before loading
model = D.load_sharded(model_dir, info, None, wrap=lambda m: wrap_lora(m, lora))
added = peak() - before
torch.manual_seed(1234)  # the reference: the whole model loaded, then wrapped, as one unsharded rank does
ref = wrap_lora(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), lora)
want = dict(ref.named_parameters())
result = {"added": added, "names": sorted(n for n, _ in model.named_parameters()) == sorted(want),
          "sharded": all(isinstance(p, DTensor) for p in model.parameters()),
          "trainable": sorted(n for n, p in model.named_parameters() if p.requires_grad),
          "ref_trainable": sorted(n for n, p in ref.named_parameters() if p.requires_grad),
          "base_diff": 0.0, "adapter_diff": 0.0, "local_diff": 0.0}
adapters = []
for name, p in model.named_parameters():  # same order on every rank: full_tensor() is a collective
    full, kind = p.full_tensor(), "adapter_diff" if "lora_" in name else "base_diff"
    result[kind] = max(result[kind], (full - want[name]).abs().max().item())
    mine = distribute_tensor(want[name].detach(), p.device_mesh, p.placements, src_data_rank=None).to_local()
    result["local_diff"] = max(result["local_diff"], (p.to_local() - mine).abs().max().item())  # this rank's own shard
    if "lora_A" in name:
        adapters.append(full.abs().max().item())
result["lora_A_max"] = min(adapters)  # kaiming-initialised, not zero: the adapter check is not vacuous
ref_buffers = dict(ref.named_buffers())
result["buffers_diff"] = max((b - ref_buffers[n]).abs().max().item() for n, b in model.named_buffers())
x = torch.arange(12).unsqueeze(0) * 7 % model.config.vocab_size
with torch.no_grad():
    result["logits_diff"] = (model(x).logits - ref(x).logits).abs().max().item()
(out / f"rank{info.rank}.json").write_text(json.dumps(result))
D.shutdown()
'''


def test_lora_ranks_load_the_base_and_the_adapters_at_their_sharded_size_and_agree_with_one_full_load(tmp_path: Path) -> None:
    """algorithm.lora: every rank's shards (and the gathered tensors) are the full load + wrap_lora of the same seed."""
    size, ranks = run(tmp_path, "lora16", layers=16, tied=False, ranks=4, worker=LORA_WORKER)
    for rank, r in enumerate(ranks):
        assert r["names"] and r["sharded"], (rank, r)
        diffs = {k: r[k] for k in ("base_diff", "adapter_diff", "local_diff", "buffers_diff", "logits_diff", "lora_A_max")}
        assert r["base_diff"] == 0.0 and r["adapter_diff"] == 0.0 and r["local_diff"] == 0.0, (rank, diffs)
        assert r["buffers_diff"] == 0.0 and r["logits_diff"] < 1e-5 and r["lora_A_max"] > 0.0, (rank, diffs)
        assert r["trainable"] == r["ref_trainable"] and all("lora_" in n for n in r["trainable"]), (rank, r["trainable"][:4])
        assert len(r["trainable"]) == 16 * 3 * 2  # A and B of q_proj, v_proj and down_proj in each of the 16 layers
    for rank, r in enumerate(ranks[1:], start=1):
        assert r["added"] < 0.5 * size, f"rank {rank} added {r['added'] / 1e6:.0f} MB loading a {size / 1e6:.0f} MB model in 4 shards"
    print("lora: added MB per rank", [round(r["added"] / 1e6) for r in ranks], f"model {size / 1e6:.0f} MB")
