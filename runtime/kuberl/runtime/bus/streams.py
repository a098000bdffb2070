"""Tickets and trajectory groups on the bus's two streams: publish, pull (with chunk reassembly), reset.

A mixin of Bus (client.py): needs its `names`, `js`, `nc`, `url`, `outage`, `max_payload`, `max_bytes`,
`_subs`, `_may_create`, the two pull locks, `_trainer_generation`, `_assembler`, `_retry`, `_publish`,
and Topology's `_consumer_config`, `_add_consumer`, `_create`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable
from typing import Any

import nats.errors
import nats.js.errors
from nats.aio.msg import Msg

from kuberl.runtime.aio import cancel_requested, raise_if_cancelling
from kuberl.runtime.bus.chunks import ChunkAssembler
from kuberl.runtime.bus.errors import BusError, GroupTooLargeError
from kuberl.runtime.bus.lease import Lease
from kuberl.runtime.bus.messages import MessageError, Ticket, TrajectoryGroup, decode_group, decode_ticket, encode, split_chunks
from kuberl.runtime.bus.names import AGENTS_CONSUMER, H_ATTEMPT, H_CHUNK, H_CHUNKS, H_GROUP, H_MSG_ID, H_SIZE, TRAINER_CONSUMER

log = logging.getLogger("kuberl.runtime.bus.client")  # the name these lines always had (client.py)

HEADER_ROOM = 4096  # bytes kept free under max_payload for headers and the protocol line
FETCH_BYTES = 256 * 1024 * 1024


async def _best_effort(what: str, aw: Awaitable[Any]) -> None:
    """Await a clean-up step whose failure changes nothing (the server forgets the object anyway)."""
    try:
        await aw
    except Exception as exc:  # noqa: BLE001 - any failure here only costs a debug line
        log.debug("%s failed: %s", what, exc)


class StreamsMixin:
    """Training tickets (agents' work queue) and trajectory groups (the trainer's stream)."""

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
            msgs = await sub.fetch(batch, timeout=timeout)
        except (TimeoutError, nats.errors.TimeoutError):
            raise_if_cancelling()  # the client may have dropped a cancel (kuberl/runtime/aio.py)
            return []
        except (nats.errors.ConnectionReconnectingError, nats.errors.ConnectionClosedError, nats.errors.NoRespondersError) as exc:
            if self.nc.is_closed:
                raise BusError(f"the bus connection to {self.url} is closed") from None
            log.debug("pull from %s: %s", consumer, type(exc).__name__)
        except nats.js.errors.APIError as exc:
            # The consumer went away (deleted, or a server that lost its state): bind again, or re-create it.
            log.warning("bus: pull from consumer %r failed (%s); re-binding", consumer, exc)
            await self._recover_consumer(consumer)
        else:
            if cancel_requested():  # messages came back and the cancel was dropped: give them back
                for m in msgs:
                    with contextlib.suppress(Exception):
                        await m.nak()  # redelivered at once, not after ack_wait
                raise asyncio.CancelledError
            return msgs
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
