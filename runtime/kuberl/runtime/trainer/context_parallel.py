"""Context (sequence) parallel for the FSDP trainer, DeepSpeed-Ulysses style (trainer.parallelism.context).

The world is dp x cp ranks: consecutive ranks form a CP group (rank // cp = data-parallel replica, rank % cp = CP
rank). FSDP2 still shards over the whole world; rows are dealt to the dp replicas, so every rank of a CP group runs
the same micro-batches, each feeding a contiguous 1/cp slice of every packed row (padding-free packing,
packing.packed_layout) with that slice's GLOBAL position_ids (so RoPE is right).

Attention (`ulysses_attention`, registered with transformers' AttentionInterface as ATTN_NAME): q/k/v [B, H, S/cp, D]
go through an all-to-all to [B, H/cp, S, D] (all positions, a 1/cp share of the heads), sdpa runs with the
block-diagonal causal mask of the FULL rows (built from their position_ids, which the caller stashes with
`set_positions` before the forward), and a second all-to-all brings [B, H, S/cp, D] back. Both all-to-alls are
autograd functions (the backward of an equal-split all-to-all is the same all-to-all), so gradients flow back.

The LM head runs only at the scored positions of the rank's slice. The per-token log-probs [rows, width] are then
summed over the CP group (`gather_tokens`: each entry computed by exactly one CP rank) so that every CP rank of a
replica computes the same, whole loss (sequence-level ratios and aggregations see whole sequences); its backward
keeps the gradient of the entries this rank computed only, so the sum of the CP ranks' parameter gradients is the
replica's gradient and FSDP's average over the world times world_size is the minibatch's (compute.py's rule).
Statistics are counted on CP rank 0 only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from kuberl.runtime.errors import ConfigError
from kuberl.runtime.trainer.packing import packed_layout, scored_logits

ATTN_NAME = "kuberl_ulysses"


@dataclass(frozen=True)
class ContextParallel:
    """This rank's place in the dp x cp layout; `group` holds the ranks of its CP group."""

    size: int
    rank: int  # within the CP group
    dp_rank: int
    dp_size: int
    group: Any = None

    @property
    def lead(self) -> bool:
        """CP rank 0: the rank of its group that reports statistics and fills rows that are summed over the world."""
        return self.rank == 0


def setup_context_parallel(rank: int, world: int, size: int) -> ContextParallel | None:
    """The CP groups (every rank must call: new_group is collective); None when size is 1."""
    if size == 1:
        return None
    if size < 1 or world % size:
        raise ConfigError(f"trainer.parallelism.context {size} must divide the trainer's world size {world} (nodes * accelerator.count)")
    group = None
    for d in range(world // size):
        ranks = list(range(d * size, (d + 1) * size))
        g = dist.new_group(ranks)
        if rank in ranks:
            group = g
    return ContextParallel(size=size, rank=rank % size, dp_rank=rank // size, dp_size=world // size, group=group)


def check_model(config: Any, size: int) -> None:
    """Ulysses cuts the attention heads over the CP ranks: both head counts must divide by `size`; no sliding window."""
    heads = getattr(config, "num_attention_heads", None)
    kv = getattr(config, "num_key_value_heads", None) or heads
    if not heads or heads % size or kv % size:
        raise ConfigError(f"trainer.parallelism.context {size} must divide the model's attention heads (num_attention_heads {heads}, "
                          f"num_key_value_heads {kv}): Ulysses context parallel gives each CP rank a 1/{size} share of both")
    if getattr(config, "use_sliding_window", False) and getattr(config, "sliding_window", None):
        raise ConfigError(f"trainer.parallelism.context {size}: the model uses sliding-window attention, which context parallel does not "
                          "implement (use context 1)")


def enable(model: torch.nn.Module, cp: ContextParallel) -> torch.nn.Module:
    """Check the model and switch its attention to `ulysses_attention` (before FSDP wrapping, or on a PEFT model's base)."""
    from transformers import AttentionInterface

    check_model(model.config, cp.size)
    AttentionInterface.register(ATTN_NAME, ulysses_attention)
    model.set_attn_implementation(ATTN_NAME)
    _STATE["cp"] = cp
    return model


# The CP layout and the current micro-batch's full-row sequence ids / mask: set before each forward and kept until the
# next one, so gradient checkpointing's recomputation in the backward sees the same rows.
_STATE: dict[str, Any] = {}


def set_positions(pos: torch.Tensor, cp: ContextParallel) -> None:
    """Stash the full rows' position_ids [R, S] (on the compute device) for the attention of the next forward."""
    first = pos[:, :1] - 1
    seq = (torch.diff(pos, prepend=first, dim=-1) != 1).cumsum(-1)  # a new sequence wherever positions do not continue
    S = pos.shape[1]
    causal = torch.ones(S, S, dtype=torch.bool, device=pos.device).tril()
    _STATE.update(cp=cp, mask=((seq[:, :, None] == seq[:, None, :]) & causal)[:, None])  # [R, 1, S, S], True = attend


class _AllToAll(torch.autograd.Function):
    """Equal-split all-to-all over dim 0; its adjoint is the same all-to-all."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous()  # first: empty_like keeps a permuted tensor's strides, the collective writes row-major
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


def seq_to_heads(x: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
    """[B, H, S/cp, D] (this rank's positions, all heads) -> [B, H/cp, S, D] (all positions, this rank's heads)."""
    B, H, s, D = x.shape
    y = _AllToAll.apply(x.reshape(B, cp.size, H // cp.size, s, D).transpose(0, 1), cp.group)  # [cp: head chunk to send, ...]
    return y.permute(1, 2, 0, 3, 4).reshape(B, H // cp.size, cp.size * s, D)  # received [cp: sequence chunk, ...]


def heads_to_seq(x: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
    """[B, H/cp, S, D] -> [B, H, S/cp, D]: the inverse of seq_to_heads."""
    B, h, S, D = x.shape
    y = _AllToAll.apply(x.reshape(B, h, cp.size, S // cp.size, D).permute(2, 0, 1, 3, 4), cp.group)  # [cp: sequence chunk to send, ...]
    return y.transpose(0, 1).reshape(B, cp.size * h, S // cp.size, D)  # received [cp: head chunk, ...]


def ulysses_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                      dropout: float = 0.0, scaling: float | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers attention function (AttentionInterface): sdpa over the full rows on 1/cp of the heads.

    attention_mask is ignored (transformers builds none for a registered function without a mask interface): the
    mask of the full rows comes from set_positions."""
    cp, mask = _STATE.get("cp"), _STATE.get("mask")
    if cp is None or mask is None or mask.shape[-1] != query.shape[2] * cp.size:
        raise RuntimeError("context parallel attention without the full rows' positions: call context_parallel.set_positions first")
    if kwargs.get("sliding_window"):
        raise RuntimeError("context parallel attention does not implement sliding windows")
    q, k, v = (seq_to_heads(t, cp) for t in (query, key, value))
    if k.shape[1] != q.shape[1]:  # GQA: each kv head serves H/Hkv query heads, in order (transformers' repeat_kv)
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scaling)
    return heads_to_seq(out, cp).transpose(1, 2).contiguous(), None  # [B, S/cp, H, D], as sdpa_attention_forward returns


def cp_packed_logits(model, prompts, outputs, width, device, pad_id, cp: ContextParallel):
    """packing.packed_logits under context parallel: this CP rank's slice of the packed rows, logits only at the scored
    positions inside it. Returns (logits [K, V], rows [K], cols [K], targets [K]) of those positions (K may be 0)."""
    lay = packed_layout(prompts, outputs, width, pad_id, varlen=False)
    R, S = lay.ids.shape
    Sp = math.ceil(S / cp.size) * cp.size
    ids = torch.cat([lay.ids, torch.full((R, Sp - S), pad_id, dtype=torch.long)], dim=1)
    pos = torch.cat([lay.pos, torch.arange(Sp - S, dtype=torch.long).expand(R, -1)], dim=1)  # padding: a sequence of its own
    s = Sp // cp.size
    c0 = cp.rank * s
    r, c = lay.flat // S, lay.flat % S
    local = (c >= c0) & (c < c0 + s)
    set_positions(pos.to(device), cp)
    logits = scored_logits(model, ids[:, c0:c0 + s], pos[:, c0:c0 + s], r[local] * s + (c[local] - c0), device)
    return logits, lay.rows[local], lay.cols[local], lay.targets[local].to(device)


class _GatherTokens(torch.autograd.Function):
    """Sum over the CP group of [rows, width] tensors that are zero except where this rank computed them. The backward
    is the identity, not an all-reduce (as torch.distributed.nn's all_reduce would do): every CP rank computes the same
    loss of the sum, so each already holds the whole gradient; and since this rank's tensor was scattered into zeros
    (index_put), only its own entries' gradient reaches its graph."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def gather_tokens(x: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
    """Every CP rank's entries of x [rows, width] (zero where another CP rank computes them) on every CP rank."""
    return _GatherTokens.apply(x, cp.group)
