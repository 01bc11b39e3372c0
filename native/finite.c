/* Finiteness checks over raw float bits: is any element NaN or infinite?
 *
 * A float is non-finite exactly when its exponent bits are all ones, so the check is one AND and
 * one compare per element on the integer bits, which the compiler vectorizes. The 16-bit form
 * serves bfloat16 (mask 0x7f80) and float16 (mask 0x7c00) alike. It reads each block whole and
 * stops at the first block holding a non-finite value. */
#include <stddef.h>
#include <stdint.h>

#define MUX_FINITE_BLOCK 4096

int mux_all_finite16(const uint16_t *bits, size_t n, uint16_t exp_mask) {
    for (size_t i = 0; i < n; i += MUX_FINITE_BLOCK) {
        size_t end = i + MUX_FINITE_BLOCK < n ? i + MUX_FINITE_BLOCK : n;
        unsigned bad = 0;
        for (size_t j = i; j < end; j++) bad |= (uint16_t)(bits[j] & exp_mask) == exp_mask;
        if (bad) return 0;
    }
    return 1;
}

int mux_all_finite32(const uint32_t *bits, size_t n) {
    const uint32_t exp_mask = 0x7f800000u;
    for (size_t i = 0; i < n; i += MUX_FINITE_BLOCK) {
        size_t end = i + MUX_FINITE_BLOCK < n ? i + MUX_FINITE_BLOCK : n;
        unsigned bad = 0;
        for (size_t j = i; j < end; j++) bad |= (bits[j] & exp_mask) == exp_mask;
        if (bad) return 0;
    }
    return 1;
}
