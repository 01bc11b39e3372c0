"""The trio client of one worker process: spawn it, then multiplex sessions and streams over its pipes.

Tasks of one client, all inside the client's own cancel scope:

- the **reader** routes each frame from the reply pipe to the mailbox of its request. Token frames go
  to a bounded memory channel per stream; a stream whose channel is full is cancelled with
  ``slow_consumer`` so the reader never waits for one consumer. A request's final reply (done, ok,
  error, ...) is stored on the request itself, so it can never overflow.
- the **writer** sends queued requests in the order they were made (one outbox; the write lock
  also guards closing the control pipe). A request cancelled while still queued is never sent.
- the **stderr pump** logs each line the worker writes to stderr or stdout (logger
  ``"muxworker.worker"``) and keeps the last lines for :class:`WorkerDiedError`.
- the **watcher** notices the worker's exit, and the **loss handler** settles every pending request
  once the connection is gone: with :class:`ClientClosedError` after :meth:`close`, otherwise with
  :class:`WorkerDiedError` (its exit status and stderr tail); every later call raises the same.
- the **liveness watchdog** (unless ``liveness_timeout=None``): while any request is pending, a
  worker that sends nothing (no reply, no token, no heartbeat, no byte of a large frame) for
  ``liveness_timeout`` seconds is declared dead, ``WorkerDiedError("no heartbeat for N s")``, and
  killed with SIGKILL (a stopped process ignores SIGTERM). The worker writes a heartbeat from a
  thread of its own while it is busy (``--heartbeat_ms``, added to its command line by the spawn),
  so a long forward pass does not count as silence; the timeout only has to exceed the longest
  stall of the worker process as a whole.

The child process is always reaped (terminate, then kill after a grace period) in a shielded scope,
also when the caller is cancelled.

Checkpoint calls (export, restore, save, resume) are cancellable until their transfer starts:
while queued behind other checkpoint operations, while a resume reads its file, and until the
first byte of the request frame is written. From then on a cancel waits for the transfer to settle
(so a save never leaves half a result behind); a worker that stops answering ends it through the
liveness rule.
"""
from __future__ import annotations

import enum
import logging
import math
import numbers
import os
import select
import subprocess
import sys
from collections import deque
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, AsyncIterator, Generator, Mapping, Sequence

import numpy as np
import trio

from muxworker.transport.checkpoint import CPUCheckpoint, checkpoint_from_wire, checkpoint_to_wire
from muxworker.transport.errors import InvalidArgument, MuxError, ProtocolError, error_from_wire
from muxworker.transport.fdio import make_pipe, worker_fd_args
from muxworker.transport.framing import Frame, attach_payload, payload_array
from muxworker.transport.prompt import SpecialText
from muxworker.transport.schema import MAX_SESSION_ID_BYTES, check_hello, validate
from muxworker.transport.trio_stream import TrioFrameReader, TrioFrameWriter

from .errors import ClientClosedError, ContextOverflow, SlowConsumer, WorkerDiedError, WorkerStartupError
from .params import ChatPrompt, GenerationResult, WorkerInfo, params_to_wire

if TYPE_CHECKING:
    from .store import SessionStore

__all__ = [
    "MultiplexedWorkerClient",
    "GenerationStream",
    "spawn_multiplexed_worker",
    "default_worker_command",
    "DEFAULT_STARTUP_TIMEOUT",
    "DEFAULT_STREAM_BUFFER",
    "DEFAULT_LIVENESS_TIMEOUT",
]

WORKER_LOG = logging.getLogger("muxworker.worker")

DEFAULT_STARTUP_TIMEOUT = 300.0  # the first start converts the bundled GGUF
DEFAULT_STREAM_BUFFER = 1024  # token frames buffered per stream before it is cancelled as a slow consumer
DEFAULT_CLOSE_TIMEOUT = 10.0  # how long close() lets the worker settle its requests and exit
# Heartbeats come from a thread of their own, so a long forward pass does not delay them; this only
# has to cover a stall of the whole worker process (swapping, a GIL-holding call, an overloaded host).
DEFAULT_LIVENESS_TIMEOUT = 10.0
KILL_GRACE = 5.0  # between SIGTERM and SIGKILL
STDERR_TAIL_LINES = 50
_STDERR_MAX_LINE = 64 * 1024
# After the connection is lost: how long to let the worker exit, the reader drain what the worker
# wrote before it went, and its last stderr lines arrive, before everything pending is settled.
_LOSS_SETTLE_S = 0.5

_TOKEN_MAX = 2**31 - 1


def default_worker_command(model: str | os.PathLike[str] | None = None, **flags: Any) -> list[str]:
    """``[sys.executable, "-m", "muxworker.worker", "--model", model, "--flag", value, ...]``.

    Flag names are used as given (``max_sessions=32`` becomes ``--max_sessions 32``); None values are
    left out, True adds the bare flag. The protocol fd flags are added by the spawn.
    """
    command = [sys.executable, "-m", "muxworker.worker"]
    if model is not None:
        command += ["--model", os.fspath(model)]
    for name, value in flags.items():
        if value is None or value is False:
            continue
        command.append(f"--{name}")
        if value is not True:
            command.append(str(value))
    return command


# ----------------------------------------------------------------------------------------------
# Requests


class _State(enum.Enum):
    QUEUED = "queued"  # in the outbox, not written yet: a cancel now stays local
    SENT = "sent"  # written (or being written)


class _Request:
    """One request in flight: its outgoing frame, its token mailbox and how it ended."""

    __slots__ = (
        "rid", "kind", "expect", "frame", "state", "send", "recv", "settled", "value", "error", "cancel_sent", "launched",
    )

    def __init__(self, rid: int, kind: str, expect: frozenset[str], frame: Frame, buffer: int) -> None:
        self.rid = rid
        self.kind = kind
        self.expect = expect  # reply kinds that end it ("error" always does)
        self.frame: Frame | None = frame
        self.state = _State.QUEUED
        # Token frames only; the send side is closed when the request settles.
        self.send, self.recv = trio.open_memory_channel[Frame](buffer)
        self.settled = False
        self.value: Any = None  # the parsed final reply
        self.error: BaseException | None = None  # why it failed; None with no value: the client is unusable
        self.cancel_sent = False
        self.launched = trio.Event()  # set once it is SENT (its frame is being written) or settled


_ABANDONED = object()  # the value of a request whose caller stopped waiting
_CLOSE = object()  # outbox sentinel: close the control pipe after everything queued before it
_Outgoing = _Request | int | object  # a request, the id of a generate to cancel, or _CLOSE


def _fresh(exc: BaseException) -> BaseException:
    """A new exception like ``exc``: one object raised in many tasks would share a traceback."""
    if isinstance(exc, WorkerDiedError):
        return exc.copy()
    try:
        return type(exc)(*exc.args)
    except Exception:
        return exc


# ----------------------------------------------------------------------------------------------
# Streams


class GenerationStream:
    """The output of one generation: ``async for text in stream``, then ``await stream.wait()``.

    Iteration yields the text deltas as the worker produces them; :meth:`wait` reads the rest and
    returns the :class:`GenerationResult` (or raises the request's error). :meth:`cancel` asks the
    worker to stop (a request not yet sent is never sent); :meth:`aclose` cancels and waits until the
    request has settled.
    """

    def __init__(self, client: MultiplexedWorkerClient, request: _Request, session_id: str) -> None:
        self._client = client
        self._request = request
        self.session_id = session_id
        self._chunks: list[str] = []
        self._token_ids: list[int] = []
        self._result: GenerationResult | None = None
        self._error: BaseException | None = None

    @property
    def request_id(self) -> int:
        return self._request.rid

    @property
    def text(self) -> str:
        """The text received so far."""
        return "".join(self._chunks)

    @property
    def token_ids(self) -> list[int]:
        """The token ids received so far (a copy)."""
        return list(self._token_ids)

    @property
    def finished(self) -> bool:
        """Whether the request has ended (its result or error is known; unread text may remain)."""
        return self._request.settled

    @property
    def _ended(self) -> bool:
        # The consumer has reached the end: the outcome has been taken from the request.
        return self._result is not None or self._error is not None

    def __aiter__(self) -> GenerationStream:
        return self

    async def __anext__(self) -> str:
        while True:
            if self._ended:
                if self._error is not None:
                    raise _fresh(self._error)
                raise StopAsyncIteration
            frame = await self._client._next_token_frame(self._request)
            if frame is None:
                self._finish()
                continue
            control = frame.control
            self._token_ids.extend(control["token_ids"])
            text = control["text"]
            if text:
                self._chunks.append(text)
                return text

    def _finish(self) -> None:
        try:
            self._result = self._client._outcome(self._request)
        except BaseException as exc:
            self._error = exc
            raise

    async def wait(self) -> GenerationResult:
        """Read the rest of the output and return the result (raises the request's error)."""
        while not self._ended:
            frame = await self._client._next_token_frame(self._request)
            if frame is None:
                self._finish()
            else:
                self._token_ids.extend(frame.control["token_ids"])
                if frame.control["text"]:
                    self._chunks.append(frame.control["text"])
        if self._error is not None:
            raise _fresh(self._error)
        assert self._result is not None
        return self._result

    def cancel(self) -> None:
        """Ask for the generation to stop; it ends with finish_reason "cancelled". Idempotent."""
        self._client._cancel_request(self._request)

    async def aclose(self) -> None:
        """Cancel unless finished, and wait until the request has settled (errors are dropped)."""
        if not self._request.settled:
            self.cancel()
        try:
            await self.wait()
        except MuxError:
            pass

    async def __aenter__(self) -> GenerationStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


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
        session_store: SessionStore | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        startup_timeout: float = DEFAULT_STARTUP_TIMEOUT,
        stream_buffer: int = DEFAULT_STREAM_BUFFER,
        close_timeout: float = DEFAULT_CLOSE_TIMEOUT,
        liveness_timeout: float | None = DEFAULT_LIVENESS_TIMEOUT,
    ) -> None:
        _check_spawn_args(worker_command, stream_buffer, startup_timeout, close_timeout, liveness_timeout)
        self._command = [os.fspath(a) for a in worker_command]
        self._liveness_timeout = liveness_timeout
        self.session_store = session_store
        self._env = dict(env) if env is not None else None
        self._cwd = cwd
        self._startup_timeout = startup_timeout
        self._stream_buffer = stream_buffer
        self._close_timeout = close_timeout
        self.info: WorkerInfo | None = None  # set by the handshake, before the spawn returns

        self._scope = trio.CancelScope()  # every background task of this client
        self._process: trio.Process | None = None
        self._reader: TrioFrameReader | None = None
        self._writer: TrioFrameWriter | None = None
        self._write_lock = trio.Lock()
        self._outbox_send, self._outbox_recv = trio.open_memory_channel[_Outgoing](math.inf)
        self._last_id = 0  # request ids count up from 1 and are never reused
        self._pending: dict[int, _Request] = {}
        self._stderr_tail: deque[str] = deque(maxlen=STDERR_TAIL_LINES)
        self._stderr_done = trio.Event()
        self._reader_done = trio.Event()
        self._lost = trio.Event()  # the connection ended; _lost_reason says how
        self._lost_reason = ""
        self._worker_error: str | None = None  # an error frame with id 0: the worker's last word
        self._unusable: MuxError | None = None  # what pending and later calls raise
        self._settled = trio.Event()  # every request pending at the loss has been settled
        self._closing = False
        self._closed = trio.Event()
        # Serializes every checkpoint operation, high-level and advanced (FIFO: trio.Lock is fair).
        self._checkpoint_lock = trio.Lock()
        # Liveness: when _pending last became non-empty, and an event that wakes the idle watchdog.
        self._pending_since = 0.0
        self._work_arrived = trio.Event()
        self._hung = False  # declared dead for silence: reaped with SIGKILL at once

    # -- public state -----------------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    @property
    def returncode(self) -> int | None:
        """The worker's exit status once it has exited and been reaped, else None."""
        return self._process.returncode if self._process is not None else None

    @property
    def stderr_tail(self) -> list[str]:
        """The last lines the worker wrote to stderr (or stdout)."""
        return list(self._stderr_tail)

    @property
    def is_usable(self) -> bool:
        return self._unusable is None and not self._closing and not self._lost.is_set()

    # -- lifecycle --------------------------------------------------------------------------

    async def _run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Spawn the worker, handshake, then run the background tasks until closed or lost."""
        try:
            with self._scope:
                await self._spawn()
                startup_error: BaseException | None = None
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._pump_stderr)
                    try:
                        await self._handshake()
                    except WorkerStartupError as exc:
                        # Raised below, outside the nursery, so the caller sees it as is.
                        startup_error = exc
                        nursery.cancel_scope.cancel()
                    else:
                        nursery.start_soon(self._watch_process)
                        nursery.start_soon(self._read_loop)
                        nursery.start_soon(self._write_loop)
                        nursery.start_soon(self._handle_loss)
                        if self._liveness_timeout is not None:
                            nursery.start_soon(self._watch_liveness, self._liveness_timeout)
                        task_status.started()
                if startup_error is not None:
                    raise startup_error
        finally:
            with trio.CancelScope(shield=True):
                await self._reap()
                self._settle_all()
                for stream in (self._reader, self._writer):
                    if stream is not None:
                        await stream.aclose()
                self._closed.set()

    async def _spawn(self) -> None:
        control_read, control_write = make_pipe()
        reply_read, reply_write = make_pipe()
        child_ends = (control_read, reply_write)
        try:
            self._process = await trio.lowlevel.open_process(
                [*self._command, *worker_fd_args(control_read, reply_write), *self._heartbeat_args()],
                stdin=subprocess.DEVNULL,
                # stdout and stderr share one pipe: the worker points its fd 1 at stderr anyway, and a
                # print before that (a wrapper script, a site hook) is captured the same way.
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                pass_fds=child_ends,
                env=self._env,
                cwd=self._cwd,
            )
        except BaseException as exc:
            for fd in (control_write, reply_read):
                os.close(fd)
            if isinstance(exc, OSError):
                raise WorkerStartupError(f"cannot start {self._command[0]!r}: {exc}") from exc
            raise
        finally:
            # Only the child may hold its ends, so that its exit is seen as EOF here.
            for fd in child_ends:
                os.close(fd)
        self._reader = TrioFrameReader(trio.lowlevel.FdStream(reply_read))
        self._writer = TrioFrameWriter(trio.lowlevel.FdStream(control_write))

    def _heartbeat_args(self) -> list[str]:
        """Announce protocol 1.1 and ask for heartbeats: several per liveness_timeout, so that one
        late beat is not a death (0: none, with the watchdog off)."""
        if self._liveness_timeout is None:
            return ["--heartbeat_ms", "0"]
        interval_ms = min(1000, max(10, int(self._liveness_timeout * 1000 / 5)))
        return ["--heartbeat_ms", str(interval_ms)]

    async def _handshake(self) -> None:
        """Read the hello; on anything else stop the worker and raise :class:`WorkerStartupError`."""
        assert self._reader is not None
        reason: str | None = None
        with trio.move_on_after(self._startup_timeout) as timeout:
            try:
                frame = await self._reader.receive()
            except ProtocolError as exc:
                reason = f"its first frame is broken: {exc}"
            except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                reason = f"its reply pipe failed: {exc}"
            else:
                if frame is None:
                    reason = "it exited before sending its hello"
                elif frame.control.get("kind") == "error":
                    reason = str(frame.control.get("message", "no message"))
                else:
                    try:
                        check_hello(frame.control)
                        self.info = WorkerInfo.from_hello(frame.control)
                    except ProtocolError as exc:
                        reason = f"bad hello: {exc}"
        if timeout.cancelled_caught:
            reason = f"no hello within startup_timeout={self._startup_timeout}s"
        if reason is None:
            return
        with trio.CancelScope(shield=True):
            await self._reap(wait_first=_LOSS_SETTLE_S)
            with trio.move_on_after(_LOSS_SETTLE_S):
                await self._stderr_done.wait()
        raise WorkerStartupError(reason, self.returncode, self._stderr_tail)

    async def _reap(self, wait_first: float = 0.0) -> None:
        """Make sure the worker has exited and been waited for: terminate, then kill. Shield it."""
        process = self._process
        if process is None:
            return
        if wait_first and process.returncode is None and not self._hung:
            with trio.move_on_after(wait_first):
                await process.wait()
        if process.returncode is None and not self._hung:
            process.terminate()
            with trio.move_on_after(KILL_GRACE):
                await process.wait()
        if process.returncode is None:
            process.kill()
            await process.wait()

    async def close(self) -> None:
        """Close the control pipe (the worker settles its requests and exits), reap the worker, and
        end every background task. Idempotent; safe under cancellation; never autosaves."""
        if self._closing:
            await self._closed.wait()
            return
        self._closing = True
        with trio.CancelScope(shield=True):
            try:
                if not self._lost.is_set():
                    # After everything queued before it: those requests reach the worker and settle.
                    self._outbox_send.send_nowait(_CLOSE)
                    with trio.move_on_after(self._close_timeout):
                        await self._settled.wait()
                await self._reap()
                with trio.move_on_after(_LOSS_SETTLE_S * 4):
                    await self._settled.wait()
            finally:
                self._scope.cancel()
                await self._closed.wait()

    # -- background tasks -------------------------------------------------------------------

    async def _pump_stderr(self) -> None:
        assert self._process is not None and self._process.stdout is not None
        stream = self._process.stdout
        pending = bytearray()
        try:
            while chunk := await stream.receive_some(65536):
                pending += chunk
                *lines, rest = pending.split(b"\n")
                for line in lines:
                    self._stderr_line(line)
                pending = bytearray(rest)
                if len(pending) > _STDERR_MAX_LINE:
                    self._stderr_line(pending)
                    pending.clear()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            if pending:
                self._stderr_line(pending)
            self._stderr_done.set()

    def _stderr_line(self, raw: bytes | bytearray) -> None:
        line = bytes(raw).decode("utf-8", "replace").rstrip("\r")
        self._stderr_tail.append(line)
        WORKER_LOG.info("%s", line)

    async def _watch_process(self) -> None:
        assert self._process is not None
        await self._process.wait()
        self._connection_lost("the worker exited")

    async def _read_loop(self) -> None:
        assert self._reader is not None
        try:
            while (frame := await self._reader.receive()) is not None:
                validate(frame.control, sender="worker", payloads=frame.payloads)
                self._route(frame)
            self._connection_lost("the worker closed its reply pipe")
        except ProtocolError as exc:
            self._connection_lost(f"protocol error: {exc}")
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            self._connection_lost(f"reading from the worker failed: {exc}")
        finally:
            self._reader_done.set()

    async def _write_loop(self) -> None:
        assert self._writer is not None
        async for item in self._outbox_recv:
            if item is _CLOSE:
                async with self._write_lock:
                    await self._writer.aclose()
                return
            request: _Request | None = None
            if isinstance(item, _Request):
                if item.state is not _State.QUEUED or item.frame is None:
                    continue  # cancelled or abandoned before it was sent: it stays local
                request = item
                request.state = _State.SENT
                request.launched.set()
                frame, request.frame = request.frame, None
            else:
                frame = Frame({"kind": "cancel", "id": item})
            try:
                async with self._write_lock:
                    await self._writer.send(frame)
            except ProtocolError as exc:
                # Raised before any byte left: this frame breaks the frame limits; the pipe is fine.
                if request is not None:
                    self._settle(request, error=InvalidArgument(f"request cannot be sent: {exc}"))
            except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                self._connection_lost(f"writing to the worker failed: {exc}")
                return

    async def _watch_liveness(self, timeout: float) -> None:
        """Declare the worker dead after ``timeout`` seconds without a byte from it while requests are
        pending (see the module docstring)."""
        assert self._reader is not None
        reader = self._reader
        while not self._lost.is_set():
            if not self._pending:
                self._work_arrived = trio.Event()
                await self._work_arrived.wait()
                continue
            heard = reader.last_received_at
            quiet_since = self._pending_since if heard is None else max(heard, self._pending_since)
            deadline = quiet_since + timeout
            if trio.current_time() < deadline:
                await trio.sleep_until(deadline)
                continue
            if _readable(reader.stream.fileno()):
                # Bytes wait unread (this process was the slow one): let the reader take them.
                await trio.sleep(0.01)
                continue
            self._hung = True
            self._connection_lost(f"no heartbeat for {timeout:g} s")
            return

    def _connection_lost(self, reason: str) -> None:
        if not self._lost.is_set():
            self._lost_reason = reason
            self._lost.set()

    async def _handle_loss(self) -> None:
        """Once the connection is gone: let the worker exit and the last frames and stderr lines
        arrive (briefly), stop the worker if it still runs, then settle everything pending."""
        await self._lost.wait()
        with trio.CancelScope(shield=True):
            if self._hung:
                await self._reap()  # a stopped worker writes nothing more: no reason to wait first
            with trio.move_on_after(_LOSS_SETTLE_S):
                await self._reader_done.wait()
            # After close() the worker is settling and exiting on its own; give it the time it asked for.
            await self._reap(wait_first=self._close_timeout if self._closing else _LOSS_SETTLE_S)
            with trio.move_on_after(_LOSS_SETTLE_S):
                await self._stderr_done.wait()
        self._settle_all()

    def _settle_all(self) -> None:
        """Make the client unusable and settle every pending request with that error (idempotent)."""
        if self._unusable is None:
            returncode = self.returncode
            if not self._lost.is_set():
                # Stopped from this side without a loss: the client's nursery was cancelled.
                self._unusable = ClientClosedError("the client's tasks were cancelled, so it was closed")
            elif self._closing and returncode == 0 and self._worker_error is None:
                self._unusable = ClientClosedError("the client was closed")
            else:
                reason = self._lost_reason
                if self._worker_error:
                    reason += f"; its last error: {self._worker_error}"
                self._unusable = WorkerDiedError(reason, returncode, self._stderr_tail)
        for request in list(self._pending.values()):
            self._settle(request)
        self._settled.set()

    # -- routing ------------------------------------------------------------------------------

    def _route(self, frame: Frame) -> None:
        """Reader task: hand one validated frame to its request. Never blocks."""
        control = frame.control
        kind = control["kind"]
        rid = control.get("id", 0)
        if kind == "heartbeat":
            return  # it only shows liveness, which every byte received does (_watch_liveness)
        if kind == "hello":
            raise ProtocolError("the worker sent a second hello")
        if kind == "error" and rid == 0:
            self._worker_error = f"[{control['code']}] {control['message']}"
            return
        request = self._pending.get(rid)
        if request is None:
            # Finished, abandoned, or cancelled as a slow consumer: its late frames are dropped.
            if rid > self._last_id:
                raise ProtocolError(f"{kind} frame for request {rid}, which was never sent")
            return
        if kind == "token":
            if request.kind != "generate":
                raise ProtocolError(f"token frame for request {rid}, a {request.kind!r} request")
            try:
                request.send.send_nowait(frame)
            except trio.WouldBlock:
                self._slow_consumer(request)
            return
        if kind == "error":
            self._settle(request, error=error_from_wire(control["code"], control["message"]))
            return
        if kind not in request.expect:
            raise ProtocolError(f"{kind} frame for request {rid}, a {request.kind!r} request")
        self._settle(request, value=_parse_reply(frame))

    def _slow_consumer(self, request: _Request) -> None:
        """The stream's mailbox is full: drop what it holds, cancel it in the worker, tell its reader."""
        while True:
            try:
                request.recv.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel):
                break
        self._settle(
            request,
            error=SlowConsumer(
                f"request {request.rid}: its consumer fell {self._stream_buffer} token frames behind, "
                "so the generation was cancelled"
            ),
        )
        self._send_cancel(request)

    def _settle(self, request: _Request, *, value: Any = None, error: BaseException | None = None) -> None:
        if request.settled:
            return
        request.settled = True
        request.value = value
        request.error = error
        request.frame = None
        self._pending.pop(request.rid, None)
        request.launched.set()
        request.send.close()  # wakes its reader: buffered tokens first, then EndOfChannel

    # -- requests ------------------------------------------------------------------------------

    def _check_usable(self) -> None:
        if self._unusable is not None:
            raise _fresh(self._unusable)
        if self._closing:
            raise ClientClosedError("the client is closed")

    def _submit(
        self, kind: str, fields: dict[str, Any], payloads: list[Any] | None = None, *, expect: str, buffer: int = 1
    ) -> _Request:
        """Register a request and queue its frame, in call order. Does not block."""
        self._check_usable()
        self._last_id += 1
        rid = self._last_id
        frame = Frame({"kind": kind, "id": rid, **fields}, payloads or [])
        request = _Request(rid, kind, frozenset((expect,)), frame, buffer)
        if not self._pending:
            self._pending_since = trio.current_time()  # the liveness clock starts now, not at the last frame
            self._work_arrived.set()
        self._pending[rid] = request
        self._outbox_send.send_nowait(request)
        return request

    async def _next_token_frame(self, request: _Request) -> Frame | None:
        """The next token frame of ``request``, or None once it has settled."""
        try:
            return await request.recv.receive()
        except trio.EndOfChannel:
            return None

    def _outcome(self, request: _Request) -> Any:
        """The parsed final reply of a settled request, or raise why it has none."""
        assert request.settled
        if request.error is not None:
            raise _fresh(request.error)
        if request.value is None:
            assert self._unusable is not None
            raise _fresh(self._unusable)
        return request.value

    async def _call(self, kind: str, fields: dict[str, Any], payloads: list[Any] | None = None, *, expect: str) -> Any:
        """Send one request and wait for its reply; a caller cancelled before it was sent sends nothing."""
        await trio.lowlevel.checkpoint_if_cancelled()  # an already-cancelled caller queues nothing
        request = self._submit(kind, fields, payloads, expect=expect)
        try:
            while await self._next_token_frame(request) is not None:
                pass
            return self._outcome(request)
        finally:
            if not request.settled:
                # Cancelled while waiting. Unsent: it never leaves. Sent: its reply will be dropped.
                self._settle(request, value=_ABANDONED)

    async def _transfer(
        self, kind: str, fields: dict[str, Any], payloads: list[Any] | None = None, *, expect: str
    ) -> Any:
        """Like :meth:`_call`, for checkpoint transfers: cancellable until the request frame starts to
        be written (then it is never sent); from then on shielded until the reply, or the worker's
        death (the liveness rule), settles it, and a cancel takes effect at the next checkpoint."""
        await trio.lowlevel.checkpoint_if_cancelled()
        request = self._submit(kind, fields, payloads, expect=expect)
        try:
            await request.launched.wait()
        except trio.Cancelled:
            if request.state is not _State.SENT or request.settled:
                self._settle(request, value=_ABANDONED)  # still queued: it never leaves
                raise
            # The cancel met the start of the write: the transfer has begun, so it settles first.
        with trio.CancelScope(shield=True):
            while await self._next_token_frame(request) is not None:
                pass
        return self._outcome(request)

    def _cancel_request(self, request: _Request) -> None:
        if request.settled:
            return
        if request.state is _State.QUEUED:
            self._settle(request, value=GenerationResult.cancelled_locally())
        else:
            self._send_cancel(request)

    def _send_cancel(self, request: _Request) -> None:
        if request.cancel_sent or request.state is not _State.SENT or self._closing or self._lost.is_set():
            return
        request.cancel_sent = True
        self._outbox_send.send_nowait(request.rid)

    # -- calls --------------------------------------------------------------------------------

    async def open_session(self, session_id: str) -> None:
        """Open an empty session (raises SessionExists, CapacityExhausted)."""
        _check_session_id(session_id)
        await self._call("open", {"session_id": session_id}, expect="ok")

    async def close_session(self, session_id: str) -> None:
        """Close a session; its running generation, if any, ends "cancelled" first."""
        _check_session_id(session_id)
        await self._call("close", {"session_id": session_id}, expect="ok")

    async def reset_session(self, session_id: str) -> None:
        """Forget a session's history and keep it open; its running generation ends "cancelled" first."""
        _check_session_id(session_id)
        await self._call("reset", {"session_id": session_id}, expect="ok")

    def generate(self, prompt: str | Sequence[int] | Sequence[str | Sequence[int]], params: Any) -> GenerationStream:
        """Start a generation and return its stream at once (the request is sent in call order).

        ``prompt``: text, a list of token ids (sent as an int32 payload), or a list of segments
        (each text or token ids). ``params``: a :class:`GenerationParams` or any object with its
        attributes (``session_id`` required; missing ones take the worker's defaults). Raises
        InvalidArgument for a malformed prompt or params, and ContextOverflow for token ids that
        alone exceed the worker's max_session_tokens (before converting them: 16M of them would
        hold this trio thread for seconds).
        """
        session_id, fields = params_to_wire(params)
        _check_session_id(session_id)
        room = self.info.limits.get("max_session_tokens") if self.info is not None else None
        given = _given_token_count(prompt)
        if isinstance(room, int) and given >= room:
            raise ContextOverflow(
                f"the prompt has at least {given} tokens; a session holds at most {room} (max_session_tokens), "
                "prompt plus generated tokens"
            )
        payloads: list[Any] = []
        segments = _prompt_segments(prompt, payloads)
        request = self._submit(
            "generate",
            {"session_id": session_id, "prompt": segments, **fields},
            payloads,
            expect="done",
            buffer=self._stream_buffer,
        )
        return GenerationStream(self, request, session_id)

    async def tokenize(self, text: str, *, add_special_tokens: bool = False, parse_special: bool | None = None) -> list[int]:
        """Token ids of ``text``. Special-token markers in it are parsed only with ``parse_special``
        (default: when ``text`` is a :class:`SpecialText`), as in prompts."""
        if not isinstance(text, str):
            raise InvalidArgument(f"text must be a str, got {type(text).__name__}")
        add_special_tokens = _check_bool("add_special_tokens", add_special_tokens)
        if parse_special is not None:
            parse_special = _check_bool("parse_special", parse_special)
        if parse_special is None:
            parse_special = isinstance(text, SpecialText)
        fields = {"text": str(text) if isinstance(text, str) else text, "add_special_tokens": add_special_tokens}
        if parse_special:
            fields["parse_special"] = True
        ids, _ = await self._call("tokenize", fields, expect="tokens")
        return ids

    async def detokenize(self, token_ids: Sequence[int]) -> str:
        payloads: list[Any] = []
        ref = attach_payload(payloads, _token_array(token_ids))
        return await self._call("detokenize", {"tokens": ref}, payloads, expect="text")

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
        ids, text = await self._call(
            "chat_template",
            {"messages": [dict(m) for m in messages], "add_generation_prompt": add_generation_prompt},
            expect="tokens",
        )
        return ChatPrompt(text if text is not None else "", ids)

    async def query_info(self) -> dict[str, Any]:
        """The worker's current info: the hello fields plus open sessions, requests and step stats."""
        return await self._call("info", {}, expect="ok")

    # -- checkpoints ----------------------------------------------------------------------------

    async def export_checkpoint_to_cpu(
        self, session_id: str, position: int | None = None, identity: str | None = None
    ) -> CPUCheckpoint:
        """An independent host copy of an idle session's committed state (up to ``position``).

        Queued behind other checkpoint operations. Cancellable until the transfer starts (while
        queued, and until the request is written); after that a cancel waits for it to settle,
        which the liveness rule bounds.
        """
        _check_session_id(session_id)
        position = _check_position(position, optional=True)
        _check_identity_arg("identity", identity)
        async with self._checkpoint_lock:
            return await self._export(session_id, position, identity)

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
        position = _check_position(position, optional=True)
        _check_identity_arg("expected_identity", expected_identity)
        _check_identity(checkpoint, expected_identity)
        async with self._checkpoint_lock:
            await self._restore(checkpoint, session_id, position)

    async def save_session(self, session_id: str) -> None:
        """Export the idle session and atomically replace its file in the session store.

        Cancellable while queued behind other checkpoint operations and until the export request
        is written; after that it runs to its end (the file is written) and a cancel takes effect
        at the caller's next checkpoint. A worker that stops answering ends it with WorkerDiedError.
        """
        _check_session_id(session_id)
        store = self._require_store()
        async with self._checkpoint_lock:
            checkpoint = await self._export(session_id, None, store.identity)
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(store.save, session_id, checkpoint)

    async def resume_session(self, session_id: str) -> str:
        """Load the session's file from the store and restore it into a new live session of that id.

        Cancellable while queued, while the file is read and until the restore request is written.
        """
        _check_session_id(session_id)
        store = self._require_store()
        async with self._checkpoint_lock:
            # A cancel during the read takes effect when it returns, before anything is sent.
            checkpoint = await trio.to_thread.run_sync(store.load, session_id)
            await self._restore(checkpoint, session_id, None)
        return session_id

    def _require_store(self) -> SessionStore:
        if self.session_store is None:
            raise InvalidArgument("this client has no session_store; pass one to spawn_multiplexed_worker")
        if self.info is not None:  # what the worker says it runs must be what the store declares
            self.session_store.check_worker(self.info)
        return self.session_store

    async def _export(self, session_id: str, position: int | None, identity: str | None) -> CPUCheckpoint:
        frame = await self._transfer("export", {"session_id": session_id, "position": position}, expect="checkpoint")
        checkpoint = checkpoint_from_wire(frame.control["checkpoint"], frame.payloads)
        if identity is not None:
            checkpoint.identity = identity
            checkpoint.validate()
        return checkpoint

    async def _restore(self, checkpoint: CPUCheckpoint, session_id: str, position: int | None) -> None:
        if not isinstance(checkpoint, CPUCheckpoint):
            raise InvalidArgument(f"expected a CPUCheckpoint, got {type(checkpoint).__name__}")
        if position is None:
            position = checkpoint.position
        manifest, payloads = checkpoint_to_wire(checkpoint)
        await self._transfer(
            "restore",
            {"session_id": session_id, "position": position, "checkpoint": manifest},
            list(payloads),
            expect="ok",
        )


def _check_session_id(session_id: Any) -> None:
    if not isinstance(session_id, str) or not session_id:
        raise InvalidArgument(f"session id must be a non-empty str, got {session_id!r:.200}")
    if len(session_id) * 4 > MAX_SESSION_ID_BYTES and len(session_id.encode("utf-8", "surrogatepass")) > MAX_SESSION_ID_BYTES:
        raise InvalidArgument(f"session id must be at most {MAX_SESSION_ID_BYTES} UTF-8 bytes")


def _check_position(position: Any, *, optional: bool) -> int | None:
    if position is None and optional:
        return None
    if isinstance(position, bool) or not isinstance(position, numbers.Integral) or position < 0:
        raise InvalidArgument(f"position must be an int >= 0{' or None' if optional else ''}, got {position!r:.200}")
    return int(position)


def _check_identity_arg(name: str, value: Any) -> None:
    if value is not None and not isinstance(value, str):
        raise InvalidArgument(f"{name} must be a str or None, got {type(value).__name__}")


def _check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise InvalidArgument(f"{name} must be a bool, got {value!r:.200}")
    return bool(value)


def _check_identity(checkpoint: CPUCheckpoint, expected: str | None) -> None:
    if expected is not None and checkpoint.identity != expected:
        from .checkpoint import CheckpointIncompatible

        raise CheckpointIncompatible(
            f"checkpoint identity {checkpoint.identity!r} is not the expected {expected!r}: it was made "
            "for another model or configuration"
        )


# ----------------------------------------------------------------------------------------------
# Wire helpers


def _parse_reply(frame: Frame) -> Any:
    """The value a (schema-valid) final reply carries; ProtocolError if its contents are malformed."""
    control = frame.control
    kind = control["kind"]
    try:
        if kind == "ok":
            return control.get("value", {})
        if kind == "done":
            return _parse_result(frame)
        if kind == "tokens":
            return payload_array(frame, control["tokens"]).tolist(), control.get("text")
        if kind == "text":
            return control["text"]
        if kind == "checkpoint":
            return frame
    except (InvalidArgument, KeyError, TypeError, ValueError) as exc:
        raise ProtocolError(f"malformed {kind} reply: {exc}") from None
    raise ProtocolError(f"unexpected reply kind {kind!r}")


def _parse_result(frame: Frame) -> GenerationResult:
    r = frame.control["result"]
    return GenerationResult.from_wire(r, payload_array(frame, r["generated_token_ids"]).tolist())


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
    session_store: SessionStore | None = None,
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
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < value < math.inf:
            what = "a positive number of seconds" + (" or None" if optional else "")
            raise InvalidArgument(f"{name} must be {what}, got {value!r:.200}")


def _readable(fd: int) -> bool:
    """Whether bytes wait in ``fd`` (a poll that does not block)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(0))
