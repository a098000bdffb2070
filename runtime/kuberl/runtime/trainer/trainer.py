"""The trainer loop (AReaL style): tickets out, trajectory groups in, decoupled PPO steps, new weights out.

`Trainer(exp, bus_url=..., workdir=...).run()` is what `kuberl trainer` (one process per torchrun rank)
and `kuberl run` call. Stages, in order each step: train.issue_tickets, train.collect, train.prox_logp,
train.advantages, train.ppo_update, train.publish_weights, train.checkpoint, train.report. Rank 0 does
all bus I/O and broadcasts the batch; every rank runs the compute: FSDP2 (trainer.backend fsdp) or
megatron-core with tensor/pipeline parallelism (trainer.backend megatron: megatron/backend.py).

This module holds the state (`__init__`) and the loop (`run`, `train_one_step`). The stages live in mixins,
one module per seam, all methods on the one object so each stage reads and sets the same state as before:
setup_model.py (process group, model, optimizer, ticket book), collect.py (tickets, collect, the group filters),
compute.py (pi_prox, advantages, PPO update), persist.py (resume, weights out, checkpoint, acks),
report.py (progress, metrics.jsonl and stream, tracking, evaluation rounds) and megatron/backend.py (the
Megatron path of set-up, compute and persist, which those stages hand over to when trainer.backend is megatron).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections import deque
from pathlib import Path
from typing import Any

from kuberl.api import RLExperiment
from kuberl.runtime.algorithms import resolve_algorithm
from kuberl.runtime.bus.metrics import MetricsPublisher
from kuberl.runtime.errors import ConfigError, config_error_exit, spec_errors
from kuberl.runtime.evaluation import EvalSchedule, finish_evaluation
from kuberl.runtime.tracking import Tracking
from kuberl.runtime.trainer import dist as D
from kuberl.runtime.trainer.batch import build_batch
from kuberl.runtime.trainer.bus_io import TrainerBusIO
from kuberl.runtime.trainer.collect import CollectMixin
from kuberl.runtime.trainer.compute import ComputeMixin
from kuberl.runtime.trainer.megatron.backend import MegatronMixin, check_megatron_spec
from kuberl.runtime.trainer.memory import out_of_memory_error
from kuberl.runtime.trainer.persist import PersistMixin
from kuberl.runtime.trainer.report import ReportMixin
from kuberl.runtime.trainer.setup_model import SetUpMixin
from kuberl.runtime.trainer.tickets import SeenGroups

log = logging.getLogger("kuberl.trainer")
# Why a trainer stops before totalSteps (stop_reason): SIGTERM finishes the step and checkpoints (exit 143);
# a SIGTERM while the bus is down cancels the step at once (its groups stay unacknowledged).
STOP_SIGTERM, STOP_SIGTERM_BUS_DOWN = "SIGTERM", "SIGTERM during a bus outage"

STAGES = ("train.issue_tickets", "train.collect", "train.prox_logp", "train.advantages", "train.ppo_update",
          "train.publish_weights", "train.checkpoint", "train.report")


class Trainer(SetUpMixin, PersistMixin, CollectMixin, ComputeMixin, ReportMixin, MegatronMixin):
    """One trainer rank. Build it, then `asyncio.run(trainer.run())` (returns the exit code).

        exp = load_experiment("experiment.yaml")
        code = asyncio.run(Trainer(exp, bus_url="nats://127.0.0.1:4222", workdir="runs/x").run())
    """

    def __init__(self, exp: RLExperiment, *, bus_url: str, workdir: str | Path, bus_token: str | None = None,
                 max_steps: int | None = None, collect_timeout: float | None = None, handle_sigterm: bool = True):
        self.exp, self.spec = exp, exp.spec
        self.bus_url, self.bus_token = bus_url, bus_token
        self.workdir = Path(workdir)
        if self.spec.trainer.backend == "megatron":
            check_megatron_spec(self.spec)  # what its path does not do yet: refused, naming the field
        with spec_errors():
            self.cfg = resolve_algorithm(self.spec.algorithm)
        self.B, self.n = self.spec.algorithm.batch_size, self.cfg.group_size
        self.ragged = self.spec.workflow.export_style == "individual"  # one sample per agent call: groups of >= n samples
        self.eta = self.spec.staleness.max_head_offpolicyness
        # staleness.dropStaleGroups: drop groups older than v - eta (opt-in, biased toward short answers) or train them.
        self.drop_stale = self.spec.staleness.drop_stale_groups
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
        self.over_stale = 0  # groups trained although older than v - eta (the default keeps them), this run
        self.failed_groups = 0  # tickets the agents gave up on (rollout.maxTicketAttempts failed deliveries)
        self.failed_in_a_row = 0  # failed groups since the last usable one (collect.py stops the run past a bound)
        self.last_failure: str | None = None  # the latest failed group's reason, shown in progress
        self.answered_request: str | None = None
        self.held: list[Any] = []  # bus handles of groups trained or accounted, not yet covered by a checkpoint
        self.buffer: list[tuple[Any, Any]] = []  # (group, handle) pulled but not yet trained
        # Far more than can be in flight at once ((eta + 1) * B): a duplicate arrives within that span.
        self.seen = SeenGroups(max(4096, 8 * self.B * (self.eta + 2)))
        self.duplicates = 0
        self.recent: deque[tuple[int, float]] = deque(maxlen=5)  # (samples, seconds) of recent steps
        self.last_checkpoint: dict[str, Any] | None = None
        self.pending_checkpoint = None  # a checkpoint being written behind training (persist.py, checkpoint.asyncSave)
        self.checkpoint_group = None  # the gloo group of those writes; None: checkpoints are written synchronously
        self.checkpoint_row: dict[str, Any] | None = None  # the resumed checkpoint's own step row (ReportMixin.restore_row)
        self.stop_reason: str | None = None
        self._run_task: asyncio.Task | None = None  # run()'s task: SIGTERM cancels it while the bus is down
        self.last_numbers: dict[str, Any] = {}  # reward, speed, staleness of the last step, for progress
        self.tracking: Tracking | None = None  # spec.tracking's trackers, rank 0, from the first step's report
        self.evals: EvalSchedule | None = None  # spec.evaluation's rounds (rank 0)
        self.last_row: dict[str, Any] | None = None  # the last metrics.jsonl line
        self.metrics_out: MetricsPublisher | None = None  # every step's row on the bus too (`kuberl plot <experiment>`)

    # ------------------------------------------------------------------------------------------
    # the loop
    # ------------------------------------------------------------------------------------------

    async def run(self) -> int:
        """Train until totalSteps; returns the process exit code (0 done or stopped, 1 failed, 2 configuration
        error found while setting up, 143 SIGTERM). Either failure is reported in progress.failed."""
        self.bus: TrainerBusIO | None = None
        self._run_task = asyncio.current_task()
        clean = False  # every rank reached the end: they wait for each other before tearing the group down
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
                    self.restore_row(self.checkpoint_row)
                    await self.stage_catch_up()
            await self.stage_publish_weights()  # v0 on a fresh start; the checkpoint's version on resume
            await self.stage_report(None)
            while self.step < self.total_steps:
                if not await self.train_one_step():
                    break
            await self.stage_checkpoint()
            self.sync_final_weights()
            digest = self.final_digest()  # persist.py: one parameter at a time
            log.info("final weights sha256 %s", digest)  # every rank logs it: they must agree
            if self.stop_reason is None:
                if self.info.is_main and self.evals is not None:  # the last step's evaluation, and any still open
                    await finish_evaluation(self.evals, self.bus.bus, self.workdir, self.last_row, self.tracking, self.step, self.version)
                await self.stage_report(None, done=True)
            if self.info.is_main:
                log.info("training %s at step %d", f"stopped ({self.stop_reason})" if self.stop_reason else "done", self.step)
            clean = True
            return 143 if self.stop_reason == STOP_SIGTERM else 0
        except asyncio.CancelledError:
            if self.stop_reason != STOP_SIGTERM_BUS_DOWN:
                raise
            return 143  # _on_sigterm: the step could not finish; the last checkpoint stands
        except Exception as exc:
            info = getattr(self, "info", None)  # None when the process group itself failed to start
            if info is not None and (oom := out_of_memory_error(exc, self.spec.trainer, info.device, info.world_size,
                                                                      getattr(self, "gradient_checkpointing", None))) is not None:
                log.error("out of accelerator memory", exc_info=exc)  # where in the step, and torch's account of the allocator
                exc = oom
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
            D.shutdown(synchronize=clean)

    def _install_sigterm(self) -> None:
        # Kubernetes and `kuberl run` stop the trainer with SIGTERM: finish the step, checkpoint, exit.
        try:
            asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, self._on_sigterm)
        except (NotImplementedError, RuntimeError):
            pass

    def _on_sigterm(self) -> None:
        # torchrun forwards SIGTERM to every rank; rank 0 decides when to stop and tells the others.
        if not self.info.is_main:
            return
        if self.bus is not None and not self.bus.connected and self._run_task is not None:
            # A step waiting on a bus that is down would ride out the outage (minutes) and be killed at the end of
            # the grace period anyway: exit now. Nothing is lost: its groups are unacknowledged (redelivered after
            # a restart) and the last checkpoint stands.
            saved = (self.last_checkpoint or {}).get("step")
            log.warning("SIGTERM while the bus is down: exiting now; a restart resumes from %s",
                        f"the checkpoint of step {saved}" if saved is not None else "the start (no checkpoint yet)")
            self.stop_reason = STOP_SIGTERM_BUS_DOWN
            self._run_task.cancel()
            return
        log.warning("SIGTERM: checkpointing after this step, then exiting")
        self.stop_reason = STOP_SIGTERM

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
        if plan.get("weights_resync"):  # engines asked for the current weights (weightSync.mode broadcast)
            from kuberl.runtime.weight_sync.sender import publish_broadcast

            await publish_broadcast(self, new_version=False)
            return True
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
        await self.finish_checkpoint(wait=False)  # commit the checkpoint written behind training, if its write is done
        stats.update(samples=batch.num_samples, wait_seconds=plan.get("wait_seconds", 0.0), step_seconds=time.monotonic() - t0,
                     reward_mean=float(batch.rewards.mean()), timings=timings, group_ids=list(batch.group_ids),
                     **self._staleness(batch))
        row = await self.step_row(stats) if self.info.is_main else None  # before the checkpoint, which keeps a copy
        due = self.step % self.spec.checkpoint.every_steps == 0
        if D.broadcast_object(due, self.info):
            await self.stage_checkpoint(row=row, background=True)  # with checkpoint.asyncSave: only the copy to host memory
            lap("train.checkpoint")  # into row["timings"] too (the same dict); the checkpoint's copy is without it
            if row is not None:
                row["step_seconds"] = time.monotonic() - t0
        await self.stage_report(row)
        return True
