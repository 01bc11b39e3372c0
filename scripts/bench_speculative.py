"""Single-session decode speed with and without speculative decoding, side by side in one run.

For each workload and dtype the target (default: the bundled SmolLM2-135M) decodes its prompts,
once plainly, once per early-exit draft made by scripts/make_draft.py from its first K layers, and
once with prompt lookup (``--speculative ngram``). Workloads:

- ``chat``: three chat questions (nothing to copy);
- ``edit``: a ~1,500-token source file (transport/checkpoint/blocks.py of this repository) in the
  prompt and an instruction to rewrite it with one small change, so the output copies the file.

Each runs greedily and at temperature 0.7. The table gives decode tok/s (first token excluded: that
is prefill), the ratio to plain decoding, the acceptance rate (accepted / proposed), tokens
committed per target forward, and, when greedy, whether the tokens equal the plain run (they must:
greedy speculative decoding is exact).

    python scripts/bench_speculative.py [--model PATH] [--layers 4,8] [--n_draft 4]
                                        [--dtypes float32,bfloat16] [--tokens 64] [--edit_tokens 256]
                                        [--workloads chat,edit] [--temperatures 0,0.7] [--repeats 3]

Engines run round-robin and the median round is reported, so a change in machine load mid-run
does not favour one configuration.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from make_draft import make_draft

from muxworker.worker.build import load_engine
from muxworker.worker.engine.config import EngineConfig
from muxworker.worker.engine.sampling import SamplingParams
from muxworker.worker.models.loader import resolve_model

CHATS = [
    "What is the capital of France? Answer in two sentences.",
    "Write a Python function that reverses a string, with a docstring.",
    "Name three colours of the rainbow and say something about each.",
]
SOURCE = Path(__file__).resolve().parents[1] / "transport" / "checkpoint" / "blocks.py"


def workloads() -> dict[str, list[str]]:
    code = SOURCE.read_text()
    edit = (
        "Here is a Python file:\n\n```python\n" + code + "```\n\nRewrite the whole file with one change: "
        "rename the function `split_segment` to `cut_segment` everywhere. Output only the new file."
    )
    return {"chat": CHATS, "edit": [edit]}


def decode(engine, tokens: int, prompts: list[str] = CHATS, temperature: float = 0.0) -> dict:
    """Decode every prompt in one session at a time; sum tokens and times."""
    totals = {"tokens": 0, "time": 0.0, "proposed": 0, "accepted": 0, "forwards": 0, "ids": []}
    params = SamplingParams(max_new_tokens=tokens, temperature=temperature, seed=7, stop_token_ids=[])
    for i, text in enumerate(prompts):
        ids = engine.tokenizer.encode(
            engine.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True),
            parse_special=True,
        )
        engine.open_session("bench")
        engine.submit(i + 1, "bench", ids, params)
        forwards0 = engine.stats["forward_calls"]
        result = None
        while engine.has_work():
            for out in engine.step():
                if out.result is not None:
                    result = out.result
        engine.close_session("bench")
        assert result is not None
        totals["tokens"] += result["completion_tokens"] - 1  # the first token comes from prefill
        totals["time"] += result["decode_time_s"]
        totals["proposed"] += result["draft_proposed_tokens"]
        totals["accepted"] += result["draft_accepted_tokens"]
        totals["forwards"] += engine.stats["forward_calls"] - forwards0 - 1  # minus the prefill forward
        totals["ids"].append(result["generated_token_ids"])
    return totals


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF directory or .gguf (default: bundled SmolLM2)")
    ap.add_argument("--layers", default="4,8", help="draft depths K to compare (first K layers)")
    ap.add_argument("--n_draft", type=int, default=4)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per chat prompt")
    ap.add_argument("--edit_tokens", type=int, default=256, help="new tokens of the edit workload")
    ap.add_argument("--workloads", default="chat,edit")
    ap.add_argument("--temperatures", default="0,0.7")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved rounds; the median round counts")
    args = ap.parse_args()
    model = resolve_model(args.model, progress=None)
    layers = [int(k) for k in args.layers.split(",") if k]
    prompts = workloads()
    temperatures = [float(t) for t in args.temperatures.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="muxworker-drafts-") as tmp:
        drafts = {k: make_draft(model, Path(tmp) / f"draft-{k}", k) for k in layers}
        for dtype in args.dtypes.split(","):
            limits = dict(max_sessions=1, max_session_tokens=4096)
            engines = {"none": load_engine(model, EngineConfig(**limits), dtype=dtype, progress=None)}
            config = EngineConfig(**limits, n_draft=args.n_draft, speculative="ngram")
            engines[f"ngram, n_draft {args.n_draft}"] = load_engine(model, config, dtype=dtype, progress=None)
            for k in layers:
                config = EngineConfig(**limits, n_draft=args.n_draft)
                engines[f"first {k} layers, n_draft {args.n_draft}"] = load_engine(
                    model, config, dtype=dtype, progress=None, draft=drafts[k]
                )
            for eng in engines.values():
                decode(eng, 8)  # warm-up
            for workload in args.workloads.split(","):
                n = args.edit_tokens if workload == "edit" else args.tokens
                for temperature in temperatures:
                    # Round-robin over the engines so that a change in machine load hits all alike.
                    runs: dict[str, list[dict]] = {name: [] for name in engines}
                    for _ in range(args.repeats):
                        for name, eng in engines.items():
                            runs[name].append(decode(eng, n, prompts[workload], temperature))
                    base = _median([r["tokens"] / r["time"] for r in runs["none"]])
                    for name, rs in runs.items():
                        rate = _median([r["tokens"] / r["time"] for r in rs])
                        rows.append((workload, temperature, dtype, name, rate, rate / base, rs[0], runs["none"][0]))
            del engines
    print(
        f"torch {torch.__version__}, threads {torch.get_num_threads()}, target {Path(model).name}, "
        f"chat: {len(CHATS)} prompts x {args.tokens} tokens, edit: 1 prompt x {args.edit_tokens} tokens, "
        f"one session, median of {args.repeats} rounds\n"
    )
    print(
        "| workload | temperature | dtype | speculative | decode tok/s | vs plain | acceptance "
        "| tokens / target forward | same tokens |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for workload, temperature, dtype, name, rate, ratio, r, base in rows:
        acc = f"{r['accepted'] / r['proposed']:.0%} ({r['accepted']}/{r['proposed']})" if r["proposed"] else "-"
        per_forward = r["tokens"] / max(r["forwards"], 1)
        same = ("yes" if r["ids"] == base["ids"] else "NO") if temperature == 0 else "-"
        print(
            f"| {workload} | {temperature:g} | {dtype} | {name} | {rate:.1f} | {ratio:.2f} | {acc} "
            f"| {per_forward:.2f} | {same} |"
        )


if __name__ == "__main__":
    main()
