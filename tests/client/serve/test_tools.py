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
    # Mistral: several calls in one array; a cut-off call stays text.
    parser = MISTRAL.parser(request)
    parser.feed('[TOOL_CALLS][{"name": "a", "arguments": {"x": ", "}}, {"name": "b", "arguments": {}}]')
    assert [(c.name, c.arguments) for c in parser.finish()[1]] == [("a", '{"x": ", "}'), ("b", "{}")]
    parser = MISTRAL.parser(request)
    parser.feed('[TOOL_CALLS][{"name": "a", "argu')
    assert parser.finish() == ('[TOOL_CALLS][{"name": "a", "argu', [])
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
    ],
    ids=["hermes", "generic", "mistral"],
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
