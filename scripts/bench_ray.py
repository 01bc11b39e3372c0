"""Ray Serve scale-out: throughput of 1 replica against 2, side by side in one run.

A local Ray cluster (``--num-cpus``, default all cores) serves the bundled SmolLM2 through
``muxworker.serve.ray`` with 1 and then 2 replicas, each a server and a worker of ``--threads``
threads. ``--clients`` concurrent clients each hold one session and stream ``--turns`` turns of
``--tokens`` tokens (greedy, ignore_eos). Printed: generated tokens per second for each, their
ratio (2 replicas / 1; ideal 2.0 on a machine with a core per worker thread), how sessions split
over the replicas, and the RSS of the whole process tree.

    python scripts/bench_ray.py [--clients 8] [--turns 2] [--tokens 32] [--threads 1] [--num-cpus N]
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx

from muxworker.serve.process import tree_rss
from muxworker.serve.ray import REPLICA_HEADER, deployment


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _client(url: str, k: int, turns: int, tokens: int) -> tuple[int, str]:
    messages = [{"role": "user", "content": f"Write a long story about the number {k}."}]
    made, replica = 0, ""
    with httpx.Client(timeout=600) as http:
        for _ in range(turns):
            body = {
                "model": "m",
                "messages": messages,
                "max_tokens": tokens,
                "temperature": 0,
                "ignore_eos": True,
                "stream": False,
            }
            r = http.post(url + "/v1/chat/completions", json=body, headers={"X-Session-Id": f"bench-{k}"})
            r.raise_for_status()
            out = r.json()
            made += out["usage"]["completion_tokens"]
            replica = r.headers.get(REPLICA_HEADER, "")
            messages += [out["choices"][0]["message"], {"role": "user", "content": "Go on."}]
    return made, replica


def _measure(replicas: int, args: argparse.Namespace, store: str) -> dict:
    import ray
    from ray import serve

    port = _free_port()
    ray.init(num_cpus=args.num_cpus or os.cpu_count(), include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        server_args = ["--store", store, "--served-model-name", "m", "--threads", str(args.threads)]
        server_args += ["--max_sessions", str(args.clients)]
        serve.run(deployment(server_args, replicas=replicas), name="muxworker", route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        for k in range(replicas):  # warm-up: page the weights in
            _client(url, -1 - k, 1, 4)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(args.clients) as pool:
            results = list(pool.map(lambda k: _client(url, k, args.turns, args.tokens), range(args.clients)))
        elapsed = time.perf_counter() - t0
        rss = tree_rss(os.getpid())
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
    made = sum(m for m, _ in results)
    return {"tok_s": made / elapsed, "split": sorted(Counter(r for _, r in results).values()), "rss": rss}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--turns", type=int, default=2)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--num-cpus", type=int, default=None)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        one = _measure(1, args, os.path.join(tmp, "one"))
        two = _measure(2, args, os.path.join(tmp, "two"))
    print(
        f"\n## Ray Serve: {args.clients} sessions x {args.turns} turns x {args.tokens} tokens, "
        f"workers of {args.threads} thread(s), {os.cpu_count()} cores\n"
    )
    print("| replicas | tokens/s | sessions per replica | RSS of everything, GiB |")
    print("|---:|---:|---|---:|")
    for n, r in ((1, one), (2, two)):
        print(f"| {n} | {r['tok_s']:.1f} | {'/'.join(map(str, r['split']))} | {r['rss'] / 2**30:.2f} |")
    print(f"\nratio 2 replicas / 1: {two['tok_s'] / one['tok_s']:.2f} (ideal 2.0 with a free core per worker thread)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
