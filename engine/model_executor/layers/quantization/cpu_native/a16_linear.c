/* The exact "A16" product of weight-only int4 / int8 checkpoints (included by kernels.c; a16_method.py):
 *
 *   out[m, n] = sum over groups g of scale[n, g] * (sum over k in g of (q[n, k] - zero[n, g]) * bf16(x[m, k]))
 *
 * bf16(x) rounds the activations to bfloat16 as torch's x.to(torch.bfloat16) (to nearest even), kept as float32.
 * (q - zero) is a small integer, exact in float32, and so is each product (8 x 8 significant bits), so a fused
 * multiply-add is an exact product plus one rounded addition. Summation order, fixed per output element whatever
 * M, the tiling or the thread count (batch invariance): within a group, chain c (0..3) sums the inputs
 * k = c, c + 4, ... of the group in order, one fused multiply-add each, from 0; the group's partial sum is
 * (chain 0 + chain 1) + (chain 2 + chain 3); then out = out + scale * partial over the groups in order, from 0
 * (a multiply, then an add). The portable twin (KI_PORTABLE) does the same operations in the same order.
 *
 * Layout (a16_method.py packs it), per row group of 16 output rows (the last padded), per step of 8 inputs:
 * int4: 16 uint32, one per row, nibble i (bits 4i..4i+3) holding q + 8 of input 8j + i; int8: 8 x 16 int8,
 * input 8j + i's 16 rows at byte 16i. The weights are widened to float32 in registers: int4 through a
 * 16-entry table (vpermps reads a lane's low 4 bits), int8 by sign extension and conversion. Scales and zeros
 * float32 [row groups][groups][16]. */

#define A16_TT 4 /* tokens per tile: each widened weight vector feeds all of them */

typedef struct {
    const float *x; /* [M, K] bf16-rounded */
    const uint8_t *w;
    const float *scale, *zero;
    float *out;
    int M, N, K, bits, groups, group_size;
} a16_ctx;

/* torch's float -> bfloat16 (round to nearest even; NaN to its quiet NaN), back as float32. */
static inline float a16_bf16(float f) {
    union { float f; uint32_t u; } v = {.f = f};
    if ((v.u & 0x7FFFFFFFu) > 0x7F800000u) v.u = 0x7FC00000u;
    else v.u = (v.u + 0x7FFFu + ((v.u >> 16) & 1u)) & 0xFFFF0000u;
    return v.f;
}

static inline __attribute__((always_inline)) void a16_tile(const a16_ctx *c, int g, int m0, const int mt) {
    const int K = c->K, steps = K / 8, gsteps = c->group_size / 8;
    const size_t step_bytes = c->bits == 4 ? 64 : 128;
    const uint8_t *wg = c->w + (size_t)g * steps * step_bytes;
    const float *sg = c->scale + (size_t)g * c->groups * ROWS, *zg = c->zero + (size_t)g * c->groups * ROWS;
    const float *x = c->x + (size_t)m0 * K;
    int n0 = g * ROWS, nn = c->N - n0 < ROWS ? c->N - n0 : ROWS;
#if KI_VNNI
    const __m512 table = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    __m512 out[A16_TT];
    for (int t = 0; t < mt; t++) out[t] = _mm512_setzero_ps();
    for (int grp = 0; grp < c->groups; grp++) {
        __m512 zf = _mm512_loadu_ps(zg + grp * ROWS), acc[A16_TT][4];
        for (int t = 0; t < mt; t++)
            for (int ch = 0; ch < 4; ch++) acc[t][ch] = _mm512_setzero_ps();
        for (int j = grp * gsteps; j < (grp + 1) * gsteps; j++) {
            const uint8_t *wb = wg + j * step_bytes;
            __m512i v = c->bits == 4 ? _mm512_loadu_si512(wb) : _mm512_setzero_si512();
            for (int i = 0; i < 8; i++) {
                __m512 w;
                if (c->bits == 4)
                    w = _mm512_permutexvar_ps(i ? _mm512_srli_epi32(v, 4 * i) : v, table);
                else
                    w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(wb + 16 * i))));
                w = _mm512_sub_ps(w, zf);
                for (int t = 0; t < mt; t++)
                    acc[t][i & 3] = _mm512_fmadd_ps(w, _mm512_set1_ps(x[(size_t)t * K + 8 * j + i]), acc[t][i & 3]);
            }
        }
        __m512 sf = _mm512_loadu_ps(sg + grp * ROWS);
        for (int t = 0; t < mt; t++) {
            __m512 p = _mm512_add_ps(_mm512_add_ps(acc[t][0], acc[t][1]), _mm512_add_ps(acc[t][2], acc[t][3]));
            out[t] = _mm512_add_ps(out[t], _mm512_mul_ps(sf, p));
        }
    }
    __mmask16 mask = (__mmask16)((1u << nn) - 1);
    for (int t = 0; t < mt; t++) _mm512_mask_storeu_ps(c->out + (size_t)(m0 + t) * c->N + n0, mask, out[t]);
#else
    for (int t = 0; t < mt; t++)
        for (int r = 0; r < nn; r++) {
            float o = 0.0f;
            for (int grp = 0; grp < c->groups; grp++) {
                float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f}, z = zg[grp * ROWS + r];
                for (int j = grp * gsteps; j < (grp + 1) * gsteps; j++) {
                    const uint8_t *wb = wg + j * step_bytes;
                    for (int i = 0; i < 8; i++) {
                        float q;
                        if (c->bits == 4) {
                            uint32_t word;
                            memcpy(&word, wb + 4 * r, 4);
                            q = (float)((int)((word >> (4 * i)) & 0xF) - 8);
                        } else {
                            q = (float)(int8_t)wb[16 * i + r];
                        }
                        acc[i & 3] = fmaf(q - z, x[(size_t)t * K + 8 * j + i], acc[i & 3]);
                    }
                }
                float p = (acc[0] + acc[1]) + (acc[2] + acc[3]);
                o = o + sg[grp * ROWS + r] * p;
            }
            c->out[(size_t)(m0 + t) * c->N + n0 + r] = o;
        }
#endif
}

/* Work items: row groups, each with all the tokens, A16_TT at a time. */
static void a16_task(const void *ctx, int start, int end) {
    const a16_ctx *c = ctx;
    for (int g = start; g < end; g++)
        for (int m0 = 0; m0 < c->M; m0 += A16_TT) switch (c->M - m0 < A16_TT ? c->M - m0 : A16_TT) {
            case 1: a16_tile(c, g, m0, 1); break;
            case 2: a16_tile(c, g, m0, 2); break;
            case 3: a16_tile(c, g, m0, 3); break;
            default: a16_tile(c, g, m0, 4); break;
        }
}

/* x [M, K] float32 (K and group_size multiples of 8, group_size dividing K) times packed weights -> out [M, N].
 * Returns -1 when out of memory. */
int ki_a16_linear(const float *x, int M, int K, const uint8_t *w, int bits, const float *scale, const float *zero,
                  int groups, int group_size, int N, float *out) {
    float *xb = malloc(sizeof(float) * ((size_t)M * K + 1));
    if (!xb) return -1;
    for (size_t i = 0; i < (size_t)M * K; i++) xb[i] = a16_bf16(x[i]);
    a16_ctx c = {xb, w, scale, zero, out, M, N, K, bits, groups, group_size};
    pthread_mutex_lock(&call_mu);
    parallel(a16_task, &c, (N + ROWS - 1) / ROWS);
    pthread_mutex_unlock(&call_mu);
    free(xb);
    return 0;
}
