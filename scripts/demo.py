"""The main job in one command (`make demo`): chat, save, stop the worker, restart, resume, continue.

Runs a short scripted multi-turn chat with the bundled SmolLM2-135M-Instruct, saves the session to
a SessionStore, closes the worker, starts a new one, resumes the session and continues the
conversation. Then it prints what a cold start of that last turn would have cost next to the
resumed one, measured in the same run, and checks that the resumed reply is token for token the
one the first worker gave when it continued the session without a restart.

    python scripts/demo.py [--model PATH] [--store DIR] [--dtype auto] [--weights quantized|float] [--threads N]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import trio

from muxworker.chat import Conversation
from muxworker.client import GenerationParams, SessionStore, default_worker_command, spawn_multiplexed_worker
from muxworker.worker.models.defaults import DTYPE_CHOICES, WEIGHTS_CHOICES
from muxworker.worker.models.identity import model_identity_files, worker_configuration
from muxworker.worker.models.loader import resolve_model

SCRIPT_BEFORE = [
    "Hi! I'm planning a small vegetable garden. Which three vegetables are easiest for a beginner?",
    "Which of those grows fastest?",
]
SCRIPT_AFTER = ["Great. How often should I water it?"]
SESSION = "garden-chat"


def _say(role: str, text: str) -> None:
    print(f"  {role:>9}: {text.strip()}")


async def demo(args: argparse.Namespace) -> None:
    model_dir = resolve_model(args.model, progress=sys.stderr)
    store_dir = Path(args.store) if args.store else Path(tempfile.mkdtemp(prefix="muxworker-demo-")) / "sessions"
    config = worker_configuration(backend="torch", dtype=args.dtype, weights=args.weights, model_dir=model_dir)
    command = default_worker_command(
        model_dir, dtype=args.dtype, weights=args.weights, threads=args.threads, max_sessions=2, max_session_tokens=4096
    )
    params = GenerationParams(session_id=SESSION, max_new_tokens=args.max_new_tokens, temperature=0)

    print(
        f"model: {model_dir.name} (dtype {config['dtype']}, weights {config['weights']}), session store: {store_dir}\n"
    )
    print("1. A worker starts and the conversation begins.")
    t0 = time.perf_counter()
    store = await SessionStore.create(store_dir, model_files=model_identity_files(model_dir), configuration=config)
    conv = Conversation(SESSION)
    async with spawn_multiplexed_worker(command, session_store=store) as client:
        print(f"   (worker up in {time.perf_counter() - t0:.1f} s, pid {client.pid})")
        await client.open_session(SESSION)
        for text in SCRIPT_BEFORE:
            _say("user", text)
            turn = await conv.send(client, text, params)
            _say("assistant", turn.text)
        ts = time.perf_counter()
        await client.save_session(SESSION)
        save_s = time.perf_counter() - ts
        # The reference for what resuming must reproduce: the same session continued without a restart.
        live = Conversation(SESSION, list(conv.messages), list(conv.history_ids))
        for text in SCRIPT_AFTER:
            live_turn = await live.send(client, text, params)
    file = store.path_for(SESSION)
    saved_tokens = len(conv.history_ids)
    print(
        f"\n2. Saved {saved_tokens} tokens to {file.name} ({file.stat().st_size / 2**20:.1f} MiB) in {save_s * 1000:.0f} ms;"
        " the worker was stopped.\n"
    )

    print("3. A new worker starts, with the store recreated from the same model files and settings.")
    store = await SessionStore.create(store_dir, model_files=model_identity_files(model_dir), configuration=config)
    async with spawn_multiplexed_worker(command, session_store=store) as client:
        tr = time.perf_counter()
        await client.resume_session(SESSION)
        resume_s = time.perf_counter() - tr
        print(f"   resumed {SESSION!r} in {resume_s * 1000:.0f} ms")
        # The same last turn on a cold session, for comparison (same worker, same prompt).
        cold = Conversation("cold", list(conv.messages), list(conv.history_ids))
        await client.open_session("cold")
        for text in SCRIPT_AFTER:
            _say("user", text)
            turn = await conv.send(client, text, params)
            _say("assistant", turn.text)
            cold_turn = await cold.send(client, text, GenerationParams(**{**params.__dict__, "session_id": "cold"}))
        same = live_turn.result.generated_token_ids == turn.result.generated_token_ids
        same_cold = cold_turn.result.generated_token_ids == turn.result.generated_token_ids
    r, c = turn.result, cold_turn.result
    print("\n4. The last turn, resumed vs cold (measured side by side in this run):\n")
    print("| | resumed session | cold session |")
    print("|---|---|---|")
    print(
        f"| time to first token | {(resume_s + turn.first_token_s) * 1000:.0f} ms (incl. {resume_s * 1000:.0f} ms resume) | {cold_turn.first_token_s * 1000:.0f} ms |"
    )
    print(
        f"| prompt tokens prefilled | {r.prefilled_prompt_tokens} of {r.prompt_tokens} | {c.prefilled_prompt_tokens} of {c.prompt_tokens} |"
    )
    print(f"| checkpoint file | {file.stat().st_size / 2**20:.1f} MiB, saved in {save_s * 1000:.0f} ms | - |")
    print(f"| same reply as the session continued without the restart | {'yes' if same else 'NO'} | |")
    # A cold prefill computes the history's KV in one dense pass where the live session decoded it
    # token by token (with quantized weights, through the int4 kernel), so its reply may differ.
    print(f"| same reply as the cold session | {'yes' if same_cold else 'no'} | |")
    if not args.store:
        store.delete(SESSION)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--store", default=None, help="session store directory (default: a temporary one)")
    ap.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES, help="the worker's --dtype (default: auto)")
    ap.add_argument(
        "--weights", default=None, choices=WEIGHTS_CHOICES, help="the worker's --weights (default: the model's)"
    )
    ap.add_argument("--threads", type=int, default=None, help="the worker's --threads (default: one per physical core)")
    ap.add_argument("--max_new_tokens", type=int, default=48)
    trio.run(demo, ap.parse_args())


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
