"""Native helpers built with cffi at install time.

``crc32c(data, seed=0)`` computes CRC32C (Castagnoli) over any object that exposes the buffer
protocol (bytes, bytearray, memoryview, numpy arrays, mmap) without copying it, with the GIL
released. It is incremental: ``crc32c(b, crc32c(a)) == crc32c(a + b)``.

``all_finite(array)`` tells whether a float32, float16 or bfloat16 array (bfloat16 given as its
uint16 bits, as checkpoints store it, with ``bfloat16=True``) holds no NaN or infinity, at memory
speed and with the GIL released.
"""

from __future__ import annotations

from ._crc32c import ffi as _ffi
from ._crc32c import lib as _lib

__all__ = ["crc32c", "crc32c_software", "crc32c_implementation", "all_finite"]


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


_EXP_MASK16 = {"float16": 0x7C00, "bfloat16": 0x7F80}


def all_finite(array: object, *, bfloat16: bool = False) -> bool:
    """Whether a C-contiguous float array holds only finite values (no NaN, no +-inf).

    ``array``: a numpy float32 or float16 array, or with ``bfloat16=True`` the uint16 bit patterns
    of bfloat16 values (how checkpoints store them)."""
    import numpy as np

    a = np.asarray(array)
    if not a.flags.c_contiguous:
        raise ValueError("all_finite needs a C-contiguous array")
    if bfloat16:
        if a.dtype != np.uint16:
            raise ValueError(f"bfloat16 bits must be uint16, got {a.dtype}")
        mask = _EXP_MASK16["bfloat16"]
    elif a.dtype == np.float16:
        mask = _EXP_MASK16["float16"]
    elif a.dtype == np.float32:
        if not a.size:
            return True
        return bool(_lib.mux_all_finite32(_ffi.from_buffer("uint32_t[]", a), a.size))
    else:
        raise ValueError(f"all_finite checks float32, float16 or bfloat16 bits, got {a.dtype}")
    if not a.size:
        return True
    return bool(_lib.mux_all_finite16(_ffi.from_buffer("uint16_t[]", a), a.size, mask))
