"""`python -m kuberl.runtime.inference.vllm_server vllm.entrypoints.openai.api_server ARGS...`: vLLM's OpenAI server, its
engine-core process forked rather than spawned on a one-worker CPU engine, and 16-token KV blocks allowed there
(allow_16_token_kv_blocks).

vLLM's CPU platform sets VLLM_WORKER_MULTIPROC_METHOD=spawn unconditionally (vllm/platforms/cpu.py,
check_and_update_config), for its multiproc executor's OpenMP-bound workers. With `--distributed-executor-backend uni`
(what KubeRL runs for tensor x pipeline 1, vllm.build_server_command) there are no such workers: the one worker runs
inside the engine-core process, which binds its own OpenMP threads. Spawning that process re-imports vLLM and torch
in it; forking does not. Measured on the tiny model here: healthy after 32.1 s spawned, 17.5 s forked (same tokens
for the same seed). Every `kuberl run`, engine restart and engine test fixture starts one.

The first argument names vLLM's server module, so that the process still reads as vLLM's server in `ps` (and to the
tests and benchmarks that find it there). KUBERL_VLLM_CPU_FORK=0 keeps vLLM's spawn. Re-check on every vLLM upgrade:
the engine tests start servers through this module.
"""

from __future__ import annotations

import os
import runpy
import sys

from kuberl.runtime.lifetime import watch_parent

FORK_ENV = "KUBERL_VLLM_CPU_FORK"
METHOD_ENV = "VLLM_WORKER_MULTIPROC_METHOD"


def keep_fork_for_uni_executor() -> None:
    """After vLLM's CPU platform has set spawn, put fork back when the executor is uni (one worker, in the engine core).

    Call it before vLLM's server module runs: the start method the environment named then (the user's choice) is kept;
    unset, uni gets fork. vLLM's CLI sets spawn itself before it builds the config (`cli_env_setup`), so the variable's
    value at config time says nothing about what the user asked for.
    """
    from vllm.platforms import cpu

    original = cpu.CpuPlatform.check_and_update_config.__func__
    chosen = os.environ.get(METHOD_ENV)

    def check_and_update_config(cls, vllm_config) -> None:
        original(cls, vllm_config)
        if vllm_config.parallel_config.distributed_executor_backend == "uni":
            os.environ[METHOD_ENV] = chosen or "fork"  # vLLM's own default: fork

    cpu.CpuPlatform.check_and_update_config = classmethod(check_and_update_config)


def forking() -> bool:
    """Whether this wrapper forks the engine core: KUBERL_VLLM_CPU_FORK (default on), unless the environment asks vLLM
    for another start method (VLLM_WORKER_MULTIPROC_METHOD, which keep_fork_for_uni_executor keeps)."""
    return os.environ.get(FORK_ENV, "1") != "0" and os.environ.get(METHOD_ENV, "fork") == "fork"


def allow_16_token_kv_blocks() -> None:
    """Let vLLM's CPU attention backend take KV blocks of 16 tokens (vllm.cpu_block_size picks them on x86).

    Its kernel has a path for block sizes that are not multiples of 32 (ISA "vec16", cpu_attn._get_attn_isa), but the
    backend declares multiples of 32 only. The prefix cache shares full blocks: with 16, a group's samples of a 19-token
    prompt share 16 of its tokens instead of none. Measured on bench/bench_trl.py's model, 8 and 24 groups of 8 at once:
    engine-core CPU per 64 samples 269-292 -> 228-230 ms and 213-225 -> 172-180 ms. The engine core inherits this patch
    by fork, so it is only applied (and 16 only chosen) while the engine core is forked.
    """
    from vllm.v1.attention.backend import MultipleOf
    from vllm.v1.attention.backends import cpu_attn

    cpu_attn.CPUAttentionBackend.get_supported_kernel_block_sizes = staticmethod(lambda kv_cache_spec=None: [MultipleOf(16)])


def main() -> None:
    if len(sys.argv) < 2 or not sys.argv[1].startswith("vllm."):
        raise SystemExit("usage: python -m kuberl.runtime.inference.vllm_server vllm.entrypoints.openai.api_server [vLLM arguments]")
    module = sys.argv[1]
    watch_parent()  # `kuberl engine` exec'd this: its watchdog did not survive the exec (kuberl.runtime.lifetime)
    if forking():
        keep_fork_for_uni_executor()
        allow_16_token_kv_blocks()
    sys.argv = [module, *sys.argv[2:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
