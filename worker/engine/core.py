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
- A finished turn (stop token or length) commits prompt + every sampled token, including a stop
  token.
- A turn cut by a stop string commits the prompt plus the generated tokens whose text lies wholly
  inside the visible output; the rows past them are dropped by length, as a cancel does. Where a
  sliding-window ring no longer holds the rows before the cut, it commits every sampled token
  instead (always exact, only less warm). ``committed_tokens`` in the result says how many.
- A cancelled turn commits the prompt rows that were prefilled plus the tokens sampled so far.
- A failed forward pass, or a request whose sampling fails, empties that session's history.
A session whose last turn failed is not saveable until a later clean turn; after any other turn
(finished, stop-string cut or cancelled) it is saveable and warm.

Restored rows (``kv_floor``): a restore writes only the rows its checkpoint holds, so a ring layer
of a restored slot may hold fewer than the W rows its length suggests. The session records the
first position every ring layer really holds, and every retention question (truncating, exporting,
the prefix cache) takes it into account, so nothing ever attends to a row that was not imported.

Speculative decoding (a draft executor and ``config.n_draft`` > 0; docs/SPECULATIVE.md):
- The draft has its own KV cache with the same slots and, per session, its own length
  ``draft_len`` <= ``kv_len``. Committed tokens tokens[draft_len:kv_len] are *pending*: the draft
  has not been fed them yet; its next forward feeds them before proposing.
- Each step the draft proposes up to n_draft tokens for every decoding session (one batched draft
  forward per drafted position); the target then scores all of them in its one forward, a span of
  1 + k rows per session. Accepted drafts and one target token are committed; both caches roll back
  past the rejected rows by setting their lengths (ring layers have n_draft spare rows for that).
- Prefill chunks are fed to the draft in its first forward of the step, so after a prefill the
  draft is level with the target.
"""
from __future__ import annotations

import bisect
import enum
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch

from muxworker.native import all_finite
from muxworker.transport.checkpoint import LAYOUT_VERSION, CPUCheckpoint, LayerState, numpy_storage_dtype
from muxworker.transport.prompt import SpecialText
from muxworker.transport.schema import MAX_SESSION_ID_BYTES
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

from muxworker.worker.engine.config import EngineConfig
from muxworker.worker.backends.interface import Executor
from muxworker.worker.engine.prefix_cache import PrefixCache
from muxworker.worker.backends.interface import SeqSpan
from muxworker.worker.engine.sampling import (
    Penalties,
    SamplingError,
    SamplingParams,
    sample,
    sample_draft,
    verify_drafts,
)
from muxworker.worker.models.tokenizer import IncrementalDetokenizer

Prompt = str | Sequence[int] | Sequence[str | Sequence[int]]


def _rollback_rows(cache: Any) -> int:
    """Rows a slot of ``cache`` may write past its length and then drop (see cache.RingLayerCache)."""
    rows = getattr(cache, "rollback_rows", None)
    if rows is not None:
        return int(rows)
    # A cache without spare ring rows can still roll back when no layer is a ring.
    if all(w is None or w >= cache.max_tokens for w in cache.windows):
        return cache.max_tokens
    return 0


def _geometry(executor: Executor) -> dict[str, Any]:
    args = executor.args
    return {
        "num_layers": int(args.num_hidden_layers),
        "num_kv_heads": args.num_kv_heads,
        "head_dim": int(args.head_dim),  # type: ignore[arg-type]
        "windows": list(executor.cache.windows),
    }


def _check_finite(what: str, layers: Sequence[LayerState], dtype: str) -> None:
    """Refuse a checkpoint whose KV rows hold NaN or inf. CRCs catch corruption, not a file written
    that way on purpose; such rows would turn the session's logits into NaN, and a restored slot
    later serves other sessions (prefix-cache entries), so they never enter the cache."""
    bf16 = dtype == "bfloat16"
    for i, layer in enumerate(layers):
        for name, rows in (("keys", layer.keys), ("values", layer.values)):
            if not all_finite(np.ascontiguousarray(rows), bfloat16=bf16):
                raise CheckpointRejected(f"checkpoint {what} {i} {name} hold NaN or infinite values")


def _common_prefix(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    n = 0
    while n < limit and a[n] == b[n]:
        n += 1
    return n


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
    # Rows [0, draft_len) of the draft's cache slot hold the draft's KV of tokens[:draft_len];
    # always <= kv_len (0 without a draft). tokens[draft_len:kv_len] are pending for the draft.
    draft_len: int = 0
    # The first position the slot's ring layers really hold when it was filled by a restore (or
    # from a prefix-cache entry that was); 0 when every row was computed here. See the docstring.
    kv_floor: int = 0
    draft_floor: int = 0


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
    draft_proposed: int = 0  # tokens the draft proposed for this request
    draft_accepted: int = 0  # of those, tokens the target accepted and the session committed
    penalties: Penalties | None = None  # only when a penalty is on
    text_ends: list[int] = field(default_factory=list)  # output text length after each generated token
    emitted: int = 0  # characters of output text sent so far


@dataclass
class _Proposal:
    """The draft's tokens for one decoding request in one step."""

    tokens: list[int]
    probs: list[torch.Tensor]  # q [V] each token was drawn from; empty when greedy


class Engine:
    """Continuous batching over named sessions on one model."""

    def __init__(
        self,
        executor: Executor,
        tokenizer: Any,
        config: EngineConfig,
        *,
        model_name: str = "",
        model_path: str = "",
        draft: Executor | None = None,
        draft_name: str = "",
    ) -> None:
        """``draft``: a draft model's executor for speculative decoding (with ``config.n_draft`` > 0);
        it must share the target's vocabulary (the caller checks that the tokenizers agree), dtype
        and slot count."""
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
        self.draft = draft
        self.draft_name = draft_name
        self.n_draft = config.n_draft
        if draft is not None or config.n_draft:
            self._check_draft(draft, config)
        self.eos_token_ids: list[int] = list(getattr(tokenizer, "eos_token_ids", []) or [])
        self._sessions: dict[str, _Session] = {}
        self._free_slots: list[int] = list(range(config.max_sessions - 1, -1, -1))
        self._requests: dict[int, _Request] = {}
        self._outputs: list[EngineOutput] = []
        self._decode_cursor = 0
        self._prefill_cursor = 0
        self._seed_gen = torch.Generator().manual_seed(config.seed if config.seed is not None else 0x5EED)
        self._closed = False
        # Test and benchmark hook: called with the session ids of every forward pass.
        self.on_forward: Callable[[list[str]], None] | None = None
        self.stats = {"forward_calls": 0, "forward_time_s": 0.0, "draft_forward_calls": 0, "draft_forward_time_s": 0.0}
        self.readiness = Readiness.READY

    def _check_draft(self, draft: Executor | None, config: EngineConfig) -> None:
        if draft is None:
            raise InvalidArgument(f"n_draft is {config.n_draft} but no draft model was given")
        if config.n_draft < 1:
            raise InvalidArgument("a draft model needs n_draft >= 1 (tokens proposed per step)")
        draft_vocab = int(draft.args.vocab_size)
        if draft_vocab != self.vocab_size:
            raise InvalidArgument(
                f"the draft model's vocabulary has {draft_vocab} tokens but the target's has {self.vocab_size}; "
                "a draft must use the target's tokenizer"
            )
        if draft.dtype_name != self.executor.dtype_name:
            raise InvalidArgument(f"the draft runs in {draft.dtype_name} but the target in {self.executor.dtype_name}")
        if draft.cache.slots < self.cache.slots:
            raise InvalidArgument(
                f"the draft's cache has {draft.cache.slots} slots; the target's has {self.cache.slots}"
            )
        draft_context = int(draft.args.max_position_embeddings)
        if config.max_session_tokens > draft_context:
            raise InvalidArgument(
                f"max_session_tokens ({config.max_session_tokens}) exceeds the draft model's context length "
                f"({draft_context})"
            )
        # Verification writes 1 + k target rows and keeps as few as 1; the draft writes k and keeps 1.
        for who, cache, rows in (("target", self.cache, config.n_draft), ("draft", draft.cache, config.n_draft - 1)):
            if _rollback_rows(cache) < rows:
                raise InvalidArgument(
                    f"the {who}'s KV cache cannot roll back {rows} rows; build its executor with "
                    f"rollback_rows >= {config.n_draft} (sliding-window rings need that many spare rows)"
                )

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
            "draft": None if self.draft is None else {"name": self.draft_name, "n_draft": self.n_draft},
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
        self.prefix_cache.insert(s.slot, s.tokens[: s.kv_len], s.kv_floor)
        del self._sessions[sid]
        self._free_slots.append(s.slot)

    def reset_session(self, sid: str) -> None:
        s = self._session(sid)
        if s.request is not None:
            self._finish(s.request, "cancelled")
        s.tokens = []
        s.kv_len = s.kv_floor = 0
        s.draft_len = s.draft_floor = 0
        s.unsaveable = "empty"

    def session_ids(self) -> list[str]:
        return list(self._sessions)

    def session_tokens(self, sid: str) -> list[int]:
        """The committed token history of a session (a copy)."""
        return list(self._session(sid).tokens)

    def pending_draft_tokens(self, sid: str) -> list[int]:
        """Committed tokens whose KV the target has and the draft has not been fed yet (a copy)."""
        s = self._session(sid)
        return s.tokens[s.draft_len : s.kv_len]

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
                ids.extend(self.tokenizer.encode(seg, parse_special=isinstance(seg, SpecialText)))
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
        common = _common_prefix(s.tokens, prompt, min(s.kv_len, len(prompt) - 1))
        if common and not self.cache.can_truncate(s.kv_len, common, s.kv_floor):
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
        if not params.greedy and seed is None:
            seed = int(torch.randint(0, 2**62, (1,), generator=self._seed_gen))
        gen = torch.Generator().manual_seed(seed) if not params.greedy else None
        fresh = s.kv_len == 0
        reused = self._reusable_prefix(s, ids)
        floor = s.kv_floor if reused else 0
        hit = self.prefix_cache.match(ids, len(ids) - 1)
        if hit is not None and hit[1] > reused:
            floor = self.prefix_cache.copy_into(hit[0], s.slot, hit[1])
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
            penalties=Penalties(params, ids, self.vocab_size) if params.penalized else None,
        )
        if self.draft is not None:
            # The draft keeps what its own rows share with the prompt, never more than the target;
            # the rest (a prefix-cache hit included) is pending and fed with the first prefill chunk.
            keep = _common_prefix(s.tokens, ids, min(s.draft_len, reused))
            if keep and not self.draft.cache.can_truncate(s.draft_len, keep, s.draft_floor):
                keep = 0
            s.draft_len = keep
            if not keep:
                s.draft_floor = 0
        # Commit the prompt: the session now continues from ``reused`` rows.
        s.tokens = list(ids)
        s.kv_len = reused
        s.kv_floor = floor
        s.request = req
        s.unsaveable = "busy"
        self._requests[request_id] = req

    def cancel(self, request_id: int) -> bool:
        """End a request now (its result comes from the next ``step``); returns whether it was in
        flight. The session is idle at once, so a generation submitted right after is accepted."""
        req = self._requests.get(request_id)
        if req is None:
            return False
        self._finish(req, "cancelled")
        return True

    def has_work(self) -> bool:
        return bool(self._requests or self._outputs)

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
            s.tokens, s.kv_len, s.kv_floor, s.draft_len, s.draft_floor = [], 0, 0, 0, 0
            s.unsaveable = "the last generation failed"
        else:
            # Drop prompt tokens that never got KV (cancelled during prefill).
            if req.phase is _Phase.PREFILL:
                s.tokens = s.tokens[: s.kv_len]
            elif req.stop_cut:
                self._commit_visible(req)
            s.unsaveable = None if s.kv_len else "empty"
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
            "committed_tokens": max(0, len(s.tokens) - len(req.prompt)),
            "generated_token_ids": list(req.generated),
            "prefill_time_s": t_first - req.t_submit,
            "decode_time_s": now - t_first,
            "draft_proposed_tokens": req.draft_proposed,
            "draft_accepted_tokens": req.draft_accepted,
        }
        self._outputs.append(EngineOutput(req.rid, tail, [], result, error))

    def _commit_visible(self, req: _Request) -> None:
        """After a stop-string cut: keep only the generated tokens whose text is wholly visible."""
        s = req.session
        visible = req.emitted
        keep = bisect.bisect_right(req.text_ends, visible)
        # A trailing token with no text of its own (a partial UTF-8 sequence) belongs to what follows.
        while keep and req.text_ends[keep - 1] == (req.text_ends[keep - 2] if keep > 1 else 0):
            keep -= 1
        length = len(req.prompt) + keep
        if length >= len(s.tokens) or length > s.kv_len:
            return  # every token is visible, or the rows before the cut were never written
        if not self.cache.can_truncate(s.kv_len, length, s.kv_floor):
            return  # a ring no longer holds the rows before the cut: commit everything (exact, colder)
        s.tokens = s.tokens[:length]
        s.kv_len = length
        if self.draft is not None and s.draft_len > length:
            if self.draft.cache.can_truncate(s.draft_len, length, s.draft_floor):
                s.draft_len = length
            else:
                s.draft_len = s.draft_floor = 0  # the draft refeeds the history from the start

    def _emit_text(self, req: _Request, token: int) -> EngineOutput:
        delta = req.detok.push(token)
        req.text_ends.append((req.text_ends[-1] if req.text_ends else 0) + len(delta))
        out = self._visible(req, delta, token)
        req.emitted += len(out.text)
        return out

    def _visible(self, req: _Request, delta: str, token: int) -> EngineOutput:
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
        if req.penalties is not None:
            req.penalties.push(token)
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
        """Run one batched forward pass (if there is work) and return the outputs it produced.

        With a draft model the target's one forward is preceded by the draft's forwards (one per
        drafted position), which propose the tokens the target verifies.
        """
        decoding, chunks = self._schedule()
        proposals: dict[int, _Proposal] = {}
        if self.draft is not None and (decoding or chunks):
            proposals = self._propose(decoding, chunks)
            decoding = [r for r in decoding if not r.finished]
            chunks = [(r, n) for r, n in chunks if not r.finished]
        if decoding or chunks:
            self._forward(decoding, chunks, proposals)
        out, self._outputs = self._outputs, []
        return out

    def _draft_budget(self, req: _Request) -> int:
        """Tokens to draft for ``req`` this step: at most n_draft, and never past max_new_tokens
        (the target's token after the drafts must still fit), so drafted positions stay inside the
        session's max_session_tokens. A penalized request drafts nothing: its logits at each drafted
        position would depend on the drafts before it, which one verification pass does not model."""
        if req.params.penalized:
            return 0
        return max(0, min(self.n_draft, req.max_new - len(req.generated) - 1))

    def _fail(self, req: _Request, exc: Exception) -> None:
        """End one request whose own processing raised; the other requests of the step carry on."""
        if req.finished:
            return
        message = str(exc) if isinstance(exc, SamplingError) else f"{type(exc).__name__}: {exc}"
        self._finish(req, "error", InternalError(f"request {req.rid} failed: {message}"))

    def _draft_forward(
        self, reqs: list[_Request], tokens: list[int], positions: list[int], spans: list[SeqSpan], rows: list[int]
    ) -> torch.Tensor | None:
        """One draft forward; on failure end ``reqs`` with an error and return None."""
        assert self.draft is not None
        t0 = time.perf_counter()
        try:
            return self.draft.forward(tokens, positions, spans, rows)
        except Exception as exc:  # a failed forward ends the requests in this batch only
            for r in reqs:
                self._finish(r, "error", InternalError(f"draft forward pass failed: {type(exc).__name__}: {exc}"))
            return None
        finally:
            self.stats["draft_forward_calls"] += 1
            self.stats["draft_forward_time_s"] += time.perf_counter() - t0

    def _propose(self, decoding: list[_Request], chunks: list[tuple[_Request, int]]) -> dict[int, _Proposal]:
        """Run the draft: feed pending tokens and prefill chunks, and draft tokens for decoding requests.

        The first draft forward carries, per session, the pending tokens plus either the chunk the
        target prefills this step or the last committed token (whose logits give the first draft
        token); each later forward carries one drafted token per session still drafting.
        """
        budget = {r.rid: self._draft_budget(r) for r in decoding}
        drafting = [r for r in decoding if budget[r.rid] > 0]
        if not drafting and not chunks:
            return {}
        tokens: list[int] = []
        positions: list[int] = []
        spans: list[SeqSpan] = []
        rows: list[int] = []
        for r in drafting:
            s = r.session
            end = len(s.tokens)  # through the last committed token, which the target has no KV of yet
            spans.append(SeqSpan(s.slot, s.draft_len, end - s.draft_len, len(tokens)))
            tokens.extend(s.tokens[s.draft_len : end])
            positions.extend(range(s.draft_len, end))
            rows.append(len(tokens) - 1)
        for r, n in chunks:
            s = r.session
            end = s.kv_len + n  # the target's rows after this step's chunk
            spans.append(SeqSpan(s.slot, s.draft_len, end - s.draft_len, len(tokens)))
            tokens.extend(s.tokens[s.draft_len : end])
            positions.extend(range(s.draft_len, end))
        logits = self._draft_forward(drafting + [r for r, _ in chunks], tokens, positions, spans, rows)
        if logits is None:
            return {}
        # The chunk sessions' draft rows now reach kv_len + n; _forward sets draft_len with kv_len.
        proposals: dict[int, _Proposal] = {r.rid: _Proposal([], []) for r in drafting}
        active = drafting
        for j in range(self.n_draft):
            for r, row in zip(active, logits):
                try:
                    token, q = sample_draft(row, r.params, r.generator)
                except Exception as exc:  # the draft's logits hold no distribution: end this request alone
                    self._fail(r, exc)
                    proposals.pop(r.rid, None)
                    continue
                proposals[r.rid].tokens.append(token)
                if q is not None:
                    proposals[r.rid].probs.append(q)
            active = [r for r in active if budget[r.rid] > j + 1 and not r.finished]
            if not active:
                break
            # Feed each session's newest draft token to get the distribution for the next one.
            tokens, positions, spans = [], [], []
            for r in active:
                s = r.session
                pos = len(s.tokens) + j
                spans.append(SeqSpan(s.slot, pos, 1, len(tokens)))
                tokens.append(proposals[r.rid].tokens[-1])
                positions.append(pos)
            logits = self._draft_forward(active, tokens, positions, spans, list(range(len(active))))
            if logits is None:  # those requests ended; the others keep what they drafted
                return {rid: p for rid, p in proposals.items() if rid in self._requests}
        return proposals

    def _forward(
        self, decoding: list[_Request], chunks: list[tuple[_Request, int]], proposals: dict[int, _Proposal]
    ) -> None:
        tokens: list[int] = []
        positions: list[int] = []
        spans: list[SeqSpan] = []
        sample_rows: list[int] = []
        sample_reqs: list[_Request] = []
        for r in decoding:
            # The last committed token, then the draft's tokens: logits for every row.
            s = r.session
            pos = s.kv_len
            drafted = proposals[r.rid].tokens if r.rid in proposals else []
            span = [s.tokens[pos]] + drafted
            spans.append(SeqSpan(s.slot, pos, len(span), len(tokens)))
            sample_rows.extend(range(len(tokens), len(tokens) + len(span)))
            sample_reqs.append(r)
            tokens.extend(span)
            positions.extend(range(pos, pos + len(span)))
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
        for r, n in chunks:
            r.session.kv_len += n
            if self.draft is not None:
                r.session.draft_len = r.session.kv_len  # _propose fed the draft the same chunk
            if r.fresh and r.session.kv_len == len(r.prompt):
                self.prefix_cache.insert(r.session.slot, r.prompt, r.session.kv_floor)
        row = 0
        for r in sample_reqs:
            decoding_now = r.phase is _Phase.DECODE
            proposal = proposals.get(r.rid) if decoding_now else None
            n = (len(proposal.tokens) if proposal is not None else 0) + 1 if decoding_now else 1
            try:
                if decoding_now:
                    self._commit_decoded(r, logits[row : row + n], proposal)
                elif not r.finished:
                    self._accept_token(r, sample(logits[row], r.params, r.generator, r.penalties))
            except Exception as exc:  # one request's sampling or output failed: end it alone
                self._fail(r, exc)
            row += n

    def _commit_decoded(self, r: _Request, logits: torch.Tensor, proposal: _Proposal | None) -> None:
        """Commit what the target's logits [1 + k, V] over (last token, k drafted tokens) decide."""
        if r.finished:
            return
        s = r.session
        if proposal is None or not proposal.tokens:
            s.kv_len += 1
            self._accept_token(r, sample(logits[0], r.params, r.generator, r.penalties))
            return
        n = len(s.tokens)  # the target just wrote rows [n - 1, n + k), the draft [.., n + k - 1)
        k = len(proposal.tokens)
        probs = torch.stack(proposal.probs) if proposal.probs else None
        commit, accepted = verify_drafts(logits, proposal.tokens, probs, r.params, r.generator)
        r.draft_proposed += k
        committed_drafts = 0
        for i, token in enumerate(commit):
            if r.finished:  # a stop token or stop string among the drafts ends the turn there
                break
            if i < accepted:
                committed_drafts += 1
                r.draft_accepted += 1
            self._accept_token(r, token)
        # Roll back both caches past the rejected rows by setting lengths. As after any sampled
        # token, the last committed token has no KV yet. The draft's rows hold tokens[:n] and drafts
        # 1..k-1; those it shares with the committed history stay.
        s.kv_len = len(s.tokens) - 1
        s.draft_len = min(n + min(committed_drafts, k - 1), s.kv_len)
    # ----------------------------------------------------------------- checkpoints

    def executor_format(self) -> dict[str, Any]:
        return {"backend": self.executor.backend, "dtype": self.executor.dtype_name, "layout_version": LAYOUT_VERSION}

    def geometry(self) -> dict[str, Any]:
        return _geometry(self.executor)

    def draft_geometry(self) -> dict[str, Any] | None:
        return None if self.draft is None else _geometry(self.draft)

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
        if not self.cache.can_truncate(s.kv_len, position, s.kv_floor):
            raise CheckpointRejected(
                f"session {sid!r} no longer retains the history position {position} needs "
                f"(earliest is {self.cache.earliest_position(s.kv_len, s.kv_floor)})"
            )
        layers = self.executor.export_layers(s.slot, s.kv_len, position, s.kv_floor)
        return CPUCheckpoint(
            format=self.executor_format(),
            geometry=self.geometry(),
            position=position,
            token_ids=np.asarray(s.tokens[:position], dtype=np.int32),
            layers=layers,
            draft=None if self.draft is None else self._export_draft(s, position),
        )

    def _export_draft(self, s: _Session, position: int) -> dict[str, Any]:
        """The draft's state at ``position``: its rows up to where it is (at most ``position``) and the
        committed tokens after that which it has not been fed (``pending_token_ids``)."""
        assert self.draft is not None
        at = min(s.draft_len, position)
        if at and not self.draft.cache.can_truncate(s.draft_len, at, s.draft_floor):
            at = 0  # its rings no longer hold what ``at`` needs: the draft restarts from the beginning
        if at:
            layers = self.draft.export_layers(s.slot, s.draft_len, at, s.draft_floor)
        else:
            geo = self.draft_geometry()
            assert geo is not None
            empty = np.zeros((0, geo["num_kv_heads"], geo["head_dim"]), numpy_storage_dtype(self.draft.dtype_name))
            layers = [LayerState(0, empty, empty.copy()) for _ in range(geo["num_layers"])]
        return {
            "geometry": self.draft_geometry(),
            "layers": layers,
            "pending_token_ids": np.asarray(s.tokens[at:position], dtype=np.int32),
        }

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
        draft_position = self._check_draft_state(checkpoint)
        checkpoint.validate_restore_position(position)
        if position >= self.config.max_session_tokens:
            raise ContextOverflow(
                f"restore position {position} leaves no room in max_session_tokens ({self.config.max_session_tokens})"
            )
        ids = checkpoint.token_ids[:position]
        if ids.size and (int(ids.max()) >= self.vocab_size):
            raise CheckpointRejected(f"checkpoint token ids exceed the vocabulary ({self.vocab_size})")
        draft_len = min(position, draft_position)
        _check_finite("layer", checkpoint.layers, self.executor.dtype_name)
        if self.draft is not None and draft_len:
            assert checkpoint.draft is not None
            _check_finite("draft layer", checkpoint.draft["layers"], self.draft.dtype_name)
        if not self._free_slots:
            raise CapacityExhausted(f"all {self.config.max_sessions} session slots are in use (max_sessions)")
        slot = self._free_slots[-1]
        floor = self.executor.import_layers(slot, position, checkpoint.layers)
        draft_floor = 0
        if self.draft is not None and draft_len:
            assert checkpoint.draft is not None
            draft_floor = self.draft.import_layers(slot, draft_len, checkpoint.draft["layers"])
        self._free_slots.pop()
        self._sessions[sid] = _Session(
            sid, slot, ids.tolist(), position, None, None, draft_len, kv_floor=floor, draft_floor=draft_floor
        )

    def _check_draft_state(self, checkpoint: CPUCheckpoint) -> int:
        """Check the checkpoint's draft state against this engine; return the draft's position (0 without one)."""
        if self.draft is None:
            if checkpoint.draft is not None:
                raise CheckpointRejected(
                    "the checkpoint carries draft-model state but this worker runs no draft model; "
                    "restore it into a worker started with the same --draft"
                )
            return 0
        if checkpoint.draft is None:
            raise CheckpointRejected(
                "this worker runs a draft model but the checkpoint has no draft state (it was made without one); "
                "restore it into a worker without --draft"
            )
        d = checkpoint.draft
        if d["geometry"] != self.draft_geometry():
            raise CheckpointRejected(
                f"checkpoint draft geometry {d['geometry']} does not match the draft model's {self.draft_geometry()}"
            )
        extra = sorted(set(d) - {"geometry", "layers", "pending_token_ids"})
        if extra:
            raise CheckpointRejected(f"checkpoint draft state has fields this worker does not know: {extra}")
        pending = d.get("pending_token_ids")
        if pending is None or pending.dtype != np.int32 or pending.ndim != 1:
            raise CheckpointRejected("checkpoint draft state lacks pending_token_ids (int32 [n])")
        at = checkpoint.draft_position
        assert at is not None
        if at + pending.shape[0] != checkpoint.position or not np.array_equal(pending, checkpoint.token_ids[at:]):
            raise CheckpointRejected(
                f"checkpoint pending_token_ids ({pending.shape[0]} tokens) are not the committed tokens "
                f"[{at}, {checkpoint.position}) after the draft's rows"
            )
        return at

    # ----------------------------------------------------------------- shutdown

    def shutdown(self) -> list[EngineOutput]:
        """Settle every accepted request (cancelled) and refuse new work. Idempotent."""
        if not self._closed:
            self._closed = True
            for req in list(self._requests.values()):
                self._finish(req, "cancelled")
        out, self._outputs = self._outputs, []
        return out

