"""An agent loop through the OpenAI Agents SDK against the HTTP server (the bundled SmolLM2, the
generic tool format): the agent calls its Python function tool ``--turns`` times (tool_choice
required), then answers (tool_choice none). Prints, per model call, the prompt and reply tokens and
``cached_tokens`` against the previous call's prompt plus reply: the requests carry no session
id, so the reuse is the server's reuse without a session id (client/serve/reuse.py), tool results
included.

    python scripts/bench_agents.py [--turns 5] [--prefix-cache-entries 0]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import time
from typing import Literal

os.environ.setdefault("OPENAI_AGENTS_DISABLE_TRACING", "1")

import agents  # noqa: E402
import openai  # noqa: E402

from muxworker.serve.process import ServerProcess  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--prefix-cache-entries", type=int, default=0)
    args = p.parse_args()
    agents.set_tracing_disabled(True)
    called: list[str] = []

    @agents.function_tool
    def get_weather(city: str, unit: Literal["celsius", "fahrenheit"]) -> str:
        """Get the current weather in a city, in celsius or fahrenheit."""
        called.append(city)
        return f"It is 18 degrees {unit} and sunny in {city}."

    class AnswerAfter(agents.RunHooks):
        async def on_tool_end(self, context, agent, tool, result):
            if len(called) >= args.turns:
                agent.model_settings = dataclasses.replace(agent.model_settings, tool_choice="none")

    server_args = ["--max_sessions", "4", "--max_session_tokens", "4096"]
    server_args += ["--prefix_cache_entries", str(args.prefix_cache_entries)]

    async def run(server: ServerProcess) -> agents.RunResult:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0) as client:
            agent = agents.Agent(
                name="weather",
                instructions="You answer questions about the weather.",
                tools=[get_weather],
                model=agents.OpenAIChatCompletionsModel(model=server.model, openai_client=client),
                model_settings=agents.ModelSettings(temperature=0, tool_choice="required", max_tokens=96),
                reset_tool_choice=False,
            )
            question = "What is the weather in Paris?"
            return await agents.Runner.run(agent, question, max_turns=args.turns + 2, hooks=AnswerAfter())

    with ServerProcess(server_args) as server:
        t0 = time.perf_counter()
        result = asyncio.run(run(server))
        seconds = time.perf_counter() - t0
    print(f"{len(called)} tool calls, final answer {result.final_output!r:.80} ({seconds:.1f} s)")
    print("| call | prompt | reply | cached | previous prompt + reply | cached / previous |")
    print("|---:|---:|---:|---:|---:|---:|")
    previous = None
    for i, response in enumerate(result.raw_responses, 1):
        u = response.usage
        cached = u.input_tokens_details.cached_tokens
        share = f"{cached / previous:.3f}" if previous else ""
        print(f"| {i} | {u.input_tokens} | {u.output_tokens} | {cached} | {previous or ''} | {share} |")
        previous = u.input_tokens + u.output_tokens
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
