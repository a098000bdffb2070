"""The live progress of `kuberl run` (kuberl.runtime.launcher): the progress bar or, in a pipe, a line every few
seconds, read from the trainer's progress in the bus KV; and the reward curve drawn at the end of a run."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from kuberl.runtime.aio import raise_if_cancelling

if TYPE_CHECKING:
    from kuberl.runtime.launcher import LocalRun

log = logging.getLogger("kuberl.run")


PROGRESS_READ_SECONDS = 3.0
"""Longest wait for one progress read: the loop must see `stop` soon after the supervisor gives up on the bus."""


def progress_info(report: dict) -> str:
    """The live line's text after the step count: version, reward, speed, staleness, evaluation, and failed groups with
    the latest reason (a run whose episodes all fail shows why at once, not only in the agents' logs)."""
    info = (f"v{report.get('policy_version', 0)} reward {fmt_number(report.get('reward_mean'))} "
            f"{fmt_number(report.get('samples_per_second'))} samples/s staleness {fmt_number(report.get('staleness_mean'))}")
    if ev := eval_text(report.get("eval")):
        info += f" | {ev}"
    if report.get("failed_groups"):
        reason = str(report.get("last_failure") or "")
        info += f" | failed groups {report['failed_groups']}" + (f", latest {reason[:100]}" if reason else "")
    return info


async def watch_progress(run: LocalRun, stop: asyncio.Event) -> dict | None:
    """Follow the trainer's progress in the bus KV with a rich progress bar; returns the last report."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    from kuberl.runtime.bus import Bus, BusError

    bus = None
    while bus is None:  # the bus may be restarting: the supervisor brings it back, or stops the run
        try:
            bus = await Bus.connect(run.bus_url, run.exp.name, connect_timeout=5.0)
        except BusError as exc:
            log.debug("progress: %s", exc)
            if stop.is_set():
                return None
    last: dict | None = None
    total = run.exp.spec.training.total_steps
    columns = [TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
               TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn()]
    plain = not sys.stdout.isatty()
    try:
        with Progress(*columns, disable=plain, refresh_per_second=2) as bar:
            task = bar.add_task("training", total=total, info="starting roles (engine warm-up takes ~30 s on CPU)")
            last_line = 0.0

            async def read() -> dict | None:
                try:  # a Bus call rides out an outage for minutes: never wait past the supervisor's verdict
                    return await asyncio.wait_for(bus.get_state("progress"), timeout=PROGRESS_READ_SECONDS)
                except (BusError, TimeoutError) as exc:  # the bus is restarting (the supervisor brings it back, or stops us)
                    log.debug("progress unavailable: %s", exc)
                    return None

            def show(report: dict, final: bool = False) -> None:
                nonlocal last_line
                info = progress_info(report)
                bar.update(task, completed=report.get("step", 0), total=report.get("total_steps") or total, info=info)
                if plain and (final or time.monotonic() - last_line > 5):  # CI and pipes: a line every few seconds
                    print(f"step {report.get('step', 0)}/{report.get('total_steps') or total} {info}", flush=True)
                    last_line = time.monotonic()

            while not stop.is_set():
                raise_if_cancelling()  # a wait_for below may have dropped the cancel (kuberl/runtime/aio.py)
                report = await read()
                if report and report != last:
                    last = report
                    show(report, final=bool(report.get("done")))
                    if report.get("done"):
                        break
                try:
                    await asyncio.wait_for(stop.wait(), timeout=1.0)
                except TimeoutError:
                    pass
            if not (last or {}).get("done"):
                # Stopped by the supervisor: the trainer may have exited between two reads, after writing its
                # final report (the last step, the final evaluation round). One more read, so that it is not lost.
                report = await read()
                if report and report != last:
                    last = report
                    show(report, final=True)
    finally:
        try:
            await asyncio.wait_for(bus.close(), timeout=PROGRESS_READ_SECONDS)
        except TimeoutError:
            log.debug("progress: closing the bus connection timed out")
    return last


def eval_text(ev: dict | None) -> str:
    """The last held-out evaluation (progress `eval`, spec.evaluation) in one line; "" when there is none."""
    if not isinstance(ev, dict):
        return ""
    ks = " ".join(f"pass@{k} {fmt_number(v)}" for k, v in sorted((ev.get("pass_at_k") or {}).items(), key=lambda kv: int(kv[0])))
    return (f"eval (step {ev.get('step')}, v{ev.get('policy_version')}, {ev.get('items')} items): reward {fmt_number(ev.get('reward_mean'))} "
            f"greedy {fmt_number(ev.get('greedy_reward_mean'))} pass@1 greedy {fmt_number(ev.get('pass_at_1_greedy'))} {ks}").rstrip()


def fmt_number(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


def plot_rewards(metrics: Path, out: Path) -> Path | None:
    """Reward curve (mean reward per step, and a moving average) from metrics.jsonl."""
    if not metrics.exists():
        return None
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r.get("reward_mean") is not None]
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    rewards = [r["reward_mean"] for r in rows]
    window = max(1, len(rewards) // 20)
    smooth = [sum(rewards[max(0, i - window + 1): i + 1]) / len(rewards[max(0, i - window + 1): i + 1]) for i in range(len(rewards))]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, rewards, alpha=0.35, label="mean reward per step")
    ax.plot(steps, smooth, linewidth=2, label=f"moving average ({window} steps)")
    ax.set_xlabel("training step")
    ax.set_ylabel("reward")
    ax.set_title(metrics.parent.name)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
