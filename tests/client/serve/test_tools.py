"""Tool calls (client/serve/tools.py) on tiny random models carrying each family's template
(tests/data/templates: Hermes/Qwen, Mistral, Llama 3; ChatML without tools for the generic format):
the format is read from the template; under ``required`` or a named function the grammar makes
even a random model write a call that parses and validates; ``auto`` leaves text free and holds a
started call to the schemas; the parser streams content and holds back a tag until it is decided;
and a call rendered back into the next turn's prompt is exactly what the model wrote, so a session
reuses its whole history."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import torch
from helpers.engine import run
from helpers.tiny_models import CHAT_TEMPLATE

from muxworker.client.serve.tools import (
    GENERIC,
    HERMES,
    LLAMA3,
    MISTRAL,
    OutputParser,
    Tool,
    ToolCall,
    ToolRequest,
    tool_format,
)
from muxworker.worker.build import load_engine
from muxworker.worker.engine.config import EngineConfig
from muxworker.worker.engine.sampling import SamplingParams

TEMPLATES = Path(__file__).parents[2] / "data" / "templates"
WEATHER = Tool(
    "get_weather",
    "The weather in a city",
    {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
)
ADD = Tool(
    "add",
    "Add two integers",
    {
        "type": "object",
        "properties": {
            "a": {"type": "integer", "minimum": 0, "maximum": 99},
            "b": {"type": "integer", "minimum": 0, "maximum": 99},
        },
        "required": ["a", "b"],
        "additionalProperties": False,
    },
)
SCHEMAS = {t.name: t.parameters for t in (WEATHER, ADD)}
FORMATS = {"generic": CHAT_TEMPLATE, "hermes": "hermes", "mistral": "mistral", "llama3": "llama3"}


def _template(name: str) -> str:
    return CHAT_TEMPLATE if name == "generic" else (TEMPLATES / f"{name}.jinja").read_text()


@pytest.fixture(scope="module")
def engines(tiny_model_factory):
    out = {}
    for name in FORMATS:
        path = tiny_model_factory("llama", chat_template=_template(name))
        out[name] = load_engine(
            path, EngineConfig(max_sessions=2, max_session_tokens=2048), dtype="float32", progress=None
        )
    return out


def test_the_format_is_read_from_the_template():
    assert tool_format(CHAT_TEMPLATE) is GENERIC and tool_format(None) is GENERIC
    assert tool_format(_template("hermes")) is HERMES
    assert tool_format(_template("mistral")) is MISTRAL
    assert tool_format(_template("llama3")) is LLAMA3


def _prompt(engine, fmt, messages, request):
    text = engine.tokenizer.apply_chat_template(
        fmt.messages(messages, request), add_generation_prompt=True, tools=fmt.template_tools(request)
    )
    return engine.tokenizer.encode(text, parse_special=True)


def _turn(engine, fmt, messages, request, *, seed, sid="t", n=160):
    ids = _prompt(engine, fmt, messages, request)
    engine.open_session(sid)
    params = SamplingParams(max_new_tokens=n, temperature=1.0, seed=seed, constraint=fmt.constraint(request))
    engine.submit(1, sid, ids, params)
    text, result = run(engine)[1]
    parser = fmt.parser(request)
    content = parser.feed(text)
    rest, calls = parser.finish()
    return ids, content + rest, calls, result


@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize(
    "request_",
    [
        ToolRequest((WEATHER, ADD), "required"),
        ToolRequest((WEATHER, ADD), "function", "add"),
        ToolRequest((WEATHER, ADD), "required", parallel=False),
    ],
    ids=["required", "named", "one"],
)
def test_a_forced_call_always_parses_and_validates(engines, name, request_):
    engine, fmt = engines[name], tool_format(_template(name))
    messages = [{"role": "user", "content": "What is 2 plus 3, and the weather in Paris?"}]
    stopped = 0
    for seed in range(4):
        _, content, calls, result = _turn(engine, fmt, messages, request_, seed=seed)
        engine.close_session("t")
        if result["finish_reason"] == "length" and request_.most is None:
            continue  # a random model may go on adding parallel calls up to max_new_tokens
        stopped += 1
        assert result["finish_reason"] == "stop" and calls and content == "", (name, content, result)
        if request_.most == 1 or name == "llama3":
            assert len(calls) == 1
        for call in calls:
            assert call.name in ({"add"} if request_.choice == "function" else SCHEMAS)
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    assert stopped >= 1, f"none of 4 {name} replies ended within max_new_tokens"


@pytest.mark.parametrize("name", list(FORMATS))
def test_a_call_rendered_back_is_what_the_model_wrote(engines, name):
    """The next turn's prompt (the call, its result, a new question) starts with the session's
    whole history, so only the new messages are prefilled."""
    engine, fmt = engines[name], tool_format(_template(name))
    request = ToolRequest((WEATHER, ADD), "required", parallel=False)
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    _, _, calls, result = _turn(engine, fmt, messages, request, seed=11)
    history = engine.session_tokens("t")
    engine.close_session("t")
    assert calls and result["finish_reason"] == "stop"
    following = messages + [
        {"role": "assistant", "content": "", "tool_calls": calls},
        *({"role": "tool", "tool_call_id": c.id, "name": c.name, "content": "12 degrees"} for c in calls),
    ]
    again = _prompt(engine, fmt, following, ToolRequest((WEATHER, ADD), "auto"))
    assert again[: len(history)] == history


def test_auto_leaves_text_free_and_holds_a_started_call_to_the_schema(engines):
    from muxworker.worker.engine.constraints import GrammarCompiler

    engine = engines["hermes"]
    compiler = GrammarCompiler(engine.tokenizer, engine.vocab_size, engine.eos_token_ids)
    guide = compiler.compile(HERMES.constraint(ToolRequest((WEATHER,), "auto")))

    def accepts(text: str) -> bool:
        g = compiler.compile(HERMES.constraint(ToolRequest((WEATHER,), "auto")))
        return g.matcher.consume_tokens(engine.tokenizer.encode(text)) and g.matcher.is_accepting()

    assert guide is not None
    assert accepts("Just text, with < and tool_call in it.")
    assert accepts(
        'Let me look. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}\n</tool_call>'
    )
    assert not accepts('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>')  # no unit
    assert not accepts('<tool_call>\n{"name": "launch", "arguments": {}}\n</tool_call>')
    generic = compiler.compile(GENERIC.constraint(ToolRequest((WEATHER,), "auto")))
    assert generic.matcher.consume_tokens(engine.tokenizer.encode('{"response": "Hi there"}'))
    none = compiler.compile(GENERIC.constraint(ToolRequest((WEATHER,), "none")))
    assert not none.matcher.consume_tokens(engine.tokenizer.encode('{"tool_calls": ['))
    assert HERMES.constraint(ToolRequest((WEATHER,), "none")) is None


# A tool as pydantic writes one: its own $defs, and a tree that refers back to itself.
TREE = Tool(
    "plant",
    "Plant a tree",
    {
        "$defs": {
            "Node": {
                "type": "object",
                "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/Node"}, "maxItems": 2}},
                "required": ["kids"],
                "additionalProperties": False,
            }
        },
        "type": "object",
        "properties": {"root": {"$ref": "#/$defs/Node"}, "tag": {"const": {"$ref": "#"}}},
        "required": ["root", "tag"],
        "additionalProperties": False,
    },
)


@pytest.mark.parametrize("name", list(FORMATS))
def test_a_tools_references_are_its_own_schema(engines, name):
    """``#`` in a tool's parameters means the parameters, not the call the grammar wraps them in:
    pydantic's ``#/$defs/...`` compiles and holds the arguments to the tool's own schema (also
    beside another tool, and beside a response_format with references of its own)."""
    from muxworker.worker.engine.constraints import GrammarCompiler

    engine, fmt = engines[name], tool_format(_template(name))
    compiler = GrammarCompiler(engine.tokenizer, engine.vocab_size, engine.eos_token_ids)
    args = '{"root": {"kids": [{"kids": []}]}, "tag": {"$ref": "#"}}'
    nested = '{"root": {"kids": [{"kids": [], "name": "plant"}]}, "tag": {"$ref": "#"}}'
    request = ToolRequest((WEATHER, TREE), "required")
    _, sep, close = _TWO_CALLS[name]
    open_ = _TWO_CALLS[name][0]

    def accepts(arguments: str) -> bool:
        g = compiler.compile(fmt.constraint(request))
        text = open_ + _call("plant", arguments, fmt) + close
        return g.matcher.consume_tokens(engine.tokenizer.encode(text)) and g.matcher.is_accepting()

    assert accepts(args)
    assert not accepts(nested)  # a call's wrapper is not a Node
    assert not accepts('{"root": {"kids": [{"kids": []}]}, "tag": {"$ref": "#/x"}}')  # const as written
    if fmt is GENERIC:  # the reply's content schema has references too, beside the tools'
        content = {
            "$defs": {"Ok": {"type": "boolean"}},
            "type": "object",
            "properties": {"ok": {"$ref": "#/$defs/Ok"}},
            "required": ["ok"],
        }
        request = ToolRequest((WEATHER, TREE), "auto", content_schema=content)
        assert accepts(args)
        g = compiler.compile(fmt.constraint(request))
        assert g.matcher.consume_tokens(engine.tokenizer.encode('{"response": {"ok": true}}'))
        assert g.matcher.is_accepting()


def test_the_parser_streams_content_and_holds_back_a_tag():
    request = ToolRequest((WEATHER,), "auto")
    parser = HERMES.parser(request)
    out = [
        parser.feed(piece)
        for piece in [
            "Let me ",
            "check <to",
            'ol_call>\n{"name": ',
            '"get_weather", "arguments": {"city": "Rome", "unit": "f"}}\n</tool_call>',
        ]
    ]
    assert out == ["Let me ", "check ", "", ""]
    rest, calls = parser.finish()
    assert rest == "" and [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Rome", "unit": "f"}')]
    assert calls[0].id.startswith("call_")
    # A held-back "<" that turns out to be text is given out.
    parser = HERMES.parser(request)
    assert parser.feed("a <") == "a " and parser.feed("b") == "<b" and parser.finish() == ("", [])
    # Mistral: several calls in one array; a call cut short is dropped, not made text.
    parser = MISTRAL.parser(request)
    parser.feed('[TOOL_CALLS][{"name": "a", "arguments": {"x": ", "}}, {"name": "b", "arguments": {}}]')
    assert [(c.name, c.arguments) for c in parser.finish()[1]] == [("a", '{"x": ", "}'), ("b", "{}")]
    parser = MISTRAL.parser(request)
    parser.feed('[TOOL_CALLS][{"name": "a", "argu')
    assert parser.finish() == ("", [])
    # Llama 3: the reply is a call or text; text is streamed as it comes.
    parser = LLAMA3.parser(request)
    assert parser.feed(" ") == "" and parser.feed('{"name": "f", "parameters": {"q": 1}}') == ""
    assert [(c.name, c.arguments) for c in parser.finish()[1]] == [("f", '{"q": 1}')]
    parser = LLAMA3.parser(request)
    assert parser.feed("Hello") == "Hello" and parser.feed(" {x}") == " {x}"


def test_the_generic_reply_streams_its_response_string():
    parser = GENERIC.parser(ToolRequest((WEATHER,), "auto"))
    pieces = ['{"resp', 'onse": "Caf', "\\u00e9 \\ud83d", "\\ude00 line\\n", 'two \\"q\\""}']
    assert "".join(parser.feed(p) for p in pieces) == 'Café 😀 line\ntwo "q"'
    assert parser.finish() == ("", [])
    parser = GENERIC.parser(ToolRequest((WEATHER,), "auto"))
    assert parser.feed('{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Rome", "unit": "c"}}]}') == ""
    rest, calls = parser.finish()
    assert rest == "" and calls[0].arguments == '{"city": "Rome", "unit": "c"}'
    assert OutputParser().feed("x") == "x"


def test_generic_messages_put_calls_and_results_in_the_reply_shape():
    call = ToolCall("call_1", "get_weather", '{"city": "Rome", "unit": "c"}')
    request = ToolRequest((WEATHER,), "auto")
    out = GENERIC.messages(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Rome?"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "sunny"},
            {"role": "assistant", "content": "It is sunny."},
        ],
        request,
    )
    assert out[0]["role"] == "system" and out[0]["content"].startswith("Be brief.\n\nYou can call these tools:")
    assert out[2]["content"] == '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Rome", "unit": "c"}}]}'
    assert json.loads(out[3]["content"]) == {"tool_response": {"name": "get_weather", "content": "sunny"}}
    assert out[4]["content"] == '{"response": "It is sunny."}'
    # The system block does not depend on tool_choice: the prompt of a conversation stays the same.
    forced = GENERIC.messages([{"role": "user", "content": "x"}], ToolRequest((WEATHER,), "required"))
    auto = GENERIC.messages([{"role": "user", "content": "x"}], request)
    assert forced == auto


def test_a_structured_reply_beside_tools_is_held_to_response_format(engines):
    """response_format with tools (the generic format): a reply is calls, or content that the
    response schema holds, given out as its JSON text and rendered back verbatim."""
    from muxworker.worker.engine.constraints import GrammarCompiler

    engine = engines["generic"]
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    request = ToolRequest((WEATHER,), "none", content_schema=schema)
    compiler = GrammarCompiler(engine.tokenizer, engine.vocab_size, engine.eos_token_ids)

    def accepts(text: str) -> bool:
        g = compiler.compile(GENERIC.constraint(request))
        return g.matcher.consume_tokens(engine.tokenizer.encode(text)) and g.matcher.is_accepting()

    assert accepts('{"response": {"ok": true}}') and not accepts('{"response": "text"}')
    parser = GENERIC.parser(request)
    streamed = parser.feed('{"response": {"o') + parser.feed('k": true}}')
    rest, calls = parser.finish()
    assert streamed + rest == '{"ok": true}' and calls == []
    out = GENERIC.messages(
        [{"role": "user", "content": "x"}, {"role": "assistant", "content": '{"ok": true}'}], request
    )
    assert out[-1]["content"] == '{"response": {"ok": true}}'


@pytest.mark.parametrize(
    ("fmt", "text"),
    [
        (
            HERMES,
            'Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Ro\\"me}", "unit": "c"}}\n</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": [2, {"c": 3}]}}\n</tool_call>',
        ),
        (
            GENERIC,
            '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Ro\\"me}", "unit": "c"}}, {"name": "add", "arguments": {"a": 1, "b": [2, {"c": 3}]}}]}',
        ),
        (
            MISTRAL,
            '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Ro\\"me}", "unit": "c"}}, {"name": "add", "arguments": {"a": 1, "b": [2, {"c": 3}]}}]',
        ),
        (
            LLAMA3,
            '{"name": "get_weather", "parameters": {"city": "Ro\\"me}", "unit": "c"}}; {"name": "add", "parameters": {"a": 1, "b": [2, {"c": 3}]}}',
        ),
    ],
    ids=["hermes", "generic", "mistral", "llama3"],
)
def test_calls_stream_as_id_and_name_then_argument_pieces(fmt, text):
    parser = fmt.parser(ToolRequest((WEATHER, ADD), "auto"))
    deltas, content = [], ""
    for i in range(0, len(text), 3):  # three characters at a time, as tokens might come
        content += parser.feed(text[i : i + 3])
        deltas += parser.pop_deltas()
    rest, calls = parser.finish()
    deltas += parser.pop_deltas()
    assert content + rest == ("Sure. " if fmt is HERMES else "")
    assert [(c.name, c.arguments) for c in calls] == [
        ("get_weather", '{"city": "Ro\\"me}", "unit": "c"}'),
        ("add", '{"a": 1, "b": [2, {"c": 3}]}'),
    ]
    for index, call in enumerate(calls):
        mine = [d for d in deltas if d.index == index]
        assert (mine[0].id, mine[0].name) == (call.id, call.name)  # id and name first, the ids kept
        assert all(d.id is None for d in mine[1:]) and len(mine) > 3  # then several pieces
        assert "".join(d.arguments for d in mine) == call.arguments


def test_native_formats_take_response_format_beside_tools(engines):
    """Hermes and Mistral: a reply is the JSON content or tagged calls; Llama 3's calls are JSON
    objects themselves, so it is refused there (by the server, from accepts_content_schema)."""
    from muxworker.worker.engine.constraints import GrammarCompiler

    engine = engines["hermes"]
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    compiler = GrammarCompiler(engine.tokenizer, engine.vocab_size, engine.eos_token_ids)

    def accepts(fmt, request, text: str) -> bool:
        g = compiler.compile(fmt.constraint(request))
        return g.matcher.consume_tokens(engine.tokenizer.encode(text)) and g.matcher.is_accepting()

    auto = ToolRequest((WEATHER,), "auto", content_schema=schema)
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}\n</tool_call>'
    assert accepts(HERMES, auto, '{"ok": true}') and accepts(HERMES, auto, call)
    assert not accepts(HERMES, auto, "free text") and not accepts(HERMES, auto, '{"ok": 1}')
    none = ToolRequest((WEATHER,), "none", content_schema=schema)
    assert accepts(HERMES, none, '{"ok": false}') and not accepts(HERMES, none, call)
    assert accepts(MISTRAL, auto, '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "f"}}]')
    assert HERMES.accepts_content_schema and MISTRAL.accepts_content_schema and GENERIC.accepts_content_schema
    assert not LLAMA3.accepts_content_schema


_TWO_CALLS = {
    "generic": ('{"tool_calls": [', ", ", "]}"),
    "hermes": (HERMES.open, HERMES.sep, HERMES.close),
    "mistral": (MISTRAL.open, MISTRAL.sep, MISTRAL.close),
    "llama3": (LLAMA3.open, LLAMA3.sep, LLAMA3.close),
}


def _reply(name: str, calls: list[str], end: bool = True) -> str:
    """A reply of ``calls`` (each a call object's JSON text) in format ``name``, closed or not."""
    open_, sep, close = _TWO_CALLS[name]
    return open_ + sep.join(calls) + (close if end else "")


def _call(name: str, arguments: str, fmt) -> str:
    return f'{{"name": "{name}", "{fmt.args_key}": {arguments}}}'


def _stream(fmt, request, text: str, step: int = 2):
    """Feed ``text`` a few characters at a time: the content, the deltas, and finish's calls."""
    parser = fmt.parser(request)
    content, deltas = "", []
    for i in range(0, len(text), step):
        content += parser.feed(text[i : i + step])
        deltas += parser.pop_deltas()
    rest, calls = parser.finish()
    deltas += parser.pop_deltas()
    return content + rest, deltas, calls


@pytest.mark.parametrize("name", list(FORMATS))
def test_a_reply_cut_inside_a_call_keeps_its_complete_calls(name):
    """Cut by max_tokens inside its third call, a reply keeps the two complete calls (the ids and
    arguments they streamed with) and drops only the third, which streamed on an index of its own."""
    fmt = tool_format(_template(name))
    request = ToolRequest((WEATHER, ADD), "required")
    first = _call("get_weather", '{"city": "Oslo", "unit": "c"}', fmt)
    second = _call("get_weather", '{"city": "Oslo", "unit": "f"}', fmt)
    third = _call("add", '{"a": 1, "b": 2}', fmt)
    whole = _reply(name, [first, second, third])
    for cut, kept in [
        (whole.index(third) + len(third) - 4, 2),
        (whole.index(first) + len(first) - 1, 1),
        (whole.index(first) + 5, 0),
    ]:
        content, deltas, calls = _stream(fmt, request, whole[:cut])
        assert (
            content == ""
            and [(c.name, json.loads(c.arguments)) for c in calls]
            == [("get_weather", {"city": "Oslo", "unit": u}) for u in "cf"][:kept]
        ), (cut, calls)
        streamed: dict[int, list] = {}
        for d in deltas:
            if d.id is not None:
                assert d.index not in streamed  # one id per index
                streamed[d.index] = [d.id, d.name, ""]
            streamed[d.index][2] += d.arguments
        assert [s[0] for s in list(streamed.values())[:kept]] == [c.id for c in calls]
        assert len({s[0] for s in streamed.values()}) == len(streamed)
        for index, (_, _, arguments) in streamed.items():  # the complete ones parse on their own index
            assert (index < kept) == _parses(arguments), (index, arguments)
    # A whole reply: every call, each on its own index.
    content, deltas, calls = _stream(fmt, request, whole, step=5)
    assert content == "" and [c.name for c in calls] == ["get_weather", "get_weather", "add"]
    assert sorted({d.index for d in deltas}) == [0, 1, 2]


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("name", list(FORMATS))
def test_the_grammar_ends_after_a_call_and_parallel_false_allows_one(engines, name):
    """After a complete reply of calls, the end of the output may follow (the engine then stops),
    under ``required`` and ``auto`` alike; ``parallel_tool_calls: false`` allows exactly one call,
    ``true`` several."""
    from muxworker.worker.engine.constraints import GrammarCompiler

    engine, fmt = engines[name], tool_format(_template(name))
    compiler = GrammarCompiler(engine.tokenizer, engine.vocab_size, engine.eos_token_ids)
    one = _call("get_weather", '{"city": "Oslo", "unit": "c"}', fmt)
    two = _call("add", '{"a": 1, "b": 2}', fmt)

    def guide(choice: str, parallel: bool, text: str):
        g = compiler.compile(fmt.constraint(ToolRequest((WEATHER, ADD), choice, parallel=parallel)))
        ok = g.matcher.consume_tokens(engine.tokenizer.encode(text))
        return ok, g

    for choice in ("required", "auto"):
        for parallel in (True, False):
            ok, g = guide(choice, parallel, _reply(name, [one]))
            assert ok and g.matcher.is_accepting()
            eos = engine.eos_token_ids
            assert g.done or any(g.allowed(torch.device("cpu"))[t] for t in eos), (name, choice, parallel)
            assert guide(choice, parallel, _reply(name, [one, two]))[0] is parallel
        if _TWO_CALLS[name][2]:  # a format that closes its calls: not done before the close
            ok, g = guide(choice, False, _reply(name, [one], end=False))
            assert ok and not g.matcher.is_accepting()


def test_a_cut_reply_finishes_length_with_its_complete_calls():
    from types import SimpleNamespace

    from muxworker.client.serve import responses as rs

    calls = [ToolCall("call_1", "get_weather", '{"city": "Oslo", "unit": "c"}')]
    cut = SimpleNamespace(finish_reason="length", logprobs=None)
    stop = SimpleNamespace(finish_reason="stop", logprobs=None)
    body = rs.Choice(0, "", cut, calls).chat()
    assert body["finish_reason"] == "length" and body["message"]["tool_calls"] == [calls[0].openai()]
    assert body["message"]["content"] is None
    assert rs.Choice(0, "", stop, calls).chat()["finish_reason"] == "tool_calls"
    assert rs.Choice(0, "hi", stop).chat()["finish_reason"] == "stop"
    chunk = rs.ChunkWriter("chatcmpl-1", "m", chat=True).finish(cut, None, (), calls)
    assert json.loads(chunk.decode()[len("data: ") :])["choices"][0]["finish_reason"] == "length"


def test_responses_function_calls_stream_as_items_of_their_own():
    """Each call its own output item (output_index, call_id) with its own argument deltas; one
    cut by max_output_tokens closes incomplete and leaves the final output, as the events of
    OpenAI's SDK types have them."""
    from types import SimpleNamespace

    import pydantic
    from openai.types.responses import Response, ResponseStreamEvent

    from muxworker.client.serve import responses_api as ra
    from muxworker.client.serve.openai_api import ServedModel

    rq = ra.parse_responses_request({"model": "m", "input": "x"}, ServedModel(("m",)), None)
    fmt = GENERIC
    text = _reply(
        "generic",
        [
            _call("get_weather", '{"city": "Oslo", "unit": "c"}', fmt),
            _call("add", '{"a": 1, "b": 2}', fmt),
            _call("add", '{"a": 3, "b"', fmt),
        ],
    )
    text = text[: text.rindex('"b"') + 3]
    parser = fmt.parser(ToolRequest((WEATHER, ADD), "required"))
    writer = ra.EventWriter("resp_" + "1" * 32, rq, None)
    raw = writer.start()
    for i in range(0, len(text), 4):
        parser.feed(text[i : i + 4])
        raw += writer.calls(parser.pop_deltas())
    _, calls = parser.finish()
    result = SimpleNamespace(finish_reason="length", prompt_tokens=5, reused_prompt_tokens=0, completion_tokens=9)
    events, final = writer.finish(result, calls)
    raw += events
    adapter = pydantic.TypeAdapter(ResponseStreamEvent)
    parsed = [
        adapter.validate_python(json.loads(c.split("\n")[1][len("data: ") :])) for c in raw.decode().split("\n\n") if c
    ]
    added = {e.output_index: e.item for e in parsed if e.type == "response.output_item.added"}
    assert sorted(added) == [0, 1, 2] and len({i.call_id for i in added.values()}) == 3
    arguments: dict[int, str] = {}
    for e in parsed:
        if e.type == "response.function_call_arguments.delta":
            assert e.item_id == added[e.output_index].id
            arguments[e.output_index] = arguments.get(e.output_index, "") + e.delta
    assert json.loads(arguments[0]) == {"city": "Oslo", "unit": "c"} and json.loads(arguments[1]) == {"a": 1, "b": 2}
    done = {e.output_index: e.item for e in parsed if e.type == "response.output_item.done"}
    assert [done[i].status for i in (0, 1, 2)] == ["completed", "completed", "incomplete"]
    response = Response.model_validate(final)
    assert response.status == "incomplete" and [o.call_id for o in response.output] == [c.id for c in calls]
    assert [o.call_id for o in response.output] == [added[0].call_id, added[1].call_id]
    # not streamed: the same two calls
    assert [i["call_id"] for i in ra.output_items("", calls, result)] == [added[0].call_id, added[1].call_id]


def test_compiled_grammars_are_cached_by_their_constraint(engines, monkeypatch):
    """The same tool set again (an equal copy) compiles once; each request gets a matcher of its
    own; a schema whose properties come in another order is another grammar; an error is kept
    too; the cache is bounded."""
    from muxworker.worker.engine import constraints
    from muxworker.worker.engine.constraints import GrammarCompiler

    engine = engines["generic"]
    compiler = GrammarCompiler(engine.tokenizer, engine.vocab_size, engine.eos_token_ids)
    request = ToolRequest((WEATHER, ADD), "required")
    a = compiler.compile(GENERIC.constraint(request))
    b = compiler.compile(json.loads(json.dumps(GENERIC.constraint(request))))
    assert compiler.cached == 1 and a.matcher is not b.matcher
    text = '{"tool_calls": [{"name": "add", "arguments": {"a": 1, "b": 2}}]}'
    assert a.matcher.consume_tokens(engine.tokenizer.encode(text)) and a.done
    assert not b.done and b.matcher.consume_tokens(engine.tokenizer.encode(text[:20]))  # untouched by a's
    reordered = Tool("add", "", {**ADD.parameters, "properties": dict(reversed(ADD.parameters["properties"].items()))})
    c = compiler.compile(GENERIC.constraint(ToolRequest((WEATHER, reordered), "required")))
    assert compiler.cached == 2
    assert not c.matcher.consume_tokens(engine.tokenizer.encode(text))  # "b" comes first there
    for _ in range(2):
        with pytest.raises(ValueError, match="constraint.regex is not valid"):
            compiler.compile({"regex": "("})
    assert compiler.cached == 3
    monkeypatch.setattr(constraints, "GRAMMAR_CACHE_ENTRIES", 2)
    compiler.compile({"regex": "[ab]+"})
    assert compiler.cached == 2


def test_parallel_tool_calls_reaches_the_grammar():
    """Chat's and Responses' ``parallel_tool_calls``: several calls by default, exactly one under
    false (the grammar's bound), a non-boolean refused naming the field."""
    from muxworker.client.serve import openai_api as oa
    from muxworker.client.serve import responses_api as ra

    fn = {"name": "f", "parameters": {"type": "object", "properties": {}}}
    chat = {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": fn}]}
    responses = {"model": "m", "input": "x", "tools": [{"type": "function", **fn}], "tool_choice": "required"}
    for parallel, most in [(None, None), (True, None), (False, 1)]:
        extra = {} if parallel is None else {"parallel_tool_calls": parallel}
        for tools in (
            oa.parse_chat_request({**chat, "tool_choice": "required", **extra}, "m").tools,
            ra.parse_responses_request({**responses, **extra}, oa.ServedModel(("m",)), None).chat.tools,
        ):
            assert tools is not None and tools.most == most
            calls = GENERIC.constraint(tools)["json_schema"]["properties"]["tool_calls"]
            assert calls.get("maxItems") == most and calls["minItems"] == 1
    with pytest.raises(oa.APIError) as err:
        oa.parse_chat_request({**chat, "parallel_tool_calls": "no"}, "m")
    assert err.value.status == 400 and err.value.param == "parallel_tool_calls"


def test_a_second_identical_request_does_not_recompile(engines, monkeypatch):
    """Through the engine: two requests with the same tool set (equal copies, as an agent resends
    them) compile once; each still gets its own matcher and a whole call."""
    engine, fmt = engines["generic"], GENERIC
    compiled = []
    real = engine.grammars._compile
    monkeypatch.setattr(engine.grammars, "_compile", lambda c: compiled.append(c) or real(c))
    schema = {
        "type": "object",
        "properties": {"q": {"enum": ["a", "b"]}},
        "required": ["q"],
        "additionalProperties": False,
    }
    tool = Tool("lookup_once", "", schema)
    before = engine.grammars.cached
    messages = [{"role": "user", "content": "Look up a."}]
    for rid, seed in ((1, 0), (2, 1)):
        request = ToolRequest((tool,), "required", parallel=False)
        ids = _prompt(engine, fmt, messages, request)
        engine.open_session(f"s{rid}")
        params = SamplingParams(max_new_tokens=160, temperature=1.0, seed=seed, constraint=fmt.constraint(request))
        engine.submit(rid, f"s{rid}", ids, params)
    results = run(engine)
    for rid in (1, 2):
        engine.close_session(f"s{rid}")
        parser = fmt.parser(ToolRequest((tool,), "required", parallel=False))
        parser.feed(results[rid][0])
        _, calls = parser.finish()
        assert results[rid][1]["finish_reason"] == "stop" and [c.name for c in calls] == ["lookup_once"]
    assert len(compiled) == 1 and engine.grammars.cached == before + 1


_SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "bench_tool_calls.py"


@pytest.mark.slow
def test_sampled_required_calls_stream_on_their_own_index_and_are_kept_whole(tmp_path):
    """SmolLM2 on a real server, the 2-tool set of scripts/bench_tool_calls.py (an enum and a free
    string), ``tool_choice: "required"`` at temperature 1, max_tokens 64: a few seeds, each
    streamed and not, judged by the script's rules (every streamed call on an index and id of its
    own, its arguments parsing there but for the last of a reply cut by max_tokens; not streamed,
    exactly the complete calls the model wrote). The script runs 100 seeds. Then one Responses
    stream: each call its own output item, its arguments parsing on it."""
    import importlib.util
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    from muxworker.serve.process import ServerProcess

    spec = importlib.util.spec_from_file_location("bench_tool_calls", _SCRIPT)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    seeds = SAMPLED_SEEDS
    with ServerProcess(["--max_sessions", "4", "--max_session_tokens", "1024"], log_path=tmp_path / "serve.log") as s:
        with httpx.Client(base_url=s.url, timeout=300) as client, ThreadPoolExecutor(len(seeds) + 1) as pool:
            rows = pool.map(lambda seed: bench.sample(client, s.model, seed), seeds)
            events = pool.submit(_responses_events, client, s.model, bench.TOOLS, seeds[0])
            for row in rows:
                assert bench.judge(row) == [], (row["seed"], row["text"])
            events = events.result()
    added = {e["output_index"]: e["item"] for e in events if e["type"] == "response.output_item.added"}
    done = {e["output_index"]: e["item"] for e in events if e["type"] == "response.output_item.done"}
    assert added and len({i["call_id"] for i in added.values()}) == len(added)
    arguments: dict[int, str] = {}
    for e in events:
        if e["type"] == "response.function_call_arguments.delta":
            assert e["item_id"] == added[e["output_index"]]["id"]
            arguments[e["output_index"]] = arguments.get(e["output_index"], "") + e["delta"]
    final = events[-1]["response"]
    kept = [o for o in final["output"] if o["type"] == "function_call"]
    assert [o["call_id"] for o in kept] == [added[i]["call_id"] for i in sorted(added)][: len(kept)]
    for index in added:
        complete = done[index]["status"] == "completed"
        assert complete == _parses(arguments.get(index, "")) and (complete or index == max(added)), events
    assert all(_parses(o["arguments"]) for o in kept)


#: Seeds whose replies, on the CPU tried, make several calls and are cut inside one (the Responses
#: stream's too), make two whole calls, and one.
SAMPLED_SEEDS = (40, 49, 41)


def _responses_events(client, model: str, tools: list[dict], seed: int) -> list[dict]:
    body = {
        "model": model,
        "input": "What is the weather in Paris?",
        "tools": [{"type": "function", **t["function"]} for t in tools],
        "tool_choice": "required",
        "temperature": 1,
        "seed": seed,
        "max_output_tokens": 64,
        "stream": True,
        "store": False,
    }
    with client.stream("POST", "/v1/responses", json=body) as resp:
        assert resp.status_code == 200
        return [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
