"""The HTTP surface under hypothesis-generated bad requests: a real ``python -m muxworker.serve``
with the bundled SmolLM2, every route, fields spoiled with lone surrogates, NUL, huge and
non-finite numbers, wrong types, deep nesting, enormous strings (scripts/fuzz_server.py's
strategies; that script runs thousands).

What is checked, for each request: the answer is a 2xx or a 4xx (never a 5xx, never a hang), a
4xx is an OpenAI error object, and a refused request changes nothing in the session store (the
server saves each turn before answering it, ``--save sync``, so a 2xx leaves nothing pending).
Meanwhile another session streams turn after turn: each of its turns ends well, and it keeps
streaming while the bad requests arrive; ``/health`` stays 200.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings

from muxworker.serve.process import ServerProcess

pytestmark = pytest.mark.slow

_SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "fuzz_server.py"
_spec = importlib.util.spec_from_file_location("fuzz_server", _SCRIPT)
assert _spec is not None and _spec.loader is not None
fuzz = importlib.util.module_from_spec(_spec)
sys.modules["fuzz_server"] = fuzz  # its dataclasses look their module up
_spec.loader.exec_module(fuzz)

EXAMPLES = 150  # about 20 s on two idle cores beside the streaming session (40 s on two busy ones)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    store = tmp_path_factory.mktemp("fuzz-store")
    args = ["--store", str(store), "--save", "sync", "--default-max-tokens", "4", "--max_session_tokens", "1024"]
    with ServerProcess(args, log_path=store.parent / "fuzz-serve.log") as server:
        yield server, store


def _wait(condition, what: str, limit_s: float = 180.0) -> None:
    """Wait for ``condition`` (a generous bound: a stuck server fails here rather than hangs)."""
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen"
        time.sleep(0.05)


def _settled(store: Path, skip) -> dict:
    """The store once no write lands for a moment: a stored response's session is saved after
    the answer, even under ``--save sync``; a refused request is compared with the settled store."""
    last = fuzz.store_snapshot(store, skip)
    quiet = 0
    for _ in range(200):  # at most 20 s
        time.sleep(0.1)
        now = fuzz.store_snapshot(store, skip)
        quiet = quiet + 1 if now == last else 0
        if quiet >= 3:
            break
        last = now
    return last


def test_bad_requests_get_4xx_and_leave_the_server_and_the_store_as_they_were(served):
    server, store = served
    before = fuzz.store_snapshot(store)
    background = fuzz.Background(server.url, server.model).start()
    try:
        _wait(lambda: background.turns >= 1 or background.errors, "the streaming session's first turn")
        assert not background.errors
        # The streaming session's own files (it saves every turn) are the only ones allowed to change.
        own = {name.split(".")[0] for name in set(fuzz.store_snapshot(store)) - set(before)}
        assert own, "the streaming session saved nothing"

        def others(name: str) -> bool:
            return name.split(".")[0] in own

        chunks_before = background.chunks
        seen = fuzz.Seen()
        statuses: dict[int, int] = {}
        settled = {"files": _settled(store, others)}
        with httpx.Client(base_url=server.url) as client:

            @settings(
                max_examples=EXAMPLES,
                deadline=None,
                database=None,
                derandomize=True,  # the same requests on every run; scripts/fuzz_server.py explores
                phases=[Phase.generate],
                suppress_health_check=list(HealthCheck),
            )
            @given(fuzz.requests(server.model, seen, max_string=300_000))
            def check(request) -> None:
                files = settled["files"]
                outcome = fuzz.send(client, request, seen)
                statuses[outcome.status] = statuses.get(outcome.status, 0) + 1
                assert 200 <= outcome.status < 500, (outcome.status, outcome.body[:500], request.show())
                assert outcome.problem is None, (outcome.problem, request.show())
                if outcome.status >= 400:
                    after = fuzz.store_snapshot(store, others)
                    changed = {k for k in set(files) | set(after) if files.get(k) != after.get(k)}
                    assert not changed, (
                        f"a refused request ({outcome.status}) changed {sorted(changed)}",
                        request.show(),
                    )
                elif request.method != "GET":
                    settled["files"] = _settled(store, others)  # with what it wrote (its session, its response)

            check()
            assert client.get("/health").status_code == 200
        # Both kinds of answer were seen: the run reached the generation as well as the checks.
        assert any(200 <= s < 300 for s in statuses) and any(400 <= s < 500 for s in statuses), statuses
        _wait(lambda: background.chunks > chunks_before or background.errors, "the streaming session's progress")
    finally:
        background.stop()
    assert not background.errors, background.errors
    assert background.turns >= 1


_SELF = {"$ref": "#"}  # allows no value
_ENDLESS = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}  # {"a": {"a": ... forced
# Two endless branches: the start is a choice (so it compiles and starts), each branch then never ends.
_ENDLESS_LATER = {
    "anyOf": [{"$ref": "#/$defs/a"}, {"$ref": "#/$defs/b"}],
    "$defs": {
        "a": {"type": "object", "properties": {"a": {"$ref": "#/$defs/a"}}, "required": ["a"]},
        "b": {"type": "object", "properties": {"b": {"$ref": "#/$defs/b"}}, "required": ["b"]},
    },
}


def test_schemas_the_engine_cannot_follow_are_refused_cleanly(served):
    server, _ = served

    def ask(schema, stream=False, path="/v1/chat/completions"):
        if path == "/v1/responses":
            fmt = {"type": "json_schema", "name": "x", "schema": schema}
            body = {"model": server.model, "input": "JSON", "max_output_tokens": 32, "text": {"format": fmt}}
        else:
            fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
            body = {"model": server.model, "messages": [{"role": "user", "content": "JSON"}], "max_tokens": 32}
            body["response_format"] = fmt
        return httpx.post(server.url + path, json={**body, "stream": stream}, timeout=120)

    def call(schema, path="/v1/chat/completions"):  # a tool whose arguments take ``schema``
        function = {"name": "f", "parameters": schema}
        if path == "/v1/responses":
            body = {"input": "Call f", "max_output_tokens": 32, "tools": [{"type": "function", **function}]}
        else:
            body = {"messages": [{"role": "user", "content": "Call f"}], "max_tokens": 32}
            body["tools"] = [{"type": "function", "function": function}]
        body = {**body, "model": server.model, "tool_choice": "required"}
        return httpx.post(server.url + path, json=body, timeout=120)

    for schema in (_SELF, _ENDLESS):  # refused before admission, streamed or not, saying why
        for stream in (False, True):
            r = ask(schema, stream)
            assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text
            assert "cannot be followed" in r.text or "no finite value" in r.text, r.text
        r = ask(schema, path="/v1/responses")
        assert r.status_code == 400 and r.json()["error"]["param"] == "text.format", r.text
        for path in ("/v1/chat/completions", "/v1/responses"):
            r = call(schema, path)
            assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
    # A branch that never ends, found only once chosen: a 400, or a last error event on the stream.
    r = ask(_ENDLESS_LATER)
    assert r.status_code == 400 and "cannot be followed" in r.json()["error"]["message"], r.text
    r = ask(_ENDLESS_LATER, stream=True)
    if r.status_code == 400:  # the error came before any text was sent
        assert "cannot be followed" in r.json()["error"]["message"], r.text
    else:
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert r.status_code == 200 and events[-1] == "[DONE]"
        assert "cannot be followed" in events[-2] and '"error"' in events[-2], events[-3:]
    assert httpx.get(server.url + "/health").status_code == 200
