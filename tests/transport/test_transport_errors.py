"""The error hierarchy and its wire codes."""

from __future__ import annotations

import pytest

from muxworker import transport
from muxworker.transport import (
    ERROR_CLASSES,
    InternalError,
    InvalidArgument,
    MuxError,
    ProtocolError,
    error_control,
    error_from_wire,
    validate,
)

EXPECTED_CODES = {
    "InvalidArgument": "invalid_argument",
    "NotReady": "not_ready",
    "SessionNotFound": "session_not_found",
    "SessionExists": "session_exists",
    "SessionBusy": "session_busy",
    "CapacityExhausted": "capacity_exhausted",
    "ContextOverflow": "context_overflow",
    "SlowConsumer": "slow_consumer",
    "InternalError": "internal",
    "ProtocolError": "protocol",
    "Unsaveable": "unsaveable",
    "CheckpointRejected": "checkpoint_rejected",
}


@pytest.mark.parametrize("name, code", EXPECTED_CODES.items())
def test_each_class_has_one_code_and_a_one_line_docstring(name, code):
    cls = getattr(transport, name)
    assert issubclass(cls, MuxError)
    assert cls.code == code
    assert ERROR_CLASSES[code] is cls
    doc = cls.__doc__ or ""
    assert doc.strip() and "\n" not in doc.strip()


# The checkpoint file errors (transport/checkpoint/errors.py): a worker sends them when it reads
# or writes a file passed to it.
FILE_ERROR_CODES = {
    "CheckpointError": "checkpoint_error",
    "CheckpointNotFound": "checkpoint_not_found",
    "CheckpointCorrupt": "checkpoint_corrupt",
    "CheckpointIncompatible": "checkpoint_incompatible",
    "CheckpointTooLarge": "checkpoint_too_large",
    "CheckpointUnsafePath": "checkpoint_unsafe_path",
    "CheckpointWriteError": "checkpoint_write_error",
    "CheckpointReadError": "checkpoint_read_error",
}


def test_mapping_is_exactly_the_wire_codes():
    import muxworker.transport.checkpoint as checkpoint

    assert set(ERROR_CLASSES) == set(EXPECTED_CODES.values()) | set(FILE_ERROR_CODES.values())
    assert len(set(ERROR_CLASSES.values())) == len(ERROR_CLASSES)
    for name, code in FILE_ERROR_CODES.items():
        assert ERROR_CLASSES[code] is getattr(checkpoint, name, None) or ERROR_CLASSES[code].__name__ == name


@pytest.mark.parametrize("code", sorted(EXPECTED_CODES.values()))
def test_round_trip_through_an_error_message(code):
    exc = ERROR_CLASSES[code]("session 'a' is busy")
    control = error_control(42, exc)
    assert control == {"kind": "error", "id": 42, "code": code, "message": "session 'a' is busy"}
    validate(control, sender="worker")
    back = error_from_wire(control["code"], control["message"])
    assert type(back) is type(exc)
    assert back.message == str(back) == "session 'a' is busy"


def test_unknown_code_becomes_internal_error_naming_it():
    exc = error_from_wire("quota_exceeded", "too many requests")
    assert type(exc) is InternalError
    assert "quota_exceeded" in str(exc) and "too many requests" in str(exc)


def test_non_mux_exceptions_are_sent_as_internal():
    control = error_control(0, KeyError("x"))
    assert control["code"] == "internal"
    assert control["message"] == "KeyError: 'x'"
    validate(control, sender="worker")  # id 0: not tied to a request


def test_errors_are_catchable_by_base_and_carry_no_code_confusion():
    with pytest.raises(MuxError):
        raise InvalidArgument("bad")
    assert not issubclass(ProtocolError, InvalidArgument)
    assert MuxError().message == ""
