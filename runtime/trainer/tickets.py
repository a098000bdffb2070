"""The trainer's ticket book: B's StalenessManager (the bound) and TicketIssuer (the data order), plus
the one rule the trainer adds: never start more groups than training will use.

    capacity(v) = min(StalenessManager.capacity(v),  total_groups - started)

with StalenessManager's bound started = issued - rejected - dropped <= (eta + v + 1) * B (AReaL).
The issuer runs without an epoch limit: rejected and dropped groups are replaced by further items,
so training by epochs may reach a little into the next pass rather than stall. `state()` is what the
checkpoint and the KV key `tickets` hold; `load_state` restores it (ids re-issued after a restart are
the same, so the bus deduplicates them).
"""

from __future__ import annotations

from typing import Any

from kuberl.runtime.bus.messages import Ticket
from kuberl.runtime.staleness import StalenessManager, TicketIssuer


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
    started = property(lambda self: self.bound.started)

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

    def on_rejected(self) -> None:
        self.bound.on_rejected()

    def on_dropped(self) -> None:
        self.bound.on_dropped()

    def on_consumed(self, n: int) -> None:
        self.bound.on_consumed(n)

    def state(self) -> dict[str, Any]:
        return {**self.bound.to_state(), **self.issuer.to_state(), "started": self.bound.started}

    def load_state(self, state: dict[str, Any]) -> None:
        self.bound = StalenessManager.from_state(state, batch_size=self.bound.batch_size, max_head_offpolicyness=self.bound.eta,
                                                 max_concurrent=self.bound.max_concurrent)
        self.issuer = TicketIssuer.from_state(state, self.num_items, seed=self.issuer.seed, shuffle=self.issuer.shuffle)
