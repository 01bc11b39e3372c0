"""Open files passed to the worker beside the pipes: SCM_RIGHTS over a datagram socket pair.

The client's session store vets a checkpoint file (owner, mode, no symlink, regular, size) and
opens it; the worker then reads or writes that very open file, never a path, so no one can swap
the file between the check and the use (no TOCTOU window), and the worker needs no access to the
store's directory at all. The channel carries only file descriptors: each datagram is the 8-byte
little-endian id of the request that uses them, plus the descriptors as ``SCM_RIGHTS`` ancillary
data. The client sends it just before it writes that request's frame, so the worker finds it
already queued when it handles the frame; it never waits for one.

The worker learns the channel from ``--files-fd N`` (``FILES_FLAG``); a worker without it (a
custom command) says so by leaving ``files`` out of its hello, and the client then refuses
checkpoint calls: checkpoints travel only as files (a host checkpoint as one segment in a memory
file), never in frames.
"""

from __future__ import annotations

import array
import os
import socket
import struct

from .errors import InvalidArgument

__all__ = ["FILES_FLAG", "MAX_PASSED_FDS", "FileChannelPair", "FileReceiver", "send_files"]

FILES_FLAG = "--files-fd"
#: Most descriptors one request may pass (below the kernel's SCM_MAX_FD of 253).
MAX_PASSED_FDS = 240
_TOKEN = struct.Struct("<Q")


class FileChannelPair:
    """Both ends, made by the client before it spawns the worker (like ``WorkerPipes``)."""

    def __init__(self) -> None:
        client, worker = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
        client.setblocking(False)
        self.client: socket.socket | None = client
        self.worker: socket.socket | None = worker
        worker.set_inheritable(True)

    def worker_args(self) -> list[str]:
        assert self.worker is not None
        return [FILES_FLAG, str(self.worker.fileno())]

    @property
    def pass_fds(self) -> tuple[int, ...]:
        return () if self.worker is None else (self.worker.fileno(),)

    def close_worker_end(self) -> None:
        if self.worker is not None:
            self.worker.close()
            self.worker = None

    def close(self) -> None:
        self.close_worker_end()
        if self.client is not None:
            self.client.close()
            self.client = None


def send_files(sock: socket.socket, request_id: int, fds: list[int]) -> None:
    """Queue ``fds`` for request ``request_id`` (non-blocking; the kernel duplicates them, so the
    caller may close its own copies once this returns). Raises OSError when the worker is gone or
    its queue is full."""
    if not 0 < len(fds) <= MAX_PASSED_FDS:
        raise InvalidArgument(f"a request passes 1 to {MAX_PASSED_FDS} files, got {len(fds)}")
    sock.sendmsg([_TOKEN.pack(request_id)], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])


class FileReceiver:
    """The worker's end: the descriptors a request passed, matched by its id."""

    def __init__(self, fd: int) -> None:
        self.sock = socket.socket(fileno=fd)
        self.sock.set_inheritable(False)
        self.sock.setblocking(False)

    def receive(self, request_id: int, count: int) -> list[int]:
        """The ``count`` descriptors request ``request_id`` passed (the caller owns and closes them).

        Datagrams of earlier requests whose frames were refused before they were handled are
        closed and skipped. Raises :class:`InvalidArgument` when none is queued for this request or
        the count differs: the client sends them before the frame, so they are always there."""
        space = socket.CMSG_SPACE(MAX_PASSED_FDS * array.array("i").itemsize)
        while True:
            try:
                data, ancillary, flags, _ = self.sock.recvmsg(_TOKEN.size, space)
            except BlockingIOError:
                raise InvalidArgument(f"request {request_id} names passed files but none arrived") from None
            fds = _fds_of(ancillary)
            token = _TOKEN.unpack(data)[0] if len(data) == _TOKEN.size else -1
            if token == request_id and len(fds) == count and not flags & socket.MSG_CTRUNC:
                return fds
            for fd in fds:
                os.close(fd)
            if token > request_id or token == request_id:
                raise InvalidArgument(f"request {request_id} passed {len(fds)} files, not the {count} it names")

    def close(self) -> None:
        self.sock.close()


def _fds_of(ancillary: list[tuple[int, int, bytes]]) -> list[int]:
    fds = array.array("i")
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
    return list(fds)
