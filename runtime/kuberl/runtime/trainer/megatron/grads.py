"""Gradient reductions and the clipped global grad norm of the Megatron backend (what megatron's DDP wrapper,
finalize_model_grads and its chained optimizer do, for a model trained without them).

Who sums what (every rank's loss is its share of the minibatch sum, so every reduction is a sum):

* dense (non-expert) parameters, the MoE router included: over the data-parallel x context-parallel group
  (megatron's `get_data_parallel_group(with_context_parallel=True)`): CP ranks hold the same parameters and
  each back-propagates through its own positions only (context.py);
* expert parameters (`...mlp.experts.local_experts.J...`): over the expert-data-parallel group, the ranks that
  hold the same experts. An expert already received the tokens of every rank of its tensor x expert group
  (the token dispatcher's all-gather; the backward of the combine's reduce-scatter brings their gradients
  back), so summing it over the whole data-parallel group would add other experts' gradients into it under
  expert parallelism (and count its own tokens ep_size times);
* Qwen3's q/k-norm weights: over the TP group (replicated weights that see different heads);
* a tied embedding's two copies under pipeline parallelism: over the embedding group.

The norm is megatron's: dense parameters over the model-parallel group (tensor x pipeline; CP ranks hold the
same summed gradients, so not over context parallel) with its
duplicate filters, expert parameters over the expert tensor x model x pipeline group (each EP rank holds
different experts), total = sqrt(dense^2 + experts^2), as megatron's ChainedOptimizer combines its dense
and expert optimizers' norms.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from kuberl.runtime.trainer.megatron import convert_moe


def _expert_params(module: torch.nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(dense, expert) parameters of this rank's module."""
    dense, experts = [], []
    for name, p in module.named_parameters():
        (experts if convert_moe.is_expert(name) else dense).append(p)
    return dense, experts


def reduce_grads(mm: Any) -> None:
    """Sum the gradients as the module docstring says (collective over every group involved)."""
    from megatron.core import parallel_state as ps

    if mm.shape.qk_norm and ps.get_tensor_model_parallel_world_size() > 1:
        for name, p in mm.module.named_parameters():
            if ("q_layernorm" in name or "k_layernorm" in name) and p.grad is not None:
                dist.all_reduce(p.grad, group=ps.get_tensor_model_parallel_group())

    if mm.shape.tied and ps.get_pipeline_model_parallel_world_size() > 1 and ps.is_rank_in_embedding_group():
        p = mm.module.shared_embedding_or_output_weight()
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad, group=ps.get_embedding_group())
    dense, experts = _expert_params(mm.module)
    for p in experts:  # an expert no token reached: a zero gradient (as HF's fused expert tensors get), and the collectives line up
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    if ps.get_data_parallel_world_size(with_context_parallel=True) > 1:
        for p in dense:
            if p.grad is not None:
                dist.all_reduce(p.grad, group=ps.get_data_parallel_group(with_context_parallel=True))
    if experts and ps.get_expert_data_parallel_world_size() > 1:
        for p in experts:
            if p.grad is not None:
                dist.all_reduce(p.grad, group=ps.get_expert_data_parallel_group())


def grad_norm_and_clip(mm: Any, max_norm: float | None) -> float:
    """Total L2 grad norm over every shard of the model (TP, PP and EP), each parameter counted once, then clip.

    megatron's get_grad_norm_fp32 with its own filters: TP-replicated parameters (norms) count on TP rank 0
    only, the last stage's copy of a tied embedding not at all. Clipping scales every gradient by
    max_norm / (norm + 1e-6) when below 1, as torch's clip_grad_norm_.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.optimizer.clip_grads import get_grad_norm_fp32
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
    from megatron.core.transformer.module import param_is_not_shared

    dense, experts = _expert_params(mm.module)

    def counted(params: list[torch.Tensor]) -> list[torch.Tensor]:
        return [p.grad for p in params if p.grad is not None and param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p)]

    with mm.compat():
        norm = float(get_grad_norm_fp32(counted(dense), norm_type=2, grad_stats_parallel_group=ps.get_model_parallel_group()))
        if mm.shape.moe is not None:  # every rank joins (a pipeline stage of only dense layers adds 0)
            e = float(get_grad_norm_fp32(counted(experts), norm_type=2,
                                         grad_stats_parallel_group=ps.get_expert_tensor_model_pipeline_parallel_group()))
            norm = math.sqrt(norm * norm + e * e)
    if max_norm is not None and max_norm > 0:
        coeff = max_norm / (norm + 1e-6)
        if coeff < 1.0:
            for p in dense + experts:
                if p.grad is not None:
                    p.grad.mul_(coeff)
    return norm
