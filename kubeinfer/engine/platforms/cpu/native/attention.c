/* Decode attention over the paged KV cache (#included at the end of kernels.c; cpu_attention.py calls it).
 *
 * One call per layer for a step's decode rows (one query token per sequence). Work unit: a (sequence, KV head)
 * pair, run on the pool: the group of H / Hkv query heads that share the KV head, against the sequence's context
 * read in place block by block through its block-table row (cache [num_blocks, block_size, Hkv, D]), only the
 * last `window` positions where a window is set. Softmax in float32, two passes over the scores (max, then
 * exp and sum), then the weighted sum of V rows, divided by the sum. Each unit alone, in a fixed order, on one
 * thread: a sequence's output has the same bits whatever the batch around it and however units are chunked.
 *
 * Plain C that gcc vectorizes (-O3 -march=native): dot products in 16 lanes summed in a fixed tree, exp by a
 * polynomial (expf is a libm call per element). One exception, with AVX-512 (KI_VNNI) and D a multiple of 16: the
 * scores of 16 positions at a time, their 16 trees folded together across vectors (ka_scores16), the same
 * additions of the same pairs, so the same bits as the plain C the portable build runs (1.3x faster for the
 * whole unit at 48-528 positions, one thread, cache-warm), each position's K and V rows prefetched as its
 * tile is gathered (from memory: ~0.9x the time at 48 positions, ~0.8x at 528).
 * Cache element kinds: float32, bfloat16, and fp8 e4m3 / e5m2 through a 256-entry table (each byte's exact float
 * value, so widening equals torch's cast); with AVX-512 and D a multiple of 16 the fp8 bytes are widened 16 at a
 * time by bit arithmetic (e4m3) and the half-precision conversion (e5m2 is a float16's top byte) to the table's
 * very values, 3-5x faster than the lookups. A bf16 or fp8 cache takes the same
 * 16-position scores with AVX-512, its 16 K rows widened into a tile first, and its V rows are widened once per
 * position for the whole query group (each query's sums in the same order as one query at a time: the same
 * bits), not once per query. The AVX2 build (v3) widens fp8 the same way 8 bytes at a time (D a multiple of 8) and
 * otherwise runs the plain C, vectorized by gcc for AVX2: the same bits. */
#include "kubeinfer_cpu.h"

#define KA_LANES 16

typedef struct {
    const char *q;        /* [B, H, D] rows `q_stride` elements apart, heads D apart: float32 or bf16 */
    const char *k_cache;  /* [num_blocks, block_size, Hkv, D] */
    const char *v_cache;
    const float *lut;     /* kinds 2, 3: the float value of each byte */
    const int64_t *tables;/* [B, table_stride] block ids */
    const int64_t *lens;  /* [B] context lengths (the step's token included) */
    char *out;            /* [B, H, D] contiguous, q's type */
    long q_stride, table_stride;
    int q_bf16, kind, H, Hkv, D, block_size, window;
    float scale;
    atomic_int failed;
} attn_ctx;

/* sum a[d] * b[d] in 16 lanes (element d in lane d % 16), the lanes summed pairwise: a fixed order for any D. */
static inline __attribute__((always_inline)) float ka_dot(const float *a, const float *b, int D) {
    float lane[KA_LANES] = {0};
    int d = 0;
    for (; d + KA_LANES <= D; d += KA_LANES)
        for (int l = 0; l < KA_LANES; l++) lane[l] += a[d + l] * b[d + l];
    for (int l = 0; d + l < D; l++) lane[l] += a[d + l] * b[d + l];
    for (int w = KA_LANES / 2; w > 0; w /= 2)
        for (int l = 0; l < w; l++) lane[l] += lane[l + w];
    return lane[0];
}

#if KI_VNNI
/* Pairs of vectors a, b summed as ka_dot's tree sums each one's lanes: lane l of a (or b) with lane l + w, for
 * w = 8, 4, 2, 1 in turn. Four levels over 16 vectors (one a position) give the 16 dot products in one vector:
 * the same additions of the same pairs as ka_dot's tree (a float sum does not depend on its operands' order),
 * so the same bits, with 15 vector additions in place of 16 horizontal trees. */
static inline __attribute__((always_inline)) __m512 ka_fold8(__m512 a, __m512 b) { /* lanes 0-7 a's, 8-15 b's */
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
}
static inline __attribute__((always_inline)) __m512 ka_fold4(__m512 a, __m512 b) { /* quads: a lo, a hi, b lo, b hi */
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
}
static inline __attribute__((always_inline)) __m512 ka_fold2(__m512 a, __m512 b) { /* per quad: a's 2, b's 2 */
    return _mm512_add_ps(_mm512_shuffle_ps(a, b, _MM_SHUFFLE(1, 0, 1, 0)), _mm512_shuffle_ps(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
}
static inline __attribute__((always_inline)) __m512 ka_fold1(__m512 a, __m512 b) {
    return _mm512_add_ps(_mm512_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* The K and V rows of a position (any cache type) asked for ahead of use: K's read at the end of its tile of 16,
 * V's after the softmax. A unit's rows are 2 x 256 bytes (D 64) scattered by the block table, too few in a row
 * for the hardware prefetcher: without, the loads wait on memory one row at a time. */
static inline __attribute__((always_inline)) void ka_prefetch(const attn_ctx *c, long row, const int D) {
    const int bytes = D * (c->kind == 0 ? 4 : c->kind == 1 ? 2 : 1);
    const char *k = c->k_cache + (size_t)row * bytes, *v = c->v_cache + (size_t)row * bytes;
    for (int at = 0; at < bytes; at += 64) __builtin_prefetch(k + at), __builtin_prefetch(v + at);
}

/* s[j * n + i] = ka_dot(q + j * D, rows[i], D) * scale for i < m <= 16 and each of the group's j: each float32
 * K row read once per query from L1, its products in 16 lanes as ka_dot's, then the 16 trees folded together. */
static inline __attribute__((always_inline)) void ka_scores16(const float *q, int group, const float *const *rows,
                                                              int m, const int D, float scale, float *s, long n) {
    /* after the four folds, lane 4k + r holds position k + 4r */
    const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
    for (int j = 0; j < group; j++) {
        __m512 p[KA_LANES];
        for (int i = 0; i < KA_LANES; i++) {
            __m512 acc = _mm512_setzero_ps();
            if (i < m)
                for (int d = 0; d < D; d += KA_LANES)
                    acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_loadu_ps(q + j * D + d), _mm512_loadu_ps(rows[i] + d)));
            p[i] = acc;
        }
        __m512 w[8], z[4], u[2];
        for (int i = 0; i < 8; i++) w[i] = ka_fold8(p[2 * i], p[2 * i + 1]);
        for (int i = 0; i < 4; i++) z[i] = ka_fold4(w[2 * i], w[2 * i + 1]);
        for (int i = 0; i < 2; i++) u[i] = ka_fold2(z[2 * i], z[2 * i + 1]);
        __m512 dots = _mm512_permutexvar_ps(order, ka_fold1(u[0], u[1]));
        _mm512_mask_storeu_ps(s + j * n, (__mmask16)((1u << m) - 1), _mm512_mul_ps(dots, _mm512_set1_ps(scale)));
    }
}
#endif

#if KI_VNNI
/* 16 fp8 e4m3fn bytes as float32, exactly as torch's cast: normals rebiased (exponent + 120), subnormals m * 2^-9
 * (an exact int-to-float product), 0x7F / 0xFF NaN with torch's bits, the sign or-ed in. */
static inline __attribute__((always_inline)) __m512 ka_e4m3x16(const uint8_t *src) {
    const __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)src));
    const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(x, _mm512_set1_epi32(0x80)), 24);
    const __m512i mag = _mm512_and_si512(x, _mm512_set1_epi32(0x7F));
    __m512i bits = _mm512_add_epi32(_mm512_slli_epi32(mag, 20), _mm512_set1_epi32(120 << 23));
    const __m512 sub = _mm512_mul_ps(_mm512_cvtepi32_ps(mag), _mm512_set1_ps(0x1p-9f));
    bits = _mm512_mask_mov_epi32(bits, _mm512_cmplt_epi32_mask(mag, _mm512_set1_epi32(8)), _mm512_castps_si512(sub));
    bits = _mm512_mask_mov_epi32(bits, _mm512_cmpeq_epi32_mask(mag, _mm512_set1_epi32(0x7F)),
                                 _mm512_set1_epi32(0x7FF00000));
    return _mm512_castsi512_ps(_mm512_or_si512(bits, sign));
}

/* 16 fp8 e5m2 bytes as float32: each the top byte of a float16, widened by the exact half-precision conversion
 * (subnormals, inf, NaN quieted: torch's bits). */
static inline __attribute__((always_inline)) __m512 ka_e5m2x16(const uint8_t *src) {
    return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)src)), 8));
}
#endif

#if !KI_VNNI && KI_AVX2
/* ka_e4m3x16's arithmetic on 8 bytes (AVX2: blends for the masked moves): the same exact values. */
static inline __attribute__((always_inline)) __m256 ka_e4m3x8(const uint8_t *src) {
    const __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)src));
    const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x80)), 24);
    const __m256i mag = _mm256_and_si256(x, _mm256_set1_epi32(0x7F));
    __m256i bits = _mm256_add_epi32(_mm256_slli_epi32(mag, 20), _mm256_set1_epi32(120 << 23));
    const __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(mag), _mm256_set1_ps(0x1p-9f));
    bits = _mm256_blendv_epi8(bits, _mm256_castps_si256(sub), _mm256_cmpgt_epi32(_mm256_set1_epi32(8), mag));
    bits = _mm256_blendv_epi8(bits, _mm256_set1_epi32(0x7FF00000), _mm256_cmpeq_epi32(mag, _mm256_set1_epi32(0x7F)));
    return _mm256_castsi256_ps(_mm256_or_si256(bits, sign));
}

/* ka_e5m2x16's on 8 bytes: F16C's exact half-precision conversion. */
static inline __attribute__((always_inline)) __m256 ka_e5m2x8(const uint8_t *src) {
    return _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)src)), 8));
}
#endif

/* Row `row` (token slot * Hkv + head) of a cache as float32: the cache itself for float32, else widened to buf. */
static inline __attribute__((always_inline)) const float *ka_row(const attn_ctx *c, const char *cache, size_t row, float *buf, const int D) {
    size_t at = row * (size_t)D;
    if (c->kind == 0) return (const float *)cache + at;
    if (c->kind == 1) {
        const uint16_t *src = (const uint16_t *)cache + at;
        for (int d = 0; d < D; d++) buf[d] = bf16_to_f32(src[d]);
    } else {
        const uint8_t *src = (const uint8_t *)cache + at;
#if KI_VNNI
        if (D % KA_LANES == 0) {
            for (int d = 0; d < D; d += KA_LANES)
                _mm512_storeu_ps(buf + d, c->kind == 2 ? ka_e4m3x16(src + d) : ka_e5m2x16(src + d));
            return buf;
        }
#elif KI_AVX2
        if (D % 8 == 0) {
            for (int d = 0; d < D; d += 8)
                _mm256_storeu_ps(buf + d, c->kind == 2 ? ka_e4m3x8(src + d) : ka_e5m2x8(src + d));
            return buf;
        }
#endif
        for (int d = 0; d < D; d++) buf[d] = c->lut[src[d]];
    }
    return buf;
}

/* Query j of the group (KV head g, sequence b): its D sums divided by its softmax sum, in q's type. */
static inline __attribute__((always_inline)) void ka_store(const attn_ctx *c, const float *a, int b, int g, int group,
                                                           int j, float sum, const int D) {
    size_t o = ((size_t)b * c->H + (size_t)g * group + j) * D;
    for (int d = 0; d < D; d++) {
        float x = a[d] / sum;
        if (c->q_bf16) ((uint16_t *)c->out)[o + d] = f32_to_bf16(x);
        else ((float *)c->out)[o + d] = x;
    }
}

/* Positions p of [start, len) in order, t = p - start, `row` the cache row (slot * Hkv + head g) of p: a block's
 * slots are consecutive, so the block table is read, and p divided by the block size, once per block. */
#define FOR_EACH_POSITION(c, table, start, len, t, row)                                                        \
    for (long blk_ = (start) / (c)->block_size, t = 0; t < (len) - (start); blk_++)                            \
        for (long off_ = t ? 0 : (start) % (c)->block_size,                                                     \
                  end_ = off_ + (len) - (start) - t < (c)->block_size ? off_ + (len) - (start) - t : (c)->block_size, \
                  row = ((long)(table)[blk_] * (c)->block_size + off_) * (c)->Hkv + g;                         \
             off_ < end_; off_++, t++, row += (c)->Hkv)

/* One (sequence, KV head) unit. D a constant where inlined (64, 128): the d loops unroll and the lanes stay in
 * registers; the same operations in the same order as the generic D. */
static inline __attribute__((always_inline)) void attn_unit_d(attn_ctx *c, int unit, const int D) {
    const int b = unit / c->Hkv, g = unit % c->Hkv, group = c->H / c->Hkv;
    const long len = c->lens[b];
    const long start = c->window > 0 && len > c->window ? len - c->window : 0, n = len - start;
    if (n <= 0) { /* no context (cannot happen for a decode): zeros, as an empty softmax has no rows */
        for (int j = 0; j < group; j++) {
            size_t o = ((size_t)b * c->H + (size_t)g * group + j) * D;
            if (c->q_bf16) memset((uint16_t *)c->out + o, 0, 2 * (size_t)D);
            else memset((float *)c->out + o, 0, 4 * (size_t)D);
        }
        return;
    }
    const int tile = KI_VNNI && c->kind != 0 ? KA_LANES : 1; /* rows widened for the 16-position scores */
    float *mem = malloc(sizeof(float) * ((size_t)group * (D + n) + (size_t)tile * D));
    if (!mem) {
        atomic_store(&c->failed, 1);
        return;
    }
    float *qf = mem, *buf = qf + (size_t)group * D, *s = buf + (size_t)tile * D;
    for (int j = 0; j < group; j++) {
        size_t at = (size_t)b * c->q_stride + ((size_t)g * group + j) * D;
        for (int d = 0; d < D; d++)
            qf[j * D + d] = c->q_bf16 ? bf16_to_f32(((const uint16_t *)c->q)[at + d]) : ((const float *)c->q)[at + d];
    }
    const int64_t *table = c->tables + (size_t)b * c->table_stride;
#if KI_VNNI
    if (D % KA_LANES == 0) { /* 16 positions at a time, the same sums (a bf16 / fp8 cache: widened into buf) */
        const float *rows[KA_LANES];
        int m = 0;
        long t0 = 0;
        FOR_EACH_POSITION(c, table, start, len, t, row) {
            if (m == 0) t0 = t;
            rows[m] = ka_row(c, c->k_cache, row, buf + (size_t)m * D, D);
            m++;
            ka_prefetch(c, row, D);
            if (m == KA_LANES || t + 1 == n) {
                ka_scores16(qf, group, rows, m, D, c->scale, s + t0, n);
                m = 0;
            }
        }
    } else
#endif
    FOR_EACH_POSITION(c, table, start, len, t, row) { /* scores s[j * n + t] */
        const float *k = ka_row(c, c->k_cache, row, buf, D);
        for (int j = 0; j < group; j++) s[j * n + t] = ka_dot(qf + j * D, k, D) * c->scale;
    }
    float sum[group];
    for (int j = 0; j < group; j++) {
        float *sj = s + j * n, m = sj[0];
        for (long t = 1; t < n; t++) m = sj[t] > m ? sj[t] : m;
        float lane[KA_LANES] = {0};
        long t = 0;
        for (; t + KA_LANES <= n; t += KA_LANES)
            for (int l = 0; l < KA_LANES; l++) {
                float e = ki_expf(sj[t + l] - m);
                sj[t + l] = e;
                lane[l] += e;
            }
        for (int l = 0; t + l < n; l++) {
            float e = ki_expf(sj[t + l] - m);
            sj[t + l] = e;
            lane[l] += e;
        }
        for (int w = KA_LANES / 2; w > 0; w /= 2)
            for (int l = 0; l < w; l++) lane[l] += lane[l + w];
        sum[j] = lane[0];
    }
    if (c->kind == 0 || group == 1) {
        for (int j = 0; j < group; j++) { /* per query: its D sums stay in registers where D is a constant */
            float a[D];
            for (int d = 0; d < D; d++) a[d] = 0.0f;
            FOR_EACH_POSITION(c, table, start, len, t, row) {
                const float *v = ka_row(c, c->v_cache, row, buf, D), w = s[j * n + t];
                for (int d = 0; d < D; d++) a[d] += w * v[d];
            }
            ka_store(c, a, b, g, group, j, sum[j], D);
        }
    } else { /* a widened V row serves the whole group; each query's sums in the same order */
        float a[group * D];
        for (int d = 0; d < group * D; d++) a[d] = 0.0f;
        FOR_EACH_POSITION(c, table, start, len, t, row) {
            const float *v = ka_row(c, c->v_cache, row, buf, D);
            for (int j = 0; j < group; j++) {
                const float w = s[j * n + t];
                for (int d = 0; d < D; d++) a[j * D + d] += w * v[d];
            }
        }
        for (int j = 0; j < group; j++) ka_store(c, a + (size_t)j * D, b, g, group, j, sum[j], D);
    }
    free(mem);
}

static void attn_unit_64(attn_ctx *c, int unit) { attn_unit_d(c, unit, 64); }
static void attn_unit_128(attn_ctx *c, int unit) { attn_unit_d(c, unit, 128); }
static void attn_unit_any(attn_ctx *c, int unit) { attn_unit_d(c, unit, c->D); }

static void attn_task(const void *ctx, int start, int end) {
    attn_ctx *c = (attn_ctx *)ctx;
    void (*unit)(attn_ctx *, int) = c->D == 64 ? attn_unit_64 : c->D == 128 ? attn_unit_128 : attn_unit_any;
    for (int u = start; u < end; u++) unit(c, u);
}

/* The step's new K and V rows (B of them, `kv_stride` elements apart, Hkv * D each, already in the cache's type
 * of `elem` bytes) copied into their slots: index_copy_'s result. Before any unit reads (a slot may be read by
 * a unit of another sequence only where blocks are shared, and a decode never writes a shared block). */
static void write_kv(const char *k, const char *v, long kv_stride, int B, int Hkv, int D, int elem,
                     const int64_t *slots, char *k_cache, char *v_cache) {
    size_t row = (size_t)Hkv * D * elem;
    for (int b = 0; b < B; b++) {
        memcpy(k_cache + (size_t)slots[b] * row, k + (size_t)b * kv_stride * elem, row);
        memcpy(v_cache + (size_t)slots[b] * row, v + (size_t)b * kv_stride * elem, row);
    }
}

/* out [B, H, D] = decode attention of q's B rows (see the top of this file). kind: 0 float32 cache, 1 bf16,
 * 2 fp8 e4m3fn, 3 fp8 e5m2 (`lut`: each byte's float value). window <= 0: none. `slots` not NULL: first the step's k and v rows (`kv_stride`
 * elements apart, in the cache's type) written to those slots. Returns 0, or -1 when out of memory. */
int ki_decode_attention(const char *q, long q_stride, int q_bf16, const char *k, const char *v, long kv_stride,
                        const int64_t *slots, char *k_cache, char *v_cache, int kind, const float *lut,
                        const int64_t *tables, long table_stride, const int64_t *lens, int B, int H, int Hkv, int D,
                        int block_size, int window, float scale, char *out) {
    attn_ctx c = {q, k_cache, v_cache, lut, tables, lens, out, q_stride, table_stride, q_bf16, kind, H, Hkv, D,
                  block_size, window, scale, 0};
    pthread_mutex_lock(&call_mu);
    if (slots) write_kv(k, v, kv_stride, B, Hkv, D, kind == 0 ? 4 : kind == 1 ? 2 : 1, slots, k_cache, v_cache);
    parallel(attn_task, &c, B * Hkv);
    pthread_mutex_unlock(&call_mu);
    return atomic_load(&c.failed) ? -1 : 0;
}
