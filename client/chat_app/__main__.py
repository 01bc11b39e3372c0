"""python -m muxworker.chat [--session NAME] [--store DIR] [--model PATH]"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import trio

from muxworker.client import (
    CheckpointNotFound,
    GenerationParams,
    MuxError,
    SessionStore,
    default_worker_command,
    spawn_multiplexed_worker,
)
from muxworker.client.checkpoint import CheckpointError
from muxworker.worker.identity import model_identity_files, worker_configuration
from muxworker.worker.loader import resolve_model

from . import Conversation, default_store_dir, iter_lines


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m muxworker.chat", description="Terminal chat with resumable sessions.")
    p.add_argument("--session", default="default", help="session name; resumed from the store if saved (default: default)")
    p.add_argument("--store", type=Path, default=None, help=f"session store directory (default: {default_store_dir()})")
    p.add_argument("--model", default=None, help="HF model directory or .gguf (default: the bundled SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--max_new_tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--max_session_tokens", type=int, default=4096)
    return p


def _info(msg: str) -> None:
    print(f"[{msg}]", file=sys.stderr, flush=True)


async def chat(args: argparse.Namespace) -> int:
    # Resolve (and on first use convert) the model here, so progress shows on this terminal and
    # the store can be bound to the exact files the worker will load.
    model_dir = resolve_model(args.model, progress=sys.stderr)
    config = worker_configuration(backend="torch", dtype=args.dtype)
    store_dir = args.store or default_store_dir()
    store_dir.parent.mkdir(parents=True, exist_ok=True)
    store = await SessionStore.create(store_dir, model_files=model_identity_files(model_dir), configuration=config)
    transcripts = store_dir / "transcripts"
    transcripts.mkdir(mode=0o700, exist_ok=True)
    transcript = transcripts / f"{store.path_for(args.session).stem}.json"
    command = default_worker_command(
        model_dir, dtype=args.dtype, device=args.device, max_sessions=1, max_session_tokens=args.max_session_tokens
    )
    async with spawn_multiplexed_worker(command, session_store=store) as client:
        conv = Conversation(args.session)
        resumed = False
        if transcript.exists():
            try:
                await client.resume_session(args.session)
                conv = Conversation.load(transcript)
                resumed = True
                _info(f"resumed session {args.session!r}: {len(conv.history_ids)} tokens restored, {len(conv.messages)} messages")
            except (CheckpointNotFound, CheckpointError, MuxError) as exc:
                _info(f"could not resume {args.session!r} ({exc}); starting fresh")
        if not resumed:
            await client.open_session(args.session)
            _info(f"new session {args.session!r}; commands: /save, /reset, /quit")
        params = GenerationParams(
            session_id=args.session, max_new_tokens=args.max_new_tokens, temperature=args.temperature
        )

        async def save() -> None:
            if not conv.history_ids:
                return
            try:
                await client.save_session(args.session)
                conv.save(transcript)
                _info(f"saved {len(conv.history_ids)} tokens to {store.path_for(args.session)}")
            except MuxError as exc:
                _info(f"not saved: {exc}")

        async for line in iter_lines("you> "):
            cmd = line.strip()
            if not cmd:
                continue
            if cmd == "/quit":
                break
            if cmd == "/save":
                await save()
                continue
            if cmd == "/reset":
                await client.reset_session(args.session)
                conv = Conversation(args.session)
                _info("session reset")
                continue
            sys.stdout.write("assistant> ")
            turn = await conv.send(client, cmd, params, echo=lambda t: (sys.stdout.write(t), sys.stdout.flush()))
            sys.stdout.write("\n")
            r = turn.result
            _info(
                f"{r.completion_tokens} tokens, prefilled {r.prefilled_prompt_tokens}, reused {r.reused_prompt_tokens}, "
                f"first token {turn.first_token_s * 1000:.0f} ms"
            )
        await save()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return trio.run(chat, args)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
