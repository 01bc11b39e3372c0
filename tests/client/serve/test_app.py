"""The ASGI app (client/serve/app.py) in-process over a scripted service (tests/helpers/serve_fakes.py),
and once behind a real hypercorn socket: the routes clients use with and without ``/v1``, what
``/v1/models`` reports, unknown fields ignored and counted, a default ``max_tokens`` cut to the
room the prompt leaves, the access log, and a 413 that does not break a pooled client's next
request."""

from __future__ import annotations

import logging

import httpx
import pytest
import trio
from helpers.serve_fakes import ScriptedService
from hypercorn.config import Config
from hypercorn.trio import serve

from muxworker.serve.app import AppConfig, create_app
from muxworker.serve.defaults import GenerationDefaults
from muxworker.serve.metrics import ServerMetrics
from muxworker.serve.openai_api import ServedModel
from muxworker.serve.policy import HttpPolicy

CHAT = {"messages": [{"role": "user", "content": "hi"}]}


class _App:
    def __init__(self, service: ScriptedService | None = None, served: ServedModel | None = None, **policy) -> None:
        self.service = service or ScriptedService()
        self.metrics = ServerMetrics()
        config = AppConfig(served or ServedModel(("m",)), policy=HttpPolicy(**policy))
        self.app = create_app(self.service, self.metrics, config)  # type: ignore[arg-type]

    async def __call__(self, method: str, path: str, **kw) -> httpx.Response:
        transport = httpx.ASGITransport(app=self.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:8000") as http:
            return await http.request(method, path, **kw)

    def metric(self, line_start: str) -> float:
        for line in self.metrics.render().decode().splitlines():
            if line.startswith(line_start):
                return float(line.rsplit(" ", 1)[1])
        return 0.0


async def test_unversioned_routes_as_llama_cpp_serves_them():
    app = _App()
    for prefix in ("/v1", ""):
        r = await app("POST", prefix + "/chat/completions", json=CHAT)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "Hello there", prefix
        r = await app("POST", prefix + "/completions", json={"prompt": "hi"})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "Hello there", prefix
        r = await app("GET", prefix + "/models")
        assert r.status_code == 200 and [m["id"] for m in r.json()["data"]] == ["m"], prefix
        assert (await app("GET", prefix + "/models/m")).json()["id"] == "m"
    assert (await app("GET", "/sessions")).status_code == 404  # only what llama.cpp serves unversioned


async def test_models_report_max_model_len_and_aliases():
    app = _App(ScriptedService(max_session_tokens=2048), ServedModel(("qwen", "gpt-4o-mini")))
    listed = (await app("GET", "/v1/models")).json()["data"]
    assert [(m["id"], m["max_model_len"], m["object"]) for m in listed] == [("qwen", 2048, "model")]
    r = await app("GET", "/v1/models/gpt-4o-mini")
    assert r.status_code == 200 and (r.json()["id"], r.json()["max_model_len"]) == ("gpt-4o-mini", 2048)
    r = await app("GET", "/v1/models/gpt-5")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    # A request may name the model by any of its names, and is answered under that name.
    r = await app("POST", "/v1/chat/completions", json={**CHAT, "model": "gpt-4o-mini"})
    assert r.status_code == 200 and r.json()["model"] == "gpt-4o-mini"
    r = await app("POST", "/v1/chat/completions", json={**CHAT, "model": "gpt-5"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert r.json()["error"]["param"] == "model" and app.service.generated == 1
    # No worker up yet: the length is unknown.
    none = _App(ScriptedService(max_session_tokens=None))
    assert (await none("GET", "/v1/models")).json()["data"][0]["max_model_len"] is None


async def test_unknown_fields_are_ignored_logged_and_counted(caplog):
    app = _App()
    with caplog.at_level(logging.DEBUG, "muxworker.serve"):
        r = await app("POST", "/v1/chat/completions", json={**CHAT, "audio": None, "x-weird\nname": 1})
    assert r.status_code == 200 and app.service.generated == 1
    assert "ignoring unknown fields 'audio', 'x-weird\\nname'" in caplog.text
    assert app.metric('muxworker_unknown_fields_total{field="audio"}') == 1
    assert app.metric('muxworker_unknown_fields_total{field="other"}') == 1  # not a name: not a label
    # The labels are bounded: 64 of them (audio, other and 62 of these), then "other".
    await app("POST", "/v1/completions", json={"prompt": "hi", **{f"f{i}": 1 for i in range(100)}})
    series = [
        line
        for line in app.metrics.render().decode().splitlines()
        if line.startswith("muxworker_unknown_fields_total{")
    ]
    assert len(series) == 64 and sum(float(line.rsplit(" ", 1)[1]) for line in series) == 102
    assert app.metric('muxworker_unknown_fields_total{field="other"}') == 1 + 100 - 62


async def test_a_default_max_tokens_is_cut_to_the_room_the_prompt_leaves():
    """A request without max_tokens gets the default, cut to what the context holds after its
    prompt (rather than a context error); one that asks for more than fits is the worker's to
    refuse, as OpenAI refuses it."""
    service = ScriptedService(max_session_tokens=10, prompt=[1, 2, 3])
    app = _App(service, ServedModel(("m",), GenerationDefaults(max_tokens=4096, temperature=0.5)))
    await app("POST", "/v1/chat/completions", json=CHAT)
    await app("POST", "/v1/chat/completions", json={**CHAT, "max_tokens": 50})
    await app("POST", "/v1/completions", json={"prompt": "hey"})  # 3 tokens here
    await app("POST", "/v1/chat/completions", json={**CHAT, "n": 2})
    sent = [(p.fields["max_new_tokens"], p.fields["temperature"]) for p in service.params]
    assert sent[:3] == [(7, 0.5), (50, 0.5), (7, 0.5)]
    assert all(max_new == 7 for max_new, _ in sent[4:])  # every choice of n=2 (after the one-token prefill)
    small = _App(ScriptedService(max_session_tokens=4096), ServedModel(("m",), GenerationDefaults(max_tokens=16)))
    await small("POST", "/v1/chat/completions", json=CHAT)
    assert small.service.params[0].fields["max_new_tokens"] == 16


async def test_one_access_log_line_per_request(caplog):
    app = _App(api_keys=("k",))
    key = {"authorization": "Bearer k"}
    with caplog.at_level(logging.INFO, "muxworker.serve.access"):
        await app("POST", "/v1/chat/completions", json=CHAT, headers=key)
        await app("GET", "/v1/models", headers=key)
        await app("POST", "/v1/chat/completions", json=CHAT)  # no key
        await app("POST", "/v1/chat/completions", content=b"{}", headers={"content-type": "text/plain"})
        await app("GET", "/v1/nothing%0A", headers=key)  # the path as decoded: a newline
    lines = [r.getMessage() for r in caplog.records if r.name == "muxworker.serve.access"]
    assert len(lines) == 5
    shapes = [line.rsplit(" ", 2)[0] for line in lines]  # without the milliseconds
    assert shapes == [
        "POST /v1/chat/completions 200 prompt=3 cached=1 completion=2",
        "GET /v1/models 200",
        "POST /v1/chat/completions 401",
        "POST /v1/chat/completions 415",
        "GET /v1/nothing\\n 404",
    ]
    assert all(line.endswith(" ms") and line.rsplit(" ", 2)[1].isdigit() for line in lines)


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
async def test_a_413_does_not_break_a_pooled_clients_next_request(chunked):
    """Over a real socket (hypercorn, as the server runs): a body over the limit, declared
    (Content-Length, refused before it is read) or streamed (chunked, refused once the limit is
    passed), is a 413 with ``Connection: close``; the pooled client (httpx, the OpenAI SDK's)
    opens a new connection for its next request instead of failing on the closed one."""
    app = create_app(ScriptedService(), ServerMetrics(), AppConfig(ServedModel(("m",))))  # type: ignore[arg-type]
    config = Config()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    too_big = b"x" * (5 << 20)

    def client(url: str) -> None:  # in a thread: a sync client, whose abandoned body generator closes quietly
        with httpx.Client(base_url=url, timeout=30) as http:
            for _ in range(3):
                assert http.post("/v1/chat/completions", json=CHAT).status_code == 200
                body = (too_big[i : i + (1 << 16)] for i in range(0, len(too_big), 1 << 16)) if chunked else too_big
                r = http.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
                assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
                assert r.headers["connection"] == "close"
                r = http.post("/v1/chat/completions", json=CHAT)
                assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "Hello there"

    async with trio.open_nursery() as nursery:
        binds = await nursery.start(lambda task_status: serve(app, config, task_status=task_status))
        await trio.to_thread.run_sync(client, binds[0])
        nursery.cancel_scope.cancel()
