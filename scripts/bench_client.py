"""Client overhead: inter-token latency seen through the trio client vs the engine's own step time.

For 1, 8 and 32 concurrent greedy streams on one worker, prints one markdown table with, side by side:
the client-observed inter-token latency (median), the engine's step time (median, measured in the
worker around ``engine.step()``), their difference (the per-token cost of the worker loop, the pipes,
the framing and the client), and aggregate tokens/s as the client sees it next to the engine-only rate.

    python scripts/bench_client.py                 # a tiny random model: isolates the overhead
    python scripts/bench_client.py --model bundled # the bundled SmolLM2-135M-Instruct
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

from muxworker.client import GenerationParams, default_worker_command, spawn_multiplexed_worker

ROOT = Path(__file__).resolve().parent.parent


def _tiny_model(directory: Path) -> Path:
    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_models import write_tiny_model  # the test suite's tiny random HF model

    return write_tiny_model(directory / "tiny-llama", "llama")


async def _run(
    command: list[str], env: dict[str, str], streams: int, new_tokens: int, prompt_tokens: int
) -> dict[str, float]:
    async with spawn_multiplexed_worker(command, env=env) as client:
        vocab = client.info.model.vocab_size
        sids = [f"s{i}" for i in range(streams)]
        prompts = [[(7 * i + j) % (vocab - 10) + 5 for j in range(prompt_tokens)] for i in range(streams)]
        for sid, prompt in zip(sids, prompts):
            await client.open_session(sid)
            await client.generate(prompt, _greedy(sid, 2)).wait()  # warm-up: prefill off the clock
        before = (await client.query_info())["stats"]
        gaps: list[float] = []  # client-observed seconds per token
        done_at: list[float] = []

        async def consume(sid: str, prompt: list[int]) -> None:
            # The full prompt again: the session reuses its history and only decodes.
            stream = client.generate(prompt, _greedy(sid, new_tokens))
            seen, last = 0, None
            async for _ in stream:
                now = time.perf_counter()
                count = len(stream.token_ids)
                if last is not None and count > seen:
                    gaps.extend([(now - last) / (count - seen)] * (count - seen))
                seen, last = count, now
            result = await stream.wait()
            assert result.completion_tokens == new_tokens, result
            done_at.append(time.perf_counter())

        t0 = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for sid, prompt in zip(sids, prompts):
                nursery.start_soon(consume, sid, prompt)
        wall = max(done_at) - t0
        after = (await client.query_info())["stats"]
    steps = after["steps"] - before["steps"]
    step_time = after["step_time_s"] - before["step_time_s"]
    itl = statistics.median(gaps)
    step = after["recent_step_p50_s"]
    return {
        "streams": streams,
        "itl_ms": itl * 1e3,
        "step_ms": step * 1e3,
        "overhead_ms": (itl - step) * 1e3,
        "per_token_us": (itl - step) * 1e6 / streams,
        "client_tps": streams * new_tokens / wall,
        "engine_tps": streams * new_tokens / step_time,
        "steps": steps,
    }


def _greedy(sid: str, n: int) -> GenerationParams:
    return GenerationParams(session_id=sid, max_new_tokens=n, temperature=0.0, stop_token_ids=[])


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--model", default=None, help="model directory or .gguf; 'bundled' for SmolLM2 (default: a tiny random model)"
    )
    parser.add_argument("--streams", default="1,8,32", help="concurrency levels (default: %(default)s)")
    parser.add_argument(
        "--new-tokens", type=int, default=200, help="tokens generated per stream (default: %(default)s)"
    )
    parser.add_argument("--prompt-tokens", type=int, default=16, help="prompt length per stream (default: %(default)s)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None)
    parser.add_argument(
        "--torch-threads",
        default=None,
        help="OMP_NUM_THREADS for the worker (default: 1 for the tiny model, where intra-op threads only "
        "add spin-waiting, and torch's own default otherwise)",
    )
    args = parser.parse_args()
    levels = [int(x) for x in args.streams.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        if args.model is None:
            model, label = _tiny_model(Path(tmp)), "tiny random llama (2 layers, hidden 64)"
        elif args.model == "bundled":
            model, label = None, "bundled SmolLM2-135M-Instruct"
        else:
            model, label = args.model, args.model
        command = default_worker_command(
            model,
            device=args.device,
            dtype=args.dtype,
            max_sessions=max(levels),
            max_decode_sequences=max(levels),  # every stream decodes in every step
            max_session_tokens=args.prompt_tokens + args.new_tokens + 8,
        )
        env = dict(os.environ)
        threads = args.torch_threads or ("1" if args.model is None else None)
        if threads:
            env["OMP_NUM_THREADS"] = threads
        rows = []
        for n in levels:
            rows.append(await _run(command, env, n, args.new_tokens, args.prompt_tokens))
    print(
        f"Model: {label}; device {args.device}; OMP_NUM_THREADS={threads or 'unset'}; {args.new_tokens} greedy "
        "tokens per stream; one worker per row; medians over every token. Every stream decodes in every "
        "step, so a step yields one token per stream: overhead per token = (latency - step) / streams.\n"
    )
    print(
        "| streams | client inter-token latency (ms) | engine step (ms) | latency - step (ms) "
        "| overhead per token (ms) | client tokens/s | engine-only tokens/s | client / engine |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['streams']} | {r['itl_ms']:.3f} | {r['step_ms']:.3f} | {r['overhead_ms']:.3f} "
            f"| {r['per_token_us'] / 1e3:.3f} | {r['client_tps']:.0f} | {r['engine_tps']:.0f} "
            f"| {r['client_tps'] / r['engine_tps']:.2f} |"
        )


if __name__ == "__main__":
    trio.run(main)
