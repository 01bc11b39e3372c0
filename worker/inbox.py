"""The worker's inbox: what the engine thread takes, in order, from the other threads (frames from
the reader thread, bounded; stops from anywhere; ended checkpoint jobs from the I/O thread), and
the items other than frames (server.py has the threads and who owns what)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from muxworker.transport.errors import MuxError
from muxworker.transport.framing import Frame, MiB
from muxworker.transport.sampling import SamplingFields

if TYPE_CHECKING:
    from muxworker.worker.engine.constraints import Guide

__all__ = ["Inbox", "Item", "Rejected", "Stop", "IoDone", "Guided"]

# The inbox bound: the reader thread reads no further frame while this many frames, or frames
# holding this many payload bytes, wait for the engine thread. Memory held by the inbox is at most
# _INBOX_BYTES plus one frame (which its kind's frame limit bounds).
_INBOX_FRAMES = 256
_INBOX_BYTES = 8 * MiB


@dataclass(frozen=True)
class Rejected:
    """A message that failed the schema but names a request id we can answer."""

    request_id: int
    error: MuxError


@dataclass(frozen=True)
class Stop:
    """Leave the engine loop: settle everything, then exit with ``code``."""

    code: int
    reason: str | None = None  # logged to stderr (and sent as an error frame when code != 0)


@dataclass(frozen=True)
class IoDone:
    """A checkpoint file job has ended on the I/O thread: the engine thread closes ``fds`` and
    replies with what ``finish(future)`` returns (or raises)."""

    request_id: int
    kind: str
    fds: list[int]
    future: Future[Any]
    finish: Callable[[Future[Any]], dict[str, Any]]


@dataclass(frozen=True)
class Guided:
    """A ``generate`` frame whose sampling fields the reader thread checked and whose constraint it
    compiled (worker/engine/constraints.py), so neither costs the engine thread anything."""

    frame: Frame
    params: SamplingFields
    guide: Guide


Item = Frame | Guided | Rejected | Stop | IoDone


class Inbox:
    """The engine thread's queue: frames from the reader thread (bounded), stops from anywhere,
    ended jobs from the I/O thread.

    The reader thread calls :meth:`wait_for_room` before it reads each frame, so at most
    ``max_frames`` frames or ``max_bytes`` payload bytes wait here (plus the frame read last); the
    rest stays in the control pipe, whose writer then blocks. Stops and ended jobs are never
    bounded: a signal handler, the reader's last word or the I/O thread must always get through, and
    ``SimpleQueue.put`` is safe in a signal handler (it takes no lock that the interrupted engine
    thread could hold).
    """

    def __init__(self, max_frames: int = _INBOX_FRAMES, max_bytes: int = _INBOX_BYTES) -> None:
        self._queue: queue.SimpleQueue[tuple[Item, int]] = queue.SimpleQueue()
        self._max_frames, self._max_bytes = max_frames, max_bytes
        self._room = threading.Condition()
        self._frames = 0  # frames (and rejections) queued; guarded by _room
        self._bytes = 0  # their payload bytes; guarded by _room

    def wait_for_room(self) -> None:
        """Reader thread: block while the inbox is full."""
        with self._room:
            while self._frames >= self._max_frames or self._bytes >= self._max_bytes:
                self._room.wait()

    def put_frame(self, item: Frame | Guided | Rejected) -> None:
        frame = item.frame if isinstance(item, Guided) else item
        nbytes = sum(memoryview(p).nbytes for p in frame.payloads) if isinstance(frame, Frame) else 0
        with self._room:
            self._frames += 1
            self._bytes += nbytes
        self._queue.put((item, nbytes))

    def put_event(self, item: Stop | IoDone) -> None:
        self._queue.put((item, -1))

    def get(self, block: bool = True) -> Item:
        """Engine thread: the next item (raises queue.Empty when ``block`` is false and none waits)."""
        item, nbytes = self._queue.get(block)
        if nbytes >= 0:
            with self._room:
                self._frames -= 1
                self._bytes -= nbytes
                self._room.notify()
        return item
