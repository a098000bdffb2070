"""The trainer's device choice (runtime/kuberl/runtime/trainer/dist.py): npu + HCCL when torch_npu imports and
sees an NPU, cuda + NCCL when CUDA does, else cpu + gloo. No Ascend here: torch_npu is played by a
module in sys.modules and torch's privateuse1 backend renamed to npu, as torch_npu itself does."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest
import torch

from kuberl.runtime.trainer import dist as D


@pytest.mark.parametrize("requested, npu, cuda, want", [
    (None, True, True, ("npu", "hccl")),   # an Ascend node (torch_npu present) wins over a stray CUDA
    (None, False, True, ("cuda", "nccl")),
    (None, False, False, ("cpu", "gloo")),
    ("cpu", True, True, ("cpu", "gloo")),  # an explicit request is honoured
    ("cuda", False, False, ("cuda", "nccl")),
])
def test_choose_device(requested, npu, cuda, want):
    assert D.choose_device(requested, npu=npu, cuda=cuda) == want


def test_an_unknown_device_is_refused_by_name():
    with pytest.raises(ValueError, match="device 'tpu': expected one of npu, cuda, cpu"):
        D.choose_device("tpu", npu=False, cuda=False)


def test_npu_available_needs_torch_npu_and_an_npu(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # import torch_npu raises ImportError
    assert D.npu_available() is False
    monkeypatch.setitem(sys.modules, "torch_npu", types.ModuleType("torch_npu"))
    monkeypatch.setattr(torch, "npu", types.SimpleNamespace(is_available=lambda: False), raising=False)
    assert D.npu_available() is False  # the image has torch_npu, the node has no NPU
    monkeypatch.setattr(torch, "npu", types.SimpleNamespace(is_available=lambda: True), raising=False)
    assert D.npu_available() is True


NPU_RANK = r"""
import os, sys, types, torch
import torch.distributed as dist
torch.utils.rename_privateuse1_backend("npu")   # what torch_npu does on import
calls = []
sys.modules["torch_npu"] = types.ModuleType("torch_npu")
torch.npu = types.SimpleNamespace(is_available=lambda: True, set_device=lambda d: calls.append(("set_device", str(d))))
dist.init_process_group = lambda backend, **kw: calls.append(("init_process_group", backend))
dist.is_initialized = lambda: False
dist.get_rank = lambda: 1
dist.get_world_size = lambda: 2
os.environ.update(RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
from kuberl.runtime.trainer import dist as D
info = D.init_distributed()
print(info.device, calls)
"""


def test_a_rank_on_an_ascend_node_joins_with_hccl_on_its_local_npu():
    proc = subprocess.run([sys.executable, "-c", NPU_RANK], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "npu:1 [('set_device', 'npu:1'), ('init_process_group', 'hccl')]"
