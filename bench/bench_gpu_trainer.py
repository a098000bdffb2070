"""The trainer's step on one GPU (FSDP2, bf16 compute, NCCL group), against a plain PyTorch GRPO step on the same batch.

KubeRL's side is the real trainer: `Trainer.setup()` loads the model, wraps it in FSDP2 with a bf16 mixed-precision
policy (float32 master weights) and builds its optimizer; each step runs the stages `kuberl trainer` runs between
collect and publish (train.prox_logp, train.advantages, train.ppo_update) on a synthetic batch of B prompts x G samples
(random tokens, a shared prompt per group, ragged responses). The peer is what a hand-written GRPO step does with the
same model: float32 weights under bf16 autocast, rows right-padded, micro-batches of `--peer-rows`, the clipped loss,
fused AdamW. Both sides use the same model, batch, learning rate and clip; each prints the median seconds per step
(after warm-up), tokens/s and the achieved TFLOP/s (6 x parameters x tokens; attention not counted).

The models are random-init Qwen2.5 shapes built here (nothing is downloaded): qwen2.5-0.5b (tied, 494M) and qwen2.5-1.5b.

    python bench/bench_gpu_trainer.py [--models qwen2.5-0.5b qwen2.5-1.5b] [--groups 16] [--prompt 128] [--response 512]
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

G = 8
SHAPES = {  # Qwen2.5's published configs (config.json), vocabulary included
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, tie_word_embeddings=True),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 tie_word_embeddings=True),  # the smoke run's
}
VOCAB = 151936
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a smoke run of this script's code (--models tiny --cpu), no figures


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def build_model(root: Path, name: str) -> Path:
    """A random-init model of `name`'s shape in Hugging Face layout (bf16 safetensors), with the tiny tokenizer padded to
    the model's vocabulary (`pad_vocabulary`)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from kuberl.runtime.models import build_tokenizer

    out = root / name
    cfg = Qwen2Config(**SHAPES[name], vocab_size=VOCAB, max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6,
                      bos_token_id=None, eos_token_id=151645, pad_token_id=151643)
    torch.manual_seed(0)
    with torch.device(DEV):
        model = Qwen2ForCausalLM(cfg)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    build_tokenizer().save_pretrained(out)
    pad_vocabulary(out / "tokenizer.json", VOCAB)
    del model
    return out


def pad_vocabulary(tokenizer_json: Path, size: int) -> None:
    """Placeholder entries up to `size` ids in a saved tokenizer.json's BPE vocabulary. Merges never produce them, so text
    encodes as before; each decodes to its own text ("<v123>"). The tiny tokenizer alone decodes the ids a random-init
    model samples beyond its ~320 to nothing, so an engine serving the model (bench_engine_path.py --shape) would detokenize
    almost nothing and the agent score empty answers: with every id decoding to text, detokenizing and scoring cost what
    they cost with a real vocabulary. Everything else (special tokens, chat template) stays as build_tokenizer saved it."""
    import json

    spec = json.loads(tokenizer_json.read_text())
    vocab = spec["model"]["vocab"]
    taken = set(vocab.values()) | {t["id"] for t in spec["added_tokens"]}
    vocab.update({f"<v{i}>": i for i in range(size) if i not in taken})
    tokenizer_json.write_text(json.dumps(spec))


def make_groups(groups: int, prompt: int, response: int, seed: int) -> list[dict]:
    """B groups of G samples: one random prompt per group, responses of response/4..response tokens, 0/1 rewards."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for g in range(groups):
        p = torch.randint(0, VOCAB, (prompt,), generator=gen).tolist()
        samples = []
        for _ in range(G):
            n = int(torch.randint(response // 4, response + 1, (1,), generator=gen))
            o = torch.randint(0, VOCAB, (n,), generator=gen).tolist()
            samples.append({"input_ids": p, "output_ids": o, "logprobs": [-12.0] * n, "versions": [0] * n, "loss_mask": [1] * n,
                            "reward": float(torch.randint(0, 2, (1,), generator=gen))})
        out.append({"group_id": f"g{seed}-{g}", "samples": samples})
    return out


def manifest(model: Path, groups: int, response: int, micro_batch_tokens: int = 16384, checkpointing: bool = False,
             packing: str = "auto") -> dict:
    return {
        "apiVersion": "kuberl.io/v1alpha1", "kind": "RLExperiment", "metadata": {"name": "bench-gpu-trainer"},
        "spec": {
            "model": {"path": str(model), "dtype": "bfloat16"},
            "dataset": {"builtin": "repeat-digit", "size": 64},
            "algorithm": {"name": "grpo", "samplesPerPrompt": G, "batchSize": groups, "maxNewTokens": response,
                          "learningRate": 1e-6, "epsClip": 0.2, "ppoMinibatches": 1},
            "trainer": {"backend": "fsdp", "accelerator": {"type": "nvidia", "count": 1}, "microBatchTokens": micro_batch_tokens,
                        "gradientCheckpointing": checkpointing, "packing": packing},
            "training": {"totalSteps": 100},
        },
    }


def time_steps(step, warmup: int, reps: int) -> list[float]:
    times = []
    for k in range(warmup + reps):
        sync()
        t = time.perf_counter()
        step(k)
        sync()
        if k >= warmup:
            times.append(time.perf_counter() - t)
    return times


def kuberl_side(model_dir: Path, batches: list[list[dict]], args, work: Path) -> dict:
    from kuberl.api import RLExperiment
    from kuberl.runtime.trainer import dist as D
    from kuberl.runtime.trainer.batch import build_batch
    from kuberl.runtime.trainer.trainer import Trainer

    exp = RLExperiment.model_validate(manifest(model_dir, args.groups, args.response, args.micro_batch_tokens, args.gradient_checkpointing,
                                                  args.packing))
    t = Trainer(exp, bus_url="nats://unused:4222", workdir=work)
    t.info = D.init_distributed()
    t.setup()
    stages: dict[str, list[float]] = {"prox_logp": [], "ppo_update": []}

    def step(k: int) -> None:
        batch = build_batch(batches[k % len(batches)], G)
        a = time.perf_counter()
        t.stage_prox_logp(batch)
        sync()
        b = time.perf_counter()
        t.stage_advantages(batch)
        t.stage_ppo_update(batch)
        sync()
        stages["prox_logp"].append(b - a)
        stages["ppo_update"].append(time.perf_counter() - b)

    times = time_steps(step, args.warmup, args.reps)
    probe = build_batch(batches[0], G)
    info = {"packed": t._packed(probe, t.model),
            "fsdp": type(t.model).__name__, "attn": t.model.config._attn_implementation, "prox_in_update": t.prox_in_update(),
            "backend": torch.distributed.get_backend(), "peak_gib": peak_gib(),
            "stages": {k: statistics.median(v[args.warmup:]) for k, v in stages.items()}}
    return {"times": times, **info}  # the model and optimizer go with this frame: main empties the cache after


def peer_side(model_dir: Path, batches: list[list[dict]], args) -> dict:
    """A plain GRPO step: padded rows, bf16 autocast, micro-batches of --peer-rows, clipped token-mean loss, fused AdamW."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(DEV).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.0, fused=True)

    def step(k: int) -> None:
        rows = [(s["input_ids"], s["output_ids"], s["reward"]) for g in batches[k % len(batches)] for s in g["samples"]]
        rewards = torch.tensor([r for *_, r in rows]).view(-1, G)
        adv = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)).flatten()
        total_tokens = sum(len(o) for _, o, _ in rows)
        for i in range(0, len(rows), args.peer_rows):
            chunk = rows[i:i + args.peer_rows]
            width = max(len(p) + len(o) for p, o, _ in chunk)
            ids = torch.zeros(len(chunk), width, dtype=torch.long)
            mask = torch.zeros(len(chunk), width)
            for j, (p, o, _) in enumerate(chunk):
                ids[j, :len(p) + len(o)] = torch.tensor(p + o)
                mask[j, len(p):len(p) + len(o)] = 1
            ids, mask = ids.to(DEV), mask.to(DEV)
            with torch.autocast(DEV, dtype=torch.bfloat16, enabled=DEV == "cuda"):
                logits = model(input_ids=ids).logits[:, :-1].float()  # right padding: causal rows never see it
            logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
            m = mask[:, 1:]
            ratio = torch.exp(logp - logp.detach())
            a = adv[i:i + len(chunk)].to(DEV)[:, None]
            loss = -(torch.minimum(ratio * a, ratio.clamp(0.8, 1.2) * a) * m).sum() / total_tokens
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    times = time_steps(step, args.warmup, args.reps)
    return {"times": times, "peak_gib": peak_gib()}


def peak_gib() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if DEV == "cuda" else 0.0


def empty_cache() -> None:
    gc.collect()  # FSDP's modules hold reference cycles
    if DEV == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["qwen2.5-0.5b", "qwen2.5-1.5b"], choices=list(SHAPES))
    ap.add_argument("--groups", type=int, default=16, help="prompts per step (B); G = 8 samples each")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--response", type=int, default=512, help="longest response; lengths are drawn from response/4..response")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--micro-batch-tokens", type=int, default=16384, help="KubeRL's trainer.microBatchTokens (its default)")
    ap.add_argument("--gradient-checkpointing", action="store_true", help="KubeRL's trainer.gradientCheckpointing")
    ap.add_argument("--packing", choices=["auto", "on", "off"], default="auto",
                    help="KubeRL's trainer.packing (auto packs where it feeds fewer token slots: packing.use_packing)")
    ap.add_argument("--no-peer", action="store_true", help="time KubeRL's side only")
    ap.add_argument("--peer-rows", type=int, default=8, help="rows per micro-batch of the plain step")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    ap.add_argument("--cpu", action="store_true", help="run without a GPU (a smoke run of the script: its figures mean nothing)")
    args = ap.parse_args()
    if DEV != "cuda" and not args.cpu:
        raise SystemExit("no CUDA device: this benchmark times the GPU path (the CPU trainer is bench/bench_trl.py's; --cpu smoke-runs it)")
    device = torch.cuda.get_device_name() if DEV == "cuda" else "CPU (smoke run)"
    batches = [make_groups(args.groups, args.prompt, args.response, seed) for seed in range(3)]
    tokens = statistics.mean(sum(len(s["input_ids"]) + len(s["output_ids"]) for g in b for s in g["samples"]) for b in batches)
    results = []
    print(f"{time.strftime('%Y-%m-%d')}, {device}, torch {torch.__version__}; {args.groups} prompts x {G} samples, "
          f"prompt {args.prompt}, responses {args.response // 4}..{args.response} tokens ({tokens:.0f} tokens a step)", flush=True)
    with tempfile.TemporaryDirectory(prefix="kuberl-bench-gpu-") as tmp:
        for name in args.models:
            try:
                model_dir = build_model(Path(tmp), name)
                params = sum(math.prod(v) for v in _shapes(model_dir))
                empty_cache()
                ours = kuberl_side(model_dir, batches, args, Path(tmp) / f"work-{name}")
                empty_cache()
                peer = None if args.no_peer else peer_side(model_dir, batches, args)
                empty_cache()
            except Exception:
                traceback.print_exc()
                print(f"{name}: failed (above)", flush=True)
                continue
            sides = [("KubeRL trainer (FSDP2, bf16)", ours)] + ([("plain PyTorch step (autocast)", peer)] if peer else [])
            for side, r in sides:
                s = statistics.median(r["times"])
                r.update(name=name, side=side, params=params, step_s=s, tokens_per_s=tokens / s, tflops=6 * params * tokens / s / 1e12)
                results.append(r)
            print(f"\n{name} ({params / 1e6:.0f}M parameters): {ours['fsdp']}, attention {ours['attn']}, process group {ours['backend']}, "
                  f"microBatchTokens {args.micro_batch_tokens}, gradient checkpointing {args.gradient_checkpointing}, "
                  f"packing {args.packing} (packed: {ours['packed']}), "
                  f"pi_prox from the update's forward: {ours['prox_in_update']}; trainer stages (median s): "
                  + ", ".join(f"{k} {v:.3f}" for k, v in ours["stages"].items()), flush=True)
            for _, r in sides:
                print(f"  {r['side']:<32} {r['step_s']:7.3f} s/step  {r['tokens_per_s']:9.0f} tokens/s  {r['tflops']:6.1f} TFLOP/s  "
                      f"peak {r['peak_gib']:.1f} GiB  (steps: {', '.join(f'{x:.3f}' for x in r['times'])})", flush=True)
            if peer:
                print(f"  KubeRL / plain: {peer['step_s'] / ours['step_s']:.2f}x the plain step's speed", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0 if results else 1


def _shapes(model_dir: Path):
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        for k in f.keys():
            yield f.get_slice(k).get_shape()


if __name__ == "__main__":
    sys.exit(main())
