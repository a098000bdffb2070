"""Checkpoint formats on disk, in one process without a process group: sharded (DCP) and full dicts (earlier versions).

The multi-rank behaviour (resharding 1 <-> 2 ranks, torn checkpoints, resuming) is in
tests/integration/test_checkpoint_resharding.py; here the file-level rules: which format a folder is,
reading a whole model from either, and that a temporary folder holding shards is never a checkpoint.
"""

from __future__ import annotations

import pytest
import torch

from kuberl.runtime.trainer import checkpoint as ck
from kuberl.runtime.trainer import dist as D

# No process group here on purpose: DCP says it saves and loads in this one process.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _model_and_optimizer(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    return model, opt


def test_sharded_state_written_without_a_process_group_reads_back_as_the_full_model(tmp_path):
    model, opt = _model_and_optimizer()
    D.save_sharded_state(tmp_path, model, opt)
    assert ck.is_sharded(tmp_path) and (tmp_path / ck.DCP_METADATA).is_file()
    full = ck.read_model_state(tmp_path)
    assert full.keys() == model.state_dict().keys()
    for k, v in model.state_dict().items():
        assert torch.equal(full[k], v), k


def test_load_sharded_state_restores_model_and_adam_state_into_another_model(tmp_path):
    model, opt = _model_and_optimizer(0)
    D.save_sharded_state(tmp_path, model, opt)
    other, other_opt = _model_and_optimizer(1)
    assert not torch.equal(other[0].weight, model[0].weight)
    D.load_sharded_state(tmp_path, other, other_opt)
    for k, v in model.state_dict().items():
        assert torch.equal(other.state_dict()[k], v), k
    want, got = opt.state_dict()["state"], other_opt.state_dict()["state"]
    for i in want:
        for field in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(got[i][field], want[i][field]), (i, field)


def test_a_folder_of_full_dicts_from_an_earlier_version_is_read_through_model_pt(tmp_path):
    path = ck.save_checkpoint(tmp_path, 3, {"model.pt": {"w": torch.ones(2)}, "optimizer.pt": {}}, {"version": 3})
    assert not ck.is_sharded(path)
    assert torch.equal(ck.read_model_state(path)["w"], torch.ones(2))


def test_a_folder_with_neither_shards_nor_model_pt_is_refused_by_name(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"neither \.metadata \(sharded\) nor model\.pt"):
        ck.is_sharded(tmp_path)


def test_a_temporary_folder_with_every_shard_is_not_a_checkpoint(tmp_path):
    model, opt = _model_and_optimizer()
    ck.save_checkpoint(tmp_path, 1, {"model.pt": model.state_dict()}, {"version": 1})
    tmp = ck.begin_checkpoint(tmp_path, 2)
    D.save_sharded_state(tmp, model, opt)  # shards and index written; the trainer died before the commit
    ck.write_torch(tmp, "scheduler.pt", {})
    assert [c.step for c in ck.list_checkpoints(tmp_path)] == [1]
    assert ck.latest_checkpoint(tmp_path).step == 1
    ck.commit_checkpoint(tmp_path, 2, {"version": 2})
    assert ck.latest_checkpoint(tmp_path).step == 2 and ck.is_sharded(ck.latest_checkpoint(tmp_path).path)
