"""The rollout agent honours what a ticket says, on a real nats-server and a real vLLM CPU engine.

A ticket starts only on weights at least as new as the version it was issued at (else, at eta = 0,
the trainer drops the group as stale), and a ticket whose reward fails on every delivery becomes a
failed group after rollout.maxTicketAttempts deliveries instead of bouncing between agents forever.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from test_rollout import agent_for, bus, engine, make_experiment, pull_all, tokenizer  # noqa: F401  (fixtures)

from kuberl.runtime.bus import Ticket
from kuberl.runtime.bus.names import KEY_WEIGHTS
from kuberl.runtime.rewards import resolve_reward
from kuberl.runtime.rollout import agent as agent_module
from kuberl.runtime.rollout.workflows import RLVRWorkflow, SamplingConfig

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


def ticket(i: int, version: int) -> Ticket:
    return Ticket(ticket_id=f"e0-i{i}-{i}", index=i, epoch=0, issued_version=version)


def weights(version: int, path) -> dict:
    return {"version": version, "mode": "disk", "path": str(path), "object": None, "time": time.time()}


def slow_weight_loads(agent, seconds: float) -> None:
    """The follower takes `seconds` before each load (a large model's download): a ticket pulled meanwhile
    would start on the old weights if nothing made it wait."""
    real = agent.apply_weights

    async def slow(w):
        await asyncio.sleep(seconds)
        await real(w)

    agent.apply_weights = slow


async def test_a_ticket_issued_at_a_newer_version_waits_for_those_weights(bus, engine, tokenizer, vllm_server, experiment_name):
    exp = make_experiment(experiment_name)
    agent = agent_for(exp, bus, engine, tokenizer, vllm_server.workdir)
    slow_weight_loads(agent, 3.0)
    run = asyncio.create_task(agent.run(max_tickets=2))
    await asyncio.sleep(1.0)  # the agent serves v0 and waits for tickets
    # What the trainer does after a step: publish v1, then issue tickets at v1.
    await bus.put_state(KEY_WEIGHTS, weights(1, vllm_server.other_weights))
    await bus.publish_tickets([ticket(0, 1), ticket(1, 1)])
    stats = await asyncio.wait_for(run, 180)
    groups = await pull_all(bus, 2)
    assert {v for g in groups for s in g.samples for v in s.versions} == {1}, "a ticket issued at v1 generated on v0"
    assert stats.started_behind == 0 and stats.published == 2 and engine.version == 1


async def test_a_ticket_newer_than_any_published_weights_starts_without_waiting(bus, engine, tokenizer, vllm_server, experiment_name):
    # A trainer restarted from an earlier checkpoint republishes an older version; its old tickets must not hang.
    exp = make_experiment(experiment_name)
    await bus.put_state(KEY_WEIGHTS, weights(1, vllm_server.other_weights))
    await bus.publish_tickets([ticket(0, 4)])
    agent = agent_for(exp, bus, engine, tokenizer, vllm_server.workdir)
    stats = await asyncio.wait_for(agent.run(max_tickets=1), 60)
    [group] = await pull_all(bus, 1)
    assert stats.published == 1 and stats.started_behind == 1 and group.head_version == 1


async def test_a_ticket_whose_reward_always_raises_becomes_a_failed_group_and_the_agent_goes_on(
        bus, engine, tokenizer, vllm_server, experiment_name, monkeypatch):
    monkeypatch.setattr(agent_module, "NAK_DELAY_SECONDS", 0.2)
    exp = make_experiment(experiment_name)
    exp.spec.rollout.max_ticket_attempts = 2
    from kuberl.runtime.data import load_items

    poison = load_items(exp.spec.dataset, seed=exp.spec.seed)[0].prompt
    good = resolve_reward("repeat-digit")

    def reward(prompt, completion, answer):
        if prompt == poison:
            raise ValueError("boom: this item's reward always fails")
        return good(prompt, completion, answer)

    wf = RLVRWorkflow(tokenizer, reward, SamplingConfig(n=2, max_new_tokens=4, stop_token_ids=[tokenizer.eos_token_id]))
    await bus.publish_tickets([ticket(0, 0), ticket(1, 0)])
    agent = agent_for(exp, bus, engine, tokenizer, vllm_server.workdir, wf)
    stats = await asyncio.wait_for(agent.run(max_tickets=3), 120)  # ticket 0 twice, ticket 1 once
    groups = {g.group_id: g for g in await pull_all(bus, 2)}
    assert stats.failed_groups == 1 and stats.failed == 2 and stats.published == 1
    bad = groups["e0-i0-0"]
    assert bad.rejected and bad.samples == [] and "boom" in bad.failure
    assert not groups["e0-i1-1"].rejected and groups["e0-i1-1"].failure is None
    info = await bus.stream_info()
    assert info["tickets_pending"] == 0 and info["tickets_in_flight"] == 0  # the poison ticket is acked, not nak'd again


async def test_a_multi_turn_episode_shares_max_new_tokens_across_its_turns(engine, tokenizer):
    # The overlong penalty and Dr.GRPO's normaliser measure all turns' generated tokens against maxNewTokens:
    # a turn may only use what the earlier turns left.
    from kuberl.runtime.data import Item
    from kuberl.runtime.rollout.workflows import EpisodeContext, MultiTurnWorkflow

    def never(p, c, a):  # never correct: the episode goes on while turns and budget last
        return 0.0

    wf = MultiTurnWorkflow(tokenizer, never, SamplingConfig(n=4, max_new_tokens=6, stop_token_ids=[tokenizer.eos_token_id]),
                           max_turns=3, turn_discount=0.9)
    samples = await wf.arun_episode(engine, Item(0, "Repeat the digit 4.", "44444444"), EpisodeContext())
    for s in samples:
        assert sum(s.loss_mask) <= 6, f"{sum(s.loss_mask)} generated tokens over {s.num_turns} turns for a 6-token budget"
        runs = "".join(map(str, s.loss_mask)).split("0")
        turns = [len(r) for r in runs if r]
        assert len(turns) == s.num_turns and s.reward == 0.0
        assert s.loss_mask[-1] == 1, "feedback appended for a turn that never came"
