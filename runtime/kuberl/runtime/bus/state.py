"""Shared state on the bus: the experiment's KV bucket (JSON objects by key), read, written and watched.

A mixin of Bus (client.py): needs its `_kv`, `names`, `reconnects` and `_retry`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import nats.errors
import nats.js.errors

from kuberl.runtime.aio import raise_if_cancelling
from kuberl.runtime.bus.errors import BusError
from kuberl.runtime.bus.names import KV_KEY
from kuberl.runtime.bus.streams import _best_effort

log = logging.getLogger("kuberl.runtime.bus.client")  # the name these lines always had (client.py)

WATCH_CHECK_SECONDS = 15.0  # how often an idle state watch checks that its consumer still exists


class StateMixin:
    """get_state, put_state, watch_state (survives reconnects and a re-created bucket)."""

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
                        raise_if_cancelling()  # the client may have dropped a cancel (kuberl/runtime/aio.py)
                        idle += 1.0
                        if idle >= WATCH_CHECK_SECONDS:
                            idle = 0.0
                            if not await self._watch_alive(watcher):
                                last_revision = 0  # the bucket was re-created: revisions start again
                                break
                        continue
                    idle = 0.0
                    raise_if_cancelling()
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


def _loads(data: bytes, key: str) -> dict[str, Any]:
    try:
        value = json.loads(data)
    except ValueError as exc:
        raise BusError(f"state {key!r} is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise BusError(f"state {key!r} is a JSON {type(value).__name__}, expected an object")
    return value
