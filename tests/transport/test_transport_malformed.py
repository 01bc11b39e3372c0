"""Every malformed-input rule, through the real fd reader on an OS pipe.

Each rule gives ProtocolError naming it; nothing is allocated at a size the limits forbid; a
clean EOF at a frame boundary is a normal end; nothing hangs (the write end is always closed,
so every read ends).
"""

from __future__ import annotations

import os
import random
import struct
import threading
import tracemalloc

import msgpack
import numpy as np
import pytest
from helpers.wire import assert_same_frame
from hypothesis import given, settings
from hypothesis import strategies as st

from muxworker.transport import (
    DEFAULT_LIMITS,
    MAGIC,
    FdFrameReader,
    Frame,
    FrameLimits,
    ProtocolError,
    encode_frame,
)

MiB = 1 << 20


class Allocations:
    """An allocate hook that records sizes and refuses any the limits should have stopped."""

    def __init__(self, limits: FrameLimits = DEFAULT_LIMITS):
        self.limits = limits
        self.sizes: list[int] = []

    def __call__(self, n: int) -> np.ndarray:
        assert 0 < n <= self.limits.payload_ceiling
        self.sizes.append(n)
        assert sum(self.sizes) <= self.limits.payload_ceiling
        return np.empty(n, dtype=np.uint8)


def read_stream(data: bytes, limits: FrameLimits = DEFAULT_LIMITS, allocate=None) -> list[Frame]:
    """The frames the fd reader makes of ``data`` followed by EOF (or the ProtocolError it raises)."""
    r, w = os.pipe()

    def feed() -> None:
        try:
            _write_all(w, data)
        except BrokenPipeError:
            pass  # the reader stopped early, as it should on bad input
        finally:
            os.close(w)

    writer = threading.Thread(target=feed)
    writer.start()
    reader = FdFrameReader(r, limits, allocate=allocate)
    try:
        return list(reader)
    finally:
        reader.close()
        writer.join()


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def header(
    control: bytes = b"",
    lengths: tuple[int, ...] = (),
    *,
    magic: bytes = MAGIC,
    major: int = 1,
    minor: int = 0,
    flags: int = 0,
    control_len: int | None = None,
    count: int | None = None,
) -> bytes:
    return (
        struct.pack(
            "<4sBBHII",
            magic,
            major,
            minor,
            flags,
            len(control) if control_len is None else control_len,
            len(lengths) if count is None else count,
        )
        + struct.pack(f"<{len(lengths)}Q", *lengths)
        + control
    )


def wire(frame: Frame, limits: FrameLimits = DEFAULT_LIMITS) -> bytes:
    return b"".join(memoryview(b).tobytes() for b in encode_frame(frame, limits))


GOOD = Frame({"kind": "tokens", "id": 7, "n": [1, 2, 3]}, [b"abcdef", b"", np.arange(3, dtype=np.int32)])


# --- ends of stream -------------------------------------------------------------------------


def test_empty_stream_is_a_clean_end():
    assert read_stream(b"") == []


def test_eof_after_whole_frames_is_a_clean_end():
    got = read_stream(wire(GOOD) * 3)
    assert len(got) == 3
    for frame in got:
        assert_same_frame(frame, GOOD)


def test_reader_keeps_returning_none_after_the_end():
    r, w = os.pipe()
    os.write(w, wire(GOOD))
    os.close(w)
    with FdFrameReader(r) as reader:
        assert reader.read() is not None
        assert reader.read() is None
        assert reader.read() is None


@pytest.mark.parametrize("cut", range(1, len(wire(GOOD))))
def test_truncated_frame_at_every_byte(cut):
    data = wire(GOOD)
    section = (
        "header"
        if cut < 16
        else "payload length"
        if cut < 16 + 24
        else "control map"
        if cut < len(data) - 18
        else "payload"
    )
    with pytest.raises(ProtocolError, match=f"truncated frame: end of stream after .* {section}"):
        read_stream(data + data[:cut])


def test_truncated_inside_a_large_control_map():
    data = wire(Frame({"kind": "x", "s": "y" * 300_000}))
    with pytest.raises(ProtocolError, match="after 200000 of the 3000.. control map bytes"):
        read_stream(data[: 16 + 200_000])


def test_truncated_inside_a_large_payload():
    data = wire(Frame({"kind": "x"}, [bytes(3 * MiB)]))
    with pytest.raises(ProtocolError, match=f"of the {3 * MiB} bytes of payload 0"):
        read_stream(data[:-1])


# --- header rules ---------------------------------------------------------------------------


@pytest.mark.parametrize("magic", [b"MXWG", b"\x00\x00\x00\x00", b"mxwf", b"HTTP"])
def test_wrong_magic(magic):
    with pytest.raises(ProtocolError, match="bad magic"):
        read_stream(header(msgpack.packb({}), magic=magic))


@pytest.mark.parametrize("major", [0, 2, 255])
def test_wrong_major_version(major):
    with pytest.raises(ProtocolError, match=f"protocol version {major}.0; this end speaks 1.x"):
        read_stream(header(msgpack.packb({}), major=major))


def test_newer_minor_version_is_accepted():
    (frame,) = read_stream(header(msgpack.packb({"kind": "x"}), minor=9))
    assert frame.control == {"kind": "x"}


@pytest.mark.parametrize("flags", [1, 0x8000])
def test_unknown_flags(flags):
    with pytest.raises(ProtocolError, match="unknown header flags"):
        read_stream(header(msgpack.packb({}), flags=flags))


def test_empty_control():
    with pytest.raises(ProtocolError, match="control_len is 0"):
        read_stream(header(b""))


def test_control_over_limit_is_rejected_from_the_header_alone():
    # Only the header is sent: the reader must not wait for (or allocate) the declared bytes.
    with pytest.raises(ProtocolError, match="exceeds max_control_bytes=1048576"):
        read_stream(header(control_len=MiB + 1))
    with pytest.raises(ProtocolError, match="exceeds max_control_bytes=100"):
        read_stream(header(control_len=101), FrameLimits(max_control_bytes=100))


def test_too_many_payloads():
    with pytest.raises(ProtocolError, match="declares 1025 payloads, over max_payloads=1024"):
        read_stream(header(control_len=1, count=1025))
    with pytest.raises(ProtocolError, match="over max_payloads=2"):
        read_stream(header(msgpack.packb({}), (0, 0, 0)), FrameLimits(max_payloads=2))


@pytest.mark.parametrize("declared", [2**60, 2**64 - 1, 16 * (1 << 30) + 1])
def test_huge_payload_is_rejected_before_allocating(declared):
    allocations = Allocations()
    tracemalloc.start()
    try:
        with pytest.raises(ProtocolError, match="over the largest payload limit"):
            read_stream(header(msgpack.packb({"kind": "restore"}), (declared,)), allocate=allocations)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert allocations.sizes == []
    assert peak < 4 * MiB


def test_payload_total_is_bounded_not_just_each_payload():
    lengths = (2**34,) * 1024  # each under 16 GiB, the sum far over
    allocations = Allocations()
    with pytest.raises(ProtocolError, match="over the largest payload limit"):
        read_stream(header(msgpack.packb({}), lengths), allocate=allocations)
    assert allocations.sizes == []


def test_kind_limit_is_checked_after_the_control_map_but_before_allocating():
    limits = FrameLimits(max_payload_bytes=100, kind_payload_bytes={"restore": 1000})
    allocations = Allocations(limits)
    data = header(msgpack.packb({"kind": "generate"}), (600,)) + bytes(600)
    with pytest.raises(ProtocolError, match="'generate' frame declares 600 payload bytes, over its limit of 100"):
        read_stream(data, limits, allocate=allocations)
    assert allocations.sizes == []
    (frame,) = read_stream(header(msgpack.packb({"kind": "restore"}), (600,)) + bytes(600), limits, allocations)
    assert allocations.sizes == [600]
    assert bytes(frame.payloads[0]) == bytes(600)


def test_default_ordinary_frame_limit_is_64_mib():
    allocations = Allocations()
    data = header(msgpack.packb({"kind": "generate"}), (32 * MiB, 32 * MiB + 1))
    with pytest.raises(ProtocolError, match=f"over the largest payload limit of {64 * MiB} bytes"):
        read_stream(data, allocate=allocations)
    assert allocations.sizes == []


# --- control map rules ------------------------------------------------------------------------


def _nested(depth: int) -> dict:
    control: dict = {"kind": "x"}
    node = control
    for _ in range(depth - 1):
        node["n"] = [{}]
        node = node["n"][0]
    return control


@pytest.mark.parametrize(
    "control, match",
    [
        (msgpack.packb([1, 2]), "must be a msgpack map, got list"),
        (msgpack.packb(5), "must be a msgpack map, got int"),
        (msgpack.packb("kind"), "must be a msgpack map, got str"),
        (msgpack.packb(None), "must be a msgpack map, got NoneType"),
        (b"\xc1", "not valid msgpack"),
        (b"\x82\xa1a\x01", "not valid msgpack"),  # a map of 2 entries with 1 inside control_len
        (msgpack.packb({}) + b"\x00", "trailing bytes"),
        (msgpack.packb({1: "x"}), "not valid msgpack"),
        (msgpack.packb({b"kind": "x"}, use_bin_type=True), "keys must be strings, got bytes"),
        (msgpack.packb({"a": {"b": {2.5: 1}}}), "not valid msgpack"),
        (msgpack.packb({"a": msgpack.ExtType(5, b"xy")}), "not valid msgpack"),
        (b"\x81\xa1a\xc7\x00\x05", "not a plain msgpack type"),  # an empty ext value
        (b"\x81\xa1a\xd6\xff\x00\x00\x00\x01", "not valid msgpack"),  # a timestamp
        (b"\x81\xa1a\xa2\xff\xfe", "not valid msgpack"),  # invalid UTF-8 in a str
        (msgpack.packb(_nested(17)), "nested deeper than max_depth=32"),  # 33 levels (map, list, ...)
        (b"\x81\xa1a" + b"\x91" * 5000 + b"\xc0", "nested deeper than max_depth=32"),
    ],
)
def test_bad_control_maps(control, match):
    with pytest.raises(ProtocolError, match=match):
        read_stream(header(control))


def test_depth_32_is_allowed_and_the_limit_is_configurable():
    value: object = 1
    for _ in range(31):
        value = [value]
    deep = {"kind": "x", "d": value}  # the map and 31 lists: 32 levels
    (frame,) = read_stream(header(msgpack.packb(deep)))
    assert frame.control == deep
    four = {"a": [[{"b": 1}]]}
    assert read_stream(header(msgpack.packb(four)), FrameLimits(max_depth=4))[0].control == four
    with pytest.raises(ProtocolError, match="max_depth=4"):
        read_stream(header(msgpack.packb({"a": [[{"b": [1]}]]})), FrameLimits(max_depth=4))


def test_errors_are_sticky():
    r, w = os.pipe()
    os.write(w, header(msgpack.packb({}), magic=b"XXXX") + wire(GOOD))
    os.close(w)
    with FdFrameReader(r) as reader:
        with pytest.raises(ProtocolError, match="bad magic"):
            reader.read()
        with pytest.raises(ProtocolError, match="unusable after an earlier error"):
            reader.read()


# --- random input ---------------------------------------------------------------------------


def _outcome(data: bytes, limits: FrameLimits) -> None:
    """Random input ends in frames and a clean end, or in ProtocolError; nothing else."""
    allocations = Allocations(limits)
    try:
        read_stream(data, limits, allocate=allocations)
    except ProtocolError:
        pass


SMALL = FrameLimits(max_control_bytes=4096, max_payloads=8, max_payload_bytes=4096, kind_payload_bytes={})


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=2048))
def test_random_bytes(data):
    _outcome(data, DEFAULT_LIMITS)


@settings(max_examples=200, deadline=None)
@given(
    major=st.sampled_from([1, 1, 1, 2]),
    flags=st.sampled_from([0, 0, 0, 1]),
    control_len=st.integers(0, 5000),
    count=st.integers(0, 10),
    lengths=st.lists(st.integers(0, 5000) | st.integers(0, 2**64 - 1), max_size=10),
    rest=st.binary(max_size=3000),
)
def test_plausible_headers_with_random_bodies(major, flags, control_len, count, lengths, rest):
    data = header(b"", tuple(lengths), major=major, flags=flags, control_len=control_len, count=count) + rest
    _outcome(data, SMALL)


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), flips=st.integers(1, 4), cut=st.integers(0, 400))
def test_mutated_valid_frames(seed, flips, cut):
    rng = random.Random(seed)
    data = bytearray(wire(GOOD) * 2)
    for _ in range(flips):
        data[rng.randrange(len(data))] = rng.randrange(256)
    _outcome(bytes(data[: len(data) - cut]), SMALL)
