"""Packed (padding-free) against padded and shared-prompt log-probs: the trainer's pi_prox forward and its update.

The trainer's shapes: B = 8 prompts x G = 8 samples (64 rows), prompts of 10..20 tokens shared within a group,
outputs of 1..16 tokens (the quickstart) or 1..200 (ragged), the builtin tiny Qwen2 (or --hidden/--layers for a
bigger one), micro-batches planned as the trainer plans them (trainer.microBatchTokens). Prints the median ms of
  prox    one no-grad eval-mode forward over every row (train.prox_logp)
  update  forward + backward of a token-weighted sum of the log-probs, entropy on (train.ppo_update's pass)
for each layout, and what trainer.packing auto picks:
  padded       rows right-padded to the longest, one forward (share_prompts off; what FSDP runs)
  shared       each group's prompt once, its responses on the prompt's KV cache (the default without FSDP)
  packed       rows back to back, position_ids restarting; on sdpa (CPU) in rows as long as the longest sequence
  packed-1row  the whole micro-batch as ONE row (what flash-attn varlen runs on GPU), timed here on sdpa

    flock /tmp/kuberl-heavy.lock python3 bench/bench_packing.py [--reps 7] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from unittest import mock

import torch

from kuberl.runtime.trainer import packing
from kuberl.runtime.trainer.batch import response_logprobs, shard_micro_batches

LAYOUTS = {"padded": dict(share_prompts=False), "shared": dict(share_prompts=True), "packed": dict(packed=True), "packed-1row": dict(packed=True)}


def rows(out_max: int, seed: int = 0, groups: int = 8, g: int = 8, vocab: int = 300) -> tuple[list[list[int]], list[list[int]]]:
    gen = torch.Generator().manual_seed(seed)
    prompts, outputs = [], []
    for _ in range(groups):
        p = torch.randint(3, vocab, (int(torch.randint(10, 21, (1,), generator=gen)),), generator=gen).tolist()
        for _ in range(g):
            prompts.append(p)
            outputs.append(torch.randint(3, vocab, (int(torch.randint(1, out_max + 1, (1,), generator=gen)),), generator=gen).tolist())
    return prompts, outputs


def run_layout(model, prompts, outputs, name: str, budget: int, grad: bool) -> None:
    seq_lens = [len(p) + len(o) for p, o in zip(prompts, outputs)]
    width = max(len(o) for o in outputs)
    kw = LAYOUTS[name]
    for mb in shard_micro_batches(seq_lens, range(len(prompts)), budget, 0, 1, packed=kw.get("packed", False)):
        args = ([prompts[i] for i in mb], [outputs[i] for i in mb], width)
        if grad:
            lp, _ = response_logprobs(model, *args, entropy=True, **kw)
            lp.sum().backward()
        else:
            with torch.no_grad():
                response_logprobs(model, *args, **kw)


def median_ms(fn, reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1000)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--budget", type=int, default=16384, help="trainer.microBatchTokens")
    ap.add_argument("--hidden", type=int, default=0, help="hidden_size override (0: the builtin tiny-qwen2)")
    ap.add_argument("--layers", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    from kuberl.runtime.models import build_tiny_model

    overrides = {k: v for k, v in (("hidden_size", args.hidden), ("intermediate_size", 4 * args.hidden), ("num_hidden_layers", args.layers)) if v}
    with tempfile.TemporaryDirectory() as tmp:
        model = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp, **overrides), dtype=torch.float32)
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {params / 1e6:.2f}M parameters, attn {model.config._attn_implementation}, torch threads {torch.get_num_threads()}, "
          f"microBatchTokens {args.budget}")
    for case, out_max in (("quickstart (outputs 1..16)", 16), ("ragged (outputs 1..200)", 200)):
        prompts, outputs = rows(out_max)
        lens = [len(p) + len(o) for p, o in zip(prompts, outputs)]
        print(f"\n{case}: 64 rows, {sum(lens)} real tokens; slots: padded {packing.padded_slots(prompts, outputs, False)}, "
              f"shared {packing.padded_slots(prompts, outputs)}, packed {packing.packed_slots(lens, False)} (rows of the longest); "
              f"auto packs: {packing.use_packing('auto', prompts, outputs, model)}")
        print(f"  {'layout':<12} {'prox ms':>9} {'update ms':>10}")
        for name in LAYOUTS:
            with mock.patch.object(packing, "varlen_attention", lambda m, one=name == "packed-1row": one):
                model.eval()
                prox = median_ms(lambda p=prompts, o=outputs, n=name: run_layout(model, p, o, n, args.budget, False), args.reps)
                model.train()
                upd = median_ms(lambda p=prompts, o=outputs, n=name: (model.zero_grad(set_to_none=True), run_layout(model, p, o, n, args.budget, True)),
                                args.reps)
            print(f"  {name:<12} {prox:9.1f} {upd:10.1f}")


if __name__ == "__main__":
    main()
