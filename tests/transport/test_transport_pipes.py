"""The blocking fd end over real OS pipes, across processes, and the fd convention helpers."""

from __future__ import annotations

import fcntl
import os
import sys
import threading

import numpy as np
import pytest
from helpers.wire import EchoChild, assert_same_frame, echo_child, frames
from hypothesis import given, settings

from muxworker.transport import (
    FDS_ENV,
    PIPE_SIZE,
    FdFrameReader,
    FdFrameWriter,
    Frame,
    FrameLimits,
    ProtocolError,
    WorkerPipes,
    make_pipe,
    worker_fd_args,
    worker_fds,
)

MiB = 1 << 20


@pytest.fixture(scope="module")
def echo():
    """One echo child for the module: its reader and writer ends, wrapped."""
    with echo_child(max_payloads=3000) as child:
        limits = FrameLimits(max_payloads=3000)
        writer = FdFrameWriter(child.control_fd, limits)
        reader = FdFrameReader(child.reply_fd, limits)
        yield writer, reader, child
        status, err = child.finish()
        assert reader.read() is None  # the child closed its end after our EOF
        assert status == 0, err


def round_trip(echo, frame: Frame) -> Frame | None:
    writer, reader, _ = echo
    # The child reads a whole frame before echoing it, so writing first cannot deadlock.
    writer.write(frame)
    return reader.read()


@settings(max_examples=60, deadline=None)
@given(frame=frames)
def test_round_trip_through_another_process(echo, frame):
    assert_same_frame(round_trip(echo, frame), frame)


def test_frame_larger_than_the_pipe_needs_partial_writes(echo):
    big = np.random.default_rng(5).integers(0, 256, 5 * MiB + 3, dtype=np.uint8)
    frame = Frame({"kind": "x"}, [big, b"tail", big[:70_000]])
    assert_same_frame(round_trip(echo, frame), frame)


@pytest.mark.parametrize("count", [1023, 1024, 1025, 3000])
def test_more_buffers_than_iov_max(echo, count):
    # 1 header buffer + count payloads: around and past IOV_MAX (1024 on Linux).
    payloads = [bytes([i % 256]) * (i % 7) for i in range(count)]
    frame = Frame({"kind": "many", "count": count}, payloads)
    assert_same_frame(round_trip(echo, frame), frame)


def test_many_small_frames_back_to_back(echo):
    writer, reader, _ = echo
    sent = [Frame({"kind": "token", "id": i, "text": "x" * (i % 50)}, [bytes(i % 5)]) for i in range(500)]
    # Interleave: a burst of writes fills the pipe with several frames per read.
    for start in range(0, len(sent), 50):
        for frame in sent[start : start + 50]:
            writer.write(frame)
        for frame in sent[start : start + 50]:
            assert_same_frame(reader.read(), frame)


def test_child_finds_fds_from_the_environment():
    with echo_child(use_env=True) as child:
        writer, reader = FdFrameWriter(child.control_fd), FdFrameReader(child.reply_fd)
        frame = Frame({"kind": "x", "via": "env"}, [b"payload"])
        writer.write(frame)
        assert_same_frame(reader.read(), frame)
        assert child.finish()[0] == 0


def test_child_rejects_garbage_with_protocol_error():
    with echo_child() as child:
        os.write(child.control_fd, b"GET / HTTP/1.1\r\n\r\n")
        status, err = child.finish()
        assert status == 3
        assert "ProtocolError: bad magic b'GET '" in err
        assert FdFrameReader(child.reply_fd).read() is None  # it died at a frame boundary


def test_non_blocking_fds_still_work():
    r, w = make_pipe()
    os.set_blocking(r, False)
    os.set_blocking(w, False)
    frame = Frame({"kind": "x"}, [np.arange(3 * MiB // 8, dtype=np.int64)])
    got: list[Frame | None] = []
    reader_thread = threading.Thread(target=lambda: got.append(FdFrameReader(r).read()))
    reader_thread.start()
    with FdFrameWriter(w) as writer:
        writer.write(frame)
    reader_thread.join()
    os.close(r)
    assert_same_frame(got[0], frame)


def test_writer_after_reader_went_away():
    r, w = make_pipe()
    os.close(r)
    with FdFrameWriter(w) as writer:
        with pytest.raises(BrokenPipeError):
            writer.write(Frame({"kind": "x"}))
        with pytest.raises(BrokenPipeError, match="unusable after an earlier failed write"):
            writer.write(Frame({"kind": "x"}))


def test_writer_refuses_bad_frames_before_writing_anything():
    r, w = make_pipe()
    with FdFrameWriter(w, FrameLimits(max_payloads=1)) as writer:
        with pytest.raises(ProtocolError, match="max_payloads=1"):
            writer.write(Frame({"kind": "x"}, [b"a", b"b"]))
        writer.write(Frame({"kind": "ok"}))  # the writer is still usable
    with FdFrameReader(r) as reader:
        assert reader.read().control == {"kind": "ok"}
        assert reader.read() is None


def test_closed_reader_and_writer():
    r, w = make_pipe()
    reader, writer = FdFrameReader(r), FdFrameWriter(w)
    reader.close()
    reader.close()  # idempotent
    writer.close()
    writer.close()
    with pytest.raises(ValueError, match="closed"):
        reader.read()
    with pytest.raises(ValueError, match="closed"):
        writer.write(Frame({"kind": "x"}))


# --- the fd convention ------------------------------------------------------------------------


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="F_SETPIPE_SZ is Linux only")
def test_make_pipe_enlarges_the_pipe():
    r, w = make_pipe()
    try:
        assert fcntl.fcntl(w, fcntl.F_GETPIPE_SZ) == PIPE_SIZE == MiB
        assert not os.get_inheritable(r) and not os.get_inheritable(w)
        assert os.get_blocking(r) and os.get_blocking(w)
    finally:
        os.close(r)
        os.close(w)


def test_worker_pipes_lifecycle():
    pipes = WorkerPipes.open()
    try:
        assert pipes.pass_fds == (pipes.control_read, pipes.reply_write)
        assert pipes.worker_args() == worker_fd_args(pipes.control_read, pipes.reply_write)
        assert pipes.worker_env() == {FDS_ENV: f"{pipes.control_read},{pipes.reply_write}"}
        assert worker_fds(pipes.worker_args(), {}) == pipes.pass_fds
        pipes.close_worker_ends()
        pipes.close_worker_ends()
        assert pipes.pass_fds == (-1, -1)
    finally:
        pipes.close()
        pipes.close()
    assert (pipes.control_write, pipes.reply_read) == (-1, -1)


@pytest.fixture
def two_fds():
    r, w = make_pipe()
    os.set_inheritable(r, True)
    os.set_inheritable(w, True)
    yield r, w
    os.close(r)
    os.close(w)


def test_worker_fds_forms(two_fds):
    r, w = two_fds
    assert worker_fds(["--model", "m", "--control-fd", str(r), "--reply-fd", str(w)], {}) == (r, w)
    assert worker_fds([f"--control-fd={r}", f"--reply-fd={w}", "--other"], {}) == (r, w)
    assert worker_fds([], {FDS_ENV: f"{r},{w}"}) == (r, w)
    # flags win over the environment
    assert worker_fds(["--control-fd", str(r), "--reply-fd", str(w)], {FDS_ENV: "98,99"}) == (r, w)
    # the worker's fds are not passed on to its own children
    assert not os.get_inheritable(r) and not os.get_inheritable(w)


@pytest.mark.parametrize(
    "argv, env, match",
    [
        ([], {}, "no protocol fds"),
        (["--control-fd", "5"], {}, "pass both"),
        (["--control-fd", "x", "--reply-fd", "6"], {}, "integer"),
        (["--control-fd", "0", "--reply-fd", "1"], {}, "stdin, stdout or stderr"),
        ([], {FDS_ENV: "7"}, "control_fd,reply_fd"),
        ([], {FDS_ENV: "a,b"}, "control_fd,reply_fd"),
        (["--control-fd", "100000", "--reply-fd", "100001"], {}, "not open"),
    ],
)
def test_worker_fds_errors(argv, env, match):
    with pytest.raises(ValueError, match=match):
        worker_fds(argv, env)


def test_worker_fds_must_differ(two_fds):
    r, _ = two_fds
    with pytest.raises(ValueError, match="must differ"):
        worker_fds(["--control-fd", str(r), "--reply-fd", str(r)], {})


def test_echo_child_helper_cleans_up():
    child = EchoChild()
    child.close()
    assert child.proc.returncode is not None
