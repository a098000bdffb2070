"""The trainer's weight publish (train.publish_weights, disk mode) at real model shapes, on this machine's CPU.

    python3 bench/bench_publish.py                         # the Qwen2.5-0.5B shape (tied), 9 versions each way
    python3 bench/bench_publish.py --model qwen2.5-1.5b --versions 4

Builds a random-init model of the shape (bench_gpu_trainer.SHAPES; nothing downloaded), then publishes `--versions`
versions with `weights.export_model_weights` as the trainer does (engine dtype bfloat16, weightSync.bucketMB shards, keep
3, no fsync) in two ways, alternating version by version:

  now      a tied LM head written once (weights.written_entries) and pruned versions deleted behind the publish
  before   the LM head written under both names and pruned versions unlinked inside the publish (until 2026-11-29)

and prints the median seconds per version of each, the bytes written and the ratio. One process, one rank, the folder on
this machine's disk (page cache: no fsync, as the trainer publishes). On a GPU the gather and cast run on the device and
the host does the same serialisation and file work; the GPU figure is in docs/benchmarks.md when one was measured.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-0.5b", help="a bench_gpu_trainer.SHAPES name")
    ap.add_argument("--versions", type=int, default=9, help="versions published each way (the first of each is not timed)")
    ap.add_argument("--bucket-mb", type=int, default=256, help="weightSync.bucketMB")
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary folder under the current one)")
    args = ap.parse_args()
    if args.versions < 2:
        ap.error("--versions must be >= 2 (the first of each way is a warm-up)")
    import torch
    from bench_gpu_trainer import SHAPES, build_model
    from transformers import AutoModelForCausalLM

    from kuberl.runtime.trainer import dist as D
    from kuberl.runtime.trainer import weights as W

    if args.model not in SHAPES:
        ap.error(f"--model: one of {', '.join(SHAPES)}")
    info = D.init_distributed("cpu")
    with tempfile.TemporaryDirectory(dir=args.dir or ".", prefix=".bench-publish-") as tmp:
        src = build_model(Path(tmp), args.model)
        model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
        params = sum(p.numel() for p in model.parameters())

        def before():  # the LM head under both names; the old version unlinked inside the publish
            def prune_now(root, keep, protect=None):
                removed = real_prune(root, keep, protect)
                W.wait_for_pruning()
                return removed
            return mock.patch.multiple(W, written_entries=lambda m, entries: entries, prune_weights=prune_now)

        real_prune = W.prune_weights
        ways = {"now": contextlib.nullcontext, "before": before}
        times: dict[str, list[float]] = {k: [] for k in ways}
        written: dict[str, int] = {}
        for v in range(args.versions):
            for way, patch in ways.items():
                stats: dict = {}
                with patch():
                    W.wait_for_pruning()  # start from the same state: no deletion of an earlier version still running
                    t0 = time.perf_counter()
                    W.export_model_weights(model, info, Path(tmp) / way, v, shard_bytes=args.bucket_mb << 20, source_dir=src,
                                           dtype=torch.bfloat16, keep=3, stats=stats, durable=False)
                    seconds = time.perf_counter() - t0
                if v:
                    times[way].append(seconds)
                written[way] = stats["total_bytes"]
        W.wait_for_pruning()
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"{args.model}: {params / 1e6:.0f}M parameters (tied: {model.config.tie_word_embeddings}), bfloat16 versions in "
          f"{args.bucket_mb} MB shards, {args.versions - 1} timed each way, this machine's CPU and disk")
    for way in ways:
        print(f"  {way:<7} {med[way]:6.2f} s a version (min {min(times[way]):.2f}, max {max(times[way]):.2f}), "
              f"{written[way] / 1e9:.2f} GB written")
    print(f"before / now: {med['before'] / med['now']:.2f}x")
    D.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
