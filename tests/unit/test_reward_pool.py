"""The reward pool (kuberl.runtime.reward_pool): rewards scored in worker processes off the agent's event loop, a
timeout per response (0, counted, the stuck worker replaced), any finite reward accepted, NaN/inf refused with a reason.
The reward functions live at module level: a worker process imports them by name, as it does a user's."""

from __future__ import annotations

import asyncio
import logging
import os
import time

import pytest

from kuberl.runtime import reward_pool
from kuberl.runtime.data import Item
from kuberl.runtime.inference.base import GenerateResult
from kuberl.runtime.reward_pool import RewardPool
from kuberl.runtime.rewards import RewardError, RewardRefused
from kuberl.runtime.rollout.workflows import EpisodeContext, RLVRWorkflow, SamplingConfig

HANG = "hang"


def slow_on_hang(prompt: str, completion: str, answer: str) -> float:
    """Hangs on the response 'hang' (a reward stuck in a regex or a sandbox); else the response's length."""
    if completion == HANG:
        time.sleep(600)
    return float(len(completion))


def answer_as_reward(prompt: str, completion: str, answer: str) -> float:
    """The reference answer is the reward: -1, 3.5, nan, inf... as a reward model or a +-1 verifier gives them."""
    return float(answer)


def sleepy(prompt: str, completion: str, answer: str) -> float:
    time.sleep(float(answer))
    return 1.0


def raises_or_dies(prompt: str, completion: str, answer: str) -> float:
    if completion == "die":
        os._exit(3)
    raise KeyError("no such field")


def pid(prompt: str, completion: str, answer: str) -> float:
    return float(os.getpid())


@pytest.fixture
def pools():
    made: list[RewardPool] = []

    def make(fn, **kw) -> RewardPool:
        kw.setdefault("workers", 2)
        kw.setdefault("timeout_seconds", 2.0)
        made.append(RewardPool(fn, name=getattr(fn, "__name__", "fn"), **kw))
        return made[-1]

    yield make
    for p in made:
        p.close()


class TestTimeout:
    async def test_a_reward_past_the_timeout_scores_zero_is_counted_and_logged_while_the_others_are_scored(self, pools, caplog):
        pool = pools(slow_on_hang, workers=2, timeout_seconds=2.0)
        before = reward_pool.COUNTS.timeouts
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="kuberl.runtime.reward_pool"):
            got = await asyncio.gather(*(pool.score("q", c, "a", where=f"item {i}") for i, c in enumerate([HANG, "ab", "abc", "a"])))
        assert got == [0.0, 2.0, 3.0, 1.0]
        assert pool.timeouts == 1 and reward_pool.COUNTS.timeouts == before + 1
        assert "no result within 2 s for item 0 (response 'hang'): reward 0" in caplog.text
        assert time.monotonic() - t0 < 120, "the hung reward (600 s) held nothing up"
        # The stuck worker was killed and replaced: the pool goes on scoring with both workers.
        assert await asyncio.gather(*(pool.score("q", "x" * n, "a") for n in (4, 5, 6))) == [4.0, 5.0, 6.0]

    async def test_waiting_for_a_free_worker_is_not_timed(self, pools):
        pool = pools(sleepy, workers=1, timeout_seconds=3.0)
        # Three rewards of 1.2 s on one worker: the third waits 2.4 s, then runs 1.2 s, well within its own 3 s.
        assert await asyncio.gather(*(pool.score("q", "c", "1.2") for _ in range(3))) == [1.0, 1.0, 1.0]
        assert pool.timeouts == 0

    async def test_scoring_leaves_the_event_loop_free(self, pools):
        pool = pools(sleepy, workers=1, timeout_seconds=10.0)
        await pool.score("q", "c", "0")  # the worker's start is not what this measures
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.05)
                ticks += 1

        task = asyncio.create_task(ticker())
        assert await pool.score("q", "c", "1.0") == 1.0
        task.cancel()
        assert ticks >= 5, f"the loop ran {ticks} times during a 1 s reward (20 when free, 0 when blocked)"

    async def test_a_function_that_cannot_go_to_a_process_runs_on_threads_with_the_same_timeout(self, pools):
        pool = pools(lambda p, c, a: time.sleep(10) if c == HANG else 0.25, timeout_seconds=1.0)
        assert pool.mode == "thread"
        assert await asyncio.gather(pool.score("q", HANG, "a"), pool.score("q", "ok", "a")) == [0.0, 0.25]
        assert pool.timeouts == 1


class TestRange:
    async def test_any_finite_reward_flows_through(self, pools):
        pool = pools(answer_as_reward)
        assert pool.mode == "process"
        assert await asyncio.gather(*(pool.score("q", "c", a) for a in ("-1", "3.5", "0", "1e6"))) == [-1.0, 3.5, 0.0, 1e6]

    @pytest.mark.parametrize("bad", ["nan", "inf", "-inf"])
    async def test_nan_and_infinity_are_refused_with_the_value_and_counted(self, pools, bad):
        pool = pools(answer_as_reward)
        before = reward_pool.COUNTS.refused
        with pytest.raises(RewardRefused, match=rf"workflow.reward answer_as_reward: returned {bad}; expected a finite number"):
            await pool.score("q", "c", bad)
        assert pool.refused == 1 and reward_pool.COUNTS.refused == before + 1


class TestFailures:
    async def test_a_reward_that_raises_names_the_reward_and_the_item_and_the_worker_goes_on(self, pools):
        pool = pools(raises_or_dies, workers=1)
        with pytest.raises(RewardError, match=r"workflow.reward raises_or_dies raised on item 7: KeyError: 'no such field'"):
            await pool.score("q", "c", "a", where="item 7")
        first = pool._idle[0].process.pid
        with pytest.raises(RewardError, match="KeyError"):
            await pool.score("q", "c", "a")
        assert pool._idle[0].process.pid == first, "an exception is the reward's answer, not a reason to restart"

    async def test_a_worker_that_dies_is_reported_and_replaced(self, pools):
        pool = pools(raises_or_dies, workers=1)
        with pytest.raises(RewardError, match="its worker process died while scoring .* exit code 3"):
            await pool.score("q", "die", "a")
        with pytest.raises(RewardError, match="KeyError"):  # a fresh worker answers
            await pool.score("q", "c", "a")

    async def test_a_function_the_worker_cannot_import_is_refused_at_its_start(self, pools, monkeypatch):
        import sys
        import types

        mod = types.ModuleType("only_in_the_parent")
        exec("def f(p, c, a):\n    return 1.0\n", mod.__dict__)
        monkeypatch.setitem(sys.modules, "only_in_the_parent", mod)
        pool = pools(mod.f)
        assert pool.mode == "process"
        with pytest.raises(RewardError, match="a reward worker process cannot load it: ModuleNotFoundError"):
            await pool.score("q", "c", "a")

    async def test_workers_are_reused_and_stopped_by_close(self, pools):
        pool = pools(pid, workers=1)
        first = await pool.score("q", "c", "a")
        assert await pool.score("q", "c", "a") == first != os.getpid()
        worker = pool._idle[0]
        pool.close()
        assert worker.process.poll() is not None
        with pytest.raises(RewardError, match="closed"):
            await pool.score("q", "c", "a")


class OneToken:
    """A scripted engine: every response is the token 5 (any reward function decides the rest)."""

    async def generate(self, req):
        return GenerateResult([5], [-0.1], "stop", version=1)


class Tok:
    eos_token_id = 0

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [1, 2]}

    def decode(self, ids, skip_special_tokens=True):
        return "c"

    def apply_chat_template(self, msgs, tokenize=False, add_generation_prompt=True):
        return msgs[-1]["content"]


class TestWorkflow:
    def workflow(self, pool: RewardPool) -> RLVRWorkflow:
        return RLVRWorkflow(Tok(), pool.fn, SamplingConfig(n=3, max_new_tokens=4), reward_name=pool.name, scorer=pool)

    async def test_a_reward_of_minus_one_or_three_and_a_half_reaches_the_samples(self, pools):
        wf = self.workflow(pools(answer_as_reward))
        for answer, want in (("-1", -1.0), ("3.5", 3.5)):
            samples = await wf.arun_episode(OneToken(), Item(0, "q", answer), EpisodeContext(ticket_id="t"))
            assert [s.reward for s in samples] == [want] * 3

    async def test_a_nan_reward_rejects_the_group_with_its_reason_logged(self, pools, caplog):
        wf = self.workflow(pools(answer_as_reward))
        with caplog.at_level(logging.WARNING, logger="kuberl.runtime.rollout.workflows"):
            assert await wf.arun_episode(OneToken(), Item(4, "q", "nan"), EpisodeContext(ticket_id="t-9")) is None
        assert "ticket t-9, item 4: group rejected: workflow.reward answer_as_reward: returned nan" in caplog.text

    async def test_a_timed_out_response_scores_zero_and_its_group_is_kept(self, pools):
        wf = self.workflow(pools(sleepy, timeout_seconds=1.0))
        samples = await wf.arun_episode(OneToken(), Item(0, "q", "30"), EpisodeContext())
        assert [s.reward for s in samples] == [0.0] * 3 and wf.scorer.timeouts == 3
