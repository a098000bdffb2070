"""Trainer compute stages on every rank: log pi_prox (and pi_ref), advantages, the decoupled PPO update.

A mixin of `Trainer` (runtime/kuberl/runtime/trainer/trainer.py), which owns the model, optimizer and schedule.
"""

from __future__ import annotations

import logging

import torch

from kuberl.runtime.algorithms import compute_token_advantages, loss_denominator, ppo_actor_loss, shape_rewards
from kuberl.runtime.trainer import dist as D
from kuberl.runtime.trainer.batch import RolloutBatch, minibatch_rows, response_logprobs, shard_micro_batches
from kuberl.runtime.trainer.packing import fsdp_root, use_packing

log = logging.getLogger("kuberl.trainer")


class ComputeMixin:
    """train.prox_logp, train.advantages, train.ppo_update: the same calls on every rank (FSDP2 collectives)."""

    def stage_prox_logp(self, batch: RolloutBatch) -> None:
        """train.prox_logp: log pi_prox with the pre-update weights (and log pi_ref with a KL term).

        One no-grad forward in eval mode (dropout off), or none at all where the update's own forward
        gives the same numbers (`prox_in_update`): then stage_ppo_update takes pi_prox from it.
        """
        if self.megatron:
            self.megatron_prox_logp(batch)
            return
        rows = list(range(batch.num_samples))
        width = batch.loss_mask.shape[1]
        batch.extra["prox_in_update"] = self.prox_in_update()
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                if not batch.extra["prox_in_update"]:
                    batch.prox_logp = self._logprobs_all_rows(self.model, batch, rows, width)
                if self.ref_model is not None:
                    batch.ref_logp = self._logprobs_all_rows(self.ref_model, batch, rows, width)
        finally:
            self.model.train(was_training)

    def prox_in_update(self) -> bool:
        """True when pi_prox needs no forward of its own: one PPO minibatch (every micro-batch of the update
        runs at the pre-update weights), no dropout (train-mode logits equal eval-mode ones) and no KL in
        the reward (the advantages need pi_prox before the update). Then log pi_prox is the update's own
        log pi_theta, detached: the same numbers, one forward pass fewer per step."""
        if self.spec.algorithm.ppo_minibatches != 1 or self.cfg.kl_in_reward:
            return False
        if not hasattr(self, "_dropout"):
            self._dropout = _has_dropout(self.model)
        return not self._dropout

    @property
    def cp(self):
        """The context-parallel layout (context_parallel.ContextParallel), or None at trainer.parallelism.context 1."""
        return getattr(self, "context_parallel", None)

    def _micro_batches(self, batch: RolloutBatch, rows: list[int], packed: bool) -> list[list[int] | None]:
        """This rank's micro-batches: rows are dealt to the data-parallel replicas; the ranks of a CP group share theirs."""
        cp = self.cp
        dp_rank, dp_size = (cp.dp_rank, cp.dp_size) if cp else (self.info.rank, self.info.world_size)
        return shard_micro_batches(batch.seq_lens, rows, self.spec.trainer.micro_batch_tokens, dp_rank, dp_size, packed=packed)

    def _packed(self, batch: RolloutBatch, model: torch.nn.Module) -> bool:
        """trainer.packing for this batch; context parallel always packs (its one path)."""
        return self.cp is not None or use_packing(self.spec.trainer.packing, batch.prompts, batch.outputs, model)

    def _logprobs_all_rows(self, model: torch.nn.Module, batch: RolloutBatch, rows: list[int], width: int) -> torch.Tensor:
        out = torch.zeros(batch.num_samples, width)
        packed = self._packed(batch, model)
        lead = self.cp is None or self.cp.lead  # each row filled by one rank of the world: CP rank 0 of its replica
        for mb in self._micro_batches(batch, rows, packed):
            idx = mb if mb is not None else rows[:1]  # filler: same collectives, result discarded
            lp = response_logprobs(model, [batch.prompts[i] for i in idx], [batch.outputs[i] for i in idx], width,
                                   temperature=self.cfg_temperature, device=self.info.device, packed=packed, cp=self.cp).cpu()
            if mb is not None and lead:
                out[mb] = lp
        if self.info.world_size > 1:
            t = out.to(self.info.device)
            torch.distributed.all_reduce(t)  # each row was computed by exactly one rank
            out = t.cpu()
        return out

    def _gradient_sync(self, *, last: bool) -> None:
        """FSDP2: reduce-scatter the gradients only in the backward of an optimizer step's last micro-batch; the others
        accumulate unsharded (set_requires_gradient_sync False), one communication per step instead of one per micro-batch.
        The sum is the same: each micro-batch's loss is scaled for the average FSDP takes once. Where the unsharded
        gradients would not fit (defer_gradient_sync), every micro-batch syncs as before."""
        if not hasattr(self, "_sync_root"):
            self._sync_root = fsdp_root(self.model)
            if self._sync_root is not None:
                defer, why = defer_gradient_sync(self.model, self.info.device)
                self._sync_root = self._sync_root if defer else None
                if self.info.is_main:
                    log.info("gradient sync %s (%s)", "once per optimizer step" if defer else "every micro-batch", why)
        if self._sync_root is not None:
            self._sync_root.set_requires_gradient_sync(last)

    @property
    def cfg_temperature(self) -> float:
        return self.spec.algorithm.temperature

    def stage_advantages(self, batch: RolloutBatch) -> None:
        """train.advantages: shaped rewards -> per-token advantages [N, T] (same on every rank)."""
        shaped = shape_rewards(batch.rewards, batch.response_lengths(), self.cfg)
        kl = None
        if self.cfg.kl_in_reward:
            kl = batch.prox_logp - batch.ref_logp
        batch.advantages = compute_token_advantages(shaped, batch.loss_mask, self.cfg, kl=kl, group_sizes=batch.group_sizes)

    def stage_ppo_update(self, batch: RolloutBatch) -> dict[str, float]:
        """train.ppo_update: algorithm.ppoMinibatches optimizer steps of the decoupled PPO loss."""
        if self.megatron:
            return self.megatron_ppo_update(batch)
        self.model.train()
        width = batch.loss_mask.shape[1]
        fused_prox = torch.zeros(batch.num_samples, width) if batch.extra.get("prox_in_update") else None
        sums: dict[str, float] = {}
        token_total = 0.0
        grad_norms, losses = [], []
        packed = self._packed(batch, self.model)
        # Under context parallel every CP rank computes its replica's whole loss (context_parallel.gather_tokens): its
        # statistics and pi_prox rows count once, from CP rank 0.
        lead = self.cp is None or self.cp.lead
        for rows in minibatch_rows(batch.num_groups, batch.group_sizes, self.spec.algorithm.ppo_minibatches):
            denom = loss_denominator(batch.loss_mask[rows], self.cfg)
            mb_loss = 0.0
            micro = self._micro_batches(batch, rows, packed)
            for k, mb in enumerate(micro):
                self._gradient_sync(last=k == len(micro) - 1)  # the optimizer step's gradients, reduce-scattered once
                idx = mb if mb is not None else rows[:1]
                logp, ent = response_logprobs(self.model, [batch.prompts[i] for i in idx], [batch.outputs[i] for i in idx], width,
                                              temperature=self.cfg_temperature, device=self.info.device, entropy=True, packed=packed,
                                              cp=self.cp)
                prox, behave, adv, mask, ref = (None if t is None else t[idx].to(self.info.device) for t in
                                                (batch.prox_logp, batch.behave_logp, batch.advantages, batch.loss_mask, batch.ref_logp))
                if fused_prox is not None:  # pre-update weights (one minibatch): pi_prox is this forward, detached
                    prox = logp.detach()
                    if mb is not None and lead:
                        fused_prox[mb] = prox.cpu()
                loss, st = ppo_actor_loss(logp, prox, behave, adv, mask, self.cfg, ref_logp=ref, denominator=denom)
                # FSDP averages gradients over ranks; the loss is a sum over the whole minibatch, so undo it. (Under context
                # parallel each CP rank's gradient is that of its own tokens' part of the loss: summed, the replica's.)
                scale = float(self.info.world_size) if mb is not None else 0.0
                (loss * scale).backward()
                if mb is not None:
                    mb_loss += st["loss"]
                    tok = st["tokens"]
                    token_total += tok
                    # Policy entropy from this forward (no extra pass): token mean over loss tokens, below.
                    sums["entropy"] = sums.get("entropy", 0.0) + float((ent * mask).sum())
                    for k, v in st.items():
                        if k not in ("loss", "tokens", "sequences", "entropy") and not k.endswith("_max"):
                            sums[k] = sums.get(k, 0.0) + v * tok
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.spec.algorithm.optimizer.grad_clip)
            norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            grad_norms.append(float(norm))
            losses.append(mb_loss)
        if fused_prox is not None:  # every row's pi_prox on every rank, as the separate forward gives it
            batch.prox_logp = D.all_reduce_rows(fused_prox, self.info)
        if not lead:  # the same numbers as CP rank 0's: counted there only (the same keys on every rank for the all-reduce)
            token_total, losses, sums = 0.0, [0.0] * len(losses), dict.fromkeys(sums, 0.0)
        totals = D.all_reduce_sum([token_total, sum(losses)] + [sums[k] for k in sorted(sums)], self.info)
        tokens = max(totals[0], 1.0)
        out = {k: v / tokens for k, v in zip(sorted(sums), totals[2:])}
        out.update(loss=totals[1] / max(len(losses), 1), grad_norm=sum(grad_norms) / len(grad_norms),
                   lr=self.scheduler.get_last_lr()[0], tokens=totals[0])
        return out


def _has_dropout(model: torch.nn.Module) -> bool:
    """Whether training mode changes the model's outputs: a dropout layer or a dropout rate in its config."""
    if any(isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0 for m in model.modules()):
        return True
    config = getattr(model, "config", None)
    rates = [getattr(config, k, 0.0) for k in ("attention_dropout", "hidden_dropout", "dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop")]
    return any(isinstance(r, (int, float)) and r > 0 for r in rates)


# Defer the gradient reduce-scatter only where the unsharded float32 gradients kept between micro-batches take at most
# this share of the accelerator's memory (a 1.5B model on an 80 GB GPU: 6 GB, 7.5%; 7B: 28 GB, deferred no more).
DEFER_SYNC_MAX_SHARE = 0.10


def defer_gradient_sync(model: torch.nn.Module, device: torch.device) -> tuple[bool, str]:
    """(whether to defer an FSDP2 model's gradient sync to the last micro-batch, why). Deferring keeps every trainable
    parameter's full gradient (float32) on each rank between micro-batches, so only where that fits easily: on CPU
    (host memory), or within DEFER_SYNC_MAX_SHARE of a CUDA device's memory."""
    grad_bytes = 4 * sum(p.numel() for p in model.parameters() if p.requires_grad)  # a DTensor's numel is the full one
    if device.type == "cpu":
        return True, f"{grad_bytes / 2**30:.2f} GiB of unsharded gradients in host memory"
    if device.type != "cuda":
        return False, f"no memory figure for {device.type}"
    total = torch.cuda.get_device_properties(device).total_memory
    why = f"unsharded gradients {grad_bytes / 2**30:.1f} GiB, {grad_bytes / total:.0%} of the GPU; deferred up to {DEFER_SYNC_MAX_SHARE:.0%}"
    return grad_bytes <= DEFER_SYNC_MAX_SHARE * total, why
