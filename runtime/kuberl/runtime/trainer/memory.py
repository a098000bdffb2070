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


# Two measurements calibrate the estimate (docs/design/gpu-trainer-2026-11-28-h200.log: one H200, FSDP2, bf16 compute,
# packing auto, trainer.microBatchTokens 16384, no gradient checkpointing): Qwen2.5-1.5B (1544M parameters, 28 layers,
# hidden 1536) peaked at 92.0 GiB, Qwen2.5-0.5B (494M, 24 layers, hidden 896) at 44.9 GiB. The float32 master weights,
# gradients and Adam's two moments are 16 bytes a parameter, the float32 log-probabilities of the vocabulary (151936
# words) 4 bytes a token and word; the rest is the decoder's activations kept for the backward, 91 and 86 bytes a token,
# layer and unit of the hidden size. With 92 the estimate is 92.7 and 46.8 GiB. (With checkpointing the 1.5B step
# peaked at 33.4 GiB, ~19% slower.)
STATE_BYTES_PER_PARAM = 16
LOGIT_BYTES = 4
ACTIVATION_BYTES = 92
CHECKPOINTING_FIT = 0.85
"""Gradient checkpointing goes on when the step without it is estimated above this share of the accelerator's memory."""


def step_memory_gib(params: int, layers: int, hidden: int, vocab: int, micro_batch_tokens: int, ranks: int) -> float:
    """Estimated peak GiB of one FSDP rank's step without gradient checkpointing: its shard of the weights, gradients
    and optimizer state, the vocabulary log-probabilities and the activations of one micro-batch (constants above)."""
    states = params * STATE_BYTES_PER_PARAM / max(ranks, 1)
    logits = micro_batch_tokens * vocab * LOGIT_BYTES
    activations = micro_batch_tokens * layers * hidden * ACTIVATION_BYTES
    return (states + logits + activations) / GIB


def choose_gradient_checkpointing(spec: TrainerSpec, model: torch.nn.Module, device: torch.device, ranks: int) -> tuple[bool, str]:
    """trainer.gradientCheckpointing, and why: the manifest's value when set; unset, on when the step without it is
    estimated above CHECKPOINTING_FIT of the accelerator's memory (a Qwen2.5-1.5B step on an 80 GB card), off where it
    fits (recomputing costs ~19% of a step) and on CPU (host memory is not the accelerator's to budget)."""
    if spec.gradient_checkpointing is not None:
        return spec.gradient_checkpointing, "set in the manifest"
    total = memory_gib(device)
    if total is None:
        return False, f"unset: off on {device.type}"
    cfg = model.config
    params = sum(p.numel() for p in model.parameters())
    need = step_memory_gib(params, cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size, spec.micro_batch_tokens, ranks)
    on = need > CHECKPOINTING_FIT * total[1]
    verdict = "over" if on else "within"
    return on, (f"unset: {'on' if on else 'off'}, a step without it estimated at {need:.1f} GiB of the {total[1]:.1f} GiB "
                f"{device.type} ({verdict} {CHECKPOINTING_FIT:.0%})")


def out_of_memory_error(exc: BaseException, spec: TrainerSpec, device: torch.device, ranks: int,
                        checkpointing: bool | None = None) -> ConfigError | None:
    """A ConfigError for `exc` when it is the accelerator out of memory (else None): how much was in use, at which
    settings, and which of them lower it. `checkpointing`: what the trainer chose (trainer.gradientCheckpointing unset)."""
    if not is_out_of_memory(exc, device):
        return None
    tried = _TRIED.search(str(exc))
    used = memory_gib(device)
    where = f"{device.type} out of memory" + (f" (t{tried.group(0)[1:]})" if tried else "")
    if used is not None:
        where += f": {used[0]:.1f} GiB allocated at the peak, of {used[1]:.1f} GiB"
    on = bool(spec.gradient_checkpointing if checkpointing is None else checkpointing)
    if spec.gradient_checkpointing is not None:
        state = str(on).lower()
    else:  # unset: what the trainer chose, or nothing yet when it ran out of memory loading the model
        state = "unset" if checkpointing is None else f"{str(on).lower()} (chosen: the field is unset)"
    settings = (f"trainer.microBatchTokens {spec.micro_batch_tokens}, trainer.gradientCheckpointing {state}, "
                f"{ranks} trainer rank{'s' if ranks != 1 else ''}")
    if on:
        advice = "lower trainer.microBatchTokens, or give the trainer more ranks (FSDP shards weights and optimizer state over them)"
    else:
        advice = ("set trainer.gradientCheckpointing: true (a Qwen2.5-1.5B step on one GPU: 92 -> 33 GiB, ~19% slower) "
                  "or lower trainer.microBatchTokens")
    return ConfigError(f"trainer: {where} at {settings}; {advice}")
