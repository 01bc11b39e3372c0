"""The client's exceptions: every wire error class, plus the ones only the client raises.

All derive from :class:`MuxError` and are defined, with the table of their codes, in
:mod:`muxworker.transport.errors`. A request error (one class per wire code) ends that request
only; :class:`WorkerDiedError` means the worker is gone, and every pending and later call raises it;
:class:`ClientClosedError` means *you* closed the client; :class:`OperationCancelled` that an
operation was cancelled before it ran. None of those three is ever sent by a worker.
"""

from __future__ import annotations

from muxworker.transport.errors import (
    ERROR_CLASSES,
    CapacityExhausted,
    CheckpointRejected,
    ClientClosedError,
    ContextOverflow,
    InternalError,
    InvalidArgument,
    MuxError,
    NotReady,
    OperationCancelled,
    ProtocolError,
    SessionBusy,
    SessionExists,
    SessionNotFound,
    SlowConsumer,
    Unsaveable,
    WorkerDiedError,
    WorkerStartupError,
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
    "OperationCancelled",
    "ClientClosedError",
]
