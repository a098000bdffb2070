"""The rollout agent end to end: real nats-server (JetStream), real vLLM CPU server, real tiny model.

The agent loads the latest weights before its first ticket, takes tickets, runs the workflow on the
engine, publishes trajectory groups whose tokens carry the version that generated them, follows
weight updates mid-rollout, rejects all-equal groups under dynamic sampling, and gives tickets back
when stopped.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import pytest_asyncio
from conftest_engines import generated_tokens
from dropped_cancels import drop_cancels

from kuberl.api.v1alpha1 import RLExperiment
from kuberl.runtime.bus import Bus, Ticket
from kuberl.runtime.bus.names import KEY_WEIGHTS
from kuberl.runtime.data import load_items
from kuberl.runtime.inference.vllm import VLLMEngine
from kuberl.runtime.rewards import resolve_reward
from kuberl.runtime.rollout.agent import RolloutAgent
from kuberl.runtime.rollout.workflows import (
    MultiTurnWorkflow,
    RLVRWorkflow,
    SamplingConfig,
    make_workflow,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


def make_experiment(name: str, **algorithm) -> RLExperiment:
    return RLExperiment.model_validate({
        "apiVersion": "kuberl.io/v1alpha1", "kind": "RLExperiment", "metadata": {"name": name},
        "spec": {
            "model": {"builtin": "tiny-qwen2", "dtype": "float32"},
            "dataset": {"builtin": "repeat-digit", "size": 20},
            "workflow": {"reward": "repeat-digit"},
            "algorithm": {"samplesPerPrompt": 4, "maxNewTokens": 8, "batchSize": 2, **algorithm},
            "rollout": {"engine": "vllm", "concurrency": 2, "accelerator": {"type": "cpu"}},
            "training": {"totalSteps": 1},
        },
    })


@pytest_asyncio.fixture(loop_scope="function")
async def engine(vllm_server):
    e = VLLMEngine(url=vllm_server.url)
    await e.start()
    await e.pause()
    await e.update_weights_from_disk(str(vllm_server.model_dir), 0)  # every test starts from v0
    await e.resume()
    yield e
    await e.close()


@pytest_asyncio.fixture(loop_scope="function")
async def bus(nats_server, experiment_name):
    b = await Bus.connect(nats_server.url, experiment_name)
    yield b
    await b.close()


@pytest.fixture
def tokenizer(vllm_server):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(vllm_server.model_dir)


def tickets(n: int, start: int = 0) -> list[Ticket]:
    return [Ticket(ticket_id=f"e0-i{i}-{i}", index=i, epoch=0, issued_version=0) for i in range(start, start + n)]


def agent_for(exp, bus, engine, tokenizer, workdir, workflow=None) -> RolloutAgent:
    workflow = workflow or make_workflow(exp.spec, tokenizer, max_total_tokens=512)
    return RolloutAgent(exp, bus, engine, workflow, load_items(exp.spec.dataset, seed=exp.spec.seed), workdir=workdir,
                        agent_id="agent-under-test", log_every=5)


def long_responses(tokenizer) -> RLVRWorkflow:
    """No stop token: every response runs to the context limit, so updates and stops land mid-generation."""
    return RLVRWorkflow(tokenizer, resolve_reward("repeat-digit"), SamplingConfig(n=4, max_new_tokens=490, max_total_tokens=512))


async def generating(engine: VLLMEngine, run: asyncio.Task) -> None:
    """Wait until the agent's generations are running on the engine."""
    base = await generated_tokens(engine)
    deadline = time.monotonic() + 60
    # A few tokens in, not a fixed wait: on a quiet machine the 8 responses finish in a fraction of a second.
    while await generated_tokens(engine) - base < 8:
        assert not run.done() and time.monotonic() < deadline, "the agent never started generating"
        await asyncio.sleep(0.002)


async def pull_all(bus: Bus, n: int, timeout: float = 30.0):
    groups, deadline = [], time.monotonic() + timeout
    while len(groups) < n and time.monotonic() < deadline:
        for lease in await bus.pull_groups(n - len(groups), timeout=2.0):
            groups.append(lease.value)
            await lease.ack()
    return groups


async def test_the_agent_loads_the_latest_weights_first_and_publishes_groups_stamped_with_that_version(
        bus, engine, tokenizer, vllm_server, experiment_name):
    exp = make_experiment(experiment_name)
    await bus.put_state(KEY_WEIGHTS, {"version": 1, "mode": "disk", "path": str(vllm_server.other_weights), "object": None, "time": time.time()})
    await bus.publish_tickets(tickets(3))
    agent = agent_for(exp, bus, engine, tokenizer, vllm_server.workdir)
    stats = await asyncio.wait_for(agent.run(max_tickets=3), 180)
    assert stats.published == 3 and stats.failed == 0 and engine.version == 1
    groups = await pull_all(bus, 3)
    items = load_items(exp.spec.dataset, seed=exp.spec.seed)
    reward = resolve_reward("repeat-digit")
    assert sorted(g.group_id for g in groups) == ["e0-i0-0", "e0-i1-1", "e0-i2-2"]
    for g in groups:
        assert g.agent == "agent-under-test" and not g.rejected and len(g.samples) == 4
        assert g.head_version == 1
        item = items[g.ticket.index]
        for s in g.samples:
            assert 1 <= len(s.output_ids) <= 8 and set(s.versions) == {1} and set(s.loss_mask) == {1}
            assert all(lp <= 0 for lp in s.logprobs)
            assert s.input_ids == tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": item.prompt}], tokenize=False,
                                                                          add_generation_prompt=True), add_special_tokens=False)["input_ids"]
            assert s.reward == reward(item.prompt, tokenizer.decode(s.output_ids, skip_special_tokens=True), item.answer)
    info = await bus.stream_info()
    assert info["tickets_pending"] == 0 and info["tickets_in_flight"] == 0  # every ticket acked


async def test_a_weight_update_during_rollout_is_loaded_and_unfinished_responses_continue_on_the_new_version(
        bus, engine, tokenizer, vllm_server, experiment_name):
    exp = make_experiment(experiment_name)
    await bus.publish_tickets(tickets(2))
    agent = agent_for(exp, bus, engine, tokenizer, vllm_server.workdir, long_responses(tokenizer))
    run = asyncio.create_task(agent.run(max_tickets=2))
    await generating(engine, run)
    await bus.put_state(KEY_WEIGHTS, {"version": 5, "mode": "disk", "path": str(vllm_server.other_weights), "object": None, "time": time.time()})
    in_flight_at_update = engine._in_flight
    stats = await asyncio.wait_for(run, 300)
    if stats.weight_updates == 0 and in_flight_at_update == 0:
        # Seen once in a module run: the 8 responses had all finished when the update was published, so the
        # agent returned (max_tickets) with nothing to continue. The precondition failed, not the behaviour.
        pytest.xfail("the generations finished before the weight update was published: nothing to continue")
    assert stats.weight_updates == 1 and engine.version == 5, f"in flight when the update was published: {in_flight_at_update}"
    groups = await pull_all(bus, 2)
    samples = [s for g in groups for s in g.samples]
    assert len(samples) == 8
    mixed = [s for s in samples if set(s.versions) == {0, 5}]
    assert mixed, "no response spans the update"
    for s in samples:
        assert s.versions == sorted(s.versions)  # old-version tokens first, then new ones
    assert min(g.head_version for g in groups) == 0


async def test_weights_sent_through_the_bus_object_store_are_downloaded_and_served(
        bus, engine, tokenizer, vllm_server, experiment_name, tmp_path):
    exp = make_experiment(experiment_name)
    prefix = await bus.put_weights(3, vllm_server.other_weights)
    await bus.put_state(KEY_WEIGHTS, {"version": 3, "mode": "bus", "path": None, "object": prefix, "time": time.time()})
    await bus.publish_tickets(tickets(1))
    agent = RolloutAgent(exp, bus, engine, make_workflow(exp.spec, tokenizer, max_total_tokens=512),
                         load_items(exp.spec.dataset, seed=exp.spec.seed), workdir=tmp_path, agent_id="bus-agent",
                         weights_cache=tmp_path / "cache")
    stats = await asyncio.wait_for(agent.run(max_tickets=1), 120)
    assert stats.published == 1 and engine.version == 3
    local = tmp_path / "cache" / prefix
    assert (local / "model.safetensors").read_bytes() == (vllm_server.other_weights / "model.safetensors").read_bytes()
    [group] = await pull_all(bus, 1)
    assert {v for s in group.samples for v in s.versions} == {3}


async def test_dynamic_sampling_rejects_a_group_whose_rewards_are_all_equal(bus, engine, tokenizer, vllm_server, experiment_name):
    exp = make_experiment(experiment_name, dynamicSampling=True)
    flat = RLVRWorkflow(tokenizer, lambda p, c, a: 0.0, SamplingConfig(n=3, max_new_tokens=4, stop_token_ids=[tokenizer.eos_token_id]))
    await bus.publish_tickets(tickets(1))
    stats = await asyncio.wait_for(agent_for(exp, bus, engine, tokenizer, vllm_server.workdir, flat).run(max_tickets=1), 120)
    assert stats.rejected == 1 and stats.published == 0
    [group] = await pull_all(bus, 1)
    assert group.rejected and group.samples == [] and group.group_id == "e0-i0-0"


@pytest.mark.parametrize("cancel", ["reaches-the-agent", "dropped-by-a-bus-call"])
async def test_a_stopped_agent_gives_its_tickets_back_at_once(cancel, monkeypatch, bus, engine, tokenizer, vllm_server,
                                                              experiment_name):
    exp = make_experiment(experiment_name)  # concurrency 2
    # Dropped: one ticket runs and the agent waits in pull_ticket for the next, which comes with the cancel.
    await bus.publish_tickets(tickets(2 if cancel == "reaches-the-agent" else 1))
    if cancel == "dropped-by-a-bus-call":
        drop_cancels(monkeypatch, Bus, "pull_ticket", until_result=True)
    agent = agent_for(exp, bus, engine, tokenizer, vllm_server.workdir, long_responses(tokenizer))
    run = asyncio.create_task(agent.run())
    await generating(engine, run)
    run.cancel()
    if cancel == "dropped-by-a-bus-call":
        await bus.publish_tickets(tickets(1, start=1))
    done, _ = await asyncio.wait({run}, timeout=60)  # a fail, not a hang, when the agent runs on
    assert run in done and run.cancelled(), "the cancelled agent runs on"
    again = [await bus.pull_ticket(timeout=5.0) for _ in range(2)]  # long before the 30 s ack_wait
    assert sorted(lease.value.ticket_id for lease in again if lease) == ["e0-i0-0", "e0-i1-1"]
    assert all(lease.delivered == 2 for lease in again)
    for lease in again:
        await lease.ack()


async def test_multi_turn_feedback_tokens_are_masked_and_the_reward_is_discounted_per_extra_turn(engine, tokenizer):
    def half(p, c, a):  # never "correct", so every episode uses all turns
        return 0.5

    # Every token id stops a turn: each turn is one token, so three turns fit the episode's 6-token budget.
    wf = MultiTurnWorkflow(tokenizer, half, SamplingConfig(n=2, max_new_tokens=6, stop_token_ids=list(range(len(tokenizer)))),
                           max_turns=3, turn_discount=0.5)
    from kuberl.runtime.data import Item
    from kuberl.runtime.rollout.workflows import EpisodeContext

    samples = await wf.arun_episode(engine, Item(0, "Repeat the digit 4.", "44444444"), EpisodeContext())
    fb = wf.feedback_ids(ended_with_eos=False)
    for s in samples:
        assert s.num_turns == 3 and s.reward == pytest.approx(0.5 * 0.5 ** 2)
        masked = [i for i, m in enumerate(s.loss_mask) if m == 0]
        assert len(masked) >= 2 * (len(fb) - 1)  # two feedback turns (minus an eos the model may have said)
        assert all(s.versions[i] == -1 and s.logprobs[i] == 0.0 for i in masked)
        assert all(s.versions[i] == 0 for i, m in enumerate(s.loss_mask) if m == 1)
        text = tokenizer.decode(s.output_ids)
        assert text.count(wf.feedback) == 2 and text.count("<|im_start|>assistant") == 2
