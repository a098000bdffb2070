"""The episode API: agents in their own processes take the rollout agent's episodes (`workflow.external`).

Per ticket, ExternalAgentWorkflow offers algorithm.samplesPerPrompt episodes on an EpisodeBoard. An external agent
opens one (`POST /v1/episodes`, with the experiment's episode key) and gets the item, its group, and a base URL and
API key scoped to that episode (an OpenAIProxy session: every call recorded token for token, as for in-pod agents);
it runs its agent there and closes the episode (`POST /v1/episodes/{id}/close`, with the episode's key) with a
reward, or with nothing (or a final answer) for workflow.reward to score. The group goes to the trainer once all its
episodes are closed, through the ticket path of in-pod agents (staleness, concurrency slots, retries, failed groups):
only the agent function is replaced. One server carries the proxy and this API: the episode port on every address in
a pod ($KUBERL_EPISODE_PORT, $KUBERL_EPISODE_LISTEN), loopback in `kuberl run`. Called by the rollout agent's main.py
(attach) and make_workflow (workflow.type agent with workflow.external).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import math
import os
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from kuberl.runtime.bus.messages import Sample
from kuberl.runtime.data import Item
from kuberl.runtime.inference.base import InferenceEngine
from kuberl.runtime.rollout.agent_workflow import AgentWorkflow, EpisodeFailed
from kuberl.runtime.rollout.openai_proxy import LOOPBACK, OpenAIProxy, Session
from kuberl.runtime.rollout.registry import WorkflowError, WorkflowSetup

log = logging.getLogger(__name__)

# Set by the rollout StatefulSet (operator builders/rollout.py names the same strings) and by `kuberl run` (launcher.py).
PORT_ENV = "KUBERL_EPISODE_PORT"  # where the proxy and the episode API listen (unset: a free port)
LISTEN_ENV = "KUBERL_EPISODE_LISTEN"  # the address they listen on (unset: 127.0.0.1; a pod: 0.0.0.0)
ADVERTISE_ENV = "KUBERL_EPISODE_ADVERTISE"  # the host base URLs name for agents that came from elsewhere (a pod: its IP)
KEY_ENV = "KUBERL_EPISODE_API_KEY"  # the experiment's episode key (a pod: from the Secret `{name}-episode-api`)
KEY_FILE_ENV = "KUBERL_EPISODE_API_KEY_FILE"  # ... or a file holding it (`kuberl run`: <workdir>/episode-api.key)
MAX_WAIT_SECONDS = 60.0  # the longest an open request waits for an episode (long poll) before a 204


def episode_key() -> str:
    """The experiment's episode key from $KUBERL_EPISODE_API_KEY or the file $KUBERL_EPISODE_API_KEY_FILE names;
    WorkflowError (a configuration error) when neither gives one: the API must never be open to anyone."""
    key = os.environ.get(KEY_ENV, "").strip()
    path = os.environ.get(KEY_FILE_ENV, "").strip()
    if not key and path:
        try:
            key = Path(path).read_text().strip()
        except OSError as exc:
            raise WorkflowError(f"workflow.external: cannot read the episode key file ${KEY_FILE_ENV}={path}: {exc}") from exc
    if not key or any(c.isspace() for c in key):
        raise WorkflowError(f"workflow.external needs the experiment's episode key in ${KEY_ENV} or a file named by ${KEY_FILE_ENV} "
                            "(the operator sets it from the Secret <name>-episode-api; kuberl run writes <workdir>/episode-api.key)")
    return key


@dataclass
class Offer:
    """One episode waiting for, or held by, an external agent."""

    group: str  # the ticket id: every episode of a group is trained together
    index: int  # the episode's place in its group
    size: int  # episodes in the group (samplesPerPrompt)
    item: Item
    session: Session
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    opened: asyncio.Event = field(default_factory=asyncio.Event)
    closed: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    opened_at: float | None = None


class EpisodeBoard:
    """Episodes offered to external agents (first offered, first taken) and those they hold, by id."""

    def __init__(self) -> None:
        self.pending: deque[Offer] = deque()
        self.held: dict[str, Offer] = {}
        self._arrived = asyncio.Condition()

    async def offer(self, o: Offer) -> None:
        async with self._arrived:
            self.pending.append(o)
            self._arrived.notify()

    async def take(self, wait: float) -> Offer | None:
        """The oldest offered episode, marked opened; None if none came within `wait` seconds."""
        deadline = time.monotonic() + wait
        async with self._arrived:
            while not self.pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                try:
                    await asyncio.wait_for(self._arrived.wait(), left)
                except TimeoutError:
                    return None
            o = self.pending.popleft()
        o.opened_at = time.monotonic()
        self.held[o.id] = o
        o.opened.set()
        return o

    def withdraw(self, o: Offer) -> None:
        """The episode is over (closed, timed out, cancelled): nobody may take or close it any more."""
        if o in self.pending:
            self.pending.remove(o)
        self.held.pop(o.id, None)


def _error(status: int, message: str, code: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": code, "code": code}}, status=status)


def _bearer(request: web.Request) -> bytes:
    return request.headers.get("Authorization", "").removeprefix("Bearer ").strip().encode()


def _is_loopback(host: str) -> bool:
    name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
    return name in ("127.0.0.1", "localhost", "[::1]") or name.startswith("127.")


class EpisodeAPI:
    """The HTTP endpoints (routes(app) adds them to the proxy's server): open and close, each checked by its key."""

    def __init__(self, board: EpisodeBoard, key: str, *, timeout_seconds: float, advertise: str | None = None) -> None:
        self.board = board
        self.key = key.encode()
        self.timeout = timeout_seconds
        self.advertise = advertise
        self.port = 0  # the server's, once it listens (base URLs name it)

    def routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/episodes", self.open)
        app.router.add_post("/v1/episodes/{eid}/close", self.close)

    def base_url(self, request: web.Request, session: Session) -> str:
        """The URL the agent reaches this rollout agent's proxy at: the address it used when that is loopback (`kuberl run`,
        kubectl port-forward to the pod), else the pod's own address ($KUBERL_EPISODE_ADVERTISE: a Service would spread
        the episode's calls over pods that do not hold it), else the address it used."""
        host = request.host
        if self.advertise and not _is_loopback(host):
            name = f"[{self.advertise}]" if ":" in self.advertise else self.advertise
            host = f"{name}:{self.port}"
        return f"http://{host}/s/{session.id}/v1"

    async def _json(self, request: web.Request) -> dict[str, Any]:
        if not request.can_read_body:
            return {}
        try:
            body = await request.json()
        except ValueError as exc:
            raise web.HTTPBadRequest(text=f"the request body is not JSON: {exc}") from exc
        if not isinstance(body, dict):
            raise web.HTTPBadRequest(text="the request body must be a JSON object")
        return body

    async def open(self, request: web.Request) -> web.Response:
        """POST /v1/episodes {"wait_seconds": s}: the next episode, or 204 when none was offered within s (default 30)."""
        if not hmac.compare_digest(_bearer(request), self.key):
            return _error(401, "wrong or missing episode key (Authorization: Bearer <the experiment's episode key>)", "invalid_api_key")
        try:
            body = await self._json(request)
        except web.HTTPBadRequest as exc:
            return _error(400, exc.text or "bad request", "invalid_request_error")
        wait = body.get("wait_seconds", 30.0)
        if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not 0 <= wait <= MAX_WAIT_SECONDS:
            return _error(400, f"wait_seconds must be a number of seconds from 0 to {MAX_WAIT_SECONDS:g}, got {wait!r}", "invalid_request_error")
        o = await self.board.take(float(wait))
        if o is None:
            return web.Response(status=204)
        log.info("episode %s (group %s, %d of %d) opened by %s", o.id[:8], o.group, o.index + 1, o.size, request.remote)
        return web.json_response({
            "episode_id": o.id, "group": {"id": o.group, "index": o.index, "size": o.size},
            "item": {"index": o.item.index, "prompt": o.item.prompt, "answer": o.item.answer},
            "base_url": self.base_url(request, o.session), "api_key": o.session.key, "timeout_seconds": self.timeout,
        })

    async def close(self, request: web.Request) -> web.Response:
        """POST /v1/episodes/{id}/close with the episode's key: {"reward": r}, {"final_answer": text} or {} (workflow.reward
        scores the answer given, else the last call's), or {"error": reason} (the episode failed)."""
        o = self.board.held.get(request.match_info["eid"])
        if o is None or o.closed.done():
            return _error(404, "unknown or finished episode (closed, timed out, or never opened)", "episode_not_found")
        if not hmac.compare_digest(_bearer(request), o.session.key.encode()):
            return _error(401, "wrong API key for this episode (close it with the api_key its open returned)", "invalid_api_key")
        try:
            outcome = self.outcome(await self._json(request))
        except (web.HTTPBadRequest, ValueError) as exc:
            return _error(400, getattr(exc, "text", None) or str(exc), "invalid_request_error")
        o.closed.set_result(outcome)
        self.board.withdraw(o)
        return web.json_response({"episode_id": o.id, "closed": True, "calls": len(o.session.calls)})

    @staticmethod
    def outcome(body: dict[str, Any]) -> dict[str, Any]:
        """A close request's body, checked: at most one of reward (a finite number), final_answer (text), error (text)."""
        given = [k for k in ("reward", "final_answer", "error") if body.get(k) is not None]
        unknown = sorted(set(body) - {"reward", "final_answer", "error"})
        if unknown:
            raise ValueError(f"unknown field(s) {', '.join(unknown)}: close takes reward, final_answer or error")
        if len(given) > 1:
            raise ValueError(f"close takes one of reward, final_answer and error, got {', '.join(given)}")
        r = body.get("reward")
        if r is not None and (isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r)):
            raise ValueError(f"reward must be a finite number, got {r!r}")
        for k in ("final_answer", "error"):
            if body.get(k) is not None and not isinstance(body[k], str):
                raise ValueError(f"{k} must be a string")
        return {k: body[k] for k in given}


class ExternalAgentWorkflow(AgentWorkflow):
    """`workflow.type: agent` with `workflow.external`: each episode is run by an agent in its own process, through the
    episode API, instead of an in-pod function; the samples come from its calls as for AgentWorkflow."""

    def __init__(self, tokenizer: Any, sampling: Any, reward_fn: Any, *, key: str, claim_timeout_seconds: float = 600.0,
                 listen: str = LOOPBACK, port: int = 0, advertise: str | None = None, **kwargs: Any) -> None:
        super().__init__(None, tokenizer, sampling, reward_fn, name="external", **kwargs)
        self.board = EpisodeBoard()
        self.api = EpisodeAPI(self.board, key, timeout_seconds=self.timeout, advertise=advertise)
        self.claim_timeout = claim_timeout_seconds
        self.listen = listen
        self.listen_port = port

    @classmethod
    def from_setup(cls, setup: WorkflowSetup) -> ExternalAgentWorkflow:
        w = setup.spec.workflow
        assert w.external is not None
        port = os.environ.get(PORT_ENV, "").strip()
        if port and not port.isdigit():
            raise WorkflowError(f"${PORT_ENV} must be a port number, got {port!r}")
        return cls(setup.tokenizer, setup.sampling, setup.reward_fn, key=episode_key(), claim_timeout_seconds=w.external.claim_timeout_seconds,
                   listen=os.environ.get(LISTEN_ENV, "").strip() or LOOPBACK, port=int(port or 0),
                   advertise=os.environ.get(ADVERTISE_ENV, "").strip() or None, reward_name=w.reward,
                   timeout_seconds=w.episode_timeout_seconds, export_style=str(w.export_style or "concat"), turn_discount=w.turn_discount,
                   scorer=setup.scorer)

    async def attach(self, engine: InferenceEngine) -> OpenAIProxy:
        """Start serving the proxy and the episode API for `engine` (before the first ticket, so agents can poll)."""
        async with self._proxy_lock:
            if self.proxy is None:
                proxy = OpenAIProxy(engine, self.tokenizer, self.sampling, episode_budget=self.export_style == "concat",
                                    host=self.listen, port=self.listen_port, routes=self.api.routes)
                await proxy.start()
                self.proxy, self.api.port = proxy, proxy.port
                log.info("episode API on http://%s:%d/v1/episodes", self.listen, proxy.port)
            elif self.proxy.engine is not engine:
                raise RuntimeError("one AgentWorkflow serves one engine")
            return self.proxy

    def waiting(self) -> str | None:
        """What the episodes wait for, when they wait on external agents (the liveness probe: health.py); else None."""
        if not self.board.pending and not self.board.held:
            return None
        return f"waiting for external agents: {len(self.board.pending)} episodes offered, {len(self.board.held)} open"

    async def _proxy_for(self, engine: InferenceEngine) -> OpenAIProxy:
        return await self.attach(engine)

    async def run_episode(self, engine: InferenceEngine, item: Item, episode: str) -> list[Sample]:
        """Offer the episode (`episode` = "<ticket>/<index>"), wait for an agent to open it (claimTimeoutSeconds) and close
        it (episodeTimeoutSeconds from the open), then make its samples; EpisodeFailed when either wait runs out."""
        proxy = await self.attach(engine)
        group, _, index = episode.rpartition("/")
        o = Offer(group=group, index=int(index), size=self.sampling.n, item=item, session=proxy.open_session())
        self.stats.episodes += 1
        await self.board.offer(o)
        try:
            try:
                await asyncio.wait_for(o.opened.wait(), self.claim_timeout)
            except TimeoutError:
                raise EpisodeFailed("unclaimed", f"no external agent opened the episode within workflow.external.claimTimeoutSeconds "
                                                 f"({self.claim_timeout:g} s)") from None
            try:
                outcome = await asyncio.wait_for(asyncio.shield(o.closed), self.timeout)
            except TimeoutError:
                raise EpisodeFailed("timeout", f"the external agent did not close the episode within workflow.episodeTimeoutSeconds "
                                               f"({self.timeout:g} s) of opening it") from None
        finally:
            self.board.withdraw(o)
            calls = proxy.close_session(o.session)
        if "error" in outcome:
            raise EpisodeFailed("raised", f"the external agent failed the episode: {outcome['error'][:300]}")
        return await self.episode_samples(o.session, calls, outcome.get("reward"), item, episode, final=outcome.get("final_answer"))
