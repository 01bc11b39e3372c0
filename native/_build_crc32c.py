"""cffi (API mode) build script for the native extension (CRC32C, finiteness checks), run by setuptools at install time."""

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
    int mux_all_finite16(const uint16_t *bits, size_t n, uint16_t exp_mask);
    int mux_all_finite32(const uint32_t *bits, size_t n);
    """
)

_machine = platform.machine().lower()
_extra_compile_args = ["-O3"]
if _machine in ("x86_64", "amd64"):
    # Only the hardware function gets SSE4.2 (via a target attribute); the rest stays portable.
    pass
elif _machine in ("aarch64", "arm64"):
    _extra_compile_args.append("-march=armv8-a+crc")

_source = ""
for _name in ("crc32c.c", "finite.c"):  # one extension module, two sources
    with open(os.path.join(_HERE, _name), encoding="utf-8") as _f:
        _source += _f.read() + "\n"

ffibuilder.set_source(
    "muxworker.native._crc32c",
    _source,
    extra_compile_args=_extra_compile_args,
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
