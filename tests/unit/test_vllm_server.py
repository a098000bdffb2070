"""vllm_server: vLLM's OpenAI server with a one-worker CPU engine's core process forked, not spawned."""

from __future__ import annotations

import inspect
import os
from types import SimpleNamespace

import pytest

from kuberl.runtime.inference import vllm, vllm_server


def test_vllm_still_forces_spawn_on_cpu():
    """What vllm_server undoes: if a vLLM upgrade stops forcing spawn, the wrapper can go."""
    from vllm.platforms.cpu import CpuPlatform

    assert 'os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"' in inspect.getsource(CpuPlatform.check_and_update_config)


@pytest.mark.parametrize(("executor", "before", "after"), [("uni", None, "fork"), ("uni", "fork", "fork"), ("mp", None, "spawn")])
def test_fork_comes_back_for_the_uni_executor_only(monkeypatch, executor, before, after):
    from vllm.platforms import cpu

    def forces_spawn(cls, vllm_config):  # what vLLM's CPU platform does to the variable
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"

    monkeypatch.setattr(cpu.CpuPlatform, "check_and_update_config", classmethod(forces_spawn))
    if before is None:
        monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD", raising=False)
    else:
        monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", before)
    vllm_server.keep_fork_for_uni_executor()
    cpu.CpuPlatform.check_and_update_config(SimpleNamespace(parallel_config=SimpleNamespace(distributed_executor_backend=executor)))
    assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == after


def test_only_one_worker_cpu_engines_go_through_it(monkeypatch):
    monkeypatch.setattr(vllm, "on_cpu", lambda: True)
    one = vllm.build_server_command("/m", port=8000)
    assert one[1:4] == ["-m", "kuberl.runtime.inference.vllm_server", "vllm.entrypoints.openai.api_server"]
    assert one[one.index("--distributed-executor-backend") + 1] == "uni"
    two = vllm.build_server_command("/m", port=8000, tensor_parallel_size=2)  # mp executor: vLLM's spawn stays
    assert two[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    monkeypatch.setattr(vllm, "on_cpu", lambda: False)
    assert vllm.build_server_command("/m", port=8000)[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]


def test_it_refuses_to_run_anything_but_a_vllm_module(monkeypatch):
    monkeypatch.setattr("sys.argv", ["vllm_server", "os"])
    with pytest.raises(SystemExit, match="usage"):
        vllm_server.main()
