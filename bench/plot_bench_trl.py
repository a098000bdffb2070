"""Every round of `bench/bench_trl.py` logs, as one picture: TRL's and KubeRL's samples/s per round and their ratio.

Reads the logs bench_trl.py prints (one block per round: TRL's row, KubeRL's row, the ratio line), in the order given,
and plots samples/s (top) and KubeRL / TRL (bottom, with the 1.5x target and the median of the rounds).

    python bench/plot_bench_trl.py docs/design/bench-trl-2026-11-28-xeon-{a,b,c,d,e}.log ... -o docs/images/bench-trl-rounds.png
"""

from __future__ import annotations

import argparse
import re
import statistics
from dataclasses import dataclass
from pathlib import Path

HEADER = re.compile(r"^(\d{4}-\d\d-\d\d)(?: \(round \d+ of \d+\))?, \d+ cores")  # "(round i of n)" with --repeats
ROW = re.compile(r"^(TRL GRPOTrainer|KubeRL) .*?\s([\d.]+)\s+step (\d+), (\d+) s\s+([\d.]+)\s*$")
RATIO = re.compile(r"samples/s ([\d.]+)x; time to reward [\d.]+ ([\d.]+)x faster")
TARGET = 1.5


@dataclass
class Round:
    date: str
    source: str
    trl: float  # samples/s
    kuberl: float
    ratio: float  # as the bench printed it (2 decimals)
    sooner: float  # TRL's seconds to the reward threshold / KubeRL's


def parse_log(path: Path) -> list[Round]:
    """The rounds of one bench_trl.py log; a round missing its TRL row, KubeRL row or ratio line is an error."""
    rounds: list[Round] = []
    date, rows = None, {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if m := HEADER.match(line):
            date, rows = m.group(1), {}
        elif m := ROW.match(line):
            rows[m.group(1)] = float(m.group(2))
        elif (m := RATIO.search(line)) and date is not None:
            if set(rows) != {"TRL GRPOTrainer", "KubeRL"}:
                raise ValueError(f"{path}:{n}: a ratio line without both rows of its round (found {sorted(rows)})")
            rounds.append(Round(date, path.name, rows["TRL GRPOTrainer"], rows["KubeRL"], float(m.group(1)), float(m.group(2))))
            date, rows = None, {}
    if not rounds:
        raise ValueError(f"{path}: no bench_trl.py round in it")
    return rounds


def plot(rounds: list[Round], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = list(range(1, len(rounds) + 1))
    ratios = [r.ratio for r in rounds]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True, height_ratios=[3, 2])
    top.plot(x, [r.kuberl for r in rounds], "o-", label="KubeRL (vLLM CPU, eta 2, inFlight keep)")
    top.plot(x, [r.trl for r in rounds], "s-", label="TRL GRPOTrainer")
    top.set_ylabel("samples/s")
    top.set_ylim(bottom=0)
    top.legend(loc="lower right")
    top.set_title(title)
    bottom.bar(x, ratios, color=["tab:green" if v >= TARGET else "tab:red" for v in ratios])
    bottom.axhline(TARGET, color="black", linestyle="--", linewidth=1, label=f"target {TARGET}x")
    median = statistics.median(ratios)
    bottom.axhline(median, color="tab:blue", linewidth=1, label=f"median {median:.3f}x")
    bottom.set_ylim(1.0, max(ratios) + 0.3)
    bottom.set_ylabel("KubeRL / TRL")
    bottom.set_xlabel("round (each ratio against the same round's TRL run)")
    bottom.legend(loc="upper center", ncol=2)
    # One tick per round, its date under the first round of each day.
    bottom.set_xticks(x, [r.date[5:] if i == 0 or r.date != rounds[i - 1].date else "" for i, r in enumerate(rounds)])
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("logs", nargs="+", type=Path, help="bench_trl.py logs, oldest first")
    ap.add_argument("-o", "--out", type=Path, default=Path("bench-trl-rounds.png"))
    ap.add_argument("--title", default="bench/bench_trl.py, every round")
    args = ap.parse_args(argv)
    rounds = [r for log in args.logs for r in parse_log(log)]
    ratios = [r.ratio for r in rounds]
    below = [f"{v:.2f}" for v in ratios if v < TARGET]
    print(f"{len(rounds)} rounds: samples/s ratio median {statistics.median(ratios):.3f}x, {len(below)} below {TARGET}x"
          f"{' (' + ', '.join(below) + ')' if below else ''}; reward threshold sooner in {sum(r.sooner > 1 for r in rounds)}")
    plot(rounds, args.out, args.title)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
