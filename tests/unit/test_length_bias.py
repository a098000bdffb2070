"""Dropping stale groups biases training toward short answers; training every accepted group does not.

A simulation on a virtual clock drives the real Trainer's collect path (its TicketBook, StalenessManager, `_usable`
and `stage_collect`) with a stand-in bus that plays the agents: each ticket is started when it is published, at the
policy version of that moment, and its group arrives when its longest answer is done. Answer lengths are long-tailed
(lognormal), the policy version moves every step. The groups still generating when the trainer passes v - eta are the
ones with the longest answers, so staleness.dropStaleGroups trains on shorter answers than were sampled; by default
(AReaL: the bound is enforced at admission, the behaviour-weight cap handles the stragglers) every sampled answer is
trained, exactly once. Measured here: 84 of 960 groups over the bound; dropping them cuts the mean trained answer
from 64 to 56 tokens and the dropped groups' median longest answer is 372 tokens against 100 for the trained ones.
"""

from __future__ import annotations

import asyncio
import heapq
import math
import random
import statistics
from dataclasses import dataclass, field

import pytest
import torch

from kuberl.api import RLExperiment
from kuberl.runtime.bus import Sample, Ticket, TrajectoryGroup
from kuberl.runtime.trainer.dist import DistInfo
from kuberl.runtime.trainer.tickets import TicketBook
from kuberl.runtime.trainer.trainer import Trainer

# The workload (each knob commented): generation time has a long tail and the trainer keeps stepping while it finishes.
# It exaggerates the toy run (~2% of groups over the bound there, ~9% here) so that the bias shows in one run.
B, N, ETA = 8, 4, 1  # groups per step, answers per group, staleness bound
STEPS = 120  # training steps: 960 groups, 3,840 answers trained
LENGTH_MEDIAN, LENGTH_SIGMA = 40, 1.0  # lognormal answer lengths in tokens: mean ~66, 1 in 10 over ~140
TOKENS_PER_SECOND = 40.0  # decode speed of one answer: a group takes max(its lengths) / 40 s, median ~2 s
TRAIN_SECONDS = 4.0  # one PPO step on the virtual clock: the trainer, not generation, sets the pace
SEED = 7
ALPHA_CRITICAL = 1.95  # c(alpha) of the two-sample KS test at alpha = 0.001: D > c * sqrt((n + m) / (n * m)) rejects


@dataclass
class AgentsBus:
    """The TrainerBusIO methods the collect stage uses, on a virtual clock, with the agents behind it.

    A ticket is started when it is published, on the weights of the trainer's current version (its head version), and
    generates N answers of lognormal lengths; its group arrives max(lengths) / TOKENS_PER_SECOND later. A pull with
    nothing arrived moves the clock to the next arrival (the trainer waits).
    """

    trainer: Trainer
    rng: random.Random
    now: float = 0.0
    sampled: dict[str, list[int]] = field(default_factory=dict)  # group id -> its answers' lengths, as generated
    _arrivals: list[tuple[float, int, TrajectoryGroup]] = field(default_factory=list)  # a heap by arrival time

    async def publish_tickets(self, tickets: list[Ticket]) -> int:
        for tk in tickets:
            lengths = [max(1, round(self.rng.lognormvariate(math.log(LENGTH_MEDIAN), LENGTH_SIGMA))) for _ in range(N)]
            self.sampled[tk.ticket_id] = lengths
            done = self.now + max(lengths) / TOKENS_PER_SECOND
            heapq.heappush(self._arrivals, (done, len(self.sampled), answers(tk, lengths, self.trainer.version)))
        return len(tickets)

    async def put_tickets(self, state) -> None:
        pass

    async def get_control(self) -> dict:
        return {}

    async def fetch_groups(self, max_n: int, timeout: float) -> list:
        if self._arrivals and self._arrivals[0][0] > self.now:
            self.now = self._arrivals[0][0]
        got = []
        while self._arrivals and self._arrivals[0][0] <= self.now and len(got) < max_n:
            got.append(heapq.heappop(self._arrivals)[2])
        return [(g, g.group_id) for g in got]


def answers(tk: Ticket, lengths: list[int], version: int) -> TrajectoryGroup:
    """A group of len(lengths) answers, every token generated at `version` (rewards alternate: no group is all-equal)."""
    samples = [Sample(input_ids=[1], output_ids=[5] * n, logprobs=[-1.0] * n, versions=[version] * n, loss_mask=[1] * n,
                      reward=float(i % 2)) for i, n in enumerate(lengths)]
    return TrajectoryGroup(group_id=tk.ticket_id, ticket=tk, samples=samples)


@dataclass
class Run:
    lengths: dict[str, list[int]]  # group id -> its answers' lengths, for every group the agents generated
    trained: list[str]  # the groups trained, in order
    trainer: Trainer

    @property
    def untrained(self) -> list[str]:
        """Groups generated but never trained (dropped as stale)."""
        taken = set(self.trained)
        return [g for g in self.lengths if g not in taken]

    def answers(self, groups: list[str]) -> list[int]:
        return [n for g in groups for n in self.lengths[g]]

    def longest(self, groups: list[str]) -> list[int]:
        """Each group's longest answer: what its generation time follows (one value per group, so independent)."""
        return [max(self.lengths[g]) for g in groups]


async def simulate(tmp_path, *, drop_stale: bool) -> Run:
    """STEPS training steps of the real collect path; the version moves after each, as train_one_step does."""
    exp = RLExperiment.model_validate({
        "apiVersion": "kuberl.io/v1alpha1", "kind": "RLExperiment", "metadata": {"name": "length-bias"},
        "spec": {"model": {"builtin": "tiny-qwen2"}, "dataset": {"builtin": "repeat-digit", "size": 1000},
                 "algorithm": {"name": "grpo", "samplesPerPrompt": N, "batchSize": B},
                 "staleness": {"maxHeadOffpolicyness": ETA, **({"dropStaleGroups": True} if drop_stale else {})},
                 "training": {"totalSteps": STEPS}},
    })
    t = Trainer(exp, bus_url="nats://unused:4222", workdir=tmp_path)
    t.info = DistInfo(0, 1, 0, torch.device("cpu"))
    t.book = TicketBook(1000, B, ETA, total_groups=STEPS * B)  # as setup(): never more groups started than training uses
    t.bus = bus = AgentsBus(t, random.Random(SEED))
    trained: list[str] = []
    for _ in range(STEPS):
        await t.stage_issue_tickets()
        plan = await t.stage_collect()
        trained += [g["group_id"] for g in plan["groups"]]
        t.version += 1
        t.step += 1
        t.book.on_consumed(len(plan["groups"]))
        bus.now += TRAIN_SECONDS
    assert not bus._arrivals and not t.buffer, "every group started was trained or dropped: none left over"
    assert len(trained) == len(set(trained)) == STEPS * B
    return Run(lengths=bus.sampled, trained=trained, trainer=t)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[bool, Run]:
    """One simulation per setting (about a second each): default (train every group) and dropStaleGroups on."""
    return {drop: asyncio.run(simulate(tmp_path_factory.mktemp(f"drop-{drop}"), drop_stale=drop)) for drop in (False, True)}


class TestTrainingEveryAcceptedGroup:
    """The default: the ticket gate bounds staleness at admission; every group that comes back is trained."""

    def test_the_trained_answers_are_exactly_the_sampled_ones(self, runs):
        run = runs[False]
        assert run.untrained == []
        assert sorted(run.answers(run.trained)) == sorted(run.answers(list(run.lengths)))
        assert ks_statistic(run.answers(run.trained), run.answers(list(run.lengths))) == 0.0

    def test_stragglers_over_the_bound_were_trained_and_counted_not_dropped(self, runs):
        t = runs[False].trainer
        assert t.dropped_stale == t.book.dropped == 0
        # The same workload that biases the drop below: the test would say nothing without stragglers.
        assert t.over_stale >= 0.05 * STEPS * B, t.over_stale
        assert t.book.issued == t.book.consumed == STEPS * B, "no slot given back: no ticket re-issued"


class TestDroppingStaleGroups:
    """staleness.dropStaleGroups: the groups overtaken are those still generating their longest answers."""

    def test_the_trained_answers_are_shorter_than_the_sampled_ones(self, runs):
        run = runs[True]
        sampled, trained = statistics.mean(run.answers(list(run.lengths))), statistics.mean(run.answers(run.trained))
        assert trained < 0.95 * sampled, f"mean trained length {trained:.1f} vs sampled {sampled:.1f} (measured: 56 vs 64)"
        tail = statistics.quantiles(run.answers(list(run.lengths)), n=10)[-1]  # the sampled answers' 90th percentile
        share = sum(n > tail for n in run.answers(run.trained)) / len(run.answers(run.trained))
        assert share < 0.09, f"{share:.1%} of the trained answers are in the sampled top 10%"

    def test_what_was_dropped_is_not_a_random_subset_but_the_long_groups(self, runs):
        # Dropping independent of length would leave the dropped and the trained groups' longest answers alike;
        # a two-sample KS test rejects that at alpha = 0.001 (one value per group: the samples are independent).
        run = runs[True]
        kept, dropped = run.longest(run.trained), run.longest(run.untrained)
        critical = ALPHA_CRITICAL * math.sqrt((len(kept) + len(dropped)) / (len(kept) * len(dropped)))
        d = ks_statistic(kept, dropped)
        assert d > critical, f"KS D {d:.3f} <= {critical:.3f} ({len(dropped)} groups dropped)"
        assert statistics.median(dropped) > 2 * statistics.median(kept)

    def test_every_dropped_group_gave_its_slot_back_and_was_replaced(self, runs):
        run = runs[True]
        t = run.trainer
        assert len(run.untrained) == t.dropped_stale == t.book.dropped > 0
        assert t.over_stale == 0, "every group over the bound was dropped, none trained"
        assert t.book.issued == STEPS * B + t.book.dropped and t.book.consumed == STEPS * B


def ks_statistic(a: list[int], b: list[int]) -> float:
    """Two-sample Kolmogorov-Smirnov D = max |F_a(x) - F_b(x)| over the empirical CDFs."""
    a, b = sorted(a), sorted(b)
    i = j = 0
    d = 0.0
    for x in sorted(set(a) | set(b)):
        while i < len(a) and a[i] <= x:
            i += 1
        while j < len(b) and b[j] <= x:
            j += 1
        d = max(d, abs(i / len(a) - j / len(b)))
    return d


def test_ks_statistic_is_zero_for_equal_samples_and_one_for_disjoint_ones():
    assert ks_statistic([1, 2, 2, 3], [3, 2, 1, 2]) == 0.0
    assert ks_statistic([1, 2], [3, 4]) == 1.0
    assert ks_statistic([1, 2, 3, 4], [3, 4, 5, 6]) == 0.5
