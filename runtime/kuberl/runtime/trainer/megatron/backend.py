"""The Trainer's Megatron path (trainer.backend megatron, issue #13): the stages' work on a megatron-core GPTModel.

A mixin of `Trainer` (runtime/kuberl/runtime/trainer/trainer.py). The FSDP stages (setup_model.py, compute.py,
persist.py) hand over to these methods when `self.megatron`; everything else (tickets, collect, advantages,
reports, the bus) is the same code for both backends.

Layout: tensor x pipeline x context from trainer.parallelism, data parallel over the rest (world / (tp * pp * cp)),
megatron's groups over the trainer's default process group (model.init_parallel); with `expert` > 1 (a MoE
model) each expert lives on one of `expert` data-parallel ranks (expert data parallel = dp / expert). Every
rank of one tensor/pipeline/context group computes the same rows (a context-parallel rank its share of every
sequence's positions, context.py); rows are split over the data-parallel ranks (each row is scored and trained
by exactly one DP replica), whose gradients model.train_step sums (over data x context parallel). CP ranks hold
the same weights: CP rank 0 alone publishes and checkpoints. Published weights
are gathered one parameter at a time: an all-gather within the TP group (an expert's also within its EP
group), then (pipeline stages other than the first) sent to global rank 0, which writes them as HF tensors
(convert.merge_tp + full_to_hf) into weights/v{N}. The optimizer is megatron-core's distributed optimizer over
megatron's DDP (optim.py): on a GPU the model computes in model.dtype (bf16/fp16) with float32 main weights; on the
CPU in float32. trainer.gradientCheckpointing: megatron's full recomputation of every layer (model.RECOMPUTE).
Checkpoints: each (tp, pp, ep) rank of expert-data-parallel replica 0 saves its own model shard, every rank its slice
of the optimizer state (optim.save_shard); resuming needs the same tensor, pipeline and expert sizes (any
data-parallel size). The final weight hash gathers one parameter at a time (digest.py).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from kuberl.runtime.algorithms import loss_denominator
from kuberl.runtime.errors import ConfigError, spec_errors
from kuberl.runtime.trainer import checkpoint as ck
from kuberl.runtime.trainer import dist as D
from kuberl.runtime.trainer.batch import RolloutBatch, minibatch_rows, plan_micro_batches
from kuberl.runtime.trainer.megatron.consolidate import LAYOUT_FILE, read_layout, shard_file

__all__ = ["LAYOUT_FILE", "MegatronMixin", "check_megatron_spec", "read_layout"]

log = logging.getLogger("kuberl.trainer")



def check_megatron_spec(spec: Any) -> None:
    """ConfigError for what the Megatron path does not do (yet), naming the field; called by Trainer.__init__."""
    if spec.algorithm.lora is not None:
        raise ConfigError("algorithm.lora: LoRA adapters are trained by trainer.backend fsdp only; remove algorithm.lora or use fsdp")
    if spec.weight_sync.mode == "broadcast":
        raise ConfigError("weightSync.mode broadcast is not implemented for trainer.backend megatron: use weightSync.mode disk or bus")
    p = spec.trainer.parallelism
    if p.context > 1 and p.expert > 1:
        raise ConfigError(f"trainer.parallelism.context {p.context} with expert {p.expert}: context parallel of a mixture-of-experts model "
                          "is not implemented for trainer.backend megatron; use context 1 or expert 1")


class MegatronMixin:
    """Set-up, pi_prox, PPO update, weights out, checkpoint in and out for trainer.backend megatron (collectives: every rank calls)."""

    @property
    def megatron(self) -> bool:
        return self.spec.trainer.backend == "megatron"

    # ---- set-up ----------------------------------------------------------------------------------------------

    def setup_megatron_model(self) -> None:
        """megatron's process groups, this rank's GPTModel (self.mm; self.model is its module, for the optimizer) and,
        with a KL term, a frozen reference copy (self.ref_mm)."""
        from megatron.core import parallel_state as ps

        from kuberl.runtime.trainer.megatron import convert
        from kuberl.runtime.trainer.megatron.model import RECOMPUTE, build_model, init_parallel

        p, world = self.spec.trainer.parallelism, self.info.world_size
        tp, pp, ep, cp = p.tensor, p.pipeline, p.expert, p.context
        if world % (tp * pp * cp):
            raise ConfigError(f"trainer.parallelism tensor {tp} x pipeline {pp} x context {cp} does not divide the trainer's {world} processes "
                              "(nodes * accelerator.count)")
        if (world // (tp * pp * cp)) % ep:
            raise ConfigError(f"trainer.parallelism.expert {ep} does not divide the data-parallel size {world // (tp * pp * cp)} "
                              f"({world} processes / (tensor {tp} x pipeline {pp} x context {cp}))")
        with spec_errors():
            shape = convert.model_shape(_hf_config(self.model_dir))
        model = self.spec.model.id or self.spec.model.builtin or self.spec.model.path
        if ep > 1 and shape.moe is None:  # admission cannot tell: it does not read the model
            raise ConfigError(f"trainer.parallelism.expert {ep} needs a mixture-of-experts model; {shape.model_type} ({model}) is dense: use expert 1")
        if cp > 1 and shape.moe is not None:
            raise ConfigError(f"trainer.parallelism.context {cp}: context parallel of a mixture-of-experts model ({shape.model_type}, {model}) "
                              "is not implemented for trainer.backend megatron; use context 1")
        init_parallel(tp, pp, ep, cp_size=cp, device=self.info.device, seed=self.spec.seed)
        dtype = self._megatron_dtype()
        self.gradient_checkpointing, why = self._megatron_recompute(shape)
        if self.info.is_main:
            log.info("trainer.gradientCheckpointing %s (%s)%s", "on" if self.gradient_checkpointing else "off", why,
                     ": megatron recompute_granularity full, method uniform, 1 layer" if self.gradient_checkpointing else "")
        with spec_errors():  # a model type or head count megatron cannot cut (convert.model_shape / check_parallel)
            self.mm = build_model(str(self.model_dir), device=self.info.device, dtype=dtype, **(RECOMPUTE if self.gradient_checkpointing else {}))
            self.ref_mm = None
            if self.cfg.kl_coef > 0:  # the initial policy
                self.ref_mm = build_model(str(self.model_dir), device=self.info.device, dtype=dtype)
                self.ref_mm.module.eval().requires_grad_(False)
        self.model, self.ref_model = self.mm.module, None
        if self.info.is_main:
            log.info("megatron: tensor %d x pipeline %d x context %d x data %d (expert %d) over %d processes", ps.get_tensor_model_parallel_world_size(),
                     ps.get_pipeline_model_parallel_world_size(), ps.get_context_parallel_world_size(), ps.get_data_parallel_world_size(),
                     ps.get_expert_model_parallel_world_size(), world)

    def _megatron_dtype(self) -> torch.dtype:
        """model.dtype on a GPU (bf16/fp16 compute, float32 main weights in the optimizer); float32 on the CPU, as the
        FSDP path (bf16 matmuls there are slow or unsupported), said in a log line."""
        want = getattr(torch, self.spec.model.dtype)
        if self.info.device.type == "cpu":
            if want != torch.float32 and self.info.is_main:
                log.info("megatron: model.dtype %s computes in float32 on the CPU (mixed precision is for GPUs)", self.spec.model.dtype)
            return torch.float32
        return want

    def _megatron_recompute(self, shape: Any) -> tuple[bool, str]:
        """trainer.gradientCheckpointing, or unset: memory.step_memory_gib's estimate for the model (FSDP's, over the
        trainer's ranks) against the accelerator's memory, as choose_gradient_checkpointing decides for FSDP."""
        from kuberl.runtime.trainer.memory import CHECKPOINTING_FIT, memory_gib, step_memory_gib

        t = self.spec.trainer
        if t.gradient_checkpointing is not None:
            return t.gradient_checkpointing, "set in the manifest"
        total = memory_gib(self.info.device)
        if total is None:
            return False, f"unset: off on {self.info.device.type}"
        need = step_memory_gib(_param_count(self.model_dir), shape.num_layers, shape.hidden, shape.vocab, t.micro_batch_tokens, self.info.world_size)
        on = need > CHECKPOINTING_FIT * total[1]
        return on, f"unset: a step without it estimated at {need:.1f} GiB of the {total[1]:.1f} GiB {self.info.device.type}"

    def megatron_optimizer(self, total_optimizer_steps: int) -> tuple[Any, Any]:
        """megatron's distributed optimizer over this rank's model (optim.build_optimizer) and the trainer's LR schedule on it."""
        from kuberl.runtime.trainer.megatron.optim import MegatronLR, build_optimizer, distributed, master_dtypes

        opt = build_optimizer(self.mm, self.spec.algorithm)
        if self.info.is_main:
            how = (f"distributed optimizer, its state sharded over {self._dp()[1]} data-parallel rank(s)" if distributed(self.spec.algorithm)
                   else "non-distributed optimizer (megatron-core shards only adam and adamw)")
            log.info("megatron: %s; parameters %s, optimizer main weights %s", how, next(self.mm.module.parameters()).dtype,
                     sorted(str(d) for d in master_dtypes(opt)))
        return opt, MegatronLR(opt, self.spec.algorithm.optimizer, total_optimizer_steps)

    # ---- pi_prox and the update ------------------------------------------------------------------------------

    def _dp(self) -> tuple[int, int, Any]:
        from megatron.core import parallel_state as ps

        return ps.get_data_parallel_rank(), ps.get_data_parallel_world_size(), ps.get_data_parallel_group()

    def _dp_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over the data-parallel ranks (the TP/PP/CP ranks of one replica hold the same numbers: not summed)."""
        _, size, group = self._dp()
        if size > 1:
            t = t.to(self.info.device)
            dist.all_reduce(t, group=group)
        return t.cpu()

    def megatron_prox_logp(self, batch: RolloutBatch) -> None:
        """train.prox_logp: as ComputeMixin.stage_prox_logp, each DP rank scoring its own rows."""
        width = batch.loss_mask.shape[1]
        batch.extra["prox_in_update"] = self.prox_in_update()
        if not batch.extra["prox_in_update"]:
            batch.prox_logp = self._megatron_logprobs(self.mm, batch, width)
        if self.ref_mm is not None:
            batch.ref_logp = self._megatron_logprobs(self.ref_mm, batch, width)

    def _megatron_logprobs(self, mm: Any, batch: RolloutBatch, width: int) -> torch.Tensor:
        from megatron.core import parallel_state as ps

        from kuberl.runtime.trainer.megatron.model import response_logprobs

        dp_rank, dp, _ = self._dp()
        mine = list(range(batch.num_samples))[dp_rank::dp]
        out = torch.zeros(batch.num_samples, width)
        # the same on every rank of this replica's TP/PP/CP group: they run the forward together; under expert
        # parallelism a replica without rows still joins its expert group's forwards (with fillers)
        if mine or ps.get_expert_model_parallel_world_size() > 1:
            plans = plan_micro_batches([batch.seq_lens[i] for i in mine], range(len(mine)), self.spec.trainer.micro_batch_tokens)
            was_training = mm.module.training
            mm.module.eval()
            try:
                out[mine] = response_logprobs(mm, [batch.prompts[i] for i in mine], [batch.outputs[i] for i in mine], width,
                                              temperature=self.cfg_temperature, micro_batches=plans)
            finally:
                mm.module.train(was_training)
        return self._dp_sum(out)

    def megatron_ppo_update(self, batch: RolloutBatch) -> dict[str, float]:
        """train.ppo_update: algorithm.ppoMinibatches optimizer steps through model.train_step; the same stats as the FSDP path.

        A minibatch's rows are dealt to the DP ranks (row k to rank k mod dp); a rank left without rows trains a
        filler row with an all-zero loss mask (zero loss and gradient), since the gradient sum needs every DP rank.
        """
        from kuberl.runtime.trainer.megatron.model import MicroBatch, train_step

        dp_rank, dp, _ = self._dp()
        width = batch.loss_mask.shape[1]
        fused = bool(batch.extra.get("prox_in_update"))
        fused_prox = torch.zeros(batch.num_samples, width) if fused else None
        sums: dict[str, float] = {}
        token_total, losses, grad_norms = 0.0, [], []
        for rows in minibatch_rows(batch.num_groups, batch.group_sizes, self.spec.algorithm.ppo_minibatches):
            denom = loss_denominator(batch.loss_mask[rows], self.cfg)  # the whole minibatch's, over every DP rank
            mine = rows[dp_rank::dp]
            filler = not mine
            idx = mine or rows[:1]
            plans = [[idx[j] for j in plan] for plan in
                     plan_micro_batches([batch.seq_lens[i] for i in idx], range(len(idx)), self.spec.trainer.micro_batch_tokens)]

            def rows_of(t: torch.Tensor | None, sel: list[int]) -> torch.Tensor | None:
                return None if t is None else t[sel]

            mbs = [MicroBatch(prompts=[batch.prompts[i] for i in sel], outputs=[batch.outputs[i] for i in sel],
                              loss_mask=batch.loss_mask[sel] * (0.0 if filler else 1.0), behave_logp=batch.behave_logp[sel],
                              advantages=batch.advantages[sel], prox_logp=None if fused else rows_of(batch.prox_logp, sel),
                              ref_logp=rows_of(batch.ref_logp, sel)) for sel in plans]
            st = train_step(self.mm, self.optimizer, mbs, self.cfg, denominator=denom, temperature=self.cfg_temperature,
                            grad_clip=self.spec.algorithm.optimizer.grad_clip, prox_from_update=fused)
            self.scheduler.step()
            if fused and not filler:
                for sel, prox in zip(plans, st["prox_logp"]):
                    fused_prox[sel] = prox
            grad_norms.append(float(st["grad_norm"]))
            losses.append(st["loss"])
            token_total += st["tokens"]
            sums["entropy"] = sums.get("entropy", 0.0) + st["entropy_x_tokens"]
            for k, v in st.items():
                if k.endswith("_x_tokens") and k != "entropy_x_tokens":
                    sums[k[: -len("_x_tokens")]] = sums.get(k[: -len("_x_tokens")], 0.0) + v
        if fused_prox is not None:  # every row's pi_prox on every rank, as the separate forward gives it
            batch.prox_logp = self._dp_sum(fused_prox)
        keys = sorted(sums)
        totals = self._dp_sum(torch.tensor([token_total, sum(losses)] + [sums[k] for k in keys], dtype=torch.float64)).tolist()
        tokens = max(totals[0], 1.0)
        out = {k: v / tokens for k, v in zip(keys, totals[2:])}
        out.update(loss=totals[1] / max(len(losses), 1), grad_norm=sum(grad_norms) / len(grad_norms),
                   lr=self.scheduler.get_last_lr()[0], tokens=totals[0])
        return out

    # ---- weights out -----------------------------------------------------------------------------------------

    def _publish_plan(self) -> list[list[tuple[str, tuple[str, ...], tuple[int, ...], torch.dtype]]]:
        """Per pipeline stage: (megatron name, global megatron names, full shape, dtype) of each parameter to publish;
        an expert parameter has one global name per EP rank (its local expert j is expert r * E/ep + j on EP rank r),
        any other one name. Cached: the same every version (an all-gather of names and shapes over the pipeline group, once)."""
        if getattr(self, "_mg_plan", None) is not None:
            return self._mg_plan
        from megatron.core import parallel_state as ps

        from kuberl.runtime.trainer.megatron import convert, convert_moe

        shape, tp, ep = self.mm.shape, ps.get_tensor_model_parallel_world_size(), ps.get_expert_model_parallel_world_size()
        per = shape.moe.num_experts // ep if shape.moe is not None else 0
        offset = convert.stage_layers(shape.num_layers, ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()).start
        mine = []
        for name, p in convert.megatron_names(dict(self.mm.module.named_parameters()), te=False).items():
            if name == "output_layer.weight" and shape.tied:
                continue  # the last stage's copy of a tied embedding
            kind, full = convert.tp_kind(name), list(p.shape)
            if kind == "vocab":
                full[0] = shape.vocab
            elif kind in ("column", "gated"):
                full[0] *= tp
            elif kind == "row":
                full[1] *= tp
            gname = convert.renumber(name, offset)
            gnames = tuple(convert_moe.renumber_expert(gname, r * per) for r in range(ep)) if convert_moe.is_expert(name) else (gname,)
            mine.append((name, gnames, tuple(full), p.dtype))
        stages: list[Any] = [mine]
        if ps.get_pipeline_model_parallel_world_size() > 1:
            stages = [None] * ps.get_pipeline_model_parallel_world_size()
            dist.all_gather_object(stages, mine, group=ps.get_pipeline_model_parallel_group())
        self._mg_plan = stages
        return stages

    def _tp_full(self, name: str, param: torch.Tensor) -> torch.Tensor:
        """Collective over the TP group: megatron parameter `name` of this stage, merged from its TP shards (CPU)."""
        from megatron.core import parallel_state as ps

        from kuberl.runtime.trainer.megatron import convert

        t = param.detach().contiguous()
        parts = [t]
        if ps.get_tensor_model_parallel_world_size() > 1:
            parts = [torch.empty_like(t) for _ in range(ps.get_tensor_model_parallel_world_size())]
            dist.all_gather(parts, t, group=ps.get_tensor_model_parallel_group())
        return convert.merge_tp(name, [x.cpu() for x in parts], self.mm.shape)

    def _ep_parts(self, full: torch.Tensor) -> list[torch.Tensor]:
        """Collective over the EP group: one expert parameter (TP-merged) from every EP rank, in EP-rank order (CPU)."""
        from megatron.core import parallel_state as ps

        ep = ps.get_expert_model_parallel_world_size()
        if ep == 1:
            return [full]
        t = full.to(self.info.device)
        parts = [torch.empty_like(t) for _ in range(ep)]
        dist.all_gather(parts, t, group=ps.get_expert_model_parallel_group())
        return [x.cpu() for x in parts]

    def _hf_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Rank 0: every HF tensor, one megatron parameter at a time (the stages after the first send theirs).
        Other ranks of data-parallel replica 0 take part in the gathers and sends and yield nothing; under expert
        parallelism the other EP ranks of expert-data-parallel replica 0 join the experts' gathers too. Context
        parallel ranks other than 0 hold the same weights as CP rank 0 and take no part."""
        from megatron.core import parallel_state as ps

        from kuberl.runtime.trainer.megatron import convert

        if ps.get_context_parallel_rank() != 0:
            return  # (their own TP/PP groups: the CP rank 0 groups gather and send without them)
        stages, shape = self._publish_plan(), self.mm.shape
        pp_rank, group = ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_group()
        replica0 = self._dp()[0] == 0
        if not replica0 and ps.get_expert_data_parallel_rank() != 0:
            return  # the other replicas hold the same weights
        sender = replica0 and ps.get_tensor_model_parallel_rank() == 0 and pp_rank > 0
        params = convert.megatron_names(dict(self.mm.module.named_parameters()), te=False)
        stage_ranks = dist.get_process_group_ranks(group) if len(stages) > 1 else [0]
        for s, entries in enumerate(stages):
            if not self.info.is_main and s != pp_rank:
                continue
            for name, gnames, full_shape, dtype in entries:
                expert = len(gnames) > 1
                if s == pp_rank:
                    if not (replica0 or expert):
                        continue  # a dense parameter: data-parallel replica 0 alone
                    parts = [self._tp_full(name, params[name])]
                    if expert:
                        parts = self._ep_parts(parts[0])
                    if sender:
                        for t in parts:
                            dist.send(t.to(self.info.device), dst=0)
                else:  # rank 0, a later stage's parameter
                    parts = []
                    for _ in gnames:
                        t = torch.empty(full_shape, dtype=dtype, device=self.info.device)
                        dist.recv(t, src=stage_ranks[s])
                        parts.append(t.cpu())
                if self.info.is_main:
                    for gname, full in zip(gnames, parts):
                        # A tied LM head is not among them: written once, under the embedding's name, as the FSDP path
                        # (weights.written_entries) and save_pretrained write it; engines tie it on load.
                        yield from convert.full_to_hf({gname: full}, shape).items()

    def _hf_sizes(self, dtype: torch.dtype | None) -> list[tuple[str, int]]:
        """(HF name, bytes) of everything _hf_tensors yields, in its order (from shapes alone: meta tensors)."""
        from kuberl.runtime.trainer.megatron import convert
        from kuberl.runtime.trainer.weights import tensor_nbytes

        out = []
        for entries in self._publish_plan():
            for _, gnames, full_shape, pdtype in entries:
                for gname in gnames:
                    for hname, t in convert.full_to_hf({gname: torch.empty(full_shape, dtype=pdtype, device="meta")}, self.mm.shape).items():
                        out.append((hname, tensor_nbytes(t, dtype)))
        return out

    def megatron_export_weights(self, dtype: torch.dtype, stats: dict) -> Path | None:
        """Collective: weights/v{version} in HF layout (the names vLLM loads), written by rank 0 in shards of weightSync.bucketMB."""
        from kuberl.runtime.trainer.weights import write_weights_streamed

        tensors = self._hf_tensors()
        if not self.info.is_main:
            for _ in tensors:
                pass
            return None
        return write_weights_streamed(self._hf_sizes(dtype), tensors, self.weights_root, self.version, shard_bytes=self.spec.weight_sync.bucket_mb << 20,
                                      source_dir=self.model_dir, dtype=dtype, keep=3, stats=stats, durable=False)

    def megatron_digest(self) -> str:
        """Collective, every rank: weights.digest_state of the trained HF tensors, gathered one parameter at a time (digest.py)."""
        from kuberl.runtime.trainer.megatron import convert
        from kuberl.runtime.trainer.megatron.digest import StreamedHF
        from kuberl.runtime.trainer.weights import digest_state

        params = convert.megatron_names(dict(self.mm.module.named_parameters()), te=False)
        return digest_state(StreamedHF(self.mm, self._publish_plan(), params, self._tp_full, self._ep_parts, self.info.device))

    # ---- checkpoints -----------------------------------------------------------------------------------------

    def _shard_file(self) -> str:
        from megatron.core import parallel_state as ps

        return shard_file(ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(), ps.get_expert_model_parallel_rank(),
                          ps.get_expert_model_parallel_world_size())

    def _coords(self) -> tuple[int, int, int]:
        from megatron.core import parallel_state as ps

        return ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(), ps.get_expert_model_parallel_rank()

    def megatron_write_state(self, root: Path, step: int) -> None:
        """Collective: this checkpoint's tensors into `.tmp-step-N/` (persist.write_state's contract): each (tp, pp, ep) rank
        of expert-DP replica 0 (DP replica 0 without experts; CP rank 0) its model shard, every rank its slice of the
        optimizer state (optim.save_shard) and its RNG state, rank 0 the schedule and the layout."""
        from megatron.core import parallel_state as ps

        from kuberl.runtime.trainer.megatron.optim import save_shard

        info = self.info
        if info.is_main:
            ck.begin_checkpoint(root, step)
        D.barrier(info)
        tmp = ck.tmp_checkpoint_path(root, step)
        ck.write_torch(tmp, f"rng-rank{info.rank}.pt", ck.capture_rng_state())
        # DP replicas hold the same weights and (summed gradients) the same optimizer state; the EP ranks of one
        # expert-data-parallel replica hold different experts (at ep 1 the expert-DP group is the DP x CP group);
        # CP ranks hold the same weights and optimizer state (gradients summed over data x context parallel)
        if ps.get_expert_data_parallel_rank() == 0 and ps.get_context_parallel_rank() == 0:
            ck.write_torch(tmp, self._shard_file(), {"model": self.mm.module.state_dict()})
        save_shard(self.optimizer, self.mm, tmp, info.rank, self._coords(),
                   replica0=ps.get_expert_data_parallel_rank() == 0 and ps.get_context_parallel_rank() == 0)
        if info.is_main:
            ck.write_torch(tmp, "scheduler.pt", self.scheduler.state_dict())
            p = self.spec.trainer.parallelism
            if getattr(self, "_mg_config", None) is None:  # the HF config: consolidate.read_hf_state rebuilds the HF names from it
                self._mg_config = json.loads(_hf_config(self.model_dir).to_json_string())
            ck.write_json(tmp, LAYOUT_FILE, {"tensor": p.tensor, "pipeline": p.pipeline, "expert": p.expert, "context": p.context,
                                             "model": self._mg_config})
        D.barrier(info)

    def megatron_read_state(self, path: Path, layout: dict | None) -> None:
        """This rank's model and optimizer shard of checkpoint `path`; `layout`: its LAYOUT_FILE (rank 0 read it), None if absent."""
        p = self.spec.trainer.parallelism
        if layout is None:
            raise ConfigError(f"checkpoint {path} was written by trainer.backend fsdp; trainer.backend megatron cannot resume it "
                              f"(start a new experiment, or set trainer.backend fsdp)")
        expert = layout.get("expert", 1)  # checkpoints written before expert parallelism: 1
        if (layout["tensor"], layout["pipeline"], expert) != (p.tensor, p.pipeline, p.expert):
            raise ConfigError(f"checkpoint {path} was written with trainer.parallelism tensor {layout['tensor']}, pipeline {layout['pipeline']}, "
                              f"expert {expert}; this trainer runs tensor {p.tensor}, pipeline {p.pipeline}, expert {p.expert}: resume with the "
                              "same tensor, pipeline and expert sizes (data and context parallel may differ)")
        from kuberl.runtime.trainer.megatron.optim import load_shards

        state = ck.read_torch(path, self._shard_file())
        if "optimizer" in state:
            raise ConfigError(f"checkpoint {path} holds a per-rank torch optimizer (written before trainer.backend megatron used megatron-core's "
                              "distributed optimizer): it cannot be resumed; start a new experiment")
        self.mm.module.load_state_dict(state["model"])
        with self.mm.compat():
            load_shards(self.optimizer, self.mm, path, self._coords())


def _param_count(model_dir: Any) -> int:
    """The HF model's parameter count from its config alone (built on the meta device: nothing allocated)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(_hf_config(model_dir))
    return sum(p.numel() for p in model.parameters())


def _hf_config(model_dir: Any) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(model_dir), local_files_only=True)


