"""Every training step's metrics row on the experiment's bus, so the whole curve of a cluster run can be read back.

The trainer (rank 0) appends each metrics.jsonl row to the stream `KUBERL_{E}_METRICS` (subject
`kuberl[.{run}].{exp}.metrics`, names in kuberl.runtime.bus.names), one message per step with
`Nats-Msg-Id: step-{N}`, so a step published twice (a retried publish, a restarted trainer) is kept
once; `kuberl plot <experiment>` reads the stream back whole (`read_rows`). Limits: 200,000 messages
and 128 MiB, oldest dropped first, so 100,000 steps of ~1 KB rows fit. `group_ids` (the audit list of
a step's groups) stays in metrics.jsonl only: it grows with the batch and no curve needs it.

Publishing never blocks or fails training: `MetricsPublisher.publish(row)` queues the row and returns;
a background task sends the queue in step order, and while the bus is away it keeps the rows (up to
100,000), logs one warning, retries with a backoff up to 30 s and says when it caught up.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import time
from collections.abc import Iterable
from typing import Any

import nats.errors
import nats.js.errors
from nats.js import api

from kuberl.runtime.bus.names import H_MSG_ID, BusNames

log = logging.getLogger(__name__)

MAX_STEPS = 100_000  # steps the stream is sized for (and rows the publisher keeps while the bus is away)
MAX_MSGS = 2 * MAX_STEPS  # room for steps redone after a restart from an older checkpoint
MAX_BYTES = 128 * 1024 * 1024
DUPLICATE_WINDOW = 24 * 3600.0  # a step id is remembered a day (one short id per step: little server memory)
FETCH_BATCH = 1000
NOT_IN_STREAM = ("group_ids",)  # kept in metrics.jsonl only


class MetricsError(Exception):
    """The metrics stream cannot be read: missing, or a message that is not a metrics row."""


# -- the wire format (pure) -------------------------------------------------------------------------


def msg_id(step: int) -> str:
    return f"step-{step}"


def encode_row(row: dict[str, Any]) -> tuple[bytes, dict[str, str]]:
    """The message of one metrics row: its JSON (without group_ids) and its dedupe header."""
    step = row.get("step")
    if not isinstance(step, int) or isinstance(step, bool):
        raise ValueError(f"a metrics row needs an integer step, got {step!r}")
    body = {k: v for k, v in row.items() if k not in NOT_IN_STREAM}
    return json.dumps(body, separators=(",", ":")).encode(), {H_MSG_ID: msg_id(step)}


def decode_rows(payloads: Iterable[bytes], source: str) -> list[dict[str, Any]]:
    """Rows from the stream's messages, one per step (the last message of a step wins), sorted by step."""
    by_step: dict[int, dict[str, Any]] = {}
    for n, data in enumerate(payloads, 1):
        try:
            row = json.loads(data)
        except (ValueError, UnicodeDecodeError) as exc:
            raise MetricsError(f"{source}: message {n} is not JSON ({exc})") from None
        if not isinstance(row, dict) or not isinstance(row.get("step"), int) or isinstance(row.get("step"), bool):
            raise MetricsError(f"{source}: message {n} is not a metrics row (an object with an integer step)")
        by_step[row["step"]] = row
    return [by_step[s] for s in sorted(by_step)]


def stream_config(names: BusNames) -> api.StreamConfig:
    return api.StreamConfig(
        name=names.metrics_stream, subjects=[names.metrics_subject], retention=api.RetentionPolicy.LIMITS,
        storage=api.StorageType.FILE, discard=api.DiscardPolicy.OLD, max_msgs=MAX_MSGS, max_bytes=MAX_BYTES,
        duplicate_window=DUPLICATE_WINDOW, num_replicas=1)


async def ensure_stream(js: Any, names: BusNames, *, fresh: bool = False) -> None:
    """Create the metrics stream if missing; `fresh` deletes it first (a fresh start reuses step ids)."""
    if fresh:
        try:
            await js.delete_stream(names.metrics_stream)
        except nats.js.errors.NotFoundError:
            pass
    try:
        await js.stream_info(names.metrics_stream)
    except nats.js.errors.NotFoundError:
        try:
            await js.add_stream(stream_config(names))
        except nats.js.errors.BadRequestError:  # created meanwhile
            await js.stream_info(names.metrics_stream)


# -- the trainer's side -----------------------------------------------------------------------------


class MetricsPublisher:
    """Sends metrics rows to the stream in the background. `await MetricsPublisher.start(bus, fresh=...)`,
    then `publish(row)` per step (never blocks, never raises) and `await close()` at the end."""

    def __init__(self, js: Any, names: BusNames, *, url: str, max_payload: int, keep: int = MAX_STEPS,
                 max_backoff: float = 30.0) -> None:
        self.js, self.names, self.url, self.max_payload = js, names, url, max_payload
        self.keep, self.max_backoff = keep, max_backoff
        self._queue: collections.deque[tuple[int, bytes, dict[str, str]]] = collections.deque()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._fresh = False
        self._ready = False
        self._failing_since: float | None = None
        self.published = 0  # rows the stream took (duplicates included: the server keeps them once)
        self.dropped = 0  # rows given up: too large, or the queue was full

    @classmethod
    async def start(cls, bus: Any, *, fresh: bool) -> MetricsPublisher:
        """Publisher on `bus` (a kuberl.runtime.bus.Bus); `fresh` (no checkpoint) starts the stream over."""
        pub = cls(bus.js, bus.names, url=bus.url, max_payload=bus.chunk_size)
        pub._fresh = fresh
        pub._task = asyncio.create_task(pub._run(), name="kuberl-metrics-publisher")
        return pub

    def publish(self, row: dict[str, Any]) -> None:
        try:
            data, headers = encode_row(row)
        except (ValueError, TypeError) as exc:
            self.dropped += 1
            log.error("metrics stream: not publishing a row: %s", exc)
            return
        if len(data) > self.max_payload:
            self.dropped += 1
            log.error("metrics stream: step %s's row is %d bytes, above the bus's %d: kept in metrics.jsonl only",
                      row["step"], len(data), self.max_payload)
            return
        if len(self._queue) >= self.keep:
            self._queue.popleft()
            self.dropped += 1
            if self.dropped == 1:
                log.warning("metrics stream: %d rows waiting for the bus; dropping the oldest (metrics.jsonl keeps them)", self.keep)
        self._queue.append((row["step"], data, headers))
        self._wake.set()

    @property
    def pending(self) -> int:
        return len(self._queue)

    async def _send(self, step: int, data: bytes, headers: dict[str, str]) -> None:
        if not self._ready:
            await ensure_stream(self.js, self.names, fresh=self._fresh)
            self._ready, self._fresh = True, False
        try:
            await self.js.publish(self.names.metrics_subject, data, headers=headers, timeout=5.0, stream=self.names.metrics_stream)
        except nats.js.errors.NoStreamResponseError:
            self._ready = False  # the stream is gone (a bus that lost its store): create it again
            raise

    async def _run(self) -> None:
        delay = 0.5
        while True:
            if not self._queue:
                self._wake.clear()
                await self._wake.wait()
                continue
            step, data, headers = self._queue[0]
            try:
                await self._send(step, data, headers)
            except asyncio.CancelledError:
                raise
            except nats.js.errors.APIError as exc:
                if isinstance(exc, (nats.js.errors.ServiceUnavailableError, nats.js.errors.NoStreamResponseError)):
                    await self._failed(exc, delay)
                    delay = min(delay * 2, self.max_backoff)
                    continue
                self._queue.popleft()  # refused for good (e.g. a message above the stream's limit)
                self.dropped += 1
                log.error("metrics stream refused step %d: %s", step, exc)
                continue
            except Exception as exc:  # noqa: BLE001 - a bus hiccup of any kind: keep the row, try again later
                await self._failed(exc, delay)
                delay = min(delay * 2, self.max_backoff)
                continue
            self._queue.popleft()
            self.published += 1
            delay = 0.5
            if self._failing_since is not None:
                log.warning("metrics stream: publishing again after %.0f s; %d rows still queued",
                            time.monotonic() - self._failing_since, len(self._queue))
                self._failing_since = None

    async def _failed(self, exc: BaseException, delay: float) -> None:
        if self._failing_since is None:
            self._failing_since = time.monotonic()
            log.warning("metrics stream on %s: cannot publish (%s: %s); training goes on, rows are kept and retried",
                        self.url, type(exc).__name__, exc)
        else:
            log.debug("metrics stream: still failing: %s", exc)
        await asyncio.sleep(delay)

    async def close(self, timeout: float = 10.0) -> None:
        """Wait up to `timeout` s for the queued rows, then stop; what is left is logged (metrics.jsonl has it)."""
        deadline = time.monotonic() + timeout
        while self._queue and self._task is not None and not self._task.done() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            except Exception as exc:  # noqa: BLE001 - the worker never raises; be safe at exit
                log.debug("metrics publisher: %s", exc)
        if self._queue:
            log.warning("metrics stream: %d rows (steps %d..%d) not published at exit; metrics.jsonl has them",
                        len(self._queue), self._queue[0][0], self._queue[-1][0])


# -- the reader's side ------------------------------------------------------------------------------


async def read_rows(js: Any, names: BusNames, *, timeout: float = 30.0) -> list[dict[str, Any]]:
    """Every row in the experiment's metrics stream, one per step, sorted. [] when the stream is empty;
    MetricsError when there is no stream (the trainer has not started, or predates the stream)."""
    source = f"stream {names.metrics_stream}"
    try:
        info = await js.stream_info(names.metrics_stream)
    except nats.js.errors.NotFoundError:
        raise MetricsError(f"no metrics stream {names.metrics_stream} on the bus: the trainer of {names.experiment!r} "
                           "has not reported a step yet") from None
    if not info.state.messages:
        return []
    cfg = api.ConsumerConfig(ack_policy=api.AckPolicy.NONE, deliver_policy=api.DeliverPolicy.ALL, inactive_threshold=60.0,
                             mem_storage=True, filter_subject=names.metrics_subject)
    sub = await js.pull_subscribe(names.metrics_subject, stream=names.metrics_stream, config=cfg)
    payloads: list[bytes] = []
    deadline = time.monotonic() + timeout
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise MetricsError(f"{source}: read {len(payloads)} of about {info.state.messages} messages in {timeout:.0f} s")
            try:
                msgs = await sub.fetch(FETCH_BATCH, timeout=min(left, 5.0))
            except (TimeoutError, nats.errors.TimeoutError):
                if len(payloads) >= info.state.messages:  # nothing more (and none published meanwhile)
                    break
                continue
            payloads.extend(m.data for m in msgs)
            if msgs and msgs[-1].metadata.num_pending == 0:
                break
    finally:
        for what, aw in (("unsubscribe", sub.unsubscribe()), ("delete consumer", js.delete_consumer(names.metrics_stream, cfg.name))):
            try:
                await aw
            except Exception as exc:  # noqa: BLE001 - the ephemeral consumer goes away by itself (inactive_threshold)
                log.debug("%s: %s", what, exc)
    return decode_rows(payloads, source)
