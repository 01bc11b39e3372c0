"""Issue 30's reuse and Responses targets against the HTTP server (the bundled SmolLM2), side by
side in one run:

1. previous_response_id after a server restart: time to first token of the next turn of a
   ~2,000-token conversation, against a cold prefill of the same input (goal: <= 1/10).
2. Four conversations sent round-robin, with no session id, to a worker with 2 session slots:
   each turn's reuse against the previous turn's prompt plus reply (goal: >= 90% each).
3. Streaming cost: the server process's CPU time per streamed token, Responses events against
   chat completion chunks (goal: within 1.1x).

    python scripts/bench_responses.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import openai

from muxworker.serve.process import ServerProcess

FILLER = "The quick brown fox jumps over the lazy dog near the river bank. "


def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=600)


def ttft_responses(c: openai.OpenAI, model: str, **kw) -> float:
    t0 = time.perf_counter()
    with c.responses.stream(model=model, max_output_tokens=8, temperature=0, **kw) as stream:
        for event in stream:
            if event.type == "response.output_text.delta":
                return time.perf_counter() - t0
    return time.perf_counter() - t0


def restart_target(tmp: Path, args) -> tuple[float, float, int]:
    store = str(tmp / "store-restart")
    base = ["--store", store, "--max_session_tokens", "4096"]
    long_input = "Summarize this text later.\n" + FILLER * 150  # ~2,000 tokens
    with ServerProcess(base, log_path=tmp / "restart1.log") as server:
        c = client(server)
        first = c.responses.create(model=server.model, input=long_input, max_output_tokens=16, temperature=0)
        tokens = first.usage.input_tokens + first.usage.output_tokens
    warm, cold = [], []
    with ServerProcess(base, log_path=tmp / "restart2.log") as server:
        c = client(server)
        for i in range(args.rounds):
            # The same next turn, continued from the stored response (a branch each time) ...
            warm.append(ttft_responses(c, server.model, input=f"Now in one word ({i}).", previous_response_id=first.id))
            # ... and the same whole input sent cold: nothing of it stored under this cache_salt.
            items = [
                {"role": "user", "content": long_input},
                {"role": "assistant", "content": first.output_text},
                {"role": "user", "content": f"Now in one word ({i})."},
            ]
            cold.append(
                ttft_responses(c, server.model, input=items, store=False, extra_body={"cache_salt": f"cold{i}"})
            )
    return statistics.median(warm), statistics.median(cold), tokens


def interleaved_target(tmp: Path, turns: int) -> list[float]:
    """Per conversation, the lowest reuse share of its turns 2..n."""
    args = ["--store", str(tmp / "store-rr"), "--max_sessions", "2", "--max_session_tokens", "4096"]
    worst = []
    with ServerProcess(args, log_path=tmp / "rr.log") as server:
        c = client(server)
        histories = [[{"role": "system", "content": f"You are assistant number {k}. " * 20}] for k in range(4)]
        last: list[tuple[int, int] | None] = [None] * 4
        shares: list[list[float]] = [[] for _ in range(4)]
        for t in range(turns):
            for k in range(4):
                histories[k].append({"role": "user", "content": f"Conversation {k}, turn {t}: " + FILLER * 6})
                r = c.chat.completions.create(model=server.model, messages=histories[k], max_tokens=16, temperature=0)
                u = r.usage
                if last[k] is not None:
                    prompt, reply = last[k]
                    shares[k].append(u.prompt_tokens_details.cached_tokens / (prompt + reply))
                last[k] = (u.prompt_tokens, u.completion_tokens)
                histories[k].append({"role": "assistant", "content": r.choices[0].message.content or ""})
        worst = [min(s) for s in shares]
    return worst


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def streaming_target(tmp: Path, rounds: int, tokens: int) -> tuple[float, float]:
    """Server-process CPU ms per streamed token: (chat completions, responses)."""
    args = ["--store", str(tmp / "store-cpu"), "--max_session_tokens", "4096"]
    with ServerProcess(args, log_path=tmp / "cpu.log") as server:
        assert server.process is not None
        c = client(server)
        pid = server.process.pid
        question = [{"role": "user", "content": "Write a long story about a fox."}]
        out = {"chat": [], "responses": []}
        for i in range(rounds):
            for kind in ("chat", "responses"):
                before = cpu_seconds(pid)
                count = 0
                body = dict(temperature=1.0, extra_body={"ignore_eos": True, "seed": i, "cache_salt": f"{kind}{i}"})
                if kind == "chat":
                    stream = c.chat.completions.create(
                        model=server.model, messages=question, max_tokens=tokens, stream=True, **body
                    )
                    for chunk in stream:
                        count += bool(chunk.choices and chunk.choices[0].delta.content)
                else:
                    with c.responses.stream(
                        model=server.model, input=question, max_output_tokens=tokens, store=False, **body
                    ) as stream:
                        for event in stream:
                            count += event.type == "response.output_text.delta"
                out[kind].append((cpu_seconds(pid) - before) * 1000 / max(1, count))
    return statistics.median(out["chat"]), statistics.median(out["responses"])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--stream-tokens", type=int, default=200)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        warm, cold, tokens = restart_target(tmp, args)
        worst = interleaved_target(tmp, args.turns)
        chat_ms, resp_ms = streaming_target(tmp, args.rounds, args.stream_tokens)
    print("| target | measured | goal |")
    print("|---|---:|---:|")
    print(
        f"| previous_response_id after a restart ({tokens} tokens): TTFT warm / cold | "
        f"{warm * 1000:.0f} / {cold * 1000:.0f} ms = {warm / cold:.3f} | <= 0.1 |"
    )
    print(
        f"| 4 conversations round-robin on 2 slots, no session id: worst turn's reuse per conversation | "
        f"{' / '.join(f'{w:.0%}' for w in worst)} | >= 90% |"
    )
    print(
        f"| server CPU per streamed token: Responses / chat completions | "
        f"{resp_ms:.3f} / {chat_ms:.3f} ms = {resp_ms / chat_ms:.2f}x | <= 1.1x |"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
