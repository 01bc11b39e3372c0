"""The engine facade: named sessions, submit, cancel, step, export and restore, over one executor.

Plain calls, no I/O. The worker process (server.py) and the tests drive the same methods. A step
reads schedule (scheduler.py) -> propose drafts (speculative.py) -> pack -> execute -> update
(sampling.py for the tokens, output.py for text, stop strings and the result).

Ownership: one thread (the caller of ``step``) owns everything here: the model, the KV cache, every
session's history and every request's sampling state. Other threads must talk to the engine through
that thread (the worker uses a queue). The one exception is a checkpoint file job
(checkpoint_files.py): between ``begin_save`` and ``finish_save`` the job's thread reads the rows of
a session that is busy (nothing changes them meanwhile), and between ``begin_restore`` and
``finish_restore`` it writes the slot reserved for a session not yet published.

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

Prefix-cache scoping (``cache_salt``, prefix_cache.py): a request matches and seeds only entries of
its own salt, and a closed session files its history under the salt of its latest request; a
restored session that has served no request since its restore files nothing. A session's reuse of
its own history is not scoped: that history is its own state, whatever salt its next request names.

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

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from muxworker.transport.errors import (
    CapacityExhausted,
    ContextOverflow,
    InternalError,
    InvalidArgument,
    MuxError,
    NotReady,
    SessionBusy,
    SessionExists,
    SessionNotFound,
)
from muxworker.transport.prompt import SpecialText
from muxworker.transport.schema import MAX_CACHE_SALT_BYTES, MAX_SESSION_ID_BYTES
from muxworker.worker.backends.interface import Executor
from muxworker.worker.engine import output
from muxworker.worker.engine.checkpoints import EngineCheckpoints
from muxworker.worker.engine.config import EngineConfig
from muxworker.worker.engine.constraints import GrammarCompiler, Guide, fill_masks
from muxworker.worker.engine.ngram import NgramProposer
from muxworker.worker.engine.prefix_cache import PrefixCache
from muxworker.worker.engine.sampling import (
    Penalties,
    SamplingError,
    SamplingParams,
    sample,
    token_logprob,
    verify_drafts,
)
from muxworker.worker.engine.scheduler import Batch, Scheduler
from muxworker.worker.engine.speculative import DraftProposer, Proposal
from muxworker.worker.engine.state import EngineOutput, Phase, Readiness, Request, Session, common_prefix
from muxworker.worker.models.tokenizer import IncrementalDetokenizer

__all__ = ["Engine", "EngineOutput", "Readiness", "Prompt"]

Prompt = str | Sequence[int] | Sequence[str | Sequence[int]]


class Engine(EngineCheckpoints):
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
        weights: str = "float",
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
        self.weights = weights  # what the hello reports: muxworker.worker.models.defaults.resolve_weights
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
        self.proposer: DraftProposer | NgramProposer | None = None
        if config.speculative == "ngram":
            if draft is not None:
                raise InvalidArgument("--speculative ngram drafts from the session's history: it takes no draft model")
            self.proposer = NgramProposer(executor, config)
        elif draft is not None:
            self.proposer = DraftProposer(draft, executor, config, draft_name)
        elif config.n_draft:
            raise InvalidArgument(f"n_draft is {config.n_draft} but no draft model was given")
        # A draft model has state of its own (its KV, checkpointed with the session); a lookup has none.
        self._draft_model: DraftProposer | None = self.proposer if isinstance(self.proposer, DraftProposer) else None
        self.n_draft = config.n_draft
        self.eos_token_ids: list[int] = list(getattr(tokenizer, "eos_token_ids", []) or [])
        # Constraints compile against this model's tokenizer (worker/engine/constraints.py); the
        # masks of a step are computed on _masks' thread while the forward pass runs.
        self.grammars = GrammarCompiler(tokenizer, self.vocab_size, sorted(self.eos_token_ids))
        self._masks: ThreadPoolExecutor | None = None
        self._sessions: dict[str, Session] = {}
        self._free_slots: list[int] = list(range(config.max_sessions - 1, -1, -1))
        # Ids of sessions being restored from files (begin_restore reserved a slot), until finish_restore.
        self._restoring: set[str] = set()
        self._requests: dict[int, Request] = {}
        self._outputs: list[EngineOutput] = []
        self._scheduler = Scheduler(config)
        self._seed_gen = torch.Generator().manual_seed(config.seed if config.seed is not None else 0x5EED)
        self._closed = False
        # Test and benchmark hook: called with the session ids of every forward pass.
        self.on_forward: Callable[[list[str]], None] | None = None
        self._stats = {"forward_calls": 0, "forward_time_s": 0.0}
        self.readiness = Readiness.READY

    # ----------------------------------------------------------------- description

    @property
    def draft(self) -> Executor | None:
        """The draft model's executor (speculative decoding), if any."""
        return self._draft_model.executor if self._draft_model is not None else None

    @property
    def draft_model(self) -> DraftProposer | None:
        """The draft model (its executor and state), if the engine runs one; n-gram lookup has none."""
        return self._draft_model

    @property
    def draft_name(self) -> str:
        return self._draft_model.name if self._draft_model is not None else ""

    @property
    def stats(self) -> dict[str, float]:
        """Forward counts and times of the target (and the draft, with one)."""
        draft = {"draft_forward_calls": 0, "draft_forward_time_s": 0.0}
        return {**self._stats, **draft, **(self.proposer.stats if self.proposer is not None else {})}

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
            "draft": None if self._draft_model is None else {"name": self.draft_name, "n_draft": self.n_draft},
            # How each tensor type is held and which passes run it (WeightGroup).
            "weight_groups": [g.to_dict() for g in self.executor.weight_groups],
        }

    # ----------------------------------------------------------------- sessions

    @staticmethod
    def _check_session_id(sid: object) -> str:
        if not isinstance(sid, str) or not sid:
            raise InvalidArgument(f"session id must be a non-empty string, got {sid!r}")
        if len(sid.encode("utf-8", "surrogatepass")) > MAX_SESSION_ID_BYTES:
            raise InvalidArgument(f"session id is longer than {MAX_SESSION_ID_BYTES} UTF-8 bytes")
        return sid

    def _session(self, sid: str) -> Session:
        self._check_session_id(sid)
        s = self._sessions.get(sid)
        if s is None:
            self._check_not_restoring(sid)
            raise SessionNotFound(f"session {sid!r} is not open")
        return s

    def _idle_session(self, sid: str) -> Session:
        """The session, unless a save of it is in flight (then nothing may touch its rows or slot)."""
        s = self._session(sid)
        if s.saving:
            raise SessionBusy(f"session {sid!r} is being saved")
        return s

    def _check_not_restoring(self, sid: str) -> None:
        if sid in self._restoring:
            raise SessionBusy(f"session {sid!r} is being restored")

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
        self._check_not_restoring(sid)
        if not self._free_slots:
            raise CapacityExhausted(f"all {self.config.max_sessions} session slots are in use (max_sessions)")
        self._sessions[sid] = Session(sid, self._free_slots.pop())

    def close_session(self, sid: str) -> None:
        s = self._idle_session(sid)
        if s.request is not None:
            self._finish(s.request, "cancelled")
        # A closed session's history becomes a prefix-cache entry (when the cache is on), under the
        # salt of its latest request; a restored session that served none has no salt to file it under.
        if s.salt_known:
            self.prefix_cache.insert(s.slot, s.tokens[: s.kv_len], s.kv_floor, s.cache_salt)
        del self._sessions[sid]
        self._free_slots.append(s.slot)

    def reset_session(self, sid: str) -> None:
        s = self._idle_session(sid)
        if s.request is not None:
            self._finish(s.request, "cancelled")
        s.forget()
        s.unsaveable = "empty"

    def fork_session(self, sid: str, target: str, rows: int) -> None:
        """Make ``target``'s history the first ``rows`` tokens of ``sid``'s, copying their rows
        slot to slot (the seed's fork): ``target`` then continues from them as if it had computed
        them. ``target`` must be open and idle (its own history is replaced); ``sid`` may be
        generating (rows below its length do not change). ``rows`` may be at most what ``sid``
        holds, and only where every ring layer still holds what continuing from there needs. The
        draft model's rows are copied as far as they reach; the rest is pending for it."""
        self._check_ready()
        s = self._session(sid)
        d = self._idle_session(target)
        if d is s:
            raise InvalidArgument(f"cannot fork session {sid!r} into itself")
        if d.request is not None:
            raise SessionBusy(f"session {target!r} is generating (request {d.request.rid})")
        if isinstance(rows, bool) or not isinstance(rows, int) or not 0 <= rows <= s.kv_len:
            raise InvalidArgument(f"rows must be an integer in [0, {s.kv_len}] (the rows session {sid!r} holds)")
        if rows < s.kv_len and not self.cache.can_truncate(s.kv_len, rows, s.kv_floor):
            raise InvalidArgument(
                f"session {sid!r} no longer holds the rows before {rows} (its sliding-window layers moved on)"
            )
        self.cache.copy_slot(s.slot, d.slot, rows)
        d.forget()
        d.tokens, d.kv_len, d.kv_floor = list(s.tokens[:rows]), rows, s.kv_floor if rows else 0
        d.cache_salt, d.salt_known = s.cache_salt, s.salt_known
        d.unsaveable = None if rows else "empty"
        draft = self.draft
        keep = min(rows, s.draft_len)
        if draft is not None and keep and draft.cache.can_truncate(s.draft_len, keep, s.draft_floor):
            draft.cache.copy_slot(s.slot, d.slot, keep)
            d.draft_len, d.draft_floor = keep, s.draft_floor

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

    def _reusable_prefix(self, s: Session, prompt: list[int]) -> int:
        """Rows of the session's cache the prompt can keep (at most len(prompt) - 1). Not scoped by
        cache_salt: the session's history is its own state, unlike the shared prefix cache."""
        common = common_prefix(s.tokens, prompt, min(s.kv_len, len(prompt) - 1))
        if common and not self.cache.can_truncate(s.kv_len, common, s.kv_floor):
            return 0
        return common

    @staticmethod
    def _check_cache_salt(salt: object) -> str | None:
        if salt is None:
            return None
        if not isinstance(salt, str) or not salt:
            raise InvalidArgument(f"cache_salt must be a non-empty string or None, got {salt!r:.80}")
        if len(salt.encode("utf-8", "surrogatepass")) > MAX_CACHE_SALT_BYTES:
            raise InvalidArgument(f"cache_salt is longer than {MAX_CACHE_SALT_BYTES} UTF-8 bytes")
        return salt

    def submit(
        self,
        request_id: int,
        sid: str,
        prompt: Prompt,
        params: SamplingParams,
        *,
        cache_salt: str | None = None,
        guide: Guide | None = None,
    ) -> None:
        """Accept a generation or raise; results come from later ``step`` calls.

        ``cache_salt``: the prefix-cache namespace of the request (module docstring); None is the
        shared one. It never limits the session's reuse of its own history. ``guide``: the
        request's constraint already compiled by ``self.grammars`` (the worker compiles on its
        reader thread); when None, a constraint is compiled here."""
        self._check_ready()
        if not isinstance(request_id, int) or not 0 < request_id < 2**63:
            raise InvalidArgument(f"request id must be a positive 64-bit integer, got {request_id!r}")
        if request_id in self._requests:
            raise InvalidArgument(f"request id {request_id} is already in flight")
        s = self._idle_session(sid)
        if s.request is not None:
            raise SessionBusy(f"session {sid!r} is already generating (request {s.request.rid})")
        # A compiled guide's constraint was checked where it was compiled (the worker's reader thread).
        params.validate(self.vocab_size, constraint=guide is None)
        cache_salt = self._check_cache_salt(cache_salt)
        if params.constraint is None:
            guide = None
        elif guide is None:
            guide = self.grammars.compile(params.constraint)
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
        gen: torch.Generator | None = None
        if not params.greedy:
            seed = params.seed
            if seed is None:
                seed = int(torch.randint(0, 2**62, (1,), generator=self._seed_gen))
            gen = torch.Generator().manual_seed(seed)
        fresh = s.kv_len == 0
        reused = self._reusable_prefix(s, ids)
        floor = s.kv_floor if reused else 0
        s.keep_rows(reused)
        hit = self.prefix_cache.match(ids, len(ids) - 1, cache_salt)
        if hit is not None and hit[1] > reused:
            floor = self.prefix_cache.copy_into(hit[0], s.slot, hit[1])
            reused = hit[1]
            s.durable = None  # the entry's rows replaced the slot's
        req = Request(
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
            cache_salt=cache_salt,
            penalties=Penalties(params, ids, self.vocab_size) if params.penalized else None,
            guide=guide,
        )
        if self._draft_model is not None:
            self._draft_model.keep_on_submit(s, ids, reused)
        # Commit the prompt: the session now continues from ``reused`` rows.
        s.tokens = list(ids)
        s.kv_len = reused
        s.kv_floor = floor
        s.cache_salt, s.salt_known = cache_salt, True
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

    # ----------------------------------------------------------------- ending a request

    def _finish(self, req: Request, reason: str, error: MuxError | None = None) -> None:
        """End ``req``: commit what its session keeps (see the module docstring) and queue its result."""
        if req.finished:
            return
        req.finished = True
        s = req.session
        if reason == "error":
            s.forget()
            s.unsaveable = "the last generation failed"
        else:
            # Drop prompt tokens that never got KV (cancelled during prefill).
            if req.phase is Phase.PREFILL:
                s.tokens = s.tokens[: s.kv_len]
            elif req.stop_cut:
                self._truncate(s, len(req.prompt) + output.visible_tokens(req))
            s.unsaveable = None if s.kv_len else "empty"
        s.request = None
        del self._requests[req.rid]
        tail = req.held_text + req.detok.flush() if reason in ("length", "stop") and not req.stop_cut else ""
        self._outputs.append(EngineOutput(req.rid, tail, [], output.result(req, reason, time.perf_counter()), error))

    def _truncate(self, s: Session, length: int) -> None:
        """Keep ``tokens[:length]`` (dropping the rows past it by length) where every cache still
        holds what continuing from there needs; otherwise keep everything (exact, only colder)."""
        if length >= len(s.tokens) or length > s.kv_len:
            return  # nothing to drop, or the rows before the cut were never written
        if not self.cache.can_truncate(s.kv_len, length, s.kv_floor):
            return  # a ring no longer holds the rows before the cut
        s.tokens = s.tokens[:length]
        s.kv_len = length
        s.keep_rows(length)
        draft = self.draft
        if draft is not None and s.draft_len > length:
            if draft.cache.can_truncate(s.draft_len, length, s.draft_floor):
                s.draft_len = length
            else:
                s.draft_len = s.draft_floor = 0  # the draft refeeds the history from the start

    def _fail(self, req: Request, exc: Exception) -> None:
        """End one request whose own processing raised; the other requests of the step carry on."""
        if req.finished:
            return
        if isinstance(exc, (InternalError, InvalidArgument)):
            error = exc
        else:
            message = str(exc) if isinstance(exc, SamplingError) else f"{type(exc).__name__}: {exc}"
            error = InternalError(f"request {req.rid} failed: {message}")
        self._finish(req, "error", error)

    def _accept_token(self, req: Request, token: int, logits: torch.Tensor | None = None) -> None:
        """Commit ``token``, sampled from ``logits`` (its row [V]; for the logprobs asked for)."""
        now = time.perf_counter()
        if req.t_first_token is None:
            req.t_first_token = now
        s = req.session
        req.generated.append(token)
        s.tokens.append(token)
        if req.penalties is not None:
            req.penalties.push(token)
        req.phase = Phase.DECODE
        if req.guide is not None and not req.guide.consume(token):
            # The grammar cannot go on past its parser's limits (a schema whose values must nest
            # without end, say): the request's own constraint is at fault, so invalid_argument.
            raise InvalidArgument(
                f"the constraint (response_format, tools) cannot be followed after {len(req.generated)} tokens: "
                f"{req.guide.error}"
            )
        k = req.params.logprobs
        lp = [token_logprob(logits, token, k)] if k is not None and logits is not None else None
        if token in req.stop_ids:
            self._outputs.append(EngineOutput(req.rid, "", [token], logprobs=lp))
            self._finish(req, "stop")
            return
        out = output.emit_text(req, token)
        out.logprobs = lp
        self._outputs.append(out)
        if req.stop_cut or (req.guide is not None and req.guide.done):
            self._finish(req, "stop")
        elif len(req.generated) >= req.max_new:
            self._finish(req, "length")

    # ----------------------------------------------------------------- stepping

    def step(self) -> list[EngineOutput]:
        """Run one batched forward pass (if there is work) and return the outputs it produced.

        schedule -> propose (with a draft model: its forwards, one per drafted position) -> pack ->
        execute the target's one forward -> update each request with its logits.
        """
        batch = self._scheduler.schedule(list(self._requests.values()))
        proposals: dict[int, Proposal] = {}
        if self.proposer is not None and batch:
            proposals, failures = self.proposer.propose(batch.decoding, batch.chunks)
            for r, exc in failures:
                self._fail(r, exc)
            batch.drop_finished()
        if batch:
            batch.pack({rid: p.tokens for rid, p in proposals.items()})
            masks = self._start_masks(batch)
            logits = self._execute(batch)
            if masks is not None:
                masks.result()
            if logits is not None:
                self._update(batch, logits, proposals)
        out, self._outputs = self._outputs, []
        return out

    def _start_masks(self, batch: Batch) -> Future[None] | None:
        """Compute the grammar masks of the constrained requests this step samples, on a helper
        thread while the forward pass runs (llguidance releases the GIL)."""
        guides = [r.guide for r in batch.sampled if r.guide is not None and not r.finished]
        if not guides:
            return None
        if self._masks is None:
            self._masks = ThreadPoolExecutor(1, thread_name_prefix="muxworker-masks")
        return self._masks.submit(fill_masks, guides)

    def _execute(self, batch: Batch) -> torch.Tensor | None:
        """The target's forward; a failure ends the requests of this batch only."""
        if self.on_forward is not None:
            self.on_forward([r.session.sid for r in batch.requests])
        t0 = time.perf_counter()
        try:
            return self.executor.forward(batch.tokens, batch.positions, batch.spans, batch.sample_rows)
        except Exception as exc:
            for r in batch.requests:
                self._finish(r, "error", InternalError(f"forward pass failed: {type(exc).__name__}: {exc}"))
            return None
        finally:
            self._stats["forward_calls"] += 1
            self._stats["forward_time_s"] += time.perf_counter() - t0

    def _update(self, batch: Batch, logits: torch.Tensor, proposals: dict[int, Proposal]) -> None:
        """Advance lengths by what the forward wrote, then sample each request's tokens."""
        for r, n in batch.chunks:
            r.session.kv_len += n
            if self._draft_model is not None:
                r.session.draft_len = r.session.kv_len  # propose() fed the draft the same chunk
            if r.fresh and r.session.kv_len == len(r.prompt):
                self.prefix_cache.insert(r.session.slot, r.prompt, r.session.kv_floor, r.cache_salt)
        row = 0
        for r in batch.sampled:
            decoding = r.phase is Phase.DECODE
            proposal = proposals.get(r.rid) if decoding else None
            n = (len(proposal.tokens) if proposal is not None else 0) + 1 if decoding else 1
            try:
                if decoding:
                    self._commit_decoded(r, logits[row : row + n], proposal)
                elif not r.finished:
                    token = sample(logits[row], r.params, r.generator, r.penalties, r.guide)
                    self._accept_token(r, token, logits[row])
            except Exception as exc:  # one request's sampling or output failed: end it alone
                self._fail(r, exc)
            row += n

    def _commit_decoded(self, r: Request, logits: torch.Tensor, proposal: Proposal | None) -> None:
        """Commit what the target's logits [1 + k, V] over (last token, k drafted tokens) decide."""
        if r.finished:
            return
        s = r.session
        if proposal is None or not proposal.tokens:
            s.kv_len += 1
            self._accept_token(r, sample(logits[0], r.params, r.generator, r.penalties, r.guide), logits[0])
            return
        n = len(s.tokens)  # the target just wrote rows [n - 1, n + k), the draft [.., n + k - 1)
        k = len(proposal.tokens)
        probs: torch.Tensor | None
        if proposal.point and not r.params.greedy:  # q of a looked-up token: all mass on it
            probs = torch.nn.functional.one_hot(
                torch.tensor(proposal.tokens, device=logits.device), logits.shape[-1]
            ).to(torch.float32)
        else:
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
            self._accept_token(r, token, logits[i])  # row i scored the token committed at i
        # Roll back both caches past the rejected rows by setting lengths. As after any sampled
        # token, the last committed token has no KV yet. The draft's rows hold tokens[:n] and drafts
        # 1..k-1; those it shares with the committed history stay.
        s.kv_len = len(s.tokens) - 1
        if self._draft_model is not None:
            s.draft_len = min(n + min(committed_drafts, k - 1), s.kv_len)

    # ----------------------------------------------------------------- shutdown

    def shutdown(self) -> list[EngineOutput]:
        """Settle every accepted request (cancelled) and refuse new work. Idempotent."""
        if not self._closed:
            self._closed = True
            for req in list(self._requests.values()):
                self._finish(req, "cancelled")
        out, self._outputs = self._outputs, []
        return out
