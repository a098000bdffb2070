"""The Bus: one experiment's trajectory bus on NATS JetStream (tickets, groups, KV state, weights).

The trainer publishes tickets, pulls trajectory groups and writes state; rollout agents pull tickets,
publish groups and watch the `weights` key. Names and message fields follow docs/design/contracts.md.
Usage: `bus = await Bus.connect(url, "my-exp")`, then `async with bus: ...` or `await bus.close()`.

This module holds the connection (connect, close, retry through outages, publish) and stream_info; the
rest are mixins, one module per seam: streams.py (tickets and trajectory groups), state.py (KV state),
object_store.py (weights), eval_queues.py (held-out evaluation), topology.py (creating the objects).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable
from typing import Any, Self, TypeVar

import nats.errors
from nats.aio.client import Client as NATS
from nats.js import api

from kuberl.runtime.bus.chunks import ChunkAssembler
from kuberl.runtime.bus.connection import bus_credentials, open_connection, redact
from kuberl.runtime.bus.errors import BusError, BusFullError, GroupTooLargeError
from kuberl.runtime.bus.eval_queues import EvalQueues
from kuberl.runtime.bus.lease import Lease
from kuberl.runtime.bus.names import AGENTS_CONSUMER, TRAINER_CONSUMER, BusNames
from kuberl.runtime.bus.object_store import ObjectStoreMixin
from kuberl.runtime.bus.outage import Outage, retry
from kuberl.runtime.bus.server import parse_max_payload, parse_size
from kuberl.runtime.bus.state import StateMixin
from kuberl.runtime.bus.streams import StreamsMixin
from kuberl.runtime.bus.topology import Topology

__all__ = ["Bus", "BusError", "BusFullError", "GroupTooLargeError", "Lease"]

log = logging.getLogger(__name__)
T = TypeVar("T")


class Bus(StreamsMixin, StateMixin, ObjectStoreMixin, EvalQueues, Topology):
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
