"""Context parallel for the Megatron backend without Transformer Engine: each CP rank holds part of every sequence.

megatron-core's context parallel is Transformer Engine's attention (the local `DotProductAttention` asserts
`context_parallel_size == 1`, transformer/dot_product_attention.py:57). This module gives the layer spec a
core attention of its own and keeps everything else megatron's:

* Layout (megatron's, load balanced): a sequence of S positions (S a multiple of 2 cp) is cut into 2 cp chunks
  and CP rank r holds chunks r and 2 cp - 1 - r, in that order (`utils.get_batch_on_this_cp_rank`,
  utils.py:1994). megatron's RoPE slices its table the same way (`get_pos_emb_on_this_cp_rank`,
  models/common/embeddings/rope_utils.py:48, called from rotary_pos_embedding.py:204 on a table of
  S = local length x cp positions, rotary_pos_embedding.py:253), so following the layout makes the
  rotary positions right without touching RoPE. `positions` is the one place that knows the layout.
* Attention (`ContextParallelAttention`): each rank all-gathers K and V over the CP group (megatron's
  `gather_from_sequence_parallel_region`: all-gather forward, reduce-scatter backward, so every rank's
  keys get the gradients of every rank's queries), puts them in sequence order and attends its local
  queries to the whole sequence with the causal mask's rows at the queries' global positions (the model's
  attention mask is the full [1, 1, S, S] one, its query rows sliced by `split_rows`). Exact: the same
  softmax as one process, at the cost of K/V for the whole sequence on every rank (no ring, no overlap).
* Log-probs: each rank scores the output tokens predicted at its own positions; `cp_sum` adds the ranks'
  [rows, width] tensors (all-reduce forward, identity backward: every CP rank then computes the same loss
  from the same full tensor and back-propagates it through its own positions only), so the loss and its
  statistics are the whole rows' on every CP rank. megatron's schedule multiplies a two-output loss by the
  CP size (pipeline_parallel/schedules.py:268, its convention for a DP x CP gradient *average*); the train
  step divides it back out, and grads.py *sums* gradients over data x context parallel.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist


def cp_size() -> int:
    from megatron.core import parallel_state as ps

    return ps.get_context_parallel_world_size()


def positions(seq_len: int, size: int, rank: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Global positions held by CP rank `rank`, in its local order: chunks rank and 2 size - 1 - rank of 2 size."""
    if seq_len % (2 * size):
        raise ValueError(f"context parallel: sequence length {seq_len} is not a multiple of 2 x {size}")
    n = seq_len // (2 * size)
    chunks = [rank, 2 * size - 1 - rank]
    return torch.cat([torch.arange(c * n, (c + 1) * n, device=device) for c in chunks])


def local_positions(seq_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """This rank's global positions (all of them without context parallel)."""
    from megatron.core import parallel_state as ps

    size = cp_size()
    if size == 1:
        return torch.arange(seq_len, device=device)
    return positions(seq_len, size, ps.get_context_parallel_rank(), device)


def split_rows(input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """This CP rank's share of a micro-batch: its positions of the [R, S] inputs and the causal mask's rows at
    those positions ([1, 1, S/cp, S], keys in sequence order)."""
    if cp_size() == 1:
        return input_ids, position_ids, attention_mask
    pos = local_positions(input_ids.shape[1], input_ids.device)
    return input_ids[:, pos], position_ids[:, pos], attention_mask[:, :, pos, :]


def local_columns(col: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(index into this rank's positions, held here) for global sequence positions `col`."""
    pos = local_positions(seq_len, col.device)
    where = torch.full((seq_len,), -1, dtype=torch.long, device=col.device)
    where[pos] = torch.arange(pos.numel(), device=col.device)
    idx = where[col]
    return idx.clamp(min=0), idx >= 0


class _SumOverContext(torch.autograd.Function):
    """All-reduce (sum) over the CP group forward, identity backward (every CP rank computes the same loss from the sum)."""

    @staticmethod
    def forward(ctx, x):
        from megatron.core import parallel_state as ps

        x = x.clone()
        dist.all_reduce(x, group=ps.get_context_parallel_group())
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad


def cp_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum of the CP ranks' tensors (each holds its positions' values, zeros elsewhere); differentiable."""
    if cp_size() == 1:
        return x
    if not x.requires_grad:
        from megatron.core import parallel_state as ps

        x = x.clone()
        dist.all_reduce(x, group=ps.get_context_parallel_group())
        return x
    return _SumOverContext.apply(x)


_ATTENTION: Any = None


def attention_class() -> type:
    """ContextParallelAttention (a DotProductAttention subclass, made on first use: megatron is imported lazily)."""
    global _ATTENTION
    if _ATTENTION is not None:
        return _ATTENTION
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class ContextParallelAttention(DotProductAttention):
        """megatron's local DotProductAttention over the whole sequence's keys and values, for this CP rank's queries.

        Same constructor and forward signature as DotProductAttention (the `core_attention` submodule of
        SelfAttention). Inputs: query [S/cp, b, np, hn], key/value [S/cp, b, ng, hn] at this rank's positions
        (`positions`), attention_mask [1, 1, S/cp, S] (`split_rows`). Output [S/cp, b, np * hn].
        """

        def __init__(self, config: Any, *args: Any, **kwargs: Any):
            kwargs.pop("cp_comm_type", None)  # megatron passes it for TE's ring/all-to-all variants: this module all-gathers
            local = copy.copy(config)
            local.context_parallel_size = 1  # DotProductAttention asserts it; the CP work is in forward
            super().__init__(local, *args, **kwargs)
            self.cp_config = config

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None):
            from megatron.core import parallel_state as ps
            from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

            size = ps.get_context_parallel_world_size()
            if size > 1:
                if packed_seq_params is not None:
                    raise ValueError("ContextParallelAttention: packed sequences (THD) are not supported; use the padded layout")
                group = ps.get_context_parallel_group()
                local = query.shape[0]
                seq = local * size
                # gathered in rank order (rank 0's positions, rank 1's, ...) -> sequence order
                order = torch.cat([positions(seq, size, r, query.device) for r in range(size)])
                inverse = torch.empty_like(order)
                inverse[order] = torch.arange(seq, device=query.device)
                key = gather_from_sequence_parallel_region(key.contiguous(), group=group)[inverse]
                value = gather_from_sequence_parallel_region(value.contiguous(), group=group)[inverse]
                if attention_mask is None or attention_mask.shape[-2:] != (local, seq):
                    raise ValueError(f"ContextParallelAttention: the attention mask must be [.., {local}, {seq}] (context.split_rows), got "
                                     f"{None if attention_mask is None else tuple(attention_mask.shape)}")
            return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type, attention_bias=attention_bias,
                                   packed_seq_params=packed_seq_params)

    _ATTENTION = ContextParallelAttention
    return _ATTENTION
