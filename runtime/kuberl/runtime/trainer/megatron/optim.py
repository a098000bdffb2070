"""The Megatron backend's optimizer, as Megatron-LM's training loop builds it: megatron-core's DDP wrapper and its
distributed optimizer, with float32 master weights when the model computes in bfloat16 or float16.

    mm = build_model(model_dir, device=device, dtype=torch.bfloat16)   # model.py: parameters in bf16
    opt = build_optimizer(mm, spec.algorithm)                         # Float16Module + DDP, mm.ddp set
    sched = MegatronLR(opt, spec.algorithm.optimizer, total_steps)
    stats = train_step(mm, opt, ...)                                  # model.py: DDP buffers, opt.step() clips

* Mixed precision: `Float16Module` runs the GPTModel in bf16/fp16 (logits come back in float32); the optimizer
  (megatron's MixedPrecisionOptimizer) keeps a float32 main copy of every parameter, steps Adam on it and copies
  the result back to the bf16 parameters; gradients reduce in float32 (`grad_reduce_in_fp32`). float16 adds
  megatron's dynamic loss scaling (`config.grad_scale_func`).
* Distributed optimizer (`use_distributed_optimizer`, ZeRO-1): gradients are reduce-scattered over the
  data-parallel (x context-parallel) group, each DP rank holds and steps the main weights and Adam moments of
  its 1/dp slice of the flattened parameters, then the updated parameters are all-gathered. Expert parameters
  the same over the expert-data-parallel group (a second, chained optimizer). At data parallel 1 the slice is
  everything. megatron-core shards Adam only: algorithm.optimizer.type sgd gets its non-distributed optimizer
  (every DP rank the whole state, gradients all-reduced). Every rank's loss is its share of the minibatch sum, and DDP multiplies gradients by 1/dp before
  its sum (`average_in_collective` off): train_step scales the loss by dp to keep the sum.
* Weight decay applies to every parameter (config_overrides={}), as the FSDP path's torch optimizer does
  (megatron's default would exempt biases and norms). adamw: decoupled decay (torch AdamW), adam: L2 (torch Adam).
* Checkpoints (`save_shard` / `load_shards`): each rank writes its own slice of every parameter's main weight and
  optimizer moments with the slice's position in the flattened parameter, so a run resumes at another data-parallel
  size (the same tensor, pipeline and expert sizes) by copying the overlapping ranges; nothing is gathered. The
  non-distributed optimizer (sgd) writes its whole state from data-parallel replica 0, which any DP size loads.
"""

from __future__ import annotations

import glob
import logging
from pathlib import Path
from typing import Any

import torch

from kuberl.runtime.trainer.optim import lr_factor

log = logging.getLogger("kuberl.trainer")

OPTIM_FILE = "optimizer-megatron-rank{rank}.pt"  # not megatron-*.pt: the model shards (consolidate.shard_file)


def build_optimizer(mm: Any, algorithm: Any) -> Any:
    """Wrap mm's GPTModel (Float16Module when its parameters are bf16/fp16, then DDP: mm.ddp) and return megatron's
    (chained) distributed optimizer over it, from spec.algorithm (lr, optimizer type, betas, eps, weight decay, grad clip)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    o = algorithm.optimizer
    if o.type not in ("adamw", "adam", "sgd"):
        raise ValueError(f"algorithm.optimizer.type: {o.type!r} is not adamw, adam or sgd")
    config = mm.module.config
    dtype = next(mm.module.parameters()).dtype
    sharded = distributed(algorithm)
    half = dtype in (torch.bfloat16, torch.float16)
    with mm.compat():
        inner = Float16Module(config, mm.module) if half else mm.module
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=sharded, overlap_grad_reduce=False,
                                                   overlap_param_gather=False)
        mm.ddp = DistributedDataParallel(config, ddp_config, inner)
        oc = OptimizerConfig(optimizer="sgd" if o.type == "sgd" else "adam", lr=algorithm.learning_rate, weight_decay=o.weight_decay,
                             adam_beta1=o.beta1, adam_beta2=o.beta2, adam_eps=o.eps, sgd_momentum=o.beta1,
                             decoupled_weight_decay=o.type != "adam", bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
                             params_dtype=dtype, use_distributed_optimizer=sharded, clip_grad=float(o.grad_clip or 0.0))
        opt = get_megatron_optimizer(oc, [mm.ddp], config_overrides={})
    config.grad_scale_func = opt.scale_loss  # the schedule scales each micro-batch loss (float16's loss scale; 1 otherwise)
    return opt


def distributed(algorithm: Any) -> bool:
    """Whether megatron-core shards this optimizer over the data-parallel ranks: Adam and AdamW (its DistributedOptimizer
    refuses any other, 'due to checkpointing requirements')."""
    return algorithm.optimizer.type != "sgd"


def inner_optimizers(opt: Any) -> list[Any]:
    """megatron's per-group optimizers (dense, then experts) under a ChainedOptimizer, or [opt]."""
    return list(getattr(opt, "chained_optimizers", [opt]))


def master_dtypes(opt: Any) -> set[torch.dtype]:
    """The dtypes of the weights the optimizer steps (float32 main copies under mixed precision)."""
    return {p.dtype for o in inner_optimizers(opt) for g in o.optimizer.param_groups for p in g["params"]}


class MegatronLR:
    """The trainer's learning-rate schedule (optim.lr_factor) on megatron's optimizer: a torch LambdaLR on each inner
    torch optimizer (LambdaLR takes torch optimizers only), stepped together. The interface Trainer uses of LambdaLR."""

    def __init__(self, opt: Any, spec: Any, total_optimizer_steps: int):
        lr_factor(0, total_optimizer_steps, spec)  # fail now on a bad schedule name
        self.schedules = [torch.optim.lr_scheduler.LambdaLR(o.optimizer, lambda s: lr_factor(s, total_optimizer_steps, spec))
                          for o in inner_optimizers(opt)]

    def step(self) -> None:
        for s in self.schedules:
            s.step()

    def get_last_lr(self) -> list[float]:
        return self.schedules[0].get_last_lr()

    def state_dict(self) -> dict:
        return self.schedules[0].state_dict()

    def load_state_dict(self, state: dict) -> None:
        for s in self.schedules:
            s.load_state_dict(state)


def _named(mm: Any) -> dict[Any, str]:
    """Parameter -> its name in mm.module (the GPTModel's own names, the same on every DP replica)."""
    return {p: n for n, p in mm.module.named_parameters()}


def _slices(opt: Any, mm: Any) -> dict[str, dict[str, Any]]:
    """This rank's slice of every parameter: name -> start, end (in the flattened parameter), the main weight and the
    optimizer's per-parameter state (Adam's moments and step), as CPU tensors."""
    names, out = _named(mm), {}
    for o in inner_optimizers(opt):
        for param in o.model_param_group_index_map:
            rng = o._get_model_param_range_map(param)["param"]
            tensors = o._get_main_param_and_optimizer_states(param)
            out[names[param]] = {"start": rng.start, "end": rng.end,
                                 **{k: v.detach().cpu().clone() for k, v in tensors.items() if isinstance(v, torch.Tensor)}}
    return out


def _sharded(opt: Any) -> bool:
    return all(hasattr(o, "model_param_group_index_map") for o in inner_optimizers(opt))  # DistributedOptimizer's


def save_shard(opt: Any, mm: Any, folder: Path, rank: int, coords: tuple[int, ...], replica0: bool) -> None:
    """This rank's optimizer file in checkpoint `folder`: its parameter slices (_slices), the optimizer's param groups
    and step (megatron's state_dict, the same on every rank) and `coords` (tensor, pipeline, expert rank). A
    non-distributed optimizer's whole state instead, written only where `replica0` (DP replicas hold the same)."""
    from kuberl.runtime.trainer import checkpoint as ck

    if _sharded(opt):
        ck.write_torch(folder, OPTIM_FILE.format(rank=rank), {"coords": list(coords), "groups": opt.state_dict(), "slices": _slices(opt, mm)})
    elif replica0:
        ck.write_torch(folder, OPTIM_FILE.format(rank=rank), {"coords": list(coords), "whole": opt.state_dict()})


@torch.no_grad()
def load_shards(opt: Any, mm: Any, folder: Path, coords: tuple[int, ...]) -> None:
    """Restore this rank's slices from every optimizer file of checkpoint `folder` written at `coords` (tensor, pipeline,
    expert rank), at any data-parallel size: each saved slice fills the part of this rank's slice it overlaps.
    ValueError when a parameter's slice is not covered whole (a checkpoint of another model or layout)."""
    files = sorted(glob.glob(str(Path(folder) / OPTIM_FILE.format(rank="*"))))
    saved = [s for s in (torch.load(f, map_location="cpu", weights_only=False, mmap=True) for f in files) if tuple(s["coords"]) == tuple(coords)]
    if not saved:
        raise ValueError(f"{folder}: no {OPTIM_FILE.format(rank='*')} written at tensor/pipeline/expert rank {coords}")
    if _sharded(opt) != ("slices" in saved[0]):
        raise ValueError(f"{folder}: its optimizer state was written by a {'non-' if 'whole' in saved[0] else ''}distributed optimizer; "
                         "resume with the same algorithm.optimizer.type")
    if "whole" in saved[0]:
        opt.load_state_dict(saved[0]["whole"])
        return
    opt.load_state_dict(saved[0]["groups"])  # param groups and step; allocates the state megatron fills below
    for o in inner_optimizers(opt):
        for st in o.optimizer.state.values():  # megatron 0.16 gives every parameter ONE step tensor (torch Adam would
            if isinstance(st.get("step"), torch.Tensor):  # then count a step once per parameter): each its own
                st["step"] = st["step"].clone()
    names = _named(mm)
    for o in inner_optimizers(opt):
        for param in o.model_param_group_index_map:
            name, rng = names[param], o._get_model_param_range_map(param)["param"]
            target = {k: v.detach().clone() for k, v in o._get_main_param_and_optimizer_states(param).items()}
            covered = 0
            for s in saved:
                piece = s["slices"].get(name)
                if piece is None:
                    continue
                lo, hi = max(rng.start, piece["start"]), min(rng.end, piece["end"])
                if lo >= hi:
                    continue
                for key, t in target.items():
                    if t.dim() == 0:  # Adam's step: the same in every slice
                        t.copy_(piece[key])
                    else:
                        t[lo - rng.start: hi - rng.start].copy_(piece[key][lo - piece["start"]: hi - piece["start"]])
                covered += hi - lo
            if covered != rng.end - rng.start:
                raise ValueError(f"{folder}: optimizer state of {name}[{rng.start}:{rng.end}] covered {covered} of {rng.end - rng.start} elements")
            o._set_main_param_and_optimizer_states(param, target)
    for o in inner_optimizers(opt):  # this rank's slice of the model's parameters from the restored main weights
        o._copy_main_params_to_model_params()
