"""Qwen3-MoE on the Megatron backend, expert parallel over gloo, against Hugging Face transformers on one process.

One torch.distributed.run launch (megatron_worker.py via agreement.run_agreement) runs the tiny MoE models of
megatron_models.TINY_MOE (4 experts, top-2; one with every layer MoE and normalised top-k weights, one with a
dense first layer and plain softmax weights) at:
  * EP=2 (data parallel 2, expert-data-parallel 1): each rank holds 2 of the 4 experts and trains its own
    micro-batches (3 micro-batches over 2 ranks: one rank runs a filler to keep the experts' all-gathers paired);
  * EP=1, data parallel 2 (every expert on both ranks);
  * PP=2, EP=1 (the mixed model's first stage has no MoE layer).
and compares with the single-process HF model: weights loaded and gathered back bit for bit, log-probs and
entropies, the decoupled-PPO step's gradients (experts gathered from the EP ranks), global grad norm (over the
EP ranks' different experts) and updated weights.
"""

from __future__ import annotations

import pytest
import torch
from agreement import MISSING, TRAIN, max_diff, run_agreement
from megatron_models import TINY_MOE

pytestmark = pytest.mark.megatron

LAYOUTS = [(1, 1, 2), (1, 1, 1), (1, 2, 1)]  # (tp, pp, ep) on 2 ranks
PLANS = [[0, 1], [2, 3], [4, 5]]  # at data parallel 2: rank 0 trains micro-batches 0 and 2, rank 1 micro-batch 1
CASES = [(name, f"tp{tp}-pp{pp}-dp{2 // (tp * pp)}" + (f"-ep{ep}" if ep > 1 else "")) for name in TINY_MOE for tp, pp, ep in LAYOUTS]
IDS = [f"{n}-{lay}" for n, lay in CASES]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    if MISSING:
        pytest.fail(MISSING)
    return run_agreement(tmp_path_factory.mktemp("megatron-moe"), list(TINY_MOE), LAYOUTS, PLANS)


@pytest.mark.parametrize(("name", "layout"), CASES, ids=IDS)
def test_moe_weights_load_and_gather_back_exactly(runs, name, layout):
    refs, results = runs
    got, want = results[f"{name}/{layout}"]["loaded"], refs[name]["loaded"]
    assert sorted(got) == sorted(want)
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in want
    for k in want:
        assert torch.equal(got[k], want[k]), k


@pytest.mark.parametrize(("name", "layout"), CASES, ids=IDS)
def test_moe_logprobs_and_entropy_match_transformers(runs, name, layout):
    refs, results = runs
    r, ref = results[f"{name}/{layout}"], refs[name]
    d_lp = (r["logp"] - ref["logp"]).abs().max().item()
    d_ent = (r["entropy"] - ref["entropy"]).abs().max().item()
    print(f"{name} {layout}: max |logp diff| {d_lp:.2e}, max |entropy diff| {d_ent:.2e}, logp range {ref['logp'].min():.1f}..0")
    assert d_lp < 1e-4 and d_ent < 1e-4
    assert ref["logp"].min() < -5


@pytest.mark.parametrize(("name", "layout"), CASES, ids=IDS)
def test_moe_train_step_matches_transformers(runs, name, layout):
    refs, results = runs
    r, ref = results[f"{name}/{layout}"], refs[name]
    expert = [k for k in ref["grads"] if ".mlp.experts." in k]
    router = [k for k in ref["grads"] if k.endswith("mlp.gate.weight")]
    scale = max(v.abs().max().item() for v in ref["grads"].values())
    d_grad = max_diff(r["grads"], ref["grads"])
    d_w = max_diff(r["after"], ref["after"])
    moved = max_diff(ref["after"], ref["loaded"])
    print(f"{name} {layout}: grad norm {r['stats']['grad_norm']:.6g} vs {ref['grad_norm']:.6g}, max |grad diff| {d_grad:.2e} "
          f"(max |grad| {scale:.2e}), max |weight diff| {d_w:.2e} after a step that moved weights by up to {moved:.2e}")
    # every expert and router trains (a wrong routing would leave some expert's gradient at 0 or move others)
    assert all(ref["grads"][k].abs().max() > 0 for k in expert + router)
    assert abs(r["stats"]["loss"] - ref["loss"]) < 1e-5
    assert abs(r["stats"]["grad_norm"] - ref["grad_norm"]) < 1e-4 * ref["grad_norm"]
    assert ref["grad_norm"] > TRAIN["grad_clip"]
    assert d_grad < 1e-4 * scale
    assert d_w < 2e-6 and moved > 5e-4


def test_the_expert_parallel_ranks_hold_different_experts_and_agree_with_ep1(runs):
    """EP=2 and EP=1 give the same log-probs and the same updated experts (the EP=1 run is the DP=2 one)."""
    _, results = runs
    a, b = results["qwen3-moe/tp1-pp1-dp2-ep2"], results["qwen3-moe/tp1-pp1-dp2"]
    assert (a["logp"] - b["logp"]).abs().max() < 1e-4  # fp32 noise on log-probs down to -27
    assert max_diff(a["after"], b["after"]) < 2e-6
    assert sum(".mlp.experts." in k for k in a["after"]) == 2 * 4 * 3  # 2 layers x 4 experts x gate/up/down
