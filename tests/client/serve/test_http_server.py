"""The HTTP server end to end: a real ``python -m muxworker.serve`` process on 127.0.0.1 with a real
worker and the bundled SmolLM2, driven by clients nobody here wrote (the official ``openai``
package, httpx for raw SSE).

What is checked: OpenAI's wire format (chat and completions, streamed and not, usage, errors and
their HTTP statuses through the SDK's exception classes); sessions named by a header or a body
field reuse their history (``cached_tokens``) and are saved after each turn; a server restart
resumes a session from the store with only the new turn prefilled, with the same reply as a cold
run; a killed worker gives 503 and is restarted; API keys, tenants and cache salts keep tenants
apart; capacity gives 429; a client that goes away cancels its generation.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from muxworker.client import SessionStore
from muxworker.serve.process import ServerProcess, process_table

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "Name three colours of the rainbow."}]


def _client(server: ServerProcess, key: str = "none", **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=120, **kw)


def _metric(server: ServerProcess, name: str, headers: dict | None = None) -> float:
    text = httpx.get(server.url + "/metrics", headers=headers).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    store = tmp_path_factory.mktemp("serve-store")
    args = ["--store", str(store), "--max_sessions", "6", "--prefix_cache_entries", "2", "--max_session_tokens", "2048"]
    with ServerProcess(args, log_path=store.parent / "serve.log") as s:
        yield s


def test_models_health_and_unknown_routes(server):
    client = _client(server)
    models = client.models.list()
    assert [m.id for m in models.data] == [server.model] == ["SmolLM2-135M-Instruct.Q4_1"]
    assert client.models.retrieve(server.model).id == server.model
    # How the worker holds each tensor type: SmolLM2's Q4_1 layers and Q8_0 embedding run packed in
    # the native decode step, their dense copies prefill.
    groups = {
        (g["type"], g["held"], g["runs"]) for g in httpx.get(server.url + "/v1/models").json()["data"][0]["weights"]
    }
    assert {("Q4_1", "mapped", "decode"), ("Q8_0", "mapped", "decode")} <= groups
    assert any(held == "dense" and runs == "prefill" for _, held, runs in groups)
    assert httpx.get(server.url + "/health").json() == {"status": "ok", "store": {"status": "ok"}}
    r = httpx.get(server.url + "/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = httpx.put(server.url + "/v1/chat/completions")
    assert r.status_code == 405 and "error" in r.json()


def test_chat_streamed_equals_non_streamed(server):
    client = _client(server)
    full = client.chat.completions.create(model=server.model, messages=QUESTION, temperature=0, max_tokens=24)
    choice = full.choices[0]
    assert full.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.message.content and choice.finish_reason in ("stop", "length")
    assert (
        full.usage.completion_tokens > 0
        and full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    )
    chunks = list(
        client.chat.completions.create(
            model=server.model,
            messages=QUESTION,
            temperature=0,
            max_tokens=24,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_completions_and_raw_sse(server):
    client = _client(server)
    done = client.completions.create(model=server.model, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert done.object == "text_completion" and done.choices[0].text
    with httpx.stream(
        "POST",
        server.url + "/v1/completions",
        json={"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0, "stream": True},
        timeout=60,
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    parts = [json.loads(e[6:]) for e in events[:-1]]
    assert "".join(p["choices"][0]["text"] for p in parts) == done.choices[0].text
    assert parts[-1]["choices"][0]["finish_reason"] == done.choices[0].finish_reason


PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def test_response_format_is_enforced_on_chat_and_completions(server):
    import jsonschema

    client = _client(server)
    ask = [{"role": "user", "content": "Describe a person named Ann, aged 31, as JSON."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    for temperature in (0, 1):
        reply = client.chat.completions.create(
            model=server.model, messages=ask, temperature=temperature, seed=7, max_tokens=64, response_format=fmt
        )
        assert reply.choices[0].finish_reason == "stop", reply
        jsonschema.validate(json.loads(reply.choices[0].message.content), PERSON)
    chunks = list(
        client.chat.completions.create(
            model=server.model,
            messages=[{"role": "user", "content": "Reply with a JSON object whose key colour names a colour."}],
            temperature=0,
            max_tokens=200,
            stream=True,
            response_format={"type": "json_object"},
        )
    )
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert isinstance(json.loads("".join(c.choices[0].delta.content or "" for c in chunks if c.choices)), dict)
    done = client.completions.create(
        model=server.model,
        prompt="Ann is 31. As JSON:",
        max_tokens=64,
        temperature=0,
        extra_body={"response_format": fmt},
    )
    jsonschema.validate(json.loads(done.choices[0].text), PERSON)
    # A schema the grammar compiler refuses is a 400 naming the problem, before any work.
    with pytest.raises(openai.BadRequestError, match="json_schema"):
        client.chat.completions.create(
            model=server.model,
            messages=ask,
            max_tokens=8,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
        )


def test_logprobs_in_openais_shapes_streamed_and_not(server):
    client = _client(server)
    kw = {"model": server.model, "messages": QUESTION, "temperature": 0, "max_tokens": 12}
    # Each with its own cache_salt: both prefill the whole prompt (a prefix-cache hit recomputes only
    # the last row, which on the quantized path rounds a little differently).
    full = client.chat.completions.create(**kw, logprobs=True, top_logprobs=3, extra_body={"cache_salt": "lp-1"})
    content = full.choices[0].logprobs.content
    assert len(content) == full.usage.completion_tokens
    text = full.choices[0].message.content
    assert b"".join(bytes(e.bytes) for e in content).decode().startswith(text)
    for e in content:
        assert len(e.top_logprobs) == 3 and e.top_logprobs[0].logprob == e.logprob <= 0  # greedy
        assert [t.logprob for t in e.top_logprobs] == sorted((t.logprob for t in e.top_logprobs), reverse=True)
    chunks = list(
        client.chat.completions.create(
            **kw, logprobs=True, top_logprobs=3, stream=True, extra_body={"cache_salt": "lp-2"}
        )
    )
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    plain = client.chat.completions.create(**kw)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == text
    done = client.completions.create(
        model=server.model, prompt="The capital of France is", max_tokens=6, temperature=0, logprobs=2
    )
    lp = done.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == done.usage.completion_tokens
    assert "".join(lp.tokens).startswith(done.choices[0].text) and lp.text_offset[0] == 0
    assert all(len(top) == 2 and max(top.values()) == p for top, p in zip(lp.top_logprobs, lp.token_logprobs))


def test_n_choices_are_forks_of_one_prefill_streamed_with_their_index(server):
    client = _client(server)
    kw = {"model": server.model, "temperature": 1.0, "seed": 5, "max_tokens": 16, "n": 3}
    ask = [{"role": "user", "content": "Write a line about the sea."}]
    full = client.chat.completions.create(messages=ask, extra_body={"cache_salt": "n-1", "session_id": "n-sess"}, **kw)
    assert [c.index for c in full.choices] == [0, 1, 2]
    texts = [c.message.content for c in full.choices]
    assert len(set(texts)) == 3  # each choice samples with its own seed
    one = client.chat.completions.create(messages=ask, **{**kw, "n": 1})
    assert full.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counted once
    assert full.usage.completion_tokens > one.usage.completion_tokens  # the choices' tokens summed
    chunks = list(client.chat.completions.create(messages=ask, stream=True, extra_body={"cache_salt": "n-2"}, **kw))
    streamed: dict[int, str] = {}
    finished = {}
    for chunk in chunks:
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                finished[c.index] = c.finish_reason
    assert [streamed[i] for i in range(3)] == texts and sorted(finished) == [0, 1, 2]
    # The named session continues from choice 0: its next turn reuses the prompt and that reply.
    follow = ask + [{"role": "assistant", "content": texts[0]}, {"role": "user", "content": "Another."}]
    again = client.chat.completions.create(
        model=server.model, messages=follow, max_tokens=4, temperature=0, extra_body={"session_id": "n-sess"}
    )
    assert again.usage.prompt_tokens_details.cached_tokens >= full.usage.prompt_tokens + 1
    # More choices than free session slots: 429, and nothing is left behind.
    with pytest.raises(openai.RateLimitError):
        client.chat.completions.create(messages=ask, **{**kw, "n": 8})
    with pytest.raises(openai.BadRequestError, match="n must be"):
        client.chat.completions.create(messages=ask, **{**kw, "n": 9})
    assert client.chat.completions.create(messages=ask, **kw).choices[2].message.content


def test_bad_requests_get_openai_errors(server):
    client = _client(server)
    cases = [
        (dict(model=server.model, messages=QUESTION, temperature=-1), "invalid_value"),
        (dict(model=server.model, messages=QUESTION, n=9), "invalid_value"),
        (dict(model=server.model, messages=[]), "invalid_value"),
        (dict(model=server.model, messages=[{"role": "tool", "content": "x"}]), "invalid_value"),  # no call id
        (dict(model=server.model, messages=[{"role": "function", "content": "x"}]), "unsupported"),
        (dict(model=server.model, messages=QUESTION, extra_body={"session_id": "../../etc"}), "invalid_session_id"),
        (dict(model=server.model, messages=[{"role": "user", "content": "hi " * 3000}]), "context_length_exceeded"),
    ]
    for kwargs, code in cases:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(**kwargs)
        assert info.value.status_code == 400 and info.value.code == code, (kwargs, info.value)
        assert info.value.message
    with pytest.raises(openai.NotFoundError) as missing:  # OpenAI's answer to a model it does not serve
        client.chat.completions.create(model="gpt-4", messages=QUESTION)
    assert missing.value.code == "model_not_found"
    r = httpx.post(
        server.url + "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = httpx.post(server.url + "/v1/chat/completions", content=b"x" * (4 * 1024 * 1024 + 1))
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    # The worker served all of that and still answers.
    assert client.chat.completions.create(model=server.model, messages=QUESTION, max_tokens=2).choices[0].message


def test_prompts_far_beyond_the_context_are_refused(server):
    # 3.5 MB (under the 4 MiB body limit) of text as a chat message, a completions prompt and a
    # tool's description: each refused as too long for the context (before it is rendered or
    # tokenized whole, prompt_bound.py), and the server serves on.
    text = "the keeper climbed the stairs " * 120_000
    tool = {"type": "function", "function": {"name": "f", "description": text, "parameters": {"type": "object"}}}
    bodies = [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}], "max_tokens": 2}),
        ("/v1/completions", {"prompt": text, "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": QUESTION, "tools": [tool], "max_tokens": 2}),
    ]
    for path, body in bodies:
        r = httpx.post(server.url + path, json={"model": server.model, **body}, timeout=120)
        assert r.status_code == 400, r.text[:300]
        error = r.json()["error"]
        assert error["code"] == "context_length_exceeded" and "at most 2048" in error["message"], error
    reply = _client(server).chat.completions.create(model=server.model, messages=QUESTION, max_tokens=2)
    assert reply.choices[0].finish_reason in ("length", "stop")


def test_session_reuses_its_history_and_is_saved(server):
    client = _client(server)
    headers = {"X-Session-Id": "conv-1"}
    messages = [{"role": "user", "content": "Write one sentence about the sea."}]
    first = client.chat.completions.create(
        model=server.model, messages=messages, temperature=0, max_tokens=40, extra_headers=headers
    )
    # At most the chat template's system prompt comes from the prefix cache (same tenant).
    assert first.usage.prompt_tokens_details.cached_tokens < first.usage.prompt_tokens - 8
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And one about the sky."},
    ]
    second = client.chat.completions.create(
        model=server.model, messages=messages, temperature=0, max_tokens=16, extra_body={"session_id": "conv-1"}
    )
    cached = second.usage.prompt_tokens_details.cached_tokens
    # Everything but the new turn's few tokens is the session's own history.
    assert cached >= first.usage.prompt_tokens + first.usage.completion_tokens - 2
    assert second.usage.prompt_tokens - cached < 20
    listed = httpx.get(server.url + "/v1/sessions").json()["data"]
    assert {"id": "conv-1", "state": "live"}.items() <= next(s for s in listed if s["id"] == "conv-1").items()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # the save after the turn runs in the background
        info = httpx.get(server.url + "/v1/sessions/conv-1").json()
        if info.get("saved_tokens", 0) >= second.usage.prompt_tokens:
            break
        time.sleep(0.1)
    assert info["saved_tokens"] >= second.usage.prompt_tokens, info
    saved = httpx.post(server.url + "/v1/sessions/conv-1/save").json()
    assert saved["saved_tokens"] >= second.usage.prompt_tokens
    assert httpx.delete(server.url + "/v1/sessions/conv-1").json()["deleted"] is True
    assert httpx.get(server.url + "/v1/sessions/conv-1").status_code == 404
    assert httpx.delete(server.url + "/v1/sessions/conv-1").status_code == 404


def test_sixteen_concurrent_streaming_clients(server):
    # More clients than worker slots (6): the generations beyond them wait in the queue, and
    # sessions beyond the slots are evicted to the store and resumed; none is refused or hung.
    client = _client(server)

    def run(i: int) -> tuple[str, str | None]:
        try:
            stream = client.chat.completions.create(
                model=server.model,
                messages=[{"role": "user", "content": f"Count from {i} to {i + 5}."}],
                temperature=0,
                max_tokens=12,
                stream=True,
                extra_headers={"X-Session-Id": f"many-{i}"},
            )
            return "".join(c.choices[0].delta.content or "" for c in stream if c.choices), None
        except openai.RateLimitError as exc:
            return "", str(exc)

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(run, range(16)))
    assert all(err is None and text for text, err in results), results
    # Every session can continue afterwards, one at a time (evicted ones come back from the store).
    for i in range(16):
        text, err = run(i)
        assert err is None and text


def test_disconnect_cancels_the_generation(server):
    before = _metric(server, "muxworker_client_disconnects_total")
    tokens_before = _metric(server, "muxworker_completion_tokens_total")
    with httpx.stream(
        "POST",
        server.url + "/v1/completions",
        json={"prompt": "Once upon a time", "max_tokens": 1500, "temperature": 1, "stream": True, "seed": 1},
        timeout=60,
    ) as r:
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
    # The connection is closed here, long before 1500 tokens.
    deadline = time.monotonic() + 30
    while _metric(server, "muxworker_client_disconnects_total") == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _metric(server, "muxworker_client_disconnects_total") == before + 1
    # The request is counted once the worker has settled its cancel (a step, or more on a busy machine).
    answered = 'muxworker_http_requests_total{endpoint="completions",status="499"}'
    while _metric(server, answered) == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _metric(server, "muxworker_completion_tokens_total") - tokens_before < 1000
    metrics = httpx.get(server.url + "/metrics").text
    for name in (
        "muxworker_time_to_first_token_seconds_bucket",
        "muxworker_inter_token_seconds_bucket",
        "muxworker_stream_overhead_seconds_bucket",
        'muxworker_sessions{state="live"}',
        "muxworker_cached_prompt_tokens_total",
        'muxworker_http_requests_total{endpoint="completions",status="499"}',  # the client went away
    ):
        assert name in metrics, name


def test_requests_beyond_the_slots_queue_then_get_429(tmp_path):
    args = ["--store", str(tmp_path / "store"), "--max-concurrent-requests", "1", "--max_sessions", "2"]
    args += ["--max-queued-requests", "2", "--queue-timeout", "60"]
    with ServerProcess(args, log_path=tmp_path / "serve.log") as server:
        client = _client(server)
        # It runs and holds the only slot until closed: past the end of turn, for longer than the
        # test takes at any decode speed (400 tokens took 2 s once decoding got faster).
        long = client.chat.completions.create(
            model=server.model,
            messages=QUESTION,
            max_tokens=1800,
            temperature=1,
            stream=True,
            seed=3,
            extra_body={"ignore_eos": True},
        )
        next(iter(long))

        def ask(_: int) -> int:
            try:
                client.chat.completions.create(model=server.model, messages=QUESTION, max_tokens=2)
                return 200
            except openai.RateLimitError as exc:
                assert exc.response.headers["retry-after"] == "1"
                return 429

        with ThreadPoolExecutor(3) as pool:
            waiting = [pool.submit(ask, i) for i in range(2)]
            deadline = time.monotonic() + 30  # both are in the queue before the third asks
            while _metric(server, "muxworker_http_requests_in_flight") < 1 and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.5)
            assert ask(2) == 429  # the queue holds two
            long.close()  # the slot comes free: the queued two run
            assert [w.result(timeout=60) for w in waiting] == [200, 200]
        # A burst of 12 on one slot and a queue of two: those beyond are refused at once, the rest answered.
        with ThreadPoolExecutor(12) as pool:
            codes = list(pool.map(ask, range(12)))
        assert codes.count(200) >= 3 and 429 in codes, codes  # the queue holds two; the rest are refused
        assert client.chat.completions.create(model=server.model, messages=QUESTION, max_tokens=2).choices


def test_api_keys_tenants_and_cache_salt(tmp_path):
    args = [
        "--store",
        str(tmp_path / "store"),
        "--api-key",
        "key-a",
        "--prefix_cache_entries",
        "4",
        "--max_sessions",
        "4",
    ]
    with ServerProcess(args, log_path=tmp_path / "serve.log", env={"MUXWORKER_API_KEY": "key-b"}) as server:
        assert httpx.get(server.url + "/health").status_code == 200  # no key needed
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "key-a"}):
            r = httpx.get(server.url + "/v1/models", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(server.url + "/metrics").status_code == 401
        # A tenant's key does not read server-wide figures (other tenants' traffic).
        assert httpx.get(server.url + "/metrics", headers={"Authorization": "Bearer key-a"}).status_code == 403
        with pytest.raises(openai.AuthenticationError):
            _client(server, "wrong").models.list()
        a, b = _client(server, "key-a"), _client(server, "key-b")
        # Tenants have their own session ids: b's "shared" is not a's.
        a.chat.completions.create(
            model=server.model, messages=QUESTION, max_tokens=4, extra_headers={"X-Session-Id": "shared"}
        )
        listed_b = b.get("/sessions", cast_to=httpx.Response).json()["data"]
        assert [s["id"] for s in a.get("/sessions", cast_to=httpx.Response).json()["data"]] == ["shared"]
        assert listed_b == []
        # The prefix cache: a stateless prompt of a's is reused by a, never by b, nor by a's other salt.
        prompt = "A long and private prompt about the secret plans of tenant A. " * 4
        kw = dict(model=server.model, prompt=prompt, max_tokens=2, temperature=0)
        assert a.completions.create(**kw).usage.prompt_tokens_details.cached_tokens == 0
        time.sleep(0.3)  # the stateless session's close (which makes the entry) runs after the reply
        assert a.completions.create(**kw).usage.prompt_tokens_details.cached_tokens > 0
        assert b.completions.create(**kw).usage.prompt_tokens_details.cached_tokens == 0
        salted = a.completions.create(**kw, extra_body={"cache_salt": "other"})
        assert salted.usage.prompt_tokens_details.cached_tokens == 0


def _worker_pid(server: ServerProcess) -> int:
    """The server's one child process (trio spawns it from a thread, so scan every process's parent)."""
    children = [pid for pid, stat in process_table().items() if stat.ppid == server.pid]
    assert children, "the server has no worker process"
    return children[0]


def test_restart_resumes_sessions_and_a_dead_worker_is_replaced(tmp_path):
    store = tmp_path / "store"
    # float32: the resumed continuation must equal the cold one token for token.
    args = ["--store", str(store), "--dtype", "float32", "--max_sessions", "4", "--max_session_tokens", "4096"]
    story = " ".join(f"Fact {i}: the number {i} squared is {i * i}." for i in range(60))
    messages = [{"role": "user", "content": f"Read these facts.\n{story}\nWhat is 7 squared?"}]
    with ServerProcess(args, log_path=tmp_path / "serve1.log") as server:
        client = _client(server)
        first = client.chat.completions.create(
            model=server.model, messages=messages, temperature=0, max_tokens=24, extra_headers={"X-Session-Id": "long"}
        )
        client.chat.completions.create(
            model=server.model, messages=QUESTION, max_tokens=4, extra_headers={"X-Session-Id": "broken"}
        )
    # Stopped with SIGTERM: the session was saved after its turn (and again at shutdown if needed).
    infos = SessionStore.inspect(store).list_info()
    assert [i.session_id for i in infos] == ["local/broken", "local/long"]
    assert infos[1].tokens >= first.usage.prompt_tokens
    # Damage one byte of "broken"'s payload: resuming it must fail clearly and change nothing.
    segment = SessionStore.inspect(store).files_of("local/broken")[-1]
    damaged = bytearray(segment.read_bytes())
    damaged[len(damaged) // 2] ^= 0xFF  # inside the KV payload
    segment.write_bytes(bytes(damaged))
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And what is 8 squared?"},
    ]
    with ServerProcess(args, log_path=tmp_path / "serve2.log") as server:
        client = _client(server)
        resumed = client.chat.completions.create(
            model=server.model, messages=messages, temperature=0, max_tokens=24, extra_headers={"X-Session-Id": "long"}
        )
        usage = resumed.usage
        with pytest.raises(openai.UnprocessableEntityError) as info:
            client.chat.completions.create(
                model=server.model, messages=QUESTION, max_tokens=4, extra_headers={"X-Session-Id": "broken"}
            )
        assert info.value.code == "session_unresumable" and "segment" in info.value.message
        assert segment.read_bytes() == bytes(damaged)  # left as it was, for the operator
        assert usage.prompt_tokens > 900
        assert usage.prompt_tokens_details.cached_tokens >= 0.9 * usage.prompt_tokens, usage
        cold = client.chat.completions.create(model=server.model, messages=messages, temperature=0, max_tokens=24)
        assert cold.usage.prompt_tokens_details.cached_tokens == 0
        assert resumed.choices[0].message.content == cold.choices[0].message.content

        # Kill the worker: requests get 503 until it is back, then the session resumes from the store.
        os.kill(_worker_pid(server), signal.SIGKILL)
        deadline = time.monotonic() + 120
        saw_503 = False
        while time.monotonic() < deadline:
            try:
                again = client.chat.completions.create(
                    model=server.model,
                    messages=messages,
                    max_tokens=4,
                    temperature=0,
                    extra_headers={"X-Session-Id": "long"},
                )
                break
            except openai.InternalServerError as exc:
                assert exc.status_code == 503 and exc.response.headers["retry-after"] == "1"
                saw_503 = True
                time.sleep(0.2)
        assert saw_503
        assert again.usage.prompt_tokens_details.cached_tokens >= 0.9 * again.usage.prompt_tokens
        assert httpx.get(server.url + "/health").json()["status"] == "ok"
        assert _metric(server, "muxworker_worker_restarts_total") == 1


def test_save_on_shutdown_only(tmp_path):
    store = tmp_path / "store"
    args = ["--store", str(store), "--save", "evict"]
    with ServerProcess(args, log_path=tmp_path / "serve.log") as server:
        client = _client(server)
        client.chat.completions.create(
            model=server.model, messages=QUESTION, max_tokens=4, extra_headers={"X-Session-Id": "s"}
        )
        time.sleep(0.3)
        assert SessionStore.inspect(store).list_info() == []  # not after the turn
        stopped = threading.Event()
        threading.Thread(target=lambda: (server.stop(), stopped.set()), daemon=True).start()
        assert stopped.wait(120) and server.process.returncode == 0
    assert [i.session_id for i in SessionStore.inspect(store).list_info()] == ["local/s"]


def test_what_agent_clients_send_to_a_model_with_defaults(tiny_llama_dir, tmp_path):
    """A model whose generation_config.json says temperature 0, served under two names: a client
    that sends no max_tokens (aider) gets a reply cut to the room its prompt leaves, not a context
    error; an unknown field is accepted; the unversioned routes, an alias and /models'
    max_model_len answer as llama.cpp's and vLLM's do; each request leaves an access log line."""
    model = shutil.copytree(tiny_llama_dir, tmp_path / "model")
    config = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**config, "temperature": 0.0}))
    args = ["--model", str(model), "--store", str(tmp_path / "store"), "--served-model-name", "tiny", "agent-model"]
    args += ["--max_session_tokens", "64", "--dtype", "float32"]
    with ServerProcess(args, log_path=tmp_path / "serve.log") as server:
        assert server.model == "tiny"
        models = httpx.get(server.url + "/models").json()["data"]
        assert [(m["id"], m["max_model_len"]) for m in models] == [("tiny", 64)]
        client = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=120)  # no /v1
        kw = {
            "model": "agent-model",
            "messages": [{"role": "user", "content": "hello"}],
            "extra_body": {"audio": None, "ignore_eos": True},
        }
        first = client.chat.completions.create(**kw)
        assert first.model == "agent-model" and first.choices[0].finish_reason == "length"
        assert first.usage.prompt_tokens + first.usage.completion_tokens == 64
        again = client.chat.completions.create(**kw)
        assert again.choices[0].message.content == first.choices[0].message.content  # the model's temperature 0
        with pytest.raises(openai.BadRequestError) as info:  # a max_tokens the request sets is its own
            client.chat.completions.create(**kw, max_tokens=100)
        assert info.value.code == "context_length_exceeded"
    log = (tmp_path / "serve.log").read_text()
    assert "temperature 0.0 (generation_config.json)" in log
    assert log.count("muxworker.serve.access: POST /chat/completions 200 prompt=") == 2
    assert "muxworker.serve.access: POST /chat/completions 400 " in log
