"""The episode API (workflow.external): agents outside the rollout agent open episodes, run them through the proxy with the
episode's own key, and close them with a reward or for workflow.reward to score; timeouts and wrong keys fail as they should.

The engine is test_agent_workflow's scripted one (it records every generation), so every sample can be checked against
what the engine generated, token for token. The external agents here are coroutines of the test talking HTTP to the
server; tests/integration/test_external_agent_run.py trains one in its own process with `kuberl run`.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import aiohttp
import openai
import pytest

from kuberl.api import RLExperimentSpec
from kuberl.runtime.data import Item
from kuberl.runtime.rewards import exact_match_reward
from kuberl.runtime.rollout import episode_api
from kuberl.runtime.rollout.agent_workflow import EpisodeFailed
from kuberl.runtime.rollout.episode_api import ExternalAgentWorkflow
from kuberl.runtime.rollout.registry import WorkflowError
from kuberl.runtime.rollout.workflows import EpisodeContext
from tests.unit.test_agent_workflow import ScriptedEngine, sampling

KEY = "experiment-key-for-tests"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from kuberl.runtime.models import build_tiny_model

    return AutoTokenizer.from_pretrained(build_tiny_model(tmp_path_factory.mktemp("tiny")))
ITEM = Item(3, "Say 5.", "5")


def external(tok, *, n=2, timeout=30.0, claim=30.0, advertise=None):
    return ExternalAgentWorkflow(tok, sampling(tok, n), exact_match_reward, key=KEY, claim_timeout_seconds=claim, timeout_seconds=timeout,
                                 reward_name="exact-match", advertise=advertise)


async def post(url, key, body=None):
    """(status, JSON body or None) of a POST with a Bearer key."""
    async with aiohttp.ClientSession() as http:
        headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
        async with http.post(url, json=body, headers=headers) as r:
            return r.status, (await r.json() if r.content_type == "application/json" else None)


async def open_episode(wf, key=KEY, wait=5.0):
    return await post(f"http://127.0.0.1:{wf.proxy.port}/v1/episodes", key, {"wait_seconds": wait})


async def close_episode(wf, ep, body, key=None):
    return await post(f"http://127.0.0.1:{wf.proxy.port}/v1/episodes/{ep['episode_id']}/close", key or ep["api_key"], body)


async def ask(ep, text="go"):
    """One chat call through the episode's base URL and key, as an external agent's framework makes it."""
    client = openai.AsyncOpenAI(base_url=ep["base_url"], api_key=ep["api_key"], max_retries=0)
    try:
        r = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": ep["item"]["prompt"] + text}])
        return r.choices[0].message.content
    finally:
        await client.close()


def run_group(tok, engine, agents, wf=None):
    """Roll out one ticket's group (ticket t-1) while `agents(wf)` play the external agents; (samples or exception, agents' result)."""
    wf = wf or external(tok, n=len(agents) if isinstance(agents, list) else 2)

    async def main():
        await wf.attach(engine)
        try:
            group = asyncio.create_task(wf.arun_episode(engine, ITEM, EpisodeContext(ticket_id="t-1", seed=None)))
            played = await (asyncio.gather(*(a(wf) for a in agents)) if isinstance(agents, list) else agents(wf))
            try:
                return await group, played
            except EpisodeFailed as exc:
                return exc, played
        finally:
            await wf.aclose()

    return asyncio.run(main())


class TestEpisodesOpenedAndClosed:
    def test_a_group_trains_once_every_episode_is_closed_with_a_reward_or_scored(self, tokenizer):
        engine = ScriptedEngine(tokenizer, lambda ids: "5")

        async def rewarded(wf):
            status, ep = await open_episode(wf)
            assert status == 200 and ep["item"] == {"index": 3, "prompt": "Say 5.", "answer": "5"}
            assert ep["group"]["id"] == "t-1" and ep["group"]["size"] == 2
            await ask(ep)
            return ep, await close_episode(wf, ep, {"reward": 0.25})

        async def scored(wf):
            await asyncio.sleep(0.05)
            status, ep = await open_episode(wf)
            assert status == 200
            await ask(ep)
            return ep, await close_episode(wf, ep, {})  # workflow.reward (exact-match) scores the last answer, "5"

        samples, played = run_group(tokenizer, engine, [rewarded, scored])
        assert not isinstance(samples, Exception), samples
        assert [p[1] for p in played] == [(200, {"episode_id": played[0][0]["episode_id"], "closed": True, "calls": 1}),
                                          (200, {"episode_id": played[1][0]["episode_id"], "closed": True, "calls": 1})]
        assert sorted(s.reward for s in samples) == [0.25, 1.0]
        served = [(req.input_ids, res.output_ids, res.logprobs) for req, res in engine.calls]
        for s in samples:  # each sample is one call, token for token: the prompt the engine saw and what it generated
            assert (s.input_ids, s.output_ids, s.logprobs) in served and all(s.loss_mask)
        assert {p[0]["group"]["index"] for p in played} == {0, 1}

    def test_a_final_answer_given_at_close_is_what_the_reward_function_scores(self, tokenizer):
        engine = ScriptedEngine(tokenizer, lambda ids: "7")  # the model's answer is wrong

        async def agent(wf):
            _, ep = await open_episode(wf)
            await ask(ep)
            return await close_episode(wf, ep, {"final_answer": "5"})

        samples, _ = run_group(tokenizer, engine, [agent])
        assert [s.reward for s in samples] == [1.0]

    def test_an_agent_that_reports_an_error_fails_the_group_with_its_reason(self, tokenizer):
        engine = ScriptedEngine(tokenizer, lambda ids: "5")

        async def agent(wf):
            _, ep = await open_episode(wf)
            await ask(ep)
            return await close_episode(wf, ep, {"error": "tool server down"})

        failed, _ = run_group(tokenizer, engine, [agent])
        assert isinstance(failed, EpisodeFailed) and "tool server down" in str(failed)

    @pytest.mark.parametrize("body, why", [({"reward": float("nan")}, "finite"), ({"reward": True}, "finite"),
                                           ({"reward": 1, "error": "x"}, "one of"), ({"score": 1}, "unknown field")])
    def test_a_bad_close_is_refused_and_the_episode_stays_open(self, tokenizer, body, why):
        engine = ScriptedEngine(tokenizer, lambda ids: "5")

        async def agent(wf):
            _, ep = await open_episode(wf)
            await ask(ep)
            refused = await close_episode(wf, ep, body)
            return refused, await close_episode(wf, ep, {"reward": 0.5})

        samples, [(refused, closed)] = run_group(tokenizer, engine, [agent])
        assert refused[0] == 400 and why in refused[1]["error"]["message"]
        assert closed[0] == 200 and [s.reward for s in samples] == [0.5]

    def test_with_nothing_offered_an_open_waits_then_answers_204(self, tokenizer):
        wf = external(tokenizer)

        async def main():
            await wf.attach(ScriptedEngine(tokenizer, lambda ids: "5"))
            try:
                return await open_episode(wf, wait=0.2)
            finally:
                await wf.aclose()

        assert asyncio.run(main()) == (204, None)


class TestKeys:
    def test_without_the_experiment_key_nothing_is_opened(self, tokenizer):
        engine = ScriptedEngine(tokenizer, lambda ids: "5")

        async def agents(wf):
            refused = [await open_episode(wf, key="wrong"), await open_episode(wf, key=None)]
            _, ep = await open_episode(wf)  # the episode was still there for the right key
            await ask(ep)
            await close_episode(wf, ep, {"reward": 1.0})
            return refused

        samples, refused = run_group(tokenizer, engine, agents, wf=external(tokenizer, n=1))
        assert [r[0] for r in refused] == [401, 401] and len(samples) == 1

    def test_an_episode_key_works_for_its_own_episode_only(self, tokenizer):
        engine = ScriptedEngine(tokenizer, lambda ids: "5")

        async def agents(wf):
            _, a = await open_episode(wf)
            _, b = await open_episode(wf)
            crossed = dict(b, api_key=a["api_key"])  # b's URL with a's key
            with pytest.raises(openai.AuthenticationError):
                await ask(crossed)
            with pytest.raises(openai.AuthenticationError):  # nor the experiment key: it opens episodes, it runs none
                await ask(dict(b, api_key=KEY))
            wrong_close = await close_episode(wf, b, {"reward": 1.0}, key=a["api_key"])
            exp_close = await close_episode(wf, b, {"reward": 1.0}, key=KEY)
            for ep in (a, b):
                await ask(ep)
                assert (await close_episode(wf, ep, {"reward": 1.0}))[0] == 200
            with pytest.raises(openai.NotFoundError):  # a closed episode's key is spent
                await ask(a)
            return wrong_close, exp_close, await close_episode(wf, a, {"reward": 0.0})

        samples, (wrong_close, exp_close, again) = run_group(tokenizer, engine, agents)
        assert wrong_close[0] == 401 and exp_close[0] == 401 and again[0] == 404
        assert len(samples) == 2 and len(engine.calls) == 2  # the refused calls never reached the engine

    def test_a_workflow_without_a_key_is_a_configuration_error(self, monkeypatch, tmp_path):
        monkeypatch.delenv(episode_api.KEY_ENV, raising=False)
        monkeypatch.delenv(episode_api.KEY_FILE_ENV, raising=False)
        with pytest.raises(WorkflowError, match="episode key"):
            episode_api.episode_key()
        (tmp_path / "k").write_text("from-a-file\n")
        monkeypatch.setenv(episode_api.KEY_FILE_ENV, str(tmp_path / "k"))
        assert episode_api.episode_key() == "from-a-file"


class TestTimeouts:
    def test_an_episode_nobody_opens_fails_after_the_claim_timeout(self, tokenizer):
        engine = ScriptedEngine(tokenizer, lambda ids: "5")

        async def nobody(wf):
            return None

        failed, _ = run_group(tokenizer, engine, nobody, wf=external(tokenizer, n=1, claim=0.3))
        assert isinstance(failed, EpisodeFailed) and failed.kind == "unclaimed" and "claimTimeoutSeconds" in str(failed)

    def test_an_episode_not_closed_in_time_fails_and_its_key_and_close_are_refused_after(self, tokenizer):
        engine = ScriptedEngine(tokenizer, lambda ids: "5")

        async def slow(wf):
            _, ep = await open_episode(wf)
            await ask(ep)
            await asyncio.sleep(0.6)
            with pytest.raises(openai.NotFoundError):
                await ask(ep)
            return await close_episode(wf, ep, {"reward": 1.0})

        failed, [late] = run_group(tokenizer, engine, [slow], wf=external(tokenizer, n=1, timeout=0.3))
        assert isinstance(failed, EpisodeFailed) and failed.kind == "timeout" and "episodeTimeoutSeconds" in str(failed)
        assert late[0] == 404


def test_a_rollout_agent_whose_slots_wait_on_external_agents_stays_alive(tokenizer):
    """Liveness (health.py) fails an agent that made no progress for stall_seconds, unless its episodes wait on agents
    elsewhere: restarting the pod would not bring them."""
    from kuberl.runtime.rollout.health import AgentHealth

    clock = SimpleNamespace(now=100.0)
    wf = external(tokenizer, n=1, claim=30.0)
    health = AgentHealth(stall_seconds=10.0, clock=lambda: clock.now)
    health.agent = SimpleNamespace(last_progress=0.0, workflow=wf)
    engine = ScriptedEngine(tokenizer, lambda ids: "5")

    async def main():
        await wf.attach(engine)
        try:
            stalled = health.live()
            group = asyncio.create_task(wf.arun_episode(engine, ITEM, EpisodeContext(ticket_id="t-9", seed=None)))
            await asyncio.sleep(0.05)
            waiting = health.live()
            group.cancel()
            await asyncio.gather(group, return_exceptions=True)
            return stalled, waiting, health.live()
        finally:
            await wf.aclose()

    stalled, waiting, after = asyncio.run(main())
    assert stalled[0] is False and after[0] is False  # nothing offered: a stall like any other
    assert waiting == (True, "waiting for external agents: 1 episodes offered, 0 open")


class TestAddresses:
    """Which host an episode's base URL names (EpisodeAPI.base_url)."""

    def api(self, advertise):
        api = episode_api.EpisodeAPI(episode_api.EpisodeBoard(), KEY, timeout_seconds=1.0, advertise=advertise)
        api.port = 8002
        return api

    def url(self, api, host):
        return api.base_url(SimpleNamespace(host=host), SimpleNamespace(id="x"))

    def test_through_a_service_the_url_names_the_pod_that_holds_the_episode(self):
        assert self.url(self.api("10.1.2.3"), "exp-rollout.ns.svc:8002") == "http://10.1.2.3:8002/s/x/v1"
        assert self.url(self.api("fd00::7"), "exp-rollout.ns.svc:8002") == "http://[fd00::7]:8002/s/x/v1"

    def test_through_loopback_the_url_is_the_address_the_agent_used(self):
        for host in ("127.0.0.1:41000", "localhost:41000", "[::1]:41000"):  # kuberl run; kubectl port-forward
            assert self.url(self.api("10.1.2.3"), host) == f"http://{host}/s/x/v1"

    def test_without_a_pod_address_the_url_is_the_address_the_agent_used(self):
        assert self.url(self.api(None), "agents.example:8002") == "http://agents.example:8002/s/x/v1"


def test_make_workflow_builds_the_external_workflow_from_the_spec(tokenizer, monkeypatch):
    from kuberl.runtime.rollout.workflows import make_workflow

    monkeypatch.setenv(episode_api.KEY_ENV, KEY)
    monkeypatch.setenv(episode_api.PORT_ENV, "0")
    spec = RLExperimentSpec.model_validate({"model": {"builtin": "tiny-qwen2"}, "dataset": {"builtin": "repeat-digit"},
                                            "training": {"totalSteps": 1},
                                            "workflow": {"type": "agent", "external": {"claimTimeoutSeconds": 12}, "episodeTimeoutSeconds": 34}})
    wf = make_workflow(spec, tokenizer)
    assert isinstance(wf, ExternalAgentWorkflow) and (wf.claim_timeout, wf.timeout) == (12, 34)


def test_held_out_evaluation_with_external_agents_is_a_configuration_error(tokenizer, monkeypatch):
    from kuberl.runtime.evaluation import Evaluator

    monkeypatch.setenv(episode_api.KEY_ENV, KEY)
    spec = RLExperimentSpec.model_validate({"model": {"builtin": "tiny-qwen2"}, "dataset": {"builtin": "repeat-digit"},
                                            "training": {"totalSteps": 1}, "evaluation": {"split": "test", "everySteps": 1},
                                            "workflow": {"type": "agent", "external": {}}})
    with pytest.raises(WorkflowError, match="spec.evaluation is not available with workflow.external"):
        Evaluator.from_experiment(spec, tokenizer)
