"""Checkpoint file throughput against raw file I/O of the same bytes, side by side in one run.

For SmolLM2-135M-shaped sessions (30 layers, 3 KV heads, head_dim 64, float32 or bfloat16) of 512,
4,096 and 8,000 tokens: ``save_checkpoint`` (CRC32C, write, fsync, rename, directory fsync) against a raw
write + fsync of the same payload bytes, and ``load_checkpoint`` of a file in the page cache
(read, verify every CRC, build the checkpoint) against a raw read of the same bytes into a fresh
buffer. A ratio is raw time / checkpoint time (1.0 = as fast as raw; the target is >= 0.5).

    python scripts/bench_checkpoint_file.py [--tokens 512,4096,8000] [--dtype float32|bfloat16]
                                            [--repeat 5] [--dir DIR]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import numpy as np

from muxworker.transport.checkpoint import CPUCheckpoint, LayerState, load_checkpoint, save_checkpoint

LAYERS, KV_HEADS, HEAD_DIM = 30, 3, 64


def smollm2_checkpoint(tokens: int, seed: int = 0, dtype: str = "float32") -> CPUCheckpoint:
    rng = np.random.default_rng(seed)

    def rows() -> np.ndarray:  # [T, KV, D]
        x = rng.random((tokens, KV_HEADS, HEAD_DIM), dtype=np.float32)
        # bfloat16 travels as its raw bits in uint16: the top half of each float32.
        return x if dtype == "float32" else (x.view(np.uint32) >> 16).astype(np.uint16)

    return CPUCheckpoint(
        format={"backend": "torch", "dtype": dtype, "layout_version": 1},
        geometry={"num_layers": LAYERS, "num_kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "windows": [None] * LAYERS},
        position=tokens,
        token_ids=rng.integers(0, 49_152, size=tokens, dtype=np.int32),
        layers=[LayerState(0, rows(), rows()) for _ in range(LAYERS)],
        identity="0" * 64,
    )


def raw_write(path: str, buffers: list[memoryview]) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for view in buffers:
            done = 0
            while done < view.nbytes:
                done += os.write(fd, view[done:])
        os.fsync(fd)
    finally:
        os.close(fd)


def raw_read(path: str) -> np.ndarray:
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        out = np.empty(size, dtype=np.uint8)
        view = memoryview(out)
        done = 0
        while done < size:
            done += os.readv(fd, [view[done:]])
        return out
    finally:
        os.close(fd)


def timed(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def bench(tokens: int, repeat: int, directory: str, dtype: str = "float32") -> dict:
    ckpt = smollm2_checkpoint(tokens, dtype=dtype)
    payloads = [ckpt.token_ids] + [a for layer in ckpt.layers for a in (layer.keys, layer.values)]
    views = [memoryview(p).cast("B") for p in payloads]
    path = os.path.join(directory, f"ckpt-{tokens}.mxckpt")
    raw_path = os.path.join(directory, f"raw-{tokens}.bin")
    # Warm-up: first touches of fresh memory and of the files are not what is being measured.
    save_checkpoint(ckpt, path)
    raw_write(raw_path, views)
    load_checkpoint(path)
    raw_read(raw_path)
    # Interleaved, alternating which side goes first, so background load from other processes and
    # the cost of first touches of memory the VM has handed back hit both sides alike.
    save, wsave, load, rload = [], [], [], []
    for i in range(repeat):
        pair = [(save, save_checkpoint, (ckpt, path)), (wsave, raw_write, (raw_path, views))]
        for times, fn, args in pair if i % 2 == 0 else pair[::-1]:
            times.append(timed(fn, *args))
    for i in range(repeat):
        pair = [(load, load_checkpoint, (path,)), (rload, raw_read, (raw_path,))]
        for times, fn, args in pair if i % 2 == 0 else pair[::-1]:
            times.append(timed(fn, *args))
    loaded = load_checkpoint(path)
    if loaded.layers[-1].values.tobytes() != ckpt.layers[-1].values.tobytes():
        raise SystemExit("round trip mismatch")
    result = {
        "tokens": tokens,
        "payload": ckpt.nbytes,
        "file": os.path.getsize(path),
        "raw_file": os.path.getsize(raw_path),
        "save": statistics.median(save),
        "raw_write": statistics.median(wsave),
        "load": statistics.median(load),
        "raw_read": statistics.median(rload),
    }
    os.unlink(path)
    os.unlink(raw_path)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="512,4096,8000")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp directory)")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(dir=args.dir) as directory:
        for tokens in (int(t) for t in args.tokens.split(",")):
            rows.append(bench(tokens, args.repeat, directory, args.dtype))
    mib = 2**20
    print(
        f"SmolLM2-135M geometry ({LAYERS} layers x {KV_HEADS} KV heads x {HEAD_DIM} head_dim, {args.dtype}), "
        f"median of {args.repeat}; ratio = raw time / checkpoint time (target >= 0.5)\n"
    )
    print(
        "| tokens | payload MiB | file MiB | save ms | raw write+fsync ms | save ratio "
        "| load ms | raw read ms | load ratio | save MiB/s | load MiB/s |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['tokens']} | {r['payload'] / mib:.1f} | {r['file'] / mib:.1f} "
            f"| {r['save'] * 1e3:.1f} | {r['raw_write'] * 1e3:.1f} | {r['raw_write'] / r['save']:.2f} "
            f"| {r['load'] * 1e3:.1f} | {r['raw_read'] * 1e3:.1f} | {r['raw_read'] / r['load']:.2f} "
            f"| {r['payload'] / mib / r['save']:.0f} | {r['payload'] / mib / r['load']:.0f} |"
        )


if __name__ == "__main__":
    main()
