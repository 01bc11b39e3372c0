"""Agents on the HTTP server, driven by clients nobody here wrote: the ``openai`` SDK (tools,
tool_choice, streamed tool-call deltas), the OpenAI Agents SDK (an agent whose Python function tool
is called and whose result flows back to a final answer) and LangChain's ``ChatOpenAI``
(``bind_tools``, ``with_structured_output``), against a real server process with the bundled
SmolLM2 (the generic tool format). Every call's arguments and every structured output validate
against their schemas; a conversation with tool calls and results is a session like any other,
reused whole from turn to turn, after a restart too. No network: the Agents SDK's tracing is off,
and nothing here fetches anything at run time."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
from typing import Any, Literal

import jsonschema
import openai
import pytest

from muxworker.serve.process import ServerProcess

pytestmark = pytest.mark.slow

WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city",
            "parameters": WEATHER_SCHEMA,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    },
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
ARGS = ["--max_sessions", "4", "--max_session_tokens", "4096"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    store = tmp_path_factory.mktemp("agents-store")
    with ServerProcess(["--store", str(store), *ARGS], log_path=store.parent / "agents.log") as s:
        yield s


def _client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def _validated(calls) -> list[tuple[str, dict]]:
    out = []
    for call in calls:
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, SCHEMAS[call.function.name])
        out.append((call.function.name, args))
    return out


def test_tool_choice_required_named_auto_and_none(server):
    client = _client(server)
    kw = {"model": server.model, "messages": ASK, "tools": TOOLS, "max_tokens": 96}
    for temperature in (0, 1):
        reply = client.chat.completions.create(**kw, tool_choice="required", temperature=temperature, seed=3)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert _validated(choice.message.tool_calls)
        assert all(c.id.startswith("call_") and c.type == "function" for c in choice.message.tool_calls)
    named = client.chat.completions.create(
        **kw, tool_choice={"type": "function", "function": {"name": "add"}}, temperature=0
    )
    assert [name for name, _ in _validated(named.choices[0].message.tool_calls)] == ["add"]
    auto = client.chat.completions.create(**kw, temperature=0)  # the model picks; either way it parses
    message = auto.choices[0].message
    assert (message.tool_calls and _validated(message.tool_calls)) or (message.content and not message.tool_calls)
    none = client.chat.completions.create(**kw, tool_choice="none", temperature=0)
    assert none.choices[0].message.tool_calls is None and none.choices[0].message.content
    assert none.choices[0].finish_reason in ("stop", "length")


def test_streamed_tool_call_deltas_assemble_into_the_same_call(server):
    client = _client(server)
    kw = {"model": server.model, "messages": ASK, "tools": TOOLS, "tool_choice": "required", "temperature": 0}
    whole = client.chat.completions.create(**kw, max_tokens=96, extra_body={"cache_salt": "whole"})
    chunks = list(
        client.chat.completions.create(**kw, max_tokens=96, stream=True, extra_body={"cache_salt": "streamed"})
    )
    calls: dict[int, dict] = {}
    for chunk in chunks:
        for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            call = calls.setdefault(delta.index, {"id": None, "name": None, "arguments": ""})
            if delta.id:
                assert call["id"] is None and call["arguments"] == ""  # id and name come first
                call["id"], call["name"] = delta.id, delta.function.name
            call["arguments"] += delta.function.arguments or ""
    assert [c.finish_reason for c in (ch.choices[0] for ch in chunks if ch.choices)][-1] == "tool_calls"
    expected = [(c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls]
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == expected
    assert all(c["id"].startswith("call_") for c in calls.values())


def test_a_tool_conversation_is_a_session_reused_whole_after_a_restart(tmp_path):
    """Tool results appended: each turn prefills only its new messages, before and after a restart."""
    store = tmp_path / "sessions"
    kw = {"tools": TOOLS, "temperature": 0, "max_tokens": 96, "extra_body": {"session_id": "agent-1"}}
    messages = list(ASK)
    previous = 0
    for server_turns in ((0, 1), (2,)):  # the third turn on a new server: the session comes from the store
        with ServerProcess(["--store", str(store), *ARGS], log_path=tmp_path / f"serve{server_turns[0]}.log") as s:
            client = _client(s)
            for turn in server_turns:
                choice = "required" if turn < 2 else "none"
                reply = client.chat.completions.create(model=s.model, messages=messages, tool_choice=choice, **kw)
                usage = reply.usage
                if turn:
                    assert usage.prompt_tokens_details.cached_tokens >= 0.9 * previous, (turn, usage, previous)
                previous = usage.prompt_tokens + usage.completion_tokens
                message = reply.choices[0].message
                if turn == 2:
                    assert message.content and not message.tool_calls
                    break
                _validated(message.tool_calls)
                messages.append(message.model_dump(exclude_none=True))
                for call in message.tool_calls:
                    messages.append({"role": "tool", "tool_call_id": call.id, "content": "18 degrees, sunny"})


def _run_agent(server: ServerProcess, agent: dict, question: str, max_turns: int, hooks: Any, api: str = "chat") -> Any:
    """Run an Agents SDK agent (``agent``: its keyword arguments) on the server, greedy, tool_choice
    required until ``hooks`` say otherwise, over chat completions or (``api="responses"``) the SDK's
    default Responses model; its client is closed in the run's own event loop."""
    import agents

    async def run() -> Any:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0) as client:
            kind = agents.OpenAIResponsesModel if api == "responses" else agents.OpenAIChatCompletionsModel
            built = agents.Agent(
                **agent,
                model=kind(model=server.model, openai_client=client),
                model_settings=agents.ModelSettings(temperature=0, tool_choice="required", max_tokens=96),
                reset_tool_choice=False,
            )
            return await agents.Runner.run(built, question, max_turns=max_turns, hooks=hooks)

    return asyncio.run(run())


def test_an_agents_sdk_agent_calls_its_function_and_answers(server):
    """With the SDK's default model, the Responses one (the output-type test below runs its chat
    completions model)."""
    os.environ["OPENAI_AGENTS_DISABLE_TRACING"] = "1"
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    called: list[tuple[str, str]] = []

    @agents.function_tool
    def get_weather(city: str, unit: Literal["celsius", "fahrenheit"]) -> str:
        """Get the current weather in a city, in celsius or fahrenheit."""
        called.append((city, unit))
        return f"It is 18 degrees {unit} and sunny in {city}."

    class AnswerAfter(agents.RunHooks):
        """The agent calls its tool five times (tool_choice required), then must answer."""

        async def on_tool_end(self, context, agent, tool, result):
            if len(called) >= 5:
                agent.model_settings = dataclasses.replace(agent.model_settings, tool_choice="none")

    agent = dict(name="weather", instructions="You answer questions about the weather.", tools=[get_weather])
    result = _run_agent(server, agent, "What is the weather in Paris?", 8, AnswerAfter(), "responses")
    assert len(called) == 5 and all(unit in ("celsius", "fahrenheit") for _, unit in called)
    assert isinstance(result.final_output, str) and result.final_output.strip()
    # The requests name no session and resend the whole history (the Responses model stores each
    # response too): each continues the previous turn's session, from turn 2 on at least 90% of
    # the previous prompt plus reply.
    usages = [r.usage for r in result.raw_responses]
    assert len(usages) == 6
    for before, after in zip(usages, usages[1:]):
        assert after.input_tokens_details.cached_tokens >= 0.9 * (before.input_tokens + before.output_tokens)


def test_langchain_bind_tools_and_structured_output(server):
    langchain_openai = pytest.importorskip("langchain_openai")
    from pydantic import BaseModel, Field

    llm = langchain_openai.ChatOpenAI(
        model=server.model, base_url=server.url + "/v1", api_key="none", temperature=0, max_tokens=96, max_retries=0
    )
    tools = [t["function"] for t in TOOLS]
    message = llm.bind_tools(tools, tool_choice="get_weather").invoke("What is the weather in Paris?")
    assert [c["name"] for c in message.tool_calls] == ["get_weather"]
    jsonschema.validate(message.tool_calls[0]["args"], WEATHER_SCHEMA)
    # LangChain's "any" is OpenAI's "required"; one call (a small model may repeat parallel calls).
    required = llm.bind_tools(tools, tool_choice="any", parallel_tool_calls=False).invoke("Add 2 and 3.")
    assert len(required.tool_calls) == 1 and required.tool_calls[0]["name"] in SCHEMAS
    jsonschema.validate(required.tool_calls[0]["args"], SCHEMAS[required.tool_calls[0]["name"]])

    class City(BaseModel):
        name: str = Field(max_length=30)
        country: str = Field(max_length=30)
        population: int

    city = llm.with_structured_output(City, method="json_schema", strict=True).invoke("Describe Paris.")
    assert isinstance(city, City)
    jsonschema.validate(city.model_dump(), City.model_json_schema())


def test_an_agents_sdk_agent_with_an_output_type_answers_in_it(server):
    """output_type and tools together (response_format beside tools): a call, then the answer as
    the agent's structured output."""
    agents = pytest.importorskip("agents")
    from pydantic import BaseModel, Field

    agents.set_tracing_disabled(True)

    class Report(BaseModel):
        city: str = Field(max_length=30)
        degrees: int

    called: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        called.append(city)
        return f"It is 18 degrees in {city}."

    class AnswerAfterOne(agents.RunHooks):
        async def on_tool_end(self, context, agent, tool, result):
            agent.model_settings = dataclasses.replace(agent.model_settings, tool_choice="none")

    agent = dict(name="reporter", instructions="You report the weather.", tools=[get_weather], output_type=Report)
    result = _run_agent(server, agent, "What is the weather in Oslo?", 4, AnswerAfterOne())
    assert len(called) == 1 and isinstance(result.final_output, Report)
