"""The OpenAI Responses API (`POST /v1/responses`) as a translation onto the agent proxy's chat path.

openai_proxy.py serves /s/<session>/v1/responses by turning the request into a Chat Completions request
(`to_chat`: input items -> messages, flat function tools -> chat tools, instructions -> a system message,
previous_response_id -> the stored conversation of that response), running it through the very code that
serves /v1/chat/completions (so the same messages give the same prompt tokens and the same training
sample), and turning the chat answer back into a Response object (`response_object`) or its SSE event
sequence (`stream_events`). Fields it cannot honour are refused with FieldRefused naming the field.

Honoured: `input` (a string, or message items with text parts, `function_call` and `function_call_output` items;
`reasoning` items are skipped: their text was generated and is in the recorded tokens), `instructions`, function
`tools`, `tool_choice` and `parallel_tool_calls` (as chat), `previous_response_id` (responses of the open episode;
instructions are not carried over, as OpenAI does), `max_output_tokens`, `stream`. Accepted: `store`, `metadata`,
`user` and other bookkeeping; logged once: `temperature`/`top_p` (the manifest's), `include`, `reasoning`,
`text.verbosity`. Refused, naming the field: hosted tools, image/file parts, `text.format` json_object/json_schema,
`background`, `conversation`, `prompt`, `truncation: auto`, `top_logprobs`, `max_tool_calls` and any other field.
docs/agents.md has the table.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from aiohttp import web

from kuberl.runtime.rollout.proxy_fields import FieldRefused

if TYPE_CHECKING:
    from kuberl.runtime.rollout.openai_proxy import OpenAIProxy, Session

# Fields accepted as they are: bookkeeping that changes nothing the engine generates.
_ACCEPTED = {"model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "previous_response_id",
             "max_output_tokens", "temperature", "top_p", "stream", "store", "metadata", "user", "safety_identifier",
             "prompt_cache_key", "prompt_cache_retention", "prompt_cache_options", "service_tier", "stream_options", "text",
             "include", "reasoning", "truncation", "background"}
# Fields that ask for something the proxy does not do: logged once, since honouring them would change the policy
# the trainer scores (reasoning effort) or they only add detail to the answer (include).
_LOGGED = {"include": "include={value!r} ignored: the proxy returns no extra output data (log-probs, encrypted reasoning)",
           "reasoning": "reasoning={value!r} ignored: the policy's reasoning is what it generates; the effort is not set per call",
           "service_tier": "service_tier={value!r} ignored: one engine serves every call"}
_TEXT_PARTS = {"input_text", "output_text", "text"}


@dataclass
class ChatRequest:
    """A Responses request as the proxy's chat path sees it."""

    messages: list[dict[str, Any]]  # chat-format messages: instructions (system) first, then the conversation
    history: list[dict[str, Any]]  # the conversation without the instructions: stored under the response's id
    body: dict[str, Any]  # the chat request fields: tools, tool_choice, parallel_tool_calls, max_tokens, temperature, top_p
    tools: list[dict[str, Any]] = field(default_factory=list)  # the request's tools as it sent them (echoed in the Response)


def to_chat(body: dict[str, Any], stored: Mapping[str, list[dict[str, Any]]], warn: Callable[[str, str], None]) -> ChatRequest:
    """The chat request for a Responses request; `stored`: the conversations of the episode's earlier responses, by id.

    FieldRefused names any field the proxy cannot honour; `warn(field, message)` for a field it ignores."""
    _check_fields(body, warn)
    prior: list[dict[str, Any]] = []
    prev = body.get("previous_response_id")
    if prev is not None:
        if prev not in stored:
            raise FieldRefused(f"previous_response_id {prev!r} is not a response of this episode (the proxy keeps the "
                               "responses of the open episode only); replay the input instead")
        prior = [dict(m) for m in stored[prev]]
    history = prior + input_messages(body.get("input"))
    if not history:
        raise FieldRefused("input must be a non-empty string or list of items")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise FieldRefused(f"instructions must be a string, got {type(instructions).__name__}")
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + history
    tools = body.get("tools") or []
    chat: dict[str, Any] = {"tools": chat_tools(tools) or None}
    for name in ("tool_choice", "parallel_tool_calls", "temperature", "top_p"):
        if body.get(name) is not None:
            chat[name] = _tool_choice(body[name]) if name == "tool_choice" else body[name]
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    return ChatRequest(messages, history, chat, list(tools))


def _check_fields(body: dict[str, Any], warn: Callable[[str, str], None]) -> None:
    """Refuse what cannot be honoured, naming the field; log once what is ignored."""
    for name, value in body.items():
        if value is None:
            continue
        if name not in _ACCEPTED:
            raise FieldRefused(f"{name} is not supported by the proxy's Responses API (it serves input, instructions, function "
                               "tools, tool_choice, previous_response_id, max_output_tokens, stream)")
        if name in _LOGGED and value not in ([], {}):
            warn(name, _LOGGED[name].format(value=value))
    if body.get("background"):
        raise FieldRefused("background true is not supported: the proxy answers each call while the agent waits")
    if body.get("truncation") not in (None, "disabled"):
        raise FieldRefused(f"truncation {body['truncation']!r} is not supported: the proxy never drops context (a prompt "
                           "past the engine's context is refused); send truncation disabled")
    text = body.get("text")
    if text is not None:
        fmt = (text.get("format") or {}) if isinstance(text, dict) else None
        kind = fmt.get("type") if isinstance(fmt, dict) else fmt
        if kind not in (None, "text"):
            raise FieldRefused(f"text.format {kind!r} is not supported: the rollout engine's token path has no constrained "
                               "decoding; ask for JSON in the prompt and parse the text")
        if text.get("verbosity") is not None:
            warn("text.verbosity", f"text.verbosity={text['verbosity']!r} ignored: the policy answers as it samples")


def _tool_choice(choice: Any) -> Any:
    """Responses' tool_choice in chat's form, for proxy_fields.call_options (which refuses all but auto and none)."""
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def chat_tools(tools: Any) -> list[dict[str, Any]]:
    """Responses' flat function tools (`{"type": "function", "name", "parameters", ...}`) as chat tools
    (`{"type": "function", "function": {...}}`), the keys in the order a chat client writes them."""
    if not isinstance(tools, list):
        raise FieldRefused("tools must be a list")
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise FieldRefused(f"tools[{i}] of type {kind!r} is not supported: the proxy runs no hosted tools; "
                               "give the agent a function tool instead")
        if not isinstance(tool.get("name"), str):
            raise FieldRefused(f"tools[{i}].name must be a string")
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def input_messages(value: Any) -> list[dict[str, Any]]:
    """Chat-format messages from `input`: a string is one user message; items become messages, a `function_call`
    joining the assistant turn before it (one turn: its text and its tool calls, as chat writes it)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list):
        raise FieldRefused(f"input must be a string or a list of items, not {type(value).__name__}")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise FieldRefused(f"input[{i}] must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise FieldRefused(f"input[{i}].role must be user, system, developer or assistant, got {role!r}")
            out.append({"role": "system" if role == "developer" else role, "content": _text(item.get("content"), f"input[{i}].content")})
        elif kind == "function_call":
            call = {"id": str(item.get("call_id") or item.get("id") or ""), "type": "function",
                    "function": {"name": str(item.get("name", "")), "arguments": item.get("arguments") or "{}"}}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": str(item.get("call_id", "")),
                        "content": output if isinstance(output, str) else _text(output, f"input[{i}].output")})
        elif kind == "reasoning":
            continue  # generated text, already in the recorded tokens; chat drops reasoning_content the same way
        else:
            raise FieldRefused(f"input[{i}] of type {kind!r} is not supported (message, function_call, function_call_output "
                               "and reasoning items are)")
    return out


def _text(content: Any, where: str) -> str:
    """The text of a message's content: a string, or text parts (input_text, output_text); anything else refused."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise FieldRefused(f"{where} must be a string or a list of text parts")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _TEXT_PARTS:
            parts.append(str(part.get("text", "")))
        elif kind == "refusal":
            parts.append(str(part.get("refusal", "")))
        else:
            raise FieldRefused(f"{where}[{j}] of type {kind!r} is not supported (text only)")
    return "".join(parts)


async def serve(proxy: OpenAIProxy, request: web.Request, s: Session, body: dict[str, Any]) -> web.StreamResponse:
    """POST /v1/responses: the request as chat, answered by the proxy's chat path (recorded as a chat call), kept for a
    later previous_response_id, returned as a Response or, with stream true, as its SSE events. FieldRefused: a 400."""
    req = to_chat(body, s.responses, lambda name, message: proxy.warn(s, name, message))
    opts = proxy.check_common(s, req.body)
    choices, usage = await proxy.chat_answers(s, req.messages, req.body, opts)
    resp = response_object(body, req, choices[0], usage, (proxy.sampling.temperature, proxy.sampling.top_p))
    s.responses[resp["id"]] = req.history + [reply_message(choices[0])]
    if not body.get("stream"):
        return web.json_response(resp)
    stream = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await stream.prepare(request)
    for chunk in sse(stream_events(resp)):
        await stream.write(chunk)
    await stream.write_eof()
    return stream


# ---------------------------------------------------------------------------------------------
# The answer
# ---------------------------------------------------------------------------------------------


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def output_items(choice: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat choice as Responses output items: reasoning (text before `</think>`), the message, each tool call."""
    msg, done = choice["message"], "incomplete" if choice["finish_reason"] == "length" else "completed"
    items: list[dict[str, Any]] = []
    if msg.get("reasoning_content") is not None:
        items.append({"id": _id("rs"), "type": "reasoning", "summary": [], "status": done,
                      "content": [{"type": "reasoning_text", "text": msg["reasoning_content"]}]})
    if msg.get("content") or not msg.get("tool_calls"):
        items.append({"id": _id("msg"), "type": "message", "role": "assistant", "status": done,
                      "content": [{"type": "output_text", "text": msg.get("content") or "", "annotations": [], "logprobs": []}]})
    for tc in msg.get("tool_calls") or []:
        items.append({"id": _id("fc"), "type": "function_call", "call_id": tc["id"], "name": tc["function"]["name"],
                      "arguments": tc["function"]["arguments"], "status": "completed"})
    return items


def response_object(body: dict[str, Any], req: ChatRequest, choice: dict[str, Any], usage: dict[str, int],
                    sampling: tuple[float, float]) -> dict[str, Any]:
    """The Response for one answer. An answer cut at its token limit is `completed` with incomplete_details reason
    max_output_tokens and its message item `incomplete`: OpenAI would mark the whole response incomplete, which the
    OpenAI Agents SDK turns into an exception, failing the episode; in RL a cut answer is a sample like any other
    (a chat call returns it with finish_reason length), and the overlong penalty, not a lost episode, teaches brevity."""
    incomplete = choice["finish_reason"] == "length"
    return {
        "id": _id("resp"), "object": "response", "created_at": int(time.time()), "model": str(body.get("model") or "policy"),
        "status": "completed", "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "instructions": body.get("instructions"), "output": output_items(choice),
        "parallel_tool_calls": body.get("parallel_tool_calls") is not False, "tool_choice": body.get("tool_choice") or "auto",
        "tools": req.tools, "temperature": sampling[0], "top_p": sampling[1], "max_output_tokens": body.get("max_output_tokens"),
        "previous_response_id": body.get("previous_response_id"), "store": body.get("store", True) is not False,
        "metadata": body.get("metadata") or {}, "text": {"format": {"type": "text"}}, "truncation": "disabled",
        "usage": {"input_tokens": usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": 0},
                  "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": usage["total_tokens"]},
    }


def reply_message(choice: dict[str, Any]) -> dict[str, Any]:
    """The answer as the chat assistant message a replaying client would send (stored for previous_response_id)."""
    msg = choice["message"]
    return {"role": "assistant", "content": msg.get("content")} | ({"tool_calls": msg["tool_calls"]} if msg.get("tool_calls") else {})


def stream_events(response: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """The Responses SSE sequence the openai client parses: created, in_progress, each output item (added, its parts
    and deltas, done), then completed; the generated text arrives whole, in one delta."""
    start = dict(response, status="in_progress", output=[], usage=None, incomplete_details=None)
    yield from (("response.created", {"response": start}), ("response.in_progress", {"response": start}))
    for index, item in enumerate(response["output"]):
        yield "response.output_item.added", {"output_index": index, "item": _opened(item)}
        yield from _item_events(index, item)
        yield "response.output_item.done", {"output_index": index, "item": item}
    yield "response.completed", {"response": response}


def _opened(item: dict[str, Any]) -> dict[str, Any]:
    """An output item as `output_item.added` shows it: in progress, its text or arguments still empty."""
    if item["type"] == "message":
        return dict(item, status="in_progress", content=[])
    if item["type"] == "function_call":
        return dict(item, status="in_progress", arguments="")
    return dict(item, status="in_progress", content=[])


def _item_events(index: int, item: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """The events between an item's added and done: its text (one delta) or its arguments."""
    at = {"item_id": item["id"], "output_index": index}
    if item["type"] == "function_call":
        yield "response.function_call_arguments.delta", {**at, "delta": item["arguments"]}
        yield "response.function_call_arguments.done", {**at, "arguments": item["arguments"], "name": item["name"]}
        return
    if item["type"] == "reasoning":
        text = item["content"][0]["text"]
        yield "response.reasoning_text.delta", {**at, "content_index": 0, "delta": text}
        yield "response.reasoning_text.done", {**at, "content_index": 0, "text": text}
        return
    part = item["content"][0]
    empty = dict(part, text="")
    yield "response.content_part.added", {**at, "content_index": 0, "part": empty}
    yield "response.output_text.delta", {**at, "content_index": 0, "delta": part["text"], "logprobs": []}
    yield "response.output_text.done", {**at, "content_index": 0, "text": part["text"], "logprobs": []}
    yield "response.content_part.done", {**at, "content_index": 0, "part": part}


def sse(events: Iterator[tuple[str, dict[str, Any]]]) -> Iterator[bytes]:
    """Each event as `event: <type>` and its JSON data (with type and sequence_number), as OpenAI sends them."""
    for n, (kind, data) in enumerate(events):
        yield f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': n, **data})}\n\n".encode()
