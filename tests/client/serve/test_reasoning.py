"""Models that think (client/serve/reasoning.py): the parser splits reasoning from the answer
wherever the tags fall in the stream, and only the answer reaches the tool-call parser; the
grammar of a tool call or ``response_format`` holds from the end of the reasoning (the worker's own
compiler); the app returns ``reasoning_content``, reasoning deltas, Responses reasoning items and
events (the openai SDK's types are the oracle), over a scripted service; then a real server with a
tiny random model whose Qwen3-like template opens ``<think>`` and drops past reasoning: the reply
is all reasoning, and the next turn reuses everything up to where the two renders part."""

from __future__ import annotations

import json
from types import SimpleNamespace

import httpx
import openai
import pydantic
import pytest
from helpers.serve_fakes import ScriptedService
from helpers.tiny_models import tiny_tokenizer
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response, ResponseStreamEvent

from muxworker.serve import openai_api as oa
from muxworker.serve import responses_api as ra
from muxworker.serve.app import AppConfig, create_app
from muxworker.serve.metrics import ServerMetrics
from muxworker.serve.openai_api import ServedModel
from muxworker.serve.reasoning import CLOSED, FREE, OPEN, Thinking
from muxworker.serve.tools import HERMES, OutputParser, Tool, ToolRequest

THINK_TAGS = ("<think>", "</think>")
# Stand-in token ids for the sans-I/O tests: the tags, a newline, anything else reads "x".
START_ID, END_ID, NL, EOS = 100, 101, 10, 2
_TEXT = {START_ID: "<think>", END_ID: "</think>", NL: "\n"}
TAGS = Thinking(START_ID, END_ID, lambda ids: "".join(_TEXT.get(i, "x") for i in ids), frozenset({EOS}))
WEATHER = Tool("get_weather", "The weather in a city", {"type": "object", "properties": {"city": {"type": "string"}}})
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
EVENTS = pydantic.TypeAdapter(ResponseStreamEvent)


def _split(parser: OutputParser, pieces: list[str]) -> tuple[str, str, list, list]:
    """Feed ``pieces`` as a stream's deltas: the reasoning and content given out, the calls and
    call deltas. No reasoning comes once content has (one delta may hold both)."""
    reasoning, content, deltas = "", "", []
    for piece in pieces:
        before = content
        content += parser.feed(piece)
        more = parser.pop_reasoning()
        assert not (more and before), (pieces, more, before)
        reasoning += more
        deltas += parser.pop_deltas()
    rest, calls = parser.finish()
    reasoning += parser.pop_reasoning()
    deltas += parser.pop_deltas()
    return reasoning, content + rest, calls, deltas


def test_the_close_tag_is_found_wherever_the_stream_cuts_it():
    reply = "Hmm, 2 < 3 </b>.\n</think>\n\nThe answer.\n"
    at = reply.index("</think>")
    for i in range(at, at + len("</think>") + 1):  # every boundary inside the tag...
        for j in range(i, len(reply) + 1):  # ... and a second cut anywhere after it
            parser = TAGS.parser(OPEN)
            out = _split(parser, [reply[:i], reply[i:j], reply[j:]])
            assert out[:2] == ("Hmm, 2 < 3 </b>.\n", "The answer.\n"), (i, j)
            assert parser.reasoning == "Hmm, 2 < 3 </b>.\n"
    parser = TAGS.parser(OPEN)
    assert _split(parser, list(reply))[:2] == ("Hmm, 2 < 3 </b>.\n", "The answer.\n")  # a character at a time


def test_a_block_the_model_opens_itself_and_a_reply_without_one():
    for pieces in (
        ["<think>", "plan</think>", "\n\nDone."],
        ["\n<thi", "nk>plan</th", "ink>Done."],
        ["<think>plan</think>Done."],
    ):
        parser = TAGS.parser(FREE)
        assert _split(parser, pieces)[:2] == ("plan", "Done."), pieces
        assert parser.reasoning_tokens([START_ID, 7, END_ID, NL, 8]) == 1
    parser = TAGS.parser(FREE)
    assert _split(parser, ["\n", "Hello <think>x</think>"])[:2] == ("", "\nHello <think>x</think>")
    assert parser.reasoning is None and parser.reasoning_tokens([7, START_ID, 8, END_ID]) == 0
    parser = TAGS.parser(FREE)  # a reply cut short inside what might have been the tag is content
    assert _split(parser, [" <th"])[:2] == ("", " <th") and parser.reasoning is None


def test_without_a_close_it_is_all_reasoning_and_a_closed_block_leaves_it_all_content():
    parser = TAGS.parser(OPEN)
    assert _split(parser, ["Still", " thinking </th"])[:2] == ("Still thinking </th", "")
    assert parser.reasoning_tokens([7, 8, 9, EOS]) == 3  # the stop token is no reasoning
    assert parser.reasoning_tokens([7, 8, END_ID, NL, 9, EOS]) == 2
    parser = TAGS.parser(OPEN)
    assert _split(parser, [])[:2] == ("", "") and parser.reasoning == ""  # opened, even if empty
    parser = TAGS.parser(CLOSED)
    assert _split(parser, ["\nAnswer <think>"])[:2] == ("", "\nAnswer <think>") and parser.reasoning is None
    assert parser.reasoning_tokens([7]) == 0 and OutputParser().reasoning_tokens([7]) is None


def test_tool_calls_are_read_from_the_answer_only():
    text = "Should I write <tool_call>? Yes.\n</think>\n\n" + CALL
    base = TAGS.parser(OPEN, HERMES.parser(ToolRequest((WEATHER,), "auto")))
    for size in (1, 3, 7, len(text)):
        parser = base.fresh()  # n > 1: each choice parses alike
        reasoning, content, calls, deltas = _split(parser, [text[i : i + size] for i in range(0, len(text), size)])
        assert reasoning == "Should I write <tool_call>? Yes.\n" and content == "", size
        assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Oslo"}')]
        assert deltas[0].id == calls[0].id and "".join(d.arguments for d in deltas) == calls[0].arguments


@pytest.mark.parametrize(
    ("tail", "start", "rerendered"),
    [
        ([START_ID, NL], OPEN, 2),  # the template opened the block: the reply starts in it
        ([START_ID], OPEN, 1),
        ([START_ID, NL, NL, END_ID, NL, NL], CLOSED, 6),  # thinking switched off by the template
        ([7, 8], FREE, 0),
        ([START_ID, 7], FREE, 0),
        ([START_ID, NL, 7, END_ID, 8, NL], FREE, 0),  # a past turn's block
    ],
)
def test_where_a_reply_starts_is_read_from_the_prompts_end(tail, start, rerendered):
    prompt = [7, 8, 9, *tail]
    assert TAGS.start(prompt) == start and TAGS.rerendered(prompt) == rerendered


def test_a_model_thinks_when_both_tags_are_single_tokens():
    def tokenizer(vocab):
        return SimpleNamespace(token_to_id=vocab.get, decode=lambda ids: "", eos_token_ids=[EOS])

    found = Thinking.of(tokenizer({"<think>": 5, "</think>": 6}))
    assert found is not None and (found.start_id, found.end_id, found.eos_ids) == (5, 6, {EOS})
    assert Thinking.of(tokenizer({"<think>": 5})) is None and Thinking.of(tokenizer({})) is None


def test_a_grammar_holds_from_the_end_of_the_reasoning():
    """The worker's own compiler on a tokenizer with the tags: a forced call, ``auto`` and a JSON
    schema, after a block the template opened or one the model may open."""
    from muxworker.worker.engine.constraints import GrammarCompiler
    from muxworker.worker.models.tokenizer import Tokenizer

    backend = tiny_tokenizer(THINK_TAGS)
    tokenizer = Tokenizer(backend)
    tags = Thinking.of(tokenizer)
    assert tags is not None
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size, [backend.token_to_id("<|im_end|>")])

    def accepts(constraint, text: str) -> bool:
        g = compiler.compile(constraint)
        return g.matcher.consume_tokens(tokenizer.encode(text)) and g.matcher.is_accepting()

    required = HERMES.constraint(ToolRequest((WEATHER,), "required"))
    opened = tags.constrain(required, OPEN)
    assert accepts(opened, "A call it is.</think>\n\n" + CALL) and accepts(opened, "</think>" + CALL)
    assert not accepts(opened, CALL)  # still reasoning: the block must close first
    assert not accepts(opened, "Hmm.</think>\n\nNo call.")
    free = tags.constrain(required, FREE)
    assert accepts(free, CALL) and accepts(free, "<think>Hmm.</think>\n\n" + CALL)
    auto = tags.constrain(HERMES.constraint(ToolRequest((WEATHER,), "auto")), OPEN)
    assert accepts(auto, "Maybe <tool_call>, maybe not.</think>\n\nJust text.")
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    json_reply = tags.constrain({"json_schema": schema}, OPEN)
    assert accepts(json_reply, 'Yes.</think>\n\n{"ok": true}') and not accepts(json_reply, '{"ok": true}')
    assert accepts(tags.constrain({"json_object": True}, OPEN), "</think>{}")
    assert tags.constrain(required, CLOSED) is required and tags.constrain(None, OPEN) is None
    assert tags.constrain({"regex": "a+"}, OPEN) == {"regex": "a+"}  # a kind the server never builds


# -- the app over a scripted service (tests/helpers/serve_fakes.py) ------------------------------------

WORDS = ["Let me think", " about it.</th", "ink>\n", "\nHello", " there"]  # the tag split across deltas
IDS = [7, 8, 9, END_ID, NL, 11, 12, EOS]  # three tokens of reasoning


def _thinking_service(**kw) -> ScriptedService:
    return ScriptedService(prompt=[1, 2, START_ID, NL], words=WORDS, token_ids=IDS, thinking_tags=TAGS, **kw)


async def _post(service: ScriptedService, path: str, body: dict) -> httpx.Response:
    app = create_app(service, ServerMetrics(), AppConfig(ServedModel(("m",))))  # type: ignore[arg-type]
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1:8000") as http:
        return await http.post(path, json={"model": "m", **body})


def _sse(response: httpx.Response) -> list[dict]:
    lines = [line for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


CHAT = {"messages": [{"role": "user", "content": "hi"}]}


async def test_chat_returns_the_reasoning_apart_streamed_or_not():
    body = (await _post(_thinking_service(), "/v1/chat/completions", CHAT)).json()
    ChatCompletion.model_validate(body)
    assert body["choices"][0]["message"] == {
        "role": "assistant",
        "content": "Hello there",
        "reasoning_content": "Let me think about it.",
    }
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": 3}
    assert body["usage"]["completion_tokens"] == len(IDS)

    stream = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    chunks = _sse(await _post(_thinking_service(), "/v1/chat/completions", stream))
    for chunk in chunks:
        ChatCompletionChunk.model_validate(chunk)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Let me think about it."
    assert "".join(d.get("content") or "" for d in deltas) == "Hello there"
    last_reasoning = max(i for i, d in enumerate(deltas) if d.get("reasoning_content"))
    assert all(not d.get("content") for d in deltas[:last_reasoning])
    assert chunks[-1]["usage"]["completion_tokens_details"] == {"reasoning_tokens": 3}


async def test_a_model_that_does_not_think_answers_exactly_as_before():
    service = ScriptedService(words=["a</think>", "b"])
    body = (await _post(service, "/v1/chat/completions", CHAT)).json()
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "a</think>b"}
    assert "completion_tokens_details" not in body["usage"]
    chunks = _sse(await _post(service, "/v1/chat/completions", {**CHAT, "stream": True}))
    assert all("reasoning_content" not in c["choices"][0]["delta"] for c in chunks)


async def test_a_tool_call_after_the_reasoning_and_its_grammar():
    """The generic tool format's reply after a block: the call is found in the answer, and the
    grammar the worker gets lets the reasoning come first."""
    words = ["Oslo, then.</think>\n\n", '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}}]}']
    service = _thinking_service()
    service.words = words
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER.parameters}}]
    body = (await _post(service, "/v1/chat/completions", {**CHAT, "tools": tools, "tool_choice": "required"})).json()
    ChatCompletion.model_validate(body)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert choice["message"]["reasoning_content"] == "Oslo, then."
    assert [c["function"]["arguments"] for c in choice["message"]["tool_calls"]] == ['{"city": "Oslo"}']
    grammar = service.params[-1].fields["constraint"]["lark"]
    assert grammar.startswith(f"start: THOUGHT? <[{END_ID}]> GAP? reply") and "%json" in grammar


async def test_responses_put_the_reasoning_in_its_own_item_first():
    body = (await _post(_thinking_service(), "/v1/responses", {"input": "hi", "store": False})).json()
    response = Response.model_validate(body)
    assert [o.type for o in response.output] == ["reasoning", "message"]
    assert response.output[0].content[0].text == "Let me think about it." and response.output[0].summary == []
    assert response.output_text == "Hello there"
    assert response.usage.output_tokens_details.reasoning_tokens == 3

    raw = await _post(_thinking_service(), "/v1/responses", {"input": "hi", "stream": True, "store": False})
    events = [
        EVENTS.validate_python(json.loads(line[6:])) for line in raw.text.splitlines() if line.startswith("data: ")
    ]
    assert [e.type for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response  # type: ignore[union-attr]
    assert [o.type for o in final.output] == ["reasoning", "message"]
    assert final.output[0].content[0].text == "Let me think about it." and final.output_text == "Hello there"
    assert final.usage.output_tokens_details.reasoning_tokens == 3


def test_reasoning_comes_back_to_the_template_from_chat_and_responses_input():
    chat = oa.parse_chat_request(
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning": "r"}]},
        "m",
    )
    assert chat.messages[1] == {"role": "assistant", "content": "a", "reasoning_content": "r"}
    with pytest.raises(oa.APIError, match="reasoning_content must be a string"):
        oa.parse_chat_request({"messages": [{"role": "assistant", "content": "a", "reasoning_content": 1}]}, "m")
    body = {
        "model": "m",
        "input": [
            {"role": "user", "content": "weather?"},
            {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Hm."}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "rain"},
            {"type": "reasoning", "id": "rs_2", "summary": [], "encrypted_content": "..."},  # another model's
        ],
    }
    rq = ra.parse_responses_request(body, ServedModel(("m",)), None)
    assert [(m["role"], m.get("reasoning_content"), m["content"]) for m in rq.chat.messages] == [
        ("user", None, "weather?"),
        ("assistant", "Hm.", "Checking."),
        ("tool", None, "rain"),
    ]
    assert rq.chat.messages[1]["tool_calls"][0].name == "get_weather"
    assert [i["type"] for i in rq.input_items] == [
        "message",
        "reasoning",
        "message",
        "function_call",
        "function_call_output",
    ]
    # A stored response's reasoning goes back with its turn when it is continued.
    first = ra.parse_responses_request({"model": "m", "input": "q"}, ServedModel(("m",)), None)
    result = SimpleNamespace(finish_reason="stop", prompt_tokens=5, reused_prompt_tokens=0, completion_tokens=3)
    output = ra.output_items("answer", [], result, None, "thought")  # type: ignore[arg-type]
    stored = json.loads(ra.record({"output": output, "created_at": 0}, first, "t/~r-x"))
    rq = ra.parse_responses_request({"model": "m", "input": "more"}, ServedModel(("m",)), stored)
    assert rq.chat.messages[1] == {"role": "assistant", "content": "answer", "reasoning_content": "thought"}
    # Reasoning and no text (cut while thinking): no empty message, as OpenAI answers.
    assert [i["type"] for i in ra.output_items("", [], result, None, "cut")] == ["reasoning"]  # type: ignore[arg-type]


# -- a real server, a tiny random model that thinks ---------------------------------------------------

#: Qwen3's rules, short: past assistant turns (before the last user message) lose their
#: reasoning, later ones keep it; the generation prompt opens <think>.
QWEN3_LIKE = (
    "{%- set ns = namespace(last=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last = loop.index0 -%}{%- endif -%}{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if loop.index0 > ns.last and m.reasoning_content is defined -%}"
    "{{- '<think>\\n' + m.reasoning_content.strip('\\n') + '\\n</think>\\n\\n' -}}"
    "{%- endif -%}"
    "{{- (m.content or '') + '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n<think>\\n' -}}{%- endif -%}"
)
OPENED = 2  # the tokens of "<think>\n" the generation prompt ends with, which the next render drops
Q1 = {"role": "user", "content": "Is 7 prime?"}
Q2 = {"role": "user", "content": "And 9?"}
Q3 = {"role": "user", "content": "Name a colour."}  # the Responses test's own conversation
Q4 = {"role": "user", "content": "Another one."}


@pytest.fixture(scope="module")
def server(tiny_model_factory, tmp_path_factory):
    from muxworker.serve.process import ServerProcess

    model = tiny_model_factory("qwen3", chat_template=QWEN3_LIKE, added_tokens=THINK_TAGS)
    store = tmp_path_factory.mktemp("thinking-store")
    args = ["--model", str(model), "--store", str(store), "--max_sessions", "4", "--max_session_tokens", "512"]
    with ServerProcess(args, log_path=store.parent / "thinking.log") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60) as c:
        yield c


def _copies(server) -> float:
    text = httpx.get(server.url + "/metrics").text
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("muxworker_reuse_copies_total")
    )


KW = {"temperature": 0, "max_tokens": 8}


@pytest.mark.slow
def test_a_thinking_reply_and_the_next_turn_reuse_all_but_the_opened_block(server, client):
    """The random model never closes its block within 8 tokens: the reply is all reasoning. The
    next turn's render drops it (and the <think> the template opened), and runs on the same
    session in place: its history is reused up to there, with no copy, named or not."""
    c = client
    first = c.chat.completions.create(model=server.model, messages=[Q1], extra_body={"session_id": "t1"}, **KW)
    message, usage = first.choices[0].message, first.usage
    assert first.choices[0].finish_reason == "length" and message.content == "" and message.reasoning_content
    assert usage.completion_tokens_details.reasoning_tokens == usage.completion_tokens == 8
    chunks = list(
        c.chat.completions.create(
            model=server.model, messages=[Q1], stream=True, stream_options={"include_usage": True}, **KW
        )
    )
    deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == message.reasoning_content
    assert not "".join(d.content or "" for d in deltas)
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == 8

    turn = {"role": "assistant", "content": message.content, "reasoning_content": message.reasoning_content}
    copies = _copies(server)
    for extra in ({"session_id": "t1"}, {}):  # named; then no id (the streamed turn's implicit session)
        second = c.chat.completions.create(model=server.model, messages=[Q1, turn, Q2], extra_body=extra, **KW)
        assert second.usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - OPENED, extra
        assert second.usage.prompt_tokens > usage.prompt_tokens
    assert _copies(server) == copies  # in place: no branch kept, no fork


@pytest.mark.slow
def test_responses_return_the_reasoning_item_and_continue_from_it(server, client):
    c = client
    first = c.responses.create(model=server.model, input=[Q3], temperature=0, max_output_tokens=8)
    assert [o.type for o in first.output] == ["reasoning"] and first.status == "incomplete"
    thought = first.output[0].content[0].text
    assert thought and first.usage.output_tokens_details.reasoning_tokens == first.usage.output_tokens == 8
    events = list(
        c.responses.create(model=server.model, input=[Q3], temperature=0, max_output_tokens=8, stream=True, store=False)
    )
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == thought
    again = c.responses.create(
        model=server.model, input=[Q4], previous_response_id=first.id, temperature=0, max_output_tokens=8
    )
    assert again.usage.input_tokens_details.cached_tokens == first.usage.input_tokens - OPENED
