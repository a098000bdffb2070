"""The trained weights' sha256 that every trainer rank logs at the end of a run (persist.full_weights_digest): the bytes of
weights.digest_state over the full weights, gathered one parameter at a time, never the whole state at once (a whole-state
gather on every rank runs out of accelerator memory from ~14B parameters, and a restart then fails the same way)."""

from __future__ import annotations

import re

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from kuberl.runtime.trainer.persist import FullTensors, full_weights_digest
from kuberl.runtime.trainer.weights import digest_state
from tests.unit.torchrun import torchrun

WORKER = r'''
import sys, weakref
import torch
from torch.distributed.tensor import DTensor
from transformers import Qwen2Config, Qwen2ForCausalLM
from kuberl.runtime.trainer import dist as D
from kuberl.runtime.trainer.persist import full_weights_digest
from kuberl.runtime.trainer.weights import digest_state

info = D.init_distributed("cpu")
torch.manual_seed(0)
cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, tie_word_embeddings=True)
model = Qwen2ForCausalLM(cfg).to(torch.float32)
unsharded = digest_state(model.state_dict())  # the same model before it is cut (same seed on both ranks)
model = D.shard_model(model, info)
assert all(isinstance(p, DTensor) for p in model.parameters()), "not sharded"
with torch.no_grad():  # weights that differ from the initial ones, so a digest of anything else shows
    for p in model.parameters():
        p.add_(0.01)
whole = digest_state({n: t.full_tensor() for n, t in model.state_dict().items()})  # the earlier way: every tensor at once

alive, peak, calls, biggest = [0], [0], [0], [0]
real = DTensor.full_tensor

def counted(self, *a, **kw):
    out = real(self, *a, **kw)
    calls[0] += 1
    alive[0] += 1
    peak[0] = max(peak[0], alive[0])
    biggest[0] = max(biggest[0], out.numel())
    weakref.finalize(out, lambda: alive.__setitem__(0, alive[0] - 1))
    return out

DTensor.full_tensor = counted
streamed = full_weights_digest(model)
DTensor.full_tensor = real
largest = max(p.numel() for p in model.parameters())
print(f"rank {info.rank} unsharded={unsharded} whole={whole} streamed={streamed} peak={peak[0]} calls={calls[0]} "
      f"entries={len(model.state_dict())} biggest={biggest[0]} largest={largest};", flush=True)
D.shutdown()
from kuberl.runtime.trainer.main import exit_now
exit_now(0)  # as the trainer leaves: torch's CPU teardown at exit can abort a 2-rank process (SIGABRT)
'''


def test_two_fsdp_ranks_hash_the_full_weights_one_parameter_at_a_time(tmp_path):
    """2 gloo ranks, FSDP2: each rank's digest equals digest_state of the whole gathered state (what the trainer logged
    before, and what tests/integration/test_trainer.py compares with the published weights); at most one gathered
    parameter is alive at any time, and none is bigger than the largest parameter."""
    script = tmp_path / "digest_worker.py"
    script.write_text(WORKER)
    proc = torchrun(str(script), timeout=240, cwd=tmp_path)
    fields = r"rank (\d) unsharded=(\w+) whole=(\w+) streamed=(\w+) peak=(\d+) calls=(\d+) entries=(\d+) biggest=(\d+) largest=(\d+);"
    rows = re.findall(fields, proc.stdout)
    assert sorted(r[0] for r in rows) == ["0", "1"], proc.stdout
    for _, unsharded, whole, streamed, peak, calls, entries, biggest, largest in rows:
        assert streamed == whole != unsharded  # the trained weights, not the initial ones
        assert int(peak) == 1 and int(calls) == int(entries)  # one gather per state-dict entry, each dropped before the next
        assert int(biggest) == int(largest)
    assert rows[0][3] == rows[1][3]  # the ranks agree


def test_one_rank_digest_equals_digest_state_and_gathers_nothing():
    """World size 1 trains the plain module (dist.shard_model): the digest is digest_state of its state dict."""
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, tie_word_embeddings=True)
    model = Qwen2ForCausalLM(cfg)
    before = full_weights_digest(model)
    assert before == digest_state(model.state_dict())
    lazy = FullTensors(model.state_dict())
    assert sorted(lazy) == sorted(model.state_dict()) and len(lazy) == len(model.state_dict())
    with torch.no_grad():
        model.model.norm.weight[0] += 1e-3
    assert full_weights_digest(model) != before
