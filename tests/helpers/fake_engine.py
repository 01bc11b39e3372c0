"""The fake worker's engine (see fake_worker.py for what it keeps of the real one): the sessions
and their histories, the engine's refusals, and one loop that takes requests in arrival order
between steps and gives every running generation up to ``tokens_per_step`` tokens a step.

:class:`FakeEngine` is a mixin of :class:`~helpers.fake_worker.FakeWorkerClient`, whose
constructor sets the state it runs on and whose request plumbing (``_settle``, ``_lose``, ``kill``)
it answers through. :class:`ByteTokenizer` is the fake model's default tokenizer.
"""

from __future__ import annotations

import signal
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import trio

from muxworker.client.params import ChatPrompt, GenerationResult, WorkerInfo
from muxworker.transport.errors import (
    CapacityExhausted,
    CheckpointTooLarge,
    ClientClosedError,
    ContextOverflow,
    InvalidArgument,
    MuxError,
    SessionBusy,
    SessionExists,
    SessionNotFound,
    SlowConsumer,
    Unsaveable,
)

from .fake_store import FakeCheckpoint

__all__ = ["EOS", "ByteTokenizer", "FakeEngine"]

EOS = 2  # the fake model's end-of-sequence token
_FIRST_LETTER = 3 + ord("a")  # generated tokens are the byte tokens of a..z


# ----------------------------------------------------------------------------------------------
# the fake engine's state


@dataclass
class _Session:
    tokens: list[int] = field(default_factory=list)
    kv_len: int = 0
    generation: _Request | None = None
    saving: bool = False


class _Request:
    """One request from the client to the fake worker, and (for a generation) its stream's mailbox."""

    def __init__(self, rid: int, kind: str, fields: dict[str, Any], buffer: int) -> None:
        self.rid = rid
        self.kind = kind
        self.fields = fields
        self.buffer = buffer
        self.done = trio.Event()
        self.value: Any = None
        self.error: BaseException | None = None
        self.frames: deque[tuple[str, list[int]]] = deque()
        self.arrived = trio.Event()  # a frame or the end: wakes the stream's reader
        self.cancel_requested = False
        # Generations in the engine:
        self.prompt: list[int] = []
        self.generated: list[int] = []
        self.text = ""
        self.reused = 0

    @property
    def settled(self) -> bool:
        return self.done.is_set()

    def push(self, text: str, ids: list[int]) -> None:
        self.frames.append((text, ids))
        self.arrived.set()


def _default_next_token(history: Sequence[int]) -> int:
    """A letter that depends on the whole history (so a restored history continues identically)."""
    h = len(history)
    for t in history[-8:]:
        h = (h * 131 + t) % 1_000_003
    return _FIRST_LETTER + h % 26


class ByteTokenizer:
    """Text <-> token ids, one token per UTF-8 byte (ids 3..258); 0-2 are special and decode to
    nothing. Any object with these three methods can stand in (a real ``Tokenizer.from_dir``)."""

    def encode(self, text: str, add_special_tokens: bool = False, *, parse_special: bool = False) -> list[int]:
        return [3 + b for b in text.encode("utf-8")]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return bytes(t - 3 for t in ids if 3 <= t < 259).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> str:
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return text + "<assistant>" if add_generation_prompt else text


# ----------------------------------------------------------------------------------------------
# the engine


class FakeEngine:
    """The fake engine's loop and rules, run in the client's trio thread (module docstring)."""

    # Set by FakeWorkerClient.__init__:
    info: WorkerInfo
    tokenizer: Any
    next_token: Callable[[Sequence[int]], int]
    step_s: float
    tokens_per_step: int
    _sessions: dict[str, _Session]
    _running: dict[int, _Request]  # generations in the engine, by request id
    _pending: dict[int, _Request]  # every request not settled yet
    _inbox_recv: trio.MemoryReceiveChannel[_Request | None]
    _failures: dict[str, deque[BaseException]]
    _hung: bool
    _wake: trio.Event
    _pending_changed: trio.Event
    # The client's, through which the engine answers:
    _settle: Callable[..., None]
    _lose: Callable[[BaseException, int], None]
    kill: Callable[..., None]

    async def _engine(self) -> None:
        """Take requests in arrival order between steps; one token per running generation per step."""
        while True:
            while True:
                if self._running:
                    try:
                        request = self._inbox_recv.receive_nowait()
                    except trio.WouldBlock:
                        break
                else:
                    request = await self._inbox_recv.receive()
                await self._while_hung()
                if request is None:
                    return self._exit_on_eof()
                if not request.settled:
                    self._handle(request)
            await trio.sleep(self.step_s)
            await self._while_hung()
            self._step()

    async def _while_hung(self) -> None:
        while self._hung:
            self._wake = trio.Event()
            await self._wake.wait()

    def _exit_on_eof(self) -> None:
        for request in list(self._running.values()):
            self._finish(request, "cancelled")
        self._lose(ClientClosedError("the client was closed"), 0)

    async def _watch_liveness(self, timeout: float) -> None:
        """The client's liveness rule: silence for ``timeout`` s with requests pending is a death."""
        while True:
            if not self._pending or not self._hung:
                self._pending_changed = trio.Event()
                await self._pending_changed.wait()
                continue
            with trio.move_on_after(timeout):
                while self._hung:
                    self._wake = trio.Event()
                    await self._wake.wait()
                continue
            if self._pending and self._hung:
                self.kill(-signal.SIGKILL, f"no heartbeat for {timeout:g} s")
                return

    def _session(self, session_id: str, *, idle: bool = True) -> _Session:
        session = self._sessions.get(session_id)
        if session is None:
            raise SessionNotFound(f"session {session_id!r} is not open")
        if idle and session.saving:
            raise SessionBusy(f"session {session_id!r} is being saved")
        return session

    def _take_slot(self, session_id: str) -> None:
        if session_id in self._sessions:
            raise SessionExists(f"session {session_id!r} is already open")
        if len(self._sessions) >= self.info.limits["max_sessions"]:
            raise CapacityExhausted(f"all {self.info.limits['max_sessions']} session slots are in use (max_sessions)")

    def _handle(self, request: _Request) -> None:
        kind, fields = request.kind, request.fields
        sid = fields.get("session_id")
        failures = self._failures.get(kind)
        try:
            if failures:
                raise failures.popleft()
            if kind == "open":
                self._take_slot(sid)
                self._sessions[sid] = _Session()
                value: Any = {}
            elif kind in ("close", "reset"):
                session = self._session(sid)
                if session.generation is not None:
                    self._finish(session.generation, "cancelled")
                if kind == "close":
                    del self._sessions[sid]
                else:
                    session.tokens, session.kv_len = [], 0
                value = {}
            elif kind == "fork":
                source, target = self._session(sid, idle=False), self._session(fields["target_id"])
                if target.generation is not None:
                    raise SessionBusy(f"session {fields['target_id']!r} is generating")
                if not 0 <= fields["rows"] <= source.kv_len:
                    raise InvalidArgument(f"rows must be in [0, {source.kv_len}]")
                target.tokens, target.kv_len = list(source.tokens[: fields["rows"]]), fields["rows"]
                value = {}
            elif kind == "generate":
                return self._submit_generation(request)
            elif kind in ("save", "export"):
                session = self._session(sid)
                if session.generation is not None:
                    raise Unsaveable(f"session {sid!r} is busy generating (request {session.generation.rid})")
                if session.kv_len == 0:
                    raise Unsaveable(f"session {sid!r} cannot be saved: empty")
                position = fields.get("position") or session.kv_len
                if not 1 <= position <= session.kv_len:
                    raise InvalidArgument(f"export position must be in [1, {session.kv_len}], got {position!r}")
                value = FakeCheckpoint(position, np.asarray(session.tokens[:position], dtype=np.int32))
                if kind == "save" and value.nbytes > fields["max_bytes"]:
                    raise CheckpointTooLarge(
                        f"the session needs {value.nbytes} bytes; the store takes {fields['max_bytes']}"
                    )
            elif kind == "restore":
                checkpoint = fields["checkpoint"]
                self._take_slot(sid)
                position = fields["position"] if fields["position"] is not None else checkpoint.position
                tokens = [int(t) for t in checkpoint.token_ids[:position]]
                self._sessions[sid] = _Session(tokens=tokens, kv_len=len(tokens))
                value = {}
            elif kind == "tokenize":
                value = self.tokenizer.encode(
                    fields["text"],
                    add_special_tokens=fields["add_special_tokens"],
                    parse_special=fields["parse_special"],
                )
            elif kind == "detokenize":
                vocab = self.info.model.vocab_size
                if any(not 0 <= t < vocab for t in fields["ids"]):
                    raise InvalidArgument(f"token ids must lie in [0, {vocab})")
                value = self.tokenizer.decode(fields["ids"])
            elif kind == "chat_template":
                try:
                    text = self.tokenizer.apply_chat_template(
                        fields["messages"], add_generation_prompt=fields["add_generation_prompt"]
                    )
                except ValueError as exc:  # the tokenizer's ChatTemplateError
                    raise InvalidArgument(str(exc)) from None
                value = ChatPrompt(text, self.tokenizer.encode(text, parse_special=True))
            elif kind == "info":
                value = {
                    "sessions": sorted(self._sessions),
                    "inflight_requests": len(self._running),
                    "limits": dict(self.info.limits),
                }
            else:  # pragma: no cover - a request kind this fake does not know
                raise InvalidArgument(f"unknown request kind {kind!r}")
        except MuxError as exc:
            self._settle(request, error=exc)
            return
        self._settle(request, value=value)

    def _submit_generation(self, request: _Request) -> None:
        sid, prompt, params = request.fields["session_id"], request.fields["prompt"], request.fields["params"]
        session = self._session(sid)
        if session.generation is not None:
            raise SessionBusy(f"session {sid!r} is already generating (request {session.generation.rid})")
        limit = self.info.limits["max_inflight_requests"]
        if len(self._running) >= limit:
            raise CapacityExhausted(f"{len(self._running)} requests are in flight (max_inflight_requests={limit})")
        if not prompt:
            raise InvalidArgument("the prompt is empty")
        vocab = self.info.model.vocab_size
        if any(not 0 <= t < vocab for t in prompt):
            raise InvalidArgument(f"a token id is outside the vocabulary [0, {vocab})")
        room = self.info.limits["max_session_tokens"]
        if len(prompt) >= room:
            raise ContextOverflow(f"the prompt has {len(prompt)} tokens; a session holds at most {room}")
        max_new = params.get("max_new_tokens", 256)
        max_new = room - len(prompt) if max_new == -1 else max_new
        if len(prompt) + max_new > room:
            raise ContextOverflow(
                f"prompt ({len(prompt)} tokens) plus max_new_tokens ({max_new}) exceeds max_session_tokens ({room})"
            )
        common = 0
        limit_common = min(session.kv_len, len(prompt) - 1)
        while common < limit_common and session.tokens[common] == prompt[common]:
            common += 1
        request.prompt = list(prompt)
        request.reused = common
        request.fields["max_new"] = max_new
        stop = params.get("stop_token_ids")
        request.fields["stop_ids"] = frozenset(stop if stop is not None else self.info.model.eos_token_ids)
        request.fields["stop"] = list(params.get("stop") or ())
        # Prefilled now: the session holds the prompt (its KV), and what it generates next.
        session.tokens, session.kv_len = list(prompt), len(prompt)
        session.generation = request
        self._running[request.rid] = request

    def _step(self) -> None:
        """One forward pass: up to ``tokens_per_step`` tokens for every running generation, sent
        as one token frame each (as accepted speculative tokens are)."""
        for request in list(self._running.values()):
            if request.settled:
                continue
            if request.cancel_requested:
                self._finish(request, "cancelled")
                continue
            if len(request.frames) >= request.buffer:
                self._slow_consumer(request)
                continue
            session = self._sessions[request.fields["session_id"]]
            ids: list[int] = []
            start = len(request.text)
            reason = None
            for _ in range(self.tokens_per_step):
                token = self.next_token(session.tokens)
                session.tokens.append(token)
                session.kv_len = len(session.tokens) - 1
                request.generated.append(token)
                ids.append(token)
                if token in request.fields["stop_ids"]:
                    reason = "stop"
                    break
                request.text += self.tokenizer.decode([token])
                cut = min((i for i in (request.text.find(s) for s in request.fields["stop"]) if i >= 0), default=-1)
                if cut >= 0:
                    request.text = request.text[:cut]
                    reason = "stop"
                    break
                if len(request.generated) >= request.fields["max_new"]:
                    reason = "length"
                    break
            request.push(request.text[start:], ids)
            if reason is not None:
                self._finish(request, reason)

    def _slow_consumer(self, request: _Request) -> None:
        request.frames.clear()
        self._end_generation(request)
        self._settle(
            request,
            error=SlowConsumer(
                f"request {request.rid}: its consumer fell {request.buffer} token frames behind, "
                "so the generation was cancelled"
            ),
        )

    def _end_generation(self, request: _Request) -> None:
        session = self._sessions.get(request.fields["session_id"])
        if session is not None and session.generation is request:
            session.generation = None
        self._running.pop(request.rid, None)

    def _finish(self, request: _Request, reason: str) -> None:
        self._end_generation(request)
        prompt, generated = request.prompt, request.generated
        result = GenerationResult(
            finish_reason=reason,
            prompt_tokens=len(prompt),
            reused_prompt_tokens=request.reused,
            prefilled_prompt_tokens=len(prompt) - request.reused,
            completion_tokens=len(generated),
            generated_token_ids=list(generated),
            prefill_time_s=0.0,
            decode_time_s=0.0,
            committed_tokens=len(generated),
        )
        self._settle(request, value=result)
