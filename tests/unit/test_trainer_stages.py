"""The Trainer's bus-side stages (issue_tickets, collect) driven with in-memory groups, no servers.

The real bus is exercised in tests/integration/test_trainer.py; here a list stands in for the stream so
the accounting rules can be checked one by one.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from kuberl.api import RLExperiment
from kuberl.runtime.bus import Sample, Ticket, TrajectoryGroup
from kuberl.runtime.trainer.dist import DistInfo
from kuberl.runtime.trainer.tickets import TicketBook
from kuberl.runtime.trainer.trainer import Trainer

B, N = 2, 2


class MemoryBus:
    """The TrainerBusIO methods the collect stage uses, over Python lists."""

    def __init__(self) -> None:
        self.stream: list[TrajectoryGroup] = []
        self.tickets: list[dict[str, Any]] = []
        self.control: dict[str, Any] = {}
        self.book: dict[str, Any] | None = None
        self.answer = None  # ticket -> group: plays the agents for tickets not answered yet
        self._answered = 0
        self.progress: list[dict[str, Any]] = []
        self.groups_buffered = 0

    async def put_progress(self, doc):
        self.progress.append(dict(doc))

    async def publish_tickets(self, tickets):
        self.tickets += tickets
        return len(tickets)

    async def put_tickets(self, state):
        self.book = state

    async def get_control(self):
        return self.control

    async def fetch_groups(self, max_n, timeout):
        if self.answer is not None:
            self.stream += [self.answer(tk) for tk in self.tickets[self._answered:]]
            self._answered = len(self.tickets)
        got, self.stream = self.stream[:max_n], self.stream[max_n:]
        if not got:  # a pull with nothing to deliver waits a little, as the bus's does (up to its timeout)
            await asyncio.sleep(min(timeout, 0.02))
        return [(g, f"lease-{g.group_id}") for g in got]


def make_trainer(tmp_path, *, eta=0, dynamic=False, drop_stale=False) -> Trainer:
    exp = RLExperiment.model_validate({
        "apiVersion": "kuberl.io/v1alpha1", "kind": "RLExperiment", "metadata": {"name": "unit"},
        "spec": {"model": {"builtin": "tiny-qwen2"}, "dataset": {"builtin": "repeat-digit", "size": 20},
                 "algorithm": {"name": "dapo" if dynamic else "grpo", "samplesPerPrompt": N, "batchSize": B, "dynamicSampling": dynamic},
                 "staleness": {"maxHeadOffpolicyness": eta, "dropStaleGroups": drop_stale}, "training": {"totalSteps": 5}},
    })
    t = Trainer(exp, bus_url="nats://unused:4222", workdir=tmp_path)
    t.info = DistInfo(0, 1, 0, torch.device("cpu"))
    t.book = TicketBook(20, B, eta, total_groups=5 * B)
    t.bus = MemoryBus()
    return t


def group(tk: Ticket, version: int = 0, rewards=(1.0, 0.0), rejected: bool = False) -> TrajectoryGroup:
    samples = [] if rejected else [Sample(input_ids=[1, 2], output_ids=[3, 4], logprobs=[-1.0, -1.0], versions=[version] * 2,
                                          loss_mask=[1, 1], reward=r) for r in rewards]
    return TrajectoryGroup(group_id=tk.ticket_id, ticket=tk, samples=samples, rejected=rejected)


async def test_issue_tickets_fills_the_bound_and_no_more(tmp_path):
    t = make_trainer(tmp_path, eta=1)
    assert await t.stage_issue_tickets() == (1 + 0 + 1) * B
    assert await t.stage_issue_tickets() == 0
    t.version = 1
    assert await t.stage_issue_tickets() == B
    assert t.bus.book["issued"] == 3 * B


async def test_collect_returns_b_groups_and_holds_their_leases_for_the_checkpoint(tmp_path):
    t = make_trainer(tmp_path)
    await t.stage_issue_tickets()
    t.bus.stream = [group(tk) for tk in t.bus.tickets]
    plan = await t.stage_collect()
    assert [g["group_id"] for g in plan["groups"]] == [tk.ticket_id for tk in t.bus.tickets]
    assert t.held == [f"lease-{tk.ticket_id}" for tk in t.bus.tickets]
    assert plan["wait_seconds"] < 1.0, "the groups were there already: nothing to wait for"


async def test_wait_seconds_is_the_time_collect_spent_waiting_for_groups(tmp_path):
    t = make_trainer(tmp_path)
    await t.stage_issue_tickets()

    async def agents_answer_later():
        await asyncio.sleep(0.3)
        t.bus.stream = [group(tk) for tk in t.bus.tickets]

    late = asyncio.create_task(agents_answer_later())
    plan = await t.stage_collect()
    await late
    assert len(plan["groups"]) == B and 0.3 <= plan["wait_seconds"] < 5.0


async def test_a_rejected_group_is_replaced_by_a_new_ticket(tmp_path):
    t = make_trainer(tmp_path)
    t.bus.answer = lambda tk: group(tk, rejected=tk.ticket_id == t.bus.tickets[0].ticket_id)
    await t.stage_issue_tickets()
    plan = await t.stage_collect()
    assert len(plan["groups"]) == B and t.bus.tickets[0].ticket_id not in [g["group_id"] for g in plan["groups"]]
    assert t.book.rejected == 1 and t.book.issued == B + 1
    assert len(t.held) == B + 1, "the rejected group's lease is acknowledged with the next checkpoint too"


async def test_a_group_older_than_v_minus_eta_is_dropped_and_counted(tmp_path):
    """With staleness.dropStaleGroups (opt-in): the stale group gives its slot back and is not trained."""
    t = make_trainer(tmp_path, eta=1, drop_stale=True)
    t.version = 3
    t.book.bound.issued = 6  # as if three batches were issued at versions 0..2
    t.book.bound.consumed = 6
    await t.stage_issue_tickets()
    tickets = list(t.bus.tickets)
    t.bus.stream = [group(tickets[0], version=1), group(tickets[1], version=2), group(tickets[2], version=3)]
    plan = await t.stage_collect()
    assert [g["group_id"] for g in plan["groups"]] == [tickets[1].ticket_id, tickets[2].ticket_id]
    assert t.dropped_stale == 1 and t.book.dropped == 1
    assert t.over_stale == 0, "a dropped group is not trained, so not counted as trained over the bound"


async def test_by_default_a_group_older_than_v_minus_eta_is_trained_and_counted_as_over_stale(tmp_path):
    t = make_trainer(tmp_path, eta=1)
    t.version = 3
    t.book.bound.issued = 6
    t.book.bound.consumed = 6
    await t.stage_issue_tickets()
    tickets = list(t.bus.tickets)
    t.bus.stream = [group(tickets[0], version=1), group(tickets[1], version=2), group(tickets[2], version=3),
                    group(tickets[3], version=3)]
    plan = await t.stage_collect()
    assert [g["group_id"] for g in plan["groups"]] == [tickets[0].ticket_id, tickets[1].ticket_id]
    assert t.dropped_stale == 0 and t.book.dropped == 0
    assert t.over_stale == 1, "the group at head version 1 < 3 - 1 is trained and counted"
    assert t.book.issued == 6 + 2 * B, "no replacement ticket: nothing was given back"
    plan = await t.stage_collect()  # the next batch, both at version 3: nothing over the bound
    assert [g["group_id"] for g in plan["groups"]] == [tickets[2].ticket_id, tickets[3].ticket_id]
    assert t.over_stale == 1


async def test_dynamic_sampling_rejects_groups_whose_rewards_are_all_equal(tmp_path):
    t = make_trainer(tmp_path, dynamic=True)
    t.bus.answer = lambda tk: group(tk, rewards=(1.0, 1.0) if tk.ticket_id == t.bus.tickets[0].ticket_id else (1.0, 0.0))
    await t.stage_issue_tickets()
    plan = await t.stage_collect()
    assert t.book.rejected == 1 and t.book.issued == B + 1 and len(plan["groups"]) == B
    assert all(len({s["reward"] for s in g["samples"]}) > 1 for g in plan["groups"])


async def test_a_new_checkpoint_request_interrupts_collection_and_keeps_the_groups_so_far(tmp_path):
    t = make_trainer(tmp_path)
    await t.stage_issue_tickets()
    t.bus.stream = [group(t.bus.tickets[0])]
    t.bus.control = {"checkpoint_request": "suspend-1", "stop": False}
    assert await t.stage_collect() == {"checkpoint_request": "suspend-1"}
    t.answered_request = "suspend-1"  # what stage_checkpoint records
    t.bus.stream = [group(t.bus.tickets[0]), group(t.bus.tickets[1])]
    plan = await t.stage_collect()
    assert len(plan["groups"]) == B


async def test_control_stop_and_sigterm_end_collection(tmp_path):
    t = make_trainer(tmp_path)
    t.bus.control = {"stop": True}
    assert await t.stage_collect() == {"stop": "control.stop"}
    t.bus.control = {}
    t.stop_reason = "SIGTERM"
    assert await t.stage_collect() == {"stop": "SIGTERM"}


async def test_waiting_longer_than_collect_timeout_fails_with_a_reason(tmp_path):
    t = make_trainer(tmp_path)
    t.collect_timeout = 0.0
    with pytest.raises(TimeoutError, match="no trajectory group arrived"):
        await t.stage_collect()


async def test_a_group_that_arrives_twice_is_trained_once_and_both_copies_are_acked(tmp_path):
    t = make_trainer(tmp_path)
    await t.stage_issue_tickets()
    first, second = t.bus.tickets
    # The same ticket rolled out twice (e.g. re-issued after a restart beyond the dedupe window);
    # one copy is a rejected group, which must not give its slot back a second time either.
    t.bus.stream = [group(first), group(first), group(second, rejected=True), group(second, rejected=True)]
    t.bus._answered = len(t.bus.tickets)  # the agents answer only tickets issued from now on
    t.bus.answer = lambda tk: group(tk)  # the replacement for the rejected group
    plan = await t.stage_collect()
    ids = [g["group_id"] for g in plan["groups"]]
    assert ids.count(first.ticket_id) == 1 and second.ticket_id not in ids
    assert t.duplicates == 2 and t.book.rejected == 1
    assert sorted(t.held) == sorted(f"lease-{i}" for i in [first.ticket_id] * 2 + [second.ticket_id] * 2 + [ids[1]])


async def test_a_resumed_trainer_does_not_reissue_tickets_already_on_the_bus(tmp_path):
    crashed = make_trainer(tmp_path / "a", eta=1)
    await crashed.stage_issue_tickets()
    checkpoint = crashed.book.state()
    crashed.version = 1
    await crashed.stage_issue_tickets()  # B more, after the checkpoint; KV `tickets` holds them
    restarted = make_trainer(tmp_path / "b", eta=1)
    restarted.book.load_state(checkpoint)
    restarted.bus.book = crashed.bus.book
    restarted.bus.get_tickets = lambda: _value(crashed.bus.book)
    assert await restarted.stage_catch_up() == B
    restarted.version = 1
    assert await restarted.stage_issue_tickets() == 0, "the bound is full with the tickets already out"
    restarted.version = 2
    await restarted.stage_issue_tickets()
    assert [tk.ticket_id for tk in restarted.bus.tickets] == [tk.ticket_id for tk in crashed.book.next_tickets(2)]


async def _value(v):
    return v


async def test_a_usable_group_frees_its_concurrency_slot_when_it_arrives_not_when_trained(tmp_path):
    t = make_trainer(tmp_path, eta=2)
    t.book = TicketBook(20, B, 2, max_concurrent=B, total_groups=5 * B)
    await t.stage_issue_tickets()
    assert len(t.bus.tickets) == B  # the concurrency cap
    t.bus.stream = [group(tk) for tk in t.bus.tickets]
    plan = await t.stage_collect()
    assert len(plan["groups"]) == B and t.book.accepted == B and t.book.consumed == 0
    # The collect stage issued the next B prompts as soon as this batch arrived, before training it.
    assert len(t.bus.tickets) == 2 * B and t.book.running == B


async def keep_as_an_interrupted_collect_does(t) -> None:
    """The groups on the stream, pulled, accepted and left in the buffer, as a collect interrupted by a request leaves them."""
    got = await t.bus.fetch_groups(B, timeout=0)
    t.bus._answered = 1
    for g, h in got:
        assert t._first_time(g, h) and t._usable(g)
        t.book.on_accepted()
        t.buffer.append((g, h))


async def test_a_kept_group_judged_stale_later_leaves_the_accepted_count(tmp_path):
    t = make_trainer(tmp_path, eta=0, drop_stale=True)
    await t.stage_issue_tickets()
    t.bus.stream = [group(tk) for tk in t.bus.tickets[:1]]
    t.bus.control = {}
    await keep_as_an_interrupted_collect_does(t)
    t.version = 1  # the kept group (version 0) is now stale at eta 0
    t.bus.answer = lambda tk: group(tk, version=1)
    await t.stage_collect()
    assert t.dropped_stale == 1 and t.book.dropped == 1
    assert t.book.accepted == B and t.book.running == t.book.started - B


async def test_by_default_a_kept_group_that_went_stale_is_trained_once_and_counted_once(tmp_path):
    t = make_trainer(tmp_path, eta=0)
    await t.stage_issue_tickets()
    first = t.bus.tickets[0]
    t.bus.stream = [group(first)]
    await keep_as_an_interrupted_collect_does(t)
    t.version = 1  # the kept group (version 0) is older than 1 - 0 now
    t.bus.control = {"checkpoint_request": "suspend-1"}
    assert await t.stage_collect() == {"checkpoint_request": "suspend-1"}  # judged again: kept, not counted yet
    assert t.over_stale == 0 and len(t.buffer) == 1
    t.answered_request = "suspend-1"
    t.bus.answer = lambda tk: group(tk, version=1)
    plan = await t.stage_collect()
    assert first.ticket_id in [g["group_id"] for g in plan["groups"]]
    assert t.over_stale == 1 and t.dropped_stale == 0 and t.book.dropped == 0
    assert t.book.accepted == B and t.book.running == t.book.started - B


def test_the_drop_warns_once_at_start_and_the_default_says_nothing(tmp_path, caplog):
    with caplog.at_level("WARNING", logger="kuberl.trainer"):
        make_trainer(tmp_path / "a").warn_stale_drop()
        assert caplog.records == []
        make_trainer(tmp_path / "b", drop_stale=True).warn_stale_drop()
    [record] = caplog.records
    assert "dropStaleGroups" in record.getMessage() and "shorter" in record.getMessage()
