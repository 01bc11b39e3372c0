"""The blocking end of the wire, on raw file descriptors (used by the worker process).

Also the fd convention: the protocol runs over two dedicated inherited pipes, never stdin/stdout,
so a stray print from any library in the worker cannot corrupt it. The client creates both pipes
(:class:`WorkerPipes`), passes the worker's ends with ``pass_fds`` and names them on the worker's
command line (``--control-fd N --reply-fd M``) or in ``MUXWORKER_FDS="N,M"``; the worker finds
them with :func:`worker_fds`.
"""

from __future__ import annotations

import argparse
import errno
import fcntl
import os
import select
import stat
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .framing import DEFAULT_LIMITS, Frame, FrameDecoder, FrameLimits, MiB, encode_frame

__all__ = [
    "FdFrameReader",
    "FdFrameWriter",
    "PIPE_SIZE",
    "FDS_ENV",
    "make_pipe",
    "WorkerPipes",
    "worker_fd_args",
    "worker_fds",
    "flags_of",
]

PIPE_SIZE = 1 * MiB
FDS_ENV = "MUXWORKER_FDS"

try:
    _IOV_MAX = max(2, min(os.sysconf("SC_IOV_MAX"), 1024))
except (AttributeError, ValueError, OSError):  # pragma: no cover - not Linux/macOS
    _IOV_MAX = 16


def flags_of(**flags: Any) -> list[str]:
    """Keyword flags as the worker's command line spells them (one rule for every caller that
    builds one): ``max_sessions=2`` is ``--max_sessions 2``; True is the bare flag; None and False
    are left out."""
    out: list[str] = []
    for name, value in flags.items():
        if value is None or value is False:
            continue
        out.append(f"--{name}")
        if value is not True:
            out.append(str(value))
    return out


def _wait(fd: int, events: int) -> None:
    """Block until a non-blocking fd is ready (the fds are normally blocking; this keeps us correct)."""
    poller = select.poll()
    poller.register(fd, events)
    poller.poll()


class FdFrameReader:
    """Reads frames from a file descriptor with blocking reads into preallocated buffers.

    ``read()`` returns the next :class:`Frame`, or None once the stream ends cleanly at a frame
    boundary. Anything else (a frame over the limits, a bad header, a truncated frame, a bad
    control map) raises :class:`ProtocolError`, and so does every later call. Not thread-safe:
    one thread reads. The reader owns the fd and ``close()`` closes it. ``screen``: see
    :class:`FrameDecoder` (a refused frame is returned before its payload bytes are read).
    """

    def __init__(
        self,
        fd: int,
        limits: FrameLimits = DEFAULT_LIMITS,
        *,
        allocate: Callable[[int], Any] | None = None,
        screen: Callable[[dict[str, Any], tuple[int, ...]], Exception | None] | None = None,
    ):
        self._fd = fd
        self._decoder = FrameDecoder(limits, allocate=allocate, screen=screen)
        self._eof = False

    def fileno(self) -> int:
        return self._fd

    @property
    def in_frame(self) -> bool:
        """Whether part of a frame has been read and the rest is still to come.

        Read by the worker's heartbeat thread while the reader thread reads: a stale answer
        costs one heartbeat interval, never correctness."""
        return not self._decoder.at_boundary

    def read(self) -> Frame | None:
        if self._fd < 0:
            raise ValueError("read from a closed FdFrameReader")
        decoder = self._decoder
        while (frame := decoder.next_frame()) is None:
            if self._eof:
                return None
            targets = decoder.read_targets(_IOV_MAX)
            try:
                n = os.readv(self._fd, targets)
            except BlockingIOError:
                _wait(self._fd, select.POLLIN)
                continue
            if n == 0:
                decoder.eof()
                self._eof = True
                return None
            decoder.commit(n)
        return frame

    def __iter__(self) -> Iterator[Frame]:
        while (frame := self.read()) is not None:
            yield frame

    def close(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)

    def __enter__(self) -> FdFrameReader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _skip_written(pending: list[memoryview], i: int, n: int) -> int:
    """After a write of ``n`` bytes from ``pending[i:]``: the index of the first unfinished buffer
    (the partially written one is replaced by its unwritten tail)."""
    while n:
        size = len(pending[i])
        if n >= size:
            n -= size
            i += 1
        else:
            pending[i] = pending[i][n:]
            n = 0
    return i


def _writev_all(fd: int, buffers: list[Any]) -> None:
    """Write every buffer, in order, with as few writev calls as IOV_MAX and partial writes allow."""
    pending = [memoryview(b) for b in buffers if len(b)]
    i = 0
    while i < len(pending):
        try:
            n = os.writev(fd, pending[i : i + _IOV_MAX])
        except BlockingIOError:
            _wait(fd, select.POLLOUT)
            continue
        i = _skip_written(pending, i, n)


class FdFrameWriter:
    """Writes frames to a file descriptor with gather writes (payloads are never copied).

    A frame that breaks the limits raises :class:`ProtocolError` before any byte is written. If a
    write fails part way (the reader went away: ``BrokenPipeError``; or an exception interrupted
    it), the stream is left mid-frame, so the writer refuses every later frame. Not thread-safe:
    one thread writes. The writer owns the fd and ``close()`` closes it.
    """

    def __init__(self, fd: int, limits: FrameLimits = DEFAULT_LIMITS):
        self._fd = fd
        self._limits = limits
        self._broken: BaseException | None = None

    def fileno(self) -> int:
        return self._fd

    def write(self, frame: Frame) -> None:
        if self._fd < 0:
            raise ValueError("write to a closed FdFrameWriter")
        if self._broken is not None:
            raise BrokenPipeError(
                errno.EPIPE, f"frame writer is unusable after an earlier failed write: {self._broken!r}"
            )
        buffers = encode_frame(frame, self._limits)
        try:
            _writev_all(self._fd, buffers)
        except BaseException as exc:
            self._broken = exc
            raise

    def write_many(self, frames: Sequence[Frame]) -> None:
        """Write several frames in order with as few gather writes as possible.

        The worker sends one step's token frames this way: one syscall and one reader wake-up per
        step instead of one per stream. Every frame is encoded (and checked against the limits)
        before any byte is written, so a frame that breaks them raises with nothing sent.
        """
        if self._fd < 0:
            raise ValueError("write to a closed FdFrameWriter")
        if self._broken is not None:
            raise BrokenPipeError(
                errno.EPIPE, f"frame writer is unusable after an earlier failed write: {self._broken!r}"
            )
        buffers = [buf for frame in frames for buf in encode_frame(frame, self._limits)]
        try:
            _writev_all(self._fd, buffers)
        except BaseException as exc:
            self._broken = exc
            raise

    def close(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)

    def __enter__(self) -> FdFrameWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def make_pipe(size: int = PIPE_SIZE) -> tuple[int, int]:
    """``os.pipe()`` (non-inheritable, blocking) enlarged to ``size`` bytes where the OS allows.

    A 1 MiB pipe (Linux ``F_SETPIPE_SZ``; the unprivileged maximum by default) means fewer
    context switches per large payload. Where it cannot be enlarged the default size is kept.
    """
    r, w = os.pipe()
    setpipe = getattr(fcntl, "F_SETPIPE_SZ", None)
    if setpipe is not None and size:
        try:
            fcntl.fcntl(w, setpipe, size)
        except OSError:
            pass  # EPERM over /proc/sys/fs/pipe-max-size or the per-user quota: keep the default
    return r, w


def worker_fd_args(control_fd: int, reply_fd: int) -> list[str]:
    """The worker command-line flags naming its two protocol fds."""
    return ["--control-fd", str(control_fd), "--reply-fd", str(reply_fd)]


@dataclass
class WorkerPipes:
    """The two pipes between a client and one worker, made by the client before it spawns the worker.

    control: client writes ``control_write``, worker reads ``control_read``.
    reply:   worker writes ``reply_write``, client reads ``reply_read``.

    Spawn the worker with ``pass_fds=pipes.pass_fds`` and ``pipes.worker_args()`` on its command
    line, then call ``close_worker_ends()`` in the client so that the client sees EOF on the reply
    pipe when the worker exits.
    """

    control_read: int
    control_write: int
    reply_read: int
    reply_write: int

    @classmethod
    def open(cls, size: int = PIPE_SIZE) -> WorkerPipes:
        control_read, control_write = make_pipe(size)
        try:
            reply_read, reply_write = make_pipe(size)
        except BaseException:
            os.close(control_read)
            os.close(control_write)
            raise
        return cls(control_read, control_write, reply_read, reply_write)

    @property
    def pass_fds(self) -> tuple[int, int]:
        return (self.control_read, self.reply_write)

    def worker_args(self) -> list[str]:
        return worker_fd_args(self.control_read, self.reply_write)

    def worker_env(self) -> dict[str, str]:
        """The environment alternative to worker_args()."""
        return {FDS_ENV: f"{self.control_read},{self.reply_write}"}

    def close_worker_ends(self) -> None:
        """Close the worker's ends in this process (idempotent)."""
        for name in ("control_read", "reply_write"):
            fd = getattr(self, name)
            if fd >= 0:
                setattr(self, name, -1)
                os.close(fd)

    def close(self) -> None:
        """Close every end still open here (idempotent)."""
        self.close_worker_ends()
        for name in ("control_write", "reply_read"):
            fd = getattr(self, name)
            if fd >= 0:
                setattr(self, name, -1)
                os.close(fd)


def worker_fds(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> tuple[int, int]:
    """The worker's (control_fd, reply_fd), from ``--control-fd N --reply-fd M`` or ``MUXWORKER_FDS=N,M``.

    Command-line flags win over the environment. Both fds must be open and must not be stdin,
    stdout or stderr. They are made non-inheritable, so a grandchild process (a compiler, a
    tokenizer pool) cannot hold the reply pipe open after the worker dies.
    Raises ValueError with the expected form when they are missing or wrong.
    """
    argv = sys.argv[1:] if argv is None else argv
    environ = os.environ if environ is None else environ
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
    parser.add_argument("--control-fd", type=int)
    parser.add_argument("--reply-fd", type=int)
    try:
        args, _ = parser.parse_known_args(list(argv))
    except argparse.ArgumentError as exc:
        raise ValueError(f"--control-fd and --reply-fd take one integer fd number each: {exc}") from None
    if args.control_fd is not None or args.reply_fd is not None:
        if args.control_fd is None or args.reply_fd is None:
            raise ValueError("pass both --control-fd N and --reply-fd M")
        fds = (args.control_fd, args.reply_fd)
    elif environ.get(FDS_ENV):
        parts = environ[FDS_ENV].split(",")
        try:
            control_fd, reply_fd = (int(p) for p in parts)
        except ValueError:
            raise ValueError(f"{FDS_ENV} must be 'control_fd,reply_fd', got {environ[FDS_ENV]!r}") from None
        fds = (control_fd, reply_fd)
    else:
        raise ValueError(f"no protocol fds: pass --control-fd N --reply-fd M or set {FDS_ENV}=N,M")
    for name, fd in zip(("control", "reply"), fds):
        if fd in (0, 1, 2):
            raise ValueError(f"the {name} fd must not be stdin, stdout or stderr (got {fd})")
        try:
            mode = os.fstat(fd).st_mode
        except OSError as exc:
            raise ValueError(f"the {name} fd {fd} is not open: {exc.strerror}") from None
        if stat.S_ISDIR(mode):
            raise ValueError(f"the {name} fd {fd} is a directory")
        os.set_inheritable(fd, False)
    if fds[0] == fds[1]:
        raise ValueError("the control and reply fds must differ")
    return fds
