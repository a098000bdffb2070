"""Creating or binding one experiment's JetStream objects (streams, durable consumers, KV, object store).

The base class of Bus: `_create()` makes whatever is missing without undoing settings another role
chose; `_bind()` only checks they exist. Settings follow docs/design/contracts.md.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import nats.errors
import nats.js.errors
from nats.js import api

from kuberl.env import env_seconds
from kuberl.runtime.bus.errors import BusError
from kuberl.runtime.bus.names import AGENTS_CONSUMER, EVAL_AGENTS_CONSUMER, EVAL_TRAINER_CONSUMER, TRAINER_CONSUMER, BusNames

DUPLICATE_WINDOW = 3600.0  # contract: dedupe window of 1 h on both streams
# Overrides it for streams created from now on (seconds). The fault tests shorten it to show that a
# trainer restarted after the window does not roll out or train a ticket twice; it also bounds the
# server's memory of message ids on very long runs.
DUPLICATE_WINDOW_ENV = "KUBERL_BUS_DUPLICATE_WINDOW"


def duplicate_window() -> float:
    try:
        return env_seconds(DUPLICATE_WINDOW_ENV, DUPLICATE_WINDOW)
    except ValueError as exc:
        raise BusError(str(exc)) from None
DEFAULT_TICKET_ACK_WAIT = 30.0  # contract: a dead agent's ticket goes to another agent after 30 s
DEFAULT_GROUP_ACK_WAIT = 24 * 3600.0  # the trainer acks after a checkpoint; restarts reset the consumer
# nats-server's "error creating store for stream" (HTTP-like code 500): seen in CI (2026-11-28) when reset_experiment
# re-created the streams it had just deleted, the account's store directory still being removed. Transient: try again.
STORE_CREATE_ERR_CODE = 10049
STORE_CREATE_ATTEMPTS = 5
# JetStream's "stream not found": a consumer's stream deleted between its check and the consumer's creation, by another
# role's reset_experiment (a trainer's fresh start) while this one binds. _create then runs again, up to this many times.
STREAM_NOT_FOUND_ERR_CODE = 10059
STREAM_GONE_ATTEMPTS = 5


class _StreamGone(BusError):
    """A consumer's stream was not found (a BusError wherever _create does not bind again)."""

    def __init__(self, stream: str, consumer: str) -> None:
        super().__init__(f"cannot create consumer {consumer} on {stream}: stream not found")
        self.stream = stream

log = logging.getLogger("kuberl.runtime.bus.client")


class Topology:
    """Mixin: needs `js`, `names`, `url`, `max_bytes`, `ticket_ack_wait`, `group_ack_wait`."""

    js: Any
    names: BusNames
    url: str
    max_bytes: int | None
    ticket_ack_wait: float | None
    group_ack_wait: float | None
    _kv: Any
    _obj: Any

    async def _check_jetstream(self) -> None:
        try:
            await self.js.account_info()
        except (nats.errors.NoRespondersError, nats.js.errors.ServiceUnavailableError, nats.errors.TimeoutError) as exc:
            raise BusError(f"the NATS server at {self.url} has no JetStream ({type(exc).__name__}): "
                           "start nats-server with -js (or `jetstream {}` in its config)") from None

    def _stream_config(self, which: str) -> api.StreamConfig:
        n = self.names
        common = {"retention": api.RetentionPolicy.WORK_QUEUE, "storage": api.StorageType.FILE,
                  "discard": api.DiscardPolicy.NEW, "duplicate_window": duplicate_window(), "num_replicas": 1}
        if which == "tickets":
            return api.StreamConfig(name=n.tickets_stream, subjects=[n.tickets_subject, n.eval_tickets_subject, n.eval_results_subject], **common)
        return api.StreamConfig(name=n.traj_stream, subjects=[n.traj_subject, n.chunk_subject],
                                max_bytes=self.max_bytes or -1, **common)

    def _consumer_config(self, name: str) -> tuple[str, api.ConsumerConfig]:
        n = self.names
        base = {"ack_policy": api.AckPolicy.EXPLICIT, "deliver_policy": api.DeliverPolicy.ALL,
                "max_deliver": -1, "max_ack_pending": -1, "name": name, "durable_name": name}
        if name == AGENTS_CONSUMER:
            return n.tickets_stream, api.ConsumerConfig(
                ack_wait=self.ticket_ack_wait or DEFAULT_TICKET_ACK_WAIT, filter_subject=n.tickets_subject, **base)
        if name == EVAL_AGENTS_CONSUMER:  # evaluation tickets: the same ack_wait as training tickets
            return n.tickets_stream, api.ConsumerConfig(
                ack_wait=self.ticket_ack_wait or DEFAULT_TICKET_ACK_WAIT, filter_subject=n.eval_tickets_subject, **base)
        if name == EVAL_TRAINER_CONSUMER:  # evaluation results: small, acked as soon as they are counted
            return n.tickets_stream, api.ConsumerConfig(ack_wait=DEFAULT_TICKET_ACK_WAIT, filter_subject=n.eval_results_subject, **base)
        # No filter: the trainer reads groups and their chunks in stream order.
        return n.traj_stream, api.ConsumerConfig(ack_wait=self.group_ack_wait or DEFAULT_GROUP_ACK_WAIT, **base)

    async def _create(self) -> None:
        for attempt in range(1, STREAM_GONE_ATTEMPTS + 1):
            try:
                return await self._create_once()
            except _StreamGone as exc:
                if attempt == STREAM_GONE_ATTEMPTS:
                    raise BusError(f"{exc} ({attempt} attempts: another role keeps deleting it)") from None
                log.warning("bus: stream %s was deleted while binding (another role reset the experiment); binding again", exc.stream)
                await asyncio.sleep(0.2 * attempt)

    async def _create_once(self) -> None:
        for which, explicit in (("tickets", False), ("traj", self.max_bytes is not None)):
            cfg = self._stream_config(which)
            try:
                info = await self.js.stream_info(cfg.name)
            except nats.js.errors.NotFoundError:
                try:
                    info = await self._store_created(f"stream {cfg.name}", lambda c=cfg: self.js.add_stream(c))
                except nats.js.errors.BadRequestError:  # created meanwhile by another role
                    info = await self.js.stream_info(cfg.name)
            else:
                if set(cfg.subjects or []) - set(info.config.subjects or []):  # a stream from before evaluation subjects
                    info = await self.js.update_stream(dataclasses.replace(info.config, subjects=cfg.subjects))
                if explicit and info.config.max_bytes != cfg.max_bytes:
                    try:
                        info = await self.js.update_stream(cfg)
                    except nats.js.errors.APIError as exc:
                        raise BusError(f"cannot resize stream {cfg.name}: {exc.description}") from None
            if which == "traj" and (info.config.max_bytes or -1) > 0:
                self.max_bytes = info.config.max_bytes
        for name, explicit in ((AGENTS_CONSUMER, self.ticket_ack_wait), (TRAINER_CONSUMER, self.group_ack_wait)):
            stream, cfg = self._consumer_config(name)
            try:
                info = await self.js.consumer_info(stream, name)
            except nats.js.errors.NotFoundError:
                await self._add_consumer(stream, cfg)
            else:
                if explicit is not None and abs((info.config.ack_wait or 0) - explicit) > 1e-3:
                    await self._add_consumer(stream, cfg)  # create-or-update: ack_wait may change
                elif name == TRAINER_CONSUMER:
                    self.group_ack_wait = info.config.ack_wait  # keep it across reset_trainer_consumer
        for name in (EVAL_AGENTS_CONSUMER, EVAL_TRAINER_CONSUMER):
            stream, cfg = self._consumer_config(name)
            try:
                await self.js.consumer_info(stream, name)
            except nats.js.errors.NotFoundError:
                await self._add_consumer(stream, cfg)
        n = self.names
        self._kv = await self._store_created(f"bucket {n.kv_bucket}", lambda: self.js.create_key_value(
            bucket=n.kv_bucket, history=1, storage=api.StorageType.FILE))
        self._obj = await self._store_created(f"bucket {n.weights_bucket}", lambda: self.js.create_object_store(
            bucket=n.weights_bucket, storage=api.StorageType.FILE))

    async def _store_created(self, what: str, create: Callable[[], Awaitable[Any]]) -> Any:
        """`create()`, again after a moment while the server cannot create the store (STORE_CREATE_ERR_CODE)."""
        for attempt in range(1, STORE_CREATE_ATTEMPTS + 1):
            try:
                return await create()
            except nats.js.errors.ServerError as exc:
                if exc.err_code != STORE_CREATE_ERR_CODE:
                    raise
                if attempt == STORE_CREATE_ATTEMPTS:
                    raise BusError(f"cannot create {what} on {self.url}: {exc.description} ({attempt} attempts)") from None
                log.warning("bus: creating %s failed (%s); trying again", what, exc.description)
                await asyncio.sleep(0.2 * attempt)
        return None  # not reached: the last attempt returns or raises

    async def _add_consumer(self, stream: str, cfg: api.ConsumerConfig) -> None:
        try:
            await self.js.add_consumer(stream, cfg)
        except nats.js.errors.APIError as exc:
            if exc.err_code == STREAM_NOT_FOUND_ERR_CODE:
                raise _StreamGone(stream, cfg.name) from None
            raise BusError(f"cannot create consumer {cfg.name} on {stream}: {exc.description}") from None

    async def _bind(self) -> None:
        n = self.names
        try:
            for which in ("tickets", "traj"):
                info = await self.js.stream_info(self._stream_config(which).name)
                if which == "traj" and (info.config.max_bytes or -1) > 0:
                    self.max_bytes = info.config.max_bytes
            for name in (AGENTS_CONSUMER, TRAINER_CONSUMER):
                stream, _ = self._consumer_config(name)
                info = await self.js.consumer_info(stream, name)
                if name == TRAINER_CONSUMER and self.group_ack_wait is None:
                    self.group_ack_wait = info.config.ack_wait
            self._kv = await self.js.key_value(n.kv_bucket)
            self._obj = await self.js.object_store(n.weights_bucket)
        except (nats.js.errors.NotFoundError, nats.js.errors.BucketNotFoundError):
            raise BusError(f"the bus objects of experiment {n.experiment!r} do not exist on {self.url} "
                           "(streams, consumers, KV bucket): start the trainer first, or connect with create=True") from None
