"""The trainer's ticket book: B's StalenessManager (the bound) and TicketIssuer (the data order), plus
the one rule the trainer adds: never start more groups than training will use.

    capacity(v) = min(StalenessManager.capacity(v),  total_groups - started)

with StalenessManager's bound started = issued - rejected - dropped <= (eta + v + 1) * B (AReaL) and
its concurrency cap running = started - accepted <= maxConcurrentRollouts: the trainer calls
`on_accepted` as soon as a usable group arrives, so the next groups are issued while it trains.
The issuer runs without an epoch limit: rejected and dropped groups are replaced by further items,
so training by epochs may reach a little into the next pass rather than stall. `state()` is what the
checkpoint and the KV key `tickets` hold; `load_state` restores it from the checkpoint, and
`catch_up` then moves it forward to the KV copy: tickets issued between the checkpoint and a crash
are still on the bus (or their groups are), so a restarted trainer does not issue them again. That
matters once a restart comes later than the streams' dedupe window (1 h), which would no longer
catch the repeated ids and would roll out, and train on, those prompts twice.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any

from kuberl.runtime.bus.messages import Ticket
from kuberl.runtime.staleness import StalenessManager, TicketIssuer

log = logging.getLogger(__name__)


class TicketBook:
    def __init__(self, num_items: int, batch_size: int, eta: int, *, seed: int = 1, shuffle: bool = True,
                 max_concurrent: int | None = None, total_groups: int | None = None):
        if num_items < 1:
            raise ValueError(f"dataset: needs at least one item, got {num_items}")
        self.num_items = num_items
        self.total_groups = total_groups
        self.bound = StalenessManager(batch_size, eta, max_concurrent)
        self.issuer = TicketIssuer(num_items, seed=seed, shuffle=shuffle)

    # counters, as B's StalenessManager keeps them
    issued = property(lambda self: self.bound.issued)
    rejected = property(lambda self: self.bound.rejected)
    dropped = property(lambda self: self.bound.dropped)
    consumed = property(lambda self: self.bound.consumed)
    accepted = property(lambda self: self.bound.accepted)
    started = property(lambda self: self.bound.started)
    running = property(lambda self: self.bound.running)

    @property
    def epoch(self) -> int:
        """The epoch the next ticket belongs to."""
        return self.issuer.epoch

    def capacity(self, version: int) -> int:
        room = self.bound.capacity(version)
        if self.total_groups is not None:
            room = min(room, self.total_groups - self.bound.started)
        return max(room, 0)

    def next_tickets(self, version: int) -> list[Ticket]:
        """The tickets to publish now; counted as issued."""
        tickets = self.issuer.issue(self.capacity(version), version)
        self.bound.on_issued(len(tickets))
        return tickets

    def on_accepted(self) -> None:
        """A usable group arrived: its concurrency slot is free (AReaL's on_rollout_accepted)."""
        self.bound.on_accepted()

    def on_rejected(self) -> None:
        self.bound.on_rejected()

    def on_dropped(self, *, accepted: bool = False) -> None:
        self.bound.on_dropped(accepted=accepted)

    def on_consumed(self, n: int) -> None:
        self.bound.on_consumed(n)

    def state(self) -> dict[str, Any]:
        return {**self.bound.to_state(), **self.issuer.to_state(), "started": self.bound.started}

    def load_state(self, state: dict[str, Any]) -> None:
        self.bound = StalenessManager.from_state(state, batch_size=self.bound.batch_size, max_head_offpolicyness=self.bound.eta,
                                                 max_concurrent=self.bound.max_concurrent)
        self.issuer = TicketIssuer.from_state(state, self.num_items, seed=self.issuer.seed, shuffle=self.issuer.shuffle)

    def catch_up(self, bus_state: dict[str, Any] | None) -> int:
        """After a restart from a checkpoint: count the tickets the bus's copy of the book (KV `tickets`)
        has issued beyond the checkpoint as issued, without publishing them again. Returns how many.

        The copy is ignored (0) when absent, behind the checkpoint, or made with another data order.
        """
        if not bus_state:
            return 0
        try:
            ahead = TicketIssuer.from_state(bus_state, self.num_items, seed=self.issuer.seed, shuffle=self.issuer.shuffle)
        except ValueError as exc:
            log.warning("KV tickets does not match this run (%s): issuing from the checkpoint's position", exc)
            return 0
        n = ahead.issued_total - self.issuer.issued_total
        if n <= 0:
            return 0
        self.issuer = ahead
        self.bound.on_issued(n)
        return n


class SeenGroups:
    """The ids of the last `size` groups the trainer took off the bus, to spot a group that arrives twice.

    Ticket ids never repeat within a run, so a repeat is a duplicate: the same ticket rolled out twice
    (re-issued after a restart beyond the dedupe window, or published by two agents). Counting it again
    would train the prompt twice and break the staleness accounting.
    """

    def __init__(self, size: int):
        self.size = size
        self._order: deque[str] = deque()
        self._ids: set[str] = set()

    def add(self, group_id: str) -> bool:
        """Remember `group_id`; False if it was seen already."""
        if group_id in self._ids:
            return False
        self._order.append(group_id)
        self._ids.add(group_id)
        if len(self._order) > self.size:
            self._ids.discard(self._order.popleft())
        return True
