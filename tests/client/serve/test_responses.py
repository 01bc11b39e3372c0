"""The response shapes (client/serve/responses.py) parse as the official SDK's types: bodies with
one or several choices (tool calls among them), usage counted once per prompt, and the chunks of a
streamed reply, another choice's with its index."""

from __future__ import annotations

import json

from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from muxworker.client.params import GenerationResult
from muxworker.serve import openai_api as oa
from muxworker.serve import responses as rs
from muxworker.serve.tools import CallDelta, ToolCall

MODEL = "m"

RESULT = GenerationResult("stop", 5, 3, 2, 4, [1, 2, 3, 4], 0.1, 0.2, committed_tokens=4)


def test_responses_parse_as_the_sdk_types():
    body = rs.completion_body(True, "chatcmpl-1", MODEL, [rs.Choice(0, "hello", RESULT)], "s", None)
    parsed = ChatCompletion.model_validate(body)
    assert parsed.choices[0].message.content == "hello" and parsed.usage.prompt_tokens_details.cached_tokens == 3
    assert parsed.usage.total_tokens == 9
    completion = Completion.model_validate(
        rs.completion_body(False, "cmpl-1", MODEL, [rs.Choice(0, "x", RESULT)], None, None)
    )
    assert completion.choices[0].text == "x" and completion.choices[0].finish_reason == "stop"
    # Two choices, one a tool call: the prompt counted once, the completions summed.
    call = ToolCall("call_1", "f", '{"a": 1}')
    body = rs.completion_body(
        True, "c", MODEL, [rs.Choice(0, "hi", RESULT), rs.Choice(1, "", RESULT, [call])], None, None, 2
    )
    parsed = ChatCompletion.model_validate(body)
    assert [c.index for c in parsed.choices] == [0, 1] and parsed.choices[1].message.content is None
    assert parsed.choices[1].finish_reason == "tool_calls" and parsed.choices[1].message.tool_calls[0].id == "call_1"
    assert (parsed.usage.prompt_tokens, parsed.usage.completion_tokens) == (5, 8)
    assert parsed.usage.prompt_tokens_details.cached_tokens == 2


def test_stream_chunks_parse_as_the_sdk_types():
    writer = rs.ChunkWriter("chatcmpl-1", MODEL, chat=True)
    events = [writer.role(), writer.delta('a "quoted"\n\u00e9'), writer.finish(RESULT), writer.usage([RESULT])]
    chunks = []
    for event in events:
        assert event.startswith(b"data: ") and event.endswith(b"\n\n")
        chunks.append(ChatCompletionChunk.model_validate(json.loads(event[6:])))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[1].choices[0].delta.content == 'a "quoted"\n\u00e9'
    assert chunks[2].choices[0].finish_reason == "stop" and chunks[3].usage.completion_tokens == 4
    text = rs.ChunkWriter("cmpl-1", MODEL, chat=False)
    # As OpenAI streams completions: finish_reason null until the last chunk (the SDK's Completion
    # type only admits the final values, so the SDK reads stream chunks without validating them).
    assert json.loads(text.delta("t")[6:])["choices"][0] == {
        "index": 0,
        "text": "t",
        "logprobs": None,
        "finish_reason": None,
    }
    assert Completion.model_validate(json.loads(text.finish(RESULT)[6:])).choices[0].finish_reason == "stop"
    assert json.loads(rs.ChunkWriter.error(oa.bad_request("no"))[6:])["error"]["message"] == "no"
    # Another choice's chunks carry its index; a tool call comes as its head, then its arguments.
    other = ChatCompletionChunk.model_validate(json.loads(writer.delta("b", (), 2)[6:]))
    assert other.choices[0].index == 2 and other.choices[0].delta.content == "b"
    deltas = [CallDelta(0, "call_9", "f", ""), CallDelta(0, None, None, '{"x": '), CallDelta(0, None, None, "1}")]
    head, args, more = writer.call_deltas(deltas, 1).split(b"\n\n")[:3]
    head_chunk = ChatCompletionChunk.model_validate(json.loads(head[6:]))
    assert head_chunk.choices[0].index == 1 and head_chunk.choices[0].delta.tool_calls[0].function.name == "f"
    assert json.loads(args[6:])["choices"][0]["delta"]["tool_calls"][0]["function"]["arguments"] == '{"x": '
    assert json.loads(more[6:])["choices"][0]["delta"]["tool_calls"][0] == {"index": 0, "function": {"arguments": "1}"}}
