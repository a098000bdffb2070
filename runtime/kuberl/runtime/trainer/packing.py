"""Padding-free packing (trainer.packing): a micro-batch's sequences back to back, position_ids restarting at 0.

No attention mask is passed: transformers (masking_utils.find_packed_sequence_indices, used by create_causal_mask)
reads the sequence boundaries from the position_ids and builds a block-diagonal causal mask for sdpa and eager;
with flash_attention_2/3 the same position_ids drive flash-attn's varlen kernel. Each sequence then sees exactly
the tokens it would see alone, at the same RoPE positions, so log-probs and gradients equal the padded path's.

Where the attention kernel is varlen (flash-attn) a micro-batch is ONE row: its cost is the real tokens. sdpa and
eager (CPU) compute a dense masked [S, S] attention, so one row of S = sum(lengths) would cost S^2; there the
sequences are packed into rows as long as the micro-batch's longest sequence (first-fit decreasing), which drops
the padding and keeps the attention cost of the padded layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

PACKING_MODES = ("auto", "on", "off")
VARLEN_ATTENTION = ("flash_attention_2", "flash_attention_3", "kernels-community/flash-attn", "kernels-community/flash-attn3")
# auto packs when the unpacked path feeds at least this many times the packed layout's token slots: on this CPU packed rows
# already beat padding at 1.12x the slots (bench/bench_packing.py: 16 vs 24 ms pi_prox, quickstart shapes), so a small margin.
AUTO_MIN_GAIN = 1.1


def varlen_attention(model: torch.nn.Module) -> bool:
    """Whether the model's attention kernel skips masked blocks (flash-attn varlen): then one packed row per micro-batch."""
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None) or ""
    return impl in VARLEN_ATTENTION


def pack_rows(lens: Sequence[int], capacity: int | None) -> list[list[int]]:
    """Indices of `lens` grouped into rows of at most `capacity` tokens (first-fit decreasing); None: one row of all.
    A length above the capacity gets a row of its own."""
    order = sorted(range(len(lens)), key=lambda i: -lens[i])
    if capacity is None:
        return [order] if order else []
    rows: list[list[int]] = []
    free: list[int] = []
    for i in order:
        for k, room in enumerate(free):
            if lens[i] <= room:
                rows[k].append(i)
                free[k] -= lens[i]
                break
        else:
            rows.append([i])
            free.append(capacity - lens[i])
    return rows


def is_fsdp(model: torch.nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return False
    return isinstance(model, FSDPModule)


def fsdp_root(model: torch.nn.Module) -> torch.nn.Module | None:
    """The outermost FSDP2 module: the model itself, or with LoRA the base model inside the PEFT wrapper (which is not
    an FSDP module itself); None when nothing is sharded."""
    return next((m for m in model.modules() if is_fsdp(m)), None)


def can_share_prompts(model: torch.nn.Module) -> bool:
    """Whether response_logprobs' shared-prompt path may run: it feeds the responses on the prompts' KV cache, which
    FSDP's hooks (one forward per backward) rule out, and so does gradient checkpointing in training mode
    (transformers then turns use_cache off and returns no cache)."""
    checkpointing = model.training and bool(getattr(model, "is_gradient_checkpointing", False))
    return fsdp_root(model) is None and not checkpointing  # a LoRA wrapper around FSDP2 too


def padded_slots(prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]], share_prompts: bool = True) -> int:
    """Token slots the unpacked path feeds: rows x longest sequence, or where rows share prompts (response_logprobs'
    shared-prompt path) each distinct prompt padded to the longest plus rows x longest response."""
    if not prompts:
        return 0
    padded = len(prompts) * max(len(p) + len(o) for p, o in zip(prompts, outputs))
    distinct = {tuple(p) for p in prompts}
    if share_prompts and len(distinct) < len(prompts):
        padded = min(padded, len(distinct) * max(len(p) for p in distinct) + len(prompts) * max(len(o) for o in outputs))
    return padded


def packed_slots(seq_lens: Sequence[int], varlen: bool) -> int:
    """Token slots the packed layout feeds: the real tokens (varlen), or rows of the longest x their count."""
    if varlen or not seq_lens:
        return sum(seq_lens)
    return len(pack_rows(seq_lens, max(seq_lens))) * max(seq_lens)


def use_packing(mode: str, prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]], model: torch.nn.Module) -> bool:
    """trainer.packing for one batch: on, off, or auto: pack when the unpacked path (padded, or shared-prompt where
    groups share a prompt and `can_share_prompts`) would feed AUTO_MIN_GAIN x the packed layout's token slots."""
    if mode not in PACKING_MODES:
        raise ValueError(f"trainer.packing must be one of {', '.join(PACKING_MODES)}, got {mode!r}")
    if mode != "auto":
        return mode == "on"
    packed = packed_slots([len(p) + len(o) for p, o in zip(prompts, outputs)], varlen_attention(model))
    return packed > 0 and padded_slots(prompts, outputs, share_prompts=can_share_prompts(model)) >= AUTO_MIN_GAIN * packed


@dataclass(frozen=True)
class PackedLayout:
    """Packed rows and where the scored tokens sit: ids/pos [R, S]; per scored token (K of them) its flat index r * S + column
    in the rows, its (row, column) in the [rows, width] layout and its target token."""

    ids: torch.Tensor
    pos: torch.Tensor
    flat: torch.Tensor
    rows: torch.Tensor
    cols: torch.Tensor
    targets: torch.Tensor


def packed_layout(prompts, outputs, width, pad_id, *, varlen: bool) -> PackedLayout:
    """Sequence i is fed as prompt_i + output_i[:n_i - 1] (n_i = scored tokens, its last token predicts nothing
    scored) at positions 0..; rows are right-filled with pad tokens that form a sequence of their own, which
    nothing real attends to. `varlen`: one row of everything (flash-attn), else rows as long as the longest sequence."""
    n = [min(len(o), width) for o in outputs]
    live = [i for i in range(len(outputs)) if n[i] > 0]
    fed = {i: list(prompts[i]) + list(outputs[i])[: n[i] - 1] for i in live}
    lens = [len(fed[i]) for i in live]
    bins = pack_rows(lens, None if varlen else max(lens))
    S = max(sum(lens[j] for j in b) for b in bins)
    ids = torch.full((len(bins), S), pad_id, dtype=torch.long)
    pos = torch.zeros((len(bins), S), dtype=torch.long)
    where, rows, cols, targets = [], [], [], []
    for r, b in enumerate(bins):
        at = 0
        for j in b:
            i = live[j]
            L = lens[j]
            ids[r, at: at + L] = torch.tensor(fed[i], dtype=torch.long)
            pos[r, at: at + L] = torch.arange(L)
            first = at + len(prompts[i]) - 1  # predicts output token 0
            where.append(r * S + torch.arange(first, first + n[i]))
            rows.append(torch.full((n[i],), i, dtype=torch.long))
            cols.append(torch.arange(n[i]))
            targets.append(torch.tensor(list(outputs[i])[: n[i]], dtype=torch.long))
            at += L
        pos[r, at:] = torch.arange(S - at)
    return PackedLayout(ids, pos, torch.cat(where), torch.cat(rows), torch.cat(cols), torch.cat(targets))


def scored_logits(model, ids: torch.Tensor, pos: torch.Tensor, flat: torch.Tensor, device) -> torch.Tensor:
    """One forward of the rows ids/pos [R, S]; logits [K, V] at the flat indices r * S + column (the LM head only there)."""
    S = ids.shape[1]
    if ids.shape[0] == 1:  # the LM head only at the scored positions
        return model(input_ids=ids.to(device), position_ids=pos.to(device), use_cache=False, logits_to_keep=flat.to(device)).logits[0]
    # one index set serves every row: keep the columns any row scores, then pick each row's own
    keep = torch.unique(flat % S)
    logits = model(input_ids=ids.to(device), position_ids=pos.to(device), use_cache=False, logits_to_keep=keep.to(device)).logits
    return logits.reshape(-1, logits.shape[-1])[((flat // S) * keep.numel() + torch.searchsorted(keep, flat % S)).to(device)]


def packed_logits(model, prompts, outputs, width, device, pad_id) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logits at every scored position, flat [K, V], each one's (row, column) in the [rows, width] layout and its target token [K]
    (packed_layout's rows; the LM head runs only at the scored positions)."""
    lay = packed_layout(prompts, outputs, width, pad_id, varlen=varlen_attention(model))
    return scored_logits(model, lay.ids, lay.pos, lay.flat, device), lay.rows, lay.cols, lay.targets.to(device)
