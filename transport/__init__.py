"""The wire between the client and the worker, shared by both ends.

A frame is a fixed little-endian header, a msgpack control map and zero or more raw payloads
(docs/PROTOCOL.md). The worker uses the blocking fd end (:class:`FdFrameReader`,
:class:`FdFrameWriter`), the client the trio end (:class:`TrioFrameReader`,
:class:`TrioFrameWriter`); :func:`validate` checks every message kind against one table, and
:mod:`.errors` holds the error classes and the one table of their codes (:data:`ERRORS`: who sends
each, and its HTTP status). :mod:`.messages` holds the typed contracts (every request, the result,
the hello) that the schema is checked against, and :mod:`.checkpoint` the checkpoint's data model,
file format and identity.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .errors import (
    ERROR_CLASSES,
    ERRORS,
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
from .fdio import FDS_ENV, PIPE_SIZE, FdFrameReader, FdFrameWriter, WorkerPipes, make_pipe, worker_fd_args, worker_fds
from .framing import (
    DEFAULT_LIMITS,
    DTYPES,
    HEADER_SIZE,
    MAGIC,
    PROTOCOL_VERSION,
    Frame,
    FrameDecoder,
    FrameLimits,
    attach_payload,
    encode_frame,
    payload_array,
)
from .messages import RESULT_FIELDS, GenerateRequest, GenerationResult, ModelInfo, WorkerInfo
from .schema import (
    MAX_CACHE_SALT_BYTES,
    MAX_REQUEST_ID,
    MAX_SESSION_ID_BYTES,
    MESSAGES,
    check_hello,
    error_control,
    hello_control,
    validate,
)

if TYPE_CHECKING:
    from .trio_stream import TrioFrameReader, TrioFrameWriter


def __getattr__(name: str) -> Any:
    # The trio end is imported on first use: the worker process never needs trio (70 ms of its start).
    if name in ("TrioFrameReader", "TrioFrameWriter"):
        from . import trio_stream

        return getattr(trio_stream, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    # errors
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
    "ERRORS",
    "ERROR_CLASSES",
    "error_from_wire",
    # framing
    "MAGIC",
    "PROTOCOL_VERSION",
    "HEADER_SIZE",
    "DTYPES",
    "FrameLimits",
    "DEFAULT_LIMITS",
    "Frame",
    "FrameDecoder",
    "encode_frame",
    "attach_payload",
    "payload_array",
    # blocking fd end and the fd convention
    "FdFrameReader",
    "FdFrameWriter",
    "PIPE_SIZE",
    "FDS_ENV",
    "make_pipe",
    "WorkerPipes",
    "worker_fd_args",
    "worker_fds",
    # trio end
    "TrioFrameReader",
    "TrioFrameWriter",
    # typed contracts
    "GenerateRequest",
    "GenerationResult",
    "RESULT_FIELDS",
    "ModelInfo",
    "WorkerInfo",
    # schema
    "MESSAGES",
    "MAX_REQUEST_ID",
    "MAX_SESSION_ID_BYTES",
    "MAX_CACHE_SALT_BYTES",
    "validate",
    "check_hello",
    "hello_control",
    "error_control",
]
