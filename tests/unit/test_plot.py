"""`kuberl plot`: a run's metrics.jsonl to a PNG of reward / entropy / staleness (/ eval) panels, from a workdir; bad
input fails with the line it is on. A cluster run (its metrics stream on the bus): tests/unit/test_plot_stream.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kuberl.runtime.plot import PlotError, eval_series, parse_metrics, plot_metrics

ROOT = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def metrics_rows(n: int = 12, evals: bool = False) -> list[dict]:
    rows = []
    for s in range(1, n + 1):
        r = {"step": s, "time": 1.0 * s, "reward_mean": s / n, "entropy": 3.0 - s / n, "staleness_mean": 0.5, "staleness_max": 1,
             "timings": {"train.collect": 0.1}, "group_ids": ["a"]}
        if evals and s % 4 == 0:
            r["eval"] = {"reward_mean": s / (2 * n), "pass@4": s / n}
        rows.append(r)
    return rows


def write_run(folder: Path, rows: list[dict]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def kuberl(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kuberl.cli", "plot", *args], capture_output=True, text=True, cwd=ROOT, timeout=120,
                          env=env, check=False)


def test_kuberl_plot_of_a_workdir_draws_reward_entropy_and_staleness(tmp_path):
    run = write_run(tmp_path / "myrun", metrics_rows())
    done = kuberl(str(run))
    assert done.returncode == 0, done.stderr
    png = run / "curves.png"
    assert "12 steps; reward, entropy, staleness curves in" in done.stdout
    w, h = png_size(png)
    assert w > 500 and h > 500


def test_the_panels_and_their_lines(tmp_path):
    fig = plot_metrics(metrics_rows(), tmp_path / "a.png")
    assert fig.panels == {"reward": ["mean reward per step", "moving average (1 steps)"], "entropy": ["entropy"], "staleness": ["mean", "max"]}
    with_eval = plot_metrics(metrics_rows(evals=True), tmp_path / "b.png")
    assert with_eval.panels["eval"] == ["eval/pass@4", "eval/reward_mean"]
    assert png_size(tmp_path / "b.png")[1] > png_size(tmp_path / "a.png")[1]  # one more panel, a taller image
    # A run without entropy or staleness (an old metrics.jsonl) gets the reward panel alone.
    bare = plot_metrics([{"step": s, "reward_mean": 0.1 * s} for s in (1, 2, 3)], tmp_path / "c.png")
    assert list(bare.panels) == ["reward"]


def test_eval_curves_sit_at_the_evaluated_step_and_timings_are_no_curve():
    rows = [{"step": 1, "reward_mean": 0.1},
            {"step": 3, "reward_mean": 0.3, "evaluated_step": 2, "eval/pass_at_4": 0.5, "eval/reward_mean": 0.25, "eval_seconds": 9.0},
            {"step": 4, "reward_mean": 0.4, "eval": {"pass@1": 0.75}}]
    assert eval_series(rows) == {"eval/pass_at_4": ([2], [0.5]), "eval/reward_mean": ([2], [0.25]), "eval/pass@1": ([4], [0.75])}


def test_a_step_written_twice_is_drawn_once_from_its_last_line(tmp_path):
    rows = metrics_rows(4) + [{"step": 3, "reward_mean": 0.99}, {"step": 4, "reward_mean": 0.98}]  # a restart redid 3 and 4
    parsed = parse_metrics("".join(json.dumps(r) + "\n" for r in rows), "m")
    assert [(r["step"], r["reward_mean"]) for r in parsed] == [(1, 0.25), (2, 0.5), (3, 0.99), (4, 0.98)]


@pytest.mark.parametrize("text, message", [
    ('{"step": 1, "reward_mean": 0.1}\n{"step": 2, "rew\n', "metrics.jsonl:2: not a JSON line"),
    ('{"reward_mean": 0.1}\n', "metrics.jsonl:1: a metrics line is an object with an integer step"),
    ('{"step": 1, "loss": 0.1}\n', "no training step with a reward_mean"),
    ("", "no training step with a reward_mean"),
])
def test_bad_metrics_fail_with_the_line_and_exit_2(tmp_path, text, message):
    (tmp_path / "metrics.jsonl").write_text(text)
    done = kuberl(str(tmp_path))
    assert done.returncode == 2
    assert message in done.stderr
    assert not (tmp_path / "curves.png").exists()


def test_a_missing_workdir_says_what_plot_takes(tmp_path):
    done = kuberl(str(tmp_path / "nope" / "x"), "-o", str(tmp_path / "o.png"))
    assert done.returncode == 2 and "no such file" in done.stderr


def test_plot_error_is_an_exception_with_the_message():
    with pytest.raises(PlotError, match="nothing to plot"):
        plot_metrics([], "unused.png")
