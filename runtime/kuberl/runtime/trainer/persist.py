"""Trainer state out and back in: resume from `latest`, publish weights, checkpoint, ack the groups a checkpoint covers.

A mixin of `Trainer` (runtime/kuberl/runtime/trainer/trainer.py), which owns the state these methods read and set.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from kuberl.runtime.resources import host_memory_free
from kuberl.runtime.trainer import checkpoint as ck
from kuberl.runtime.trainer import dist as D
from kuberl.runtime.trainer.async_checkpoint import PendingCheckpoint, choose_async_save, state_bytes
from kuberl.runtime.trainer.megatron.backend import read_layout
from kuberl.runtime.trainer.weights import adapter_state, digest_state, export_adapter, export_model_weights, sync_folder, version_dir

log = logging.getLogger("kuberl.trainer")


class FullTensors(Mapping):
    """A state dict's names -> each full tensor, gathered only when read (DTensor.full_tensor: a collective that every
    rank makes in the same name order). Read one entry at a time, the extra memory is one parameter, not the model."""

    def __init__(self, state: dict[str, torch.Tensor]):
        self.state = state

    def __getitem__(self, name: str) -> torch.Tensor:
        t = self.state[name]
        return t.full_tensor() if hasattr(t, "full_tensor") else t

    def __iter__(self) -> Iterator[str]:
        return iter(self.state)

    def __len__(self) -> int:
        return len(self.state)


def full_weights_digest(model: torch.nn.Module) -> str:
    """Collective: weights.digest_state of the model's full weights without holding them: digest_state reads them in
    name order, one at a time, so each rank gathers one parameter, hashes it and drops it. Gathering the whole state
    instead (every rank, on its accelerator) runs out of memory from ~14B parameters, after the last checkpoint."""
    return digest_state(FullTensors(model.state_dict()))


def _begin_state(info: D.DistInfo, root: Path, step: int, scheduler: torch.optim.lr_scheduler.LRScheduler) -> Path:
    """Collective: `.tmp-step-N/` begun, with each rank's RNG state and rank 0's schedule in it; returns the folder."""
    if info.is_main:
        ck.begin_checkpoint(root, step)
    D.barrier(info)
    tmp = ck.tmp_checkpoint_path(root, step)
    ck.write_torch(tmp, f"rng-rank{info.rank}.pt", ck.capture_rng_state())
    if info.is_main:
        ck.write_torch(tmp, "scheduler.pt", scheduler.state_dict())
    return tmp


def write_state(info: D.DistInfo, root: Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                scheduler: torch.optim.lr_scheduler.LRScheduler) -> Path:
    """Collective: the tensors of a checkpoint into `.tmp-step-N/` (not committed: `ck.commit_checkpoint` does that).

    Every rank writes its own model and optimizer shards (DCP) and its RNG state; rank 0 the schedule.
    Returns once every rank has finished writing (barrier), so rank 0 may commit.
    """
    tmp = _begin_state(info, root, step, scheduler)
    D.save_sharded_state(tmp, model, optimizer)
    D.barrier(info)
    return tmp


def write_state_async(info: D.DistInfo, root: Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                      scheduler: torch.optim.lr_scheduler.LRScheduler, group: Any) -> Any:
    """Collective: `write_state` with the model and optimizer shards written behind training (DCP async_save on `group`).

    RNG state and schedule are written before it returns, the shards from a host copy taken before it returns; the
    returned Future is done when every rank's shards are written (then rank 0 may commit)."""
    return D.async_save_sharded_state(_begin_state(info, root, step, scheduler), model, optimizer, group)


def read_state(info: D.DistInfo, path: Path, sharded: bool, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Collective: model and optimizer state of checkpoint `path` into this rank's shards, at any world size.

    `sharded` (rank 0's `ck.is_sharded`, the same on every rank): DCP shards, which every rank reads and
    reshards; else the full model.pt / optimizer.pt of an earlier version, which rank 0 reads and scatters.
    """
    if sharded:
        D.load_sharded_state(path, model, optimizer)
        return
    full: dict[str, Any] = {"model": {}, "optim": {}}

    def read_full() -> None:  # rank 0 only; what it cannot read fails every rank (D.rank0_call), not a hang in the scatter
        full["model"], full["optim"] = ck.read_torch(path, ck.MODEL_FILE), ck.read_torch(path, ck.OPTIMIZER_FILE)

    D.rank0_call(read_full, info)
    D.load_full_state(model, optimizer, full["model"], full["optim"])


class PersistMixin:
    """Resume, train.publish_weights and train.checkpoint (collectives: every rank calls them)."""

    def _resume(self) -> Path | None:
        main = self.info.is_main
        # Rank 0 reads and decides; the other ranks get the same answer (they may not see the same files),
        # or the same error when rank 0 cannot read the checkpoint (rather than waiting in the broadcast).
        def read_latest() -> tuple | None:
            if (latest := ck.latest_checkpoint(self.ckpt_root)) is None:
                return None
            # The format: megatron's layout (None for an FSDP checkpoint), or whether FSDP's is sharded.
            fmt = read_layout(latest.path) if self.megatron else ck.is_sharded(latest.path)
            return (latest.path, ck.load_trainer_state(latest.path), ck.read_torch(latest.path, "scheduler.pt"), fmt)

        found = D.rank0_call(read_latest, self.info)
        if found is None:
            return None
        path, state, sched, fmt = found
        if self.megatron:
            self.megatron_read_state(Path(path), fmt)
        else:
            read_state(self.info, Path(path), fmt, self.model, self.optimizer)
        self.scheduler.load_state_dict(sched)
        rng = Path(path) / f"rng-rank{self.info.rank}.pt"
        if rng.is_file():  # absent when the world size grew since the checkpoint
            ck.restore_rng_state(ck.read_torch(path, rng.name))
        self.step, self.version = int(state["step"]), int(state["version"])
        self.dropped_stale = int(state.get("dropped_stale", 0))
        self.over_stale = int(state.get("over_stale", 0))  # absent in checkpoints from before the count
        self.failed_groups = int(state.get("failed_groups", 0))  # absent in checkpoints from before the count
        self.answered_request = state.get("answered_request")
        self.book.load_state(state["tickets"])
        self.last_checkpoint = state.get("checkpoint")
        self.checkpoint_row = state.get("metrics_row")  # absent in checkpoints from before it was kept
        if main:
            log.info("resumed from %s: step %d, policy version %d", path, self.step, self.version)
        return Path(path)

    async def stage_publish_weights(self) -> None:
        """train.publish_weights: the weights (algorithm.lora: the adapter) -> weights/v{N} (disk) or the object store (bus); KV weights, policy_version.
        disk/bus: gathered one tensor at a time and written by rank 0 in shards of weightSync.bucketMB, never the whole model on one rank.
        broadcast: bucket by bucket to the engines over a group of their own (kuberl.runtime.weight_sync), no full state dict."""
        if self.spec.weight_sync.mode == "broadcast":
            from kuberl.runtime.weight_sync.sender import publish_broadcast

            await publish_broadcast(self, new_version=True)
            return
        from kuberl.runtime.inference.main import engine_dtype  # the engine's compute dtype (float32 on CPU)

        dtype = getattr(torch, engine_dtype(self.spec))
        if self.spec.algorithm.lora is not None:
            state = adapter_state(self.model)  # collective: every rank takes part; the adapters alone are small
            if not self.info.is_main:
                return
            path = export_adapter(state, self.model.peft_config["default"], self.weights_root, self.version, dtype=dtype, keep=3)
        else:
            stats: dict = {}
            if self.megatron:  # one parameter at a time: TP all-gather, later pipeline stages send to rank 0
                path = self.megatron_export_weights(dtype, stats)
            else:
                path = export_model_weights(self.model, self.info, self.weights_root, self.version, shard_bytes=self.spec.weight_sync.bucket_mb << 20,
                                            source_dir=self.model_dir, dtype=dtype, keep=3, stats=stats,  # collective: every rank gathers
                                            durable=False)  # no fsync each step: a version lost to a node crash is published again on resume
            if path is None:
                return
            log.debug("weights v%d: %.1f MB in %d shard(s), at most %.1f MB held", self.version, stats["total_bytes"] / 1e6, stats["shards"],
                      stats["peak_bytes"] / 1e6)
        await self.bus.publish_weights(self.version, path, mode=self.spec.weight_sync.mode)

    def setup_checkpoints(self) -> None:
        """Collective, at set-up: whether periodic checkpoints are written behind training (checkpoint.asyncSave; every rank
        must take the same path, so one rank without host memory for the copy keeps them all synchronous) and, if so,
        the gloo group their writes use."""
        backend = self.spec.trainer.backend
        need = state_bytes(self.model, self.optimizer) if backend == "fsdp" else 0
        wanted, why = choose_async_save(self.spec.checkpoint.async_save, backend=backend, device_type=self.info.device.type,
                                        need=need, free=host_memory_free())
        agreed = D.all_reduce_sum([1.0 if wanted else 0.0], self.info)[0] == self.info.world_size
        if wanted and not agreed:
            why = "checkpoint.asyncSave auto: another rank has no host memory for its copy; checkpoints are written synchronously"
        if agreed:
            self.checkpoint_group = D.checkpoint_group()
        if self.info.is_main:
            log.info("checkpoints %s (%s)", "written behind training" if agreed else "written synchronously", why)

    async def stage_checkpoint(self, *, request: str | None = None, row: dict[str, Any] | None = None, background: bool = False) -> None:
        """train.checkpoint: model and optimizer shards, schedule, RNG, ticket book and this step's metrics row (rank 0's
        `row`, ReportMixin.step_row); then ack the groups it covers.

        background (the periodic checkpoints, with asyncSave): return once the state is copied; `finish_checkpoint`
        commits it and acks its groups when the write is done. The last checkpoint and the operator's are synchronous."""
        await self.finish_checkpoint()  # one in flight at most; it may be this very step's
        saved = request is None and bool(self.last_checkpoint) and self.last_checkpoint.get("step") == self.step and self._saved(self.step)
        if D.broadcast_object(saved, self.info):  # rank 0 decides: every rank must take the same path
            if self.info.is_main:
                await self._ack_held()
            return  # this step is saved already (e.g. the end right after a periodic checkpoint)
        if request is not None:
            self.answered_request = request
        if background and self.checkpoint_group is not None:
            future = write_state_async(self.info, self.ckpt_root, self.step, self.model, self.optimizer, self.scheduler, self.checkpoint_group)
            pending = PendingCheckpoint(self.step, future)
            if self.info.is_main:  # the state and the groups as of this step: later steps go on changing both
                pending.state, pending.held, self.held = self._checkpoint_state(row), self.held, []
            self.pending_checkpoint = pending
            return
        if self.megatron:
            self.megatron_write_state(self.ckpt_root, self.step)
        else:
            write_state(self.info, self.ckpt_root, self.step, self.model, self.optimizer, self.scheduler)
        if self.info.is_main:  # every rank has written its shards (write_state ends on a barrier)
            held, self.held = self.held, []
            await self._commit(self.step, self._checkpoint_state(row), held)
        D.barrier(self.info)

    async def finish_checkpoint(self, *, wait: bool = True) -> None:
        """The checkpoint written in the background, once its write is done: committed and its groups acked (rank 0).
        wait=False (between steps): only if the write is done already. Raises what the write raised."""
        pending = self.pending_checkpoint
        if pending is None or not (wait or pending.future.done()):
            return
        await asyncio.wrap_future(pending.future)  # the bus's client keeps running meanwhile
        self.pending_checkpoint = None
        if self.info.is_main:  # rank 0's future is done only after every rank reported its writes (DCP's coordinator)
            log.info("checkpoint step %d: written behind training, committed %.1f s after it was taken", pending.step, time.monotonic() - pending.started)
            await self._commit(pending.step, pending.state, pending.held)

    def _checkpoint_state(self, row: dict[str, Any] | None) -> dict[str, Any]:
        """Rank 0: trainer_state.json of a checkpoint of this step (the ticket book, counters, this step's metrics row)."""
        info = {"step": self.step, "policy_version": self.version, "path": str(self.ckpt_root / ck.checkpoint_name(self.step)), "time": time.time()}
        return {"version": self.version, "dropped_stale": self.dropped_stale, "over_stale": self.over_stale, "failed_groups": self.failed_groups,
                "tickets": self.book.state(),
                "answered_request": self.answered_request, "total_steps": self.total_steps, "checkpoint": info,
                "world_size": self.info.world_size, "experiment": self.exp.name, "metrics_row": row}

    async def _commit(self, step: int, state: dict[str, Any], held: list[Any]) -> None:
        """Rank 0, once every rank's shards of `step` are written: commit, then ack the groups it covers."""
        info = state["checkpoint"]
        ck.commit_checkpoint(self.ckpt_root, step, state, keep=self.spec.checkpoint.keep)
        self.last_checkpoint = info
        log.info("checkpoint step %d (policy version %d) in %s", step, info["policy_version"], info["path"])
        if self.bus is not None:
            if held:
                await self.bus.ack(held)
            await self.bus.put_progress(self._progress_base())

    def sync_final_weights(self) -> None:
        """fsync the last published version (published without, each step): it is the run's trained model."""
        path = version_dir(self.weights_root, self.version)
        if self.info.is_main and path.is_dir():
            sync_folder(path)

    def final_digest(self) -> str:
        """Collective: sha256 of the trained weights (weights.digest_state's bytes), which every rank logs at the end of a run
        for the cross-check that the ranks agree. Both backends gather one parameter at a time (full_weights_digest;
        megatron/digest.py)."""
        if self.megatron:
            return self.megatron_digest()
        return full_weights_digest(self.model)

    def _saved(self, step: int) -> bool:
        return (self.ckpt_root / ck.checkpoint_name(step) / ck.STATE_FILE).is_file()

    async def _ack_held(self) -> None:
        if self.bus is not None and self.held:
            await self.bus.ack(self.held)
            self.held = []
