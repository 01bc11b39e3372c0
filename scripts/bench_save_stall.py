"""How long other sessions wait while one session is saved or resumed: a streaming session's
inter-token gaps during a save (and a resume) of another, long session, against its median gap,
through a real worker process.

On the bundled SmolLM2-135M with the worker's default configuration (bfloat16, quantized weights,
4,096-token sessions), one session ("long") is prefilled to ``--tokens`` tokens (default 4,000:
about 92 MB of KV rows); another ("stream") then decodes a long greedy answer. While it streams:

- ``save_session("long")`` writes the long session whole into a fresh store entry (a segment the
  store created, fsync, manifest replace), ``--repeats`` times; between two saves the stream runs
  on for a while, and the entry is deleted halfway (unlinking 88 MB costs the kernel tens of ms of
  CPU, so not next to a save);
- then ``close_session("long")`` and ``resume_session("long")`` (its segment read back into a
  free slot, from the page cache as after a recent save), ``--repeats`` times.

Each token's arrival time is taken as the client receives it. An operation's stall is the largest
gap between two tokens of the streaming session that overlaps it, and the figure that matters is
its ratio to the median gap outside every operation (1x: it went unnoticed; the target is at most
2x, one extra median gap). The largest gap outside them is printed too: what the machine's own
noise does to the same stream.

    python scripts/bench_save_stall.py [--tokens 4000] [--repeats 5] [--model PATH] [--store DIR]

``--store``: the directory the store lives in (default: a temporary directory under ``$TMPDIR``;
it should be on a real disk, since the fsync is part of a save).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import trio

from muxworker.client import GenerationParams, SessionStore, default_worker_command, spawn_multiplexed_worker
from muxworker.worker.models.identity import model_identity_files, worker_configuration
from muxworker.worker.models.loader import bundled_gguf_path, resolve_model

TEXT = (
    "The river town woke slowly in the early autumn. Fishermen pulled their boats onto the gravel, "
    "the baker opened his shutters to let out the smell of bread, and children ran along the quay. "
)
WARMUP_TOKENS = 24  # streamed tokens before the first operation (the first steps' one-time costs)
PAUSE_TOKENS = 24  # streamed tokens between two operations


async def measure(args: argparse.Namespace) -> dict:
    model_dir = resolve_model(args.model, progress=sys.stderr)
    command = default_worker_command(model_dir, max_sessions=2)
    with tempfile.TemporaryDirectory(prefix="bench-save-stall-", dir=args.store) as tmp:
        async with spawn_multiplexed_worker(command) as probe:
            info = probe.info
            ids = await probe.tokenize(TEXT * (args.tokens // 20 + 1))
        config = worker_configuration(backend=info.backend, dtype=info.dtype, model_dir=model_dir, weights=info.weights)
        store = await SessionStore.create(
            Path(tmp) / "sessions", model_files=model_identity_files(model_dir), configuration=config
        )
        arrivals: list[float] = []
        saves: list[tuple[float, float]] = []
        resumes: list[tuple[float, float]] = []
        saved_bytes = 0
        async with spawn_multiplexed_worker(command, session_store=store) as client:
            await client.open_session("long")
            params = GenerationParams(session_id="long", max_new_tokens=1, stop_token_ids=[])
            await client.generate(ids[: args.tokens], params).wait()  # kv_len == args.tokens
            await client.open_session("stream")
            stream = client.generate(
                ids[:32], GenerationParams(session_id="stream", max_new_tokens=3000, temperature=0.0, stop_token_ids=[])
            )
            ended = trio.Event()

            async def read_stream() -> None:
                seen = 0
                async for _ in stream:  # a text delta per token (greedy English text)
                    now = time.perf_counter()
                    n = len(stream.token_ids)
                    arrivals.extend([now] * (n - seen))  # a token without text arrives with the next
                    seen = n
                ended.set()

            async def wait_tokens(n: int) -> None:
                target = len(arrivals) + n
                while len(arrivals) < target:
                    if ended.is_set():
                        raise RuntimeError("the streaming session ended before the saves did")
                    await trio.sleep(0.001)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(read_stream)
                await wait_tokens(WARMUP_TOKENS)
                for i in range(args.repeats):
                    t0 = time.perf_counter()
                    saved_bytes = (await client.save_session("long")).payload_bytes
                    saves.append((t0, time.perf_counter()))
                    await wait_tokens(PAUSE_TOKENS // 2)
                    if i < args.repeats - 1:  # a fresh entry: the next save writes the whole session
                        await trio.to_thread.run_sync(store.delete, "long")
                    await wait_tokens(PAUSE_TOKENS // 2)
                for _ in range(args.repeats):
                    await client.close_session("long")
                    await wait_tokens(PAUSE_TOKENS // 2)
                    t0 = time.perf_counter()
                    await client.resume_session("long")
                    resumes.append((t0, time.perf_counter()))
                    await wait_tokens(PAUSE_TOKENS // 2)
                stream.cancel()
    return {
        "arrivals": arrivals,
        "saves": saves,
        "resumes": resumes,
        "bytes": saved_bytes,
        "dtype": info.dtype,
        "weights": info.weights,
    }


def report(args: argparse.Namespace, m: dict) -> None:
    arrivals = m["arrivals"][2:]  # the first gaps include the prompt's prefill
    gaps = [(a, b, b - a) for a, b in zip(arrivals, arrivals[1:])]
    windows = m["saves"] + m["resumes"]
    outside = [g for a, b, g in gaps if not any(b > t0 and a < t1 for t0, t1 in windows)]
    median = statistics.median(outside)
    print(
        f"\n{Path(args.model).name}, muxworker {m['dtype']} ({m['weights']} weights): one session streams "
        f"while another, {args.tokens:,} tokens ({m['bytes'] / 2**20:.1f} MiB of token ids and KV rows), is "
        f"saved whole or resumed; the stream's median inter-token gap outside those {median * 1e3:.1f} ms "
        f"({len(outside)} gaps; the largest {max(outside) * 1e3:.1f} ms)\n"
    )
    print("| operation | ms | tokens during it | largest gap during it, ms | / median gap |")
    print("|---|---:|---:|---:|---:|")
    worst: dict[str, float] = {}
    for name, spans in (("save", m["saves"]), ("resume", m["resumes"])):
        for i, (t0, t1) in enumerate(spans):
            largest = max((g for a, b, g in gaps if b > t0 and a < t1), default=0.0)  # gaps overlapping it
            worst[name] = max(worst.get(name, 0.0), largest)
            tokens = sum(1 for t in arrivals if t0 <= t <= t1)
            print(
                f"| {name} {i + 1} | {(t1 - t0) * 1e3:.1f} | {tokens} | {largest * 1e3:.1f} | {largest / median:.2f}x |"
            )
    print()
    for name, gap in worst.items():
        print(f"largest gap during a {name}: {gap * 1e3:.1f} ms = {gap / median:.2f}x the median gap (target <= 2x)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4000, help="length of the saved session")
    ap.add_argument("--repeats", type=int, default=5, help="saves (and resumes) during the stream")
    ap.add_argument("--model", default=None, help="model (default: the bundled SmolLM2 GGUF)")
    ap.add_argument("--store", default=None, help="directory for the temporary store (default: $TMPDIR)")
    args = ap.parse_args()
    args.model = str(Path(args.model) if args.model else bundled_gguf_path())
    report(args, trio.run(measure, args))


if __name__ == "__main__":
    main()
