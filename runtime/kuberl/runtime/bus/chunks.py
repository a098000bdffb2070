"""Reassembly of trajectory groups that were published in chunks (the reader side of Bus.publish_group).

A large group is published as chunks on `kuberl.{exp}.traj.chunk` (headers: group, attempt, index,
count), then a head message on `kuberl.{exp}.traj` (msg id = group_id). Bus.pull_groups feeds every
message it fetches to a ChunkAssembler, which returns complete payloads and sweeps orphans.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kuberl.runtime.bus.messages import MessageError, join_chunks
from kuberl.runtime.bus.names import H_ATTEMPT, H_CHUNK, H_CHUNKS, H_GROUP, H_SIZE

# A publisher sends a group's head right after its last chunk (retrying at most ~30 s), so chunks with
# no head after the stream has moved this many seconds past them belong to a dead publisher.
ORPHAN_GRACE_SECONDS = 120.0


@dataclass
class _Pending:
    chunks: dict[int, Any] = field(default_factory=dict)  # index -> Msg
    head: Any = None
    last_ts: float = 0.0


class ChunkAssembler:
    """Collects chunk messages per (group, attempt) until the head and all chunks are there.

    `add(msg)` returns `(payload, msgs)` when a group is complete (msgs: head first, then its chunks,
    to be acked together), else None. `sweep()` returns `(msg, reason)` pairs to terminate: chunks of
    a superseded or abandoned attempt, and heads whose chunks never came.
    """

    def __init__(self, grace: float = ORPHAN_GRACE_SECONDS) -> None:
        self.grace = grace
        self._pending: dict[tuple[str, str], _Pending] = {}
        self._doomed: list[tuple[Any, str]] = []
        self._newest = 0.0

    @property
    def buffered(self) -> int:
        """Chunk and head messages held, waiting for the rest of their group."""
        return sum(len(p.chunks) + (p.head is not None) for p in self._pending.values())

    def add(self, msg: Any) -> tuple[bytes, list[Any]] | None:
        headers = msg.headers or {}
        ts = _timestamp(msg)
        self._newest = max(self._newest, ts)
        if H_CHUNKS not in headers:
            return msg.data, [msg]
        gid, attempt = headers.get(H_GROUP, ""), headers.get(H_ATTEMPT, "")
        key = (gid, attempt)
        try:
            count = int(headers[H_CHUNKS])
            index = int(headers[H_CHUNK]) if H_CHUNK in headers else None
        except ValueError:
            self._doomed.append((msg, f"group {gid!r}: bad chunk headers {dict(headers)!r}"))
            return None
        pending = self._pending.setdefault(key, _Pending())
        pending.last_ts = max(pending.last_ts, ts)
        if index is not None:
            pending.chunks[index] = msg  # a redelivery replaces the earlier delivery of the same chunk
        else:
            pending.head = msg
            # Another attempt of the same group lost the dedupe race: its chunks will never complete.
            for other in [k for k in self._pending if k[0] == gid and k != key]:
                stale = self._pending.pop(other)
                self._doomed += [(m, f"group {gid!r}: chunk of superseded attempt {other[1]}") for m in stale.chunks.values()]
        if pending.head is None or len(pending.chunks) < count:
            return None
        del self._pending[key]
        head = pending.head
        size = (head.headers or {}).get(H_SIZE)
        try:
            data = join_chunks({i: m.data for i, m in pending.chunks.items()}, count, int(size) if size else None)
        except (MessageError, ValueError) as exc:
            msgs = [head, *pending.chunks.values()]
            self._doomed += [(m, f"group {gid!r}: {exc}") for m in msgs]
            return None
        return data, [head, *(pending.chunks[i] for i in range(count))]

    def sweep(self) -> list[tuple[Any, str]]:
        """Messages to terminate now, each with the reason (for the log)."""
        out, self._doomed = self._doomed, []
        for key in [k for k, p in self._pending.items() if self._newest - p.last_ts > self.grace]:
            p = self._pending.pop(key)
            why = (f"group {key[0]!r}: head arrived but chunks are missing" if p.head is not None
                   else f"group {key[0]!r}: chunks of attempt {key[1]} never got their head (publisher died?)")
            out += [(m, why) for m in ([p.head] if p.head is not None else []) + list(p.chunks.values())]
        return out


def _timestamp(msg: Any) -> float:
    try:
        ts = msg.metadata.timestamp
        return ts.timestamp() if hasattr(ts, "timestamp") else float(ts)
    except (AttributeError, TypeError, ValueError):  # messages built by hand carry no JetStream metadata
        return 0.0
