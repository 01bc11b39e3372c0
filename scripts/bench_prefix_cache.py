"""Time to first token for N new sessions sharing a long system prompt, prefix cache off vs on.

Both engines run in this process on the bundled SmolLM2, alternating, so the ratio is measured
side by side. Each session's prompt is the shared system prompt plus its own short user turn.

    python scripts/bench_prefix_cache.py [--sessions 8] [--system_tokens 1000] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import statistics
import time

from muxworker.worker.build import load_engine
from muxworker.worker.engine.config import EngineConfig
from muxworker.worker.engine.sampling import SamplingParams

TEXT = (
    "You are a careful coding assistant. Follow the repository's style, explain every change, "
    "prefer small commits, write tests first, and never guess an API: read its documentation. "
)


def ttfts(engine, prompts: list[list[int]]) -> tuple[list[float], list[int]]:
    """One new session per prompt, one after another; time until each first token."""
    out, prefilled = [], []
    params = SamplingParams(max_new_tokens=1, temperature=0, stop_token_ids=[])
    for i, p in enumerate(prompts):
        sid = f"s{i}"
        engine.open_session(sid)
        t0 = time.perf_counter()
        engine.submit(i + 1, sid, p, params)
        result = None
        while result is None:
            for o in engine.step():
                if o.result is not None:
                    result = o.result
        out.append(time.perf_counter() - t0)
        prefilled.append(result["prefilled_prompt_tokens"])
        engine.close_session(sid)
    return out, prefilled


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--system_tokens", type=int, default=1000)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--model", default=None)
    args = ap.parse_args()
    engines = {
        entries: load_engine(
            args.model,
            EngineConfig(max_sessions=2, max_session_tokens=args.system_tokens + 256, prefix_cache_entries=entries),
            dtype=args.dtype,
            progress=None,
        )
        for entries in (0, 4)
    }
    tok = engines[0].tokenizer
    system = (tok.encode(TEXT) * (args.system_tokens // 20 + 1))[: args.system_tokens]
    prompts = [
        system + tok.encode(f"User {i}: please review pull request number {100 + i}.") for i in range(args.sessions)
    ]
    for e in engines.values():  # warm-up; its prompt shares no prefix with the measured ones
        ttfts(e, [tok.encode("warm up the kernels") * 4])
    off, off_pref = ttfts(engines[0], prompts)
    on, on_pref = ttfts(engines[4], prompts)
    print(
        f"SmolLM2-135M, {args.dtype}, CPU; {args.sessions} new sessions, {args.system_tokens}-token shared system prompt\n"
    )
    print("| | cache off | cache on (4 entries) | on / off |")
    print("|---|---:|---:|---:|")
    print(f"| first session TTFT | {off[0] * 1e3:.0f} ms | {on[0] * 1e3:.0f} ms | {on[0] / off[0]:.2f} |")
    m_off, m_on = statistics.median(off[1:]), statistics.median(on[1:])
    print(f"| later sessions, median TTFT | {m_off * 1e3:.0f} ms | {m_on * 1e3:.0f} ms | {m_on / m_off:.2f} |")
    print(
        f"| later sessions, tokens prefilled each | {statistics.median(off_pref[1:]):.0f} | {statistics.median(on_pref[1:]):.0f} | |"
    )
    print(
        f"| all {args.sessions} sessions, total TTFT | {sum(off) * 1e3:.0f} ms | {sum(on) * 1e3:.0f} ms | {sum(on) / sum(off):.2f} |"
    )


if __name__ == "__main__":
    main()
