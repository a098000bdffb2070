"""Agent workflows through the OpenAI-compatible proxy, with the real `openai` client and a scripted engine.

The engine is scripted (it records every request and result) so that each test can check the recorded
samples against what the engine generated, token for token; the real vLLM path is in
tests/integration/test_agent.py.
"""

from __future__ import annotations

import asyncio
import hashlib
import json

import openai
import pytest

from kuberl.runtime.data import Item
from kuberl.runtime.inference.base import EngineError, GenerateRequest, GenerateResult
from kuberl.runtime.rewards import exact_match_reward
from kuberl.runtime.rollout.agent_workflow import AgentWorkflow, EpisodeFailed, concat_sample
from kuberl.runtime.rollout.openai_proxy import CallRecord, parse_tool_calls
from kuberl.runtime.rollout.workflows import EpisodeContext, SamplingConfig

ADD_TOOL = {"type": "function", "function": {"name": "add", "description": "a + b",
                                             "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from kuberl.runtime.models import build_tiny_model

    return AutoTokenizer.from_pretrained(build_tiny_model(tmp_path_factory.mktemp("tiny")))


class ScriptedEngine:
    """An InferenceEngine whose answer is `reply(input_ids) + eos`; records (request, result) pairs.

    `abort_after=k` cuts the next generation after k tokens (finish abort), then bumps the version, as a
    weight update does; the continuation request gets the rest.
    """

    def __init__(self, tokenizer, reply, *, version=0):
        self.tok = tokenizer
        self.reply = reply
        self._version = version
        self.calls: list[tuple[GenerateRequest, GenerateResult]] = []
        self.abort_after: int | None = None
        self._rest: list[int] | None = None
        self.fail: EngineError | None = None

    @property
    def version(self):
        return self._version

    async def generate(self, req):
        await asyncio.sleep(0.001)
        if self.fail is not None:
            raise self.fail
        if self._rest is not None:
            ids, self._rest = self._rest, None
        else:
            ids = list(self.tok(self.reply(req.input_ids), add_special_tokens=False)["input_ids"]) + [self.tok.eos_token_id]
        ids = ids[: req.max_new_tokens]
        finish = "stop" if ids and ids[-1] == self.tok.eos_token_id else "length"
        version = self._version
        if self.abort_after is not None:
            ids, self._rest, finish = ids[: self.abort_after], ids[self.abort_after:], "abort"
            self.abort_after = None
            self._version += 1
        res = GenerateResult(ids, [-0.01 * (i + 1) for i in range(len(ids))], finish, version)
        self.calls.append((req, res))
        return res


def sampling(tok, n=1, max_new=256):
    return SamplingConfig(n=n, max_new_tokens=max_new, temperature=1.0, top_p=1.0, stop_token_ids=[tok.eos_token_id], max_total_tokens=4096)


def workflow(tok, agent, *, n=1, timeout=30.0, reward=exact_match_reward):
    return AgentWorkflow(agent, tok, sampling(tok, n), reward, reward_name="exact-match", timeout_seconds=timeout, name="test-agent")


def generated_segments(sample):
    """The sample's runs of mask-1 tokens, with where each starts."""
    segs, cur, start = [], [], None
    for i, (t, m) in enumerate(zip(sample.output_ids, sample.loss_mask)):
        if m:
            if not cur:
                start = i
            cur.append(t)
        elif cur:
            segs.append((start, cur))
            cur = []
    if cur:
        segs.append((start, cur))
    return segs


async def tool_agent(client: openai.AsyncOpenAI, item: Item):
    """Asks, executes the tool call the model makes, asks again; the reward function scores the last answer."""
    messages = [{"role": "user", "content": item.prompt}]
    first = await client.chat.completions.create(model="policy", messages=messages, tools=[ADD_TOOL])
    msg = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls" and msg.tool_calls, msg
    call = msg.tool_calls[0]
    args = json.loads(call.function.arguments)
    messages.append(msg.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": f"result {args['a'] + args['b']}"})
    second = await client.chat.completions.create(model="policy", messages=messages, tools=[ADD_TOOL])
    assert second.choices[0].message.content == "5"
    return None


ADD_ITEM = Item(0, "What is 2 + 3?", "5")


class TestAToolCallingAgent:
    def run(self, tok, engine, agent=tool_agent, item=ADD_ITEM):
        wf = workflow(tok, agent)

        async def go():
            try:
                return await wf.arun_episode(engine, item, EpisodeContext(ticket_id="t1"))
            finally:
                await wf.aclose()

        return wf, asyncio.run(go())

    def engine(self, tok):
        def reply(ids):
            text = tok.decode(ids)
            return "5" if "result 5" in text else '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
        return ScriptedEngine(tok, reply, version=7)

    def test_its_calls_become_one_sample_that_matches_the_engine_token_for_token(self, tokenizer):
        engine = self.engine(tokenizer)
        wf, samples = self.run(tokenizer, engine)
        assert samples is not None and len(samples) == 1
        s = samples[0]
        (req1, res1), (req2, res2) = engine.calls
        # The sample starts with exactly the first prompt; its generated runs are exactly the engine's outputs,
        # each with the engine's logprobs and version.
        assert s.input_ids == req1.input_ids
        segs = generated_segments(s)
        assert [seg for _, seg in segs] == [res1.output_ids, res2.output_ids]
        full = s.input_ids + s.output_ids
        # The second request was the first prompt + what the engine generated + the tool turn (token for token).
        start2 = segs[1][0]
        assert req2.input_ids == full[: len(s.input_ids) + start2]
        assert [lp for lp, m in zip(s.logprobs, s.loss_mask) if m] == res1.logprobs + res2.logprobs
        assert [v for v, m in zip(s.versions, s.loss_mask) if m] == [7] * (len(res1.output_ids) + len(res2.output_ids))
        assert s.reward == 1.0 and s.num_turns == 2

    def test_the_tool_output_is_in_the_sample_but_never_trained_on(self, tokenizer):
        engine = self.engine(tokenizer)
        _, samples = self.run(tokenizer, engine)
        s = samples[0]
        masked = [t for t, m in zip(s.output_ids, s.loss_mask) if not m]
        assert "result 5" in tokenizer.decode(masked)
        assert "result 5" not in tokenizer.decode([t for t, m in zip(s.output_ids, s.loss_mask) if m])
        assert all(v == -1 for v, m in zip(s.versions, s.loss_mask) if not m)

    def test_the_tools_reach_the_prompt_through_the_template(self, tokenizer):
        engine = self.engine(tokenizer)
        self.run(tokenizer, engine)
        assert '"name": "add"' in tokenizer.decode(engine.calls[0][0].input_ids)

    def test_a_weight_update_mid_call_continues_the_generation_and_keeps_each_tokens_version(self, tokenizer):
        engine = self.engine(tokenizer)
        engine.abort_after = 3  # the first call is cut after 3 tokens; the engine then serves v8
        _, samples = self.run(tokenizer, engine)
        s = samples[0]
        gen_versions = [v for v, m in zip(s.versions, s.loss_mask) if m]
        first_len = sum(len(r.output_ids) for _, r in engine.calls[:2])
        assert gen_versions[:3] == [7, 7, 7] and set(gen_versions[3:first_len]) == {8}
        assert set(gen_versions[first_len:]) == {8}  # the second call ran entirely on v8
        assert engine.calls[1][0].input_ids == engine.calls[0][0].input_ids + engine.calls[0][1].output_ids


class CharEngine(ScriptedEngine):
    """Answers its reply one character per token + eos: a split the tokenizer would never make of that text (it merges them)."""

    async def generate(self, req):
        await asyncio.sleep(0.001)
        ids = (self.tok.convert_tokens_to_ids(list(self.reply(req.input_ids))) + [self.tok.eos_token_id])[: req.max_new_tokens]
        res = GenerateResult(ids, [-0.01] * len(ids), "stop", self._version)
        self.calls.append((req, res))
        return res


def episode_of(wf, engine, item=None):
    """One episode of the workflow `wf` on `engine` (its proxy closed after): the samples."""
    async def go():
        try:
            return await wf.arun_episode(engine, item or Item(0, "question", "answer"), EpisodeContext(ticket_id="t"))
        finally:
            await wf.aclose()

    return asyncio.run(go())


def run_episode(tok, engine, agent, samp, **kw):
    wf = AgentWorkflow(agent, tok, samp, exact_match_reward, reward_name="exact-match", timeout_seconds=30.0, name="t", **kw)
    return episode_of(wf, engine)


def proxy_call(tok, reply, create, errors=openai.APIStatusError):
    """One call through a fresh proxy in front of a ScriptedEngine answering `reply`: `create(client)` makes it.
    Returns (engine, the result or the `errors` exception, the session)."""
    from kuberl.runtime.rollout.openai_proxy import OpenAIProxy

    engine = ScriptedEngine(tok, reply)

    async def go():
        proxy = OpenAIProxy(engine, tok, sampling(tok))
        await proxy.start()
        try:
            session = proxy.open_session()
            client = openai.AsyncOpenAI(base_url=proxy.base_url(session), api_key=session.key, max_retries=0)
            try:
                out = await create(client)
            except errors as exc:
                out = exc
            await client.close()
            return out, session
        finally:
            await proxy.stop()

    return engine, *asyncio.run(go())


def test_a_continued_conversation_keeps_the_generated_tokens_and_renders_as_the_chat_template(tokenizer):
    """The second call's prompt is the first call's prompt + exactly the tokens the engine generated (not the tokenizer's
    split of their text) + the template's glue; decoded, it is the template's rendering of the conversation: the answer
    closed by the one <|im_end|> the model generated, not by a second one the template adds."""

    async def agent(client, item):
        messages = [{"role": "user", "content": item.prompt}]
        first = await client.chat.completions.create(model="p", messages=messages)
        messages += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "again"}]
        await client.chat.completions.create(model="p", messages=messages)
        return 1.0

    engine = CharEngine(tokenizer, lambda ids: "answer")
    run_episode(tokenizer, engine, agent, sampling(tokenizer))
    (req1, res1), (req2, _) = engine.calls
    assert res1.output_ids[:-1] != tokenizer("answer", add_special_tokens=False)["input_ids"]  # the premise: not the canonical split
    assert req2.input_ids[: len(req1.input_ids) + len(res1.output_ids)] == req1.input_ids + res1.output_ids
    conversation = [{"role": "user", "content": "question"}, {"role": "assistant", "content": "answer"}, {"role": "user", "content": "again"}]
    assert tokenizer.decode(req2.input_ids) == tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)


def test_the_engine_samples_with_the_manifests_temperature_and_top_p_whatever_the_agent_asks(tokenizer, caplog):
    """The trainer scores the policy at algorithm.temperature (and the engine's top_p is the manifest's): an agent that asks
    for greedy decoding or another top_p is served the manifest's values, with one warning per setting."""

    async def agent(client, item):
        for _ in range(2):
            await client.chat.completions.create(model="p", messages=[{"role": "user", "content": "hi"}], temperature=0.0, top_p=0.5)
        await client.completions.create(model="p", prompt="hi", temperature=1.5)
        return 1.0

    engine = ScriptedEngine(tokenizer, lambda ids: "ok")
    manifest = SamplingConfig(n=1, max_new_tokens=64, temperature=0.7, top_p=0.9, stop_token_ids=[tokenizer.eos_token_id], max_total_tokens=4096)
    run_episode(tokenizer, engine, agent, manifest, export_style="individual")
    assert [(req.temperature, req.top_p) for req, _ in engine.calls] == [(0.7, 0.9)] * 3
    assert caplog.text.count("temperature=0.0 ignored") == 1 and caplog.text.count("top_p=0.5 ignored") == 1


def test_parse_tool_calls_reads_hermes_blocks_and_leaves_broken_ones_as_text():
    content, calls = parse_tool_calls('Let me add.<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>')
    assert content == "Let me add." and calls == [{"name": "add", "arguments": {"a": 1}}]
    content, calls = parse_tool_calls("<tool_call>{not json}</tool_call>")
    assert calls == [] and content == "<tool_call>{not json}</tool_call>"


def test_concat_sample_keeps_only_the_chain_that_ends_at_the_last_call():
    a = CallRecord("chat", [1, 2], [3], [-0.1], [0], "stop", "x")
    b = CallRecord("chat", [9, 9], [4], [-0.2], [1], "stop", "y")  # the agent rewrote its history
    c = CallRecord("chat", [9, 9, 4, 5], [6, 7], [-0.3, -0.4], [2, 2], "stop", "z", parent=1)
    s, left_out = concat_sample([a, b, c], 0.5)
    assert left_out == 1
    assert s.input_ids == [9, 9] and s.output_ids == [4, 5, 6, 7]
    assert s.loss_mask == [1, 0, 1, 1] and s.versions == [1, -1, 2, 2] and s.logprobs == [-0.2, 0.0, -0.3, -0.4]


def prompt_digest_reply(tok):
    """An engine whose answer is a digest of its whole input: any mix-up between sessions shows."""
    return lambda ids: " ".join(hashlib.sha1(str(ids).encode()).hexdigest()[:6])


async def two_call_agent(client: openai.AsyncOpenAI, item: Item):
    messages = [{"role": "user", "content": item.prompt}]
    for _ in range(2):
        r = await client.chat.completions.create(model="policy", messages=messages)
        messages += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": f"again [{item.index}]"}]
        await asyncio.sleep(0.001 * (item.index % 5))  # interleave the episodes
    return float(item.index)


def test_many_concurrent_episodes_through_one_proxy_are_never_mixed(tokenizer):
    engine = ScriptedEngine(tokenizer, prompt_digest_reply(tokenizer))
    wf = workflow(tokenizer, two_call_agent, n=4)
    items = [Item(i, f"question [{i}]", "") for i in range(12)]

    async def go():
        try:
            return await asyncio.gather(*(wf.arun_episode(engine, it, EpisodeContext(ticket_id=f"t{it.index}")) for it in items))
        finally:
            await wf.aclose()

    groups = asyncio.run(go())
    by_input = {tuple(req.input_ids): res for req, res in engine.calls}
    assert len(engine.calls) == 12 * 4 * 2
    for item, group in zip(items, groups):
        assert len(group) == 4 and all(s.reward == float(item.index) for s in group)
        for s in group:
            full = s.input_ids + s.output_ids
            text = tokenizer.decode(full)
            assert f"question [{item.index}]" in text and f"again [{item.index}]" in text
            assert all(f"[{j}]" not in text for j in range(12) if j != item.index)
            for start, seg in generated_segments(s):  # each generated run is what the engine answered to that very prefix
                assert by_input[tuple(full[: len(s.input_ids) + start])].output_ids == seg


class TestBadAgents:
    def run(self, tok, agent, timeout=30.0, n=2):
        engine = ScriptedEngine(tok, lambda ids: "ok")
        wf = workflow(tok, agent, n=n, timeout=timeout)

        async def go():
            try:
                return await wf.arun_episode(engine, Item(3, "q", "ok"), EpisodeContext(ticket_id="t"))
            except EpisodeFailed as exc:  # the rollout agent's poison-ticket rule takes it (retries, then a failed group)
                return exc
            finally:
                await wf.aclose()

        return wf, asyncio.run(go())

    def test_an_agent_that_raises_fails_its_episode_and_the_group_is_rejected(self, tokenizer, caplog):
        async def agent(client, item):
            await client.chat.completions.create(model="p", messages=[{"role": "user", "content": "hi"}])
            raise KeyError("boom")

        wf, out = self.run(tokenizer, agent)
        assert isinstance(out, EpisodeFailed) and wf.stats.failed["raised"] == 2
        assert str(out) == "2 of 2 agent episodes failed; first: the agent raised KeyError: 'boom'"
        assert "the agent raised KeyError: 'boom'" in caplog.text

    def test_an_agent_that_hangs_is_stopped_at_the_episode_timeout(self, tokenizer, caplog):
        async def agent(client, item):
            await asyncio.sleep(3600)

        wf, out = self.run(tokenizer, agent, timeout=0.3)
        assert isinstance(out, EpisodeFailed) and out.kind == "timeout" and wf.stats.failed["timeout"] == 2
        assert "episodeTimeoutSeconds (0.3 s)" in caplog.text

    def test_an_agent_that_returns_a_non_number_fails_its_episode(self, tokenizer, caplog):
        async def agent(client, item):
            await client.chat.completions.create(model="p", messages=[{"role": "user", "content": "hi"}])
            return "great"

        wf, out = self.run(tokenizer, agent)
        assert isinstance(out, EpisodeFailed) and wf.stats.failed["bad-return"] == 2
        assert "returned 'great' (str)" in caplog.text

    def test_an_agent_that_makes_no_call_fails_its_episode(self, tokenizer):
        async def agent(client, item):
            return 1.0

        wf, out = self.run(tokenizer, agent)
        assert isinstance(out, EpisodeFailed) and wf.stats.failed["no-call"] == 2

    def test_an_engine_failure_under_the_agent_gives_the_ticket_back_instead(self, tokenizer):
        engine = ScriptedEngine(tokenizer, lambda ids: "ok")
        engine.fail = EngineError("engine down", status=None)

        async def agent(client, item):
            await client.chat.completions.create(model="p", messages=[{"role": "user", "content": "hi"}])

        wf = workflow(tokenizer, agent, n=1)

        async def go():
            try:
                return await wf.arun_episode(engine, Item(0, "q", "a"), EpisodeContext())
            finally:
                await wf.aclose()

        with pytest.raises(EngineError, match="engine down"):
            asyncio.run(go())
        assert not wf.stats.failed

    def test_a_sync_agent_with_the_sync_client_runs_in_a_thread(self, tokenizer):
        def agent(client: openai.OpenAI, item):
            r = client.chat.completions.create(model="p", messages=[{"role": "user", "content": item.prompt}])
            return r.choices[0].message.content == "ok"

        wf, out = self.run(tokenizer, agent)
        assert [s.reward for s in out] == [1.0, 1.0]


class TestOneHTTPClientForAllEpisodes:
    """Each episode gets its own openai client (own base_url and key) over one shared HTTP client: a new HTTP
    client per episode cost ~17 ms of CPU (its SSL context), on the core the engine shares."""

    def run(self, tok, agent, tickets=3, n=4):
        engine = ScriptedEngine(tok, lambda ids: "ok")
        wf = workflow(tok, agent, n=n)

        async def go():
            try:
                return [await wf.arun_episode(engine, Item(i, "q", "ok"), EpisodeContext(ticket_id=f"t{i}")) for i in range(tickets)]
            finally:
                await wf.aclose()

        return wf, asyncio.run(go())

    def test_async_agents_share_one_http_client_and_closing_their_client_leaves_it_open(self, tokenizer):
        seen = []

        async def agent(client: openai.AsyncOpenAI, item):
            seen.append(client._client)
            async with client:  # closes the openai client on exit, as a tidy agent does
                r = await client.chat.completions.create(model="p", messages=[{"role": "user", "content": item.prompt}])
            await client.close()
            return r.choices[0].message.content == "ok"

        wf, groups = self.run(tokenizer, agent)
        assert [s.reward for g in groups for s in g] == [1.0] * 12  # the episodes after the first closes still reach the proxy
        assert len({id(c) for c in seen}) == 1 and len(seen) == 12
        assert wf._async_http is None and seen[0].is_closed  # aclose() really closes it

    def test_sync_agents_share_one_http_client_and_closing_their_client_leaves_it_open(self, tokenizer):
        seen = []

        def agent(client: openai.OpenAI, item):
            seen.append(client._client)
            r = client.chat.completions.create(model="p", messages=[{"role": "user", "content": item.prompt}])
            client.close()
            return r.choices[0].message.content == "ok"

        wf, groups = self.run(tokenizer, agent)
        assert [s.reward for g in groups for s in g] == [1.0] * 12
        assert len({id(c) for c in seen}) == 1 and len(seen) == 12
        assert wf._sync_http is None and seen[0].is_closed


    @pytest.mark.parametrize("sync", [False, True])
    def test_an_http_proxy_in_the_environment_does_not_reroute_the_loopback_calls(self, tokenizer, monkeypatch, sync):
        for var in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
            monkeypatch.setenv(var, "http://127.0.0.1:9")  # nothing listens there: a rerouted call fails
        monkeypatch.delenv("NO_PROXY", raising=False)
        monkeypatch.delenv("no_proxy", raising=False)

        async def async_agent(client, item):
            return (await client.chat.completions.create(model="p", messages=[{"role": "user", "content": "q"}])).choices[0].message.content == "ok"

        def sync_agent(client, item):
            return client.chat.completions.create(model="p", messages=[{"role": "user", "content": "q"}]).choices[0].message.content == "ok"

        _, groups = self.run(tokenizer, sync_agent if sync else async_agent, tickets=1, n=2)
        assert [s.reward for g in groups for s in g] == [1.0, 1.0]


def test_the_proxy_listens_on_loopback_only_and_checks_each_sessions_key(tokenizer):
    from kuberl.runtime.rollout.openai_proxy import OpenAIProxy

    async def go():
        proxy = OpenAIProxy(ScriptedEngine(tokenizer, lambda ids: "ok"), tokenizer, sampling(tokenizer))
        await proxy.start()
        try:
            addrs = [s.getsockname()[0] for site in proxy._runner.sites for s in site._server.sockets]
            a, b = proxy.open_session(), proxy.open_session()
            wrong = openai.AsyncOpenAI(base_url=proxy.base_url(a), api_key=b.key, max_retries=0)
            with pytest.raises(openai.AuthenticationError):
                await wrong.chat.completions.create(model="p", messages=[{"role": "user", "content": "x"}])
            proxy.close_session(a)
            closed = openai.AsyncOpenAI(base_url=proxy.base_url(a), api_key=a.key, max_retries=0)
            with pytest.raises(openai.NotFoundError):
                await closed.chat.completions.create(model="p", messages=[{"role": "user", "content": "x"}])
            ok = openai.AsyncOpenAI(base_url=proxy.base_url(b), api_key=b.key, max_retries=0)
            chunks = [c async for c in await ok.chat.completions.create(model="p", messages=[{"role": "user", "content": "x"}], stream=True)]
            text = "".join(c.choices[0].delta.content or "" for c in chunks)
            comp = await ok.completions.create(model="p", prompt="hello")
            with pytest.raises(openai.BadRequestError, match="response_format 'json_object' is not supported"):
                await ok.chat.completions.create(model="p", messages=[{"role": "user", "content": "x"}], response_format={"type": "json_object"})
            for c in (wrong, closed, ok):
                await c.close()
            return addrs, text, comp, b
        finally:
            await proxy.stop()

    addrs, text, comp, b = asyncio.run(go())
    assert addrs == ["127.0.0.1"]
    assert text == "ok" and comp.choices[0].text == "ok"
    assert [c.kind for c in b.calls] == ["chat", "completion"]


class TestTheEpisodeBudget:
    """exportStyle concat trains an episode as one sample, and the overlong penalty and Dr.GRPO's normaliser read its
    generated tokens against maxNewTokens: the episode's calls share that budget (as a multi-turn episode's turns do).
    exportStyle individual trains each call as its own sample: each call gets the whole budget."""

    MAX_NEW = 40

    def run(self, tok, export_style):
        engine = ScriptedEngine(tok, lambda ids: " ".join(["step"] * 6))  # ~24 tokens + eos a call (the tiny tokenizer is byte-level)
        finishes: list[str] = []

        async def looping_agent(client, item):
            messages = [{"role": "user", "content": item.prompt}]
            for _ in range(4):  # an agent that keeps calling until the model runs out of room
                out = await client.chat.completions.create(model="policy", messages=messages)
                finishes.append(out.choices[0].finish_reason)
                messages += [out.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "go on"}]
            return 1.0

        wf = AgentWorkflow(looping_agent, tok, sampling(tok, max_new=self.MAX_NEW), exact_match_reward, reward_name="exact-match",
                           timeout_seconds=30.0, name="looping", export_style=export_style)

        async def go():
            try:
                return await wf.arun_episode(engine, Item(0, "start", ""), EpisodeContext(ticket_id="t"))
            finally:
                await wf.aclose()

        return engine, finishes, asyncio.run(go())

    def test_concat_episodes_share_max_new_tokens_and_the_shaping_reads_what_was_generated(self, tokenizer):
        import types

        import torch

        from kuberl.runtime.algorithms.advantages import overlong_penalty

        engine, finishes, samples = self.run(tokenizer, "concat")
        (s,) = samples
        generated = sum(s.loss_mask)
        asked = [req.max_new_tokens for req, _ in engine.calls]
        assert generated == sum(len(res.output_ids) for _, res in engine.calls) == self.MAX_NEW
        assert asked[0] == self.MAX_NEW and asked[1] == self.MAX_NEW - len(engine.calls[0][1].output_ids)
        assert len(engine.calls) == 2  # the spent budget answers later calls without the engine
        assert finishes == ["stop", "length", "length", "length"]
        cfg = types.SimpleNamespace(max_new_tokens=self.MAX_NEW, overlong_buffer=10, overlong_penalty_factor=1.0)
        assert float(overlong_penalty(torch.tensor([generated]), cfg)) == -1.0  # at L_max, as a single call that hit it

    def test_calls_of_one_episode_in_flight_at_once_share_the_budget_too(self, tokenizer):
        """The budget a call may use is reserved when it starts: a second call made while the first runs gets what is left
        (here nothing: it ends at once with finish_reason length), never a second whole budget."""

        class SlowEngine(ScriptedEngine):
            async def generate(self, req):
                await asyncio.sleep(0.3)  # both calls reach the proxy while this one runs
                return await super().generate(req)

        engine = SlowEngine(tokenizer, lambda ids: " ".join(["step"] * 6))  # ~24 tokens + eos, under the budget of 40
        finishes: list[str] = []

        async def parallel_agent(client, item):
            outs = await asyncio.gather(*(client.chat.completions.create(model="policy", messages=[{"role": "user", "content": f"part {k}"}])
                                          for k in range(2)))
            finishes.extend(sorted(o.choices[0].finish_reason for o in outs))
            return 1.0

        (s,) = run_episode(tokenizer, engine, parallel_agent, sampling(tokenizer, max_new=self.MAX_NEW), export_style="concat")
        assert [req.max_new_tokens for req, _ in engine.calls] == [self.MAX_NEW]
        assert finishes == ["length", "stop"] and sum(s.loss_mask) == len(engine.calls[0][1].output_ids) < self.MAX_NEW

    def test_individual_episodes_give_each_call_the_whole_budget(self, tokenizer):
        engine, finishes, samples = self.run(tokenizer, "individual")
        assert [req.max_new_tokens for req, _ in engine.calls] == [self.MAX_NEW] * 4
        assert len(samples) == 4 and all(sum(s.loss_mask) <= self.MAX_NEW for s in samples)
        assert finishes == ["stop"] * 4


class TestRequestFields:
    """The OpenAI fields agent frameworks send (proxy_fields.py): honoured, ignored with one warning, or a 400 naming
    the field, never silently changed."""

    def call(self, tok, reply, **kwargs):
        return proxy_call(tok, reply, lambda client: client.chat.completions.create(
            model="p", messages=[{"role": "user", "content": "q"}], **kwargs), errors=openai.BadRequestError)

    def test_stop_ends_the_answer_there_and_the_trained_tokens_keep_what_was_generated(self, tokenizer):
        engine, out, session = self.call(tokenizer, lambda ids: "Thought: add\nObservation: 5", stop=["Observation:"])
        req, res = engine.calls[0]
        assert "Observation:" in req.stop
        assert out.choices[0].message.content == "Thought: add\n" and out.choices[0].finish_reason == "stop"
        assert session.calls[0].output_ids == res.output_ids  # what the engine generated, as generated

    def test_n_samples_each_answer_independently_and_records_each(self, tokenizer):
        engine, out, session = self.call(tokenizer, lambda ids: "ok", n=3)
        assert [c.index for c in out.choices] == [0, 1, 2] and len(engine.calls) == 3 and len(session.calls) == 3

    def test_a_client_seed_never_reaches_the_engine_and_is_logged_once(self, tokenizer, caplog):
        engine, out, _ = self.call(tokenizer, lambda ids: "ok", seed=7, n=2)
        assert [req.seed for req, _ in engine.calls] == [None, None]
        assert sum("seed=7 ignored" in r.message for r in caplog.records) == 1

    def test_tool_choice_none_leaves_the_tools_out_and_required_is_refused_naming_the_field(self, tokenizer):
        engine, out, _ = self.call(tokenizer, lambda ids: "ok", tools=[ADD_TOOL], tool_choice="none")
        assert '"name": "add"' not in tokenizer.decode(engine.calls[0][0].input_ids)
        _, refused, _ = self.call(tokenizer, lambda ids: "ok", tools=[ADD_TOOL], tool_choice="required")
        assert isinstance(refused, openai.BadRequestError) and "tool_choice 'required' cannot be enforced" in str(refused)

    def test_parallel_tool_calls_false_returns_the_first_call(self, tokenizer):
        two = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call><tool_call>{"name": "add", "arguments": {"a": 3, "b": 4}}</tool_call>'
        _, both, _ = self.call(tokenizer, lambda ids: two, tools=[ADD_TOOL])
        _, first, _ = self.call(tokenizer, lambda ids: two, tools=[ADD_TOOL], parallel_tool_calls=False)
        assert len(both.choices[0].message.tool_calls) == 2
        assert [json.loads(c.function.arguments) for c in first.choices[0].message.tool_calls] == [{"a": 1, "b": 2}]

    def test_reasoning_before_think_end_is_returned_apart_from_the_answer(self, tokenizer):
        _, out, session = self.call(tokenizer, lambda ids: "<think>2 and 3 make 5</think>The answer is 5")
        message = out.choices[0].message
        assert message.content == "The answer is 5" and message.model_extra["reasoning_content"] == "2 and 3 make 5"
        assert "2 and 3 make 5" in session.calls[0].text  # the reasoning is generated, so it is trained

    @pytest.mark.parametrize(("field", "value"), [("logprobs", True), ("top_logprobs", 3), ("logit_bias", {"42": 5}),
                                                  ("frequency_penalty", 0.5), ("presence_penalty", 1.0)])
    def test_sampling_fields_the_token_path_does_not_honour_are_refused_naming_the_field(self, tokenizer, field, value):
        engine, refused, _ = self.call(tokenizer, lambda ids: "ok", **{field: value})
        assert isinstance(refused, openai.BadRequestError) and f"{field}=" in str(refused) and not engine.calls

    def test_their_no_op_values_pass_and_an_unknown_field_is_logged_once_by_name(self, tokenizer, caplog):
        _, out, _ = self.call(tokenizer, lambda ids: "ok", logprobs=False, frequency_penalty=0, logit_bias={}, user="u",
                              extra_body={"guided_choice": ["a"]})
        assert out.choices[0].message.content == "ok"
        assert sum("guided_choice is not a field the agent proxy knows" in r.message for r in caplog.records) == 1
