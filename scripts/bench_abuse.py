"""A bystander's stream while other clients send requests the server must refuse, side by side in
one run (issue 27's target: the bystander keeps >= 0.7 of its rate).

One client streams a long reply (``ignore_eos``) alone, then again while ``--attackers`` threads
loop bad requests: bodies of thousands of messages (the red team's worst: they cut a bystander from
36 to 2 tokens/s when the worker rendered them), oversized bodies, ``text/plain`` bodies, foreign
Host and Origin headers, keyless requests and malformed JSON. Prints the bystander's tokens/s in
both rounds, their ratio, and how many bad requests were refused with which status.

    python scripts/bench_abuse.py
    python scripts/bench_abuse.py --tokens 256 --attackers 4 --rounds 3
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx

from muxworker.serve.process import ServerProcess

KEY = "bench-key"


def _bystander(url: str, tokens: int) -> float:
    """Decode tokens/s of one streamed reply (from its first delta to its last)."""
    body = {
        "messages": [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}],
        "max_tokens": tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    headers = {"Authorization": f"Bearer {KEY}"}
    stamps: list[float] = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=headers, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {") and '"content": "' in line and '"role"' not in line:
                stamps.append(time.perf_counter())
    if len(stamps) < 2:
        raise RuntimeError("the bystander got no stream")
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def _bad_requests(url: str) -> list[tuple[str, dict]]:
    port = url.rsplit(":", 1)[1]
    auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    many = json.dumps({"messages": [{"role": "user", "content": "hi"}] * 10_000, "max_tokens": 4}).encode()
    return [
        ("10,000 messages", dict(content=many, headers=auth)),
        ("5 MiB body", dict(content=b"x" * (5 << 20), headers=auth)),
        ("text/plain", dict(content=b'{"messages": []}', headers={**auth, "Content-Type": "text/plain"})),
        ("foreign Host", dict(content=many, headers={**auth, "Host": f"attacker.example:{port}"})),
        ("foreign Origin", dict(content=many, headers={**auth, "Origin": "https://attacker.example"})),
        ("no key", dict(content=many, headers={"Content-Type": "application/json"})),
        ("bad JSON", dict(content=b"{" * 100_000, headers=auth)),
    ]


def _attack(url: str, stop: threading.Event, counts: collections.Counter) -> None:
    cases = _bad_requests(url)
    with httpx.Client(timeout=60) as http:
        i = 0
        while not stop.is_set():
            name, kw = cases[i % len(cases)]
            i += 1
            try:
                status = http.post(url + "/v1/chat/completions", **kw).status_code
            except httpx.HTTPError as exc:
                status = type(exc).__name__
            counts[(name, status)] += 1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=192)
    p.add_argument("--attackers", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3, help="alternating quiet and attacked streams (median)")
    p.add_argument("--threads", type=int, default=1, help="worker threads (leave the server a core)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        flags = ["--store", str(Path(tmp) / "store"), "--api-key", KEY, "--threads", str(args.threads)]
        flags += ["--max_session_tokens", "8192"]
        with ServerProcess(flags, log_path=Path(tmp) / "serve.log") as server:
            _bystander(server.url, 16)  # warm-up
            quiet, attacked = [], []
            counts: collections.Counter = collections.Counter()
            for _ in range(args.rounds):
                quiet.append(_bystander(server.url, args.tokens))
                stop = threading.Event()
                threads = [
                    threading.Thread(target=_attack, args=(server.url, stop, counts), daemon=True)
                    for _ in range(args.attackers)
                ]
                for t in threads:
                    t.start()
                time.sleep(0.5)  # the attack is under way
                try:
                    attacked.append(_bystander(server.url, args.tokens))
                finally:
                    stop.set()
                    for t in threads:
                        t.join(timeout=120)
    q, a = statistics.median(quiet), statistics.median(attacked)
    print(f"| bystander stream ({args.tokens} tokens, median of {args.rounds}) | tokens/s |")
    print("|---|---:|")
    print(f"| alone | {q:.1f} |")
    print(f"| while {args.attackers} clients loop bad requests | {a:.1f} |")
    print(f"| ratio (target >= 0.7) | {a / q:.2f} |")
    print()
    print("| bad request | status | count |")
    print("|---|---|---:|")
    for (name, status), n in sorted(counts.items(), key=lambda kv: str(kv[0])):
        print(f"| {name} | {status} | {n} |")


if __name__ == "__main__":
    main()
