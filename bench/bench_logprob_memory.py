"""Memory and time of scoring response tokens: plain autograd ops against kuberl's target_logprobs.

The trainer's loss needs log softmax(logits / T) at each sampled token. This bench builds logits of a real model's
vocabulary (Qwen2.5's 151,936 by default) for N response tokens in bf16, as a bf16 model's LM head returns them,
then runs the forward and the backward of a token-weighted sum, once per variant, each in a fresh process, and
prints the peak memory beyond the logits themselves (max RSS) and the time:

- plain: `logits.float() / T`, `logsumexp`, `gather` (what kuberl did before 2026-11-28; what most RL trainers do);
- kuberl: `kuberl.runtime.trainer.token_logprobs.target_logprobs`, a slice of rows at a time.

    python bench/bench_logprob_memory.py [--tokens 2048] [--vocab 151936] [--temperature 0.7]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB on Linux


def child(variant: str, tokens: int, vocab: int, T: float) -> dict:
    import torch

    torch.manual_seed(0)
    logits = torch.randn(tokens, vocab, dtype=torch.bfloat16).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,))
    w = torch.randn(tokens)
    base = rss_mb()  # the logits (and torch) are in; what follows is the scoring's own memory
    t0 = time.perf_counter()
    if variant == "plain":
        z = logits.float() / T
        lp = z.gather(-1, targets[:, None]).squeeze(-1) - torch.logsumexp(z, dim=-1)
        del z
    else:
        from kuberl.runtime.trainer.token_logprobs import target_logprobs

        lp, _ = target_logprobs(logits, targets, T)
    (lp * w).sum().backward()
    seconds = time.perf_counter() - t0
    return {"variant": variant, "peak_extra_mb": rss_mb() - base, "seconds": seconds,
            "logits_mb": logits.numel() * logits.element_size() / 2**20}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--child", choices=["plain", "kuberl"], help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child, a.tokens, a.vocab, a.temperature)))
        return
    rows = []
    for _ in range(a.repeats):
        for variant in ("plain", "kuberl"):
            out = subprocess.run([sys.executable, __file__, "--child", variant, "--tokens", str(a.tokens), "--vocab",
                                  str(a.vocab), "--temperature", str(a.temperature)], capture_output=True, text=True, check=True)
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    logits_mb = rows[0]["logits_mb"]
    print(f"{a.tokens} tokens x {a.vocab} vocabulary, bf16 logits {logits_mb:.0f} MB, T = {a.temperature}")
    print(f"{'variant':8} {'peak beyond the logits (MB)':>28} {'x logits':>9} {'forward+backward (s)':>21}")
    best = {}
    for r in rows:
        print(f"{r['variant']:8} {r['peak_extra_mb']:28.0f} {r['peak_extra_mb'] / logits_mb:9.2f} {r['seconds']:21.3f}")
        b = best.setdefault(r["variant"], r)
        if r["peak_extra_mb"] < b["peak_extra_mb"]:
            best[r["variant"]] = r
    p, k = best["plain"], best["kuberl"]
    print(f"kuberl / plain: memory {k['peak_extra_mb'] / p['peak_extra_mb']:.2f}x, "
          f"time {min(r['seconds'] for r in rows if r['variant'] == 'kuberl') / min(r['seconds'] for r in rows if r['variant'] == 'plain'):.2f}x")


if __name__ == "__main__":
    main()
