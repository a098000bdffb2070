"""bench/plot_bench_trl.py reads bench_trl.py's logs as printed (the README's rounds plot comes from it)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("plot_bench_trl", ROOT / "bench" / "plot_bench_trl.py")
plot_bench_trl = importlib.util.module_from_spec(spec)
sys.modules.setdefault("plot_bench_trl", plot_bench_trl)  # dataclasses look their module up
spec.loader.exec_module(plot_bench_trl)

ROUND = """\
2026-11-29 (round {i} of 2), 2 cores, TRL 1.16.0; 400 steps of 8 prompts x 8, 16 new tokens, reward 0.6 = trailing 10-step mean
                                               samples/s         reward 0.6 at  final reward
TRL GRPOTrainer (transformers generate, sync)      {trl}        step 137, 50 s         0.981
KubeRL (vLLM CPU, eta=2, inFlight keep)            {k}        step 134, 36 s         0.981

KubeRL (vLLM CPU, eta=2, inFlight keep) / TRL: samples/s {r}x; time to reward 0.6 1.39x faster (TRL's seconds / KubeRL's); final reward 0.981 vs 0.981
  trainer, mean seconds per step: advantages 0.001, checkpoint 0.004, collect 0.024
"""


def test_each_round_of_a_log_is_read_with_both_sides_and_the_printed_ratio(tmp_path):
    log = tmp_path / "b.log"
    log.write_text(ROUND.format(i=1, trl="167.3", k="246.4", r="1.47") + "\n" + ROUND.format(i=2, trl="152.9", k="245.2", r="1.60")
                   + "\n2 alternating rounds, each ratio against the same round's TRL run:\n  inFlight keep: samples/s ratio median 1.54x\n")
    rounds = plot_bench_trl.parse_log(log)
    assert [(r.trl, r.kuberl, r.ratio, r.sooner) for r in rounds] == [(167.3, 246.4, 1.47, 1.39), (152.9, 245.2, 1.60, 1.39)]
    assert rounds[0].date == "2026-11-29"


def test_a_single_round_log_without_a_round_count_is_read(tmp_path):
    log = tmp_path / "one.log"
    log.write_text(ROUND.format(i=1, trl="139.6", k="215.5", r="1.54").replace(" (round 1 of 2)", ""))
    assert [r.ratio for r in plot_bench_trl.parse_log(log)] == [1.54]


def test_a_round_missing_a_side_or_a_log_without_rounds_is_an_error(tmp_path):
    log = tmp_path / "cut.log"
    lines = ROUND.format(i=1, trl="1.0", k="2.0", r="2.00").splitlines()
    log.write_text("\n".join(x for x in lines if not (x.startswith("KubeRL (") and "/ TRL" not in x)))  # KubeRL's row, not the ratio line
    with pytest.raises(ValueError, match="without both rows"):
        plot_bench_trl.parse_log(log)
    empty = tmp_path / "empty.log"
    empty.write_text("nothing here\n")
    with pytest.raises(ValueError, match="no bench_trl.py round"):
        plot_bench_trl.parse_log(empty)


def test_the_committed_logs_give_the_readmes_figures_and_a_picture(tmp_path):
    """Every committed bench_trl log still parses (the README's plot is made from them), and a picture is written."""
    logs = sorted((ROOT / "docs" / "design").glob("bench-trl-*.log"))
    assert logs
    rounds = [r for log in logs for r in plot_bench_trl.parse_log(log)]
    assert all(r.kuberl > 0 and r.trl > 0 and abs(r.kuberl / r.trl - r.ratio) < 0.006 for r in rounds)
    out = tmp_path / "rounds.png"
    assert plot_bench_trl.main([str(p) for p in logs] + ["-o", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
