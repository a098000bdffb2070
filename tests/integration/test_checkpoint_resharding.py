"""Sharded (DCP) trainer checkpoints across world sizes, torn checkpoints, and checkpoints of earlier versions.

Each run is 1 or 2 real processes in a gloo group (dcp_worker.py: the trainer's own write_state / read_state /
commit_checkpoint on a small Qwen2 with AdamW, FSDP2 at 2 ranks). A run saves at step 2 and goes on one step
(the run that never stopped); a second run at the other world size, from different initial weights, resumes
and takes the same step. Model parameters and Adam state (exp_avg, exp_avg_sq, step) must equal what was
saved, and the step after resuming must give the uninterrupted run's parameters within 1e-6.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kuberl.net import free_port
from kuberl.runtime.trainer import checkpoint as ck

pytestmark = pytest.mark.integration

WORKER = Path(__file__).with_name("dcp_worker.py")


def launch(tmp: Path, name: str, world: int, ops: list, *, tie: bool = False, init_seed: int = 0, expect: int = 0) -> Path:
    """Run the plan on `world` ranks; returns its output folder (dumps, resumed.json)."""
    out = tmp / name
    out.mkdir()
    plan = out / "plan.json"
    plan.write_text(json.dumps({"out": str(out), "root": str(tmp / "checkpoints"), "tie": tie, "init_seed": init_seed, "ops": ops}))
    port = free_port()
    procs = []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(WORKER.parent)}
        log = open(out / f"rank{rank}.log", "wb")
        procs.append(subprocess.Popen([sys.executable, str(WORKER), str(plan)], env=env, stdout=log, stderr=subprocess.STDOUT))
    try:
        codes = [p.wait(timeout=240) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    logs = "\n".join((out / f"rank{r}.log").read_text()[-3000:] for r in range(world))
    assert codes == [expect] * world, f"{name}: exit codes {codes}, expected {expect}:\n{logs}"
    return out


def load(out: Path, name: str) -> dict:
    return torch.load(out / f"{name}.pt", weights_only=False)


def assert_same_state(got: dict, want: dict, atol: float = 0.0) -> None:
    """Full model and optimizer state (Adam exp_avg, exp_avg_sq, step per parameter) equal within atol."""
    assert got["model"].keys() == want["model"].keys()
    for k, w in want["model"].items():
        diff = (got["model"][k] - w).abs().max().item()
        assert diff <= atol, f"model {k}: differs by {diff:.3g} (allowed {atol})"
    gs, ws = got["optimizer"]["state"], want["optimizer"]["state"]
    assert gs.keys() == ws.keys() and len(ws) > 0
    for k, w in ws.items():
        assert gs[k].keys() == w.keys() == {"exp_avg", "exp_avg_sq", "step"}, k
        for field in ("exp_avg", "exp_avg_sq", "step"):
            diff = (gs[k][field].float() - w[field].float()).abs().max().item()
            assert diff <= atol, f"optimizer {k}.{field}: differs by {diff:.3g} (allowed {atol})"
    assert got["lr"] == pytest.approx(want["lr"], abs=1e-12)


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied-embeddings"])
@pytest.mark.parametrize("saved_at, resumed_at", [(1, 2), (2, 1)], ids=["1-to-2-ranks", "2-to-1-ranks"])
def test_a_sharded_checkpoint_resumes_at_another_world_size_with_the_same_state_and_next_step(tmp_path, saved_at, resumed_at, tie):
    first = launch(tmp_path, "first", saved_at, [["train", 2], ["save"], ["dump", "saved"], ["train", 1], ["dump", "continued"]], tie=tie)
    root = tmp_path / "checkpoints"
    step2 = root / "step-00000002"
    assert ck.is_sharded(step2) and not (step2 / "model.pt").exists() and not (step2 / "optimizer.pt").exists()
    shards = sorted(p.name for p in step2.glob("*.distcp"))
    assert len(shards) == saved_at, f"one shard file per rank, got {shards}"
    # Other initial weights: what the second run ends with can only come from the checkpoint.
    second = launch(tmp_path, "second", resumed_at, [["resume"], ["dump", "resumed"], ["train", 1], ["dump", "after"]], tie=tie, init_seed=7)
    assert json.loads((second / "resumed.json").read_text()) == {"path": str(step2), "step": 2, "sharded": True}
    saved, resumed = load(first, "saved"), load(second, "resumed")
    assert_same_state(resumed, saved)
    assert resumed["tied"] is tie and load(second, "after")["tied"] is tie
    if tie:  # one tensor under two names: the saved copy and the loaded one agree for both
        assert torch.equal(resumed["model"]["lm_head.weight"], resumed["model"]["model.embed_tokens.weight"])
    assert_same_state(load(second, "after"), load(first, "continued"), atol=1e-6)
    # The trainer's tools read the whole model from the shards, without a process group.
    full = ck.read_model_state(step2)
    for k, w in saved["model"].items():
        assert torch.equal(full[k], w), k


def test_a_checkpoint_torn_between_its_shards_and_the_commit_is_never_resumed(tmp_path):
    launch(tmp_path, "first", 2, [["train", 1], ["save"], ["dump", "saved"], ["train", 1], ["torn"]], expect=3)
    root = tmp_path / "checkpoints"
    torn = ck.tmp_checkpoint_path(root, 2)
    assert (torn / ck.DCP_METADATA).is_file() and len(list(torn.glob("*.distcp"))) == 2, "the shards of step 2 were all written"
    assert [c.step for c in ck.list_checkpoints(root)] == [1]
    second = launch(tmp_path, "second", 1, [["resume"], ["dump", "resumed"]], init_seed=7)
    assert json.loads((second / "resumed.json").read_text())["step"] == 1
    assert_same_state(load(second, "resumed"), load(tmp_path / "first", "saved"))


@pytest.mark.parametrize("resumed_at", [1, 2], ids=["at-1-rank", "at-2-ranks"])
def test_a_full_dict_checkpoint_of_an_earlier_version_still_resumes(tmp_path, resumed_at):
    first = launch(tmp_path, "first", 1, [["train", 2], ["save_old"], ["dump", "saved"], ["train", 1], ["dump", "continued"]], tie=True)
    step2 = tmp_path / "checkpoints" / "step-00000002"
    assert not ck.is_sharded(step2) and (step2 / "model.pt").is_file()
    second = launch(tmp_path, "second", resumed_at, [["resume"], ["dump", "resumed"], ["train", 1], ["dump", "after"]], tie=True, init_seed=7)
    assert json.loads((second / "resumed.json").read_text())["sharded"] is False
    assert_same_state(load(second, "resumed"), load(first, "saved"))
    assert_same_state(load(second, "after"), load(first, "continued"), atol=1e-6)
