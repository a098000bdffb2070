"""Policy weights in Hugging Face layout: `weights/v{N}/` (config.json, model.safetensors, tokenizer files).

The Trainer calls `export_model_weights` on every rank after each step: the ranks gather one tensor at a time
(FSDP2: `full_tensor()`, collective) and rank 0 writes them out shard by shard (`weightSync.bucketMB` each), so
no rank holds more than one shard of full tensors. A version that fits one shard is a plain `model.safetensors`;
a bigger one is Hugging Face's sharded layout (`model-0000i-of-0000N.safetensors` + `model.safetensors.index.json`),
which vLLM, SGLang, transformers and `load_weights` read. `export_weights` does the same from a full state dict.
Written to a temporary folder and renamed, so a reader never sees half a version; only the newest `keep` versions stay.

With algorithm.lora the version folder holds a PEFT adapter instead (`save_pretrained` layout:
adapter_config.json + adapter_model.safetensors, see `export_adapter`), which vLLM hot-loads.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shutil
import time
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

log = logging.getLogger(__name__)

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"  # transformers' SAFE_WEIGHTS_INDEX_NAME: {"metadata": {"total_size"}, "weight_map": {name: file}}
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


def _plain_tensor(name: str, tensor: Any, dtype: torch.dtype | None) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"state dict entry {name!r} is a {type(tensor).__name__}, not a tensor (pass a full state dict)")
    src = tensor.detach()
    t = src
    if dtype is not None and t.is_floating_point():
        # Cast where the tensor lives, then copy: from a GPU's float32 master weights to a bf16 engine, half the bytes
        # cross to the host and the host does no cast (0.5-0.8 s for a 0.5B model on two cores). Same rounding either way.
        t = t.to(dtype)
    t = t.to("cpu").contiguous()
    # Still the caller's memory (a live parameter; tied weights share it, which safetensors refuses): a copy of its own.
    return t.clone() if t.untyped_storage().data_ptr() == src.untyped_storage().data_ptr() else t


def _plain_tensors(state_dict: dict[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    return {name: _plain_tensor(name, tensor, dtype) for name, tensor in state_dict.items()}


def tensor_nbytes(tensor: torch.Tensor, dtype: torch.dtype | None) -> int:
    """Bytes `tensor` takes in the file: its global shape (a DTensor's too), floating ones in `dtype` when given."""
    out = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
    return tensor.numel() * out.itemsize


def plan_shards(sizes: list[tuple[str, int]], shard_bytes: int | None) -> list[list[str]]:
    """Consecutive (name, bytes) entries grouped into shards of at most `shard_bytes`; a bigger tensor gets a shard of its own.

    None: one shard. Planned from shapes and dtypes before any tensor is gathered, so the number of files is known.
    """
    if shard_bytes is not None and shard_bytes < 1:
        raise ValueError(f"weight shard size must be positive, got {shard_bytes} bytes (weightSync.bucketMB)")
    shards: list[list[str]] = []
    size = 0
    for name, n in sizes:
        if not shards or (shard_bytes is not None and shards[-1] and size + n > shard_bytes):
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards or [[]]  # no tensors: one empty model.safetensors, as save_file writes it


def shard_file_names(count: int) -> list[str]:
    """File names of a version in `count` shards: model.safetensors alone, else transformers' model-0000i-of-0000N.safetensors."""
    if count <= 1:
        return [WEIGHTS_FILE]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def _drain(tensors: Iterator[Any]) -> None:
    """Run the rest of a collective iterator (the other ranks still gather), ignoring what it raises."""
    try:
        deque(tensors, maxlen=0)
    except Exception:  # noqa: BLE001  the first error is the one worth reporting
        log.exception("weights: the remaining gathers failed too")


def write_weights_streamed(
    sizes: list[tuple[str, int]],
    tensors: Iterable[tuple[str, torch.Tensor]],
    root: str | Path,
    version: int,
    *,
    shard_bytes: int | None = None,
    source_dir: str | Path | None = None,
    config: Any = None,
    tokenizer: Any = None,
    dtype: torch.dtype | None = None,
    keep: int | None = 3,
    stats: dict[str, Any] | None = None,
    durable: bool = True,
) -> Path:
    """Write `root/v{version}/` atomically from (name, tensor) pairs that arrive one at a time, and return it.

    sizes: every (name, bytes in the file) in the order `tensors` yields them (`tensor_nbytes`); the shards are planned
    from it up front. At most one shard (`shard_bytes`) of tensors is held at once: each is written when complete.
    source_dir: the model folder whose config and tokenizer files are copied (the usual case);
    config / tokenizer: transformers objects saved with save_pretrained instead (either may be given).
    dtype: cast floating tensors (e.g. to the engine's bfloat16); None keeps them as they are.
    stats (filled when given): shards, total_bytes, peak_bytes (the most bytes of converted tensors held at once: one shard at most,
    or one tensor bigger than a shard).
    durable: fsync the files before the rename. Readers see a complete folder either way (the rename is atomic, and
    NFS flushes a file on close); False skips the disk wait for versions that a node crash may lose (`sync_version`).
    If writing fails, the rest of `tensors` is still run through (under FSDP each item is a collective) before raising.
    """
    it = iter(tensors)
    root = Path(root)
    final = version_dir(root, version)
    tmp = root / f".tmp-v{version}-{os.getpid()}"
    peak = 0
    try:
        plan = plan_shards(sizes, shard_bytes)
        files = shard_file_names(len(plan))
        file_of = {name: files[i] for i, names in enumerate(plan) for name in names}
        if len(file_of) != len(sizes):
            raise ValueError(f"weights v{version}: duplicate tensor names in the state dict")
        total = sum(n for _, n in sizes)
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        for i, names in enumerate(plan):
            shard: dict[str, torch.Tensor] = {}
            held = 0
            for want in names:
                name, tensor = next(it, (None, None))
                if name != want:
                    raise ValueError(f"weights v{version}: expected tensor {want!r} next, got {name!r} (the tensors must follow `sizes`)")
                shard[name] = _plain_tensor(name, tensor, dtype)
                del tensor
                held += shard[name].nbytes
                peak = max(peak, held)
            save_file(shard, str(tmp / files[i]), metadata={"format": "pt"})
            del shard
        if next(it, None) is not None:
            raise ValueError(f"weights v{version}: more tensors than planned ({len(sizes)})")
        if len(files) > 1:
            index = {"metadata": {"total_size": total}, "weight_map": file_of}
            (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
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
        _commit_folder(tmp, final, root, version, durable=durable)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, Exception):
            _drain(it)
        raise
    if stats is not None:
        stats.update(shards=len(files), total_bytes=total, peak_bytes=peak)
    if keep is not None:
        prune_weights(root, keep, protect=version)
    return final


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
    shard_bytes: int | None = None,
    stats: dict[str, Any] | None = None,
) -> Path:
    """Write a full state dict as `root/v{version}/` atomically and return it (arguments: `write_weights_streamed`).

    shard_bytes None: one `model.safetensors`, whatever the size.
    """
    for name, tensor in state_dict.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"state dict entry {name!r} is a {type(tensor).__name__}, not a tensor (pass a full state dict)")
    sizes = [(name, tensor_nbytes(t, dtype)) for name, t in state_dict.items()]
    return write_weights_streamed(sizes, state_dict.items(), root, version, shard_bytes=shard_bytes, source_dir=source_dir, config=config,
                                  tokenizer=tokenizer, dtype=dtype, keep=keep, stats=stats)


def export_model_weights(model: torch.nn.Module, info: Any, root: str | Path, version: int, *, shard_bytes: int | None,
                         source_dir: str | Path | None = None, dtype: torch.dtype | None = None, keep: int | None = 3,
                         stats: dict[str, Any] | None = None, durable: bool = True) -> Path | None:
    """Collective (every rank calls): `model`'s weights as `root/v{version}/`, written by rank 0 shard by shard.

    The ranks gather one state dict entry at a time in the same order (FSDP2: `full_tensor()`); rank 0 keeps at most
    one shard (`shard_bytes`) of them. Same names as a full state dict (`dist.full_model_state`), a tied LM head left out
    (`written_entries`). info: the trainer's `dist.DistInfo`. Returns the folder on rank 0, None elsewhere. durable: `write_weights_streamed`.
    """
    from kuberl.runtime.trainer import dist as D

    entries = written_entries(model, D.model_state_entries(model, cached=True))
    tensors = D.iter_full_tensors(entries)
    if not info.is_main:
        deque(tensors, maxlen=0)  # take part in every gather, in rank 0's order, holding none once the next one starts
        return None
    sizes = [(name, tensor_nbytes(t, dtype)) for name, t in entries]
    return write_weights_streamed(sizes, tensors, root, version, shard_bytes=shard_bytes, source_dir=source_dir, dtype=dtype,
                                  keep=keep, stats=stats, durable=durable)


def written_entries(model: torch.nn.Module, entries: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """The entries a published version holds: with tied word embeddings (config.tie_word_embeddings) a tensor shared
    under two names is written once, under its first (`model.embed_tokens.weight`), as `save_pretrained` writes it and as
    the Hub's tied models (Qwen2.5-0.5B/1.5B) are; engines and transformers tie the LM head to it on load. For the
    0.5B shape that is 21% fewer bytes to gather, cast and write every step. Every rank gets the same list (a collective
    gathers each entry)."""
    if not getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        return entries
    first: dict[int, str] = {}
    again = set()  # names of a parameter registered under an earlier name too (the same on every rank: module structure)
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            again.add(name)
        else:
            first[id(p)] = name
    return [(name, t) for name, t in entries if name not in again]


def _commit_folder(tmp: Path, final: Path, root: Path, version: int, *, durable: bool = True) -> None:
    """fsync every file of `tmp` (durable), then rename it to `final` (replacing a version written before)."""
    if durable:
        sync_folder(tmp)
    if final.exists():  # a restarted trainer re-publishes a version it wrote before
        old = root / f".old-v{version}-{os.getpid()}"
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)


def sync_folder(path: str | Path) -> None:
    """fsync every file of a folder, then the folder itself: a version written with durable=False made crash-safe."""
    path = Path(path)
    for f in path.iterdir():
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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


TRASH_PREFIX = ".trash-v"  # a pruned version, renamed out of the listing, being deleted in the background


def prune_weights(root: str | Path, keep: int, protect: int | None = None) -> list[int]:
    """Remove all but the newest `keep` versions (and never `protect`, the one just published); returns the versions removed.

    Each is renamed out of the listing at once (`.trash-vN-...`) and deleted by a background thread, with any trash a
    crash left: unlinking the shards of a 0.5B-shape version (1.3 GB) took 0.4 s of a 2.5 s publish on this CPU."""
    root = Path(root)
    versions = list_versions(root)
    removed = []
    for v in versions[: max(len(versions) - keep, 0)]:
        if v == protect:
            continue
        try:
            os.rename(version_dir(root, v), root / f"{TRASH_PREFIX}{v}-{os.getpid()}-{time.monotonic_ns()}")
        except FileNotFoundError:  # pruned meanwhile by another writer of this folder
            continue
        removed.append(v)
    trash = [p for p in root.glob(f"{TRASH_PREFIX}*") if p.is_dir()]
    if trash:
        _trash_deleter().submit(_delete_all, trash)
    return removed


@functools.cache
def _trash_deleter() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="kuberl-prune")  # joined at exit: nothing left half-deleted


def _delete_all(paths: list[Path]) -> None:
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)


def wait_for_pruning() -> None:
    """Block until every pruned version handed to the background thread so far is deleted (tests, tools)."""
    _trash_deleter().submit(lambda: None).result()


def weight_files(path: str | Path) -> list[Path]:
    """The safetensors files of a version folder: model.safetensors, or the shards its index names (each checked present)."""
    path = Path(path)
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{index}: not a safetensors index ({exc})") from None
        files = [path / f for f in dict.fromkeys(weight_map.values())]
        if missing := [f.name for f in files if not f.is_file()]:
            raise FileNotFoundError(f"{index}: names shard(s) {', '.join(missing)}, which are not in {path}")
        return files
    file = path / WEIGHTS_FILE
    if not file.is_file():
        raise FileNotFoundError(f"{file}: no weights there (neither {WEIGHTS_FILE} nor {INDEX_FILE})")
    return [file]


def load_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of a `v{N}/` folder (or of any folder with model.safetensors or a sharded safetensors index)."""
    path = Path(path)
    files = weight_files(path)
    if len(files) == 1 and files[0].name == WEIGHTS_FILE:
        return load_file(str(files[0]))
    weight_map = json.loads((path / INDEX_FILE).read_text())["weight_map"]
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(str(f)))
    if missing := sorted(set(weight_map) - set(out)):
        raise ValueError(f"{path / INDEX_FILE}: {len(missing)} tensor(s) not in their shard, e.g. {missing[0]!r}")
    if extra := sorted(set(out) - set(weight_map)):
        raise ValueError(f"{path / INDEX_FILE}: shard tensors the index does not name, e.g. {extra[0]!r}")
    return out


def digest_state(state: dict[str, torch.Tensor]) -> str:
    """sha256 over a state dict's names and float32 bytes, in name order (to compare weights across ranks/files)."""
    h = hashlib.sha256()
    for name in sorted(state):
        h.update(name.encode())
        h.update(state[name].detach().to(torch.float32).contiguous().cpu().numpy().tobytes())
    return h.hexdigest()
