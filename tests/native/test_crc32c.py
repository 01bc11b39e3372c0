"""CRC32C against published vectors and an independent pure-Python reference."""

from __future__ import annotations

import mmap
import os
import platform
import threading
import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from muxworker.native import crc32c, crc32c_implementation, crc32c_software

POLY = 0x82F63B78  # Castagnoli, reflected

IMPLEMENTATIONS = [pytest.param(crc32c, id="dispatch"), pytest.param(crc32c_software, id="software")]


def crc32c_bitwise(data: bytes, crc: int = 0) -> int:
    """The definition, one bit at a time (slow; small inputs only)."""
    crc ^= 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ POLY if crc & 1 else crc >> 1
    return crc ^ 0xFFFFFFFF


def _table() -> list[int]:
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ POLY if c & 1 else c >> 1
        table.append(c)
    return table


_TABLE = _table()


def crc32c_bytewise(data: bytes, crc: int = 0) -> int:
    """Pure-Python table reference (checked against the bitwise one below), for larger inputs."""
    crc ^= 0xFFFFFFFF
    table = _TABLE
    for byte in data:
        crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


# RFC 3720 (iSCSI) appendix B.4, and the common check value.
VECTORS = [
    (bytes(32), 0x8A9136AA),
    (b"\xff" * 32, 0x62A8AB43),
    (bytes(range(32)), 0x46DD794E),
    (bytes(range(31, -1, -1)), 0x113FDB5C),
    (b"123456789", 0xE3069283),
    (b"", 0x00000000),
]


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("data, expected", VECTORS, ids=[f"vector{i}" for i in range(len(VECTORS))])
def test_published_vectors(impl, data, expected):
    assert impl(data) == expected


@pytest.mark.parametrize("data, expected", VECTORS, ids=[f"vector{i}" for i in range(len(VECTORS))])
def test_python_references_agree_with_vectors(data, expected):
    assert crc32c_bitwise(data) == expected
    assert crc32c_bytewise(data) == expected


@settings(max_examples=60, deadline=None)
@given(data=st.binary(max_size=2048), seed=st.integers(0, 0xFFFFFFFF))
def test_random_buffers_match_bitwise_reference(data, seed):
    expected = crc32c_bitwise(data, seed)
    assert crc32c(data, seed) == expected
    assert crc32c_software(data, seed) == expected


# Lengths around the hardware path's 3 x 8192-byte interleaved block and the 8-byte word loop.
BLOCK3 = 3 * 8192
LENGTHS = [
    0,
    1,
    2,
    3,
    7,
    8,
    9,
    15,
    16,
    17,
    63,
    64,
    65,
    8191,
    8192,
    8193,
    BLOCK3 - 1,
    BLOCK3,
    BLOCK3 + 1,
    2 * BLOCK3 + 13,
    3 * BLOCK3 + 5,
]


@pytest.mark.parametrize("length", LENGTHS)
def test_every_alignment_and_block_boundary(length):
    content = np.random.default_rng(length).integers(0, 256, length, dtype=np.uint8).tobytes()
    expected = crc32c_bytewise(content)
    backing = np.zeros(length + 64, dtype=np.uint8)  # numpy data is 16-byte aligned at least
    base = (-backing.ctypes.data) % 16
    for offset in range(16):
        view = backing[base + offset : base + offset + length]
        assert view.ctypes.data % 16 == offset % 16 or length == 0
        view[:] = np.frombuffer(content, dtype=np.uint8)
        assert crc32c(view) == expected, f"hardware/dispatch path, offset {offset}"
        assert crc32c_software(view) == expected, f"software path, offset {offset}"


@settings(max_examples=40, deadline=None)
@given(
    size=st.integers(0, 200_000),
    offset=st.integers(0, 15),
    seed=st.integers(0, 2**32 - 1),
    crc_seed=st.integers(0, 0xFFFFFFFF),
)
def test_hardware_equals_software(size, offset, seed, crc_seed):
    buf = np.random.default_rng(seed).integers(0, 256, size + offset, dtype=np.uint8)[offset:]
    assert crc32c(buf, crc_seed) == crc32c_software(buf, crc_seed)


@settings(max_examples=60, deadline=None)
@given(data=st.binary(max_size=4096), cuts=st.lists(st.integers(0, 4096), max_size=4))
def test_incremental_equals_one_shot(data, cuts):
    points = sorted({min(c, len(data)) for c in cuts} | {0, len(data)})
    for impl in (crc32c, crc32c_software):
        crc = 0
        for a, b in zip(points, points[1:]):
            crc = impl(data[a:b], crc)
        assert crc == impl(data)


def test_incremental_across_the_hardware_block():
    data = np.random.default_rng(7).integers(0, 256, 4 * BLOCK3 + 11, dtype=np.uint8)
    whole = crc32c(data)
    for cut in (1, 7, 8, BLOCK3 - 1, BLOCK3, BLOCK3 + 3, 3 * BLOCK3 + 1):
        assert crc32c(data[cut:], crc32c(data[:cut])) == whole
    assert crc32c_software(data) == whole


def test_implementation_is_reported():
    impl = crc32c_implementation()
    assert impl in ("hardware", "software")
    if platform.machine().lower() in ("x86_64", "amd64") and os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            has_sse42 = "sse4_2" in f.read()
        assert impl == ("hardware" if has_sse42 else "software")


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_accepts_every_buffer_kind(impl, tmp_path):
    raw = bytes(range(256)) * 5
    expected = impl(raw)
    assert impl(bytearray(raw)) == expected
    assert impl(memoryview(raw)) == expected
    assert impl(memoryview(raw).cast("I")) == expected  # a non-byte memoryview format
    assert impl(np.frombuffer(raw, dtype=np.uint8)) == expected
    assert impl(np.frombuffer(raw, dtype=np.int32).reshape(16, 20)) == expected
    assert impl(np.frombuffer(raw, dtype=np.float16)) == expected
    assert impl(np.frombuffer(raw, dtype=">u8")) == expected  # byte order does not matter: bytes do
    readonly = np.frombuffer(raw, dtype=np.uint8)
    assert not readonly.flags.writeable
    assert impl(readonly) == expected
    path = tmp_path / "blob"
    path.write_bytes(raw)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        assert impl(m) == expected
    scalar = np.array(0x0102030405060708, dtype="<u8")  # 0-d array
    assert impl(scalar) == impl(scalar.tobytes())
    assert impl(np.zeros((0, 3), dtype=np.float32)) == 0


def test_does_not_copy_large_buffers():
    big = np.ones(64 << 20, dtype=np.uint8).view(np.int64)  # 64 MiB, non-uint8 dtype
    crc32c(big)  # warm up any lazy initialisation
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for value in (big, memoryview(big), big.reshape(1024, -1)):
            crc32c(value)
            crc32c_software(value)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak - before < 1 << 20


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_rejects_non_contiguous_and_bad_arguments(impl):
    arr = np.arange(100, dtype=np.uint8)
    with pytest.raises(ValueError, match="contiguous"):
        impl(arr[::2])
    with pytest.raises(ValueError, match="contiguous"):
        impl(memoryview(bytes(100))[::3])
    with pytest.raises(ValueError, match="contiguous"):
        impl(np.asfortranarray(np.arange(12, dtype=np.int32).reshape(3, 4)))
    with pytest.raises(TypeError):
        impl("text is not bytes")
    with pytest.raises(ValueError, match="seed"):
        impl(b"x", -1)
    with pytest.raises(ValueError, match="seed"):
        impl(b"x", 1 << 32)


def test_threads_agree():
    """The GIL is released during the computation; concurrent first calls must all be right."""
    data = np.random.default_rng(3).integers(0, 256, 3 * BLOCK3 + 17, dtype=np.uint8)
    expected = crc32c_bytewise(data.tobytes())
    results: list[int] = []

    def work() -> None:
        for _ in range(20):
            results.append(crc32c(data))
            results.append(crc32c_software(data))

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [expected] * len(results)
