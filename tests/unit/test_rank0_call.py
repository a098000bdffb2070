"""dist.rank0_call: what rank 0 alone reads (a checkpoint's trainer state) reaches every rank, and so does its failure.

Before it, rank 0 raised on an unreadable checkpoint while the other ranks waited in the broadcast until the
process group's timeout (30 min by default). Two gloo ranks under torchrun, as the trainer runs them."""

from __future__ import annotations

from tests.unit.torchrun import torchrun

WORKER = '''
import os, sys, time
import torch.distributed as dist
from datetime import timedelta
from kuberl.runtime.trainer import dist as D

dist.init_process_group("gloo", timeout=timedelta(seconds=60))
info = D.DistInfo(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=dist.get_rank(), device=__import__("torch").device("cpu"))
mode = sys.argv[1]
def read():
    if mode == "fail":
        raise ValueError("trainer_state.json: not JSON")
    return {"step": 7}
t = time.monotonic()
try:
    got = D.rank0_call(read, info)
    print(f"rank {info.rank} got {got}", flush=True)
except D.RankZeroError as exc:
    print(f"rank {info.rank} raised {exc} after {time.monotonic() - t:.1f}s", flush=True)
dist.destroy_process_group()
os._exit(0)
'''


def run(tmp_path, mode: str) -> str:
    script = tmp_path / "rank0_worker.py"
    script.write_text(WORKER)
    proc = torchrun(str(script), mode, timeout=120, cwd=tmp_path)
    return proc.stdout


def test_every_rank_gets_rank_zeros_result(tmp_path):
    out = run(tmp_path, "ok")
    assert "rank 0 got {'step': 7}" in out and "rank 1 got {'step': 7}" in out, out


def test_rank_zeros_failure_fails_every_rank_at_once(tmp_path):
    out = run(tmp_path, "fail")
    for rank in (0, 1):
        assert f"rank {rank} raised rank 0: ValueError: trainer_state.json: not JSON" in out, out
    # no rank waited for a timeout
    assert all(float(line.rsplit(" after ", 1)[1].rstrip("s")) < 10 for line in out.splitlines() if " raised " in line), out
