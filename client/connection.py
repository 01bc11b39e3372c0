"""The client's connection to one worker: requests, routing, settlement, loss and liveness.

Runs over any pair of trio streams (the worker's pipes in production, ``trio.testing`` memory
streams and a fake worker in tests). Tasks of one connection, started by :meth:`Connection.run`:

- the **reader** routes each frame to the mailbox of its request. Token frames go to a bounded
  memory channel per stream; a stream whose channel is full is cancelled with ``slow_consumer`` so
  the reader never waits for one consumer. A request's final reply (done, ok, error, ...) is stored
  on the request itself, so it can never overflow.
- the **writer** sends queued requests in the order they were made (one outbox; the write lock
  also guards closing the send stream). A request cancelled while still queued is never sent.
- the **loss handler** settles every pending request once the connection is gone: with
  :class:`ClientClosedError` after :meth:`Connection.close`, otherwise with
  :class:`WorkerDiedError` (the peer's exit status and stderr tail); every later call raises the same.
- the **liveness watchdog** (unless ``liveness_timeout=None``): while any request is pending, a
  worker that sends nothing (no reply, no token, no heartbeat, no byte of a large frame) for
  ``liveness_timeout`` seconds is declared dead, ``WorkerDiedError("no heartbeat for N s")``, and
  the peer is told (:meth:`Peer.mark_hung`: the process is killed at once).

Owner: the pending table, the outbox and the connection state belong to this object and are only
touched from trio tasks of one run (no locks needed beyond the write lock).
"""

from __future__ import annotations

import enum
import math
import select
import socket
from collections.abc import Sequence
from typing import Any, Protocol

import trio

from muxworker.transport.errors import (
    ClientClosedError,
    InvalidArgument,
    MuxError,
    ProtocolError,
    SlowConsumer,
    WorkerDiedError,
    error_from_wire,
)
from muxworker.transport.fdpass import send_files
from muxworker.transport.framing import Frame, payload_array
from muxworker.transport.messages import CancelRequest, GenerationResult
from muxworker.transport.schema import validate
from muxworker.transport.trio_stream import TrioFrameReader, TrioFrameWriter

__all__ = ["Connection", "Peer", "NoPeer", "ABANDONED", "LOSS_SETTLE_S"]

# After the connection is lost: how long to let the worker exit, the reader drain what the worker
# wrote before it went, and its last stderr lines arrive, before everything pending is settled.
LOSS_SETTLE_S = 0.5


class Peer(Protocol):
    """What the connection needs of the process at the other end (``process.WorkerProcess``)."""

    @property
    def returncode(self) -> int | None: ...

    @property
    def stderr_tail(self) -> list[str]: ...

    stderr_done: trio.Event

    async def reap(self, wait_first: float = 0.0) -> None: ...

    def mark_hung(self) -> None: ...


class NoPeer:
    """The peer of a connection with no process behind it (tests, an in-process worker): once
    reaped it reads as a process that exited with status 0, so a closed connection ends clean."""

    def __init__(self) -> None:
        self.returncode: int | None = None
        self.stderr_done = trio.Event()
        self.stderr_done.set()
        self.hung = False

    @property
    def stderr_tail(self) -> list[str]:
        return []

    async def reap(self, wait_first: float = 0.0) -> None:
        await trio.lowlevel.checkpoint()
        self.returncode = 0

    def mark_hung(self) -> None:
        self.hung = True


# ----------------------------------------------------------------------------------------------
# Requests


class State(enum.Enum):
    QUEUED = "queued"  # in the outbox, not written yet: a cancel now stays local
    SENT = "sent"  # written (or being written)


class Request:
    """One request in flight: its outgoing frame, its token mailbox and how it ended."""

    __slots__ = (
        "rid",
        "kind",
        "expect",
        "frame",
        "state",
        "send",
        "recv",
        "settled",
        "value",
        "error",
        "cancel_sent",
        "launched",
        "fds",
    )

    def __init__(self, rid: int, kind: str, expect: frozenset[str], frame: Frame, buffer: int) -> None:
        self.rid = rid
        self.kind = kind
        self.expect = expect  # reply kinds that end it ("error" always does)
        self.frame: Frame | None = frame
        self.state = State.QUEUED
        # Token frames only; the send side is closed when the request settles.
        self.send, self.recv = trio.open_memory_channel[Frame](buffer)
        self.settled = False
        self.value: Any = None  # the parsed final reply
        self.error: BaseException | None = None  # why it failed; None with no value: the client is unusable
        self.cancel_sent = False
        self.launched = trio.Event()  # set once it is SENT (its frame is being written) or settled
        self.fds: list[int] = []  # open files passed with the frame (transport/fdpass.py); the caller owns them


ABANDONED = object()  # the value of a request whose caller stopped waiting
_CLOSE = object()  # outbox sentinel: close the send stream after everything queued before it
_Outgoing = Request | int | object  # a request, the id of a generate to cancel, or _CLOSE


def fresh(exc: BaseException) -> BaseException:
    """A new exception like ``exc``: one object raised in many tasks would share a traceback."""
    if isinstance(exc, WorkerDiedError):
        return exc.copy()
    try:
        return type(exc)(*exc.args)
    except Exception:
        return exc


# ----------------------------------------------------------------------------------------------
# The connection


class Connection:
    """Requests multiplexed over one stream pair to a worker (see the module docstring).

    ``receive_stream`` carries the worker's frames, ``send_stream`` the client's; the connection
    owns both and closes them when :meth:`run` ends. ``peer``: the process behind them, reaped when
    the connection is lost (default :class:`NoPeer`).
    """

    def __init__(
        self,
        receive_stream: trio.abc.ReceiveStream,
        send_stream: trio.abc.SendStream,
        *,
        peer: Peer | None = None,
        stream_buffer: int,
        close_timeout: float,
        liveness_timeout: float | None,
    ) -> None:
        self.reader = TrioFrameReader(receive_stream)
        self.writer = TrioFrameWriter(send_stream)
        self.peer: Peer = peer if peer is not None else NoPeer()
        self.stream_buffer = stream_buffer
        self._close_timeout = close_timeout
        self._liveness_timeout = liveness_timeout
        self._write_lock = trio.Lock()
        self._outbox_send, self._outbox_recv = trio.open_memory_channel[_Outgoing](math.inf)
        self._last_id = 0  # request ids count up from 1 and are never reused
        self._pending: dict[int, Request] = {}
        self._reader_done = trio.Event()
        self._lost = trio.Event()  # the connection ended; _lost_reason says how
        self._lost_reason = ""
        self._worker_error: str | None = None  # an error frame with id 0: the worker's last word
        self._unusable: MuxError | None = None  # what pending and later calls raise
        self.settled = trio.Event()  # every request pending at the loss has been settled
        self.closing = False
        # Liveness: when _pending last became non-empty, and an event that wakes the idle watchdog.
        self._pending_since = 0.0
        self._work_arrived = trio.Event()
        self._hung = False  # declared dead for silence
        # The client's end of the worker's file channel, when its hello says it takes files.
        self.files: socket.socket | None = None

    @property
    def is_usable(self) -> bool:
        return self._unusable is None and not self.closing and not self._lost.is_set()

    @property
    def lost(self) -> bool:
        return self._lost.is_set()

    # -- lifecycle --------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the reader, writer, loss handler and watchdog until they end or are cancelled; then
        reap the peer, settle every pending request and close both streams (shielded)."""
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._read_loop)
                nursery.start_soon(self._write_loop)
                nursery.start_soon(self._handle_loss)
                if self._liveness_timeout is not None:
                    nursery.start_soon(self._watch_liveness, self._liveness_timeout)
                task_status.started()
        finally:
            with trio.CancelScope(shield=True):
                await self.peer.reap()
                await self.aclose()

    async def aclose(self) -> None:
        """Settle everything pending and close both streams (idempotent; no waiting on the peer)."""
        self.settle_all()
        for stream in (self.reader, self.writer):
            await stream.aclose()

    async def close(self) -> None:
        """Close the send stream after everything queued before (the worker then settles its
        requests and exits) and wait, at most ``close_timeout``, until every request has settled."""
        self.closing = True
        if not self._lost.is_set():
            self._outbox_send.send_nowait(_CLOSE)
            with trio.move_on_after(self._close_timeout):
                await self.settled.wait()

    def connection_lost(self, reason: str) -> None:
        """The worker is gone (its process exited, a stream broke): settle everything, once."""
        if not self._lost.is_set():
            self._lost_reason = reason
            self._lost.set()

    # -- background tasks -------------------------------------------------------------------

    async def _read_loop(self) -> None:
        try:
            while (frame := await self.reader.receive()) is not None:
                validate(frame.control, sender="worker", payloads=frame.payloads)
                self._route(frame)
            self.connection_lost("the worker closed its reply pipe")
        except ProtocolError as exc:
            self.connection_lost(f"protocol error: {exc}")
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            self.connection_lost(f"reading from the worker failed: {exc}")
        finally:
            self._reader_done.set()

    async def _write_loop(self) -> None:
        async for item in self._outbox_recv:
            if item is _CLOSE:
                async with self._write_lock:
                    await self.writer.aclose()
                return
            request: Request | None = None
            if isinstance(item, Request):
                if item.state is not State.QUEUED or item.frame is None:
                    continue  # cancelled or abandoned before it was sent: it stays local
                request = item
                request.state = State.SENT
                request.launched.set()
                frame, request.frame = item.frame, None
            else:
                frame = Frame({"kind": CancelRequest.KIND, "id": item, **CancelRequest().fields()})
            if request is not None and request.fds:
                # The files go first, so the worker finds them queued when it reads the frame.
                try:
                    if self.files is None:
                        raise OSError("this worker takes no files")
                    send_files(self.files, request.rid, request.fds)
                except OSError as exc:
                    self._settle(request, error=InvalidArgument(f"cannot pass the checkpoint files: {exc}"))
                    continue
            try:
                async with self._write_lock:
                    await self.writer.send(frame)
            except ProtocolError as exc:
                # Raised before any byte left: this frame breaks the frame limits; the pipe is fine.
                if request is not None:
                    self._settle(request, error=InvalidArgument(f"request cannot be sent: {exc}"))
            except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                self.connection_lost(f"writing to the worker failed: {exc}")
                return

    async def _watch_liveness(self, timeout: float) -> None:
        """Declare the worker dead after ``timeout`` seconds without a byte from it while requests are
        pending (see the module docstring)."""
        reader = self.reader
        fileno = getattr(reader.stream, "fileno", None)
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
            if fileno is not None and _readable(fileno()):
                # Bytes wait unread (this process was the slow one): let the reader take them.
                await trio.sleep(0.01)
                continue
            self._hung = True
            self.peer.mark_hung()
            self.connection_lost(f"no heartbeat for {timeout:g} s")
            return

    async def _handle_loss(self) -> None:
        """Once the connection is gone: let the worker exit and the last frames and stderr lines
        arrive (briefly), stop the worker if it still runs, then settle everything pending."""
        await self._lost.wait()
        with trio.CancelScope(shield=True):
            if self._hung:
                await self.peer.reap()  # a stopped worker writes nothing more: no reason to wait first
            with trio.move_on_after(LOSS_SETTLE_S):
                await self._reader_done.wait()
            # After close() the worker is settling and exiting on its own; give it the time it asked for.
            await self.peer.reap(wait_first=self._close_timeout if self.closing else LOSS_SETTLE_S)
            with trio.move_on_after(LOSS_SETTLE_S):
                await self.peer.stderr_done.wait()
        self.settle_all()

    def settle_all(self) -> None:
        """Make the connection unusable and settle every pending request with that error (idempotent)."""
        if self._unusable is None:
            returncode = self.peer.returncode
            if not self._lost.is_set():
                # Stopped from this side without a loss: the client's nursery was cancelled.
                self._unusable = ClientClosedError("the client's tasks were cancelled, so it was closed")
            elif self.closing and returncode == 0 and self._worker_error is None:
                self._unusable = ClientClosedError("the client was closed")
            else:
                reason = self._lost_reason
                if self._worker_error:
                    reason += f"; its last error: {self._worker_error}"
                self._unusable = WorkerDiedError(reason, returncode, self.peer.stderr_tail)
        for request in list(self._pending.values()):
            self._settle(request)
        self.settled.set()

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
            self._settle(request, error=error_from_wire(control["code"], control["message"], control.get("reason")))
            return
        if kind not in request.expect:
            raise ProtocolError(f"{kind} frame for request {rid}, a {request.kind!r} request")
        self._settle(request, value=_parse_reply(frame))

    def _slow_consumer(self, request: Request) -> None:
        """The stream's mailbox is full: drop what it holds, cancel it in the worker, tell its reader."""
        while True:
            try:
                request.recv.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel):
                break
        self._settle(
            request,
            error=SlowConsumer(
                f"request {request.rid}: its consumer fell {self.stream_buffer} token frames behind, "
                "so the generation was cancelled"
            ),
        )
        self._send_cancel(request)

    def _settle(self, request: Request, *, value: Any = None, error: BaseException | None = None) -> None:
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

    def check_usable(self) -> None:
        if self._unusable is not None:
            raise fresh(self._unusable)
        if self.closing:
            raise ClientClosedError("the client is closed")

    def submit(
        self,
        kind: str,
        fields: dict[str, Any],
        payloads: Sequence[Any] | None = None,
        *,
        expect: str,
        buffer: int = 1,
        fds: Sequence[int] = (),
    ) -> Request:
        """Register a request and queue its frame, in call order. Does not block."""
        self.check_usable()
        self._last_id += 1
        rid = self._last_id
        frame = Frame({"kind": kind, "id": rid, **fields}, list(payloads or []))
        request = Request(rid, kind, frozenset((expect,)), frame, buffer)
        request.fds = list(fds)
        if not self._pending:
            self._pending_since = trio.current_time()  # the liveness clock starts now, not at the last frame
            self._work_arrived.set()
        self._pending[rid] = request
        self._outbox_send.send_nowait(request)
        return request

    async def next_token_frame(self, request: Request) -> Frame | None:
        """The next token frame of ``request``, or None once it has settled."""
        try:
            return await request.recv.receive()
        except trio.EndOfChannel:
            return None

    def outcome(self, request: Request) -> Any:
        """The parsed final reply of a settled request, or raise why it has none."""
        assert request.settled
        if request.error is not None:
            raise fresh(request.error)
        if request.value is None:
            assert self._unusable is not None
            raise fresh(self._unusable)
        return request.value

    async def call(
        self, kind: str, fields: dict[str, Any], payloads: Sequence[Any] | None = None, *, expect: str
    ) -> Any:
        """Send one request and wait for its reply; a caller cancelled before it was sent sends nothing."""
        await trio.lowlevel.checkpoint_if_cancelled()  # an already-cancelled caller queues nothing
        request = self.submit(kind, fields, payloads, expect=expect)
        try:
            while await self.next_token_frame(request) is not None:
                pass
            return self.outcome(request)
        finally:
            if not request.settled:
                # Cancelled while waiting. Unsent: it never leaves. Sent: its reply will be dropped.
                self._settle(request, value=ABANDONED)

    async def transfer(
        self,
        kind: str,
        fields: dict[str, Any],
        payloads: Sequence[Any] | None = None,
        *,
        expect: str,
        fds: Sequence[int] = (),
    ) -> Any:
        """Like :meth:`call`, for checkpoint transfers: cancellable until the request frame starts to
        be written (then it is never sent); from then on shielded until the reply, or the worker's
        death (the liveness rule), settles it, and a cancel takes effect at the next checkpoint.
        ``fds``: open files passed with the frame (they stay open; close them after this returns)."""
        await trio.lowlevel.checkpoint_if_cancelled()
        request = self.submit(kind, fields, payloads, expect=expect, fds=fds)
        try:
            await request.launched.wait()
        except trio.Cancelled:
            if request.state is not State.SENT or request.settled:
                self._settle(request, value=ABANDONED)  # still queued: it never leaves
                raise
            # The cancel met the start of the write: the transfer has begun, so it settles first.
        with trio.CancelScope(shield=True):
            while await self.next_token_frame(request) is not None:
                pass
        return self.outcome(request)

    def cancel_request(self, request: Request) -> None:
        """Cancel a generate: unsent, it settles "cancelled" here; sent, the worker is asked to stop."""
        if request.settled:
            return
        if request.state is State.QUEUED:
            self._settle(request, value=GenerationResult.cancelled_locally())
        else:
            self._send_cancel(request)

    def _send_cancel(self, request: Request) -> None:
        if request.cancel_sent or request.state is not State.SENT or self.closing or self._lost.is_set():
            return
        request.cancel_sent = True
        self._outbox_send.send_nowait(request.rid)


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
            r = control["result"]
            return GenerationResult.from_wire(r, payload_array(frame, r["generated_token_ids"]).tolist())
        if kind == "tokens":
            return payload_array(frame, control["tokens"]).tolist(), control.get("text")
        if kind == "text":
            return control["text"]
        if kind == "checkpoint":
            return frame
    except (InvalidArgument, KeyError, TypeError, ValueError) as exc:
        raise ProtocolError(f"malformed {kind} reply: {exc}") from None
    raise ProtocolError(f"unexpected reply kind {kind!r}")


def _readable(fd: int) -> bool:
    """Whether bytes wait in ``fd`` (a poll that does not block)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(0))
