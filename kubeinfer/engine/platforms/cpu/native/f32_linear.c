/* float32 products of small batches, out[M, N] = x[M, K] @ w[N, K]^T, on the pool (included by kernels.c).
 *
 * The weights stay in the checkpoint's row-major [N, K] layout: nothing repacked, so nothing more is held, a tied
 * embedding's rows and torch's fallback read the same tensor. Read this way (the next rows prefetched into L2:
 * a row of 1024 inputs is one 4 KiB page, too short a stream for the hardware prefetcher) one thread reached
 * about OpenBLAS's read rate at one token and the FMA peak (39 GMAC/s, OpenBLAS 25) at 16 tokens on lm_head's
 * [16384, 1024]: a panel layout was not tried (benchmarks/RESULTS.md native-f32-linear). A tile is
 * RT output rows x TT tokens: each step loads 16 inputs of every row and of every token and makes the RT x TT
 * multiply-adds between them, so each weight vector loaded serves every token of the tile. Work is split over
 * the pool by groups of GROUP rows; one token takes a group's rows in one tile (more independent streams).
 *
 * Summation order, fixed per output element whatever M, the tiling or the thread count (batch invariance): lane
 * j (0..15) sums w[k] * x[k] for k = j, j + 16, ... with one fused multiply-add each, in order, the inputs past
 * K read as zeros; then the 16 lanes in a tree: j += j + 8, j += j + 4, j += j + 2, then lane 0 + lane 1. The
 * portable twin (KI_PORTABLE) does the same operations in the same order: the same bits. The AVX2 path (KI_AVX2
 * without AVX-512: build.py's v3) holds lanes 0-7 and 8-15 in two 8-lane registers, the same fused multiply-adds,
 * and starts the tree by adding the two: the same bits again. */
#include "kubeinfer_cpu.h"

#define F32_LANES 16
#define F32_RT 4     /* rows per tile (several tokens) */
#define F32_TT 4     /* tokens per tile */
#define F32_GROUP 8  /* rows per work item; a one-token tile takes all of them */

typedef struct {
    const float *x, *w;
    float *out;
    int M, N, K;
} f32_ctx;

#if KI_VNNI
/* The lanes' tree sum of f32_linear.c's order: (j, j + 8), (j, j + 4), (j, j + 2), (0, 1). */
static inline float f32_tree16(__m512 v) {
    __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}
#endif

#if !KI_VNNI && KI_AVX2
/* f32_tree16 from its first step's sum (lanes j + lanes j + 8, one 8-lane register). */
static inline float f32_tree8(__m256 s8) {
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}

/* Lanes k.. k + 7 of a row, those at or past K read as zeros (as the AVX-512 path's masked loads). */
static inline __m256 f32_load8(const float *row, int k, int K) {
    if (K - k >= 8) return _mm256_loadu_ps(row + k);
    if (K - k <= 0) return _mm256_setzero_ps();
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_maskload_ps(row + k, _mm256_cmpgt_epi32(_mm256_set1_epi32(K - k), lanes));
}

/* nr (<= 4) rows times mt (<= 2 where nr > 2) tokens: 2 * nr * mt accumulators (of 16 registers). */
static inline __attribute__((always_inline)) void f32_tile8(const f32_ctx *c, int n0, int m0, const int nr,
                                                            const int mt, const float *pf) {
    const int K = c->K;
    __m256 acc[4][2][2];
    for (int r = 0; r < nr; r++)
        for (int t = 0; t < mt; t++) acc[r][t][0] = acc[r][t][1] = _mm256_setzero_ps();
    const float *w = c->w + (size_t)n0 * K, *x = c->x + (size_t)m0 * K;
    for (int k = 0; k < K; k += F32_LANES) {
        const int whole = K - k >= F32_LANES;
        __m256 xv[2][2];
        for (int t = 0; t < mt; t++)
            for (int h = 0; h < 2; h++)
                xv[t][h] = whole ? _mm256_loadu_ps(x + (size_t)t * K + k + 8 * h)
                                 : f32_load8(x + (size_t)t * K, k + 8 * h, K);
        if (pf)
            for (int r = 0; r < nr; r++) _mm_prefetch((const char *)(pf + (size_t)r * K + k), _MM_HINT_T1);
        for (int r = 0; r < nr; r++)
            for (int h = 0; h < 2; h++) {
                __m256 wv = whole ? _mm256_loadu_ps(w + (size_t)r * K + k + 8 * h)
                                  : f32_load8(w + (size_t)r * K, k + 8 * h, K);
                for (int t = 0; t < mt; t++) acc[r][t][h] = _mm256_fmadd_ps(wv, xv[t][h], acc[r][t][h]);
            }
    }
    for (int t = 0; t < mt; t++)
        for (int r = 0; r < nr; r++)
            c->out[(size_t)(m0 + t) * c->N + n0 + r] = f32_tree8(_mm256_add_ps(acc[r][t][0], acc[r][t][1]));
}
#endif

/* Rows n0.. (nr of them) times tokens m0.. (mt); nr and mt are constants where inlined. */
static inline __attribute__((always_inline)) void f32_tile(const f32_ctx *c, int n0, int m0, const int nr,
                                                           const int mt, const float *pf) {
    const int K = c->K;
#if KI_VNNI
    __m512 acc[F32_GROUP][F32_TT];
    for (int r = 0; r < nr; r++)
        for (int t = 0; t < mt; t++) acc[r][t] = _mm512_setzero_ps();
    const float *w = c->w + (size_t)n0 * K, *x = c->x + (size_t)m0 * K;
    for (int k = 0; k < K; k += F32_LANES) {
        __mmask16 mask = K - k >= F32_LANES ? 0xFFFF : (__mmask16)((1u << (K - k)) - 1);
        __m512 wv[F32_GROUP], xv[F32_TT];
        for (int r = 0; r < nr; r++) wv[r] = _mm512_maskz_loadu_ps(mask, w + (size_t)r * K + k);
        if (pf) /* the next tile's rows, on their way into the cache while this one computes */
            for (int r = 0; r < nr; r++) _mm_prefetch((const char *)(pf + (size_t)r * K + k), _MM_HINT_T1);
        for (int t = 0; t < mt; t++) xv[t] = _mm512_maskz_loadu_ps(mask, x + (size_t)t * K + k);
        for (int r = 0; r < nr; r++)
            for (int t = 0; t < mt; t++) acc[r][t] = _mm512_fmadd_ps(wv[r], xv[t], acc[r][t]);
    }
    for (int t = 0; t < mt; t++)
        for (int r = 0; r < nr; r++) c->out[(size_t)(m0 + t) * c->N + n0 + r] = f32_tree16(acc[r][t]);
#elif KI_AVX2
    /* AVX2's 16 registers: 4 rows of one token, or 2 rows of 2 tokens, a sub-tile (nr, mt constants: unrolled) */
    const int rs = mt == 1 ? 4 : 2, ts = mt == 1 ? 1 : 2;
    for (int r0 = 0; r0 < nr; r0 += rs)
        for (int t0 = 0; t0 < mt; t0 += ts) {
            const float *p = pf && t0 == 0 ? pf + (size_t)r0 * K : NULL;
            const int rn = nr - r0 < rs ? nr - r0 : rs, tn = mt - t0 < ts ? mt - t0 : ts;
            if (tn == 2) {
                if (rn == 2) f32_tile8(c, n0 + r0, m0 + t0, 2, 2, p);
                else f32_tile8(c, n0 + r0, m0 + t0, 1, 2, p);
            } else switch (rn) {
                case 4: f32_tile8(c, n0 + r0, m0 + t0, 4, 1, p); break;
                case 3: f32_tile8(c, n0 + r0, m0 + t0, 3, 1, p); break;
                case 2: f32_tile8(c, n0 + r0, m0 + t0, 2, 1, p); break;
                default: f32_tile8(c, n0 + r0, m0 + t0, 1, 1, p); break;
            }
        }
#else
    (void)pf;
    for (int t = 0; t < mt; t++) {
        const float *x = c->x + (size_t)(m0 + t) * K;
        for (int r = 0; r < nr; r++) {
            const float *w = c->w + (size_t)(n0 + r) * K;
            float lane[F32_LANES];
            for (int j = 0; j < F32_LANES; j++) {
                float a = 0.0f;
                for (int k = j; k < K + F32_LANES - 1 - (K - 1) % F32_LANES; k += F32_LANES)
                    a = fmaf(k < K ? w[k] : 0.0f, k < K ? x[k] : 0.0f, a);
                lane[j] = a;
            }
            for (int h = 8; h; h /= 2)
                for (int j = 0; j < h; j++) lane[j] += lane[j + h];
            c->out[(size_t)(m0 + t) * c->N + n0 + r] = lane[0];
        }
    }
#endif
}

/* One token: up to F32_GROUP rows in one tile. */
static void f32_rows1(const f32_ctx *c, int n0, int nr, const float *pf) {
    switch (nr) {
        case 8: f32_tile(c, n0, 0, 8, 1, pf); break;
        case 7: f32_tile(c, n0, 0, 7, 1, pf); break;
        case 6: f32_tile(c, n0, 0, 6, 1, pf); break;
        case 5: f32_tile(c, n0, 0, 5, 1, pf); break;
        case 4: f32_tile(c, n0, 0, 4, 1, pf); break;
        case 3: f32_tile(c, n0, 0, 3, 1, pf); break;
        case 2: f32_tile(c, n0, 0, 2, 1, pf); break;
        default: f32_tile(c, n0, 0, 1, 1, pf); break;
    }
}

#define F32_TOKENS(c, n0, m0, nr, mt, pf)                                                                           \
    switch (mt) {                                                                                              \
        case 4: f32_tile(c, n0, m0, nr, 4, pf); break;                                                             \
        case 3: f32_tile(c, n0, m0, nr, 3, pf); break;                                                             \
        case 2: f32_tile(c, n0, m0, nr, 2, pf); break;                                                             \
        default: f32_tile(c, n0, m0, nr, 1, pf); break;                                                            \
    }

/* Several tokens: F32_RT rows (fewer at the end) times F32_TT tokens a tile. */
static void f32_rows(const f32_ctx *c, int n0, int m0, int nr, int mt, const float *pf) {
    switch (nr) {
        case 4: F32_TOKENS(c, n0, m0, 4, mt, pf); break;
        case 3: F32_TOKENS(c, n0, m0, 3, mt, pf); break;
        case 2: F32_TOKENS(c, n0, m0, 2, mt, pf); break;
        default: F32_TOKENS(c, n0, m0, 1, mt, pf); break;
    }
}

static void f32_task(const void *ctx, int start, int end) {
    const f32_ctx *c = ctx;
    for (int u = start; u < end; u++) {
        int g0 = u * F32_GROUP, gn = c->N - g0 < F32_GROUP ? c->N - g0 : F32_GROUP;
        if (c->M == 1) {
            /* the next group's rows prefetched: each row is one 4 KiB page at K = 1024, too short a stream for
             * the hardware's prefetcher alone */
            f32_rows1(c, g0, gn, g0 + 2 * F32_GROUP <= c->N ? c->w + (size_t)(g0 + F32_GROUP) * c->K : NULL);
            continue;
        }
        for (int n0 = g0; n0 < g0 + gn; n0 += F32_RT) { /* a tile's rows stay in cache for all the tokens */
            /* the first token tile prefetches the next F32_RT rows (in this item or the next one) */
            const float *pf = n0 + 2 * F32_RT <= c->N ? c->w + (size_t)(n0 + F32_RT) * c->K : NULL;
            for (int m0 = 0; m0 < c->M; m0 += F32_TT)
                f32_rows(c, n0, m0, g0 + gn - n0 < F32_RT ? g0 + gn - n0 : F32_RT,
                         c->M - m0 < F32_TT ? c->M - m0 : F32_TT, m0 == 0 ? pf : NULL);
        }
    }
}

/* x [M, K], w [N, K] (row-major, contiguous) -> out [M, N], float32; `threads` 0: the pool's, 1: this thread. Each
 * pointer's buffer length in bytes after it; KI_EBOUNDS (nothing written) when the dimensions do not fit them. */
int ki_f32_linear(const float *x, long x_bytes, int M, int K, const float *w, long w_bytes, int N, float *out,
                  long out_bytes, int threads) {
    if (M < 0 || K < 1 || N < 1 || !ki_fits(x_bytes, M, K, 4) || !ki_fits(w_bytes, N, K, 4)
        || !ki_fits(out_bytes, M, N, 4))
        return KI_EBOUNDS;
    f32_ctx c = {x, w, out, M, N, K};
    int items = (N + F32_GROUP - 1) / F32_GROUP;
    if (threads == 1 || pool_active == 1) {
        f32_task(&c, 0, items);
        return 0;
    }
    pthread_mutex_lock(&call_mu);
    parallel(f32_task, &c, items);
    pthread_mutex_unlock(&call_mu);
    return 0;
}

/* Mixture-of-experts products in one call: rows of x sorted by expert, expert e's rows [ends[e-1], ends[e]) times
 * its weight w[e] [N, K] -> the same rows of out [M, N]. Every (active expert, group of F32_GROUP rows of N) is one
 * work item of the pool, so the experts' few rows each fill both cores in one job, where a product per expert pays
 * a job (or torch's per-expert GEMM) each. Each element is summed as ki_f32_linear sums it (same bits). */
typedef struct {
    const float *x, *w;
    float *out;
    const int32_t *ends;
    const int *first; /* first[e]: the first item of expert e (first[E]: the count) */
    int E, N, K;
} f32_grouped_ctx;

static void f32_grouped_task(const void *ctx, int start, int end) {
    const f32_grouped_ctx *g = ctx;
    int e = 0;
    while (g->first[e + 1] <= start) e++;
    for (int u = start; u < end; u++) {
        while (g->first[e + 1] <= u) e++;
        int row0 = e ? g->ends[e - 1] : 0;
        f32_ctx c = {g->x + (size_t)row0 * g->K, g->w + (size_t)e * g->N * g->K, g->out + (size_t)row0 * g->N,
                     g->ends[e] - row0, g->N, g->K};
        f32_task(&c, u - g->first[e], u - g->first[e] + 1);
    }
}

/* x [M, K]; w [E, N, K]; ends [E] (int32, non-decreasing, ends[E-1] == M); out [M, N]; `threads` as ki_f32_linear.
 * KI_EBOUNDS (nothing written) when the dimensions or the ends do not fit the buffers. */
int ki_f32_grouped_linear(const float *x, long x_bytes, int M, int K, const float *w, long w_bytes, int E, int N,
                          const int32_t *ends, long ends_bytes, float *out, long out_bytes, int threads) {
    if (M < 0 || K < 1 || N < 1 || E < 1 || !ki_fits(x_bytes, M, K, 4) || !ki_fits(ends_bytes, E, 1, 4)
        || !ki_fits(w_bytes, (long)E * N, K, 4) || !ki_fits(out_bytes, M, N, 4))
        return KI_EBOUNDS;
    int per = (N + F32_GROUP - 1) / F32_GROUP;
    int *first = malloc(sizeof(int) * (size_t)(E + 1));
    if (!first) return KI_EBOUNDS;
    first[0] = 0;
    for (int e = 0; e < E; e++) {
        int prev = e ? ends[e - 1] : 0;
        if (ends[e] < prev || ends[e] > M || (e == E - 1 && ends[e] != M)) {
            free(first);
            return KI_EBOUNDS;
        }
        first[e + 1] = first[e] + (ends[e] > prev ? per : 0);
    }
    f32_grouped_ctx g = {x, w, out, ends, first, E, N, K};
    int items = first[E];
    if (threads == 1 || pool_active == 1 || items <= 1) {
        if (items) f32_grouped_task(&g, 0, items);
    } else {
        pthread_mutex_lock(&call_mu);
        parallel(f32_grouped_task, &g, items);
        pthread_mutex_unlock(&call_mu);
    }
    free(first);
    return 0;
}
