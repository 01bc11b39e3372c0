"""OpenAI's Responses API (``/v1/responses``), sans-I/O: a request becomes the chat turn it means
(its input items, after the stored conversation of ``previous_response_id``, as chat messages; its
tools, text format and sampling as chat fields, checked by openai_api.py), and the turn's result
becomes a response object, or the documented stream of events, each with its ``sequence_number``.

A stored response (``store``, the default) is a record in the session store (its response
object, its own input items and the whole conversation so far) beside the session whose KV holds
that conversation; continuing it prefills only the new input, in this server or one started
later on the same store (client/serve/reuse.py finds the session). The SDK's pydantic types are
the oracle for every shape here (tests/client/serve/test_responses_api.py).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from muxworker.client.params import GenerationResult, TokenLogprob

from . import openai_api as oa
from .responses import Logprobs
from .tools import CallDelta, ToolCall

__all__ = [
    "EventWriter",
    "ResponsesRequest",
    "output_items",
    "parse_responses_request",
    "reasoning_item",
    "response_object",
]

#: Fields read here. Others are accepted and ignored (``ignored``), as OpenAI's newer fields must
#: not break an older server; these change nothing here: ``reasoning`` (a model thinks as its
#: chat template has it: client/serve/reasoning.py),
#: ``include``, ``metadata`` (echoed), ``service_tier``, ``user``, ``safety_identifier``,
#: ``prompt_cache_retention``, ``max_tool_calls`` (built-in tools only), ``stream_options``.
_FIELDS = frozenset(
    {
        "model",
        "input",
        "instructions",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "text",
        "max_output_tokens",
        "temperature",
        "top_p",
        "top_logprobs",
        "store",
        "previous_response_id",
        "prompt_cache_key",
        "stream",
        "truncation",
        "metadata",
        "user",
        "background",
        "conversation",
        "prompt",
        # muxworker's own, as on chat completions
        "seed",
        "top_k",
        "min_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "stop",
        "cache_salt",
        "ignore_eos",
    }
)
IGNORED = frozenset(
    {
        "reasoning",
        "include",
        "service_tier",
        "safety_identifier",
        "prompt_cache_retention",
        "max_tool_calls",
        "stream_options",
    }
)
_PASSED: tuple[str, ...] = ("seed", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
_PASSED += ("stop", "temperature", "top_p", "parallel_tool_calls", "cache_salt", "model", "stream", "ignore_eos")
_TEXT_PARTS = ("input_text", "output_text", "text")
#: Chat field names in openai_api.py's errors, as a Responses client knows them.
_PARAMS = {"max_tokens": "max_output_tokens", "response_format": "text.format", "messages": "input"}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class ResponsesRequest:
    """A ``POST /v1/responses`` body: the chat turn it means, and what the response echoes."""

    chat: oa.ChatRequest
    body: dict[str, Any]  # the request as given (its echoed fields)
    input_items: list[dict[str, Any]]  # this request's input, each item with its id
    history: list[dict[str, Any]]  # the stored conversation it continues (items), then its input
    store: bool
    previous_response_id: str | None
    truncation: str
    ignored: list[str] = field(default_factory=list)
    previous_session: str | None = None  # the session holding the previous response (a reuse hint)
    namespaces: dict[str, str] = field(default_factory=dict)  # function name -> the namespace tool grouping it


def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in _TEXT_PARTS and isinstance(part.get("text"), str):
                parts.append(part["text"])
            elif kind == "refusal" and isinstance(part.get("refusal"), str):
                parts.append(part["refusal"])
            else:
                raise oa.bad_request(
                    f"{where}: only text parts (input_text, output_text) are served here, got a part of type "
                    f"{kind!r:.40}",
                    param="input",
                    code="unsupported",
                )
        return "".join(parts)
    raise oa.bad_request(f"{where} must be a string or a list of text parts", param="input")


def normalize_input(raw: Any) -> list[dict[str, Any]]:
    """``input`` as items, each with an ``id`` (a string is one user message)."""
    if isinstance(raw, str):
        raw = [{"role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise oa.bad_request("input must be a non-empty string or list of items", param="input")
    items = []
    for i, item in enumerate(raw):
        if not isinstance(item, dict):
            raise oa.bad_request(f"input[{i}] must be an object", param="input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise oa.bad_request(
                    f"input[{i}].role must be user, system, developer or assistant, got {role!r:.40}", param="input"
                )
            text = _text_of(item.get("content"), f"input[{i}].content")
            part = "output_text" if role == "assistant" else "input_text"
            items.append(
                {
                    "type": "message",
                    "id": item.get("id") or new_id("msg"),
                    "role": role,
                    "status": "completed",
                    "content": [{"type": part, "text": text, **({"annotations": []} if role == "assistant" else {})}],
                }
            )
        elif kind == "function_call":
            for key in ("call_id", "name", "arguments"):
                if not isinstance(item.get(key), str):
                    raise oa.bad_request(f"input[{i}] (function_call) needs a string {key}", param="input")
            items.append(
                {
                    "type": "function_call",
                    "id": item.get("id") or new_id("fc"),
                    "call_id": item["call_id"],
                    "name": item["name"],
                    "arguments": item["arguments"],
                    "status": "completed",
                    **({"namespace": item["namespace"]} if isinstance(item.get("namespace"), str) else {}),
                }
            )
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise oa.bad_request(f"input[{i}] (function_call_output) needs a string call_id", param="input")
            output = item.get("output")
            text = output if isinstance(output, str) else _text_of(output, f"input[{i}].output")
            items.append(
                {
                    "type": "function_call_output",
                    "id": item.get("id") or new_id("fco"),
                    "call_id": item["call_id"],
                    "output": text,
                    "status": "completed",
                }
            )
        elif kind == "reasoning":
            thought = _reasoning_text(item)
            if thought is None:
                continue  # another model's (encrypted, or a summary only): nothing this one reads
            items.append(reasoning_item(item.get("id") or new_id("rs"), thought, _summary(item.get("summary"))))
        else:
            raise oa.bad_request(
                f"input[{i}] is of type {kind!r:.40}; served here: message, function_call, function_call_output, reasoning",
                param="input",
                code="unsupported",
            )
    return items


def _reasoning_text(item: Mapping[str, Any]) -> str | None:
    """A reasoning item's text (its ``reasoning_text`` parts); None when it has none."""
    content = item.get("content")
    parts = [
        p["text"]
        for p in (content if isinstance(content, list) else [])
        if isinstance(p, dict) and p.get("type") == "reasoning_text" and isinstance(p.get("text"), str)
    ]
    return "".join(parts) if parts else None


def _summary(raw: Any) -> list[dict[str, str]]:
    """A reasoning item's ``summary`` parts, as kept with it."""
    parts = raw if isinstance(raw, list) else []
    return [
        {"type": "summary_text", "text": p["text"]}
        for p in parts
        if isinstance(p, dict) and p.get("type") == "summary_text" and isinstance(p.get("text"), str)
    ]


def reasoning_item(item_id: str, text: str, summary: list[dict[str, str]] | None = None) -> dict[str, Any]:
    """A model's reasoning as OpenAI's ``reasoning`` output item (client/serve/reasoning.py)."""
    return {
        "type": "reasoning",
        "id": item_id,
        "summary": summary or [],
        "content": [{"type": "reasoning_text", "text": text}],
    }


def chat_messages(instructions: str | None, items: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The chat messages (openai_api.py's request shape) of ``instructions`` and ``items``: a
    function call joins the assistant message before it, as the model wrote them in one turn, and
    a reasoning item begins the assistant turn it came with (its ``reasoning_content``)."""
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    for item in items:
        kind = item["type"]
        last = messages[-1] if messages else None
        if kind == "reasoning":
            text = "".join(p["text"] for p in item["content"])
            messages.append({"role": "assistant", "content": None, "reasoning_content": text})
        elif kind == "message":
            text = "".join(p.get("text", p.get("refusal", "")) for p in item["content"])
            if item["role"] == "assistant" and last is not None and _reasoning_only(last):
                last["content"] = text  # the answer after its reasoning: one turn
            else:
                messages.append({"role": item["role"], "content": text})
        elif kind == "function_call":
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
    return messages


def _reasoning_only(message: Mapping[str, Any]) -> bool:
    """An assistant turn that so far holds only its reasoning."""
    return (
        message["role"] == "assistant"
        and message.get("reasoning_content") is not None
        and message.get("content") is None
        and not message.get("tool_calls")
    )


def _chat_tools(tools: Any) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """Chat tools, and {function name: namespace} of the functions a ``namespace`` tool groups
    (Codex CLI sends one): the model sees them as functions; a call of one names its namespace."""
    if not isinstance(tools, list):
        raise oa.bad_request("tools must be a list", param="tools")
    out, namespaces = [], {}
    for i, t in enumerate(tools):
        members: list[tuple[str, Any, str | None]] = [(f"tools[{i}]", t, None)]
        if isinstance(t, dict) and t.get("type") == "namespace" and isinstance(t.get("tools"), list):
            members = [(f"tools[{i}].tools[{j}]", m, str(t.get("name"))) for j, m in enumerate(t["tools"])]
        for where, m, namespace in members:
            if not isinstance(m, dict) or m.get("type") != "function":
                kind = m.get("type") if isinstance(m, dict) else None
                raise oa.bad_request(
                    f"{where} is of type {kind!r:.40}: only function tools are served here (no built-in tools)",
                    param="tools",
                    code="unsupported",
                )
            fn = {k: m[k] for k in ("name", "description", "parameters") if m.get(k) is not None}
            out.append({"type": "function", "function": fn})
            if namespace is not None and isinstance(m.get("name"), str):
                namespaces[m["name"]] = namespace
    return out, namespaces


def _chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict):
        if choice.get("type") == "function" and isinstance(choice.get("name"), str):
            return {"type": "function", "function": {"name": choice["name"]}}
        raise oa.bad_request(
            f"tool_choice must be none, auto, required or {{type: function, name}}, got {choice!r:.100}",
            param="tool_choice",
            code="unsupported",
        )
    return choice


def _response_format(text: Any) -> dict[str, Any] | None:
    if text is None:
        return None
    if not isinstance(text, dict):
        raise oa.bad_request("text must be an object {format: {...}}", param="text")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise oa.bad_request("text.format must be an object", param="text.format")
    if fmt.get("type") == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        spec.setdefault("name", "response")
        return {"type": "json_schema", "json_schema": spec}
    if fmt.get("type") in ("text", "json_object"):
        return {"type": fmt["type"]}
    raise oa.bad_request(
        f"text.format.type must be text, json_object or json_schema, got {fmt.get('type')!r:.40}", param="text.format"
    )


def parse_responses_request(
    body: Mapping[str, Any],
    served: Any,
    previous: Mapping[str, Any] | None,
    max_messages: int | None = None,
) -> ResponsesRequest:
    """A ``POST /v1/responses`` body; ``previous``: the stored record of its
    ``previous_response_id`` (its ``items``: the conversation up to and with that response)."""
    ignored = sorted(set(body) - _FIELDS - IGNORED)
    for name, allowed in (("background", (None, False)), ("conversation", (None,)), ("prompt", (None,))):
        if body.get(name) not in allowed:
            hint = {"conversation": "continue with previous_response_id instead", "background": "leave it out"}
            raise oa.bad_request(
                f"{name} is not served here; {hint.get(name, 'send the input itself')}", param=name, code="unsupported"
            )
    store = body.get("store", True)
    if store is None:
        store = True
    if not isinstance(store, bool):
        raise oa.bad_request(f"store must be a boolean, got {store!r:.40}", param="store")
    truncation = body.get("truncation") or "disabled"
    if truncation not in ("disabled", "auto"):
        raise oa.bad_request(f"truncation must be disabled or auto, got {truncation!r:.40}", param="truncation")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise oa.bad_request("instructions must be a string", param="instructions")
    items = normalize_input(body.get("input"))
    history = [*(previous["items"] if previous is not None else []), *items]
    chat: dict[str, Any] = {k: body[k] for k in _PASSED if k in body}
    chat["messages"] = chat_messages(instructions, history)
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    ns: dict[str, str] = {}
    if body.get("tools"):
        chat["tools"], ns = _chat_tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _chat_tool_choice(body["tool_choice"])
    fmt = _response_format(body.get("text"))
    if fmt is not None:
        chat["response_format"] = fmt
    top = body.get("top_logprobs")
    if top is not None:
        chat["logprobs"], chat["top_logprobs"] = True, top
    try:
        parsed = oa.parse_chat_request(chat, served, max_messages)
    except oa.APIError as exc:
        if exc.param in _PARAMS:  # named as a Responses client knows it, in the message too
            name = _PARAMS[exc.param]
            if exc.message.startswith(exc.param + " "):
                exc.message = name + exc.message[len(exc.param) :]
                exc.args = (exc.message,)
            exc.param = name
        raise
    return ResponsesRequest(
        parsed, dict(body), items, history, store, body.get("previous_response_id"), truncation, ignored, namespaces=ns
    )


def usage(result: GenerationResult, reasoning_tokens: int | None = None) -> dict[str, Any]:
    return {
        "input_tokens": result.prompt_tokens,
        # The prompt tokens prefilled now are what this turn wrote to the cache (its session keeps them).
        "input_tokens_details": {
            "cached_tokens": result.reused_prompt_tokens,
            "cache_write_tokens": result.prompt_tokens - result.reused_prompt_tokens,
        },
        "output_tokens": result.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens or 0},
        "total_tokens": result.prompt_tokens + result.completion_tokens,
    }


def output_items(
    text: str,
    calls: Sequence[ToolCall],
    result: GenerationResult,
    logprobs: list[dict[str, Any]] | None = None,
    reasoning: str | None = None,
) -> list[dict[str, Any]]:
    """A turn's output: its reasoning (a model that thinks), its text as a message (when there is
    text, or neither a call nor reasoning), then its calls."""
    status = "incomplete" if result.finish_reason == "length" else "completed"
    items: list[dict[str, Any]] = []
    if reasoning is not None:
        items.append(reasoning_item(new_id("rs"), reasoning))
    if text or not (calls or reasoning is not None):
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}
        items.append({"type": "message", "id": new_id("msg"), "status": status, "role": "assistant", "content": [part]})
    for call in calls:
        items.append(_call_item(new_id("fc"), call.id, call.name, call.arguments, "completed"))
    return items


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def response_object(
    rid: str,
    request: ResponsesRequest,
    created: float,
    *,
    status: str = "completed",
    output: list[dict[str, Any]] | None = None,
    result: GenerationResult | None = None,
    error: oa.APIError | None = None,
    reasoning_tokens: int | None = None,
) -> dict[str, Any]:
    """The response object: what the request set, echoed, and (once it ended) its output and usage."""
    body = request.body
    incomplete = status == "incomplete"
    for item in output or []:
        _name_namespace(item, request.namespaces)
    text: dict[str, Any] = body["text"] if isinstance(body.get("text"), dict) else {}
    return {
        "id": rid,
        "object": "response",
        "created_at": int(created),
        "completed_at": int(time.time()) if status == "completed" else None,
        "status": status,
        "error": None if error is None else {"code": _failure_code(error), "message": error.message},
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "model": request.chat.model,
        "output": output or [],
        "parallel_tool_calls": body.get("parallel_tool_calls", True) is not False,
        "previous_response_id": request.previous_response_id,
        "prompt_cache_key": body.get("prompt_cache_key"),
        "reasoning": {"effort": None, "summary": None},
        "store": request.store,
        "temperature": body.get("temperature"),
        "text": {"format": text.get("format") or {"type": "text"}},
        "tool_choice": body.get("tool_choice") or "auto",
        "tools": body.get("tools") or [],
        "top_logprobs": body.get("top_logprobs"),
        "top_p": body.get("top_p"),
        "truncation": request.truncation,
        "usage": usage(result, reasoning_tokens) if result is not None else None,
        "user": body.get("user"),
        "metadata": body.get("metadata") or {},
        "background": False,
        "service_tier": "default",
    }


def _name_namespace(item: dict[str, Any], namespaces: Mapping[str, str]) -> None:
    """A function call of a function a ``namespace`` tool grouped names that namespace."""
    if item.get("type") == "function_call" and item.get("name") in namespaces:
        item["namespace"] = namespaces[item["name"]]


def _failure_code(error: oa.APIError) -> str:
    """A failed response's ``error.code``: one of OpenAI's few (the error event before it carries
    muxworker's own code)."""
    if error.status == 429:
        return "rate_limit_exceeded"
    return "invalid_prompt" if error.status < 500 else "server_error"


def record(response: dict[str, Any], request: ResponsesRequest, session: str) -> bytes:
    """A stored response as the store keeps it: the response object, its own input items, the
    whole conversation with its output (what a continuation renders), and the session holding it."""
    doc = {
        "response": response,
        "input_items": request.input_items,
        "items": [*request.history, *response["output"]],
        "session": session,
        "created": response["created_at"],
    }
    return json.dumps(doc, separators=(",", ":")).encode()


class EventWriter:
    """The server-sent events of one streamed response, numbered in order: its output items open
    as their first text or call piece arrives and close at the end."""

    def __init__(self, rid: str, request: ResponsesRequest, logprobs: Logprobs | None) -> None:
        self.rid = rid
        self.request = request
        self.created = time.time()
        self.logprobs = logprobs
        self.seq = 0
        self.output: list[dict[str, Any]] = []  # items as they stand
        self._message: dict[str, Any] | None = None  # the open message item
        self._calls: dict[int, dict[str, Any]] = {}  # call index -> its open item
        self._reasoning: dict[str, Any] | None = None  # the reasoning item (first, when the model thinks)
        self._reasoning_open = False

    def _event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()

    def _snapshot(self, status: str, **kw: Any) -> dict[str, Any]:
        return response_object(self.rid, self.request, self.created, status=status, output=self.output, **kw)

    def start(self) -> bytes:
        snap = self._snapshot("in_progress")
        return self._event("response.created", response=snap) + self._event("response.in_progress", response=snap)

    def reasoning(self, delta: str) -> bytes:
        """A piece of the reasoning; its item opens with the first piece."""
        out = b""
        if self._reasoning is None:
            item = reasoning_item(new_id("rs"), "")
            item["content"] = []
            self._reasoning, self._reasoning_open = item, True
            self.output.append(item)
            index = len(self.output) - 1
            out += self._event("response.output_item.added", output_index=index, item=item)
            part = {"type": "reasoning_text", "text": ""}
            out += self._event(
                "response.content_part.added", item_id=item["id"], output_index=index, content_index=0, part=part
            )
            item["content"].append({**part})
        item = self._reasoning
        item["content"][0]["text"] += delta
        return out + self._event(
            "response.reasoning_text.delta",
            item_id=item["id"],
            output_index=self.output.index(item),
            content_index=0,
            delta=delta,
        )

    def _close_reasoning(self) -> bytes:
        """The reasoning's closing events, once, before the next item opens."""
        if self._reasoning is None or not self._reasoning_open:
            return b""
        self._reasoning_open = False
        item, index = self._reasoning, self.output.index(self._reasoning)
        part = item["content"][0]
        out = self._event(
            "response.reasoning_text.done", item_id=item["id"], output_index=index, content_index=0, text=part["text"]
        )
        out += self._event(
            "response.content_part.done", item_id=item["id"], output_index=index, content_index=0, part=part
        )
        return out + self._event("response.output_item.done", output_index=index, item=item)

    def text(self, delta: str, entries: Sequence[TokenLogprob] = ()) -> bytes:
        out = self._close_reasoning()
        if self._message is None:
            item: dict[str, Any] = {
                "type": "message",
                "id": new_id("msg"),
                "status": "in_progress",
                "role": "assistant",
                "content": [],
            }
            self._message = item
            self.output.append(item)
            index = len(self.output) - 1
            out += self._event("response.output_item.added", output_index=index, item=item)
            part: dict[str, Any] = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            out += self._event(
                "response.content_part.added", item_id=item["id"], output_index=index, content_index=0, part=part
            )
            item["content"].append({**part})
        part = self._message["content"][0]
        lps = self.logprobs.of(entries)["content"] if self.logprobs is not None and entries else []
        part["text"] += delta
        part["logprobs"] += lps
        return out + self._event(
            "response.output_text.delta",
            item_id=self._message["id"],
            output_index=self.output.index(self._message),
            content_index=0,
            delta=delta,
            logprobs=lps,
        )

    def calls(self, deltas: Sequence[CallDelta]) -> bytes:
        out = self._close_reasoning() if deltas else b""
        for d in deltas:
            item = self._calls.get(d.index)
            if item is None:
                item = _call_item(new_id("fc"), d.id or ToolCall.new_id(), d.name or "", "", "in_progress")
                _name_namespace(item, self.request.namespaces)
                self._calls[d.index] = item
                self.output.append(item)
                out += self._event("response.output_item.added", output_index=len(self.output) - 1, item=dict(item))
            if d.arguments:
                item["arguments"] += d.arguments
                out += self._event(
                    "response.function_call_arguments.delta",
                    item_id=item["id"],
                    output_index=self.output.index(item),
                    delta=d.arguments,
                )
        return out

    def finish(
        self, result: GenerationResult, calls: Sequence[ToolCall], reasoning_tokens: int | None = None
    ) -> tuple[bytes, dict[str, Any]]:
        """The closing events and the final response object."""
        out = self._close_reasoning()
        status = "incomplete" if result.finish_reason == "length" else "completed"
        if self._message is None and not calls and not self._calls and self._reasoning is None:
            out += self.text("")  # an empty reply is still one message
        if self._message is not None:
            item, index = self._message, self.output.index(self._message)
            part = item["content"][0]
            out += self._event(
                "response.output_text.done",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                text=part["text"],
                logprobs=part["logprobs"],
            )
            out += self._event(
                "response.content_part.done", item_id=item["id"], output_index=index, content_index=0, part=part
            )
            item["status"] = status
            out += self._event("response.output_item.done", output_index=index, item=item)
        for i, call in enumerate(calls):
            if i not in self._calls:  # a call no delta announced (its text came whole at the end)
                out += self.calls([CallDelta(i, call.id, call.name, "")])
            item = self._calls[i]
            item.update(call_id=call.id, name=call.name, arguments=call.arguments, status="completed")
            _name_namespace(item, self.request.namespaces)
            index = self.output.index(item)
            out += self._event(
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=index,
                arguments=call.arguments,
            )
            out += self._event("response.output_item.done", output_index=index, item=item)
        for i in sorted(i for i in self._calls if i >= len(calls)):
            # A call cut short by max_output_tokens: its item closes as incomplete and leaves the
            # output (the last item: no other's index moves), as the response not streamed drops it.
            item = self._calls.pop(i)
            item["status"] = "incomplete"
            out += self._event("response.output_item.done", output_index=self.output.index(item), item=item)
            self.output.remove(item)
        final = self._snapshot(status, result=result, reasoning_tokens=reasoning_tokens)
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        return out + self._event(kind, response=final), final

    def fail(self, error: oa.APIError) -> bytes:
        """An error mid-stream: the error event, then the failed response."""
        return self._event("error", code=error.code, message=error.message, param=error.param) + self._event(
            "response.failed", response=self._snapshot("failed", error=error)
        )


def item_page(items: Sequence[dict[str, Any]], query: Mapping[str, str]) -> dict[str, Any]:
    """``GET /v1/responses/{id}/input_items``: a page of a response's input items (``order``
    desc by default, ``limit`` 1-100, default 20, ``after`` an item id)."""
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise oa.bad_request(f"order must be asc or desc, got {order!r:.20}", param="order")
    try:
        limit = int(query.get("limit", "20"))
    except ValueError:
        limit = 0
    if not 1 <= limit <= 100:
        raise oa.bad_request("limit must be an integer in [1, 100]", param="limit")
    ordered = list(items) if order == "asc" else list(reversed(items))
    after = query.get("after")
    if after is not None:
        ids = [item["id"] for item in ordered]
        if after not in ids:
            raise oa.bad_request(f"after names no item of this response: {after!r:.80}", param="after")
        ordered = ordered[ids.index(after) + 1 :]
    page = ordered[:limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(ordered) > limit,
    }


def logprob_entries(logprobs: Logprobs | None, entries: Sequence[TokenLogprob] | None) -> list[dict[str, Any]] | None:
    if logprobs is None or not entries:
        return None
    return logprobs.of(entries)["content"]


TokenBytes = Callable[[int], bytes]
