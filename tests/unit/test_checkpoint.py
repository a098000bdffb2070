"""Checkpoint files: atomic writes, `latest`, pruning, and a round trip that gives an identical next step."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from kuberl.runtime.trainer import checkpoint as ck


def _state(step: int) -> dict:
    return {"version": step, "tickets": {"issued": 3 * step}}


class TestSaveAndList:
    def test_a_saved_checkpoint_is_listed_and_named_by_latest(self, tmp_path: Path):
        path = ck.save_checkpoint(tmp_path, 7, {"model.pt": {"w": torch.ones(2)}}, _state(7))
        assert path == tmp_path / "step-00000007"
        assert (tmp_path / "latest").read_text().strip() == "step-00000007"
        assert [c.step for c in ck.list_checkpoints(tmp_path)] == [7]
        assert ck.latest_checkpoint(tmp_path).path == path
        assert ck.load_trainer_state(path)["tickets"] == {"issued": 21}
        assert torch.equal(ck.read_torch(path, "model.pt")["w"], torch.ones(2))

    def test_a_half_written_checkpoint_is_invisible(self, tmp_path: Path):
        ck.save_checkpoint(tmp_path, 1, {"model.pt": {}}, _state(1))
        tmp = ck.begin_checkpoint(tmp_path, 2)  # a crash happens before commit
        ck.write_torch(tmp, "model.pt", {"w": torch.zeros(1)})
        assert [c.step for c in ck.list_checkpoints(tmp_path)] == [1]
        assert ck.latest_checkpoint(tmp_path).step == 1

    def test_a_folder_without_trainer_state_is_not_a_checkpoint(self, tmp_path: Path):
        (tmp_path / "step-00000005").mkdir(parents=True)
        assert ck.list_checkpoints(tmp_path) == []
        assert ck.latest_checkpoint(tmp_path) is None

    def test_a_stale_latest_falls_back_to_the_newest_complete_checkpoint(self, tmp_path: Path):
        ck.save_checkpoint(tmp_path, 3, {}, _state(3))
        (tmp_path / "latest").write_text("step-00000009\n")
        assert ck.latest_checkpoint(tmp_path).step == 3

    def test_saving_the_same_step_twice_replaces_it(self, tmp_path: Path):
        ck.save_checkpoint(tmp_path, 4, {"a.pt": 1}, _state(4))
        ck.save_checkpoint(tmp_path, 4, {"a.pt": 2}, _state(4))
        assert ck.read_torch(tmp_path / "step-00000004", "a.pt") == 2
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp")] == []

    def test_commit_without_begin_names_the_missing_folder(self, tmp_path: Path):
        with pytest.raises(FileNotFoundError, match="begin_checkpoint"):
            ck.commit_checkpoint(tmp_path, 1, {})

    def test_a_missing_file_names_the_checkpoint(self, tmp_path: Path):
        path = ck.save_checkpoint(tmp_path, 1, {}, _state(1))
        with pytest.raises(FileNotFoundError, match="optimizer.pt.*step-00000001"):
            ck.read_torch(path, "optimizer.pt")

    def test_corrupt_trainer_state_is_reported_with_its_path(self, tmp_path: Path):
        path = ck.save_checkpoint(tmp_path, 1, {}, _state(1))
        (path / ck.STATE_FILE).write_text("{not json")
        with pytest.raises(ValueError, match="trainer_state.json: corrupt"):
            ck.load_trainer_state(path)


class TestPrune:
    def test_only_the_newest_keep_checkpoints_remain(self, tmp_path: Path):
        for step in (1, 2, 3, 4, 5):
            ck.save_checkpoint(tmp_path, step, {}, _state(step), keep=2)
        assert [c.step for c in ck.list_checkpoints(tmp_path)] == [4, 5]

    def test_the_checkpoint_latest_names_is_never_deleted(self, tmp_path: Path):
        for step in (1, 2, 3):
            ck.save_checkpoint(tmp_path, step, {}, _state(step))
        (tmp_path / "latest").write_text("step-00000001\n")
        ck.prune_checkpoints(tmp_path, 1)
        assert [c.step for c in ck.list_checkpoints(tmp_path)] == [1, 3]

    def test_crash_leftovers_are_removed(self, tmp_path: Path):
        ck.begin_checkpoint(tmp_path, 9)
        ck.save_checkpoint(tmp_path, 1, {}, _state(1), keep=3)
        assert not any(p.name.startswith(".tmp") for p in tmp_path.iterdir())

    def test_keep_below_one_is_refused(self, tmp_path: Path):
        with pytest.raises(ValueError, match="checkpoint.keep must be >= 1, got 0"):
            ck.prune_checkpoints(tmp_path, 0)


def _model_and_opt(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return model, opt, sched


def _step(model, opt, sched) -> float:
    # Dropout and the random batch both draw from the RNG: an identical step needs the RNG restored too.
    x = torch.randn(16, 6)
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    sched.step()
    opt.zero_grad()
    return loss.item()


class TestRoundTrip:
    def test_restoring_model_optimizer_scheduler_and_rng_gives_an_identical_next_step(self, tmp_path: Path):
        model, opt, sched = _model_and_opt()
        for _ in range(3):
            _step(model, opt, sched)
        ck.save_checkpoint(
            tmp_path, 3,
            {"model.pt": model.state_dict(), "optimizer.pt": opt.state_dict(), "scheduler.pt": sched.state_dict(), "rng.pt": ck.capture_rng_state()},
            _state(3),
        )
        expected_loss = _step(model, opt, sched)
        expected = [p.detach().clone() for p in model.parameters()]

        fresh, fopt, fsched = _model_and_opt(seed=123)  # different init: everything must come from the checkpoint
        torch.manual_seed(999)
        path = ck.latest_checkpoint(tmp_path).path
        fresh.load_state_dict(ck.read_torch(path, "model.pt"))
        fopt.load_state_dict(ck.read_torch(path, "optimizer.pt"))
        fsched.load_state_dict(ck.read_torch(path, "scheduler.pt"))
        ck.restore_rng_state(ck.read_torch(path, "rng.pt"))
        assert _step(fresh, fopt, fsched) == expected_loss
        for got, want in zip(fresh.parameters(), expected):
            assert torch.equal(got, want)

    def test_files_are_synced_before_the_rename(self, tmp_path: Path, monkeypatch):
        synced: list[str] = []
        real = os.fsync
        monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real(fd))[1])
        renamed: list[str] = []
        real_rename = os.rename
        monkeypatch.setattr(os, "rename", lambda a, b: (renamed.append(str(a)), real_rename(a, b))[1])
        ck.save_checkpoint(tmp_path, 2, {"model.pt": {"w": torch.ones(1)}}, _state(2))
        tmp = str(tmp_path / ".tmp-step-00000002")
        assert renamed == [tmp]
        assert f"{tmp}/model.pt" in synced and f"{tmp}/trainer_state.json" in synced
