"""OpenAI's wire format without a server: request parsing, error mapping and the SSE chunks, checked
against the official ``openai`` package's own models where it has one (its pydantic types parse
what the server sends, as its client does)."""

from __future__ import annotations

import errno
import json

import pytest

from muxworker.client import (
    CapacityExhausted,
    CheckpointCorrupt,
    CheckpointRejected,
    CheckpointWriteError,
    ClientClosedError,
    ContextOverflow,
    EvictionFailed,
    InvalidArgument,
    NotReady,
    StoreUnavailable,
    Unsaveable,
    WorkerDiedError,
)
from muxworker.serve import openai_api as oa
from muxworker.serve.defaults import GenerationDefaults
from muxworker.serve.tenants import TenantQuotaExceeded
from muxworker.transport.checkpoint.errors import CheckpointMalformed, os_failure
from muxworker.transport.errors import ERRORS

MODEL = "m"
MESSAGES = [{"role": "user", "content": "hi"}]


def chat(**fields):
    return oa.parse_chat_request({"model": MODEL, "messages": MESSAGES, **fields}, MODEL)


def code_of(body: dict, parse=oa.parse_chat_request) -> str | None:
    with pytest.raises(oa.APIError) as info:
        parse(body, MODEL)
    assert info.value.status == 400 and info.value.message
    return info.value.code


def test_defaults_follow_openai():
    r = chat()
    assert not r.stream and not r.include_usage and r.session_id is None and r.cache_salt is None
    # OpenAI's defaults: temperature 1, top_p 1, no length limit but the context.
    p = r.params.fields
    assert p["temperature"] == 1.0 and p["top_p"] == 1.0 and p["max_new_tokens"] == -1
    assert r.messages == [{"role": "user", "content": "hi"}]
    assert "stop_token_ids" not in p  # the worker's default: the model's end-of-turn tokens
    assert chat(ignore_eos=True).params.fields["stop_token_ids"] == []


def test_fields_map_to_generation_params():
    r = chat(
        temperature=0,
        top_p=0.5,
        max_tokens=7,
        max_completion_tokens=9,
        stop="\n",
        seed=3,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        stream=True,
        stream_options={"include_usage": True},
        session_id="s-1",
        cache_salt="salt",
        user="ignored",
        prompt_cache_key="ignored too",
    )
    p = r.params.fields
    assert (p["temperature"], p["top_p"], p["max_new_tokens"], list(p["stop"]), p["seed"]) == (0.0, 0.5, 9, ["\n"], 3)
    assert (p["presence_penalty"], p["frequency_penalty"]) == (0.5, -0.5)
    assert r.stream and r.include_usage and r.session_id == "s-1" and r.cache_salt == "salt"


def test_content_parts_developer_role_and_null_assistant_content():
    r = oa.parse_chat_request(
        {
            "messages": [
                {"role": "developer", "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]},
                {"role": "assistant", "content": None},
            ]
        },
        MODEL,
    )
    assert r.messages == [{"role": "system", "content": "be brief"}, {"role": "assistant", "content": ""}]


@pytest.mark.parametrize(
    "fields, code",
    [
        ({"temperature": "hot"}, "invalid_value"),
        ({"temperature": -0.1}, "invalid_value"),
        ({"top_p": 0}, "invalid_value"),
        ({"presence_penalty": 3}, "invalid_value"),
        ({"max_tokens": 0}, "invalid_value"),
        ({"max_tokens": True}, "invalid_value"),
        ({"n": 0}, "invalid_value"),
        ({"n": 9}, "invalid_value"),
        ({"logprobs": 1}, "invalid_value"),  # chat's is a boolean
        ({"logprobs": True, "top_logprobs": 21}, "invalid_value"),
        ({"top_logprobs": 2}, "invalid_value"),  # without logprobs
        ({"tools": [{"type": "function"}]}, "invalid_value"),  # no function
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "invalid_value"),
        ({"tool_choice": "required"}, "invalid_value"),  # without tools
        ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "sometimes"}, "invalid_value"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": {"type": "function", "function": {"name": "g"}},
            },
            "invalid_value",
        ),
        ({"response_format": {"type": "yaml"}}, "invalid_value"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "invalid_value"),  # no name
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": []}}}, "invalid_value"),
        ({"response_format": {"type": "json_object", "schema": {}}}, "invalid_value"),
        ({"stop": ["a", 1]}, "invalid_value"),
        ({"stop": [""]}, "invalid_value"),
        ({"seed": -1}, "invalid_value"),
        ({"stream": "yes"}, "invalid_value"),
        ({"ignore_eos": 1}, "invalid_value"),
        ({"stream_options": {"include_usage": True}}, "invalid_value"),  # without stream
        ({"session_id": "a/b"}, "invalid_session_id"),
        ({"session_id": "x" * 129}, "invalid_session_id"),
        ({"cache_salt": ""}, "invalid_value"),
        ({"messages": "hi"}, "invalid_value"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "invalid_value"),  # no tool_call_id
        (
            {"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]}]},
            "invalid_value",
        ),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "unsupported"),
        ({"messages": [{"role": "user", "content": 5}]}, "invalid_value"),
        ({"messages": [{"role": ["user"], "content": "x"}]}, "invalid_value"),
        ({"temperature": 10**400}, "invalid_value"),
        ({"functions": [{"name": "f"}]}, "unsupported"),
        ({"modalities": ["audio"]}, "unsupported"),
    ],
)
def test_bad_chat_requests_are_400_naming_the_problem(fields, code):
    assert code_of({"model": MODEL, "messages": MESSAGES, **fields}) == code


def test_unknown_fields_are_ignored_and_named():
    """As vLLM does: a field a newer SDK sends (``audio: null``) breaks no client; the parsed
    request names it, for the server's debug log and metric."""
    r = chat(audio=None, frobnicate={"x": 1}, user="u", temperature=0.5)
    assert r.ignored == ("audio", "frobnicate")  # user is a known field that changes nothing
    assert r.params.fields == chat(temperature=0.5).params.fields
    assert chat().ignored == ()
    c = oa.parse_completion_request({"prompt": "hi", "audio": None}, MODEL)
    assert c.ignored == ("audio",)


@pytest.mark.parametrize(
    "body, message",
    [
        ({"logit_bias": {"50256": -100}}, "logit_bias is not supported by this server; leave it out or send {}"),
        (
            {"functions": [{"name": "f"}]},
            "functions is not supported by this server (use tools); leave it out or send []",
        ),
        (
            {"function_call": {"name": "f"}},
            'function_call is not supported by this server (use tool_choice); leave it out or send "none" or "auto"',
        ),
        (
            {"modalities": ["text", "audio"]},
            'modalities is not supported by this server; leave it out or send ["text"]',
        ),
    ],
)
def test_unsupported_fields_say_what_to_do(body, message):
    with pytest.raises(oa.APIError) as info:
        chat(**body)
    err = info.value
    assert (err.status, err.code, err.param, err.message) == (400, "unsupported", next(iter(body)), message)


@pytest.mark.parametrize(
    "body, message",
    [
        ({"echo": True}, "echo is not supported by this server; leave it out or send false"),
        ({"suffix": "}"}, "suffix is not supported by this server; leave it out"),
        ({"best_of": 3}, "best_of is not supported by this server; leave it out or send 1"),
    ],
)
def test_unsupported_completion_fields_say_what_to_do(body, message):
    with pytest.raises(oa.APIError) as info:
        oa.parse_completion_request({"prompt": "hi", **body}, MODEL)
    assert (info.value.code, info.value.message) == ("unsupported", message)
    assert oa.parse_completion_request({"prompt": "hi", "echo": False, "best_of": 1, "suffix": None}, MODEL)


def test_values_are_quoted_as_json_and_cut_with_an_ellipsis():
    with pytest.raises(oa.APIError) as info:
        chat(temperature="hot")
    assert info.value.message == 'temperature must be a finite number, got "hot"'
    with pytest.raises(oa.APIError) as info:
        chat(stream=None, ignore_eos="x" * 500)
    assert info.value.message.endswith('got "' + "x" * 76 + "...")


def test_a_model_not_served_is_404_and_aliases_are_served():
    served = oa.ServedModel(("qwen", "gpt-4o-mini", "default"))
    for name in served.names:
        r = oa.parse_chat_request({"model": name, "messages": MESSAGES}, served)
        assert r.model == name  # echoed as the request named it
    assert oa.parse_chat_request({"messages": MESSAGES}, served).model == "qwen"  # none given: the id
    for parse, body in [
        (oa.parse_chat_request, {"messages": MESSAGES}),
        (oa.parse_completion_request, {"prompt": "x"}),
    ]:
        with pytest.raises(oa.APIError) as info:
            parse({**body, "model": "gpt-5"}, served)
        err = info.value
        assert (err.status, err.code, err.param, err.type) == (404, "model_not_found", "model", "invalid_request_error")
        assert (
            err.message
            == 'the model "gpt-5" does not exist here; this server serves "qwen" (also named "gpt-4o-mini", "default")'
        )
    with pytest.raises(ValueError):
        oa.ServedModel(())


def test_defaults_fill_what_a_request_leaves_out():
    """The model's and the flags' defaults (client/serve/defaults.py) apply to the fields a
    request leaves out; a field the request gives (null included as absent, as OpenAI reads it) wins."""
    served = oa.ServedModel(("m",), GenerationDefaults(max_tokens=512, temperature=0.6, top_k=20, min_p=0.05))
    r = oa.parse_chat_request({"messages": MESSAGES}, served)
    p = r.params.fields
    assert (p["max_new_tokens"], p["temperature"], p["top_k"], p["min_p"], p["top_p"]) == (512, 0.6, 20, 0.05, 1.0)
    assert r.default_max_tokens  # the server cuts it to the room the prompt leaves
    r = oa.parse_chat_request(
        {"messages": MESSAGES, "max_completion_tokens": 7, "temperature": 0, "top_k": None, "min_p": 0}, served
    )
    p = r.params.fields
    assert (p["max_new_tokens"], p["temperature"], p["top_k"], p["min_p"]) == (7, 0.0, 20, 0.0)
    assert not r.default_max_tokens
    c = oa.parse_completion_request({"prompt": "x"}, served)
    assert c.params.fields["max_new_tokens"] == 512 and c.default_max_tokens
    # Nobody said: OpenAI's temperature 1 and no limit but the context.
    r = oa.parse_chat_request({"messages": MESSAGES}, oa.ServedModel(("m",)))
    assert (r.params.fields["temperature"], r.params.fields["max_new_tokens"], r.default_max_tokens) == (1.0, -1, False)


def test_completion_prompts():
    assert oa.parse_completion_request({"prompt": "hi"}, MODEL).prompt == "hi"
    assert oa.parse_completion_request({"prompt": ["hi"]}, MODEL).prompt == "hi"
    assert oa.parse_completion_request({"prompt": [1, 2, 3]}, MODEL).prompt == [1, 2, 3]
    assert oa.parse_completion_request({"prompt": [[1, 2]]}, MODEL).prompt == [1, 2]
    for body in ({"prompt": ""}, {"prompt": ["a", "b"]}, {"prompt": [True]}, {}, {"prompt": "a", "echo": True}):
        assert code_of(body, oa.parse_completion_request) in ("invalid_value", "unsupported")


def test_parse_json():
    assert oa.parse_json(b'{"a": 1}') == {"a": 1}
    for raw in (b"{", b"[1]", b"\xff", b"[" * 100_000, b"1" * 5000):
        with pytest.raises(oa.APIError) as info:
            oa.parse_json(raw)
        assert info.value.code == "invalid_json"


@pytest.mark.parametrize(
    "exc, status, code",
    [
        (ContextOverflow("too long"), 400, "context_length_exceeded"),
        (InvalidArgument("bad"), 400, "invalid_value"),
        (CapacityExhausted("full"), 429, "capacity"),
        (CheckpointCorrupt("crc"), 422, "session_unresumable"),  # not 409, which the SDKs retry
        (Unsaveable("empty"), 409, "unsaveable"),
        (WorkerDiedError("gone"), 503, "worker_unavailable"),
        (RuntimeError("boom"), 500, "internal_error"),
    ],
)
def test_error_mapping(exc, status, code):
    err = oa.error_from_mux(exc)
    assert (err.status, err.code) == (status, code)
    assert set(err.body()["error"]) == {"message", "type", "param", "code"}
    if status in (429, 503):
        assert err.headers["Retry-After"] == str(oa.RETRY_AFTER_S)
    assert "boom" not in err.message  # an internal error does not leak its text


@pytest.mark.parametrize("row", ERRORS, ids=lambda row: row.code)
def test_every_error_code_answers_with_its_rows_status_type_and_code(row):
    err = oa.error_from_mux(row.cls("what happened"))
    assert (err.status, err.type, err.code) == (row.status, row.type, row.http_code)
    assert "what happened" in err.message
    assert err.body()["error"]["code"] == row.http_code


def test_the_servers_words_and_headers_per_code():
    store = oa.error_from_mux(StoreUnavailable("timed out"))
    assert store.headers == {"Retry-After": str(oa.STORE_RETRY_AFTER_S)} and "DELETE" not in store.message
    assert "The session is kept" in store.message
    damaged = oa.error_from_mux(CheckpointRejected("crc"))
    assert damaged.code == "session_unresumable" and "DELETE /v1/sessions/{id}" in damaged.message
    assert not damaged.headers
    for exc in (NotReady("starting"), WorkerDiedError("gone"), ClientClosedError("closed"), CapacityExhausted("x")):
        assert oa.error_from_mux(exc).headers == {"Retry-After": str(oa.RETRY_AFTER_S)}
    assert oa.error_from_mux(CapacityExhausted("full")).message == "the server is at capacity: full"
    assert oa.error_from_mux(ContextOverflow("long")).param == "messages"
    # A subclass without a code of its own answers as its ancestor.
    assert oa.error_from_mux(EvictionFailed("no slot")).code == "capacity"
    assert oa.error_from_mux(CheckpointMalformed("bad")).code == "session_unresumable"


def test_a_disk_full_save_is_not_called_a_damaged_session():
    """The system refused a write: the session's files are not known to be bad, so nothing invites
    deleting them, and the reason reaches the caller."""
    exc = os_failure(CheckpointWriteError, OSError(errno.ENOSPC, "No space left on device"), "cannot save 's'")
    err = oa.error_from_mux(exc)
    assert (err.status, err.code) == (503, "checkpoint_write_error")
    assert "disk full" in err.message and "DELETE" not in err.message


def test_the_servers_own_limits_stay_its_own():
    sessions = oa.error_from_mux(TenantQuotaExceeded("too many", "sessions"))
    assert (sessions.status, sessions.type, sessions.code) == (429, "rate_limit_error", "tenant_session_limit")
    storage = oa.error_from_mux(TenantQuotaExceeded("too big", "bytes"))
    assert (storage.status, storage.type, storage.code) == (507, "insufficient_storage", "tenant_storage_limit")


def test_response_format_with_tools_holds_the_content_not_the_calls():
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"type": "function", "function": {"name": "f"}}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}},
    }
    parsed = oa.parse_chat_request(body, MODEL)
    assert parsed.tools is not None and parsed.tools.content_schema == {"type": "object"}
    assert "constraint" not in parsed.params.fields  # the tool format's grammar takes it in


SURROGATE = "\\ud800"  # as JSON writes it: json.loads makes it a lone surrogate


@pytest.mark.parametrize(
    "raw, param",
    [
        ('{"model": "m%s", "messages": []}', "model"),
        ('{"session_id": "a%s"}', "session_id"),
        ('{"prompt_cache_key": "a%s"}', "prompt_cache_key"),
        ('{"cache_salt": "%s"}', "cache_salt"),
        ('{"messages": [{"role": "user"}, {"role": "u%s", "content": "x"}]}', "messages[1].role"),
        ('{"messages": [{"role": "user", "content": "x%s"}]}', "messages[0].content"),
        (
            '{"messages": [{"role": "user", "content": [{"type": "text", "text": "%s"}]}]}',
            "messages[0].content[0].text",
        ),
        ('{"response_format": {"type": "t%s"}}', "response_format.type"),
        ('{"input": "hi", "model": "%s"}', "model"),  # a Responses body: the same one pass
        ('{"prompt": "a%s"}', "prompt"),
        (
            '{"tools": [{"type": "function", "function": {"name": "f", "description": "%s"}}]}',
            "tools[0].function.description",
        ),
        ('{"metadata": {"a b": "%s"}}', 'metadata["a b"]'),
        ('{"stop": ["ok", "%sx"]}', "stop[1]"),
    ],
)
def test_every_string_of_a_body_is_checked_for_lone_surrogates(raw, param):
    with pytest.raises(oa.APIError) as info:
        oa.parse_json((raw % SURROGATE).encode())
    assert (info.value.status, info.value.param) == (400, param)
    assert "unpaired surrogate" in info.value.message
    info.value.body()["error"]["message"].encode("utf-8")  # the answer itself can be written


def test_a_lone_surrogate_in_a_key_and_a_valid_pair_are_told_apart():
    with pytest.raises(oa.APIError) as info:
        oa.parse_json(b'{"metadata": {"\\udc00": 1}}')
    assert info.value.param == 'metadata["\\udc00"]'
    assert oa.parse_json(b'{"messages": [{"content": "\\ud83d\\ude00"}]}')["messages"][0]["content"] == "\U0001f600"


@pytest.mark.parametrize("name", ["session_id", "prompt_cache_key", "cache_salt", "previous_response_id"])
def test_nul_is_refused_where_an_id_is_built(name):
    with pytest.raises(oa.APIError) as info:
        oa.parse_json(b'{"%s": "a\\u0000b"}' % name.encode())
    assert (info.value.status, info.value.param) == (400, name)
    assert oa.parse_json(b'{"messages": [{"content": "a\\u0000b"}]}')  # NUL in text is text


def test_nesting_is_bounded_and_named():
    deep = "[" * (oa.MAX_JSON_DEPTH + 1) + "]" * (oa.MAX_JSON_DEPTH + 1)
    with pytest.raises(oa.APIError) as info:
        oa.parse_json(f'{{"metadata": {deep}}}'.encode())
    assert info.value.status == 400 and info.value.param.startswith("metadata[0][0]")
    fits = "[" * (oa.MAX_JSON_DEPTH - 2) + "]" * (oa.MAX_JSON_DEPTH - 2)
    assert oa.parse_json(f'{{"metadata": {fits}}}'.encode())


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"max_tokens": 10**30}, "max_tokens"),
        ({"max_tokens": 1e30}, "max_tokens"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": 2**31}, "max_tokens"),
        ({"max_completion_tokens": 2**31}, "max_completion_tokens"),
        ({"max_tokens": 1.0}, "max_tokens"),
        ({"seed": 2**63}, "seed"),
        ({"seed": 2**70}, "seed"),
        ({"seed": -1}, "seed"),
        ({"top_k": 2**31}, "top_k"),
        ({"top_k": 1.5}, "top_k"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": 10**400}, "temperature"),
        ({"temperature": True}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"repetition_penalty": 1e300}, "repetition_penalty"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -1e308}, "frequency_penalty"),
        ({"n": 2.0}, "n"),
        ({"n": 10**30}, "n"),
        ({"logprobs": True, "top_logprobs": 10**30}, "top_logprobs"),
        ({"stop": "x" * 1025}, "stop"),
    ],
)
def test_numbers_out_of_range_are_400_naming_the_field(fields, param):
    with pytest.raises(oa.APIError) as info:
        chat(**fields)
    assert (info.value.status, info.value.param) == (400, param), info.value.message


def test_completion_token_ids_and_logprobs_out_of_range():
    for body, param in (
        ({"prompt": [1, 2**31]}, "prompt"),
        ({"prompt": [-1]}, "prompt"),
        ({"prompt": "a", "logprobs": 10**30}, "logprobs"),
    ):
        with pytest.raises(oa.APIError) as info:
            oa.parse_completion_request(body, MODEL)
        assert (info.value.status, info.value.param) == (400, param)


def test_non_finite_numbers_are_refused_anywhere_in_a_body():
    """JSON has no NaN or Infinity (Python reads them, and 1e400 as inf): echoed back, as a
    response echoes its metadata, they could not be written."""
    for raw, param in ((b'{"metadata": {"a": NaN}}', "metadata.a"), (b'{"max_tokens": 1e400}', "max_tokens")):
        with pytest.raises(oa.APIError) as info:
            oa.parse_json(raw)
        assert (info.value.status, info.value.param) == (400, param)


def test_tool_call_arguments_are_checked_as_templates_render_them_decoded():
    """A chat template renders an earlier call's arguments decoded (``tojson`` writes no escapes):
    a lone surrogate escaped inside the arguments string is as bad as one in the body."""

    def body(arguments: str) -> bytes:
        call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
        messages = [{"role": "user", "content": "w"}, {"role": "assistant", "content": None, "tool_calls": [call]}]
        return json.dumps({"messages": messages}).encode()

    with pytest.raises(oa.APIError) as info:
        oa.parse_chat_request(oa.parse_json(body('{"city": "\\ud800"}')), MODEL)
    assert (info.value.status, info.value.param) == (400, "messages[1].tool_calls[0].function.arguments.city")
    for fine in ('{"city": "\\ud83d\\ude00"}', "not JSON at all \\ud800", "[" * 5000):
        parsed = oa.parse_chat_request(oa.parse_json(body(fine)), MODEL)
        assert parsed.messages[1]["tool_calls"][0].arguments == fine
