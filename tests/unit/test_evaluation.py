"""Held-out evaluation (spec.evaluation): pass@k, rounds, the trainer's schedule and report, the agents'
episodes, the held-out items and the status. The real bus and a real `kuberl run`: tests/integration/test_evaluation_run.py.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from dataclasses import dataclass
from typing import Any

import pytest

from kuberl.api import RLExperiment, RLExperimentStatus
from kuberl.api.evaluation import EvaluationSpec
from kuberl.api.v1alpha1 import TrainingProgress
from kuberl.operator.status import _progress
from kuberl.runtime.bus.messages import EvalResult, EvalTicket, decode_eval_result, decode_eval_ticket
from kuberl.runtime.data import DatasetError, load_eval_items, load_items
from kuberl.runtime.evaluation import EvalRound, EvalSchedule, Evaluator, finish_evaluation, pass_at_k
from kuberl.runtime.inference.base import GenerateResult
from kuberl.runtime.launcher import eval_text
from tests.unit.test_trainer_stages import B, group, make_trainer


def spec_with(evaluation: dict[str, Any] | None, dataset: dict[str, Any] | None = None) -> Any:
    doc = {"apiVersion": "kuberl.io/v1alpha1", "kind": "RLExperiment", "metadata": {"name": "x"},
           "spec": {"model": {"builtin": "tiny-qwen2"}, "dataset": dataset or {"builtin": "repeat-digit", "size": 20},
                    "algorithm": {"samplesPerPrompt": 2, "batchSize": 2}}}
    if evaluation is not None:
        doc["spec"]["evaluation"] = evaluation
    return RLExperiment.model_validate(doc).spec


# --- pass@k -------------------------------------------------------------------------------------


def brute_pass_at_k(outcomes: list[bool], k: int) -> float:
    """The definition: the chance that k of the n samples, drawn without replacement, hold a correct one."""
    subsets = list(itertools.combinations(outcomes, k))
    return sum(any(s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n, c, k", [(4, 0, 1), (4, 1, 1), (4, 1, 2), (4, 2, 3), (4, 4, 4), (6, 2, 2), (8, 3, 5), (5, 1, 5)])
def test_pass_at_k_is_the_unbiased_estimator(n, c, k):
    assert pass_at_k(n, c, k) == pytest.approx(brute_pass_at_k([True] * c + [False] * (n - c), k))


def test_pass_at_k_refuses_impossible_counts():
    for n, c, k in [(4, 5, 1), (4, 1, 0), (4, 1, 5)]:
        with pytest.raises(ValueError, match="pass@k needs"):
            pass_at_k(n, c, k)


# --- a round's metrics --------------------------------------------------------------------------


def result(index: int, rewards: list[float], greedy: float | None = None, step: int = 3, failure: str | None = None) -> EvalResult:
    return EvalResult(eval_id=f"s{step}-i{index}", step=step, index=index, version=step, rewards=rewards, greedy_reward=greedy, failure=failure)


def test_round_metrics_reward_greedy_and_pass_at_k():
    rnd = EvalRound(step=3, version=3, items=3)
    rnd.results = {0: result(0, [1.0, 0.0, 0.0, 0.0], 1.0), 1: result(1, [0.5, 0.5, 0.0, 0.0], 0.0), 2: result(2, [], failure="boom")}
    m = rnd.metrics([1, 2], correct=1.0)
    assert m["evaluated_step"] == 3 and m["evaluated_items"] == 2 and m["evaluated_failed_items"] == 1
    assert m["eval/reward_mean"] == pytest.approx(2.0 / 8)
    assert m["eval/pass_at_1"] == pytest.approx((0.25 + 0.0) / 2)
    assert m["eval/pass_at_2"] == pytest.approx((0.5 + 0.0) / 2)
    assert m["eval/greedy_reward_mean"] == pytest.approx(0.5) and m["eval/pass_at_1_greedy"] == pytest.approx(0.5)
    # correctReward lowers the bar: 0.5 counts as correct
    assert rnd.metrics([1], correct=0.5)["eval/pass_at_1"] == pytest.approx((0.25 + 0.5) / 2)


# --- the trainer's schedule ---------------------------------------------------------------------


class EvalBus:
    """The Bus methods EvalSchedule uses; `agents` answers each ticket with a result (None: no answer)."""

    def __init__(self, answer=None) -> None:
        self.eval_tickets: list[EvalTicket] = []
        self.results: list[EvalResult] = []
        self.answer = answer
        self.purged = 0
        self.acked: list[str] = []

    async def purge_eval(self):
        self.purged += 1

    async def publish_eval_tickets(self, tickets):
        self.eval_tickets += tickets
        if self.answer is not None:
            self.results += [r for r in map(self.answer, tickets) if r is not None]
        return len(tickets)

    async def pull_eval_results(self, max_n=256, timeout=0.0):
        got, self.results = self.results[:max_n], self.results[max_n:]
        if not got:
            await asyncio.sleep(min(timeout, 0.01))
        return [Lease(r, self.acked) for r in got]


@dataclass
class Lease:
    value: Any
    acked: list[str]

    async def ack(self):
        self.acked.append(self.value.eval_id)


def answer_all(t: EvalTicket) -> EvalResult:
    return EvalResult(eval_id=t.eval_id, step=t.step, index=t.index, version=t.version, rewards=[1.0] * t.samples, greedy_reward=0.0)


def test_due_every_n_steps_and_after_the_last_but_never_twice():
    s = EvalSchedule(EvaluationSpec(split="test", every_steps=3), num_items=4, total_steps=7)
    assert [step for step in range(0, 8) if s.due(step)] == [3, 6, 7]
    s.issued.add(3)
    assert not s.due(3)


def test_tickets_one_per_item_at_the_version():
    s = EvalSchedule(EvaluationSpec(split="test", samples_per_prompt=3, greedy=False, pass_at_k=[1, 3]), num_items=4, total_steps=9)
    ts = s.tickets(step=6, version=6)
    assert [t.eval_id for t in ts] == ["s6-i0", "s6-i1", "s6-i2", "s6-i3"] and {(t.version, t.samples, t.greedy) for t in ts} == {(6, 3, False)}
    assert decode_eval_ticket(ts[0].encode()) == ts[0] and decode_eval_result(answer_all(ts[0]).encode()) == answer_all(ts[0])


async def test_poll_issues_a_due_round_and_reports_it_only_once_complete():
    s = EvalSchedule(EvaluationSpec(split="test", every_steps=2), num_items=3, total_steps=10)
    held: list[EvalResult] = []
    bus = EvalBus(answer=lambda t: held.append(answer_all(t)) or None)
    assert await s.poll(bus, step=1, version=1) == {} and bus.purged == 1 and bus.eval_tickets == []
    assert await s.poll(bus, step=2, version=2) == {} and len(bus.eval_tickets) == 3
    bus.results = held[:2] + [result(0, [1.0], step=99)]  # two of three, and one of no open round (ignored)
    assert await s.poll(bus, step=3, version=3) == {} and s.last is None
    bus.results = held[2:]
    m = await s.poll(bus, step=3, version=3)
    assert m["evaluated_step"] == 2 and m["eval/reward_mean"] == 1.0 and m["eval/pass_at_1_greedy"] == 0.0
    assert s.last["step"] == 2 and s.last["pass_at_k"] == {"1": 1.0}
    assert len(bus.acked) == 4 and bus.purged == 1, "every result is acked, the purge happens once"
    assert await s.poll(bus, step=3, version=3) == {}, "a round is reported once"


async def test_finish_evaluates_the_last_step_and_waits_for_open_rounds(tmp_path):
    s = EvalSchedule(EvaluationSpec(split="test", every_steps=4), num_items=2, total_steps=5)
    bus = EvalBus(answer=answer_all)
    last_row = {"step": 5, "reward_mean": 0.5}
    s.rounds[4] = EvalRound(step=4, version=4, items=2)  # a round still open when training ends
    bus.results = [answer_all(t) for t in s.tickets(4, 4)]
    rounds = await finish_evaluation(s, bus, tmp_path, last_row, None, step=5, version=5)
    assert [m["evaluated_step"] for m in rounds] == [4, 5]
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == [{**last_row, **m, "time": r["time"]} for m, r in zip(rounds, rows)], "a line of the last step per round, the final one last"


async def test_finish_gives_up_after_its_timeout():
    s = EvalSchedule(EvaluationSpec(split="test", every_steps=4), num_items=2, total_steps=5)
    assert await s.finish(EvalBus(answer=None), step=5, version=5, timeout=0.2) == [] and 5 in s.rounds


# --- the trainer: eval never changes what is trained; its metrics land in the step's report -------


class ReportBus:
    """TrainerBusIO's report-side methods, with the raw Bus (`.bus`) the evaluation uses."""

    def __init__(self, bus: EvalBus) -> None:
        self.bus, self.groups_buffered, self.progress = bus, 0, []

    async def refresh_buffered(self, local):
        pass

    async def put_tickets(self, state):
        pass

    async def put_progress(self, progress):
        self.progress.append(progress)


async def trained_ids(tmp_path, with_eval: bool) -> list[list[str]]:
    t = make_trainer(tmp_path)
    t.total_steps = 5
    if with_eval:
        t.evals = EvalSchedule(EvaluationSpec(split="test", every_steps=1), num_items=3, total_steps=5)
    t.bus.answer = lambda tk: group(tk, version=tk.issued_version)
    eval_bus = EvalBus(answer=answer_all)
    steps = []
    for step in range(1, 4):
        await t.stage_issue_tickets()
        plan = await t.stage_collect()
        steps.append([g["group_id"] for g in plan["groups"]])
        t.book.on_consumed(B)
        t.step, t.version = step, step
        memory, t.bus = t.bus, ReportBus(eval_bus)
        row = await t.step_row({"samples": 4, "step_seconds": 1.0, "wait_seconds": 0.0, "reward_mean": 0.5, "staleness_mean": 0.0,
                                "staleness_max": 0, "loss": 0.0, "group_ids": steps[-1]})
        await t.stage_report(row)
        if with_eval:
            assert t.bus.progress[-1]["eval"]["step"] == step, "status.progress.eval: the round of this step"
        t.bus = memory
    assert all(not isinstance(x, EvalTicket) for x in memory.tickets), "no evaluation ticket among the training tickets"
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [("eval/reward_mean" in r) for r in rows] == [with_eval] * 3
    return steps


async def test_evaluation_changes_no_trained_group(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    assert await trained_ids(tmp_path / "a", True) == await trained_ids(tmp_path / "b", False)


# --- the agents' episodes -----------------------------------------------------------------------


class FakeEngine:
    version = 4

    def __init__(self) -> None:
        self.requests = []

    async def generate(self, req):
        self.requests.append(req)
        return GenerateResult(output_ids=[5, 6], logprobs=[-0.1, -0.2], finish_reason="stop", version=self.version)


class Tok:
    eos_token_id = 0

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) % 50 for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return "77777777"

    def apply_chat_template(self, msgs, tokenize=False, add_generation_prompt=True):
        return msgs[0]["content"]


async def test_evaluator_samples_n_at_the_temperature_and_one_greedy():
    spec = spec_with({"split": "test", "size": 5, "samplesPerPrompt": 3, "temperature": 0.7, "passAtK": [1, 3]},
                     {"builtin": "repeat-digit", "size": 20})
    ev = Evaluator.from_experiment(spec, Tok())
    engine = FakeEngine()
    ticket = EvalTicket(eval_id="s4-i1", step=4, index=1, version=4, samples=3, greedy=True)
    res = await ev.run(engine, ticket, "agent-0")
    assert sorted(r.temperature for r in engine.requests) == [0.0, 0.7, 0.7, 0.7]
    assert len(res.rewards) == 3 and res.greedy_reward is not None and res.version == 4 and res.agent == "agent-0"
    expected = 1.0 if ev.items[1].answer == "77777777" else 0.0  # every response decodes to 77777777 here
    assert res.rewards == [expected] * 3 and res.greedy_reward == expected
    with pytest.raises(IndexError, match="held-out set has 5"):
        await ev.run(engine, ticket.model_copy(update={"index": 9}), "a")


def test_no_evaluation_no_evaluator_and_no_schedule():
    spec = spec_with(None)
    assert Evaluator.from_experiment(spec, Tok()) is None and EvalSchedule.from_experiment(spec, 5) is None


# --- held-out items -----------------------------------------------------------------------------


def test_a_builtin_split_is_generated_apart_from_the_training_items():
    spec = spec_with({"split": "heldout", "size": 50}, {"builtin": "add-small", "size": 50})
    held, train = load_eval_items(spec), load_items(spec.dataset, spec.seed)
    assert len(held) == 50 and [(i.prompt, i.answer) for i in held] != [(i.prompt, i.answer) for i in train]
    assert load_eval_items(spec) == held, "the same items in every role"


def test_held_out_items_from_a_file(tmp_path):
    f = tmp_path / "eval.jsonl"
    f.write_text("\n".join(json.dumps({"question": f"q{i}", "answer": str(i)}) for i in range(5)))
    spec = spec_with({"path": str(f), "size": 3}, {"path": str(tmp_path / "train.jsonl")})
    assert [(i.prompt, i.answer) for i in load_eval_items(spec)] == [("q0", "0"), ("q1", "1"), ("q2", "2")]


@pytest.mark.parametrize("evaluation, dataset, message", [
    ({"path": "/nonexistent/eval.jsonl"}, None, "does not exist"),
    ({"split": "train"}, None, "is the split trained on"),
    ({"split": "test"}, {"path": "/tmp/x.jsonl"}, "a file, which has no splits; use evaluation.path"),
])
def test_bad_held_out_sources_are_refused_clearly(evaluation, dataset, message):
    with pytest.raises(DatasetError, match=message):
        load_eval_items(spec_with(evaluation, dataset))


def test_the_trainer_refuses_a_missing_file_as_a_configuration_error():
    from kuberl.runtime.errors import ConfigError, spec_errors

    with pytest.raises(ConfigError, match="does not exist"), spec_errors():
        EvalSchedule.from_experiment(spec_with({"path": "/nonexistent/eval.jsonl"}), 5)


# --- status and kuberl run ----------------------------------------------------------------------


def test_status_progress_eval_in_camel_case():
    exp = RLExperiment.model_validate({"apiVersion": "kuberl.io/v1alpha1", "kind": "RLExperiment", "metadata": {"name": "x"},
                                       "spec": {"model": {"builtin": "tiny-qwen2"}, "dataset": {"builtin": "repeat-digit"}}})
    ev = {"step": 6, "policy_version": 6, "items": 8, "reward_mean": 0.4, "greedy_reward_mean": 0.5, "pass_at_1_greedy": 0.25,
          "pass_at_k": {"1": 0.3, "4": 0.6}, "time": 1.7e9}
    out = _progress(exp, {"step": 7, "policy_version": 7, "dropped_stale": 0, "eval": ev}, {})
    assert out["eval"] == {"step": 6, "policyVersion": 6, "items": 8, "rewardMean": 0.4, "greedyRewardMean": 0.5, "passAt1Greedy": 0.25,
                           "passAtK": {"1": 0.3, "4": 0.6}, "updatedAt": out["eval"]["updatedAt"]}
    assert out["eval"]["updatedAt"].startswith("2023-11-14T")
    TrainingProgress.model_validate(out)
    RLExperimentStatus.model_validate({"progress": out})
    assert "eval" not in _progress(exp, {"step": 1, "eval": "garbage"}, {}), "a malformed eval object is left out, not fatal"


def test_kuberl_run_prints_the_evaluation():
    text = eval_text({"step": 6, "policy_version": 6, "items": 8, "reward_mean": 0.4, "greedy_reward_mean": 0.5,
                      "pass_at_1_greedy": 0.25, "pass_at_k": {"4": 0.6, "1": 0.3}})
    assert text == "eval (step 6, v6, 8 items): reward 0.4 greedy 0.5 pass@1 greedy 0.25 pass@1 0.3 pass@4 0.6"
    assert eval_text(None) == ""


# --- the agent: training tickets first, evaluation tickets in the slots left free (real nats-server) --


@pytest.fixture
def bus_url(tmp_path):
    from kuberl.runtime.bus.server import start_nats_server

    server = start_nats_server(store_dir=str(tmp_path / "store"))
    yield server.url
    server.stop()


async def test_the_agent_takes_training_tickets_first_and_evaluates_with_free_slots(bus_url, tmp_path):
    from kuberl.runtime.bus import Bus, Ticket
    from kuberl.runtime.data import Item
    from kuberl.runtime.rollout.agent import RolloutAgent
    from tests.unit.test_agent_engine_lost import DyingEngine, OneShotWorkflow, experiment

    order: list[str] = []

    class Workflow(OneShotWorkflow):
        async def arun_episode(self, engine, item, ctx):
            order.append(ctx.ticket_id)
            return await super().arun_episode(engine, item, ctx)

    class Ev:
        async def run(self, engine, ticket, agent):
            order.append(ticket.eval_id)
            return EvalResult(eval_id=ticket.eval_id, step=ticket.step, index=ticket.index, version=engine.version, rewards=[1.0, 0.0], agent=agent)

    bus = await Bus.connect(bus_url, "evalagent")
    trainer_bus = await Bus.connect(bus_url, "evalagent")  # the trainer's own connection, as in a run
    try:
        await bus.reset_experiment()
        await bus.publish_eval_tickets([EvalTicket(eval_id=f"s1-i{i}", step=1, index=i, version=0, samples=2, greedy=False) for i in range(2)])
        await bus.publish_tickets([Ticket(ticket_id="e0-i0-0", index=0, epoch=0, issued_version=0)])
        agent = RolloutAgent(experiment(), bus, DyingEngine(), Workflow(), [Item(0, "p", "a")], workdir=tmp_path, evaluator=Ev())
        task = asyncio.create_task(agent.run())
        results: list[Any] = []
        async with asyncio.timeout(12):
            while len(results) < 2:
                results += await trainer_bus.pull_eval_results(timeout=1.0)
            while agent.stats.evaluated < 2:  # counted once its result is published and its ticket acked
                await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert order == ["e0-i0-0", "s1-i0", "s1-i1"], "the training ticket first (concurrency 1), then the evaluation tickets"
        assert sorted(r.value.eval_id for r in results) == ["s1-i0", "s1-i1"] and agent.stats.evaluated == 2
        groups = await trainer_bus.pull_groups(10, timeout=1.0)
        assert [g.value.group_id for g in groups] == ["e0-i0-0"], "an evaluation is never published as a training group"
    finally:
        await bus.close()
        await trainer_bus.close()
