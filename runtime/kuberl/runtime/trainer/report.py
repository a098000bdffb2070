"""Trainer reporting (rank 0): KV progress, metrics.jsonl, the metrics stream, tracking, evaluation rounds, the log line.

A mixin of `Trainer` (runtime/kuberl/runtime/trainer/trainer.py), which owns the state these methods read and set.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Any

from kuberl.runtime.tracking import Tracking
from kuberl.runtime.trainer.batch import RolloutBatch

log = logging.getLogger("kuberl.trainer")


class ReportMixin:
    """train.report and the progress document every other report (checkpoint, failure) starts from."""

    async def step_row(self, stats: dict[str, Any]) -> dict[str, Any]:
        """This step's metrics.jsonl row (rank 0), made before train.checkpoint: the checkpoint keeps a copy, so that a
        trainer killed between its checkpoint and its report still gets the row written, on resume (restore_row)."""
        row = {"step": self.step, "time": time.time(), "policy_version": self.version, "samples_per_second": self._sps(stats),
               "dropped_stale": self.dropped_stale, "over_stale": self.over_stale, "failed_groups": self.failed_groups, **stats}
        if self.evals is not None:  # held-out evaluation: issue a due round, merge the finished ones (never waits)
            row.update(await self.evals.poll(self.bus.bus, self.step, self.version))
        return row

    def _sps(self, stats: dict[str, Any]) -> float:
        """Samples per second over the recent steps and this one."""
        window = [*self.recent, (stats["samples"], stats["step_seconds"])][-(self.recent.maxlen or 5):]
        secs = sum(s for _, s in window)
        return sum(n for n, _ in window) / secs if secs > 0 else 0.0

    async def stage_report(self, row: dict[str, Any] | None, done: bool = False) -> None:
        """train.report: KV progress every step; a step's row (step_row) into metrics.jsonl, the metrics stream and
        the tracker, and its log line."""
        if not self.info.is_main:
            return
        await self.bus.refresh_buffered(len(self.buffer))
        await self.bus.put_tickets(self.book.state())
        progress = self._progress_base(done=done)
        self._ensure_tracking()
        if row is not None:
            row["time"] = time.time()
            row["samples_per_second"] = self._sps(row)  # with the step's whole time (its checkpoint included)
            self.recent.append((row["samples"], row["step_seconds"]))
            # Kept for every later report (checkpoints, done): the last step's numbers stay visible.
            self.last_numbers = {"reward_mean": row["reward_mean"], "samples_per_second": row["samples_per_second"],
                                 "staleness_mean": row["staleness_mean"], "staleness_max": row["staleness_max"],
                                 "trainer_wait_fraction": row["wait_seconds"] / max(row["step_seconds"], 1e-9), "entropy": row.get("entropy")}
            progress.update(self.last_numbers)
            if self.evals is not None:
                progress["eval"] = self.evals.last
            self._write_row(row)
            secs = sum(s for _, s in self.recent)
            eta_s = (self.total_steps - self.step) * secs / len(self.recent)
            log.info("step %d/%d v%d reward %.3f loss %.4f entropy %.3f samples/s %.1f staleness %.2f (max %d) dropped %d over-stale %d failed %d "
                     "wait %.0f%% ETA %s", self.step, self.total_steps, self.version, row["reward_mean"], row["loss"],
                     row.get("entropy", float("nan")), row["samples_per_second"], row["staleness_mean"], row["staleness_max"],
                     self.dropped_stale, self.over_stale, self.failed_groups, 100 * progress["trainer_wait_fraction"], _fmt_eta(eta_s))
        await self.bus.put_progress(progress)

    def _ensure_tracking(self) -> None:
        if self.tracking is None:  # rank 0 only, from the first report (/metrics before step 1)
            self.tracking = Tracking.from_spec(self.spec.tracking, workdir=self.workdir, name=self.exp.name, namespace=self.exp.namespace,
                                               config=self.spec.to_manifest())

    def _write_row(self, row: dict[str, Any]) -> None:
        """One row into metrics.jsonl, the metrics stream on the bus and the tracker."""
        self.last_row = row
        with open(self.workdir / "metrics.jsonl", "a") as fh:
            fh.write(json.dumps(row) + "\n")
        if self.metrics_out is not None:  # never blocks: a background task sends it
            self.metrics_out.publish(row)
        self.tracking.log(row["step"], row)  # never blocks; a tracker that is down is logged once, training goes on

    def restore_row(self, row: dict[str, Any] | None) -> None:
        """On resume (rank 0): drop a metrics.jsonl row cut short by the kill (appending after it would spoil the next
        row too), and write the checkpoint's own step row if the file lacks it (the trainer died after committing
        the checkpoint and before its report). Reads the file line by line: it grows with the run."""
        path = self.workdir / "metrics.jsonl"
        if path.is_file() and (cut := _cut_short(path)):
            log.warning("metrics.jsonl ends in a row cut short (%d bytes, the trainer was killed writing it): removed", cut)
        if row is None:
            return
        prefix = f'{{"step": {row["step"]},'  # how every row starts (step_row puts the step first)
        if path.is_file():
            with open(path) as fh:
                if any(line.startswith(prefix) for line in fh):
                    return
        log.warning("metrics.jsonl has no row for step %d (the trainer stopped between its checkpoint and its report): "
                    "writing the one the checkpoint kept", row["step"])
        self._ensure_tracking()
        self._write_row(row)

    def _progress_base(self, done: bool = False) -> dict[str, Any]:
        return {"step": self.step, "total_steps": getattr(self, "total_steps", None),
                "epoch": self.book.consumed // self.book.num_items if hasattr(self, "book") else 0,
                "policy_version": self.version, "reward_mean": None, "samples_per_second": None, "staleness_mean": None,
                "staleness_max": None, "dropped_stale": self.dropped_stale, "over_stale": self.over_stale, "failed_groups": self.failed_groups,
                "last_failure": getattr(self, "last_failure", None), "trainer_wait_fraction": None,
                "groups_buffered": self.bus.groups_buffered if self.bus is not None else None, "done": done, "failed": None,
                "checkpoint": self.last_checkpoint, "time": time.time(), "eval": getattr(getattr(self, "evals", None), "last", None),
                **self.last_numbers}

    def _staleness(self, batch: RolloutBatch) -> dict[str, Any]:
        # Measured against the version the batch was trained at (before this step's bump).
        # Never negative: after a restart, redelivered groups may come from versions newer than the checkpoint's.
        lags = [max(self.version - 1 - h, 0) for h in batch.head_versions if h >= 0]
        return {"staleness_mean": sum(lags) / len(lags) if lags else 0.0, "staleness_max": max(lags) if lags else 0}


def _cut_short(path: Path, chunk: int = 1 << 16) -> int:
    """Remove the last line of `path` if it has no newline; the bytes removed (0: the file ends in a whole line)."""
    with open(path, "rb+") as fh:
        size = fh.seek(0, 2)
        end = size
        while end > 0:
            start = max(0, end - chunk)
            fh.seek(start)
            block = fh.read(end - start)
            if end == size and block.endswith(b"\n"):
                return 0
            if (i := block.rfind(b"\n")) >= 0:
                fh.truncate(start + i + 1)
                return size - (start + i + 1)
            end = start
        fh.truncate(0)
        return size


def _fmt_eta(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"
