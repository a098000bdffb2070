"""Lease: a message taken from a JetStream work queue, with ack/nak/in_progress (returned by Bus pulls)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any, Generic, TypeVar

import nats.errors
from nats.aio.msg import Msg

from kuberl.runtime.bus.outage import Outage, retry

log = logging.getLogger(__name__)
T = TypeVar("T")


class Lease(Generic[T]):
    """A message taken from a work queue: `.value`; `ack()` when done, `nak()` to give it back,
    `in_progress()` to keep it longer than ack_wait. A chunked group holds several messages."""

    def __init__(self, value: T, msgs: list[Msg], generation: int = 0, owner: Any = None, outage: Outage | None = None) -> None:
        self.value = value
        self._outage = outage or getattr(owner, "outage", None)
        self._msgs = msgs
        self._generation = generation
        self._owner = owner
        self._reconnects = self._outage.reconnects if self._outage is not None else 0  # as delivered

    @property
    def delivered(self) -> int:
        """How many times the server delivered this message (1 = first time)."""
        return self._msgs[0].metadata.num_delivered

    def _stale(self) -> bool:
        # After reset_trainer_consumer the old consumer is gone: the messages come again from the new one.
        return self._owner is not None and self._generation != self._owner._trainer_generation

    async def ack(self) -> bool:
        """Acknowledge (the work queue deletes it); waits for the server's confirmation. True once the
        server confirmed it; False when a restarted server had forgotten delivering it (a kill -9 before it
        wrote the consumer's state): such an ack is never answered, and the message comes again (every
        reader tolerates a repeat: stream dedupe ids, the trainer's duplicate count)."""
        if self._stale():
            log.warning("ack of a lease from before reset_trainer_consumer ignored (it will be redelivered)")
            return False
        # Retried through a bus outage (a restarted nats-server keeps the consumer's state): acking twice
        # is harmless (the server confirms it again), a lost ack would redeliver.
        outage = self._outage or Outage(self._msgs[0]._client, 15.0)
        per_try = min(5.0, outage.publish_timeout)  # a try longer than the server is given would outlive the call
        for m in self._msgs:  # the head message first: a crash midway leaves only orphan chunks
            m._ackd = False  # nats-py refuses a second ack_sync of a message it thinks acked
            if not await retry(outage, "the bus", f"ack {self.value!r:.60}", lambda m=m: self._ack_one(m, per_try, outage)):
                return False
        return True

    async def _ack_one(self, m: Msg, timeout: float, outage: Outage) -> bool:
        try:
            await m.ack_sync(timeout=timeout)
            return True
        except (TimeoutError, nats.errors.TimeoutError):
            # Unanswered. After a reconnect, the server may be a restarted one that lost this delivery:
            # JetStream answers no ack above its consumer's delivered pointer, however often it is sent.
            if outage.reconnects == self._reconnects or not await self._forgotten(m):
                raise
            md = m.metadata
            log.warning("the restarted bus forgot delivering %s (stream sequence %d; its consumer %s had not "
                        "written it before the server died): the ack cannot count, the message comes again",
                        f"{self.value!r:.60}", md.sequence.stream, md.consumer)
            return False

    @staticmethod
    async def _forgotten(m: Msg) -> bool:
        """Whether the server's consumer has not delivered m as far as it knows (its delivered stream
        sequence is below m's). Unknown (the info call fails) counts as not forgotten: the ack is retried."""
        md = m.metadata
        try:
            info = await m._client.jetstream(timeout=5.0).consumer_info(md.stream, md.consumer)
        except Exception as exc:  # noqa: BLE001 - the caller's retry goes on
            log.debug("consumer info of %s/%s: %s", md.stream, md.consumer, exc)
            return False
        return (info.delivered.stream_seq or 0) < md.sequence.stream

    async def nak(self, delay: float | None = None) -> None:
        """Give it back for redelivery (after `delay` seconds)."""
        if not self._stale():
            for m in self._msgs:
                await m.nak(delay=delay)

    async def in_progress(self) -> None:
        """Reset the server's ack_wait timer: still working on it."""
        if not self._stale():
            for m in self._msgs:
                await m.in_progress()

    @contextlib.asynccontextmanager
    async def keep_alive(self, interval: float = 10.0) -> AsyncIterator[Lease[T]]:
        """`async with lease.keep_alive(): ...` sends in_progress every `interval` seconds meanwhile
        (keep it below the consumer's ack_wait: 30 s for tickets)."""

        async def beat() -> None:
            while True:
                await asyncio.sleep(interval)
                try:
                    await self.in_progress()
                except Exception as exc:  # noqa: BLE001 - a lost beat only risks a redelivery; keep working
                    log.warning("in_progress for %r failed: %s", self.value, exc)

        task = asyncio.create_task(beat())
        try:
            yield self
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def term(self) -> None:
        """Never redeliver (poison message)."""
        if not self._stale():
            for m in self._msgs:
                await m.term()

    def __repr__(self) -> str:
        return f"Lease({self.value!r:.80}, messages={len(self._msgs)})"
