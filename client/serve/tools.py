"""Tool calls: OpenAI's ``tools`` rendered in the model's own format, enforced by a grammar, and
parsed back into ``tool_calls``.

A :class:`ToolFormat` is picked once per model from its chat template (:func:`tool_format`):

- **hermes** (Qwen2.5/3, Hermes, and any template that writes ``<tool_call>``): the template renders
  the tools; a call is ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, several
  one after another.
- **mistral** (``[TOOL_CALLS]``): ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``.
- **llama3** (Llama 3.1-3.3 JSON tool calling, a template that renders ``"parameters"``): the whole
  reply is one ``{"name": ..., "parameters": {...}}`` object.
- **generic**, for every other model (the bundled SmolLM2 among them), as llama.cpp's generic
  handler does: a system block lists the tools and asks for one JSON object, ``{"tool_calls":
  [{"name": ..., "arguments": {...}}]}`` or ``{"response": "..."}``; tool results go back as user
  messages ``{"tool_response": {"name": ..., "content": ...}}``.

Decoding (:meth:`ToolFormat.constraint`): ``required`` and a named function force a call whose
arguments follow the function's JSON schema; ``auto`` lets the model write text, and once it
starts a call (its opening tag; in the generic format, the ``tool_calls`` key) the call is held to
the schemas; ``none`` allows no call (native formats: free text; generic: only ``{"response": ...}``,
so the prompt and the reply shape stay those of the conversation). Every format renders a call back exactly as the grammar
made the model write it (JSON on one line, ``", "`` and ``": "``, the arguments verbatim), so the
next turn of a session reuses the whole history, tool calls and results included.

:class:`OutputParser` turns the generated text into content and calls, streamed: content as it
comes (a possible opening tag held back until it is decided), each call's id and name once its
name is written, then its arguments piece by piece (:class:`CallDelta`), each call on an index of
its own. An output cut by max_tokens keeps its complete calls; only the one cut short is dropped
(it streamed on the last index). For a model that thinks,
reasoning.py's parser stands in front of it and hands it the answer only, never the reasoning.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from muxworker.transport.sampling import JSON_LAYOUT, bounded_schema, rebased_schema

__all__ = ["Tool", "ToolCall", "CallDelta", "ToolRequest", "ToolFormat", "OutputParser", "tool_format", "TOOL_NAME"]

TOOL_NAME = re.compile(r"[A-Za-z0-9_\-.]{1,64}")


@dataclass(frozen=True)
class Tool:
    """One function the model may call; ``parameters``: the JSON Schema of its arguments object."""

    name: str
    description: str
    parameters: dict[str, Any]

    def openai(self) -> dict[str, Any]:
        """As OpenAI's request carries it (and chat templates take it)."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


@dataclass(frozen=True)
class ToolRequest:
    """A request's tools and how it lets the model use them."""

    tools: tuple[Tool, ...]
    choice: str = "auto"  # "none", "auto", "required", or "function" (the one named ``function``)
    function: str | None = None
    parallel: bool = True
    # response_format's JSON Schema for a reply that is not a call (None: free text); for the
    # formats whose accepts_content_schema says so
    content_schema: dict[str, Any] | None = None

    @property
    def callable(self) -> tuple[Tool, ...]:
        """The tools a call may name."""
        if self.choice == "function":
            return tuple(t for t in self.tools if t.name == self.function)
        return self.tools if self.choice != "none" else ()

    @property
    def forced(self) -> bool:
        return self.choice in ("required", "function")

    @property
    def most(self) -> int | None:
        """The most calls one reply may make (None: no bound)."""
        return None if self.parallel and self.choice != "function" else 1


@dataclass(frozen=True)
class ToolCall:
    """A call the model made; ``arguments`` is the JSON text of its arguments object."""

    id: str
    name: str
    arguments: str

    @staticmethod
    def new_id() -> str:
        return "call_" + secrets.token_hex(12)

    def openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _call_schema(tool: Tool, args_key: str, params: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": tool.name}, args_key: params},
        "required": ["name", args_key],
        "additionalProperties": False,
    }


def _one_of(tools: Sequence[Tool], args_key: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The schema of one call to any of ``tools``, and the ``$defs`` its root schema must carry:
    a tool's parameters that refer to themselves (``#/$defs/...``, as pydantic writes them, or
    ``#``) lie there as ``t<i>``, their references rebased, so ``#`` still means the parameters
    and not the call around them."""
    defs: dict[str, Any] = {}
    schemas = []
    for i, tool in enumerate(tools):
        params = tool.parameters or {"type": "object"}
        if '"$ref"' in json.dumps(params):
            defs[f"t{i}"] = rebased_schema(params, f"#/$defs/t{i}")
            params = {"$ref": f"#/$defs/t{i}"}
        schemas.append(_call_schema(tool, args_key, params))
    return (schemas[0] if len(schemas) == 1 else {"anyOf": schemas}), defs


def _with_defs(schema: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    return {**schema, "$defs": defs} if defs else schema


def _lark_json(tools: Sequence[Tool], args_key: str) -> str:
    """A Lark ``%json`` of one call, in the one JSON layout (a schema inside a Lark grammar takes
    its options from its own ``x-guidance``)."""
    call = _with_defs(*_one_of(tools, args_key))
    return "%json " + json.dumps({**bounded_schema(call), "x-guidance": JSON_LAYOUT})


def _lark_text(value: str) -> str:
    """``value`` as a Lark string literal."""
    return json.dumps(value)


def _reasoned(message: dict[str, Any], out: dict[str, Any]) -> dict[str, Any]:
    """``out`` with the reasoning of ``message`` (an assistant turn's, which templates of models
    that think render or drop: reasoning.py)."""
    if message.get("reasoning_content") is not None:
        out["reasoning_content"] = message["reasoning_content"]
    return out


def _parsed_arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


class ToolFormat:
    """How one model family writes tool calls (see the module docstring)."""

    name = "generic"
    args_key = "arguments"
    accepts_content_schema = False  # whether a reply's content may be held to response_format

    # -- rendering ----------------------------------------------------------------------------

    def messages(self, messages: list[dict[str, Any]], request: ToolRequest | None) -> list[dict[str, Any]]:
        """The messages to hand the chat template (tool calls and results in this format)."""
        raise NotImplementedError

    def template_tools(self, request: ToolRequest | None) -> list[dict[str, Any]] | None:
        """The ``tools`` variable for the chat template (None: the template is not told)."""
        return [t.openai() for t in request.tools] if request is not None and request.tools else None

    # -- decoding -----------------------------------------------------------------------------

    def constraint(self, request: ToolRequest) -> dict[str, Any] | None:
        """The sampling constraint for ``request`` (None: free text)."""
        raise NotImplementedError

    def parser(self, request: ToolRequest | None) -> OutputParser:
        raise NotImplementedError


class GenericFormat(ToolFormat):
    """For templates that know nothing of tools: one JSON object per reply (module docstring)."""

    name = "generic"
    accepts_content_schema = True

    def _active(self, request: ToolRequest | None) -> bool:
        # With tools given, every reply is the JSON object, tool_choice none included (then only
        # {"response": ...} is allowed): the prompt stays the same whatever tool_choice says.
        return request is not None and bool(request.tools)

    def messages(self, messages: list[dict[str, Any]], request: ToolRequest | None) -> list[dict[str, Any]]:
        active = self._active(request)
        out: list[dict[str, Any]] = []
        for m in messages:
            role, content = m["role"], m.get("content") or ""
            if role == "assistant" and m.get("tool_calls"):
                calls = ", ".join(
                    f'{{"name": {json.dumps(c.name, ensure_ascii=False)}, "arguments": {c.arguments}}}'
                    for c in m["tool_calls"]
                )
                out.append(_reasoned(m, {"role": "assistant", "content": f'{{"tool_calls": [{calls}]}}'}))
            elif role == "assistant" and active:
                value = json.dumps(content, ensure_ascii=False)
                if request is not None and request.content_schema is not None and _is_json(content):
                    value = content  # a structured reply: the JSON text as the model wrote it
                out.append(_reasoned(m, {"role": "assistant", "content": f'{{"response": {value}}}'}))
            elif role == "tool":
                result = {"tool_response": {"name": m.get("name") or "", "content": content}}
                out.append({"role": "user", "content": json.dumps(result, ensure_ascii=False)})
            else:
                out.append(_reasoned(m, {"role": role, "content": content}))
        if active:
            assert request is not None
            block = self._system_block(request)
            if out and out[0]["role"] == "system":
                out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + block}
            else:
                out.insert(0, {"role": "system", "content": block})
        return out

    def template_tools(self, request: ToolRequest | None) -> list[dict[str, Any]] | None:
        return None  # the tools are in the system block

    @staticmethod
    def _system_block(request: ToolRequest) -> str:
        """The same whatever tool_choice says (the grammar enforces it), so the prompt of one
        conversation stays the same from turn to turn and its history is reused."""
        tools = "\n".join(json.dumps(t.openai()["function"], ensure_ascii=False) for t in request.tools)
        return (
            f"You can call these tools:\n{tools}\n"
            'Reply with one JSON object: {"tool_calls": [{"name": <tool name>, "arguments": <arguments object>}]} '
            'to call tools, or {"response": <your reply>} to answer the user. After a tool_response, '
            "answer the user unless you need another tool."
        )

    def constraint(self, request: ToolRequest) -> dict[str, Any] | None:
        if not request.tools:
            return None
        content = request.content_schema or {"type": "string"}
        defs: dict[str, Any] = {}
        if '"$ref"' in json.dumps(content):  # its "#" is the content's schema, not the reply's
            defs["content"] = rebased_schema(content, "#/$defs/content")
            content = {"$ref": "#/$defs/content"}
        response = {
            "type": "object",
            "properties": {"response": content},
            "required": ["response"],
            "additionalProperties": False,
        }
        if not request.callable:
            return {"json_schema": _with_defs(response, defs)}
        call, call_defs = _one_of(request.callable, "arguments")
        calls: dict[str, Any] = {"type": "array", "items": call, "minItems": 1}
        if request.most is not None:
            calls["maxItems"] = request.most
        schema: dict[str, Any] = {
            "type": "object",
            "properties": {"tool_calls": calls},
            "required": ["tool_calls"],
            "additionalProperties": False,
        }
        if not request.forced:
            schema = {"anyOf": [schema, response]}
        return {"json_schema": _with_defs(schema, {**defs, **call_defs})}

    def parser(self, request: ToolRequest | None) -> OutputParser:
        if not self._active(request):
            return OutputParser()
        assert request is not None
        return _JsonReplyParser(raw=request.content_schema is not None)


@dataclass(frozen=True)
class _Native(ToolFormat):
    """A family whose template renders the tools and whose calls sit between fixed strings:
    ``open`` + call + (``sep`` + call)* + ``close``; text before ``open`` is content."""

    name: str = "hermes"
    open: str = "<tool_call>\n"
    sep: str = "\n</tool_call>\n<tool_call>\n"
    close: str = "\n</tool_call>"
    args_key: str = "arguments"
    text_first: bool = True  # whether content may precede the calls (llama3: the reply is the call)

    @property
    def accepts_content_schema(self) -> bool:  # type: ignore[override]
        # A reply is JSON content or calls that open with a tag; llama3's calls are JSON objects
        # themselves, which a content schema could not be told apart from.
        return self.text_first

    @property
    def trigger(self) -> str:
        """What starts the calls (the ``open`` string without its trailing whitespace)."""
        return self.open.rstrip() or "{"

    def messages(self, messages: list[dict[str, Any]], request: ToolRequest | None) -> list[dict[str, Any]]:
        out = []
        for m in messages:
            if m["role"] == "assistant" and m.get("tool_calls"):
                calls = [
                    {
                        "id": c.id,
                        "type": "function",
                        "function": {"name": c.name, "arguments": _parsed_arguments(c.arguments)},
                    }
                    for c in m["tool_calls"]
                ]
                out.append(_reasoned(m, {"role": "assistant", "content": m.get("content") or "", "tool_calls": calls}))
            else:
                out.append(dict(m))
        return out

    def constraint(self, request: ToolRequest) -> dict[str, Any] | None:
        content = None
        if request.content_schema is not None:  # response_format: a reply that is not a call
            layout = {**bounded_schema(request.content_schema), "x-guidance": JSON_LAYOUT}
            content = "content: %json " + json.dumps(layout)
        if not request.callable:
            return {"lark": f"start: content\n{content}"} if content else None
        call = "call: " + _lark_json(request.callable, self.args_key)
        more = f" ({_lark_text(self.sep)} call)*" if request.most is None else ""
        calls = " ".join(p for p in (_lark_text(self.open) if self.open else "", f"call{more}") if p)
        if self.close:
            calls += " " + _lark_text(self.close)
        if request.forced:
            return {"lark": f"start: {calls}\n{call}"}
        if content is not None:
            return {"lark": f"start: content | {calls}\n{content}\n{call}"}
        if not self.text_first:
            # The reply is the call, or text that does not start like one.
            return {"lark": f"start: FREE? | {calls}\nFREE: /[^{{\\s](.|\\n)*/\n{call}"}
        # Text until the first opening tag (one lexeme that cannot hold the tag), then the calls.
        tag = re.escape(self.trigger)
        rest = self.open[len(self.trigger) :]
        after = " ".join(p for p in (_lark_text(rest) if rest else "", f"call{more}") if p)
        if self.close:
            after += " " + _lark_text(self.close)
        rules = [
            "start: FREE | LEAD calls",
            f"FREE: /(.|\\n)*/ & ~/(.|\\n)*{tag}(.|\\n)*/",
            f"LEAD: /(.|\\n)*{tag}/ & ~/(.|\\n)*{tag}(.|\\n)+/",
            f"calls: {after}",
            call,
        ]
        return {"lark": "\n".join(rules)}

    def parser(self, request: ToolRequest | None) -> OutputParser:
        if request is None or not request.callable:
            return OutputParser()
        return _TaggedParser(self)


HERMES = _Native()
MISTRAL = _Native("mistral", "[TOOL_CALLS][", ", ", "]")
LLAMA3 = _Native("llama3", "", "; ", "", "parameters", text_first=False)
GENERIC = GenericFormat()


def tool_format(chat_template: str | None) -> ToolFormat:
    """The format the model's chat template speaks (module docstring)."""
    t = chat_template or ""
    if "tools" not in t:
        return GENERIC
    if "<tool_call>" in t:
        return HERMES
    if "[TOOL_CALLS]" in t:
        return MISTRAL
    if '"parameters"' in t or "<|python_tag|>" in t:
        return LLAMA3
    return GENERIC


# -- parsing --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CallDelta:
    """A piece of a streamed call: its first carries the call's ``id`` and ``name`` (once the name
    is complete), the rest pieces of its arguments' JSON text as the model writes them."""

    index: int  # the call's place in the reply
    id: str | None
    name: str | None
    arguments: str


class OutputParser:
    """Free text: everything is content."""

    def fresh(self) -> OutputParser:
        """A parser like this one for another output (one parser holds one output's state)."""
        return type(self)()

    def feed(self, text: str) -> str:
        """The content ``text`` adds (possibly less: a part that may open a call is held back)."""
        return text

    def finish(self) -> tuple[str, list[ToolCall]]:
        """At the end of the output: the content not yet given out, and the complete calls (an
        output cut by max_tokens inside a call keeps the calls before it). The calls are those of
        the streamed indexes 0..len-1; a streamed index past them is a call cut short."""
        return "", []

    def pop_deltas(self) -> list[CallDelta]:
        """The call pieces found since the last call (after :meth:`feed` or :meth:`finish`)."""
        return []

    @property
    def reasoning(self) -> str | None:
        """The reply's reasoning so far (a model that thinks: reasoning.py); None: it has none."""
        return None

    def pop_reasoning(self) -> str:
        """The reasoning found since the last call (after :meth:`feed` or :meth:`finish`)."""
        return ""

    def reasoning_tokens(self, token_ids: Sequence[int]) -> int | None:
        """How many of the reply's ``token_ids`` are reasoning; None: a model that does not think."""
        return None


class _CallScanner:
    """Finds the calls of a reply as they are written, ``{"name": <string>, "<key>": <value>}`` in
    the grammar's one layout, whatever stands between them: each call's id and name once its name
    is complete, then pieces of its arguments as they come."""

    _OPEN = '{"name": "'

    def __init__(self, args_key: str) -> None:
        self._key = f', "{args_key}": '
        self.text = ""
        self.calls: list[ToolCall] = []
        self._deltas: list[CallDelta] = []
        self._pos = 0  # where to look for the next call
        self._value: int | None = None  # where the current call's arguments start, while in them
        self._scan = 0  # how far they were scanned
        self._depth = 0
        self._in_string = self._escaped = False

    def feed(self, text: str) -> None:
        self.text += text
        while self._step():
            pass

    def pop(self) -> list[CallDelta]:
        out, self._deltas = self._deltas, []
        return out

    def whole(self) -> list[ToolCall]:
        """The calls whose arguments are complete: all of them, or all but the last when the output
        was cut by max_tokens inside its arguments. They are the first of the streamed indexes, so
        a streamed call whose index is not among them is the one cut short."""
        out = []
        for call in self.calls if self._value is None else self.calls[:-1]:
            if not _is_json(call.arguments):  # never under the grammar; no call after it is kept
                break
            out.append(call)
        return out

    def _step(self) -> bool:
        """Advance as far as the text allows; True when another round may find more."""
        text = self._text_or_none()
        if text is None:
            return False
        if self._value is None:
            at = text.find(self._OPEN, self._pos)
            if at == -1:
                return False
            end = _string_end(text, at + len(self._OPEN))
            if end is None or len(text) < end + 1 + len(self._key):
                return False
            if not text.startswith(self._key, end + 1):
                self._pos = end + 1  # not a call after all
                return True
            call = ToolCall(ToolCall.new_id(), json.loads(text[at + len(self._OPEN) - 1 : end + 1]), "")
            self.calls.append(call)
            self._deltas.append(CallDelta(len(self.calls) - 1, call.id, call.name, ""))
            self._value = self._scan = end + 1 + len(self._key)
            self._depth, self._in_string, self._escaped = 0, False, False
            return True
        start, done = self._scan, None
        for i in range(self._scan, len(text)):
            c = text[i]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif c == "\\":
                    self._escaped = True
                elif c == '"':
                    self._in_string = False
            elif c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]" or (c == "," and self._depth == 0):
                if self._depth == 0:  # a scalar value ends before this
                    done = i
                    break
                self._depth -= 1
                if self._depth == 0:
                    done = i + 1
                    break
        end = len(text) if done is None else done
        piece = text[start:end]
        self._scan = end
        index = len(self.calls) - 1
        if piece:
            call = self.calls[index]
            self.calls[index] = ToolCall(call.id, call.name, call.arguments + piece)
            self._deltas.append(CallDelta(index, None, None, piece))
        if done is None:
            return False
        self._value, self._pos = None, end
        return True

    def _text_or_none(self) -> str | None:
        return self.text if self._pos < len(self.text) or self._value is not None else None


def _string_end(text: str, start: int) -> int | None:
    """The index of the quote that closes the JSON string whose characters begin at ``start``."""
    i = start
    while i < len(text):
        if text[i] == "\\":
            i += 2
            continue
        if text[i] == '"':
            return i
        i += 1
    return None


class _TaggedParser(OutputParser):
    """Content up to the format's trigger, calls after it (parsed at the end)."""

    def __init__(self, fmt: _Native) -> None:
        self.fmt = fmt
        self._held = ""  # text that may be the start of the trigger
        self._calls: str | None = None  # the text from the trigger on, once it appeared
        self._content = False  # llama3: the reply was decided to be text
        self._scanner = _CallScanner(fmt.args_key)

    def fresh(self) -> OutputParser:
        return _TaggedParser(self.fmt)

    def pop_deltas(self) -> list[CallDelta]:
        return self._scanner.pop()

    def feed(self, text: str) -> str:
        content = self._feed(text)
        if self._calls is not None:
            self._scanner.feed(self._calls[len(self._scanner.text) :])
        return content

    def _feed(self, text: str) -> str:
        if self._calls is not None:
            self._calls += text
            return ""
        text = self._held + text
        trigger = self.fmt.trigger
        if not self.fmt.text_first:
            if self._content:
                self._held = ""
                return text
            stripped = text.lstrip()
            if not stripped:
                self._held = text
                return ""
            if stripped.startswith(trigger):
                self._calls, self._held = stripped, ""
                return ""
            self._content, self._held = True, ""
            return text
        at = text.find(trigger)
        if at != -1:
            self._calls, self._held = text[at:], ""
            return text[:at]
        keep = next((k for k in range(min(len(trigger) - 1, len(text)), 0, -1) if text.endswith(trigger[:k])), 0)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

    def finish(self) -> tuple[str, list[ToolCall]]:
        if self._calls is None:
            held, self._held = self._held, ""
            return held, []
        # As streamed (the same ids, the arguments as written); cut by max_tokens, the complete
        # calls are kept and only the one cut short is dropped (the grammar holds everything after
        # the trigger to calls, so no text is lost).
        return "", self._scanner.whole()


class _JsonReplyParser(OutputParser):
    """The generic format's one JSON object: ``response`` streamed as content, ``tool_calls`` at the end."""

    _PREFIX = '{"response": '

    def __init__(self, raw: bool = False) -> None:
        self.raw = raw  # the response is a JSON value (response_format), given out as its text
        self._text = ""
        self._given = 0  # characters of the response given out
        self._scanner = _CallScanner("arguments")

    def fresh(self) -> OutputParser:
        return _JsonReplyParser(self.raw)

    def pop_deltas(self) -> list[CallDelta]:
        return self._scanner.pop()

    def feed(self, text: str) -> str:
        self._text += text
        if self._text.startswith('{"tool_calls": '[: len(self._text)]):
            self._scanner.feed(self._text[len(self._scanner.text) :])
            return ""
        prefix = self._PREFIX if self.raw else self._PREFIX + '"'
        if not self._text.startswith(prefix[: len(self._text)]) or len(self._text) < len(prefix):
            return ""
        if self.raw:  # everything but the wrapper's closing brace, which ends the output
            decoded = self._text[len(prefix) : -1]
        else:
            decoded, _ = _json_string_prefix(self._text[len(prefix) :])
        out = decoded[self._given :]
        self._given = len(decoded)
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        try:
            obj = json.loads(self._text)
        except ValueError:
            # Cut by max_tokens: the response given so far is the content; of calls, the complete
            # ones are kept and only the one cut short is dropped.
            return "", self._scanner.whole() if self._text.startswith('{"tool_calls": ') else []
        if isinstance(obj, dict) and "response" in obj:
            if self.raw:
                return self._text[len(self._PREFIX) : -1][self._given :], []
            if isinstance(obj["response"], str):
                return obj["response"][self._given :], []
        if isinstance(obj, dict) and isinstance(obj.get("tool_calls"), list):
            return "", self._scanner.whole()  # as streamed: the same ids, the arguments as written
        return "", []


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _json_string_prefix(body: str) -> tuple[str, bool]:
    """The characters of a JSON string whose text (after the opening quote) starts ``body``, as far
    as they are certain, and whether the string has closed."""
    out: list[str] = []
    i = 0
    while i < len(body):
        c = body[i]
        if c == '"':
            return "".join(out), True
        if c != "\\":
            out.append(c)
            i += 1
            continue
        if i + 1 >= len(body):
            break
        e = body[i + 1]
        if e == "u":
            if i + 6 > len(body):
                break
            code = int(body[i + 2 : i + 6], 16)
            if 0xD800 <= code < 0xDC00:  # a surrogate pair: both halves needed
                if i + 12 > len(body):
                    break
                low = int(body[i + 8 : i + 12], 16)
                out.append(chr(0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00)))
                i += 12
                continue
            out.append(chr(code))
            i += 6
            continue
        out.append({"n": "\n", "t": "\t", "r": "\r", "b": "\b", "f": "\f"}.get(e, e))
        i += 2
    return "".join(out), False
