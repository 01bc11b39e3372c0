"""SessionRuntime: per-session leases and bounded admission over a MultiplexedWorkerClient.

Servers (an HTTP front, an agent host) get per-session ordering and bounded admission without
writing their own locks:

- **Admission.** At most ``capacity`` operations (generations, lifecycle and checkpoint calls) are
  admitted at once: ``min(worker's max_inflight_requests, max_concurrent_requests)``. One more fails
  at once with :class:`CapacityExhausted`; nothing waits in a hidden queue. An operation waiting for
  its session's lease counts as admitted.
- **Leases.** Each session has a lane: its admitted operations run one at a time, first come first
  served, in the order of the calls (``generate`` admits when called, the async calls when awaited).
  The operation at the head of a lane holds the lease until it settles; different sessions run
  concurrently. So a save waits for the generation before it, and a generation never meets
  ``session_busy``.
- **Cancellation.** An operation still waiting in its lane when its caller is cancelled (or its
  stream's :meth:`RuntimeStream.cancel` is called) leaves the lane and never runs; its capacity is
  free at once. A checkpoint call (save, resume, export, restore) that holds its lease but has not
  started its transfer (it waits in the client's checkpoint queue behind another session's, or its
  request is not written yet) is cancelled with its caller and never starts. Once it holds the
  lease, a cancelled lifecycle call, or a checkpoint call whose transfer has started, returns to its
  caller at once while the operation settles under the lease, so later operations on that session
  wait behind it; a cancelled generation is cancelled in the worker and holds the lease until the
  worker has ended it. Nothing undoes a completed save or restore. A worker that stops answering
  ends every stuck operation with WorkerDiedError (the client's liveness rule), which frees them.

Each operation holding a lease runs in a trio *system* task, so it outlives a cancelled caller (and
the caller's nursery); :meth:`SessionRuntime.aclose_worker` waits for all of them before it closes
the worker.

Ownership: everything here runs in the trio thread; lanes and counters are touched only between
checkpoints, so they need no locks.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import trio

from .checkpoint import CPUCheckpoint
from .client import DEFAULT_STREAM_BUFFER, GenerationStream, MultiplexedWorkerClient
from .errors import (
    CapacityExhausted,
    ClientClosedError,
    InvalidArgument,
    MuxError,
    OperationCancelled,
    SlowConsumer,
    WorkerDiedError,
)
from .params import GenerationResult, params_to_wire

__all__ = ["SessionRuntime", "RuntimeStream"]


class _State(enum.Enum):
    QUEUED = "queued"  # in its lane behind the lease holder
    RUNNING = "running"  # holds its session's lease (head of the lane); its system task runs it
    DONE = "done"  # settled: value or error set, lease and capacity released


class _Op:
    """One admitted operation: what it runs, where it stands, and how it ended."""

    __slots__ = (
        "session_id",
        "body",
        "state",
        "done",
        "value",
        "error",
        "on_settle",
        "cancel",
        "scope",
        "follows_caller",
    )

    def __init__(self, session_id: str, body: Callable[[], Awaitable[Any]], *, follows_caller: bool = False) -> None:
        self.session_id = session_id
        self.body = body
        # Checkpoint calls: a cancelled caller cancels the body too (the client's checkpoint calls
        # are cancellable until their transfer starts and shield themselves after that).
        self.follows_caller = follows_caller
        self.scope = trio.CancelScope()  # entered by the op's system task around the body
        self.state = _State.QUEUED
        self.done = trio.Event()
        self.value: Any = None
        self.error: BaseException | None = None
        self.on_settle: Callable[[], None] | None = None
        # Generations only: what aclose_worker calls to stop it when it is cancelled itself.
        self.cancel: Callable[[], None] | None = None


class RuntimeStream:
    """A generation admitted by a :class:`SessionRuntime`; used like a :class:`GenerationStream`.

    ``async for text in stream`` yields text deltas, then ``await stream.wait()`` returns the
    :class:`GenerationResult` (or raises the request's error). :meth:`cancel` stops this generation
    only: one still waiting for its session's lease never runs and ends with the result of
    :meth:`GenerationResult.cancelled_locally`; a running one ends with finish_reason "cancelled".
    A consumer that falls ``DEFAULT_STREAM_BUFFER`` deltas behind gets :class:`SlowConsumer`, as with
    the client's own streams.
    """

    def __init__(self, runtime: SessionRuntime, session_id: str, prompt: Any, params: Any, buffer: int) -> None:
        self.session_id = session_id
        self._runtime = runtime
        self._prompt = prompt
        self._params = params
        self._buffer = buffer
        # Written by the op's system task (the pump), read by the consumer; closed when the op settles.
        self._send, self._recv = trio.open_memory_channel[str](buffer)
        self._chunks: list[str] = []
        self._stream: GenerationStream | None = None
        self._cancel_requested = False
        self._overflow: SlowConsumer | None = None
        self._op: _Op  # set by SessionRuntime.generate right after admission

    @property
    def request_id(self) -> int | None:
        """The client's request id once the generation has been sent (ids grow in send order)."""
        return self._stream.request_id if self._stream is not None else None

    @property
    def text(self) -> str:
        """The text received so far."""
        return "".join(self._chunks)

    @property
    def finished(self) -> bool:
        """Whether the generation has settled (and released its session's lease)."""
        return self._op.state is _State.DONE

    def __aiter__(self) -> RuntimeStream:
        return self

    async def __anext__(self) -> str:
        try:
            delta = await self._recv.receive()
        except trio.EndOfChannel:
            await self._op.done.wait()  # already set: the channel closes as the op settles
            if self._op.error is not None:
                raise _fresh(self._op.error) from None
            raise StopAsyncIteration from None
        self._chunks.append(delta)
        return delta

    async def wait(self) -> GenerationResult:
        """Read the rest of the output and return the result (raises the request's error)."""
        async for _ in self:
            pass
        return self._op.value

    def cancel(self) -> None:
        """Cancel this generation only (see the class docstring). Idempotent."""
        self._cancel_requested = True
        if self._op.state is _State.QUEUED:
            self._runtime._abandon(self._op, value=GenerationResult.cancelled_locally())
        elif self._stream is not None:
            self._stream.cancel()
        # RUNNING with no stream yet: the pump sees _cancel_requested before it sends anything.

    async def aclose(self) -> None:
        """Cancel unless finished, and wait until it has settled (errors are dropped)."""
        if not self.finished:
            self.cancel()
        with trio.CancelScope(shield=True):
            await self._op.done.wait()

    async def __aenter__(self) -> RuntimeStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def _pump(self) -> GenerationResult:
        """The op's body, in its system task: send the generation, forward its deltas, return its result."""
        if self._cancel_requested:
            return GenerationResult.cancelled_locally()
        stream = self._runtime.client.generate(self._prompt, self._params)
        self._stream = stream
        # Drains the client's mailbox promptly, so only this stream's own buffer can overflow.
        async for delta in stream:
            if self._overflow is not None:
                continue
            try:
                self._send.send_nowait(delta)
            except trio.WouldBlock:
                self._overflow = SlowConsumer(
                    f"session {self.session_id!r}: the consumer fell {self._buffer} deltas behind, "
                    "so the generation was cancelled"
                )
                _drain(self._recv)
                stream.cancel()
        # Returns once the worker has ended the request, so the lease is held until then.
        result = await stream.wait()
        if self._overflow is not None:
            raise self._overflow
        return result


class SessionRuntime:
    """Per-session FIFO leases and bounded admission over ``client`` (see the module docstring).

    ``max_concurrent_requests`` lowers the capacity below the worker's ``max_inflight_requests``.
    """

    def __init__(self, client: MultiplexedWorkerClient, *, max_concurrent_requests: int | None = None) -> None:
        if max_concurrent_requests is not None and (
            isinstance(max_concurrent_requests, bool)
            or not isinstance(max_concurrent_requests, int)
            or max_concurrent_requests < 1
        ):
            raise InvalidArgument(
                f"max_concurrent_requests must be a positive integer or None, got {max_concurrent_requests!r}"
            )
        if not isinstance(client, MultiplexedWorkerClient):
            raise InvalidArgument(f"client must be a MultiplexedWorkerClient, got {type(client).__name__}")
        if client.info is None:
            raise InvalidArgument("the client has not connected to its worker yet (use spawn_multiplexed_worker)")
        self.client = client
        limits = [client.info.limits["max_inflight_requests"], max_concurrent_requests]
        self.capacity: int = min(n for n in limits if n is not None)
        # Session id -> its admitted, unsettled operations: the head holds the lease (RUNNING),
        # the rest are QUEUED in arrival order. A lane is removed when it empties.
        self._lanes: dict[str, deque[_Op]] = {}
        self._admitted = 0
        self._all_settled = trio.Event()  # set while nothing is admitted
        self._all_settled.set()
        self._closing = False

    # -- introspection (tests and metrics) --------------------------------------------------------

    @property
    def admitted(self) -> int:
        """Operations admitted and not yet settled (running or waiting for their lease)."""
        return self._admitted

    @property
    def leased_sessions(self) -> int:
        """Sessions with an operation admitted and not yet settled."""
        return len(self._lanes)

    # -- admission and leases ---------------------------------------------------------------------

    def _admit(self, session_id: str, body: Callable[[], Awaitable[Any]], *, follows_caller: bool = False) -> _Op:
        """Queue ``body`` in its session's lane, or raise at once. Does not block."""
        if self._closing:
            raise ClientClosedError("the session runtime is closing")
        if not isinstance(session_id, str) or not session_id:
            raise InvalidArgument(f"session id must be a non-empty string, got {session_id!r}")
        if self._admitted >= self.capacity:
            raise CapacityExhausted(f"{self._admitted} operations are admitted (capacity {self.capacity})")
        op = _Op(session_id, body, follows_caller=follows_caller)
        lane = self._lanes.setdefault(session_id, deque())
        lane.append(op)
        self._admitted += 1
        if self._all_settled.is_set():
            self._all_settled = trio.Event()
        if len(lane) == 1:
            self._start(op)
        return op

    def _start(self, op: _Op) -> None:
        """Give ``op`` its session's lease and run it in a system task, so it outlives its caller."""
        op.state = _State.RUNNING
        trio.lowlevel.spawn_system_task(self._run, op, name=f"muxworker-session-op:{op.session_id}")

    async def _run(self, op: _Op) -> None:
        try:
            with op.scope:
                op.value = await op.body()
            if op.scope.cancelled_caught:
                op.error = OperationCancelled(f"cancelled before its transfer started on session {op.session_id!r}")
        except trio.Cancelled:
            # Only when the trio run itself ends (the system nursery is cancelled): no caller is left.
            op.error = OperationCancelled("the trio run ended while the operation was running")
            raise
        except BaseException as exc:  # handed to the caller; it must never escape a system task
            op.error = exc
        finally:
            self._settle(op)

    def _abandon(self, op: _Op, *, value: Any = None) -> None:
        """Drop an operation still waiting for its lease: it never runs and frees its capacity."""
        if op.state is _State.QUEUED:
            op.value = value
            if value is None:
                op.error = OperationCancelled(f"cancelled while waiting for session {op.session_id!r}")
            self._settle(op)

    def _settle(self, op: _Op) -> None:
        """Record that ``op`` ended; if it held the lease, pass the lease to the next in its lane."""
        if op.state is _State.DONE:
            return
        held_lease = op.state is _State.RUNNING
        op.state = _State.DONE
        lane = self._lanes[op.session_id]
        if held_lease:
            lane.popleft()  # the lease holder is always the head
        else:
            lane.remove(op)
        if op.on_settle is not None:
            op.on_settle()
        op.done.set()
        self._admitted -= 1
        if not lane:
            del self._lanes[op.session_id]
        elif held_lease:
            self._start(lane[0])
        if self._admitted == 0:
            self._all_settled.set()

    async def _call(self, session_id: str, body: Callable[[], Awaitable[Any]], *, follows_caller: bool = False) -> Any:
        op = self._admit(session_id, body, follows_caller=follows_caller)
        try:
            await op.done.wait()
        except trio.Cancelled:
            self._abandon(op)  # no-op once it holds the lease: then it settles under the lease
            if op.follows_caller:
                op.scope.cancel()  # a checkpoint call not yet transferring never starts
            raise
        if op.error is not None:
            raise _fresh(op.error)
        return op.value

    # -- operations -------------------------------------------------------------------------------

    def generate(self, session_id: str, prompt: str | Sequence[int] | Sequence[Any], params: Any) -> RuntimeStream:
        """Admit a generation on ``session_id`` and return its stream (raises CapacityExhausted at once).

        ``params`` is a :class:`GenerationParams` or any object with its attributes; its
        ``session_id`` may be left out (or None), and must otherwise equal ``session_id``.
        """
        given = getattr(params, "session_id", None)
        if given is not None and not (isinstance(given, str) and given == session_id):
            raise InvalidArgument(f"params.session_id is {given!r} but the generation is for session {session_id!r}")
        params_to_wire(_SessionParams(params, session_id))  # bad params fail here, not in the stream
        stream = RuntimeStream(self, session_id, prompt, _SessionParams(params, session_id), DEFAULT_STREAM_BUFFER)
        op = self._admit(session_id, stream._pump)
        op.on_settle = stream._send.close  # ends iteration, whether or not the generation ran
        op.cancel = stream.cancel
        stream._op = op
        return stream

    async def open_session(self, session_id: str) -> None:
        return await self._call(session_id, lambda: self.client.open_session(session_id))

    async def close_session(self, session_id: str) -> None:
        return await self._call(session_id, lambda: self.client.close_session(session_id))

    async def reset_session(self, session_id: str) -> None:
        return await self._call(session_id, lambda: self.client.reset_session(session_id))

    async def save_session(self, session_id: str) -> None:
        """Save the session to the client's store after every earlier operation on it (a running
        generation included)."""
        return await self._call(session_id, lambda: self.client.save_session(session_id), follows_caller=True)

    async def resume_session(self, session_id: str) -> str:
        """Restore the session's saved file into a new live session of that id; returns the id."""
        return await self._call(session_id, lambda: self.client.resume_session(session_id), follows_caller=True)

    async def export_checkpoint_to_cpu(
        self, session_id: str, position: int | None = None, identity: str | None = None
    ) -> CPUCheckpoint:
        return await self._call(
            session_id,
            lambda: self.client.export_checkpoint_to_cpu(session_id, position, identity),
            follows_caller=True,
        )

    async def restore_checkpoint_from_cpu(
        self,
        checkpoint: CPUCheckpoint,
        session_id: str,
        position: int | None = None,
        expected_identity: str | None = None,
    ) -> None:
        return await self._call(
            session_id,
            lambda: self.client.restore_checkpoint_from_cpu(checkpoint, session_id, position, expected_identity),
            follows_caller=True,
        )

    async def aclose_worker(self) -> None:
        """Refuse new operations, let every admitted one settle, then close the worker.

        Idempotent. If the caller is cancelled while waiting, generations are cancelled (waiting
        ones never run), the worker is closed at once, and the remaining operations settle (those
        still waiting for a lease fail with ClientClosedError) before the Cancelled propagates.
        """
        self._closing = True
        try:
            await self._all_settled.wait()
        except trio.Cancelled:
            with trio.CancelScope(shield=True):
                for lane in list(self._lanes.values()):
                    for op in list(lane):
                        if op.cancel is not None:
                            op.cancel()
                await self.client.close()
                # Quick now: the client fails every call; a save already writing its file finishes.
                await self._all_settled.wait()
            raise
        with trio.CancelScope(shield=True):
            await self.client.close()


class _SessionParams:
    """``params`` as the client reads them, with ``session_id`` set to the runtime's argument."""

    __slots__ = ("session_id", "_params")

    def __init__(self, params: Any, session_id: str) -> None:
        self.session_id = session_id
        self._params = params

    def __getattr__(self, name: str) -> Any:
        return getattr(self._params, name)


def _drain(recv: trio.MemoryReceiveChannel[str]) -> None:
    while True:
        try:
            recv.receive_nowait()
        except (trio.WouldBlock, trio.EndOfChannel):
            return


def _fresh(exc: BaseException) -> BaseException:
    """A copy of a stored error for raising again (a stream can raise it from __anext__ and wait)."""
    if isinstance(exc, WorkerDiedError):
        return exc.copy()
    if isinstance(exc, MuxError):
        try:
            new = type(exc)(*exc.args)
        except Exception:
            return exc
        new.__dict__.update(vars(exc))
        return new
    return exc
