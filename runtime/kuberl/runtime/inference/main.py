"""`kuberl engine --config FILE --port P`: start the inference server (vLLM or SGLang) for spec.rollout.

The engine container of each rollout pod runs this (and `kuberl run` does locally). It resolves the
model (builtin: built into $KUBERL_WORKDIR/models, or a temp folder), picks launch settings, then
execs the server so it becomes the container's main process (signals and exit codes go straight to it).
Before the exec, a configuration error (manifest, model, engine settings) exits 2 with the reason in
the termination message (contracts.md); a model hub that cannot be reached exits 1 (retryable).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile

from pydantic import ValidationError

from kuberl.api import RLExperiment, load_experiment
from kuberl.api.v1alpha1 import AcceleratorType
from kuberl.runtime.errors import ConfigError, config_error_exit, spec_errors
from kuberl.runtime.inference.engine_auth import engine_api_key, redact_command
from kuberl.runtime.lifetime import before_exec

log = logging.getLogger("kuberl.engine")

# Context for the builtin tiny model (its prompts are ~25 tokens, responses up to maxNewTokens).
BUILTIN_MAX_MODEL_LEN = 512


def engine_on_cpu(spec) -> bool:
    from kuberl.runtime.inference.vllm import on_cpu

    return spec.rollout.accelerator.type == AcceleratorType.CPU or on_cpu()


def engine_dtype(spec) -> str:
    """The dtype the engine computes in, and so the one the trainer exports weights in.

    bf16 on this CPU dies with SIGILL unless AMX is initialised in every worker: CPU engines run float32,
    and get float32 weights (bf16-rounded weights would make pi_behave differ from the trainer's pi_prox).
    """
    return "float32" if engine_on_cpu(spec) else spec.model.dtype


def engine_settings(exp: RLExperiment) -> dict:
    """Launch keyword arguments for the engine class's build_server_command, from the spec."""
    spec = exp.spec
    cpu = engine_on_cpu(spec)
    settings: dict = {
        "tensor_parallel_size": spec.rollout.tensor_parallel_size,
        "pipeline_parallel_size": spec.rollout.pipeline_parallel_size,
        "dtype": engine_dtype(spec),
        "seed": spec.seed,
        "extra_args": list(spec.rollout.engine_args),
        "max_model_len": None,
        "max_num_seqs": None,
    }
    if spec.model.builtin is not None:
        settings["max_model_len"] = BUILTIN_MAX_MODEL_LEN
    if spec.algorithm.lora is not None:  # vLLM serves the adapters (admission refuses lora with sglang)
        settings["lora_rank"] = spec.algorithm.lora.rank
    if cpu:
        # One agent keeps concurrency groups x samplesPerPrompt sequences in flight.
        settings["max_num_seqs"] = max(1, min(256, spec.rollout.concurrency * spec.algorithm.samples_per_prompt))
    return settings


def model_workdir(flag: str | None) -> str:
    return flag or os.environ.get("KUBERL_WORKDIR") or os.path.join(tempfile.gettempdir(), "kuberl")


def server_command(exp: RLExperiment, model_path: str, port: int, host: str) -> tuple[list[str], dict[str, str]]:
    """The server command line and environment for spec.rollout.engine."""
    engine = exp.spec.rollout.engine
    settings = engine_settings(exp)
    if engine == "vllm":
        from kuberl.runtime.inference import vllm

        return vllm.build_server_command(model_path, port=port, host=host, **settings), vllm.server_env()
    if engine == "sglang":
        from kuberl.runtime.inference import sglang

        return sglang.build_server_command(model_path, port=port, host=host, api_key=engine_api_key(), **settings), dict(os.environ)
    raise ValueError(f"rollout.engine: unknown engine {engine!r}")


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s [engine] %(message)s", datefmt="%H:%M:%S")
    try:
        exp = load_experiment(args.config)
    except (ValueError, ValidationError, OSError) as exc:
        return config_error_exit("engine", exc)
    from kuberl.runtime.models import resolve_model

    try:
        with spec_errors():
            model_path = resolve_model(exp.spec.model, model_workdir(getattr(args, "workdir", None)))
            cmd, env = server_command(exp, model_path, args.port, args.host)
    except ConfigError as exc:
        return config_error_exit("engine", exc)
    except ValueError as exc:  # only a transient one gets past spec_errors (the hub unreachable): retry
        print(f"kuberl engine: {exc}", file=sys.stderr)
        return 1
    log.info("exec: %s", redact_command(cmd))
    sys.stdout.flush()
    sys.stderr.flush()
    before_exec()  # the server dies with `kuberl run` though it may start no watchdog of its own (kuberl.runtime.lifetime)
    os.execvpe(cmd[0], cmd, env)
    return 0  # not reached
