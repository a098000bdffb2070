"""`kuberl plot`: a run's curves (reward, entropy, staleness, and eval when present) from its metrics.jsonl to a PNG.

    kuberl plot runs/quickstart                    # a `kuberl run` workdir (or the metrics.jsonl itself)
    kuberl plot my-experiment -n team-a            # a cluster run: every step, from the metrics stream on its bus

One panel per kind of curve that has data: reward (mean per step and a moving average), entropy,
staleness (mean and max policy-version lag), eval (every numeric value of a row's `eval` dict or of
its `eval/*` keys, at its `evaluated_step`). A step written twice (a trainer restarted from an older checkpoint redoes
steps) is drawn once, from its last line. A cluster run is read from its bus (kuberl.runtime.plot_cluster:
the trainer publishes every row to a stream, kuberl.runtime.bus.metrics), while the bus runs; its
metrics.jsonl also stays on the checkpoint volume (see docs/tracking.md).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"
DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


class PlotError(Exception):
    """Bad input for `kuberl plot`: the message says what and where."""


@dataclass
class Figure:
    """What was drawn: the PNG, and each panel's title with the labels of its lines (for tests and messages)."""

    path: Path
    steps: int
    panels: dict[str, list[str]] = field(default_factory=dict)


def parse_metrics(text: str, source: str) -> list[dict[str, Any]]:
    """metrics.jsonl rows, one per step (the last line of a step wins), sorted by step."""
    by_step: dict[int, dict[str, Any]] = {}
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise PlotError(f"{source}:{n}: not a JSON line ({exc.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("step"), int):
            raise PlotError(f"{source}:{n}: a metrics line is an object with an integer step")
        by_step[row["step"]] = row
    return [by_step[s] for s in sorted(by_step)]


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def _series(rows: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], _num(r.get(key))) for r in rows]
    pts = [(s, v) for s, v in pts if v is not None]
    return [s for s, _ in pts], [v for _, v in pts]


def eval_series(rows: list[dict[str, Any]]) -> dict[str, tuple[list[int], list[float]]]:
    """Evaluation curves: a row's `eval` dict (flattened) and its `eval/*` keys (kuberl.runtime.evaluation), at the
    step that was evaluated (`evaluated_step`) when the row names it. `eval_seconds` and the like are no curve."""
    out: dict[str, tuple[list[int], list[float]]] = {}

    def add(name: str, step: int, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                add(f"{name}/{k}", step, v)
        elif (v := _num(value)) is not None:
            xs, ys = out.setdefault(name, ([], []))
            xs.append(step)
            ys.append(v)

    for r in rows:
        at = r["step"] if not isinstance(r.get("evaluated_step"), int) else r["evaluated_step"]
        for key, value in r.items():
            if key == "eval" or key.startswith("eval/"):
                add(key, at, value)
    return out


def _moving_average(ys: list[float]) -> tuple[list[float], int]:
    window = max(1, len(ys) // 20)
    return [sum(ys[max(0, i - window + 1): i + 1]) / len(ys[max(0, i - window + 1): i + 1]) for i in range(len(ys))], window


def plot_metrics(rows: list[dict[str, Any]], out: str | Path, title: str = "") -> Figure:
    """Draw the panels that have data into `out` (PNG). Raises PlotError when no step has a reward."""
    steps, rewards = _series(rows, "reward_mean")
    if not steps:
        raise PlotError(f"no training step with a reward_mean in {title or 'the metrics'}: nothing to plot yet")
    panels: list[tuple[str, str, list[tuple[str, list[int], list[float], dict[str, Any]]]]] = []
    smooth, window = _moving_average(rewards)
    panels.append(("reward", "mean reward", [("mean reward per step", steps, rewards, {"alpha": 0.35}),
                                             (f"moving average ({window} steps)", steps, smooth, {"linewidth": 2})]))
    if (ent := _series(rows, "entropy"))[0]:
        panels.append(("entropy", "policy entropy (nats/token)", [("entropy", *ent, {})]))
    stale = [(label, *_series(rows, key), {}) for key, label in (("staleness_mean", "mean"), ("staleness_max", "max"))]
    if any(xs for _, xs, _, _ in stale):
        panels.append(("staleness", "policy versions behind", [s for s in stale if s[1]]))
    if evals := eval_series(rows):
        panels.append(("eval", "evaluation", [(name, xs, ys, {"marker": "o"}) for name, (xs, ys) in sorted(evals.items())]))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 2.6 * len(panels) + 0.6), sharex=True, squeeze=False)
    drawn: dict[str, list[str]] = {}
    for ax, (name, ylabel, lines) in zip(axes[:, 0], panels):
        for label, xs, ys, style in lines:
            ax.plot(xs, ys, label=label, **style)
        ax.set_title(name)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize="small")
        drawn[name] = [label for label, *_ in lines]
    axes[-1, 0].set_xlabel("training step")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return Figure(out, len(rows), drawn)


# ----------------------------------------------------------------------------------------------
# Where the metrics come from: a workdir (or the file); a cluster run: kuberl.runtime.plot_cluster
# ----------------------------------------------------------------------------------------------


def read_local(target: Path) -> tuple[str, Path]:
    path = target / METRICS_FILE if target.is_dir() else target
    if not path.is_file():
        raise PlotError(f"{path}: no such file (kuberl plot takes a run's workdir, its {METRICS_FILE}, or an experiment name)")
    return path.read_text(), path


def read_cluster(name: str, namespace: str, kubeconfig: str | None, context: str | None) -> list[dict[str, Any]]:
    """Every step's row of a cluster run, from the metrics stream on its bus (kuberl.runtime.plot_cluster)."""
    from kuberl.runtime.plot_cluster import ClusterError, read_cluster_rows

    try:
        rows = read_cluster_rows(name, namespace, kubeconfig, context)
    except ClusterError as exc:
        raise PlotError(str(exc)) from None
    if not rows:
        raise PlotError(f"experiment {namespace}/{name}: its metrics stream is empty: no training step yet")
    return rows


def main(args: argparse.Namespace) -> int:
    target = Path(args.target)
    try:
        if target.exists() or not DNS1123_LABEL.match(args.target):
            text, source = read_local(target)
            rows = parse_metrics(text, str(source))
            out, title = source.parent / "curves.png", source.parent.name
        else:
            namespace = args.namespace or "default"
            rows = read_cluster(args.target, namespace, args.kubeconfig, getattr(args, "context", None))
            out, title = Path(f"{args.target}-curves.png"), f"{namespace}/{args.target}"
        fig = plot_metrics(rows, args.output or out, title=title)
    except PlotError as exc:
        print(f"kuberl plot: {exc}", file=sys.stderr)
        return 2
    print(f"kuberl plot: {fig.steps} steps; {', '.join(fig.panels)} curves in {fig.path}")
    return 0
