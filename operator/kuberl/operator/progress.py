"""Training progress for the operator, read from the experiment's bus KV (nats-py), and control requests.

Called by kuberl.operator.handlers (status, autoscaling, suspend). The names come from
docs/design/contracts.md, re-derived here because the operator never imports kuberl.runtime:
KV bucket `kuberl_{E}` (E = name upper-cased, '-' -> '_', then `_{R}` for the run R, upper-cased with
'.' and '-' -> '_'), keys `progress` and `control`. The run (naming.bus_run: namespace and uid) keeps
another namespace's experiment of the same name, or an earlier one re-created, out of this one's status.
A bus that cannot be reached yields None (no progress yet), never an exception in the handlers.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("kuberl.operator.progress")


@dataclass(frozen=True)
class NatsCreds:
    """A NATS user's `.creds` file (JWT and seed) and the inbox prefix its permissions allow: the operator's
    own user on a shared account (kuberl.operator.bus_users). Hashable: connections are kept per credential."""

    text: str = field(repr=False)
    inbox_prefix: str


# How the operator authenticates to a bus: a token (an external bus's credentials Secret), a
# (user, password) pair (the embedded bus's `operator` user, builders.bus_auth), a minted user
# (NatsCreds: a shared NATS with accountSigningKeySecret) or nothing.
Credentials = str | tuple[str, str] | NatsCreds | None
KEY_PROGRESS = "progress"
KEY_CONTROL = "control"


def kv_bucket(experiment: str, run: str = "") -> str:
    e = experiment.upper().replace("-", "_")
    if run:
        e += "_" + run.upper().replace("-", "_").replace(".", "_")
    return f"kuberl_{e}"


async def _quiet(exc: Exception) -> None:
    """nats-py logs every connection error with a traceback; an absent bus is normal while it starts."""
    log.debug("nats: %s", exc)


async def _quiet_event() -> None:
    return None


def _auth(credentials: Credentials) -> dict[str, Any]:
    if isinstance(credentials, NatsCreds):
        from nats.aio.client import RawCredentials

        return {"user_credentials": RawCredentials(credentials.text), "inbox_prefix": credentials.inbox_prefix}
    if isinstance(credentials, tuple):
        return {"user": credentials[0], "password": credentials[1]}
    return {"token": credentials} if credentials else {}


class BusReader:
    """One shared NATS connection per bus (url, token): every experiment on one NATS URL with the same
    credentials reads through the same connection. Connects are serialised per key only (a bus that
    hangs on connect delays no other bus), and the KV handle of each bucket is kept, so a read is one
    round trip (no stream-info lookup per read). Reads progress, writes control requests."""

    def __init__(self, connect_timeout: float = 2.0, failure_backoff: float = 10.0):
        self._conns: dict[tuple[str, Credentials], Any] = {}
        self._kvs: dict[tuple[str, Credentials], dict[str, Any]] = {}
        self._failed_at: dict[tuple[str, Credentials], float] = {}
        self._locks: dict[tuple[str, Credentials], asyncio.Lock] = {}
        self.connect_timeout = connect_timeout
        self.failure_backoff = failure_backoff  # a bus that is still starting must not slow every tick
        self.connects = 0  # connection attempts made (the scale tests and the benchmark read it)

    async def _connection(self, key: tuple[str, Credentials]) -> Any | None:
        import nats

        async with self._locks.setdefault(key, asyncio.Lock()):
            nc = self._conns.get(key)
            if nc is not None and not nc.is_connected:
                await self._forget(key)
                nc = None
            if nc is None:
                if time.monotonic() - self._failed_at.get(key, -1e9) < self.failure_backoff:
                    return None
                self.connects += 1
                try:
                    nc = await nats.connect(key[0], **_auth(key[1]), connect_timeout=self.connect_timeout,
                                            max_reconnect_attempts=1, allow_reconnect=False, name="kuberl-operator",
                                            error_cb=_quiet, disconnected_cb=_quiet_event, closed_cb=_quiet_event)
                except Exception as exc:  # noqa: BLE001 - nats-py raises many kinds; all mean 'no bus now'
                    self._failed_at[key] = time.monotonic()
                    log.debug("bus %s not reachable: %s", key[0], exc)
                    return None
                self._conns[key] = nc
            return nc

    async def _kv(self, url: str, token: Credentials, experiment: str, run: str = "") -> Any | None:
        from nats.js.errors import BucketNotFoundError

        key = (url, token)
        nc = await self._connection(key)
        if nc is None:
            return None
        bucket = kv_bucket(experiment, run)
        kvs = self._kvs.setdefault(key, {})
        if bucket in kvs:
            return kvs[bucket]
        try:
            kv = await nc.jetstream().key_value(bucket)
        except BucketNotFoundError:
            return None
        except Exception as exc:  # noqa: BLE001 - nats-py raises many kinds; all mean 'no bus now'
            log.debug("bus KV of %s not readable: %s", experiment, exc)
            if not nc.is_connected:
                await self._forget(key)
            return None
        kvs[bucket] = kv
        return kv

    async def _forget(self, key: tuple[str, Credentials]) -> None:
        self._kvs.pop(key, None)
        nc = self._conns.pop(key, None)
        if nc is not None:
            try:
                await nc.close()
            except Exception as exc:  # noqa: BLE001 - closing a broken connection may fail; it is gone either way
                log.debug("closing the bus connection: %s", exc)

    async def read(self, url: str, token: Credentials, experiment: str, key: str = KEY_PROGRESS, *,
                   run: str = "") -> dict[str, Any] | None:
        """The JSON value of a KV key (default: progress) of `experiment`'s `run`, or None."""
        from nats.js.errors import KeyNotFoundError

        kv = await self._kv(url, token, experiment, run)
        if kv is None:
            return None
        try:
            entry = await kv.get(key)
        except KeyNotFoundError:
            return None
        except Exception as exc:  # noqa: BLE001 - nats-py raises many kinds; all mean 'no bus now'
            log.debug("reading %s of %s failed: %s", key, experiment, exc)
            self._kvs.get((url, token), {}).pop(kv_bucket(experiment, run), None)  # looked up afresh next time
            return None
        try:
            value = json.loads(entry.value or b"null")
        except ValueError:
            log.warning("bus key %s of %s is not JSON; ignored", key, experiment)
            return None
        return value if isinstance(value, dict) else None

    async def request_checkpoint(self, url: str, token: Credentials, experiment: str, request_id: str, *, run: str = "") -> bool:
        """Ask the trainer for a checkpoint (control.checkpoint_request); False if the bus is unreachable."""
        kv = await self._kv(url, token, experiment, run)
        if kv is None:
            return False
        control = await self.read(url, token, experiment, KEY_CONTROL, run=run) or {"stop": False}
        control["checkpoint_request"] = request_id
        try:
            await kv.put(KEY_CONTROL, json.dumps(control).encode())
            return True
        except Exception as exc:  # noqa: BLE001 - nats-py raises many kinds; all mean 'no bus now'
            log.warning("could not ask %s for a checkpoint: %s", experiment, exc)
            return False

    def open_connections(self) -> int:
        return sum(1 for nc in self._conns.values() if nc.is_connected)

    async def close(self) -> None:
        for key in list(self._conns):
            await self._forget(key)
