"""cffi (API mode) build script for the CRC32C extension, run by setuptools at install time."""
from __future__ import annotations

import os
import platform

from cffi import FFI

_HERE = os.path.dirname(os.path.abspath(__file__))

ffibuilder = FFI()
ffibuilder.cdef(
    """
    uint32_t mux_crc32c(uint32_t crc, const unsigned char *buf, size_t len);
    uint32_t mux_crc32c_sw(uint32_t crc, const unsigned char *buf, size_t len);
    int mux_crc32c_hw_available(void);
    """
)

_machine = platform.machine().lower()
_extra_compile_args = ["-O3"]
if _machine in ("x86_64", "amd64"):
    # Only the hardware function gets SSE4.2 (via a target attribute); the rest stays portable.
    pass
elif _machine in ("aarch64", "arm64"):
    _extra_compile_args.append("-march=armv8-a+crc")

with open(os.path.join(_HERE, "crc32c.c"), encoding="utf-8") as _f:
    _source = _f.read()

ffibuilder.set_source(
    "muxworker.native._crc32c",
    _source,
    extra_compile_args=_extra_compile_args,
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
