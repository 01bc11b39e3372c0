"""Sessions at the speed of the disk: save, incremental save, resume and resume + first token of a
long session, through real worker processes, side by side with a cold prefill in one run, and with
llama.cpp's state_save_file / state_load_file of the same GGUF when its venv exists.

For each session length (default 4,096 tokens) on the bundled SmolLM2-135M (the worker's defaults:
bfloat16, quantized weights):

- save: ``save_session`` of the whole session (the worker writes its KV rows straight into a segment
  the store created; fsync, manifest replace, directory fsync), on a fresh store entry;
- incremental save: the same session after a turn of 64 new tokens (only those are written);
- resume: ``resume_session`` in a new worker process (the files in the page cache, as after a
  recent save), and resume + first token of a 1-token suffix (the pending last token and one new
  one are evaluated, as in llama.cpp's row) and of a 16-token suffix;
- cold: the first token of a fresh session that prefills the whole conversation instead.

llama.cpp (``--peer-python``, default ``.venv-peer/bin/python`` when it exists; ``make bench-peer``
builds it): a fresh peer process prefills the same tokens and saves them with
``llama_state_seq_save_file`` + fsync; another loads the file and evaluates the pending token and a
1-token suffix. Each figure is the median of ``--repeats`` rounds.

    python scripts/bench_checkpoint.py [--tokens 4096] [--repeats 3] [--model PATH] [--peer-python PATH]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import trio

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_vs_llamacpp import TEXT, bundled_gguf_path, peer_problem, peer_run  # noqa: E402

from muxworker.client import GenerationParams, SessionStore, default_worker_command, spawn_multiplexed_worker  # noqa: E402
from muxworker.worker.models.identity import model_identity_files, worker_configuration  # noqa: E402
from muxworker.worker.models.loader import NAMED_MODELS, named_model_path, resolve_model  # noqa: E402

TURN = 64  # new tokens before the incremental save: 60 of prompt, 4 generated
LONG_SUFFIX = 16
ROOT = Path(__file__).resolve().parents[1]


async def _first_token(client, sid: str, prompt: list[int], n: int = 1):
    t0 = time.perf_counter()
    stream = client.generate(prompt, GenerationParams(session_id=sid, max_new_tokens=n, stop_token_ids=[]))
    async for _ in stream:
        break
    first = time.perf_counter() - t0
    return first, await stream.wait()


async def run_mux(args, n: int) -> dict:
    model_dir = resolve_model(args.model, progress=sys.stderr)
    top = n + args.repeats * TURN + LONG_SUFFIX + 16
    command = default_worker_command(model_dir, max_sessions=2, max_session_tokens=top, threads=args.threads)
    out: dict = {
        "save": [],
        "incremental": [],
        "resume": [],
        "resume_first_1": [],
        "resume_first_16": [],
        "cold_1": [],
        "cold_16": [],
    }
    with tempfile.TemporaryDirectory(prefix="bench-checkpoint-") as tmp:
        store_dir = Path(tmp) / "sessions"
        async with spawn_multiplexed_worker(command) as probe:
            info = probe.info
            base = await probe.tokenize(TEXT * (top // 40 + 1))
        config = worker_configuration(backend=info.backend, dtype=info.dtype, model_dir=model_dir, weights=info.weights)
        store = await SessionStore.create(store_dir, model_files=model_identity_files(model_dir), configuration=config)
        out["dtype"], out["weights"] = info.dtype, info.weights
        history: list[int] = []
        async with spawn_multiplexed_worker(command, session_store=store) as client:
            await client.open_session("s")
            _, first = await _first_token(client, "s", base[:n])
            history = base[:n] + first.generated_token_ids
            for _ in range(args.repeats):
                store.delete("s")  # a fresh entry: the save writes everything
                t0 = time.perf_counter()
                full = await client.save_session("s")
                out["save"].append(time.perf_counter() - t0)
            out["save_bytes"] = full.payload_bytes
            out["file_bytes"] = store.nbytes("s")
            out["position"] = full.position
            for r in range(args.repeats):
                prompt = history + base[n + r * TURN : n + r * TURN + TURN - 4]
                result = await client.generate(
                    prompt, GenerationParams(session_id="s", max_new_tokens=4, stop_token_ids=[])
                ).wait()
                history = prompt + result.generated_token_ids
                t0 = time.perf_counter()
                inc = await client.save_session("s")
                out["incremental"].append(time.perf_counter() - t0)
                out["incremental_bytes"] = inc.payload_bytes
                out["incremental_tokens"] = inc.position - inc.start
        async with spawn_multiplexed_worker(command, session_store=store) as client:
            await client.open_session("warm")
            await _first_token(client, "warm", base[:64])  # the first forward's one-time costs
            await client.close_session("warm")
            store.load("s")  # the files are in the page cache, as after a recent save
            for key, suffix in (("resume", 0), ("resume_first_1", 1), ("resume_first_16", LONG_SUFFIX)):
                for _ in range(args.repeats):
                    t0 = time.perf_counter()
                    await client.resume_session("s")
                    if suffix:
                        await _first_token(client, "s", history + base[:suffix])
                    out[key].append(time.perf_counter() - t0)
                    await client.close_session("s")
            for key, suffix in (("cold_1", 1), ("cold_16", LONG_SUFFIX)):
                for _ in range(min(args.repeats, 2)):
                    await client.open_session("cold")
                    dt, _ = await _first_token(client, "cold", history + base[:suffix])
                    out[key].append(dt)
                    await client.close_session("cold")
    return out


def run_peer(args, n: int) -> dict:
    problem = peer_problem(args)
    if problem:
        return {"problem": problem}
    out: dict = {"save": [], "restore": [], "restore_first": []}
    with tempfile.TemporaryDirectory(prefix="bench-checkpoint-peer-") as tmp:
        state = os.path.join(tmp, "state.bin")
        for _ in range(args.repeats):
            saved = peer_run(args, {"mode": "state", "n_ctx": n + 64, "text": TEXT, "tokens": n, "state_path": state})
            out["save"].append(saved["save_s"])
            out["file_bytes"] = saved["state_file_bytes"]
            restored = peer_run(
                args,
                {
                    "mode": "restore",
                    "n_ctx": n + 64,
                    "state_path": state,
                    "saved_tokens": saved["saved_tokens"],
                    "pending_token": saved["pending_token"],
                    "suffix_token": saved["suffix_token"],
                },
            )
            out["restore"].append(restored["restore_s"])
            out["restore_first"].append(restored["restore_first_token_s"])
    return out


def _ms(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values) * 1e3:.1f} ({min(values) * 1e3:.1f}-{max(values) * 1e3:.1f})"


def _ratio(a: list[float], b: list[float]) -> str:
    return f"{statistics.median(a) / statistics.median(b):.2f}x" if a and b else "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="4096", help="comma list of session lengths")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model", default=None, help="a GGUF or a model name (default: the bundled SmolLM2 GGUF)")
    ap.add_argument("--threads", type=int, default=2)
    default_peer = ROOT / ".venv-peer" / "bin" / "python"
    ap.add_argument("--peer-python", default=str(default_peer) if default_peer.exists() else None)
    args = ap.parse_args()
    gguf = named_model_path(args.model) if args.model in NAMED_MODELS else Path(args.model or bundled_gguf_path())
    args.model = str(gguf)
    for n in (int(t) for t in args.tokens.split(",")):
        mux = trio.run(run_mux, args, n)
        peer = run_peer(args, n)
        mib = 2**20
        print(
            f"\n{gguf.name}, a {mux['position']:,}-token session, muxworker {mux['dtype']} "
            f"({mux['weights']} weights), {args.threads} threads; ms, median (min-max) of {args.repeats}\n"
        )
        print("| figure | llama.cpp | muxworker | ratio muxworker / llama.cpp |")
        print("|---|---:|---:|---:|")
        p = peer if "problem" not in peer else {}
        print(
            f"| save the session to a file (+fsync) | {_ms(p.get('save', []))} | {_ms(mux['save'])} | "
            f"{_ratio(mux['save'], p.get('save', []))} |"
        )
        print(
            f"| restore it in a new process | {_ms(p.get('restore', []))} | {_ms(mux['resume'])} | "
            f"{_ratio(mux['resume'], p.get('restore', []))} |"
        )
        print(
            f"| restore + first token (1-token suffix) | {_ms(p.get('restore_first', []))} | "
            f"{_ms(mux['resume_first_1'])} | {_ratio(mux['resume_first_1'], p.get('restore_first', []))} |"
        )
        file_peer = f"{p['file_bytes'] / mib:.1f}" if "file_bytes" in p else "-"
        print(f"| bytes on disk, MiB | {file_peer} | {mux['file_bytes'] / mib:.1f} | |")
        if "problem" in peer:
            print(f"\nllama.cpp rows not measured: {peer['problem']}")
        print("\nmuxworker alone:\n")
        print("| figure | ms | against |")
        print("|---|---:|---|")
        print(
            f"| incremental save after {mux['incremental_tokens']} new tokens "
            f"({mux['incremental_bytes'] / mib:.2f} MiB written, full: {mux['save_bytes'] / mib:.1f} MiB) | "
            f"{_ms(mux['incremental'])} | {_ratio(mux['incremental'], mux['save'])} of a full save's time, "
            f"{mux['incremental_bytes'] / mux['save_bytes']:.3f}x its bytes |"
        )
        for suffix in (1, LONG_SUFFIX):
            resumed, cold = mux[f"resume_first_{suffix}"], mux[f"cold_{suffix}"]
            print(
                f"| resume + first token of a {suffix}-token suffix | {_ms(resumed)} | "
                f"cold prefill of the same {mux['position'] + 1 + suffix:,} tokens: {_ms(cold)}, "
                f"{statistics.median(cold) / statistics.median(resumed):.0f}x slower |"
            )


if __name__ == "__main__":
    main()
