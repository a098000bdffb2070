"""Weight sync by broadcast (`weightSync.mode: broadcast`): the wire protocol, the engine worker's receiver, the agent's request.

The trainer (rank 0, sender.py) streams the parameters bucket by bucket with `broadcast` over a torch.distributed
process group of its own: NCCL on GPU, gloo on CPU. The group is built from the trainer's TCPStore and a
`ProcessGroupGloo` / `ProcessGroupNCCL` object, never `init_process_group`, so the trainer's default group (FSDP,
torchrun) is untouched, and each vLLM worker joins through the `kuberl_receive_weights` worker extension method
(vllm_worker.py), called by the agent over /collective_rpc while its engine is paused. No tensor goes through the
shared volume or the bus; the bus only carries the `weights` record (version, rendezvous address, session).

Membership (elastic engines): one group per update, with exactly the engines that asked for it.
- An agent that wants weights (a new `weights` record, a fresh or restarted engine, a failed receive) files a
  request in the trainer's store (`req/count`, `req/{i}` = its id and worker count) and waits for its
  assignment `req/{i}/assign` = {update, rank, world, version, ...}. It pauses its engine only then.
- The trainer serves the pending requests (a) when it publishes a new version: it waits up to
  weightSync.joinTimeoutSeconds for the engines that took part in the previous update (the usual members), and
  (b) whenever it waits for trajectory groups (trainer/collect.py: a pending request turns the wait into a resync
  of the current version). So an engine that starts later or restarts gets the current weights within about a
  second of asking, if the trainer is waiting for groups, or at the end of the step it is computing.
- A member that does not join, or dies mid-broadcast, fails the update: building the group waits at most
  joinTimeoutSeconds + 30 s (`rendezvous_timeout`; an engine killed between its assignment and the receive), every
  bucket's collective at most weightSync.timeoutSeconds; the trainer logs it and goes on, rank 0 keeps stepping through the
  parameters so the other FSDP ranks' collectives still match. An engine whose receive failed may hold a mix
  of versions: its agent keeps it paused and asks again until a receive completes (next resync, about a second).
- A restarted trainer has a new session (a nonce in the record): agents waiting on the old one ask again.

Buckets: parameters in the trainer's order, packed (16-byte aligned) into uint8 buffers of about
weightSync.bucketMB; a parameter bigger than that goes alone. The manifest (names, shapes, dtypes per bucket)
is in the store, so a receiver knows every bucket's size before it arrives. Imported in vLLM's worker:
torch only.
"""

from __future__ import annotations

import datetime
import json
import logging
import socket
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

ALIGN = 16  # byte alignment of every tensor in a bucket (so the receiver can view any dtype in place)
REQ_COUNT = "req/count"
BACKENDS = ("gloo", "nccl")
REFUSED_GRACE_S = 2.0  # how long a refused store connection is retried before the store is taken for gone
PAUSE_GRACE_S = 30.0  # beyond the join window, what building a group allows members to pause their engine and call the worker


def req_key(i: int) -> str:
    return f"req/{i}"


def assign_key(i: int) -> str:
    return f"req/{i}/assign"


def manifest_key(update: str) -> str:
    return f"{update}/manifest"


@dataclass(frozen=True)
class Entry:
    """One tensor of an update: its name, shape and dtype as the engine receives it."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # torch dtype name without "torch." (float32, bfloat16, ...)

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=dtype_of(self.dtype)).element_size()


def dtype_of(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"weight broadcast manifest: {name!r} is not a torch dtype")
    return dt


def dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def plan_buckets(entries: list[Entry], bucket_bytes: int) -> list[list[Entry]]:
    """Consecutive entries grouped into buckets of at most `bucket_bytes` (aligned sizes); a bigger entry goes alone."""
    if bucket_bytes < 1:
        raise ValueError(f"weightSync.bucketMB: bucket size must be positive, got {bucket_bytes} bytes")
    buckets: list[list[Entry]] = []
    cur: list[Entry] = []
    size = 0
    for e in entries:
        n = _aligned(e.nbytes)
        if cur and size + n > bucket_bytes:
            buckets.append(cur)
            cur, size = [], 0
        cur.append(e)
        size += n
    if cur:
        buckets.append(cur)
    return buckets


def bucket_size(bucket: list[Entry]) -> int:
    return sum(_aligned(e.nbytes) for e in bucket)


def manifest_json(buckets: list[list[Entry]]) -> str:
    return json.dumps([[[e.name, list(e.shape), e.dtype] for e in b] for b in buckets])


def parse_manifest(text: str | bytes) -> list[list[Entry]]:
    try:
        raw = json.loads(text)
        return [[Entry(str(n), tuple(int(d) for d in s), str(dt)) for n, s, dt in b] for b in raw]
    except (ValueError, TypeError) as exc:
        raise ValueError(f"weight broadcast manifest is malformed: {exc}") from exc


def pack(bucket: list[Entry], tensors: list[torch.Tensor], device: torch.device | str = "cpu") -> torch.Tensor:
    """One uint8 buffer holding `tensors` (cast to each entry's dtype) at aligned offsets."""
    if len(bucket) != len(tensors):
        raise ValueError(f"bucket of {len(bucket)} entries got {len(tensors)} tensors")
    buf = torch.empty(bucket_size(bucket), dtype=torch.uint8, device=device)
    off = 0
    for e, t in zip(bucket, tensors, strict=True):
        if tuple(t.shape) != e.shape:
            raise ValueError(f"{e.name}: shape {tuple(t.shape)} differs from the manifest's {e.shape}")
        flat = t.detach().to(device=device, dtype=dtype_of(e.dtype)).contiguous().reshape(-1).view(torch.uint8)
        buf[off: off + e.nbytes].copy_(flat)
        off += _aligned(e.nbytes)
    return buf


def unpack(bucket: list[Entry], buf: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) views into `buf` (no copy)."""
    out = []
    off = 0
    for e in bucket:
        out.append((e.name, buf[off: off + e.nbytes].view(dtype_of(e.dtype)).view(e.shape)))
        off += _aligned(e.nbytes)
    return out


def connect_store(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    """A client of the trainer's TCPStore.

    A store that refuses connections is gone (the trainer starts it before it announces it): ConnectionError at once,
    where torch's client would retry its connect for the whole `timeout_s` (seen: an engine blocked 40 s on the store of
    a killed trainer while its restarted successor waited to serve it). Other connect failures (no route, a slow
    network) are left to torch's retries."""
    deadline = time.monotonic() + REFUSED_GRACE_S
    while True:
        try:
            socket.create_connection((host, int(port)), timeout=min(5.0, float(timeout_s))).close()
            break
        except ConnectionRefusedError:
            if time.monotonic() >= deadline:
                raise ConnectionError(f"the trainer's weight store at {host}:{port} refuses connections: the trainer that "
                                      "announced it is gone") from None
            time.sleep(0.2)
        except OSError:
            break
    return dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)


def new_group(store: Any, update: str, rank: int, world: int, backend: str, timeout_s: float) -> Any:
    """A process group of `world` ranks for one update, on its own store prefix; the default group is left alone."""
    prefix = dist.PrefixStore(f"{update}/pg/", store)
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "gloo":
        return dist.ProcessGroupGloo(prefix, rank, world, timeout)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(prefix, rank, world, opts)
    raise ValueError(f"weight broadcast backend {backend!r}: expected one of {', '.join(BACKENDS)}")


def broadcast(pg: Any, buf: torch.Tensor, timeout_s: float | None = None) -> None:
    """Rank 0's `buf` into every member's; `timeout_s` bounds this one collective (the group's own timeout is the shorter
    rendezvous limit, so a member that never joins is given up on quickly)."""
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    if timeout_s is not None:
        opts.timeout = datetime.timedelta(seconds=timeout_s)
    pg.broadcast([buf], opts).wait()


def rendezvous_timeout(join_timeout_s: float, timeout_s: float) -> float:
    """How long building an update's group waits for its members: the join window plus time to pause an engine, never more than timeoutSeconds."""
    return min(float(timeout_s), float(join_timeout_s) + PAUSE_GRACE_S)


def parse_rendezvous(text: str) -> tuple[str, int]:
    host, _, port = str(text).rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"weights record: rendezvous {text!r} is not host:port")
    return host.strip("[]"), int(port)


# -- the engine worker's side -------------------------------------------------------------------


def join_update(assign: dict[str, Any], *, local_rank: int) -> tuple[Any, list]:
    """Connect to the trainer's store and join update `assign["update"]`: (its group, its buckets).

    Within the join window, not weightSync.timeoutSeconds: a trainer killed after it assigned this update leaves a
    dead store, and torch's client retries its connect for the whole timeout (seen in CI: the engine blocked
    2 x 300 s). Call it before the engine starts reloading (vllm_worker.py), so that such a failure leaves the
    model untouched. The collectives keep the longer limit.
    """
    host, port = parse_rendezvous(assign["rendezvous"])
    joining = float(assign.get("rendezvous_timeout", assign["timeout"]))
    store = connect_store(host, port, joining)
    buckets = parse_manifest(store.get(manifest_key(assign["update"])))
    pg = new_group(store, assign["update"], int(assign["rank"]) + local_rank, int(assign["world"]), assign["backend"], joining)
    return pg, buckets


def receive_weights(assign: dict[str, Any], *, local_rank: int, device: torch.device | str, stats: dict[str, Any],
                    joined: tuple[Any, list] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Join update `assign["update"]` as rank assign["rank"] + local_rank (or use `joined`, join_update's) and yield each
    received (name, tensor).

    A generator for vLLM's reload_weights(weights_iterator=...): bucket k+1 is received only after the model took
    bucket k, so at most one bucket is held. stats gets buckets/bytes/seconds, and complete=True once all came.
    """
    timeout = float(assign["timeout"])
    started = time.monotonic()
    pg, buckets = joined if joined is not None else join_update(assign, local_rank=local_rank)
    stats.update(buckets=0, bytes=0, complete=False)
    for bucket in buckets:
        buf = torch.empty(bucket_size(bucket), dtype=torch.uint8, device=device)
        broadcast(pg, buf, timeout)
        stats["buckets"] += 1
        stats["bytes"] += buf.numel()
        yield from unpack(bucket, buf)
    stats["complete"] = stats["buckets"] == len(buckets)
    stats["seconds"] = round(time.monotonic() - started, 3)
    del pg


# -- the agent's side ---------------------------------------------------------------------------


def file_request(record: dict[str, Any], agent: str, workers: int, timeout_s: float = 30.0) -> int:
    """Ask the trainer of `record` (a `weights` record with mode broadcast) for the current weights; the request's index."""
    host, port = parse_rendezvous(record["rendezvous"])
    store = connect_store(host, port, timeout_s)
    i = int(store.add(REQ_COUNT, 1))
    store.set(req_key(i), json.dumps({"agent": agent, "workers": int(workers)}))
    return i


def wait_assignment(record: dict[str, Any], i: int, wait_s: float) -> dict[str, Any] | None:
    """Request `i`'s assignment once the trainer serves it, or None after `wait_s` seconds."""
    host, port = parse_rendezvous(record["rendezvous"])
    store = connect_store(host, port, 30.0)
    try:
        store.wait([assign_key(i)], datetime.timedelta(seconds=wait_s))
    except (dist.DistStoreError, RuntimeError) as exc:
        if "timeout" in str(exc).lower() or "timed out" in str(exc).lower() or isinstance(exc, dist.DistStoreError):
            return None
        raise
    return json.loads(store.get(assign_key(i)))


def entries_for(named: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype | None) -> list[Entry]:
    """The manifest entries of named tensors (DTensors give their global shape); floating ones cast to `dtype`."""
    out = []
    for name, t in named:
        dt = dtype if dtype is not None and t.is_floating_point() else t.dtype
        out.append(Entry(name, tuple(int(d) for d in t.shape), dtype_name(dt)))
    return out
