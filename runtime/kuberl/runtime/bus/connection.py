"""Opening the NATS connection for a Bus: retry for a while at start-up, then reconnect forever.

Called by Bus.connect. Errors name the URL (without credentials) and the likely fix.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.client import RawCredentials

from kuberl.runtime.bus.errors import BusError

log = logging.getLogger(__name__)
TOKEN_ENV, USER_ENV, PASSWORD_ENV = "KUBERL_BUS_TOKEN", "KUBERL_BUS_USER", "KUBERL_BUS_PASSWORD"
# A shared NATS in JWT mode: the role's own user (a .creds file's text, minted by the operator) and the
# reply-subject prefix its permissions allow (kuberl.operator.builders.bus_auth).
CREDS_ENV, INBOX_ENV = "KUBERL_BUS_CREDS", "KUBERL_BUS_INBOX"


def redact(url: str) -> str:
    """The URL without user:password, for messages and logs."""
    parts = urlsplit(url)
    if parts.username or parts.password:
        host = parts.hostname or ""
        return urlunsplit((parts.scheme, f"***@{host}" + (f":{parts.port}" if parts.port else ""), parts.path, "", ""))
    return url


def bus_credentials(token: str | None, user: str | None, password: str | None) -> tuple[str | None, str | None, str | None]:
    """(token, user, password): those given, else $KUBERL_BUS_TOKEN, $KUBERL_BUS_USER, $KUBERL_BUS_PASSWORD.
    A token or a user with its password, not both: ValueError names what is wrong (never a value)."""
    token = token if token is not None else (os.environ.get(TOKEN_ENV) or None)
    user = user if user is not None else (os.environ.get(USER_ENV) or None)
    password = password if password is not None else (os.environ.get(PASSWORD_ENV) or None)
    creds = os.environ.get(CREDS_ENV) or None
    if creds and (token or user or password):
        raise ValueError(f"bus credentials: {CREDS_ENV} (a NATS user's credentials) goes alone, without {TOKEN_ENV} or {USER_ENV}")
    if token and (user or password):
        raise ValueError(f"bus credentials: set a token ({TOKEN_ENV}) or a user and password ({USER_ENV}, {PASSWORD_ENV}), not both")
    if bool(user) != bool(password):
        raise ValueError(f"bus credentials: {USER_ENV} and {PASSWORD_ENV} go together; only {'the user' if user else 'the password'} is set")
    return token, user, password


async def open_connection(url: str, token: str | None, wait: float, name: str,
                          on_reconnect: Callable[[], None] | None = None, *, user: str | None = None,
                          password: str | None = None, on_denied: Callable[[str], None] | None = None) -> NATS:
    """Connect with a token or a user and password (or neither), retrying for `wait` seconds; then
    reconnect forever on later disconnects (calling `on_reconnect` each time the connection is back).
    `on_denied(message)` hears of each publish or subscription the server refused (a NATS user's
    permissions): the server only says so asynchronously, the refused request itself gets no answer."""
    nc = NATS()
    last: list[BaseException] = []
    state = {"logged": 0.0}

    async def error_cb(exc: BaseException) -> None:
        if _is_permission_error(exc):
            log.debug("bus %s: %s", redact(url), exc)
            if on_denied is not None:
                on_denied(str(exc))
            return
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

    creds = os.environ.get(CREDS_ENV) if not (token or user) else None
    opts: dict[str, Any] = {
        "servers": [url], "name": name, "connect_timeout": min(5.0, max(wait, 0.5)), "allow_reconnect": True,
        "max_reconnect_attempts": -1, "reconnect_time_wait": 0.5, "error_cb": error_cb,
        "disconnected_cb": disconnected_cb, "reconnected_cb": reconnected_cb,
        "pending_size": 64 * 1024 * 1024,  # buffer while reconnecting: a few large groups
    }
    if token:
        opts["token"] = token
    if creds:
        opts["user_credentials"] = RawCredentials(creds)
    if inbox := os.environ.get(INBOX_ENV):
        opts["inbox_prefix"] = inbox
    if user:
        opts["user"], opts["password"] = user, password
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
            what = "KUBERL_BUS_USER and KUBERL_BUS_PASSWORD" if user else "KUBERL_BUS_TOKEN"
            if creds:
                what = f"{CREDS_ENV} (the operator-minted user: was the account or its signing key changed?)"
            hint = f": authorization failed, check {what}"
        elif "maximum control line exceeded" in str(err).lower():
            hint = (": the server refused the user's JWT as too long: set `max_control_line: 16KB` in its config "
                    "(docs/operations.md, A shared external NATS)")
        raise BusError(f"cannot reach the bus at {redact(url)} within {wait:.0f}s ({type(err).__name__}: {err}){hint}") from None
    return nc


def _is_auth_error(exc: BaseException) -> bool:
    return isinstance(exc, nats.errors.AuthorizationError) or "authorization" in str(exc).lower()


def _is_permission_error(exc: BaseException) -> bool:
    return "permissions violation" in str(exc).lower()
