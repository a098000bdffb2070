"""What test_megatron_tp.py and test_megatron_moe.py share: the batch, the HF reference step, and the 2-process (or 4) launch.

The worker (megatron_worker.py) and the single-process HF model compute the same things; the tests compare:
log-probs and entropies (temperature 0.7, shared prompts, an empty and a truncated response), then one train
step of the decoupled PPO loss (ppo_actor_loss with KL, grad clipping, AdamW): the gradients, their global
norm and the updated weights.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch
from megatron_models import hf_state, tiny_model

from kuberl.api.v1alpha1 import AlgorithmSpec
from kuberl.net import free_port
from kuberl.runtime.algorithms import loss_denominator, ppo_actor_loss, resolve_algorithm
from kuberl.runtime.trainer.batch import response_logprobs
from kuberl.runtime.trainer.megatron.convert_moe import checkpoint_names

try:
    import megatron.core  # noqa: F401

    MISSING = None
except ImportError as exc:  # not skipped: the megatron tier must not pass without megatron-core
    MISSING = f"megatron-core is not installed ({exc}); install it for the megatron tests: pip install megatron-core==0.16.1"

ALGORITHM = dict(name="grpo", kl_coef=0.05)
TEMPERATURE = 0.7
WIDTH = 8
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
    # clipped, as the worker records them; a MoE model's fused experts under their checkpoint names
    grads = checkpoint_names({k: p.grad.detach().clone() for k, p in model.named_parameters()})
    opt.step()
    return dict(logp=logp, entropy=ent, grads=grads, grad_norm=norm, loss=stats["loss"], after=hf_state(model))


def run_agreement(tmp: Path, names, layouts, plans, nproc: int = 2):
    """(HF references, worker results) for the tiny models `names` at every layout, from one `nproc`-process launch."""
    cfg = resolve_algorithm(AlgorithmSpec(**ALGORITHM))
    prompts, outputs = batch()
    valid = torch.zeros(len(outputs), WIDTH, dtype=torch.bool)
    for i, o in enumerate(outputs):
        valid[i, : min(len(o), WIDTH)] = True
    refs, dirs, trains = {}, {}, {}
    for name in names:
        model = tiny_model(name)
        model.save_pretrained(tmp / name)
        dirs[name] = str(tmp / name)
        with torch.no_grad():
            base = response_logprobs(model, prompts, outputs, WIDTH, temperature=TEMPERATURE)
        tr = train_tensors(base, valid)
        tr["denominator"] = loss_denominator(tr["loss_mask"], cfg)
        trains[name] = tr
        refs[name] = hf_reference(model, prompts, outputs, cfg, tr) | {"loaded": hf_state(tiny_model(name))}
    job = dict(models=dirs, layouts=layouts, prompts=prompts, outputs=outputs, width=WIDTH, temperature=TEMPERATURE,
               micro_batches=plans, algorithm=ALGORITHM, train={name: tr | TRAIN for name, tr in trains.items()})
    torch.save(job, tmp / "job.pt")
    script = Path(__file__).with_name("megatron_worker.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1", "--master-port",
           str(free_port()), str(script), str(tmp / "job.pt"), str(tmp / "out.pt")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, cwd=tmp)
    assert proc.returncode == 0, f"megatron worker failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-8000:]}"
    return refs, torch.load(tmp / "out.pt", weights_only=False)


def max_diff(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b)
    return max((a[k] - b[k]).abs().max().item() for k in a)
