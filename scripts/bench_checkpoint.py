"""Resume vs cold prefill, end to end through real worker processes, side by side in one run.

For sessions of 512, 4,096 and 8,000 tokens on the bundled SmolLM2-135M: time to first token of a
cold prefill of the whole conversation vs a resumed session (resume_session, then the first token
of a 16-token suffix; the file is in the page cache), the save time and file size, and the
checkpoint file's throughput against raw file I/O of the same bytes (bench_checkpoint_file.py).

    python scripts/bench_checkpoint.py [--tokens 512,4096,8000] [--dtype bfloat16] [--model PATH] [--backends torch,mlx]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import trio

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_checkpoint_file import bench as file_bench  # noqa: E402

from muxworker.client import GenerationParams, SessionStore, default_worker_command, spawn_multiplexed_worker  # noqa: E402
from muxworker.worker.models.identity import model_identity_files, worker_configuration
from muxworker.worker.models.loader import resolve_model

SUFFIX = 16
TEXT = (
    "The history of gardening spans thousands of years, from the irrigated plots of ancient Egypt to "
    "the kitchen gardens of medieval monasteries. Gardeners learned which plants grow well together, "
    "how to rotate crops, and how to keep soil rich with compost and careful watering. "
)


async def _ttft(client, sid: str, prompt: list[int]) -> tuple[float, dict]:
    t0 = time.perf_counter()
    stream = client.generate(prompt, GenerationParams(session_id=sid, max_new_tokens=1, stop_token_ids=[]))
    async for _ in stream:
        pass
    result = await stream.wait()
    return time.perf_counter() - t0, result


async def run(args, backend: str = "torch") -> list[dict]:
    model_dir = resolve_model(args.model, progress=sys.stderr)
    sizes = [int(t) for t in args.tokens.split(",")]
    top = max(sizes) + SUFFIX + 8
    command = default_worker_command(
        model_dir, backend=backend, dtype=args.dtype, max_sessions=3, max_session_tokens=top, prefill_chunk_tokens=512
    )
    config = worker_configuration(backend=backend, dtype=args.dtype, model_dir=model_dir)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        store_dir = Path(tmp) / "sessions"
        store = await SessionStore.create(store_dir, model_files=model_identity_files(model_dir), configuration=config)
        async with spawn_multiplexed_worker(command, session_store=store) as client:
            base = await client.tokenize(TEXT * (top // 40 + 1))
            for n in sizes:
                sid = f"s{n}"
                await client.open_session(sid)
                _, first = await _ttft(client, sid, base[:n])
                t0 = time.perf_counter()
                await client.save_session(sid)
                save_s = time.perf_counter() - t0
                await client.close_session(sid)
                rows.append(
                    {
                        "backend": backend,
                        "tokens": n,
                        "save": save_s,
                        "file": store.path_for(sid).stat().st_size,
                        "history": base[:n] + list(first.generated_token_ids),
                    }
                )
        # A fresh worker: resume vs cold on the same process, alternating order.
        store = await SessionStore.create(store_dir, model_files=model_identity_files(model_dir), configuration=config)
        async with spawn_multiplexed_worker(command, session_store=store) as client:
            await client.open_session("warm")
            await _ttft(client, "warm", base[:64])  # first-forward warm-up
            await client.close_session("warm")
            for row in rows:
                n = row["tokens"]
                store.load(f"s{n}")  # the file is in the page cache, as after a recent save
                prompt = row["history"] + base[n + 1 : n + 1 + SUFFIX]
                t0 = time.perf_counter()
                await client.resume_session(f"s{n}")
                resume_s = time.perf_counter() - t0
                first_s, res = await _ttft(client, f"s{n}", prompt)
                row["resume_ttft"] = resume_s + first_s
                row["resume_prefilled"] = res.prefilled_prompt_tokens
                await client.open_session("cold")
                row["cold_ttft"], cold = await _ttft(client, "cold", prompt)
                row["cold_prefilled"] = cold.prefilled_prompt_tokens
                assert cold.generated_token_ids == res.generated_token_ids
                await client.close_session("cold")
                await client.close_session(f"s{n}")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="512,4096,8000")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--model", default=None)
    ap.add_argument("--repeat", type=int, default=3, help="file-throughput repetitions")
    ap.add_argument("--backends", "--backend", default="torch", help="comma list of backends (torch, mlx)")
    args = ap.parse_args()
    backends = args.backends.split(",")
    rows = [r for backend in backends for r in trio.run(run, args, backend)]
    mib = 2**20
    print(f"SmolLM2-135M, {args.dtype}, CPU; resume = resume_session + first token of a {SUFFIX}-token suffix\n")
    print(
        "| backend | tokens | cold TTFT ms | resumed TTFT ms | resumed / cold | prefilled cold / resumed | save ms | file MiB |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['backend']} | {r['tokens']} | {r['cold_ttft'] * 1e3:.0f} | {r['resume_ttft'] * 1e3:.0f} | "
            f"1/{r['cold_ttft'] / r['resume_ttft']:.0f} | {r['cold_prefilled']} / {r['resume_prefilled']} | "
            f"{r['save'] * 1e3:.0f} | {r['file'] / mib:.1f} |"
        )
    print("\nCheckpoint file vs raw file I/O of the same bytes (float32 SmolLM2 geometry, median):\n")
    print("| tokens | save ms | raw write+fsync ms | save ratio | load ms | raw read ms | load ratio |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as d:
        for r in (r for r in rows if r["backend"] == backends[0]):  # file I/O does not depend on the backend
            f = file_bench(r["tokens"], args.repeat, d)
            print(
                f"| {f['tokens']} | {f['save'] * 1e3:.1f} | {f['raw_write'] * 1e3:.1f} | {f['raw_write'] / f['save']:.2f} "
                f"| {f['load'] * 1e3:.1f} | {f['raw_read'] * 1e3:.1f} | {f['raw_read'] / f['load']:.2f} |"
            )


if __name__ == "__main__":
    main()
