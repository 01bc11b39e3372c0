/* CRC32C (Castagnoli, reflected polynomial 0x82F63B78).
 *
 * Hardware path: SSE4.2 crc32 on x86-64, ARMv8 CRC on arm64, chosen at run time.
 * Fallback: slicing-by-8 tables. The public function is incremental: pass the
 * previous result as `crc` (0 to start); pre- and post-inversion happen inside.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

static uint32_t crc_table[8][256];
static int crc_table_ready = 0;

static void crc_init_tables(void) {
    if (crc_table_ready) return;
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = n;
        for (int k = 0; k < 8; k++) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : (c >> 1);
        crc_table[0][n] = c;
    }
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = crc_table[0][n];
        for (int k = 1; k < 8; k++) {
            c = crc_table[0][c & 0xff] ^ (c >> 8);
            crc_table[k][n] = c;
        }
    }
    crc_table_ready = 1; /* benign race: every thread computes identical tables */
}

static uint32_t crc_sw_raw(uint32_t crc, const unsigned char *p, size_t len) {
    crc_init_tables();
    while (len && ((uintptr_t)p & 7)) {
        crc = crc_table[0][(crc ^ *p++) & 0xff] ^ (crc >> 8);
        len--;
    }
    while (len >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        w ^= crc; /* little-endian hosts only; big-endian falls to the byte loop below */
        crc = crc_table[7][w & 0xff] ^ crc_table[6][(w >> 8) & 0xff] ^
              crc_table[5][(w >> 16) & 0xff] ^ crc_table[4][(w >> 24) & 0xff] ^
              crc_table[3][(w >> 32) & 0xff] ^ crc_table[2][(w >> 40) & 0xff] ^
              crc_table[1][(w >> 48) & 0xff] ^ crc_table[0][(w >> 56) & 0xff];
        p += 8;
        len -= 8;
    }
    while (len--) crc = crc_table[0][(crc ^ *p++) & 0xff] ^ (crc >> 8);
    return crc;
}

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "crc32c.c assumes a little-endian host"
#endif

uint32_t mux_crc32c_sw(uint32_t crc, const unsigned char *buf, size_t len) {
    return ~crc_sw_raw(~crc, buf, len);
}

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#include <nmmintrin.h>

/* Three independent streams hide the 3-cycle latency of crc32q; they are
 * combined with a zero-extension table built once (shift by BLOCK bytes). */
#define HW_BLOCK 8192

static uint32_t shift_table[4][256];
static int shift_ready = 0;

/* Multiply in GF(2) modulo the reflected polynomial. */
static uint32_t gf2_mul(uint32_t a, uint32_t b) {
    uint32_t prod = 0;
    for (int i = 0; i < 32; i++) {
        prod ^= (uint32_t)(-(int32_t)((b >> 31) & 1)) & a;
        a = (a & 1) ? (a >> 1) ^ 0x82F63B78u : (a >> 1);
        b <<= 1;
    }
    return prod;
}

/* x^(8*n) mod P in reflected representation. */
static uint32_t xpow8n(size_t n) {
    uint32_t result = 0x80000000u; /* x^0 */
    uint32_t base = 0x00800000u;   /* x^8 */
    while (n) {
        if (n & 1) result = gf2_mul(result, base);
        base = gf2_mul(base, base);
        n >>= 1;
    }
    return result;
}

static void shift_init(void) {
    if (shift_ready) return;
    uint32_t k = xpow8n(HW_BLOCK);
    for (int byte = 0; byte < 4; byte++)
        for (uint32_t v = 0; v < 256; v++) shift_table[byte][v] = gf2_mul(v << (8 * byte), k);
    shift_ready = 1;
}

static inline uint32_t shift_block(uint32_t crc) {
    return shift_table[0][crc & 0xff] ^ shift_table[1][(crc >> 8) & 0xff] ^
           shift_table[2][(crc >> 16) & 0xff] ^ shift_table[3][crc >> 24];
}

__attribute__((target("sse4.2"))) static uint32_t crc_hw_raw(uint32_t crc, const unsigned char *p,
                                                             size_t len) {
    while (len && ((uintptr_t)p & 7)) {
        crc = _mm_crc32_u8(crc, *p++);
        len--;
    }
    shift_init();
    while (len >= 3 * HW_BLOCK) {
        uint64_t c0 = crc, c1 = 0, c2 = 0;
        const unsigned char *p1 = p + HW_BLOCK, *p2 = p + 2 * HW_BLOCK;
        for (size_t i = 0; i < HW_BLOCK; i += 8) {
            uint64_t w0, w1, w2;
            memcpy(&w0, p + i, 8);
            memcpy(&w1, p1 + i, 8);
            memcpy(&w2, p2 + i, 8);
            c0 = _mm_crc32_u64(c0, w0);
            c1 = _mm_crc32_u64(c1, w1);
            c2 = _mm_crc32_u64(c2, w2);
        }
        crc = shift_block((uint32_t)c0) ^ (uint32_t)c1;
        crc = shift_block(crc) ^ (uint32_t)c2;
        p += 3 * HW_BLOCK;
        len -= 3 * HW_BLOCK;
    }
    uint64_t c = crc;
    while (len >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        c = _mm_crc32_u64(c, w);
        p += 8;
        len -= 8;
    }
    crc = (uint32_t)c;
    while (len--) crc = _mm_crc32_u8(crc, *p++);
    return crc;
}

static int hw_available(void) {
    unsigned int a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return 0;
    return (c & bit_SSE4_2) != 0;
}
#define HAVE_HW 1

#elif defined(__aarch64__) && defined(__ARM_FEATURE_CRC32)
#include <arm_acle.h>
#if defined(__linux__)
#include <sys/auxv.h>
#include <asm/hwcap.h>
static int hw_available(void) { return (getauxval(AT_HWCAP) & HWCAP_CRC32) != 0; }
#else
static int hw_available(void) { return 1; } /* Apple silicon always has CRC32 */
#endif

static uint32_t crc_hw_raw(uint32_t crc, const unsigned char *p, size_t len) {
    while (len && ((uintptr_t)p & 7)) {
        crc = __crc32cb(crc, *p++);
        len--;
    }
    while (len >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        crc = __crc32cd(crc, w);
        p += 8;
        len -= 8;
    }
    while (len--) crc = __crc32cb(crc, *p++);
    return crc;
}
#define HAVE_HW 1
#else
#define HAVE_HW 0
#endif

static int hw_state = -1; /* -1 unknown, 0 no, 1 yes */

int mux_crc32c_hw_available(void) {
#if HAVE_HW
    if (hw_state < 0) hw_state = hw_available();
    return hw_state;
#else
    return 0;
#endif
}

/* Build every table and probe the CPU once, when the library is loaded (the loader runs this
 * single-threaded). The lazy checks above then never race: the functions run with the GIL
 * released, and two threads filling a table while a third reads it would be a data race. */
__attribute__((constructor)) static void mux_crc32c_init(void) {
    crc_init_tables();
#if HAVE_HW
    if (mux_crc32c_hw_available()) {
#if defined(__x86_64__) || defined(_M_X64)
        shift_init();
#endif
    }
#endif
}

uint32_t mux_crc32c(uint32_t crc, const unsigned char *buf, size_t len) {
#if HAVE_HW
    if (mux_crc32c_hw_available()) return ~crc_hw_raw(~crc, buf, len);
#endif
    return ~crc_sw_raw(~crc, buf, len);
}
