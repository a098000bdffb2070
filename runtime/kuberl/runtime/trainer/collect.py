"""Trainer stages on rank 0's bus side: issue tickets, catch up on resume, collect B usable groups.

Every group pulled is accounted here: duplicates, rejected, failed (poison tickets) and malformed groups
give their ticket slot back and are held for the next checkpoint's ack. A group older than v - eta (a
straggler the ticket gate let start in time) is trained and counted in `over_stale`, as AReaL does: the
decoupled loss's behaviour weight corrects it. Dropping it instead (staleness.dropStaleGroups) biases
training toward short answers, since the groups overtaken are those still generating their longest ones.
A mixin of `Trainer` (runtime/kuberl/runtime/trainer/trainer.py), which owns the state these methods read and set.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from kuberl.runtime.algorithms import dynamic_sampling_keep
from kuberl.runtime.errors import ConfigError
from kuberl.runtime.trainer.batch import group_size_error

log = logging.getLogger("kuberl.trainer")


class CollectMixin:
    """train.issue_tickets and train.collect (rank 0 only: the ticket book and the bus live there)."""

    async def stage_issue_tickets(self) -> int:
        """train.issue_tickets: top the ticket queue up to the staleness bound at the current version."""
        tickets = self.book.next_tickets(self.version)
        if tickets:
            await self.bus.publish_tickets(tickets)
            await self.bus.put_tickets(self.book.state())
        return len(tickets)

    async def stage_catch_up(self) -> int:
        """On resume: tickets issued after the checkpoint are still on the bus; do not issue them again."""
        n = self.book.catch_up(await self.bus.get_tickets())
        if n:
            log.info("resume: %d tickets issued after the checkpoint are still on the bus (they or their groups "
                     "come back): not issuing them again", n)
        return n

    def _first_time(self, group: Any, handle: Any) -> bool:
        """False for a group id already taken in this process: it is held for the ack and otherwise ignored."""
        if self.seen.add(group.group_id):
            return True
        self.duplicates += 1
        self.held.append(handle)
        log.warning("group %s arrived twice (the same ticket rolled out again): the copy is ignored", group.group_id)
        return False

    def warn_stale_drop(self) -> None:
        """At start (rank 0): staleness.dropStaleGroups trains on a sample of the data biased toward short answers."""
        if self.drop_stale:
            log.warning("staleness.dropStaleGroups is on: groups older than v - %d are dropped and re-issued. The groups "
                        "overtaken are those still generating their longest answers, so training is biased toward shorter, "
                        "easier answers than were sampled; leave it off to train every group (the behaviour-weight cap "
                        "corrects the stragglers)", self.eta)

    def _usable(self, group: Any, accepted: bool = False) -> bool:
        """Account for a group that cannot be trained on (rejected, malformed; stale with staleness.dropStaleGroups);
        True if usable. `accepted`: the group was accepted before (kept from an interrupted collect) and is judged again."""
        if group.rejected or (self.cfg.dynamic_sampling and not dynamic_sampling_keep([s.reward for s in group.samples])):
            self.book.on_rejected()
            if getattr(group, "failure", None) is not None:  # a poison ticket: accounted like a rejected group
                self.failed_groups += 1
                self.failed_in_a_row += 1
                self.last_failure = f"item {group.ticket.index}: {group.failure}"[:500]
                log.warning("group %s failed on every delivery (item %d), its slot is given back: %s",
                            group.group_id, group.ticket.index, group.failure)
            return False
        if self.book.bound.is_stale(group.head_version, self.version):
            if self.drop_stale:  # opt-in; the ticket gate makes stale groups rare (slow agents, restarts)
                self.book.on_dropped(accepted=accepted)
                self.dropped_stale += 1
                log.info("dropped group %s: head version %d < %d - %d", group.group_id, group.head_version, self.version, self.eta)
                return False
        if (why := group_size_error(len(group.samples), self.n, self.ragged)) is not None:
            log.warning("group %s %s: treated as rejected", group.group_id, why)
            self.book.on_rejected()
            return False
        self.failed_in_a_row = 0
        return True

    @property
    def max_failed_in_a_row(self) -> int:
        """Failed groups in a row (none usable between them) that stop the run: max(8, 2 batches), at most 64. A run
        whose every episode fails (an agent calling an endpoint the proxy lacks, a reward that always raises) would
        otherwise wait forever at step 0 with the reason only in the rollout agents' logs."""
        return max(8, min(2 * self.B, 64))

    async def _after_failures(self, before: int) -> None:
        """New failed groups: shown in progress at once (the launcher's line, status.progress), and past
        max_failed_in_a_row in a row the run stops, as a configuration error (exit 2: a restart fails the same way)."""
        if self.failed_groups == before:
            return
        if self.failed_in_a_row >= self.max_failed_in_a_row:
            raise ConfigError(f"the last {self.failed_in_a_row} trajectory groups all failed and none could be trained; "
                              f"the latest: {self.last_failure} (each agent's log has every failure)")
        await self.bus.put_progress(self._progress_base())

    async def stage_collect(self) -> dict[str, Any]:
        """train.collect: pull until B usable groups; rejected ones (and stale ones, with staleness.dropStaleGroups) give
        their slot back (a new ticket).

        Returns the plan every rank follows: {"groups", "wait_seconds"}, or {"checkpoint_request"} (answer an
        operator's request between steps), {"weights_resync"} (weightSync.mode broadcast: send the current weights to
        engines that asked, weight_sync/sender.py), or {"stop"}.
        """
        t0 = time.monotonic()
        last_seen = t0
        # Groups kept from an interrupted collect may have gone stale meanwhile: judge them again (dropStaleGroups).
        kept, self.buffer = self.buffer, []
        for group, handle in kept:
            if self._usable(group, accepted=True):
                self.buffer.append((group, handle))
            else:
                self.held.append(handle)
        while len(self.buffer) < self.B:
            await self.finish_checkpoint(wait=False)  # a checkpoint written behind training: committed as soon as it is written
            if self.stop_reason is not None:
                return {"stop": self.stop_reason}
            control = await self.bus.get_control()
            if control.get("stop"):
                return {"stop": "control.stop"}
            request = control.get("checkpoint_request")
            if request and request != self.answered_request:
                return {"checkpoint_request": request}
            sender = getattr(self, "weight_sender", None)  # weightSync.mode broadcast: an engine asked for the weights
            if sender is not None and sender.pending():
                return {"weights_resync": True}
            got = await self.bus.fetch_groups(self.B - len(self.buffer), timeout=1.0)
            if got:
                last_seen = time.monotonic()
            elif self.collect_timeout is not None and time.monotonic() - last_seen > self.collect_timeout:
                raise TimeoutError(f"no trajectory group arrived for {self.collect_timeout:.0f}s (are rollout agents running?)")
            failed_before = self.failed_groups
            for group, handle in got:
                if not self._first_time(group, handle):
                    continue
                if self._usable(group):
                    self.book.on_accepted()  # its concurrency slot is free now, not once it is trained (AReaL)
                    self.buffer.append((group, handle))
                else:
                    self.held.append(handle)  # acknowledged with the next checkpoint, like trained groups
            await self._after_failures(failed_before)
            await self.stage_issue_tickets()  # replacements for rejected/dropped groups
        taken, self.buffer = self.buffer[: self.B], self.buffer[self.B :]
        self.held.extend(h for _, h in taken)
        self._count_over_stale(g for g, _ in taken)
        return {"groups": [g.model_dump(mode="json") for g, _ in taken], "wait_seconds": time.monotonic() - t0}

    def _count_over_stale(self, groups: Any) -> None:
        """Count the groups about to be trained whose head version is older than v - eta (counted once: when trained).
        Always none with staleness.dropStaleGroups, whose _usable dropped them at this version."""
        late = [g for g in groups if self.book.bound.is_stale(g.head_version, self.version)]
        self.over_stale += len(late)
        for g in late:
            log.info("training group %s over the staleness bound: head version %d < %d - %d (the behaviour-weight cap "
                     "corrects it)", g.group_id, g.head_version, self.version, self.eta)
