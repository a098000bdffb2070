"""Checkpoints written behind training (checkpoint.asyncSave): the choice, and the checkpoint in flight.

A synchronous checkpoint stops every rank until its shards are on disk: on one H200 a 0.5B model's checkpoint (weights
and AdamW state, ~6 GB) took 7.6-10.5 s against a 0.2-1.1 s step. With asyncSave each rank copies its state to host
memory (DCP's `async_save`), training goes on, and a background thread writes the copy. Rank 0 commits the checkpoint
(trainer_state.json, rename, `latest`) and only then acknowledges the trajectory groups it covers, so a crash while it
is written loses nothing: the checkpoint before it stands and its groups are redelivered.

The writes' collectives (DCP's plan and its report of the writes) run on a gloo group of their own (`dist.checkpoint_group`),
never on training's group: two threads issuing collectives on one group may interleave them differently on each rank.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

# The host copy is as large as the state; keep this much more free for everything else the process allocates meanwhile.
HEADROOM = 1.25


@dataclass
class PendingCheckpoint:
    """A checkpoint whose shards are being written: committed (rank 0) once `future` is done."""

    step: int
    future: Future
    started: float = field(default_factory=time.monotonic)
    state: dict[str, Any] | None = None  # rank 0: trainer_state.json as of the step it was taken at
    held: list[Any] = field(default_factory=list)  # rank 0: the groups it covers, acknowledged at the commit


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> int:
    """Bytes of this rank's share of what a checkpoint holds: its trained parameters' local shards and the optimizer
    state of them (without a step yet, AdamW's two moments are counted as if there: the host copy must fit later)."""
    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    params = [p for p in model.parameters() if p.requires_grad]
    total = sum(local(p).numel() * local(p).element_size() for p in params)
    state = getattr(optimizer, "state", None) or {}
    held = sum(local(v).numel() * local(v).element_size() for s in state.values() for v in s.values() if isinstance(v, torch.Tensor))
    if not held:
        held = 2 * sum(local(p).numel() * 4 for p in params)  # exp_avg and exp_avg_sq, float32
    return total + held


def choose_async_save(setting: str, *, backend: str, device_type: str, need: int, free: int | None) -> tuple[bool, str]:
    """(write checkpoints in the background?, why), for checkpoint.asyncSave `setting` on this rank.

    auto: on for trainer.backend fsdp on NVIDIA GPUs (a synchronous write stops training for seconds there) when the host
    copy of this rank's state (`need` bytes, with headroom) fits in `free`; off on CPU, where the write would take the
    cores training runs on, and for megatron, which writes its own format.
    """
    if setting == "off":
        return False, "checkpoint.asyncSave off"
    if backend != "fsdp":  # admission refuses asyncSave on with megatron
        return False, f"trainer.backend {backend} writes its checkpoints synchronously"
    if setting == "on":
        return True, "checkpoint.asyncSave on"
    if device_type != "cuda":
        return False, f"checkpoint.asyncSave auto: synchronous on {device_type}"
    if free is not None and need * HEADROOM > free:
        return False, (f"checkpoint.asyncSave auto: the host copy of this rank's state ({need / 2**30:.1f} GiB) would not fit "
                       f"in the {free / 2**30:.1f} GiB of host memory left; checkpoints are written synchronously")
    return True, f"checkpoint.asyncSave auto: {need / 2**30:.1f} GiB of state a rank, copied to host memory for each write"
