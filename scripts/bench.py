"""All component benchmarks in one run, printed as one markdown table of ratios (`make bench`).

Each row is measured side by side with its baseline in this same run, so the ratio holds even on a
shared, noisy machine where absolute times drift:

- resume vs cold time to first token (512, 4,096, 8,000-token sessions; SmolLM2, real workers)
- 8 vs 1 session aggregate decode (SmolLM2, engine in-process)
- transport vs raw pipe (64 MiB payloads between two processes)
- checkpoint file save/load vs raw write+fsync/read of the same bytes
- crc32c vs zlib.crc32 (256 MiB)
- a pointer to `make bench-peer`, the side-by-side benchmark against llama.cpp on the same GGUF

    python scripts/bench.py [--quick] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import zlib

import numpy as np
import torch
import trio

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_checkpoint  # noqa: E402
import bench_checkpoint_file  # noqa: E402
import bench_engine  # noqa: E402
import bench_transport  # noqa: E402

from muxworker.native import crc32c  # noqa: E402
from muxworker.worker.build import load_engine
from muxworker.worker.engine.config import EngineConfig


def _row(rows, what, ours, base, ratio):
    rows.append((what, ours, base, ratio))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller sizes (512 and 4,096 tokens only, fewer repeats)")
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    rows: list[tuple[str, str, str, str]] = []
    tokens = "512,4096" if args.quick else "512,4096,8000"

    # 1. Resume vs cold (real worker processes).
    ns = argparse.Namespace(tokens=tokens, dtype=args.dtype, model=None)
    for r in trio.run(bench_checkpoint.run, ns):
        _row(
            rows,
            f"time to first token, {r['tokens']}-token session: resumed vs cold",
            f"{r['resume_ttft'] * 1e3:.0f} ms",
            f"{r['cold_ttft'] * 1e3:.0f} ms",
            f"1/{r['cold_ttft'] / r['resume_ttft']:.0f}",
        )

    # 2. 8 vs 1 session decode (in-process engine).
    engine = load_engine(None, EngineConfig(max_sessions=8, max_session_tokens=1024), dtype=args.dtype, progress=None)
    bench_engine.bench_prefill(engine, 64, 1)
    d1 = bench_engine.bench_decode(engine, 1, 32, 1000)
    d8 = bench_engine.bench_decode(engine, 8, 32, 8000)
    del engine
    _row(
        rows,
        f"aggregate decode, 8 sessions vs 1 ({args.dtype})",
        f"{d8:.0f} tok/s",
        f"{d1:.0f} tok/s",
        f"{d8 / d1:.1f}x",
    )

    # 3. Transport vs raw pipe.
    it = 4 if args.quick else 8
    best = bench_transport.best_of(
        3,
        {
            "raw": (bench_transport.raw_throughput, it),
            "fd": (bench_transport.frame_throughput, it, False),
            "trio": (bench_transport.trio_frame_throughput, it),
        },
    )
    gb = 1e9
    _row(
        rows,
        "64 MiB payloads through the framing (fd reader) vs raw os.write/os.readv",
        f"{best['fd'] / gb:.2f} GB/s",
        f"{best['raw'] / gb:.2f} GB/s",
        f"{best['fd'] / best['raw']:.2f}x",
    )
    _row(
        rows,
        "64 MiB payloads through the framing (trio reader) vs raw",
        f"{best['trio'] / gb:.2f} GB/s",
        f"{best['raw'] / gb:.2f} GB/s",
        f"{best['trio'] / best['raw']:.2f}x",
    )

    # 4. Checkpoint file vs raw file I/O.
    with tempfile.TemporaryDirectory() as d:
        f = bench_checkpoint_file.bench(4096, 3 if args.quick else 5, d)
    _row(
        rows,
        "checkpoint save (4,096 tokens, 180 MiB) vs raw write+fsync",
        f"{f['save'] * 1e3:.0f} ms",
        f"{f['raw_write'] * 1e3:.0f} ms",
        f"{f['raw_write'] / f['save']:.2f}x",
    )
    _row(
        rows,
        "checkpoint load, all CRCs verified, vs raw read",
        f"{f['load'] * 1e3:.0f} ms",
        f"{f['raw_read'] * 1e3:.0f} ms",
        f"{f['raw_read'] / f['load']:.2f}x",
    )

    # 5. crc32c vs zlib.
    data = np.random.default_rng(0).integers(0, 256, 256 << 20, dtype=np.uint8)
    ours = bench_transport.checksum_rate(crc32c, data, 3)
    base = bench_transport.checksum_rate(zlib.crc32, data, 3)
    _row(rows, "crc32c vs zlib.crc32, 256 MiB", f"{ours / gb:.1f} GB/s", f"{base / gb:.1f} GB/s", f"{ours / base:.1f}x")
    del data

    # 6. llama.cpp on the same GGUF: its own benchmark, with llama-cpp-python built in its own venv.
    _row(rows, "muxworker vs llama.cpp (same GGUF)", "-", "-", "see `make bench-peer` (scripts/bench_vs_llamacpp.py)")

    print(f"\ntorch {torch.__version__}, {torch.get_num_threads()} threads, dtype {args.dtype}\n")
    print("| measurement | muxworker | baseline | ratio |")
    print("|---|---:|---:|---:|")
    for what, a, b, r in rows:
        print(f"| {what} | {a} | {b} | {r} |")


if __name__ == "__main__":
    main()
