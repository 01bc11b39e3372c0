"""The frame format itself, without I/O: encoder, sans-I/O decoder, limits, payload references."""

from __future__ import annotations

import random
import struct

import msgpack
import numpy as np
import pytest
from helpers.wire import assert_same_frame, frames, payload_bytes
from hypothesis import given, settings
from hypothesis import strategies as st

from muxworker.transport import (
    DEFAULT_LIMITS,
    DTYPES,
    HEADER_SIZE,
    MAGIC,
    PROTOCOL_VERSION,
    Frame,
    FrameDecoder,
    FrameLimits,
    InvalidArgument,
    ProtocolError,
    attach_payload,
    encode_frame,
    payload_array,
)

GiB = 1 << 30
MiB = 1 << 20


def wire(frame: Frame, limits: FrameLimits = DEFAULT_LIMITS) -> bytes:
    return b"".join(memoryview(b).tobytes() for b in encode_frame(frame, limits))


def test_header_layout_is_fixed_little_endian():
    payloads = [b"abc", np.arange(2, dtype="<u8")]
    data = wire(Frame({"kind": "x"}, payloads))
    body = msgpack.packb({"kind": "x"})
    assert data[:4] == MAGIC == b"MXWF"
    assert (data[4], data[5]) == PROTOCOL_VERSION == (1, 1)
    assert struct.unpack_from("<HII", data, 6) == (0, len(body), 2)
    assert HEADER_SIZE == 16
    assert struct.unpack_from("<2Q", data, 16) == (3, 16)
    assert data[32 : 32 + len(body)] == body
    assert data[32 + len(body) :] == b"abc" + np.arange(2, dtype="<u8").tobytes()


def _decode_in_chunks(data: bytes, rng: random.Random, decoder: FrameDecoder | None = None) -> list[Frame]:
    """Feed ``data`` through feed() in random chunk sizes (as a trio stream would)."""
    decoder = decoder or FrameDecoder()
    out: list[Frame] = []
    pos = 0
    while True:
        while (frame := decoder.next_frame()) is not None:
            out.append(frame)
        if pos == len(data):
            decoder.eof()
            return out
        n = min(rng.randint(1, 100_000), decoder.space(), len(data) - pos)
        decoder.feed(data[pos : pos + n])
        pos += n


def _decode_with_partial_reads(data: bytes, rng: random.Random) -> list[Frame]:
    """Drive read_targets()/commit() the way the fd loop does, with short reads of random size."""
    decoder = FrameDecoder()
    out: list[Frame] = []
    pos = 0
    while True:
        while (frame := decoder.next_frame()) is not None:
            out.append(frame)
        if pos == len(data):
            decoder.eof()
            return out
        targets = decoder.read_targets(max_buffers=rng.choice([2, 3, 1024]))
        n = min(rng.randint(1, sum(len(t) for t in targets)), len(data) - pos)
        left = n
        for target in targets:
            take = min(len(target), left)
            target[:take] = data[pos : pos + take]
            pos += take
            left -= take
        decoder.commit(n)


@settings(max_examples=80, deadline=None)
@given(batch=st.lists(frames, min_size=1, max_size=4), seed=st.integers(0, 2**32 - 1))
def test_decoder_round_trip_under_any_split(batch, seed):
    data = b"".join(wire(f) for f in batch)
    rng = random.Random(seed)
    for decode in (_decode_in_chunks, _decode_with_partial_reads):
        got = decode(data, rng)
        assert len(got) == len(batch)
        for g, f in zip(got, batch):
            assert_same_frame(g, f)


def test_received_payloads_are_writable_byte_views():
    frame = Frame({"kind": "x"}, [b"", b"12345", np.zeros(3, np.float32)])
    (got,) = _decode_in_chunks(wire(frame), random.Random(0))
    for view in got.payloads:
        assert isinstance(view, memoryview)
        assert view.format == "B" and view.ndim == 1 and not view.readonly
    assert payload_bytes(got) == [b"", b"12345", bytes(12)]


def test_large_payload_is_read_directly_into_its_buffer():
    """Only the bytes staged before the payload began are copied; the rest is read in place."""
    allocated: list[np.ndarray] = []

    def allocate(n: int) -> np.ndarray:
        allocated.append(np.empty(n, dtype=np.uint8))
        return allocated[-1]

    payload = np.random.default_rng(1).integers(0, 256, 4 * MiB, dtype=np.uint8)
    data = wire(Frame({"kind": "x"}, [payload]))
    decoder = FrameDecoder(allocate=allocate)
    pos = 0
    direct = 0
    while (frame := decoder.next_frame()) is None:
        targets = decoder.read_targets()
        if len(targets) > 1:  # a payload buffer comes first, the staging buffer last
            assert np.shares_memory(np.asarray(targets[0]), allocated[0])
            direct += len(targets[0])
        n = min(sum(len(t) for t in targets), len(data) - pos)
        left = n
        for target in targets:
            take = min(len(target), left)
            target[:take] = data[pos : pos + take]
            pos += take
            left -= take
        decoder.commit(n)
    staging = 64 * 1024 + HEADER_SIZE + 8 * DEFAULT_LIMITS.max_payloads
    assert direct >= len(payload) - staging
    assert np.shares_memory(np.asarray(frame.payloads[0]), allocated[0])
    assert np.array_equal(np.asarray(frame.payloads[0]), payload)


def test_allocate_hook_gets_exact_sizes_after_limits_pass():
    sizes: list[int] = []

    def allocate(n: int) -> bytearray:
        sizes.append(n)
        return bytearray(n + 10)  # larger buffers are fine; the frame sees exactly n bytes

    frame = Frame({"kind": "x"}, [b"a" * 5, b"", b"b" * 70_000])
    (got,) = _decode_in_chunks(wire(frame), random.Random(2), FrameDecoder(allocate=allocate))
    assert sizes == [5, 70_000]  # zero-length payloads need no allocation
    assert payload_bytes(got) == [b"a" * 5, b"", b"b" * 70_000]


def test_allocate_hook_must_return_a_writable_buffer():
    decoder = FrameDecoder(allocate=lambda n: bytes(n))
    decoder.feed(wire(Frame({"kind": "x"}, [b"abc"])))
    with pytest.raises(ValueError, match="writable"):
        decoder.next_frame()
    with pytest.raises(ProtocolError, match="unusable"):
        decoder.next_frame()


def test_tuples_are_sent_as_arrays():
    frame = Frame({"kind": "x", "t": (1, (2, 3))})
    (got,) = _decode_in_chunks(wire(frame), random.Random(0))
    assert got.control == {"kind": "x", "t": [1, [2, 3]]}


# --- limits ---------------------------------------------------------------------------------


def test_default_limits():
    limits = FrameLimits()
    assert limits.max_control_bytes == 1 * MiB
    assert limits.max_payloads == 1024
    assert limits.max_payload_bytes == 64 * MiB
    assert limits.max_depth == 32
    assert limits.payload_limit("generate") == 64 * MiB
    assert limits.payload_limit(None) == 64 * MiB
    assert limits.payload_limit("restore") == 64 * MiB  # no kind is special: checkpoints travel as files
    assert limits.payload_ceiling == 64 * MiB
    assert limits.to_dict()["kind_payload_bytes"] == {}
    msgpack.packb(limits.to_dict())  # fits in a hello


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_control_bytes": 0},
        {"max_payloads": -1},
        {"max_depth": 0},
        {"max_payload_bytes": -5},
        {"kind_payload_bytes": {"restore": -1}},
        {"max_control_bytes": 1.5},
    ],
)
def test_limits_reject_nonsense(kwargs):
    with pytest.raises(ValueError):
        FrameLimits(**kwargs)


def test_limits_are_immutable():
    limits = FrameLimits(kind_payload_bytes={"restore": 10})
    with pytest.raises(TypeError):
        limits.kind_payload_bytes["restore"] = 11  # type: ignore[index]


# --- encoder refuses what the decoder would refuse, before writing anything ----------------------


@pytest.mark.parametrize(
    "frame, limits, match",
    [
        (Frame({"kind": "x", "blob": b"x" * (MiB + 1)}), DEFAULT_LIMITS, "max_control_bytes"),
        (Frame({"kind": "x"}, [b""] * 3), FrameLimits(max_payloads=2), "max_payloads"),
        (Frame({"kind": "x"}, [b"12", b"345"]), FrameLimits(max_payload_bytes=4), "over its limit of 4"),
        (
            Frame({"kind": "generate"}, [b"12345"]),
            FrameLimits(max_payload_bytes=4, kind_payload_bytes={"restore": 9}),
            "limit of 4",
        ),
        (Frame({"kind": "x", 1: "int key"}), DEFAULT_LIMITS, "keys must be strings"),
        (Frame({"kind": "x", "v": {1, 2}}), DEFAULT_LIMITS, "not a plain msgpack type"),
        (Frame({"kind": "x", "v": np.int64(3)}), DEFAULT_LIMITS, "not a plain msgpack type"),
        (Frame({"kind": "x", "v": 2**64}), DEFAULT_LIMITS, "cannot be encoded"),
        (Frame([1, 2]), DEFAULT_LIMITS, "must be a msgpack map"),  # type: ignore[arg-type]
    ],
)
def test_encoder_rejects(frame, limits, match):
    with pytest.raises(ProtocolError, match=match):
        encode_frame(frame, limits)


def test_encoder_allows_kind_specific_payload_limit():
    limits = FrameLimits(max_payload_bytes=4, kind_payload_bytes={"restore": 9})
    encode_frame(Frame({"kind": "restore"}, [b"123456789"]), limits)


def _nested(depth: int) -> dict:
    control: dict = {"kind": "x"}
    node = control
    for _ in range(depth - 1):
        node["n"] = {}
        node = node["n"]
    return control


def test_encoder_depth_limit():
    encode_frame(Frame(_nested(32)))
    with pytest.raises(ProtocolError, match="max_depth=32"):
        encode_frame(Frame(_nested(33)))
    cyclic: dict = {"kind": "x"}
    cyclic["self"] = cyclic
    with pytest.raises(ProtocolError, match="max_depth"):
        encode_frame(Frame(cyclic))


def test_encoder_rejects_non_contiguous_payloads():
    with pytest.raises(ValueError, match="C-contiguous"):
        encode_frame(Frame({"kind": "x"}, [np.arange(10)[::2]]))
    with pytest.raises(TypeError, match="buffer protocol"):
        encode_frame(Frame({"kind": "x"}, ["text"]))


def test_encoder_does_not_copy_payloads():
    payload = np.arange(1000, dtype=np.float32).reshape(10, 100)
    buffers = encode_frame(Frame({"kind": "x"}, [payload]))
    assert len(buffers) == 2
    assert np.shares_memory(np.asarray(buffers[1]), payload)


# --- payload references -----------------------------------------------------------------------


@pytest.mark.parametrize("name", [n for n in DTYPES if n != "bfloat16"])
def test_attach_and_view_every_dtype(name):
    array = (np.arange(24) % 2).astype(DTYPES[name]).reshape(2, 3, 4)
    payloads: list = []
    ref = attach_payload(payloads, array)
    assert ref == {"payload": 0, "dtype": name, "shape": [2, 3, 4]}
    (got,) = _decode_in_chunks(wire(Frame({"kind": "x", "a": ref}, payloads)), random.Random(0))
    view = payload_array(got, got.control["a"])
    assert view.dtype == DTYPES[name] and view.shape == (2, 3, 4)
    assert np.array_equal(view, array)
    assert np.shares_memory(view, np.asarray(got.payloads[0]))  # zero copy
    assert view.flags.writeable


def test_attach_raw_buffers_and_scalars():
    payloads: list = []
    assert attach_payload(payloads, b"hello") == {"payload": 0, "dtype": "uint8", "shape": [5]}
    assert attach_payload(payloads, np.float64(2.5)) == {"payload": 1, "dtype": "float64", "shape": []}
    assert attach_payload(payloads, np.zeros((0, 4), np.int32))["shape"] == [0, 4]
    frame = Frame({"kind": "x"}, payloads)
    assert payload_array(frame, {"payload": 1, "dtype": "float64", "shape": []}) == 2.5
    assert payload_array(frame, {"payload": 2, "dtype": "int32", "shape": [0, 4]}).shape == (0, 4)


def test_bfloat16_travels_as_uint16():
    torch = pytest.importorskip("torch")
    tensor = torch.tensor([1.0, -2.5, 3.0e10], dtype=torch.bfloat16)
    payloads: list = []
    ref = attach_payload(payloads, tensor.view(torch.int16).numpy(), dtype="bfloat16")
    assert ref["dtype"] == "bfloat16"
    (got,) = _decode_in_chunks(wire(Frame({"kind": "x", "r": ref}, payloads)), random.Random(0))
    view = payload_array(got, got.control["r"])
    assert view.dtype == np.uint16
    assert torch.equal(torch.from_numpy(view).view(torch.bfloat16), tensor)


def test_torch_numpy_views_are_accepted_without_copy():
    torch = pytest.importorskip("torch")
    tensor = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    payloads: list = []
    ref = attach_payload(payloads, tensor.numpy())
    buffers = encode_frame(Frame({"kind": "x", "t": ref}, payloads))
    assert np.shares_memory(np.asarray(buffers[1]), tensor.numpy())
    (got,) = _decode_in_chunks(b"".join(memoryview(b).tobytes() for b in buffers), random.Random(0))
    assert torch.equal(torch.from_numpy(payload_array(got, got.control["t"])), tensor)


@pytest.mark.parametrize(
    "data, dtype, match",
    [
        (np.arange(10)[::2], None, "C-contiguous"),
        (np.zeros(3, ">i4"), None, "no wire dtype"),
        (np.zeros(3, np.complex64), None, "no wire dtype"),
        (np.zeros(3, np.int32), "bfloat16", "cannot be sent as"),
        (np.zeros(3, np.int16), "complex", "unknown payload dtype"),
    ],
)
def test_attach_payload_rejects(data, dtype, match):
    with pytest.raises(ValueError, match=match):
        attach_payload([], data, dtype=dtype)


@pytest.mark.parametrize(
    "ref, match",
    [
        ({"payload": 1, "dtype": "int32", "shape": [2]}, "not one of the frame's 1 payloads"),
        ({"payload": -1, "dtype": "int32", "shape": [2]}, "not one of"),
        ({"payload": True, "dtype": "int32", "shape": [2]}, "not one of"),
        ({"payload": 0, "dtype": "int33", "shape": [2]}, "unknown payload dtype"),
        ({"payload": 0, "dtype": "int32", "shape": [3]}, "has 8 bytes but int32\\[3\\] needs 12"),
        ({"payload": 0, "dtype": "int32", "shape": [-2]}, "non-negative"),
        ({"payload": 0, "dtype": "int32", "shape": 2}, "list"),
        ({"payload": 0, "dtype": "int32"}, "exactly payload, dtype, shape"),
        ({"payload": 0, "dtype": "int32", "shape": [2], "x": 1}, "exactly payload, dtype, shape"),
        ([0, "int32", [2]], "exactly payload, dtype, shape"),
    ],
)
def test_payload_array_rejects_bad_references(ref, match):
    frame = Frame({"kind": "x"}, [np.zeros(2, np.int32)])
    with pytest.raises(InvalidArgument, match=match):
        payload_array(frame, ref)


# --- screening a frame from its header ------------------------------------------------------


def test_a_screened_frame_is_handed_out_before_its_payloads_which_are_skipped_unallocated():
    from muxworker.transport.errors import ContextOverflow

    allocated: list[int] = []

    def allocate(n: int):
        allocated.append(n)
        return np.empty(n, np.uint8)

    def screen(control, lengths):
        return ContextOverflow("too long") if control.get("big") else None

    big = wire(Frame({"kind": "generate", "id": 1, "big": True}, [np.zeros(300_000, np.int32)]))
    small = Frame({"kind": "generate", "id": 2}, [np.arange(3, dtype=np.int32)])
    # Header, lengths and control map: the same frame with an empty payload has exactly those.
    head = len(wire(Frame({"kind": "generate", "id": 1, "big": True}, [b""])))
    decoder = FrameDecoder(allocate=allocate, screen=screen)
    # Only the header and the control map have arrived: the refusal is already known.
    decoder.feed(big[:head])
    refused = decoder.next_frame()
    assert refused is not None and refused.payloads == [] and isinstance(refused.refused, ContextOverflow)
    assert refused.control["id"] == 1 and not decoder.at_boundary
    # The payload bytes are dropped as they come, in chunks of any size, and the next frame decodes.
    rest = big[head:] + wire(small)
    (got,) = _decode_in_chunks(rest, random.Random(3), decoder)
    assert got.control == small.control and got.refused is None
    assert bytes(got.payloads[0]) == np.arange(3, dtype=np.int32).tobytes()
    assert allocated == [12]  # never the refused frame's 1.2 MB
    assert decoder.at_boundary


def test_eof_inside_a_skipped_payload_is_a_truncated_frame():
    decoder = FrameDecoder(screen=lambda control, lengths: ValueError("no"))
    data = wire(Frame({"kind": "x"}, [b"abcdef"]))
    decoder.feed(data[:-2])
    assert decoder.next_frame().refused is not None
    assert decoder.next_frame() is None
    with pytest.raises(ProtocolError, match="truncated frame.*refused frame"):
        decoder.eof()
