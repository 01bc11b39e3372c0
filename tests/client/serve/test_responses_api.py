"""The Responses API: request parsing, response objects and stream events against the openai
SDK's own pydantic types (sans-I/O), then a real server with the SDK: create, stream,
previous_response_id, a function tool round trip, branches, and continuing after a restart (a
stored response, and a chat that named no session)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import httpx
import openai
import pydantic
import pytest
from openai.types.responses import Response, ResponseStreamEvent

from muxworker.client.serve import openai_api as oa
from muxworker.client.serve import responses_api as ra
from muxworker.client.serve.openai_api import ServedModel
from muxworker.client.serve.tools import CallDelta, ToolCall
from muxworker.client.stores.binding import session_hash

SERVED = ServedModel(("m",))
EVENTS = pydantic.TypeAdapter(ResponseStreamEvent)


def _result(finish="stop", prompt=10, reused=4, completion=3):
    return SimpleNamespace(
        finish_reason=finish,
        prompt_tokens=prompt,
        reused_prompt_tokens=reused,
        completion_tokens=completion,
        logprobs=None,
    )


def test_input_items_become_chat_messages_with_calls_joined_to_their_turn():
    body = {
        "model": "m",
        "instructions": "Be brief.",
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city":"Oslo"}'},
            {"type": "function_call_output", "call_id": "c1", "output": "rain"},
            {"type": "reasoning", "id": "rs_1", "summary": []},
        ],
        "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}],
        "text": {"format": {"type": "json_object"}},
        "max_output_tokens": 20,
        "reasoning": {"effort": "low"},
        "some_future_field": 1,
    }
    rq = ra.parse_responses_request(body, SERVED, None)
    roles = [m["role"] for m in rq.chat.messages]
    assert roles == ["system", "user", "assistant", "tool"]
    assert rq.chat.messages[2]["tool_calls"][0].name == "get_weather"
    assert rq.chat.messages[3]["tool_call_id"] == "c1"
    assert rq.chat.tools is not None and rq.chat.tools.content_schema == {"type": "object"}
    assert rq.chat.params.fields["max_new_tokens"] == 20
    assert rq.ignored == ["some_future_field"] and rq.store and rq.truncation == "disabled"
    assert [i["type"] for i in rq.input_items] == ["message", "message", "function_call", "function_call_output"]
    assert all(i["id"] for i in rq.input_items)


def test_a_continuation_renders_the_stored_conversation_first():
    first = ra.parse_responses_request({"model": "m", "input": "hi"}, SERVED, None)
    reply = ra.output_items("hello", [], _result())
    stored = json.loads(ra.record({"output": reply, "created_at": 0}, first, "t/~r-x"))
    rq = ra.parse_responses_request({"model": "m", "input": "more", "store": False}, SERVED, stored)
    assert [m["content"] for m in rq.chat.messages] == ["hi", "hello", "more"]
    assert [i["type"] for i in rq.input_items] == ["message"] and not rq.store


@pytest.mark.parametrize(
    "body, param, words",
    [
        ({"input": []}, "input", "non-empty"),
        ({"input": [{"type": "input_image"}]}, "input", "served here"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools", "only function tools"),
        ({"input": "x", "background": True}, "background", "leave it out"),
        ({"input": "x", "conversation": "conv_1"}, "conversation", "previous_response_id"),
        ({"input": "x", "truncation": "middle"}, "truncation", "disabled or auto"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens", "max_output_tokens must be at least 1"),
        ({"input": "x", "max_output_tokens": 2**31}, "max_output_tokens", "max_output_tokens must be at least 1"),
        ({"input": "x", "max_output_tokens": 1e30}, "max_output_tokens", "max_output_tokens must be an integer"),
        ({"input": "x", "top_logprobs": 10**30}, "top_logprobs", "top_logprobs"),
        ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format", "json_schema"),
    ],
)
def test_bad_requests_name_the_responses_field(body, param, words):
    with pytest.raises(oa.APIError) as info:
        ra.parse_responses_request({"model": "m", **body}, SERVED, None)
    assert info.value.status == 400 and info.value.param == param and words in info.value.message


def test_response_objects_and_events_are_the_sdks_shapes():
    rq = ra.parse_responses_request({"model": "m", "input": "x", "metadata": {"a": "b"}}, SERVED, None)
    out = ra.output_items("text", [ToolCall("call_1", "f", "{}")], _result())
    body = ra.response_object("resp_" + "0" * 32, rq, 0.0, output=out, result=_result())
    parsed = Response.model_validate(body)
    assert parsed.output_text == "text" and parsed.usage.input_tokens_details.cached_tokens == 4
    assert parsed.output[1].type == "function_call" and parsed.output[1].call_id == "call_1"

    writer = ra.EventWriter("resp_" + "1" * 32, rq, None)
    raw = writer.start() + writer.text("Hel") + writer.text("lo")
    raw += writer.calls(
        [CallDelta(0, "call_2", "f", ""), CallDelta(0, None, None, '{"a"'), CallDelta(0, None, None, ":1}")]
    )
    events, final = writer.finish(_result(finish="length"), [ToolCall("call_2", "f", '{"a":1}')])
    raw += events
    parsed_events = []
    for chunk in raw.decode().split("\n\n"):
        if chunk:
            kind, data = chunk.split("\n")
            event = EVENTS.validate_python(json.loads(data[len("data: ") :]))
            assert kind == f"event: {event.type}"
            parsed_events.append(event)
    kinds = [e.type for e in parsed_events]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [e.sequence_number for e in parsed_events] == list(range(len(kinds)))
    done = parsed_events[-1].response
    assert done.status == "incomplete" and done.incomplete_details.reason == "max_output_tokens"
    assert done.output_text == "Hello" and done.output[1].arguments == '{"a":1}'
    failed = writer.fail(oa.APIError(500, "boom", code="internal_error"))
    assert [
        EVENTS.validate_python(json.loads(c.split("\n")[1][6:])).type for c in failed.decode().split("\n\n") if c
    ] == [
        "error",
        "response.failed",
    ]


def test_input_item_pages():
    items = [{"id": f"i{n}"} for n in range(5)]
    page = ra.item_page(items, {"limit": "2"})
    assert [i["id"] for i in page["data"]] == ["i4", "i3"] and page["has_more"]
    page = ra.item_page(items, {"order": "asc", "after": "i2"})
    assert [i["id"] for i in page["data"]] == ["i3", "i4"] and not page["has_more"]
    with pytest.raises(oa.APIError):
        ra.item_page(items, {"limit": "500"})


FN = {"type": "function", "name": "spawn_agent", "parameters": {"type": "object", "properties": {}}}


def test_a_namespace_tool_serves_its_functions_and_its_calls_name_it():
    """Codex's default tools include a namespace of functions; its calls must name the namespace,
    or Codex answers "unsupported call"."""
    body = {
        "model": "m",
        "input": [
            {"role": "user", "content": "go"},
            {"type": "function_call", "call_id": "c0", "name": "spawn_agent", "arguments": "{}", "namespace": "agents"},
            {"type": "function_call_output", "call_id": "c0", "output": "ok"},
        ],
        "tools": [{"type": "namespace", "name": "agents", "description": "Sub-agents.", "tools": [FN]}],
        "stream": True,
    }
    rq = ra.parse_responses_request(body, SERVED, None)
    assert rq.chat.tools is not None and [t.name for t in rq.chat.tools.tools] == ["spawn_agent"]
    assert rq.namespaces == {"spawn_agent": "agents"} and rq.input_items[1]["namespace"] == "agents"
    result = SimpleNamespace(
        finish_reason="tool_calls", prompt_tokens=10, reused_prompt_tokens=0, completion_tokens=3, logprobs=None
    )
    call = ToolCall("call_1", "spawn_agent", "{}")
    out = ra.output_items("", [call], result)
    obj = ra.response_object("resp_1", rq, 0, output=out, result=result)
    assert Response.model_validate(obj).output[0].namespace == "agents"
    w = ra.EventWriter("resp_2", rq, None)
    raw = w.start() + w.calls([CallDelta(0, "call_1", "spawn_agent", "{}")])
    done, final = w.finish(result, [call])
    events = [
        EVENTS.validate_python(json.loads(line[6:]))
        for line in (raw + done).decode().splitlines()
        if line.startswith("data: ")
    ]
    items = [e.item for e in events if e.type in ("response.output_item.added", "response.output_item.done")]
    assert [i.namespace for i in items] == ["agents", "agents"]
    assert Response.model_validate(final).output[0].namespace == "agents"


def test_a_namespace_tool_with_a_custom_tool_is_refused():
    body = {
        "model": "m",
        "input": "x",
        "tools": [
            {"type": "namespace", "name": "n", "description": "d", "tools": [FN, {"type": "custom", "name": "p"}]}
        ],
    }
    with pytest.raises(oa.APIError, match=r"tools\[0\].tools\[1\] is of type 'custom'"):
        ra.parse_responses_request(body, SERVED, None)


ASK_COUNT = {"role": "user", "content": "Count to five."}
ASK_MORE = {"role": "user", "content": "Go on."}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


@pytest.mark.slow
def test_responses_with_the_sdk_continue_across_a_restart(tmp_path):
    from muxworker.client.serve.process import ServerProcess

    store = str(tmp_path / "store")

    def client(server):
        return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)

    with ServerProcess(["--store", store], log_path=tmp_path / "serve1.log") as server:
        c = client(server)
        # A function tool round trip: the call, then its output as the next input. An agent sends
        # its tools every turn (they render first, so the prefix stays put).
        asked = c.responses.create(
            model=server.model,
            input="What is the weather in Oslo? Use the tool.",
            tools=[WEATHER],
            tool_choice="required",
            parallel_tool_calls=False,  # one call, then the turn ends
            max_output_tokens=60,
            temperature=0,
        )
        assert asked.usage.input_tokens_details.cached_tokens == 0
        calls = [o for o in asked.output if o.type == "function_call"]
        assert calls and calls[0].name == "get_weather" and json.loads(calls[0].arguments)["city"]
        prompt_before = asked.usage.input_tokens
        answered = c.responses.create(
            model=server.model,
            input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "rain, 12 C"}],
            tools=[WEATHER],
            previous_response_id=asked.id,
            max_output_tokens=30,
            temperature=0,
        )
        assert answered.usage.input_tokens_details.cached_tokens >= prompt_before
        # Streamed with the SDK's helper: the documented events, then the same response stored.
        with c.responses.stream(
            model=server.model, input="Thanks!", tools=[WEATHER], previous_response_id=answered.id, max_output_tokens=16
        ) as stream:
            events = list(stream)
            kinds = [event.type for event in events]
            streamed = events[-1].response  # completed, or incomplete at max_output_tokens
        assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] in (
            "response.completed",
            "response.incomplete",
        )
        assert c.responses.retrieve(streamed.id).output_text == streamed.output_text
        items = c.responses.input_items.list(answered.id).data
        assert [i.type for i in items] == ["function_call_output"]
        # A branch: a second continuation of the same response; both stay continuable.
        branch = c.responses.create(
            model=server.model,
            input="Say no.",
            tools=[WEATHER],
            previous_response_id=answered.id,
            max_output_tokens=8,
            temperature=0,
        )
        assert branch.usage.input_tokens_details.cached_tokens >= answered.usage.input_tokens
        # A chat naming no session: the server keeps its history as an implicit session.
        chat = [{"role": "user", "content": "Count to five."}]
        said = c.chat.completions.create(model=server.model, messages=chat, max_tokens=12, temperature=0)
        chat += [{"role": "assistant", "content": said.choices[0].message.content}]
        # A named session (aider's, say), whose first turn after the restart diverges.
        named = [{"role": "system", "content": "You are a careful assistant. " * 12}, ASK_COUNT]
        aider = {"X-Session-Id": "aider"}
        first_named = c.chat.completions.create(
            model=server.model, messages=named, max_tokens=12, temperature=0, extra_headers=aider
        )
        named += [{"role": "assistant", "content": first_named.choices[0].message.content}, ASK_MORE]
        kinds = {s["kind"] for s in httpx.get(server.url + "/v1/sessions").json()["data"]}
        assert kinds == {"response", "implicit", "named"}
    with ServerProcess(["--store", store], log_path=tmp_path / "serve2.log") as server:
        c = client(server)
        after = c.responses.create(
            model=server.model,
            input="One more.",
            tools=[WEATHER],
            previous_response_id=streamed.id,
            max_output_tokens=8,
            temperature=0,
        )
        # Only the new input is prefilled: the conversation's KV came back from the store.
        assert after.usage.input_tokens_details.cached_tokens >= streamed.usage.input_tokens
        and_then = c.responses.create(
            model=server.model, input="And?", tools=[WEATHER], previous_response_id=branch.id, max_output_tokens=4
        )
        assert and_then.usage.input_tokens_details.cached_tokens >= branch.usage.input_tokens
        # aider's "summarize" under the same header, then back to the conversation: the history the
        # summary overwrote was kept as a branch (read back from the store), so it is reused.
        summary = [named[0], {"role": "user", "content": "Summarize our conversation."}]
        c.chat.completions.create(model=server.model, messages=summary, max_tokens=4, extra_headers=aider)
        back = c.chat.completions.create(model=server.model, messages=named, max_tokens=4, extra_headers=aider)
        assert back.usage.prompt_tokens_details.cached_tokens >= first_named.usage.prompt_tokens
        # The chat that named no session continues too: its implicit session was saved at shutdown.
        chat += [{"role": "user", "content": "Again."}]
        again = c.chat.completions.create(model=server.model, messages=chat, max_tokens=4, temperature=0)
        assert again.usage.prompt_tokens_details.cached_tokens >= said.usage.prompt_tokens
        # An input over the context: OpenAI's error, or with truncation "auto" the oldest items go.
        long = "The quick brown fox jumps over the lazy dog near the river bank. " * 150
        items = [{"role": "user", "content": long}, {"role": "assistant", "content": "Noted."}] * 2
        items.append({"role": "user", "content": "How many foxes?"})
        with pytest.raises(openai.BadRequestError) as info:
            c.responses.create(model=server.model, input=items, store=False, max_output_tokens=4)
        assert info.value.code == "context_length_exceeded"
        cut = c.responses.create(model=server.model, input=items, store=False, max_output_tokens=4, truncation="auto")
        assert cut.truncation == "auto" and 2000 < cut.usage.input_tokens < 4096 - 4
        assert c.responses.delete(asked.id) is None
        with pytest.raises(openai.NotFoundError):
            c.responses.retrieve(asked.id)
        with pytest.raises(openai.BadRequestError) as info:
            c.responses.create(model=server.model, input="x", previous_response_id=asked.id)
        assert info.value.code == "previous_response_not_found"
        # Deleting a response deletes its session once no other stored response needs it, by what
        # the store lists (these sessions were saved before the restart): one the chain still needs
        # stays and is reused; once all are deleted no response session, record or file is left.
        again_after = c.responses.create(
            model=server.model,
            input="Last.",
            tools=[WEATHER],
            previous_response_id=after.id,
            store=False,
            max_output_tokens=2,
        )
        assert again_after.usage.input_tokens_details.cached_tokens >= after.usage.input_tokens
        responses = _sessions(server, "response")
        assert responses
        for rid in (answered.id, streamed.id, branch.id, after.id, and_then.id):
            assert c.responses.delete(rid) is None
        assert _sessions(server, "response") == []
        for sid in responses:
            assert not (tmp_path / "store" / (session_hash("local/" + sid) + ".mxckpt")).exists()
        assert not list((tmp_path / "store").glob("*.mxrec"))
        # A tenant deletes its own implicit sessions by the ids GET /v1/sessions lists (live ones and
        # ones saved before the restart): gone from the list and from the store.
        implicit = _sessions(server, "implicit")
        assert implicit
        for sid in implicit:
            assert httpx.delete(f"{server.url}/v1/sessions/{sid}").status_code == 200
            assert not (tmp_path / "store" / (session_hash("local/" + sid) + ".mxckpt")).exists()
        assert _sessions(server, "implicit") == []
        assert httpx.delete(f"{server.url}/v1/sessions/{implicit[0]}").status_code == 404
        assert httpx.delete(f"{server.url}/v1/sessions/~i-{implicit[0][3:-1]}").status_code == 400


def _sessions(server, kind: str) -> list[str]:
    """The ids of the server's sessions of ``kind`` (``GET /v1/sessions``)."""
    listed = httpx.get(server.url + "/v1/sessions", timeout=30).json()["data"]
    return [s["id"] for s in listed if s["kind"] == kind]
