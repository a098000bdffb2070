"""This rank's megatron-core GPTModel: build it from a HF model directory, score responses, train one PPO step.

Call order on every rank (after `torch.distributed.init_process_group`):

    init_parallel(tp_size, pp_size, device=device)                    # megatron's process groups + RNG seeds
    mm = build_model(model_dir, device=device)                        # this rank's GPTModel, HF weights loaded
    lp = response_logprobs(mm, prompts, outputs, width, temperature=T)          # [rows, width], CPU, every stage
    stats = train_step(mm, optimizer, micro_batches, cfg, denominator=D, temperature=T, grad_clip=c)
    hf = gather_hf_state(mm)                                          # HF names and shapes, on every rank

Every rank of a tensor/pipeline group makes the same calls with the same data (megatron's collectives).
Logits stay vocab-parallel (each TP rank holds V/tp columns): log-softmax at the target is an all-reduce
of the max and of the sum of exponentials over the TP group, never a gather of the vocabulary. On the CPU
everything runs inside `cpu.cpu_compat()` (megatron-core's CUDA assumptions mapped to the CPU).
"""

from __future__ import annotations

import contextlib
import glob
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from kuberl.runtime.trainer.megatron import convert
from kuberl.runtime.trainer.megatron.cpu import cpu_compat, seed_cpu


@dataclass
class MegatronModel:
    """This rank's GPTModel and what the functions below need to know about it."""

    module: torch.nn.Module  # megatron.core.models.gpt.GPTModel (this pipeline stage, this TP shard)
    shape: convert.ModelShape
    device: torch.device
    te: bool  # built with the Transformer Engine layer spec (its parameter names differ, see convert.megatron_names)

    @property
    def on_cpu(self) -> bool:
        return self.device.type == "cpu"

    def compat(self) -> contextlib.AbstractContextManager:
        return cpu_compat(self.on_cpu)


def init_parallel(tp_size: int = 1, pp_size: int = 1, *, device: torch.device | str = "cpu", seed: int = 1234) -> None:
    """megatron's tensor/pipeline/data-parallel groups over the default process group, then its RNG seeds.

    The data-parallel size is world_size / (tp_size * pp_size). On CUDA, call torch.cuda.set_device(local_rank)
    first. Re-entrant: a second call tears the previous groups down (tests switch layouts in one process).
    """
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp_size, pipeline_model_parallel_size=pp_size)
    if torch.device(device).type == "cpu":
        seed_cpu(seed)
    else:
        tensor_parallel.model_parallel_cuda_manual_seed(seed)


def _te_available(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def read_hf_state(model_dir: str, shape: convert.ModelShape, pp_rank: int = 0, pp_size: int = 1) -> dict[str, torch.Tensor]:
    """The HF tensors that pipeline stage pp_rank needs, read from the directory's *.safetensors files."""
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise ValueError(f"{model_dir}: no *.safetensors file (save the model with save_pretrained(safe_serialization=True))")
    layers = convert.stage_layers(shape.num_layers, pp_rank, pp_size)
    first, last = pp_rank == 0, pp_rank == pp_size - 1

    def wanted(name: str) -> bool:
        i = convert.layer_index(name)
        if i is not None:
            return i in layers
        if name == "model.embed_tokens.weight":
            return first or (last and shape.tied)
        return last and name in ("model.norm.weight", "lm_head.weight")

    out: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(path, framework="pt") as fh:
            for name in fh.keys():
                if wanted(name):
                    out[name] = fh.get_tensor(name)
    return out


def build_model(model_dir: str, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, load: bool = True,
                **config_overrides: Any) -> MegatronModel:
    """This rank's GPTModel for the HF model in `model_dir` (config.json + safetensors), its weights loaded.

    Uses the local (pure megatron-core) layer spec, or the Transformer Engine one on CUDA when TE is
    installed. `config_overrides` go to TransformerConfig. Needs `init_parallel` first.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt import gpt_layer_specs as specs
    from megatron.core.transformer.transformer_config import TransformerConfig
    from transformers import AutoConfig

    device = torch.device(device)
    hf_config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    tp, pp = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
    te = _te_available(device)
    tc_kwargs, gpt_kwargs, spec_kwargs = convert.megatron_config(
        hf_config, tp_size=tp, pp_size=pp, dtype=dtype, use_cpu_initialization=device.type == "cpu", perform_initialization=not load,
        **config_overrides)
    spec = specs.get_gpt_layer_with_transformer_engine_spec(**spec_kwargs) if te else specs.get_gpt_layer_local_spec(**spec_kwargs)
    with cpu_compat(device.type == "cpu"):
        module = GPTModel(config=TransformerConfig(**tc_kwargs), transformer_layer_spec=spec, pre_process=ps.is_pipeline_first_stage(),
                          post_process=ps.is_pipeline_last_stage(), **gpt_kwargs)
    module.to(device)
    _mark_tensor_parallel(module, te)
    mm = MegatronModel(module=module, shape=convert.model_shape(hf_config), device=device, te=te)
    if load:
        load_hf_state(mm, read_hf_state(model_dir, mm.shape, ps.get_pipeline_model_parallel_rank(), pp))
    return mm


def _mark_tensor_parallel(module: torch.nn.Module, te: bool) -> None:
    """Set megatron's tensor_model_parallel / partition_dim / partition_stride on every TP-sharded weight.

    megatron-core 0.16.1 sets them on linear and embedding weights only inside its weight initialisation
    (tensor_parallel/layers.py:244, 265, 855, 877, 1178, 1201 run only with perform_initialization), so a
    model built to be loaded (perform_initialization=False) lacks them, and everything that tells sharded
    from replicated parameters (the grad norm's duplicate filter) would count a shard on TP rank 0 only.
    """
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    for name, p in convert.megatron_names(dict(module.named_parameters()), te=False).items():
        kind = convert.tp_kind(name)
        if kind != "replicated" and not getattr(p, "tensor_model_parallel", False):
            set_tensor_model_parallel_attributes(p, True, 1 if kind == "row" else 0, 2 if kind == "gated" else 1)


def load_hf_state(mm: MegatronModel, hf: dict[str, torch.Tensor]) -> None:
    """Copy HF tensors (at least this stage's) into this rank's parameters; ValueError on any name or shape mismatch."""
    from megatron.core import parallel_state as ps

    mine = convert.hf_to_megatron(hf, mm.shape, tp_rank=ps.get_tensor_model_parallel_rank(), tp_size=ps.get_tensor_model_parallel_world_size(),
                                  pp_rank=ps.get_pipeline_model_parallel_rank(), pp_size=ps.get_pipeline_model_parallel_world_size())
    mine = convert.megatron_names(mine, te=mm.te)
    params = dict(mm.module.named_parameters())
    if set(params) != set(mine):
        raise ValueError(f"load_hf_state: megatron parameters {sorted(set(params) - set(mine))} get no weight; "
                         f"converted weights {sorted(set(mine) - set(params))} have no parameter")
    with torch.no_grad():
        for name, p in params.items():
            if p.shape != mine[name].shape:
                raise ValueError(f"load_hf_state: {name} is {tuple(p.shape)}, the converted weight {tuple(mine[name].shape)}")
            p.copy_(mine[name].to(p.dtype))


def gather_hf_state(mm: MegatronModel, *, grads: bool = False) -> dict[str, torch.Tensor]:
    """All parameters (or, with `grads`, their gradients) under HF names and shapes, on every rank (CPU tensors).

    An all-gather per parameter over the TP group, then every stage's dict to every rank: for checkpoints
    and tests of small models. A streaming publisher gathers one parameter at a time instead
    (convert.merge_tp + convert.full_to_hf).
    """
    from megatron.core import parallel_state as ps

    tp, tp_group = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_group()
    offset = convert.stage_layers(mm.shape.num_layers, ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()).start
    stage: dict[str, torch.Tensor] = {}
    for name, p in convert.megatron_names(dict(mm.module.named_parameters()), te=False).items():
        t = p.grad if grads else p
        t = torch.zeros_like(p) if t is None else t.detach().contiguous()
        parts = [t]
        if tp > 1:
            parts = [torch.empty_like(t) for _ in range(tp)]
            dist.all_gather(parts, t, group=tp_group)
        if name == "output_layer.weight" and mm.shape.tied:
            continue  # the last stage's copy of a tied embedding
        stage[convert.renumber(name, offset)] = convert.merge_tp(name, [x.cpu() for x in parts], mm.shape)
    if ps.get_pipeline_model_parallel_world_size() > 1:
        stages: list[Any] = [None] * ps.get_pipeline_model_parallel_world_size()
        dist.all_gather_object(stages, stage, group=ps.get_pipeline_model_parallel_group())
        stage = {k: v for s in stages for k, v in s.items()}
    return convert.full_to_hf(stage, mm.shape)


# ---- log-probs from vocab-parallel logits --------------------------------------------------------------------

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
class _Rows:
    """One micro-batch as model inputs: prompt + output tokens right-padded, and where each output token is predicted."""

    input_ids: torch.Tensor  # [R, S]
    position_ids: torch.Tensor  # [R, S]
    attention_mask: torch.Tensor  # [1, 1, S, S] bool, True = masked (causal)
    col: torch.Tensor  # [R, width] sequence position predicting output token t
    targets: torch.Tensor  # [R, width] output token ids (pad_id beyond the response)
    valid: torch.Tensor  # [R, width] bool
    rows: int  # real rows (the rest is padding)


def _rows(prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]], width: int, pad_id: int, device: torch.device,
          num_rows: int = 0, seq_len: int = 0) -> _Rows:
    """Inputs for the rows; padded to num_rows rows and seq_len positions when those are larger (pipeline
    parallelism sends fixed shapes between stages). Right padding needs no padding mask under a causal one."""
    seqs = [list(p) + list(o)[:width] for p, o in zip(prompts, outputs)]
    S = max(seq_len, max(len(s) for s in seqs) - 1, 1)
    R = max(num_rows, len(seqs))
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
    return _Rows(ids.to(device), pos.to(device), mask.to(device), col.to(device), targets.to(device), valid.to(device), len(seqs))


def _row_logprobs(mm: MegatronModel, logits: torch.Tensor, r: _Rows, temperature: float, entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[rows, width] log-probs (0 outside the responses) from [R, S, V/tp] logits; only the real rows."""
    picked = logits[: r.rows].gather(1, r.col[: r.rows].unsqueeze(-1).expand(-1, -1, logits.shape[-1]))
    lp, ent = vocab_parallel_logprobs(picked, r.targets[: r.rows], mm.shape.vocab, temperature=temperature, entropy=entropy)
    zero = torch.zeros((), dtype=lp.dtype, device=lp.device)
    valid = r.valid[: r.rows]
    return torch.where(valid, lp, zero), (None if ent is None else torch.where(valid, ent, zero))


def _schedule(mm: MegatronModel, batches: list[_Rows], loss_func_for, forward_only: bool) -> list[Any]:
    """Run megatron's forward(-backward) schedule over the micro-batches; returns the loss functions' dicts (last stage)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    it = iter(batches)
    index = iter(range(len(batches)))

    def forward_step(data_iterator, model):
        b, k = next(data_iterator), next(index)
        out = model(b.input_ids, b.position_ids, b.attention_mask)
        return out, loss_func_for(k, b)

    seq, rows = batches[0].input_ids.shape[1], batches[0].input_ids.shape[0]
    return get_forward_backward_func()(forward_step_func=forward_step, data_iterator=it, model=[mm.module], num_microbatches=len(batches),
                                       seq_length=seq, micro_batch_size=rows, forward_only=forward_only)


def _micro_rows(mm: MegatronModel, prompts, outputs, width, pad_id, plans: Sequence[Sequence[int]]) -> list[_Rows]:
    """_Rows of each micro-batch (row indices); all one shape under pipeline parallelism."""
    from megatron.core import parallel_state as ps

    R = S = 0
    if ps.get_pipeline_model_parallel_world_size() > 1:
        R = max(len(p) for p in plans)
        S = max(len(prompts[i]) + min(len(outputs[i]), width) - 1 for p in plans for i in p)
    return [_rows([prompts[i] for i in p], [outputs[i] for i in p], width, pad_id, mm.device, R, S) for p in plans]


def _last_stage_to_all(value: Any) -> Any:
    """Broadcast a picklable value from the last pipeline stage to the other stages of this pipeline."""
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=ps.get_pipeline_model_parallel_last_rank(), group=ps.get_pipeline_model_parallel_group())
    return box[0]


def response_logprobs(mm: MegatronModel, prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]], width: int, *,
                      temperature: float = 1.0, pad_id: int = 0, entropy: bool = False, micro_batches: Sequence[Sequence[int]] | None = None,
                      to_all_stages: bool = True) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None:
    """log pi(output token t | prefix) per row, [rows, width] on the CPU, 0 beyond each response: the contract of
    kuberl.runtime.trainer.batch.response_logprobs (logits / temperature; with `entropy`, also the entropy).

    No grad. `micro_batches`: row indices per forward (default: all rows in one). The result lives on the
    last pipeline stage; `to_all_stages` broadcasts it to the other stages (else they get None).
    Rows are right-padded (no packing, no shared-prompt KV cache) and GPTModel runs its output layer at
    every position, prompts included ([rows, seq, V/tp] logits per micro-batch): size micro-batches for that.
    """
    rows = len(outputs)
    if width < 1 or max((len(o) for o in outputs), default=0) == 0:
        z = torch.zeros((rows, max(width, 0)))
        return (z, z.clone()) if entropy else z
    plans = [list(p) for p in (micro_batches or [range(rows)])]
    batches = _micro_rows(mm, prompts, outputs, width, pad_id, plans)

    def loss_func_for(k, b):
        def loss_func(logits):
            lp, ent = _row_logprobs(mm, logits, b, temperature, entropy)
            return torch.zeros((), device=logits.device), {"k": k, "logp": lp.cpu(), "entropy": None if ent is None else ent.cpu()}
        return loss_func

    with mm.compat(), torch.no_grad():
        found = _schedule(mm, batches, loss_func_for, forward_only=True)
    result = None
    if found:
        lp, ent = torch.zeros(rows, width), torch.zeros(rows, width)
        for d in found:
            lp[plans[d["k"]]] = d["logp"]
            if entropy:
                ent[plans[d["k"]]] = d["entropy"]
        result = (lp, ent) if entropy else lp
    return _last_stage_to_all(result) if to_all_stages else result


# ---- the PPO train step --------------------------------------------------------------------------------------

@dataclass
class MicroBatch:
    """Rows of one micro-batch and their per-token tensors [rows, width] (as in RolloutBatch)."""

    prompts: list[list[int]]
    outputs: list[list[int]]
    loss_mask: torch.Tensor
    behave_logp: torch.Tensor
    advantages: torch.Tensor
    prox_logp: torch.Tensor | None = None
    ref_logp: torch.Tensor | None = None


def grad_norm_and_clip(mm: MegatronModel, max_norm: float | None) -> float:
    """Total L2 grad norm over every shard of the model (TP and PP), each parameter counted once, then clip.

    megatron's get_grad_norm_fp32 over the model-parallel group, with its own filters: TP-replicated
    parameters (norms) count on TP rank 0 only, the last stage's copy of a tied embedding not at all.
    Clipping scales every gradient by max_norm / (norm + 1e-6) when below 1, as torch's clip_grad_norm_.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.optimizer.clip_grads import get_grad_norm_fp32
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
    from megatron.core.transformer.module import param_is_not_shared

    params = [p for p in mm.module.parameters() if p.grad is not None]
    counted = [p.grad for p in params if param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p)]
    with mm.compat():
        norm = float(get_grad_norm_fp32(counted, norm_type=2, grad_stats_parallel_group=ps.get_model_parallel_group()))
    if max_norm is not None and max_norm > 0:
        coeff = max_norm / (norm + 1e-6)
        if coeff < 1.0:
            for p in params:
                p.grad.mul_(coeff)
    return norm


def _reduce_grads(mm: MegatronModel) -> None:
    """What megatron's finalize_model_grads does for a model without its DDP wrapper: sum the q/k-norm gradients
    over the TP group (each rank normalises only its own heads with the replicated weight), sum a tied
    embedding's two copies (first and last stage), and sum over the data-parallel group."""
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
    if ps.get_data_parallel_world_size() > 1:  # each DP rank's loss is its share of the minibatch sum
        for p in mm.module.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=ps.get_data_parallel_group())


def train_step(mm: MegatronModel, optimizer: torch.optim.Optimizer, micro_batches: Sequence[MicroBatch], cfg: Any, *, denominator: float,
               temperature: float = 1.0, grad_clip: float | None = 1.0, pad_id: int = 0, prox_from_update: bool = False) -> dict[str, Any]:
    """One optimizer step of KubeRL's decoupled PPO loss (algorithms.ppo_actor_loss, unchanged) over the micro-batches.

    `denominator` is loss_denominator(...) of the whole minibatch (all DP ranks), so the micro-batch losses
    add up to the minibatch loss; megatron's schedules divide each micro-batch loss by num_microbatches,
    which the loss function undoes. Returns on every rank: grad_norm (before clipping), and the sums over
    this rank's micro-batches of loss, tokens and entropy x tokens, plus ppo_actor_loss's stats weighted
    by tokens (`<stat>_x_tokens`).

    `prox_from_update` (the trainer's prox_in_update: one minibatch, no dropout): log pi_prox is this forward's
    log pi_theta, detached, instead of the micro-batches' prox_logp; it comes back as `prox_logp`, one
    [rows, width] CPU tensor per micro-batch, on every pipeline stage.
    """
    from kuberl.runtime.algorithms import ppo_actor_loss

    width = micro_batches[0].loss_mask.shape[1]
    prompts = [p for mb in micro_batches for p in mb.prompts]
    outputs = [o for mb in micro_batches for o in mb.outputs]
    plans, at = [], 0
    for mb in micro_batches:
        plans.append(list(range(at, at + len(mb.prompts))))
        at += len(mb.prompts)
    batches = _micro_rows(mm, prompts, outputs, width, pad_id, plans)
    n = len(micro_batches)
    fused: dict[int, torch.Tensor] = {}  # micro-batch -> its log pi_prox (last stage, prox_from_update)

    def loss_func_for(k, b):
        mb = micro_batches[k]

        def loss_func(logits):
            lp, ent = _row_logprobs(mm, logits, b, temperature, entropy=True)
            dev = lp.device
            prox, behave, adv, mask, ref = (None if t is None else t.to(dev) for t in (mb.prox_logp, mb.behave_logp, mb.advantages, mb.loss_mask,
                                                                                       mb.ref_logp))
            if prox_from_update:  # pre-update weights: pi_prox is this very forward, detached
                prox = lp.detach()
                fused[k] = prox.cpu()
            loss, st = ppo_actor_loss(lp, prox, behave, adv, mask, cfg, ref_logp=ref, denominator=denominator)
            st = dict(st, entropy_x_tokens=float((ent * mask).sum()))
            return loss * n, st  # the schedule divides by num_microbatches
        return loss_func

    mm.module.train()
    mm.module.zero_grad(set_to_none=True)
    with mm.compat():
        found = _schedule(mm, batches, loss_func_for, forward_only=False)
    sums: dict[str, float] = {}
    for st in found:
        tok = st["tokens"]
        for key, v in st.items():
            if key in ("loss", "tokens", "sequences", "entropy_x_tokens"):
                sums[key] = sums.get(key, 0.0) + v
            elif not key.endswith("_max"):
                sums[key + "_x_tokens"] = sums.get(key + "_x_tokens", 0.0) + v * tok
    _reduce_grads(mm)
    norm = grad_norm_and_clip(mm, grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    sums, prox = _last_stage_to_all((sums, [fused.get(k) for k in range(n)]))
    out: dict[str, Any] = dict(sums, grad_norm=norm)
    if prox_from_update:
        out["prox_logp"] = prox
    return out
