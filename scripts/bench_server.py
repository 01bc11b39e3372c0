"""The HTTP server against the trio client it wraps, side by side in one run.

Prints one markdown table:

1. **16 concurrent streaming clients**: aggregate decode tokens/s through ``python -m
   muxworker.serve`` (httpx clients streaming SSE) vs the same workload through the trio client
   directly (``SessionRuntime`` in this process), on the same worker flags. Each session first
   takes a short turn (prefill off the clock); the measured turn resends its prompt, so it reuses
   the history and only decodes ``--tokens`` tokens (``ignore_eos``).
2. **Server overhead per streamed token**: the CPU the server process spends per token beyond what
   the same trio client and runtime spend in this process for the same workload (kernel counters);
   the server's own wall time per delta (``muxworker_stream_overhead_seconds``); and the same app
   alone, fed a scripted stream (no model).
3. **Resume after a restart**: sessions of ~2,000 tokens are made, the server is stopped (SIGTERM)
   and started again; the time to first token of the next turn (resumed from the store) vs the
   same conversation sent stateless (prefilled cold), median of ``--repeats``.

    python scripts/bench_server.py                  # the bundled SmolLM2-135M-Instruct
    python scripts/bench_server.py --clients 16 --tokens 128 --repeats 3
    python scripts/bench_server.py --threads 1      # leave the server a core of its own
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import trio
from hypercorn.config import Config
from hypercorn.trio import serve

from muxworker.client import (
    GenerationParams,
    GenerationResult,
    SessionRuntime,
    default_worker_command,
    spawn_multiplexed_worker,
)
from muxworker.serve.app import AppConfig, create_app
from muxworker.serve.metrics import ServerMetrics
from muxworker.serve.openai_api import ServedModel
from muxworker.serve.process import ServerProcess
from muxworker.serve.tools import GENERIC, ToolFormat
from muxworker.worker.models.loader import resolve_model

TOPICS = ["the sea", "mountains", "a city at night", "trains", "bread", "rain", "a garden", "the moon"]


def _messages(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Write a long story about {TOPICS[i % len(TOPICS)]} and the number {i}."}]


def _flags(clients: int, tokens: int, threads: int | None) -> list[str]:
    return (["--threads", str(threads)] if threads else []) + [
        "--max_sessions",
        str(clients),
        "--max_decode_sequences",
        str(clients),
        "--max_session_tokens",
        str(max(3072, 256 + 2 * tokens)),
    ]


# -- the trio client directly ------------------------------------------------------------------------


async def _direct(model_dir: Path, flags: list[str], clients: int, tokens: int) -> dict[str, float]:
    command = default_worker_command(model_dir) + flags
    async with spawn_multiplexed_worker(command) as client:
        runtime = SessionRuntime(client)
        prompts = []
        for i in range(clients):
            sid = f"d{i}"
            await runtime.open_session(sid)
            ids = (await client.apply_chat_template(_messages(i))).token_ids
            prompts.append(ids)
            await runtime.generate(sid, ids, _params(sid, 2)).wait()
        gaps: list[float] = []
        total = 0

        async def one(i: int) -> None:
            nonlocal total
            stream = runtime.generate(f"d{i}", prompts[i], _params(f"d{i}", tokens))
            last = None
            async for _ in stream:
                now = time.perf_counter()
                if last is not None:
                    gaps.append(now - last)
                last = now
            total += (await stream.wait()).completion_tokens

        t0, cpu0 = time.perf_counter(), time.process_time()
        async with trio.open_nursery() as nursery:
            for i in range(clients):
                nursery.start_soon(one, i)
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        await runtime.aclose_worker()
    return {
        "tokens_per_s": total / wall,
        "itl_ms": 1000 * statistics.median(gaps),
        "tokens": total,
        "cpu_ms_per_token": 1000 * cpu / total,  # this process: the trio client, the runtime, the loop
    }


def _params(sid: str, n: int) -> GenerationParams:
    return GenerationParams(session_id=sid, max_new_tokens=n, temperature=0.0, stop_token_ids=[])


# -- through HTTP -----------------------------------------------------------------------------------


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) the process ``pid`` has used, its children not included."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _http(url: str, pid: int, clients: int, tokens: int, tag: str) -> dict[str, float]:
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:

        async def turn(i: int, n: int, gaps: list[float] | None) -> int:
            body = {
                "messages": _messages(i),
                "max_tokens": n,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            headers = {"X-Session-Id": f"{tag}{i}"}
            last, usage = None, 0
            async with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
                if r.status_code != 200:
                    raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode()[:300]}")
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    now = time.perf_counter()
                    if '"content": "' in line and '"role"' not in line:
                        if gaps is not None and last is not None:
                            gaps.append(now - last)
                        last = now
                    elif '"usage"' in line:
                        usage = json.loads(line[6:])["usage"]["completion_tokens"]
            return usage

        for i in range(clients):
            await turn(i, 2, None)
        gaps: list[float] = []
        counts: list[int] = []

        async def one(i: int) -> None:
            counts.append(await turn(i, tokens, gaps))

        t0, cpu0 = time.perf_counter(), _cpu_s(pid)
        async with trio.open_nursery() as nursery:
            for i in range(clients):
                nursery.start_soon(one, i)
        wall, cpu = time.perf_counter() - t0, _cpu_s(pid) - cpu0
    total = sum(counts)
    return {
        "tokens_per_s": total / wall,
        "itl_ms": 1000 * statistics.median(gaps),
        "tokens": total,
        "cpu_ms_per_token": 1000 * cpu / total,  # the server process (its worker not included)
    }


def _buckets(metrics: str, name: str) -> list[tuple[float, float]]:
    """A Prometheus histogram's cumulative buckets: (upper edge, count)."""
    buckets = []
    for line in metrics.splitlines():
        if line.startswith(name + "_bucket{"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            buckets.append((float("inf") if le == "+Inf" else float(le), float(line.rsplit(" ", 1)[1])))
    return buckets


def _histogram_median(before: str, after: str, name: str) -> float:
    """The median of what a histogram observed between two scrapes, interpolated in its bucket."""
    old = dict(_buckets(before, name))
    buckets = [(edge, count - old.get(edge, 0.0)) for edge, count in _buckets(after, name)]
    total = buckets[-1][1]
    lo_edge, lo_count = 0.0, 0.0
    for edge, count in buckets:
        if count >= total / 2:
            if edge == float("inf"):
                return lo_edge
            return lo_edge + (edge - lo_edge) * (total / 2 - lo_count) / max(count - lo_count, 1e-9)
        lo_edge, lo_count = edge, count
    return float("nan")


# -- the server alone ------------------------------------------------------------------------------


class _ScriptedStream:
    """A stream of ``n`` one-word deltas, one per millisecond: the server's own cost per delta
    with no model in the process (the real app, hypercorn, h11 and the socket)."""

    def __init__(self, n: int) -> None:
        self.n, self.finished = n, False

    def __aiter__(self) -> _ScriptedStream:
        return self

    async def __anext__(self) -> str:
        if self.n == 0:
            self.finished = True
            raise StopAsyncIteration
        self.n -= 1
        await trio.sleep(0.001)
        return " word"

    async def wait(self) -> GenerationResult:
        return GenerationResult("length", 3, 0, 3, 0, [], 0.0, 0.0)

    def cancel(self) -> None:
        pass

    def logprobs_from(self, start: int) -> list:
        return []


class _ScriptedService:
    ready, last_error = True, None

    async def render_chat(self, messages: list, tools: object = None) -> list[int]:
        return [1, 2, 3]

    def tool_format(self) -> ToolFormat:
        return GENERIC

    def max_messages(self) -> None:
        return None

    async def open_ephemeral(self, tenant: object) -> tuple[str, None]:
        return "s", None

    def generate(self, *args: object) -> tuple[_ScriptedStream, None]:
        return _ScriptedStream(2000), None

    def release_ephemeral(self, *args: object) -> None:
        pass


async def _server_alone() -> float:
    """Median seconds the real app spends per streamed delta, fed by a scripted stream."""
    metrics = ServerMetrics()
    seen: list[float] = []
    observe = metrics.stream_overhead.observe
    metrics.stream_overhead.observe = lambda v: (seen.append(v), observe(v))  # type: ignore[method-assign]
    app = create_app(_ScriptedService(), metrics, AppConfig(ServedModel(("m",))))  # type: ignore[arg-type]
    config = Config()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(lambda task_status: serve(app, config, task_status=task_status))
        async with httpx.AsyncClient(base_url=binds[0]) as http:
            body = {"messages": [{"role": "user", "content": "hi"}], "stream": True}
            async with http.stream("POST", "/v1/chat/completions", json=body) as r:
                async for _ in r.aiter_raw():
                    pass
        nursery.cancel_scope.cancel()
    return statistics.median(seen)


# -- resume after a restart -----------------------------------------------------------------------


def _long_messages(k: int) -> list[dict[str, str]]:
    facts = " ".join(f"Note {k}.{i}: item {i} costs {i * 3 + k} coins and weighs {i % 7 + 1} kg." for i in range(95))
    return [{"role": "user", "content": f"Remember these notes.\n{facts}\nWhich item is heaviest?"}]


def _ttft(url: str, messages: list[dict[str, str]], session: str | None) -> tuple[float, dict]:
    headers = {"X-Session-Id": session} if session else {}
    body = {
        "messages": messages,
        "max_tokens": 4,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    first = None
    usage: dict = {}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=headers, timeout=600) as r:
        for line in r.iter_lines():
            if first is None and '"content": "' in line and '"role"' not in line:
                first = time.perf_counter() - t0
            if '"usage"' in line:
                usage = json.loads(line[6:])["usage"]
    assert first is not None, "no token came back"
    return first, usage


def _restart(store: Path, flags: list[str], repeats: int, log_dir: Path) -> dict[str, float]:
    args = ["--store", str(store), *flags]
    conversations = []
    with ServerProcess(args, log_path=log_dir / "restart-1.log") as server:
        for k in range(repeats):
            messages = _long_messages(k)
            body = {"messages": messages, "max_tokens": 8, "temperature": 0}
            reply = httpx.post(
                server.url + "/v1/chat/completions", json=body, headers={"X-Session-Id": f"long-{k}"}, timeout=600
            ).json()
            messages = messages + [
                {"role": "assistant", "content": reply["choices"][0]["message"]["content"]},
                {"role": "user", "content": "And which is the cheapest?"},
            ]
            conversations.append((messages, reply["usage"]["total_tokens"]))
    resumed, cold, cached, prompt = [], [], [], []
    with ServerProcess(args, log_path=log_dir / "restart-2.log") as server:
        _ttft(server.url, [{"role": "user", "content": "warm up"}], None)
        for k, (messages, _) in enumerate(conversations):
            t, usage = _ttft(server.url, messages, f"long-{k}")
            resumed.append(t)
            cached.append(usage["prompt_tokens_details"]["cached_tokens"])
            prompt.append(usage["prompt_tokens"])
            t, usage = _ttft(server.url, messages, None)
            assert usage["prompt_tokens_details"]["cached_tokens"] < 64, usage  # at most the template's system prompt
            cold.append(t)
    return {
        "session_tokens": statistics.median(n for _, n in conversations),
        "prompt_tokens": statistics.median(prompt),
        "cached_tokens": statistics.median(cached),
        "resumed_ttft_ms": 1000 * statistics.median(resumed),
        "cold_ttft_ms": 1000 * statistics.median(cold),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model path (default: the bundled SmolLM2)")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--tokens", type=int, default=128, help="tokens each client decodes in the measured turn")
    p.add_argument("--repeats", type=int, default=3, help="long sessions for the restart figure")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="the worker's --threads (default: one per physical core, leaving the server none of its own)",
    )
    args = p.parse_args()
    model_dir = resolve_model(args.model, progress=sys.stderr)
    flags = _flags(args.clients, args.tokens, args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        rows = []
        with ServerProcess(["--store", str(tmp_path / "store"), *flags], log_path=tmp_path / "serve.log") as server:
            for clients in (args.clients, 1):
                direct = trio.run(_direct, model_dir, flags, clients, args.tokens)
                before = httpx.get(server.url + "/metrics").text
                http = trio.run(_http, server.url, server.pid, clients, args.tokens, f"c{clients}-")
                after = httpx.get(server.url + "/metrics").text
                http["server_ms"] = 1000 * _histogram_median(before, after, "muxworker_stream_overhead_seconds")
                rows.append((clients, direct, http))
            model_name = server.model
        restart = _restart(tmp_path / "restart-store", flags, args.repeats, tmp_path)
    alone_ms = 1000 * trio.run(_server_alone)

    threads = f", worker --threads {args.threads}" if args.threads else ""
    print(f"\n## HTTP server vs the trio client ({model_name}, {args.tokens} decoded tokens per client{threads})\n")
    print(
        "| clients | trio client tok/s | HTTP tok/s | ratio (target >= 0.85) | ITL trio (ms) | ITL HTTP (ms) "
        "| CPU per token, trio client / server (ms) | server overhead per token: CPU (ms, target < 0.3) "
        "| server time per token (ms) |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for clients, direct, http in rows:
        print(
            f"| {clients} | {direct['tokens_per_s']:.1f} | {http['tokens_per_s']:.1f} | "
            f"{http['tokens_per_s'] / direct['tokens_per_s']:.2f} | {direct['itl_ms']:.2f} | {http['itl_ms']:.2f} "
            f"| {direct['cpu_ms_per_token']:.3f} / {http['cpu_ms_per_token']:.3f} "
            f"| {http['cpu_ms_per_token'] - direct['cpu_ms_per_token']:.3f} | {http['server_ms']:.3f} |"
        )
    print(
        "\nServer overhead per token: the CPU the server process spends per streamed token beyond what the "
        "same trio client and runtime spend in this process for the same workload (both from the kernel's "
        "counters over the measured turn; the worker's own CPU is in neither). Server time per token: the "
        "median of muxworker_stream_overhead_seconds over that run (wall time from the runtime handing a "
        "delta over to hypercorn taking its bytes, including other tasks that run while the send yields). "
        f"The server alone (the same app fed a scripted stream of 2,000 deltas, no model in the process): "
        f"{alone_ms:.3f} ms per delta."
    )
    ratio = restart["resumed_ttft_ms"] / restart["cold_ttft_ms"]
    print(
        f"\nAfter a server restart, a {restart['session_tokens']:.0f}-token session's next turn "
        f"({restart['prompt_tokens']:.0f} prompt tokens, {restart['cached_tokens']:.0f} cached): "
        f"first token {restart['resumed_ttft_ms']:.0f} ms resumed vs {restart['cold_ttft_ms']:.0f} ms cold "
        f"= {ratio:.3f} (target <= 0.1; median of {args.repeats})."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
