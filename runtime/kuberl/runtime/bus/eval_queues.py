"""Held-out evaluation on the bus (spec.evaluation): a mixin of Bus.

The trainer publishes EvalTickets on `<prefix>.eval.tickets` and pulls EvalResults from
`<prefix>.eval.results`; the agents do the opposite. Both subjects belong to the tickets stream (a work
queue) and each has its own durable consumer (eval-agents, eval-trainer), so evaluation never shows up
in the training tickets' counts or the trainer's group stream (docs/design/contracts.md).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import nats.js.errors

from kuberl.runtime.bus.lease import Lease
from kuberl.runtime.bus.messages import EvalResult, EvalTicket, MessageError, decode_eval_result, decode_eval_ticket
from kuberl.runtime.bus.names import EVAL_AGENTS_CONSUMER, EVAL_TRAINER_CONSUMER, H_MSG_ID


class EvalQueues:
    """Needs Bus's `names`, `js`, `outage`, `_publish`, `_fetch`, `_poison`, `_retry`."""

    names: Any
    js: Any
    outage: Any
    _subs: dict[str, Any]

    def _eval_lock(self, consumer: str) -> asyncio.Lock:
        """One pull request at a time per consumer's subscription (as for training tickets)."""
        locks = self.__dict__.setdefault("_eval_pull_locks", {})
        return locks.setdefault(consumer, asyncio.Lock())

    async def publish_eval_tickets(self, tickets: list[EvalTicket]) -> int:
        """Publish evaluation tickets (msg id = eval_id: a repeat is deduplicated); returns how many were new."""
        acks = await asyncio.gather(*(self._publish(self.names.eval_tickets_subject, t.encode(), {H_MSG_ID: t.eval_id},  # type: ignore[attr-defined]
                                                    f"publish eval ticket {t.eval_id}") for t in tickets))
        return sum(not a.duplicate for a in acks)

    async def pull_eval_ticket(self, timeout: float = 0.0) -> Lease[EvalTicket] | None:
        """The next evaluation ticket, or None when none is waiting (after at most `timeout` seconds)."""
        got = await self._pull_eval(EVAL_AGENTS_CONSUMER, decode_eval_ticket, 1, timeout)
        return got[0] if got else None

    async def publish_eval_result(self, result: EvalResult) -> None:
        # msg id: one result per eval ticket, also when a redelivered ticket is evaluated twice
        await self._publish(self.names.eval_results_subject, result.encode(), {H_MSG_ID: f"r-{result.eval_id}"},  # type: ignore[attr-defined]
                            f"publish eval result {result.eval_id}")

    async def pull_eval_results(self, max_n: int = 256, timeout: float = 0.0) -> list[Lease[EvalResult]]:
        """Evaluation results waiting for the trainer (none: [] after at most `timeout` seconds)."""
        return await self._pull_eval(EVAL_TRAINER_CONSUMER, decode_eval_result, max_n, timeout)

    async def _pull_eval(self, consumer: str, decode: Any, max_n: int, timeout: float) -> list[Lease[Any]]:
        out: list[Lease[Any]] = []
        deadline = time.monotonic() + max(timeout, 0.05)
        async with self._eval_lock(consumer):
            while not out and (left := deadline - time.monotonic()) > 0.01:
                for m in await self._fetch(consumer, max_n, left):  # type: ignore[attr-defined]
                    try:
                        out.append(Lease(decode(m.data), [m], outage=self.outage))
                    except MessageError as exc:
                        await self._poison(m, exc)  # type: ignore[attr-defined]
        return out

    async def purge_eval(self) -> None:
        """Drop every evaluation ticket and result (a trainer starting over: its rounds are gone)."""
        for subject in (self.names.eval_tickets_subject, self.names.eval_results_subject):
            try:
                await self._retry(f"purge {subject}", lambda s=subject: self.js.purge_stream(self.names.tickets_stream, subject=s))  # type: ignore[attr-defined]
            except nats.js.errors.NotFoundError:
                pass
