"""The Bus: one experiment's trajectory bus on NATS JetStream (tickets, groups, KV state, weights).

The trainer publishes tickets, pulls trajectory groups and writes state; rollout agents pull tickets,
publish groups and watch the `weights` key. Names and message fields follow docs/design/contracts.md.
Usage: `bus = await Bus.connect(url, "my-exp")`, then `async with bus: ...` or `await bus.close()`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Self, TypeVar

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import api

from kuberl.runtime.bus import weights as weights_io
from kuberl.runtime.bus.chunks import ChunkAssembler
from kuberl.runtime.bus.connection import bus_credentials, open_connection, redact
from kuberl.runtime.bus.errors import BusError, BusFullError, GroupTooLargeError
from kuberl.runtime.bus.eval_queues import EvalQueues
from kuberl.runtime.bus.lease import Lease
from kuberl.runtime.bus.messages import (
    MessageError,
    Ticket,
    TrajectoryGroup,
    decode_group,
    decode_ticket,
    encode,
    split_chunks,
)
from kuberl.runtime.bus.names import (
    AGENTS_CONSUMER,
    H_ATTEMPT,
    H_CHUNK,
    H_CHUNKS,
    H_GROUP,
    H_MSG_ID,
    H_SIZE,
    KV_KEY,
    TRAINER_CONSUMER,
    BusNames,
)
from kuberl.runtime.bus.outage import Outage, retry
from kuberl.runtime.bus.server import parse_max_payload, parse_size
from kuberl.runtime.bus.topology import Topology

__all__ = ["Bus", "BusError", "BusFullError", "GroupTooLargeError", "Lease"]

log = logging.getLogger(__name__)
T = TypeVar("T")

HEADER_ROOM = 4096  # bytes kept free under max_payload for headers and the protocol line
FETCH_BYTES = 256 * 1024 * 1024
WATCH_CHECK_SECONDS = 15.0  # how often an idle state watch checks that its consumer still exists


async def _best_effort(what: str, aw: Awaitable[Any]) -> None:
    """Await a clean-up step whose failure changes nothing (the server forgets the object anyway)."""
    try:
        await aw
    except Exception as exc:  # noqa: BLE001 - any failure here only costs a debug line
        log.debug("%s failed: %s", what, exc)


class Bus(EvalQueues, Topology):
    """A connection to one experiment's bus objects. Create with `await Bus.connect(...)`."""

    def __init__(self, nc: NATS, names: BusNames, *, max_payload: int, ticket_ack_wait: float | None,
                 group_ack_wait: float | None, max_bytes: int | None, publish_timeout: float, url: str) -> None:
        self.nc = nc
        self.js = nc.jetstream(timeout=5.0)
        self.names = names
        self.max_payload = max_payload
        self.ticket_ack_wait = ticket_ack_wait
        self.group_ack_wait = group_ack_wait
        self.max_bytes = max_bytes
        self.publish_timeout = publish_timeout
        self.url = url
        self._kv: Any = None
        self._obj: Any = None
        self._subs: dict[str, Any] = {}  # consumer name -> pull subscription
        self._may_create = True
        self._ticket_lock = asyncio.Lock()
        self._group_lock = asyncio.Lock()
        self._trainer_generation = 0
        self._assembler = ChunkAssembler()
        self.bad_messages = 0  # undecodable messages terminated (each logged)
        self.reconnects = 0
        self.outage = Outage(nc, publish_timeout)  # how long calls wait for a restarted server

    def _on_reconnect(self) -> None:
        self.reconnects += 1
        self.outage.on_reconnect()

    # -- connecting -----------------------------------------------------------------------------

    @classmethod
    async def connect(cls, url: str | None, experiment: str, *, token: str | None = None,
                      user: str | None = None, password: str | None = None,
                      max_payload: int | str | None = None, create: bool = True, ticket_ack_wait: float | None = None,
                      group_ack_wait: float | None = None, max_bytes: int | str | None = None,
                      connect_timeout: float = 30.0, publish_timeout: float = 30.0, name: str | None = None) -> Bus:
        """Connect and create (or, with create=False, only bind) the experiment's streams, consumers and buckets.

        url None = $KUBERL_BUS_URL; token None = $KUBERL_BUS_TOKEN; user/password None = $KUBERL_BUS_USER and
        $KUBERL_BUS_PASSWORD (the embedded bus: one NATS user per role); none of them set = no auth.
        max_payload: cap on message size (default and ceiling: the server's max_payload).
        ticket_ack_wait: seconds before an agent's unacked ticket goes to another agent (default 30).
        group_ack_wait: the trainer acks only after a checkpoint covers a group, so this is long (default
            24 h); after a trainer restart `reset_trainer_consumer()` redelivers at once.
        max_bytes: size limit of the trajectory stream (publishes fail loudly when full, nothing is dropped).
        The three settings above apply when this call creates the object, or when given explicitly
        (then existing objects are updated): a Bus connecting with defaults never undoes another's choice.
        connect_timeout: keep trying to reach the server this long (pods may start before the bus);
            after the first connection the client reconnects forever.
        """
        names = BusNames.for_experiment(experiment)
        url = url or os.environ.get("KUBERL_BUS_URL")
        if not url:
            raise BusError("no bus URL: pass one, set spec.bus, or set KUBERL_BUS_URL (e.g. nats://127.0.0.1:4222)")
        for what, v in (("ticket_ack_wait", ticket_ack_wait), ("group_ack_wait", group_ack_wait)):
            if v is not None and not v > 0:
                raise ValueError(f"{what} must be > 0 seconds, got {v!r}")
        payload_cap = parse_max_payload(max_payload) if max_payload is not None else None
        stream_bytes = parse_size(max_bytes, "max_bytes") if max_bytes is not None else None
        token, user, password = bus_credentials(token, user, password)
        hooks: list[Callable[[], None]] = []
        denied: list[Callable[[str], None]] = []
        nc = await open_connection(url, token, connect_timeout, name or f"kuberl-{experiment}-{os.getpid()}",
                                   on_reconnect=lambda: [h() for h in hooks], user=user, password=password,
                                   on_denied=lambda m: [d(m) for d in denied])
        try:
            limit = min(nc.max_payload, payload_cap) if payload_cap else nc.max_payload
            bus = cls(nc, names, max_payload=limit, ticket_ack_wait=ticket_ack_wait, group_ack_wait=group_ack_wait,
                      max_bytes=stream_bytes, publish_timeout=publish_timeout, url=redact(url))
            hooks.append(bus._on_reconnect)
            denied.append(bus.outage.on_denied)
            await bus._check_jetstream()
            bus._may_create = create
            await (bus._create() if create else bus._bind())
            return bus
        except BaseException:
            await nc.close()
            raise

    async def close(self) -> None:
        if not self.nc.is_closed:
            try:
                await self.nc.close()
            except (OSError, nats.errors.Error) as exc:  # a server already gone: nothing left to flush to
                log.debug("closing the bus connection: %s", exc)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- helpers ---------------------------------------------------------------------------------

    async def _retry(self, what: str, fn: Callable[[], Awaitable[T]]) -> T:
        """fn() retried through a bus outage (kuberl.runtime.bus.outage); missing streams are re-created."""
        return await retry(self.outage, self.url, what, fn, self._create if self._may_create else None)

    async def _publish(self, subject: str, payload: bytes, headers: dict[str, str], what: str) -> api.PubAck:
        # A request sent while reconnecting can vanish: wait for its answer only as long as the payload needs.
        timeout = 2.0 + len(payload) / 10e6
        return await self._retry(what, lambda: self.js.publish(subject, payload, headers=headers, timeout=timeout))

    # -- tickets ---------------------------------------------------------------------------------

    async def publish_tickets(self, tickets: list[Ticket]) -> int:
        """Publish tickets (msg id = ticket_id, so re-issuing after a restart is deduplicated).
        Returns how many were new."""
        subject = self.names.tickets_subject
        new = 0
        for start in range(0, len(tickets), 256):
            batch = tickets[start : start + 256]
            acks = await asyncio.gather(*(
                self._publish(subject, t.encode(), {H_MSG_ID: t.ticket_id}, f"publish ticket {t.ticket_id}") for t in batch))
            new += sum(not a.duplicate for a in acks)
        return new

    async def pull_ticket(self, timeout: float = 5.0) -> Lease[Ticket] | None:
        """Take the next ticket (no other agent gets it unless this lease expires); None on timeout.

        While working on it, call `lease.in_progress()` more often than ticket_ack_wait (or use
        `async with lease.keep_alive(): ...`); ack when its group is published.
        """
        got = await self.pull_tickets(1, timeout)
        return got[0] if got else None

    async def pull_tickets(self, max_n: int, timeout: float = 5.0) -> list[Lease[Ticket]]:
        """Take up to max_n tickets, waiting at most `timeout` for the first; returns what is there then."""
        if max_n < 1:
            raise ValueError(f"max_n must be >= 1, got {max_n}")
        deadline = time.monotonic() + timeout
        out: list[Lease[Ticket]] = []
        async with self._ticket_lock:  # one pull request at a time per subscription (shared inbox)
            while not out and (left := deadline - time.monotonic()) > 0.01:
                for m in await self._fetch(AGENTS_CONSUMER, max_n, left):
                    try:
                        out.append(Lease(decode_ticket(m.data), [m], outage=self.outage))
                    except MessageError as exc:
                        await self._poison(m, exc)
        return out

    async def _fetch(self, consumer: str, batch: int, timeout: float) -> list[Msg]:
        """One pull request; [] on timeout or a transient problem (the callers loop until their deadline)."""
        sub = self._subs.get(consumer)
        try:
            if sub is None:
                stream, _ = self._consumer_config(consumer)
                sub = self._subs[consumer] = await self.js.pull_subscribe_bind(consumer, stream=stream)
            return await sub.fetch(batch, timeout=timeout)
        except (TimeoutError, nats.errors.TimeoutError):
            return []
        except (nats.errors.ConnectionReconnectingError, nats.errors.ConnectionClosedError, nats.errors.NoRespondersError) as exc:
            if self.nc.is_closed:
                raise BusError(f"the bus connection to {self.url} is closed") from None
            log.debug("pull from %s: %s", consumer, type(exc).__name__)
        except nats.js.errors.APIError as exc:
            # The consumer went away (deleted, or a server that lost its state): bind again, or re-create it.
            log.warning("bus: pull from consumer %r failed (%s); re-binding", consumer, exc)
            await self._recover_consumer(consumer)
        await asyncio.sleep(min(0.5, max(timeout, 0.0)))
        return []

    async def _recover_consumer(self, consumer: str) -> None:
        sub = self._subs.pop(consumer, None)
        if sub is not None:
            await _best_effort("unsubscribe", sub.unsubscribe())
        stream, _ = self._consumer_config(consumer)
        try:
            await self.js.consumer_info(stream, consumer)
            return
        except nats.js.errors.NotFoundError:
            pass
        except Exception:  # noqa: BLE001 - not reachable now: the next pull tries again
            return
        if not self._may_create:
            raise BusError(f"consumer {consumer!r} of experiment {self.names.experiment!r} no longer exists on {self.url}")
        await self._create()  # idempotent: re-creates whatever is missing (the stream too, after a reset)
        if consumer == TRAINER_CONSUMER:  # a new consumer redelivers everything unacked
            self._trainer_generation += 1
            self._assembler = ChunkAssembler()

    async def _poison(self, m: Msg, exc: Exception) -> None:
        self.bad_messages += 1
        log.error("bus: dropping an undecodable message on %s (stream seq %s): %s", m.subject, m.metadata.sequence.stream, exc)
        await m.term()

    # -- trajectory groups -----------------------------------------------------------------------

    @property
    def chunk_size(self) -> int:
        return max(self.max_payload - HEADER_ROOM, 1024)

    async def publish_group(self, group: TrajectoryGroup) -> bool:
        """Publish a group (msg id = group_id). Returns False if the bus already had this group.

        A group above max_payload goes as chunks on the chunk subject followed by a header message;
        the trainer's `pull_groups` reassembles it. Raises GroupTooLargeError if it can never fit, and
        BusFullError while the stream is full (nothing is dropped: retry later).
        """
        gid = group.group_id
        payload = encode(group)
        n = self.names
        if len(payload) <= self.chunk_size:
            ack = await self._publish(n.traj_subject, payload, {H_MSG_ID: gid, H_GROUP: gid}, f"publish group {gid}")
            return not ack.duplicate
        if self.max_bytes is not None and len(payload) > self.max_bytes:
            raise GroupTooLargeError(f"group {gid} is {len(payload)} bytes encoded, more than the whole trajectory "
                                     f"stream holds (max_bytes {self.max_bytes}): raise the bus size or lower maxNewTokens")
        attempt = uuid.uuid4().hex[:12]
        parts = split_chunks(payload, self.chunk_size)
        seqs: list[int] = []
        try:
            for i, part in enumerate(parts):
                headers = {H_MSG_ID: f"{gid}.{attempt}.{i}", H_GROUP: gid, H_ATTEMPT: attempt,
                           H_CHUNK: str(i), H_CHUNKS: str(len(parts))}
                seqs.append((await self._publish(n.chunk_subject, part, headers, f"publish chunk {i} of group {gid}")).seq)
            head = {H_MSG_ID: gid, H_GROUP: gid, H_ATTEMPT: attempt, H_CHUNKS: str(len(parts)), H_SIZE: str(len(payload))}
            ack = await self._publish(n.traj_subject, b"", head, f"publish group {gid}")
        except BaseException:
            await self._delete_seqs(seqs)
            raise
        if ack.duplicate:  # an earlier attempt got through: our chunks are orphans
            await self._delete_seqs(seqs)
            return False
        return True

    async def _delete_seqs(self, seqs: list[int]) -> None:
        for s in seqs:
            try:
                await self.js.delete_msg(self.names.traj_stream, s)
            except Exception as exc:  # noqa: BLE001 - the reader's orphan sweep removes what we could not
                log.debug("could not delete orphan chunk seq %d: %s", s, exc)

    async def pull_groups(self, max_n: int, timeout: float = 5.0) -> list[Lease[TrajectoryGroup]]:
        """Up to max_n groups, waiting at most `timeout` seconds for them (fewer, or none, on timeout).

        Only one process should read the trainer consumer: chunked groups are reassembled here.
        """
        if max_n < 1:
            raise ValueError(f"max_n must be >= 1, got {max_n}")
        out: list[Lease[TrajectoryGroup]] = []
        deadline = time.monotonic() + timeout
        async with self._group_lock:
            while len(out) < max_n and (left := deadline - time.monotonic()) > 0.01:
                # Bound the bytes one pull request may bring (client buffers are finite): 32 x 8 MB.
                batch = min(max_n - len(out), max(1, FETCH_BYTES // self.max_payload))
                msgs = await self._fetch(TRAINER_CONSUMER, batch, left)
                for m in msgs:
                    ready = self._assembler.add(m)
                    if ready is None:
                        continue
                    payload, parts = ready
                    try:
                        out.append(Lease(decode_group(payload), parts, self._trainer_generation, self))
                    except MessageError as exc:
                        for p in parts:
                            await self._poison(p, exc)
                for m, why in self._assembler.sweep():
                    self.bad_messages += 1
                    log.error("bus: %s (subject %s, stream seq %s); dropping it", why, m.subject, m.metadata.sequence.stream)
                    await m.term()
        return out

    async def reset_trainer_consumer(self) -> None:
        """Delete and recreate the trainer's durable consumer: every unacked group is redelivered now.

        Call it when a trainer starts (or restarts from a checkpoint). Leases taken before are void.
        """
        stream, cfg = self._consumer_config(TRAINER_CONSUMER)
        async with self._group_lock:
            sub = self._subs.pop(TRAINER_CONSUMER, None)
            if sub is not None:
                await _best_effort("unsubscribe", sub.unsubscribe())
            try:
                await self.js.delete_consumer(stream, TRAINER_CONSUMER)
            except nats.js.errors.NotFoundError:
                pass
            await self._add_consumer(stream, cfg)
            self._trainer_generation += 1
            self._assembler = ChunkAssembler()

    async def reset_experiment(self) -> None:
        """Delete and re-create every bus object of the experiment: for a fresh start (no checkpoint).

        Needed because ticket ids repeat across runs and the streams deduplicate them for an hour.
        Agents re-bind by themselves; call it before they start watching state.
        """
        n = self.names
        async with self._ticket_lock, self._group_lock:
            for sub in self._subs.values():
                await _best_effort("unsubscribe", sub.unsubscribe())
            self._subs.clear()
            for stream in (n.tickets_stream, n.traj_stream):
                try:  # through _retry: a NATS user that may not delete it gets a BusError saying so
                    await self._retry(f"delete stream {stream}", lambda s=stream: self.js.delete_stream(s))
                except nats.js.errors.NotFoundError:
                    pass
            for delete, bucket in ((self.js.delete_key_value, n.kv_bucket), (self.js.delete_object_store, n.weights_bucket)):
                try:
                    await self._retry(f"delete bucket {bucket}", lambda d=delete, b=bucket: d(b))
                except nats.js.errors.NotFoundError:
                    pass
            await self._create()
            self._trainer_generation += 1
            self._assembler = ChunkAssembler()
        log.info("bus: reset every object of experiment %s", n.experiment)

    # -- shared state (KV) -----------------------------------------------------------------------

    @staticmethod
    def _check_key(key: str) -> None:
        if not isinstance(key, str) or not KV_KEY.match(key):
            raise ValueError(f"KV key {key!r} is invalid: use letters, digits and - _ = . /")

    async def get_state(self, key: str) -> dict[str, Any] | None:
        """The JSON value of a KV key, or None if unset or deleted."""
        self._check_key(key)
        try:
            entry = await self._retry(f"read state {key!r}", lambda: self._kv.get(key))
        except nats.js.errors.KeyNotFoundError:
            return None
        if entry.value is None or entry.operation in ("DEL", "PURGE"):
            return None
        return _loads(entry.value, key)

    async def put_state(self, key: str, value: dict[str, Any]) -> int:
        """Set a KV key to a JSON object; returns the revision."""
        self._check_key(key)
        if not isinstance(value, dict):
            raise TypeError(f"state {key!r} must be a dict, got {type(value).__name__}")
        data = json.dumps(value, separators=(",", ":")).encode()
        return await self._retry(f"write state {key!r}", lambda: self._kv.put(key, data))

    async def watch_state(self, key: str) -> AsyncIterator[dict[str, Any]]:
        """Every value the key takes, starting with the current one (if set). Deletions are skipped.

        After a reconnect the watch is re-created (a restarted server forgets it) and values already
        seen (same KV revision) are not yielded twice.
        """
        self._check_key(key)
        last_revision = 0
        while True:
            generation = self.reconnects
            watcher = await self._retry(f"watch state {key!r}", lambda: self._kv.watch(key))
            idle = 0.0
            try:
                while generation == self.reconnects:
                    try:
                        entry = await watcher.updates(timeout=1.0)
                    except nats.errors.TimeoutError:
                        idle += 1.0
                        if idle >= WATCH_CHECK_SECONDS:
                            idle = 0.0
                            if not await self._watch_alive(watcher):
                                last_revision = 0  # the bucket was re-created: revisions start again
                                break
                        continue
                    idle = 0.0
                    if entry is None or entry.value is None or entry.operation in ("DEL", "PURGE"):
                        continue  # None marks "caught up with the history"
                    if entry.revision <= last_revision:
                        continue
                    last_revision = entry.revision
                    yield _loads(entry.value, key)
            finally:
                await _best_effort("stop watch", watcher.stop())

    async def _watch_alive(self, watcher: Any) -> bool:
        """False when the watch's consumer is gone (e.g. reset_experiment re-created the bucket)."""
        sub = getattr(watcher, "_sub", None)
        if sub is None:
            return True
        try:
            await sub.consumer_info()
        except nats.js.errors.NotFoundError:
            log.warning("bus: the watch on %s lost its consumer; watching again", self.names.kv_bucket)
            return False
        except Exception as exc:  # noqa: BLE001 - unreachable now: a reconnect re-creates the watch
            log.debug("watch check failed: %s", exc)
        return True

    # -- weights (object store) ------------------------------------------------------------------

    # Each call is retried whole through a bus outage (a kill -9 of the server mid-upload): objects are
    # replaced by name and the manifest is written last, so a repeated upload or download is safe.

    async def put_weights(self, version: int, folder: str | os.PathLike[str]) -> str:
        """Upload every file of `folder` as objects `v{version}/{file}`; returns the prefix `v{version}`."""
        chunk = min(self.chunk_size, 2 * 1024 * 1024)
        return await self._retry(f"upload weights v{version}", lambda: weights_io.put_weights(self._obj, version, folder, chunk_size=chunk))

    async def get_weights(self, prefix: str, dest_folder: str | os.PathLike[str]) -> str:
        """Download the objects under `prefix` into dest_folder (written beside it, then renamed)."""
        return await self._retry(f"download weights {prefix}", lambda: weights_io.get_weights(self._obj, prefix, dest_folder))

    async def delete_weights(self, prefix: str) -> int:
        """Delete the objects under `prefix`; returns how many."""
        return await self._retry(f"delete weights {prefix}", lambda: weights_io.delete_weights(self._obj, prefix))

    async def list_weights(self) -> list[str]:
        """Prefixes of the complete weight uploads in the object store."""
        return await self._retry("list weights", lambda: weights_io.list_weights(self._obj))

    # -- observation -----------------------------------------------------------------------------

    async def stream_info(self) -> dict[str, int]:
        """Pending counts for the autoscaler and progress reports.

        tickets_pending: issued tickets no agent has finished (acked); tickets_waiting: not yet taken;
        tickets_in_flight: taken, not acked. groups_pending: groups on the stream (not acked by the
        trainer); groups_waiting: not yet delivered to the trainer (chunks included);
        groups_unacked: delivered, awaiting ack; traj_bytes: stream size.
        """
        n = self.names
        ts = await self._retry("stream info", lambda: self.js.stream_info(n.tickets_stream, subjects_filter=n.tickets_subject))
        tc = await self._retry("consumer info", lambda: self.js.consumer_info(n.tickets_stream, AGENTS_CONSUMER))
        gs = await self._retry("stream info", lambda: self.js.stream_info(n.traj_stream, subjects_filter=n.traj_subject))
        gc = await self._retry("consumer info", lambda: self.js.consumer_info(n.traj_stream, TRAINER_CONSUMER))
        return {
            "tickets_pending": (ts.state.subjects or {}).get(n.tickets_subject, 0),  # evaluation tickets not counted
            "tickets_waiting": tc.num_pending or 0,
            "tickets_in_flight": tc.num_ack_pending or 0,
            "groups_pending": (gs.state.subjects or {}).get(n.traj_subject, 0),
            "groups_waiting": gc.num_pending or 0,
            "groups_unacked": gc.num_ack_pending or 0,
            "traj_bytes": gs.state.bytes,
        }


def _loads(data: bytes, key: str) -> dict[str, Any]:
    try:
        value = json.loads(data)
    except ValueError as exc:
        raise BusError(f"state {key!r} is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise BusError(f"state {key!r} is a JSON {type(value).__name__}, expected an object")
    return value
