"""Training batches: trajectory groups -> response-aligned tensors, micro-batch plans, token logprobs.

Pure tensor code used by the Trainer's stages (no bus, no torch.distributed). Rows are samples in
group-major order (g * n + i), columns the response tokens (everything after the prompt), padded to
the longest response: the [N, T] layout `kuberl.runtime.algorithms` expects. Groups of varying size
(the agent workflow's exportStyle individual, `ragged=True`) keep that row order; their rewards are
flat [N] and `group_sizes` says where each group's rows are.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kuberl.runtime.trainer.packing import can_share_prompts, packed_logits
from kuberl.runtime.trainer.token_logprobs import target_logprobs


class BatchError(ValueError):
    """A trajectory group cannot be trained on (its message names the group and the field)."""


@dataclass
class RolloutBatch:
    """B groups of n samples (or of group_sizes[g] samples), flattened group-major; per-token tensors are [N, T]."""

    group_ids: list[str]
    prompts: list[list[int]]
    outputs: list[list[int]]
    loss_mask: torch.Tensor  # [N, T] float, 1 where the policy generated the token
    behave_logp: torch.Tensor  # [N, T] log pi_behave, the engine's logprobs
    versions: torch.Tensor  # [N, T] long, -1 where not generated
    rewards: torch.Tensor  # [G, n] raw rewards; flat [N] when the groups are ragged
    head_versions: list[int]  # per group: min version of its generated tokens
    prox_logp: torch.Tensor | None = None  # [N, T] log pi_prox, recomputed before the update
    ref_logp: torch.Tensor | None = None  # [N, T] log pi_ref, only with a KL term
    advantages: torch.Tensor | None = None  # [N, T]
    extra: dict[str, Any] = field(default_factory=dict)
    group_sizes: list[int] = field(default_factory=list)  # samples per group (all n unless ragged)

    @property
    def num_groups(self) -> int:
        return len(self.group_ids)

    @property
    def num_samples(self) -> int:
        return len(self.outputs)

    @property
    def seq_lens(self) -> list[int]:
        return [len(p) + len(o) for p, o in zip(self.prompts, self.outputs)]

    def response_lengths(self) -> torch.Tensor:
        """Generated tokens per sample, [G, n] ([N] when ragged), over all turns (what the overlong penalty and
        Dr.GRPO measure against maxNewTokens, which a multi-turn episode shares across its turns)."""
        return self.loss_mask.sum(dim=1).reshape(self.rewards.shape)


def _get(obj: Any, name: str) -> Any:
    return obj[name] if isinstance(obj, dict) else getattr(obj, name)


def head_version(group: Any) -> int:
    """min(versions of generated tokens) over a group's samples; -1 if it generated nothing."""
    found = [v for s in _get(group, "samples") for v, m in zip(_get(s, "versions"), _get(s, "loss_mask")) if m and v >= 0]
    return min(found) if found else -1


def group_size_error(count: int, group_size: int, ragged: bool) -> str | None:
    """Why a group of `count` samples cannot be trained on, or None. Fixed groups hold exactly group_size
    samples; ragged ones (one sample per agent call) at least group_size (every episode makes a call)."""
    if ragged:
        return None if count >= group_size else f"has {count} samples, fewer than its algorithm.samplesPerPrompt={group_size} episodes"
    return None if count == group_size else f"has {count} samples, algorithm.samplesPerPrompt is {group_size}"


def build_batch(groups: Sequence[Any], group_size: int, *, ragged: bool = False) -> RolloutBatch:
    """Check and stack trajectory groups (TrajectoryGroup objects or their dicts) into a RolloutBatch.

    `ragged`: groups may hold more than group_size samples (exportStyle individual); rewards are then flat [N]
    unless every group happens to hold exactly group_size.
    """
    if not groups:
        raise BatchError("build_batch: no groups")
    prompts, outputs, masks, logps, versions, rewards, heads, ids = [], [], [], [], [], [], [], []
    for g in groups:
        gid = _get(g, "group_id")
        samples = _get(g, "samples")
        why = group_size_error(len(samples), group_size, ragged)
        if why is not None:
            raise BatchError(f"group {gid}: {why}")
        row = []
        for k, s in enumerate(samples):
            out = list(_get(s, "output_ids"))
            for name in ("logprobs", "versions", "loss_mask"):
                if len(_get(s, name)) != len(out):
                    raise BatchError(f"group {gid} sample {k}: {name} has {len(_get(s, name))} entries for {len(out)} output_ids")
            if not _get(s, "input_ids"):
                raise BatchError(f"group {gid} sample {k}: input_ids is empty (the prompt needs at least one token)")
            prompts.append(list(_get(s, "input_ids")))
            outputs.append(out)
            masks.append(list(_get(s, "loss_mask")))
            logps.append(list(_get(s, "logprobs")))
            versions.append(list(_get(s, "versions")))
            row.append(float(_get(s, "reward")))
        rewards.append(row)
        heads.append(head_version(g))
        ids.append(gid)
    T = max(1, max(len(o) for o in outputs))
    sizes = [len(row) for row in rewards]
    uniform = all(k == group_size for k in sizes)

    def pad(rows: list[list], value: float, dtype: torch.dtype) -> torch.Tensor:
        out = torch.full((len(rows), T), value, dtype=dtype)
        for i, r in enumerate(rows):
            if r:
                out[i, : len(r)] = torch.tensor(r, dtype=dtype)
        return out

    return RolloutBatch(
        group_ids=ids,
        prompts=prompts,
        outputs=outputs,
        loss_mask=pad(masks, 0, torch.float32),
        behave_logp=pad(logps, 0.0, torch.float32),
        versions=pad(versions, -1, torch.long),
        rewards=torch.tensor(rewards if uniform else [x for row in rewards for x in row], dtype=torch.float32),
        head_versions=heads,
        group_sizes=sizes,
    )


def plan_micro_batches(seq_lens: Sequence[int], rows: Sequence[int], max_tokens: int, *, packed: bool = False) -> list[list[int]]:
    """Split `rows` (in order) into micro-batches that stay <= max_tokens: their padded size (rows x longest),
    or with `packed` their real tokens (sum of lengths).

    A sequence longer than max_tokens gets a micro-batch of its own (it cannot be split).
    """
    plans: list[list[int]] = []
    cur: list[int] = []
    longest = total = 0
    for r in rows:
        n = seq_lens[r]
        size = total + n if packed else max(longest, n) * (len(cur) + 1)
        if cur and size > max_tokens:
            plans.append(cur)
            cur, longest, total = [], 0, 0
        cur.append(r)
        longest = max(longest, n)
        total += n
    if cur:
        plans.append(cur)
    return plans


def minibatch_rows(num_groups: int, group_size: int | Sequence[int], minibatches: int) -> list[list[int]]:
    """Rows of each PPO minibatch: whole groups, split as evenly as possible by group count (group-major rows).
    `group_size`: samples per group, or each group's count when they differ (RolloutBatch.group_sizes)."""
    minibatches = min(minibatches, num_groups)
    bounds = [round(k * num_groups / minibatches) for k in range(minibatches + 1)]
    if isinstance(group_size, int):
        return [list(range(bounds[k] * group_size, bounds[k + 1] * group_size)) for k in range(minibatches)]
    if len(group_size) != num_groups:
        raise BatchError(f"minibatch_rows: {len(group_size)} group sizes for {num_groups} groups")
    starts = [0]
    for k in group_size:
        starts.append(starts[-1] + k)
    return [list(range(starts[bounds[k]], starts[bounds[k + 1]])) for k in range(minibatches)]


def shard_micro_batches(seq_lens: Sequence[int], rows: Sequence[int], max_tokens: int, rank: int, world: int,
                        *, packed: bool = False) -> list[list[int] | None]:
    """This rank's micro-batches of `rows` (dealt by length, deal_rows); every rank gets the same count (None = a
    no-loss filler).

    FSDP needs every rank to run the same number of forward/backward passes, so ranks with less work
    run fillers whose loss is multiplied by zero.
    """
    plans = [plan_micro_batches(seq_lens, mine, max_tokens, packed=packed) for mine in deal_rows(seq_lens, rows, world)]
    count = max(len(p) for p in plans)
    mine: list[list[int] | None] = list(plans[rank])
    return mine + [None] * (count - len(mine))


def deal_rows(seq_lens: Sequence[int], rows: Sequence[int], world: int) -> list[list[int]]:
    """`rows` dealt to `world` data-parallel ranks with about equal tokens, so that no rank waits on one with the long
    sequences: longest first, each to the rank with the fewest tokens so far (the lowest rank on a tie). The loads then
    differ by at most the longest row. Each rank keeps its rows in batch order. The loss does not depend on the deal:
    its denominator counts the whole minibatch (compute.stage_ppo_update)."""
    dealt: list[list[int]] = [[] for _ in range(world)]
    loads = [0] * world
    for r in sorted(rows, key=lambda r: -seq_lens[r]):  # stable: equal lengths keep batch order
        k = min(range(world), key=lambda k: (loads[k], k))
        dealt[k].append(r)
        loads[k] += seq_lens[r]
    at = {r: i for i, r in enumerate(rows)}
    return [sorted(mine, key=at.__getitem__) for mine in dealt]


def _pad(rows: Sequence[Sequence[int]], width: int, value: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded [rows, width] long tensor of `rows` (cut at width) and its 0/1 mask."""
    ids = torch.full((len(rows), width), value, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        r = list(r)[:width]
        if r:
            ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
            mask[i, : len(r)] = 1
    return ids, mask


def _full_sequence_logits(model, prompts, outputs, width, device, pad_id) -> torch.Tensor:
    """[rows, width, V] logits predicting output token t of each row, from one forward over prompt + output.

    The last token of the longest row is never an input that predicts a scored token, so it is not fed;
    the LM head runs only from the shortest prompt's last position on (`logits_to_keep`), not over
    every prompt position.
    """
    seqs = [list(p) + list(o)[:width] for p, o in zip(prompts, outputs)]
    L = max(len(s) for s in seqs)
    ids, attn = _pad(seqs, L - 1, pad_id)
    first = min(len(p) for p in prompts) - 1
    keep = torch.arange(first, L - 1, device=device)
    logits = model(input_ids=ids.to(device), attention_mask=attn.to(device), use_cache=False, logits_to_keep=keep).logits
    # Output token t of row i is predicted at sequence position len(prompt_i) - 1 + t = column (that - first).
    t = torch.arange(width, device=device)
    col = (torch.tensor([len(p) - 1 - first for p in prompts], device=device)[:, None] + t[None, :]).clamp(max=keep.numel() - 1)
    return logits.gather(1, col[:, :, None].expand(-1, -1, logits.shape[-1]))


def _shared_prompt_logits(model, prompts, outputs, width, device, pad_id, owner, uniq) -> torch.Tensor:
    """Like _full_sequence_logits, but each distinct prompt runs once (a GRPO group shares one): the
    responses then run on its KV cache, selected per row, so gradients flow back through the prompt pass.

    Rows keep their own RoPE positions (len(prompt) + t); prompt padding sits between a short prompt
    and its response in the cache and is masked out.
    """
    P = max(len(p) for p in uniq)
    p_ids, p_attn = _pad(uniq, P, pad_id)
    p_last = torch.tensor([len(p) - 1 for p in uniq], device=device)
    keep = torch.unique(p_last)  # the LM head only at the prompts' last positions
    out = model(input_ids=p_ids.to(device), attention_mask=p_attn.to(device), use_cache=True, logits_to_keep=keep)
    first = out.logits[torch.arange(len(uniq), device=device), torch.searchsorted(keep, p_last)]  # [U, V]
    owner_t = torch.tensor(owner, device=device)
    first = first[owner_t][:, None, :]  # [rows, 1, V]: predicts output token 0
    R = min(width, max(len(o) for o in outputs)) - 1  # inputs: output tokens 0..R-1 predict tokens 1..R
    if R < 1:
        logits = first
    else:
        cache = out.past_key_values
        cache.batch_select_indices(owner_t)
        r_ids, r_attn = _pad([list(o)[:R] for o in outputs], R, pad_id)
        attn = torch.cat([p_attn.to(device)[owner_t], r_attn.to(device)], dim=1)
        pos = torch.tensor([len(prompts[i]) for i in range(len(prompts))], device=device)[:, None] + torch.arange(R, device=device)[None, :]
        rest = model(input_ids=r_ids.to(device), attention_mask=attn, position_ids=pos, past_key_values=cache, use_cache=True).logits
        logits = torch.cat([first, rest], dim=1)  # [rows, R + 1, V]
    if logits.shape[1] < width:  # every response is shorter than width: those columns are masked anyway
        logits = torch.cat([logits, logits[:, -1:].expand(-1, width - logits.shape[1], -1)], dim=1)
    return logits


def response_logprobs(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    outputs: Sequence[Sequence[int]],
    width: int,
    *,
    temperature: float = 1.0,
    device: torch.device | str = "cpu",
    pad_id: int = 0,
    entropy: bool = False,
    share_prompts: bool = True,
    packed: bool = False,
    cp: Any = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """log pi(output token t | prefix) for each row, [rows, width] (0 beyond each response).

    Logits are divided by the sampling temperature, as the engine did when it reported its logprobs.
    Right padding with an attention mask; positions count from 0 in every row. The LM head runs only
    where a scored token is predicted (never [rows, L, V] over prompts). Rows with the same prompt (a
    group) run it once and their responses on its KV cache (`share_prompts`, where packing.can_share_prompts
    allows it). With `entropy`, also the entropy of softmax(logits / T) at each output position, [rows, width],
    from the same forward (no grad: a statistic, not a loss term): H = logsumexp(z) - sum softmax(z) * z. `packed`: the rows back to back, no padding
    (kuberl.runtime.trainer.packing), the same numbers. `cp` (a context_parallel.ContextParallel): the packed rows
    split over the CP group, every CP rank gets the whole [rows, width] (each entry computed by one of them).
    """
    if width < 1 or max((len(o) for o in outputs), default=0) == 0:  # no output token in any row: nothing to score
        zeros = torch.zeros((len(outputs), max(width, 0)), device=device)
        return (zeros, zeros.clone()) if entropy else zeros
    if cp is not None:
        from kuberl.runtime.trainer.context_parallel import cp_packed_logits

        logits, row, col, targets = cp_packed_logits(model, prompts, outputs, width, device, pad_id, cp)
        packed, valid = True, None
    elif packed:
        logits, row, col, targets = packed_logits(model, prompts, outputs, width, device, pad_id)
        valid = None
    else:
        index: dict[tuple[int, ...], int] = {}
        owner = [index.setdefault(tuple(p), len(index)) for p in prompts]
        if share_prompts and len(index) < len(prompts) and can_share_prompts(model):
            logits = _shared_prompt_logits(model, prompts, outputs, width, device, pad_id, owner, [list(k) for k in index])
        else:
            logits = _full_sequence_logits(model, prompts, outputs, width, device, pad_id)
        targets, valid = _pad(outputs, width, pad_id)
        targets, valid = targets.to(device), valid.to(device).bool()
    # log softmax(logits / T) at the target only, in float32, a slice of rows at a time (token_logprobs).
    token_logp, ent = target_logprobs(logits, targets, temperature, entropy=entropy)
    if packed:  # flat scored positions -> [rows, width], 0 elsewhere
        at = (row * width + col).to(device)
        out = torch.zeros(len(outputs) * width, device=device, dtype=token_logp.dtype).index_put((at,), token_logp).view(len(outputs), width)
        if ent is not None:
            ent = torch.zeros(len(outputs) * width, device=device, dtype=ent.dtype).index_put((at,), ent).view(len(outputs), width)
        if cp is not None:
            from kuberl.runtime.trainer.context_parallel import gather_tokens

            out = gather_tokens(out, cp)
            ent = None if ent is None else gather_tokens(ent, cp)
    else:
        out = torch.where(valid, token_logp, torch.zeros((), device=token_logp.device))
        if ent is not None:
            ent = torch.where(valid, ent, torch.zeros((), device=ent.device))
    return (out, ent) if entropy else out
