"""The llama.cpp side of scripts/bench_vs_llamacpp.py; runs inside the peer venv (llama-cpp-python).

Not meant to be run by hand: bench_vs_llamacpp.py starts it as
``PEER_PYTHON scripts/_llamacpp_peer.py CONFIG_JSON``, a fresh process for each mode of each
round. It prints ``ready <time.monotonic()>`` as soon as the model and context are loaded (the
parent subtracts its own monotonic reading from before Popen: load to ready), then one JSON object
of figures on the last line of stdout; a figure that failed is left out and its error is under
``errors``. It imports nothing from muxworker.

It drives llama.cpp through llama-cpp-python's low-level API (``llama_cpp.llama_*``), as a C user
of libllama would: one model, one context of ``n_ctx`` cells for ``n_seq_max`` sequences, batches
of at most 512 tokens (``n_batch``, the same as muxworker's prefill chunk), greedy argmax over the
logits in numpy (EOS is just another token, as muxworker's ``stop_token_ids=[]``).

Modes (``mode`` in the config):

- ``load``: load only (the warm-up before timing).
- ``single``: load; RSS; decode after a short prompt; cold prefill of two prompt lengths (the
  longer one is saved to ``state_path`` with llama_state_seq_save_file, plus an fsync, as
  muxworker's save does); decode after a long prompt; peak RSS.
- ``restore``: load; llama_state_seq_load_file of that file; then the pending token and a 1-token
  suffix are evaluated and the next token read (restore + first token).
- ``multi``: ``n_seq`` sequences in one context (n_seq_max), each prefilled with its own short
  prompt in one batch, then ``decode_tokens`` steps decoding all of them together in one batch.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import time

T_START = time.perf_counter()

import llama_cpp  # noqa: E402
import numpy as np  # noqa: E402

T_IMPORTED = time.perf_counter()
N_BATCH = 512  # tokens per llama_decode (n_batch = n_ubatch), as muxworker's --prefill_chunk_tokens
PROMPT_STRIDE = 37  # sequence s of the multi mode starts at token s * 37 of the text


def rss_mb(field: str = "VmRSS") -> float:
    """This process's resident set (or VmHWM, its peak) from /proc, in MB (10^6 bytes)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024 / 1e6
    return float("nan")


class Engine:
    """One llama.cpp model and context, with greedy decoding over numpy views of the logits."""

    def __init__(self, model_path: str, n_ctx: int, n_seq_max: int, threads: int) -> None:
        llama_cpp.llama_backend_init()
        model_params = llama_cpp.llama_model_default_params()
        model_params.n_gpu_layers = 0
        self.model = llama_cpp.llama_model_load_from_file(model_path.encode(), model_params)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {model_path}")
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_batch = N_BATCH
        params.n_ubatch = N_BATCH
        params.n_seq_max = n_seq_max
        params.n_threads = threads
        params.n_threads_batch = threads
        self.flash_attn_type = int(params.flash_attn_type)  # llama.cpp's default (-1: auto)
        self.ctx = llama_cpp.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create the context")
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)
        self.mem = llama_cpp.llama_get_memory(self.ctx)
        self.batch = llama_cpp.llama_batch_init(N_BATCH, 0, 1)

    def tokenize(self, text: str) -> list[int]:
        raw = text.encode()
        buf = (llama_cpp.llama_token * (len(raw) + 16))()
        n = llama_cpp.llama_tokenize(self.vocab, raw, len(raw), buf, len(buf), False, False)
        if n < 0:
            raise RuntimeError(f"tokenize: {-n} tokens do not fit")
        return list(buf[:n])

    def clear(self) -> None:
        llama_cpp.llama_memory_clear(self.mem, True)

    def decode_batch(self, entries: list[tuple[int, int, int, bool]]) -> None:
        """One llama_decode of (token, position, sequence, wants logits) entries."""
        b = self.batch
        for i, (tok, pos, seq, logits) in enumerate(entries):
            b.token[i] = tok
            b.pos[i] = pos
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq
            b.logits[i] = logits
        b.n_tokens = len(entries)
        rc = llama_cpp.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def argmax(self, i: int) -> int:
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.ctx, i), shape=(self.n_vocab,))
        return int(logits.argmax())

    def prefill(self, tokens: list[int], start: int = 0, seq: int = 0) -> int:
        """Evaluate ``tokens`` at positions start.. of ``seq`` in 512-token batches; the greedy next token."""
        for i in range(0, len(tokens), N_BATCH):
            chunk = tokens[i : i + N_BATCH]
            last = i + len(chunk) == len(tokens)
            self.decode_batch(
                [(t, start + i + j, seq, last and j == len(chunk) - 1) for j, t in enumerate(chunk)],
            )
        return self.argmax(-1)

    def decode(self, first: int, pos: int, n: int) -> tuple[list[int], float]:
        """``n`` greedy steps after ``first`` (the token at ``pos``): the tokens and the seconds."""
        out, tok = [], first
        t0 = time.perf_counter()
        for k in range(n):
            self.decode_batch([(tok, pos + k, 0, True)])
            tok = self.argmax(-1)
            out.append(tok)
        return out, time.perf_counter() - t0


def ready(engine: Engine, load_s: float) -> dict:
    # CLOCK_MONOTONIC is system-wide: the parent subtracts its own reading from before Popen.
    print(f"ready {time.monotonic()!r}", flush=True)
    return {
        "load_s": load_s,
        "import_s": T_IMPORTED - T_START,
        "rss_after_load_mb": rss_mb(),
        "flash_attn_type": engine.flash_attn_type,
        "system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip(),
    }


def text_tokens(engine: Engine, text: str, n: int) -> list[int]:
    ids: list[int] = []
    k = 1
    while len(ids) < n:
        ids = engine.tokenize(text * k)
        k *= 2
    return ids[:n]


def attempt(out: dict, keys: tuple[str, ...], fn, *args):
    """``fn(*args)``; on an error, record why under each of ``keys`` in ``out["errors"]`` and return None."""
    try:
        return fn(*args)
    except Exception as e:  # one figure failing must not lose the others
        for key in keys:
            out.setdefault("errors", {})[key] = f"{type(e).__name__}: {e}"
        return None


def run_single(cfg: dict, engine: Engine, out: dict) -> None:
    longest = cfg["prefill_lengths"][-1]
    base = text_tokens(engine, cfg["text"], max(cfg["long_decode_prompt"], longest) + 8)
    out["first_token_ids"] = base[:16]
    n_decode = cfg["decode_tokens"] - 1  # the tokens after the first

    def decode_after(prompt: int) -> float:
        engine.clear()
        first = engine.prefill(base[:prompt])
        _, dt = engine.decode(first, prompt, n_decode)
        return n_decode / dt

    def prefill(n: int) -> int:
        engine.clear()
        t0 = time.perf_counter()
        first = engine.prefill(base[:n])
        out[f"prefill_{n}_tok_s"] = n / (time.perf_counter() - t0)
        return first

    def save(first: int) -> None:
        save_state(cfg, engine, out, base, longest, first)

    out["decode_short_tok_s"] = attempt(out, ("decode_short_tok_s",), decode_after, cfg["short_prompt"])
    first = None
    for n in cfg["prefill_lengths"]:
        first = attempt(out, (f"prefill_{n}_tok_s",), prefill, n)
    if first is None:
        out.setdefault("errors", {})["save_s"] = "the prefill before it failed"
    else:
        attempt(out, ("save_s", "state_file_bytes"), save, first)
    out["decode_long_tok_s"] = attempt(out, ("decode_long_tok_s",), decode_after, cfg["long_decode_prompt"])
    out["peak_rss_mb"] = rss_mb("VmHWM")


def save_state(cfg: dict, engine: Engine, out: dict, base: list[int], n: int, first: int) -> None:
    """Save the sequence just prefilled (its ``n`` tokens in the KV, ``first`` pending) to
    ``cfg["state_path"]`` and fsync it; record the time, the file size and what a restore needs."""
    tokens = (llama_cpp.llama_token * n)(*base[:n])
    t0 = time.perf_counter()
    written = llama_cpp.llama_state_seq_save_file(engine.ctx, cfg["state_path"].encode(), 0, tokens, n)
    fd = os.open(cfg["state_path"], os.O_RDONLY)  # durable, as muxworker's save (fsync) is
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    out["save_s"] = time.perf_counter() - t0
    if not written:
        raise RuntimeError("llama_state_seq_save_file failed")
    out["state_file_bytes"] = os.path.getsize(cfg["state_path"])
    out["saved_tokens"] = n
    out["pending_token"] = first
    out["suffix_token"] = base[n + 1]
    # The live session's next turn (what a restore must reproduce): the pending token and the suffix.
    out["live_next_token"] = engine.prefill([first, base[n + 1]], start=n)


def run_state(cfg: dict, engine: Engine, out: dict) -> None:
    """Prefill ``cfg["tokens"]`` tokens of the text and save the state (scripts/bench_checkpoint.py)."""
    n = cfg["tokens"]
    base = text_tokens(engine, cfg["text"], n + 8)
    engine.clear()
    first = engine.prefill(base[:n])
    save_state(cfg, engine, out, base, n, first)


def run_restore(cfg: dict, engine: Engine, out: dict) -> None:
    cap = cfg["saved_tokens"] + 8
    tokens = (llama_cpp.llama_token * cap)()
    count = ctypes.c_size_t(0)
    engine.clear()
    t0 = time.perf_counter()
    read = llama_cpp.llama_state_seq_load_file(
        engine.ctx, cfg["state_path"].encode(), 0, tokens, cap, ctypes.byref(count)
    )
    t1 = time.perf_counter()
    if not read or count.value != cfg["saved_tokens"]:
        raise RuntimeError(f"llama_state_seq_load_file read {read} bytes, {count.value} tokens")
    # What the restored memory holds: a sliding-window cache may keep only the window's positions.
    out["restored_pos_min"] = llama_cpp.llama_memory_seq_pos_min(engine.mem, 0)
    out["restored_pos_max"] = llama_cpp.llama_memory_seq_pos_max(engine.mem, 0)
    # The pending token and a 1-token suffix, then the next token: what muxworker's resumed turn does.
    out["restored_next_token"] = engine.prefill([cfg["pending_token"], cfg["suffix_token"]], start=count.value)
    t2 = time.perf_counter()
    out["restore_s"] = t1 - t0
    out["restore_first_token_s"] = t2 - t0


def run_multi(cfg: dict, engine: Engine, out: dict) -> None:
    n_seq, p, steps = cfg["n_seq"], cfg["short_prompt"], cfg["decode_tokens"]
    base = text_tokens(engine, cfg["text"], n_seq * PROMPT_STRIDE + p)
    engine.clear()
    # Every sequence's prompt (its own slice of the text) in one batch, then its first token.
    entries = [(base[s * PROMPT_STRIDE + j], j, s, j == p - 1) for s in range(n_seq) for j in range(p)]
    if len(entries) > N_BATCH:
        raise ValueError(f"{n_seq} prompts of {p} tokens do not fit one {N_BATCH}-token batch")
    engine.decode_batch(entries)
    toks = [engine.argmax(s * p + p - 1) for s in range(n_seq)]
    t0 = time.perf_counter()
    for k in range(steps):
        engine.decode_batch([(toks[s], p + k, s, True) for s in range(n_seq)])
        toks = [engine.argmax(s) for s in range(n_seq)]
    out["decode_multi_tok_s"] = n_seq * steps / (time.perf_counter() - t0)


def main() -> None:
    cfg = json.loads(sys.argv[1])
    t0 = time.perf_counter()
    engine = Engine(cfg["model"], cfg["n_ctx"], cfg.get("n_seq", 1), cfg["threads"])
    out = ready(engine, time.perf_counter() - t0)
    out["version"] = llama_cpp.__version__
    modes = {
        "load": lambda *_: None,
        "single": run_single,
        "state": run_state,
        "restore": run_restore,
        "multi": run_multi,
    }
    modes[cfg["mode"]](cfg, engine, out)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
