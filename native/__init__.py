"""Native helpers built with cffi at install time.

``crc32c(data, seed=0)`` computes CRC32C (Castagnoli) over any object that exposes the buffer
protocol (bytes, bytearray, memoryview, numpy arrays, mmap) without copying it, with the GIL
released. It is incremental: ``crc32c(b, crc32c(a)) == crc32c(a + b)``.
"""
from __future__ import annotations

from ._crc32c import ffi as _ffi, lib as _lib

__all__ = ["crc32c", "crc32c_software", "crc32c_implementation"]


def _as_cdata(data: object):
    if isinstance(data, (bytes, bytearray)):
        return _ffi.from_buffer("unsigned char[]", data), len(data)
    mv = memoryview(data)  # type: ignore[arg-type]
    if not mv.c_contiguous:
        raise ValueError("crc32c needs a C-contiguous buffer")
    nbytes = mv.nbytes
    if mv.ndim != 1 or mv.itemsize != 1:
        mv = mv.cast("B") if nbytes else memoryview(b"")
    return _ffi.from_buffer("unsigned char[]", mv), nbytes


def crc32c(data: object, seed: int = 0) -> int:
    """CRC32C of ``data`` continuing from ``seed`` (the CRC of the bytes before it)."""
    if not 0 <= seed <= 0xFFFFFFFF:
        raise ValueError(f"seed must be a 32-bit unsigned integer, got {seed!r}")
    buf, n = _as_cdata(data)
    return int(_lib.mux_crc32c(seed, buf, n))


def crc32c_software(data: object, seed: int = 0) -> int:
    """The portable table implementation (for tests and machines without the instruction)."""
    if not 0 <= seed <= 0xFFFFFFFF:
        raise ValueError(f"seed must be a 32-bit unsigned integer, got {seed!r}")
    buf, n = _as_cdata(data)
    return int(_lib.mux_crc32c_sw(seed, buf, n))


def crc32c_implementation() -> str:
    """'hardware' when the CPU's CRC32C instruction is used, else 'software'."""
    return "hardware" if _lib.mux_crc32c_hw_available() else "software"
