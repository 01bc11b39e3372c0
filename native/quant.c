/* Quantized matrix-vector products over GGUF blocks, and the decode step built on them.
 *
 * Weights stay in their GGUF blocks (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K), read in place.
 * Activations are quantized per block of 32 values to int8 with a float scale (mux_q8, llama.cpp's
 * Q8_0 idea with a float32 scale and the block's sums), and every 32-value sub-block of a weight row
 * contributes
 *
 *     d_a * (scale * (h0 * I_lo + h1 * I_hi) + bias * (h0 * S_lo + h1 * S_hi))
 *
 * where I_lo/I_hi are the integer dot products of the weight's codes with the activation's int8
 * values over the sub-block's two halves, S_lo/S_hi the activation's sums over them, and (scale,
 * bias, h0, h1) the weight sub-block's own: w = scale * code + bias, with h0 = h1 = 1 except for
 * Q6_K, whose 16-value halves carry their own int8 scales (w = d * h * (code - 32)). The integer
 * products run on AVX-512 VNNI (vpdpbusd) or AVX2 (vpmaddubsw), chosen at run time, or portable C.
 *
 * Row independence: each output row's sum is computed by one thread, in one order, from that
 * activation row and that weight row alone, so a row's result is the same whatever else the call
 * holds (other activation rows, other threads). The forward pass (mux_forward) extends that to a
 * whole decode step: every row of it, decode or a short prompt chunk, is computed the same way on
 * its own.
 *
 * Threads: a pool of --threads - 1 workers (the caller is the last one) that spin briefly between
 * jobs and then sleep on a condition variable. */
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define MUX_X86 1
#else
#define MUX_X86 0
#endif

#define MUX_MAX_M 16 /* activation rows per product call: the forward pass's short-row limit */

enum { T_Q4_0, T_Q4_1, T_Q5_0, T_Q8_0, T_Q4_K, T_Q5_K, T_Q6_K, T_COUNT };

/* GGML type id -> (index, values per block, bytes per block) */
static const struct { int ggml, values, bytes; } TYPES[T_COUNT] = {
    {2, 32, 18}, {3, 32, 20}, {6, 32, 22}, {8, 32, 34}, {12, 256, 144}, {13, 256, 176}, {14, 256, 210},
};

static int type_index(int ggml) {
    for (int t = 0; t < T_COUNT; t++)
        if (TYPES[t].ggml == ggml) return t;
    return -1;
}

int mux_q_row_bytes(int ggml_type, int64_t cols) {
    int t = type_index(ggml_type);
    if (t < 0 || cols % TYPES[t].values) return -1;
    return (int)(cols / TYPES[t].values * TYPES[t].bytes);
}

typedef struct {
    float d;
    float ds[2]; /* d times the sums of q[0:16] and of q[16:32] (exact: |sum| <= 2032) */
    int8_t q[32];
} mux_q8;

/* One activation row: nsub mux_q8 blocks, then its scales d[nsub] and d times each block's sum
 * dsum[nsub] as plain float arrays (the SIMD products load eight blocks' at once). In mux_q8 units. */
#define Q8_ROW(nsub) ((size_t)(nsub) + ((size_t)(nsub) * 2 * sizeof(float) + sizeof(mux_q8) - 1) / sizeof(mux_q8))

static inline const float *q8_d(const mux_q8 *row, int nsub) { return (const float *)(row + nsub); }
static inline const float *q8_dsum(const mux_q8 *row, int nsub) { return (const float *)(row + nsub) + nsub; }

typedef struct {
    float scale, bias;
    int h0, h1;
} mux_sub;

static inline uint16_t rd16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

static float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000 | (man << 13);
    } else if (exp) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man) { /* subnormal */
        int e = -1;
        do { e++; man <<= 1; } while (!(man & 0x400));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3ff) << 13);
    } else {
        bits = sign;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline void k_scale_min(int j, const uint8_t *q, int *sc, int *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* exp with the Cephes polynomial the SIMD paths use (inputs below -87 give exp(-87)). */
static float mux_expf(float x) {
    if (x < -87.0f) x = -87.0f;
    float k = nearbyintf(x * 1.4426950408889634f);
    float r = x - k * 0.693359375f - k * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + (r + 1.0f);
    uint32_t e = (uint32_t)((int)k + 127) << 23;
    float s;
    memcpy(&s, &e, 4);
    return p * s;
}

/* ---- one instruction set's kernels ---- */

typedef struct {
    void (*rowdot)(int t, const uint8_t *row, int nsub, const mux_q8 *const *a, int M, float *out);
    void (*scores)(const float *q, int G, const char *kb, size_t row, int c0, int n, int capacity, int d, int bf16,
                   float *s);
    void (*values)(float *o, const float *p, int n, const char *vb, size_t row, int c0, int capacity, int d,
                   int bf16);
    float (*exp_sum)(float *x, int n, float mx);
} mux_isa;

/* ---- portable C ---- */

static void unpack_portable(int t, const uint8_t *row, int j, mux_sub *s, int c[32]) {
    s->h0 = s->h1 = 1;
    switch (t) {
    case T_Q4_0:
    case T_Q4_1:
    case T_Q5_0: {
        int sz = t == T_Q4_0 ? 18 : t == T_Q4_1 ? 20 : 22;
        const uint8_t *b = row + (size_t)j * sz, *qs = b + (t == T_Q4_0 ? 2 : t == T_Q4_1 ? 4 : 6);
        float d = f16_to_f32(rd16(b));
        uint32_t qh = 0;
        if (t == T_Q5_0) memcpy(&qh, b + 2, 4);
        for (int i = 0; i < 16; i++) {
            c[i] = (qs[i] & 15) | (int)(((qh >> i) & 1) << 4);
            c[i + 16] = (qs[i] >> 4) | (int)(((qh >> (i + 16)) & 1) << 4);
        }
        s->scale = d;
        s->bias = t == T_Q4_0 ? -8.0f * d : t == T_Q4_1 ? f16_to_f32(rd16(b + 2)) : -16.0f * d;
        return;
    }
    case T_Q8_0: {
        const uint8_t *b = row + (size_t)j * 34;
        for (int i = 0; i < 32; i++) c[i] = (int8_t)b[2 + i];
        s->scale = f16_to_f32(rd16(b));
        s->bias = 0.0f;
        return;
    }
    case T_Q4_K:
    case T_Q5_K: {
        int k5 = t == T_Q5_K, jj = j & 7, sc, mn;
        const uint8_t *b = row + (size_t)(j >> 3) * (k5 ? 176 : 144);
        const uint8_t *qs = b + (k5 ? 48 : 16) + 32 * (jj >> 1);
        k_scale_min(jj, b + 4, &sc, &mn);
        for (int i = 0; i < 32; i++) {
            c[i] = (jj & 1 ? qs[i] >> 4 : qs[i] & 15);
            if (k5) c[i] |= ((b[16 + i] >> jj) & 1) << 4;
        }
        s->scale = f16_to_f32(rd16(b)) * (float)sc;
        s->bias = -f16_to_f32(rd16(b + 2)) * (float)mn;
        return;
    }
    default: { /* T_Q6_K */
        const uint8_t *b = row + (size_t)(j >> 3) * 210;
        int jj = j & 7, n = jj >> 2, sub = jj & 3;
        const uint8_t *ql = b + 64 * n + 32 * (sub & 1), *qh = b + 128 + 32 * n;
        const int8_t *scales = (const int8_t *)(b + 192) + 8 * n;
        for (int i = 0; i < 32; i++)
            c[i] = ((sub >= 2 ? ql[i] >> 4 : ql[i]) & 15) | (((qh[i] >> (2 * sub)) & 3) << 4);
        float d = f16_to_f32(rd16(b + 208));
        s->scale = d;
        s->bias = -32.0f * d;
        s->h0 = scales[2 * sub];
        s->h1 = scales[2 * sub + 1];
        return;
    }
    }
}

static void rowdot_portable(int t, const uint8_t *row, int nsub, const mux_q8 *const *a, int M, float *out) {
    float acc[MUX_MAX_M], bacc[MUX_MAX_M];
    for (int m = 0; m < M; m++) acc[m] = bacc[m] = 0.0f;
    for (int j = 0; j < nsub; j++) {
        mux_sub s;
        int c[32];
        unpack_portable(t, row, j, &s, c);
        for (int m = 0; m < M; m++) {
            const mux_q8 *b = a[m] + j;
            int lo = 0, hi = 0;
            for (int i = 0; i < 16; i++) lo += c[i] * b->q[i];
            for (int i = 16; i < 32; i++) hi += c[i] * b->q[i];
            acc[m] += (float)(s.h0 * lo + s.h1 * hi) * (s.scale * b->d);
            bacc[m] += s.bias * ((float)s.h0 * b->ds[0] + (float)s.h1 * b->ds[1]);
        }
    }
    for (int m = 0; m < M; m++) out[m] = acc[m] + bacc[m];
}

static inline float load1(const void *p, int i, int bf16) {
    if (!bf16) return ((const float *)p)[i];
    uint32_t bits = (uint32_t)((const uint16_t *)p)[i] << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* s[h * n + t] = dot(q + h * d, key row of position c0 + t) for G heads and n keys. */
static void scores_portable(const float *q, int G, const char *kb, size_t row, int c0, int n, int capacity, int d,
                            int bf16, float *s) {
    for (int t = 0; t < n; t++) {
        const char *k = kb + (size_t)((c0 + t) % capacity) * row;
        for (int h = 0; h < G; h++) {
            float acc = 0.0f;
            for (int i = 0; i < d; i++) acc += q[h * d + i] * load1(k, i, bf16);
            s[h * n + t] = acc;
        }
    }
}

/* o[0:d] = sum over t < n of p[t] times the value row of position c0 + t (ring row (c0 + t) % capacity). */
static void values_portable(float *o, const float *p, int n, const char *vb, size_t row, int c0, int capacity, int d,
                            int bf16) {
    for (int t = 0; t < n; t++) {
        const char *v = vb + (size_t)((c0 + t) % capacity) * row;
        for (int i = 0; i < d; i++) o[i] += p[t] * load1(v, i, bf16);
    }
}

static float exp_sum_portable(float *x, int n, float mx) {
    float s = 0.0f;
    for (int i = 0; i < n; i++) {
        x[i] = mux_expf(x[i] - mx);
        s += x[i];
    }
    return s;
}

static const mux_isa portable_isa = {rowdot_portable, scores_portable, values_portable, exp_sum_portable};

#if MUX_X86
#define TGT __attribute__((target("avx2,fma,f16c")))
#define NS(name) name##_avx2
#define DOT_U8(w, a) _mm256_madd_epi16(_mm256_maddubs_epi16((w), (a)), _mm256_set1_epi16(1))
#include "quant_simd.h"
#undef TGT
#undef NS
#undef DOT_U8

#define TGT __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")))
#define NS(name) name##_vnni
#define DOT_U8(w, a) _mm256_dpbusd_epi32(_mm256_setzero_si256(), (w), (a))
#include "quant_simd.h"
#undef TGT
#undef NS
#undef DOT_U8
#endif

/* 0 portable, 1 AVX2, 2 AVX-512 VNNI */
static int isa_available(int level) {
#if MUX_X86
    __builtin_cpu_init();
    if (level == 1) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    if (level == 2)
        return isa_available(1) && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vnni");
#endif
    return level == 0;
}

static const mux_isa *isa_of(int level) {
#if MUX_X86
    if (level == 2) return &isa_vnni;
    if (level == 1) return &isa_avx2;
#endif
    (void)level;
    return &portable_isa;
}

static int best_isa = -1;
static int current_isa = -1; /* what calls use: best_isa unless MUXWORKER_NATIVE_ISA or a test forced another */

int mux_q_best_isa(void) {
    if (best_isa < 0) best_isa = isa_available(2) ? 2 : isa_available(1) ? 1 : 0;
    return best_isa;
}

/* Force an instruction set (tests compare them; MUXWORKER_NATIVE_ISA, read by native/__init__.py);
   -1 returns to the best. 0 on success. */
int mux_q_set_isa(int level) {
    if (level < 0) level = mux_q_best_isa();
    if (level > 2 || !isa_available(level)) return -1;
    current_isa = level;
    return 0;
}

int mux_q_isa(void) {
    if (current_isa < 0) current_isa = mux_q_best_isa();
    return current_isa;
}

/* ---- activation quantization (portable only: the int8 values must not depend on the ISA) ---- */

static void quantize_row(const float *x, int64_t k, mux_q8 *out) {
    int nsub = (int)(k / 32);
    float *dv = (float *)(out + nsub), *dsum = dv + nsub;
    for (int64_t b = 0; b < k / 32; b++) {
        const float *v = x + b * 32;
        float amax = 0.0f;
        for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(v[i]));
        float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
        int s0 = 0, s1 = 0;
        for (int i = 0; i < 32; i++) {
            int q = (int)nearbyintf(v[i] * id);
            q = q > 127 ? 127 : q < -127 ? -127 : q;
            out[b].q[i] = (int8_t)q;
            if (i < 16) s0 += q; else s1 += q;
        }
        out[b].d = d;
        out[b].ds[0] = d * (float)s0;
        out[b].ds[1] = d * (float)s1;
        dv[b] = d;
        dsum[b] = d * (float)(s0 + s1);
    }
}

/* ---- thread pool ---- */

typedef void (*mux_task)(void *ctx, int task, int thread);

#define MUX_MAX_THREADS 256
#define MUX_SPIN 20000

static struct {
    int n; /* threads including the caller */
    pthread_t th[MUX_MAX_THREADS];
    pthread_mutex_t mu;
    pthread_cond_t cv;
    atomic_int gen, next, done, stop;
    int start_gen; /* gen when the workers were started: their first job is the one after it */
    int sleeping, n_tasks;
    mux_task fn;
    void *ctx;
} pool = {.n = 1, .mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};

static void run_tasks(int thread) {
    int t;
    while ((t = atomic_fetch_add_explicit(&pool.next, 1, memory_order_relaxed)) < pool.n_tasks)
        pool.fn(pool.ctx, t, thread);
}

static inline void cpu_relax(void) {
#if MUX_X86
    _mm_pause();
#endif
}

static void *worker_main(void *arg) {
    int id = (int)(intptr_t)arg;
    int seen = pool.start_gen; /* not gen now: a job may have been posted before this thread ran */
    for (;;) {
        int spins = 0;
        while (atomic_load_explicit(&pool.gen, memory_order_acquire) == seen && spins < MUX_SPIN) {
            cpu_relax();
            spins++;
        }
        if (atomic_load_explicit(&pool.gen, memory_order_acquire) == seen) {
            pthread_mutex_lock(&pool.mu);
            pool.sleeping++;
            while (atomic_load(&pool.gen) == seen) pthread_cond_wait(&pool.cv, &pool.mu);
            pool.sleeping--;
            pthread_mutex_unlock(&pool.mu);
        }
        seen = atomic_load(&pool.gen);
        if (atomic_load(&pool.stop)) return NULL;
        run_tasks(id);
        atomic_fetch_add_explicit(&pool.done, 1, memory_order_acq_rel);
    }
}

static void pool_broadcast(void) {
    atomic_fetch_add_explicit(&pool.gen, 1, memory_order_acq_rel);
    pthread_mutex_lock(&pool.mu);
    if (pool.sleeping) pthread_cond_broadcast(&pool.cv);
    pthread_mutex_unlock(&pool.mu);
}

static void pool_stop(void) {
    if (pool.n <= 1) return;
    atomic_store(&pool.stop, 1);
    pool_broadcast();
    for (int i = 1; i < pool.n; i++) pthread_join(pool.th[i], NULL);
    atomic_store(&pool.stop, 0);
    pool.n = 1;
}

/* A forked child has none of the parent's workers: it starts over with none (a later
 * mux_q_set_threads starts new ones), rather than waiting forever for threads that are gone. */
static void pool_after_fork(void) {
    pthread_mutex_init(&pool.mu, NULL);
    pthread_cond_init(&pool.cv, NULL);
    pool.sleeping = 0;
    pool.n = 1;
}

/* Threads the products use, the caller included (1: no workers). 0 on success. */
int mux_q_set_threads(int n) {
    static int registered = 0;
    if (n < 1 || n > MUX_MAX_THREADS) return -1;
    if (!registered) {
        pthread_atfork(NULL, NULL, pool_after_fork);
        registered = 1;
    }
    if (n == pool.n) return 0;
    pool_stop();
    pool.start_gen = atomic_load(&pool.gen);
    for (int i = 1; i < n; i++) {
        if (pthread_create(&pool.th[i], NULL, worker_main, (void *)(intptr_t)i)) {
            pool.n = i;
            pool_stop();
            return -2;
        }
        pool.n = i + 1;
    }
    return 0;
}

int mux_q_threads(void) { return pool.n; }

static void pool_run(mux_task fn, void *ctx, int n_tasks) {
    if (pool.n <= 1 || n_tasks <= 1) {
        for (int t = 0; t < n_tasks; t++) fn(ctx, t, 0);
        return;
    }
    pool.fn = fn;
    pool.ctx = ctx;
    pool.n_tasks = n_tasks;
    atomic_store(&pool.next, 0);
    atomic_store(&pool.done, 0);
    pool_broadcast();
    run_tasks(0);
    while (atomic_load_explicit(&pool.done, memory_order_acquire) < pool.n - 1) cpu_relax();
}

/* ---- products ---- */

typedef struct {
    const uint8_t *data;
    int32_t type; /* GGML type id */
    int32_t rows;
    int64_t row_bytes; /* stride between rows */
    const int32_t *row_map; /* output column of each row, or NULL: row r -> column r */
    int32_t out_offset; /* added to the column */
} mux_qweight;

#define MUX_ROWS_PER_TASK 16
#define MUX_PREFETCH_ROWS 4

typedef struct {
    const mux_qweight *w;
    int nw;
    int task_start[8]; /* first task of each weight */
    int task_rows[8]; /* rows per task of each weight */
    int nsub, M;
    const mux_q8 *const *a;
    float *y;
    int64_t ldy;
    const mux_isa *isa;
} matmul_job;

static void matmul_task(void *ctx, int task, int thread) {
    (void)thread;
    matmul_job *j = ctx;
    int wi = 0;
    while (wi + 1 < j->nw && task >= j->task_start[wi + 1]) wi++;
    const mux_qweight *w = j->w + wi;
    int t = type_index(w->type);
    int r0 = (task - j->task_start[wi]) * j->task_rows[wi];
    int r1 = r0 + j->task_rows[wi] < w->rows ? r0 + j->task_rows[wi] : w->rows;
    float out[MUX_MAX_M];
    for (int r = r0; r < r1; r++) {
        /* Prefetch a few rows ahead into every cache level: the weights stream from L3 or memory
         * once per step, and without it a SmolLM2 step took 15 ms instead of 5.1 (2 threads; the
         * non-temporal hint gave 10). */
        if (r + MUX_PREFETCH_ROWS < w->rows) {
            const char *next = (const char *)w->data + (size_t)(r + MUX_PREFETCH_ROWS) * w->row_bytes;
            for (int64_t off = 0; off < w->row_bytes; off += 64) __builtin_prefetch(next + off, 0, 3);
        }
        j->isa->rowdot(t, w->data + (size_t)r * w->row_bytes, j->nsub, j->a, j->M, out);
        int64_t col = (w->row_map ? w->row_map[r] : r) + w->out_offset;
        for (int m = 0; m < j->M; m++) j->y[m * j->ldy + col] = out[m];
    }
}

/* y[m, col(w, r)] = dot(row r of each weight w, activation row m) for M quantized rows. */
static int matmul_q8(const mux_qweight *w, int nw, int64_t k, const mux_q8 *const *a, int M, float *y, int64_t ldy) {
    if (nw < 1 || nw > 8 || M < 1 || M > MUX_MAX_M || k % 32) return -1;
    matmul_job j = {.w = w, .nw = nw, .nsub = (int)(k / 32), .M = M, .a = a, .y = y, .ldy = ldy,
                    .isa = isa_of(mux_q_isa())};
    int tasks = 0;
    for (int i = 0; i < nw; i++) {
        int t = type_index(w[i].type);
        if (t < 0 || k % TYPES[t].values || w[i].row_bytes < mux_q_row_bytes(w[i].type, k)) return -2;
        /* One contiguous run of rows per thread and weight: long sequential streams are what the
         * hardware prefetchers follow (16-row tasks interleaved between threads ran at half the
         * bandwidth). */
        int per = (w[i].rows + pool.n - 1) / pool.n;
        j.task_rows[i] = per < MUX_ROWS_PER_TASK ? MUX_ROWS_PER_TASK : per;
        j.task_start[i] = tasks;
        tasks += (w[i].rows + j.task_rows[i] - 1) / j.task_rows[i];
    }
    pool_run(matmul_task, &j, tasks);
    return 0;
}

/* y [M, ldy] = x [M, k] float32 times the weights' rows (see mux_qweight), with x quantized to int8
 * per block of 32 first. Returns 0, or < 0 for a bad argument (-2: a type or size it cannot do). */
int mux_qmatmul(const mux_qweight *w, int nw, int64_t k, const float *x, int M, float *y, int64_t ldy) {
    if (M < 1 || M > MUX_MAX_M || k < 32 || k % 32) return -1;
    mux_q8 *q = malloc(sizeof(mux_q8) * Q8_ROW(k / 32) * (size_t)M);
    if (!q) return -3;
    const mux_q8 *rows[MUX_MAX_M];
    for (int m = 0; m < M; m++) {
        quantize_row(x + m * k, k, q + m * Q8_ROW(k / 32));
        rows[m] = q + m * Q8_ROW(k / 32);
    }
    int rc = matmul_q8(w, nw, k, rows, M, y, ldy);
    free(q);
    return rc;
}

/* ---- the decode step ---- */

typedef struct {
    mux_qweight q, k, v, o, gate, up, down;
    const float *bias_q, *bias_k, *bias_v; /* NULL when the model has none */
    const float *attn_norm, *ffn_norm; /* the attention's and the MLP's input norms */
    const float *q_norm, *k_norm; /* [D], per head before rope (Qwen3, Gemma 3); else NULL */
    const float *post_attn_norm, *post_ffn_norm; /* of the attention's and MLP's outputs (Gemma 3) */
    const float *rope_cos, *rope_sin; /* [max_pos, head_dim / 2]: this layer's (Gemma: local or global) */
    void *k_cache, *v_cache; /* [slots, KV, capacity, D] */
    int64_t slot_stride, head_stride; /* in elements */
    int32_t capacity; /* rows per slot: position p lives in row p % capacity */
    int32_t window; /* 0: full attention */
} mux_layer;

typedef struct {
    int32_t n_layers, hidden, n_heads, n_kv, head_dim, inter, vocab, max_pos, cache_bf16;
    int32_t gelu; /* the MLP's activation: 0 SiLU, 1 GELU (tanh) */
    float eps, attn_scale;
    const float *final_norm;
    mux_qweight head;
    const mux_layer *layers;
} mux_model;

static void rms_norm(const float *x, const float *w, int n, float eps, float *out) {
    double ss = 0.0;
    for (int i = 0; i < n; i++) ss += (double)x[i] * x[i];
    float r = (float)(1.0 / sqrt(ss / n + eps));
    for (int i = 0; i < n; i++) out[i] = x[i] * r * w[i];
}

static void rope(float *v, int heads, int d, const float *cos, const float *sin) {
    int half = d / 2;
    for (int h = 0; h < heads; h++) {
        float *x = v + h * d;
        for (int i = 0; i < half; i++) {
            float a = x[i], b = x[i + half];
            x[i] = a * cos[i] - b * sin[i];
            x[i + half] = b * cos[i] + a * sin[i];
        }
    }
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffff) > 0x7f800000) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    return (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

static void store_row(void *dst, const float *src, int d, int bf16) {
    if (!bf16) {
        memcpy(dst, src, sizeof(float) * (size_t)d);
        return;
    }
    uint16_t *o = dst;
    for (int i = 0; i < d; i++) o[i] = f32_to_bf16(src[i]);
}

/* Attention is split over fixed chunks of MUX_KEY_CHUNK keys (never over anything that depends on
 * the batch or the threads), each chunk's softmax kept unnormalized with its own max and sum, and
 * the chunks merged in order: a row's result is the same whatever else the pass holds, and one
 * long row's keys spread over every thread (a single decode has only KV heads to split). */
#define MUX_KEY_CHUNK 256

typedef struct {
    const mux_model *m;
    const mux_layer *L;
    const float *qkv; /* [n, (H + 2KV) D], q after rope */
    const int32_t *pos, *slot;
    const int32_t *task_row; /* first task of each row, n + 1 entries */
    float *part; /* per task: G * (D + 2) floats: unnormalized outputs, then G maxima, G sums */
    float *scratch; /* per thread: G * MUX_KEY_CHUNK floats */
    const mux_isa *isa;
} attn_job;

static inline int first_key(const mux_layer *L, int p) {
    return L->window > 0 && p - L->window + 1 > 0 ? p - L->window + 1 : 0;
}

static void attn_task(void *ctx, int task, int thread) {
    attn_job *j = ctx;
    const mux_model *m = j->m;
    const mux_layer *L = j->L;
    int kvh = m->n_kv, d = m->head_dim, G = m->n_heads / kvh, bf16 = m->cache_bf16;
    int i = 0;
    while (task >= j->task_row[i + 1]) i++;
    int local = task - j->task_row[i], chunks = (local / kvh), g = local % kvh;
    int p = j->pos[i], lo = first_key(L, p);
    int c0 = lo + chunks * MUX_KEY_CHUNK, c1 = c0 + MUX_KEY_CHUNK < p + 1 ? c0 + MUX_KEY_CHUNK : p + 1;
    int n = c1 - c0;
    size_t es = bf16 ? 2 : 4, row = (size_t)d * es;
    const float *q = j->qkv + (int64_t)i * (m->n_heads + 2 * kvh) * d + g * G * d;
    const char *kb = (const char *)L->k_cache + ((int64_t)j->slot[i] * L->slot_stride + g * L->head_stride) * es;
    const char *vb = (const char *)L->v_cache + ((int64_t)j->slot[i] * L->slot_stride + g * L->head_stride) * es;
    float *s = j->scratch + (size_t)thread * G * MUX_KEY_CHUNK; /* [G, n] */
    j->isa->scores(q, G, kb, row, c0, n, L->capacity, d, bf16, s);
    float *o = j->part + (size_t)task * G * (d + 2), *mx = o + G * d, *sum = mx + G;
    memset(o, 0, sizeof(float) * (size_t)(G * d));
    for (int h = 0; h < G; h++) {
        float *sh = s + h * n, top = -INFINITY;
        for (int t = 0; t < n; t++) {
            sh[t] *= m->attn_scale;
            top = sh[t] > top ? sh[t] : top;
        }
        mx[h] = top;
        sum[h] = j->isa->exp_sum(sh, n, top);
        j->isa->values(o + h * d, sh, n, vb, row, c0, L->capacity, d, bf16);
    }
}

/* out[i] = the chunks of row i merged in order: o = sum_c o_c e^(m_c - M) / sum_c s_c e^(m_c - M). */
static void attn_merge(const attn_job *j, int n, float *out) {
    const mux_model *m = j->m;
    int kvh = m->n_kv, d = m->head_dim, G = m->n_heads / kvh;
    for (int i = 0; i < n; i++) {
        int chunks = (j->task_row[i + 1] - j->task_row[i]) / kvh;
        for (int g = 0; g < kvh; g++)
            for (int h = 0; h < G; h++) {
                float top = -INFINITY, total = 0.0f;
                for (int c = 0; c < chunks; c++) {
                    const float *part = j->part + (size_t)(j->task_row[i] + c * kvh + g) * G * (d + 2);
                    top = part[G * d + h] > top ? part[G * d + h] : top;
                }
                float *o = out + (int64_t)i * m->n_heads * d + (g * G + h) * d;
                memset(o, 0, sizeof(float) * (size_t)d);
                for (int c = 0; c < chunks; c++) {
                    const float *part = j->part + (size_t)(j->task_row[i] + c * kvh + g) * G * (d + 2);
                    float w = mux_expf(part[G * d + h] - top);
                    total += part[G * d + G + h] * w;
                    for (int e = 0; e < d; e++) o[e] += part[h * d + e] * w;
                }
                float inv = 1.0f / total;
                for (int e = 0; e < d; e++) o[e] *= inv;
            }
    }
}

static float silu(float x) { return x / (1.0f + expf(-x)); }

/* GELU with the tanh approximation (Gemma's gelu_pytorch_tanh). */
static float gelu_tanh(float x) { return 0.5f * x * (1.0f + tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x))); }

/* One forward pass over n rows (each a token at pos[i] of the session in cache slot slot[i]),
 * x [n, hidden] their embeddings, updated in place to the last layer's output. Each layer writes
 * every row's keys and values into the caches before any row attends, so the rows of one session's
 * chunk see each other causally. logits [n_logits, vocab] for rows logit_rows. Returns 0, or < 0. */
int mux_forward(const mux_model *m, int n, float *x, const int32_t *pos, const int32_t *slot, int n_logits,
                const int32_t *logit_rows, float *logits) {
    if (n < 1 || n > MUX_MAX_M || n_logits < 0 || n_logits > n) return -1;
    int C = m->hidden, H = m->n_heads, KV = m->n_kv, D = m->head_dim, F = m->inter;
    if (C % 32 || F % 32 || (H * D) % 32 || D % 8 || H % KV || H / KV > 64) return -1;
    for (int i = 0; i < n; i++)
        if (pos[i] < 0 || pos[i] >= m->max_pos) return -4;
    const mux_isa *isa = isa_of(mux_q_isa());
    int QKV = (H + 2 * KV) * D, wide = F > C ? F : C;
    wide = wide > H * D ? wide : H * D;
    size_t floats = (size_t)n * (C + QKV + H * D + 2 * F + C);
    int G = H / KV;
    /* Attention tasks: (row, key chunk, KV head); room for their partial results (as if no layer had
     * a window) and per-thread scores. */
    size_t tasks = 0;
    for (int i = 0; i < n; i++) tasks += (size_t)((pos[i] + MUX_KEY_CHUNK) / MUX_KEY_CHUNK) * KV;
    size_t part_floats = tasks * G * (D + 2), scratch_floats = (size_t)pool.n * G * MUX_KEY_CHUNK;
    float *buf = malloc(sizeof(float) * (floats + part_floats + scratch_floats));
    mux_q8 *qa = malloc(sizeof(mux_q8) * (size_t)n * Q8_ROW(wide / 32));
    if (!buf || !qa) {
        free(buf);
        free(qa);
        return -3;
    }
    float *h = buf, *qkv = h + n * C, *att = qkv + (size_t)n * QKV, *gu = att + (size_t)n * H * D;
    float *tmp = gu + (size_t)n * 2 * F, *part = tmp + (size_t)n * C, *scratch = part + part_floats;
    const mux_q8 *rows[MUX_MAX_M];
    int rc = 0;
#define QUANT(src, k, ld)                                                   \
    for (int i = 0; i < n; i++) {                                           \
        quantize_row((src) + (int64_t)i * (ld), (k), qa + (int64_t)i * Q8_ROW((k) / 32)); \
        rows[i] = qa + (int64_t)i * Q8_ROW((k) / 32);                             \
    }
    for (int l = 0; l < m->n_layers && !rc; l++) {
        const mux_layer *L = m->layers + l;
        for (int i = 0; i < n; i++) rms_norm(x + (int64_t)i * C, L->attn_norm, C, m->eps, h + (int64_t)i * C);
        QUANT(h, C, C);
        mux_qweight w3[3] = {L->q, L->k, L->v};
        w3[1].out_offset += H * D;
        w3[2].out_offset += (H + KV) * D;
        if ((rc = matmul_q8(w3, 3, C, rows, n, qkv, QKV))) break;
        for (int i = 0; i < n; i++) {
            float *r = qkv + (int64_t)i * QKV;
            if (L->bias_q)
                for (int e = 0; e < H * D; e++) r[e] += L->bias_q[e];
            if (L->bias_k)
                for (int e = 0; e < KV * D; e++) r[H * D + e] += L->bias_k[e];
            if (L->bias_v)
                for (int e = 0; e < KV * D; e++) r[(H + KV) * D + e] += L->bias_v[e];
            if (L->q_norm) /* Qwen3, Gemma 3: each query and key head normalized before rope */
                for (int e = 0; e < H; e++) rms_norm(r + e * D, L->q_norm, D, m->eps, r + e * D);
            if (L->k_norm)
                for (int e = H; e < H + KV; e++) rms_norm(r + e * D, L->k_norm, D, m->eps, r + e * D);
            const float *c = L->rope_cos + (int64_t)pos[i] * (D / 2), *s = L->rope_sin + (int64_t)pos[i] * (D / 2);
            rope(r, H + KV, D, c, s);
            size_t es = m->cache_bf16 ? 2 : 4;
            for (int g = 0; g < KV; g++) {
                int64_t off = (int64_t)slot[i] * L->slot_stride + g * L->head_stride + (int64_t)(pos[i] % L->capacity) * D;
                store_row((char *)L->k_cache + off * es, r + (H + g) * D, D, m->cache_bf16);
                store_row((char *)L->v_cache + off * es, r + (H + KV + g) * D, D, m->cache_bf16);
            }
        }
        int32_t tr[MUX_MAX_M + 1];
        tr[0] = 0;
        for (int i = 0; i < n; i++) {
            int keys = pos[i] + 1 - first_key(L, pos[i]);
            tr[i + 1] = tr[i] + ((keys + MUX_KEY_CHUNK - 1) / MUX_KEY_CHUNK) * KV;
        }
        attn_job aj = {m, L, qkv, pos, slot, tr, part, scratch, isa};
        pool_run(attn_task, &aj, tr[n]);
        attn_merge(&aj, n, att);
        QUANT(att, H * D, H * D);
        mux_qweight wo = L->o;
        if ((rc = matmul_q8(&wo, 1, H * D, rows, n, tmp, C))) break;
        if (L->post_attn_norm) /* Gemma 3 normalizes the attention's output too */
            for (int i = 0; i < n; i++) rms_norm(tmp + (int64_t)i * C, L->post_attn_norm, C, m->eps, tmp + (int64_t)i * C);
        for (int64_t e = 0; e < (int64_t)n * C; e++) x[e] += tmp[e];
        for (int i = 0; i < n; i++) rms_norm(x + (int64_t)i * C, L->ffn_norm, C, m->eps, h + (int64_t)i * C);
        QUANT(h, C, C);
        mux_qweight w2[2] = {L->gate, L->up};
        w2[1].out_offset += F;
        if ((rc = matmul_q8(w2, 2, C, rows, n, gu, 2 * F))) break;
        for (int i = 0; i < n; i++) {
            float *g = gu + (int64_t)i * 2 * F;
            if (m->gelu)
                for (int e = 0; e < F; e++) g[e] = gelu_tanh(g[e]) * g[F + e];
            else
                for (int e = 0; e < F; e++) g[e] = silu(g[e]) * g[F + e];
        }
        QUANT(gu, F, 2 * F);
        mux_qweight wd = L->down;
        if ((rc = matmul_q8(&wd, 1, F, rows, n, tmp, C))) break;
        if (L->post_ffn_norm)
            for (int i = 0; i < n; i++) rms_norm(tmp + (int64_t)i * C, L->post_ffn_norm, C, m->eps, tmp + (int64_t)i * C);
        for (int64_t e = 0; e < (int64_t)n * C; e++) x[e] += tmp[e];
    }
    if (!rc && n_logits > 0) {
        for (int i = 0; i < n_logits; i++) {
            int r = logit_rows[i];
            if (r < 0 || r >= n) { rc = -1; break; }
            rms_norm(x + (int64_t)r * C, m->final_norm, C, m->eps, h + (int64_t)i * C);
        }
        if (!rc) {
            for (int i = 0; i < n_logits; i++) {
                quantize_row(h + (int64_t)i * C, C, qa + (int64_t)i * Q8_ROW(C / 32));
                rows[i] = qa + (int64_t)i * Q8_ROW(C / 32);
            }
            mux_qweight wh = m->head;
            rc = matmul_q8(&wh, 1, C, rows, n_logits, logits, m->vocab);
        }
    }
#undef QUANT
    free(buf);
    free(qa);
    return rc;
}
