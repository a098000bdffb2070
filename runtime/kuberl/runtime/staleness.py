"""Bounded staleness (AReaL) and ticket issuing: the trainer's accounting of what may be rolled out.

The trainer owns one StalenessManager and one TicketIssuer: it asks `capacity(v)` how many tickets it
may publish, issues them in the data set's seeded order, and saves both states in checkpoints and in
the bus KV key `tickets`. Pure classes: no I/O, no clock.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kuberl.runtime.bus.messages import Ticket

_COUNTERS = ("issued", "rejected", "dropped", "consumed")


@dataclass
class StalenessManager:
    """How many trajectory groups may start now, so none is trained more than eta versions late.

    With policy version v, B = batch_size groups per step, eta = max_head_offpolicyness and
    C = max_concurrent (AReaL's max_concurrent_rollouts):

        started      = issued - rejected - dropped          (accepted + running)
        running      = started - accepted                   (issued, not yet back on the bus)
        capacity(v)  = min((eta + v + 1) * B - started,  C - running)        (clamped at 0)

    The first term is AReaL's staleness bound: by the time a group is trained (at version >= v) at
    most eta versions passed since it started. eta = 0 is synchronous RL: B groups per version.
    The second caps groups being generated: a group frees its concurrency slot when it is accepted
    (arrives on the bus, usable), not when it is trained, so the engines keep generating while the
    trainer trains (AReaL's `running`, decremented on accept). No cap when C is None.
    Rejected groups (e.g. dynamic sampling) and groups dropped as stale give both slots back.
    A group whose head version < v - eta (`is_stale`: a straggler, or one started under an older
    bound, e.g. before a restart) is trained and counted like any other (consumed) by default, as
    AReaL does; with staleness.dropStaleGroups the trainer drops it (`on_dropped`) and re-issues its
    slot, which biases training toward short answers (the stragglers are the longest).

    `accepted` is not saved: a checkpoint acknowledges exactly the groups it trained (consumed) and
    the rejected/dropped ones, so accepted-but-untrained groups come back after a restart and are
    accepted again. A restored manager therefore starts with accepted = consumed.
    """

    batch_size: int
    max_head_offpolicyness: int
    max_concurrent: int | None = None
    issued: int = 0
    rejected: int = 0
    dropped: int = 0
    consumed: int = 0
    accepted: int | None = None  # usable groups taken off the bus (trained or waiting); None = consumed

    def __post_init__(self) -> None:
        if self.accepted is None:
            self.accepted = self.consumed
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ValueError(f"batch_size (algorithm.batchSize) must be an int >= 1, got {self.batch_size!r}")
        if not isinstance(self.max_head_offpolicyness, int) or self.max_head_offpolicyness < 0:
            raise ValueError(f"max_head_offpolicyness (staleness.maxHeadOffpolicyness) must be an int >= 0, got {self.max_head_offpolicyness!r}")
        if self.max_concurrent is not None and (not isinstance(self.max_concurrent, int) or self.max_concurrent < 1):
            raise ValueError(f"max_concurrent (staleness.maxConcurrentRollouts) must be an int >= 1 or None, got {self.max_concurrent!r}")
        for name in (*_COUNTERS, "accepted"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise ValueError(f"{name} must be an int >= 0, got {getattr(self, name)!r}")
        self._check()

    @property
    def eta(self) -> int:
        return self.max_head_offpolicyness

    @property
    def started(self) -> int:
        """Groups accepted or running: issued minus those given back."""
        return self.issued - self.rejected - self.dropped

    @property
    def running(self) -> int:
        """Groups issued whose group has not come back yet (being generated, or waiting for an agent)."""
        return self.started - self.accepted

    @property
    def in_flight(self) -> int:
        """Groups issued but not yet consumed, rejected or dropped (accepted ones waiting included)."""
        return self.started - self.consumed

    def capacity(self, version: int) -> int:
        """How many more tickets may be issued at policy version `version`."""
        if version < 0:
            raise ValueError(f"policy version must be >= 0, got {version}")
        cap = (self.eta + version + 1) * self.batch_size - self.started
        if self.max_concurrent is not None:
            cap = min(cap, self.max_concurrent - self.running)
        return max(cap, 0)

    def on_issued(self, n: int = 1) -> None:
        self.issued += _count(n)

    def on_accepted(self, n: int = 1) -> None:
        """Usable groups arrived on the bus: their concurrency slots are free (their staleness slots are not)."""
        self.accepted += _count(n)
        self._check()

    def on_rejected(self, n: int = 1) -> None:
        """A group came back rejected: its slot is free again."""
        self.rejected += _count(n)
        self._check()

    def on_dropped(self, n: int = 1, *, accepted: bool = False) -> None:
        """The trainer dropped a stale group: its slot is free again. `accepted`: the groups had been
        accepted before (kept waiting, then judged stale), so they leave the accepted count."""
        self.dropped += _count(n)
        if accepted:
            self.accepted -= n
        self._check()

    def on_consumed(self, n: int = 1) -> None:
        """The trainer trained on a group (a trained group was accepted: counted so if the caller did not)."""
        self.consumed += _count(n)
        self.accepted = max(self.accepted, self.consumed)
        self._check()

    def is_stale(self, head_version: int | None, version: int) -> bool:
        """True if a group whose oldest token came from `head_version` is too old to train at `version`.
        A group with no generated token (head_version None) is never stale."""
        return head_version is not None and head_version < version - self.eta

    def _check(self) -> None:
        # accepted >= consumed: trained groups were accepted; name whichever count broke the sum.
        name, count = ("accepted", self.accepted) if self.accepted > self.consumed else ("consumed", self.consumed)
        if self.rejected + self.dropped + count > self.issued:
            raise ValueError(
                f"staleness accounting broken: rejected {self.rejected} + dropped {self.dropped} + {name} "
                f"{count} > issued {self.issued} (a group counted twice, or groups from another run on the bus?)"
            )

    def to_state(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in _COUNTERS}

    @classmethod
    def from_state(cls, state: dict[str, Any], *, batch_size: int, max_head_offpolicyness: int,
                   max_concurrent: int | None = None) -> StalenessManager:
        """Restore the counters from `to_state()` output (other keys, e.g. the issuer's, are ignored)."""
        missing = [k for k in _COUNTERS if k not in state]
        if missing:
            raise ValueError(f"ticket accounting state lacks {missing}: got keys {sorted(state)}")
        return cls(batch_size, max_head_offpolicyness, max_concurrent, **{k: state[k] for k in _COUNTERS})


def _count(n: int) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"count must be an int >= 0, got {n!r}")
    return n


def ticket_id(epoch: int, index: int, position: int) -> str:
    """Deterministic id, so a trainer restarted from a checkpoint re-issues the same ids (deduplicated)."""
    return f"e{epoch}-i{index}-{position}"


class TicketIssuer:
    """Walks the data set in a seeded, per-epoch shuffled order and issues one Ticket per item.

    State = (epoch, position): the next ticket is item `order(epoch)[position]`. The order depends only
    on (seed, epoch, dataset_size), so restoring the state continues exactly where a checkpoint left off.
    `epochs` None = endless; else `exhausted` turns True after that many passes. `on_epoch_end(epoch)`
    is called when the last item of an epoch has been issued.
    """

    def __init__(self, dataset_size: int, *, seed: int = 1, shuffle: bool = True, epochs: int | None = None,
                 epoch: int = 0, position: int = 0, on_epoch_end: Callable[[int], None] | None = None) -> None:
        if isinstance(dataset_size, bool) or not isinstance(dataset_size, int) or dataset_size < 1:
            raise ValueError(f"dataset_size must be an int >= 1, got {dataset_size!r} (is the data set empty?)")
        if epochs is not None and epochs < 1:
            raise ValueError(f"epochs (training.epochs) must be >= 1 or None, got {epochs!r}")
        if epoch < 0 or not 0 <= position < dataset_size:
            raise ValueError(f"issuer state out of range: epoch {epoch}, position {position} (dataset_size {dataset_size})")
        self.dataset_size = dataset_size
        self.seed = seed
        self.shuffle = shuffle
        self.epochs = epochs
        self.epoch = epoch
        self.position = position
        self.on_epoch_end = on_epoch_end
        self._order_epoch: int | None = None
        self._order: list[int] = []

    def order(self, epoch: int) -> list[int]:
        """Item indices of `epoch`, in issue order."""
        if self._order_epoch != epoch:
            items = list(range(self.dataset_size))
            if self.shuffle:
                random.Random(f"kuberl-{self.seed}-{epoch}").shuffle(items)
            self._order, self._order_epoch = items, epoch
        return self._order

    @property
    def exhausted(self) -> bool:
        return self.epochs is not None and self.epoch >= self.epochs

    @property
    def issued_total(self) -> int:
        return self.epoch * self.dataset_size + self.position

    def issue(self, n: int, version: int) -> list[Ticket]:
        """The next n tickets (fewer once the last epoch is issued)."""
        out: list[Ticket] = []
        for _ in range(_count(n)):
            if self.exhausted:
                break
            index = self.order(self.epoch)[self.position]
            out.append(Ticket(ticket_id=ticket_id(self.epoch, index, self.position), index=index,
                              epoch=self.epoch, issued_version=version))
            self.position += 1
            if self.position == self.dataset_size:
                finished = self.epoch
                self.epoch, self.position = self.epoch + 1, 0
                if self.on_epoch_end is not None:
                    self.on_epoch_end(finished)
        return out

    def to_state(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "dataset_size": self.dataset_size, "shuffle": self.shuffle}

    @classmethod
    def from_state(cls, state: dict[str, Any], dataset_size: int, *, seed: int = 1, shuffle: bool = True,
                   epochs: int | None = None, on_epoch_end: Callable[[int], None] | None = None) -> TicketIssuer:
        """Continue from `to_state()` output; refuses a state made with another data set size, seed or shuffle."""
        for key, now in (("dataset_size", dataset_size), ("seed", seed), ("shuffle", shuffle)):
            if key in state and state[key] != now:
                raise ValueError(f"ticket state was saved with {key}={state[key]!r} but the run has {key}={now!r}: "
                                 "the data order would differ; resume with the same data set and spec.seed")
        missing = [k for k in ("epoch", "position") if k not in state]
        if missing:
            raise ValueError(f"ticket state lacks {missing}: got keys {sorted(state)}")
        return cls(dataset_size, seed=seed, shuffle=shuffle, epochs=epochs, epoch=state["epoch"],
                   position=state["position"], on_epoch_end=on_epoch_end)
