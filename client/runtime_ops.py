"""An operation a :class:`~.runtime.SessionRuntime` admitted, and a generation's stream.

Each admitted operation is an :class:`_Op` in its session's lane (runtime.py): QUEUED behind the
lease holder, RUNNING at the head of the lane in its own system task, DONE once settled. A
generation's :class:`RuntimeStream` is the caller's side of one: its op's body (``_pump``) forwards
the client stream's deltas into the caller's bounded channel. Owner: the trio thread, like the
runtime.
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import trio

from muxworker.transport.errors import MuxError, SlowConsumer, WorkerDiedError

from .params import GenerationResult, RuntimeGenerationResult, TokenLogprob
from .stream import GenerationStream

if TYPE_CHECKING:
    from .runtime import SessionRuntime

__all__ = ["RuntimeStream"]


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
        "internal",
    )

    def __init__(
        self,
        session_id: str,
        body: Callable[[], Awaitable[Any]],
        *,
        follows_caller: bool = False,
        internal: bool = False,
    ) -> None:
        self.session_id = session_id
        self.body = body
        # An eviction: run on behalf of an admitted operation, so not admitted (nor counted) itself.
        self.internal = internal
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
    :class:`RuntimeGenerationResult` (or raises the request's error). :meth:`cancel` stops this
    generation only: one still waiting for its session's lease never runs and ends with the result of
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
        # (text delta, the logprobs of the tokens that made it: empty unless asked for)
        self._send, self._recv = trio.open_memory_channel[tuple[str, list[TokenLogprob]]](buffer)
        self._chunks: list[str] = []
        self._logprobs: list[TokenLogprob] = []
        self._taken = 0  # the pump's count of the client stream's logprobs already sent
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
    def logprobs(self) -> list[TokenLogprob]:
        """The logprobs of the tokens behind the text received so far (a copy; empty unless the
        params asked for ``logprobs``). The result's ``logprobs`` has every token's."""
        return list(self._logprobs)

    def logprobs_from(self, start: int) -> list[TokenLogprob]:
        """The logprobs of the text received, from token ``start`` on."""
        return self._logprobs[start:]

    @property
    def finished(self) -> bool:
        """Whether the generation has settled (and released its session's lease)."""
        return self._op.state is _State.DONE

    def __aiter__(self) -> RuntimeStream:
        return self

    async def __anext__(self) -> str:
        try:
            delta, logprobs = await self._recv.receive()
        except trio.EndOfChannel:
            await self._op.done.wait()  # already set: the channel closes as the op settles
            if self._op.error is not None:
                raise _fresh(self._op.error) from None
            raise StopAsyncIteration from None
        self._chunks.append(delta)
        self._logprobs += logprobs
        return delta

    async def wait(self) -> RuntimeGenerationResult:
        """Read the rest of the output and return the result (raises the request's error)."""
        async for _ in self:
            pass
        return self._op.value

    async def settled(self) -> tuple[RuntimeGenerationResult | None, BaseException | None]:
        """Wait until the generation has settled, without reading its output: (its result, None),
        or (None, its error)."""
        await self._op.done.wait()
        if self._op.error is not None:
            return None, self._op.error
        return self._op.value, None

    def cancel(self) -> None:
        """Cancel this generation only (see the class docstring). Idempotent."""
        self._cancel_requested = True
        if self._op.state is _State.QUEUED:
            self._runtime._abandon(self._op, value=RuntimeGenerationResult.cancelled_locally())
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

    async def _pump(self) -> RuntimeGenerationResult:
        """The op's body, in its system task: resume an evicted session, send the generation,
        forward its deltas, return its result."""
        if self._cancel_requested:
            return RuntimeGenerationResult.of(GenerationResult.cancelled_locally())
        resumed = await self._runtime._bring_back(self.session_id)
        if self._cancel_requested:
            return RuntimeGenerationResult.of(GenerationResult.cancelled_locally(), resumed_from_store=resumed)
        stream = self._runtime.client.generate(self._prompt, self._params)
        self._stream = stream
        # Drains the client's mailbox promptly, so only this stream's own buffer can overflow.
        async for delta in stream:
            if self._overflow is not None:
                continue
            entries = stream.logprobs_from(self._taken)
            try:
                self._send.send_nowait((delta, entries))
                self._taken += len(entries)
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
        return RuntimeGenerationResult.of(result, resumed_from_store=resumed)


def _drain(recv: trio.MemoryReceiveChannel[Any]) -> None:
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
        new.__cause__ = exc.__cause__
        return new
    return exc
