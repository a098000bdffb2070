"""An OpenAI-compatible endpoint in front of the local engine, one session per agent episode.

The agent workflow (agent_workflow.py) opens a session per episode and hands the agent function a
client whose base_url is `http://127.0.0.1:PORT/s/<session>/v1` and whose API key is the session's
secret. /v1/chat/completions (tools and tool_calls through the tokenizer's chat template, Hermes
`<tool_call>` syntax), /v1/responses (translated onto the chat path: responses_api.py) and
/v1/completions generate through `generate_continuing`, so a weight update mid-call continues the
generation and every token keeps its version; each call's prompt ids, output ids, behaviour logprobs
and versions are recorded on the session. It listens on 127.0.0.1 only, unless workflow.external serves it, with the
episode API, to agents in their own processes (episode_api.py).
"""

from __future__ import annotations

import asyncio
import copy
import hmac
import json
import logging
import re
import secrets
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from kuberl.runtime.inference.base import EngineError, GenerateRequest, InferenceEngine
from kuberl.runtime.rollout import responses_api
from kuberl.runtime.rollout.proxy_fields import CallOptions, FieldRefused, call_options, split_reasoning, visible_text
from kuberl.runtime.rollout.workflows import PartialGeneration, SamplingConfig, generate_continuing

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
_MARKER = "\x00KUBERL_ASSISTANT\x00"
_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


class ProxyError(Exception):
    """A request the proxy refuses: becomes an OpenAI-style error response with `status`."""

    def __init__(self, message: str, status: int = 400, code: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status = status
        self.code = code


@dataclass
class CallRecord:
    """One model call of an episode, token by token (what the engine saw and generated)."""

    kind: str  # "chat" or "completion"
    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str
    text: str  # the generated text returned to the agent (tool-call markup included)
    messages: list[dict[str, Any]] | None = None  # chat: the request's messages, normalised
    reply: dict[str, Any] | None = None  # chat: the assistant message returned, normalised
    parent: int | None = None  # the earlier call whose prompt + output this call's prompt extends


@dataclass
class Session:
    """One episode's view of the proxy: its own URL path, secret key, and call records."""

    id: str
    key: str
    calls: list[CallRecord] = field(default_factory=list)
    closed: bool = False
    engine_error: EngineError | None = None  # the engine failed under a call: the episode is retried, not failed
    warned: set[str] = field(default_factory=set)
    spent: int = 0  # tokens generated (or reserved by calls in flight) against the episode budget
    responses: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # /v1/responses: id -> its conversation


# ---------------------------------------------------------------------------------------------
# Messages and tool calls (pure)
# ---------------------------------------------------------------------------------------------


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise ProxyError(f"message content parts of type {part.get('type') if isinstance(part, dict) else part!r} are not supported (text only)")
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise ProxyError(f"message content must be a string or a list of text parts, not {type(content).__name__}")


def _tool_calls(raw: Any) -> list[dict[str, Any]]:
    """[(name, arguments as an object)] from OpenAI tool_calls (arguments are JSON strings there)."""
    out = []
    for tc in raw or []:
        fn = (tc or {}).get("function") or {}
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                pass  # keep the string: the template renders it as given
        out.append({"name": fn.get("name", ""), "arguments": args})
    return out


def normalise_message(msg: Any) -> dict[str, Any]:
    """The parts of a chat message that reach the template: role, text, tool calls, tool call id."""
    if not isinstance(msg, dict) or "role" not in msg:
        raise ProxyError("each message must be an object with a role")
    out: dict[str, Any] = {"role": str(msg["role"]), "content": _content_text(msg.get("content"))}
    if msg.get("tool_calls"):
        out["tool_calls"] = _tool_calls(msg["tool_calls"])
    if msg.get("tool_call_id"):
        out["tool_call_id"] = str(msg["tool_call_id"])
    if msg.get("name"):
        out["name"] = str(msg["name"])
    return out


def _same_turn(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two normalised messages render the same (tool call ids aside: clients invent them)."""
    return (a["role"] == b["role"] and a["content"].strip() == b["content"].strip()
            and a.get("tool_calls", []) == b.get("tool_calls", []))


def parse_tool_calls(text: str) -> tuple[str, list[dict[str, Any]]]:
    """Split generated text into content and Hermes/Qwen `<tool_call>{"name", "arguments"}</tool_call>` calls.

    A block that is not a JSON object with a name stays in the content (the model wrote no valid call).
    """
    calls: list[dict[str, Any]] = []

    def take(m: re.Match) -> str:
        try:
            obj = json.loads(m.group(1))
        except json.JSONDecodeError:
            return m.group(0)
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return m.group(0)
        args = obj.get("arguments", {})
        calls.append({"name": obj["name"], "arguments": args if args is not None else {}})
        return ""

    content = _TOOL_CALL.sub(take, text)
    return (content.strip() if calls else content), calls


def _openai_tool_calls(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"id": f"call_{uuid.uuid4().hex[:16]}", "type": "function",
             "function": {"name": c["name"], "arguments": c["arguments"] if isinstance(c["arguments"], str) else json.dumps(c["arguments"])}}
            for c in calls]


class ChatRenderer:
    """Token ids of a conversation through the tokenizer's chat template (tools and tool calls included).

    Templates that know no tools (the builtin tiny model's) get the tools as a system message and
    earlier tool calls inlined as `<tool_call>` text, the same syntax the proxy parses back (JSON with
    non-ASCII text as is, as the templates' `tojson` writes it, not as \\u escapes).
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        template = getattr(tokenizer, "chat_template", None) or ""
        self.native_tools = "tools" in template
        self.native_tool_calls = "tool_calls" in template

    def _prepare(self, messages: list[dict[str, Any]], tools: list | None) -> list[dict[str, Any]]:
        msgs = []
        for m in messages:
            m = dict(m)
            if m.get("tool_calls") and not self.native_tool_calls:
                inline = "".join(f"<tool_call>\n{json.dumps(c, ensure_ascii=False)}\n</tool_call>" for c in m.pop("tool_calls"))
                m["content"] = (m["content"] + "\n" if m["content"] else "") + inline
            msgs.append(m)
        if tools and not self.native_tools:
            desc = ("# Tools\nYou may call these functions:\n<tools>\n" + "\n".join(json.dumps(t, ensure_ascii=False) for t in tools) +
                    "\n</tools>\nTo call one, reply <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>")
            if msgs and msgs[0]["role"] == "system":
                msgs[0] = {**msgs[0], "content": msgs[0]["content"] + "\n\n" + desc}
            else:
                msgs.insert(0, {"role": "system", "content": desc})
        return msgs

    def render(self, messages: list[dict[str, Any]], tools: list | None) -> str:
        kwargs = {"tools": tools} if tools and self.native_tools else {}
        try:
            return self.tokenizer.apply_chat_template(self._prepare(messages, tools), tokenize=False, add_generation_prompt=True, **kwargs)
        except Exception as exc:  # noqa: BLE001  a template error is the request's fault: say so
            raise ProxyError(f"the chat template cannot render these messages: {type(exc).__name__}: {exc}") from exc

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def suffix_ids(self, messages: list[dict[str, Any]], k: int, tools: list | None, ended_with_eos: bool,
                   stop_text: str | None = None) -> list[int]:
        """Tokens after assistant turn `k` (generated earlier, kept token for token): its closing, the later
        messages, and the generation prompt; the turn's closing token is dropped when the generation already ended with it
        (`stop_text`: the text of the stop token it ended with; default the tokenizer's eos)."""
        msgs = copy.deepcopy(messages)
        msgs[k] = {"role": "assistant", "content": _MARKER}
        text = self.render(msgs, tools)
        at = text.find(_MARKER)
        if at < 0:
            raise ProxyError("the chat template dropped an earlier assistant turn; cannot continue its tokens")
        suffix = text[at + len(_MARKER):]
        eos = (stop_text if stop_text is not None else getattr(self.tokenizer, "eos_token", None)) or ""
        if ended_with_eos and eos and suffix.startswith(eos):
            suffix = suffix[len(eos):]
        return self.encode(suffix)


# ---------------------------------------------------------------------------------------------
# The server
# ---------------------------------------------------------------------------------------------


class OpenAIProxy:
    """The aiohttp app serving every session of one rollout agent, in front of one engine."""

    def __init__(self, engine: InferenceEngine, tokenizer: Any, sampling: SamplingConfig, *, port: int = 0,
                 episode_budget: bool = False, host: str = LOOPBACK, routes: Any = None) -> None:
        """`episode_budget`: the episode's calls share maxNewTokens (exportStyle concat: the episode is one sample,
        and the overlong penalty and Dr.GRPO's normaliser measure its generated tokens against maxNewTokens, as for
        a multi-turn episode); else each call may use maxNewTokens (exportStyle individual: a sample per call)."""
        self.engine = engine
        self.episode_budget = episode_budget
        self.tokenizer = tokenizer
        self.renderer = ChatRenderer(tokenizer)
        self.sampling = sampling
        self.port = port
        self.host = host  # another address only for the episode API's agents (episode_api.py); sessions keep their keys
        self.routes = routes  # routes(app): more endpoints on the same server (the episode API)
        self.sessions: dict[str, Session] = {}
        self.warned: set[str] = set()  # request fields ignored with a warning (logged once each)
        self._runner: web.AppRunner | None = None
        self._eos_ids = set(sampling.stop_token_ids) | ({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set())

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/s/{sid}/v1/chat/completions", self._chat)
        app.router.add_post("/s/{sid}/v1/completions", self._completions)
        app.router.add_post("/s/{sid}/v1/responses", self._responses)
        app.router.add_get("/s/{sid}/v1/models", self._models)
        if self.routes is not None:
            self.routes(app)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)  # loopback: never outside the pod
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        log.info("OpenAI-compatible proxy on http://%s:%d", self.host, self.port)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @property
    def started(self) -> bool:
        return self._runner is not None

    # -- sessions ------------------------------------------------------------------------------

    def open_session(self) -> Session:
        s = Session(id=uuid.uuid4().hex, key="kuberl-" + secrets.token_urlsafe(24))
        self.sessions[s.id] = s
        return s

    def base_url(self, session: Session) -> str:
        return f"http://{LOOPBACK}:{self.port}/s/{session.id}/v1"

    def close_session(self, session: Session) -> list[CallRecord]:
        """End a session: later calls with its key are refused; returns its calls in completion order."""
        session.closed = True
        self.sessions.pop(session.id, None)
        return session.calls

    def _session(self, request: web.Request) -> Session:
        s = self.sessions.get(request.match_info["sid"])
        if s is None or s.closed:
            raise ProxyError("unknown or finished session (the episode is over)", status=404, code="session_not_found")
        auth = request.headers.get("Authorization", "")
        if not hmac.compare_digest(auth.removeprefix("Bearer ").strip().encode(), s.key.encode()):
            raise ProxyError("wrong API key for this session", status=401, code="invalid_api_key")
        return s

    # -- requests ------------------------------------------------------------------------------

    def _max_new(self, s: Session, body: dict[str, Any], prompt_len: int) -> int:
        """The call's max_new_tokens: what the agent asked, at most maxNewTokens (what the episode has left of it
        under an episode budget; 0 once it is spent) and the engine's context."""
        asked = body.get("max_completion_tokens") or body.get("max_tokens")
        cap = self.sampling.max_new_tokens
        if self.episode_budget:
            cap -= s.spent
            if cap < 1:
                return 0
        if asked is not None:
            if not isinstance(asked, int) or asked < 1:
                raise ProxyError(f"max_tokens must be a positive integer, got {asked!r}")
            cap = min(cap, asked)
        if self.sampling.max_total_tokens is not None:
            cap = min(cap, self.sampling.max_total_tokens - prompt_len)
        if cap < 1:
            raise ProxyError(f"the prompt has {prompt_len} tokens and leaves no room under the engine's "
                             f"{self.sampling.max_total_tokens}-token context", code="context_length_exceeded")
        return cap

    def warn(self, s: Session, name: str, message: str) -> None:
        """Log an ignored request field once per rollout agent: the same agent code sends it on every call."""
        if name not in self.warned:
            self.warned.add(name)
            log.warning("%s (proxy session %s; logged once)", message, s.id[:8])

    def check_common(self, s: Session, body: dict[str, Any]) -> CallOptions:
        """The request's fields beyond messages or prompt (proxy_fields.py: honoured, ignored with a log, refused)."""
        def warn(name: str, message: str) -> None:
            self.warn(s, name, message)

        for name, ours in (("temperature", self.sampling.temperature), ("top_p", self.sampling.top_p)):
            if body.get(name) is not None and abs(float(body[name]) - ours) > 1e-9:
                warn(name, f"{name}={body[name]} ignored; the engine samples with the manifest's {name}={ours} (the policy the trainer scores)")
        return call_options(body, warn)  # FieldRefused: a 400 naming the field (_handle)

    def _parent(self, s: Session, prompt_ids: list[int]) -> int | None:
        for i in range(len(s.calls) - 1, -1, -1):
            c = s.calls[i]
            n = len(c.prompt_ids) + len(c.output_ids)
            if n <= len(prompt_ids) and prompt_ids[: len(c.prompt_ids)] == c.prompt_ids and prompt_ids[len(c.prompt_ids): n] == c.output_ids:
                return i
        return None

    def _chat_prompt(self, s: Session, messages: list[dict[str, Any]], tools: list | None) -> list[int]:
        """Prompt ids that reuse an earlier call's tokens when the conversation continues it (so the
        episode's calls share a prefix and the engine sees exactly the tokens it generated)."""
        for c in reversed(s.calls):
            if c.messages is None or c.reply is None:
                continue
            k = len(c.messages)
            if len(messages) > k and all(_same_turn(a, b) for a, b in zip(messages[:k], c.messages)) and _same_turn(messages[k], c.reply):
                ended = bool(c.output_ids) and c.output_ids[-1] in self._eos_ids
                stop_text = self.tokenizer.decode(c.output_ids[-1:]) if ended else None
                return c.prompt_ids + c.output_ids + self.renderer.suffix_ids(messages, k, tools, ended, stop_text)
        return self.renderer.encode(self.renderer.render(messages, tools))

    async def _generate(self, s: Session, prompt_ids: list[int], body: dict[str, Any], opts: CallOptions):
        """The engine's answer; under an episode budget that is spent, an empty one that stopped at its length
        (no engine call, nothing recorded: the agent sees finish_reason length and ends its loop)."""
        sp = self.sampling
        max_new = self._max_new(s, body, len(prompt_ids))
        if max_new == 0:
            spent = PartialGeneration(prompt_ids, GenerateRequest(input_ids=prompt_ids, max_new_tokens=0))
            spent.finish_reason = "length"
            return spent
        req = GenerateRequest(input_ids=prompt_ids, max_new_tokens=max_new, temperature=sp.temperature,
                              top_p=sp.top_p, stop_token_ids=list(sp.stop_token_ids), stop=[*sp.stop, *opts.stop])
        s.spent += max_new  # reserved: calls of one episode may run at once
        gen = None
        try:
            gen = await generate_continuing(self.engine, prompt_ids, req)
            return gen
        except EngineError as exc:
            s.engine_error = exc
            raise ProxyError(f"engine error: {exc}", status=exc.status if exc.permanent else 503, code="engine_error") from exc
        finally:
            s.spent -= max_new - (len(gen.output_ids) if gen is not None else 0)

    async def _handle(self, request: web.Request, kind: str) -> web.StreamResponse:
        try:
            s = self._session(request)
            try:
                body = await request.json()
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise ProxyError(f"the request body is not JSON: {exc}") from exc
            if not isinstance(body, dict):
                raise ProxyError("the request body must be a JSON object")
            if kind == "responses":
                return await responses_api.serve(self, request, s, body)
            opts = self.check_common(s, body)
            return await (self._do_chat(request, s, body, opts) if kind == "chat" else self._do_completion(s, body, opts))
        except FieldRefused as exc:
            return web.json_response({"error": {"message": str(exc), "type": "invalid_request_error", "code": "invalid_request_error"}}, status=400)
        except ProxyError as exc:
            return web.json_response({"error": {"message": str(exc), "type": exc.code, "code": exc.code}}, status=exc.status)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, "chat")

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, "completion")

    async def _responses(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, "responses")

    async def _models(self, request: web.Request) -> web.Response:
        try:
            self._session(request)
        except ProxyError as exc:
            return web.json_response({"error": {"message": str(exc), "type": exc.code}}, status=exc.status)
        return web.json_response({"object": "list", "data": [{"id": "policy", "object": "model", "owned_by": "kuberl"}]})

    def _record(self, s: Session, rec: CallRecord) -> None:
        if s.closed:  # the episode ended (timeout) while this call ran: nothing of it is trained
            return
        if not rec.output_ids and rec.finish_reason == "length":  # the episode budget was spent: nothing to train
            return
        rec.parent = self._parent(s, rec.prompt_ids)
        s.calls.append(rec)

    async def _do_chat(self, request: web.Request, s: Session, body: dict[str, Any], opts: CallOptions) -> web.StreamResponse:
        choices, usage = await self.chat_answers(s, body.get("messages"), body, opts)
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        model = str(body.get("model") or "policy")
        if not body.get("stream"):
            return web.json_response({"id": cid, "object": "chat.completion", "created": created, "model": model, "usage": usage,
                                      "choices": choices})
        # Streaming: each whole answer in one delta (generation is not token-streamed), then its finish chunk.
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        for c in choices:
            delta = dict(c["message"])
            if "tool_calls" in delta:
                delta["tool_calls"] = [dict(tc, index=i) for i, tc in enumerate(delta["tool_calls"])]
            for part in ({"index": c["index"], "delta": delta, "finish_reason": None},
                         {"index": c["index"], "delta": {}, "finish_reason": c["finish_reason"]}):
                chunk = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [part]}
                await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def chat_answers(self, s: Session, raw: Any, body: dict[str, Any], opts: CallOptions) -> tuple[list[dict[str, Any]], dict[str, int]]:
        """The n answers to chat messages (`raw`) with `body`'s tools, each recorded as a call, and the usage: what
        /v1/chat/completions and /v1/responses both serve, so that one conversation gives the same tokens through either."""
        if not isinstance(raw, list) or not raw:
            raise ProxyError("messages must be a non-empty list")
        messages = [normalise_message(m) for m in raw]
        tools = body.get("tools") or None
        if tools is not None and not isinstance(tools, list):
            raise ProxyError("tools must be a list")
        tools = tools if opts.tools_enabled else None  # tool_choice none: the model is not offered them
        prompt_ids = self._chat_prompt(s, messages, tools)
        gens = await asyncio.gather(*(self._generate(s, prompt_ids, body, opts) for _ in range(opts.n)))
        choices = [self._chat_choice(s, i, gen, prompt_ids, messages, tools, opts) for i, gen in enumerate(gens)]
        out = sum(len(g.output_ids) for g in gens)
        return choices, {"prompt_tokens": len(prompt_ids), "completion_tokens": out, "total_tokens": len(prompt_ids) + out}

    def _chat_choice(self, s: Session, index: int, gen: Any, prompt_ids: list[int], messages: list[dict[str, Any]],
                     tools: list | None, opts: CallOptions) -> dict[str, Any]:
        """One answer as a chat choice, recorded as a call: its text before any stop string, the reasoning before
        `</think>` apart (reasoning_content), tool calls parsed (only the first with parallel_tool_calls false)."""
        text = self.tokenizer.decode(gen.output_ids, skip_special_tokens=True)
        reasoning, answer = split_reasoning(visible_text(text, opts.stop))
        content, calls = parse_tool_calls(answer) if tools else (answer, [])
        if opts.first_tool_call_only and len(calls) > 1:
            log.info("session %s: parallel_tool_calls false: %d tool calls, the first returned", s.id[:8], len(calls))
            calls = calls[:1]
        finish = "tool_calls" if calls else ("length" if gen.finish_reason == "length" else "stop")
        reply = {"role": "assistant", "content": content} | ({"tool_calls": calls} if calls else {})
        self._record(s, CallRecord("chat", prompt_ids, gen.output_ids, gen.logprobs, gen.versions, gen.finish_reason or "stop",
                                   text, messages=messages, reply=reply))
        message: dict[str, Any] = {"role": "assistant", "content": content if (content or not calls) else None}
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = _openai_tool_calls(calls)
        return {"index": index, "message": message, "finish_reason": finish, "logprobs": None}

    async def _do_completion(self, s: Session, body: dict[str, Any], opts: CallOptions) -> web.Response:
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            prompt_ids = self.renderer.encode(prompt)
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            prompt_ids = list(prompt)
        else:
            raise ProxyError("prompt must be a string or a non-empty list of token ids (one prompt per request)")
        if body.get("stream"):
            raise ProxyError("stream is not supported on /v1/completions; use /v1/chat/completions")
        gens = await asyncio.gather(*(self._generate(s, prompt_ids, body, opts) for _ in range(opts.n)))
        choices = []
        for i, gen in enumerate(gens):
            text = self.tokenizer.decode(gen.output_ids, skip_special_tokens=True)
            self._record(s, CallRecord("completion", prompt_ids, gen.output_ids, gen.logprobs, gen.versions, gen.finish_reason or "stop", text))
            choices.append({"index": i, "text": visible_text(text, opts.stop), "logprobs": None,
                            "finish_reason": "length" if gen.finish_reason == "length" else "stop"})
        out = sum(len(g.output_ids) for g in gens)
        return web.json_response({
            "id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()), "model": str(body.get("model") or "policy"),
            "choices": choices, "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": out, "total_tokens": len(prompt_ids) + out},
        })

