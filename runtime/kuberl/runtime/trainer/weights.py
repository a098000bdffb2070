"""Policy weights in Hugging Face layout: `weights/v{N}/` (config.json, model.safetensors, tokenizer files).

The Trainer calls `export_weights` on rank 0 with a full CPU state dict after each step; engines (vLLM,
SGLang) and `load_weights` read the folder back. Written to a temporary folder and renamed, so a
reader never sees half a version; only the newest `keep` versions stay.

With algorithm.lora the version folder holds a PEFT adapter instead (`save_pretrained` layout:
adapter_config.json + adapter_model.safetensors, see `export_adapter`), which vLLM hot-loads.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

log = logging.getLogger(__name__)

WEIGHTS_FILE = "model.safetensors"
ADAPTER_FILE = "adapter_model.safetensors"  # PEFT's names (peft.utils.constants SAFETENSORS_WEIGHTS_NAME, CONFIG_NAME)
ADAPTER_CONFIG = "adapter_config.json"
# What an engine needs besides the tensors; copied from the source model folder when present.
SIDE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "added_tokens.json",
)


def version_dir(root: str | Path, version: int) -> Path:
    return Path(root) / f"v{version}"


def _plain_tensors(state_dict: dict[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    out = {}
    for name, tensor in state_dict.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"state dict entry {name!r} is a {type(tensor).__name__}, not a tensor (pass a full state dict)")
        t = tensor.detach().to("cpu")
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        # safetensors refuses tensors sharing storage (tied weights): give each its own copy.
        out[name] = t.contiguous().clone()
    return out


def export_weights(
    state_dict: dict[str, torch.Tensor],
    root: str | Path,
    version: int,
    *,
    source_dir: str | Path | None = None,
    config: Any = None,
    tokenizer: Any = None,
    dtype: torch.dtype | None = None,
    keep: int | None = 3,
) -> Path:
    """Write `root/v{version}/` atomically and return it.

    source_dir: the model folder whose config and tokenizer files are copied (the usual case);
    config / tokenizer: transformers objects saved with save_pretrained instead (either may be given).
    dtype: cast floating tensors (e.g. to the engine's bfloat16); None keeps them as they are.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = version_dir(root, version)
    tmp = root / f".tmp-v{version}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        save_file(_plain_tensors(state_dict, dtype), str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        if source_dir is not None:
            for name in SIDE_FILES:
                src = Path(source_dir) / name
                if src.is_file():
                    shutil.copy2(src, tmp / name)
        if config is not None:
            config.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if not (tmp / "config.json").is_file():
            raise ValueError(f"weights v{version}: no config.json (pass source_dir with one, or config)")
        if dtype is not None:
            _set_config_dtype(tmp / "config.json", dtype)
        _commit_folder(tmp, final, root, version)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if keep is not None:
        prune_weights(root, keep, protect=version)
    return final


def _commit_folder(tmp: Path, final: Path, root: Path, version: int) -> None:
    """fsync every file of `tmp`, then rename it to `final` (replacing a version written before)."""
    for f in tmp.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    if final.exists():  # a restarted trainer re-publishes a version it wrote before
        old = root / f".old-v{version}-{os.getpid()}"
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)


def adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Collective (every rank calls): the trainable (adapter) parameters, full and on CPU on rank 0, in PEFT's file names.

    Only parameters with requires_grad are gathered (the frozen base model never leaves its shards); the
    keys are what `PeftModel.save_pretrained` writes (`...q_proj.lora_A.weight`, the adapter name dropped).
    Other ranks get an empty dict.
    """
    from peft.utils import get_peft_model_state_dict
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
    state = get_model_state_dict(model, options=opts)
    if not state:
        return {}
    # save_embedding_layers=False: only the adapters, never the (frozen) embedding matrices of lm_head / embed_tokens targets
    return get_peft_model_state_dict(model, state_dict=state, save_embedding_layers=False)


def export_adapter(state_dict: dict[str, torch.Tensor], peft_config: Any, root: str | Path, version: int, *,
                   dtype: torch.dtype | None = None, keep: int | None = 3) -> Path:
    """Write a PEFT adapter as `root/v{version}/` atomically (adapter_config.json + adapter_model.safetensors) and return it.

    state_dict: `adapter_state`'s output; peft_config: the model's LoraConfig (`model.peft_config["default"]`).
    """
    if not state_dict:
        raise ValueError(f"adapter v{version}: no adapter tensors (is the model wrapped with PEFT?)")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = version_dir(root, version)
    tmp = root / f".tmp-v{version}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        save_file(_plain_tensors(state_dict, dtype), str(tmp / ADAPTER_FILE), metadata={"format": "pt"})
        peft_config.save_pretrained(str(tmp))
        if not (tmp / ADAPTER_CONFIG).is_file():
            raise ValueError(f"adapter v{version}: the PEFT config wrote no {ADAPTER_CONFIG}")
        _commit_folder(tmp, final, root, version)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if keep is not None:
        prune_weights(root, keep, protect=version)
    return final


def is_adapter(path: str | Path) -> bool:
    """Whether a version folder holds a PEFT adapter (LoRA) rather than full weights."""
    return (Path(path) / ADAPTER_CONFIG).is_file()


def _set_config_dtype(path: Path, dtype: torch.dtype) -> None:
    cfg = json.loads(path.read_text())
    name = str(dtype).removeprefix("torch.")
    cfg["torch_dtype"] = name
    cfg["dtype"] = name
    path.write_text(json.dumps(cfg, indent=2))


def list_versions(root: str | Path) -> list[int]:
    """Versions present under root, ascending."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(int(p.name[1:]) for p in root.iterdir() if p.is_dir() and p.name[:1] == "v" and p.name[1:].isdigit())


def prune_weights(root: str | Path, keep: int, protect: int | None = None) -> list[int]:
    """Delete all but the newest `keep` versions (and never `protect`, the one just published)."""
    versions = list_versions(root)
    removed = []
    for v in versions[: max(len(versions) - keep, 0)]:
        if v == protect:
            continue
        shutil.rmtree(version_dir(root, v), ignore_errors=True)
        removed.append(v)
    return removed


def load_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of a `v{N}/` folder (or of any folder with model.safetensors)."""
    file = Path(path) / WEIGHTS_FILE
    if not file.is_file():
        raise FileNotFoundError(f"{file}: no weights there")
    return load_file(str(file))


def digest_state(state: dict[str, torch.Tensor]) -> str:
    """sha256 over a state dict's names and float32 bytes, in name order (to compare weights across ranks/files)."""
    h = hashlib.sha256()
    for name in sorted(state):
        h.update(name.encode())
        h.update(state[name].detach().to(torch.float32).contiguous().cpu().numpy().tobytes())
    return h.hexdigest()
