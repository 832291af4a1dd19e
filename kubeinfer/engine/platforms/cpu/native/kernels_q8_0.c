/* llama.cpp's arithmetic for weight-only int8 / int4 checkpoints (included by kernels.c).
 *
 * Activations are quantized per block of 32 inputs as llama.cpp's Q8_0 (ggml's quantize_row_q8_0, the gguf
 * package's Q8_0.quantize_blocks): d = amax / 127, q = roundf(x / d) computed as x * (1 / d) rounded half away
 * from zero, d kept as float16. Each block's int32 sum with the weights becomes float and is accumulated as
 * sum += isum * (d * weight scale), the weight's zero point z subtracted as z * sum(q) of the block.
 *
 * Speed (benchmarks/RESULTS.md "cpu-native-vnni", "q8-0-kernels-tuned"): a decode step streams the model's
 * weights from memory (the large benchmark model: 106 MB int4, more than the L3), so a tile is one row group's
 * weights, one stream, prefetched 8 KB ahead, times up to 8 tokens: one token and four are bound by reading the
 * weights (~45-51 GB/s on this machine's two cores), sixteen by vpdpbusd and the broadcasts of the activations
 * (~290 GMAC/s a core). Two row groups times four tokens a tile (before) is 1.1-1.2x faster with the weights in
 * cache (and the prefetch costs ~10% there at one token), but 1.1-2x slower from memory (two streams, each tile
 * reading them again). */
#include "kubeinfer_cpu.h"

#ifndef Q8_TILE /* (-D: benchmarks/bench_q8_0_shapes.py --variants) */
#define Q8_TILE 8        /* tokens per tile: each weight vector feeds 8 of them */
#endif
#ifndef Q8_PREFETCH
#define Q8_PREFETCH 8192 /* bytes: how far ahead in its stream of weights a tile asks for them (0: never) */
#endif

/* float -> float16 -> float, round to nearest even (numpy's astype(np.float16), F16C's vcvtps2ph). */
static float half_round(float f) {
#if KI_VNNI
    return _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtps_ph(_mm_set_ss(f), _MM_FROUND_TO_NEAREST_INT)));
#else
    return (float)(_Float16)f;
#endif
}

static inline float roundf_away(float v) { /* gguf's np_roundf, exactly */
    float a = fabsf(v), fl = floorf(a);
    float b = fl + floorf(2.0f * (a - fl));
    return v < 0 ? -b : (v > 0 ? b : 0.0f);
}

#if KI_VNNI
/* roundf_away on 16 lanes: t = trunc(|v|), plus one where |v| - t (exact) >= 0.5, the sign put back. */
static inline __m512 round_away16(__m512 v) {
    __m512 a = _mm512_abs_ps(v), t = _mm512_roundscale_ps(a, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    __mmask16 up = _mm512_cmp_ps_mask(_mm512_sub_ps(a, t), _mm512_set1_ps(0.5f), _CMP_GE_OQ);
    t = _mm512_mask_add_ps(t, up, t, _mm512_set1_ps(1.0f));
    return _mm512_or_ps(t, _mm512_and_ps(v, _mm512_set1_ps(-0.0f)));
}
#endif

/* x [M, K] float32, K a multiple of 32 -> q [M, K] int8, d [M, K / 32] float, s [M, K / 32] int32 sums of q.
 * The vector path does the scalar one's float operations (each exactly rounded), so the same bits. */
void ki_quantize_q8_0(const float *x, int M, int K, int8_t *q, float *d, int32_t *s) {
    int blocks = K / BLOCK;
    for (long b = 0; b < (long)M * blocks; b++) {
        const float *xb = x + b * BLOCK;
#if KI_VNNI
        __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
        float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
        float db = amax / 127.0f, id = db == 0.0f ? 0.0f : 1.0f / db;
        __m512 vid = _mm512_set1_ps(id);
        __m512i v0 = _mm512_cvttps_epi32(round_away16(_mm512_mul_ps(x0, vid)));
        __m512i v1 = _mm512_cvttps_epi32(round_away16(_mm512_mul_ps(x1, vid)));
        _mm_storeu_si128((__m128i *)(q + b * BLOCK), _mm512_cvtepi32_epi8(v0));
        _mm_storeu_si128((__m128i *)(q + b * BLOCK + 16), _mm512_cvtepi32_epi8(v1));
        int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(v0, v1));
#else
        float amax = 0.0f;
        for (int i = 0; i < BLOCK; i++) amax = fmaxf(amax, fabsf(xb[i]));
        float db = amax / 127.0f, id = db == 0.0f ? 0.0f : 1.0f / db;
        int32_t sum = 0;
        for (int i = 0; i < BLOCK; i++) {
            int v = (int)roundf_away(xb[i] * id);
            q[b * BLOCK + i] = (int8_t)v;
            sum += v;
        }
#endif
        d[b] = half_round(db);
        s[b] = sum;
    }
}

typedef struct {
    const int8_t *q;
    const float *d;
    const int32_t *s;       /* [M, K / 32]: (uint16)(-sum of the block's q), vpdpwssd's operand */
    const uint8_t *w;       /* packed, bits 8 or 4 */
    const float *scale;     /* [groups of rows][weight groups][16] */
    const int32_t *offset;  /* the same shape: the storage offset (128 or 8) plus the zero point */
    float *out;
    int M, N, K, bits, groups, blocks_per_group;
} q8_ctx;

#if KI_VNNI
/* Step j (8 inputs) of a block's weights for one row group: w0 the inputs 8j..8j+3 of the 16 rows, w1 the next
 * four (int4: the high nibbles as 16 * nibble); `fetch`: ask for the weights Q8_PREFETCH bytes ahead. */
static inline __attribute__((always_inline)) void q8_weights(const q8_ctx *c, const uint8_t *wb, int j, int fetch,
                                                             __m512i *w0, __m512i *w1) {
    if (c->bits == 8) {
        if (fetch) {
            _mm_prefetch((const char *)wb + 128 * j + Q8_PREFETCH, _MM_HINT_T0);
            _mm_prefetch((const char *)wb + 128 * j + 64 + Q8_PREFETCH, _MM_HINT_T0);
        }
        *w0 = _mm512_loadu_si512(wb + 128 * j), *w1 = _mm512_loadu_si512(wb + 128 * j + 64);
    } else {
        if (fetch) _mm_prefetch((const char *)wb + 64 * j + Q8_PREFETCH, _MM_HINT_T0);
        __m512i v = _mm512_loadu_si512(wb + 64 * j);
        *w0 = _mm512_and_si512(v, _mm512_set1_epi8(0x0F)), *w1 = _mm512_and_si512(v, _mm512_set1_epi8((char)0xF0));
    }
}
#endif

/* Row group g (16 output rows) times the tokens m0 .. m0 + mt - 1; mt a constant where inlined, so the loops
 * unroll and the sums stay in registers. Each token's block sum runs in two chains (even and odd steps of 4
 * inputs; int4: the low nibbles, and the high ones as 16 * nibble, no shift, that chain shifted after). */
static inline __attribute__((always_inline)) void q8_tile(const q8_ctx *c, int g, int m0, const int mt,
                                                          const uint8_t *stop) {
    int blocks = c->K / BLOCK;
    size_t block_bytes = (size_t)BLOCK * ROWS * c->bits / 8;
    const uint8_t *wg = c->w + (size_t)g * blocks * block_bytes;
    const float *scales = c->scale + (size_t)g * c->groups * ROWS;
    const int32_t *offsets = c->offset + (size_t)g * c->groups * ROWS;
    int n0 = g * ROWS, nn = c->N - n0 < ROWS ? c->N - n0 : ROWS;
#if KI_VNNI
    __m512 acc[Q8_TILE];
    for (int t = 0; t < mt; t++) acc[t] = _mm512_setzero_ps();
    for (int b = 0; b < blocks; b++) {
        const uint8_t *wb = wg + b * block_bytes;
        /* the first tile only (later ones find the weights in cache), and not past the task's own weights */
        const int fetch = Q8_PREFETCH && m0 == 0 && wb + block_bytes + Q8_PREFETCH <= stop;
        __m512i even[Q8_TILE], odd[Q8_TILE];
        for (int t = 0; t < mt; t++) even[t] = odd[t] = _mm512_setzero_si512();
        if (mt > 4) { /* compute-bound: 16 inputs a step, each token's 16 bytes one broadcast, then shuffled */
            for (int j = 0; j < BLOCK / 8; j += 2) {
                __m512i w0, w1, w2, w3;
                q8_weights(c, wb, j, fetch, &w0, &w1), q8_weights(c, wb, j + 1, fetch, &w2, &w3);
                for (int t = 0; t < mt; t++) {
                    const int8_t *q = c->q + (size_t)(m0 + t) * c->K + b * BLOCK + 8 * j;
                    __m512i a = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)q));
                    even[t] = _mm512_dpbusd_epi32(even[t], w0, _mm512_shuffle_epi32(a, 0x00));
                    odd[t] = _mm512_dpbusd_epi32(odd[t], w1, _mm512_shuffle_epi32(a, 0x55));
                    even[t] = _mm512_dpbusd_epi32(even[t], w2, _mm512_shuffle_epi32(a, 0xAA));
                    odd[t] = _mm512_dpbusd_epi32(odd[t], w3, _mm512_shuffle_epi32(a, 0xFF));
                }
            }
        } else { /* bound by reading the weights: 8 inputs a step, the activations broadcast from memory */
            for (int j = 0; j < BLOCK / 8; j++) {
                __m512i w0, w1;
                q8_weights(c, wb, j, fetch, &w0, &w1);
                for (int t = 0; t < mt; t++) {
                    const int8_t *q = c->q + (size_t)(m0 + t) * c->K + b * BLOCK + 8 * j;
                    even[t] = _mm512_dpbusd_epi32(even[t], w0, _mm512_set1_epi32(*(const int32_t *)q));
                    odd[t] = _mm512_dpbusd_epi32(odd[t], w1, _mm512_set1_epi32(*(const int32_t *)(q + 4)));
                }
            }
        }
        int gi = b / c->blocks_per_group;
        __m512 sw = _mm512_loadu_ps(scales + gi * ROWS);
        __m512i off = _mm512_loadu_si512(offsets + gi * ROWS);
        for (int t = 0; t < mt; t++) {
            long idx = (long)(m0 + t) * blocks + b;
            __m512i sum = _mm512_add_epi32(even[t], c->bits == 8 ? odd[t] : _mm512_srai_epi32(odd[t], 4));
            sum = _mm512_dpwssd_epi32(sum, off, _mm512_set1_epi32(c->s[idx])); /* -off * sum(q) */
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(_mm512_set1_ps(c->d[idx]), sw), acc[t]);
        }
    }
    __mmask16 mask = (__mmask16)((1u << nn) - 1);
    for (int t = 0; t < mt; t++) _mm512_mask_storeu_ps(c->out + (size_t)(m0 + t) * c->N + n0, mask, acc[t]);
#else
    for (int t = 0; t < mt; t++) {
        int m = m0 + t;
        for (int r = 0; r < nn; r++) {
            float acc = 0.0f;
            for (int b = 0; b < blocks; b++) {
                const uint8_t *wb = wg + b * block_bytes;
                int gi = b / c->blocks_per_group;
                int32_t sum = 0;
                for (int k = 0; k < BLOCK; k++) {
                    int u = c->bits == 8 ? wb[(k / 4) * 64 + r * 4 + k % 4]
                                         : (wb[(k / 8) * 64 + r * 4 + k % 4] >> (k % 8 / 4 * 4)) & 0x0F;
                    sum += u * c->q[(size_t)m * c->K + b * BLOCK + k];
                }
                long idx = (long)m * blocks + b;
                sum += offsets[gi * ROWS + r] * (int16_t)c->s[idx]; /* s: -sum(q) in 16 bits */
                acc = fmaf((float)sum, c->d[idx] * scales[gi * ROWS + r], acc);
            }
            c->out[(size_t)m * c->N + n0 + r] = acc;
        }
    }
#endif
}

#define Q8_CASE(n) case n: q8_tile(c, g, m0, n, stop); break;

/* Work item u: row groups 2u and 2u + 1, each alone (one stream of weights) in tiles of Q8_TILE tokens. */
static void q8_task(const void *ctx, int start, int end) {
    const q8_ctx *c = ctx;
    int groups = (c->N + ROWS - 1) / ROWS, last = 2 * end < groups ? 2 * end : groups;
    const uint8_t *stop = c->w + (size_t)last * (c->K / BLOCK) * BLOCK * ROWS * c->bits / 8;
    for (int g = 2 * start; g < 2 * end && g < groups; g++)
        for (int m0 = 0; m0 < c->M; m0 += Q8_TILE) switch (c->M - m0 < Q8_TILE ? c->M - m0 : Q8_TILE) {
            Q8_CASE(1) Q8_CASE(2) Q8_CASE(3) Q8_CASE(4) Q8_CASE(5) Q8_CASE(6) Q8_CASE(7)
            default: q8_tile(c, g, m0, Q8_TILE, stop);
        }
}

/* x [M, K] float32 (K a multiple of 32) times packed weights [ceil(N / 16) groups] (scale and offset [ceil(N / 16)]
 * [groups][16], groups of group_size inputs, a multiple of 32, the last maybe short) -> out [M, N] float32. Each
 * pointer's buffer length in bytes after it. Returns -1 when out of memory, KI_EBOUNDS (nothing written) when the
 * dimensions are not the layout's or do not fit the buffers. */
int ki_q8_0_linear(const float *x, long x_bytes, int M, int K, const uint8_t *w, long w_bytes, int bits,
                   const float *scale, long scale_bytes, const int32_t *offset, long offset_bytes, int groups,
                   int group_size, int N, float *out, long out_bytes) {
    if (M < 0 || K < BLOCK || K % BLOCK || N < 1 || (bits != 4 && bits != 8) || groups < 1 || group_size < BLOCK
        || group_size % BLOCK || groups != (K + group_size - 1) / group_size || !ki_fits(x_bytes, M, K, 4)
        || !ki_fits(w_bytes, ki_padded_rows(N), (long)K * bits / 8, 1)
        || !ki_fits(scale_bytes, ki_padded_rows(N), groups, 4) || !ki_fits(offset_bytes, ki_padded_rows(N), groups, 4)
        || !ki_fits(out_bytes, M, N, 4))
        return KI_EBOUNDS;
    size_t blocks = (size_t)M * (K / BLOCK);
    int8_t *q = malloc((size_t)M * K + 64);
    float *d = malloc(sizeof(float) * (blocks + 1));
    int32_t *s = malloc(sizeof(int32_t) * (blocks + 1));
    if (!q || !d || !s) {
        free(q), free(d), free(s);
        return -1;
    }
    ki_quantize_q8_0(x, M, K, q, d, s);
    for (size_t b = 0; b < blocks; b++) s[b] = (uint16_t)(-s[b]); /* |sum| <= 4096: int16, high half zero */
    q8_ctx c = {q, d, s, w, scale, offset, out, M, N, K, bits, groups, group_size / BLOCK};
    pthread_mutex_lock(&call_mu);
    parallel(q8_task, &c, ((N + ROWS - 1) / ROWS + 1) / 2);
    pthread_mutex_unlock(&call_mu);
    free(q), free(d), free(s);
    return 0;
}
