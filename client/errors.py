"""The client's exceptions: every wire error class, plus the ones only the client raises.

All derive from :class:`MuxError`. A request error (one class per wire code) ends that request
only; :class:`WorkerDiedError` means the worker is gone, and every pending and later call raises it;
:class:`ClientClosedError` means *you* closed the client.
"""

from __future__ import annotations

from collections.abc import Sequence

from muxworker.transport.errors import (
    ERROR_CLASSES,
    CapacityExhausted,
    CheckpointRejected,
    ContextOverflow,
    InternalError,
    InvalidArgument,
    MuxError,
    NotReady,
    ProtocolError,
    SessionBusy,
    SessionExists,
    SessionNotFound,
    SlowConsumer,
    Unsaveable,
    error_from_wire,
)

__all__ = [
    "MuxError",
    "InvalidArgument",
    "NotReady",
    "SessionNotFound",
    "SessionExists",
    "SessionBusy",
    "CapacityExhausted",
    "ContextOverflow",
    "SlowConsumer",
    "InternalError",
    "ProtocolError",
    "Unsaveable",
    "CheckpointRejected",
    "ERROR_CLASSES",
    "error_from_wire",
    "WorkerDiedError",
    "WorkerStartupError",
    "ClientClosedError",
]


class WorkerDiedError(MuxError):
    """The worker process exited or broke the protocol; every pending and later call raises this."""

    code = "worker_died"  # never on the wire: the worker cannot report its own death

    def __init__(self, reason: str, returncode: int | None = None, stderr_tail: Sequence[str] = ()) -> None:
        self.reason = reason
        self.returncode = returncode
        self.stderr_tail: tuple[str, ...] = tuple(stderr_tail)
        status = "still running" if returncode is None else _describe_status(returncode)
        message = f"worker died: {reason} ({status})"
        if self.stderr_tail:
            message += "; last stderr lines:\n" + "\n".join(f"  | {line}" for line in self.stderr_tail)
        super().__init__(message)

    def copy(self) -> WorkerDiedError:
        """A fresh exception with the same fields: raising one object from many tasks tangles tracebacks."""
        return type(self)(self.reason, self.returncode, self.stderr_tail)


class WorkerStartupError(WorkerDiedError):
    """The worker failed before its hello: bad flags, a model that does not load, a timeout."""


class OperationCancelled(MuxError):
    """The operation was cancelled while it waited for its session's lease, so it never ran."""

    code = "cancelled"  # never on the wire


class ClientClosedError(MuxError):
    """The client was closed by its owner; it takes no more calls."""

    code = "client_closed"  # never on the wire


def _describe_status(returncode: int) -> str:
    if returncode < 0:
        import signal

        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"killed by {name}"
    return f"exit status {returncode}"
