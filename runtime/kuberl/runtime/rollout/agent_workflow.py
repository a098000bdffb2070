"""`workflow.type: agent`: train an unmodified OpenAI-client agent (`workflow.agent: package.module:function`).

Per ticket the workflow runs samplesPerPrompt episodes; each gets its own proxy session
(openai_proxy.py) and calls `function(client, item)` (also `ctx=AgentContext` if it takes `ctx`) with a
real `openai` client pointed at it: AsyncOpenAI for `async def` agents, OpenAI (run in a thread) else.
The agent returns its reward, or None to let workflow.reward score the final answer. The episode's
calls become samples per workflow.exportStyle:
- concat (the default): one sample; the calls that extend each other share one prefix; the tokens
  between them (tool outputs, user turns, template glue) are in the sample with loss_mask 0, version -1.
- individual (AReaL's style): one sample per call; its prompt is the call's whole context (tool outputs
  included, never trained), its output exactly what the engine generated (loss_mask 1); call k of K
  gets reward * workflow.turnDiscount ** (K - 1 - k). A group then holds >= samplesPerPrompt samples.
A failing agent (raises, times out, returns a non-number, makes no call) fails its episode: the reason
is logged and counted in `stats`, and the ticket fails with EpisodeFailed, which the rollout agent's
poison-ticket rule retries and then publishes as a failed group (its slot goes back); the run goes on.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import math
import os
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from kuberl.api.v1alpha1 import SandboxSpec
from kuberl.runtime.bus.messages import Sample
from kuberl.runtime.data import Item
from kuberl.runtime.inference.base import InferenceEngine
from kuberl.runtime.reward_pool import RewardPool
from kuberl.runtime.rewards import RewardFn
from kuberl.runtime.rollout.openai_proxy import CallRecord, OpenAIProxy
from kuberl.runtime.rollout.registry import WorkflowError, WorkflowSetup, import_path
from kuberl.runtime.rollout.sandbox import SandboxResult, run_python
from kuberl.runtime.rollout.sandbox_server import SANDBOX_URL_ENV, SandboxClient
from kuberl.runtime.rollout.workflows import SamplingConfig

log = logging.getLogger(__name__)

SYNC_AGENT_THREADS = 64  # sync agents run in threads of their own (the default executor has ~6 here)


@dataclass
class AgentContext:
    """What an agent function may ask for with a `ctx` parameter. `await ctx.run_python(code)` runs code in the tool
    sandbox wherever workflow.sandbox.placement puts it (a subprocess here, or the sandbox server: `sandbox_client`)."""

    base_url: str
    api_key: str
    episode: str
    timeout_seconds: float
    sandbox: SandboxSpec = field(default_factory=SandboxSpec)
    sandbox_client: SandboxClient | None = None  # placement pod: the sandbox server's client

    async def run_python(self, code: str) -> SandboxResult:
        """Run `code` in the sandbox with workflow.sandbox's limits; never raises for the code's or the server's faults."""
        if self.sandbox_client is not None:
            return await self.sandbox_client.run(code, self.sandbox)
        return await run_python(code, self.sandbox)


class EpisodeFailed(Exception):
    """The agent's episode cannot be trained on; `kind` is the metric label, the message the reason."""

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(reason)
        self.kind = kind


@dataclass
class AgentWorkflowStats:
    episodes: int = 0
    failed: Counter = field(default_factory=Counter)  # kind -> episodes (raised, timeout, bad-return, no-call, reward)
    calls: int = 0
    calls_outside_sample: int = 0  # calls that did not extend into the final call's conversation (not trained)


def concat_sample(calls: list[CallRecord], reward: float) -> tuple[Sample, int]:
    """One sample from the chain of calls that ends at the last one; returns it and how many calls it left out.

    Each call's prompt extends its parent's prompt + output (openai_proxy keeps those tokens), so the
    chain is one sequence: the root's prompt, then generated tokens (mask 1, their versions and
    logprobs) alternating with the tokens between calls (mask 0, version -1, logprob 0).
    """
    chain: list[CallRecord] = []
    i: int | None = len(calls) - 1
    while i is not None:
        chain.append(calls[i])
        i = calls[i].parent
    chain.reverse()
    root = chain[0]
    out, lps, vers = list(root.output_ids), list(root.logprobs), list(root.versions)
    mask = [1] * len(out)
    end = len(root.prompt_ids) + len(root.output_ids)
    for c in chain[1:]:
        gap = c.prompt_ids[end:]
        out += gap + c.output_ids
        lps += [0.0] * len(gap) + c.logprobs
        vers += [-1] * len(gap) + c.versions
        mask += [0] * len(gap) + [1] * len(c.output_ids)
        end = len(c.prompt_ids) + len(c.output_ids)
    sample = Sample(input_ids=list(root.prompt_ids), output_ids=out, logprobs=lps, versions=vers, loss_mask=mask, reward=reward,
                    num_turns=len(chain), finish_reason=chain[-1].finish_reason)
    return sample, len(calls) - len(chain)


def individual_samples(calls: list[CallRecord], reward: float, turn_discount: float = 1.0) -> list[Sample]:
    """One sample per call (exportStyle individual): its prompt = the call's full context, its output = what the
    engine generated for it (loss_mask 1, its logprobs and versions). Every call shares the episode reward,
    discounted backwards from the last call: call k of K gets reward * turn_discount ** (K - 1 - k)."""
    last = len(calls) - 1
    return [Sample(input_ids=list(c.prompt_ids), output_ids=list(c.output_ids), logprobs=list(c.logprobs), versions=list(c.versions),
                   loss_mask=[1] * len(c.output_ids), reward=reward * turn_discount ** (last - k), num_turns=1,
                   finish_reason=c.finish_reason)
            for k, c in enumerate(calls)]


def check_reward(value: Any) -> float:
    """The agent's return value as a reward: a finite real number (bool counts as 0/1)."""
    if isinstance(value, bool):
        return float(value)
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        raise EpisodeFailed("bad-return", f"the agent returned {value!r} ({type(value).__name__}); expected a finite number (the reward) or None")
    return float(value)


def _shared(client_class: type) -> type:
    """An HTTP client class (httpx's, as openai uses it) whose close()/aclose() leave it open: many openai
    clients share one instance and each may close itself; shutdown() really closes it."""
    if hasattr(client_class, "aclose"):
        class SharedAsync(client_class):  # type: ignore[valid-type,misc]
            async def aclose(self) -> None:
                pass

            async def shutdown(self) -> None:
                await client_class.aclose(self)

        return SharedAsync

    class SharedSync(client_class):  # type: ignore[valid-type,misc]
        def close(self) -> None:
            pass

        def shutdown(self) -> None:
            client_class.close(self)

    return SharedSync


class AgentWorkflow:
    """Runs an agent function once per episode against the local OpenAI-compatible proxy."""

    def __init__(self, agent_fn: Any | None, tokenizer: Any, sampling: SamplingConfig, reward_fn: RewardFn, *, reward_name: str = "reward",
                 timeout_seconds: float = 600.0, sandbox: SandboxSpec | None = None, name: str = "agent",
                 export_style: str = "concat", turn_discount: float = 1.0, scorer: RewardPool | None = None,
                 sandbox_url: str | None = None) -> None:
        self.agent_fn = agent_fn
        self.name = name
        self.is_async, self.wants_ctx = True, False
        if agent_fn is not None:  # None: external agents drive the episodes (episode_api.ExternalAgentWorkflow)
            self._check_agent(agent_fn, name)
        self.tokenizer = tokenizer
        self.sampling = sampling
        self.reward_fn = reward_fn
        self.reward_name = reward_name
        if scorer is None:
            from kuberl.runtime.rollout.workflows import _default_pool

            scorer = _default_pool(reward_fn, reward_name)
        self.scorer = scorer  # workflow.reward off the event loop, with workflow.rewardTimeoutSeconds
        self.timeout = timeout_seconds
        self.sandbox = sandbox or SandboxSpec()
        self.sandbox_client = self._sandbox_client(self.sandbox, sandbox_url)
        if export_style not in ("concat", "individual"):
            raise WorkflowError(f"workflow.exportStyle: {export_style!r} is not concat or individual")
        if not 0.0 < turn_discount <= 1.0:
            raise WorkflowError(f"workflow.turnDiscount: {turn_discount!r} is not in (0, 1]")
        self.export_style = export_style
        self.turn_discount = turn_discount
        self.stats = AgentWorkflowStats()
        self.proxy: OpenAIProxy | None = None
        self._proxy_lock = asyncio.Lock()
        self._threads: ThreadPoolExecutor | None = None
        self._async_http: Any = None  # shared by the episodes' openai clients (see _http_client)
        self._sync_http: Any = None

    def _check_agent(self, agent_fn: Any, name: str) -> None:
        """Refuse an agent that cannot be called as (client, item[, ctx]) now, as a configuration error, not per episode."""
        if not callable(agent_fn):
            raise WorkflowError(f"workflow.agent: {name!r} is a {type(agent_fn).__name__}, not a function")
        self.is_async = inspect.iscoroutinefunction(agent_fn)
        params = inspect.signature(agent_fn).parameters
        positional = [p for p in params.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if len(positional) < 2 and not any(p.kind == p.VAR_POSITIONAL for p in params.values()):
            raise WorkflowError(f"workflow.agent: {name} must take (client, item) and may take ctx; it takes ({', '.join(params)})")
        self.wants_ctx = "ctx" in params

    @staticmethod
    def _sandbox_client(sandbox: SandboxSpec, url: str | None) -> SandboxClient | None:
        """placement pod: the client of the sandbox server at `url`, else None (a subprocess per call); a configuration error
        when placement pod comes without a URL."""
        if sandbox.placement != "pod":
            return None
        if not url:
            raise WorkflowError(f"workflow.sandbox.placement pod needs the sandbox server's URL in ${SANDBOX_URL_ENV} (the operator sets "
                                "it to the Service {name}-sandbox, `kuberl run` to its own sandbox server; `kuberl run --ray` has none: "
                                "use placement process there)")
        try:
            return SandboxClient(url)
        except ValueError as exc:
            raise WorkflowError(f"${SANDBOX_URL_ENV}: {exc}") from exc

    @classmethod
    def from_setup(cls, setup: WorkflowSetup) -> AgentWorkflow:
        w = setup.spec.workflow
        fn = import_path(w.agent or "", "workflow.agent")
        return cls(fn, setup.tokenizer, setup.sampling, setup.reward_fn, reward_name=w.reward, timeout_seconds=w.episode_timeout_seconds,
                   sandbox=w.sandbox, name=w.agent or "agent", export_style=str(w.export_style or "concat"), turn_discount=w.turn_discount,
                   scorer=setup.scorer, sandbox_url=os.environ.get(SANDBOX_URL_ENV) or None)

    async def _proxy_for(self, engine: InferenceEngine) -> OpenAIProxy:
        async with self._proxy_lock:
            if self.proxy is None:
                proxy = OpenAIProxy(engine, self.tokenizer, self.sampling, episode_budget=self.export_style == "concat")
                await proxy.start()
                self.proxy = proxy
            elif self.proxy.engine is not engine:
                raise RuntimeError("one AgentWorkflow serves one engine")
            return self.proxy

    def _http_client(self) -> Any:
        """The HTTP client every episode's openai client shares (one per workflow and client kind).

        A new openai client builds its own HTTP client, whose SSL context alone costs ~17 ms of CPU (measured
        here), on the core the engine shares: for 128 episodes a step, seconds. Sharing one costs ~0.1 ms an
        episode. The agent may close its openai client (`async with`, close()): that leaves the shared one open.
        trust_env=False: the proxy is on loopback, and an HTTP(S)_PROXY in the pod's environment must not reroute it.
        """
        import openai

        if self.is_async:
            if self._async_http is None:
                # openai's aiohttp transport: ~1.3 ms less CPU per call than its httpx one here (older openai: httpx)
                self._async_http = _shared(getattr(openai, "DefaultAioHttpClient", openai.DefaultAsyncHttpxClient))(trust_env=False)
            return self._async_http
        if self._sync_http is None:
            self._sync_http = _shared(openai.DefaultHttpxClient)(trust_env=False)
        return self._sync_http

    async def aclose(self) -> None:
        if self.proxy is not None:
            await self.proxy.stop()
            self.proxy = None
        if self._async_http is not None:
            await self._async_http.shutdown()
            self._async_http = None
        if self._sync_http is not None:
            self._sync_http.shutdown()
            self._sync_http = None
        if self._threads is not None:
            self._threads.shutdown(wait=False, cancel_futures=True)
        if self.sandbox_client is not None:
            await self.sandbox_client.aclose()

    # -- one episode ---------------------------------------------------------------------------

    async def _call_agent(self, base_url: str, api_key: str, item: Item, ctx: AgentContext) -> Any:
        import openai  # the real client library the user's agent already uses

        kwargs = {"ctx": ctx} if self.wants_ctx else {}
        http = self._http_client()
        if self.is_async:
            client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=self.timeout, http_client=http)
            return await self.agent_fn(client, item, **kwargs)  # closing it is a no-op: the HTTP client is shared
        if self._threads is None:
            self._threads = ThreadPoolExecutor(SYNC_AGENT_THREADS, thread_name_prefix="kuberl-agent")
        sync_client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=self.timeout, http_client=http)
        loop = asyncio.get_running_loop()
        # A sync agent past its timeout cannot be stopped: its thread runs on until its next call, which the
        # closed session refuses.
        return await loop.run_in_executor(self._threads, functools.partial(self.agent_fn, sync_client, item, **kwargs))

    async def run_episode(self, engine: InferenceEngine, item: Item, episode: str) -> list[Sample]:
        """One agent episode -> its samples (one for concat, one per call for individual); EpisodeFailed for the
        agent's faults, EngineError for the engine's."""
        proxy = await self._proxy_for(engine)
        session = proxy.open_session()
        base_url = proxy.base_url(session)
        ctx = AgentContext(base_url=base_url, api_key=session.key, episode=episode, timeout_seconds=self.timeout, sandbox=self.sandbox,
                           sandbox_client=self.sandbox_client)
        self.stats.episodes += 1
        try:
            try:
                result = await asyncio.wait_for(self._call_agent(base_url, session.key, item, ctx), self.timeout)
            except TimeoutError:
                raise EpisodeFailed("timeout", f"the agent ran past workflow.episodeTimeoutSeconds ({self.timeout:g} s)") from None
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001  the user's code: any exception fails the episode
                if session.engine_error is not None:
                    raise session.engine_error from exc
                raise EpisodeFailed("raised", f"the agent raised {type(exc).__name__}: {exc}") from exc
        finally:
            calls = proxy.close_session(session)
        return await self.episode_samples(session, calls, result, item, episode)

    async def episode_samples(self, session: Any, calls: list[CallRecord], result: Any, item: Item, episode: str,
                              final: str | None = None) -> list[Sample]:
        """A finished episode's samples: `result` is its reward, or None to score `final` (default: the last call's
        answer) with workflow.reward. The engine's failure under a call fails it as the engine's (the ticket is
        retried), an episode without calls or with a bad reward as the agent's (EpisodeFailed)."""
        if session.engine_error is not None:  # the agent caught the engine's failure: still the engine's
            raise session.engine_error
        if not calls:
            raise EpisodeFailed("no-call", "the agent made no model call through its client (nothing to train on)")
        self.stats.calls += len(calls)
        if result is None:
            if final is None:
                last = calls[-1]
                final = last.reply["content"] if last.reply is not None else last.text
            try:
                reward = await self.scorer.score(item.prompt, final, item.answer, where=f"item {item.index} ({episode})")
            except Exception as exc:  # noqa: BLE001  a user reward function: same treatment as the agent
                raise EpisodeFailed("reward", f"workflow.reward {self.reward_name} failed on the final answer: {exc}") from exc
        else:
            reward = check_reward(result)
        if self.export_style == "individual":
            return individual_samples(calls, reward, self.turn_discount)
        sample, left_out = concat_sample(calls, reward)
        self.stats.calls_outside_sample += left_out
        return [sample]

    async def arun_episode(self, engine: InferenceEngine, item: Item, ctx: Any) -> list[Sample] | None:
        """samplesPerPrompt episodes at once, their samples in episode order; EpisodeFailed if any failed (the
        trainer trains full groups only)."""
        ticket = getattr(ctx, "ticket_id", "") or "episode"
        results = await asyncio.gather(*(self.run_episode(engine, item, f"{ticket}/{i}") for i in range(self.sampling.n)),
                                       return_exceptions=True)
        failures = [r for r in results if isinstance(r, EpisodeFailed)]
        others = [r for r in results if isinstance(r, BaseException) and not isinstance(r, EpisodeFailed)]
        if others:
            raise others[0]  # cancellation, engine errors, bugs: the agent gives the ticket back
        if failures:
            for f in failures:
                self.stats.failed[f.kind] += 1
            counts = ", ".join(f"{k} {v}" for k, v in sorted(self.stats.failed.items()))
            log.warning("agent %s: %d of %d episodes of item %d (ticket %s) failed: %s [failed episodes so far: %s]",
                        self.name, len(failures), len(results), item.index, ticket, failures[0], counts)
            # The rollout agent's poison-ticket rule takes it from here: the ticket is tried again up to
            # rollout.maxTicketAttempts, then published as a failed group with this reason (metrics, status).
            raise EpisodeFailed(failures[0].kind, f"{len(failures)} of {len(results)} agent episodes failed; first: {failures[0]}")
        return [s for r in results for s in r]  # type: ignore[union-attr]
