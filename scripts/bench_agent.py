"""The main job against the peer users would pick: an agent trace replayed against muxworker's
HTTP server and llama.cpp's own OpenAI server (llama-cpp-python[server] in the peer venv, `make
bench-peer` builds it) on the same GGUF, side by side in one run.

The trace is an agent session as coding agents send it: a long system prompt, a task, then turns
of (the agent's reply, a tool result of a few hundred tokens), the whole history resent every turn
with no session id (what opencode, aider and the OpenAI SDKs send). Each turn streams a reply of
``--reply-tokens`` (greedy; the trace's own reply, not the model's, goes into the next turn's
history, as a replayed trace does). Modes: each server straight through, and restarted every
``--restart-every`` turns (a graceful stop: muxworker saves its sessions; llama.cpp keeps nothing);
muxworker both with no session id and with X-Session-Id.

Prints per mode: total request time (server restarts excluded), mean time to first token, the
last turn's, and for muxworker the share of each turn's prompt that was reused, against the
previous turn's prompt plus reply (the reuse target: >= 90% from turn 2).

    python scripts/bench_agent.py [--turns 16] [--restart-every 5] [--peer-python .venv-peer/bin/python]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from muxworker.serve.process import ServerProcess
from muxworker.worker.models.loader import bundled_gguf_path

SYSTEM = (
    "You are a coding agent working in a Python repository. You read files with the read tool, run "
    "tests with the test tool and edit files with the edit tool. Think about what the user asked, look "
    "at the code before you change it, keep changes small, and run the tests after each change. When a "
    "test fails, read its output carefully and fix the cause rather than the symptom. Answer briefly. "
) * 4
TASK = "The function parse_config in config.py drops keys that contain dots. Find out why and fix it."


def tool_result(turn: int) -> str:
    """A file or test output of a few hundred tokens, different every turn."""
    lines = [f"# file src/module_{turn}.py"]
    for i in range(8):
        lines.append(f"def helper_{turn}_{i}(value, key='k{i}'):  # line {i}")
        lines.append(f"    return value.get(key, {turn * 100 + i})")
    return "\n".join(lines)


def reply(turn: int) -> str:
    return f"Turn {turn}: I read module_{turn}.py; helper_{turn}_3 looks relevant. Next I will read the next module."


def conversation(turns: int) -> list[list[dict]]:
    """The message list each turn sends (the whole history, then the newest tool result)."""
    history = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASK}]
    out = []
    for t in range(turns):
        out.append(list(history))
        history += [
            {"role": "assistant", "content": reply(t)},
            {"role": "user", "content": "Tool result:\n" + tool_result(t)},
        ]
    return out


@dataclass
class Turn:
    ttft: float
    total: float
    prompt: int | None = None
    cached: int | None = None
    completion: int | None = None


@dataclass
class Run:
    name: str
    turns: list[Turn] = field(default_factory=list)


def stream_turn(base: str, model: str, messages: list[dict], reply_tokens: int, headers: dict) -> Turn:
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": reply_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    ttft = None
    usage = None
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, headers=headers, timeout=600) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {r.read().decode()[:500]}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if ttft is None and chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                ttft = time.perf_counter() - t0
            if chunk.get("usage"):
                usage = chunk["usage"]
    total = time.perf_counter() - t0
    turn = Turn(ttft if ttft is not None else total, total)
    if usage:
        turn.prompt = usage["prompt_tokens"]
        turn.completion = usage["completion_tokens"]
        turn.cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    return turn


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaCppServer:
    """llama-cpp-python's OpenAI server on the GGUF, one context of ``n_ctx`` (its prompt cache:
    the common prefix with the last prompt of that context)."""

    def __init__(self, python: str, gguf: Path, n_ctx: int, threads: int) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = "peer"
        self.cmd = [python, "-m", "llama_cpp.server", "--model", str(gguf), "--model_alias", "peer"]
        self.cmd += ["--n_ctx", str(n_ctx), "--n_threads", str(threads), "--n_threads_batch", str(threads)]
        self.cmd += ["--n_batch", "512", "--host", "127.0.0.1", "--port", str(self.port)]
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> LlamaCppServer:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "DO_NOT_TRACK": "1"}
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/v1/models", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama.cpp's server exited with {self.proc.returncode}")
            time.sleep(0.2)
        raise RuntimeError("llama.cpp's server did not start in 120 s")

    def __exit__(self, *exc: object) -> None:
        assert self.proc is not None
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def run_mode(name: str, start, convo: list[list[dict]], args, headers: dict) -> Run:
    run = Run(name)
    server = None
    try:
        for t, messages in enumerate(convo):
            if server is None or (args.restart_every and t and t % args.restart_every == 0 and "restart" in name):
                if server is not None:
                    server.__exit__(None, None, None)
                server = start()
                server.__enter__()
            run.turns.append(stream_turn(server.url, server.model, messages, args.reply_tokens, headers))
            print(f"  {name} turn {t + 1}: ttft {run.turns[-1].ttft * 1000:.0f} ms", file=sys.stderr, flush=True)
    finally:
        if server is not None:
            server.__exit__(None, None, None)
    return run


def reuse_shares(run: Run) -> list[float]:
    """Per turn from the second: cached tokens / (previous prompt + previous reply)."""
    out = []
    for prev, cur in zip(run.turns, run.turns[1:]):
        if cur.cached is None or prev.prompt is None:
            return []
        out.append(cur.cached / (prev.prompt + (prev.completion or 0)))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--turns", type=int, default=16)
    p.add_argument("--restart-every", type=int, default=5)
    p.add_argument("--reply-tokens", type=int, default=24)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--peer-python", default=".venv-peer/bin/python")
    p.add_argument("--skip-peer", action="store_true")
    args = p.parse_args()
    convo = conversation(args.turns)
    gguf = bundled_gguf_path()
    n_ctx = 8192
    runs: list[Run] = []
    with tempfile.TemporaryDirectory() as tmp:
        if not args.skip_peer:
            for name in ("llama.cpp", "llama.cpp restart"):
                runs.append(
                    run_mode(name, lambda: LlamaCppServer(args.peer_python, gguf, n_ctx, args.threads), convo, args, {})
                )
        for label, headers in (("no id", {}), ("X-Session-Id", {"X-Session-Id": "agent-1"})):
            for restart in (False, True):
                store = Path(tmp) / f"store-{len(runs)}"
                name = f"muxworker {label}" + (" restart" if restart else "")
                server_args = ["--store", str(store), "--max_session_tokens", str(n_ctx), "--max_sessions", "4"]
                runs.append(
                    run_mode(
                        name,
                        lambda a=server_args, n=name: ServerProcess(a, log_path=Path(tmp) / f"{n}.log"),
                        convo,
                        args,
                        headers,
                    )
                )
    last_prompt = next((t.prompt for r in runs for t in r.turns[-1:] if t.prompt), None)
    print(f"\nAgent trace: {args.turns} turns, the history resent each turn, {last_prompt} prompt tokens at the end")
    print(f"({args.reply_tokens}-token replies, restarts every {args.restart_every} turns in the restart modes)\n")
    print("| mode | total s | mean TTFT ms | last TTFT ms | reuse from turn 2 (min / mean) |")
    print("|---|---:|---:|---:|---:|")
    for r in runs:
        total = sum(t.total for t in r.turns)
        shares = reuse_shares(r)
        share = f"{min(shares):.0%} / {statistics.mean(shares):.0%}" if shares else "-"
        mean_ttft = statistics.mean(t.ttft for t in r.turns) * 1000
        print(f"| {r.name} | {total:.1f} | {mean_ttft:.0f} | {r.turns[-1].ttft * 1000:.0f} | {share} |")
    by = {r.name: sum(t.total for t in r.turns) for r in runs}
    for suffix in ("", " restart"):
        named, none = by.get("muxworker X-Session-Id" + suffix), by.get("muxworker no id" + suffix)
        if named and none:
            print(f"\nno id / X-Session-Id{suffix or ' straight'}: {none / named:.2f}x (goal <= 1.1x)")
        peer = by.get("llama.cpp" + suffix)
        if peer and none:
            print(f"llama.cpp / muxworker no id{suffix or ' straight'}: {peer / none:.2f}x")
    print("\nTTFT per turn (ms):")
    print("| turn | " + " | ".join(r.name for r in runs) + " |")
    print("|---:|" + "---:|" * len(runs))
    for i in range(args.turns):
        print(f"| {i + 1} | " + " | ".join(f"{r.turns[i].ttft * 1000:.0f}" for r in runs) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
