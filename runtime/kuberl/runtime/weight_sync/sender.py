"""The trainer's side of `weightSync.mode: broadcast` (protocol and membership: broadcast.py's docstring).

`BroadcastSender.serve` is a collective of the trainer's ranks: rank 0 owns the TCPStore, picks the members, and
sends; with FSDP every rank takes part in each parameter's `full_tensor()` (one parameter at a time), so no rank
ever holds more than one bucket of full parameters beside its shards.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import uuid
from typing import Any

import torch
import torch.distributed as dist

from kuberl.runtime.weight_sync import broadcast as B

log = logging.getLogger(__name__)

HOST_ENV = "KUBERL_WEIGHT_SYNC_HOST"  # the address engines reach the trainer at (the operator sets rank 0's pod DNS name)
PORT_ENV = "KUBERL_WEIGHT_SYNC_PORT"  # overrides weightSync.port; unset without HOST_ENV: a free port on 127.0.0.1 (`kuberl run`)
JOIN_GRACE_S = 0.5  # an update with no usual members waits this long for requests (later ones resync while the trainer waits for groups)
_WRAPPERS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def clean_name(name: str) -> str:
    """A parameter's Hugging Face name (activation-checkpoint / compile wrappers dropped)."""
    for w in _WRAPPERS:
        name = name.replace(w, "")
    return name


def model_parameters(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Parameters in a fixed order, tied ones once (under the first name: embed_tokens for a tied head, as vLLM loads it)."""
    return [(clean_name(n), p) for n, p in model.named_parameters(remove_duplicate=True)]


class BroadcastSender:
    """One per trainer process; rank 0 holds the store the engines connect to."""

    def __init__(self, *, rank: int, world_size: int, bucket_mb: int, join_timeout_s: float, timeout_s: float, backend: str,
                 port: int = 0, host: str | None = None) -> None:
        if backend not in B.BACKENDS:
            raise ValueError(f"weight broadcast backend {backend!r}: expected one of {', '.join(B.BACKENDS)}")
        self.rank, self.world_size = rank, world_size
        self.bucket_bytes = int(bucket_mb) * 1024 * 1024
        self.join_timeout_s, self.timeout_s, self.backend = float(join_timeout_s), float(timeout_s), backend
        self.host = host or os.environ.get(HOST_ENV) or "127.0.0.1"
        env_port = os.environ.get(PORT_ENV)
        self.bind_port = int(env_port) if env_port else (port if os.environ.get(HOST_ENV) else 0)
        self.session = uuid.uuid4().hex[:12]
        self.store: Any = None
        self.served = 0  # requests answered so far (req/1..served)
        self.usual: set[str] = set()  # agents served by the last update that went through: waited for at the next one
        self.updates = 0
        self.last: dict[str, Any] = {}

    @classmethod
    def from_spec(cls, spec: Any, rank: int, world_size: int, device: torch.device) -> BroadcastSender:
        ws = spec.weight_sync
        return cls(rank=rank, world_size=world_size, bucket_mb=ws.bucket_mb, join_timeout_s=ws.join_timeout_seconds,
                   timeout_s=ws.timeout_seconds, backend="nccl" if device.type == "cuda" else "gloo", port=ws.port)

    def start(self) -> None:
        if self.rank != 0 or self.store is not None:
            return
        import datetime

        self.store = dist.TCPStore("0.0.0.0", self.bind_port, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=self.timeout_s))
        self.store.add(B.REQ_COUNT, 0)
        log.info("weight broadcast: engines connect to %s:%d (%s, buckets of %d MiB)", self.host, self.store.port, self.backend,
                 self.bucket_bytes >> 20)

    def record(self) -> dict[str, Any]:
        """What the `weights` record carries besides version and mode."""
        return {"rendezvous": f"{self.host}:{self.store.port}", "session": self.session, "backend": self.backend}

    def pending(self) -> bool:
        """Rank 0: has an engine asked for weights since the last update?"""
        return self.store is not None and int(self.store.add(B.REQ_COUNT, 0)) > self.served

    def _requests(self, upto: int) -> list[tuple[int, dict[str, Any]]]:
        out = []
        for i in range(self.served + 1, upto + 1):
            try:
                req = json.loads(self.store.get(B.req_key(i)))
                out.append((i, {"agent": str(req["agent"]), "workers": max(1, int(req.get("workers", 1)))}))
            except Exception as exc:  # noqa: BLE001  a request half written by an agent that died: skip it
                log.warning("weight broadcast: request %d unreadable (%s); skipped", i, exc)
        return out

    def _members(self, wait_usual: bool) -> list[tuple[int, dict[str, Any]]]:
        """Rank 0: close the join window and return the requests this update serves."""
        deadline = time.monotonic() + (0.0 if not wait_usual else self.join_timeout_s if self.usual else JOIN_GRACE_S)
        while True:
            count = int(self.store.add(B.REQ_COUNT, 0))
            reqs = self._requests(count)
            asked = {r["agent"] for _, r in reqs}
            if (self.usual and self.usual <= asked) or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        if wait_usual and (missing := self.usual - asked):
            log.warning("weight broadcast: %s did not ask within %.0fs; they get the weights when they do", sorted(missing), self.join_timeout_s)
        self.served = count
        return reqs

    def serve(self, model: torch.nn.Module, version: int, dtype: torch.dtype | None, *, new_version: bool, info: Any) -> dict[str, Any]:
        """Collective (every trainer rank): send `model`'s parameters to the engines that asked; returns stats (rank 0)."""
        from kuberl.runtime.trainer import dist as D

        params = model_parameters(model)
        entries = B.entries_for(params, dtype)
        buckets = B.plan_buckets(entries, self.bucket_bytes)
        members: list[tuple[int, dict[str, Any]]] = []
        update = f"{self.session}-u{self.updates + 1}"
        world = 1
        if self.rank == 0:
            members = self._members(wait_usual=new_version)
            world = 1 + sum(r["workers"] for _, r in members)
        go = D.broadcast_object(bool(members), info)
        if not go:
            return {"members": 0}
        self.updates += 1
        started = time.monotonic()
        pg = None
        failed: str | None = None
        if self.rank == 0:
            self.store.set(B.manifest_key(update), B.manifest_json(buckets))
            rendezvous = B.rendezvous_timeout(self.join_timeout_s, self.timeout_s)
            rank = 1
            for i, req in members:
                self.store.set(B.assign_key(i), json.dumps({
                    "update": update, "rank": rank, "world": world, "version": version, "backend": self.backend,
                    "timeout": self.timeout_s, "rendezvous_timeout": rendezvous, "rendezvous": f"{self.host}:{self.store.port}"}))
                rank += req["workers"]
            try:
                pg = B.new_group(self.store, update, 0, world, self.backend, rendezvous)
            except Exception as exc:  # noqa: BLE001  a member that never joined: skip the update, go on
                failed = f"group: {exc}"
        device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")
        sent = 0
        it = iter(params)
        for bucket in buckets:
            tensors = []
            for _entry in bucket:
                _, p = next(it)
                full = p.full_tensor() if hasattr(p, "full_tensor") else p  # collective under FSDP: every rank, in order
                tensors.append(full.detach())
            if self.rank != 0 or failed is not None:
                continue
            try:
                buf = B.pack(bucket, tensors, device=device)
                B.broadcast(pg, buf, self.timeout_s)
                sent += buf.numel()
            except Exception as exc:  # noqa: BLE001  a receiver died or timed out: the others resync on their own
                failed = f"bucket {buckets.index(bucket) + 1}/{len(buckets)}: {exc}"
            del tensors
        if self.rank != 0:
            return {}
        del pg
        seconds = time.monotonic() - started
        agents = [r["agent"] for _, r in members]
        self.usual = set() if failed else set(agents)
        self.last = {"members": len(members), "agents": agents, "buckets": len(buckets), "bytes": sent, "seconds": round(seconds, 3),
                     "version": version, "failed": failed}
        if failed:
            log.warning("weight broadcast v%d to %s failed (%s) after %.2fs; the engines ask again", version, agents, failed, seconds)
        else:
            log.info("weight broadcast v%d: %.1f MB in %d buckets to %d engines (%s) in %.2fs", version, sent / 1e6, len(buckets),
                     len(members), ", ".join(agents), seconds)
        return self.last


async def publish_broadcast(trainer: Any, *, new_version: bool) -> dict[str, Any]:
    """train.publish_weights in broadcast mode (every rank calls): announce version `trainer.version` on the bus (rank 0,
    only for a new version) and serve the engines that asked. `new_version` False: a resync of the current version
    for engines that asked while the trainer waited for groups (trainer/collect.py)."""
    from kuberl.runtime.inference.main import engine_dtype  # the engine's compute dtype (float32 on CPU)

    info = trainer.info
    sender = getattr(trainer, "weight_sender", None)
    if sender is None:
        sender = trainer.weight_sender = BroadcastSender.from_spec(trainer.spec, info.rank, info.world_size, info.device)
        sender.start()
    if new_version and info.is_main:
        await trainer.bus.publish_weights(trainer.version, None, mode="broadcast", record=sender.record())
    # In a thread: the join window and the collectives block, and the trainer's bus connection must stay served meanwhile.
    dtype = getattr(torch, engine_dtype(trainer.spec))
    return await asyncio.to_thread(sender.serve, trainer.model, trainer.version, dtype, new_version=new_version, info=info)
