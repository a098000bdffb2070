"""Trainer set-up: process group, model (FSDP2; PEFT LoRA adapters with algorithm.lora; or megatron-core), reference model,
data set size, optimizer, schedule, ticket book.

A mixin of `Trainer` (runtime/kuberl/runtime/trainer/trainer.py), which owns the state these methods read and set.
"""

from __future__ import annotations

import logging

import torch

from kuberl.runtime.errors import spec_errors
from kuberl.runtime.evaluation import EvalSchedule
from kuberl.runtime.trainer import dist as D
from kuberl.runtime.trainer.attention import choose_attention
from kuberl.runtime.trainer.context_parallel import enable as enable_context_parallel
from kuberl.runtime.trainer.context_parallel import setup_context_parallel
from kuberl.runtime.trainer.memory import choose_gradient_checkpointing
from kuberl.runtime.trainer.optim import build_optimizer, build_scheduler
from kuberl.runtime.trainer.tickets import TicketBook

log = logging.getLogger("kuberl.trainer")


def wrap_lora(model: torch.nn.Module, lora) -> torch.nn.Module:
    """The model wrapped with PEFT LoRA adapters (spec.algorithm.lora): base weights frozen, adapters trainable.

    The adapters start as the identity (B = 0), so the wrapped model is the base model until the first update.
    """
    from peft import LoraConfig, get_peft_model

    alpha = int(lora.alpha) if float(lora.alpha).is_integer() else lora.alpha
    config = LoraConfig(r=lora.rank, lora_alpha=alpha, target_modules=list(lora.target_modules), lora_dropout=lora.dropout,
                        bias="none", task_type="CAUSAL_LM")
    try:
        return get_peft_model(model, config)
    except ValueError as exc:
        raise ValueError(f"algorithm.lora.targetModules {list(lora.target_modules)}: {exc}") from exc


class SetUpMixin:
    """`setup()`: everything a step needs, built once per rank before the loop (then `_resume`, in persist.py)."""

    def setup(self) -> None:
        """Process group, model (FSDP2), optimizer, schedule, ticket book; then resume from `latest`.

        A model or data set the spec names but that cannot be had raises ConfigError (exit code 2).
        """
        from transformers import AutoModelForCausalLM

        from kuberl.runtime.data import load_items
        from kuberl.runtime.models import resolve_model

        self.info = getattr(self, "info", None) or D.init_distributed()
        # trainer.parallelism.context: Ulysses sequence parallel over consecutive ranks (context_parallel.py); megatron builds its own (megatron/context.py).
        self.context_parallel = None if self.megatron else setup_context_parallel(self.info.rank, self.info.world_size,
                                                                                   self.spec.trainer.parallelism.context)
        if self.context_parallel is not None and self.info.is_main:
            cp = self.context_parallel
            log.info("context parallel %d (Ulysses): %d data-parallel replica(s) of %d ranks, each feeding 1/%d of every packed row",
                     cp.size, cp.dp_size, cp.size, cp.size)
            if self.spec.trainer.packing == "off":
                log.warning("trainer.packing off: context parallel always packs (its one path), so the rows are packed")
        if self.info.is_main:
            for note in self.cfg.notes:
                log.info("algorithm: %s", note)
            self.warn_stale_drop()  # collect.py: staleness.dropStaleGroups biases training toward short answers
        with spec_errors():  # model.path not on the volume, no config.json, an unknown builtin...
            self.model_dir = resolve_model(self.spec.model, self.workdir)
        on_gpu = self.info.device.type != "cpu"  # cuda, or npu on Ascend (dist.choose_device)
        # Master weights in float32; on CPU everything stays float32 (bf16 matmuls are slow or unsupported here).
        param_dtype = getattr(torch, self.spec.model.dtype) if on_gpu else None
        torch.manual_seed(self.spec.seed)

        lora = self.spec.algorithm.lora
        attention = None if self.megatron else self._choose_attention()

        def prepare(m: torch.nn.Module) -> None:
            if self.context_parallel is not None:
                enable_context_parallel(m, self.context_parallel)  # the heads must divide: ConfigError (exit 2) naming the field

        def adapt(m: torch.nn.Module) -> torch.nn.Module:
            with spec_errors():  # a targetModules name the model does not have
                return wrap_lora(m, lora)

        def load(adapters: bool = False) -> torch.nn.Module:
            wrap = adapt if adapters else None
            if D.shards(self.info, param_dtype):  # FSDP2: each rank allocates only its shard (of the base and the adapters)
                return D.load_sharded(self.model_dir, self.info, param_dtype, attention=attention, prepare=prepare, wrap=wrap)
            # One rank in float32: nothing to shard.
            m = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32, attn_implementation=attention).to(self.info.device)
            prepare(m)
            return wrap(m) if wrap is not None else m

        if self.megatron:  # megatron-core GPTModel shards (megatron/backend.py)
            self.setup_megatron_model()
        else:
            self.model = load(adapters=lora is not None)
            self.gradient_checkpointing, why = choose_gradient_checkpointing(self.spec.trainer, self.model, self.info.device,
                                                                             self.info.world_size)
            if self.info.is_main:
                log.info("trainer.gradientCheckpointing %s (%s)", "on" if self.gradient_checkpointing else "off", why)
            if self.gradient_checkpointing:
                # transformers' default is non-reentrant checkpointing: adapters get gradients behind frozen embeddings
                self.model.gradient_checkpointing_enable()
            self.ref_model = None
            if self.cfg.kl_coef > 0:  # the initial policy: with LoRA, the base model (zero adapters)
                self.ref_model = load().eval().requires_grad_(False)
        with spec_errors():  # dataset.path missing, a row without promptField/answerField...
            items = load_items(self.spec.dataset, self.spec.seed)
        self.total_steps = self._total_steps(len(items))
        optimizer_steps = self.total_steps * self.spec.algorithm.ppo_minibatches
        if self.megatron:  # megatron-core's distributed optimizer (megatron/optim.py)
            self.optimizer, self.scheduler = self.megatron_optimizer(optimizer_steps)
        else:
            self.optimizer = build_optimizer(self.model, self.spec.algorithm)
            self.scheduler = build_scheduler(self.optimizer, self.spec.algorithm.optimizer, optimizer_steps)
        self.book = TicketBook(
            self._num_items, self.B, self.eta, seed=self.spec.seed,
            shuffle=self.spec.dataset.shuffle, max_concurrent=self.spec.staleness.max_concurrent_rollouts,
            total_groups=self.total_steps * self.B,
        )
        with spec_errors():  # spec.evaluation: its split or file missing or empty
            self.evals = EvalSchedule.from_experiment(self.spec, self.total_steps) if self.info.is_main else None
        self.resumed_from = self._resume()
        self.setup_checkpoints()  # persist.py: checkpoint.asyncSave

    def _choose_attention(self) -> str:
        """trainer.attention for this rank's device (attention.choose_attention: ConfigError where it cannot run), logged."""
        impl, why = choose_attention(self.spec.trainer.attention, self.info.device, self.spec.model.dtype,
                                     context_parallel=self.context_parallel is not None)
        if self.info.is_main:
            log.info("trainer.attention %s: %s (%s)", self.spec.trainer.attention, impl, why)
        return impl

    def _total_steps(self, num_items: int) -> int:
        self._num_items = num_items
        t = self.spec.training
        steps = t.total_steps if t.total_steps is not None else max(1, (t.epochs * num_items) // self.B)
        return min(steps, self.max_steps) if self.max_steps is not None else steps
