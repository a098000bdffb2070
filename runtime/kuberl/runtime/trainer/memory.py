"""The trainer running out of accelerator memory, told as the configuration error it is.

A step's memory is set by the spec: the model, `trainer.microBatchTokens` (the activations of one micro-batch) and
`trainer.gradientCheckpointing`, over the ranks FSDP shards the weights and optimizer state across. The same spec runs
out of memory again after a restart, so a restart only reloads the model to fail once more. `out_of_memory_error`
turns the accelerator's out-of-memory error into a ConfigError (exit code 2, not retried) whose message says how
much was in use and which settings lower it.
"""

from __future__ import annotations

import re

import torch

from kuberl.api.roles import TrainerSpec
from kuberl.runtime.errors import ConfigError, exception_chain

GIB = 2**30
_TRIED = re.compile(r"Tried to allocate [\d.]+ [KMGT]i?B")


def is_out_of_memory(exc: BaseException, device: torch.device) -> bool:
    """Whether `exc`, or what caused it, is the accelerator out of memory: torch.OutOfMemoryError (CUDA), or the
    RuntimeError an Ascend NPU raises ("NPU out of memory"). Never on CPU, where the kernel kills the process."""
    if device.type == "cpu":
        return False
    return any(isinstance(e, torch.OutOfMemoryError) or (isinstance(e, RuntimeError) and "out of memory" in str(e))
               for e in exception_chain(exc))


def memory_gib(device: torch.device) -> tuple[float, float] | None:
    """(peak allocated, total) GiB on `device` through torch.cuda or torch.npu; None where they cannot be read."""
    backend = getattr(torch, device.type, None)
    try:
        return backend.max_memory_allocated(device) / GIB, backend.get_device_properties(device).total_memory / GIB
    except Exception:  # no such backend here, or no device behind it
        return None


def out_of_memory_error(exc: BaseException, spec: TrainerSpec, device: torch.device, ranks: int) -> ConfigError | None:
    """A ConfigError for `exc` when it is the accelerator out of memory (else None): how much was in use, at which
    settings, and which of them lower it."""
    if not is_out_of_memory(exc, device):
        return None
    tried = _TRIED.search(str(exc))
    used = memory_gib(device)
    where = f"{device.type} out of memory" + (f" (t{tried.group(0)[1:]})" if tried else "")
    if used is not None:
        where += f": {used[0]:.1f} GiB allocated at the peak, of {used[1]:.1f} GiB"
    settings = (f"trainer.microBatchTokens {spec.micro_batch_tokens}, trainer.gradientCheckpointing "
                f"{str(spec.gradient_checkpointing).lower()}, {ranks} trainer rank{'s' if ranks != 1 else ''}")
    if spec.gradient_checkpointing:
        advice = "lower trainer.microBatchTokens, or give the trainer more ranks (FSDP shards weights and optimizer state over them)"
    else:
        advice = ("set trainer.gradientCheckpointing: true (a Qwen2.5-1.5B step on one GPU: 92 -> 33 GiB, ~19% slower) "
                  "or lower trainer.microBatchTokens")
    return ConfigError(f"trainer: {where} at {settings}; {advice}")
