"""Fuzz the HTTP server: hypothesis-generated bad requests on every route, against a real server.

    python scripts/fuzz_server.py [--requests 5000] [--url URL] [--model PATH_OR_NAME] [--seed N]

Starts ``python -m muxworker.serve`` on a temporary store (the bundled SmolLM2 unless --model;
``--default-max-tokens 4``) unless --url names a running one, then sends ``--requests`` requests,
one at a time, while another session streams turn after turn beside them. Each request is a valid
one of its route with one to three fields replaced by a bad value (lone surrogates, NUL, huge and
non-finite numbers, wrong types, deep nesting, enormous strings, unknown fields), or a body that is
not JSON at all, or odd ids, queries and headers on the other routes. Prints the count per status
(and per route), every 5xx or hang it saw, and exits 1 if there was any, or if the streaming
session failed or /health stopped answering 200.

tests/client/serve/test_fuzz.py draws its requests from the same strategies (:func:`requests`)
and checks the same outcomes (:func:`send`), in a bounded run.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

__all__ = ["Background", "FuzzRequest", "Outcome", "Seen", "requests", "send", "store_snapshot"]

SURROGATES = ("\ud800", "\udfff", "\udbff", "\udc00", "\ud83d")
#: A raw JSON number or literal the encoder cannot write itself (1e400 reads as inf; NaN is Python's).
_RAW = "\x00raw:"


def raw(text: str) -> str:
    """A placeholder that :func:`dumps` writes as ``text`` itself (a number literal JSON cannot spell)."""
    return f"{_RAW}{text}\x00"


def dumps(body: Any) -> bytes:
    """``body`` as JSON with lone surrogates escaped (``\\ud800``), NaN as ``NaN``, raw literals as they are."""
    text = json.dumps(body)  # ensure_ascii: a lone surrogate becomes its \\u escape
    while '"\\u0000raw:' in text:
        start = text.index('"\\u0000raw:')
        end = text.index('\\u0000"', start + 1)
        text = text[:start] + text[start + len('"\\u0000raw:') : end] + text[end + len('\\u0000"') :]
    return text.encode()


def _nested(depth: int, leaf: Any = 1) -> Any:
    out: Any = leaf
    for i in range(depth):
        out = [out] if i % 2 else {"a": out}
    return out


def bad_values(max_string: int) -> st.SearchStrategy[Any]:
    """Values no field should take (and a few it may): each must get a 2xx or a 4xx, never a 5xx."""
    text = st.text(max_size=12)
    return st.one_of(
        st.builds(lambda a, s, b: a + s + b, text, st.sampled_from(SURROGATES), text),  # unpaired surrogates
        st.builds(lambda a, b: a + "\x00" + b, text, text),  # NUL
        text,
        st.sampled_from(["", " ", "\n", "a" * 200, "..", "../x", "a/b", "é", "\U0001f600", "\u202e"]),
        st.sampled_from(['{"city": "\\ud800"}', '{"city": NaN}', "[" * 5000, '{"a": 1}']),  # JSON inside a string
        st.integers(),
        st.sampled_from(
            [0, -1, 1, 2**31, 2**31 - 1, 2**32, 2**53 + 1, 2**63, 2**64, 2**70, -(2**63), 10**30, 10**4000]
        ),
        st.floats(allow_nan=True, allow_infinity=True),
        st.sampled_from([0.5, 1.5, -0.0, 1e30, 1e-320, 2.5, 100.0]),
        st.sampled_from([raw("1e400"), raw("-1e400"), raw("NaN"), raw("Infinity"), raw("1" * 5000), raw("1.0e-400")]),
        st.booleans(),
        st.none(),
        st.lists(st.one_of(st.integers(), text, st.none()), max_size=4),
        st.dictionaries(text, st.one_of(st.integers(), text), max_size=3),
        st.integers(20, 400).map(_nested),
        st.sampled_from([1_000, 100_000, max_string]).map(lambda n: "x" * n),
    )


_MODEL = "__model__"  # replaced by the served model's id

_CHAT: dict[str, Any] = {
    "model": _MODEL,
    "messages": [{"role": "user", "content": "Say hi"}],
    "max_tokens": 2,
    "temperature": 0,
}
_CHAT_FIELDS = (
    "model",
    "messages",
    "messages[0]",
    "messages[0].role",
    "messages[0].content",
    "messages[0].content[0].text",
    "messages[0].content[0].type",
    "messages[1]",
    "messages[1].role",
    "messages[1].tool_calls",
    "messages[1].tool_calls[0].function.arguments",
    "messages[1].tool_call_id",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "n",
    "stop",
    "stop[0]",
    "stream",
    "stream_options",
    "stream_options.include_usage",
    "logprobs",
    "top_logprobs",
    "tools",
    "tools[0]",
    "tools[0].function.name",
    "tools[0].function.description",
    "tools[0].function.parameters",
    "tools[0].function.parameters.properties.city.enum",
    "tool_choice",
    "tool_choice.function.name",
    "parallel_tool_calls",
    "response_format",
    "response_format.type",
    "response_format.json_schema",
    "response_format.json_schema.schema",
    "response_format.json_schema.schema.properties",
    "session_id",
    "prompt_cache_key",
    "cache_salt",
    "ignore_eos",
    "user",
    "metadata",
    "logit_bias",
    "functions",
    "modalities",
    "reasoning_effort",
    "zz_unknown",
    "zz_unknown.deep",
)
_COMPLETION: dict[str, Any] = {"model": _MODEL, "prompt": "Hello", "max_tokens": 2, "temperature": 0}
_COMPLETION_FIELDS = (
    "model",
    "prompt",
    "prompt[0]",
    "prompt[1]",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "n",
    "stop",
    "stream",
    "stream_options",
    "logprobs",
    "echo",
    "suffix",
    "best_of",
    "logit_bias",
    "response_format",
    "response_format.type",
    "session_id",
    "prompt_cache_key",
    "cache_salt",
    "ignore_eos",
    "zz_unknown",
)
_RESPONSES: dict[str, Any] = {"model": _MODEL, "input": "Say hi", "max_output_tokens": 2, "temperature": 0}
_RESPONSES_FIELDS = (
    "model",
    "input",
    "input[0]",
    "input[0].type",
    "input[0].role",
    "input[0].content",
    "input[0].content[0].text",
    "input[0].content[0].type",
    "input[1].call_id",
    "input[1].output",
    "instructions",
    "max_output_tokens",
    "temperature",
    "top_p",
    "top_logprobs",
    "seed",
    "stop",
    "stream",
    "store",
    "previous_response_id",
    "prompt_cache_key",
    "cache_salt",
    "tools",
    "tools[0].name",
    "tools[0].parameters",
    "tools[0].type",
    "tool_choice",
    "parallel_tool_calls",
    "text",
    "text.format",
    "text.format.type",
    "text.format.schema",
    "truncation",
    "metadata",
    "user",
    "reasoning",
    "include",
    "background",
    "conversation",
    "prompt",
    "zz_unknown",
)
_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
            "required": ["city"],
        },
    },
}
#: Optional parts a request may carry before its fields are spoiled (valid on their own).
_CHAT_EXTRAS: dict[str, Any] = {
    "stream": True,
    "n": 2,
    "seed": 7,
    "stop": ["\n\n"],
    "logprobs": True,
    "tools": [_TOOL],
    "response_format": {"type": "json_object"},
    "session_id": "SESSION",
    "prompt_cache_key": "a key",
    "messages": [
        {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ],
}
_RESPONSES_EXTRAS: dict[str, Any] = {
    "stream": True,
    "store": False,
    "instructions": "Be brief.",
    "tools": [{"type": "function", "name": "get_weather", "parameters": _TOOL["function"]["parameters"]}],
    "text": {"format": {"type": "json_schema", "name": "out", "schema": {"type": "object"}}},
    "previous_response_id": "PREVIOUS",
    "input": [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
    ],
}


@dataclass
class FuzzRequest:
    """One request: ``route`` labels it in the counts (its method and route template)."""

    route: str
    method: str
    path: str
    body: bytes | None = None
    headers: dict[str, str] = field(default_factory=dict)
    mutated: tuple[str, ...] = ()  # the fields spoiled (for a report)

    def show(self, limit: int = 300) -> str:
        body = (self.body or b"")[:limit].decode("utf-8", "replace")
        return f"{self.method} {self.path[:200]} {self.headers} {self.mutated} {body}"


@dataclass
class Seen:
    """Ids the server handed out during a run (stored responses, sessions): some requests name
    one, so the routes that read or delete them are reached with ids that exist."""

    responses: list[str] = field(default_factory=list)
    sessions: list[str] = field(default_factory=list)

    def pick(self, kind: str, index: int) -> str:
        ids = self.responses if kind == "response" else self.sessions
        return ids[index % len(ids)] if ids else ("resp_" if kind == "response" else "s-") + uuid.uuid4().hex


def _parse_path(path: str) -> list[str | int]:
    out: list[str | int] = []
    for part in path.replace("]", "").replace("[", ".").split("."):
        out.append(int(part) if part.isdigit() else part)
    return out


def _set(body: Any, path: str, value: Any) -> Any:
    """``body`` with ``path`` set to ``value``, parents made as needed (a list grows to the index)."""
    keys = _parse_path(path)
    node = body
    for key, nxt in zip(keys, keys[1:]):
        child_kind: type = list if isinstance(nxt, int) else dict
        if isinstance(key, int):
            if not isinstance(node, list):
                return body
            while len(node) <= key:
                node.append(child_kind())
            if not isinstance(node[key], (dict, list)):
                node[key] = child_kind()
            node = node[key]
        else:
            if not isinstance(node, dict):
                return body
            if not isinstance(node.get(key), (dict, list)):
                node[key] = child_kind()
            node = node[key]
    last = keys[-1]
    if isinstance(last, int) and isinstance(node, list):
        while len(node) <= last:
            node.append(None)
        node[last] = value
    elif isinstance(node, dict):
        node[str(last)] = value
    return body


_ID_TEXT = st.one_of(
    st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), min_size=1, max_size=40),
    st.sampled_from(["%00", "a%00b", "%ED%A0%80", "%FF%FE", "..", "a/../b", "x" * 5000, "%2e%2e", "~i-x", "-a", "a b"]),
)
# A header value as HTTP allows one (printable, no space at either end): what a client can send.
_INDEXES = st.integers(0, 1000)  # which id of those seen a request names
_HEADER_TEXT = st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=200).map(str.strip)


def _generation(model: str, max_string: int, seen: Seen) -> st.SearchStrategy[FuzzRequest]:
    # Strategies built once: one made inside a draw is validated again at every draw (most of the
    # time hypothesis would spend).
    kinds = st.one_of(
        [
            st.tuples(
                st.just((path, base, extras)),
                st.lists(st.sampled_from(sorted(extras)), max_size=3, unique=True),  # valid parts added
                st.lists(st.sampled_from(fields), min_size=1, max_size=3, unique=True),  # then spoiled
            )
            for path, base, fields, extras in (
                ("/v1/chat/completions", _CHAT, _CHAT_FIELDS, _CHAT_EXTRAS),
                ("/v1/completions", _COMPLETION, _COMPLETION_FIELDS, {"stream": True, "prompt": [1, 2]}),
                ("/v1/responses", _RESPONSES, _RESPONSES_FIELDS, _RESPONSES_EXTRAS),
            )
        ]
    )
    values = bad_values(max_string)
    header = st.one_of(_HEADER_TEXT, st.just("fz-"))

    @st.composite
    def build(draw: st.DrawFn) -> FuzzRequest:
        (path, base, extras), chosen, mutated_fields = draw(kinds)
        body = copy.deepcopy(base)
        for key in chosen:
            body[key] = copy.deepcopy(extras[key])
        if body.get("session_id") == "SESSION":
            body["session_id"] = "fz-" + uuid.uuid4().hex[:12]
        if body.get("previous_response_id") == "PREVIOUS":
            body["previous_response_id"] = seen.pick("response", draw(_INDEXES))
        mutated = tuple(mutated_fields)
        for where in mutated:
            body = _set(body, where, draw(values))
        if body.get("model") == _MODEL:
            body["model"] = model
        headers = {"content-type": "application/json"}
        if draw(st.integers(0, 9)) == 0:
            sid = draw(header)
            headers["x-session-id"] = sid + uuid.uuid4().hex[:12] if sid == "fz-" else sid
        return FuzzRequest(f"POST {path}", "POST", path, dumps(body), headers, mutated)

    return build()


_RAW_BODIES = st.one_of(
    st.binary(max_size=64),
    st.sampled_from(
        [
            b"",
            b"{",
            b"[]",
            b"null",
            b'"text"',
            b"1e400",
            b"\xef\xbb\xbf{}",
            b'{"model": "\xff\xfe"}',
            b'{"a": "\\ud800"}',
            b'{"messages": [' * 3000,
            b"[" * 100_000,
            b'{"a":' * 50_000 + b"1" + b"}" * 50_000,
            b'{"max_tokens": ' + b"9" * 5000 + b"}",
            b'{"temperature": NaN, "messages": []}',
            b'{"model": 1, "model": 2}',
        ]
    ),
)


def _raw_body() -> st.SearchStrategy[FuzzRequest]:
    paths = st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/responses"])
    content_types = st.sampled_from(["application/json", "text/plain", "", "application/json; charset=latin-1"])
    return st.builds(
        lambda path, body, ctype: FuzzRequest(
            f"POST {path}", "POST", path, body, {"content-type": ctype} if ctype else {}
        ),
        paths,
        _RAW_BODIES,
        content_types,
    )


_QUERIES = st.one_of(
    st.just(""),
    st.builds(
        lambda k, v: f"?{k}={v}",
        st.sampled_from(["limit", "order", "after", "x"]),
        st.sampled_from(["0", "1", "100", "101", "-1", "1e400", "9" * 5000, "asc", "desc", "%00", "%ED%A0%80"]),
    ),
)
_ROUTES = st.sampled_from(
    [
        ("GET /health", "GET", "/health"),
        ("GET /metrics", "GET", "/metrics"),
        ("GET /v1/models", "GET", "/v1/models"),
        ("GET /v1/models/{model}", "GET", "/v1/models/{model}"),
        ("GET /v1/sessions", "GET", "/v1/sessions"),
        ("GET /v1/sessions/{id}", "GET", "/v1/sessions/{sid}"),
        ("DELETE /v1/sessions/{id}", "DELETE", "/v1/sessions/{sid}"),
        ("POST /v1/sessions/{id}/save", "POST", "/v1/sessions/{sid}/save"),
        ("GET /v1/responses/{id}", "GET", "/v1/responses/{rid}"),
        ("DELETE /v1/responses/{id}", "DELETE", "/v1/responses/{rid}"),
        ("GET /v1/responses/{id}/input_items", "GET", "/v1/responses/{rid}/input_items{query}"),
        ("GET /v1/chat/completions", "GET", "/v1/chat/completions"),
        ("PUT /v1/responses", "PUT", "/v1/responses"),
        ("GET /v1/unknown", "GET", "/v1/{sid}"),
        ("GET /models (unversioned)", "GET", "/models/{model}"),
    ]
)
_HEADER_NAMES = st.sampled_from(["x-session-id", "authorization", "content-type", "accept"])


def _other_routes(model: str, seen: Seen) -> st.SearchStrategy[FuzzRequest]:
    @st.composite
    def build(draw: st.DrawFn) -> FuzzRequest:
        known = draw(st.booleans())
        index = draw(_INDEXES)
        rid = seen.pick("response", index) if known else draw(_ID_TEXT)
        sid = seen.pick("session", index) if known else draw(_ID_TEXT)
        query = draw(_QUERIES)
        route, method, path = draw(_ROUTES)
        name = model if draw(st.booleans()) else draw(_ID_TEXT)
        path = path.format(model=name, sid=sid, rid=rid, query=query)
        headers = {}
        if draw(st.integers(0, 4)) == 0:
            headers[draw(_HEADER_NAMES)] = draw(_HEADER_TEXT)
        return FuzzRequest(route, method, path, None, headers)

    return build()


def requests(model: str, seen: Seen, max_string: int = 300_000) -> st.SearchStrategy[FuzzRequest]:
    """Requests over every route: generation bodies with spoiled fields (most), bodies that are
    not JSON, and the other routes with odd ids, queries and headers."""
    return st.one_of(
        _generation(model, max_string, seen),
        _generation(model, max_string, seen),
        _generation(model, max_string, seen),
        _raw_body(),
        _other_routes(model, seen),
    )


@dataclass
class Outcome:
    status: int  # 0: no answer (a hang past the timeout, or the connection broke)
    problem: str | None = None  # what is wrong with the answer, beyond a 5xx
    body: bytes = b""


def send(client: httpx.Client, request: FuzzRequest, seen: Seen | None = None, timeout: float = 120.0) -> Outcome:
    """Send ``request`` and read the whole answer (a stream to its end). ``problem``: a 4xx that
    is not an OpenAI error object, or a stream that broke; ids of stored responses and sessions
    the answer names go into ``seen``."""
    try:
        with client.stream(
            request.method, request.path, content=request.body, headers=request.headers, timeout=timeout
        ) as r:
            data = r.read()
            status = r.status_code
            headers = r.headers
    except httpx.TimeoutException:
        return Outcome(0, "no answer within the timeout")
    except httpx.HTTPError as exc:
        return Outcome(0, f"{type(exc).__name__}: {exc}")
    problem = None
    if status >= 400:
        try:
            error = json.loads(data)["error"]
            if not isinstance(error.get("message"), str) or not error["message"]:
                problem = "the error object has no message"
        except (ValueError, KeyError, TypeError):
            problem = f"a {status} that is not an OpenAI error object: {data[:200]!r}"
    elif seen is not None and headers.get("content-type", "").startswith("application/json"):
        try:
            doc = json.loads(data)
        except ValueError:
            return Outcome(status, "a 2xx JSON answer that is not JSON", data)
        if isinstance(doc, dict) and doc.get("object") == "response" and doc.get("store") and len(seen.responses) < 200:
            seen.responses.append(doc["id"])
    if seen is not None and headers.get("x-session-id") and len(seen.sessions) < 200:
        seen.sessions.append(headers["x-session-id"])
    return Outcome(status, problem, data)


def store_snapshot(store: Path, skip: Callable[[str], bool] = lambda name: False) -> dict[str, tuple[int, int]]:
    """{file name: (size, mtime)} of the store's files, lock files and those ``skip`` names aside."""
    out = {}
    for path in store.rglob("*"):
        rel = str(path.relative_to(store))
        if path.is_file() and not path.name.startswith(".") and not skip(rel):
            st_ = path.stat()
            out[rel] = (st_.st_size, st_.st_mtime_ns)
    return out


class Background:
    """Another session streaming turn after turn (its own thread) while the fuzz runs: each turn
    must end well. ``turns`` and ``chunks`` count what it got; ``errors`` what went wrong."""

    def __init__(self, url: str, model: str, session: str | None = None) -> None:
        self.url = url
        self.model = model
        self.session = session or f"bg-{uuid.uuid4().hex}"
        self.turns = 0
        self.chunks = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def turn(self, client: httpx.Client) -> None:
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": "Count from one to one hundred."}],
            "max_tokens": 48,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        done = False
        with client.stream("POST", "/v1/chat/completions", json=body, headers={"X-Session-Id": self.session}) as r:
            if r.status_code != 200:
                self.errors.append(f"turn {self.turns}: status {r.status_code}: {r.read()[:300]!r}")
                return
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        self.errors.append(f"turn {self.turns}: {chunk['error']}")
                        return
                    if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                        self.chunks += 1
        if not done:
            self.errors.append(f"turn {self.turns}: the stream ended without [DONE]")
        self.turns += 1

    def _run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=120) as client:
            while not self._stop.is_set():
                try:
                    self.turn(client)
                except httpx.HTTPError as exc:
                    self.errors.append(f"turn {self.turns}: {type(exc).__name__}: {exc}")
                if self.errors:
                    return

    def start(self) -> Background:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=180)


@contextmanager
def _server(args: argparse.Namespace, store: Path) -> Iterator[tuple[str, str]]:
    if args.url:
        yield args.url, httpx.get(args.url + "/v1/models").json()["data"][0]["id"]
        return
    from muxworker.serve.process import ServerProcess

    flags = ["--store", str(store), "--default-max-tokens", "4", "--max_session_tokens", "1024"]
    if args.model:
        flags += ["--model", args.model]
    with ServerProcess(flags, log_path=store.parent / "fuzz-serve.log") as server:
        print(f"server {server.url} ({server.model}); log {store.parent / 'fuzz-serve.log'}", flush=True)
        yield server.url, server.model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--url", help="a running server (else one is started on a temporary store)")
    parser.add_argument("--model", help="the model to serve (default: the bundled SmolLM2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-string", type=int, default=3_000_000, help="the longest string a field gets")
    args = parser.parse_args(argv)
    statuses: Counter[int] = Counter()
    routes: Counter[tuple[str, int]] = Counter()
    bad: list[str] = []
    seen = Seen()
    with tempfile.TemporaryDirectory(prefix="muxworker-fuzz-") as tmp:
        store = Path(tmp) / "store"
        with _server(args, store) as (url, model):
            background = Background(url, model).start()
            t0 = time.monotonic()
            with httpx.Client(base_url=url) as client:

                @settings(
                    max_examples=args.requests,
                    deadline=None,
                    database=None,
                    phases=[Phase.generate],
                    suppress_health_check=list(HealthCheck),
                    derandomize=False,
                )
                @given(requests(model, seen, args.max_string))
                def one(request: FuzzRequest) -> None:
                    outcome = send(client, request, seen)
                    statuses[outcome.status] += 1
                    routes[(request.route, outcome.status)] += 1
                    if outcome.status >= 500 or outcome.status == 0 or outcome.problem:
                        bad.append(f"{outcome.status} {outcome.problem or outcome.body[:300]!r} <- {request.show()}")
                    done = sum(statuses.values())
                    if done % 500 == 0:
                        print(
                            f"{done} requests, {time.monotonic() - t0:.0f} s: {dict(sorted(statuses.items()))}",
                            flush=True,
                        )

                seed(args.seed)(one)()
                health = client.get("/health").status_code
            background.stop()
            elapsed = time.monotonic() - t0
    total = sum(statuses.values())
    print(f"\n{total} requests in {elapsed:.0f} s; per status: {dict(sorted(statuses.items()))}")
    for (route, status), count in sorted(routes.items()):
        print(f"  {route:44} {status:3}  {count}")
    print(f"the other session streamed {background.turns} turns ({background.chunks} chunks) meanwhile")
    print(f"/health at the end: {health}")
    for line in bad[:50]:
        print("PROBLEM", line)
    for line in background.errors:
        print("BACKGROUND", line)
    return 1 if bad or background.errors or health != 200 else 0


if __name__ == "__main__":
    sys.exit(main())
