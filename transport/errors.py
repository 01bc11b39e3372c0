"""Every muxworker error that has a code, and the one table of what each code means.

Every error class a caller can meet is a :class:`MuxError` subclass with one ``code``. The worker
sends ``{"kind": "error", "id": ..., "code": exc.code, "message": str(exc), "reason"?: ...}``
(:func:`muxworker.transport.schema.error_control`) and the client turns it back into the same class
with :func:`error_from_wire`.

:data:`ERRORS` is the table: one row per code, naming the class that owns it, whether a worker
ever sends it, and the HTTP status, OpenAI error type and OpenAI error code the server answers it
with (client/serve/openai_api.py). :data:`ERROR_CLASSES` (what :func:`error_from_wire` rebuilds),
the HTTP mapping and the table in docs/PROTOCOL.md (:func:`error_table`) are all read from it.

Why every class with a code lives in this module, even the ones only the client raises (a dead
worker, the session store's errors): the table has to name each class, and this is the one module
that both ends and the doc generator import. The client cannot be imported from here (the import
rule is client -> transport), and a table that each module fills in as it is imported is complete
only once all of them are, which takes an import back from here into each of them: a circle. So
the classes are defined here and re-exported where they
belong: :mod:`muxworker.transport.checkpoint.errors` (the checkpoint file errors),
:mod:`muxworker.client.errors` (the client's) and :mod:`muxworker.client.stores` (the store's).
The table is one literal after the classes, so that it reads as the table it is; a test checks
that every class that declares a code has exactly one row, and that each wire code survives the
trip through an ``error`` frame with its class and ``reason``.

A subclass without a code of its own travels as its nearest ancestor in the table:
``CheckpointMalformed`` and ``CheckpointRetentionError`` (transport/checkpoint/errors.py) are a
``checkpoint_rejected``, :class:`WorkerStartupError` a ``worker_died``.

Two levels, as in the rest of muxworker: a request error ends that one request; a
:class:`ProtocolError` means the byte stream itself can no longer be trusted, and the connection is
closed; a :class:`WorkerDiedError` means the worker is gone, and every pending and later call
raises it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

__all__ = [
    "MuxError",
    # sent by the worker
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
    "CheckpointError",
    "CheckpointNotFound",
    "CheckpointCorrupt",
    "CheckpointIncompatible",
    "CheckpointTooLarge",
    "CheckpointUnsafePath",
    "CheckpointWriteError",
    "CheckpointReadError",
    # raised by the client only
    "WorkerDiedError",
    "WorkerStartupError",
    "OperationCancelled",
    "ClientClosedError",
    "StorePermissionError",
    "ConfigurationMismatch",
    "StoreBusy",
    "SaveConflict",
    "StoreUnavailable",
    # the table
    "ErrorCode",
    "ERRORS",
    "ERROR_CLASSES",
    "error_code_of",
    "error_from_wire",
    "error_table",
]


class MuxError(Exception):
    """Base of every muxworker error that has a code."""

    code: ClassVar[str] = "internal"

    @property
    def message(self) -> str:
        return str(self.args[0]) if self.args else ""


# ----------------------------------------------------------------------------------------------
# Request errors the worker sends


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


# ----------------------------------------------------------------------------------------------
# Checkpoint file errors (transport/checkpoint/errors.py re-exports them): raised by the file
# layer on either end, and sent by a worker when a file passed to it (save_file, restore_file)
# fails. Not a CheckpointRejected: ``except CheckpointRejected`` around a restore does not also
# catch a missing file.


class CheckpointError(MuxError):
    """A checkpoint file, the session store or an identity check failed (base of the file errors)."""

    code = "checkpoint_error"


class CheckpointNotFound(CheckpointError):
    """No checkpoint file exists at this path (or for this session id)."""

    code = "checkpoint_not_found"


class CheckpointCorrupt(CheckpointError):
    """The file is truncated, damaged or not a checkpoint: a magic, size, structure or checksum failed."""

    code = "checkpoint_corrupt"


class CheckpointIncompatible(CheckpointError):
    """The checkpoint was made for another model/configuration identity, format or file version."""

    code = "checkpoint_incompatible"


class CheckpointTooLarge(CheckpointError):
    """The checkpoint's payload bytes exceed the configured ``max_bytes``."""

    code = "checkpoint_too_large"


class CheckpointUnsafePath(CheckpointError):
    """The path is a symlink, FIFO, directory or other non-regular file, so it is not read or replaced."""

    code = "checkpoint_unsafe_path"


class _OSFailure(CheckpointError):
    """Base of the errors that carry the operating system's reason (sent as the frame's ``reason``)."""

    def __init__(self, message: str, *, reason: str = "os_error", errno: int | None = None) -> None:
        super().__init__(message)
        # "disk_full", "read_only", "permission_denied", ... (transport/checkpoint/errors.py).
        self.reason = reason
        self.errno = errno  # this side's only: not sent


class CheckpointWriteError(_OSFailure):
    """The system refused or failed a write (disk full, read-only, permission denied); earlier files stay."""

    code = "checkpoint_write_error"


class CheckpointReadError(_OSFailure):
    """The system refused or failed a read of a checkpoint file (permission denied, I/O error)."""

    code = "checkpoint_read_error"


# ----------------------------------------------------------------------------------------------
# Raised by the client only (muxworker.client.errors re-exports them): never on the wire.


class WorkerDiedError(MuxError):
    """The worker process exited or broke the protocol; every pending and later call raises this."""

    code = "worker_died"  # the worker cannot report its own death

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

    code = "cancelled"


class ClientClosedError(MuxError):
    """The client was closed by its owner; it takes no more calls."""

    code = "client_closed"


def _describe_status(returncode: int) -> str:
    if returncode < 0:
        import signal

        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"killed by {name}"
    return f"exit status {returncode}"


# The session store's errors (muxworker.client.stores re-exports them). File errors, so an
# ``except CheckpointError`` around a save or a resume sees them too, each with its own code.


class StorePermissionError(CheckpointError):
    """The store directory is missing, a symlink, not a directory, not owned by this user, or writable by group or others."""

    code = "store_permission"


class ConfigurationMismatch(CheckpointIncompatible):
    """The worker (or a checkpoint) does not run the configuration the store was created with."""

    code = "configuration_mismatch"


class StoreBusy(CheckpointError):
    """A writer holds the store, so an operation that needs it alone (``clean``) did not run."""

    code = "store_busy"


class SaveConflict(CheckpointError):
    """Another writer saved or deleted the session while this incremental save ran; save again."""

    code = "save_conflict"


class StoreUnavailable(CheckpointError):
    """The store could not be reached or answered with a server/network error; the session's data is not known to be damaged."""

    code = "store_unavailable"


# ----------------------------------------------------------------------------------------------
# The table


@dataclass(frozen=True)
class ErrorCode:
    """One row of :data:`ERRORS`: a code, the class that owns it, and its HTTP answer."""

    cls: type[MuxError]
    wire: bool  # a worker sends it; False: only the client raises it, and it is never sent
    status: int  # the HTTP status of the server's answer (client/serve/openai_api.py)
    type: str  # OpenAI's error type
    http_code: str  # OpenAI's error ``code``: OpenAI's own name where it has one, else the server's

    @property
    def code(self) -> str:
        return self.cls.code

    @property
    def meaning(self) -> str:
        return " ".join((self.cls.__doc__ or "").split()).replace("``", "`")


_WIRE, _CLIENT = True, False
_REQUEST, _RATE, _SERVER = "invalid_request_error", "rate_limit_error", "server_error"
# A session whose saved state cannot be used: 422, not 409, because the SDKs retry a 409 and a
# damaged or foreign file stays so.
_UNRESUMABLE = (422, _REQUEST, "session_unresumable")
_WORKER_GONE = (503, _SERVER, "worker_unavailable")

ERRORS: tuple[ErrorCode, ...] = (
    # class, sent by the worker?, HTTP status, OpenAI error type, OpenAI error code
    ErrorCode(InvalidArgument, _WIRE, 400, _REQUEST, "invalid_value"),
    ErrorCode(NotReady, _WIRE, *_WORKER_GONE),
    ErrorCode(SessionNotFound, _WIRE, 404, _REQUEST, "session_not_found"),
    ErrorCode(SessionExists, _WIRE, 500, _SERVER, "session_exists"),  # the server names sessions itself
    ErrorCode(SessionBusy, _WIRE, 409, _REQUEST, "session_busy"),
    ErrorCode(CapacityExhausted, _WIRE, 429, _RATE, "capacity"),
    ErrorCode(ContextOverflow, _WIRE, 400, _REQUEST, "context_length_exceeded"),
    ErrorCode(SlowConsumer, _WIRE, 500, _SERVER, "slow_consumer"),
    ErrorCode(InternalError, _WIRE, 500, _SERVER, "internal"),
    ErrorCode(ProtocolError, _WIRE, 500, _SERVER, "protocol"),
    ErrorCode(Unsaveable, _WIRE, 409, _REQUEST, "unsaveable"),
    ErrorCode(CheckpointRejected, _WIRE, *_UNRESUMABLE),
    ErrorCode(CheckpointError, _WIRE, *_UNRESUMABLE),
    ErrorCode(CheckpointNotFound, _WIRE, *_UNRESUMABLE),
    ErrorCode(CheckpointCorrupt, _WIRE, *_UNRESUMABLE),
    ErrorCode(CheckpointIncompatible, _WIRE, *_UNRESUMABLE),
    ErrorCode(CheckpointTooLarge, _WIRE, *_UNRESUMABLE),
    ErrorCode(CheckpointUnsafePath, _WIRE, *_UNRESUMABLE),
    # The system failed a read or write: the files are not known to be bad, so nothing invites
    # deleting the session; the message names the reason (disk full, read-only, ...).
    ErrorCode(CheckpointWriteError, _WIRE, 503, _SERVER, "checkpoint_write_error"),
    ErrorCode(CheckpointReadError, _WIRE, 503, _SERVER, "checkpoint_read_error"),
    ErrorCode(WorkerDiedError, _CLIENT, *_WORKER_GONE),
    ErrorCode(OperationCancelled, _CLIENT, 500, _SERVER, "cancelled"),
    ErrorCode(ClientClosedError, _CLIENT, *_WORKER_GONE),
    ErrorCode(StorePermissionError, _CLIENT, 500, _SERVER, "store_permission"),  # the operator's to fix
    ErrorCode(ConfigurationMismatch, _CLIENT, *_UNRESUMABLE),
    ErrorCode(StoreBusy, _CLIENT, 503, _SERVER, "store_busy"),
    ErrorCode(SaveConflict, _CLIENT, 409, _REQUEST, "save_conflict"),  # "save again": a 409 is retried
    ErrorCode(StoreUnavailable, _CLIENT, 503, _SERVER, "store_unavailable"),
)

#: The wire codes a worker sends and the class :func:`error_from_wire` rebuilds for each.
ERROR_CLASSES: dict[str, type[MuxError]] = {row.code: row.cls for row in ERRORS if row.wire}

_ROW_OF: dict[type, ErrorCode] = {row.cls: row for row in ERRORS}


def error_code_of(exc: BaseException | type[BaseException]) -> ErrorCode | None:
    """The row of an exception (or class): its nearest ancestor in :data:`ERRORS`; None when it
    is not a :class:`MuxError` (the bare base, too, has no row: it is sent as ``internal``)."""
    cls = exc if isinstance(exc, type) else type(exc)
    for klass in cls.__mro__:
        row = _ROW_OF.get(klass)
        if row is not None:
            return row
    return None


def error_from_wire(code: str, message: str, reason: str | None = None) -> MuxError:
    """The exception an ``error`` message stands for; an unknown code (or one that is never sent)
    becomes :class:`InternalError` naming it. ``reason`` (a file error's ``disk_full``, ...) is
    given to the classes that carry one."""
    cls = ERROR_CLASSES.get(code)
    if cls is None:
        return InternalError(f"unknown error code {code!r}: {message}")
    if issubclass(cls, _OSFailure) and reason is not None:
        return cls(message, reason=reason)
    return cls(message)


def error_table() -> str:
    """The error-code table of docs/PROTOCOL.md, generated from :data:`ERRORS`."""
    lines = [
        "| code | class | sent | HTTP status: OpenAI code | meaning |",
        "|---|---|---|---|---|",
    ]
    for row in ERRORS:
        sender = "by the worker" if row.wire else "never: the client's own"
        cells = [f"`{row.code}`", f"`{row.cls.__name__}`", sender, f"{row.status}: `{row.http_code}`", row.meaning]
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join(lines) + "\n"
