/* W4A8: int8 activations per token (compressed-tensors' dynamic symmetric quantization, done by the caller:
 * ki_quantize_token_int8 or torch) times int4 weights per group of input columns (symmetric, one float32 scale
 * per output row and group), exact integer sums per weight group (included by kernels.c).
 *
 *   out[m, n] = sum over groups g = 0, 1, ... of fl( (float)isum_g[m, n] * fl(sx[m] * sw[n, g]) ),
 *
 * isum_g = sum of q[m, k] * w[n, k] over the group's columns, exact in int32; the float32 sum taken left to
 * right from 0, no fused multiply-add (-ffp-contract=off), the same order for every token and batch size, so a
 * token's output does not depend on its batch. w8a8_int4.py's torch twin does the same operations.
 *
 * Weights as ops.pack_int4 lays them out (kernels.c): per row group of 16 rows, [inputs / 8][16 rows][4 bytes],
 * inputs 8i..8i+3 in the low nibbles and 8i+4..8i+7 in the high ones, stored as w + 8 (0..15): vpdpbusd's
 * unsigned operand. A group's sum of (w + 8) * q is isum + 8 * sum(q), the latter subtracted in int32 (integer
 * sums: any order gives the same bits). Below 5 tokens (bound by reading the weights) one row group's weights are
 * one stream, prefetched W4_PREFETCH bytes ahead, the high nibbles multiplied as 16 * nibble (no shift in the
 * loop) and that chain shifted right by 4 after: exact, |16 * 15 * 128 * K / 2| < 2^31 for K <= ops.MAX_INPUTS.
 * From 5 tokens (bound by vpdpbusd) two row groups at once times up to W4_TILE tokens, the first tile prefetching
 * the next pair: 6 tokens a tile ran 1.2x faster than 8 (whose 16 accumulators gcc spilled) and 4 or 5 (more
 * unpacking per product) on the 222M model's shapes (benchmarks/RESULTS.md "cpu-w4a8-kernel"). */
#include "kubeinfer_cpu.h"

#ifndef W4_TILE
#define W4_TILE 6
#endif
#ifndef W4_PREFETCH
#define W4_PREFETCH 8192
#endif

typedef struct {
    const int8_t *q;   /* [M, Kp] activations, zero-padded to Kp (a multiple of 32) */
    const int32_t *s;  /* [M, groups]: 8 * the group's sum of q */
    const float *sx;   /* [M] */
    const uint8_t *w;  /* packed int4, [ceil(N / 16)][Kp / 8][16][4] */
    const float *sw;   /* [ceil(N / 16)][groups][16] (ops.pack_groups) */
    float *out;        /* [M, N] */
    int M, N, Kp, groups, bpg; /* bpg: blocks of 32 inputs per weight group */
} w4a8_ctx;

#if KI_VNNI
/* 1 to 4 tokens, one row group: bound by reading the weights. The activations broadcast from memory, four chains a
 * token (vpdpbusd's latency, not the loads, would bound two chains at one token). */
static inline __attribute__((always_inline)) void w4a8_narrow(const w4a8_ctx *c, int g, int m0, const int mt,
                                                              const uint8_t *stop) {
    const int blocks = c->Kp / BLOCK;
    const uint8_t *wg = c->w + (size_t)g * blocks * (BLOCK * ROWS / 2);
    const float *scales = c->sw + (size_t)g * c->groups * ROWS;
    int n0 = g * ROWS, nn = c->N - n0 < ROWS ? c->N - n0 : ROWS;
    __m512 acc[4];
    for (int t = 0; t < mt; t++) acc[t] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi8(0x0F), high = _mm512_set1_epi8((char)0xF0);
    for (int gi = 0; gi < c->groups; gi++) {
        int b0 = gi * c->bpg, b1 = b0 + c->bpg < blocks ? b0 + c->bpg : blocks;
        __m512i even[4], odd[4], even2[4], odd2[4];
        for (int t = 0; t < mt; t++) even[t] = odd[t] = even2[t] = odd2[t] = _mm512_setzero_si512();
        for (int b = b0; b < b1; b++) {
            const uint8_t *wb = wg + (size_t)b * (BLOCK * ROWS / 2);
            /* the first tile only (later ones find the weights in cache), and not past the task's own weights */
            const int fetch = m0 == 0 && wb + BLOCK * ROWS / 2 + W4_PREFETCH <= stop;
            for (int j = 0; j < BLOCK / 8; j += 2) {
                if (fetch) {
                    _mm_prefetch((const char *)wb + 64 * j + W4_PREFETCH, _MM_HINT_T0);
                    _mm_prefetch((const char *)wb + 64 * j + 64 + W4_PREFETCH, _MM_HINT_T0);
                }
                __m512i v0 = _mm512_loadu_si512(wb + 64 * j), v1 = _mm512_loadu_si512(wb + 64 * j + 64);
                __m512i w0 = _mm512_and_si512(v0, low), w1 = _mm512_and_si512(v0, high);
                __m512i w2 = _mm512_and_si512(v1, low), w3 = _mm512_and_si512(v1, high);
                for (int t = 0; t < mt; t++) {
                    const int8_t *q = c->q + (size_t)(m0 + t) * c->Kp + b * BLOCK + 8 * j;
                    even[t] = _mm512_dpbusd_epi32(even[t], w0, _mm512_set1_epi32(*(const int32_t *)q));
                    odd[t] = _mm512_dpbusd_epi32(odd[t], w1, _mm512_set1_epi32(*(const int32_t *)(q + 4)));
                    even2[t] = _mm512_dpbusd_epi32(even2[t], w2, _mm512_set1_epi32(*(const int32_t *)(q + 8)));
                    odd2[t] = _mm512_dpbusd_epi32(odd2[t], w3, _mm512_set1_epi32(*(const int32_t *)(q + 12)));
                }
            }
        }
        __m512 sw = _mm512_loadu_ps(scales + gi * ROWS);
        for (int t = 0; t < mt; t++) {
            int m = m0 + t;
            __m512i e = _mm512_add_epi32(even[t], even2[t]), o = _mm512_add_epi32(odd[t], odd2[t]);
            __m512i sum = _mm512_add_epi32(e, _mm512_srai_epi32(o, 4));
            sum = _mm512_sub_epi32(sum, _mm512_set1_epi32(c->s[(size_t)m * c->groups + gi]));
            __m512 scale = _mm512_mul_ps(_mm512_set1_ps(c->sx[m]), sw);
            acc[t] = _mm512_add_ps(acc[t], _mm512_mul_ps(_mm512_cvtepi32_ps(sum), scale));
        }
    }
    __mmask16 mask = (__mmask16)((1u << nn) - 1);
    for (int t = 0; t < mt; t++) _mm512_mask_storeu_ps(c->out + (size_t)(m0 + t) * c->N + n0, mask, acc[t]);
}

/* 4 activation bytes broadcast to a register: kept a vpbroadcastd (the empty asm), not folded into vpdpbusd as an
 * embedded broadcast ({1to16}), which ran at a third of the register form's rate on this CPU (Zen 5). */
static inline __attribute__((always_inline)) __m512i w4a8_bcast(const int8_t *q) {
    __m512i b = _mm512_set1_epi32(*(const int32_t *)q);
    __asm__("" : "+v"(b));
    return b;
}

/* 5 or more tokens, R (1 or 2) row groups: bound by vpdpbusd. Each step's weight vector unpacked once for the
 * tile's tokens (low nibbles; high nibbles shifted down), each token's 4 activation bytes broadcast once for both
 * row groups, one int32 chain per row group and token. pf: prefetch the next pair of row groups, step by step. */
static inline __attribute__((always_inline)) void w4a8_wide(const w4a8_ctx *c, int g, const int R, int m0,
                                                            const int mt, int pf) {
    const int steps = c->Kp / 8, gsteps = c->bpg * BLOCK / 8;
    const size_t rg = (size_t)steps * 64; /* one row group's bytes */
    const uint8_t *wg = c->w + (size_t)g * rg;
    float part[2][8][ROWS] __attribute__((aligned(64)));
    const int8_t *q0 = c->q + (size_t)m0 * c->Kp;
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int gi = 0; gi < c->groups; gi++) {
        int s0 = gi * gsteps, s1 = s0 + gsteps < steps ? s0 + gsteps : steps;
        __m512i isum[2][8]; /* mt <= W4_TILE <= 8 */
        for (int r = 0; r < R; r++)
            for (int t = 0; t < mt; t++) isum[r][t] = _mm512_setzero_si512();
        for (int s = s0; s < s1; s++) {
            const uint8_t *ws = wg + (size_t)s * 64;
            if (pf) {
                _mm_prefetch((const char *)ws + 2 * rg, _MM_HINT_T0);
                if (R == 2) _mm_prefetch((const char *)ws + 3 * rg, _MM_HINT_T0);
            }
            __m512i lo[2], hi[2];
            for (int r = 0; r < R; r++) {
                __m512i v = _mm512_loadu_si512(ws + r * rg);
                lo[r] = _mm512_and_si512(v, low), hi[r] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            }
            for (int t = 0; t < mt; t++) {
                const int8_t *q = q0 + (size_t)t * c->Kp + 8 * s;
                __m512i a = w4a8_bcast(q), b = w4a8_bcast(q + 4);
                for (int r = 0; r < R; r++) {
                    isum[r][t] = _mm512_dpbusd_epi32(isum[r][t], lo[r], a);
                    isum[r][t] = _mm512_dpbusd_epi32(isum[r][t], hi[r], b);
                }
            }
        }
        for (int r = 0; r < R; r++) {
            __m512 sw = _mm512_loadu_ps(c->sw + ((size_t)(g + r) * c->groups + gi) * ROWS);
            for (int t = 0; t < mt; t++) {
                int m = m0 + t;
                __m512i sum = _mm512_sub_epi32(isum[r][t], _mm512_set1_epi32(c->s[(size_t)m * c->groups + gi]));
                __m512 scale = _mm512_mul_ps(_mm512_set1_ps(c->sx[m]), sw);
                __m512 prev = gi ? _mm512_load_ps(part[r][t]) : _mm512_setzero_ps();
                _mm512_store_ps(part[r][t], _mm512_add_ps(prev, _mm512_mul_ps(_mm512_cvtepi32_ps(sum), scale)));
            }
        }
    }
    for (int r = 0; r < R; r++) {
        int n0 = (g + r) * ROWS, nn = c->N - n0 < ROWS ? c->N - n0 : ROWS;
        __mmask16 mask = (__mmask16)((1u << nn) - 1);
        for (int t = 0; t < mt; t++)
            _mm512_mask_storeu_ps(c->out + (size_t)(m0 + t) * c->N + n0, mask, _mm512_load_ps(part[r][t]));
    }
}
#elif KI_AVX2
/* AVX2: a step's 16 rows x 8 inputs as two halves of 8 rows; per half the low and the high nibbles (0..15) times the
 * token's 4 + 4 activation bytes by vpmaddubsw (int16 pair sums of at most 2 * 15 * 128: no saturation), the two
 * added (at most 7680), widened to one int32 a row by vpmaddwd with ones: exact integer sums, the portable bits.
 * One row group, mt (<= 4) tokens: 2 * mt int32 accumulators. */
static inline __attribute__((always_inline)) void w4a8_avx2(const w4a8_ctx *c, int g, int m0, const int mt) {
    const int steps = c->Kp / 8, gsteps = c->bpg * BLOCK / 8;
    const uint8_t *wg = c->w + (size_t)g * steps * 64;
    const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    __m256 out[4][2];
    for (int t = 0; t < mt; t++) out[t][0] = out[t][1] = _mm256_setzero_ps();
    for (int gi = 0; gi < c->groups; gi++) {
        const int s0 = gi * gsteps, s1 = s0 + gsteps < steps ? s0 + gsteps : steps;
        __m256i isum[4][2];
        for (int t = 0; t < mt; t++) isum[t][0] = isum[t][1] = _mm256_setzero_si256();
        for (int st = s0; st < s1; st++) {
            const uint8_t *ws = wg + (size_t)st * 64;
            if (m0 == 0) _mm_prefetch((const char *)ws + W4_PREFETCH, _MM_HINT_T0);
            __m256i lo[2], hi[2];
            for (int h = 0; h < 2; h++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(ws + 32 * h));
                lo[h] = _mm256_and_si256(v, low), hi[h] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
            }
            for (int t = 0; t < mt; t++) {
                const int8_t *q = c->q + (size_t)(m0 + t) * c->Kp + 8 * st;
                int32_t qa, qb;
                memcpy(&qa, q, 4), memcpy(&qb, q + 4, 4);
                const __m256i a = _mm256_set1_epi32(qa), b = _mm256_set1_epi32(qb);
                for (int h = 0; h < 2; h++) {
                    const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo[h], a), _mm256_maddubs_epi16(hi[h], b));
                    isum[t][h] = _mm256_add_epi32(isum[t][h], _mm256_madd_epi16(p, ones));
                }
            }
        }
        for (int h = 0; h < 2; h++) {
            const __m256 sw = _mm256_loadu_ps(c->sw + ((size_t)g * c->groups + gi) * ROWS + 8 * h);
            for (int t = 0; t < mt; t++) {
                const int m = m0 + t;
                const __m256i sum =
                    _mm256_sub_epi32(isum[t][h], _mm256_set1_epi32(c->s[(size_t)m * c->groups + gi]));
                const __m256 scale = _mm256_mul_ps(_mm256_set1_ps(c->sx[m]), sw);
                out[t][h] = _mm256_add_ps(out[t][h], _mm256_mul_ps(_mm256_cvtepi32_ps(sum), scale));
            }
        }
    }
    const int n0 = g * ROWS, nn = c->N - n0 < ROWS ? c->N - n0 : ROWS;
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int h = 0; h < 2 && nn > 8 * h; h++) {
        const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(nn - 8 * h), lanes);
        for (int t = 0; t < mt; t++)
            _mm256_maskstore_ps(c->out + (size_t)(m0 + t) * c->N + n0 + 8 * h, mask, out[t][h]);
    }
}
#else
/* The portable twin: the same sums (exact integers) and the same float operations in the same order. */
static void w4a8_rows(const w4a8_ctx *c, int g, int m0, const int mt) {
    const int blocks = c->Kp / BLOCK;
    const uint8_t *wg = c->w + (size_t)g * blocks * (BLOCK * ROWS / 2);
    const float *scales = c->sw + (size_t)g * c->groups * ROWS;
    int n0 = g * ROWS, nn = c->N - n0 < ROWS ? c->N - n0 : ROWS;
    for (int t = 0; t < mt; t++) {
        int m = m0 + t;
        const int8_t *q = c->q + (size_t)m * c->Kp;
        for (int r = 0; r < nn; r++) {
            float acc = 0.0f;
            for (int gi = 0; gi < c->groups; gi++) {
                int k0 = gi * c->bpg * BLOCK, k1 = k0 + c->bpg * BLOCK < c->Kp ? k0 + c->bpg * BLOCK : c->Kp;
                int32_t sum = 0;
                for (int k = k0; k < k1; k++)
                    sum += ((wg[(k / 8) * 64 + r * 4 + k % 4] >> (k % 8 / 4 * 4)) & 0x0F) * q[k];
                sum -= c->s[(size_t)m * c->groups + gi];
                acc = acc + (float)sum * (c->sx[m] * scales[gi * ROWS + r]);
            }
            c->out[(size_t)m * c->N + n0 + r] = acc;
        }
    }
}
#endif

#define W4_WIDE(n) case n: if (R == 2) w4a8_wide(c, g, 2, m0, n, pf); else w4a8_wide(c, g, 1, m0, n, pf); break;

/* Work item u: row groups 2u and 2u + 1. Below 5 tokens each row group alone (one stream of weights) in tiles of
 * up to 4 tokens; from 5 tokens both together in tiles of up to W4_TILE tokens. */
static void w4a8_task(const void *ctx, int start, int end) {
    const w4a8_ctx *c = ctx;
    int groups = (c->N + ROWS - 1) / ROWS, last = 2 * end < groups ? 2 * end : groups;
    const uint8_t *stop = c->w + (size_t)last * c->Kp * ROWS / 2;
    for (int g = 2 * start; g < last; g += 2) {
#if KI_VNNI
        const int R = last - g < 2 ? 1 : 2;
        if (c->M > 4)
            for (int m0 = 0; m0 < c->M; m0 += W4_TILE) {
                const int pf = m0 == 0 && g + 2 < groups; /* the first tile prefetches the next pair */
                const int mt = c->M - m0 < W4_TILE ? c->M - m0 : W4_TILE;
                if (mt == W4_TILE) {
                    if (R == 2) w4a8_wide(c, g, 2, m0, W4_TILE, pf); else w4a8_wide(c, g, 1, m0, W4_TILE, pf);
                } else
                    switch (mt) { W4_WIDE(1) W4_WIDE(2) W4_WIDE(3) W4_WIDE(4) W4_WIDE(5) W4_WIDE(6) default: W4_WIDE(7) }
            }
        else
            for (int r = 0; r < R; r++)
                switch (c->M) { case 1: w4a8_narrow(c, g + r, 0, 1, stop); break;
                                case 2: w4a8_narrow(c, g + r, 0, 2, stop); break;
                                case 3: w4a8_narrow(c, g + r, 0, 3, stop); break;
                                default: w4a8_narrow(c, g + r, 0, 4, stop); }
#elif KI_AVX2
        (void)stop;
        for (int r = 0; r < 2 && g + r < last; r++)
            for (int m0 = 0; m0 < c->M; m0 += 4)
                switch (c->M - m0 < 4 ? c->M - m0 : 4) {
                    case 1: w4a8_avx2(c, g + r, m0, 1); break;
                    case 2: w4a8_avx2(c, g + r, m0, 2); break;
                    case 3: w4a8_avx2(c, g + r, m0, 3); break;
                    default: w4a8_avx2(c, g + r, m0, 4);
                }
#else
        (void)stop;
        for (int r = 0; r < 2 && g + r < last; r++) w4a8_rows(c, g + r, 0, c->M);
#endif
    }
}

/* q [M, K] int8 and sx [M] (the activations as quantized per token), w packed (Kp = K rounded up to 32 inputs),
 * sw [ceil(N / 16)][groups][16], groups of group_size inputs (a multiple of 32, or one group of all K) ->
 * out [M, N] float32; each pointer's buffer length in bytes after it. Returns -1 when out of memory, -2 for a group
 * size it does not take, KI_EBOUNDS (nothing written) when the dimensions do not fit the buffers. */
int ki_w4a8(const int8_t *q, long q_bytes, const float *sx, long sx_bytes, int M, int K, const uint8_t *w,
            long w_bytes, const float *sw, long sw_bytes, int groups, int group_size, int N, float *out,
            long out_bytes) {
    if (M < 0 || K < 1 || K > 65536 || N < 1 || !ki_fits(q_bytes, M, K, 1) || !ki_fits(sx_bytes, M, 1, 4)
        || !ki_fits(w_bytes, ki_padded_rows(N), (K + BLOCK - 1) / BLOCK * BLOCK / 2, 1)
        || !ki_fits(sw_bytes, ki_padded_rows(N), groups, 4) || !ki_fits(out_bytes, M, N, 4))
        return KI_EBOUNDS;
    int Kp = (K + BLOCK - 1) / BLOCK * BLOCK;
    int bpg = groups == 1 ? Kp / BLOCK : group_size / BLOCK;
    if (groups < 1 || (groups > 1 && (group_size < BLOCK || group_size % BLOCK || (groups - 1) * bpg * BLOCK >= Kp
                                      || groups * bpg * BLOCK < Kp)))
        return -2;
    int8_t *qp = ki_alloc64((size_t)M * Kp + 64);
    int32_t *s = malloc(sizeof(int32_t) * ((size_t)M * groups + 1));
    if (!qp || !s) {
        free(qp), free(s);
        return -1;
    }
    for (int m = 0; m < M; m++) {
        int8_t *row = qp + (size_t)m * Kp;
        memcpy(row, q + (size_t)m * K, K);
        memset(row + K, 0, Kp - K);
        for (int gi = 0; gi < groups; gi++) {
            int k0 = gi * bpg * BLOCK, k1 = k0 + bpg * BLOCK < Kp ? k0 + bpg * BLOCK : Kp;
            int32_t sum = 0;
            for (int k = k0; k < k1; k++) sum += row[k];
            s[(size_t)m * groups + gi] = 8 * sum;
        }
    }
    w4a8_ctx c = {qp, s, sx, w, sw, out, M, N, Kp, groups, bpg};
    pthread_mutex_lock(&call_mu);
    parallel(w4a8_task, &c, ((N + ROWS - 1) / ROWS + 1) / 2);
    pthread_mutex_unlock(&call_mu);
    free(qp), free(s);
    return 0;
}

/* ki_w4a8 on float32 x [M, K], quantized first by ki_quantize_token_int8 (one call a layer from Python). */
int ki_w4a8_f32(const float *x, long x_bytes, int M, int K, const uint8_t *w, long w_bytes, const float *sw,
                long sw_bytes, int groups, int group_size, int N, float *out, long out_bytes) {
    if (M < 0 || K < 1 || !ki_fits(x_bytes, M, K, 4)) return KI_EBOUNDS;
    const long q_bytes = (long)M * K, sx_bytes = 4L * M;
    int8_t *q = malloc((size_t)q_bytes + 64);
    float *sx = malloc((size_t)sx_bytes + 4);
    if (!q || !sx) {
        free(q), free(sx);
        return -1;
    }
    ki_quantize_token_int8(x, x_bytes, M, K, q, q_bytes, sx, sx_bytes);
    int status = ki_w4a8(q, q_bytes, sx, sx_bytes, M, K, w, w_bytes, sw, sw_bytes, groups, group_size, N, out,
                         out_bytes);
    free(q), free(sx);
    return status;
}
