"""The engine: named sessions, a continuous-batching scheduler, and the model's KV cache.

Plain calls, no I/O. The worker process (server.py) and the tests drive the same methods.

Ownership: one thread (the caller of ``step``) owns everything here: the model, the KV cache, every
session's history and every request's sampling state. Other threads must talk to the engine through
that thread (the worker uses a queue).

History semantics (what a session commits):
- ``tokens`` is the committed token history; rows [0, kv_len) of the session's cache hold its KV.
  After a turn the last sampled token is committed but has no KV yet, so kv_len == len(tokens) - 1.
- A prompt is matched against tokens[:kv_len]; the longest common prefix that every layer still
  retains is reused; the rest is prefilled. A prompt equal to the history re-runs its last token.
- A finished turn (stop token, stop string or length) commits prompt + every sampled token,
  including a stop token and the tokens of a stop string (the text withheld from the output).
- A cancelled turn commits the prompt rows that were prefilled plus the tokens sampled so far.
- A failed forward pass empties the histories of the sessions in that batch.
A session whose last turn was cancelled, failed or cut by a stop string is not saveable until a
later clean turn.
"""
from __future__ import annotations

import enum
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch

from muxworker.transport.checkpoint import LAYOUT_VERSION, CPUCheckpoint
from muxworker.transport.errors import (
    CapacityExhausted,
    CheckpointRejected,
    ContextOverflow,
    InternalError,
    InvalidArgument,
    MuxError,
    NotReady,
    SessionBusy,
    SessionExists,
    SessionNotFound,
    Unsaveable,
)

from .config import EngineConfig
from .executor import Executor
from .prefix_cache import PrefixCache
from .model import SeqSpan
from .sampling import SamplingParams, sample
from .tokenizer import IncrementalDetokenizer

MAX_SESSION_ID_BYTES = 1024

Prompt = str | Sequence[int] | Sequence[str | Sequence[int]]


class Readiness(enum.Enum):
    PENDING = "pending"
    READY = "ready"
    FAILED = "failed"


@dataclass
class EngineOutput:
    """A text delta for one request; the last one for a request carries ``result``."""

    request_id: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    result: dict[str, Any] | None = None
    error: MuxError | None = None  # set when finish_reason is "error"


class _Phase(enum.Enum):
    PREFILL = 1
    DECODE = 2


@dataclass
class _Session:
    sid: str
    slot: int
    tokens: list[int] = field(default_factory=list)
    kv_len: int = 0
    request: "_Request | None" = None
    unsaveable: str | None = "empty"  # why it cannot be exported now, None when it can


@dataclass
class _Request:
    rid: int
    session: _Session
    prompt: list[int]
    params: SamplingParams
    max_new: int
    stop_ids: frozenset[int]
    generator: torch.Generator | None
    detok: Any
    reused: int
    phase: _Phase = _Phase.PREFILL
    generated: list[int] = field(default_factory=list)
    held_text: str = ""  # decoded text withheld because it may start a stop string
    stop_cut: bool = False  # a stop string ended the output
    t_submit: float = 0.0
    t_first_token: float | None = None
    finished: bool = False
    fresh: bool = False  # the session had no history: its prefilled prompt may seed the prefix cache


class Engine:
    """Continuous batching over named sessions on one model."""

    def __init__(
        self, executor: Executor, tokenizer: Any, config: EngineConfig, *, model_name: str = "", model_path: str = ""
    ) -> None:
        self.executor = executor
        self.tokenizer = tokenizer
        self.config = config
        self.args = executor.args
        self.model_name = model_name
        self.model_path = model_path
        self.readiness = Readiness.PENDING
        context = int(self.args.max_position_embeddings)
        if config.max_session_tokens > context:
            raise InvalidArgument(
                f"max_session_tokens ({config.max_session_tokens}) exceeds the model's context length ({context})"
            )
        self.cache = executor.cache
        if self.cache.slots < config.max_sessions + config.prefix_cache_entries:
            raise InvalidArgument("the executor's cache has fewer slots than max_sessions + prefix_cache_entries")
        self.prefix_cache = PrefixCache(
            self.cache, range(config.max_sessions, config.max_sessions + config.prefix_cache_entries)
        )
        self.vocab_size = int(self.args.vocab_size)
        self.eos_token_ids: list[int] = list(getattr(tokenizer, "eos_token_ids", []) or [])
        self._sessions: dict[str, _Session] = {}
        self._free_slots: list[int] = list(range(config.max_sessions - 1, -1, -1))
        self._requests: dict[int, _Request] = {}
        self._cancelled: deque[int] = deque()
        self._outputs: list[EngineOutput] = []
        self._decode_cursor = 0
        self._prefill_cursor = 0
        self._seed_gen = torch.Generator().manual_seed(config.seed if config.seed is not None else 0x5EED)
        self._closed = False
        # Test and benchmark hook: called with the session ids of every forward pass.
        self.on_forward: Callable[[list[str]], None] | None = None
        self.stats = {"forward_calls": 0, "forward_time_s": 0.0}
        self.readiness = Readiness.READY

    # ----------------------------------------------------------------- description

    @property
    def backend(self) -> str:
        return self.executor.backend

    @property
    def device_name(self) -> str:
        return self.executor.device_name

    @property
    def dtype_name(self) -> str:
        return self.executor.dtype_name

    def model_info(self) -> dict[str, Any]:
        """What the worker's hello says about the model."""
        tok = self.tokenizer
        return {
            "name": self.model_name,
            "path": self.model_path,
            "architecture": self.args.architecture,
            "vocab_size": self.vocab_size,
            "context_length": int(self.args.max_position_embeddings),
            "has_chat_template": bool(getattr(tok, "has_chat_template", False)),
            "bos_token_id": getattr(tok, "bos_token_id", None),
            "eos_token_ids": list(self.eos_token_ids),
        }

    # ----------------------------------------------------------------- sessions

    @staticmethod
    def _check_session_id(sid: object) -> str:
        if not isinstance(sid, str) or not sid:
            raise InvalidArgument(f"session id must be a non-empty string, got {sid!r}")
        if len(sid.encode("utf-8", "surrogatepass")) > MAX_SESSION_ID_BYTES:
            raise InvalidArgument(f"session id is longer than {MAX_SESSION_ID_BYTES} UTF-8 bytes")
        return sid

    def _session(self, sid: str) -> _Session:
        self._check_session_id(sid)
        s = self._sessions.get(sid)
        if s is None:
            raise SessionNotFound(f"session {sid!r} is not open")
        return s

    def _check_ready(self) -> None:
        if self._closed:
            raise NotReady("the engine is shut down")
        if self.readiness is not Readiness.READY:
            raise NotReady(f"the engine is {self.readiness.value}")

    def open_session(self, sid: str) -> None:
        self._check_ready()
        self._check_session_id(sid)
        if sid in self._sessions:
            raise SessionExists(f"session {sid!r} is already open")
        if not self._free_slots:
            raise CapacityExhausted(f"all {self.config.max_sessions} session slots are in use (max_sessions)")
        self._sessions[sid] = _Session(sid, self._free_slots.pop())

    def close_session(self, sid: str) -> None:
        s = self._session(sid)
        if s.request is not None:
            self._finish(s.request, "cancelled")
        # A closed session's history becomes a prefix-cache entry (when the cache is on).
        self.prefix_cache.insert(s.slot, s.tokens[: s.kv_len])
        del self._sessions[sid]
        self._free_slots.append(s.slot)

    def reset_session(self, sid: str) -> None:
        s = self._session(sid)
        if s.request is not None:
            self._finish(s.request, "cancelled")
        s.tokens = []
        s.kv_len = 0
        s.unsaveable = "empty"

    def session_ids(self) -> list[str]:
        return list(self._sessions)

    def session_tokens(self, sid: str) -> list[int]:
        """The committed token history of a session (a copy)."""
        return list(self._session(sid).tokens)

    # ----------------------------------------------------------------- requests

    def _encode_prompt(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            segments: list[Any] = [prompt]
        elif isinstance(prompt, (list, tuple)) and not any(isinstance(t, (str, list, tuple)) for t in prompt):
            segments = [list(prompt)]  # flat token ids; each is checked below
        elif isinstance(prompt, (list, tuple)):
            segments = list(prompt)
        else:
            raise InvalidArgument(f"prompt must be text, token ids or a list of segments, got {type(prompt).__name__}")
        ids: list[int] = []
        for seg in segments:
            if isinstance(seg, str):
                ids.extend(self.tokenizer.encode(seg))
            elif isinstance(seg, (list, tuple)) or hasattr(seg, "tolist"):
                seg_ids = seg.tolist() if hasattr(seg, "tolist") else list(seg)
                for t in seg_ids:
                    if not isinstance(t, int) or isinstance(t, bool):
                        raise InvalidArgument(f"token ids must be integers, got {t!r}")
                    if not 0 <= t < self.vocab_size:
                        raise InvalidArgument(f"token id {t} is outside the vocabulary [0, {self.vocab_size})")
                ids.extend(seg_ids)
            else:
                raise InvalidArgument(f"a prompt segment must be text or token ids, got {type(seg).__name__}")
        if not ids:
            raise InvalidArgument("the prompt is empty")
        return ids

    def _reusable_prefix(self, s: _Session, prompt: list[int]) -> int:
        """Rows of the session's cache the prompt can keep (at most len(prompt) - 1)."""
        limit = min(s.kv_len, len(prompt) - 1)
        common = 0
        hist = s.tokens
        while common < limit and hist[common] == prompt[common]:
            common += 1
        if common and not self.cache.can_truncate(s.kv_len, common):
            return 0
        return common

    def submit(self, request_id: int, sid: str, prompt: Prompt, params: SamplingParams) -> None:
        """Accept a generation or raise; results come from later ``step`` calls."""
        self._check_ready()
        if not isinstance(request_id, int) or not 0 < request_id < 2**63:
            raise InvalidArgument(f"request id must be a positive 64-bit integer, got {request_id!r}")
        if request_id in self._requests:
            raise InvalidArgument(f"request id {request_id} is already in flight")
        s = self._session(sid)
        if s.request is not None:
            raise SessionBusy(f"session {sid!r} is already generating (request {s.request.rid})")
        params.validate(self.vocab_size)
        if len(self._requests) >= self.config.max_inflight_requests:
            raise CapacityExhausted(
                f"{len(self._requests)} requests are in flight (max_inflight_requests={self.config.max_inflight_requests})"
            )
        ids = self._encode_prompt(prompt)
        room = self.config.max_session_tokens
        if len(ids) >= room:
            raise ContextOverflow(
                f"the prompt has {len(ids)} tokens; a session holds at most {room} (max_session_tokens), "
                "prompt plus generated tokens"
            )
        max_new = params.max_new_tokens if params.max_new_tokens != -1 else room - len(ids)
        if len(ids) + max_new > room:
            raise ContextOverflow(
                f"prompt ({len(ids)} tokens) plus max_new_tokens ({max_new}) exceeds max_session_tokens ({room})"
            )
        stop_ids = frozenset(params.stop_token_ids if params.stop_token_ids is not None else self.eos_token_ids)
        seed = params.seed
        if params.temperature > 0 and seed is None:
            seed = int(torch.randint(0, 2**62, (1,), generator=self._seed_gen))
        gen = torch.Generator().manual_seed(seed) if params.temperature > 0 else None
        fresh = s.kv_len == 0
        reused = self._reusable_prefix(s, ids)
        hit = self.prefix_cache.match(ids, len(ids) - 1)
        if hit is not None and hit[1] > reused:
            self.prefix_cache.copy_into(hit[0], s.slot, hit[1])
            reused = hit[1]
        req = _Request(
            rid=request_id,
            session=s,
            prompt=ids,
            params=params,
            max_new=max_new,
            stop_ids=stop_ids,
            generator=gen,
            detok=IncrementalDetokenizer(self.tokenizer, ids),
            reused=reused,
            t_submit=time.perf_counter(),
            fresh=fresh,
        )
        # Commit the prompt: the session now continues from ``reused`` rows.
        s.tokens = list(ids)
        s.kv_len = reused
        s.request = req
        s.unsaveable = "busy"
        self._requests[request_id] = req

    def cancel(self, request_id: int) -> bool:
        """Ask for a request to end; returns whether it was in flight. Takes effect at the next step."""
        if request_id in self._requests:
            self._cancelled.append(request_id)
            return True
        return False

    def has_work(self) -> bool:
        return bool(self._requests or self._outputs or self._cancelled)

    @property
    def inflight(self) -> int:
        return len(self._requests)

    # ----------------------------------------------------------------- stepping

    def _finish(self, req: _Request, reason: str, error: MuxError | None = None) -> None:
        if req.finished:
            return
        req.finished = True
        s = req.session
        now = time.perf_counter()
        if reason == "error":
            s.tokens, s.kv_len = [], 0
            s.unsaveable = "the last generation failed"
        else:
            # Drop prompt tokens that never got KV (cancelled during prefill).
            if req.phase is _Phase.PREFILL:
                s.tokens = s.tokens[: s.kv_len]
            if reason == "cancelled":
                s.unsaveable = "the last generation was cancelled"
            elif req.stop_cut:
                s.unsaveable = "the last generation was cut by a stop string"
            else:
                s.unsaveable = None if s.tokens else "empty"
        s.request = None
        del self._requests[req.rid]
        tail = ""
        if reason in ("length", "stop") and not req.stop_cut:
            tail = req.held_text + req.detok.flush()
        t_first = req.t_first_token if req.t_first_token is not None else now
        result = {
            "finish_reason": reason,
            "prompt_tokens": len(req.prompt),
            "reused_prompt_tokens": req.reused,
            "prefilled_prompt_tokens": len(req.prompt) - req.reused,
            "completion_tokens": len(req.generated),
            "generated_token_ids": list(req.generated),
            "prefill_time_s": t_first - req.t_submit,
            "decode_time_s": now - t_first,
        }
        self._outputs.append(EngineOutput(req.rid, tail, [], result, error))

    def _emit_text(self, req: _Request, token: int) -> EngineOutput:
        delta = req.detok.push(token)
        text = req.held_text + delta
        stops = req.params.stop
        if stops:
            cut = -1
            for st in stops:
                i = text.find(st)
                if i != -1 and (cut == -1 or i < cut):
                    cut = i
            if cut != -1:
                req.stop_cut = True
                req.held_text = ""
                return EngineOutput(req.rid, text[:cut], [token])
            hold = 0
            for st in stops:
                for k in range(min(len(st) - 1, len(text)), 0, -1):
                    if text.endswith(st[:k]):
                        hold = max(hold, k)
                        break
            req.held_text = text[len(text) - hold :] if hold else ""
            return EngineOutput(req.rid, text[: len(text) - hold], [token])
        req.held_text = ""
        return EngineOutput(req.rid, text, [token])

    def _accept_token(self, req: _Request, token: int) -> None:
        now = time.perf_counter()
        if req.t_first_token is None:
            req.t_first_token = now
        s = req.session
        req.generated.append(token)
        s.tokens.append(token)
        req.phase = _Phase.DECODE
        if token in req.stop_ids:
            self._outputs.append(EngineOutput(req.rid, "", [token]))
            self._finish(req, "stop")
            return
        out = self._emit_text(req, token)
        self._outputs.append(out)
        if req.stop_cut:
            self._finish(req, "stop")
        elif len(req.generated) >= req.max_new:
            self._finish(req, "length")

    def _process_cancels(self) -> None:
        while self._cancelled:
            rid = self._cancelled.popleft()
            req = self._requests.get(rid)
            if req is not None:
                self._finish(req, "cancelled")

    def _schedule(self) -> tuple[list[_Request], list[tuple[_Request, int]]]:
        """Pick decode requests and prefill chunks for one forward pass."""
        reqs = list(self._requests.values())
        decoding = [r for r in reqs if r.phase is _Phase.DECODE]
        prefilling = [r for r in reqs if r.phase is _Phase.PREFILL]
        cap = self.config.max_decode_sequences
        if len(decoding) > cap:
            start = self._decode_cursor % len(decoding)
            decoding = (decoding[start:] + decoding[:start])[:cap]
            self._decode_cursor += cap
        chunks: list[tuple[_Request, int]] = []
        budget = self.config.prefill_chunk_tokens
        if prefilling:
            start = self._prefill_cursor % len(prefilling)
            order = prefilling[start:] + prefilling[:start]
            self._prefill_cursor += 1
            for r in order:
                if budget <= 0:
                    break
                n = min(len(r.prompt) - r.session.kv_len, budget)
                chunks.append((r, n))
                budget -= n
        return decoding, chunks

    def step(self) -> list[EngineOutput]:
        """Run one batched forward pass (if there is work) and return the outputs it produced."""
        self._process_cancels()
        decoding, chunks = self._schedule()
        if decoding or chunks:
            self._forward(decoding, chunks)
        out, self._outputs = self._outputs, []
        return out

    def _forward(self, decoding: list[_Request], chunks: list[tuple[_Request, int]]) -> None:
        tokens: list[int] = []
        positions: list[int] = []
        spans: list[SeqSpan] = []
        sample_rows: list[int] = []
        sample_reqs: list[_Request] = []
        for r in decoding:
            s = r.session
            pos = s.kv_len
            spans.append(SeqSpan(s.slot, pos, 1, len(tokens)))
            sample_rows.append(len(tokens))
            sample_reqs.append(r)
            tokens.append(s.tokens[pos])
            positions.append(pos)
        for r, n in chunks:
            s = r.session
            pos = s.kv_len
            spans.append(SeqSpan(s.slot, pos, n, len(tokens)))
            tokens.extend(r.prompt[pos : pos + n])
            positions.extend(range(pos, pos + n))
            if pos + n == len(r.prompt):
                sample_rows.append(len(tokens) - 1)
                sample_reqs.append(r)
        batch_reqs = decoding + [r for r, _ in chunks]
        if self.on_forward is not None:
            self.on_forward([r.session.sid for r in batch_reqs])
        t0 = time.perf_counter()
        try:
            logits = self.executor.forward(tokens, positions, spans, sample_rows)
        except Exception as exc:  # a failed forward ends the requests in this batch only
            for r in batch_reqs:
                self._finish(r, "error", InternalError(f"forward pass failed: {type(exc).__name__}: {exc}"))
            return
        finally:
            self.stats["forward_calls"] += 1
            self.stats["forward_time_s"] += time.perf_counter() - t0
        for r in decoding:
            r.session.kv_len += 1
        for r, n in chunks:
            r.session.kv_len += n
            if r.fresh and r.session.kv_len == len(r.prompt):
                self.prefix_cache.insert(r.session.slot, r.prompt)
        for i, r in enumerate(sample_reqs):
            if r.finished:
                continue
            self._accept_token(r, sample(logits[i], r.params, r.generator))

    # ----------------------------------------------------------------- checkpoints

    def executor_format(self) -> dict[str, Any]:
        return {"backend": self.executor.backend, "dtype": self.executor.dtype_name, "layout_version": LAYOUT_VERSION}

    def geometry(self) -> dict[str, Any]:
        return {
            "num_layers": int(self.args.num_hidden_layers),
            "num_kv_heads": self.args.num_kv_heads,
            "head_dim": int(self.args.head_dim),  # type: ignore[arg-type]
            "windows": list(self.cache.windows),
        }

    def export_checkpoint(self, sid: str, position: int | None = None) -> CPUCheckpoint:
        """An independent host copy of a session's committed state at ``position``.

        The default position is the committed boundary: every token whose KV the cache holds.
        """
        s = self._session(sid)
        if s.request is not None:
            raise Unsaveable(f"session {sid!r} is busy generating (request {s.request.rid})")
        if s.unsaveable is not None:
            raise Unsaveable(f"session {sid!r} cannot be saved: {s.unsaveable}")
        if s.kv_len == 0:
            raise Unsaveable(f"session {sid!r} cannot be saved: empty")
        if position is None:
            position = s.kv_len
        if isinstance(position, bool) or not isinstance(position, int) or not 1 <= position <= s.kv_len:
            raise InvalidArgument(f"export position must be in [1, {s.kv_len}], got {position!r}")
        if not self.cache.can_truncate(s.kv_len, position):
            raise CheckpointRejected(
                f"session {sid!r} no longer retains the history position {position} needs "
                f"(earliest is {self.cache.earliest_position(s.kv_len)})"
            )
        layers = self.executor.export_layers(s.slot, s.kv_len, position)
        return CPUCheckpoint(
            format=self.executor_format(),
            geometry=self.geometry(),
            position=position,
            token_ids=np.asarray(s.tokens[:position], dtype=np.int32),
            layers=layers,
        )

    def restore_checkpoint(self, sid: str, checkpoint: CPUCheckpoint, position: int | None = None) -> None:
        """Publish a new session ``sid`` continuing from ``position`` of ``checkpoint``.

        Everything is validated before the session exists; a rejected restore leaves ``sid`` unused.
        """
        self._check_ready()
        self._check_session_id(sid)
        if sid in self._sessions:
            raise SessionExists(f"session {sid!r} is already open; restore needs an unused session id")
        if position is None:
            position = checkpoint.position
        fmt = checkpoint.format
        ours = self.executor_format()
        if fmt.get("layout_version") != ours["layout_version"]:
            raise CheckpointRejected(
                f"checkpoint layout version {fmt.get('layout_version')} is not {ours['layout_version']}"
            )
        if fmt.get("dtype") != ours["dtype"]:
            raise CheckpointRejected(f"checkpoint dtype {fmt.get('dtype')} does not match the worker's {ours['dtype']}")
        if checkpoint.geometry != self.geometry():
            raise CheckpointRejected(
                f"checkpoint geometry {checkpoint.geometry} does not match the model's {self.geometry()}"
            )
        if checkpoint.draft is not None:
            raise CheckpointRejected("the checkpoint carries draft-model state but this worker runs no draft model")
        checkpoint.validate_restore_position(position)
        if position >= self.config.max_session_tokens:
            raise ContextOverflow(
                f"restore position {position} leaves no room in max_session_tokens ({self.config.max_session_tokens})"
            )
        ids = checkpoint.token_ids[:position]
        if ids.size and (int(ids.max()) >= self.vocab_size):
            raise CheckpointRejected(f"checkpoint token ids exceed the vocabulary ({self.vocab_size})")
        if not self._free_slots:
            raise CapacityExhausted(f"all {self.config.max_sessions} session slots are in use (max_sessions)")
        slot = self._free_slots[-1]
        self.executor.import_layers(slot, position, checkpoint.layers)
        self._free_slots.pop()
        self._sessions[sid] = _Session(sid, slot, ids.tolist(), position, None, None)

    # ----------------------------------------------------------------- shutdown

    def shutdown(self) -> list[EngineOutput]:
        """Settle every accepted request (cancelled) and refuse new work. Idempotent."""
        if not self._closed:
            self._closed = True
            for req in list(self._requests.values()):
                self._finish(req, "cancelled")
            self._cancelled.clear()
        out, self._outputs = self._outputs, []
        return out

