"""Opening the NATS connection for a Bus: retry for a while at start-up, then reconnect forever.

Called by Bus.connect. Errors name the URL (without credentials) and the likely fix.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import nats.errors
from nats.aio.client import Client as NATS

from kuberl.runtime.bus.errors import BusError

log = logging.getLogger(__name__)


def redact(url: str) -> str:
    """The URL without user:password, for messages and logs."""
    parts = urlsplit(url)
    if parts.username or parts.password:
        host = parts.hostname or ""
        return urlunsplit((parts.scheme, f"***@{host}" + (f":{parts.port}" if parts.port else ""), parts.path, "", ""))
    return url


async def open_connection(url: str, token: str | None, wait: float, name: str,
                          on_reconnect: Callable[[], None] | None = None) -> NATS:
    """Connect, retrying for `wait` seconds; then reconnect forever on later disconnects
    (calling `on_reconnect` each time the connection is back)."""
    nc = NATS()
    last: list[BaseException] = []
    state = {"logged": 0.0}

    async def error_cb(exc: BaseException) -> None:
        last[:] = [exc]
        if _is_auth_error(exc):
            state["auth"] = 1.0  # later attempts may only see the server hang up: remember the cause
        now = time.monotonic()
        if nc.is_connected and now - state["logged"] > 30:  # rate-limited: a long outage logs every 30 s
            state["logged"] = now
            log.warning("bus %s: %s", redact(url), exc)

    async def disconnected_cb() -> None:
        if nc.is_closed:  # our own close()
            return
        log.warning("bus %s: disconnected; reconnecting", redact(url))

    async def reconnected_cb() -> None:
        log.info("bus %s: reconnected", redact(url))
        if on_reconnect is not None:
            on_reconnect()

    opts: dict[str, Any] = {
        "servers": [url], "name": name, "connect_timeout": min(5.0, max(wait, 0.5)), "allow_reconnect": True,
        "max_reconnect_attempts": -1, "reconnect_time_wait": 0.5, "error_cb": error_cb,
        "disconnected_cb": disconnected_cb, "reconnected_cb": reconnected_cb,
        "pending_size": 64 * 1024 * 1024,  # buffer while reconnecting: a few large groups
    }
    if token:
        opts["token"] = token
    try:
        await asyncio.wait_for(nc.connect(**opts), timeout=wait)
    except (TimeoutError, OSError, nats.errors.Error) as exc:
        err = last[0] if last else exc
        try:
            await nc.close()
        except Exception as close_exc:  # noqa: BLE001 - a half-open client; the error below matters
            log.debug("closing the failed connection: %s", close_exc)
        hint = ""
        if state.get("auth") or _is_auth_error(err):
            hint = ": authorization failed, check KUBERL_BUS_TOKEN"
        raise BusError(f"cannot reach the bus at {redact(url)} within {wait:.0f}s ({type(err).__name__}: {err}){hint}") from None
    return nc


def _is_auth_error(exc: BaseException) -> bool:
    return isinstance(exc, nats.errors.AuthorizationError) or "authorization" in str(exc).lower()
