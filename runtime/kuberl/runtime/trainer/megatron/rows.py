"""Rows of prompt + response tokens as GPTModel inputs, and log-probs from vocab-parallel logits (Megatron backend).

Logits stay vocab-parallel (each TP rank holds V/tp columns): log-softmax at the target is an all-reduce
of the max and of the sum of exponentials over the TP group, never a gather of the vocabulary.

Micro-batch shapes: every rank of a pipeline sends fixed shapes between stages, so under pipeline
parallelism all micro-batches are padded to one [rows, seq]. Under expert parallelism the allgather token
dispatcher (megatron's MoEAllGatherTokenDispatcher, token_dispatcher.py:256) all-gathers the tokens of
every rank of the tensor x expert group in every MoE layer: those ranks (different data-parallel replicas,
with their own rows) must run the same number of forwards with the same [rows, seq]. `micro_rows` pads
the micro-batches to the group's largest and adds filler micro-batches (no real rows) to a rank that has
fewer; the caller drops what fillers compute. Under context parallelism the sequence length is a multiple of
2 x cp (context.py: megatron's chunks); every CP rank of a replica gets the same rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kuberl.runtime.trainer.megatron.context import cp_sum, local_columns


def vocab_parallel_logprobs(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int, *, temperature: float = 1.0,
                            entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(logits / T)[target] and (no grad) the entropy, from this TP rank's vocabulary shard.

    logits: [..., V/tp], columns tp_rank * V/tp onwards of the (padded) vocabulary; columns >= vocab_size
    are padding and are left out of the softmax. targets: [...] global token ids. Differentiable: the sums
    over the TP group are megatron's reduce_from_tensor_model_parallel_region (all-reduce forward, identity
    backward), correct because every TP rank computes the same loss from them.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region as tp_sum

    n_local = logits.shape[-1]
    start = ps.get_tensor_model_parallel_rank() * n_local
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    pad = None
    if start + n_local > vocab_size:
        pad = torch.arange(start, start + n_local, device=z.device) >= vocab_size
        z = z.masked_fill(pad, float("-inf"))
    zmax = z.detach().amax(dim=-1)
    if ps.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(zmax, op=dist.ReduceOp.MAX, group=ps.get_tensor_model_parallel_group())
    e = torch.exp(z - zmax.unsqueeze(-1))
    sum_exp = tp_sum(e.sum(dim=-1))
    lse = zmax + torch.log(sum_exp)
    local = targets - start
    here = (local >= 0) & (local < n_local)
    z_t = z.gather(-1, local.clamp(0, n_local - 1).unsqueeze(-1)).squeeze(-1)
    z_t = tp_sum(torch.where(here, z_t, torch.zeros((), dtype=z.dtype, device=z.device)))
    logp = z_t - lse
    ent = None
    if entropy:
        with torch.no_grad():  # H = lse - sum_v softmax_v * z_v
            pz = (e / sum_exp.unsqueeze(-1)) * z
            if pad is not None:
                pz = pz.masked_fill(pad, 0.0)  # 0 * -inf
            ent = lse.detach() - tp_sum(pz.sum(dim=-1))
    return logp, ent


@dataclass
class Rows:
    """One micro-batch as model inputs: prompt + output tokens right-padded, and where each output token is predicted."""

    input_ids: torch.Tensor  # [R, S]
    position_ids: torch.Tensor  # [R, S]
    attention_mask: torch.Tensor  # [1, 1, S, S] bool, True = masked (causal)
    col: torch.Tensor  # [R, width] sequence position predicting output token t
    targets: torch.Tensor  # [R, width] output token ids (pad_id beyond the response)
    valid: torch.Tensor  # [R, width] bool
    rows: int  # real rows (the rest is padding)


def make_rows(prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]], width: int, pad_id: int, device: torch.device,
              num_rows: int = 0, seq_len: int = 0, seq_multiple: int = 1) -> Rows:
    """Inputs for the rows; padded to num_rows rows and seq_len positions when those are larger (pipeline
    parallelism sends fixed shapes between stages), and to a multiple of seq_multiple positions (2 x the
    context-parallel size: megatron's 2 cp chunks). Right padding needs no padding mask under a causal one."""
    seqs = [list(p) + list(o)[:width] for p, o in zip(prompts, outputs)]
    S = max(seq_len, max((len(s) for s in seqs), default=0) - 1, 1)
    S = -(-S // seq_multiple) * seq_multiple
    R = max(num_rows, len(seqs), 1)  # a filler micro-batch (no rows) is one row of padding
    ids = torch.full((R, S), pad_id, dtype=torch.long)
    targets = torch.full((R, width), pad_id, dtype=torch.long)
    valid = torch.zeros((R, width), dtype=torch.bool)
    col = torch.zeros((R, width), dtype=torch.long)
    t = torch.arange(width)
    for i, (p, o, s) in enumerate(zip(prompts, outputs, seqs)):
        inp = s[:-1] or s
        ids[i, : len(inp)] = torch.tensor(inp[:S])
        o = list(o)[:width]
        if o:
            targets[i, : len(o)] = torch.tensor(o)
            valid[i, : len(o)] = True
        col[i] = (len(p) - 1 + t).clamp(max=S - 1)
    pos = torch.arange(S).unsqueeze(0).expand(R, S)
    mask = torch.triu(torch.ones(1, 1, S, S, dtype=torch.bool), diagonal=1)
    return Rows(ids.to(device), pos.to(device), mask.to(device), col.to(device), targets.to(device), valid.to(device), len(seqs))




def row_logprobs(logits: torch.Tensor, r: Rows, vocab: int, temperature: float, entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[rows, width] log-probs (0 outside the responses) from [R, S, V/tp] logits; only the real rows.

    Under context parallelism the logits are this CP rank's [R, S/cp, V/tp] (context.local_positions): each
    rank scores the tokens predicted at its positions and context.cp_sum assembles the whole rows on every rank.
    """
    col, here = local_columns(r.col[: r.rows], r.input_ids.shape[1])
    picked = logits[: r.rows].gather(1, col.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))
    lp, ent = vocab_parallel_logprobs(picked, r.targets[: r.rows], vocab, temperature=temperature, entropy=entropy)
    zero = torch.zeros((), dtype=lp.dtype, device=lp.device)
    valid = r.valid[: r.rows] & here
    return cp_sum(torch.where(valid, lp, zero)), (None if ent is None else cp_sum(torch.where(valid, ent, zero)))


def micro_rows(prompts, outputs, width: int, pad_id: int, plans: Sequence[Sequence[int]], device: torch.device) -> list[Rows]:
    """Rows of each micro-batch (row indices). All one shape under pipeline or expert parallelism; under expert
    parallelism also as many micro-batches as the rank of the tensor x expert group with the most (the ones
    past len(plans) are fillers without real rows)."""
    from megatron.core import parallel_state as ps

    n = len(plans)
    R = S = 0
    ep = ps.get_expert_model_parallel_world_size() > 1
    if ps.get_pipeline_model_parallel_world_size() > 1 or ep:
        R = max((len(p) for p in plans), default=1)
        S = max((len(prompts[i]) + min(len(outputs[i]), width) - 1 for p in plans for i in p), default=1)
    if ep:
        dims = torch.tensor([n, R, S], dtype=torch.long, device=device)
        dist.all_reduce(dims, op=dist.ReduceOp.MAX, group=ps.get_expert_tensor_and_model_parallel_group())
        n, R, S = (int(x) for x in dims.tolist())
    plans = list(plans) + [[]] * (n - len(plans))
    m = 2 * ps.get_context_parallel_world_size()
    return [make_rows([prompts[i] for i in p], [outputs[i] for i in p], width, pad_id, device, R, S, m) for p in plans]
