"""The main job in one command (`make demo`): chat, save, stop the worker, restart, resume, continue.

Runs two conversations with the bundled SmolLM2-135M-Instruct: a short scripted chat, and a long one
(2,000+ tokens: its user turns paste parts of a garden log). Replies stream as they are generated.
Both sessions are saved to a SessionStore, the worker is closed, a new one starts, and each session
is resumed and continued. For each, the resumed last turn is printed next to a cold session that
prefills the whole history for the same turn, measured in the same run, and the resumed reply is
checked to be token for token the one the first worker gave when it continued the session without a
restart (the exit status is 1 if it is not). The header names the weights as the file holds them
(a GGUF's tensor types) and as the worker runs them (its hello's weights and dtype).

    python scripts/demo.py [--model PATH] [--store DIR] [--dtype auto] [--weights quantized|float] [--threads N]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import trio

from muxworker.chat import Conversation, Turn
from muxworker.client import (
    GenerationParams,
    GenerationResult,
    MultiplexedWorkerClient,
    SessionStore,
    WorkerInfo,
    spawn_multiplexed_worker,
)
from muxworker.native import QUANT_TYPES
from muxworker.worker.models.defaults import DTYPE_CHOICES, WEIGHTS_CHOICES
from muxworker.worker.models.gguf_tensors import TENSOR_INDEX, GGUFTensorIndex
from muxworker.worker.models.loader import load_model_dir, resolve_model
from muxworker.worker.spec import WorkerSpec

SCRIPT_BEFORE = [
    "Hi! I'm planning a small vegetable garden. Which three vegetables are easiest for a beginner?",
    "Which of those grows fastest?",
]
SCRIPT_AFTER = ["Great. How often should I water it?"]
SESSION = "garden-chat"

LONG_SESSION = "garden-log"
LONG_AFTER = "Looking at all of my notes, which bed will be ready to harvest first, and how much water does it need?"
BEDS_PER_PART = 8
MAX_LONG_PARTS = 12  # a bound on the loop below, far above what 2,000 tokens take

# The garden log the long conversation pastes: (crop, sown, spacing cm, light, water cm a week,
# days to harvest, a note). Bed i grows _CROPS[i % len(_CROPS)]; later rounds are later sowings.
_CROPS = [
    ("radishes", "March", 5, "full sun", 2.5, 25, "The first sowing came up unevenly, so I thinned it twice"),
    (
        "lettuce",
        "March",
        25,
        "partial shade",
        3.0,
        45,
        "Slugs took a few seedlings before I put copper tape round the bed",
    ),
    ("spinach", "April", 15, "partial shade", 2.5, 40, "It bolted in the first hot week, earlier than the packet said"),
    ("peas", "April", 8, "full sun", 2.5, 60, "The netting went up late and the tendrils caught on the second try"),
    ("carrots", "April", 5, "full sun", 2.5, 70, "I mixed the seed with sand to sow it thinly, which worked well"),
    ("beetroot", "April", 10, "full sun", 2.5, 60, "Each seed cluster gave three or four seedlings to thin out"),
    ("onions", "April", 10, "full sun", 2.0, 110, "The sets went in with their tips just showing above the soil"),
    ("potatoes", "April", 30, "full sun", 3.0, 90, "I earthed them up twice, when the shoots reached about 20 cm"),
    ("tomatoes", "May", 50, "full sun", 4.0, 75, "Staked at planting, with the side shoots pinched out every week"),
    ("courgettes", "May", 90, "full sun", 4.0, 55, "Two plants would have been plenty; four is far too many for us"),
    ("runner beans", "May", 20, "full sun", 3.5, 70, "The canes form a wigwam at the north end so they shade nothing"),
    ("kale", "May", 45, "full sun", 2.5, 60, "A mesh cover keeps the cabbage white butterflies off the leaves"),
    ("chard", "May", 30, "partial shade", 2.5, 55, "The rainbow variety looks good enough to grow by the front door"),
    ("cucumbers", "June", 45, "full sun", 4.0, 60, "They climb a trellis against the fence and need tying in weekly"),
    ("pumpkins", "June", 150, "full sun", 4.0, 110, "One plant has already spread across the path to the compost bin"),
    ("leeks", "June", 15, "full sun", 2.5, 120, "Dropped into deep dibber holes and watered in, not backfilled"),
]
_ROUNDS = ["first", "second", "third", "fourth"]


def garden_log_part(part: int, beds: int = BEDS_PER_PART) -> str:
    """Part ``part`` (from 0) of the garden log: ``beds`` paragraphs, one per bed, deterministic."""
    paragraphs = []
    for i in range(part * beds, (part + 1) * beds):
        crop, month, spacing, light, water, days, note = _CROPS[i % len(_CROPS)]
        sowing = _ROUNDS[(i // len(_CROPS)) % len(_ROUNDS)]
        paragraphs.append(
            f"Bed {i + 1}: {crop}, the {sowing} sowing. Sown in {month}, {spacing} cm apart, in {light}. "
            f"It gets about {water} cm of water a week, more in dry spells, and should be ready about "
            f"{days} days after sowing. {note}. The soil was dug over in February and had two "
            f"barrows of compost; I check the bed every other evening and note what has changed."
        )
    return "\n\n".join(paragraphs)


def long_user_message(part: int) -> tuple[str, str]:
    """(the message sent, what the demo prints for it) for part ``part`` of the long conversation."""
    log = garden_log_part(part)
    first, last = part * BEDS_PER_PART + 1, (part + 1) * BEDS_PER_PART
    question = "In one short sentence: which of these beds needs the most water?"
    text = f"Here is part {part + 1} of my garden log, beds {first} to {last}:\n\n{log}\n\n{question}"
    return text, f"[pastes part {part + 1} of a garden log: beds {first}-{last}, {len(log):,} characters] {question}"


def weights_format(model_dir: Path) -> str:
    """The weights as the model's files hold them: a GGUF's name and its tensors' types, or the
    safetensors files and their dtype."""
    if (model_dir / TENSOR_INDEX).is_file():
        index = GGUFTensorIndex.open(model_dir)
        types = Counter(e.type for e in index.entries.values())
        counts = ", ".join(f"{n} {t}" for t, n in types.most_common())
        return f"{index.path.name} (GGUF, {sum(types.values())} tensors: {counts})"
    files = load_model_dir(model_dir)
    dtype = files.config.get("torch_dtype") or files.config.get("dtype") or "dtype not stated"
    return f"{', '.join(f.name for f in files.weight_files)} (safetensors, {dtype})"


def runs_as(info: WorkerInfo, model_dir: Path) -> str:
    """How the worker says (its hello) it runs the weights."""
    head = f"weights {info.weights}, dtype {info.dtype}, {info.backend} on {info.device}"
    if info.weights == "quantized" and (model_dir / TENSOR_INDEX).is_file():
        types = {e.type for e in GGUFTensorIndex.open(model_dir).entries.values()}
        kept = "/".join(t for t in QUANT_TYPES if t in types)
        if kept:
            return f"{head}: its {kept} blocks decode in place (native step), prefill runs dense copies"
    if info.weights == "float":
        return f"{head}: every tensor in {info.dtype}"
    if info.weights in ("int4", "int8"):
        return f"{head}: linear weights quantized to {info.weights} blocks at load (native step)"
    return head


class _Echo:
    """Prints a reply's deltas as they arrive, without its leading and trailing whitespace."""

    def __init__(self) -> None:
        self.started = False
        self.pending = ""

    def __call__(self, delta: str) -> None:
        text = self.pending + delta
        if not self.started:
            text = text.lstrip()
            if not text:
                return
            self.started = True
        shown = text.rstrip()
        self.pending = text[len(shown) :]
        print(shown, end="", flush=True)


async def streamed_turn(
    conv: Conversation, client: MultiplexedWorkerClient, text: str, params: GenerationParams, shown: str | None = None
) -> Turn:
    """One turn, printed: the user's message, then the reply as it streams."""
    print(f"  {'user':>9}: {(shown or text).strip()}")
    print(f"  {'assistant':>9}: ", end="", flush=True)
    turn = await conv.send(client, text, params, echo=_Echo())
    print()
    return turn


def _tokens(r: GenerationResult) -> str:
    return f"{r.reused_prompt_tokens:,} reused + {r.prefilled_prompt_tokens:,} prefilled of {r.prompt_tokens:,}"


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:,.0f} ms"


async def demo(args: argparse.Namespace) -> int:
    model_dir = resolve_model(args.model, progress=sys.stderr)
    store_dir = Path(args.store) if args.store else Path(tempfile.mkdtemp(prefix="muxworker-demo-")) / "sessions"
    spec = WorkerSpec.of(
        model_dir, dtype=args.dtype, weights=args.weights, threads=args.threads, max_sessions=2, max_session_tokens=4096
    )
    command = spec.command()
    params = GenerationParams(session_id=SESSION, max_new_tokens=args.max_new_tokens, temperature=0)
    fill = GenerationParams(session_id=LONG_SESSION, max_new_tokens=args.long_turn_tokens, temperature=0)
    long_params = dataclasses.replace(params, session_id=LONG_SESSION)

    print(f"model: {weights_format(model_dir)}")
    print(f"  converted directory: {model_dir}")
    print(f"session store: {store_dir}\n")
    print("1. A worker starts and the short conversation begins.")
    t0 = time.perf_counter()
    store = await SessionStore.create(store_dir, **spec.store_identity())
    conv = Conversation(SESSION)
    long = Conversation(LONG_SESSION)
    async with spawn_multiplexed_worker(command, session_store=store) as client:
        assert client.info is not None
        print(f"   (worker up in {time.perf_counter() - t0:.1f} s, pid {client.pid})")
        print(f"   the worker's hello: {runs_as(client.info, model_dir)}")
        await client.open_session(SESSION)
        for text in SCRIPT_BEFORE:
            await streamed_turn(conv, client, text, params)
        ts = time.perf_counter()
        await client.save_session(SESSION)
        save_s = time.perf_counter() - ts
        # The reference for what resuming must reproduce: the same session continued without a restart.
        live = Conversation(SESSION, list(conv.messages), list(conv.history_ids))
        for text in SCRIPT_AFTER:
            live_turn = await live.send(client, text, params)
        file = store.path_for(SESSION)
        saved_tokens = len(conv.history_ids)
        saved_mib = store.nbytes(SESSION) / 2**20
        print(f"   saved {saved_tokens} tokens ({saved_mib:.1f} MiB) in {_ms(save_s)}\n")

        print(
            f"2. The long conversation: each user turn pastes part of a garden log, until {args.long_tokens:,} tokens."
        )
        await client.open_session(LONG_SESSION)
        part = 0
        while len(long.history_ids) < args.long_tokens and part < MAX_LONG_PARTS:
            text, shown = long_user_message(part)
            turn = await streamed_turn(long, client, text, fill, shown)
            r = turn.result
            print(f"  {'':>9}  ({_tokens(r)} prompt tokens; {turn.total_s:.2f} s)")
            part += 1
        if len(long.history_ids) < args.long_tokens:
            print(f"the long conversation holds {len(long.history_ids)} tokens, under {args.long_tokens}")
            return 1
        ts = time.perf_counter()
        await client.save_session(LONG_SESSION)
        long_save_s = time.perf_counter() - ts
        live_long = Conversation(LONG_SESSION, list(long.messages), list(long.history_ids))
        live_long_turn = await live_long.send(client, LONG_AFTER, long_params)
    long_file = store.path_for(LONG_SESSION)
    long_tokens = len(long.history_ids)
    long_mib = store.nbytes(LONG_SESSION) / 2**20
    print(
        f"   saved {long_tokens:,} tokens ({long_mib:.1f} MiB) in {_ms(long_save_s)}\n\n"
        f"3. Both sessions are saved ({file.name[:12]}..., {long_file.name[:12]}...); the worker was stopped.\n"
    )

    print("4. A new worker starts, with the store recreated from the same model files and settings.")
    t0 = time.perf_counter()
    store = await SessionStore.create(store_dir, **spec.store_identity())
    async with spawn_multiplexed_worker(command, session_store=store) as client:
        print(f"   (worker up in {time.perf_counter() - t0:.1f} s, pid {client.pid})")
        tr = time.perf_counter()
        await client.resume_session(SESSION)
        resume_s = time.perf_counter() - tr
        print(f"   resumed {SESSION!r} in {_ms(resume_s)}")
        # The same last turn on a cold session, for comparison (same worker, same prompt).
        cold = Conversation("cold", list(conv.messages), list(conv.history_ids))
        await client.open_session("cold")
        for text in SCRIPT_AFTER:
            turn = await streamed_turn(conv, client, text, params)
            cold_turn = await cold.send(client, text, dataclasses.replace(params, session_id="cold"))
        same = live_turn.result.generated_token_ids == turn.result.generated_token_ids
        same_cold = cold_turn.result.generated_token_ids == turn.result.generated_token_ids
        await client.close_session(SESSION)
        await client.close_session("cold")

        tr = time.perf_counter()
        await client.resume_session(LONG_SESSION)
        long_resume_s = time.perf_counter() - tr
        print(f"\n   resumed {LONG_SESSION!r} ({long_tokens:,} tokens) in {_ms(long_resume_s)}")
        long_cold = Conversation("long-cold", list(long.messages), list(long.history_ids))
        long_turn = await streamed_turn(long, client, LONG_AFTER, long_params)
        await client.open_session("long-cold")
        long_cold_turn = await long_cold.send(
            client, LONG_AFTER, dataclasses.replace(long_params, session_id="long-cold")
        )
        long_same = live_long_turn.result.generated_token_ids == long_turn.result.generated_token_ids
        long_same_cold = long_cold_turn.result.generated_token_ids == long_turn.result.generated_token_ids

    r, c = turn.result, cold_turn.result
    print("\n5. The short conversation's last turn, resumed vs cold (measured side by side in this run):\n")
    print("| | resumed session | cold session |")
    print("|---|---|---|")
    print(
        f"| time to first token | {_ms(resume_s + turn.first_token_s)} (incl. {_ms(resume_s)} resume)"
        f" | {_ms(cold_turn.first_token_s)} |"
    )
    print(f"| prompt tokens | {_tokens(r)} | {_tokens(c)} |")
    print(f"| checkpoint files | {saved_mib:.1f} MiB, saved in {_ms(save_s)} | - |")
    print(f"| same reply as the session continued without the restart | {'yes' if same else 'NO'} | |")
    # A cold prefill computes the history's KV in one dense pass where the live session decoded it
    # token by token (with quantized weights, through the native step), so its reply may differ.
    print(f"| same reply as the cold session | {'yes' if same_cold else 'no'} | |")

    r, c = long_turn.result, long_cold_turn.result
    resumed_first = long_resume_s + long_turn.first_token_s
    resumed_total = long_resume_s + long_turn.total_s
    print(f"\n6. The long conversation ({long_tokens:,} tokens saved) and its last turn, resumed vs cold:\n")
    print("| | resumed session | cold session |")
    print("|---|---|---|")
    history = f"| the {long_tokens:,}-token history | restored by resume_session in {_ms(long_resume_s)}"
    print(f"{history} | prefilled with the turn |")
    print(f"| prompt tokens | {_tokens(r)} | {_tokens(c)} |")
    print(
        f"| time to first token | {_ms(resumed_first)} (incl. {_ms(long_resume_s)} resume)"
        f" | {_ms(long_cold_turn.first_token_s)} |"
    )
    print(
        f"| whole turn ({r.completion_tokens} tokens generated) | {_ms(resumed_total)} (incl. resume)"
        f" | {_ms(long_cold_turn.total_s)} |"
    )
    print(f"| checkpoint files | {long_mib:.1f} MiB, saved in {_ms(long_save_s)} | - |")
    print(f"| same reply as the session continued without the restart | {'yes' if long_same else 'NO'} | |")
    print(f"| same reply as the cold session | {'yes' if long_same_cold else 'no'} | |")
    print(
        f"\nresumed vs cold, {long_tokens:,}-token conversation: first token {_ms(resumed_first)} vs"
        f" {_ms(long_cold_turn.first_token_s)} ({long_cold_turn.first_token_s / resumed_first:.1f}x sooner),"
        f" whole turn {_ms(resumed_total)} vs {_ms(long_cold_turn.total_s)}"
        f" ({long_cold_turn.total_s / resumed_total:.1f}x faster)"
    )
    if not args.store:
        store.delete(SESSION)
        store.delete(LONG_SESSION)
    if not (same and long_same):
        print("FAILED: a resumed reply differs from the one the session gave continued without the restart")
        return 1
    return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--store", default=None, help="session store directory (default: a temporary one)")
    ap.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES, help="the worker's --dtype (default: auto)")
    ap.add_argument(
        "--weights", default=None, choices=WEIGHTS_CHOICES, help="the worker's --weights (default: the model's)"
    )
    ap.add_argument("--threads", type=int, default=None, help="the worker's --threads (default: one per physical core)")
    ap.add_argument("--max_new_tokens", type=int, default=48, help="tokens per reply (default: 48)")
    ap.add_argument("--long_tokens", type=int, default=2000, help="the long conversation's tokens (default: 2000)")
    ap.add_argument(
        "--long_turn_tokens", type=int, default=16, help="tokens per reply while the long conversation is built"
    )
    sys.exit(trio.run(demo, ap.parse_args()))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
