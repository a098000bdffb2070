"""The rollout agent: takes tickets from the bus, runs the workflow on its engine, publishes trajectory groups.

Runs next to one inference engine (`kuberl rollout`, one per rollout pod). It follows the `weights`
KV key (pause the engine, load, resume, on every update), starts a ticket only on weights at least as
new as the version it was issued at, holds at most rollout.concurrency tickets at once (heartbeating
each with in_progress), applies DAPO dynamic sampling, turns a ticket that fails on every one of
rollout.maxTicketAttempts deliveries into a failed group, and stops cleanly on cancel.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kuberl.api.v1alpha1 import RLExperiment
from kuberl.runtime import reward_pool
from kuberl.runtime.aio import cancel_requested, raise_if_cancelling
from kuberl.runtime.algorithms import resolve_algorithm
from kuberl.runtime.bus import Bus, Lease, Ticket, TrajectoryGroup
from kuberl.runtime.bus.names import KEY_WEIGHTS
from kuberl.runtime.data import Item
from kuberl.runtime.evaluation import run_eval_ticket
from kuberl.runtime.inference.base import EngineError, EngineRestarted, InferenceEngine
from kuberl.runtime.rollout.workflows import EpisodeContext, RolloutWorkflow

log = logging.getLogger(__name__)

HEARTBEAT_SECONDS = 10.0  # well under the tickets' ack_wait (30 s)
BUS_WEIGHTS_KEEP = 2  # local copies of bus-mode weights kept (the one loaded and the one before)
NAK_DELAY_SECONDS = 5.0  # a failed ticket comes back after this long (another agent may take it)
WEIGHTS_POLL_SECONDS = 5.0  # a ticket waiting for newer weights re-reads the weights key this often
ENGINE_WAIT_SECONDS = 900.0  # how long an agent waits for its restarted engine before it fails (exit 1)


def default_agent_id() -> str:
    return os.environ.get("KUBERL_AGENT_ID") or f"{socket.gethostname()}-{os.getpid()}"


@dataclass
class AgentStats:
    published: int = 0
    rejected: int = 0
    failed: int = 0
    failed_groups: int = 0  # tickets given up after rollout.maxTicketAttempts failed deliveries
    started_behind: int = 0  # tickets started on weights older than their issued_version (none newer to load)
    weight_updates: int = 0
    evaluated: int = 0  # held-out evaluation tickets done (spec.evaluation)
    samples: int = 0
    reward_sum: float = 0.0
    started: float = 0.0

    @property
    def reward_timeouts(self) -> int:
        """Responses whose reward ran past workflow.rewardTimeoutSeconds (scored 0), training and evaluation."""
        return reward_pool.COUNTS.timeouts

    @property
    def rewards_refused(self) -> int:
        """Rewards that were not finite numbers (NaN, infinity): their groups were rejected."""
        return reward_pool.COUNTS.refused


class RolloutAgent:
    """One agent: bus + engine + workflow + data set items."""

    def __init__(self, exp: RLExperiment, bus: Bus, engine: InferenceEngine, workflow: RolloutWorkflow, items: list[Item], *,
                 workdir: str | Path, agent_id: str | None = None, weights_cache: str | Path | None = None,
                 log_every: float = 30.0, evaluator: Any = None) -> None:
        self.exp = exp
        self.bus = bus
        self.engine = engine
        self.workflow = workflow
        self.items = items
        self.evaluator = evaluator  # kuberl.runtime.evaluation.Evaluator: held-out tickets in slots training leaves free
        self.workdir = Path(workdir)
        self.agent_id = agent_id or default_agent_id()
        # bus mode: where downloaded weights go; the engine must see the same path (a shared emptyDir in a pod).
        self.weights_cache = Path(weights_cache or os.environ.get("KUBERL_WEIGHTS_CACHE") or self.workdir / "agent-weights" / self.agent_id)
        self.concurrency = exp.spec.rollout.concurrency
        # The resolved setting: dapo turns dynamic sampling on unless the manifest says otherwise.
        self.dynamic_sampling = resolve_algorithm(exp.spec.algorithm).dynamic_sampling
        self.stats = AgentStats()
        self._update_lock = asyncio.Lock()
        # Engine restarts (see _engine_lost): an episode that spans one is given back, never published.
        self._engine_epoch = 0
        self._engine_down = False
        self._last_weights: dict[str, Any] | None = None
        self.max_attempts = exp.spec.rollout.max_ticket_attempts
        # The version of the last weights update the follower finished (loaded or failed), and a condition
        # notified after each: tickets waiting for their issued_version wake on it.
        self._followed_version: int | None = None
        self._weights_followed = asyncio.Condition()
        self._episodes: set[asyncio.Task] = set()
        self.log_every = log_every
        # When the agent last moved (ticket taken or done, weights loaded, lost engine polled): the
        # liveness probe (health.py) fails after a long stall.
        self.last_progress = time.monotonic()

    def _progressed(self) -> None:
        self.last_progress = time.monotonic()

    @property
    def engine_down(self) -> bool:
        """True while the agent waits for its engine to come back (readiness fails meanwhile)."""
        return self._engine_down

    # -- weights -------------------------------------------------------------------------------

    async def _weights_dir(self, w: dict[str, Any]) -> str:
        version = int(w["version"])
        if w.get("mode") == "bus":
            prefix = w.get("object") or f"v{version}"
            dest = self.weights_cache / prefix
            if not (dest / "config.json").is_file():
                await self.bus.get_weights(prefix, dest)
            self._prune_cache(keep=dest)
            return str(dest)
        path = w.get("path")
        if not path:
            raise ValueError(f"weights key for v{version} has mode disk but no path: {w}")
        p = Path(path)
        return str(p if p.is_absolute() else self.workdir / p)

    def _prune_cache(self, keep: Path) -> None:
        if not self.weights_cache.is_dir():
            return
        others = sorted((d for d in self.weights_cache.iterdir() if d.is_dir() and d != keep), key=lambda d: d.stat().st_mtime)
        for d in others[: max(len(others) - (BUS_WEIGHTS_KEEP - 1), 0)]:
            shutil.rmtree(d, ignore_errors=True)

    async def apply_weights(self, w: dict[str, Any]) -> None:
        """Pause the engine, load the weights named by a `weights` KV value, resume (weightSync.inFlight keep: load, no pause)."""
        async with self._update_lock:
            version = int(w["version"])
            started = time.monotonic()
            if w.get("mode") == "broadcast":  # ask the trainer, pause, receive, resume (weight_sync/agent_side.py)
                from kuberl.runtime.weight_sync.agent_side import receive_broadcast

                version = await receive_broadcast(self, w)
            elif self.exp.spec.in_flight == "keep":
                # PipelineRL's in-flight update: vLLM runs the reload between two decoding steps; nothing is paused
                # or aborted, and responses in flight keep the version they started on (generate stamps it).
                await self.engine.update_weights_from_disk(await self._weights_dir(w), version)
            else:
                path = await self._weights_dir(w)  # download before pausing: generation goes on meanwhile
                await self.engine.pause()
                try:
                    await self.engine.update_weights_from_disk(path, version)
                finally:
                    await self.engine.resume()
            self._last_weights = w
            self.stats.weight_updates += 1
            self._progressed()
            log.info("agent %s: serving weights v%d (%s) after %.2f s", self.agent_id, version, w.get("mode"), time.monotonic() - started)

    async def load_initial_weights(self) -> None:
        """Before the first ticket: load the current weights if the trainer has published any."""
        w = await self.bus.get_state(KEY_WEIGHTS)
        if w is not None:
            await self.apply_weights(w)
        else:
            log.info("agent %s: no weights published yet; serving the initial model as v%d", self.agent_id, self.engine.version)

    async def follow_weights(self) -> None:
        """Load on every update of the `weights` key (also an older version: a trainer restarted from a checkpoint)."""
        async for w in self.bus.watch_state(KEY_WEIGHTS):
            if w == self._last_weights:
                continue  # the watch starts with the value load_initial_weights already applied
            try:
                await self.apply_weights(w)
            except Exception:
                log.exception("agent %s: loading weights v%s failed; still serving v%d", self.agent_id, w.get("version"), self.engine.version)
            finally:
                async with self._weights_followed:
                    self._followed_version = int(w["version"])
                    self._weights_followed.notify_all()

    async def wait_for_weights(self, wanted: int) -> bool:
        """Before a ticket starts: wait until the engine serves weights >= `wanted` (the ticket's issued_version).

        The trainer publishes version v before it issues tickets at v, so the `weights` key names them
        already; the follower is loading (or about to load) them. Starting on older weights would
        generate a group the trainer may drop as stale (at eta = 0, every such group). No wait when the key
        holds an older version (a trainer restarted from an earlier checkpoint) or when the follower
        tried that version and failed. Returns False if the ticket starts on older weights anyway.
        """
        while self.engine.version < wanted:
            raise_if_cancelling()  # the wait_for below may have dropped the cancel of a stopping agent (aio.py)
            if self._followed_version is not None and self._followed_version >= wanted:
                break  # the follower tried and failed (it logged why): do not hold tickets forever
            w = await self.bus.get_state(KEY_WEIGHTS)
            if w is None or int(w["version"]) < wanted:
                break  # nothing that new was published (or the trainer went back to a checkpoint)
            async with self._weights_followed:  # re-checked under the lock: a notify cannot slip by
                if self.engine.version < wanted and (self._followed_version is None or self._followed_version < wanted):
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._weights_followed.wait(), WEIGHTS_POLL_SECONDS)
        if self.engine.version >= wanted:
            return True
        self.stats.started_behind += 1
        log.warning("agent %s: ticket issued at v%d starts on v%d (no newer weights to load)", self.agent_id, wanted, self.engine.version)
        return False

    # -- episodes ------------------------------------------------------------------------------

    @staticmethod
    def all_rewards_equal(rewards: list[float]) -> bool:
        return len(rewards) > 0 and max(rewards) - min(rewards) < 1e-9

    async def _heartbeat(self, lease: Lease[Ticket]) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_SECONDS)
            with contextlib.suppress(Exception):
                await lease.in_progress()

    async def run_ticket(self, lease: Lease[Ticket]) -> TrajectoryGroup | None:
        """Roll out one ticket and publish its group; the lease is acked once the bus has the group."""
        ticket = lease.value
        if not 0 <= ticket.index < len(self.items):
            log.error("agent %s: ticket %s names item %d but the data set has %d items; dropping it",
                      self.agent_id, ticket.ticket_id, ticket.index, len(self.items))
            await lease.term()
            return None
        beat = asyncio.create_task(self._heartbeat(lease))
        epoch = self._engine_epoch
        try:
            await self.wait_for_weights(ticket.issued_version)
            ctx = EpisodeContext(ticket_id=ticket.ticket_id, seed=None)
            samples = await self.workflow.arun_episode(self.engine, self.items[ticket.index], ctx)
            if epoch != self._engine_epoch:  # its tokens may come from two engine lives (two weight loads)
                raise EngineError("the engine restarted during this episode")
            rewards = [s.reward for s in samples or []]
            rejected = samples is None or not samples or (self.dynamic_sampling and self.all_rewards_equal(rewards))
            group = TrajectoryGroup(group_id=ticket.ticket_id, ticket=ticket, samples=[] if rejected else samples,
                                    agent=self.agent_id, rejected=rejected)
            await self.bus.publish_group(group)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await asyncio.shield(lease.nak())  # give it back now rather than after ack_wait
            raise
        except EngineError as exc:
            if not exc.permanent:
                return await self._give_back(lease, exc)
            # The engine refuses this item for good (e.g. prompt longer than the context): reject it so
            # its slot returns to the trainer instead of bouncing between agents forever.
            log.error("agent %s: ticket %s (item %d) rejected: %s", self.agent_id, ticket.ticket_id, ticket.index, exc)
            rejected, rewards = True, []
            group = TrajectoryGroup(group_id=ticket.ticket_id, ticket=ticket, agent=self.agent_id, rejected=True)
            await self.bus.publish_group(group)
        except Exception as exc:  # noqa: BLE001  any failure: the ticket goes back for another try, up to a bound
            if lease.delivered < self.max_attempts:
                return await self._give_back(lease, exc)
            rejected, rewards = True, []
            group = await self._fail(lease, exc)
            if group is None:
                return None
        finally:
            beat.cancel()
            self._progressed()
        await lease.ack()
        if group.failure is not None:
            self.stats.failed_groups += 1
        elif rejected:
            self.stats.rejected += 1
        else:
            self.stats.published += 1
            self.stats.samples += len(rewards)
            self.stats.reward_sum += sum(rewards)
        return group

    async def _give_back(self, lease: Lease[Ticket], exc: Exception) -> None:
        self.stats.failed += 1
        if not self._engine_down and (isinstance(exc, EngineRestarted) or not await self.engine.health()):
            self._engine_lost(exc)  # gone, or back with its initial weights: wait for it, then load the current ones
        log.error("agent %s: ticket %s failed (delivery %d of at most %d), giving it back: %s", self.agent_id,
                  lease.value.ticket_id, lease.delivered, self.max_attempts, exc, exc_info=exc)
        with contextlib.suppress(Exception):
            await lease.nak(delay=NAK_DELAY_SECONDS)

    async def _fail(self, lease: Lease[Ticket], exc: Exception) -> TrajectoryGroup | None:
        """A poison ticket: it failed on its last allowed delivery. Publish it as a failed (rejected) group,
        so the trainer counts it and gives its slot back; None if even that could not be published."""
        self.stats.failed += 1
        ticket = lease.value
        reason = f"{type(exc).__name__}: {exc}"[:500]
        log.error("agent %s: ticket %s (item %d) failed on all %d deliveries, giving up on it: %s", self.agent_id,
                  ticket.ticket_id, ticket.index, lease.delivered, reason, exc_info=exc)
        group = TrajectoryGroup(group_id=ticket.ticket_id, ticket=ticket, agent=self.agent_id, rejected=True, failure=reason)
        try:
            await self.bus.publish_group(group)
        except Exception as pub:  # noqa: BLE001  the bus is down: the ticket comes back, and fails again
            log.error("agent %s: could not publish failed group %s: %s", self.agent_id, ticket.ticket_id, pub)
            with contextlib.suppress(Exception):
                await lease.nak(delay=NAK_DELAY_SECONDS)
            return None
        return group

    # -- engine lost -----------------------------------------------------------------------------

    def _engine_lost(self, exc: Exception) -> None:
        """The engine stopped answering (killed, OOM): take no ticket until it is back with the current weights."""
        self._engine_down = True
        self._engine_epoch += 1
        log.warning("agent %s: engine at %s is not answering (%s); its tickets go back, waiting for it to restart",
                    self.agent_id, getattr(self.engine, "url", "?"), exc)

    async def _engine_back(self) -> None:
        """Wait for the restarted engine (launcher or kubelet), then load the current weights into it:
        a new engine serves the initial model, whatever version the agent last loaded."""
        started = time.monotonic()
        while not await self.engine.health():
            self._progressed()
            if time.monotonic() - started > ENGINE_WAIT_SECONDS:
                raise EngineError(f"engine at {getattr(self.engine, 'url', '?')} not back after {ENGINE_WAIT_SECONDS:.0f}s")
            await asyncio.sleep(1.0)
        while True:
            w = await self.bus.get_state(KEY_WEIGHTS)
            try:
                if w is not None:
                    await self.apply_weights(w)
                else:
                    self.engine.set_version(0)
                break
            except EngineError as exc:  # answering health checks, not yet reloads: try again
                if time.monotonic() - started > ENGINE_WAIT_SECONDS:
                    raise
                log.warning("agent %s: loading weights into the restarted engine failed (%s); retrying", self.agent_id, exc)
                await asyncio.sleep(2.0)
        self._engine_down = False
        log.info("agent %s: engine back after %.0f s, serving v%d", self.agent_id, time.monotonic() - started, self.engine.version)

    async def _report(self) -> None:
        while True:
            await asyncio.sleep(self.log_every)
            s = self.stats
            rate = (s.published + s.rejected) / max(time.monotonic() - s.started, 1e-9)
            mean = s.reward_sum / s.samples if s.samples else float("nan")
            log.info("agent %s: %d groups published, %d rejected, %d failed attempts, %d failed groups, %d started behind "
                     "(%.2f groups/s), mean reward %.3f, %d reward timeouts, v%d, %d in flight", self.agent_id, s.published, s.rejected,
                     s.failed, s.failed_groups, s.started_behind, rate, mean, s.reward_timeouts, self.engine.version, len(self._episodes))

    def _start(self, episode: Any, name: str, slots: asyncio.Semaphore) -> None:
        task = asyncio.create_task(episode, name=name)
        self._episodes.add(task)
        task.add_done_callback(lambda t: (self._episodes.discard(t), slots.release()))

    @staticmethod
    async def _stop_if_cancelled(lease: Lease | None) -> None:
        """A pull may return its ticket and drop the cancel that stops this agent (kuberl/runtime/aio.py): give the
        ticket back at once (an episode task cancelled before it starts could not) and stop."""
        if cancel_requested():
            if lease is not None:
                with contextlib.suppress(Exception):
                    await lease.nak()
            raise asyncio.CancelledError

    async def run(self, max_tickets: int | None = None) -> AgentStats:
        """Take tickets until cancelled (or `max_tickets` are done); then cancel the episodes in flight."""
        self.stats.started = time.monotonic()
        await self.load_initial_weights()
        follower = asyncio.create_task(self.follow_weights(), name="follow-weights")
        reporter = asyncio.create_task(self._report(), name="report")
        slots = asyncio.Semaphore(self.concurrency)
        taken = 0
        try:
            while max_tickets is None or taken < max_tickets:
                self._progressed()
                if follower.done():
                    follower.result()  # re-raise: without weight updates the agent must not go on
                await slots.acquire()
                if self._engine_down:
                    slots.release()
                    await self._engine_back()
                    continue
                lease = await self.bus.pull_ticket(timeout=1.0 if self.evaluator is None else 0.3)
                await self._stop_if_cancelled(lease)
                self._progressed()
                if lease is None:
                    # No training ticket waiting: the free slot may take a held-out evaluation ticket.
                    if self.evaluator is not None and (ev := await self.bus.pull_eval_ticket(timeout=0.3)) is not None:
                        await self._stop_if_cancelled(ev)
                        self._start(run_eval_ticket(self, ev), f"eval-{ev.value.eval_id}", slots)
                        continue
                    slots.release()
                    continue
                taken += 1
                if lease.delivered > 1:  # the work queue gave it again: its holder died or handed it back
                    log.info("agent %s: ticket %s redelivered (delivery %d)", self.agent_id, lease.value.ticket_id, lease.delivered)
                self._start(self.run_ticket(lease), f"ticket-{lease.value.ticket_id}", slots)
            if self._episodes:
                await asyncio.gather(*list(self._episodes), return_exceptions=True)
        finally:
            for t in [follower, reporter, *self._episodes]:
                t.cancel()
            await asyncio.gather(follower, reporter, *self._episodes, return_exceptions=True)
        return self.stats
