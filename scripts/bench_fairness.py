"""Fair admission against a real server (issue 40's targets), the bundled SmolLM2 by default.

1. Flood: ``--max-concurrent-requests 2 --max-queued-requests 8`` and two API keys. Tenant B's
   chat request (``max_tokens`` 16) alone, then while tenant A has 60 of the same in flight at once.
   Prints B's status and latency in both rounds and their ratio (target: served, <= 3x), and how
   many of A's were answered and refused.
2. Stalled readers: the default flags (and again with ``--max-concurrent-requests 4``, every slot
   taken by them). Four clients open streams with a 2 KiB receive buffer and never read; meanwhile
   a bystander sends requests one after another. Prints the bystanders' statuses and latencies
   (target: 0 refused).

    python scripts/bench_fairness.py [--model PATH] [--bystanders 5]
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from muxworker.serve.process import ServerProcess

CHAT = {"messages": [{"role": "user", "content": "Name three colours of the rainbow."}], "max_tokens": 16}


def _ask(url: str, key: str | None = None) -> tuple[int, float]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/chat/completions", json={**CHAT, "temperature": 0}, headers=headers, timeout=300)
    return r.status_code, time.perf_counter() - t0


def flood(model: list[str], tmp: Path, flood_size: int) -> None:
    args = [*model, "--store", str(tmp / "flood-store"), "--max-concurrent-requests", "2"]
    args += ["--max-queued-requests", "8", "--api-key", "key-a", "--api-key", "key-b"]
    with ServerProcess(args, log_path=tmp / "flood.log") as server:
        _ask(server.url, "key-b")  # warm
        alone = statistics.median(_ask(server.url, "key-b")[1] for _ in range(3))
        with ThreadPoolExecutor(flood_size) as pool:
            burst = [pool.submit(_ask, server.url, "key-a") for _ in range(flood_size)]
            time.sleep(0.5)  # A's requests are in: two run, eight wait, the rest were refused
            status, loaded = _ask(server.url, "key-b")
            codes = [f.result()[0] for f in burst]
    print("## tenant A floods, tenant B asks (--max-concurrent-requests 2 --max-queued-requests 8)")
    print(f"B alone: {alone:.2f} s (median of 3)")
    print(f"B while A has {flood_size} in flight: status {status}, {loaded:.2f} s = {loaded / alone:.1f}x alone")
    print(
        f"A: {codes.count(200)} answered, {codes.count(429)} refused (429), other {len(codes) - codes.count(200) - codes.count(429)}"
    )


def _stalled_stream(url: str) -> socket.socket:
    parts = urlsplit(url)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    sock.connect((parts.hostname, parts.port))
    body = json.dumps(
        {**CHAT, "max_tokens": 128, "ignore_eos": True, "stream": True, "logprobs": True, "top_logprobs": 5}
    ).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    sock.sendall(head.encode() + body)
    return sock


def stalled(model: list[str], tmp: Path, extra: list[str], bystanders: int) -> None:
    args = [*model, "--store", str(tmp / "stalled-store"), *extra]
    with ServerProcess(args, log_path=tmp / "stalled.log") as server:
        _ask(server.url)  # warm
        alone = statistics.median(_ask(server.url)[1] for _ in range(3))
        socks = [_stalled_stream(server.url) for _ in range(4)]
        try:
            time.sleep(0.5)  # the four are generating
            results = [_ask(server.url) for _ in range(bystanders)]
        finally:
            for sock in socks:
                sock.close()
    codes = [c for c, _ in results]
    print(f"## 4 stalled readers, {' '.join(extra) or 'default flags'}")
    print(f"bystander alone: {alone:.2f} s; with the stalled four: {', '.join(f'{t:.2f}' for _, t in results)} s")
    print(f"bystanders refused (429): {codes.count(429)} of {len(codes)}; statuses {codes}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="a model directory or GGUF (default: the bundled SmolLM2)")
    p.add_argument("--flood", type=int, default=60)
    p.add_argument("--bystanders", type=int, default=5)
    a = p.parse_args()
    model = ["--model", a.model] if a.model else []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        flood(model, tmp, a.flood)
        stalled(model, tmp, [], a.bystanders)
        stalled(model, tmp, ["--max-concurrent-requests", "4"], a.bystanders)


if __name__ == "__main__":
    main()
