"""The trainer's ticket book: how many rollouts may start, which data set item each ticket names.

AReaL's staleness bound with the trainer as the authority (Fu et al. 2025): at policy version v with
B groups per step,
    started = issued - rejected - dropped <= (eta + v + 1) * B
    started - consumed <= max_concurrent        (when maxConcurrentRollouts is set)
    started <= total_groups                     (never more than training will use)
Rejected (dynamic sampling) and dropped (too stale) groups give their slot back, so a replacement is
issued. Ticket ids are deterministic in the data set position, so re-issuing after a restart dedupes.
Pure bookkeeping (no bus): the Trainer publishes what `next_tickets` returns and saves `state()`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from kuberl.runtime.data import epoch_order


@dataclass
class TicketBook:
    num_items: int
    batch_size: int
    eta: int
    seed: int = 1
    shuffle: bool = True
    max_concurrent: int | None = None
    total_groups: int | None = None
    # Accounting (saved in checkpoints and in KV `tickets`).
    issued: int = 0
    rejected: int = 0
    dropped: int = 0
    consumed: int = 0

    def __post_init__(self) -> None:
        if self.num_items < 1:
            raise ValueError(f"dataset: needs at least one item, got {self.num_items}")
        self._order_cache: tuple[int, list[int]] | None = None

    @property
    def started(self) -> int:
        return self.issued - self.rejected - self.dropped

    @property
    def position(self) -> int:
        """The next data set position (issued tickets so far, over all epochs)."""
        return self.issued

    @property
    def epoch(self) -> int:
        return self.issued // self.num_items

    def capacity(self, version: int) -> int:
        """How many more tickets may be issued now at policy version `version`."""
        room = (self.eta + version + 1) * self.batch_size - self.started
        if self.max_concurrent is not None:
            room = min(room, self.max_concurrent - (self.started - self.consumed))
        if self.total_groups is not None:
            room = min(room, self.total_groups - self.started)
        return max(room, 0)

    def item_at(self, position: int) -> tuple[int, int]:
        """(epoch, data set index) of a position: a fresh seeded permutation each epoch."""
        epoch, offset = divmod(position, self.num_items)
        if self._order_cache is None or self._order_cache[0] != epoch:
            self._order_cache = (epoch, epoch_order(self.num_items, epoch, self.seed, self.shuffle))
        return epoch, self._order_cache[1][offset]

    @staticmethod
    def ticket_id(epoch: int, index: int, position: int) -> str:
        return f"e{epoch}-i{index}-{position}"

    def next_tickets(self, version: int) -> list[dict[str, Any]]:
        """The tickets to issue now (as Ticket fields); counts them as issued."""
        out = []
        for _ in range(self.capacity(version)):
            epoch, index = self.item_at(self.issued)
            out.append({"ticket_id": self.ticket_id(epoch, index, self.issued), "index": index, "epoch": epoch, "issued_version": version})
            self.issued += 1
        return out

    def on_rejected(self) -> None:
        self.rejected += 1

    def on_dropped(self) -> None:
        self.dropped += 1

    def on_consumed(self, n: int) -> None:
        self.consumed += n

    def state(self) -> dict[str, Any]:
        d = {k: v for k, v in asdict(self).items() if k in ("issued", "rejected", "dropped", "consumed")}
        return {**d, "epoch": self.epoch, "position": self.position, "started": self.started}

    def load_state(self, state: dict[str, Any]) -> None:
        for key in ("issued", "rejected", "dropped", "consumed"):
            if key not in state:
                raise ValueError(f"ticket state: missing {key!r} (checkpoint written by another version?)")
            setattr(self, key, int(state[key]))
