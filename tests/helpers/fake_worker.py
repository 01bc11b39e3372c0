"""An in-process stand-in for a worker and its client: :class:`FakeWorkerClient`, a
``MultiplexedWorkerClient`` whose requests a scripted engine answers in this trio thread (no
process, no pipes, no model), and :class:`FakeStore`, a session store kept in a dict.

It exists so that what is built *on* the client (``SessionRuntime``'s leases, admission, eviction
and cancellation; the HTTP service) can be tested in milliseconds. The client itself, the worker
and the stores keep their real-process tests; a few smoke tests per feature run the same code on a
real worker (marked slow).

What the fake engine keeps of the real one (worker/engine/core.py), so that tests over it can fail
the way they would on a worker:

- Sessions and their history: a generation's prompt reuses the longest common prefix with the
  session's committed tokens that have KV (at most ``len(prompt) - 1``: the last prompt token is
  always run), reported as ``reused_prompt_tokens``; after a turn the last sampled token has no KV
  (``kv_len == len(tokens) - 1``); a cancelled turn keeps what it streamed. The next token is a
  function of the history only, so a resumed session continues exactly like one that never left.
- The engine's refusals: ``SessionExists``, ``SessionNotFound``, ``SessionBusy`` (a second
  generation, or a request on a session being saved), ``Unsaveable`` ("busy generating", "empty"),
  ``CapacityExhausted`` (``max_sessions`` slots, ``max_inflight_requests`` generations),
  ``ContextOverflow``, ``CheckpointNotFound``; close and reset cancel a running generation first.
- One engine loop: requests are taken in arrival order between steps; each step (``step_s`` apart)
  gives every running generation up to ``tokens_per_step`` tokens in one token frame, so
  generations of different sessions interleave.
- The client's rules: request ids grow in call order; argument checks are the real client's;
  checkpoint calls queue on one fair lock, are cancellable until their transfer starts and shielded
  after; a lifecycle call whose caller gives up still runs in the worker; :meth:`close` lets the
  worker answer what was sent and cancels running generations, then calls fail with
  ``ClientClosedError``; a dead worker (:meth:`kill`) fails every pending and later call with one
  ``WorkerDiedError``; a hung worker (:meth:`hang`) is declared dead after ``liveness_timeout``
  seconds of silence with requests pending ("no heartbeat for N s", SIGKILL); a consumer more than
  ``stream_buffer`` deltas behind gets ``SlowConsumer``.
- Failures on demand: :meth:`fail_next` makes the engine refuse the next request of a kind.

The engine (sessions, refusals, its loop) is fake_engine.py's :class:`FakeEngine`, a mixin of
:class:`FakeWorkerClient`; this module holds the client side: requests, streams, lifecycle.

Checkpoints are :class:`FakeCheckpoint` (token ids and a position; ``nbytes`` as if each row held
``ROW_BYTES`` of KV); saves and resumes go through the client's :class:`FakeStore`.
"""

from __future__ import annotations

import math
import signal
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

import trio

from muxworker.client.client import (
    DEFAULT_STREAM_BUFFER,
    MultiplexedWorkerClient,
    _check_bool,
    _check_session_id,
    _given_token_count,
    _prompt_segments,
    _token_array,
)
from muxworker.client.params import ChatPrompt, GenerationResult, ModelInfo, WorkerInfo, check_params
from muxworker.client.sessions import SaveResult
from muxworker.transport.errors import (
    ClientClosedError,
    ContextOverflow,
    InvalidArgument,
    MuxError,
    WorkerDiedError,
)
from muxworker.transport.prompt import SpecialText

from .fake_engine import EOS, ByteTokenizer, FakeEngine, _default_next_token, _Request, _Session
from .fake_store import ROW_BYTES, FakeCheckpoint, FakeStore

__all__ = [
    "ByteTokenizer",
    "FakeCheckpoint",
    "FakeStore",
    "FakeWorkerClient",
    "fake_worker_client",
    "ROW_BYTES",
]  # the store's: fake_store.py; the tokenizer's: fake_engine.py


# ----------------------------------------------------------------------------------------------
# streams


class FakeStream:
    """What :meth:`FakeWorkerClient.generate` returns; the interface of ``GenerationStream``."""

    def __init__(self, client: FakeWorkerClient, request: _Request, session_id: str) -> None:
        self._client = client
        self._request = request
        self.session_id = session_id
        self._chunks: list[str] = []
        self._token_ids: list[int] = []

    @property
    def request_id(self) -> int:
        return self._request.rid

    @property
    def text(self) -> str:
        return "".join(self._chunks)

    @property
    def token_ids(self) -> list[int]:
        return list(self._token_ids)

    @property
    def finished(self) -> bool:
        return self._request.settled

    # The fake engine computes no logprobs (the real engine's are tested in-process and end to end).
    logprobs = None

    def logprobs_from(self, start: int) -> list:
        return []

    def __aiter__(self) -> FakeStream:
        return self

    async def __anext__(self) -> str:
        while True:
            request = self._request
            if request.frames:
                text, ids = request.frames.popleft()
                self._token_ids.extend(ids)
                if text:
                    self._chunks.append(text)
                    return text
                continue
            if request.settled:
                self._client._outcome(request)
                raise StopAsyncIteration
            request.arrived = trio.Event()
            await request.arrived.wait()

    async def wait(self) -> GenerationResult:
        async for _ in self:
            pass
        return self._client._outcome(self._request)

    def cancel(self) -> None:
        self._client._cancel(self._request)

    async def aclose(self) -> None:
        if not self._request.settled:
            self.cancel()
        try:
            await self.wait()
        except MuxError:
            pass

    async def __aenter__(self) -> FakeStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


# ----------------------------------------------------------------------------------------------
# the client


class FakeWorkerClient(FakeEngine, MultiplexedWorkerClient):
    """A ``MultiplexedWorkerClient`` answered by an in-process fake engine (module docstring).

    Made by :func:`fake_worker_client` (or :meth:`start` in a nursery of the caller's)."""

    def __init__(
        self,
        *,
        session_store: Any = None,
        max_sessions: int = 8,
        max_inflight_requests: int = 8,
        max_session_tokens: int = 4096,
        vocab_size: int = 384,
        model_name: str = "fake",
        step_s: float = 0.001,
        tokens_per_step: int = 8,
        stream_buffer: int = DEFAULT_STREAM_BUFFER,
        liveness_timeout: float | None = 10.0,
        tokenizer: Any = None,
        eos_token_ids: Sequence[int] = (EOS,),
        next_token: Callable[[Sequence[int]], int] = _default_next_token,
    ) -> None:
        # The base class's __init__ would prepare a process; nothing of it is used here.
        self.session_store = session_store
        self.info = WorkerInfo(
            protocol=(1, 1),
            model=ModelInfo(
                name=model_name,
                architecture="FakeForCausalLM",
                vocab_size=vocab_size,
                context_length=max_session_tokens,
                has_chat_template=True,
                eos_token_ids=tuple(eos_token_ids),
            ),
            backend="fake",
            device="cpu",
            dtype="float32",
            limits={
                "max_sessions": max_sessions,
                "max_inflight_requests": max_inflight_requests,
                "max_session_tokens": max_session_tokens,
            },
        )
        self.step_s = step_s
        self.tokens_per_step = tokens_per_step
        self.tokenizer = tokenizer if tokenizer is not None else ByteTokenizer()
        self.next_token = next_token
        self._stream_buffer = stream_buffer
        self._liveness_timeout = liveness_timeout
        self._sessions: dict[str, _Session] = {}
        self._running: dict[int, _Request] = {}  # generations in the engine, by request id
        self._pending: dict[int, _Request] = {}  # every request not settled yet
        self._last_id = 0
        self._inbox_send, self._inbox_recv = trio.open_memory_channel[_Request | None](math.inf)
        self._checkpoint_lock = trio.Lock()
        self._failures: dict[str, deque[BaseException]] = {}
        self._closing = False
        self._unusable: BaseException | None = None
        self._returncode: int | None = None
        self._hung = False
        self._wake = trio.Event()  # set on unhang and on death
        self._pending_changed = trio.Event()
        self._scope = trio.CancelScope()
        self._closed = trio.Event()
        self.requests: list[tuple[str, str | None]] = []  # (kind, session id) of every request, in order

    # -- lifecycle ------------------------------------------------------------------------------

    @classmethod
    async def start(cls, nursery: trio.Nursery, **kwargs: Any) -> FakeWorkerClient:
        client = cls(**kwargs)
        await nursery.start(client._run_fake)
        return client

    async def _run_fake(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            with self._scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._engine)
                    if self._liveness_timeout is not None:
                        nursery.start_soon(self._watch_liveness, self._liveness_timeout)
                    task_status.started()
        finally:
            if self._unusable is None:
                self._lose(ClientClosedError("the client's tasks were cancelled, so it was closed"), 0)
            self._closed.set()

    @property
    def pid(self) -> int | None:
        return None

    @property
    def returncode(self) -> int | None:
        return self._returncode

    @property
    def stderr_tail(self) -> list[str]:
        return []

    @property
    def is_usable(self) -> bool:
        return not self._closing and self._unusable is None

    async def close(self) -> None:
        """Let the worker answer what was sent (running generations end "cancelled"), then stop."""
        if self._closing:
            await self._closed.wait()
            return
        self._closing = True
        with trio.CancelScope(shield=True):
            if self._hung:  # a stopped worker never reads its EOF: the client kills it
                self.kill(-signal.SIGKILL, "the worker did not exit after the control pipe closed")
            elif self._unusable is None:
                self._inbox_send.send_nowait(None)  # EOF after everything sent before it
            await self._closed.wait()

    def kill(self, returncode: int = -signal.SIGKILL, reason: str = "the worker exited") -> None:
        """The worker dies now: every pending and later call raises WorkerDiedError."""
        self._lose(WorkerDiedError(reason, returncode, []), returncode)

    def hang(self) -> None:
        """The worker stops (SIGSTOP): it takes and answers nothing until :meth:`resume` or death."""
        self._hung = True
        self._pending_changed.set()

    def resume(self) -> None:
        self._hung = False
        self._wake.set()

    def fail_next(self, kind: str, error: BaseException) -> None:
        """The engine refuses the next request of ``kind`` ("open", "generate", "save", ...) with ``error``."""
        self._failures.setdefault(kind, deque()).append(error)

    def session_tokens(self, session_id: str) -> list[int]:
        """The committed history of a live session in the fake engine (for tests)."""
        return list(self._sessions[session_id].tokens)

    def _lose(self, error: BaseException, returncode: int) -> None:
        if self._unusable is not None:
            return
        self._unusable = error
        self._returncode = returncode
        for request in list(self._pending.values()):
            self._settle(request)
        self._running.clear()
        self._sessions.clear()
        self._wake.set()
        self._scope.cancel()

    # -- requests -------------------------------------------------------------------------------

    def _check_usable(self) -> None:
        if self._unusable is not None:
            raise _fresh(self._unusable)
        if self._closing:
            raise ClientClosedError("the client is closed")

    def _submit(self, kind: str, fields: dict[str, Any], buffer: int = 1) -> _Request:
        self._check_usable()
        self._last_id += 1
        request = _Request(self._last_id, kind, fields, buffer)
        self._pending[request.rid] = request
        self._pending_changed.set()
        self.requests.append((kind, fields.get("session_id")))
        self._inbox_send.send_nowait(request)
        return request

    def _settle(self, request: _Request, *, value: Any = None, error: BaseException | None = None) -> None:
        if request.settled:
            return
        request.value = value
        request.error = error
        self._pending.pop(request.rid, None)
        self._running.pop(request.rid, None)
        request.done.set()
        request.arrived.set()

    def _outcome(self, request: _Request) -> Any:
        if request.error is not None:
            raise _fresh(request.error)
        if request.value is None:
            assert self._unusable is not None
            raise _fresh(self._unusable)
        return request.value

    async def _call(self, kind: str, fields: dict[str, Any], *_: Any, **__: Any) -> Any:
        """Send one request and wait for its reply; a caller cancelled before it was sent sends
        nothing, one cancelled after leaves it to run in the worker."""
        await trio.lowlevel.checkpoint_if_cancelled()
        request = self._submit(kind, fields)
        await request.done.wait()
        return self._outcome(request)

    async def _transfer(self, kind: str, fields: dict[str, Any]) -> Any:
        """A checkpoint transfer: once sent, shielded until it settles."""
        await trio.lowlevel.checkpoint_if_cancelled()
        request = self._submit(kind, fields)
        with trio.CancelScope(shield=True):
            await request.done.wait()
        return self._outcome(request)

    def _cancel(self, request: _Request) -> None:
        if request.settled:
            return
        request.cancel_requested = True  # the engine ends it "cancelled" at its next look

    # -- the public API ---------------------------------------------------------------------------

    async def open_session(self, session_id: str) -> None:
        _check_session_id(session_id)
        await self._call("open", {"session_id": session_id})

    async def close_session(self, session_id: str) -> None:
        _check_session_id(session_id)
        await self._call("close", {"session_id": session_id})

    async def reset_session(self, session_id: str) -> None:
        _check_session_id(session_id)
        await self._call("reset", {"session_id": session_id})

    async def fork_session(self, session_id: str, target_id: str, rows: int) -> None:
        _check_session_id(session_id)
        _check_session_id(target_id)
        await self._call("fork", {"session_id": session_id, "target_id": target_id, "rows": rows})

    def generate(self, prompt: Any, params: Any) -> FakeStream:  # type: ignore[override]
        checked = check_params(params)
        session_id, fields = checked.session_id, dict(checked.fields)
        fields.pop("cache_salt", None)
        _check_session_id(session_id)
        room = self.info.limits["max_session_tokens"]
        given = _given_token_count(prompt)
        if given >= room:
            raise ContextOverflow(f"the prompt has at least {given} tokens; a session holds at most {room}")
        payloads: list[Any] = []
        segments = _prompt_segments(prompt, payloads)
        ids: list[int] = []
        for segment in segments:
            if "text" in segment:
                ids.extend(self.tokenizer.encode(segment["text"], parse_special=bool(segment.get("special"))))
            else:
                ids.extend(int(t) for t in payloads[segment["tokens"]["payload"]])
        request = self._submit(
            "generate", {"session_id": session_id, "prompt": ids, "params": fields}, self._stream_buffer
        )
        return FakeStream(self, request, session_id)

    async def tokenize(
        self, text: str, *, add_special_tokens: bool = False, parse_special: bool | None = None
    ) -> list[int]:
        if not isinstance(text, str):
            raise InvalidArgument(f"text must be a str, got {type(text).__name__}")
        add_special_tokens = _check_bool("add_special_tokens", add_special_tokens)
        if parse_special is None:
            parse_special = isinstance(text, SpecialText)
        parse_special = _check_bool("parse_special", parse_special)
        fields = {"text": str(text), "add_special_tokens": add_special_tokens, "parse_special": parse_special}
        return await self._call("tokenize", fields)

    async def detokenize(self, token_ids: Sequence[int]) -> str:
        return await self._call("detokenize", {"ids": _token_array(token_ids).tolist()})

    async def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
    ) -> ChatPrompt:
        if (
            isinstance(messages, (str, bytes))
            or not isinstance(messages, Sequence)
            or not all(isinstance(m, Mapping) for m in messages)
        ):
            raise InvalidArgument(f"messages must be a list of {{'role', 'content'}} maps, got {messages!r:.200}")
        add_generation_prompt = _check_bool("add_generation_prompt", add_generation_prompt)
        fields = {"messages": [dict(m) for m in messages], "add_generation_prompt": add_generation_prompt}
        return await self._call("chat_template", fields)

    async def query_info(self) -> dict[str, Any]:
        return await self._call("info", {})

    async def export_checkpoint_to_cpu(
        self, session_id: str, position: int | None = None, identity: str | None = None
    ) -> FakeCheckpoint:  # type: ignore[override]
        _check_session_id(session_id)
        async with self._checkpoint_lock:
            checkpoint = await self._transfer("export", {"session_id": session_id, "position": position})
        checkpoint.identity = identity
        return checkpoint

    async def restore_checkpoint_from_cpu(
        self,
        checkpoint: Any,
        session_id: str,
        position: int | None = None,
        expected_identity: str | None = None,
    ) -> None:
        if not isinstance(checkpoint, FakeCheckpoint):
            raise InvalidArgument(f"expected a FakeCheckpoint, got {type(checkpoint).__name__}")
        _check_session_id(session_id)
        async with self._checkpoint_lock:
            await self._transfer("restore", {"session_id": session_id, "checkpoint": checkpoint, "position": position})

    async def save_session(self, session_id: str) -> SaveResult:
        _check_session_id(session_id)
        store = self._store()
        async with self._checkpoint_lock:
            checkpoint = await self._transfer("save", {"session_id": session_id, "max_bytes": store.max_bytes})
            with trio.CancelScope(shield=True):
                await store._commit(session_id, checkpoint)
        return SaveResult(checkpoint.position, 0, checkpoint.nbytes, 1)

    async def resume_session(self, session_id: str) -> str:
        _check_session_id(session_id)
        store = self._store()
        async with self._checkpoint_lock:
            checkpoint = store.load(session_id)
            await trio.lowlevel.checkpoint()  # a resume reads its file: cancellable until it is sent
            await self._transfer("restore", {"session_id": session_id, "checkpoint": checkpoint, "position": None})
        return session_id

    def _store(self) -> FakeStore:
        if self.session_store is None:
            raise InvalidArgument("this client has no session_store; pass one to spawn_multiplexed_worker")
        self.session_store.check_worker(self.info)
        return self.session_store


@asynccontextmanager
async def fake_worker_client(**kwargs: Any) -> AsyncIterator[FakeWorkerClient]:
    """``async with fake_worker_client(...) as client``: a started :class:`FakeWorkerClient`, closed
    on exit (keywords as its constructor's)."""
    async with trio.open_nursery() as nursery:
        client = await FakeWorkerClient.start(nursery, **kwargs)
        try:
            yield client
        finally:
            await client.close()


def _fresh(exc: BaseException) -> BaseException:
    if isinstance(exc, WorkerDiedError):
        return exc.copy()
    if isinstance(exc, MuxError):
        new = type(exc)(*exc.args)
        new.__dict__.update(vars(exc))
        return new
    return exc
