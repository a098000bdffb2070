"""The Megatron backend's model core against Hugging Face transformers, on 2 CPU processes over gloo.

One torch.distributed.run launch (tests/megatron_backend/megatron_worker.py) runs every tiny model of
megatron_models.TINY at TP=2, at PP=2 and at DP=2 (each rank trains one of the two micro-batches); this
module computes the same things with the single-process HF model and compares:
  * the weights loaded into megatron and gathered back to HF names are the HF weights, bit for bit;
  * log-probs and entropies (temperature 0.7, two micro-batches, shared prompts, an empty and a truncated
    response) equal kuberl's `response_logprobs` on the HF model within 1e-4;
  * one train step of the decoupled PPO loss (ppo_actor_loss with KL, two micro-batches, grad clipping,
    AdamW): the gradients, their global norm and the updated weights equal one step of the HF model.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from megatron_models import TINY, hf_state, tiny_model

from kuberl.api.v1alpha1 import AlgorithmSpec
from kuberl.net import free_port
from kuberl.runtime.algorithms import loss_denominator, ppo_actor_loss, resolve_algorithm
from kuberl.runtime.trainer.batch import response_logprobs

pytestmark = pytest.mark.megatron

try:
    import megatron.core  # noqa: F401

    MISSING = None
except ImportError as exc:  # not skipped: the megatron tier must not pass without megatron-core
    MISSING = f"megatron-core is not installed ({exc}); install it for the megatron tests: pip install megatron-core==0.16.1"

LAYOUTS = [(2, 1), (1, 2), (1, 1)]  # (tp, pp) on 2 ranks; (1, 1) is data parallel 2
ALGORITHM = dict(name="grpo", kl_coef=0.05)
TEMPERATURE = 0.7
WIDTH = 8
PLANS = [[0, 1, 2], [3, 4, 5]]
# Adam's first step is lr * g / (|g| + eps): with a tiny eps, a gradient element near 0 whose fp32 noise (~1e-6 here)
# flips its sign moves by up to 2 lr. eps 1e-3 keeps the update a smooth function of the gradient.
TRAIN = dict(lr=1e-3, betas=(0.9, 0.99), eps=1e-3, weight_decay=0.01, grad_clip=1.0)


def batch(vocab: int = 127, seed: int = 5):
    """6 rows: two prompts shared by 2 rows each (a group), an empty and a truncated (> WIDTH) response."""
    g = torch.Generator().manual_seed(seed)

    def toks(n):
        return torch.randint(0, vocab, (n,), generator=g).tolist()

    p0, p1 = toks(3), toks(6)
    prompts = [p0, p0, toks(1), p1, p1, toks(4)]
    outputs = [toks(5), toks(8), [], toks(3), toks(11), toks(7)]
    return prompts, outputs


def train_tensors(ref_logp: torch.Tensor, valid: torch.Tensor, seed: int = 9) -> dict:
    g = torch.Generator().manual_seed(seed)
    mask = (valid & (torch.rand(valid.shape, generator=g) > 0.15)).float()
    noise = lambda s: s * torch.randn(valid.shape, generator=g)  # noqa: E731
    return dict(loss_mask=mask, behave_logp=ref_logp + noise(0.3), prox_logp=ref_logp + noise(0.1), ref_logp=ref_logp + noise(0.2),
                advantages=torch.randn(valid.shape, generator=g))


def hf_reference(model, prompts, outputs, cfg, tr):
    """What the worker must reproduce: log-probs/entropy, then one step (grads, norm, updated weights) of the HF model."""
    with torch.no_grad():
        logp, ent = response_logprobs(model, prompts, outputs, WIDTH, temperature=TEMPERATURE, entropy=True)
    opt = torch.optim.AdamW(model.parameters(), lr=TRAIN["lr"], betas=TRAIN["betas"], eps=TRAIN["eps"], weight_decay=TRAIN["weight_decay"])
    lp = response_logprobs(model, prompts, outputs, WIDTH, temperature=TEMPERATURE)
    loss, stats = ppo_actor_loss(lp, tr["prox_logp"], tr["behave_logp"], tr["advantages"], tr["loss_mask"], cfg, ref_logp=tr["ref_logp"],
                                 denominator=tr["denominator"])
    loss.backward()
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), TRAIN["grad_clip"]))
    grads = {k: p.grad.detach().clone() for k, p in model.named_parameters()}  # clipped, as the worker records them
    opt.step()
    return dict(logp=logp, entropy=ent, grads=grads, grad_norm=norm, loss=stats["loss"], after=hf_state(model))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(HF references, worker results) for every tiny model, from one 2-process launch."""
    if MISSING:
        pytest.fail(MISSING)
    tmp = tmp_path_factory.mktemp("megatron")
    cfg = resolve_algorithm(AlgorithmSpec(**ALGORITHM))
    prompts, outputs = batch()
    valid = torch.zeros(len(outputs), WIDTH, dtype=torch.bool)
    for i, o in enumerate(outputs):
        valid[i, : min(len(o), WIDTH)] = True
    refs, dirs, trains = {}, {}, {}
    for name in TINY:
        model = tiny_model(name)
        model.save_pretrained(tmp / name)
        dirs[name] = str(tmp / name)
        with torch.no_grad():
            base = response_logprobs(model, prompts, outputs, WIDTH, temperature=TEMPERATURE)
        tr = train_tensors(base, valid)
        tr["denominator"] = loss_denominator(tr["loss_mask"], cfg)
        trains[name] = tr
        refs[name] = hf_reference(model, prompts, outputs, cfg, tr) | {"loaded": hf_state(tiny_model(name))}
    job = dict(models=dirs, layouts=LAYOUTS, prompts=prompts, outputs=outputs, width=WIDTH, temperature=TEMPERATURE,
               micro_batches=PLANS, algorithm=ALGORITHM, train={name: tr | TRAIN for name, tr in trains.items()})
    torch.save(job, tmp / "job.pt")
    script = Path(__file__).with_name("megatron_worker.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port",
           str(free_port()), str(script), str(tmp / "job.pt"), str(tmp / "out.pt")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, cwd=tmp)
    assert proc.returncode == 0, f"megatron worker failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-8000:]}"
    results = torch.load(tmp / "out.pt", weights_only=False)
    return refs, results


CASES = [(name, f"tp{tp}-pp{pp}-dp{2 // (tp * pp)}") for name in TINY for tp, pp in LAYOUTS]
IDS = [f"{n}-{lay}" for n, lay in CASES]


def max_diff(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b)
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.parametrize(("name", "layout"), CASES, ids=IDS)
def test_weights_load_and_gather_back_exactly(runs, name, layout):
    refs, results = runs
    got, want = results[f"{name}/{layout}"]["loaded"], refs[name]["loaded"]
    assert sorted(got) == sorted(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k


@pytest.mark.parametrize(("name", "layout"), CASES, ids=IDS)
def test_logprobs_and_entropy_match_transformers(runs, name, layout):
    refs, results = runs
    r, ref = results[f"{name}/{layout}"], refs[name]
    assert r["logp"].shape == ref["logp"].shape == (6, WIDTH)
    d_lp = (r["logp"] - ref["logp"]).abs().max().item()
    d_ent = (r["entropy"] - ref["entropy"]).abs().max().item()
    print(f"{name} {layout}: max |logp diff| {d_lp:.2e}, max |entropy diff| {d_ent:.2e}, logp range {ref['logp'].min():.1f}..0")
    assert d_lp < 1e-4 and d_ent < 1e-4
    assert ref["logp"].min() < -5  # far from uniform (log 1/128 = -4.85): a wrong layout would show


@pytest.mark.parametrize(("name", "layout"), CASES, ids=IDS)
def test_one_train_step_matches_transformers(runs, name, layout):
    refs, results = runs
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
