"""The Megatron backend's model core against Hugging Face transformers, on 2 (and 4) CPU processes over gloo.

One 2-process torch.distributed.run launch (megatron_worker.py, started by agreement.run_agreement) runs every tiny
model of megatron_models.TINY (all GQA: 4 query heads, 2 KV heads) at TP=2, at PP=2, at DP=2 (each rank trains one
of the two micro-batches) and at CP=2 (context parallel: each rank holds half of every sequence, megatron's chunks
0+3 and 1+2 of 4; micro-batches of 10 and 13 positions padded to 12 and 16); a 4-process launch runs two of them at
CP=2 x TP=2, CP=2 x PP=2 and CP=2 x DP=2. This module computes the same things with the single-process HF model
and compares:
  * the weights loaded into megatron and gathered back to HF names are the HF weights, bit for bit;
  * log-probs and entropies (temperature 0.7, two micro-batches, shared prompts, an empty and a truncated
    response) equal kuberl's `response_logprobs` on the HF model within 1e-4;
  * one train step of the decoupled PPO loss (ppo_actor_loss with KL, two micro-batches, grad clipping,
    AdamW): the gradients, their global norm and the updated weights equal one step of the HF model.
"""

from __future__ import annotations

import pytest
import torch
from agreement import MISSING, TRAIN, WIDTH, max_diff, run_agreement
from megatron_models import TINY

pytestmark = pytest.mark.megatron

# (tp, pp[, ep, cp]) per launch size: (1, 1) is data parallel 2, (1, 1, 1, 2) context parallel 2. The 4-process launch
# combines context parallel with tensor, pipeline and data parallel (2 x 2 each) on two models: qwen3 (q/k norms summed
# over TP) and qwen2-tied (the tied embedding's two copies under PP).
LAYOUTS = {2: [(2, 1), (1, 2), (1, 1), (1, 1, 1, 2)], 4: [(2, 1, 1, 2), (1, 2, 1, 2), (1, 1, 1, 2)]}
MODELS = {2: list(TINY), 4: ["qwen3", "qwen2-tied"]}
PLANS = [[0, 1, 2], [3, 4, 5]]


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    """nproc -> (HF references, worker results) for MODELS[nproc] at LAYOUTS[nproc], from one launch each (made on first use)."""
    if MISSING:
        pytest.fail(MISSING)
    done = {}

    def get(nproc: int):
        if nproc not in done:
            done[nproc] = run_agreement(tmp_path_factory.mktemp(f"megatron-{nproc}"), MODELS[nproc], LAYOUTS[nproc], PLANS, nproc=nproc)
        return done[nproc]
    return get


def layout_key(world: int, tp: int, pp: int, ep: int = 1, cp: int = 1) -> str:
    return f"tp{tp}-pp{pp}-dp{world // (tp * pp * cp)}" + (f"-cp{cp}" if cp > 1 else "")


CASES = [(nproc, name, layout_key(nproc, *lay)) for nproc in LAYOUTS for name in MODELS[nproc] for lay in LAYOUTS[nproc]]
IDS = [f"{n}-{lay}" + ("-of4" if nproc == 4 else "") for nproc, n, lay in CASES]


@pytest.mark.parametrize(("nproc", "name", "layout"), CASES, ids=IDS)
def test_weights_load_and_gather_back_exactly(launches, nproc, name, layout):
    refs, results = launches(nproc)
    got, want = results[f"{name}/{layout}"]["loaded"], refs[name]["loaded"]
    assert sorted(got) == sorted(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k


@pytest.mark.parametrize(("nproc", "name", "layout"), CASES, ids=IDS)
def test_logprobs_and_entropy_match_transformers(launches, nproc, name, layout):
    refs, results = launches(nproc)
    r, ref = results[f"{name}/{layout}"], refs[name]
    assert r["logp"].shape == ref["logp"].shape == (6, WIDTH)
    d_lp = (r["logp"] - ref["logp"]).abs().max().item()
    d_ent = (r["entropy"] - ref["entropy"]).abs().max().item()
    print(f"{name} {layout}: max |logp diff| {d_lp:.2e}, max |entropy diff| {d_ent:.2e}, logp range {ref['logp'].min():.1f}..0")
    assert d_lp < 1e-4 and d_ent < 1e-4
    assert ref["logp"].min() < -5  # far from uniform (log 1/128 = -4.85): a wrong layout would show


@pytest.mark.parametrize(("nproc", "name", "layout"), CASES, ids=IDS)
def test_one_train_step_matches_transformers(launches, nproc, name, layout):
    refs, results = launches(nproc)
    r, ref = results[f"{name}/{layout}"], refs[name]
    scale = max(v.abs().max().item() for v in ref["grads"].values())
    d_grad = max_diff(r["grads"], ref["grads"])
    d_w = max_diff(r["after"], ref["after"])
    moved = max_diff(ref["after"], ref["loaded"])
    print(f"{name} {layout}: grad norm {r['stats']['grad_norm']:.6g} vs {ref['grad_norm']:.6g}, max |grad diff| {d_grad:.2e} "
          f"(max |grad| {scale:.2e}), max |weight diff| {d_w:.2e} after a step that moved weights by up to {moved:.2e}")
    assert abs(r["stats"]["loss"] - ref["loss"]) < 1e-5
    assert abs(r["stats"]["grad_norm"] - ref["grad_norm"]) < 1e-4 * ref["grad_norm"]
    assert ref["grad_norm"] > TRAIN["grad_clip"]  # the clip is exercised
    assert d_grad < 1e-4 * scale
    assert d_w < 2e-6 and moved > 5e-4
