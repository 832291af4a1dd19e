/* Integer-dot-product kernels for quantized linear layers on the CPU (native/__init__.py says why).
 *
 * Weights are repacked at load (ops.py) so that one 64-byte vector holds 16 output rows x 4 inputs: each
 * int32 lane of AVX-512 VNNI's vpdpbusd (u8 x s8, four products summed into an int32) is one output row, the
 * activations' 4 bytes are broadcast to every lane, and no horizontal sum is needed. The weights are the
 * unsigned operand: int8 w is stored as w + 128 (int4: w + 8, two per byte), so a row's sum is
 * sum((w + c) * x) = sum(w * x) + c * sum(x), and c times the activations' sum is subtracted, exact in int32.
 * Per row group of 16 rows, the layout is [inputs / 4][16 rows][4] bytes (int8) or [inputs / 8][16][4] bytes
 * with inputs 8i..8i+3 in the low nibbles and 8i+4..8i+7 in the high ones (int4).
 *
 * Every kernel has a portable C twin (KI_PORTABLE, or a compiler without VNNI) that does the same operations
 * in the same order, so both give the same bits. -ffp-contract=off: the only fused multiply-adds are the
 * explicit ones. */
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kubeinfer_cpu.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && !defined(KI_PORTABLE)
#include <immintrin.h>
#define KI_VNNI 1
#else
#define KI_VNNI 0
#endif
/* x86-64-v3 (AVX2 and FMA; build.py's v3 library): the kernels' AVX2 paths, where they have one, take over from the
 * portable C when there is no AVX-512 path (KI_VNNI 0), in the same order of operations or the bound their file
 * states. */
#if defined(__AVX2__) && defined(__FMA__) && !defined(KI_PORTABLE)
#include <immintrin.h>
#define KI_AVX2 1
#else
#define KI_AVX2 0
#endif

#define ROWS 16  /* output rows per group: one int32 lane each */
#define BLOCK 32 /* inputs per block of the llama.cpp arithmetic (its QK8_0) */
#define TILE 4   /* tokens per tile: each weight vector loaded once per tile */

int ki_has_vnni(void) { return KI_VNNI; }

/* The instruction set the library was built for: 4 (AVX-512 VNNI), 3 (AVX2 and FMA), 0 (portable C). */
int ki_level(void) { return KI_VNNI ? 4 : KI_AVX2 ? 3 : 0; }

/* ------------------------------------------------------------------ argument checks
 * The products' dimensions come from a checkpoint (through Python), so every exported product is handed the
 * length in bytes of each buffer it reads or writes and refuses, before touching any, a call whose dimensions
 * would reach past one: KI_EBOUNDS, nothing read or written (the Python side raises). A check is a few integer
 * operations per call. */

/* Whether a * b * elem bytes (each >= 0, no overflow) fit in `have` bytes. */
static inline int ki_fits(long have, long a, long b, long elem) {
    long need;
    if (have < 0 || a < 0 || b < 0 || elem < 0) return 0;
    if (__builtin_mul_overflow(a, b, &need) || __builtin_mul_overflow(need, elem, &need)) return 0;
    return need <= have;
}

/* 64-byte aligned memory of at least `bytes`: C11's aligned_alloc takes only sizes that are a multiple of the
 * alignment (AddressSanitizer refuses others; glibc happens to accept them). */
static inline void *ki_alloc64(size_t bytes) { return aligned_alloc(64, (bytes + 63) / 64 * 64); }

/* Rows padded to whole groups of 16 (the packed layouts' row groups). */
static inline long ki_padded_rows(int N) { return ((long)N + ROWS - 1) / ROWS * ROWS; }

/* ------------------------------------------------------------------ thread pool
 * One job at a time (call_mu). The job's chunks are claimed through one 64-bit word: generation (32 bits),
 * chunk count (16), next chunk (16), so a worker that wakes late can only claim a chunk of the job that is
 * still current, and the job cannot finish (nor its fields change) before a claimed chunk is done. Workers
 * spin for spin_ns after a job, then sleep on a condition variable. The caller works too. */
typedef void (*task_fn)(const void *ctx, int start, int end);
static pthread_mutex_t call_mu = PTHREAD_MUTEX_INITIALIZER, sleep_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t sleep_cv = PTHREAD_COND_INITIALIZER;
static _Atomic uint64_t job_word;
static atomic_int remaining, sleepers, seats; /* seats: workers that may still join the current job */
static task_fn job_fn;
static const void *job_ctx;
static int job_items, job_chunk, pool_threads = 1, pool_active = 1; /* threads started, threads a job uses */
static long spin_ns = 50000;

static inline void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000L + t.tv_nsec;
}

/* Claims and runs chunks of generation `gen` until none is left. */
static void work(uint32_t gen) {
    for (;;) {
        uint64_t v = atomic_load(&job_word);
        uint32_t count = (v >> 16) & 0xFFFF, next = v & 0xFFFF;
        if ((uint32_t)(v >> 32) != gen || next >= count) return;
        if (!atomic_compare_exchange_weak(&job_word, &v, v + 1)) continue;
        int start = (int)next * job_chunk, end = start + job_chunk;
        job_fn(job_ctx, start, end < job_items ? end : job_items);
        atomic_fetch_sub(&remaining, 1);
    }
}

static void *worker(void *arg) {
    (void)arg;
    uint32_t seen = 0;
    for (;;) {
        uint32_t gen = (uint32_t)(atomic_load(&job_word) >> 32);
        if (gen == seen) {
            long until = now_ns() + spin_ns;
            for (int i = 1; (gen = (uint32_t)(atomic_load(&job_word) >> 32)) == seen; i++) {
                relax();
                if ((i & 255) == 0 && now_ns() > until) {
                    pthread_mutex_lock(&sleep_mu);
                    atomic_fetch_add(&sleepers, 1);
                    while ((gen = (uint32_t)(atomic_load(&job_word) >> 32)) == seen)
                        pthread_cond_wait(&sleep_cv, &sleep_mu);
                    atomic_fetch_sub(&sleepers, 1);
                    pthread_mutex_unlock(&sleep_mu);
                    break;
                }
            }
        }
        seen = gen;
        if (atomic_fetch_sub(&seats, 1) > 0) work(gen);
    }
    return NULL;
}

/* A forked child has none of the workers (and maybe a lock another thread held): it starts over alone. */
static void after_fork_child(void) {
    pthread_mutex_init(&call_mu, NULL), pthread_mutex_init(&sleep_mu, NULL), pthread_cond_init(&sleep_cv, NULL);
    atomic_store(&sleepers, 0);
    pool_threads = pool_active = 1;
}

static void register_fork_handler(void) { pthread_atfork(NULL, NULL, after_fork_child); }

/* Jobs use `threads` threads from now on (the caller one of them), workers started as needed; spin_us < 0 keeps
 * the spin. Returns the thread count in use. */
int ki_init(int threads, long spin_us) {
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, register_fork_handler);
    pthread_mutex_lock(&call_mu);
    if (spin_us >= 0) spin_ns = spin_us * 1000;
    while (pool_threads < threads) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        if (pthread_create(&t, &attr, worker, NULL) != 0) break;
        pthread_attr_destroy(&attr);
        pool_threads++;
    }
    pool_active = threads < pool_threads ? (threads > 1 ? threads : 1) : pool_threads;
    int n = pool_active;
    pthread_mutex_unlock(&call_mu);
    return n;
}

/* fn over [0, items), split into chunks of whole items across the pool; call_mu held by the caller. */
static void parallel(task_fn fn, const void *ctx, int items) {
    int chunks = pool_active == 1 ? 1 : pool_active * 8;
    if (chunks > items) chunks = items;
    if (chunks <= 1) {
        fn(ctx, 0, items);
        return;
    }
    job_fn = fn, job_ctx = ctx, job_items = items, job_chunk = (items + chunks - 1) / chunks;
    chunks = (items + job_chunk - 1) / job_chunk;
    atomic_store(&remaining, chunks);
    atomic_store(&seats, pool_active - 1);
    uint32_t gen = (uint32_t)(atomic_load(&job_word) >> 32) + 1;
    atomic_store(&job_word, ((uint64_t)gen << 32) | ((uint64_t)chunks << 16));
    if (atomic_load(&sleepers) > 0) {
        pthread_mutex_lock(&sleep_mu);
        pthread_cond_broadcast(&sleep_cv);
        pthread_mutex_unlock(&sleep_mu);
    }
    work(gen);
    while (atomic_load(&remaining) > 0) relax();
}

/* ------------------------------------------------------------------ W8A8: exact int32 sums
 * out[m, n] = ((float)(sum_k q[m, k] * w[n, k]) * sx[m]) * sw[n], as torch._int_mm then the two scales. */
typedef struct {
    const int8_t *q;     /* [M, Kp] activations, zero-padded */
    const int16_t *qw;   /* the AVX2 path's: q widened to int16 */
    const int32_t *bias; /* [M]: 128 * sum_k q[m, k] */
    const float *sx, *sw;
    const uint8_t *w;
    float *out;
    int M, N, Kp;
} w8a8_ctx;

/* Rows of `ng` (1 or 2) row groups from g times `mt` tokens from m0; ng and mt are constants where inlined, so
 * the loops unroll and the accumulators stay in registers (2 x 4 of them: independent dependency chains). The
 * first tile of a row group prefetches (a decode step's weights come from memory: without it the 222M model's
 * products ran 1.3-2.6x slower on cold weights than on cached ones at 16 tokens): one row group, W8_PREFETCH
 * bytes ahead in its stream; two, the next pair's same step. */
#ifndef W8_PREFETCH
#define W8_PREFETCH 8192
#endif
#if !KI_VNNI && KI_AVX2
/* AVX2 (no vpdpbusd; vpmaddubsw's int16 pair sums would saturate on (w + 128) * q): a step's 16 rows x 4 inputs
 * widened to int16 (4 rows a register), vpmaddwd with the token's 4 inputs as int16: two exact int32 partial sums
 * a row, added pairwise at the end. Integer sums: the same bits as any order. One row group, mt (<= 2) tokens. */
static inline __attribute__((always_inline)) void w8a8_tile_avx2(const w8a8_ctx *c, int g, int m0, const int mt) {
    const uint8_t *wg = c->w + (size_t)g * c->Kp * ROWS;
    __m256i acc[2][4];
    for (int t = 0; t < mt; t++)
        for (int i = 0; i < 4; i++) acc[t][i] = _mm256_setzero_si256();
    for (int k = 0; k < c->Kp; k += 4) {
        const uint8_t *wk = wg + (size_t)k * ROWS;
        if (m0 == 0) _mm_prefetch((const char *)wk + W8_PREFETCH, _MM_HINT_T0);
        __m256i w[4];
        for (int i = 0; i < 4; i++) w[i] = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(wk + 16 * i)));
        for (int t = 0; t < mt; t++) {
            int64_t x4;
            memcpy(&x4, c->qw + (size_t)(m0 + t) * c->Kp + k, 8);
            const __m256i x = _mm256_set1_epi64x(x4);
            for (int i = 0; i < 4; i++) acc[t][i] = _mm256_add_epi32(acc[t][i], _mm256_madd_epi16(w[i], x));
        }
    }
    const int n0 = g * ROWS, nn = c->N - n0 < ROWS ? c->N - n0 : ROWS;
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int t = 0; t < mt; t++) {
        const int m = m0 + t;
        for (int h = 0; h < 2; h++) { /* rows 8h.. 8h + 7: registers 2h (rows 0-1 | 2-3) and 2h + 1 (4-5 | 6-7) */
            const int rows = nn - 8 * h;
            if (rows <= 0) break;
            __m256i sum = _mm256_permute4x64_epi64(_mm256_hadd_epi32(acc[t][2 * h], acc[t][2 * h + 1]),
                                                   _MM_SHUFFLE(3, 1, 2, 0));
            sum = _mm256_sub_epi32(sum, _mm256_set1_epi32(c->bias[m]));
            const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(rows), lanes);
            const __m256 sw = _mm256_maskload_ps(c->sw + n0 + 8 * h, mask);
            const __m256 f = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(sum), _mm256_set1_ps(c->sx[m])), sw);
            _mm256_maskstore_ps(c->out + (size_t)m * c->N + n0 + 8 * h, mask, f);
        }
    }
}
#endif

static inline __attribute__((always_inline)) void w8a8_tile(const w8a8_ctx *c, int g, int m0, const int ng,
                                                            const int mt) {
#if KI_VNNI
    const size_t stride = (size_t)c->Kp * ROWS;
    const uint8_t *wg = c->w + g * stride;
    __m512i acc[2][TILE];
    for (int i = 0; i < 2; i++)
        for (int t = 0; t < TILE; t++) acc[i][t] = _mm512_setzero_si512();
    if (ng == 1) { /* one row group: its even and odd steps in two chains, summed after */
        const uint8_t *end = c->w + (size_t)((c->N + ROWS - 1) / ROWS) * stride - 128 - W8_PREFETCH;
        for (int k = 0; k < c->Kp; k += 8) {
            if (m0 == 0 && wg + k * ROWS <= end) {
                _mm_prefetch((const char *)wg + k * ROWS + W8_PREFETCH, _MM_HINT_T0);
                _mm_prefetch((const char *)wg + k * ROWS + 64 + W8_PREFETCH, _MM_HINT_T0);
            }
            __m512i w0 = _mm512_loadu_si512(wg + k * ROWS), w1 = _mm512_loadu_si512(wg + (k + 4) * ROWS);
            for (int t = 0; t < mt; t++) {
                const int8_t *q = c->q + (size_t)(m0 + t) * c->Kp + k;
                acc[0][t] = _mm512_dpbusd_epi32(acc[0][t], w0, _mm512_set1_epi32(*(const int32_t *)q));
                acc[1][t] = _mm512_dpbusd_epi32(acc[1][t], w1, _mm512_set1_epi32(*(const int32_t *)(q + 4)));
            }
        }
        for (int t = 0; t < mt; t++) acc[0][t] = _mm512_add_epi32(acc[0][t], acc[1][t]);
    } else {
        const int pf = m0 == 0 && g + 2 + ng <= (c->N + ROWS - 1) / ROWS; /* the next pair exists */
        for (int k = 0; k < c->Kp; k += 4) {
            if (pf)
                for (int i = 0; i < ng; i++) _mm_prefetch((const char *)wg + (2 + i) * stride + k * ROWS, _MM_HINT_T0);
            __m512i w[2];
            for (int i = 0; i < ng; i++) w[i] = _mm512_loadu_si512(wg + i * stride + k * ROWS);
            for (int t = 0; t < mt; t++) {
                __m512i a = _mm512_set1_epi32(*(const int32_t *)(c->q + (size_t)(m0 + t) * c->Kp + k));
                for (int i = 0; i < ng; i++) acc[i][t] = _mm512_dpbusd_epi32(acc[i][t], w[i], a);
            }
        }
    }
    for (int i = 0; i < ng; i++) {
        int n0 = (g + i) * ROWS, nn = c->N - n0 < ROWS ? c->N - n0 : ROWS;
        __mmask16 mask = (__mmask16)((1u << nn) - 1);
        __m512 sw = _mm512_maskz_loadu_ps(mask, c->sw + n0);
        for (int t = 0; t < mt; t++) {
            int m = m0 + t;
            __m512i sum = _mm512_sub_epi32(acc[i][t], _mm512_set1_epi32(c->bias[m]));
            __m512 f = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(c->sx[m])), sw);
            _mm512_mask_storeu_ps(c->out + (size_t)m * c->N + n0, mask, f);
        }
    }
#elif KI_AVX2
    for (int i = 0; i < ng; i++)
        for (int t0 = 0; t0 < mt; t0 += 2) {
            if (mt - t0 >= 2) w8a8_tile_avx2(c, g + i, m0 + t0, 2);
            else w8a8_tile_avx2(c, g + i, m0 + t0, 1);
        }
#else
    for (int i = 0; i < ng; i++) {
        const uint8_t *wg = c->w + (size_t)(g + i) * c->Kp * ROWS;
        int n0 = (g + i) * ROWS, nn = c->N - n0 < ROWS ? c->N - n0 : ROWS;
        for (int t = 0; t < mt; t++) {
            int m = m0 + t;
            const int8_t *q = c->q + (size_t)m * c->Kp;
            for (int r = 0; r < nn; r++) {
                int32_t sum = 0;
                for (int k = 0; k < c->Kp; k++) sum += (int32_t)wg[(k / 4) * 64 + r * 4 + k % 4] * q[k];
                float f = ((float)(sum - c->bias[m]) * c->sx[m]) * c->sw[n0 + r];
                c->out[(size_t)m * c->N + n0 + r] = f;
            }
        }
    }
#endif
}

/* Work item u: row groups 2u and 2u + 1 (the last may be alone), all tokens, a tile at a time. */
#define TILES(tile, c, groups, u)                                                                                \
    do {                                                                                                       \
        int g = 2 * (u), two = g + 1 < (groups) && (c)->M > 1; /* one token: two chains in one group */       \
        for (int m0 = 0; m0 < (c)->M; m0 += TILE) {                                                            \
            int mt = (c)->M - m0 < TILE ? (c)->M - m0 : TILE;                                                  \
            if (two) switch (mt) {                                                                             \
                case 1: tile(c, g, m0, 2, 1); break;                                                           \
                case 2: tile(c, g, m0, 2, 2); break;                                                           \
                case 3: tile(c, g, m0, 2, 3); break;                                                           \
                default: tile(c, g, m0, 2, TILE);                                                              \
                }                                                                                              \
            else for (int h = g; h < g + 2 && h < (groups); h++) switch (mt) {                                 \
                case 1: tile(c, h, m0, 1, 1); break;                                                           \
                case 2: tile(c, h, m0, 1, 2); break;                                                           \
                case 3: tile(c, h, m0, 1, 3); break;                                                           \
                default: tile(c, h, m0, 1, TILE);                                                              \
                }                                                                                              \
        }                                                                                                      \
    } while (0)

static void w8a8_task(const void *ctx, int start, int end) {
    const w8a8_ctx *c = ctx;
    int groups = (c->N + ROWS - 1) / ROWS;
    for (int u = start; u < end; u++) TILES(w8a8_tile, c, groups, u);
}

/* q [M, K] int8, sx [M], w packed [ceil(N / 16) groups][Kp * 16], Kp = K rounded up to 32, sw [N] -> out [M, N].
 * Each pointer's buffer length in bytes after it. Returns -1 when out of memory, KI_EBOUNDS (nothing written) when
 * the dimensions do not fit the buffers or K exceeds 65536 (the int32 sums). */
int ki_w8a8(const int8_t *q, long q_bytes, const float *sx, long sx_bytes, int M, int K, const uint8_t *w,
            long w_bytes, const float *sw, long sw_bytes, int N, float *out, long out_bytes) {
    if (M < 0 || K < 1 || K > 65536 || N < 1 || !ki_fits(q_bytes, M, K, 1) || !ki_fits(sx_bytes, M, 1, 4)
        || !ki_fits(w_bytes, ki_padded_rows(N), (K + BLOCK - 1) / BLOCK * BLOCK, 1) || !ki_fits(sw_bytes, N, 1, 4)
        || !ki_fits(out_bytes, M, N, 4))
        return KI_EBOUNDS;
    int Kp = (K + BLOCK - 1) / BLOCK * BLOCK;
    int8_t *qp = ki_alloc64((size_t)M * Kp + 64);
    int32_t *bias = malloc(sizeof(int32_t) * (size_t)(M > 0 ? M : 1));
    if (!qp || !bias) {
        free(qp), free(bias);
        return -1;
    }
    for (int m = 0; m < M; m++) {
        int32_t s = 0;
        for (int k = 0; k < K; k++) s += q[(size_t)m * K + k];
        bias[m] = 128 * s;
        memcpy(qp + (size_t)m * Kp, q + (size_t)m * K, K);
        memset(qp + (size_t)m * Kp + K, 0, Kp - K);
    }
    int16_t *qw = NULL;
#if !KI_VNNI && KI_AVX2
    qw = malloc(sizeof(int16_t) * ((size_t)M * Kp + 4));
    if (!qw) {
        free(qp), free(bias);
        return -1;
    }
    for (size_t i = 0; i < (size_t)M * Kp; i++) qw[i] = qp[i];
#endif
    w8a8_ctx c = {qp, qw, bias, sx, sw, w, out, M, N, Kp};
    pthread_mutex_lock(&call_mu);
    parallel(w8a8_task, &c, ((N + ROWS - 1) / ROWS + 1) / 2);
    pthread_mutex_unlock(&call_mu);
    free(qp), free(bias), free(qw);
    return 0;
}

/* x [M, K] float32 quantized per token as activations.py's dynamic symmetric int8 (the compressed-tensors
 * reference): scale = max(|min(x, 0)|, max(x, 0)) / 127.5 (float32 eps when 0), q = round half to even of
 * clamp(x / scale, -128, 127); the same float32 operations as the torch code, so the same bits. Each pointer's
 * buffer length in bytes after it; KI_EBOUNDS (nothing written) when M, K do not fit them. */
int ki_quantize_token_int8(const float *x, long x_bytes, int M, int K, int8_t *q, long q_bytes, float *scale,
                           long scale_bytes) {
    if (M < 0 || K < 1 || !ki_fits(x_bytes, M, K, 4) || !ki_fits(q_bytes, M, K, 1) || !ki_fits(scale_bytes, M, 1, 4))
        return KI_EBOUNDS;
    for (int m = 0; m < M; m++) {
        const float *xm = x + (size_t)m * K;
#if KI_VNNI /* 16 lanes at a time, the tail masked (zeros: neutral for the min and max, which start at 0) */
        __m512 vlo = _mm512_setzero_ps(), vhi = _mm512_setzero_ps();
        for (int k = 0; k < K; k += 16) {
            __m512 v = _mm512_maskz_loadu_ps(K - k >= 16 ? 0xFFFF : (__mmask16)((1u << (K - k)) - 1), xm + k);
            vlo = _mm512_min_ps(vlo, v), vhi = _mm512_max_ps(vhi, v);
        }
        float lo = _mm512_reduce_min_ps(vlo), hi = _mm512_reduce_max_ps(vhi);
#else
        float lo = 0.0f, hi = 0.0f;
        for (int k = 0; k < K; k++) lo = fminf(lo, xm[k]), hi = fmaxf(hi, xm[k]);
#endif
        float s = fmaxf(fabsf(lo), fabsf(hi)) / 127.5f;
        if (s == 0.0f) s = 1.1920928955078125e-07f; /* torch.finfo(float32).eps */
#if KI_VNNI /* the same float operations: an exact division, clamp, round half to even */
        __m512 vs = _mm512_set1_ps(s), vmin = _mm512_set1_ps(-128.0f), vmax = _mm512_set1_ps(127.0f);
        for (int k = 0; k < K; k += 16) {
            __mmask16 mask = K - k >= 16 ? 0xFFFF : (__mmask16)((1u << (K - k)) - 1);
            __m512 v = _mm512_min_ps(_mm512_max_ps(_mm512_div_ps(_mm512_maskz_loadu_ps(mask, xm + k), vs), vmin), vmax);
            v = _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            _mm512_mask_cvtepi32_storeu_epi8(q + (size_t)m * K + k, mask, _mm512_cvtps_epi32(v));
        }
#else
        for (int k = 0; k < K; k++) q[(size_t)m * K + k] = (int8_t)nearbyintf(fminf(fmaxf(xm[k] / s, -128.0f), 127.0f));
#endif
        scale[m] = s;
    }
    return 0;
}

/* bf16 <-> float32 for the kernels included below (attention.c, decode_ops.c). */
static inline float bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } v = {.u = (uint32_t)h << 16};
    return v.f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even; a NaN stays a (quiet) NaN */
    union { float f; uint32_t u; } v = {.f = f};
    uint16_t r = (uint16_t)((v.u + 0x7FFFu + ((v.u >> 16) & 1u)) >> 16);
    return f != f ? (uint16_t)((v.u >> 16) | 0x40u) : r;
}

/* e^x for the kernels included below (decode_ops.c's silu, attention.c's softmax), within ~2 ulps, inf above
 * 88.72 as expf (below -87.3 a tiny normal where expf gives a denormal or 0; it is
 * only ever added to 1, or a softmax weight against the max's 1): x = n ln2 + r,
 * |r| <= ln2 / 2 (ln2 in two parts, so r is exact to ~2^-32), e^r by its Taylor series to r^7 (the remainder
 * < 2^-27 relative), times 2^n put into the exponent bits. Branch-free, so loops over it vectorize. */
static inline float ki_expf(float xo) {
    float x = xo < -87.3f ? -87.3f : (xo > 88.3f ? 88.3f : xo);
    const float shift = 12582912.0f; /* 1.5 * 2^23: adding it rounds to the nearest integer */
    float t = x * 1.44269504088896341f + shift;
    float n = t - shift;
    float r = (x - n * 0.693145751953125f) - n * 1.42860682030941723e-6f;
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    union { uint32_t u; float f; } scale = {.u = (uint32_t)((int32_t)n + 127) << 23};
    return xo > 88.7228394f ? INFINITY : p * scale.f;
}

#include "kernels_q8_0.c"
#include "attention.c"
#include "decode_ops.c"
#include "f32_linear.c"
#include "a16_linear.c"
#include "w4a8_linear.c"
#include "decoder_layer.c"
