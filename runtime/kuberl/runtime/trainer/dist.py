"""torch.distributed plumbing of the trainer: process group, FSDP2 wrapping, broadcasts, state dicts (full and sharded).

Called by `Trainer`. Works with world size 1 (no torchrun: a one-process gloo group on a free port) as
well as under torchrun (RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT). gloo on CPU, NCCL on GPU,
HCCL on Ascend NPU (when torch_npu imports and sees an NPU: the runtime-npu image).
"""

from __future__ import annotations

import itertools
import logging
import os
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor

from kuberl.net import free_port

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"${name}: {raw!r} is not an integer (torchrun sets it)") from None


BACKENDS = {"npu": "hccl", "cuda": "nccl", "cpu": "gloo"}  # process-group backend per device type


def npu_available() -> bool:
    """True when torch_npu imports (it registers torch.npu) and sees at least one Ascend NPU."""
    try:
        import torch_npu  # noqa: F401
    except ImportError:
        return False
    npu = getattr(torch, "npu", None)
    return bool(npu is not None and npu.is_available())


def choose_device(requested: str | None, *, npu: bool, cuda: bool) -> tuple[str, str]:
    """(device type, process-group backend): `requested` if given, else npu/hccl, cuda/nccl, cpu/gloo, first available."""
    kind = requested or ("npu" if npu else "cuda" if cuda else "cpu")
    if kind not in BACKENDS:
        raise ValueError(f"device {kind!r}: expected one of {', '.join(BACKENDS)}")
    return kind, BACKENDS[kind]


def init_distributed(device: str | None = None) -> DistInfo:
    """Join (or create) the default process group from torchrun's environment; idempotent."""
    rank, world, local = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1), _env_int("LOCAL_RANK", 0)
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"$RANK={rank} and $WORLD_SIZE={world} do not describe a process group")
    kind, backend = choose_device(device, npu=device is None and npu_available(), cuda=device is None and torch.cuda.is_available())
    dev = torch.device(kind, local) if kind != "cpu" else torch.device("cpu")
    if kind != "cpu":
        getattr(torch, kind).set_device(dev)  # torch.cuda / torch.npu (torch_npu)
    if not dist.is_initialized():
        if world == 1 and "MASTER_ADDR" not in os.environ:
            # One process without torchrun: a private single-member group, so the same code paths run.
            init_method = f"tcp://127.0.0.1:{free_port()}"
            dist.init_process_group(backend, init_method=init_method, rank=0, world_size=1)
        else:
            dist.init_process_group(backend)
    return DistInfo(dist.get_rank(), dist.get_world_size(), local, dev)


def shards(info: DistInfo, param_dtype: torch.dtype | None = None) -> bool:
    """Whether shard_model wraps the model in FSDP2: more than one rank, or mixed precision."""
    return info.world_size > 1 or (param_dtype is not None and param_dtype != torch.float32)


def load_sharded(model_dir: str, info: DistInfo, param_dtype: torch.dtype | None, *, attention: str | None = None,
                 prepare: Any = None, wrap: Callable[[torch.nn.Module], torch.nn.Module] | None = None) -> torch.nn.Module:
    """The checkpoint at `model_dir` as an FSDP2 model, each rank holding only its shard, in float32 master weights.

    The model is built on the meta device on every rank, `prepare(model)` (context parallel's attention switch) and
    shard_model run on it, each rank allocates its shard on its device, and rank 0 alone reads the checkpoint (into
    host memory, once per node) and broadcasts it tensor by tensor into everyone's shards (torch's
    set_model_state_dict, broadcast_from_rank0); buffers (the rotary tables, not in the checkpoint) come from rank 0
    too. Loading the whole model on every rank, then on its GPU, then sharding took world_size copies of host memory
    and the whole model on each GPU before any was freed: out of memory well below the sizes FSDP trains.

    wrap: adapters (PEFT LoRA: `wrap(model)` returns the PeftModel, whose `get_base_model()` is what is sharded, the
    adapters inside its decoder layers with it). Every rank wraps its meta model under the meta device (the adapters
    take no memory and draw no random numbers there); rank 0 also wraps the loaded model first, drawing the adapters'
    initial values from the seed as an unsharded load does, and broadcasts them with the base weights, so every rank
    starts from the same adapters."""
    from transformers import AutoConfig, AutoModelForCausalLM

    full = None
    if info.is_main:  # its weights only (and the adapters' initial values)
        full = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        full = wrap(full) if wrap is not None else full
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=torch.float32,
                                                 attn_implementation=attention)
    if prepare is not None:
        prepare(model)
    if wrap is not None:
        with torch.device("meta"):
            model = wrap(model)
    shard_model(model.get_base_model() if wrap is not None else model, info, param_dtype)
    model.to_empty(device=info.device)
    set_model_state_dict(model, full.state_dict() if full is not None else {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    source = dict(full.named_buffers()) if full is not None else {}
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if full is not None:
                buf.copy_(source[name])
            dist.broadcast(buf, src=0)
    del full
    return model


def shard_model(model: torch.nn.Module, info: DistInfo, param_dtype: torch.dtype | None = None) -> torch.nn.Module:
    """FSDP2 (`fully_shard`) each decoder layer, then the root; mixed precision only where asked (GPU).

    One rank without mixed precision: the plain module. There is nothing to shard, and FSDP's hooks
    (unshard/reshard per layer, DTensor parameters) cost more than a tiny model's whole forward.
    """
    if not shards(info, param_dtype):
        return model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(info.device.type, (info.world_size,))
    kwargs: dict[str, Any] = {"mesh": mesh}
    if param_dtype is not None and param_dtype != torch.float32:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is not None:
        for layer in layers:
            fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def broadcast_object(obj: Any, info: DistInfo, src: int = 0) -> Any:
    """Rank `src`'s Python object on every rank (pickled; fine for a batch of token lists)."""
    if info.world_size == 1:
        return obj
    box = [obj if info.rank == src else None]
    dist.broadcast_object_list(box, src=src, device=info.device if info.device.type != "cpu" else None)
    return box[0]


class RankZeroError(RuntimeError):
    """What rank 0 raised in rank0_call, raised on every rank (so none waits in a collective for a rank that failed)."""


def rank0_call(fn: Any, info: DistInfo) -> Any:
    """fn() on rank 0, its result on every rank; if fn raises there, every rank raises RankZeroError with its message.

    For what only rank 0 reads (the checkpoint's trainer state, an older checkpoint's full state dict): a bare
    `broadcast_object(fn() if main else None)` leaves the other ranks blocked in the broadcast until the process
    group's timeout when fn raises on rank 0."""
    outcome: tuple[str, Any] | None = None
    if info.is_main:
        try:
            outcome = ("ok", fn())
        except Exception as exc:  # noqa: BLE001  re-raised below, on every rank
            if info.world_size == 1:
                raise
            outcome = ("error", f"{type(exc).__name__}: {exc}")
    kind, value = broadcast_object(outcome, info)
    if kind == "error":
        raise RankZeroError(f"rank 0: {value}")
    return value


def barrier(info: DistInfo) -> None:
    if info.world_size > 1:
        dist.barrier()


def all_reduce_rows(rows: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """Sum a CPU tensor over ranks (each row filled by exactly one rank, zeros elsewhere); as is on one rank."""
    if info.world_size == 1:
        return rows
    t = rows.to(info.device)
    dist.all_reduce(t)
    return t.cpu()


def all_reduce_sum(values: list[float], info: DistInfo) -> list[float]:
    if info.world_size == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=info.device)
    dist.all_reduce(t)
    return t.tolist()


_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def full_model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every rank must call; rank 0 gets the full CPU state dict, others an empty dict."""
    return get_model_state_dict(model, options=_FULL)


_ENTRIES: weakref.WeakKeyDictionary[torch.nn.Module, tuple[tuple, list]] = weakref.WeakKeyDictionary()


def model_state_entries(model: torch.nn.Module, *, cached: bool = False) -> list[tuple[str, torch.Tensor]]:
    """Every rank: the model's state dict entries as they are (DTensor shards under FSDP2), under full_model_state's names; no gather.

    cached: reuse the entries of an earlier call while the model holds the same tensors (the optimizer updates them
    in place): the trainer asks after every step, and working out the names costs ~1.5 ms of Python each time.
    """
    if not cached:
        return list(get_model_state_dict(model, options=StateDictOptions()).items())
    key = tuple((id(t), (t.to_local() if isinstance(t, DTensor) else t).data_ptr()) for t in itertools.chain(model.parameters(), model.buffers()))
    hit = _ENTRIES.get(model)
    if hit is None or hit[0] != key:
        hit = _ENTRIES[model] = (key, model_state_entries(model))
    return hit[1]


def iter_full_tensors(entries: list[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Collective (every rank, same `entries`): each entry's full tensor, one at a time (`full_tensor()` of a DTensor).

    A rank holds one full tensor beside its shards while the caller keeps it; tied entries are gathered under each name.
    """
    for name, t in entries:
        yield name, (t.full_tensor() if isinstance(t, DTensor) else t)


def full_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Every rank must call; rank 0 gets the full CPU optimizer state."""
    return get_optimizer_state_dict(model, optimizer, options=_FULL)


def load_full_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, model_sd: dict[str, Any], optim_sd: dict[str, Any] | None
) -> None:
    """Load full state dicts held by rank 0 into the sharded model (and optimizer) on every rank."""
    opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, cpu_offload=False)
    set_model_state_dict(model, model_sd, options=opts)
    if optimizer is not None and optim_sd is not None:
        set_optimizer_state_dict(model, optimizer, optim_sd, options=opts)


# Checkpoints hold what training changes: with algorithm.lora the adapters (and their optimizer state), never
# the frozen base, which a restarted trainer loads from spec.model again. Without frozen parameters (full
# fine-tuning) this is the whole model. Loading is non-strict only for the frozen keys this leaves out.
_TRAINED_ONLY = StateDictOptions(ignore_frozen_params=True, strict=False)


def save_sharded_state(folder: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Every rank must call: each writes its own shards of the model and optimizer state into `folder` (DCP).

    No rank ever holds the whole model or optimizer. Keys are parameter names (`model.layers.0...`), not
    shard positions, so `load_sharded_state` can read the folder back at any world size. DCP fsyncs each
    shard file, and rank 0 writes the `.metadata` index only after every rank reported its writes.
    """
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_TRAINED_ONLY)
    dcp.save({"model": model_sd, "optimizer": optim_sd}, storage_writer=dcp.FileSystemWriter(str(folder), sync_files=True))


def checkpoint_group() -> dist.ProcessGroup:
    """Collective (every rank, once, at set-up): a gloo group of every rank for checkpoints written in the background.

    DCP's `async_save` runs its collectives (the save plan, the report of each rank's writes) in a thread while the main
    thread trains; on training's own group the two threads' collectives could be matched in a different order on each rank.
    """
    return dist.new_group(backend="gloo")


def async_save_sharded_state(folder: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                             group: dist.ProcessGroup) -> Future:
    """`save_sharded_state` behind training: returns once this rank's state is copied to host memory (new tensors: the
    next steps may change the model at once); a background thread writes the copy. The Future is done when every rank's
    shards and rank 0's `.metadata` are written, and its result() raises what the write raised. Every rank must call."""
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_TRAINED_ONLY)
    writer = dcp.FileSystemWriter(str(folder), sync_files=True)  # its stage(): a fresh host copy (no cache kept between saves)
    return dcp.async_save({"model": model_sd, "optimizer": optim_sd}, storage_writer=writer, process_group=group)


def load_sharded_state(folder: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Every rank must call: the model and optimizer state saved by `save_sharded_state` into this rank's shards.

    DCP reshards: the folder may have been written by any number of ranks (1 -> 2, 2 -> 1, ...).
    """
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_TRAINED_ONLY)  # the target layout; initialises empty optimizer state
    state = {"model": model_sd, "optimizer": optim_sd}
    dcp.load(state, storage_reader=dcp.FileSystemReader(str(folder)))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"], options=_TRAINED_ONLY)


def shutdown(*, synchronize: bool = False) -> None:
    """Tear the process group down. `synchronize` (a clean end, every rank gets here): wait for every rank first,
    so no rank tears the group down while rank 0 still works (the last evaluation and report come after the
    others are done). Never after a failure: a peer that died would leave the barrier waiting. (The SIGABRT seen
    at the exit of 2-rank runs is torch's interpreter teardown, not this: trainer.main.exit_now.)"""
    if dist.is_initialized():
        if synchronize and dist.get_world_size() > 1:
            try:
                dist.barrier()
            except Exception as exc:  # noqa: BLE001 - the group is going away anyway; say why it could not wait
                log.warning("ranks could not meet before shutdown: %s", exc)
        dist.destroy_process_group()
