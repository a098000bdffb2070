"""Async (eta = 4) against sync (eta = 0) RL on the quickstart task: the figure AReaL is about.

Runs `kuberl run examples/quickstart.yaml` twice for the same number of steps, changing only
staleness.maxHeadOffpolicyness, and prints trained samples per second of each, their ratio and the
trainer's idle fraction (time spent waiting for trajectories). Usage:
    python bench/bench_async.py [--steps 40] [--manifest examples/quickstart.yaml]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def run_once(manifest: Path, eta: int, steps: int, workroot: Path) -> dict:
    doc = yaml.safe_load(manifest.read_text())
    doc["metadata"]["name"] = f"bench-eta{eta}"
    doc["spec"].setdefault("staleness", {})["maxHeadOffpolicyness"] = eta
    doc["spec"]["training"] = {"totalSteps": steps}
    doc["spec"].setdefault("checkpoint", {})["everySteps"] = steps  # checkpoint cost out of the comparison
    path = workroot / f"eta{eta}.yaml"
    path.write_text(yaml.safe_dump(doc))
    workdir = workroot / f"eta{eta}"
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "kuberl.cli", "run", str(path), "--workdir", str(workdir)], cwd=ROOT)
    wall = time.monotonic() - t0
    if proc.returncode != 0:
        raise SystemExit(f"eta={eta}: kuberl run failed with {proc.returncode}; logs in {workdir / 'logs'}")
    rows = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    # Skip the first step: it includes engine warm-up and the first weight load for both settings.
    timed = rows[1:]
    span = timed[-1]["time"] - rows[0]["time"]
    samples = sum(r["samples"] for r in timed)
    idle = sum(r.get("wait_seconds", 0.0) for r in timed) / span if span > 0 else float("nan")
    return {
        "eta": eta,
        "steps": len(rows),
        "samples_per_s": samples / span,
        "idle_fraction": idle,
        "final_reward": sum(r["reward_mean"] for r in rows[-5:]) / len(rows[-5:]),
        "mean_staleness": sum(r.get("staleness_mean") or 0 for r in timed) / len(timed),
        "wall_s": wall,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--manifest", type=Path, default=ROOT / "examples" / "quickstart.yaml")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kuberl-bench-") as tmp:
        results = [run_once(args.manifest, eta, args.steps, Path(tmp)) for eta in (0, 4)]
    sync, asyn = results
    print(f"\n{'setting':<16}{'samples/s':>12}{'idle':>8}{'staleness':>11}{'reward(last5)':>15}{'wall s':>9}")
    for r in results:
        label = "sync (eta=0)" if r["eta"] == 0 else f"async (eta={r['eta']})"
        print(f"{label:<16}{r['samples_per_s']:>12.1f}{r['idle_fraction']:>8.0%}{r['mean_staleness']:>11.2f}{r['final_reward']:>15.3f}{r['wall_s']:>9.0f}")
    print(f"\nasync / sync throughput ratio: {asyn['samples_per_s'] / sync['samples_per_s']:.2f}x "
          f"over {args.steps} steps (trainer idle {sync['idle_fraction']:.0%} -> {asyn['idle_fraction']:.0%})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
