"""The agent path (`workflow.type: agent`) against the plain path (rlvr) per step and per generated token.

Runs `kuberl run` on examples/quickstart.yaml and examples/agent-cpu.yaml for the same number of steps
(checkpoints out of the comparison). The two manifests differ only in the workflow: the same tiny model,
task, G = 8, batchSize 16, concurrency 16, eta 2, disk weight sync. Per sample the plain path makes one
engine call of at most 8 new tokens; the agent (runtime/kuberl/runtime/agents/repeat.py) makes two, of at
most 4 and 8, the second after a prompt that repeats the first turn plus the checker's message. So a
step of the agent path asks the engine for twice the requests and up to 1.5x the generated tokens: the
fair comparison is per generated token (the budgets; the tiny model seldom stops early). Usage:
    flock /tmp/kuberl-heavy.lock python bench/bench_agent.py [--steps 30] [--only agent]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_async import ROOT, run_once  # noqa: E402  (the same runner and step-time accounting)

CONCURRENCY = 16  # groups in flight, the same for both paths whatever the manifests say (the figures in docs/benchmarks.md are at 16)
PATHS = {  # name -> (manifest, generated-token budget per sample)
    "plain": (ROOT / "examples" / "quickstart.yaml", 8),
    "agent": (ROOT / "examples" / "agent-cpu.yaml", 4 + 8),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--only", choices=sorted(PATHS), help="run one path only")
    args = parser.parse_args()
    names = [args.only] if args.only else list(PATHS)
    results = {}
    for name in names:
        manifest, _ = PATHS[name]
        with tempfile.TemporaryDirectory(prefix=f"kuberl-bench-{name}-") as tmp:
            results[name] = run_once(manifest, 2, args.steps, Path(tmp), CONCURRENCY)
    print(f"\n{time.strftime('%Y-%m-%d %H:%M')}: {args.steps} steps each, eta 2 (first steps excluded as in bench_async)")
    print(f"{'path':<8}{'step s':>8}{'wait s':>8}{'samples/s':>10}{'tok/sample':>11}{'ms/token':>9}{'reward(last5)':>14}{'wall s':>8}")
    for name, r in results.items():
        budget = PATHS[name][1]
        ms_per_token = 1000 / (r["samples_per_s"] * budget)
        r["ms_per_token"] = ms_per_token
        print(f"{name:<8}{r['step_s']:>8.3f}{r['wait_s']:>8.3f}{r['samples_per_s']:>10.1f}{budget:>11}{ms_per_token:>9.3f}"
              f"{r['final_reward']:>14.3f}{r['wall_s']:>8.0f}")
    if len(results) == 2:
        print(f"\nagent / plain: {results['agent']['step_s'] / results['plain']['step_s']:.2f}x per step, "
              f"{results['agent']['ms_per_token'] / results['plain']['ms_per_token']:.2f}x per generated token (target <= 2x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
