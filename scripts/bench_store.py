"""The object-storage session store against raw object I/O, side by side in one run.

A 4,096-token session of the bundled SmolLM2 (bf16 KV) is saved to and resumed from S3, here moto's
S3 server on 127.0.0.1. This is the store's whole path:

- a save: the worker writes its segment into a memory file, the store uploads it and
  conditionally replaces the manifest;
- a resume: the store downloads the manifest and segments into memory files, and the worker
  restores from them with every CRC checked.

It is compared with a raw PUT and a raw GET of the same bytes through the same library (obstore)
and the same server. Targets: save <= 2x the raw PUT, resume <= 2x the raw GET.

    python scripts/bench_store.py [--tokens 4096] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import obstore
import trio

from muxworker.client import GenerationParams, default_worker_command, open_store, spawn_multiplexed_worker
from muxworker.client.object_store import connect
from muxworker.worker.models.identity import model_identity_files, worker_configuration
from muxworker.worker.models.loader import resolve_model

BUCKET = "muxworker-bench"


def _moto() -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    endpoint = f"http://127.0.0.1:{port}"
    process = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    for _ in range(600):
        try:
            httpx.get(endpoint + "/moto-api/", timeout=1)
            break
        except httpx.HTTPError:
            time.sleep(0.1)
    httpx.put(f"{endpoint}/{BUCKET}")
    return process, endpoint


def _get(store, name: str) -> bytes:
    return bytes(obstore.get(store, name).bytes())


async def _run(model_dir: Path, tokens: int, repeats: int) -> dict[str, list[float]]:
    url = f"s3://{BUCKET}/bench-{os.urandom(4).hex()}"
    config = worker_configuration(backend="torch", dtype="bfloat16", device="cpu", model_dir=model_dir)
    store = await open_store(url, model_files=model_identity_files(model_dir), configuration=config)
    command = default_worker_command(model_dir, dtype="bfloat16", max_sessions=2, max_session_tokens=tokens + 64)
    times: dict[str, list[float]] = {"save": [], "put": [], "resume": [], "get": []}
    async with spawn_multiplexed_worker(command, session_store=store) as client:
        vocab = client.info.model.vocab_size
        prompt = [(17 * i + 3) % (vocab - 100) + 50 for i in range(tokens)]
        await client.open_session("s")
        params = GenerationParams(session_id="s", max_new_tokens=1, temperature=0.0, stop_token_ids=[])
        await client.generate(prompt, params).wait()
        raw = connect(url)
        for _ in range(repeats):
            await trio.to_thread.run_sync(store.delete, "s")  # so each save writes the session whole
            t = time.perf_counter()
            await client.save_session("s")
            times["save"].append(time.perf_counter() - t)
        manifest, _ = await trio.to_thread.run_sync(store._manifest, "s")
        (segment,) = manifest.segments
        data = bytes(obstore.get(raw, segment.name).bytes())
        for i in range(repeats):
            t = time.perf_counter()
            await trio.to_thread.run_sync(obstore.put, raw, f"raw/{i}", data)
            times["put"].append(time.perf_counter() - t)
        for i in range(repeats):
            t = time.perf_counter()
            await trio.to_thread.run_sync(_get, raw, f"raw/{i}")
            times["get"].append(time.perf_counter() - t)
        for _ in range(repeats):
            await client.close_session("s")
            t = time.perf_counter()
            await client.resume_session("s")
            times["resume"].append(time.perf_counter() - t)
        times["bytes"] = [float(len(data))]
    return times


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    model_dir = resolve_model(args.model, progress=sys.stderr)
    process, endpoint = _moto()
    os.environ.update(
        AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_REGION="us-east-1"
    )
    try:
        t = trio.run(_run, model_dir, args.tokens, args.repeats)
    finally:
        process.terminate()
        process.wait(timeout=30)
    med = {k: statistics.median(v) * 1000 for k, v in t.items() if k != "bytes"}
    mib = t["bytes"][0] / 2**20
    print(f"\n## Object store (moto S3 on 127.0.0.1): a {args.tokens}-token bf16 session, {mib:.1f} MiB\n")
    print("| operation | muxworker (ms) | raw obstore, same bytes (ms) | ratio (target <= 2) |")
    print("|---|---:|---:|---:|")
    print(f"| save (whole) vs PUT | {med['save']:.0f} | {med['put']:.0f} | {med['save'] / med['put']:.2f} |")
    print(f"| resume vs GET | {med['resume']:.0f} | {med['get']:.0f} | {med['resume'] / med['get']:.2f} |")
    print(f"\nMedians of {args.repeats}. The resume includes the worker's restore with every CRC checked.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
