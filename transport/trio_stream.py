"""The trio end of the wire (used by the client), over any trio stream.

With a ``trio.lowlevel.FdStream`` (the client's pipes) the reader and writer use the fd directly:
``os.readv`` into the frame's preallocated buffers and ``os.writev`` of header, control and
payloads, waiting with ``trio.lowlevel.wait_readable/wait_writable``, exactly like FdStream does
internally. Any other ``ReceiveStream``/``SendStream`` works too, at the cost of one copy per
received chunk (trio streams return bytes).
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from typing import Any

import trio

from .fdio import _IOV_MAX, _skip_written
from .framing import DEFAULT_LIMITS, Frame, FrameDecoder, FrameLimits, KiB, MiB, encode_frame

__all__ = ["TrioFrameReader", "TrioFrameWriter"]

_RECEIVE_CHUNK = 1 * MiB  # bound on one receive_some() from a generic stream
_COALESCE_BYTES = 64 * KiB  # generic streams: buffers smaller than this are joined into one send_all


def _fd_of(stream: object) -> int | None:
    return stream.fileno() if isinstance(stream, trio.lowlevel.FdStream) else None


def _os_error(exc: OSError) -> trio.ClosedResourceError | trio.BrokenResourceError:
    if exc.errno == errno.EBADF:
        return trio.ClosedResourceError("the stream was already closed")
    return trio.BrokenResourceError(f"the stream broke: {exc}")


class TrioFrameReader:
    """Receives frames from a trio ``ReceiveStream``.

    ``await receive()`` returns the next :class:`Frame`, or None once the stream ends cleanly at a
    frame boundary; ``async for frame in reader`` stops there. A broken rule raises
    :class:`ProtocolError`, and so does every later call. Cancellation is safe: bytes already read
    stay in the reader and the next ``receive()`` continues the same frame. One task receives at a
    time (a second gets ``trio.BusyResourceError``).
    """

    def __init__(
        self,
        stream: trio.abc.ReceiveStream,
        limits: FrameLimits = DEFAULT_LIMITS,
        *,
        allocate: Callable[[int], Any] | None = None,
    ):
        self.stream = stream
        self._decoder = FrameDecoder(limits, allocate=allocate)
        self._direct = _fd_of(stream) is not None
        self._eof = False
        self._busy = False
        # trio.current_time() of the last read that brought bytes (None before the first): a
        # large frame arrives over many reads, and each one shows that the peer is alive.
        self.last_received_at: float | None = None

    async def receive(self) -> Frame | None:
        if self._busy:
            raise trio.BusyResourceError("another task is already receiving frames from this stream")
        self._busy = True
        try:
            if self._direct:
                return await self._receive_fd()
            return await self._receive_stream()
        finally:
            self._busy = False

    async def _receive_fd(self) -> Frame | None:
        await trio.lowlevel.checkpoint_if_cancelled()
        decoder = self._decoder
        waited = False
        while (frame := decoder.next_frame()) is None and not self._eof:
            fd = self.stream.fileno()  # type: ignore[attr-defined]
            if fd < 0:
                raise trio.ClosedResourceError("the stream was already closed")
            targets = decoder.read_targets(_IOV_MAX)
            try:
                n = os.readv(fd, targets)
            except BlockingIOError:
                waited = True
                await trio.lowlevel.wait_readable(fd)
                continue
            except OSError as exc:
                raise _os_error(exc) from exc
            if n == 0:
                decoder.eof()
                self._eof = True
            else:
                decoder.commit(n)
                self.last_received_at = trio.current_time()
        if not waited:
            await trio.lowlevel.cancel_shielded_checkpoint()
        return frame

    async def _receive_stream(self) -> Frame | None:
        decoder = self._decoder
        received = False
        while (frame := decoder.next_frame()) is None and not self._eof:
            data = await self.stream.receive_some(min(decoder.space(), _RECEIVE_CHUNK))
            received = True
            if data:
                decoder.feed(data)
                self.last_received_at = trio.current_time()
            else:
                decoder.eof()
                self._eof = True
        if not received:
            await trio.lowlevel.checkpoint()
        return frame

    def __aiter__(self) -> TrioFrameReader:
        return self

    async def __anext__(self) -> Frame:
        frame = await self.receive()
        if frame is None:
            raise StopAsyncIteration
        return frame

    async def aclose(self) -> None:
        await self.stream.aclose()


class TrioFrameWriter:
    """Sends frames on a trio ``SendStream``.

    A frame that breaks the limits raises :class:`ProtocolError` before any byte is sent. A send
    cancelled or failed after its first byte left leaves the stream mid-frame, so every later send
    raises ``trio.BrokenResourceError`` (cancelled before that, the writer stays usable). One task
    sends at a time; the client serializes its sends with a lock.
    """

    def __init__(self, stream: trio.abc.SendStream, limits: FrameLimits = DEFAULT_LIMITS):
        self.stream = stream
        self._limits = limits
        self._direct = _fd_of(stream) is not None
        self._broken: BaseException | None = None
        self._busy = False
        self._started = False  # the current frame's first byte has (maybe) been sent

    async def send(self, frame: Frame) -> None:
        if self._busy:
            raise trio.BusyResourceError("another task is already sending a frame on this stream")
        if self._broken is not None:
            raise trio.BrokenResourceError(f"frame writer is unusable after an interrupted send: {self._broken!r}")
        buffers = encode_frame(frame, self._limits)
        self._busy = True
        self._started = False
        try:
            if self._direct:
                await self._send_fd(buffers)
            else:
                await self._send_stream(buffers)
        except BaseException as exc:
            if self._started:
                self._broken = exc
            raise
        finally:
            self._busy = False

    async def _send_fd(self, buffers: list[Any]) -> None:
        await trio.lowlevel.checkpoint_if_cancelled()
        pending = [memoryview(b) for b in buffers if len(b)]
        waited = False
        i = 0
        while i < len(pending):
            fd = self.stream.fileno()  # type: ignore[attr-defined]
            if fd < 0:
                raise trio.ClosedResourceError("the stream was already closed")
            try:
                n = os.writev(fd, pending[i : i + _IOV_MAX])
            except BlockingIOError:
                waited = True
                await trio.lowlevel.wait_writable(fd)
                continue
            except OSError as exc:
                raise _os_error(exc) from exc
            if n:
                self._started = True
            i = _skip_written(pending, i, n)
        if not waited:
            await trio.lowlevel.cancel_shielded_checkpoint()

    async def _send_stream(self, buffers: list[Any]) -> None:
        await trio.lowlevel.checkpoint_if_cancelled()
        chunks: list[Any] = []
        small: list[Any] = []
        for buf in buffers:
            if len(buf) < _COALESCE_BYTES:
                small.append(buf)
                continue
            if small:
                chunks.append(b"".join(small))
                small = []
            chunks.append(buf)
        if small:
            chunks.append(b"".join(small))
        for chunk in chunks:
            self._started = True
            await self.stream.send_all(chunk)

    async def aclose(self) -> None:
        await self.stream.aclose()
