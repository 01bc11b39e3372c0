"""The error hierarchy, its wire codes and the one table of them (transport/errors.py)."""

from __future__ import annotations

import errno

import pytest

from muxworker import transport
from muxworker.transport import (
    DEFAULT_LIMITS,
    ERROR_CLASSES,
    Frame,
    FrameDecoder,
    InternalError,
    InvalidArgument,
    MuxError,
    ProtocolError,
    encode_frame,
    error_control,
    error_from_wire,
    validate,
)
from muxworker.transport.checkpoint.errors import _REASONS, CheckpointMalformed, CheckpointRetentionError, os_failure
from muxworker.transport.errors import (
    ERRORS,
    CheckpointRejected,
    CheckpointWriteError,
    ErrorCode,
    _OSFailure,
    error_code_of,
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


# --- the one table of codes -----------------------------------------------------------------


def _subclasses(cls: type) -> set[type]:
    out = set()
    for sub in cls.__subclasses__():
        out |= {sub} | _subclasses(sub)
    return out


def test_every_class_that_declares_a_code_has_exactly_one_row():
    import muxworker.client  # noqa: F401  (defines its own subclasses: EvictionFailed, ...)
    import muxworker.transport.checkpoint  # noqa: F401

    owners = {cls for cls in _subclasses(MuxError) if "code" in vars(cls)}
    assert owners == {row.cls for row in ERRORS}
    assert len({row.cls for row in ERRORS}) == len({row.code for row in ERRORS}) == len(ERRORS)
    for row in ERRORS:
        # Defined once, beside the table; every other module re-exports it.
        assert row.cls.__module__ == "muxworker.transport.errors", row
        assert row.cls.__doc__ and "\n" not in row.cls.__doc__.strip(), row
        assert 400 <= row.status < 600 and row.type and row.http_code, row
        assert (row.type == "server_error") == (row.status >= 500), row
    assert ERROR_CLASSES == {row.code: row.cls for row in ERRORS if row.wire}


def _through_the_wire(control: dict) -> dict:
    """``control`` as the client reads it: encoded into a frame's bytes, decoded, validated."""
    data = b"".join(memoryview(part).tobytes() for part in encode_frame(Frame(control), DEFAULT_LIMITS))
    decoder = FrameDecoder(DEFAULT_LIMITS)
    while (frame := decoder.next_frame()) is None:
        n = min(decoder.space(), len(data))
        assert n, "the frame did not decode"
        decoder.feed(data[:n])
        data = data[n:]
    assert not data
    validate(frame.control, sender="worker")
    return frame.control


def _instance(row: ErrorCode) -> MuxError:
    if issubclass(row.cls, _OSFailure):  # the system's failures carry a reason
        return row.cls("cannot save session 'a': disk full [ENOSPC]", reason="disk_full")
    return row.cls("session 'a' is busy")


@pytest.mark.parametrize("row", ERRORS, ids=lambda row: row.code)
def test_every_class_keeps_its_class_code_and_reason_across_the_wire(row):
    exc = _instance(row)
    control = _through_the_wire(error_control(7, exc))
    back = error_from_wire(control["code"], control["message"], control.get("reason"))
    if row.wire:
        assert type(back) is row.cls and back.code == row.code == control["code"]
        assert str(back) == str(exc)
        assert getattr(back, "reason", None) == getattr(exc, "reason", None)
        assert ("reason" in control) == hasattr(exc, "reason")
    else:
        # Only the client raises it: were it ever sent, it would go as `internal` naming its class,
        # and its code is not one the client rebuilds.
        assert control["code"] == "internal" and row.cls.__name__ in control["message"] and "reason" not in control
        assert type(back) is InternalError
        assert type(error_from_wire(row.code, "x")) is InternalError
    assert error_code_of(exc) is row


@pytest.mark.parametrize("number", sorted(_REASONS))
def test_a_workers_write_error_reaches_the_client_with_its_reason(number):
    reason = _REASONS[number][0]
    exc = os_failure(CheckpointWriteError, OSError(number, "refused"), "cannot save session 'a' (writing)")
    control = _through_the_wire(error_control(3, exc))
    back = error_from_wire(control["code"], control["message"], control.get("reason"))
    assert type(back) is CheckpointWriteError and back.reason == reason and str(back) == str(exc)
    if number == errno.ENOSPC:
        assert reason == "disk_full"


def test_a_class_without_a_code_of_its_own_travels_as_its_ancestor():
    from muxworker.client import EvictionFailed, WorkerStartupError

    for exc, base in [
        (CheckpointMalformed("bad"), CheckpointRejected),
        (CheckpointRetentionError("gone"), CheckpointRejected),
        (EvictionFailed("full"), transport.CapacityExhausted),
    ]:
        control = error_control(1, exc)
        assert type(error_from_wire(control["code"], control["message"])) is base
    assert error_code_of(WorkerStartupError("bad flags")).code == "worker_died"
    # The bare base has no row: sent as `internal`.
    assert error_code_of(MuxError("x")) is None and error_control(1, MuxError("x"))["code"] == "internal"
    assert error_code_of(KeyError("x")) is None
