"""The public trio client of one worker process: ``MultiplexedWorkerClient`` (its streams are stream.py's).

The client is three layers, each testable on its own:

- ``process.py``, :class:`~.process.WorkerProcess`: spawn the worker over two dedicated pipes
  (``transport.fdio.WorkerPipes``), read its hello, pump its stderr into the log (logger
  ``"muxworker.worker"``) keeping the last lines, reap it (terminate, then kill, shielded).
- ``connection.py``, :class:`~.connection.Connection`: requests multiplexed over any pair of trio
  streams: the reader that routes frames to per-request mailboxes, the writer, settlement, loss
  (every pending and later call raises one :class:`WorkerDiedError` with the exit status and stderr
  tail, or :class:`ClientClosedError` after :meth:`close`) and the liveness watchdog.
- ``sessions.py``, :class:`~.sessions.CheckpointQueue`: export, restore, save and resume, queued
  in call order on one lock.

This module puts them together behind the public API and checks every argument before anything
is queued. The liveness watchdog (unless ``liveness_timeout=None``): while any request is pending,
a worker that sends nothing (no reply, no token, no heartbeat, no byte of a large frame) for
``liveness_timeout`` seconds is declared dead, ``WorkerDiedError("no heartbeat for N s")``, and
killed with SIGKILL (a stopped process ignores SIGTERM). The worker writes a heartbeat from a
thread of its own while it is busy (``--heartbeat_ms``, added to its command line by the spawn),
so a long forward pass does not count as silence; the timeout only has to exceed the longest
stall of the worker process as a whole.

Checkpoint calls (export, restore, save, resume) are cancellable until their transfer starts:
while queued behind other checkpoint operations, while a resume reads its file, and until the
first byte of the request frame is written. From then on a cancel waits for the transfer to settle
(so a save never leaves half a result behind); a worker that stops answering ends it through the
liveness rule.
"""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import AsyncIterator, Generator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import numpy as np
import trio

from muxworker.transport.checkpoint import CPUCheckpoint
from muxworker.transport.errors import ClientClosedError, ContextOverflow, InvalidArgument, WorkerStartupError
from muxworker.transport.framing import attach_payload
from muxworker.transport.messages import (
    ChatTemplateRequest,
    CloseSession,
    DetokenizeRequest,
    ForkSession,
    GenerateRequest,
    InfoRequest,
    OpenSession,
    ResetSession,
    TokenizeRequest,
    WorkerInfo,
)
from muxworker.transport.prompt import SpecialText
from muxworker.transport.schema import MAX_SESSION_ID_BYTES

from .connection import LOSS_SETTLE_S, Connection
from .params import ChatPrompt, check_params
from .process import WorkerProcess, default_worker_command, heartbeat_args
from .sessions import (
    CheckpointQueue,
    SaveResult,
    check_identity,
    check_identity_arg,
    check_position,
    require_store,
)
from .stream import GenerationStream

if TYPE_CHECKING:
    from .stores import StoreBinding

__all__ = [
    "MultiplexedWorkerClient",
    "spawn_multiplexed_worker",
    "default_worker_command",
    "DEFAULT_STARTUP_TIMEOUT",
    "DEFAULT_STREAM_BUFFER",
    "DEFAULT_LIVENESS_TIMEOUT",
    "prompt_too_long",
]

DEFAULT_STARTUP_TIMEOUT = 300.0  # the first start converts the bundled GGUF
DEFAULT_STREAM_BUFFER = 1024  # token frames buffered per stream before it is cancelled as a slow consumer
DEFAULT_CLOSE_TIMEOUT = 10.0  # how long close() lets the worker settle its requests and exit
# Heartbeats come from a thread of their own, so a long forward pass does not delay them; this only
# has to cover a stall of the whole worker process (swapping, a GIL-holding call, an overloaded host).
DEFAULT_LIVENESS_TIMEOUT = 10.0

_TOKEN_MAX = 2**31 - 1


# ----------------------------------------------------------------------------------------------
# The client


class MultiplexedWorkerClient:
    """Many sessions and concurrent streams over one worker's two pipes (see the module docstring).

    Made by :func:`spawn_multiplexed_worker`; ``info`` is the worker's hello.
    """

    def __init__(
        self,
        worker_command: Sequence[str],
        *,
        session_store: StoreBinding | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        startup_timeout: float = DEFAULT_STARTUP_TIMEOUT,
        stream_buffer: int = DEFAULT_STREAM_BUFFER,
        close_timeout: float = DEFAULT_CLOSE_TIMEOUT,
        liveness_timeout: float | None = DEFAULT_LIVENESS_TIMEOUT,
    ) -> None:
        _check_spawn_args(worker_command, stream_buffer, startup_timeout, close_timeout, liveness_timeout)
        self._process = WorkerProcess(worker_command, env=env, cwd=cwd)
        self._liveness_timeout = liveness_timeout
        self.session_store = session_store
        self._startup_timeout = startup_timeout
        self._stream_buffer = stream_buffer
        self._close_timeout = close_timeout
        self.info: WorkerInfo | None = None  # set by the handshake, before the spawn returns

        self._scope = trio.CancelScope()  # every background task of this client
        self._connection: Connection | None = None  # made once the worker is spawned
        self._checkpoints = CheckpointQueue()
        self._closing = False
        self._closed = trio.Event()

    # -- public state -----------------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        return self._process.pid

    @property
    def returncode(self) -> int | None:
        """The worker's exit status once it has exited and been reaped, else None."""
        return self._process.returncode

    @property
    def stderr_tail(self) -> list[str]:
        """The last lines the worker wrote to stderr (or stdout)."""
        return self._process.stderr_tail

    @property
    def is_usable(self) -> bool:
        return not self._closing and self._connection is not None and self._connection.is_usable

    # -- lifecycle --------------------------------------------------------------------------

    async def _run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Spawn the worker, handshake, then run the connection until closed or lost."""
        process = self._process
        try:
            with self._scope:
                reply, control = await process.spawn(heartbeat_args(self._liveness_timeout))
                self._connection = connection = Connection(
                    reply,
                    control,
                    peer=process,
                    stream_buffer=self._stream_buffer,
                    close_timeout=self._close_timeout,
                    liveness_timeout=self._liveness_timeout,
                )
                startup_error: BaseException | None = None
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(process.pump_stderr)
                    try:
                        self.info = await process.handshake(connection.reader, self._startup_timeout, LOSS_SETTLE_S)
                        if self.info.files:
                            connection.files = process.files
                    except WorkerStartupError as exc:
                        # Raised below, outside the nursery, so the caller sees it as is.
                        startup_error = exc
                        nursery.cancel_scope.cancel()
                    else:
                        nursery.start_soon(self._watch_process, connection)
                        await nursery.start(connection.run)
                        task_status.started()
                if startup_error is not None:
                    raise startup_error
        finally:
            with trio.CancelScope(shield=True):
                await process.reap()
                if self._connection is not None:
                    await self._connection.aclose()
                self._closed.set()

    async def _watch_process(self, connection: Connection) -> None:
        await self._process.wait()
        connection.connection_lost("the worker exited")

    async def close(self) -> None:
        """Close the control pipe (the worker settles its requests and exits), reap the worker, and
        end every background task. Idempotent; safe under cancellation; never autosaves."""
        if self._closing:
            await self._closed.wait()
            return
        self._closing = True
        connection = self._connection
        with trio.CancelScope(shield=True):
            try:
                if connection is not None:
                    # After everything queued before it: those requests reach the worker and settle.
                    await connection.close()
                await self._process.reap()
                if connection is not None:
                    with trio.move_on_after(LOSS_SETTLE_S * 4):
                        await connection.settled.wait()
            finally:
                self._scope.cancel()
                await self._closed.wait()

    @property
    def _conn(self) -> Connection:
        """The connection; whether it is still usable is checked as each request is queued."""
        if self._connection is None:
            raise ClientClosedError("the client is closed" if self._closing else "the client is not started")
        return self._connection

    async def _send(self, request: Any, payloads: list[Any] | None = None, *, expect: str) -> Any:
        """Send one typed request (transport/messages.py) and wait for its reply."""
        return await self._conn.call(request.KIND, request.fields(), payloads, expect=expect)

    # -- calls --------------------------------------------------------------------------------

    async def open_session(self, session_id: str) -> None:
        """Open an empty session (raises SessionExists, CapacityExhausted)."""
        _check_session_id(session_id)
        await self._send(OpenSession(session_id), expect="ok")

    async def close_session(self, session_id: str) -> None:
        """Close a session; its running generation, if any, ends "cancelled" first."""
        _check_session_id(session_id)
        await self._send(CloseSession(session_id), expect="ok")

    async def reset_session(self, session_id: str) -> None:
        """Forget a session's history and keep it open; its running generation ends "cancelled" first."""
        _check_session_id(session_id)
        await self._send(ResetSession(session_id), expect="ok")

    async def fork_session(self, session_id: str, target_id: str, rows: int) -> None:
        """Make open session ``target_id``'s history the first ``rows`` tokens of ``session_id``'s,
        their KV rows copied in the worker (no recomputation): ``target_id`` continues from there.
        ``session_id`` may be generating meanwhile; ``target_id`` must be idle."""
        _check_session_id(session_id)
        _check_session_id(target_id)
        await self._send(ForkSession(session_id, target_id, rows), expect="ok")

    def generate(self, prompt: str | Sequence[int] | Sequence[str | Sequence[int]], params: Any) -> GenerationStream:
        """Start a generation and return its stream at once (the request is sent in call order).

        ``prompt``: text, a list of token ids (sent as an int32 payload), or a list of segments
        (each text or token ids). ``params``: a :class:`GenerationParams` or any object with its
        attributes (``session_id`` required; missing ones take the worker's defaults). Raises
        InvalidArgument for a malformed prompt or params, and ContextOverflow for token ids that
        alone exceed the worker's max_session_tokens (before converting them: 16M of them would
        hold this trio thread for seconds).
        """
        checked = check_params(params)
        session_id, fields = checked.session_id, dict(checked.fields)
        salt = fields.pop("cache_salt", None)  # not a sampling field
        _check_session_id(session_id)
        room = self.info.limits.get("max_session_tokens") if self.info is not None else None
        given = _given_token_count(prompt)
        if isinstance(room, int) and given >= room:
            raise prompt_too_long(given, room)
        payloads: list[Any] = []
        segments = _prompt_segments(prompt, payloads)
        connection = self._conn
        request = connection.submit(
            "generate",
            GenerateRequest(session_id, segments, fields, cache_salt=salt).fields(),
            payloads,
            expect="done",
            buffer=self._stream_buffer,
        )
        return GenerationStream(connection, request, session_id, logprobs=fields.get("logprobs") is not None)

    async def tokenize(
        self, text: str, *, add_special_tokens: bool = False, parse_special: bool | None = None
    ) -> list[int]:
        """Token ids of ``text``. Special-token markers in it are parsed only with ``parse_special``
        (default: when ``text`` is a :class:`SpecialText`), as in prompts."""
        if not isinstance(text, str):
            raise InvalidArgument(f"text must be a str, got {type(text).__name__}")
        add_special_tokens = _check_bool("add_special_tokens", add_special_tokens)
        if parse_special is not None:
            parse_special = _check_bool("parse_special", parse_special)
        if parse_special is None:
            parse_special = isinstance(text, SpecialText)
        ids, _ = await self._send(TokenizeRequest(str(text), add_special_tokens, parse_special), expect="tokens")
        return ids

    async def detokenize(self, token_ids: Sequence[int]) -> str:
        payloads: list[Any] = []
        ref = attach_payload(payloads, _token_array(token_ids))
        return await self._send(DetokenizeRequest(ref), payloads, expect="text")

    async def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
    ) -> ChatPrompt:
        """Render ``messages`` with the model's chat template (in the worker); returns (text, token_ids)."""
        if (
            isinstance(messages, (str, bytes))
            or not isinstance(messages, Sequence)
            or not all(isinstance(m, Mapping) for m in messages)
        ):
            raise InvalidArgument(f"messages must be a list of {{'role', 'content'}} maps, got {messages!r:.200}")
        add_generation_prompt = _check_bool("add_generation_prompt", add_generation_prompt)
        request = ChatTemplateRequest([dict(m) for m in messages], add_generation_prompt)
        ids, text = await self._send(request, expect="tokens")
        return ChatPrompt(text if text is not None else "", ids)

    async def query_info(self) -> dict[str, Any]:
        """The worker's current info: the hello fields plus open sessions, requests and step stats."""
        return await self._send(InfoRequest(), expect="ok")

    # -- checkpoints (sessions.py) --------------------------------------------------------------

    async def export_checkpoint_to_cpu(
        self, session_id: str, position: int | None = None, identity: str | None = None
    ) -> CPUCheckpoint:
        """An independent host copy of an idle session's committed state (up to ``position``).

        Queued behind other checkpoint operations. Cancellable until the transfer starts (while
        queued, and until the request is written); after that a cancel waits for it to settle,
        which the liveness rule bounds.
        """
        _check_session_id(session_id)
        position = check_position(position, optional=True)
        check_identity_arg("identity", identity)
        return await self._checkpoints.export(self._conn, session_id, position, identity)

    async def restore_checkpoint_from_cpu(
        self,
        checkpoint: CPUCheckpoint,
        session_id: str,
        position: int | None = None,
        expected_identity: str | None = None,
    ) -> None:
        """Restore ``checkpoint`` up to ``position`` (default: all of it) into the unused session id.

        Cancellable until the transfer starts, like :meth:`export_checkpoint_to_cpu`."""
        if not isinstance(checkpoint, CPUCheckpoint):
            raise InvalidArgument(f"expected a CPUCheckpoint, got {type(checkpoint).__name__}")
        _check_session_id(session_id)
        position = check_position(position, optional=True)
        check_identity_arg("expected_identity", expected_identity)
        check_identity(checkpoint, expected_identity)
        await self._checkpoints.restore(self._conn, checkpoint, session_id, position)

    async def save_session(self, session_id: str) -> SaveResult:
        """Save the idle session to the session store, atomically: the previous save stays
        loadable until the new one is complete.

        The worker writes the session's KV rows straight from its cache into a file the store
        created and vetted (passed as an open descriptor), and only the positions after the
        previous save of the session when its cache still holds exactly those rows; the store then
        replaces the session's manifest. Returns what was written (:class:`SaveResult`).

        Cancellable while queued behind other checkpoint operations and until the save request
        is written; after that it runs to its end (the file is written) and a cancel takes effect
        at the caller's next checkpoint. A worker that stops answering ends it with WorkerDiedError.
        """
        _check_session_id(session_id)
        store = require_store(self.session_store, self.info)
        return await self._checkpoints.save(self._conn, store, session_id)

    async def resume_session(self, session_id: str) -> str:
        """Restore the session saved in the store into a new live session of that id.

        The store vets and opens the session's files; the worker reads them straight into a free
        cache slot and checks every checksum before it publishes the session (a failed resume
        leaves the id unused). Cancellable while queued, while the files are opened and until the
        restore request is written.
        """
        _check_session_id(session_id)
        store = require_store(self.session_store, self.info)
        await self._checkpoints.resume(self._conn, store, session_id)
        return session_id


def _check_session_id(session_id: Any) -> None:
    if not isinstance(session_id, str) or not session_id:
        raise InvalidArgument(f"session id must be a non-empty str, got {session_id!r:.200}")
    if (
        len(session_id) * 4 > MAX_SESSION_ID_BYTES
        and len(session_id.encode("utf-8", "surrogatepass")) > MAX_SESSION_ID_BYTES
    ):
        raise InvalidArgument(f"session id must be at most {MAX_SESSION_ID_BYTES} UTF-8 bytes")


def _check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise InvalidArgument(f"{name} must be a bool, got {value!r:.200}")
    return bool(value)


# ----------------------------------------------------------------------------------------------
# Prompts


def _is_token_ids(value: Any) -> bool:
    if isinstance(value, np.ndarray):
        return value.ndim == 1 and value.dtype.kind in "iu"
    return isinstance(value, (list, tuple)) and all(
        isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in value
    )


def _token_array(ids: Any) -> np.ndarray:
    if not _is_token_ids(ids):
        raise InvalidArgument(f"token ids must be a list of integers, got {type(ids).__name__}")
    if isinstance(ids, np.ndarray):
        array = ids  # checked in its own dtype: no widened copy of a large prompt
    else:
        try:
            array = np.asarray(ids, dtype=np.int64) if len(ids) else np.zeros(0, dtype=np.int64)
        except OverflowError:  # an id beyond int64
            raise InvalidArgument(f"token ids must lie in [0, {_TOKEN_MAX}]") from None
    if array.size and (int(array.min()) < 0 or int(array.max()) > _TOKEN_MAX):
        raise InvalidArgument(f"token ids must lie in [0, {_TOKEN_MAX}]")
    return np.ascontiguousarray(array, dtype=np.int32)


def prompt_too_long(given: int, room: int) -> ContextOverflow:
    """The error for a prompt of at least ``given`` tokens where a session holds ``room`` (the
    worker's max_session_tokens): the HTTP server's 400 ``context_length_exceeded``."""
    return ContextOverflow(
        f"the prompt has at least {given} tokens; a session holds at most {room} (max_session_tokens), "
        "prompt plus generated tokens"
    )


def _given_token_count(prompt: Any) -> int:
    """How many token ids ``prompt`` gives directly (text not counted), without looking at each id."""

    def count(ids: Any) -> int:
        if isinstance(ids, np.ndarray):
            return len(ids) if ids.ndim == 1 else 0
        return len(ids) if isinstance(ids, (list, tuple)) else 0

    if isinstance(prompt, (str, np.ndarray)) or not isinstance(prompt, (list, tuple)) or not prompt:
        return count(prompt) if isinstance(prompt, np.ndarray) else 0
    if isinstance(prompt[0], numbers.Integral):  # flat token ids
        return len(prompt)
    return sum(count(segment) for segment in prompt if not isinstance(segment, str))


def _text_segment(text: str) -> dict[str, Any]:
    # Plain text never yields special tokens; SpecialText opts in (transport/prompt.py).
    return {"text": str(text), "special": True} if isinstance(text, SpecialText) else {"text": text}


def _prompt_segments(prompt: Any, payloads: list[Any]) -> list[dict[str, Any]]:
    if isinstance(prompt, str):
        return [_text_segment(prompt)]
    if _is_token_ids(prompt):
        return [{"tokens": attach_payload(payloads, _token_array(prompt))}]
    if not isinstance(prompt, (list, tuple)):
        raise InvalidArgument(f"prompt must be text, token ids or a list of segments, got {type(prompt).__name__}")
    segments: list[dict[str, Any]] = []
    for i, segment in enumerate(prompt):
        if isinstance(segment, str):
            segments.append(_text_segment(segment))
        elif _is_token_ids(segment):
            segments.append({"tokens": attach_payload(payloads, _token_array(segment))})
        else:
            raise InvalidArgument(f"prompt segment {i} must be text or token ids, got {type(segment).__name__}")
    return segments


# ----------------------------------------------------------------------------------------------
# Spawning


class _Spawn:
    """What :func:`spawn_multiplexed_worker` returns: ``await`` it (with ``nursery=``) or use it as
    ``async with ... as client`` (the client's tasks then run in a nursery of its own)."""

    def __init__(self, nursery: trio.Nursery | None, kwargs: dict[str, Any]) -> None:
        self._nursery = nursery
        self._kwargs = kwargs
        self._context: Any = None

    def __await__(self) -> Generator[Any, None, MultiplexedWorkerClient]:
        if self._nursery is None:
            raise TypeError(
                "await spawn_multiplexed_worker(...) needs nursery=<a trio nursery>; "
                "or use `async with spawn_multiplexed_worker(...) as client:`"
            )
        return self._start(self._nursery).__await__()

    async def _start(self, nursery: trio.Nursery) -> MultiplexedWorkerClient:
        client = MultiplexedWorkerClient(**self._kwargs)
        await nursery.start(client._run)
        return client

    @asynccontextmanager
    async def _managed(self) -> AsyncIterator[MultiplexedWorkerClient]:
        # Exceptions from the start or the body are re-raised outside the nursery, so they reach
        # the caller as themselves rather than wrapped in an exception group.
        error: BaseException | None = None
        async with trio.open_nursery() as nursery:
            try:
                client = await self._start(nursery)
            except BaseException as exc:
                error = exc
            else:
                try:
                    yield client
                except BaseException as exc:
                    error = exc
                finally:
                    await client.close()
        if error is not None:
            raise error

    async def __aenter__(self) -> MultiplexedWorkerClient:
        self._context = self._managed()
        return await self._context.__aenter__()

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        return await self._context.__aexit__(*exc_info)


def spawn_multiplexed_worker(
    worker_command: Sequence[str],
    *,
    session_store: StoreBinding | None = None,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    startup_timeout: float = DEFAULT_STARTUP_TIMEOUT,
    stream_buffer: int = DEFAULT_STREAM_BUFFER,
    close_timeout: float = DEFAULT_CLOSE_TIMEOUT,
    liveness_timeout: float | None = DEFAULT_LIVENESS_TIMEOUT,
    nursery: trio.Nursery | None = None,
) -> _Spawn:
    """Start a worker and connect to it once it has said hello.

    ``async with spawn_multiplexed_worker(cmd) as client: ...`` closes it on exit; or
    ``client = await spawn_multiplexed_worker(cmd, nursery=nursery)`` then ``await client.close()``.
    Raises :class:`WorkerStartupError` (with the worker's own message, exit status and stderr tail)
    when the worker fails before its hello. ``stream_buffer``: token frames a stream may hold unread
    before it is cancelled as a slow consumer. ``liveness_timeout``: seconds of silence from a worker
    with requests pending after which it is declared dead (``WorkerDiedError("no heartbeat for N
    s")``, every pending call) and killed; None turns the rule off. The worker sends heartbeats
    while busy, from a thread of its own, so the timeout need not cover a long forward pass.
    Arguments are checked here and raise :class:`InvalidArgument`.
    """
    kwargs = dict(
        worker_command=worker_command,
        session_store=session_store,
        env=env,
        cwd=cwd,
        startup_timeout=startup_timeout,
        stream_buffer=stream_buffer,
        close_timeout=close_timeout,
        liveness_timeout=liveness_timeout,
    )
    # here rather than at the await
    _check_spawn_args(worker_command, stream_buffer, startup_timeout, close_timeout, liveness_timeout)
    return _Spawn(nursery, kwargs)


def _check_spawn_args(
    worker_command: Any, stream_buffer: Any, startup_timeout: Any, close_timeout: Any, liveness_timeout: Any
) -> None:
    """InvalidArgument (a ValueError too, for callers that catch that) naming the bad argument."""
    if (
        isinstance(worker_command, (str, bytes))
        or not isinstance(worker_command, Sequence)
        or not worker_command
        or not all(isinstance(a, (str, os.PathLike)) for a in worker_command)
    ):
        raise InvalidArgument(
            f"worker_command must be a non-empty list of str arguments, e.g. default_worker_command(); got {worker_command!r:.200}"
        )
    if isinstance(stream_buffer, bool) or not isinstance(stream_buffer, int) or stream_buffer < 1:
        raise InvalidArgument(f"stream_buffer must be a positive integer, got {stream_buffer!r:.200}")
    for name, value, optional in (
        ("startup_timeout", startup_timeout, False),
        ("close_timeout", close_timeout, False),
        ("liveness_timeout", liveness_timeout, True),
    ):
        if value is None and optional:
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < float(value) < math.inf:
            what = "a positive number of seconds" + (" or None" if optional else "")
            raise InvalidArgument(f"{name} must be {what}, got {value!r:.200}")
