"""The trio end: against the blocking end in another process, and its cancellation rules.

Every test runs both the direct fd path (``trio.lowlevel.FdStream``: readv/writev into the
frame's buffers) and the generic path (any trio stream: receive_some/send_all).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import trio
import trio.testing
from helpers.wire import assert_same_frame, echo_child, frames
from hypothesis import given, settings

from muxworker.transport import (
    Frame,
    FrameLimits,
    ProtocolError,
    TrioFrameReader,
    TrioFrameWriter,
    encode_frame,
    make_pipe,
)

MiB = 1 << 20


class GenericStream(trio.abc.Stream):
    """An FdStream behind a plain trio Stream, so the readers take the generic path."""

    def __init__(self, inner: trio.lowlevel.FdStream):
        self.inner = inner

    async def send_all(self, data) -> None:
        await self.inner.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.inner.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes=None) -> bytes:
        return await self.inner.receive_some(max_bytes)

    async def aclose(self) -> None:
        await self.inner.aclose()


PATHS = ["direct", "generic"]


def wrap(fd: int, path: str) -> trio.abc.Stream:
    stream = trio.lowlevel.FdStream(fd)
    return stream if path == "direct" else GenericStream(stream)


def wire(frame: Frame) -> bytes:
    return b"".join(memoryview(b).tobytes() for b in encode_frame(frame))


@pytest.fixture(scope="module")
def echo_fds():
    with echo_child() as child:
        yield child.control_fd, child.reply_fd
        assert child.finish()[0] == 0


async def echo_round_trip(echo_fds, path: str, batch: list[Frame]) -> list[Frame | None]:
    control_fd, reply_fd = echo_fds
    writer = TrioFrameWriter(wrap(os.dup(control_fd), path))
    reader = TrioFrameReader(wrap(os.dup(reply_fd), path))
    got: list[Frame | None] = []
    try:
        async with trio.open_nursery() as nursery:

            async def send_all() -> None:
                for frame in batch:
                    await writer.send(frame)

            nursery.start_soon(send_all)
            for _ in batch:
                got.append(await reader.receive())
    finally:
        await writer.aclose()
        await reader.aclose()
    return got


@pytest.mark.parametrize("path", PATHS)
@settings(max_examples=40, deadline=None)
@given(frame=frames)
async def test_round_trip_with_the_fd_end_in_another_process(echo_fds, path, frame):
    (got,) = await echo_round_trip(echo_fds, path, [frame])
    assert_same_frame(got, frame)


@pytest.mark.parametrize("path", PATHS)
async def test_large_and_many_frames(echo_fds, path):
    big = np.random.default_rng(9).integers(0, 256, 5 * MiB + 1, dtype=np.uint8)
    batch = [Frame({"kind": "big"}, [big, b"x"])] + [Frame({"kind": "t", "i": i}, [bytes(i)]) for i in range(200)]
    got = await echo_round_trip(echo_fds, path, batch)
    for g, f in zip(got, batch, strict=True):
        assert_same_frame(g, f)


@pytest.mark.parametrize("path", PATHS)
async def test_clean_eof_and_async_iteration(path):
    r, w = make_pipe()
    batch = [Frame({"kind": "a", "i": i}, [bytes([i]) * i]) for i in range(5)]
    for frame in batch:
        os.write(w, wire(frame))
    os.close(w)
    reader = TrioFrameReader(wrap(r, path))
    got = [frame async for frame in reader]
    assert len(got) == 5
    for g, f in zip(got, batch):
        assert_same_frame(g, f)
    assert await reader.receive() is None
    await reader.aclose()


@pytest.mark.parametrize("path", PATHS)
async def test_truncated_frame_raises(path):
    r, w = make_pipe()
    os.write(w, wire(Frame({"kind": "a"}, [b"0123456789"]))[:-3])
    os.close(w)
    reader = TrioFrameReader(wrap(r, path))
    with pytest.raises(ProtocolError, match="truncated frame.*7 of the 10 bytes of payload 0"):
        await reader.receive()
    with pytest.raises(ProtocolError, match="unusable"):
        await reader.receive()
    await reader.aclose()


@pytest.mark.parametrize("path", PATHS)
async def test_limits_apply(path):
    r, w = make_pipe()
    os.write(w, wire(Frame({"kind": "a"}, [b"0123456789"])))
    os.close(w)
    reader = TrioFrameReader(wrap(r, path), FrameLimits(max_payload_bytes=9, kind_payload_bytes={}))
    with pytest.raises(ProtocolError, match="over the largest payload limit of 9"):
        await reader.receive()
    await reader.aclose()


@pytest.mark.parametrize("path", PATHS)
async def test_cancelled_receive_resumes_the_same_frame(path):
    r, w = make_pipe()
    data = wire(Frame({"kind": "a", "text": "x" * 1000}, [b"p" * 200_000]))
    reader = TrioFrameReader(wrap(r, path))
    os.write(w, data[:100])  # part of the control map
    with trio.CancelScope() as scope:
        async with trio.open_nursery() as nursery:

            async def receive() -> None:
                await reader.receive()
                pytest.fail("the frame cannot be complete yet")

            nursery.start_soon(receive)
            await trio.testing.wait_all_tasks_blocked()
            scope.cancel()
    assert scope.cancelled_caught
    os.write(w, data[100:60_000])  # the rest of the control map and part of the payload
    with trio.CancelScope() as scope:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader.receive)
            await trio.testing.wait_all_tasks_blocked()
            scope.cancel()

    async def finish_writing() -> None:
        await trio.to_thread.run_sync(os.write, w, data[60_000:])
        os.close(w)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(finish_writing)
        frame = await reader.receive()
    assert frame is not None
    assert frame.control == {"kind": "a", "text": "x" * 1000}
    assert bytes(frame.payloads[0]) == b"p" * 200_000
    assert await reader.receive() is None
    await reader.aclose()


@pytest.mark.parametrize("path", PATHS)
async def test_receive_is_a_checkpoint_even_when_a_frame_is_buffered(path):
    r, w = make_pipe()
    os.write(w, wire(Frame({"kind": "a"})) * 2)
    reader = TrioFrameReader(wrap(r, path))
    with trio.testing.assert_checkpoints():
        assert await reader.receive() is not None
    with trio.testing.assert_checkpoints():  # the second frame came in with the first read
        assert await reader.receive() is not None
    os.close(w)
    await reader.aclose()


@pytest.mark.parametrize("path", PATHS)
async def test_one_receiver_and_one_sender_at_a_time(path):
    r, unused_w = os.pipe()  # nobody writes here, so the receiver waits
    unused_r, w = os.pipe()  # a 64 KiB pipe nobody reads, so a 1 MiB frame blocks its sender
    reader = TrioFrameReader(wrap(r, path))
    writer = TrioFrameWriter(wrap(w, path))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(reader.receive)
        nursery.start_soon(writer.send, Frame({"kind": "a"}, [bytes(MiB)]))
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(trio.BusyResourceError):
            await reader.receive()
        with pytest.raises(trio.BusyResourceError):
            await writer.send(Frame({"kind": "b"}))
        nursery.cancel_scope.cancel()
    await reader.aclose()
    await writer.aclose()
    os.close(unused_r)
    os.close(unused_w)


@pytest.mark.parametrize("path", PATHS)
async def test_send_cancelled_before_the_first_byte_leaves_the_writer_usable(path):
    r, w = make_pipe()
    writer = TrioFrameWriter(wrap(w, path))
    with trio.CancelScope() as scope:
        scope.cancel()
        await writer.send(Frame({"kind": "never"}))
    assert scope.cancelled_caught
    await writer.send(Frame({"kind": "ok"}))
    await writer.aclose()
    reader = TrioFrameReader(wrap(r, path))
    assert (await reader.receive()).control == {"kind": "ok"}
    assert await reader.receive() is None
    await reader.aclose()


@pytest.mark.parametrize("path", PATHS)
async def test_send_cancelled_mid_frame_breaks_the_writer(path):
    r, w = os.pipe()
    writer = TrioFrameWriter(wrap(w, path))
    with trio.CancelScope() as scope:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(writer.send, Frame({"kind": "big"}, [bytes(MiB)]))
            await trio.testing.wait_all_tasks_blocked()  # the pipe is full, nobody reads
            scope.cancel()
    with pytest.raises(trio.BrokenResourceError, match="interrupted send"):
        await writer.send(Frame({"kind": "next"}))
    await writer.aclose()
    os.close(r)


@pytest.mark.parametrize("path", PATHS)
async def test_closed_and_broken_streams(path):
    r, w = make_pipe()
    reader = TrioFrameReader(wrap(r, path))
    await reader.aclose()
    with pytest.raises(trio.ClosedResourceError):
        await reader.receive()
    writer = TrioFrameWriter(wrap(w, path))
    await writer.aclose()
    with pytest.raises(trio.ClosedResourceError):
        await writer.send(Frame({"kind": "x"}))

    r, w = make_pipe()
    os.close(r)
    writer = TrioFrameWriter(wrap(w, path))
    with pytest.raises(trio.BrokenResourceError):
        await writer.send(Frame({"kind": "x"}))
    await writer.aclose()


async def test_memory_streams_with_tiny_chunks():
    """A stream that hands out a few bytes at a time still yields whole frames."""

    class Trickle(trio.abc.ReceiveStream):
        def __init__(self, data: bytes):
            self.data = data
            self.sizes = iter(range(1, 10**9))

        async def receive_some(self, max_bytes=None) -> bytes:
            await trio.lowlevel.checkpoint()
            n = min(next(self.sizes) % 97 + 1, max_bytes or 1)
            chunk, self.data = self.data[:n], self.data[n:]
            return chunk

        async def aclose(self) -> None:
            pass

    batch = [Frame({"kind": "k", "i": i, "s": "z" * i}, [bytes(range(i % 256))] * (i % 3)) for i in range(40)]
    reader = TrioFrameReader(Trickle(b"".join(wire(f) for f in batch)))
    got = [frame async for frame in reader]
    assert len(got) == len(batch)
    for g, f in zip(got, batch):
        assert_same_frame(g, f)
