"""Held-out evaluation (spec.evaluation): the trainer's schedule and aggregation, the agents' episodes.

Trainer (rank 0), through `EvalSchedule.poll` once per step report: after every `everySteps` steps (and
after the last one) it publishes one EvalTicket per held-out item at the current policy version; it pulls
whatever results arrived (never waiting) and returns the metrics of each round that is complete, under
`eval/...` keys (the `kuberl plot` eval panel and the trackers take them as they are). `finish` waits for
the rounds still open once training is done. Evaluation tickets never touch the TicketBook: they are not
trained on and take no staleness slot.

Agents: `Evaluator.run` rolls out one held-out item with the experiment's workflow, `samples` sampled
responses at evaluation.temperature and one greedy (temperature 0) response, and returns the rewards.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

from kuberl.runtime.bus.messages import EvalResult, EvalTicket

log = logging.getLogger(__name__)

DEFAULT_FINISH_TIMEOUT = 900.0  # seconds the trainer waits for open rounds after the last step


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: 1 - C(n-c, k) / C(n, k) (Chen et al., 2021)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


@dataclass
class EvalRound:
    """The results of one round (one evaluated step) as they arrive."""

    step: int
    version: int
    items: int
    started: float = field(default_factory=time.time)
    results: dict[int, EvalResult] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return len(self.results) >= self.items

    def metrics(self, ks: list[int], correct: float) -> dict[str, Any]:
        """eval/* metrics of the round (means over the items that did not fail) plus evaluated_* facts."""
        ok = [r for r in self.results.values() if r.failure is None]
        out: dict[str, Any] = {"evaluated_step": self.step, "evaluated_policy_version": self.version, "evaluated_items": len(ok),
                               "evaluated_failed_items": len(self.results) - len(ok),
                               "evaluated_version_min": min((r.version for r in ok), default=self.version),
                               "eval_seconds": time.time() - self.started}
        sampled = [r for r in ok if r.rewards]
        if sampled:
            rewards = [x for r in sampled for x in r.rewards]
            out["eval/reward_mean"] = sum(rewards) / len(rewards)
            for k in ks:
                vals = [pass_at_k(len(r.rewards), sum(x >= correct for x in r.rewards), k) for r in sampled if len(r.rewards) >= k]
                if vals:
                    out[f"eval/pass_at_{k}"] = sum(vals) / len(vals)
        greedy = [r.greedy_reward for r in ok if r.greedy_reward is not None]
        if greedy:
            out["eval/greedy_reward_mean"] = sum(greedy) / len(greedy)
            out["eval/pass_at_1_greedy"] = sum(g >= correct for g in greedy) / len(greedy)
        return out


def progress_view(metrics: dict[str, Any]) -> dict[str, Any]:
    """The bus `progress` key's `eval` object (status.progress.eval) from a round's metrics."""
    return {"step": metrics["evaluated_step"], "policy_version": metrics["evaluated_policy_version"], "items": metrics["evaluated_items"],
            "reward_mean": metrics.get("eval/reward_mean"), "greedy_reward_mean": metrics.get("eval/greedy_reward_mean"),
            "pass_at_1_greedy": metrics.get("eval/pass_at_1_greedy"),
            "pass_at_k": {k.removeprefix("eval/pass_at_"): v for k, v in metrics.items() if k.startswith("eval/pass_at_") and k[-1].isdigit()},
            "time": time.time()}


class EvalSchedule:
    """The trainer's side: when to evaluate, the tickets, and the rounds' metrics. Rank 0 only."""

    def __init__(self, spec: Any, num_items: int, total_steps: int) -> None:
        self.spec, self.num_items, self.total_steps = spec, num_items, total_steps
        self.rounds: dict[int, EvalRound] = {}  # open rounds by step
        self.issued: set[int] = set()
        self.last: dict[str, Any] | None = None  # progress_view of the last finished round
        self._purged = False

    @classmethod
    def from_experiment(cls, spec: Any, total_steps: int) -> EvalSchedule | None:
        """None without spec.evaluation; the held-out items are loaded (ConfigError-worthy DatasetError if they cannot be)."""
        if spec.evaluation is None:
            return None
        from kuberl.runtime.data import load_eval_items

        return cls(spec.evaluation, len(load_eval_items(spec)), total_steps)

    def due(self, step: int) -> bool:
        return step > 0 and step not in self.issued and (step % self.spec.every_steps == 0 or step >= self.total_steps)

    def tickets(self, step: int, version: int) -> list[EvalTicket]:
        return [EvalTicket(eval_id=f"s{step}-i{i}", step=step, index=i, version=version, samples=self.spec.samples_per_prompt,
                           greedy=self.spec.greedy) for i in range(self.num_items)]

    def add(self, result: EvalResult) -> None:
        rnd = self.rounds.get(result.step)
        if rnd is None or not 0 <= result.index < rnd.items:
            log.info("evaluation result %s belongs to no open round: ignored", result.eval_id)
            return
        rnd.results[result.index] = result  # a repeat (redelivered ticket) replaces the first

    def finished_rounds(self) -> list[dict[str, Any]]:
        """Metrics of each round completed since the last call, oldest first; they are forgotten here."""
        done = []
        for step in sorted(s for s, r in self.rounds.items() if r.complete):
            m = self.rounds.pop(step).metrics(self.spec.pass_at_k, self.spec.correct_reward)
            self.last = progress_view(m)
            log.info("evaluation of step %d (v%d, %d items): %s", step, m["evaluated_policy_version"], m["evaluated_items"],
                     " ".join(f"{k.removeprefix('eval/')} {v:.3f}" for k, v in m.items() if k.startswith("eval/")))
            done.append(m)
        return done

    def finished(self) -> dict[str, Any]:
        """The rounds completed since the last call, merged for one metrics line (the newest round's keys win)."""
        out: dict[str, Any] = {}
        for m in self.finished_rounds():
            out.update(m)
        return out

    async def poll(self, bus: Any, step: int, version: int) -> dict[str, Any]:
        """Issue a due round, take the results that are there (no waiting); the metrics of completed rounds."""
        await self._exchange(bus, step, version)
        return self.finished()

    async def _exchange(self, bus: Any, step: int, version: int) -> None:
        if not self._purged:  # rounds of an earlier trainer process are gone with it: drop their tickets and results
            await bus.purge_eval()
            self._purged = True
        if self.due(step):
            self.issued.add(step)
            self.rounds[step] = EvalRound(step, version, self.num_items)
            await bus.publish_eval_tickets(self.tickets(step, version))
        for lease in await bus.pull_eval_results(timeout=0.0):
            self.add(lease.value)
            await lease.ack()

    async def finish(self, bus: Any, step: int, version: int, timeout: float = DEFAULT_FINISH_TIMEOUT) -> list[dict[str, Any]]:
        """After the last step: evaluate it if not done yet and wait (at most `timeout`) for every open round;
        the metrics of each round finished meanwhile, oldest first."""
        await self._exchange(bus, step, version)
        out = self.finished_rounds()
        deadline = time.monotonic() + timeout
        while self.rounds and time.monotonic() < deadline:
            for lease in await bus.pull_eval_results(timeout=1.0):
                self.add(lease.value)
                await lease.ack()
            out += self.finished_rounds()
        if self.rounds:
            log.warning("evaluation rounds of steps %s did not finish within %.0f s (are rollout agents running?)", sorted(self.rounds), timeout)
        return out


class Evaluator:
    """The agents' side: the experiment's workflow with evaluation sampling (and a greedy twin)."""

    def __init__(self, items: list[Any], sampled: Any | None, greedy: Any | None) -> None:
        self.items, self.sampled, self.greedy = items, sampled, greedy

    @classmethod
    def from_experiment(cls, spec: Any, tokenizer: Any, *, max_total_tokens: int | None = None) -> Evaluator | None:
        """None without spec.evaluation. Raises DatasetError / WorkflowError the agent reports as configuration errors."""
        if spec.evaluation is None:
            return None
        from kuberl.runtime.data import load_eval_items
        from kuberl.runtime.rollout.registry import WorkflowError, build_workflow

        if spec.workflow.external is not None:  # its episodes would need a second episode API, on the same port
            raise WorkflowError("spec.evaluation is not available with workflow.external yet: held-out episodes are not offered to "
                                "external agents; remove spec.evaluation, or evaluate the saved checkpoints separately")
        from kuberl.runtime.rollout.workflows import SamplingConfig
        from kuberl.runtime.stop_tokens import stop_set_for

        ev, a = spec.evaluation, spec.algorithm
        stops = stop_set_for(spec, tokenizer)  # the training rollouts' stop set: evaluated answers end where trained ones do

        def workflow(n: int, temperature: float) -> Any:
            return build_workflow(spec, tokenizer, SamplingConfig(n=n, max_new_tokens=a.max_new_tokens, temperature=temperature, top_p=a.top_p,
                                                                  stop_token_ids=stops.ids, stop=list(stops.strings),
                                                                  max_total_tokens=max_total_tokens))

        sampled = workflow(ev.samples_per_prompt, ev.temperature or a.temperature) if ev.samples_per_prompt else None
        return cls(load_eval_items(spec), sampled, workflow(1, 0.0) if ev.greedy else None)

    async def run(self, engine: Any, ticket: EvalTicket, agent: str) -> EvalResult:
        """Roll out one held-out item; raises on engine failures (the agent gives the ticket back)."""
        from kuberl.runtime.rollout.workflows import EpisodeContext

        if not 0 <= ticket.index < len(self.items):
            raise IndexError(f"evaluation ticket {ticket.eval_id} names item {ticket.index} but the held-out set has {len(self.items)}")
        item = self.items[ticket.index]
        version = engine.version
        ctx = EpisodeContext(ticket_id=ticket.eval_id, seed=None)
        jobs = []
        if ticket.samples and self.sampled is not None:
            jobs.append(self.sampled.arun_episode(engine, item, ctx))
        if ticket.greedy and self.greedy is not None:
            jobs.append(self.greedy.arun_episode(engine, item, ctx))
        got = list(await asyncio.gather(*jobs))
        sampled = got.pop(0) if ticket.samples and self.sampled is not None else None
        greedy = got.pop(0) if got else None
        return EvalResult(eval_id=ticket.eval_id, step=ticket.step, index=ticket.index, version=version, agent=agent,
                          rewards=[s.reward for s in sampled or []], greedy_reward=greedy[0].reward if greedy else None)


async def run_eval_ticket(agent: Any, lease: Any) -> EvalResult | None:
    """One evaluation ticket on a RolloutAgent's engine: wait for its weights, roll out, publish, ack.

    A failure gives the ticket back (another try, maybe on another agent); on its last allowed delivery
    (rollout.maxTicketAttempts) the result is published with `failure`, so the round still completes.
    """
    from kuberl.runtime.inference.base import EngineError

    ticket: EvalTicket = lease.value
    beat = asyncio.create_task(agent._heartbeat(lease))
    epoch = agent._engine_epoch
    try:
        await agent.wait_for_weights(ticket.version)
        result = await agent.evaluator.run(agent.engine, ticket, agent.agent_id)
        if epoch != agent._engine_epoch:
            raise EngineError("the engine restarted during this evaluation episode")
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):
            await asyncio.shield(lease.nak())
        raise
    except Exception as exc:  # noqa: BLE001  any failure: another try, up to rollout.maxTicketAttempts
        if lease.delivered < agent.max_attempts:
            log.warning("agent %s: evaluation ticket %s failed (delivery %d), giving it back: %s", agent.agent_id, ticket.eval_id, lease.delivered, exc)
            if not await agent.engine.health():
                agent._engine_lost(exc)
            with contextlib.suppress(Exception):
                await lease.nak(delay=5.0)
            return None
        log.error("agent %s: evaluation ticket %s failed on all %d deliveries: %s", agent.agent_id, ticket.eval_id, lease.delivered, exc)
        result = EvalResult(eval_id=ticket.eval_id, step=ticket.step, index=ticket.index, version=agent.engine.version, agent=agent.agent_id,
                            failure=f"{type(exc).__name__}: {exc}"[:500])
    finally:
        beat.cancel()
        agent._progressed()
    await agent.bus.publish_eval_result(result)
    await lease.ack()
    agent.stats.evaluated += 1
    return result


async def finish_evaluation(schedule: EvalSchedule, bus: Any, workdir: Any, last_row: dict[str, Any] | None, tracking: Any,
                            step: int, version: int) -> list[dict[str, Any]]:
    """The trainer after its last step: wait for the open rounds (the last step's included); each round's
    metrics go into one more metrics.jsonl line of that step (the last line of a step wins in `kuberl plot`:
    the final round) and to the trackers."""
    rounds = await schedule.finish(bus, step, version)
    if last_row is not None:
        with open(f"{workdir}/metrics.jsonl", "a") as fh:
            for metrics in rounds:
                fh.write(json.dumps({**last_row, **metrics, "time": time.time()}) + "\n")
        if tracking is not None and rounds:
            tracking.log(step, {k: v for m in rounds for k, v in m.items()})
    return rounds
