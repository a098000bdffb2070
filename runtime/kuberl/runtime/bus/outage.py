"""Riding out a bus outage: the retry loop of every Bus call, and how long it waits for a restarted nats-server.

Used by Bus._retry (publishes, KV reads and writes, stream info) and Lease.ack. While the connection
is down the call waits (nats-py reconnects forever); once it is back, the server gets publish_timeout
to answer; a call gives up only after that, or after the outage limit ($KUBERL_BUS_OUTAGE_SECONDS).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import nats.errors
import nats.js.errors

from kuberl.env import env_seconds
from kuberl.runtime.bus.errors import BusError, BusFullError

log = logging.getLogger(__name__)
T = TypeVar("T")

OUTAGE_ENV = "KUBERL_BUS_OUTAGE_SECONDS"
OUTAGE_SECONDS = 600.0
"""How long a call waits for a bus that went away (a nats-server restart takes seconds; a rescheduled pod, minutes)."""

# Transient conditions while the server restarts or the client reconnects: retried (a publish is safe to
# repeat, its msg id dedupes).
TRANSIENT = (
    nats.errors.TimeoutError, nats.errors.NoRespondersError, nats.errors.ConnectionReconnectingError,
    nats.errors.ConnectionClosedError, nats.errors.StaleConnectionError, nats.errors.OutboundBufferLimitError,
    nats.js.errors.NoStreamResponseError, nats.js.errors.ServiceUnavailableError, asyncio.TimeoutError, ConnectionError,
)
FULL = {10077, 10078, 10047}  # JetStream: maximum bytes / messages exceeded, insufficient resources


# Subjects (lower-cased, as nats-py reports them) of calls whose refusal changes nothing.
BEST_EFFORT_SUBJECTS = (".stream.msg.delete.",)


def outage_seconds() -> float:
    return env_seconds(OUTAGE_ENV, OUTAGE_SECONDS)


class Outage:
    """Follows one connection's ups and downs; `deadline(started)` is when a call begun then gives up.

    A call gives up publish_timeout after it started, or after the connection last came back if that is
    later; never while the connection is down; and in any case outage seconds after it started.
    """

    def __init__(self, nc: Any, publish_timeout: float, outage: float | None = None) -> None:
        self.nc = nc
        self.publish_timeout = publish_timeout
        self.outage = outage_seconds() if outage is None else outage
        self.back_at = 0.0  # monotonic time of the last reconnect
        self.reconnects = 0
        self.denied: tuple[float, str] | None = None  # (monotonic time, message) of the last refusal

    def on_denied(self, message: str) -> None:
        """The server refused a publish or subscription (the NATS user's permissions). Refused
        best-effort clean-ups (an agent deleting its orphan chunks: the trainer's sweep removes them)
        are not counted: they must not turn another call's timeout into a refusal."""
        if not any(part in message.lower() for part in BEST_EFFORT_SUBJECTS):
            self.denied = (time.monotonic(), message)

    def denied_since(self, started: float) -> str | None:
        return self.denied[1] if self.denied is not None and self.denied[0] >= started else None

    def on_reconnect(self) -> None:
        self.back_at = time.monotonic()
        self.reconnects += 1

    @property
    def connected(self) -> bool:
        return bool(self.nc.is_connected)

    def deadline(self, started: float, tried: float | None = None) -> float:
        """When a call begun at `started` gives up, its last try having begun at `tried`. A try sent before
        the connection last came back may have been lost with the old connection (a request buffered while
        reconnecting, answered by nobody): it never counts, so the server always gets a whole try after it is back."""
        cap = started + max(self.outage, self.publish_timeout)
        if not self.connected and not self.nc.is_closed or tried is not None and tried < self.back_at:
            return cap
        return min(cap, max(started, self.back_at) + self.publish_timeout)

    def why(self) -> str:
        if self.nc.is_closed:
            return "the connection is closed"
        if not self.connected:
            return f"disconnected for more than {self.outage:.0f}s (${OUTAGE_ENV})"
        return f"not answering for {self.publish_timeout:.0f}s"


async def retry(outage: Outage, url: str, what: str, fn: Callable[[], Awaitable[T]],
                on_missing_stream: Callable[[], Awaitable[None]] | None = None) -> T:
    """fn() until it succeeds, sleeping 0.1 s doubling to 2 s between tries, while the bus may come back.

    Raises BusFullError on a full stream, BusError when the outage lasts too long or JetStream refuses,
    and lets NotFoundError through (the caller decides what a missing key means).
    """
    started = time.monotonic()
    delay = 0.1
    while True:
        tried = time.monotonic()
        try:
            return await fn()
        except nats.js.errors.ServiceUnavailableError as exc:
            if exc.err_code in FULL:
                raise BusFullError(f"{what}: the stream is full ({exc.description}): the trainer is not keeping up "
                                   "with the agents; retry later, or raise the bus size") from None
            failure = f"unavailable ({exc.description})"
        except nats.js.errors.NoStreamResponseError:
            # A server that lost its store (no PVC) answers nothing on our subjects: re-create the streams.
            if on_missing_stream is not None and outage.connected:
                try:
                    await on_missing_stream()
                    log.warning("bus: streams were missing on %s; re-created them", url)
                except Exception as exc:  # noqa: BLE001 - retried on the next attempt
                    log.debug("re-creating streams failed: %s", exc)
            failure = "no stream answers (deleted?)"
        except TRANSIENT as exc:
            if (denied := outage.denied_since(started)) is not None:  # a refused request is never answered
                raise BusError(f"{what}: the bus at {url} refused it ({denied.removeprefix('nats: ')}): "
                               "this role's NATS user may not do that") from None
            failure = type(exc).__name__
        except nats.js.errors.NotFoundError:
            raise
        except nats.js.errors.APIError as exc:
            raise BusError(f"{what}: {getattr(exc, 'description', None) or exc} (code {getattr(exc, 'err_code', None)})") from None
        if outage.nc.is_closed or time.monotonic() + delay > outage.deadline(started, tried):
            raise BusError(f"{what}: bus at {url} {outage.why()} ({failure})") from None
        await asyncio.sleep(delay)
        delay = min(delay * 2, 2.0)
