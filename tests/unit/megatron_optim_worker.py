"""Worker of test_megatron_optim.py: the Megatron backend's optimizer paths on CPU ranks over gloo (tiny Qwen3, q/k norms).

    python -m torch.distributed.run --nproc-per-node 2 megatron_optim_worker.py train DIR   # data parallel 2
    python -m torch.distributed.run --nproc-per-node 1 megatron_optim_worker.py resume DIR  # data parallel 1

train: (a) one step through megatron's DDP + distributed optimizer against the plain path (torch AdamW, grads.py sums
and clips) from the same weights; (b) three steps with a checkpoint after two (optim.save_shard), the weights after the
third and the streamed digest (digest.StreamedHF) beside the digest of the whole gathered state; (c) the gradients with
and without recomputation, and how often a layer's forward ran; (d) a bf16 model: parameter and main-weight dtypes, and
its first update against the float32 one. resume: load the checkpoint at data parallel 1 and run the third step there.
Rank 0 writes what it found to DIR/<mode>.pt.
"""

from __future__ import annotations

import datetime
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "megatron_backend"))

ALGO = dict(name="grpo", kl_coef=0.05, learning_rate=1e-3,
            optimizer=dict(type="adamw", beta1=0.9, beta2=0.99, eps=1e-3, weight_decay=0.01, grad_clip=1.0))
WIDTH = 8


def data(step: int) -> list:
    """Two micro-batches of 3 rows (the same on every rank): prompts, outputs and per-token tensors; `step` seeds them."""
    from kuberl.runtime.trainer.megatron.model import MicroBatch

    g = torch.Generator().manual_seed(100 + step)
    mbs = []
    for _ in range(2):
        prompts = [torch.randint(0, 128, (int(n),), generator=g).tolist() for n in (3, 5, 2)]
        outputs = [torch.randint(0, 128, (int(n),), generator=g).tolist() for n in (6, 8, 4)]
        mask = torch.zeros(3, WIDTH)
        for i, o in enumerate(outputs):
            mask[i, : len(o)] = 1.0
        base = -2.0 + 0.3 * torch.randn(3, WIDTH, generator=g)
        mbs.append(MicroBatch(prompts=prompts, outputs=outputs, loss_mask=mask, behave_logp=base + 0.1 * torch.randn(3, WIDTH, generator=g),
                              advantages=torch.randn(3, WIDTH, generator=g), prox_logp=base, ref_logp=base + 0.2 * torch.randn(3, WIDTH, generator=g)))
    return mbs


def step(mm, opt, cfg, k: int) -> dict:
    """Train step k: each data-parallel rank its share of the two micro-batches; the denominator is both's."""
    from megatron.core import parallel_state as ps

    from kuberl.runtime.algorithms import loss_denominator
    from kuberl.runtime.trainer.megatron.model import train_step

    mbs = data(k)
    denom = loss_denominator(torch.cat([m.loss_mask for m in mbs]), cfg)
    dp = ps.get_data_parallel_world_size()
    return train_step(mm, opt, mbs[ps.get_data_parallel_rank()::dp], cfg, denominator=denom, temperature=0.7, grad_clip=1.0)


def hf(mm) -> dict:
    from kuberl.runtime.trainer.megatron.model import gather_hf_state

    return gather_hf_state(mm)


def torch_adamw(mm, spec):
    o = spec.optimizer
    return torch.optim.AdamW(mm.module.parameters(), lr=spec.learning_rate, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay)


def layer_calls(mm) -> list[int]:
    """A counter of decoder layer 0's forward calls (a recomputed layer runs again in the backward)."""
    calls = [0]
    mm.module.decoder.layers[0].register_forward_hook(lambda *a: calls.__setitem__(0, calls[0] + 1))
    return calls


def grads_of(mm, cfg) -> dict:
    """One step's clipped gradients (HF names) on the plain path, read just before the optimizer steps."""
    from kuberl.runtime.trainer.megatron.model import gather_hf_state

    seen = {}

    class Recording(torch.optim.SGD):
        def step(self, closure=None):
            seen.update(gather_hf_state(mm, grads=True))

    step(mm, Recording(mm.module.parameters(), lr=0.0), cfg, 0)
    return seen


def train(out_dir: Path, model_dir: str, cfg, spec) -> dict:
    from kuberl.runtime.trainer.megatron import convert
    from kuberl.runtime.trainer.megatron.digest import StreamedHF
    from kuberl.runtime.trainer.megatron.model import RECOMPUTE, build_model
    from kuberl.runtime.trainer.megatron.optim import build_optimizer, master_dtypes, save_shard
    from kuberl.runtime.trainer.weights import digest_state

    rec: dict = {}
    plain = build_model(model_dir)
    rec["plain_norm"] = step(plain, torch_adamw(plain, spec), cfg, 0)["grad_norm"]
    rec["plain_after"] = hf(plain)
    mm = build_model(model_dir)
    opt = build_optimizer(mm, spec)
    rec["dist_norm"] = step(mm, opt, cfg, 0)["grad_norm"]
    rec["dist_after"] = hf(mm)
    rec["shard_sizes"] = [sum(p.numel() for g in o.optimizer.param_groups for p in g["params"]) for o in opt.chained_optimizers]
    rec["model_size"] = sum(p.numel() for p in mm.module.parameters())
    step(mm, opt, cfg, 1)
    rec["second_after"] = hf(mm)
    ck = out_dir / "ckpt"
    ck.mkdir(exist_ok=True)
    if dist.get_rank() == 0:
        torch.save(mm.module.state_dict(), ck / "model.pt")
    save_shard(opt, mm, ck, dist.get_rank(), (0, 0, 0), replica0=dist.get_rank() == 0)
    dist.barrier()
    step(mm, opt, cfg, 2)
    rec["third_after"] = hf(mm)
    whole = hf(mm)
    rec["digest_whole"] = digest_state(whole)
    backend = _Backend(mm)
    rec["digest_streamed"] = digest_state(StreamedHF(mm, backend.plan(), convert.megatron_names(dict(mm.module.named_parameters()), te=False),
                                                     backend.tp_full, backend.ep_parts, torch.device("cpu")))

    plain, again = build_model(model_dir), build_model(model_dir, **RECOMPUTE)
    rec["calls"] = (layer_calls(plain), layer_calls(again))
    rec["grads"], rec["grads_recomputed"] = grads_of(plain, cfg), grads_of(again, cfg)
    rec["calls"] = [c[0] for c in rec["calls"]]

    half = build_model(model_dir, dtype=torch.bfloat16)
    hopt = build_optimizer(half, spec)
    rec["bf16_param_dtypes"] = sorted({str(p.dtype) for p in half.module.parameters()})
    rec["bf16_master_dtypes"] = sorted(str(d) for d in master_dtypes(hopt))
    before_bf16 = {k: v.float() for k, v in hf(half).items()}
    rec["bf16_norm"] = step(half, hopt, cfg, 0)["grad_norm"]
    rec["bf16_update"] = {k: v.float() - before_bf16[k] for k, v in hf(half).items()}
    masters = [p for o in hopt.chained_optimizers for g in o.optimizer.param_groups for p in g["params"]]
    rec["bf16_master_numel"] = sum(p.numel() for p in masters)
    rec["bf16_params_are_rounded_masters"], rec["bf16_masters_finer"] = master_vs_params(hopt)
    rec.update(experts(out_dir, cfg, spec))
    return rec


def experts(out_dir: Path, cfg, spec) -> dict:
    """Expert parallel 2 (tiny Qwen3-MoE): megatron's chained optimizer (dense params sharded over DP 2, experts over
    their expert-DP group) steps as the plain path; the streamed digest gathers the experts over the EP group."""
    from megatron_models import tiny_model

    from kuberl.runtime.trainer.megatron import convert
    from kuberl.runtime.trainer.megatron.digest import StreamedHF
    from kuberl.runtime.trainer.megatron.model import build_model, init_parallel
    from kuberl.runtime.trainer.megatron.optim import build_optimizer
    from kuberl.runtime.trainer.weights import digest_state

    model_dir = str(out_dir / "qwen3-moe")
    if dist.get_rank() == 0:
        tiny_model("qwen3-moe").save_pretrained(model_dir)
    dist.barrier()
    init_parallel(1, 1, 2, device="cpu")
    plain, mm = build_model(model_dir), build_model(model_dir)
    rec = {"moe_plain_norm": step(plain, torch_adamw(plain, spec), cfg, 0)["grad_norm"], "moe_plain_after": hf(plain)}
    opt = build_optimizer(mm, spec)
    rec.update(moe_dist_norm=step(mm, opt, cfg, 0)["grad_norm"], moe_dist_after=hf(mm), moe_optimizers=len(opt.chained_optimizers))
    backend = _Backend(mm)
    rec["moe_digest_whole"] = digest_state(hf(mm))
    rec["moe_digest_streamed"] = digest_state(StreamedHF(mm, backend.plan(), convert.megatron_names(dict(mm.module.named_parameters()), te=False),
                                                         backend.tp_full, backend.ep_parts, torch.device("cpu")))
    return rec


def master_vs_params(opt) -> tuple[bool, bool]:
    """(every bf16 parameter slice equals its float32 main weight rounded to bf16, some main weight is not a bf16 value)."""
    rounded, finer = True, False
    for o in opt.chained_optimizers:
        for param in o.model_param_group_index_map:
            rng = o._get_model_param_range_map(param)["param"]
            main = o._get_main_param_and_optimizer_states(param)["param"]
            rounded &= bool(torch.equal(param.detach().view(-1)[rng.start: rng.end], main.to(torch.bfloat16)))
            finer |= bool((main != main.to(torch.bfloat16).float()).any())
    return rounded, finer


class _Backend:
    """The backend's publish-plan and gathers, borrowed from MegatronMixin for a bare MegatronModel."""

    def __init__(self, mm):
        from kuberl.runtime.trainer.megatron.backend import MegatronMixin

        self.mixin = MegatronMixin()
        self.mixin.mm = mm
        self.mixin.info = type("Info", (), {"device": torch.device("cpu")})()

    def plan(self):
        return self.mixin._publish_plan()

    def tp_full(self, name, param):
        return self.mixin._tp_full(name, param)

    def ep_parts(self, full):
        return self.mixin._ep_parts(full)


def resume(out_dir: Path, model_dir: str, cfg, spec) -> dict:
    from kuberl.runtime.trainer.megatron.model import build_model
    from kuberl.runtime.trainer.megatron.optim import build_optimizer, load_shards

    mm = build_model(model_dir)
    opt = build_optimizer(mm, spec)
    mm.module.load_state_dict(torch.load(out_dir / "ckpt" / "model.pt", weights_only=False))
    with mm.compat():
        load_shards(opt, mm, out_dir / "ckpt", (0, 0, 0))
    loaded = hf(mm)
    step(mm, opt, cfg, 2)
    return {"loaded": loaded, "third_after": hf(mm)}


def main() -> None:
    from megatron_models import tiny_model

    from kuberl.api.v1alpha1 import AlgorithmSpec
    from kuberl.runtime.algorithms import resolve_algorithm
    from kuberl.runtime.trainer.megatron.model import init_parallel

    mode, out_dir = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    torch.set_num_threads(1)
    model_dir = str(out_dir / "qwen3")
    if dist.get_rank() == 0 and not (out_dir / "qwen3").is_dir():
        tiny_model("qwen3").save_pretrained(model_dir)
    dist.barrier()
    init_parallel(1, 1, 1, device="cpu")
    spec = AlgorithmSpec(**ALGO)
    cfg = resolve_algorithm(spec)
    rec = (train if mode == "train" else resume)(out_dir, model_dir, cfg, spec)
    if dist.get_rank() == 0:
        torch.save(rec, out_dir / f"{mode}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
