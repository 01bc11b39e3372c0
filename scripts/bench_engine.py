"""Engine throughput on the bundled SmolLM2-135M (CPU by default), side by side in one run.

Prefill tok/s for 512- and 4,096-token prompts and aggregate decode tok/s for 1, 4 and 8 concurrent
sessions, for each dtype. Ratios against the single-session figure are printed in the same table.

    python scripts/bench_engine.py [--model PATH] [--device cpu] [--dtypes float32,bfloat16] [--backends torch,mlx]
        [--weights quantized,float]
"""

from __future__ import annotations

import argparse
import time

import torch

from muxworker.worker.build import load_engine
from muxworker.worker.engine.config import EngineConfig
from muxworker.worker.engine.sampling import SamplingParams


def _drain(engine) -> dict[int, dict]:
    results = {}
    while engine.has_work():
        for out in engine.step():
            if out.result is not None:
                results[out.request_id] = out.result
    return results


def _prompt(n: int, seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 100, (n,), generator=g).tolist()


def bench_prefill(engine, n: int, rid: int) -> float:
    engine.open_session(f"p{rid}")
    params = SamplingParams(max_new_tokens=1, temperature=0, stop_token_ids=[])
    t0 = time.perf_counter()
    engine.submit(rid, f"p{rid}", _prompt(n, rid, engine.vocab_size), params)
    _drain(engine)
    dt = time.perf_counter() - t0
    engine.close_session(f"p{rid}")
    return n / dt


def bench_decode(engine, sessions: int, new_tokens: int, rid0: int) -> float:
    sids = [f"d{rid0}-{i}" for i in range(sessions)]
    prompts = {}
    for i, sid in enumerate(sids):
        engine.open_session(sid)
        prompts[sid] = _prompt(64, rid0 + i, engine.vocab_size)
        engine.submit(rid0 + i, sid, prompts[sid], SamplingParams(max_new_tokens=1, temperature=0, stop_token_ids=[]))
    _drain(engine)
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0, stop_token_ids=[])
    t0 = time.perf_counter()
    for i, sid in enumerate(sids):
        engine.submit(rid0 + 100 + i, sid, engine.session_tokens(sid), params)
    res = _drain(engine)
    dt = time.perf_counter() - t0
    for sid in sids:
        engine.close_session(sid)
    return sum(r["completion_tokens"] for r in res.values()) / dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF directory or .gguf (default: bundled SmolLM2)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--backends", "--backend", default="torch", help="comma list of backends (torch, mlx)")
    ap.add_argument("--decode_tokens", type=int, default=64)
    ap.add_argument("--prefill_chunk_tokens", type=int, default=512)
    ap.add_argument("--weights", default="default", help="comma list of --weights values (default: the model's)")
    args = ap.parse_args()
    rows = []
    configs = [
        (b, d, w) for b in args.backends.split(",") for d in args.dtypes.split(",") for w in args.weights.split(",")
    ]
    for backend, dtype, weights in configs:
        engine = load_engine(
            args.model,
            EngineConfig(
                max_sessions=8,
                max_session_tokens=4096 + 64,
                max_decode_sequences=8,
                prefill_chunk_tokens=args.prefill_chunk_tokens,
            ),
            device=args.device,
            dtype=dtype,
            backend=backend,
            weights=None if weights == "default" else weights,
        )
        bench_prefill(engine, 64, 1)  # warm-up
        p512 = bench_prefill(engine, 512, 2)
        p4096 = bench_prefill(engine, 4096, 3)
        d = {k: bench_decode(engine, k, args.decode_tokens, 1000 * k) for k in (1, 4, 8)}
        rows.append((backend, dtype, engine.weights, p512, p4096, d[1], d[4], d[8]))
        del engine
    versions = f"torch {torch.__version__}"
    if "mlx" in args.backends.split(","):
        import mlx.core as mx

        versions += f", mlx {mx.__version__}"
    print(f"{versions}, device {args.device}, threads {torch.get_num_threads()}\n")
    print(
        "| backend | dtype | weights | prefill 512 tok/s | prefill 4096 tok/s | decode x1 tok/s | decode x4 tok/s "
        "| decode x8 tok/s | x8 / x1 |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for backend, dtype, weights, p512, p4096, d1, d4, d8 in rows:
        print(
            f"| {backend} | {dtype} | {weights} | {p512:.0f} | {p4096:.0f} | {d1:.1f} | {d4:.1f} | {d8:.1f} | {d8 / d1:.2f} |"
        )


if __name__ == "__main__":
    main()
