"""The object-storage session store against raw object I/O, and shared-prefix blocks against whole
files, side by side in one run, on S3 (moto's S3 server on 127.0.0.1).

1. **Save and resume.** A 4,096-token session of the bundled SmolLM2 (bf16 KV) is saved whole (into
   a fresh prefix each time) and resumed. A save: the worker writes its rows into a memory file,
   the store cuts them into content-addressed blocks and a tail, uploads those and conditionally
   replaces the manifest. A resume: the store downloads the manifest and every object into memory
   files, and the worker restores from them with every CRC checked. Compared with a raw PUT and a
   raw GET of the same bytes through the same library (obstore) and server. Targets: save <= 2x
   the raw PUT, resume <= 2x the raw GET.
2. **Shared prefixes.** 6 sessions start from the same 1,000-token prompt (the worker's prefix
   cache serves the first one's rows to the others), then run 5 turns each of their own, saved
   after every turn. The bytes the store holds at the end, and the bytes it uploaded, against what
   whole files would take: each session once, and every save written whole. Target: stored <= 0.35x.

    python scripts/bench_store.py [--tokens 4096] [--repeats 3] [--block_tokens 256 128 64]
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
from muxworker.client.stores.objects import connect
from muxworker.worker.models.identity import model_identity_files, worker_configuration
from muxworker.worker.models.loader import resolve_model

BUCKET = "muxworker-bench"
SESSIONS, TURNS, SHARED_PROMPT, USER_TOKENS, REPLY_TOKENS = 6, 5, 1000, 24, 32


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


def _stored_bytes(url: str) -> int:
    return sum(m["size"] for batch in obstore.list(connect(url)) for m in batch)


async def _store(url: str, model_dir: Path, **kw):
    config = worker_configuration(backend="torch", dtype="bfloat16", device="cpu", model_dir=model_dir)
    return await open_store(url, model_files=model_identity_files(model_dir), configuration=config, **kw)


def _greedy(sid: str, n: int) -> GenerationParams:
    return GenerationParams(session_id=sid, max_new_tokens=n, temperature=0.0, stop_token_ids=[])


async def _save_resume(model_dir: Path, tokens: int, repeats: int) -> dict[str, list[float]]:
    command = default_worker_command(model_dir, dtype="bfloat16", max_sessions=2, max_session_tokens=tokens + 64)
    times: dict[str, list[float]] = {"save": [], "put": [], "resume": [], "get": []}
    url = f"s3://{BUCKET}/bench-{os.urandom(4).hex()}"
    async with spawn_multiplexed_worker(command) as client:
        vocab = client.info.model.vocab_size
        prompt = [(17 * i + 3) % (vocab - 100) + 50 for i in range(tokens)]
        await client.open_session("s")
        await client.generate(prompt, _greedy("s", 1)).wait()
        store = None
        for i in range(repeats):
            # A fresh prefix each time, so each save uploads the session whole (no block is there).
            store = await _store(f"{url}/{i}", model_dir)
            client.session_store = store
            t = time.perf_counter()
            await client.save_session("s")
            times["save"].append(time.perf_counter() - t)
        assert store is not None
        manifest, _ = await trio.to_thread.run_sync(store._manifest, "s")
        raw = connect(url)
        data = b"".join([_get(store.store, ref.name) for ref in manifest.segments])
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
        times["objects"] = [float(len(manifest.segments))]
    return times


async def _shared(model_dir: Path, block_tokens: int) -> dict[str, float]:
    url = f"s3://{BUCKET}/shared-{block_tokens}-{os.urandom(4).hex()}"
    store = await _store(url, model_dir, block_tokens=block_tokens)
    command = default_worker_command(
        model_dir, dtype="bfloat16", max_sessions=SESSIONS, max_session_tokens=2048, prefix_cache_entries=1
    )
    positions: list[tuple[str, int]] = []
    reused = []
    async with spawn_multiplexed_worker(command, session_store=store) as client:
        vocab = client.info.model.vocab_size
        shared = [(31 * i + 7) % (vocab - 100) + 50 for i in range(SHARED_PROMPT)]
        histories = {}
        for k in range(SESSIONS):
            sid = f"s{k}"
            await client.open_session(sid)
            histories[sid] = list(shared)
        for t in range(TURNS):
            for k, sid in enumerate(histories):
                user = [(13 * (k * 97 + t * 11 + i) + 5) % (vocab - 100) + 50 for i in range(USER_TOKENS)]
                prompt = histories[sid] + ([] if t == 0 else user)
                result = await client.generate(prompt, _greedy(sid, REPLY_TOKENS)).wait()
                if t == 0:
                    reused.append(result.reused_prompt_tokens)
                histories[sid] = prompt + result.generated_token_ids
                positions.append((sid, (await client.save_session(sid)).position))
        # Whole files: each session saved once more into a store without blocks (one file each).
        whole = await _store(url + "-whole", model_dir, block_tokens=0)
        client.session_store = whole
        final = {}
        for sid in histories:
            saved = await client.save_session(sid)
            final[sid] = ((await trio.to_thread.run_sync(whole.info, sid)).nbytes, saved.position)
        whole_stored = sum(nbytes for nbytes, _ in final.values())
        # Every save written whole: a whole file's size scales with its position.
        whole_written = sum(final[sid][0] * position / final[sid][1] for sid, position in positions)
    return {
        "stored": float(_stored_bytes(url)),
        "whole_stored": float(whole_stored),
        "uploaded": float(store.uploaded_bytes),
        "whole_written": float(whole_written),
        "reused": float(min(reused[1:])),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--block_tokens", type=int, nargs="+", default=[256, 128, 64])
    args = p.parse_args()
    model_dir = resolve_model(args.model, progress=sys.stderr)
    process, endpoint = _moto()
    os.environ.update(
        AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_REGION="us-east-1"
    )
    try:
        t = trio.run(_save_resume, model_dir, args.tokens, args.repeats)
        shared = {b: trio.run(_shared, model_dir, b) for b in args.block_tokens}
    finally:
        process.terminate()
        process.wait(timeout=30)
    med = {k: statistics.median(v) * 1000 for k, v in t.items() if k not in ("bytes", "objects")}
    mib = t["bytes"][0] / 2**20
    print(
        f"\n## Object store (moto S3 on 127.0.0.1): a {args.tokens}-token bf16 session, {mib:.1f} MiB "
        f"in {int(t['objects'][0])} objects\n"
    )
    print("| operation | muxworker (ms) | raw obstore, same bytes (ms) | ratio (target <= 2) |")
    print("|---|---:|---:|---:|")
    print(f"| save (whole) vs PUT | {med['save']:.0f} | {med['put']:.0f} | {med['save'] / med['put']:.2f} |")
    print(f"| resume vs GET | {med['resume']:.0f} | {med['get']:.0f} | {med['resume'] / med['get']:.2f} |")
    print(f"\nMedians of {args.repeats}. The resume includes the worker's restore with every CRC checked.")
    print(
        f"\n## Shared prefixes: {SESSIONS} sessions from one {SHARED_PROMPT}-token prompt, {TURNS} turns of "
        f"{USER_TOKENS} + {REPLY_TOKENS} tokens each, saved after every turn\n"
    )
    print(
        "| block tokens | stored MiB | whole files MiB | stored ratio (target <= 0.35) "
        "| uploaded MiB | whole saves MiB | uploaded ratio | prompt tokens reused by sessions 2-6 |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for b, r in shared.items():
        print(
            f"| {b} | {r['stored'] / 2**20:.1f} | {r['whole_stored'] / 2**20:.1f} | {r['stored'] / r['whole_stored']:.2f} "
            f"| {r['uploaded'] / 2**20:.1f} | {r['whole_written'] / 2**20:.1f} "
            f"| {r['uploaded'] / r['whole_written']:.2f} | {int(r['reused'])} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
