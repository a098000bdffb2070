"""Async (eta >= 1) against sync (eta = 0) RL, with the engine's workers and the trainer on disjoint cores: the AReaL gain.

Runs `kuberl run` on the same manifest twice for the same number of steps, changing only
staleness.maxHeadOffpolicyness. `kuberl run` gives the engine's model workers and the trainer their own
cores (on 2 cores: one each, the stand-in for separate devices; the engine's server and agent run on both). From the sync run it measures the time
to generate a batch (the trainer's wait: weight load + generation) and to train on it (the rest of its
step), prints the ideal overlap gain (gen + train) / max(gen, train), and next to it the achieved
async / sync throughput ratio. Both runs let one agent generate (eta + 1) x batchSize groups at once (rollout.concurrency:
every group the async run's staleness bound lets start, AReaL's capacity; the sync run's bound allows one batch whatever
the setting); `--concurrency manifest` keeps the manifest's (the quickstart's 16 = one batch throttles the async run:
0.75-0.76 of the ideal gain against 0.80 at 48, 2026-11-28). Usage:
    flock /tmp/kuberl-heavy.lock python bench/bench_async.py [--steps 150] [--eta 2] [--manifest examples/quickstart.yaml]
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
SKIP = 3  # first steps: engine warm-up and the first weight loads


def run_once(manifest: Path, eta: int, steps: int, workroot: Path, concurrency: int | None = None) -> dict:
    doc = yaml.safe_load(manifest.read_text())
    doc["metadata"]["name"] = f"bench-eta{eta}"
    if concurrency is not None:
        doc["spec"].setdefault("rollout", {})["concurrency"] = concurrency
    doc["spec"].setdefault("staleness", {})["maxHeadOffpolicyness"] = eta
    doc["spec"]["training"] = {"totalSteps": steps}
    doc["spec"].setdefault("checkpoint", {})["everySteps"] = steps  # checkpoint cost out of the comparison
    path = workroot / f"eta{eta}.yaml"
    path.write_text(yaml.safe_dump(doc))
    workdir = workroot / f"eta{eta}"
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "kuberl.cli", "run", str(path), "--workdir", str(workdir)], cwd=ROOT,
                          stdout=subprocess.DEVNULL)
    wall = time.monotonic() - t0
    if proc.returncode != 0:
        raise SystemExit(f"eta={eta}: kuberl run failed with {proc.returncode}; logs in {workdir / 'logs'}")
    rows = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    timed = rows[SKIP:]
    span = timed[-1]["time"] - rows[SKIP - 1]["time"]
    n = len(timed)
    wait = sum(r.get("wait_seconds", 0.0) for r in timed) / n
    train = sum(r["step_seconds"] - r.get("wait_seconds", 0.0) for r in timed) / n
    return {
        "eta": eta, "steps": len(rows), "samples_per_s": sum(r["samples"] for r in timed) / span,
        "step_s": span / n, "wait_s": wait, "train_s": train, "idle_fraction": wait * n / span,
        "final_reward": sum(r["reward_mean"] for r in rows[-5:]) / len(rows[-5:]),
        "mean_staleness": sum(r.get("staleness_mean") or 0 for r in timed) / n, "wall_s": wall,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--eta", type=int, default=2, help="staleness bound of the async run (>= 1)")
    parser.add_argument("--manifest", type=Path, default=ROOT / "examples" / "quickstart.yaml")
    parser.add_argument("--concurrency", default="capacity",
                        help="rollout.concurrency of both runs: capacity = (eta + 1) x batchSize (default), manifest, or a number")
    args = parser.parse_args()
    if args.eta < 1:
        raise SystemExit("--eta: the async run needs a staleness bound of at least 1")
    from kuberl.api import load_experiment
    from kuberl.runtime.resources import available_cpus, format_cpu_list, plan_local_cpus

    exp = load_experiment(args.manifest)
    plan = plan_local_cpus(exp, available_cpus())
    if args.concurrency == "capacity":
        concurrency = (args.eta + 1) * exp.spec.algorithm.batch_size
    elif args.concurrency == "manifest":
        concurrency = None
    elif args.concurrency.isdigit() and int(args.concurrency) > 0:
        concurrency = int(args.concurrency)
    else:
        raise SystemExit(f"--concurrency {args.concurrency!r}: capacity, manifest or a positive number")
    with tempfile.TemporaryDirectory(prefix="kuberl-bench-") as tmp:
        results = [run_once(args.manifest, eta, args.steps, Path(tmp), concurrency) for eta in (0, args.eta)]
    sync, asyn = results
    gen, train = sync["wait_s"], sync["train_s"]  # sync: the trainer waits for the whole batch, then trains alone
    ideal = (gen + train) / max(gen, train)
    achieved = asyn["samples_per_s"] / sync["samples_per_s"]
    eng = plan["engine-0"]
    shown = exp.spec.rollout.concurrency if concurrency is None else concurrency
    print(f"\n{time.strftime('%Y-%m-%d')}: {args.manifest.name}, {args.steps} steps, rollout.concurrency {shown}; cores: engine workers "
          f"{format_cpu_list(list(eng.compute or eng.cpus))} (its server and agent {format_cpu_list(list(eng.cpus))}), "
          f"trainer {format_cpu_list(list(plan['trainer'].cpus))}")
    print(f"{'setting':<16}{'samples/s':>10}{'step s':>8}{'wait s':>8}{'idle':>6}{'staleness':>10}{'reward(last5)':>14}{'wall s':>8}")
    for r in results:
        label = "sync (eta=0)" if r["eta"] == 0 else f"async (eta={r['eta']})"
        print(f"{label:<16}{r['samples_per_s']:>10.1f}{r['step_s']:>8.3f}{r['wait_s']:>8.3f}{r['idle_fraction']:>6.0%}"
              f"{r['mean_staleness']:>10.2f}{r['final_reward']:>14.3f}{r['wall_s']:>8.0f}")
    print(f"\nsync step: generate {gen:.3f} s + train {train:.3f} s; ideal overlap gain (gen + train) / max(gen, train) = {ideal:.2f}x")
    print(f"achieved async / sync = {achieved:.2f}x = {achieved / ideal:.2f} of the ideal gain (target >= 0.8)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
