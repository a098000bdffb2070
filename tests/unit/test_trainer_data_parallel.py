"""The trainer's update on two gloo ranks (FSDP2) against one rank, through Trainer.setup and stage_ppo_update.

Each rank runs 3 micro-batches of one optimizer step. With the gradient sync deferred to the last micro-batch (compute.py:
set_requires_gradient_sync False before it) the updated weights equal those of a sync after every micro-batch and those
of one process over all the rows (plain SGD, no clipping: a wrong scale or a missing micro-batch shows), with a third of
the reduce-scatters. The rows are dealt by length (batch.shard_micro_batches), which must not change the update either.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.unit.torchrun import torchrun

WORKER = r'''
import json, os, sys
from pathlib import Path
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from kuberl.api import RLExperiment
from kuberl.runtime.trainer import compute as C
from kuberl.runtime.trainer import dist as D
from kuberl.runtime.trainer.batch import build_batch, minibatch_rows
from kuberl.runtime.trainer.trainer import Trainer

out, model_dir, defer, lora = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "lora"
world = int(os.environ.get("WORLD_SIZE", "1"))
if defer == "off":
    C.defer_gradient_sync = lambda model, device: (False, "test: a sync after every micro-batch")
counts = {"reduce_scatter": 0, "sync_flags": []}
real_rs = dist.reduce_scatter_single
def counted_rs(*a, **kw):
    counts["reduce_scatter"] += 1
    return real_rs(*a, **kw)
dist.reduce_scatter_single = counted_rs  # what FSDP2's reduce-scatter calls (fsdp._fully_shard._fsdp_collectives)
real_flag = FSDPModule.set_requires_gradient_sync
def flag(self, requires_gradient_sync, *, recurse=True):
    counts["sync_flags"].append(bool(requires_gradient_sync))
    return real_flag(self, requires_gradient_sync, recurse=recurse)
FSDPModule.set_requires_gradient_sync = flag

exp = RLExperiment.model_validate({
    "apiVersion": "kuberl.io/v1alpha1", "kind": "RLExperiment", "metadata": {"name": "dp"},
    "spec": {"model": {"path": model_dir, "dtype": "float32"}, "dataset": {"builtin": "repeat-digit", "size": 8},
             "algorithm": {"name": "grpo", "samplesPerPrompt": 3, "batchSize": 4, "learningRate": 1.0, "ppoMinibatches": 1,
                           "optimizer": {"type": "sgd", "beta1": 0.0, "weightDecay": 0.0, "gradClip": 1e6}},
             "trainer": {"microBatchTokens": 64, "packing": "off", "accelerator": {"type": "cpu", "count": world}},
             "training": {"totalSteps": 10}},
})
if lora:  # PEFT around the FSDP2 base model: the sync flag is set on the base (compute.fsdp_root)
    from kuberl.api.algorithm import LoRASpec
    exp.spec.algorithm.lora = LoRASpec.model_validate({"rank": 4, "alpha": 8, "targetModules": ["q_proj", "v_proj"]})
groups = []
for g in range(4):  # responses of 18..27 tokens after 4 prompt tokens: two rows per padded micro-batch of 64 tokens
    prompt = [5 + g, 40, 41, 42]
    samples = []
    for k in range(3):
        n = 18 + (5 * g + 7 * k) % 10
        out_ids = [(11 * g + 13 * k + 3 * j) % 300 + 10 for j in range(n)]
        samples.append({"input_ids": prompt, "output_ids": out_ids, "logprobs": [-2.0] * n, "versions": [0] * n,
                        "loss_mask": [1] * n, "reward": float(k == g % 3)})
    groups.append({"group_id": f"g{g}", "samples": samples})
t = Trainer(exp, bus_url="nats://unused:4222", workdir=Path(out).parent / "work", handle_sigterm=False)
t.setup()
batch = build_batch(groups, 3)
rows = minibatch_rows(batch.num_groups, batch.group_sizes, 1)[0]
micro = t._micro_batches(batch, rows, packed=False)
t.stage_prox_logp(batch)
t.stage_advantages(batch)
stats = t.stage_ppo_update(batch)
weights = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in t.model.named_parameters()}
report = {"rank": t.info.rank, "micro_batches": len(micro), "loss": stats["loss"], "tokens": stats["tokens"], **counts}
if t.info.is_main:
    torch.save(weights, out)
# One write(2) of the whole line: the ranks share one pipe, and print() wrote the text and the newline apart, so another
# rank's report could land between them (two reports on one line).
sys.stdout.flush()
os.write(1, ("REPORT " + json.dumps(report) + "\n").encode())
D.shutdown()
from kuberl.runtime.trainer.main import exit_now
exit_now(0)  # as the trainer leaves: torch's CPU teardown at exit can abort a 2-rank process (SIGABRT)
'''


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Updated weights and each rank's report: 2 ranks deferring the sync, 2 ranks syncing every micro-batch, 1 rank."""
    from kuberl.runtime.models import build_tiny_model

    root = tmp_path_factory.mktemp("dp")
    model_dir = build_tiny_model(root / "model", seed=0)
    script = root / "dp_worker.py"
    script.write_text(WORKER)
    out = {}
    for name, world, defer, lora in (("deferred", 2, "on", ""), ("synced", 2, "off", ""), ("one", 1, "on", ""),
                                     ("lora-deferred", 2, "on", "lora"), ("lora-one", 1, "on", "lora")):
        where = root / name
        where.mkdir()
        proc = torchrun(str(script), str(where / "weights.pt"), str(model_dir), defer, lora, ranks=world, timeout=300, cwd=where)
        reports = [json.loads(line.split("REPORT ", 1)[1]) for line in proc.stdout.splitlines() if "REPORT " in line]
        assert sorted(r["rank"] for r in reports) == list(range(world)), proc.stdout
        out[name] = (torch.load(where / "weights.pt"), reports)
    out["initial"] = _initial(model_dir)
    return out


def _initial(model_dir: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return {n: p.detach() for n, p in AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).named_parameters()}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b)
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_deferred_gradient_sync_updates_the_weights_as_a_sync_per_micro_batch_does(runs):
    (deferred, d_reports), (synced, s_reports) = runs["deferred"], runs["synced"]
    assert all(r["micro_batches"] == 3 for r in d_reports + s_reports)
    moved = max_diff(synced, runs["initial"])
    print(f"deferred vs synced {max_diff(deferred, synced):.1e}, weights moved {moved:.1e}; reduce-scatters "
          f"{d_reports[0]['reduce_scatter']} vs {s_reports[0]['reduce_scatter']}")
    assert moved > 1e-3
    assert max_diff(deferred, synced) < 1e-6, (max_diff(deferred, synced), moved)
    for r in d_reports:  # off for the first two micro-batches, on for the last
        assert r["sync_flags"] == [False, False, True], r
        assert r["loss"] == pytest.approx(s_reports[0]["loss"], abs=1e-6)
    for r in s_reports:
        assert r["sync_flags"] == []
    # FSDP2 reduce-scatters once per sharded module (3 here: 2 decoder layers and the root) per synced backward
    rs_deferred, rs_synced = d_reports[0]["reduce_scatter"], s_reports[0]["reduce_scatter"]
    assert rs_deferred > 0 and rs_synced == 3 * rs_deferred, (rs_deferred, rs_synced)


def test_two_ranks_update_the_weights_as_one_rank_does(runs):
    (two, reports), (one, one_reports) = runs["deferred"], runs["one"]
    print(f"2 ranks vs 1 {max_diff(two, one):.1e}")
    assert max_diff(two, one) < 1e-6
    assert reports[0]["tokens"] == one_reports[0]["tokens"]
    assert reports[0]["loss"] == pytest.approx(one_reports[0]["loss"], abs=1e-6)


def test_lora_adapters_with_the_deferred_sync_equal_one_ranks(runs):
    """algorithm.lora: the PEFT wrapper is not the FSDP module; the flag goes to the base model inside it."""
    (two, reports), (one, _) = runs["lora-deferred"], runs["lora-one"]
    assert all(r["sync_flags"] == [False, False, True] for r in reports), reports
    lora_b = {k: v for k, v in one.items() if "lora_B" in k}
    assert lora_b and max(v.abs().max().item() for v in lora_b.values()) > 1e-3  # B starts at 0: the adapters trained
    print(f"lora: 2 ranks vs 1 {max_diff(two, one):.1e}")
    assert max_diff(two, one) < 1e-6


def test_the_sync_is_deferred_only_where_the_unsharded_gradients_fit(monkeypatch):
    """Deferring keeps every trainable parameter's full float32 gradient between micro-batches: on a GPU only up to
    DEFER_SYNC_MAX_SHARE of its memory (a big model keeps syncing per micro-batch); always on CPU."""
    from types import SimpleNamespace

    from kuberl.runtime.trainer import compute as C

    model = torch.nn.Linear(1000, 1000)  # 1,001,000 parameters: 4.0 MB of float32 gradients
    model.bias.requires_grad_(False)  # frozen parameters (a LoRA base) keep no gradient
    grad_bytes = 4 * 1000 * 1000
    assert C.defer_gradient_sync(model, torch.device("cpu"))[0]
    for total, want in ((grad_bytes / C.DEFER_SYNC_MAX_SHARE, True), (grad_bytes / C.DEFER_SYNC_MAX_SHARE - 1, False)):
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device, total=total: SimpleNamespace(total_memory=total))
        defer, why = C.defer_gradient_sync(model, torch.device("cuda", 0))
        assert defer is want and "GiB" in why
    assert not C.defer_gradient_sync(model, SimpleNamespace(type="npu"))[0]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_a_skewed_batch_is_dealt_to_ranks_with_about_equal_tokens(world):
    """GRPO groups whose answers run from 5 to 400 tokens: round-robin gave one rank most of the long ones; by length,
    the ranks' token counts differ by at most one row's length, every row is dealt once, and each rank keeps batch order."""
    from kuberl.runtime.trainer.batch import deal_rows, shard_micro_batches

    g = torch.Generator().manual_seed(7)
    lens = [int(x) for x in torch.randint(5, 40, (24,), generator=g)]
    for r in range(0, 24, world):  # every world-th row long: round-robin sends them all to rank 0
        lens[r] = 300 + r
    rows = list(range(24))
    dealt = deal_rows(lens, rows, world)
    loads = [sum(lens[r] for r in mine) for mine in dealt]
    assert max(loads) - min(loads) <= max(lens), loads
    assert sorted(r for mine in dealt for r in mine) == rows and all(mine == sorted(mine) for mine in dealt)
    round_robin = [sum(lens[r] for r in rows[k::world]) for k in range(world)]
    assert max(round_robin) - min(round_robin) > max(lens)  # the skew the deal removes
    shards = [shard_micro_batches(lens, rows, 512, k, world, packed=True) for k in range(world)]
    assert len({len(s) for s in shards}) == 1  # the same count on every rank (fillers)
    assert [sorted(r for mb in s if mb is not None for r in mb) for s in shards] == dealt
    assert deal_rows(lens, rows, 1) == [rows]
