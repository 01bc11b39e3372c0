"""Whether sampled tool calls come back whole: the bundled SmolLM2 (the generic tool format) on a
real server, a 2-tool set (``get_weather`` with an enum ``unit`` and a free ``city``; ``search``
with a free ``query``), ``tool_choice: "required"``, temperature 1, one request per seed, each
streamed and not.

- Streamed: each call's deltas are gathered by their ``index``; a call counts as whole when its
  arguments parse as JSON on their own (a call cut by ``max_tokens`` is the last one of a reply
  that finished ``length``, and is counted apart). Every index must carry exactly one id, and the
  ids must differ.
- Not streamed: the reply is asked with ``logprobs``, whose token bytes give the text the model
  wrote; the complete calls in that text (read here with ``json``, apart from the server's
  parser) must be exactly the reply's ``message.tool_calls``.

The target of issue 40: seeds 0-99, max_tokens 64, no seed with a failure. :func:`judge` says
what a failure is; tests/client/serve/test_tools.py runs a few seeds through it.

    python scripts/bench_tool_calls.py [--seeds 100] [--max-tokens 64] [--parallel-tool-calls false] [--verbose]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from muxworker.serve.process import ServerProcess

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the web",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}},
                "required": ["query"],
                "additionalProperties": False,
            },
        },
    },
]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def request_body(model: str, seed: int, max_tokens: int, parallel: bool = True) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "messages": ASK,
        "tools": TOOLS,
        "tool_choice": "required",
        "temperature": 1,
        "seed": seed,
        "max_tokens": max_tokens,
    }
    if not parallel:
        body["parallel_tool_calls"] = False
    return body


def parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def streamed_calls(client: httpx.Client, body: dict[str, Any]) -> tuple[dict[int, dict[str, Any]], str | None]:
    """The calls of a streamed reply by index (their ids, names and arguments), and its finish reason."""
    calls: dict[int, dict[str, Any]] = {}
    finish = None
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            for choice in json.loads(line[6:]).get("choices", []):
                for d in choice["delta"].get("tool_calls") or []:
                    call = calls.setdefault(d["index"], {"ids": [], "name": None, "arguments": ""})
                    if d.get("id"):
                        call["ids"].append(d["id"])
                        call["name"] = d["function"]["name"]
                    call["arguments"] += d["function"].get("arguments") or ""
                finish = choice.get("finish_reason") or finish
    return calls, finish


def written_calls(text: str) -> list[tuple[str, str]]:
    """The complete calls of the generic format's reply ``text`` (``{"tool_calls": [call, ...]}``,
    possibly cut anywhere): each call's name and its arguments' JSON text. A call is complete when
    its arguments are (a reply cut before the call's own closing brace keeps it)."""
    head = '{"tool_calls": ['
    if not text.startswith(head):
        return []
    decoder, pos = json.JSONDecoder(), len(head)
    out: list[tuple[str, str]] = []
    while True:
        try:
            call, end = decoder.raw_decode(text, pos)
        except ValueError:
            try:  # the last call, cut just before its closing brace
                call, end = decoder.raw_decode(text + "}", pos)
            except ValueError:
                return out
            if end != len(text) + 1:
                return out
        out.append((call["name"], json.dumps(call["arguments"], ensure_ascii=False)))
        if not text.startswith(", ", end):
            return out
        pos = end + 2


def whole_reply(client: httpx.Client, body: dict[str, Any]) -> tuple[list[tuple[str, str]], str, str]:
    """A reply not streamed: the calls it carries, the text the model wrote (from its logprobs'
    token bytes), and its finish reason."""
    resp = client.post("/v1/chat/completions", json={**body, "logprobs": True})
    resp.raise_for_status()
    choice = resp.json()["choices"][0]
    text = bytes(b for e in choice["logprobs"]["content"] for b in e["bytes"]).decode("utf-8", "replace")
    carried = [(c["function"]["name"], c["function"]["arguments"]) for c in choice["message"].get("tool_calls") or []]
    return carried, text, choice["finish_reason"]


def sample(client: httpx.Client, model: str, seed: int, max_tokens: int = 64, parallel: bool = True) -> dict[str, Any]:
    """One seed's request, streamed and not: what :func:`judge` reads."""
    body = request_body(model, seed, max_tokens, parallel)
    calls, finish = streamed_calls(client, body)
    carried, text, whole_finish = whole_reply(client, body)
    return {"seed": seed, "calls": calls, "finish": finish, "carried": carried, "text": text,
            "written": written_calls(text), "whole_finish": whole_finish, "parallel": parallel}  # fmt: skip


def judge(row: dict[str, Any]) -> list[str]:
    """What is wrong with one seed's replies (nothing: an empty list).

    Streamed: at least one call; each index has exactly one id, all ids differ, and every index's
    arguments parse on their own, but the last of a reply that finished ``length`` (cut short).
    Not streamed: ``message.tool_calls`` are exactly the complete calls of the text written, the
    reply finishes ``tool_calls`` once the text is whole (``length`` when cut); under
    ``parallel_tool_calls: false``, one call at most, streamed and not."""
    out = []
    calls, finish = row["calls"], row["finish"]
    if not calls or finish not in ("tool_calls", "length"):
        out.append(f"streamed: {len(calls)} calls, finish_reason {finish}")
    ids = [i for c in calls.values() for i in c["ids"]]
    if any(len(c["ids"]) != 1 for c in calls.values()) or len(set(ids)) != len(ids):
        out.append(f"streamed: ids by index {[c['ids'] for c in calls.values()]}")
    for index, call in calls.items():
        if not parses(call["arguments"]) and not (finish == "length" and index == max(calls)):
            out.append(f"streamed: call {index}'s arguments do not parse: {call['arguments']!r}")
    if row["carried"] != row["written"]:
        out.append(f"not streamed: carried {row['carried']} but wrote {row['written']} in {row['text']!r}")
    closed = row["text"].endswith("]}")
    if row["whole_finish"] != ("tool_calls" if closed else "length"):
        out.append(f"not streamed: finish_reason {row['whole_finish']} for {row['text']!r}")
    if not row["parallel"] and (len(calls) > 1 or len(row["carried"]) > 1):
        out.append(f"parallel_tool_calls false: {len(calls)} streamed calls, {len(row['carried'])} carried")
    return out


def report(rows: list[dict[str, Any]], elapsed: float, max_tokens: int, verbose: bool) -> int:
    n = len(rows)
    streamed = whole = cut = 0
    finishes: dict[str, int] = {}
    counts: dict[int, int] = {}
    failed = 0
    for row in rows:
        calls, finish = row["calls"], row["finish"]
        finishes[finish] = finishes.get(finish, 0) + 1
        counts[len(row["carried"])] = counts.get(len(row["carried"]), 0) + 1
        for index, call in calls.items():
            streamed += 1
            if parses(call["arguments"]):
                whole += 1
            elif finish == "length" and index == max(calls):
                cut += 1
        problems = judge(row)
        failed += bool(problems)
        for problem in problems:
            print(f"seed {row['seed']}: {problem}", file=sys.stderr)
        if verbose:
            print(
                f"seed {row['seed']}: {finish}, {len(calls)} streamed, {len(row['carried'])} carried: {row['text']!r}"
            )
    kept = sum(len(r["carried"]) for r in rows if r["carried"] == r["written"])
    written = sum(len(r["written"]) for r in rows)
    carried_ok = sum(r["carried"] == r["written"] for r in rows)
    print(f"{n} seeds, max_tokens {max_tokens}, parallel_tool_calls {rows[0]['parallel']}: {elapsed:.1f} s")
    print(f"streamed: finish reasons {finishes}; {streamed} calls on their own index: {whole} parse, "
          f"{cut} cut by max_tokens (the last of a 'length' reply), {streamed - whole - cut} broken")  # fmt: skip
    print(f"not streamed: {carried_ok}/{n} replies carry exactly the complete calls written "
          f"({kept} of {written}); replies by calls carried: {dict(sorted(counts.items()))}")  # fmt: skip
    print(f"seeds with any failure: {failed}/{n}")
    return 1 if failed else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=100, help="seeds 0..N-1")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--parallel-tool-calls", choices=["true", "false"], default="true")
    p.add_argument("--clients", type=int, default=4, help="requests in flight at once")
    p.add_argument("--url", help="a running server (default: start one with the bundled model)")
    p.add_argument("--verbose", action="store_true", help="a line per seed: its finish reason, calls and text")
    args = p.parse_args()
    parallel = args.parallel_tool_calls == "true"

    def run(url: str, model: str) -> int:
        with httpx.Client(base_url=url, timeout=600) as client, ThreadPoolExecutor(args.clients) as pool:
            t0 = time.perf_counter()
            rows = list(
                pool.map(lambda seed: sample(client, model, seed, args.max_tokens, parallel), range(args.seeds))
            )
            elapsed = time.perf_counter() - t0
        return report(rows, elapsed, args.max_tokens, args.verbose)

    if args.url:
        model = httpx.get(args.url + "/v1/models").json()["data"][0]["id"]
        return run(args.url, model)
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "serve.log"
        with ServerProcess(["--max_sessions", str(args.clients), "--max_session_tokens", "4096"], log_path=log) as s:
            return run(s.url, s.model)


if __name__ == "__main__":
    sys.exit(main())
