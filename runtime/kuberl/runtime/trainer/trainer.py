"""The trainer loop (AReaL style): tickets out, trajectory groups in, decoupled PPO steps, new weights out.

`Trainer(exp, bus_url=..., workdir=...).run()` is what `kuberl trainer` (one process per torchrun rank)
and `kuberl run` call. Stages, in order each step: train.issue_tickets, train.collect, train.prox_logp,
train.advantages, train.ppo_update, train.publish_weights, train.checkpoint, train.report. Rank 0 does
all bus I/O and broadcasts the batch; every rank runs the FSDP2 compute.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import signal
import time
from collections import deque
from pathlib import Path
from typing import Any

import torch

from kuberl.api import RLExperiment
from kuberl.runtime.algorithms import (
    compute_token_advantages,
    dynamic_sampling_keep,
    loss_denominator,
    ppo_actor_loss,
    resolve_algorithm,
    shape_rewards,
)
from kuberl.runtime.bus.metrics import MetricsPublisher
from kuberl.runtime.errors import ConfigError, config_error_exit, spec_errors
from kuberl.runtime.evaluation import EvalSchedule, finish_evaluation
from kuberl.runtime.tracking import Tracking
from kuberl.runtime.trainer import checkpoint as ck
from kuberl.runtime.trainer import dist as D
from kuberl.runtime.trainer.batch import RolloutBatch, build_batch, group_size_error, minibatch_rows, response_logprobs, shard_micro_batches
from kuberl.runtime.trainer.bus_io import TrainerBusIO
from kuberl.runtime.trainer.optim import build_optimizer, build_scheduler
from kuberl.runtime.trainer.tickets import SeenGroups, TicketBook
from kuberl.runtime.trainer.weights import digest_state, export_weights

log = logging.getLogger("kuberl.trainer")

STAGES = ("train.issue_tickets", "train.collect", "train.prox_logp", "train.advantages", "train.ppo_update",
          "train.publish_weights", "train.checkpoint", "train.report")


class Trainer:
    """One trainer rank. Build it, then `asyncio.run(trainer.run())` (returns the exit code).

        exp = load_experiment("experiment.yaml")
        code = asyncio.run(Trainer(exp, bus_url="nats://127.0.0.1:4222", workdir="runs/x").run())
    """

    def __init__(self, exp: RLExperiment, *, bus_url: str, workdir: str | Path, bus_token: str | None = None,
                 max_steps: int | None = None, collect_timeout: float | None = None, handle_sigterm: bool = True):
        self.exp, self.spec = exp, exp.spec
        self.bus_url, self.bus_token = bus_url, bus_token
        self.workdir = Path(workdir)
        if self.spec.trainer.backend != "fsdp":
            # Say so instead of silently training with FSDP: the manifest asked for something else.
            raise ConfigError(f"trainer.backend {self.spec.trainer.backend!r} is not implemented by this trainer yet; use trainer.backend fsdp")
        with spec_errors():
            self.cfg = resolve_algorithm(self.spec.algorithm)
        self.B, self.n = self.spec.algorithm.batch_size, self.cfg.group_size
        self.ragged = self.spec.workflow.export_style == "individual"  # one sample per agent call: groups of >= n samples
        self.eta = self.spec.staleness.max_head_offpolicyness
        self.max_steps = max_steps
        # Give up (failed) when no trajectory arrives for this long; None = wait forever.
        self.collect_timeout = collect_timeout
        # In its own process the trainer turns SIGTERM into "checkpoint and exit"; in-process callers may keep theirs.
        self.handle_sigterm = handle_sigterm
        self.ckpt_root = self.workdir / "checkpoints"
        self.weights_root = self.workdir / "weights"
        self.step = 0
        self.version = 0
        self.dropped_stale = 0
        self.failed_groups = 0  # tickets the agents gave up on (rollout.maxTicketAttempts failed deliveries)
        self.answered_request: str | None = None
        self.held: list[Any] = []  # bus handles of groups trained or accounted, not yet covered by a checkpoint
        self.buffer: list[tuple[Any, Any]] = []  # (group, handle) pulled but not yet trained
        # Far more than can be in flight at once ((eta + 1) * B): a duplicate arrives within that span.
        self.seen = SeenGroups(max(4096, 8 * self.B * (self.eta + 2)))
        self.duplicates = 0
        self.recent: deque[tuple[int, float]] = deque(maxlen=5)  # (samples, seconds) of recent steps
        self.last_checkpoint: dict[str, Any] | None = None
        self.stop_reason: str | None = None
        self.last_numbers: dict[str, Any] = {}  # reward, speed, staleness of the last step, for progress
        self.tracking: Tracking | None = None  # spec.tracking's trackers, rank 0, from the first step's report
        self.evals: EvalSchedule | None = None  # spec.evaluation's rounds (rank 0)
        self.last_row: dict[str, Any] | None = None  # the last metrics.jsonl line
        self.metrics_out: MetricsPublisher | None = None  # every step's row on the bus too (`kuberl plot <experiment>`)

    # ------------------------------------------------------------------------------------------
    # set-up
    # ------------------------------------------------------------------------------------------

    def setup(self) -> None:
        """Process group, model (FSDP2), optimizer, schedule, ticket book; then resume from `latest`.

        A model or data set the spec names but that cannot be had raises ConfigError (exit code 2).
        """
        from transformers import AutoModelForCausalLM

        from kuberl.runtime.data import load_items
        from kuberl.runtime.models import resolve_model

        self.info = getattr(self, "info", None) or D.init_distributed()
        if self.info.is_main:
            for note in self.cfg.notes:
                log.info("algorithm: %s", note)
        with spec_errors():  # model.path not on the volume, no config.json, an unknown builtin...
            self.model_dir = resolve_model(self.spec.model, self.workdir)
        on_gpu = self.info.device.type != "cpu"  # cuda, or npu on Ascend (dist.choose_device)
        # Master weights in float32; on CPU everything stays float32 (bf16 matmuls are slow or unsupported here).
        param_dtype = getattr(torch, self.spec.model.dtype) if on_gpu else None
        torch.manual_seed(self.spec.seed)

        def load() -> torch.nn.Module:
            m = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32).to(self.info.device)
            return D.shard_model(m, self.info, param_dtype)

        self.model = load()
        if self.spec.trainer.gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
        self.ref_model = None
        if self.cfg.kl_coef > 0:
            self.ref_model = load().eval().requires_grad_(False)
        with spec_errors():  # dataset.path missing, a row without promptField/answerField...
            items = load_items(self.spec.dataset, self.spec.seed)
        self.total_steps = self._total_steps(len(items))
        self.optimizer = build_optimizer(self.model, self.spec.algorithm)
        self.scheduler = build_scheduler(self.optimizer, self.spec.algorithm.optimizer, self.total_steps * self.spec.algorithm.ppo_minibatches)
        self.book = TicketBook(
            self._num_items, self.B, self.eta, seed=self.spec.seed,
            shuffle=self.spec.dataset.shuffle, max_concurrent=self.spec.staleness.max_concurrent_rollouts,
            total_groups=self.total_steps * self.B,
        )
        with spec_errors():  # spec.evaluation: its split or file missing or empty
            self.evals = EvalSchedule.from_experiment(self.spec, self.total_steps) if self.info.is_main else None
        self.resumed_from = self._resume()

    def _total_steps(self, num_items: int) -> int:
        self._num_items = num_items
        t = self.spec.training
        steps = t.total_steps if t.total_steps is not None else max(1, (t.epochs * num_items) // self.B)
        return min(steps, self.max_steps) if self.max_steps is not None else steps

    def _resume(self) -> Path | None:
        main = self.info.is_main
        # Rank 0 reads and decides; the other ranks get the same answer (they may not see the same files).
        found = None
        if main and (latest := ck.latest_checkpoint(self.ckpt_root)) is not None:
            found = (latest.path, ck.load_trainer_state(latest.path), ck.read_torch(latest.path, "scheduler.pt"))
        found = D.broadcast_object(found, self.info)
        if found is None:
            return None
        path, state, sched = found
        model_sd = ck.read_torch(path, "model.pt") if main else {}
        optim_sd = ck.read_torch(path, "optimizer.pt") if main else {}
        D.load_full_state(self.model, self.optimizer, model_sd, optim_sd)
        self.scheduler.load_state_dict(sched)
        rng = Path(path) / f"rng-rank{self.info.rank}.pt"
        if rng.is_file():  # absent when the world size grew since the checkpoint
            ck.restore_rng_state(ck.read_torch(path, rng.name))
        self.step, self.version = int(state["step"]), int(state["version"])
        self.dropped_stale = int(state.get("dropped_stale", 0))
        self.failed_groups = int(state.get("failed_groups", 0))  # absent in checkpoints from before the count
        self.answered_request = state.get("answered_request")
        self.book.load_state(state["tickets"])
        self.last_checkpoint = state.get("checkpoint")
        if main:
            log.info("resumed from %s: step %d, policy version %d", path, self.step, self.version)
        return Path(path)

    # ------------------------------------------------------------------------------------------
    # the loop
    # ------------------------------------------------------------------------------------------

    async def run(self) -> int:
        """Train until totalSteps; returns the process exit code (0 done or stopped, 1 failed, 2 configuration
        error found while setting up, 143 SIGTERM). Either failure is reported in progress.failed."""
        self.bus: TrainerBusIO | None = None
        try:
            self.info = D.init_distributed()
            if self.handle_sigterm:
                self._install_sigterm()
            if self.info.is_main:
                # Connect first, so that a failing set-up (model, data set, checkpoint) is reported in progress.failed.
                self.bus = await TrainerBusIO.connect(self.bus_url, self.exp.name, token=self.bus_token)
            self.setup()
            if self.bus is not None:
                await self.bus.start(resumed=self.resumed_from is not None)
                self.metrics_out = await MetricsPublisher.start(self.bus.bus, fresh=self.resumed_from is None)
                if self.resumed_from is not None:
                    await self.stage_catch_up()
            await self.stage_publish_weights()  # v0 on a fresh start; the checkpoint's version on resume
            await self.stage_report(None)
            while self.step < self.total_steps:
                if not await self.train_one_step():
                    break
            await self.stage_checkpoint()
            digest = digest_state(self._full_params_everywhere())
            log.info("final weights sha256 %s", digest)  # every rank logs it: they must agree
            if self.stop_reason is None:
                if self.info.is_main and self.evals is not None:  # the last step's evaluation, and any still open
                    await finish_evaluation(self.evals, self.bus.bus, self.workdir, self.last_row, self.tracking, self.step, self.version)
                await self.stage_report(None, done=True)
            if self.info.is_main:
                log.info("training %s at step %d", f"stopped ({self.stop_reason})" if self.stop_reason else "done", self.step)
            return 143 if self.stop_reason == "SIGTERM" else 0
        except Exception as exc:
            config = isinstance(exc, ConfigError)
            if config:  # no traceback: the message names the field, and a restart cannot fix it
                log.error("configuration error: %s", exc)
            else:
                log.exception("trainer failed")
            if self.bus is not None:
                try:
                    await self.bus.put_progress({**self._progress_base(), "failed": f"{type(exc).__name__}: {exc}"})
                except Exception:  # the bus may be what failed
                    log.warning("could not report the failure on the bus")
            return config_error_exit("trainer", exc) if config else 1
        finally:
            if self.tracking is not None:
                self.tracking.close()
            if self.metrics_out is not None:
                await self.metrics_out.close()
            if self.bus is not None:
                await self.bus.close()
            D.shutdown()

    def _install_sigterm(self) -> None:
        # Kubernetes and `kuberl run` stop the trainer with SIGTERM: finish the step, checkpoint, exit.
        try:
            asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, self._on_sigterm)
        except (NotImplementedError, RuntimeError):
            pass

    def _on_sigterm(self) -> None:
        # torchrun forwards SIGTERM to every rank; rank 0 decides when to stop and tells the others.
        if self.info.is_main:
            log.warning("SIGTERM: checkpointing after this step, then exiting")
            self.stop_reason = "SIGTERM"

    async def train_one_step(self) -> bool:
        """One training step on every rank; False when the loop must end early (stop, SIGTERM)."""
        t0 = last = time.monotonic()
        timings: dict[str, float] = {}

        def lap(stage: str) -> None:  # seconds per named stage, into metrics.jsonl
            nonlocal last
            now = time.monotonic()
            timings[stage] = timings.get(stage, 0.0) + now - last
            last = now

        plan: dict[str, Any] = {}
        if self.info.is_main:
            await self.stage_issue_tickets()
            lap("train.issue_tickets")
            plan = await self.stage_collect()
        plan = D.broadcast_object(plan, self.info)
        lap("train.collect")
        if plan.get("stop"):
            self.stop_reason = plan["stop"]
            return False
        if plan.get("groups") is None:  # an operator's checkpoint request, answered between steps
            await self.stage_checkpoint(request=plan["checkpoint_request"])
            return True
        batch = build_batch(plan["groups"], self.n, ragged=self.ragged)
        self.stage_prox_logp(batch)
        lap("train.prox_logp")
        self.stage_advantages(batch)
        lap("train.advantages")
        stats = self.stage_ppo_update(batch)
        lap("train.ppo_update")
        self.version += 1
        self.step += 1
        if self.info.is_main:  # the ticket book lives on rank 0, next to the bus
            self.book.on_consumed(batch.num_groups)
        await self.stage_publish_weights()
        lap("train.publish_weights")
        due = self.step % self.spec.checkpoint.every_steps == 0
        if D.broadcast_object(due, self.info):
            await self.stage_checkpoint()
            lap("train.checkpoint")
        stats.update(samples=batch.num_samples, wait_seconds=plan.get("wait_seconds", 0.0), step_seconds=time.monotonic() - t0,
                     reward_mean=float(batch.rewards.mean()), timings=timings, group_ids=list(batch.group_ids),
                     **self._staleness(batch))
        await self.stage_report(stats)
        return True

    # ------------------------------------------------------------------------------------------
    # stages
    # ------------------------------------------------------------------------------------------

    async def stage_issue_tickets(self) -> int:
        """train.issue_tickets: top the ticket queue up to the staleness bound at the current version."""
        tickets = self.book.next_tickets(self.version)
        if tickets:
            await self.bus.publish_tickets(tickets)
            await self.bus.put_tickets(self.book.state())
        return len(tickets)

    async def stage_catch_up(self) -> int:
        """On resume: tickets issued after the checkpoint are still on the bus; do not issue them again."""
        n = self.book.catch_up(await self.bus.get_tickets())
        if n:
            log.info("resume: %d tickets issued after the checkpoint are still on the bus (they or their groups "
                     "come back): not issuing them again", n)
        return n

    def _first_time(self, group: Any, handle: Any) -> bool:
        """False for a group id already taken in this process: it is held for the ack and otherwise ignored."""
        if self.seen.add(group.group_id):
            return True
        self.duplicates += 1
        self.held.append(handle)
        log.warning("group %s arrived twice (the same ticket rolled out again): the copy is ignored", group.group_id)
        return False

    def _usable(self, group: Any, accepted: bool = False) -> bool:
        """Account for a group that cannot be trained on (rejected, stale, malformed); True if usable.
        `accepted`: the group was accepted before (kept from an interrupted collect) and is judged again."""
        if group.rejected or (self.cfg.dynamic_sampling and not dynamic_sampling_keep([s.reward for s in group.samples])):
            self.book.on_rejected()
            if getattr(group, "failure", None) is not None:  # a poison ticket: accounted like a rejected group
                self.failed_groups += 1
                log.warning("group %s failed on every delivery (item %d), its slot is given back: %s",
                            group.group_id, group.ticket.index, group.failure)
            return False
        if self.book.bound.is_stale(group.head_version, self.version):
            # The safety net: the ticket gate makes this rare (slow agents, restarts).
            self.book.on_dropped(accepted=accepted)
            self.dropped_stale += 1
            log.info("dropped group %s: head version %d < %d - %d", group.group_id, group.head_version, self.version, self.eta)
            return False
        if (why := group_size_error(len(group.samples), self.n, self.ragged)) is not None:
            log.warning("group %s %s: treated as rejected", group.group_id, why)
            self.book.on_rejected()
            return False
        return True

    async def stage_collect(self) -> dict[str, Any]:
        """train.collect: pull until B usable groups; rejected and stale ones give their slot back (a new ticket).

        Returns the plan every rank follows: {"groups", "wait_seconds"}, or {"checkpoint_request"} (answer an
        operator's request between steps), or {"stop"}.
        """
        t0 = time.monotonic()
        last_seen = t0
        # Groups kept from an interrupted collect may have gone stale meanwhile: judge them again.
        kept, self.buffer = self.buffer, []
        for group, handle in kept:
            if self._usable(group, accepted=True):
                self.buffer.append((group, handle))
            else:
                self.held.append(handle)
        while len(self.buffer) < self.B:
            if self.stop_reason is not None:
                return {"stop": self.stop_reason}
            control = await self.bus.get_control()
            if control.get("stop"):
                return {"stop": "control.stop"}
            request = control.get("checkpoint_request")
            if request and request != self.answered_request:
                return {"checkpoint_request": request}
            got = await self.bus.fetch_groups(self.B - len(self.buffer), timeout=1.0)
            if got:
                last_seen = time.monotonic()
            elif self.collect_timeout is not None and time.monotonic() - last_seen > self.collect_timeout:
                raise TimeoutError(f"no trajectory group arrived for {self.collect_timeout:.0f}s (are rollout agents running?)")
            for group, handle in got:
                if not self._first_time(group, handle):
                    continue
                if self._usable(group):
                    self.book.on_accepted()  # its concurrency slot is free now, not once it is trained (AReaL)
                    self.buffer.append((group, handle))
                else:
                    self.held.append(handle)  # acknowledged with the next checkpoint, like trained groups
            await self.stage_issue_tickets()  # replacements for rejected/dropped groups
        taken, self.buffer = self.buffer[: self.B], self.buffer[self.B :]
        self.held.extend(h for _, h in taken)
        return {"groups": [g.model_dump(mode="json") for g, _ in taken], "wait_seconds": time.monotonic() - t0}

    def stage_prox_logp(self, batch: RolloutBatch) -> None:
        """train.prox_logp: log pi_prox with the pre-update weights (and log pi_ref with a KL term).

        One no-grad forward in eval mode (dropout off), or none at all where the update's own forward
        gives the same numbers (`prox_in_update`): then stage_ppo_update takes pi_prox from it.
        """
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

    def _logprobs_all_rows(self, model: torch.nn.Module, batch: RolloutBatch, rows: list[int], width: int) -> torch.Tensor:
        out = torch.zeros(batch.num_samples, width)
        mbs = shard_micro_batches(batch.seq_lens, rows, self.spec.trainer.micro_batch_tokens, self.info.rank, self.info.world_size)
        for mb in mbs:
            idx = mb if mb is not None else rows[:1]  # filler: same collectives, result discarded
            lp = response_logprobs(model, [batch.prompts[i] for i in idx], [batch.outputs[i] for i in idx], width,
                                   temperature=self.cfg_temperature, device=self.info.device).cpu()
            if mb is not None:
                out[mb] = lp
        if self.info.world_size > 1:
            t = out.to(self.info.device)
            torch.distributed.all_reduce(t)  # each row was computed by exactly one rank
            out = t.cpu()
        return out

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
        self.model.train()
        width = batch.loss_mask.shape[1]
        fused_prox = torch.zeros(batch.num_samples, width) if batch.extra.get("prox_in_update") else None
        sums: dict[str, float] = {}
        token_total = 0.0
        grad_norms, losses = [], []
        for rows in minibatch_rows(batch.num_groups, batch.group_sizes, self.spec.algorithm.ppo_minibatches):
            denom = loss_denominator(batch.loss_mask[rows], self.cfg)
            mbs = shard_micro_batches(batch.seq_lens, rows, self.spec.trainer.micro_batch_tokens, self.info.rank, self.info.world_size)
            mb_loss = 0.0
            for mb in mbs:
                idx = mb if mb is not None else rows[:1]
                logp, ent = response_logprobs(self.model, [batch.prompts[i] for i in idx], [batch.outputs[i] for i in idx], width,
                                              temperature=self.cfg_temperature, device=self.info.device, entropy=True)
                prox, behave, adv, mask, ref = (None if t is None else t[idx].to(self.info.device) for t in
                                                (batch.prox_logp, batch.behave_logp, batch.advantages, batch.loss_mask, batch.ref_logp))
                if fused_prox is not None:  # pre-update weights (one minibatch): pi_prox is this forward, detached
                    prox = logp.detach()
                    if mb is not None:
                        fused_prox[mb] = prox.cpu()
                loss, st = ppo_actor_loss(logp, prox, behave, adv, mask, self.cfg, ref_logp=ref, denominator=denom)
                # FSDP averages gradients over ranks; the loss is a sum over the whole minibatch, so undo it.
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
        totals = D.all_reduce_sum([token_total, sum(losses)] + [sums[k] for k in sorted(sums)], self.info)
        tokens = max(totals[0], 1.0)
        out = {k: v / tokens for k, v in zip(sorted(sums), totals[2:])}
        out.update(loss=totals[1] / max(len(losses), 1), grad_norm=sum(grad_norms) / len(grad_norms),
                   lr=self.scheduler.get_last_lr()[0], tokens=totals[0])
        return out

    async def stage_publish_weights(self) -> None:
        """train.publish_weights: full state dict -> weights/v{N} (disk) or the object store (bus); KV weights, policy_version."""
        state = D.full_model_state(self.model)  # collective: every rank takes part
        if not self.info.is_main:
            return
        from kuberl.runtime.inference.main import engine_dtype  # the engine's compute dtype (float32 on CPU)

        dtype = getattr(torch, engine_dtype(self.spec))
        path = export_weights(state, self.weights_root, self.version, source_dir=self.model_dir, dtype=dtype, keep=3)
        await self.bus.publish_weights(self.version, path, mode=self.spec.weight_sync.mode)

    async def stage_checkpoint(self, *, request: str | None = None) -> None:
        """train.checkpoint: model, optimizer, schedule, RNG, ticket book; then ack the groups it covers."""
        saved = request is None and bool(self.last_checkpoint) and self.last_checkpoint.get("step") == self.step and self._saved(self.step)
        if D.broadcast_object(saved, self.info):  # rank 0 decides: every rank must take the same path
            if self.info.is_main:
                await self._ack_held()
            return  # this step is saved already (e.g. the end right after a periodic checkpoint)
        model_sd = D.full_model_state(self.model)
        optim_sd = D.full_optimizer_state(self.model, self.optimizer)
        if self.info.is_main:
            ck.begin_checkpoint(self.ckpt_root, self.step)
        D.barrier(self.info)
        tmp = self.ckpt_root / f"{ck.TMP_PREFIX}{ck.checkpoint_name(self.step)}"
        ck.write_torch(tmp, f"rng-rank{self.info.rank}.pt", ck.capture_rng_state())
        if self.info.is_main:
            ck.write_torch(tmp, "model.pt", model_sd)
            ck.write_torch(tmp, "optimizer.pt", optim_sd)
            ck.write_torch(tmp, "scheduler.pt", self.scheduler.state_dict())
        D.barrier(self.info)
        if self.info.is_main:
            if request is not None:
                self.answered_request = request
            info = {"step": self.step, "policy_version": self.version, "path": str(self.ckpt_root / ck.checkpoint_name(self.step)), "time": time.time()}
            state = {"version": self.version, "dropped_stale": self.dropped_stale, "failed_groups": self.failed_groups, "tickets": self.book.state(),
                     "answered_request": self.answered_request, "total_steps": self.total_steps, "checkpoint": info,
                     "world_size": self.info.world_size, "experiment": self.exp.name}
            ck.commit_checkpoint(self.ckpt_root, self.step, state, keep=self.spec.checkpoint.keep)
            self.last_checkpoint = info
            log.info("checkpoint step %d (policy version %d) in %s", self.step, self.version, info["path"])
            await self._ack_held()
            await self.bus.put_progress(self._progress_base())
        D.barrier(self.info)

    def _full_params_everywhere(self) -> dict[str, torch.Tensor]:
        """Every rank's own view of the full weights (all-gathered from its shards), for the final cross-check."""
        out = {}
        for name, p in self.model.state_dict().items():
            out[name] = p.full_tensor() if hasattr(p, "full_tensor") else p
        return out

    def _saved(self, step: int) -> bool:
        return (self.ckpt_root / ck.checkpoint_name(step) / ck.STATE_FILE).is_file()

    async def _ack_held(self) -> None:
        if self.bus is not None and self.held:
            await self.bus.ack(self.held)
            self.held = []

    async def stage_report(self, stats: dict[str, Any] | None, done: bool = False) -> None:
        """train.report: KV progress every step, one metrics.jsonl line and one log line per step."""
        if not self.info.is_main:
            return
        await self.bus.refresh_buffered(len(self.buffer))
        await self.bus.put_tickets(self.book.state())
        progress = self._progress_base(done=done)
        if self.tracking is None:  # rank 0 only: the other ranks returned above; from the first report (/metrics before step 1)
            self.tracking = Tracking.from_spec(self.spec.tracking, workdir=self.workdir, name=self.exp.name, namespace=self.exp.namespace,
                                               config=self.spec.to_manifest())
        if stats is not None:
            self.recent.append((stats["samples"], stats["step_seconds"]))
            secs = sum(s for _, s in self.recent)
            sps = sum(n for n, _ in self.recent) / secs if secs > 0 else 0.0
            # Kept for every later report (checkpoints, done): the last step's numbers stay visible.
            self.last_numbers = {"reward_mean": stats["reward_mean"], "samples_per_second": sps, "staleness_mean": stats["staleness_mean"],
                                 "staleness_max": stats["staleness_max"], "trainer_wait_fraction": stats["wait_seconds"] / max(stats["step_seconds"], 1e-9),
                                 "entropy": stats.get("entropy")}
            progress.update(self.last_numbers)
            row = {"step": self.step, "time": time.time(), "policy_version": self.version, "samples_per_second": sps,
                   "dropped_stale": self.dropped_stale, "failed_groups": self.failed_groups, **stats}
            if self.evals is not None:  # held-out evaluation: issue a due round, merge the finished ones (never waits)
                row.update(await self.evals.poll(self.bus.bus, self.step, self.version))
                progress["eval"] = self.evals.last
            self.last_row = row
            with open(self.workdir / "metrics.jsonl", "a") as fh:
                fh.write(json.dumps(row) + "\n")
            if self.metrics_out is not None:  # never blocks: a background task sends it
                self.metrics_out.publish(row)
            self.tracking.log(self.step, row)  # never blocks; a tracker that is down is logged once, training goes on
            eta_s = (self.total_steps - self.step) * secs / len(self.recent)
            log.info("step %d/%d v%d reward %.3f loss %.4f entropy %.3f samples/s %.1f staleness %.2f (max %d) dropped %d failed %d "
                     "wait %.0f%% ETA %s", self.step, self.total_steps, self.version, stats["reward_mean"], stats["loss"],
                     stats.get("entropy", float("nan")), sps, stats["staleness_mean"], stats["staleness_max"], self.dropped_stale,
                     self.failed_groups, 100 * progress["trainer_wait_fraction"], _fmt_eta(eta_s))
        await self.bus.put_progress(progress)

    # ------------------------------------------------------------------------------------------

    def _progress_base(self, done: bool = False) -> dict[str, Any]:
        return {"step": self.step, "total_steps": getattr(self, "total_steps", None),
                "epoch": self.book.consumed // self.book.num_items if hasattr(self, "book") else 0,
                "policy_version": self.version, "reward_mean": None, "samples_per_second": None, "staleness_mean": None,
                "staleness_max": None, "dropped_stale": self.dropped_stale, "failed_groups": self.failed_groups, "trainer_wait_fraction": None,
                "groups_buffered": self.bus.groups_buffered if self.bus is not None else None, "done": done, "failed": None,
                "checkpoint": self.last_checkpoint, "time": time.time(), "eval": getattr(getattr(self, "evals", None), "last", None),
                **self.last_numbers}

    def _staleness(self, batch: RolloutBatch) -> dict[str, Any]:
        # Measured against the version the batch was trained at (before this step's bump).
        # Never negative: after a restart, redelivered groups may come from versions newer than the checkpoint's.
        lags = [max(self.version - 1 - h, 0) for h in batch.head_versions if h >= 0]
        return {"staleness_mean": sum(lags) / len(lags) if lags else 0.0, "staleness_max": max(lags) if lags else 0}


def _has_dropout(model: torch.nn.Module) -> bool:
    """Whether training mode changes the model's outputs: a dropout layer or a dropout rate in its config."""
    if any(isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0 for m in model.modules()):
        return True
    config = getattr(model, "config", None)
    rates = [getattr(config, k, 0.0) for k in ("attention_dropout", "hidden_dropout", "dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop")]
    return any(isinstance(r, (int, float)) and r > 0 for r in rates)


def _fmt_eta(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"
