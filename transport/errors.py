"""The error hierarchy shared by the worker and the client.

Every error that crosses the wire is a :class:`MuxError` subclass with one wire ``code``. The worker
sends ``{"kind": "error", "id": ..., "code": exc.code, "message": str(exc)}`` and the client turns it
back into the same class with :func:`error_from_wire`.

Two levels, as in the rest of muxworker: a request error (every class here except
:class:`ProtocolError`) ends that one request; a :class:`ProtocolError` means the byte stream itself
can no longer be trusted, and the connection is closed.
"""

from __future__ import annotations

from typing import ClassVar

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
    "register_error_classes",
]


class MuxError(Exception):
    """Base of every muxworker error that has a wire code."""

    code: ClassVar[str] = "internal"

    @property
    def message(self) -> str:
        return str(self.args[0]) if self.args else ""


# Also a ValueError: the client's own argument checks raised ValueError before they raised this,
# and code that catches that keeps working.
class InvalidArgument(MuxError, ValueError):
    """A request field has a wrong type, is out of range, or is not known."""

    code = "invalid_argument"


class NotReady(MuxError):
    """The worker has not finished starting (or is shutting down) and takes no requests."""

    code = "not_ready"


class SessionNotFound(MuxError):
    """No open session has this id."""

    code = "session_not_found"


class SessionExists(MuxError):
    """A session with this id is already open."""

    code = "session_exists"


class SessionBusy(MuxError):
    """The session already has a request in flight."""

    code = "session_busy"


class CapacityExhausted(MuxError):
    """No free session slot or KV cache space for this request."""

    code = "capacity_exhausted"


class ContextOverflow(MuxError):
    """The prompt plus the tokens to generate do not fit in the model's context."""

    code = "context_overflow"


class SlowConsumer(MuxError):
    """The client did not read this request's output fast enough, so it was dropped."""

    code = "slow_consumer"


class InternalError(MuxError):
    """A bug or unexpected failure in the worker; the message says what."""

    code = "internal"


class ProtocolError(MuxError):
    """The peer broke the wire protocol (framing, limits, schema); the connection is unusable."""

    code = "protocol"


class Unsaveable(MuxError):
    """The session's state cannot be exported as a checkpoint right now."""

    code = "unsaveable"


class CheckpointRejected(MuxError):
    """A checkpoint does not match this model or is damaged, so it was not restored."""

    code = "checkpoint_rejected"


ERROR_CLASSES: dict[str, type[MuxError]] = {
    cls.code: cls
    for cls in (
        InvalidArgument,
        NotReady,
        SessionNotFound,
        SessionExists,
        SessionBusy,
        CapacityExhausted,
        ContextOverflow,
        SlowConsumer,
        InternalError,
        ProtocolError,
        Unsaveable,
        CheckpointRejected,
    )
}


def register_error_classes(*classes: type[MuxError]) -> None:
    """Make more wire codes known to :func:`error_from_wire` (the checkpoint file errors,
    transport/checkpoint/errors.py, which a worker sends since it reads and writes files)."""
    for cls in classes:
        ERROR_CLASSES.setdefault(cls.code, cls)


def error_from_wire(code: str, message: str, reason: str | None = None) -> MuxError:
    """The exception an ``error`` message stands for; an unknown code becomes :class:`InternalError`.
    ``reason`` (a file error's ``disk_full``, ...) is set on the exception when it has one."""
    if code.startswith("checkpoint_"):
        from . import checkpoint  # noqa: F401  (registers the file errors' codes)
    cls = ERROR_CLASSES.get(code)
    if cls is None:
        return InternalError(f"unknown error code {code!r}: {message}")
    exc = cls(message)
    if reason is not None and hasattr(exc, "reason"):
        exc.reason = reason
    return exc
