"""KubeRL (`kuberl run`, vLLM CPU engine, async) against TRL's GRPOTrainer, in one run, on the same ground.

Same locally built model (tiny Qwen2, random init, untied, ~1.77M parameters), same task (the prompt
names a digit; reward = share of the first 12 characters of the answer equal to it), same prompts with
the same chat template, G = 8 samples per prompt, 8 prompts (64 completions) per step, 16 new tokens,
temperature 1, lr 1e-4 constant, AdamW without weight decay, grad clip 1, PPO clip 0.2, no KL, group-
normalised advantages, token-mean loss, float32. Each side runs in its own process; TRL gets every
core (it is one process), KubeRL splits them per role (`kuberl run`). Prints samples/s, seconds to a
trailing-10-step mean reward of 0.6 (both timed from the end of the first training step, so start-up
is out), final reward (mean of the last 10 steps), the ratios, and KubeRL's trainer stage times.

    pip install 'kuberl[bench]'   # TRL; never needed by the tests
    flock /tmp/kuberl-heavy.lock python bench/bench_trl.py [--steps 400] [--eta 2] [--in-flight abort keep] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
G, PROMPTS, NEW_TOKENS, LR, CLIP, ANSWER_LEN, THRESHOLD, TRAIL = 8, 8, 16, 1e-4, 0.2, 12, 0.6, 10
MODEL = {"hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 2}  # 1.77M parameters with the tiny tokenizer


def build_inputs(root: Path, size: int = 2000) -> tuple[Path, Path]:
    """The model (built locally, seed 0) and the data set (.jsonl: question, answer), shared by both sides."""
    import random

    from kuberl.runtime.data import REPEAT_SHOWN
    from kuberl.runtime.models import build_tiny_model

    model = build_tiny_model(root / "model", seed=0, **MODEL)
    rng = random.Random("bench-trl")
    rows = []
    for _ in range(size):
        d = str(rng.randrange(10))
        rows.append({"question": f"Repeat the digit {d}: {d * REPEAT_SHOWN}", "answer": d * ANSWER_LEN})
    data = root / "repeat12.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return model, data


def summarise(name: str, steps: list[tuple[float, float, int]]) -> dict:
    """steps: (end time, mean reward, samples) per training step, in order."""
    t0 = steps[0][0]  # end of the first step: start-up (engine boot, model load, first batch) is excluded
    timed = steps[1:]
    span = timed[-1][0] - t0
    rewards = [r for _, r, _ in steps]
    reached = None
    for i in range(TRAIL - 1, len(steps)):
        if statistics.mean(rewards[i - TRAIL + 1: i + 1]) >= THRESHOLD:
            reached = (i + 1, steps[i][0] - t0)
            break
    return {"name": name, "steps": len(steps), "samples_per_s": sum(n for *_, n in timed) / span, "train_s": span,
            "reached_step": reached[0] if reached else None, "reached_s": reached[1] if reached else None,
            "final_reward": statistics.mean(rewards[-TRAIL:])}


# ---------------------------------------------------------------------------------------------
# KubeRL
# ---------------------------------------------------------------------------------------------


def kuberl_manifest(model: Path, data: Path, steps: int, eta: int, in_flight: str = "default") -> dict:
    """KubeRL's side. rollout.concurrency = (eta + 1) * batch: every group the staleness bound lets start at once
    (AReaL's capacity), so the engine batches as many sequences as it may (measured: 16 -> 24 groups, +5% samples/s)."""
    return {
        "apiVersion": "kuberl.io/v1alpha1", "kind": "RLExperiment", "metadata": {"name": "bench-trl"},
        "spec": {
            "model": {"path": str(model), "dtype": "float32"},
            "dataset": {"path": str(data), "promptField": "question", "answerField": "answer"},
            "workflow": {"type": "rlvr", "reward": "repeat-digit"},  # share of the first len(answer) = 12 characters
            "algorithm": {"name": "grpo", "samplesPerPrompt": G, "batchSize": PROMPTS, "maxNewTokens": NEW_TOKENS,
                          "temperature": 1.0, "topP": 1.0, "learningRate": LR, "epsClip": CLIP, "rewardScaling": 1.0,
                          "rewardBias": 0.0, "ppoMinibatches": 1, "optimizer": {"weightDecay": 0.0, "gradClip": 1.0}},
            "staleness": {"maxHeadOffpolicyness": eta},
            "rollout": {"engine": "vllm", "replicas": 1, "accelerator": {"type": "cpu", "count": 0}, "concurrency": (eta + 1) * PROMPTS},
            "trainer": {"backend": "fsdp", "accelerator": {"type": "cpu", "count": 1}},
            "weightSync": {"mode": "disk"} | ({} if in_flight == "default" else {"inFlight": in_flight}),  # default: unset
            "checkpoint": {"everySteps": steps, "keep": 1},
            "training": {"totalSteps": steps},
        },
    }


def run_kuberl(root: Path, model: Path, data: Path, steps: int, eta: int, in_flight: str) -> tuple[dict, dict]:
    path = root / f"kuberl-{in_flight}.yaml"
    path.write_text(yaml.safe_dump(kuberl_manifest(model, data, steps, eta, in_flight), sort_keys=False))
    workdir = root / f"kuberl-{in_flight}"
    proc = subprocess.run([sys.executable, "-m", "kuberl.cli", "run", str(path), "--workdir", str(workdir)], cwd=ROOT,
                          stdout=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise SystemExit(f"kuberl run failed with {proc.returncode}; logs in {workdir / 'logs'}")
    rows = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    stages: dict[str, float] = {}
    for r in rows[1:]:
        for k, v in r.get("timings", {}).items():
            stages[k] = stages.get(k, 0.0) + v / (len(rows) - 1)
    label = f"inFlight {in_flight}" if in_flight != "default" else "defaults"
    return summarise(f"KubeRL (vLLM CPU, eta={eta}, {label})", [(r["time"], r["reward_mean"], r["samples"]) for r in rows]), stages


# ---------------------------------------------------------------------------------------------
# TRL (in its own process: `--trl-worker`)
# ---------------------------------------------------------------------------------------------


def trl_worker(model_dir: str, data: str, steps: int, out: str) -> None:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from kuberl.runtime.rewards import repeat_digit_reward

    rows = [json.loads(x) for x in Path(data).read_text().splitlines() if x.strip()]
    ds = Dataset.from_list([{"prompt": [{"role": "user", "content": r["question"]}], "answer": r["answer"]} for r in rows])

    def reward(prompts, completions, answer, **_) -> list[float]:
        return [repeat_digit_reward("", c[0]["content"], a) for c, a in zip(completions, answer)]

    log: list[tuple[float, float, int]] = []

    class Times(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                log.append((time.monotonic(), float(logs["reward"]), G * PROMPTS))

    cfg = GRPOConfig(
        output_dir=str(Path(out).parent / "trl-out"), max_steps=steps, per_device_train_batch_size=G * PROMPTS,
        num_generations=G, max_completion_length=NEW_TOKENS, learning_rate=LR, lr_scheduler_type="constant",
        weight_decay=0.0, max_grad_norm=1.0, epsilon=CLIP, beta=0.0, num_iterations=1, loss_type="dapo",
        scale_rewards="group", temperature=1.0, top_p=1.0, top_k=0, logging_steps=1, save_strategy="no",
        report_to=[], use_cpu=True, bf16=False, fp16=False, seed=0, dataloader_num_workers=0, disable_tqdm=True,
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(model_dir)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=cfg, train_dataset=ds, processing_class=tok, callbacks=[Times()])
    trainer.train()
    Path(out).write_text(json.dumps(log))


def run_trl(root: Path, model: Path, data: Path, steps: int) -> dict:
    out = root / "trl.json"
    proc = subprocess.run([sys.executable, __file__, "--trl-worker", str(model), str(data), str(steps), str(out)], cwd=ROOT,
                          stdout=subprocess.DEVNULL, stderr=open(root / "trl.log", "w"))
    if proc.returncode != 0:
        raise SystemExit(f"TRL failed with {proc.returncode}; see {root / 'trl.log'}")
    return summarise("TRL GRPOTrainer (transformers generate, sync)", [tuple(x) for x in json.loads(out.read_text())])


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--trl-worker":
        trl_worker(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--eta", type=int, default=2, help="KubeRL's staleness.maxHeadOffpolicyness")
    parser.add_argument("--in-flight", nargs="+", default=["default"], choices=["default", "abort", "keep"],
                        help="KubeRL's weightSync.inFlight settings to run, each one KubeRL run (default: unset, what a user gets)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="rounds of (TRL, then each KubeRL setting), alternating, each ratio against its own round's TRL run: "
                             "a shared VM's speed drifts between runs by as much as the ratio being measured")
    parser.add_argument("--workdir", type=Path, default=None, help="keep logs and metrics here (default: a temporary folder)")
    args = parser.parse_args()
    try:
        import trl
    except ImportError:
        raise SystemExit("TRL is not installed: pip install 'kuberl[bench]'") from None
    rounds = []
    with tempfile.TemporaryDirectory(prefix="kuberl-bench-trl-") as tmp:
        base = args.workdir or Path(tmp)
        for k in range(args.repeats):
            root = base / f"round-{k}" if args.repeats > 1 else base
            root.mkdir(parents=True, exist_ok=True)
            model, data = build_inputs(root)
            theirs = run_trl(root, model, data, args.steps)
            runs = [run_kuberl(root, model, data, args.steps, args.eta, mode) for mode in args.in_flight]
            rounds.append((theirs, runs))
            report(args, trl.__version__, theirs, runs, f" (round {k + 1} of {args.repeats})" if args.repeats > 1 else "")
    if args.repeats > 1:
        print(f"\n{args.repeats} alternating rounds, each ratio against the same round's TRL run:")
        for m, mode in enumerate(args.in_flight):
            speed = [ours["samples_per_s"] / theirs["samples_per_s"] for theirs, runs in rounds for ours, _ in runs[m:m + 1]]
            sooner = [theirs["reached_s"] / ours["reached_s"] for theirs, runs in rounds for ours, _ in runs[m:m + 1]
                      if ours["reached_s"] and theirs["reached_s"]]
            print(f"  inFlight {mode}: samples/s ratio median {statistics.median(speed):.2f}x (each: {', '.join(f'{x:.2f}' for x in speed)}); "
                  f"reward {THRESHOLD} sooner median {statistics.median(sooner) if sooner else float('nan'):.2f}x "
                  f"(each: {', '.join(f'{x:.2f}' for x in sooner)})")
    return 0


def report(args, trl_version: str, theirs: dict, runs: list[tuple[dict, dict]], title: str) -> None:
    print(f"\n{time.strftime('%Y-%m-%d')}{title}, {os.cpu_count()} cores, TRL {trl_version}; {args.steps} steps of {PROMPTS} prompts x {G}, "
          f"{NEW_TOKENS} new tokens, reward {THRESHOLD} = trailing {TRAIL}-step mean, times from the end of step 1")
    print(f"{'':<46}{'samples/s':>10}{'reward 0.6 at':>22}{'final reward':>14}")
    for r in (theirs, *(ours for ours, _ in runs)):
        at = f"step {r['reached_step']}, {r['reached_s']:.0f} s" if r["reached_s"] is not None else "not reached"
        print(f"{r['name']:<46}{r['samples_per_s']:>10.1f}{at:>22}{r['final_reward']:>14.3f}")
    for ours, stages in runs:
        speed = ours["samples_per_s"] / theirs["samples_per_s"]
        to = (theirs["reached_s"] / ours["reached_s"]) if ours["reached_s"] and theirs["reached_s"] else float("nan")
        print(f"\n{ours['name']} / TRL: samples/s {speed:.2f}x; time to reward {THRESHOLD} {to:.2f}x faster "
              f"(TRL's seconds / KubeRL's); final reward {ours['final_reward']:.3f} vs {theirs['final_reward']:.3f}")
        print("  trainer, mean seconds per step: " + ", ".join(f"{k.removeprefix('train.')} {v:.3f}" for k, v in sorted(stages.items())), flush=True)


if __name__ == "__main__":
    sys.exit(main())
