"""Checkpoint save and load time: full dicts gathered on rank 0 (before) against sharded DCP files (now).

    python3 bench/bench_checkpoint.py                    # tiny and ~280 MB Qwen2, at 1 and 2 ranks (gloo, CPU)
    python3 bench/bench_checkpoint.py --sizes tiny --worlds 2 --reps 3

For each model size and world size it starts that many ranks (this script again, with torchrun's
environment), builds a random-init Qwen2 (FSDP2 at 2 ranks, as the trainer shards it), takes one AdamW
step so the optimizer holds exp_avg / exp_avg_sq, then times, `--reps` times each (the best is printed):

  full save   gather model and optimizer on rank 0 (dist.full_model_state / full_optimizer_state) and torch.save
              model.pt + optimizer.pt with fsync: what persist.stage_checkpoint did before DCP
  full load   rank 0 torch.load of both, dist.load_full_state scatters them to every rank
  dcp save    dist.save_sharded_state: every rank writes its own shards (fsync), rank 0 the index
  dcp load    dist.load_sharded_state into a model of other weights: every rank reads what it holds
  async       dist.async_save_sharded_state (checkpoint.asyncSave): "waits" is what training waits for (the copy of
              the rank's state to host memory), "written" the time until every shard is written behind it

Times are wall clock between barriers (the slowest rank). Loads read files that the save has just written,
so they come from the page cache: this measures CPU and copying, not the disk. The "rank-0 peak" column is
the bytes of state the gathering rank holds at once (the whole model and optimizer for "full", its own
shard for "dcp"): that, not the time, is what runs out at 7B and beyond.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SIZES = {  # Qwen2Config keys: the trainer's tiny model, and one of a few hundred MB (float32)
    "tiny": {"vocab_size": 320, "hidden_size": 128, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 4},
    "280MB": {"vocab_size": 8192, "hidden_size": 1024, "intermediate_size": 2048, "num_hidden_layers": 6, "num_attention_heads": 16,
              "num_key_value_heads": 4},
}


def _state_bytes(sd) -> int:
    import torch

    if isinstance(sd, torch.Tensor):
        local = sd.to_local() if hasattr(sd, "to_local") else sd
        return local.numel() * local.element_size()
    if isinstance(sd, dict):
        return sum(_state_bytes(v) for v in sd.values())
    if isinstance(sd, (list, tuple)):
        return sum(_state_bytes(v) for v in sd)
    return 0


def rank_main(size: str, reps: int, folder: Path, result: Path) -> None:
    """One rank: build, step, then time the four operations."""
    import torch
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from kuberl.runtime.trainer import checkpoint as ck
    from kuberl.runtime.trainer import dist as D

    info = D.init_distributed("cpu")
    torch.manual_seed(0)
    cfg = Qwen2Config(**SIZES[size], max_position_embeddings=64, tie_word_embeddings=False)
    model = D.shard_model(Qwen2ForCausalLM(cfg).to(torch.float32), info)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, cfg.vocab_size, (1, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    params = sum(p.numel() for p in Qwen2ForCausalLM(cfg).parameters()) if info.is_main else 0

    def timed(fn) -> float:
        best = float("inf")
        for _ in range(reps):
            D.barrier(info)
            t0 = time.perf_counter()
            fn()
            D.barrier(info)
            best = min(best, time.perf_counter() - t0)
        return best

    full_dir, dcp_dir = folder / "full", folder / "dcp"
    peaks: dict[str, int] = {}

    def full_save() -> None:
        model_sd, optim_sd = D.full_model_state(model), D.full_optimizer_state(model, optimizer)
        if info.is_main:
            peaks["full"] = _state_bytes(model_sd) + _state_bytes(optim_sd)
            full_dir.mkdir(parents=True, exist_ok=True)
            ck.write_torch(full_dir, ck.MODEL_FILE, model_sd)
            ck.write_torch(full_dir, ck.OPTIMIZER_FILE, optim_sd)

    def full_load() -> None:
        model_sd = ck.read_torch(full_dir, ck.MODEL_FILE) if info.is_main else {}
        optim_sd = ck.read_torch(full_dir, ck.OPTIMIZER_FILE) if info.is_main else {}
        D.load_full_state(model, optimizer, model_sd, optim_sd)

    def dcp_save() -> None:
        if info.is_main:
            shutil.rmtree(dcp_dir, ignore_errors=True)
            dcp_dir.mkdir(parents=True)
        D.barrier(info)
        D.save_sharded_state(dcp_dir, model, optimizer)

    def dcp_load() -> None:
        D.load_sharded_state(dcp_dir, model, optimizer)

    group = D.checkpoint_group()

    def dcp_async() -> tuple[float, float]:
        """checkpoint.asyncSave: (seconds training waits: the copy to host memory, seconds until every shard is written)."""
        if info.is_main:
            shutil.rmtree(dcp_dir, ignore_errors=True)
            dcp_dir.mkdir(parents=True)
        D.barrier(info)
        t0 = time.perf_counter()
        future = D.async_save_sharded_state(dcp_dir, model, optimizer, group)
        blocked = time.perf_counter() - t0
        future.result()
        D.barrier(info)
        return blocked, time.perf_counter() - t0

    out = {"full save": timed(full_save), "full load": timed(full_load), "dcp save": timed(dcp_save), "dcp load": timed(dcp_load)}
    out["async blocks"], out["async written"] = map(min, zip(*(dcp_async() for _ in range(reps))))
    model_sd, optim_sd = get_state_dict(model, optimizer)
    peaks["dcp"] = _state_bytes(model_sd) + _state_bytes(optim_sd)
    if info.is_main:
        on_disk = {k: sum(f.stat().st_size for f in d.iterdir()) for k, d in (("full", full_dir), ("dcp", dcp_dir))}
        result.write_text(json.dumps({"times": out, "params": params, "peak": peaks, "disk": on_disk}))
    D.barrier(info)
    D.shutdown()


def run(size: str, world: int, reps: int) -> dict:
    from kuberl.net import free_port

    with tempfile.TemporaryDirectory(prefix="kuberl-bench-ckpt-") as tmp:
        result = Path(tmp) / "result.json"
        port = free_port()
        procs = []
        for rank in range(world):
            env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": str(port), "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // world))}
            procs.append(subprocess.Popen([sys.executable, __file__, "--rank-of", size, "--reps", str(reps), "--folder", tmp, "--result", str(result)],
                                          env=env))
        codes = [p.wait() for p in procs]
        if codes != [0] * world:
            raise SystemExit(f"{size} at {world} ranks: exit codes {codes}")
        return json.loads(result.read_text())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default=",".join(SIZES), help=f"comma-separated, of {', '.join(SIZES)}")
    ap.add_argument("--worlds", default="1,2", help="comma-separated world sizes")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--rank-of", help=argparse.SUPPRESS)
    ap.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.reps < 1:
        ap.error(f"--reps must be >= 1, got {args.reps}")
    if args.rank_of:
        rank_main(args.rank_of, args.reps, args.folder, args.result)
        return 0
    sizes = args.sizes.split(",")
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        ap.error(f"--sizes: unknown {unknown}; known: {', '.join(SIZES)}")
    worlds = [int(w) for w in args.worlds.split(",")]
    print(f"{'model':>6} {'params':>8} {'ranks':>5} | {'full save':>9} {'full load':>9} {'dcp save':>9} {'dcp load':>9} | "
          f"{'async: waits':>12} {'written':>8} | {'dcp disk':>8} | rank-0 peak full / dcp")
    for size in sizes:
        for world in worlds:
            r = run(size, world, args.reps)
            t = r["times"]
            mb = r["disk"]["dcp"] / 2**20
            print(f"{size:>6} {r['params'] / 1e6:7.1f}M {world:>5} | {t['full save']:8.2f}s {t['full load']:8.2f}s {t['dcp save']:8.2f}s "
                  f"{t['dcp load']:8.2f}s | {t['async blocks']:11.2f}s {t['async written']:7.2f}s | {mb:6.0f}MB | "
                  f"{r['peak']['full'] / 2**20:.0f} MB / {r['peak']['dcp'] / 2**20:.0f} MB", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
