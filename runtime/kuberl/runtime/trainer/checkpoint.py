"""Trainer checkpoints on disk: save, load, list and prune `checkpoints/step-{S:08d}/` atomically.

File logic (no process group, no bus): the Trainer's ranks write into a temporary folder (each rank its
own DCP shards of model and optimizer, `.metadata` their index, `rng-rank{R}.pt`; rank 0 `scheduler.pt`),
then rank 0 commits: trainer_state.json, fsync, rename, and `checkpoints/latest` names the newest. A crash
at any moment leaves either the old or the new checkpoint, never a half one. Checkpoints of earlier versions
hold full `model.pt` / `optimizer.pt` dicts instead of shards: `is_sharded` tells them apart and
`read_model_state` reads either as one full state dict (for tools outside the trainer), and a
trainer.backend megatron checkpoint (per-rank files, megatron/backend.py) too.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

LATEST = "latest"
PREFIX = "step-"
TMP_PREFIX = ".tmp-"
STATE_FILE = "trainer_state.json"
DCP_METADATA = ".metadata"  # torch.distributed.checkpoint's index of the shard files, written last by rank 0
MODEL_FILE, OPTIMIZER_FILE = "model.pt", "optimizer.pt"  # full state dicts: checkpoints of earlier versions


@dataclass(frozen=True)
class CheckpointInfo:
    """A complete checkpoint folder and the step it was written at."""

    step: int
    path: Path


def checkpoint_name(step: int) -> str:
    return f"{PREFIX}{step:08d}"


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


def _fsync_dir(path: Path) -> None:
    # A rename is durable only once the folder holding it is synced.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def tmp_checkpoint_path(root: str | Path, step: int) -> Path:
    """The temporary folder of step `step` (never listed, never resumed)."""
    return Path(root) / f"{TMP_PREFIX}{checkpoint_name(step)}"


def begin_checkpoint(root: str | Path, step: int) -> Path:
    """Create (empty) the temporary folder a checkpoint is written into; every rank may add files."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    tmp = tmp_checkpoint_path(root, step)
    if tmp.exists():  # left by a crash while writing this very step
        shutil.rmtree(tmp)
    tmp.mkdir()
    return tmp


def write_torch(folder: Path, name: str, obj: Any) -> Path:
    """torch.save `obj` into folder/name and fsync it."""
    path = folder / name
    torch.save(obj, path)
    _fsync_file(path)
    return path


def write_json(folder: Path, name: str, obj: Any) -> Path:
    path = folder / name
    path.write_text(json.dumps(obj, indent=1, sort_keys=True))
    _fsync_file(path)
    return path


def commit_checkpoint(root: str | Path, step: int, trainer_state: dict[str, Any], keep: int | None = None) -> Path:
    """Finish the checkpoint begun by `begin_checkpoint`: write the trainer state, rename, update `latest`, prune."""
    root = Path(root)
    tmp = tmp_checkpoint_path(root, step)
    if not tmp.is_dir():
        raise FileNotFoundError(f"{tmp}: begin_checkpoint({step}) was not called (no temporary folder)")
    write_json(tmp, STATE_FILE, {**trainer_state, "step": step, "saved_at": time.time()})
    _fsync_dir(tmp)
    final = root / checkpoint_name(step)
    if final.exists():  # same step saved again (e.g. end of training right after a periodic one)
        old = root / f"{TMP_PREFIX}old-{checkpoint_name(step)}"
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)
    _fsync_dir(root)
    _write_latest(root, final.name)
    if keep is not None:
        prune_checkpoints(root, keep)
    return final


def save_checkpoint(
    root: str | Path, step: int, files: dict[str, Any], trainer_state: dict[str, Any], keep: int | None = None
) -> Path:
    """One-process convenience: torch.save each of `files` (name -> object), then commit."""
    tmp = begin_checkpoint(root, step)
    for name, obj in files.items():
        write_torch(tmp, name, obj)
    return commit_checkpoint(root, step, trainer_state, keep)


def _write_latest(root: Path, name: str) -> None:
    tmp = root / f"{TMP_PREFIX}{LATEST}"
    tmp.write_text(name + "\n")
    _fsync_file(tmp)
    os.replace(tmp, root / LATEST)
    _fsync_dir(root)


def list_checkpoints(root: str | Path) -> list[CheckpointInfo]:
    """Complete checkpoints under root, oldest first (temporary folders are never listed)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        if not child.is_dir() or not child.name.startswith(PREFIX):
            continue
        digits = child.name[len(PREFIX):]
        if digits.isdigit() and (child / STATE_FILE).is_file():
            found.append(CheckpointInfo(int(digits), child))
    return sorted(found, key=lambda c: c.step)


def latest_checkpoint(root: str | Path) -> CheckpointInfo | None:
    """The checkpoint `latest` names; if that file is missing or stale, the highest complete step."""
    root = Path(root)
    marker = root / LATEST
    if marker.is_file():
        name = marker.read_text().strip()
        path = root / name
        if name.startswith(PREFIX) and name[len(PREFIX):].isdigit() and (path / STATE_FILE).is_file():
            return CheckpointInfo(int(name[len(PREFIX):]), path)
        log.warning("%s names %r, which is not a complete checkpoint; using the newest complete one", marker, name)
    found = list_checkpoints(root)
    return found[-1] if found else None


def prune_checkpoints(root: str | Path, keep: int) -> list[Path]:
    """Delete the oldest checkpoints so that `keep` remain (never the one `latest` names); remove crash leftovers."""
    if keep < 1:
        raise ValueError(f"checkpoint.keep must be >= 1, got {keep}")
    root = Path(root)
    latest = latest_checkpoint(root)
    found = list_checkpoints(root)
    removed = []
    for info in found[: max(len(found) - keep, 0)]:
        if latest is not None and info.path == latest.path:
            continue
        shutil.rmtree(info.path, ignore_errors=True)
        removed.append(info.path)
    for child in root.iterdir():
        # Temporary folders of other steps are leftovers of a crash mid-write.
        if child.is_dir() and child.name.startswith(TMP_PREFIX):
            shutil.rmtree(child, ignore_errors=True)
            removed.append(child)
    return removed


def load_trainer_state(path: str | Path) -> dict[str, Any]:
    """The JSON trainer state of a checkpoint folder."""
    file = Path(path) / STATE_FILE
    try:
        return json.loads(file.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{file}: not a checkpoint (no {STATE_FILE})") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{file}: corrupt trainer state: {exc}") from exc


def read_torch(path: str | Path, name: str) -> Any:
    """torch.load one file of a checkpoint folder (our own files: full unpickling is allowed)."""
    file = Path(path) / name
    if not file.is_file():
        raise FileNotFoundError(f"{file}: missing from checkpoint {Path(path).name}")
    return torch.load(file, map_location="cpu", weights_only=False)


def is_sharded(path: str | Path) -> bool:
    """True for a checkpoint of sharded DCP files; False for one of full model.pt / optimizer.pt dicts (earlier versions)."""
    path = Path(path)
    if (path / DCP_METADATA).is_file():
        return True
    if (path / MODEL_FILE).is_file():
        return False
    raise FileNotFoundError(f"{path}: neither {DCP_METADATA} (sharded) nor {MODEL_FILE} (full): not a complete checkpoint")


def read_model_state(path: str | Path, hf_config: Any = None) -> dict[str, torch.Tensor]:
    """The full model state dict (CPU, Hugging Face parameter names) of a checkpoint, in this process.

    Consolidates DCP shards (any world size) without a process group, or reads model.pt of an older
    checkpoint, or (a `megatron.json` in the folder) merges a trainer.backend megatron checkpoint's
    per-(tensor, pipeline, expert)-rank files into HF names (megatron/consolidate.py: a MoE model's experts
    under the per-expert names save_pretrained writes; `hf_config` only for a megatron checkpoint that does
    not hold the model's config). For tools outside the trainer (evaluation, export, benchmarks): it holds
    the whole model in memory, which the trainer itself never does.
    """
    from kuberl.runtime.trainer.megatron.consolidate import LAYOUT_FILE, read_hf_state

    if (Path(path) / LAYOUT_FILE).is_file():
        return read_hf_state(path, hf_config)
    if not is_sharded(path):
        return read_torch(path, MODEL_FILE)
    import warnings

    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    with warnings.catch_warnings():  # "no process group: loading in this process" is the intent here
        warnings.simplefilter("ignore", UserWarning)
        state = _load_state_dict_from_keys({"model"}, checkpoint_id=str(path))
    if "model" not in state:
        raise ValueError(f"{path}: the DCP checkpoint holds no model state")
    return state["model"]


def capture_rng_state() -> dict[str, Any]:
    """Python, NumPy (when installed) and torch RNG states of this process, for an identical next step."""
    import random

    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:
        pass
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    import random

    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
