"""Agent workflows against the real vLLM CPU engine: the real `openai` client -> the proxy -> vLLM.

What an agent's episode records must be exactly what the engine generated (tokens, and log-probs
that the served weights give those tokens in that very context), episodes running at once must never
mix, and a weight update between two calls of one episode must show in the versions and log-probs.
"""

from __future__ import annotations

import asyncio

import openai
import pytest
import pytest_asyncio
import torch
from conftest_engines import generated_tokens

from kuberl.runtime.data import Item
from kuberl.runtime.inference.vllm import VLLMEngine
from kuberl.runtime.rewards import exact_match_reward
from kuberl.runtime.rollout.agent_workflow import AgentWorkflow
from kuberl.runtime.rollout.workflows import EpisodeContext, SamplingConfig

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "Look a digit up.",
                                           "parameters": {"type": "object", "properties": {"digit": {"type": "string"}}}}}]


class RecordingEngine:
    """The real engine, with every (request, result) it served kept."""

    def __init__(self, inner: VLLMEngine) -> None:
        self.inner = inner
        self.calls: list = []

    @property
    def version(self) -> int:
        return self.inner.version

    async def generate(self, req):
        res = await self.inner.generate(req)
        self.calls.append((req, res))
        return res


@pytest_asyncio.fixture(loop_scope="function")
async def engine(vllm_server):
    e = VLLMEngine(url=vllm_server.url)
    await e.start()
    await load(e, vllm_server.model_dir, 0)
    yield e
    await load(e, vllm_server.model_dir, 0)
    await e.close()


async def load(engine, path, version):
    await engine.pause()
    await engine.update_weights_from_disk(str(path), version)
    await engine.resume()


MID_CALL_TOKENS = 40  # the weight update is sent once the call has generated about this many tokens


def hf(path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def teacher_logprobs(model, prompt, output):
    ids = torch.tensor([prompt + output])
    logits = model(ids).logits[0, len(prompt) - 1: -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(output)[:, None])[:, 0].tolist()


def generated(sample):
    return [i for i, m in enumerate(sample.loss_mask) if m]


def make_workflow(tok, agent, n, calls=1):
    """Each call may generate 12 tokens (the agents ask max_tokens 12): a concat episode shares maxNewTokens across its
    calls, so the episode's budget is 12 per call."""
    sampling = SamplingConfig(n=n, max_new_tokens=12 * calls, temperature=1.0, top_p=1.0, stop_token_ids=[tok.eos_token_id],
                              max_total_tokens=512)
    return AgentWorkflow(agent, tok, sampling, exact_match_reward, timeout_seconds=120, name="test")


async def test_concurrent_openai_episodes_record_exactly_what_vllm_generated(engine, vllm_server):
    tok, model = hf(vllm_server.model_dir)
    seen: dict[str, list[str]] = {}

    async def agent(client: openai.AsyncOpenAI, item):
        messages = [{"role": "user", "content": item.prompt}]
        texts = seen.setdefault(f"{item.index}-{id(client)}", [])
        for turn in range(3):
            r = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, temperature=1.0, max_tokens=12)
            texts.append(r.choices[0].message.content or "")
            messages += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": f"Item {item.index}, turn {turn}."}]
        return 0.5

    rec = RecordingEngine(engine)
    wf = make_workflow(tok, agent, n=3, calls=3)
    items = [Item(i, f"Repeat the digit {i}: {str(i) * 5}", "") for i in range(8)]
    try:
        groups = await asyncio.gather(*(wf.arun_episode(rec, it, EpisodeContext(ticket_id=str(it.index))) for it in items))
    finally:
        await wf.aclose()
    assert len(rec.calls) == 8 * 3 * 3 and wf.stats.calls_outside_sample == 0
    served: dict[tuple, list] = {}  # the first prompt is the same for the 3 episodes of an item
    for req, res in rec.calls:
        served.setdefault(tuple(req.input_ids), []).append((res.output_ids, res.logprobs))
    for item, group in zip(items, groups):
        assert len(group) == 3
        for s in group:
            full = s.input_ids + s.output_ids
            text = tok.decode(full)
            assert f"Item {item.index}, turn 1." in text and all(f"Item {j}," not in text for j in range(8) if j != item.index)
            # Each generated run is what vLLM answered to exactly the tokens before it...
            runs, start = [], None
            for i, m in enumerate(s.loss_mask + [0]):
                if m and start is None:
                    start = i
                if not m and start is not None:
                    runs.append((start, i))
                    start = None
            assert len(runs) == 3 and s.num_turns == 3
            for a, b in runs:
                assert (s.output_ids[a:b], s.logprobs[a:b]) in served[tuple(full[: len(s.input_ids) + a])]
            # ...and the log-probs are those the served weights give these tokens in this whole context.
            idx = generated(s)
            ref = teacher_logprobs(model, s.input_ids, s.output_ids)
            assert [s.logprobs[i] for i in idx] == pytest.approx([ref[i] for i in idx], abs=2e-3)
            assert all(v == 0 for i, v in enumerate(s.versions) if s.loss_mask[i]) and all(v == -1 for i, v in enumerate(s.versions) if not s.loss_mask[i])
    # The text each agent saw is the decoded generated run (no re-tokenisation drift).
    assert sum(len(t) for t in seen.values()) == 8 * 3 * 3


async def test_a_weight_update_between_two_calls_of_an_episode_is_recorded_with_each_calls_version(engine, vllm_server):
    tok, old = hf(vllm_server.model_dir)
    _, new = hf(vllm_server.other_weights)
    first_done, updated = asyncio.Event(), asyncio.Event()

    async def agent(client, item):
        messages = [{"role": "user", "content": item.prompt}]
        r = await client.chat.completions.create(model="policy", messages=messages, max_tokens=12)
        first_done.set()
        await updated.wait()
        messages += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": "Once more."}]
        await client.chat.completions.create(model="policy", messages=messages, max_tokens=12)
        return 1.0

    wf = make_workflow(tok, agent, n=1, calls=2)
    task = asyncio.create_task(wf.arun_episode(engine, Item(0, "Repeat the digit 4: 44444", ""), EpisodeContext(ticket_id="w")))
    try:
        await asyncio.wait_for(first_done.wait(), 120)
        await load(engine, vllm_server.other_weights, 1)
        updated.set()
        (s,) = await asyncio.wait_for(task, 120)
    finally:
        await wf.aclose()
    idx = generated(s)
    versions = [s.versions[i] for i in idx]
    switch = versions.index(1)
    assert switch > 0 and set(versions[:switch]) == {0} and set(versions[switch:]) == {1}
    lp_old, lp_new = teacher_logprobs(old, s.input_ids, s.output_ids), teacher_logprobs(new, s.input_ids, s.output_ids)
    first, second = idx[:switch], idx[switch:]
    assert [s.logprobs[i] for i in first] == pytest.approx([lp_old[i] for i in first], abs=2e-3)
    assert [s.logprobs[i] for i in second] == pytest.approx([lp_new[i] for i in second], abs=2e-3)
    assert max(abs(s.logprobs[i] - lp_old[i]) for i in second) > 0.05  # the second call really ran on other weights


async def test_a_weight_update_in_the_middle_of_a_call_continues_it_and_each_token_keeps_its_version(engine, vllm_server):
    tok, old = hf(vllm_server.model_dir)
    _, new = hf(vllm_server.other_weights)

    async def agent(client, item):
        r = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": item.prompt}], max_tokens=460)
        return float(r.choices[0].finish_reason == "length")

    # No stop token: the call runs the whole budget, so the update can land mid-generation. The update is
    # sent once vLLM's own counter of generated tokens shows the call under way: a fixed wait missed the
    # window on a quiet machine, where the tiny model generates the 460 tokens in about 0.1 s.
    sampling = SamplingConfig(n=1, max_new_tokens=460, temperature=1.0, top_p=1.0, stop_token_ids=[], max_total_tokens=512)
    tries = []
    for _ in range(5):
        await load(engine, vllm_server.model_dir, 0)
        wf = AgentWorkflow(agent, tok, sampling, exact_match_reward, timeout_seconds=300, name="test")
        try:
            base = await generated_tokens(engine)
            task = asyncio.create_task(wf.arun_episode(engine, Item(0, "Repeat the digit 7.", ""), EpisodeContext(ticket_id="m")))
            while not task.done() and await generated_tokens(engine) - base < MID_CALL_TOKENS:
                await asyncio.sleep(0.002)
            if task.done():
                tries.append("finished before the update")
                continue
            await load(engine, vllm_server.other_weights, 1)
            (s,) = await asyncio.wait_for(task, 300)
        finally:
            await wf.aclose()
        if set(s.versions) == {0, 1}:
            break
        tries.append(f"versions {sorted(set(s.versions))}")
    else:
        pytest.fail(f"no attempt caught the call mid-generation: {tries}")
    assert s.num_turns == 1 and len(s.output_ids) == 460 and s.reward == 1.0 and all(s.loss_mask)
    switch = s.versions.index(1)
    assert set(s.versions[:switch]) == {0} and set(s.versions[switch:]) == {1}
    lp_old, lp_new = teacher_logprobs(old, s.input_ids, s.output_ids), teacher_logprobs(new, s.input_ids, s.output_ids)
    assert s.logprobs[:switch] == pytest.approx(lp_old[:switch], abs=2e-3)
    assert s.logprobs[switch:] == pytest.approx(lp_new[switch:], abs=2e-3)


async def test_a_tool_calling_agent_exported_individually_trains_one_step_on_exactly_what_vllm_generated(engine, vllm_server, tmp_path):
    """exportStyle individual through the real chain: openai client -> proxy -> vLLM -> one sample per call (2 or 3
    calls an episode, so the groups are ragged) -> one trainer step, whose recomputed pi_prox at the same weights
    equals vLLM's log-probs sample for sample (each sample's tokens sit where the engine generated them)."""
    from kuberl.api import RLExperiment
    from kuberl.runtime.agents.repeat_tools import tool_agent
    from kuberl.runtime.trainer import dist as D
    from kuberl.runtime.trainer.batch import build_batch
    from kuberl.runtime.trainer.trainer import Trainer

    tok, _ = hf(vllm_server.model_dir)

    async def agent(client, item, ctx):
        return await tool_agent(client, item, rounds=1 + int(int(ctx.episode.rsplit("/", 1)[1]) < item.index))  # item i: i episodes check twice

    rec = RecordingEngine(engine)
    sampling = SamplingConfig(n=4, max_new_tokens=8, temperature=1.0, top_p=1.0, stop_token_ids=[tok.eos_token_id], max_total_tokens=512)
    wf = AgentWorkflow(agent, tok, sampling, exact_match_reward, timeout_seconds=120, name="test", export_style="individual", turn_discount=0.9)
    items = [Item(i, f"Repeat the digit {i}: {str(i) * 4}", str(i) * 4) for i in range(3)]
    try:
        groups = await asyncio.gather(*(wf.arun_episode(rec, it, EpisodeContext(ticket_id=str(it.index))) for it in items))
    finally:
        await wf.aclose()
    assert [len(g) for g in groups] == [8, 9, 10] and len(rec.calls) == 27
    served = {(tuple(req.input_ids), tuple(res.output_ids)): res for req, res in rec.calls}
    for g in groups:
        for s in g:
            res = served[(tuple(s.input_ids), tuple(s.output_ids))]  # a call vLLM served, token for token
            assert s.logprobs == res.logprobs and s.loss_mask == [1] * len(s.output_ids) and set(s.versions) <= {0}
            assert "right. Final answer" not in tok.decode(s.output_ids)  # the tool's result is only ever context

    exp = RLExperiment.model_validate({
        "apiVersion": "kuberl.io/v1alpha1", "kind": "RLExperiment", "metadata": {"name": "individual"},
        "spec": {"model": {"path": str(vllm_server.model_dir), "dtype": "float32"}, "dataset": {"builtin": "repeat-digit", "size": 8},
                 "workflow": {"type": "agent", "agent": "kuberl.runtime.agents.repeat_tools:tool_agent", "exportStyle": "individual"},
                 "algorithm": {"name": "grpo", "samplesPerPrompt": 4, "batchSize": 3, "learningRate": 1e-3},
                 "training": {"totalSteps": 1}},
    })
    t = Trainer(exp, bus_url="nats://unused:4222", workdir=tmp_path, handle_sigterm=False)
    try:
        t.setup()
        batch = build_batch([{"group_id": str(i), "samples": [s.model_dump() for s in g]} for i, g in enumerate(groups)], t.n, ragged=t.ragged)
        assert batch.group_sizes == [8, 9, 10] and batch.num_samples == 27
        before = [p.detach().clone() for p in t.model.parameters()]
        t.stage_prox_logp(batch)
        t.stage_advantages(batch)
        stats = t.stage_ppo_update(batch)
        mask = batch.loss_mask.bool()  # pi_prox: the pre-update weights' forward (here the update's own, one minibatch)
        assert (batch.prox_logp[mask] - batch.behave_logp[mask]).abs().max() < 2e-3
        assert stats["tokens"] == float(mask.sum()) and any(not torch.equal(a, p) for a, p in zip(before, t.model.parameters()))
    finally:
        D.shutdown()
