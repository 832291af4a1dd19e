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
 * unsigned operand. A group's sum of (w + 8) * q is isum + 8 * sum(q), the latter subtracted in int32. The
 * high nibbles are multiplied as 16 * nibble (no shift in the loop) and that chain shifted right by 4 after:
 * exact, |16 * 15 * 128 * K / 2| < 2^31 for K <= ops.MAX_INPUTS. One row group's weights are one stream
 * (prefetched as kernels_q8_0.c does), times up to W4_TILE tokens a tile. */

#ifndef W4_TILE
#define W4_TILE 8
#endif
#define W4_PREFETCH 8192

typedef struct {
    const int8_t *q;   /* [M, Kp] activations, zero-padded to Kp (a multiple of 32) */
    const int32_t *s;  /* [M, groups]: 8 * the group's sum of q */
    const float *sx;   /* [M] */
    const uint8_t *w;  /* packed int4, [ceil(N / 16)][Kp / 8][16][4] */
    const float *sw;   /* [ceil(N / 16)][groups][16] (ops.pack_groups) */
    float *out;        /* [M, N] */
    int M, N, Kp, groups, bpg; /* bpg: blocks of 32 inputs per weight group */
} w4a8_ctx;

static inline __attribute__((always_inline)) void w4a8_tile(const w4a8_ctx *c, int g, int m0, const int mt,
                                                            const uint8_t *stop) {
    const int blocks = c->Kp / BLOCK;
    const uint8_t *wg = c->w + (size_t)g * blocks * (BLOCK * ROWS / 2);
    const float *scales = c->sw + (size_t)g * c->groups * ROWS;
    int n0 = g * ROWS, nn = c->N - n0 < ROWS ? c->N - n0 : ROWS;
#if KI_VNNI
    __m512 acc[W4_TILE];
    for (int t = 0; t < mt; t++) acc[t] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi8(0x0F), high = _mm512_set1_epi8((char)0xF0);
    for (int gi = 0; gi < c->groups; gi++) {
        int b0 = gi * c->bpg, b1 = b0 + c->bpg < blocks ? b0 + c->bpg : blocks;
        __m512i even[W4_TILE], odd[W4_TILE], even2[4], odd2[4]; /* even2, odd2: the memory-bound loop's (mt <= 4) */
        for (int t = 0; t < mt; t++) even[t] = odd[t] = _mm512_setzero_si512();
        for (int t = 0; t < (mt < 4 ? mt : 4); t++) even2[t] = odd2[t] = _mm512_setzero_si512();
        for (int b = b0; b < b1; b++) {
            const uint8_t *wb = wg + (size_t)b * (BLOCK * ROWS / 2);
            /* the first tile only (later ones find the weights in cache), and not past the task's own weights */
            const int fetch = m0 == 0 && wb + BLOCK * ROWS / 2 + W4_PREFETCH <= stop;
            if (mt > 4) { /* compute-bound: 16 inputs a step, each token's 16 bytes one broadcast, then shuffled */
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
                        __m512i a = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)q));
                        even[t] = _mm512_dpbusd_epi32(even[t], w0, _mm512_shuffle_epi32(a, 0x00));
                        odd[t] = _mm512_dpbusd_epi32(odd[t], w1, _mm512_shuffle_epi32(a, 0x55));
                        even[t] = _mm512_dpbusd_epi32(even[t], w2, _mm512_shuffle_epi32(a, 0xAA));
                        odd[t] = _mm512_dpbusd_epi32(odd[t], w3, _mm512_shuffle_epi32(a, 0xFF));
                    }
                }
            } else { /* bound by reading the weights: the activations broadcast from memory, four chains a token
                      * (vpdpbusd's latency, not the loads, would bound two chains at one token) */
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
        }
        __m512 sw = _mm512_loadu_ps(scales + gi * ROWS);
        for (int t = 0; t < mt; t++) {
            int m = m0 + t;
            __m512i e = even[t], o = odd[t];
            if (mt <= 4) e = _mm512_add_epi32(e, even2[t]), o = _mm512_add_epi32(o, odd2[t]);
            __m512i sum = _mm512_add_epi32(e, _mm512_srai_epi32(o, 4));
            sum = _mm512_sub_epi32(sum, _mm512_set1_epi32(c->s[(size_t)m * c->groups + gi]));
            __m512 scale = _mm512_mul_ps(_mm512_set1_ps(c->sx[m]), sw);
            acc[t] = _mm512_add_ps(acc[t], _mm512_mul_ps(_mm512_cvtepi32_ps(sum), scale));
        }
    }
    __mmask16 mask = (__mmask16)((1u << nn) - 1);
    for (int t = 0; t < mt; t++) _mm512_mask_storeu_ps(c->out + (size_t)(m0 + t) * c->N + n0, mask, acc[t]);
#else
    (void)stop;
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
#endif
}

#define W4_CASE(n) case n: w4a8_tile(c, g, m0, n, stop); break;

/* Work item u: row groups 2u and 2u + 1, each alone (one stream of weights) in tiles of W4_TILE tokens. */
static void w4a8_task(const void *ctx, int start, int end) {
    const w4a8_ctx *c = ctx;
    int groups = (c->N + ROWS - 1) / ROWS, last = 2 * end < groups ? 2 * end : groups;
    const uint8_t *stop = c->w + (size_t)last * c->Kp * ROWS / 2;
    for (int g = 2 * start; g < 2 * end && g < groups; g++)
        for (int m0 = 0; m0 < c->M; m0 += W4_TILE) switch (c->M - m0 < W4_TILE ? c->M - m0 : W4_TILE) {
            W4_CASE(1) W4_CASE(2) W4_CASE(3) W4_CASE(4) W4_CASE(5) W4_CASE(6) W4_CASE(7)
            default: w4a8_tile(c, g, m0, W4_TILE, stop);
        }
}

/* q [M, K] int8 and sx [M] (the activations as quantized per token), w packed (Kp = K rounded up to 32 inputs),
 * sw [ceil(N / 16)][groups][16], groups of group_size inputs (a multiple of 32, or one group of all K) ->
 * out [M, N] float32. Returns -1 when out of memory, -2 for a group size it does not take. */
int ki_w4a8(const int8_t *q, const float *sx, int M, int K, const uint8_t *w, const float *sw, int groups,
            int group_size, int N, float *out) {
    int Kp = (K + BLOCK - 1) / BLOCK * BLOCK;
    int bpg = groups == 1 ? Kp / BLOCK : group_size / BLOCK;
    if (groups < 1 || (groups > 1 && (group_size % BLOCK || (groups - 1) * bpg * BLOCK >= Kp
                                      || groups * bpg * BLOCK < Kp)))
        return -2;
    int8_t *qp = aligned_alloc(64, (size_t)M * Kp + 64);
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
int ki_w4a8_f32(const float *x, int M, int K, const uint8_t *w, const float *sw, int groups, int group_size, int N,
                float *out) {
    int8_t *q = malloc((size_t)M * K + 64);
    float *sx = malloc(sizeof(float) * ((size_t)M + 1));
    if (!q || !sx) {
        free(q), free(sx);
        return -1;
    }
    ki_quantize_token_int8(x, M, K, q, sx);
    int status = ki_w4a8(q, sx, M, K, w, sw, groups, group_size, N, out);
    free(q), free(sx);
    return status;
}
