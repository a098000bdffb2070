"""trainer.attention: which transformers attention kernel the fsdp trainer loads its model with (attn_implementation).

auto takes flash-attn where it can run (CUDA, the flash_attn package importing, a 16-bit compute dtype), else sdpa. An
explicit choice that cannot run is a ConfigError naming the field (exit 2), never a silent fallback: transformers itself
would fall back from a missing flash_attn to a kernel downloaded from the Hub, which a trainer pod cannot reach.
packing.varlen_attention reads the choice back from `model.config._attn_implementation`: with flash_attention_2 a packed
micro-batch is one row through flash-attn's varlen kernel.
"""

from __future__ import annotations

import importlib

import torch

from kuberl.runtime.errors import ConfigError

FLASH = "flash_attention_2"
CHOICES = ("auto", "sdpa", FLASH, "eager")
HALF = ("bfloat16", "float16")


def flash_attn_imports() -> bool:
    """Whether the flash_attn package imports here (installed, and built for this torch/CUDA: a wheel built for another
    one fails at import, not at find_spec)."""
    try:
        importlib.import_module("flash_attn")
    except Exception:  # ImportError, or an undefined CUDA symbol in its extension (OSError/RuntimeError)
        return False
    return True


def choose_attention(requested: str, device: torch.device, dtype: str, *, context_parallel: bool = False) -> tuple[str, str]:
    """(attn_implementation, why) for trainer.attention `requested` on `device` with model.dtype `dtype` (the compute dtype
    on an accelerator). Raises ConfigError where the request cannot run."""
    if requested not in CHOICES:
        raise ConfigError(f"trainer.attention must be one of {', '.join(CHOICES)}, got {requested!r}")
    if context_parallel:
        if requested not in ("auto", "sdpa"):
            raise ConfigError(f"trainer.attention {requested}: trainer.parallelism.context > 1 runs its own attention "
                              "(sdpa over each rank's share of the heads): use auto or sdpa")
        return "sdpa", "context parallel runs sdpa over each rank's share of the heads"
    if requested == "auto":
        if device.type != "cuda":
            return "sdpa", f"auto: no flash-attn on {device.type}"
        if dtype not in HALF:
            return "sdpa", f"auto: flash-attn needs model.dtype bfloat16 or float16, not {dtype}"
        if not flash_attn_imports():
            return "sdpa", "auto: the flash_attn package does not import"
        return FLASH, "auto: CUDA and flash_attn import"
    if requested == FLASH:
        if device.type == "cpu":
            raise ConfigError("trainer.attention flash_attention_2 needs a GPU; this trainer runs on cpu: use sdpa or auto")
        if dtype not in HALF:
            raise ConfigError(f"trainer.attention flash_attention_2 needs model.dtype bfloat16 or float16, not {dtype}: "
                              "set model.dtype, or trainer.attention sdpa or auto")
        if device.type == "cuda" and not flash_attn_imports():
            raise ConfigError("trainer.attention flash_attention_2: the flash_attn package does not import in this image "
                              "(use an image with flash-attn built for its torch and CUDA, or trainer.attention sdpa or auto)")
        # On an Ascend NPU transformers runs flash attention through torch_npu, without the flash_attn package.
    return requested, "trainer.attention"
