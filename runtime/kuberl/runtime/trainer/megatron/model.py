"""This rank's megatron-core GPTModel: build it from a HF model directory, score responses, train one PPO step.

Call order on every rank (after `torch.distributed.init_process_group`):

    init_parallel(tp_size, pp_size, ep_size, cp_size=cp, device=device)  # megatron's process groups + RNG seeds
    mm = build_model(model_dir, device=device)                        # this rank's GPTModel, HF weights loaded
    lp = response_logprobs(mm, prompts, outputs, width, temperature=T)          # [rows, width], CPU, every stage
    stats = train_step(mm, optimizer, micro_batches, cfg, denominator=D, temperature=T, grad_clip=c)
    hf = gather_hf_state(mm)                                          # HF names and shapes, on every rank

Every rank of a tensor/pipeline/context group makes the same calls with the same data (megatron's collectives;
context parallel ranks each run their share of every sequence, context.py).
Under expert parallelism (a MoE model, convert_moe.py) the ranks of a tensor x expert group are different
data-parallel replicas: they make the same calls, each with its own rows (rows.micro_rows pads them).
Logits stay vocab-parallel (rows.py); gradient sums and the grad norm are grads.py's. On the CPU
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

from kuberl.runtime.trainer.megatron import convert, convert_moe
from kuberl.runtime.trainer.megatron.context import attention_class, cp_size, split_rows
from kuberl.runtime.trainer.megatron.cpu import cpu_compat, no_te_shims, seed_cpu
from kuberl.runtime.trainer.megatron.grads import grad_norm_and_clip, reduce_grads
from kuberl.runtime.trainer.megatron.rows import Rows, micro_rows, row_logprobs, vocab_parallel_logprobs

__all__ = ["MegatronModel", "MicroBatch", "build_model", "gather_hf_state", "grad_norm_and_clip", "init_parallel", "load_hf_state",
           "response_logprobs", "train_step", "vocab_parallel_logprobs"]


@dataclass
class MegatronModel:
    """This rank's GPTModel and what the functions below need to know about it."""

    module: torch.nn.Module  # megatron.core.models.gpt.GPTModel (this pipeline stage, this TP shard)
    shape: convert.ModelShape
    device: torch.device
    te: bool  # built with the Transformer Engine layer spec (its parameter names differ, see convert.megatron_names)
    ddp: Any = None  # megatron's DistributedDataParallel around it (optim.build_optimizer): what the schedules run when set

    @property
    def on_cpu(self) -> bool:
        return self.device.type == "cpu"

    def compat(self) -> contextlib.AbstractContextManager:
        return cpu_compat(self.on_cpu)

    @property
    def runner(self) -> torch.nn.Module:
        """The module the schedules call: DDP(Float16Module(GPTModel)) once an optimizer wrapped it, else the GPTModel."""
        return self.ddp if self.ddp is not None else self.module


# trainer.gradientCheckpointing on: megatron's full recomputation of every transformer layer (build_model overrides);
# each layer keeps only its input for the backward, as transformers' gradient checkpointing does on the FSDP path.
RECOMPUTE = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}


def init_parallel(tp_size: int = 1, pp_size: int = 1, ep_size: int = 1, *, cp_size: int = 1, device: torch.device | str = "cpu",
                  seed: int = 1234) -> None:
    """megatron's tensor/pipeline/context/data(/expert)-parallel groups over the default process group, then its RNG seeds.

    The data-parallel size is world_size / (tp_size * pp_size * cp_size); ep_size must divide it (megatron's expert
    groups: expert tensor parallel = tp_size, expert data parallel = dp / ep_size). Context parallel: context.py. On CUDA, call
    torch.cuda.set_device(local_rank) first. Re-entrant: a second call tears the previous groups down (tests
    switch layouts in one process).
    """
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp_size, pipeline_model_parallel_size=pp_size, expert_model_parallel_size=ep_size,
                                 context_parallel_size=cp_size)
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


def read_hf_state(model_dir: str, shape: convert.ModelShape, pp_rank: int = 0, pp_size: int = 1, ep_rank: int = 0,
                  ep_size: int = 1) -> dict[str, torch.Tensor]:
    """The HF tensors that pipeline stage pp_rank (expert-parallel rank ep_rank) needs, read from the directory's *.safetensors files."""
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise ValueError(f"{model_dir}: no *.safetensors file (save the model with save_pretrained(safe_serialization=True))")
    layers = convert.stage_layers(shape.num_layers, pp_rank, pp_size)
    first, last = pp_rank == 0, pp_rank == pp_size - 1

    per = shape.moe.num_experts // ep_size if shape.moe is not None else 0

    def wanted(name: str) -> bool:
        i = convert.layer_index(name)
        e = convert_moe.hf_expert_index(name)
        if e is not None and not ep_rank * per <= e < (ep_rank + 1) * per:
            return False
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
    installed; a MoE model gets megatron's decoder block spec (its dense and MoE layers from
    `moe_layer_freq`; SequentialMLP experts, no grouped GEMM). Under context parallelism the attention's core is
    context.py's (all-gathered K/V), on any device. `config_overrides` go to TransformerConfig. Needs `init_parallel` first.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt import gpt_layer_specs as specs
    from megatron.core.transformer.transformer_config import TransformerConfig
    from transformers import AutoConfig

    device = torch.device(device)
    hf_config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    tp, pp = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
    ep, cp = ps.get_expert_model_parallel_world_size(), ps.get_context_parallel_world_size()
    te = _te_available(device)
    if not te:
        no_te_shims()
    tc_kwargs, gpt_kwargs, spec_kwargs = convert.megatron_config(
        hf_config, tp_size=tp, pp_size=pp, ep_size=ep, dtype=dtype, use_cpu_initialization=device.type == "cpu",
        perform_initialization=not load, **config_overrides)
    config = TransformerConfig(**tc_kwargs, context_parallel_size=cp)
    if config.num_moe_experts:
        spec = specs.get_gpt_decoder_block_spec(config, use_transformer_engine=te, normalization=spec_kwargs["normalization"])
    elif te:
        spec = specs.get_gpt_layer_with_transformer_engine_spec(**spec_kwargs)
    else:
        spec = specs.get_gpt_layer_local_spec(**spec_kwargs)
    if cp > 1:
        if config.num_moe_experts:
            raise ValueError("context parallel with a MoE model is not implemented in the megatron backend")
        spec.submodules.self_attention.submodules.core_attention = attention_class()
    with cpu_compat(device.type == "cpu"):
        module = GPTModel(config=config, transformer_layer_spec=spec, pre_process=ps.is_pipeline_first_stage(),
                          post_process=ps.is_pipeline_last_stage(), **gpt_kwargs)
    module.to(device)
    _mark_tensor_parallel(module, te)
    mm = MegatronModel(module=module, shape=convert.model_shape(hf_config), device=device, te=te)
    if load:
        load_hf_state(mm, read_hf_state(model_dir, mm.shape, ps.get_pipeline_model_parallel_rank(), pp, ps.get_expert_model_parallel_rank(), ep))
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
                                  pp_rank=ps.get_pipeline_model_parallel_rank(), pp_size=ps.get_pipeline_model_parallel_world_size(),
                                  ep_rank=ps.get_expert_model_parallel_rank(), ep_size=ps.get_expert_model_parallel_world_size())
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

    An all-gather per parameter over the TP group (an expert's also over the EP group, renumbered to global
    experts), then every stage's dict to every rank: for checkpoints and tests of small models. A streaming
    publisher gathers one parameter at a time instead (convert.merge_tp + convert.full_to_hf).
    """
    from megatron.core import parallel_state as ps

    tp, tp_group = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_group()
    ep, per = ps.get_expert_model_parallel_world_size(), mm.shape.moe.num_experts // ps.get_expert_model_parallel_world_size() if mm.shape.moe else 0
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
        full = convert.merge_tp(name, [x.cpu() for x in parts], mm.shape)
        if not convert_moe.is_expert(name):
            stage[convert.renumber(name, offset)] = full
            continue
        experts = [full]
        if ep > 1:
            experts = [torch.empty_like(full) for _ in range(ep)]
            dist.all_gather(experts, full, group=ps.get_expert_model_parallel_group())
        for r, t in enumerate(experts):
            stage[convert_moe.renumber_expert(convert.renumber(name, offset), r * per)] = t
    if ps.get_pipeline_model_parallel_world_size() > 1:
        stages: list[Any] = [None] * ps.get_pipeline_model_parallel_world_size()
        dist.all_gather_object(stages, stage, group=ps.get_pipeline_model_parallel_group())
        stage = {k: v for s in stages for k, v in s.items()}
    return convert.full_to_hf(stage, mm.shape)


def _schedule(mm: MegatronModel, batches: list[Rows], loss_func_for, forward_only: bool) -> list[Any]:
    """Run megatron's forward(-backward) schedule over the micro-batches; returns the loss functions' dicts (last stage)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    it = iter(batches)
    index = iter(range(len(batches)))

    def forward_step(data_iterator, model):
        b, k = next(data_iterator), next(index)
        out = model(*split_rows(b.input_ids, b.position_ids, b.attention_mask))  # this CP rank's positions (all of them without CP)
        return out, loss_func_for(k, b)

    seq, rows = batches[0].input_ids.shape[1], batches[0].input_ids.shape[0]  # the schedule divides seq by the CP size
    return get_forward_backward_func()(forward_step_func=forward_step, data_iterator=it, model=[mm.runner], num_microbatches=len(batches),
                                       seq_length=seq, micro_batch_size=rows, forward_only=forward_only)


def _expert_parallel() -> bool:
    from megatron.core import parallel_state as ps

    return ps.get_expert_model_parallel_world_size() > 1


def _filler_loss(logits: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """A filler micro-batch's (rows.micro_rows): zero loss, zero gradient, no stats."""
    return logits.sum() * 0.0, {"filler": True}


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
    z = torch.zeros((rows, max(width, 0)))
    nothing = width < 1 or max((len(o) for o in outputs), default=0) == 0
    if nothing and not _expert_parallel():
        return (z, z.clone()) if entropy else z
    plans = [] if nothing else [list(p) for p in (micro_batches or [range(rows)])]
    batches = micro_rows(prompts, outputs, max(width, 1), pad_id, plans, mm.device)  # + fillers, under expert parallelism
    if not plans:
        with mm.compat(), torch.no_grad():  # only the fillers: this rank's share of its expert group's forwards
            if batches:
                _schedule(mm, batches, lambda k, b: _filler_loss, forward_only=True)
        return (z, z.clone()) if entropy else z

    def loss_func_for(k, b):
        if k >= len(plans):
            return _filler_loss

        def loss_func(logits):
            lp, ent = row_logprobs(logits, b, mm.shape.vocab, temperature, entropy)
            return torch.zeros((), device=logits.device), {"k": k, "logp": lp.cpu(), "entropy": None if ent is None else ent.cpu()}
        return loss_func

    with mm.compat(), torch.no_grad():
        found = _schedule(mm, batches, loss_func_for, forward_only=True)
    result = None
    if found:
        lp, ent = torch.zeros(rows, width), torch.zeros(rows, width)
        for d in found:
            if d.get("filler"):
                continue
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

    With `mm.ddp` (optim.build_optimizer: megatron's DDP and distributed optimizer) the gradients go to DDP's float32
    buffers, finalize_model_grads sums them and `optimizer.step()` clips (its OptimizerConfig.clip_grad; `grad_clip`
    is not read) and steps; without it (a plain torch optimizer) grads.py sums and clips.
    """
    from kuberl.runtime.algorithms import ppo_actor_loss

    width = micro_batches[0].loss_mask.shape[1]
    prompts = [p for mb in micro_batches for p in mb.prompts]
    outputs = [o for mb in micro_batches for o in mb.outputs]
    plans, at = [], 0
    for mb in micro_batches:
        plans.append(list(range(at, at + len(mb.prompts))))
        at += len(mb.prompts)
    batches = micro_rows(prompts, outputs, width, pad_id, plans, mm.device)
    n = len(batches)  # the schedule divides every loss by this (fillers included)
    cp = cp_size()  # and multiplies it by this (schedules.py:268): every CP rank's loss is the whole rows' (context.cp_sum)
    scale = n / cp * _ddp_sum_factor(mm)
    fused: dict[int, torch.Tensor] = {}  # micro-batch -> its log pi_prox (last stage, prox_from_update)

    def loss_func_for(k, b):
        if k >= len(micro_batches):
            return _filler_loss
        mb = micro_batches[k]

        def loss_func(logits):
            lp, ent = row_logprobs(logits, b, mm.shape.vocab, temperature, entropy=True)
            dev = lp.device
            prox, behave, adv, mask, ref = (None if t is None else t.to(dev) for t in (mb.prox_logp, mb.behave_logp, mb.advantages, mb.loss_mask,
                                                                                       mb.ref_logp))
            if prox_from_update:  # pre-update weights: pi_prox is this very forward, detached
                prox = lp.detach()
                fused[k] = prox.cpu()
            loss, st = ppo_actor_loss(lp, prox, behave, adv, mask, cfg, ref_logp=ref, denominator=denominator)
            st = dict(st, entropy_x_tokens=float((ent * mask).sum()))
            return loss * scale, st  # the schedule divides by num_microbatches and multiplies by the CP size; DDP by dp
        return loss_func

    mm.module.train()
    if mm.ddp is not None:
        found, norm = _ddp_step(mm, optimizer, batches, loss_func_for)
    else:
        mm.module.zero_grad(set_to_none=True)
        with mm.compat():
            found = _schedule(mm, batches, loss_func_for, forward_only=False)
        reduce_grads(mm)
        norm = grad_norm_and_clip(mm, grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    sums: dict[str, float] = {}
    for st in found:
        if st.get("filler"):
            continue
        tok = st["tokens"]
        for key, v in st.items():
            if key in ("loss", "tokens", "sequences", "entropy_x_tokens"):
                sums[key] = sums.get(key, 0.0) + v
            elif not key.endswith("_max"):
                sums[key + "_x_tokens"] = sums.get(key + "_x_tokens", 0.0) + v * tok
    sums, prox = _last_stage_to_all((sums, [fused.get(k) for k in range(len(micro_batches))]))
    out: dict[str, Any] = dict(sums, grad_norm=norm)
    if prox_from_update:
        out["prox_logp"] = prox
    return out


def _ddp_sum_factor(mm: MegatronModel) -> int:
    """What a loss is multiplied by so that DDP's reduction sums: it scales gradients by 1/(data x context parallel
    size) before summing them (megatron's DDP with average_in_collective off, experts included); 1 without DDP."""
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_world_size(with_context_parallel=True) if mm.ddp is not None else 1


def _ddp_step(mm: MegatronModel, optimizer: Any, batches: list[Rows], loss_func_for) -> tuple[list[Any], float]:
    """Megatron-LM's step: zero DDP's grad buffers, run the schedule, finalize_model_grads (DP reduce-scatter, q/k-norm
    grads over TP, a tied embedding over the pipeline), then megatron's optimizer step (grad norm, clip, Adam on the
    float32 main weights, all-gather of the updated parameters). Returns the loss dicts and the grad norm before
    clipping (nan when float16's loss scaler skipped the step on an overflow)."""
    from megatron.core.distributed import finalize_model_grads

    mm.ddp.zero_grad_buffer()
    optimizer.zero_grad()
    with mm.compat():
        found = _schedule(mm, batches, loss_func_for, forward_only=False)
        finalize_model_grads([mm.ddp])
        ok, norm, _ = optimizer.step()
    return found, float(norm) if ok and norm is not None else float("nan")
