"""Trainer reporting (rank 0): KV progress, metrics.jsonl, the metrics stream, tracking, evaluation rounds, the log line.

A mixin of `Trainer` (runtime/kuberl/runtime/trainer/trainer.py), which owns the state these methods read and set.
"""

from __future__ import annotations

import json
import logging
import math
import time
from typing import Any

from kuberl.runtime.tracking import Tracking
from kuberl.runtime.trainer.batch import RolloutBatch

log = logging.getLogger("kuberl.trainer")


class ReportMixin:
    """train.report and the progress document every other report (checkpoint, failure) starts from."""

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


def _fmt_eta(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"
