"""Native helpers built with cffi at install time.

``crc32c(data, seed=0)`` computes CRC32C (Castagnoli) over any object that exposes the buffer
protocol (bytes, bytearray, memoryview, numpy arrays, mmap) without copying it, with the GIL
released. It is incremental: ``crc32c(b, crc32c(a)) == crc32c(a + b)``.

``all_finite(array)`` tells whether a float32, float16 or bfloat16 array (bfloat16 given as its
uint16 bits, as checkpoints store it, with ``bfloat16=True``) holds no NaN or infinity, at memory
speed and with the GIL released.

The quantized products and the decode step (quant.c) run on AVX-512 VNNI, AVX2 or portable C, the
best this CPU has, chosen at run time. The environment variable ``MUXWORKER_NATIVE_ISA``
(``portable``, ``avx2``, ``avx512-vnni``; unset or ``auto``: the best) forces one; it is read once
when this module loads, so a worker process inherits it from its parent. Results differ between
instruction sets in the last bits (the order of float additions), so a test of what must not
change (batched vs solo, resumed vs live) holds on each of them. A name this CPU cannot run is
refused, with the message, by the first use of the kernels (``set_threads``, ``qmatmul``): the
CRC and finiteness helpers, which the client uses too, never depend on it.
"""

from __future__ import annotations

import os

from ._native import ffi as _ffi
from ._native import lib as _lib

__all__ = [
    "ISA_ENV",
    "ISA_NAMES",
    "QUANT_TYPES",
    "all_finite",
    "best_isa",
    "crc32c",
    "crc32c_implementation",
    "crc32c_software",
    "fill_qweight",
    "isa",
    "parse_isa",
    "qmatmul",
    "quant_row_bytes",
    "set_isa",
    "set_threads",
]

#: GGML type name -> id, for the types quant.c multiplies in place.
QUANT_TYPES = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}
ISA_NAMES = ("portable", "avx2", "avx512-vnni")  # by level, as quant.c numbers them
ISA_ENV = "MUXWORKER_NATIVE_ISA"
MAX_ROWS = 16  # activation rows per product or forward call (MUX_MAX_M in quant.c)


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


def quant_row_bytes(type_name: str, cols: int) -> int:
    """Bytes of one row of ``cols`` values of a GGUF type quant.c multiplies; ValueError otherwise."""
    if type_name not in QUANT_TYPES:
        raise ValueError(f"no native product for GGUF type {type_name} (have {', '.join(QUANT_TYPES)})")
    n = int(_lib.mux_q_row_bytes(QUANT_TYPES[type_name], cols))
    if n < 0:
        raise ValueError(f"{type_name} rows of {cols} values: not a whole number of blocks")
    return n


def set_threads(n: int) -> None:
    """Threads the quantized products and the decode step use, the caller included."""
    _check_isa()
    if _lib.mux_q_set_threads(int(n)) != 0:
        raise ValueError(f"cannot run {n} native threads")


def best_isa() -> int:
    """The highest level this CPU runs (0 portable, 1 AVX2, 2 AVX-512 VNNI); every lower one runs too."""
    return int(_lib.mux_q_best_isa())


def isa() -> int:
    """The level the kernels use now."""
    return int(_lib.mux_q_isa())


def parse_isa(value: str, best: int) -> int:
    """The level a ``MUXWORKER_NATIVE_ISA`` value names on a CPU whose best level is ``best``;
    ValueError, saying why, for an unknown name or one the CPU cannot run."""
    name = value.strip().lower().replace("_", "-")
    if name in ("", "auto"):
        return best
    levels = {n.replace("-", ""): level for level, n in enumerate(ISA_NAMES)}
    level = levels.get(name.replace("-", ""))
    if level is None:
        raise ValueError(
            f"{ISA_ENV}={value!r} names no instruction set of the native kernels: use auto, {', '.join(ISA_NAMES)}"
        )
    if level > best:
        runs = ", ".join(ISA_NAMES[: best + 1])
        raise ValueError(f"{ISA_ENV}={value}: this CPU cannot run the {ISA_NAMES[level]} kernels (it runs {runs})")
    return level


def _default_isa() -> tuple[int, str | None]:
    """(the level ``MUXWORKER_NATIVE_ISA`` asks for, else the best; why the variable is refused, or None)."""
    best = best_isa()
    try:
        return parse_isa(os.environ.get(ISA_ENV, ""), best), None
    except ValueError as exc:
        return best, str(exc)


_DEFAULT_ISA, _ISA_ERROR = _default_isa()
_lib.mux_q_set_isa(_DEFAULT_ISA)


def _check_isa() -> None:
    """Refuse the kernels while ``MUXWORKER_NATIVE_ISA`` asks for what this CPU cannot run: running
    them on another instruction set than the one asked for would test or serve the wrong thing."""
    if _ISA_ERROR is not None:
        raise ValueError(_ISA_ERROR)


def set_isa(level: int) -> None:
    """Force an instruction set (0 portable, 1 AVX2, 2 AVX-512 VNNI; -1: the default, which is
    ``MUXWORKER_NATIVE_ISA``'s choice or else the best this CPU has)."""
    _check_isa()
    if level < 0:
        level = _DEFAULT_ISA
    if _lib.mux_q_set_isa(int(level)) != 0:
        raise ValueError(f"this CPU cannot run the {ISA_NAMES[level] if 0 <= level < 3 else level} kernels")


def fill_qweight(w, blocks, type_name: str, row_map=None, out_offset: int = 0) -> None:
    """Point the ``mux_qweight`` ``w`` at ``blocks`` (uint8 [rows, row_bytes], rows in their byte
    order) of GGUF type ``type_name``; ``row_map`` (int32 [rows]) gives each row's output column.
    The caller keeps ``blocks`` and ``row_map`` alive as long as ``w`` is used."""
    import numpy as np

    if blocks.ndim != 2 or blocks.dtype != np.uint8 or blocks.strides[1] != 1:
        raise ValueError("weight blocks must be a uint8 [rows, row_bytes] array with contiguous rows")
    w.data = _ffi.cast("const uint8_t *", _addr(blocks))
    w.type = QUANT_TYPES[type_name]
    w.rows = blocks.shape[0]
    w.row_bytes = blocks.strides[0]
    w.out_offset = out_offset
    w.row_map = _ffi.NULL
    if row_map is not None:
        if row_map.dtype != np.int32 or row_map.shape != (blocks.shape[0],) or not row_map.flags.c_contiguous:
            raise ValueError("row_map must be a contiguous int32 array with one entry per row")
        w.row_map = _ffi.cast("const int32_t *", _addr(row_map))


def _addr(a) -> int:
    return int(a.__array_interface__["data"][0])


def qmatmul(blocks, type_name: str, x, row_map=None):
    """``x @ W.T`` for float32 ``x`` [M, K] (M <= MAX_ROWS) and W in GGUF blocks [N, row_bytes]: x is
    rounded to int8 per block of 32 first (the decode step's products; the tests' oracle is that
    rounding times the gguf package's dequantized W). float32 [M, N]."""
    import numpy as np

    _check_isa()
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2 or not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"x must be [M, K] with 1 <= M <= {MAX_ROWS}, got {x.shape}")
    m, k = x.shape
    if blocks.shape[1] < quant_row_bytes(type_name, k):
        raise ValueError(f"{type_name} rows of {k} values need {quant_row_bytes(type_name, k)} bytes")
    n = blocks.shape[0]
    y = np.empty((m, n), dtype=np.float32)
    w = _ffi.new("mux_qweight *")
    fill_qweight(w, blocks, type_name, row_map)
    rc = _lib.mux_qmatmul(w, 1, k, _ffi.cast("const float *", _addr(x)), m, _ffi.cast("float *", _addr(y)), n)
    if rc != 0:
        raise ValueError(f"native product failed ({rc}) for {type_name} [{n}, {k}] x [{m}, {k}]")
    return y
