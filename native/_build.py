"""cffi (API mode) build script for the native extension (CRC32C, finiteness checks, quantized products and
the decode step of quant.c), run by setuptools at install time."""

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

    typedef struct {
        const uint8_t *data;
        int32_t type;
        int32_t rows;
        int64_t row_bytes;
        const int32_t *row_map;
        int32_t out_offset;
    } mux_qweight;
    typedef struct {
        mux_qweight q, k, v, o, gate, up, down;
        const float *bias_q, *bias_k, *bias_v;
        const float *attn_norm, *ffn_norm;
        const float *q_norm, *k_norm, *post_attn_norm, *post_ffn_norm;
        const float *rope_cos, *rope_sin;
        void *k_cache, *v_cache;
        int64_t slot_stride, head_stride;
        int32_t capacity;
        int32_t window;
    } mux_layer;
    typedef struct {
        int32_t n_layers, hidden, n_heads, n_kv, head_dim, inter, vocab, max_pos, cache_bf16;
        int32_t gelu;
        float eps, attn_scale;
        const float *final_norm;
        mux_qweight head;
        const mux_layer *layers;
    } mux_model;
    int mux_q_row_bytes(int ggml_type, int64_t cols);
    int mux_q_best_isa(void);
    int mux_q_set_isa(int level);
    int mux_q_isa(void);
    int mux_q_set_threads(int n);
    int mux_q_threads(void);
    int mux_qmatmul(const mux_qweight *w, int nw, int64_t k, const float *x, int M, float *y, int64_t ldy);
    int mux_forward(const mux_model *m, int n, float *x, const int32_t *pos, const int32_t *slot, int n_logits,
                    const int32_t *logit_rows, float *logits);
    """
)

_machine = platform.machine().lower()
_extra_compile_args = ["-O3", "-fno-math-errno"]
if _machine in ("x86_64", "amd64"):
    # Only the hardware function gets SSE4.2 (via a target attribute); the rest stays portable.
    pass
elif _machine in ("aarch64", "arm64"):
    _extra_compile_args.append("-march=armv8-a+crc")

_source = ""
for _name in ("crc32c.c", "finite.c", "quant.c"):  # one extension module
    with open(os.path.join(_HERE, _name), encoding="utf-8") as _f:
        _source += _f.read() + "\n"

ffibuilder.set_source(
    "muxworker.native._native",
    _source,
    extra_compile_args=_extra_compile_args,
    include_dirs=[_HERE],  # quant.c includes quant_simd.h once per instruction set
    libraries=["m", "pthread"] if os.name == "posix" else [],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
