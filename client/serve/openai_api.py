"""OpenAI's HTTP wire format: parse requests into muxworker calls, and errors (the response shapes
are responses.py's).

Sans-I/O: plain functions over decoded JSON, so every edge case is unit-tested without a server.
Field names, defaults and error objects follow OpenAI's API reference
(``{"error": {"message", "type", "param", "code"}}`` with the HTTP status the official client maps
to its exception classes). Sampling ranges are muxworker's own (transport/sampling.py), checked
here with :meth:`SamplingFields.validate` so a bad value is a 400 naming the field before any work.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from muxworker.client.params import CheckedParams
from muxworker.transport.errors import InvalidArgument, error_code_of
from muxworker.transport.sampling import (
    MAX_LOGPROBS,
    MAX_NEW_TOKENS,
    MAX_STOP_STRINGS,
    MAX_TOKEN_ID,
    SAMPLING_FIELD_NAMES,
    SamplingFieldError,
    SamplingFields,
    ref_cycle,
)

from .defaults import GenerationDefaults
from .tenants import TenantQuotaExceeded
from .tools import TOOL_NAME, Tool, ToolCall, ToolRequest

__all__ = [
    "APIError",
    "CompletionRequest",
    "ChatRequest",
    "SESSION_ID_PATTERN",
    "ServedModel",
    "check_body",
    "check_session_id",
    "error_from_mux",
    "parse_chat_request",
    "parse_completion_request",
]

#: A session id as the HTTP API accepts it (header, body field or URL path): 1-128 characters of
#: letters, digits and ``._:@-``, starting with a letter or digit. Store files are named by a hash
#: of the id, so no id can name a path; the pattern keeps ids printable and URL-safe.
SESSION_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}")
MAX_CACHE_SALT_CHARS = 128  # the server prefixes the tenant; the wire bound is larger

# Fields known and ignored (docs/SERVER.md lists them): OpenAI clients and agent frameworks send
# them, and they change nothing here (``user`` and ``metadata`` are labels; ``store`` is OpenAI's own log).
# ``safety_identifier`` is OpenAI's abuse hint; ``reasoning_effort`` and ``verbosity`` only steer
# reasoning models. ``prompt_cache_key`` is known but read by the app, not here: it names a session
# (:func:`cache_key_session`).
_IGNORED = frozenset(
    {
        "user",
        "metadata",
        "store",
        "service_tier",
        "prompt_cache_key",
        "safety_identifier",
        "reasoning_effort",
        "verbosity",
    }
)
# Any other field the server does not know is ignored too, as vLLM does (a new SDK field must not
# break a client), but named on the parsed request (``ignored``): the server logs and counts it.
_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
_COMMON = frozenset(
    {
        "model",
        "stream",
        "stream_options",
        "max_tokens",
        "stop",
        "seed",
        "n",
        "session_id",
        "cache_salt",
        "ignore_eos",
        "response_format",
        *_SAMPLING,
    }
)
_CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools", "tool_choice"}
_CHAT_FIELDS |= {"parallel_tool_calls"}
_CHAT_FIELDS |= {"logit_bias", "functions", "function_call", "modalities"}
_COMPLETION_FIELDS = _COMMON | {"prompt", "echo", "suffix", "best_of", "logprobs", "logit_bias"}
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
MAX_TOOLS = 128
MAX_CHOICES = 8  # n; each choice also takes a session slot while it runs


class APIError(Exception):
    """An HTTP error with OpenAI's error object. ``type`` is OpenAI's (``invalid_request_error``,
    ``authentication_error``, ``rate_limit_error``, ``server_error``); ``code`` is a stable string
    a program can switch on."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def _show(value: Any, limit: int = 80) -> str:
    """``value`` as the client wrote it (JSON), cut at ``limit`` characters with an ellipsis."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):  # not JSON (a caller's own value), or an int past str()'s limit
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass(frozen=True)
class ServedModel:
    """The model as requests name it: ``names[0]`` is the id ``/v1/models`` lists, and every name
    (``--served-model-name`` takes aliases) is accepted in a request's ``model``; ``defaults``
    fill what a request leaves out (client/serve/defaults.py)."""

    names: tuple[str, ...]
    defaults: GenerationDefaults = GenerationDefaults()

    def __post_init__(self) -> None:
        if not isinstance(self.names, tuple) or not self.names or not all(isinstance(n, str) and n for n in self.names):
            raise ValueError(f"a served model needs at least one non-empty name, got {self.names!r}")

    @property
    def id(self) -> str:
        return self.names[0]

    def named(self, model: Any) -> str:
        """The name a request gave (``None``: the id), as responses echo it; 404 for a name not served."""
        if model is None:
            return self.id
        if model not in self.names:
            raise APIError(
                404,
                f"the model {_show(model)} does not exist here; this server serves {_show(self.id)}"
                + (f" (also named {', '.join(_show(n) for n in self.names[1:])})" if len(self.names) > 1 else ""),
                code="model_not_found",
                param="model",
            )
        return model


#: Seconds a client is told to wait after a 429 or a 503 (Retry-After).
RETRY_AFTER_S = 1
#: ... and after a 503 because the session store did not answer (an outage lasts longer).
STORE_RETRY_AFTER_S = 5


@dataclass(frozen=True)
class _Words:
    """What the server adds to an OpenAI error code's answer: its own message, a Retry-After, the
    ``param`` it names. The status, type and code come from the table (transport/errors.py)."""

    message: str = ""  # "{exc}" is the exception's text; "": the exception's text as it is
    retry_after: int | None = None
    param: str | None = None


_WORDS: dict[str, _Words] = {
    "context_length_exceeded": _Words(param="messages"),
    "capacity": _Words("the server is at capacity: {exc}", RETRY_AFTER_S),
    # Nothing says the session is damaged, so nothing invites deleting it.
    "store_unavailable": _Words(
        "the session store is unavailable: {exc}. The session is kept; retry later", STORE_RETRY_AFTER_S
    ),
    "store_busy": _Words(retry_after=RETRY_AFTER_S),
    "session_unresumable": _Words(
        "the session's saved state cannot be used: {exc}. Its files are left untouched; "
        "DELETE /v1/sessions/{{id}} to start it over"
    ),
    "worker_unavailable": _Words("the model worker is unavailable: {exc}", RETRY_AFTER_S),
}


def error_from_mux(exc: BaseException) -> APIError:
    """The HTTP error a muxworker exception means to an OpenAI client: its row in the table of
    codes (transport/errors.py), with the server's words for its OpenAI code."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, TenantQuotaExceeded):  # the server's own limits, not a muxworker error
        if exc.kind == "bytes":
            return APIError(507, str(exc), type="insufficient_storage", code="tenant_storage_limit")
        return APIError(429, str(exc), type="rate_limit_error", code="tenant_session_limit")
    row = error_code_of(exc)
    if row is None:  # not a muxworker error: a bug, so the answer names only its class
        return APIError(500, f"internal error: {type(exc).__name__}", type="server_error", code="internal_error")
    words = _WORDS.get(row.http_code, _Words())
    if words.message:
        message = words.message.format(exc=exc)
    else:  # a server-side failure names its class, for whoever reads the log
        message = f"{type(exc).__name__}: {exc}" if row.status >= 500 else str(exc)
    headers = {"Retry-After": str(words.retry_after)} if words.retry_after is not None else None
    return APIError(row.status, message, type=row.type, code=row.http_code, param=words.param, headers=headers)


def check_session_id(value: Any, where: str = "session_id") -> str:
    if not isinstance(value, str) or not SESSION_ID_PATTERN.fullmatch(value):
        raise bad_request(
            f"{where} must be 1-128 characters of letters, digits and ._:@- starting with a letter or digit, "
            f"got {_show(value)}",
            param="session_id",
            code="invalid_session_id",
        )
    return value


MAX_CACHE_KEY_CHARS = 1024


def cache_key_session(key: Any) -> str | None:
    """The session OpenAI's ``prompt_cache_key`` names, as X-Session-Id would (per tenant): the
    key itself when it is a valid session id, else ``pck-`` and a hash of it (Codex sends a
    thread's UUID, which is valid; any string is accepted)."""
    if key is None:
        return None
    if not isinstance(key, str) or not 0 < len(key) <= MAX_CACHE_KEY_CHARS:
        raise bad_request(
            f"prompt_cache_key must be a string of 1-{MAX_CACHE_KEY_CHARS} characters", param="prompt_cache_key"
        )
    if SESSION_ID_PATTERN.fullmatch(key):
        return key
    return "pck-" + hashlib.sha256(key.encode()).hexdigest()[:40]


@dataclass
class _Common:
    model: str | None
    stream: bool
    include_usage: bool
    params: CheckedParams  # checked here, once; the session id and salt are the server's to set
    session_id: str | None
    cache_salt: str | None
    logprobs: int | None = None  # None: not asked; k: each token's logprob and its k most likely alternatives
    n: int = 1  # choices: the prompt prefilled once and forked (each also needs a free session slot)
    # max_new_tokens is the server's default, not the request's: cut it to the room the rendered
    # prompt leaves (defaults.clamp) rather than refuse the request
    default_max_tokens: bool = False
    ignored: tuple[str, ...] = ()  # unknown fields the request carried (ignored; the server logs and counts them)


@dataclass
class ChatRequest(_Common):
    # role, content, and for an assistant's calls "tool_calls" ([ToolCall]) and its reasoning
    # "reasoning_content"; a tool result's "tool_call_id" and "name" (the function its call named)
    messages: list[dict[str, Any]] = field(default_factory=list)
    tools: ToolRequest | None = None


@dataclass
class CompletionRequest(_Common):
    prompt: str | list[int] = ""


def parse_json(raw: bytes) -> dict[str, Any]:
    """A request body as JSON, checked whole by :func:`check_body` (the one pass every request
    kind gets before its fields are read)."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # bad UTF-8 or JSON, a 5,000-digit number, deep nesting
        raise bad_request(f"the request body is not valid JSON: {str(exc)[:200]}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}", code="invalid_json")
    check_body(body)
    return body


#: The deepest nesting of arrays and objects a body may have: a JSON Schema of 40 nested objects
#: fits, and every walk downstream (schema bounds, msgpack, the grammar compiler) stays far from
#: Python's recursion limit.
MAX_JSON_DEPTH = 128
#: Body fields an id or a store key is built from: NUL is refused in them as well.
_ID_FIELDS = frozenset({"session_id", "prompt_cache_key", "cache_salt", "previous_response_id"})
_PLAIN_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _member(path: str, key: str) -> str:
    """``path`` then ``key`` as a JSON path (``messages[0].content``; an odd key in brackets)."""
    if _PLAIN_KEY.fullmatch(key):
        return f"{path}.{key}" if path else key
    return f"{path}[{json.dumps(key)}]"  # ASCII: a key's own surrogates are escaped here


def _unpaired_surrogate(text: str) -> int | None:
    """Where ``text`` holds a lone surrogate (a JSON escape such as ``\\ud800`` decodes to one, and
    no encoder can write it), or None."""
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return exc.start
    return None


def check_body(body: Any, root: str = "") -> None:
    """One pass over a whole request body, before any field is read: every string, keys too, is
    valid Unicode (no unpaired surrogate), every number finite (a response echoes fields, and
    JSON cannot write NaN), nesting stays within :data:`MAX_JSON_DEPTH`, and the fields ids are
    built from hold no NUL. A 400 names the field by its JSON path (``param``). Also the JSON a
    string of the body holds (a tool call's arguments, which templates render decoded), with
    ``root`` the path of that string."""
    stack: list[tuple[Any, str, int]] = [(body, root, 0)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, str):
            at = _unpaired_surrogate(value)
            if at is not None:
                raise bad_request(
                    f"{path} is not valid Unicode: it holds an unpaired surrogate "
                    f"(\\u{ord(value[at]):04x}) at character {at}",
                    param=path,
                )
            if depth == 1 and not root and path in _ID_FIELDS and "\0" in value:
                raise bad_request(f"{path} must not contain NUL characters", param=path)
            continue
        if isinstance(value, float) and not math.isfinite(value):  # Python reads NaN, 1e400; JSON has neither
            raise bad_request(f"{path} must be a finite number, got {_show(value)}", param=path)
        if not isinstance(value, (dict, list)):
            continue
        if depth >= MAX_JSON_DEPTH:
            raise bad_request(
                f"{path or 'the request body'} is nested deeper than {MAX_JSON_DEPTH} levels of arrays and objects",
                param=path or None,
            )
        if isinstance(value, dict):
            children = []
            for key, item in value.items():
                where = _member(path, key)
                if _unpaired_surrogate(key) is not None:
                    raise bad_request(f"{where}: the key is not valid Unicode (an unpaired surrogate)", param=where)
                children.append((item, where, depth + 1))
        else:
            children = [(item, f"{path}[{i}]", depth + 1) for i, item in enumerate(value)]
        stack.extend(reversed(children))  # in document order: the first bad field is the one named


def _unknown(body: Mapping[str, Any], known: frozenset[str]) -> tuple[str, ...]:
    """The fields of ``body`` the server does not know (sorted): ignored, as vLLM ignores them."""
    return tuple(sorted(set(body) - known - _IGNORED))


def _absent_or(body: Mapping[str, Any], name: str, *allowed: Any, instead: str | None = None) -> None:
    """``name`` may only be missing, null, or one of ``allowed`` (a feature not served here, whose
    neutral values change nothing); the 400 says what to send (and ``instead``, what to use)."""
    value = body.get(name)
    if value is not None and not any(value == a and type(value) is type(a) for a in allowed):
        what = f"{name} is not supported by this server" + (f" (use {instead})" if instead else "")
        send = " or ".join(json.dumps(a) for a in allowed)
        raise bad_request(
            f"{what}; leave it out" + (f" or send {send}" if send else ""), param=name, code="unsupported"
        )


def _number(body: Mapping[str, Any], name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    try:
        number = float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan
    except OverflowError:  # an integer beyond a float's range
        number = math.nan
    if not math.isfinite(number):
        raise bad_request(f"{name} must be a finite number, got {_show(value)}", param=name)
    return number


def _integer(body: Mapping[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"{name} must be an integer, got {_show(value)}", param=name)
    return value


def _chat_logprobs(body: Mapping[str, Any]) -> int | None:
    """Chat's ``logprobs`` (bool) and ``top_logprobs`` (0-20, only with logprobs) as one top count."""
    asked = body.get("logprobs")
    if asked is not None and not isinstance(asked, bool):
        raise bad_request(f"logprobs must be a boolean, got {_show(asked)}", param="logprobs")
    top = _integer(body, "top_logprobs")
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise bad_request(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {top}", param="top_logprobs")
    if top is not None and not asked:
        raise bad_request("top_logprobs needs logprobs set to true", param="top_logprobs")
    return (top or 0) if asked else None


def _common(
    body: Mapping[str, Any],
    served: ServedModel | str,
    max_tokens_field: str | None,
    logprobs: int | None = None,
    ignored: tuple[str, ...] = (),
) -> _Common:
    served = served if isinstance(served, ServedModel) else ServedModel((served,))
    model = served.named(body.get("model"))
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise bad_request(f"stream must be a boolean, got {_show(stream)}", param="stream")
    include_usage = False
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict) or set(options) - {"include_usage", "include_obfuscation"}:
            raise bad_request(
                f"stream_options must be {{'include_usage': bool}}, got {_show(options)}", "stream_options"
            )
        if not stream:
            raise bad_request("stream_options is only allowed with stream=true", "stream_options")
        include_usage = bool(options.get("include_usage", False))
    n = _integer(body, "n")
    if n is not None and not 1 <= n <= MAX_CHOICES:
        raise bad_request(f"n must be in [1, {MAX_CHOICES}], got {n}", param="n")
    max_tokens = _integer(body, "max_tokens")
    if max_tokens_field is not None and body.get(max_tokens_field) is not None:
        max_tokens = _integer(body, max_tokens_field)
    max_param = (
        max_tokens_field if max_tokens_field is not None and body.get(max_tokens_field) is not None else "max_tokens"
    )
    if max_tokens is not None and not 1 <= max_tokens <= MAX_NEW_TOKENS:
        raise bad_request(
            f"{max_param} must be at least 1 and at most {MAX_NEW_TOKENS}, got {_show(max_tokens, 40)}", param=max_param
        )
    default_max = max_tokens is None and served.defaults.max_tokens is not None
    if default_max:
        max_tokens = served.defaults.max_tokens
    stop = body.get("stop")
    if stop is None:
        stop_list: list[str] = []
    elif isinstance(stop, str):
        stop_list = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= MAX_STOP_STRINGS:
        stop_list = list(stop)
    else:
        raise bad_request(f"stop must be a string or a list of at most {MAX_STOP_STRINGS} strings", param="stop")
    if any(not s for s in stop_list):
        raise bad_request("stop strings must not be empty", param="stop")
    seed = _integer(body, "seed")  # its range is SamplingFields' (validate, below)
    sampling: dict[str, Any] = {}
    for name in _SAMPLING:
        value = _integer(body, name) if name == "top_k" else _number(body, name)
        if value is not None:
            sampling[name] = value
    # The model's and the flags' defaults, then OpenAI's: temperature 1 (muxworker's own is greedy).
    served.defaults.fill(sampling)
    fields = SamplingFields(
        max_new_tokens=-1 if max_tokens is None else max_tokens,
        seed=seed,
        stop=stop_list,
        constraint=_response_format(body.get("response_format")),
        logprobs=logprobs,
        **sampling,
    )
    try:
        fields.validate()
    except SamplingFieldError as exc:
        wire = {
            "max_new_tokens": max_param,
            "constraint": "response_format",
            "logprobs": "top_logprobs" if "top_logprobs" in body else "logprobs",
        }
        raise bad_request(str(exc), param=wire.get(exc.field, exc.field)) from None
    except InvalidArgument as exc:
        raise bad_request(str(exc)) from None
    session_id = body.get("session_id")
    if session_id is not None:
        check_session_id(session_id)
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not 0 < len(salt) <= MAX_CACHE_SALT_CHARS):
        raise bad_request(f"cache_salt must be a string of 1-{MAX_CACHE_SALT_CHARS} characters", param="cache_salt")
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise bad_request(f"ignore_eos must be a boolean, got {_show(ignore_eos)}", param="ignore_eos")
    # The sampling fields as SamplingFields checked them (one definition, transport/sampling.py);
    # stop_token_ids only for vLLM's ignore_eos (benchmarks: run to max_tokens past the end of turn).
    sampled = {name: getattr(fields, name) for name in SAMPLING_FIELD_NAMES if name != "stop_token_ids"}
    if ignore_eos:
        sampled["stop_token_ids"] = []
    params = CheckedParams("", sampled)
    return _Common(model, stream, include_usage, params, session_id, salt, logprobs, n or 1, default_max, ignored)


def _response_format(value: Any) -> dict[str, Any] | None:
    """OpenAI's ``response_format`` as a sampling constraint (transport/sampling.py): ``text`` is
    free, ``json_object`` any JSON object, ``json_schema`` its ``schema``. The grammar enforces the
    schema whether ``strict`` is set or not (``strict`` only promises what is enforced anyway)."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text" and set(value) == {"type"}:
        return None
    if kind == "json_object" and set(value) == {"type"}:
        return {"json_object": True}
    if kind == "json_schema" and set(value) == {"type", "json_schema"}:
        spec = value["json_schema"]
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or set(spec) - _JSON_SCHEMA_KEYS:
            raise bad_request(
                "response_format.json_schema must be {name, schema?, strict?, description?}", param="response_format"
            )
        schema = spec.get("schema", {})
        if not isinstance(schema, dict):
            raise bad_request(
                "response_format.json_schema.schema must be a JSON Schema object", param="response_format"
            )
        if spec.get("strict") not in (None, True, False):
            raise bad_request("response_format.json_schema.strict must be a boolean", param="response_format")
        return {"json_schema": schema}
    raise bad_request(
        "response_format must be {type: text}, {type: json_object} or {type: json_schema, json_schema: {...}}, "
        f"got {_show(value, 120)}",
        param="response_format",
    )


_JSON_SCHEMA_KEYS = frozenset({"name", "schema", "strict", "description"})


def _content_text(content: Any, index: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(
                    f"messages[{index}].content: only text parts ({{'type': 'text', 'text': ...}}) are supported",
                    param="messages",
                    code="unsupported",
                )
            parts.append(part["text"])
        return "".join(parts)
    raise bad_request(f"messages[{index}].content must be a string or a list of text parts", param="messages")


def parse_chat_request(
    body: Mapping[str, Any], served: ServedModel | str, max_messages: int | None = None
) -> ChatRequest:
    """A ``POST /v1/chat/completions`` body; raises :class:`APIError` (400) naming the bad field
    (404 for a model not served). ``served``: the model (a bare name: no aliases, OpenAI's
    defaults). ``max_messages``: more messages than the context can hold (each renders to at
    least one token), refused before any is looked at."""
    ignored = _unknown(body, _CHAT_FIELDS)
    _absent_or(body, "logit_bias", {})
    _absent_or(body, "functions", [], instead="tools")
    _absent_or(body, "function_call", "none", "auto", instead="tool_choice")
    _absent_or(body, "modalities", ["text"])
    common = _common(body, served, "max_completion_tokens", _chat_logprobs(body), ignored)
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise bad_request("messages must be a non-empty list", param="messages")
    if max_messages is not None and len(raw) > max_messages:
        raise APIError(
            400,
            f"{len(raw)} messages cannot fit this model's context: at most {max_messages} can",
            code="context_length_exceeded",
            param="messages",
        )
    tools = _tool_request(body)
    content = common.params.fields.get("constraint")
    if tools is not None and content is not None:
        # Both: a reply is calls, or content that response_format holds (the tool format's grammar).
        schema = content.get("json_schema", {"type": "object"})
        tools = dataclasses.replace(tools, content_schema=schema)
        fields = {k: v for k, v in common.params.fields.items() if k != "constraint"}
        common.params = CheckedParams(common.params.session_id, fields)
    messages: list[dict[str, Any]] = []
    called: dict[str, str] = {}  # tool call id -> the function it named
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise bad_request(f"messages[{i}] must be an object", param="messages")
        given = m.get("role")
        role = _ROLES.get(given) if isinstance(given, str) else None
        if role is None:
            raise bad_request(
                f"messages[{i}].role must be one of {', '.join(_ROLES)}, got {_show(given, 40)}",
                param="messages",
                code="unsupported" if given == "function" else "invalid_value",
            )
        content = m.get("content")
        text = "" if content is None and role == "assistant" else _content_text(content, i)
        message: dict[str, Any] = {"role": role, "content": text}
        if role == "assistant":
            # The turn's reasoning, as a model that thinks returned it (vLLM's names): the chat
            # template renders it back or drops it (client/serve/reasoning.py).
            reasoning = next((m[k] for k in ("reasoning_content", "reasoning") if m.get(k) is not None), None)
            if reasoning is not None and not isinstance(reasoning, str):
                raise bad_request(f"messages[{i}].reasoning_content must be a string", param="messages")
            if reasoning is not None:
                message["reasoning_content"] = reasoning
        if role == "assistant" and m.get("tool_calls"):
            message["tool_calls"] = calls = _tool_calls(m["tool_calls"], i)
            called.update((c.id, c.name) for c in calls)
        elif role == "tool":
            call_id = m.get("tool_call_id")
            if not isinstance(call_id, str) or not call_id:
                raise bad_request(f"messages[{i}].tool_call_id must be a non-empty string", param="messages")
            message["tool_call_id"] = call_id
            message["name"] = called.get(call_id, m.get("name") if isinstance(m.get("name"), str) else "")
        messages.append(message)
    return ChatRequest(**vars(common), messages=messages, tools=tools)


def _tool_request(body: Mapping[str, Any]) -> ToolRequest | None:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls`` (None when no tools are given)."""
    raw = body.get("tools")
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad_request(f"parallel_tool_calls must be a boolean, got {_show(parallel)}", param="parallel_tool_calls")
    if raw is None or raw == []:
        if choice not in (None, "none", "auto"):
            raise bad_request("tool_choice needs tools", param="tool_choice")
        return None
    if not isinstance(raw, list) or len(raw) > MAX_TOOLS:
        raise bad_request(f"tools must be a list of at most {MAX_TOOLS} tools", param="tools")
    tools, names = [], set()
    for i, t in enumerate(raw):
        fn = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not TOOL_NAME.fullmatch(fn["name"]):
            raise bad_request(
                f"tools[{i}] must be {{type: function, function: {{name, description?, parameters?}}}} with a name "
                "of 1-64 letters, digits, _, - or .",
                param="tools",
            )
        if fn["name"] in names:
            raise bad_request(f"tools[{i}]: the name {fn['name']!r} is given twice", param="tools")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        description = fn.get("description", "")
        if not isinstance(params, dict) or not isinstance(description, str):
            raise bad_request(f"tools[{i}].function: parameters must be a JSON Schema object", param="tools")
        cycle = ref_cycle(params)
        if cycle is not None:
            raise bad_request(
                f"tools[{i}].function.parameters cannot be followed: {cycle!r} refers only to itself and allows no value",
                param="tools",
            )
        names.add(fn["name"])
        tools.append(Tool(fn["name"], description, params))
    function = None
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict):
        fn = choice.get("function") if choice.get("type") == "function" else None
        function = fn.get("name") if isinstance(fn, dict) else None
        if function not in names:
            raise bad_request(f"tool_choice names no given tool: {_show(choice, 120)}", param="tool_choice")
        choice = "function"
    elif choice not in ("none", "auto", "required"):
        raise bad_request(
            f"tool_choice must be none, auto, required or {{type: function, function: {{name}}}}, got {_show(choice)}",
            param="tool_choice",
        )
    return ToolRequest(tuple(tools), choice, function, True if parallel is None else parallel)


def _tool_calls(raw: Any, index: int) -> list[ToolCall]:
    """An assistant message's ``tool_calls``."""
    if not isinstance(raw, list):
        raise bad_request(f"messages[{index}].tool_calls must be a list", param="messages")
    calls = []
    for at, c in enumerate(raw):
        fn = c.get("function") if isinstance(c, dict) else None
        if (
            not isinstance(fn, dict)
            or not isinstance(fn.get("name"), str)
            or not isinstance(fn.get("arguments", "{}"), str)
            or not isinstance(c.get("id", ""), str)
        ):
            raise bad_request(
                f"messages[{index}].tool_calls entries must be {{id, type: function, function: {{name, arguments}}}} "
                "with arguments a JSON string",
                param="messages",
            )
        arguments = fn.get("arguments", "{}")
        try:  # templates render the arguments decoded: what they decode to is checked as the body was
            decoded = json.loads(arguments)
        except (ValueError, RecursionError):
            pass  # not JSON: rendered as the text it is
        else:
            check_body(decoded, f"messages[{index}].tool_calls[{at}].function.arguments")
        calls.append(ToolCall(c.get("id") or ToolCall.new_id(), fn["name"], arguments))
    return calls


def parse_completion_request(body: Mapping[str, Any], served: ServedModel | str) -> CompletionRequest:
    """A ``POST /v1/completions`` body (one prompt: a string or token ids)."""
    ignored = _unknown(body, _COMPLETION_FIELDS)
    _absent_or(body, "echo", False)
    _absent_or(body, "suffix")
    _absent_or(body, "best_of", 1)
    _absent_or(body, "logit_bias", {})
    top = _integer(body, "logprobs")
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise bad_request(f"logprobs must be in [0, {MAX_LOGPROBS}], got {top}", param="logprobs")
    common = _common(body, served, None, top, ignored)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        bad = next((t for t in prompt if not 0 <= t <= MAX_TOKEN_ID), None)
        if bad is not None:  # the worker checks the model's vocabulary; this keeps them encodable
            raise bad_request(f"prompt token ids must be in [0, {MAX_TOKEN_ID}], got {_show(bad, 40)}", param="prompt")
        return CompletionRequest(**vars(common), prompt=list(prompt))
    if not isinstance(prompt, str) or not prompt:
        raise bad_request(
            "prompt must be a non-empty string or a list of token ids (one prompt per request)", param="prompt"
        )
    return CompletionRequest(**vars(common), prompt=prompt)
