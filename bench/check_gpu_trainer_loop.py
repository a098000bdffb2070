"""The trainer's whole loop on a GPU: `Trainer.run()` against a real nats-server, answered by a synthetic agent.

bench_gpu_trainer.py times the compute stages; this runs what a trainer pod runs around them, on whatever device the
trainer picks (CUDA + NCCL on a GPU machine): tickets out, groups in over JetStream, the decoupled PPO step, weights
published to disk every step (FSDP2 bf16 shards gathered to full tensors), DCP checkpoints, then a second trainer that
resumes from the checkpoint and trains on. The agent answers each ticket with G random-token samples stamped with the
ticket's version (no inference engine: the point is the trainer's I/O on the device). Prints the exit codes, step
times and what was written, and fails (exit 1) if a published version does not load or the resume did not happen.

    python bench/check_gpu_trainer_loop.py [--model qwen2.5-0.5b] [--steps 4]      (--cpu: a smoke run here)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gpu_trainer import SHAPES, build_model  # noqa: E402

G, B = 8, 4


async def agent(url: str, name: str, vocab: int, stop: asyncio.Event, answered: list[int]) -> None:
    """Answer tickets until `stop`: G samples of random tokens each, stamped with the ticket's issued version."""
    from kuberl.runtime.bus import Bus, Sample, TrajectoryGroup

    rng = random.Random(0)
    bus = await Bus.connect(url, name, create=False)
    try:
        while not stop.is_set():
            for lease in await bus.pull_tickets(B, timeout=0.5):
                t = lease.value
                prompt = [rng.randrange(vocab) for _ in range(64)]
                samples = []
                for _ in range(G):
                    n = rng.randrange(32, 129)
                    samples.append(Sample(input_ids=prompt, output_ids=[rng.randrange(vocab) for _ in range(n)], logprobs=[-12.0] * n,
                                          versions=[t.issued_version] * n, loss_mask=[1] * n, reward=float(rng.random() < 0.5)))
                await bus.publish_group(TrajectoryGroup(group_id=t.ticket_id, ticket=t, samples=samples, agent="synthetic-0"))
                await lease.ack()
                answered.append(t.issued_version)
    finally:
        await bus.close()


async def train(exp, url: str, workdir: Path, vocab: int) -> tuple[int, float, int]:
    from kuberl.runtime.trainer.trainer import Trainer

    t = Trainer(exp, bus_url=url, workdir=workdir, handle_sigterm=False, collect_timeout=120)
    stop, answered = asyncio.Event(), []
    run = asyncio.create_task(t.run())
    while not (workdir / "weights").exists() and not run.done():  # the trainer resets the bus objects first
        await asyncio.sleep(0.2)
    helper = asyncio.create_task(agent(url, exp.name, vocab, stop, answered))
    t0 = time.monotonic()
    code = await run
    stop.set()
    await helper
    return code, time.monotonic() - t0, len(answered)


def out_of_memory(exp, url: str, workdir: Path, vocab: int, fraction: float) -> int:
    """The trainer on a GPU capped to `fraction` of its memory: the real allocator's OutOfMemoryError must end the run
    with exit 2 and a one-line termination message naming trainer.microBatchTokens and gradientCheckpointing."""
    torch.cuda.set_per_process_memory_fraction(fraction)
    log = workdir.parent / "termination-log"
    os.environ["KUBERL_TERMINATION_LOG"] = str(log)
    code, secs, _ = asyncio.run(train(exp, url, workdir, vocab))
    message = log.read_text() if log.exists() else ""
    print(f"trainer at {fraction:.0%} of the GPU's memory: exit {code} after {secs:.1f} s; termination message: {message.strip()}",
          flush=True)
    ok = code == 2 and "out of memory" in message and "trainer.microBatchTokens" in message and message.count("\n") == 1
    print("OK" if ok else "FAILED", flush=True)
    return 0 if ok else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-0.5b", choices=list(SHAPES))
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--backend", choices=["fsdp", "megatron"], default="fsdp", help="trainer.backend (one rank: no parallel dimension)")
    ap.add_argument("--memory-fraction", type=float, default=None,
                    help="cap this process's GPU memory (torch.cuda.set_per_process_memory_fraction) so the trainer runs out of it: "
                         "then the check is that it exits 2 with a termination message naming the settings")
    ap.add_argument("--async-save", choices=["auto", "on", "off"], default="auto",
                    help="checkpoint.asyncSave (auto: on for fsdp on a GPU when host memory has room); train.checkpoint in the "
                    "printed timings is what training waited for")
    ap.add_argument("--cpu", action="store_true", help="allow a run without a GPU (a smoke run of the script)")
    args = ap.parse_args()
    if not torch.cuda.is_available() and not args.cpu:
        raise SystemExit("no CUDA device (--cpu smoke-runs this script)")
    from kuberl.api import RLExperiment
    from kuberl.runtime.bus import start_nats_server
    from kuberl.runtime.trainer.weights import load_weights

    server = start_nats_server()
    ok = True
    try:
        with tempfile.TemporaryDirectory(prefix="kuberl-gpu-loop-") as tmp:
            model = build_model(Path(tmp), args.model)
            vocab = json.loads((model / "config.json").read_text())["vocab_size"]
            workdir = Path(tmp) / "work"

            def exp(steps: int):
                return RLExperiment.model_validate({
                    "apiVersion": "kuberl.io/v1alpha1", "kind": "RLExperiment", "metadata": {"name": "gpu-loop"},
                    "spec": {"model": {"path": str(model), "dtype": "bfloat16"}, "dataset": {"builtin": "repeat-digit", "size": 64},
                             "algorithm": {"name": "grpo", "samplesPerPrompt": G, "batchSize": B, "maxNewTokens": 128, "learningRate": 1e-6},
                             "staleness": {"maxHeadOffpolicyness": 1}, "trainer": {"backend": args.backend, "accelerator": {"type": "nvidia", "count": 1}},
                             "checkpoint": {"everySteps": 2, "keep": 2, "asyncSave": args.async_save}, "training": {"totalSteps": steps}},
                })

            if args.memory_fraction is not None:
                return out_of_memory(exp(args.steps), server.url, workdir, vocab, args.memory_fraction)
            for steps in (args.steps, args.steps + 2):
                code, secs, answered = asyncio.run(train(exp(steps), server.url, workdir, vocab))
                rows = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines() if x.strip()]
                last = rows[-1]
                print(f"trainer to step {steps}: exit {code}, {secs:.1f} s, {answered} tickets answered; metrics rows {len(rows)}, "
                      f"last step {last['step']} v{last['policy_version']} step_seconds {last['step_seconds']:.3f} "
                      f"timings {json.dumps({k: round(v, 3) for k, v in last['timings'].items()})}", flush=True)
                ok &= code == 0 and last["step"] == steps
            versions = sorted(p.name for p in (workdir / "weights").iterdir())
            state = load_weights(workdir / "weights" / versions[-1])
            print(f"weights published: {versions}; the last loads: {len(state)} tensors, "
                  f"dtypes {sorted({str(v.dtype) for v in state.values()})}; checkpoints: "
                  f"{sorted(p.name for p in (workdir / 'checkpoints').iterdir())}", flush=True)
            resumed = [r for r in rows if r["step"] == args.steps + 1]
            ok &= bool(resumed) and len(state) > 0
    finally:
        server.stop()
    print("OK" if ok else "FAILED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
