"""muxworker against llama.cpp on the same GGUF, side by side in one run (`make bench-peer`).

`make bench-peer` builds llama-cpp-python into its own venv (.venv-peer, once) and runs

    .venv/bin/python scripts/bench_vs_llamacpp.py --peer-python .venv-peer/bin/python \
        [--threads 2] [--repeats 3] [--worker-args="--weights float --dtype bfloat16"] [--model X.gguf] [--quick]

Both engines load the same GGUF (default: the bundled SmolLM2-135M-Instruct Q4_1): llama.cpp runs
it as it is, muxworker converts it once into its cache (warmed before timing) and runs the worker
with its default flags plus ``--worker-args``. Both get ``--threads`` CPU threads. The engines never
run at the same time: each round runs llama.cpp's processes, then muxworker's, for ``--repeats``
rounds, and the table gives each figure's median with the per-round range. Every process is fresh
(llama.cpp: the peer python running scripts/_llamacpp_peer.py; muxworker: a worker spawned by the
trio client), so load times and memory are those of a new process. Prompts are a paragraph of
English text repeated, tokenized by each engine, and cut to the same token counts. Decoding is
greedy and ignores EOS in both.

Each round, per engine, runs three processes:

- single stream, one context slot of 4,096 tokens (llama.cpp n_ctx=4096; muxworker --max_sessions 1
  --max_session_tokens 4096 --prefix_cache_entries 0):
  load to ready (process start to model loaded and able to generate: llama.cpp from the parent's
  Popen to the peer's "ready" line after llama_model_load_from_file + llama_init_from_model;
  muxworker from the spawn to the client's accepted hello), RSS right after that, decode tok/s
  after a 32-token prompt (128 tokens, timed from the first token to the last), cold prefill tok/s
  of a 512- and a 4,093-token prompt (prompt tokens / time to the first token, in a fresh session /
  a cleared KV cache; 4,093 leaves the room the restore below needs), the save of that 4,093-token
  session to a file (muxworker: SessionStore.save_session, atomic with fsync; llama.cpp:
  llama_state_seq_save_file plus an fsync), decode tok/s after a 3,968-token prompt, peak RSS;
- restore, in a new process with the same slot: the file back into a session (resume_session /
  llama_state_seq_load_file), and restore + first token (the pending token and a 1-token suffix
  prefilled, one token generated);
- 8 streams, 8 slots of 512 tokens (llama.cpp n_seq_max=8, n_ctx=8x512, one batch of 8 sequence
  ids per llama_decode; muxworker --max_sessions 8 --max_session_tokens 512): 8 sessions with their
  own 32-token prompts and first tokens, then 128 more tokens each, all decoding together:
  aggregate tok/s.

``--quick`` is one round with a 1,024-token slot and 32 decoded tokens (a smoke run). A figure that
cannot be measured says why in its cell.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

import muxworker
from muxworker.client import (
    GenerationParams,
    MuxError,
    SessionStore,
    default_worker_command,
    spawn_multiplexed_worker,
)
from muxworker.worker.models.identity import model_identity_files, worker_configuration
from muxworker.worker.models.loader import NAMED_MODELS, bundled_gguf_path, named_model_path, resolve_model

PEER = Path(__file__).resolve().with_name("_llamacpp_peer.py")
PEER_TIMEOUT_S = 900.0
SAVED_SESSION = "saved"
TEXT = (
    "The river town woke slowly in the early autumn. Fishermen pulled their boats onto the gravel, "
    "the baker opened his shutters to let out the smell of bread, and children ran along the quay "
    "on their way to school. Old maps in the library show that the town once stood a mile further "
    "east, before a great flood moved the river and the people followed it, carrying stones from "
    "their houses to build new ones on higher ground. "
)


@dataclass(frozen=True)
class Lengths:
    """Token counts of one run; the same for both engines."""

    slot: int  # context of the single-stream and restore processes
    decode_tokens: int  # generated per decode measurement (the first is not timed)
    short_prompt: int = 32
    prefill_short: int = 512
    n_seq: int = 8
    multi_slot: int = 512

    @property
    def prefill_long(self) -> int:
        # The saved session holds this prompt and its first token; its resumed turn adds one token
        # and generates one: prefill_long + 3 == slot.
        return self.slot - 3

    @property
    def long_decode_prompt(self) -> int:
        return self.slot - self.decode_tokens


@dataclass(frozen=True)
class Row:
    key: str
    label: str
    kind: str  # "speed" (higher is better) or "cost" (time or memory: lower is better)
    scale: float = 1.0  # shown value = figure * scale


def rows_for(n: Lengths) -> list[Row]:
    return [
        Row("load_to_ready_s", "load to ready, s (process start to able to generate)", "cost"),
        Row("rss_after_load_mb", f"RSS after load, MB (one {n.slot:,}-token slot)", "cost"),
        Row("peak_rss_mb", "peak RSS of the single-stream process (VmHWM), MB", "cost"),
        Row("decode_short_tok_s", f"decode tok/s, 1 stream, {n.short_prompt}-token prompt", "speed"),
        Row("decode_long_tok_s", f"decode tok/s, 1 stream, {n.long_decode_prompt:,}-token prompt", "speed"),
        Row(
            "decode_multi_tok_s", f"aggregate decode tok/s, {n.n_seq} streams, {n.short_prompt}-token prompts", "speed"
        ),
        Row(f"prefill_{n.prefill_short}_tok_s", f"cold prefill tok/s, {n.prefill_short:,}-token prompt", "speed"),
        Row(f"prefill_{n.prefill_long}_tok_s", f"cold prefill tok/s, {n.prefill_long:,}-token prompt", "speed"),
        Row("save_s", f"save the {n.prefill_long + 1:,}-token session to a file (fsync), ms", "cost", 1e3),
        Row("state_file_mb", "size of that file, MB", "cost"),
        Row("restore_s", "restore it from the file in a new process, ms", "cost", 1e3),
        Row("restore_first_token_s", "restore + first token (1-token suffix), ms", "cost", 1e3),
    ]


def _why(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".replace("\n", " ")
    return text if len(text) <= 200 else text[:197] + "..."


def _rss_mb(pid: int | None, field: str = "VmRSS") -> float:
    """A process's VmRSS (or VmHWM, its peak) from /proc/<pid>/status, in MB (10^6 bytes)."""
    if pid is None:
        raise RuntimeError("the client does not expose the worker's pid")
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024 / 1e6
    raise RuntimeError(f"/proc/{pid}/status has no {field}")


# ----------------------------------------------------------------------------------------------
# llama.cpp: the peer process


def peer_run(args: argparse.Namespace, config: dict[str, Any]) -> dict[str, Any]:
    """Run _llamacpp_peer.py with ``config`` in a fresh peer process; its figures plus load_to_ready_s."""
    config = {"model": str(args.model), "threads": args.threads, **config}
    with tempfile.TemporaryFile() as err:
        t0 = time.monotonic()
        proc = subprocess.run(
            [args.peer_python, str(PEER), json.dumps(config)],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            timeout=PEER_TIMEOUT_S,
        )
        lines = proc.stdout.splitlines()
        if proc.returncode != 0 or len(lines) < 2 or not lines[0].startswith("ready "):
            err.seek(0)
            tail = err.read().decode(errors="replace").strip().splitlines()[-3:]
            raise RuntimeError(f"the llama.cpp peer exited with status {proc.returncode}: {' / '.join(tail)}")
    out = json.loads(lines[-1])
    out["load_to_ready_s"] = float(lines[0].split()[1]) - t0
    return out


def llamacpp_round(args: argparse.Namespace, n: Lengths, state_path: str) -> dict[str, Any]:
    """One round of llama.cpp: the single-stream, restore and 8-stream processes."""
    figures: dict[str, Any] = {"errors": {}}
    errors = figures["errors"]
    try:
        single = peer_run(
            args,
            {
                "mode": "single",
                "n_ctx": n.slot,
                "text": TEXT,
                "short_prompt": n.short_prompt,
                "decode_tokens": n.decode_tokens,
                "prefill_lengths": [n.prefill_short, n.prefill_long],
                "long_decode_prompt": n.long_decode_prompt,
                "state_path": state_path,
            },
        )
    except Exception as e:
        errors["*single"] = _why(e)
        single = {}
    errors.update(single.pop("errors", {}))
    figures.update(single)
    if "state_file_bytes" in single:
        figures["state_file_mb"] = single["state_file_bytes"] / 1e6
    if "pending_token" in single:
        try:
            restored = peer_run(
                args,
                {
                    "mode": "restore",
                    "n_ctx": n.slot,
                    "state_path": state_path,
                    **{k: single[k] for k in ("saved_tokens", "pending_token", "suffix_token")},
                },
            )
            figures["restore_s"] = restored["restore_s"]
            figures["restore_first_token_s"] = restored["restore_first_token_s"]
            figures["restored_next_token"] = restored["restored_next_token"]
            figures["restored_positions"] = f"[{restored['restored_pos_min']}, {restored['restored_pos_max']}]"
        except Exception as e:
            errors["restore_s"] = errors["restore_first_token_s"] = _why(e)
    else:
        errors["restore_s"] = errors["restore_first_token_s"] = "no saved session"
    try:
        multi = peer_run(
            args,
            {
                "mode": "multi",
                "n_ctx": n.n_seq * n.multi_slot,
                "n_seq": n.n_seq,
                "text": TEXT,
                "short_prompt": n.short_prompt,
                "decode_tokens": n.decode_tokens,
            },
        )
        figures["decode_multi_tok_s"] = multi["decode_multi_tok_s"]
    except Exception as e:
        errors["decode_multi_tok_s"] = _why(e)
    return figures


# ----------------------------------------------------------------------------------------------
# muxworker: workers through the trio client


@dataclass
class Mux:
    """What every muxworker round shares: the worker flags, the warm-up's hello and the session store."""

    args: argparse.Namespace
    flags: dict[str, Any]  # worker flags added to every command (--threads, --prefix_cache_entries)
    store: SessionStore | None = None
    store_error: str = "the warm-up worker failed"  # why there is no store
    start_error: str = "the worker does not start"  # why the warm-up worker failed
    info: Any = None  # the warm-up worker's hello (WorkerInfo)

    def command(self, **flags: Any) -> list[str]:
        cmd = default_worker_command(self.args.model, **self.flags, **flags)
        return cmd + shlex.split(self.args.worker_args)


def _greedy(session_id: str, max_new_tokens: int) -> GenerationParams:
    return GenerationParams(session_id=session_id, max_new_tokens=max_new_tokens, temperature=0.0, stop_token_ids=[])


async def _text_tokens(client: Any, n: int) -> list[int]:
    ids: list[int] = []
    k = 1
    while len(ids) < n:
        ids = await client.tokenize(TEXT * k)
        k *= 2
    return ids[:n]


async def _first_token(client: Any, session_id: str, prompt: list[int]) -> tuple[float, Any]:
    """Seconds from generate to the first (only) token, and the result."""
    t0 = time.perf_counter()
    stream = client.generate(prompt, _greedy(session_id, 1))
    result = await stream.wait()
    return time.perf_counter() - t0, result


async def _decode_rate(client: Any, session_id: str, prompt: list[int], new_tokens: int) -> float:
    """tok/s of one stream from its first streamed token to its last."""
    stream = client.generate(prompt, _greedy(session_id, new_tokens))
    t_first, n_first = None, 0
    async for _ in stream:
        if t_first is None:
            t_first, n_first = time.perf_counter(), len(stream.token_ids)
    result = await stream.wait()
    t_end = time.perf_counter()
    if t_first is None or result.completion_tokens != new_tokens:
        raise RuntimeError(f"generated {result.completion_tokens} of {new_tokens} tokens ({result.finish_reason})")
    return (result.completion_tokens - n_first) / (t_end - t_first)


async def _attempt(errors: dict[str, str], keys: tuple[str, ...], fn: Callable[[], Awaitable[Any]]) -> Any:
    """``await fn()``; on an error, record why under each of ``keys`` and return None."""
    try:
        return await fn()
    except Exception as e:  # one figure failing must not lose the others
        for key in keys:
            errors[key] = _why(e)
        return None


async def mux_single(mux: Mux, n: Lengths, figures: dict[str, Any]) -> list[int] | None:
    """The single-stream worker; returns the saved session's token history (None: not saved)."""
    errors = figures["errors"]
    command = mux.command(max_sessions=1, max_session_tokens=n.slot)
    t0 = time.perf_counter()
    async with spawn_multiplexed_worker(command, session_store=mux.store) as client:
        figures["load_to_ready_s"] = time.perf_counter() - t0
        figures["rss_after_load_mb"] = _rss_mb(client.pid)
        weights = getattr(client.info, "weights", None)
        figures["dtype"] = f"{client.info.backend} {client.info.device} {client.info.dtype}" + (
            f", {weights} weights" if weights else ""
        )
        base = await _text_tokens(client, max(n.prefill_long, n.long_decode_prompt) + 8)
        figures["first_token_ids"] = base[:16]
        figures["suffix_token"] = base[n.prefill_long + 1]  # of the restored turn (mux_restore)

        async def decode(key: str, prompt: int) -> None:
            await client.open_session(key)
            try:
                figures[key] = await _decode_rate(client, key, base[:prompt], n.decode_tokens)
            finally:
                await client.close_session(key)

        async def prefill(length: int, keep: bool) -> list[int]:
            sid = SAVED_SESSION if keep else f"prefill{length}"
            await client.open_session(sid)
            try:
                dt, result = await _first_token(client, sid, base[:length])
                if result.prefilled_prompt_tokens != length:
                    raise RuntimeError(f"prefilled {result.prefilled_prompt_tokens} of {length} tokens")
                figures[f"prefill_{length}_tok_s"] = length / dt
                return base[:length] + list(result.generated_token_ids)
            finally:
                if not keep:
                    await client.close_session(sid)

        async def save() -> bool:
            if mux.store is None:
                raise RuntimeError(f"no session store: {mux.store_error}")
            t0 = time.perf_counter()
            await client.save_session(SAVED_SESSION)
            figures["save_s"] = time.perf_counter() - t0
            figures["state_file_mb"] = mux.store.nbytes(SAVED_SESSION) / 1e6
            return True

        await _attempt(errors, ("decode_short_tok_s",), lambda: decode("decode_short_tok_s", n.short_prompt))
        await _attempt(errors, (f"prefill_{n.prefill_short}_tok_s",), lambda: prefill(n.prefill_short, False))
        history = await _attempt(errors, (f"prefill_{n.prefill_long}_tok_s",), lambda: prefill(n.prefill_long, True))
        if history is None:
            errors["save_s"] = errors["state_file_mb"] = "the prefill before it failed"
        elif not await _attempt(errors, ("save_s", "state_file_mb"), save):
            history = None
        else:  # the live session's next turn, which the restored one must reproduce (mux_restore)
            live = await _attempt(
                errors,
                ("live_next_token",),
                lambda: _first_token(client, SAVED_SESSION, history + [figures["suffix_token"]]),
            )
            if live is not None:
                figures["live_next_token"] = live[1].generated_token_ids[0]
        with contextlib.suppress(MuxError):  # open unless its prefill failed before the open
            await client.close_session(SAVED_SESSION)
        await _attempt(errors, ("decode_long_tok_s",), lambda: decode("decode_long_tok_s", n.long_decode_prompt))
        figures["peak_rss_mb"] = _rss_mb(client.pid, "VmHWM")
    return history


async def mux_restore(mux: Mux, n: Lengths, figures: dict[str, Any], history: list[int]) -> None:
    """A new worker with the same slot: resume the saved session, then its next turn's first token."""
    command = mux.command(max_sessions=1, max_session_tokens=n.slot)
    async with spawn_multiplexed_worker(command, session_store=mux.store) as client:
        t0 = time.perf_counter()
        await client.resume_session(SAVED_SESSION)
        t1 = time.perf_counter()
        _, result = await _first_token(client, SAVED_SESSION, history + [figures["suffix_token"]])
        t2 = time.perf_counter()
        if result.prefilled_prompt_tokens != 2:
            raise RuntimeError(f"the resumed turn prefilled {result.prefilled_prompt_tokens} tokens, not 2")
        figures["restore_s"] = t1 - t0
        figures["restore_first_token_s"] = t2 - t0
        figures["restored_next_token"] = result.generated_token_ids[0]
        figures["restored_positions"] = f"[0, {result.reused_prompt_tokens - 1}] reused"


async def mux_multi(mux: Mux, n: Lengths, figures: dict[str, Any]) -> None:
    """8 sessions decoding together: prompts and first tokens first, then the timed tokens."""
    command = mux.command(max_sessions=n.n_seq, max_session_tokens=n.multi_slot)
    async with spawn_multiplexed_worker(command, session_store=mux.store) as client:
        base = await _text_tokens(client, n.n_seq * 37 + n.short_prompt)
        histories = {}
        for s in range(n.n_seq):
            sid = f"stream{s}"
            await client.open_session(sid)
            prompt = base[s * 37 : s * 37 + n.short_prompt]  # as the peer's PROMPT_STRIDE
            _, result = await _first_token(client, sid, prompt)
            histories[sid] = prompt + list(result.generated_token_ids)
        done: list[int] = []

        async def one(sid: str) -> None:
            result = await client.generate(histories[sid], _greedy(sid, n.decode_tokens)).wait()
            done.append(result.completion_tokens)

        t0 = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for sid in histories:
                nursery.start_soon(one, sid)
        dt = time.perf_counter() - t0
        if sum(done) != n.n_seq * n.decode_tokens:
            raise RuntimeError(f"generated {sum(done)} of {n.n_seq * n.decode_tokens} tokens")
        figures["decode_multi_tok_s"] = sum(done) / dt


async def mux_round(mux: Mux, n: Lengths) -> dict[str, Any]:
    """One round of muxworker: the single-stream, restore and 8-stream workers."""
    figures: dict[str, Any] = {"errors": {}}
    errors = figures["errors"]
    history = None
    try:
        history = await mux_single(mux, n, figures)
    except Exception as e:
        errors["*single"] = _why(e)
    if history is None:
        errors.setdefault("restore_s", "no saved session")
        errors.setdefault("restore_first_token_s", "no saved session")
    else:
        await _attempt(errors, ("restore_s", "restore_first_token_s"), lambda: mux_restore(mux, n, figures, history))
    await _attempt(errors, ("decode_multi_tok_s",), lambda: mux_multi(mux, n, figures))
    return figures


async def mux_warm_up(mux: Mux, store_dir: Path) -> None:
    """Convert the GGUF into the cache (once) and start one worker; then create the session store
    for what that worker's hello reports (backend, dtype and weights, whatever --worker-args chose).
    Without a store only the save and restore figures are lost."""
    model_dir = await trio.to_thread.run_sync(lambda: resolve_model(mux.args.model, progress=sys.stderr))
    async with spawn_multiplexed_worker(mux.command(max_sessions=1, max_session_tokens=512)) as client:
        mux.info = client.info
        await client.open_session("warm")
        await _first_token(client, "warm", await client.tokenize(TEXT))
    configuration: dict[str, Any] = {"backend": mux.info.backend, "dtype": mux.info.dtype}
    if getattr(mux.info, "weights", None) is not None:  # a worker with --weights says which
        configuration["weights"] = mux.info.weights
    try:
        mux.store = await SessionStore.create(
            store_dir,
            model_files=model_identity_files(model_dir),
            configuration=worker_configuration(**configuration),
        )
    except Exception as e:
        mux.store_error = _why(e)


def worker_flags(args: argparse.Namespace) -> dict[str, Any]:
    """--threads, and --prefix_cache_entries 0 where the worker has that flag (its --help)."""
    flags: dict[str, Any] = {"threads": args.threads}
    try:
        help_text = subprocess.run(
            [sys.executable, "-m", "muxworker.worker", "--help"], capture_output=True, text=True, timeout=120
        ).stdout
    except (OSError, subprocess.SubprocessError):
        help_text = ""
    if "--prefix_cache_entries" in help_text:
        flags["prefix_cache_entries"] = 0
    return flags


# ----------------------------------------------------------------------------------------------
# The table


def _num(x: float) -> str:
    if x >= 100:
        return f"{x:,.0f}"
    if x >= 10:
        return f"{x:.1f}"
    if x >= 1:
        return f"{x:.2f}"
    return f"{x:.3f}"


def _values(rounds: list[dict[str, Any]], row: Row) -> list[float]:
    return [r[row.key] * row.scale for r in rounds if isinstance(r.get(row.key), (int, float))]


def _reason(rounds: list[dict[str, Any]], key: str) -> str:
    for r in rounds:
        errors = r.get("errors", {})
        why = errors.get(key) or errors.get("*single")
        if why:
            return why
    return "not measured"


def _cell(rounds: list[dict[str, Any]], row: Row, shown: set[str]) -> tuple[str, float | None]:
    """The median (min-max) of a row's per-round values, or why there are none (once per column:
    ``shown`` holds the reasons already printed above)."""
    values = _values(rounds, row)
    if not values:
        why = _reason(rounds, row.key).replace("|", "/")
        if why in shown:
            return "not measured (as above)", None
        shown.add(why)
        return "not measured: " + why, None
    median = statistics.median(values)
    text = _num(median)
    if len(values) > 1:
        text += f" ({_num(min(values))}-{_num(max(values))})"
    if len(values) < len(rounds):
        text += f", {len(values)} of {len(rounds)} rounds"
    return text, median


def table(n: Lengths, peer_rounds: list[dict[str, Any]], mux_rounds: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| figure | llama.cpp | muxworker | ratio (>1: muxworker better) |",
        "|---|---:|---:|---:|",
    ]
    peer_shown: set[str] = set()
    mux_shown: set[str] = set()
    for row in rows_for(n):
        peer_text, peer = _cell(peer_rounds, row, peer_shown)
        mux_text, mux = _cell(mux_rounds, row, mux_shown)
        if peer is None or mux is None or peer == 0 or mux == 0:
            ratio = "-"
        elif row.kind == "speed":
            ratio = f"{mux / peer:.2f}x (mux / llama)"
        else:
            ratio = f"{peer / mux:.2f}x (llama / mux)"
        lines.append(f"| {row.label} | {peer_text} | {mux_text} | {ratio} |")
    return lines


def notes(args: argparse.Namespace, n: Lengths, mux: Mux, peer_rounds: list[dict], mux_rounds: list[dict]) -> list[str]:
    first_peer = next((r for r in peer_rounds if "version" in r), {})
    first_mux = next((r for r in mux_rounds if "dtype" in r), {})
    flags = mux.command(max_sessions=1, max_session_tokens=n.slot)[3:]
    flags[flags.index("--model") + 1] = Path(flags[flags.index("--model") + 1]).name
    same = first_peer.get("first_token_ids") == first_mux.get("first_token_ids")
    out = [
        "",
        f"- model: {Path(args.model).name}; threads: {args.threads} for each engine; "
        f"{len(mux_rounds)} round(s), alternating (llama.cpp, then muxworker); median (min-max) over rounds",
        f"- muxworker {muxworker.__version__}, {first_mux.get('dtype', '?')}; worker flags "
        f"(single-stream process): {shlex.join(flags)}",
        f"- llama.cpp: llama-cpp-python {first_peer.get('version', '?')} (low-level API), n_batch = n_ubatch = 512, "
        f"flash_attn_type {first_peer.get('flash_attn_type', '?')} (llama.cpp's default, -1 = auto), mmap on; "
        f"{first_peer.get('system_info', '')}",
        f"- llama.cpp load to ready: {_median(peer_rounds, 'import_s')} s imports + "
        f"{_median(peer_rounds, 'load_s')} s model and context, of the total (which adds interpreter start)",
        f"- same text, same token counts; the first 16 token ids of the text agree between the engines: "
        f"{'yes' if same else 'no'}",
        "- decode: greedy, EOS ignored, tok/s counted from the first generated token to the last "
        f"({n.decode_tokens} generated per stream); 8 streams: {n.n_seq} x {n.decode_tokens} tokens after each "
        "stream's prompt and first token, over the wall time of all of them",
        "- prefill: prompt tokens / time to the first token in a fresh session (cleared KV cache)",
        f"- save/restore: the {n.prefill_long:,}-token prompt's session (its KV and the pending first token); "
        "restore runs in a new process, the file in the page cache; restore + first token adds the pending "
        "token and a 1-token suffix and generates one token",
        "- a restored session's next turn (pending token + 1-token suffix) against the live session's, "
        f"per round: llama.cpp {_exact(peer_rounds)}; muxworker {_exact(mux_rounds)}",
        "- command: " + shlex.join(["python", *sys.argv]),
    ]
    return out


def _exact(rounds: list[dict]) -> str:
    """Whether each round's restored session produced the live session's next token, and what its
    memory held after the restore."""
    cells = []
    for r in rounds:
        if "restored_next_token" not in r or "live_next_token" not in r:
            cells.append("not measured")
            continue
        same = "same token" if r["restored_next_token"] == r["live_next_token"] else "a different token"
        cells.append(f"{same} (positions {r.get('restored_positions', '?')})")
    return "; ".join(cells) or "not measured"


def _median(rounds: list[dict], key: str) -> str:
    values = [r[key] for r in rounds if isinstance(r.get(key), (int, float))]
    return _num(statistics.median(values)) if values else "?"


# ----------------------------------------------------------------------------------------------


def peer_problem(args: argparse.Namespace) -> str | None:
    """Why the llama.cpp peer cannot run (None: it can)."""
    if not args.peer_python:
        return "no --peer-python (make bench-peer builds one)"
    try:
        proc = subprocess.run([args.peer_python, "-c", "import llama_cpp"], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError) as e:
        return f"{args.peer_python} does not run: {_why(e)}"
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-1:] or [f"status {proc.returncode}"]
        return f"{args.peer_python} cannot import llama_cpp: {tail[0]}"
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peer-python", default=None, help="python of the venv with llama-cpp-python (.venv-peer)")
    ap.add_argument(
        "--model", default=None, help="the GGUF both engines load, or a model name (default: the bundled SmolLM2)"
    )
    ap.add_argument("--threads", type=int, default=2, help="CPU threads of each engine (default 2)")
    ap.add_argument("--repeats", type=int, default=3, help="rounds of each engine, alternating (default 3)")
    ap.add_argument(
        "--worker-args",
        default="",
        help='extra muxworker worker flags, appended to its command; write --worker-args="--dtype bfloat16"',
    )
    ap.add_argument("--quick", action="store_true", help="one round, a 1,024-token slot, 32 decoded tokens")
    args = ap.parse_args()
    if args.model in NAMED_MODELS:
        args.model = named_model_path(args.model)
    args.model = Path(args.model) if args.model else bundled_gguf_path()
    if args.quick:
        args.repeats = 1
    n = Lengths(slot=1024, decode_tokens=32) if args.quick else Lengths(slot=4096, decode_tokens=128)

    mux = Mux(args, worker_flags(args))
    problem = peer_problem(args)
    peer_rounds: list[dict[str, Any]] = []
    mux_rounds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-vs-llamacpp-") as tmp:

        def warm_up_mux() -> None:
            try:
                trio.run(mux_warm_up, mux, Path(tmp) / "sessions")
            except Exception as e:
                mux.start_error = _why(e)
                print(f"muxworker warm-up failed: {mux.start_error}", file=sys.stderr)

        warm_up_mux()
        if problem is None:
            try:
                peer_run(args, {"mode": "load", "n_ctx": n.slot})  # page cache, shared libraries
            except Exception as e:
                problem = _why(e)
        for r in range(args.repeats):
            print(f"round {r + 1}/{args.repeats}: llama.cpp", file=sys.stderr, flush=True)
            if problem is None:
                peer_rounds.append(llamacpp_round(args, n, os.path.join(tmp, "llama-state.bin")))
            else:
                peer_rounds.append({"errors": {"*single": problem}})
            print(f"round {r + 1}/{args.repeats}: muxworker", file=sys.stderr, flush=True)
            if mux.info is None:
                warm_up_mux()  # once more: the worker may have failed for a passing reason
            if mux.info is None:
                mux_rounds.append({"errors": {"*single": mux.start_error}})
            else:
                mux_rounds.append(trio.run(mux_round, mux, n))
    print("\n".join(table(n, peer_rounds, mux_rounds) + notes(args, n, mux, peer_rounds, mux_rounds)))


if __name__ == "__main__":
    main()
