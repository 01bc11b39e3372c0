/* The x86 SIMD half of quant.c, included once per instruction set with these defined:
 *
 *   NS(name)   the function's name for this instruction set (name##_avx2, name##_vnni)
 *   TGT        its target attribute
 *   DOT_U8(w, a)  int32x8 lane sums of 4 adjacent products of unsigned bytes w by signed bytes a
 *
 * Every function here computes what its portable twin in quant.c computes; only the order of the
 * float additions differs (eight lanes, summed at the end), which the tests bound. */

/* ---- unpacking one 32-value sub-block of a weight row into 32 code bytes, in value order ---- */

TGT static inline __m256i NS(nibbles)(__m128i t) {
    const __m128i m = _mm_set1_epi8(15);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(t, 4), m), _mm_and_si128(t, m));
}

/* 0xFF where bit i of x is set, byte i (llama.cpp's bytes_from_bits_32). */
TGT static inline __m256i NS(bit_bytes)(uint32_t x) {
    const __m256i shuf = _mm256_setr_epi64x(0x0000000000000000, 0x0101010101010101, 0x0202020202020202,
                                            0x0303030303030303);
    __m256i b = _mm256_shuffle_epi8(_mm256_set1_epi32((int)x), shuf);
    b = _mm256_or_si256(b, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
    return _mm256_cmpeq_epi8(b, _mm256_set1_epi64x(-1));
}

TGT static inline __attribute__((always_inline)) __m256i NS(unpack)(const int t, const uint8_t *row, int j, mux_sub *s) {
    const __m256i m4 = _mm256_set1_epi8(15);
    switch (t) {
    case T_Q4_0: {
        const uint8_t *b = row + (size_t)j * 18;
        float d = _cvtsh_ss(rd16(b));
        s->scale = d; s->bias = -8.0f * d; s->h0 = s->h1 = 1;
        return NS(nibbles)(_mm_loadu_si128((const __m128i *)(b + 2)));
    }
    case T_Q4_1: {
        const uint8_t *b = row + (size_t)j * 20;
        s->scale = _cvtsh_ss(rd16(b)); s->bias = _cvtsh_ss(rd16(b + 2)); s->h0 = s->h1 = 1;
        return NS(nibbles)(_mm_loadu_si128((const __m128i *)(b + 4)));
    }
    case T_Q5_0: {
        const uint8_t *b = row + (size_t)j * 22;
        float d = _cvtsh_ss(rd16(b));
        uint32_t qh;
        memcpy(&qh, b + 2, 4);
        s->scale = d; s->bias = -16.0f * d; s->h0 = s->h1 = 1;
        __m256i q = NS(nibbles)(_mm_loadu_si128((const __m128i *)(b + 6)));
        return _mm256_or_si256(q, _mm256_and_si256(NS(bit_bytes)(qh), _mm256_set1_epi8(16)));
    }
    case T_Q8_0: {
        const uint8_t *b = row + (size_t)j * 34;
        s->scale = _cvtsh_ss(rd16(b)); s->bias = 0.0f; s->h0 = s->h1 = 1;
        return _mm256_loadu_si256((const __m256i *)(b + 2));
    }
    case T_Q4_K:
    case T_Q5_K: {
        int k5 = t == T_Q5_K;
        const uint8_t *b = row + (size_t)(j >> 3) * (k5 ? 176 : 144);
        int jj = j & 7, pair = jj >> 1, hi = jj & 1;
        int sc, mn;
        k_scale_min(jj, b + 4, &sc, &mn);
        s->scale = _cvtsh_ss(rd16(b)) * (float)sc;
        s->bias = -_cvtsh_ss(rd16(b + 2)) * (float)mn;
        s->h0 = s->h1 = 1;
        const uint8_t *qs = b + (k5 ? 48 : 16) + 32 * pair;
        __m256i v = _mm256_loadu_si256((const __m256i *)qs);
        __m256i q = _mm256_and_si256(hi ? _mm256_srli_epi16(v, 4) : v, m4);
        if (k5) {
            __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 16));
            __m256i bit = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(jj)), _mm256_set1_epi8(1));
            q = _mm256_or_si256(q, _mm256_slli_epi16(bit, 4));
        }
        return q;
    }
    default: { /* T_Q6_K */
        const uint8_t *b = row + (size_t)(j >> 3) * 210;
        int jj = j & 7, n = jj >> 2, sub = jj & 3;
        const uint8_t *ql = b + 64 * n, *qh = b + 128 + 32 * n;
        const int8_t *scales = (const int8_t *)(b + 192) + 8 * n;
        float d = _cvtsh_ss(rd16(b + 208));
        s->scale = d; s->bias = -32.0f * d;
        s->h0 = scales[2 * sub]; s->h1 = scales[2 * sub + 1];
        __m256i l = _mm256_loadu_si256((const __m256i *)(ql + 32 * (sub & 1)));
        if (sub >= 2) l = _mm256_srli_epi16(l, 4);
        l = _mm256_and_si256(l, m4);
        __m256i h = _mm256_loadu_si256((const __m256i *)qh);
        h = _mm256_and_si256(_mm256_srl_epi16(h, _mm_cvtsi32_si128(2 * sub)), _mm256_set1_epi8(3));
        return _mm256_or_si256(l, _mm256_slli_epi16(h, 4));
    }
    }
}

TGT static inline float NS(hsum)(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* out[m] = dot(weight row, activation row m) for m < M, with t and M constants once inlined. Each
 * row's sum takes the same operations in the same order whatever M is (explicit FMAs, so no
 * contraction choice differs between instantiations): a row's result does not depend on what it
 * is batched with. */
TGT static inline __attribute__((always_inline)) void NS(sub_dot)(const int t, const int M, const uint8_t *row, int j,
                                                                  const mux_q8 *const *a, __m256 *acc, float *bacc) {
    const int halves = t == T_Q6_K, is_signed = t == T_Q8_0, has_bias = t != T_Q8_0;
    mux_sub s;
    __m256i w = NS(unpack)(t, row, j, &s);
    __m256i wu = w, hv = _mm256_setzero_si256();
    if (halves) hv = _mm256_setr_epi32(s.h0, s.h0, s.h0, s.h0, s.h1, s.h1, s.h1, s.h1);
    if (is_signed) wu = _mm256_sign_epi8(w, w);
    for (int m = 0; m < M; m++) {
        const mux_q8 *b = a[m] + j;
        __m256i av = _mm256_loadu_si256((const __m256i *)b->q);
        if (is_signed) av = _mm256_sign_epi8(av, w);
        __m256i p = DOT_U8(wu, av);
        if (halves) p = _mm256_mullo_epi32(p, hv);
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(s.scale * b->d), acc[m]);
        if (halves)
            bacc[m] = __builtin_fmaf(s.bias, __builtin_fmaf((float)s.h0, b->ds[0], (float)s.h1 * b->ds[1]), bacc[m]);
        else if (has_bias)
            bacc[m] = __builtin_fmaf(s.bias, b->ds[0] + b->ds[1], bacc[m]);
    }
}

/* The eight lane sums of int32 vectors p0..p7, in order. */
TGT static inline __m256i NS(hsum8i)(const __m256i *p) {
    __m256i t0 = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
    __m256i t1 = _mm256_hadd_epi32(_mm256_hadd_epi32(p[4], p[5]), _mm256_hadd_epi32(p[6], p[7]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(t0, t1, 0x20), _mm256_permute2x128_si256(t0, t1, 0x31));
}

/* out[m] = dot(weight row, activation row m) for m < M, with t and M constants once inlined.
 *
 * Eight sub-blocks at a time (all types but Q6_K): their eight integer dot products are reduced
 * together into one vector of eight block sums, which is converted and scaled by the eight weight
 * scales times the eight activation scales in one multiply-add, and the bias terms likewise: a
 * few instructions per block instead of a conversion, a broadcast and scalar arithmetic each. The
 * remaining sub-blocks (and Q6_K, whose halves carry their own scales) go one at a time, even and
 * odd apart. Each row's sum takes the same operations in the same order whatever M is (explicit
 * FMAs, so no contraction choice differs between instantiations): a row's result does not depend
 * on what it is batched with. */
TGT static inline __attribute__((always_inline)) void NS(rowdot_body)(const int t, const int M, const uint8_t *row,
                                                                      int nsub, const mux_q8 *const *a, float *out) {
    __m256 acc0[4], acc1[4], vacc[4], vbias[4];
    float bacc0[4], bacc1[4];
    for (int m = 0; m < M; m++) {
        acc0[m] = acc1[m] = vacc[m] = vbias[m] = _mm256_setzero_ps();
        bacc0[m] = bacc1[m] = 0.0f;
    }
    const int is_signed = t == T_Q8_0, has_bias = t != T_Q8_0;
    int j = 0;
    if (t != T_Q6_K) {
        for (; j + 8 <= nsub; j += 8) {
            __m256i w[8], wu[8];
            float sc[8], bi[8];
            for (int u = 0; u < 8; u++) {
                mux_sub s;
                w[u] = NS(unpack)(t, row, j + u, &s);
                wu[u] = is_signed ? _mm256_sign_epi8(w[u], w[u]) : w[u];
                sc[u] = s.scale;
                bi[u] = s.bias;
            }
            __m256 scv = _mm256_loadu_ps(sc), biv = _mm256_loadu_ps(bi);
            for (int m = 0; m < M; m++) {
                const mux_q8 *b = a[m] + j;
                __m256i p[8];
                for (int u = 0; u < 8; u++) {
                    __m256i av = _mm256_loadu_si256((const __m256i *)b[u].q);
                    if (is_signed) av = _mm256_sign_epi8(av, w[u]);
                    p[u] = DOT_U8(wu[u], av);
                }
                __m256 dv = _mm256_loadu_ps(q8_d(a[m], nsub) + j);
                vacc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(NS(hsum8i)(p)), _mm256_mul_ps(scv, dv), vacc[m]);
                if (has_bias) vbias[m] = _mm256_fmadd_ps(biv, _mm256_loadu_ps(q8_dsum(a[m], nsub) + j), vbias[m]);
            }
        }
    }
    for (; j + 2 <= nsub; j += 2) {
        NS(sub_dot)(t, M, row, j, a, acc0, bacc0);
        NS(sub_dot)(t, M, row, j + 1, a, acc1, bacc1);
    }
    if (j < nsub) NS(sub_dot)(t, M, row, j, a, acc0, bacc0);
    for (int m = 0; m < M; m++)
        out[m] = NS(hsum)(_mm256_add_ps(_mm256_add_ps(acc0[m], acc1[m]), _mm256_add_ps(vacc[m], vbias[m]))) +
                 (bacc0[m] + bacc1[m]);
}

#define ROWDOT(T)                                                                                          \
    TGT static void NS(rowdot_##T)(const uint8_t *row, int nsub, const mux_q8 *const *a, int M, float *out) { \
        if (M == 1) {                                                                                      \
            NS(rowdot_body)(T, 1, row, nsub, a, out);                                                       \
            return;                                                                                        \
        }                                                                                                  \
        for (int m = 0; m < M; m += 4) {                                                                   \
            const mux_q8 *g[4];                                                                            \
            float o[4];                                                                                    \
            for (int i = 0; i < 4; i++) g[i] = a[m + i < M ? m + i : M - 1];                               \
            NS(rowdot_body)(T, 4, row, nsub, g, o);                                                         \
            for (int i = 0; i < 4 && m + i < M; i++) out[m + i] = o[i];                                    \
        }                                                                                                  \
    }
ROWDOT(T_Q4_0)
ROWDOT(T_Q4_1)
ROWDOT(T_Q5_0)
ROWDOT(T_Q8_0)
ROWDOT(T_Q4_K)
ROWDOT(T_Q5_K)
ROWDOT(T_Q6_K)
#undef ROWDOT

TGT static void NS(rowdot)(int t, const uint8_t *row, int nsub, const mux_q8 *const *a, int M, float *out) {
    switch (t) {
    case T_Q4_0: NS(rowdot_T_Q4_0)(row, nsub, a, M, out); return;
    case T_Q4_1: NS(rowdot_T_Q4_1)(row, nsub, a, M, out); return;
    case T_Q5_0: NS(rowdot_T_Q5_0)(row, nsub, a, M, out); return;
    case T_Q8_0: NS(rowdot_T_Q8_0)(row, nsub, a, M, out); return;
    case T_Q4_K: NS(rowdot_T_Q4_K)(row, nsub, a, M, out); return;
    case T_Q5_K: NS(rowdot_T_Q5_K)(row, nsub, a, M, out); return;
    default: NS(rowdot_T_Q6_K)(row, nsub, a, M, out); return;
    }
}

/* ---- attention over cache rows: float32 queries, bfloat16 or float32 keys and values ---- */

TGT static inline __m256 NS(load8)(const void *p, int bf16) {
    if (!bf16) return _mm256_loadu_ps((const float *)p);
    __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}

/* The eight lane sums of a0..a7, in order. */
TGT static inline __m256 NS(hsum8)(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6,
                                   __m256 a7) {
    __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
    return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}

/* s[h * n + t] = dot(q + h * d, key row of position c0 + t) for G heads and n keys: eight keys at a
 * time per head, their sums reduced together. */
TGT static void NS(scores)(const float *q, int G, const char *kb, size_t row, int c0, int n, int capacity, int d,
                           int bf16, float *s) {
    size_t es = bf16 ? 2 : 4;
    for (int h = 0; h < G; h++) {
        const float *qh = q + h * d;
        int t = 0;
        for (; t + 8 <= n; t += 8) {
            __m256 acc[8];
            const char *k[8];
            for (int u = 0; u < 8; u++) {
                acc[u] = _mm256_setzero_ps();
                k[u] = kb + (size_t)((c0 + t + u) % capacity) * row;
            }
            for (int i = 0; i < d; i += 8) {
                __m256 qv = _mm256_loadu_ps(qh + i);
                for (int u = 0; u < 8; u++) acc[u] = _mm256_fmadd_ps(qv, NS(load8)(k[u] + i * es, bf16), acc[u]);
            }
            _mm256_storeu_ps(s + h * n + t,
                             NS(hsum8)(acc[0], acc[1], acc[2], acc[3], acc[4], acc[5], acc[6], acc[7]));
        }
        for (; t < n; t++) {
            const char *k = kb + (size_t)((c0 + t) % capacity) * row;
            __m256 acc = _mm256_setzero_ps();
            for (int i = 0; i < d; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(qh + i), NS(load8)(k + i * es, bf16), acc);
            s[h * n + t] = NS(hsum)(acc);
        }
    }
}

/* o[0:D] += sum over t < n of p[t] times value row (c0 + t) % capacity, the D/8 accumulators kept
 * in registers across the keys (D a constant once inlined). */
TGT static inline __attribute__((always_inline)) void NS(values_d)(const int D, float *o, const float *p, int n,
                                                                  const char *vb, size_t row, int c0, int capacity,
                                                                  int bf16) {
    __m256 acc[16];
    for (int i = 0; i < D / 8; i++) acc[i] = _mm256_loadu_ps(o + 8 * i);
    size_t es = bf16 ? 2 : 4;
    for (int t = 0; t < n; t++) {
        const char *v = vb + (size_t)((c0 + t) % capacity) * row;
        __m256 w = _mm256_set1_ps(p[t]);
        for (int i = 0; i < D / 8; i++) acc[i] = _mm256_fmadd_ps(w, NS(load8)(v + 8 * i * es, bf16), acc[i]);
    }
    for (int i = 0; i < D / 8; i++) _mm256_storeu_ps(o + 8 * i, acc[i]);
}

TGT static void NS(values)(float *o, const float *p, int n, const char *vb, size_t row, int c0, int capacity, int d,
                           int bf16) {
    if (d == 64) {
        NS(values_d)(64, o, p, n, vb, row, c0, capacity, bf16);
    } else if (d == 128) {
        NS(values_d)(128, o, p, n, vb, row, c0, capacity, bf16);
    } else {
        for (int i = 0; i < d; i += 64) {
            int w = d - i < 64 ? d - i : 64;
            if (w == 64) {
                NS(values_d)(64, o + i, p, n, vb + (size_t)i * (bf16 ? 2 : 4), row, c0, capacity, bf16);
            } else {
                size_t es = bf16 ? 2 : 4;
                for (int t = 0; t < n; t++) {
                    const char *v = vb + (size_t)((c0 + t) % capacity) * row + (size_t)i * es;
                    for (int e = 0; e < w; e += 8)
                        _mm256_storeu_ps(o + i + e, _mm256_fmadd_ps(_mm256_set1_ps(p[t]), NS(load8)(v + e * es, bf16),
                                                                    _mm256_loadu_ps(o + i + e)));
                }
            }
        }
    }
}

/* x[i] = exp(x[i] - mx) for i < n; returns their sum (exp as mux_expf, eight at a time). */
TGT static float NS(exp_sum)(float *x, int n, float mx) {
    const __m256 c1 = _mm256_set1_ps(0.693359375f), c2 = _mm256_set1_ps(-2.12194440e-4f);
    const __m256 log2e = _mm256_set1_ps(1.4426950408889634f);
    __m256 sum = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_sub_ps(_mm256_loadu_ps(x + i), _mm256_set1_ps(mx));
        v = _mm256_max_ps(v, _mm256_set1_ps(-87.0f));
        __m256 k = _mm256_round_ps(_mm256_mul_ps(v, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        __m256 r = _mm256_fnmadd_ps(k, c2, _mm256_fnmadd_ps(k, c1, v));
        __m256 p = _mm256_set1_ps(1.9875691500e-4f);
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
        p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
        __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
        __m256 y = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
        _mm256_storeu_ps(x + i, y);
        sum = _mm256_add_ps(sum, y);
    }
    float s = NS(hsum)(sum);
    for (; i < n; i++) {
        x[i] = mux_expf(x[i] - mx);
        s += x[i];
    }
    return s;
}

static const mux_isa NS(isa) = {NS(rowdot), NS(scores), NS(values), NS(exp_sum)};
