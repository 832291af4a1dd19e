/* The exact "A16" product of weight-only int4 / int8 checkpoints (included by kernels.c; a16_method.py):
 *
 *   out[m, n] = sum over groups g of scale[n, g] * (sum over k in g of (q[n, k] - zero[n, g]) * bf16(x[m, k]))
 *
 * bf16(x) rounds the activations to bfloat16 as torch's x.to(torch.bfloat16) (to nearest even; magnitudes below
 * 2^-126, bf16's subnormals, taken as zero, as AVX-512 BF16 reads them). (q - zero) is an integer of at most 8
 * significant bits, exact in bf16, and each product is exact in float32 (8 x 8 bits). Summation order, fixed per
 * output element whatever M, the tiling or the thread count (batch invariance): within a group, in steps of 8
 * inputs, pair p (0..3: inputs 2p and 2p + 1 of the step) goes to chain p, which adds the odd input's product,
 * then the even one's, each addition rounded to float32 (what vdpbf16ps computes: Intel's definition, checked on
 * this CPU; a subnormal sum flushed to zero); the group's partial sum is (chain 0 + chain 1) + (chain 2 + chain 3);
 * then out = out + scale * partial over the groups in order, from 0 (a multiply, then an add). The portable
 * twin (KI_PORTABLE) does the same operations in the same order.
 *
 * Layout (a16_method.py packs it), per row group of 16 output rows (the last padded), per step of 8 inputs:
 * int4: 16 uint32, one per row, the low half holding q + 8 of inputs 0, 2, 4, 6 (bits 0, 4, 8, 12), the high
 * half inputs 1, 3, 5, 7, so that pair p is the two halves' nibble p; int8: per pair p, 32 bytes: rows 0-7 then
 * rows 8-15, each row its even and odd input. The weights become bf16 words in registers: int4 through a
 * 32-entry table of bf16(i - 15) indexed by nibble + 7 - zero (vpermw), int8 as int32 minus the zero, converted
 * to float and packed to bf16 (exact). Zeros per row group and weight group: int4 32 int16 (7 - zero, each row
 * twice), int8 32 int32 (rows 0-7 then 8-15, each twice); scales float32 [row groups][groups][16]. */

#if KI_VNNI && defined(__AVX512BF16__)
#define KI_A16_BF16 1
#else
#define KI_A16_BF16 0
#endif

#define A16_TT 4 /* tokens per tile: each weight vector feeds all of them */

typedef struct {
    const uint16_t *x; /* [M, K] bf16 */
    const uint8_t *w;
    const float *scale;
    const void *zero;
    float *out;
    int M, N, K, bits, groups, group_size;
} a16_ctx;

int ki_has_a16_bf16(void) { return KI_A16_BF16; }

/* torch's float -> bfloat16 (round to nearest even; NaN to its quiet NaN); subnormal results to +0. */
static inline uint16_t a16_bf16(float f) {
    union { float f; uint32_t u; } v = {.f = f};
    if ((v.u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
    uint16_t h = (uint16_t)((v.u + 0x7FFFu + ((v.u >> 16) & 1u)) >> 16);
    return (h & 0x7F80) == 0 ? 0 : h;
}

#if !KI_A16_BF16
static inline float a16_float(uint16_t h) {
    union { uint32_t u; float f; } v = {.u = (uint32_t)h << 16};
    return v.f;
}

static inline float a16_ftz(float f) { return fabsf(f) < 0x1p-126f ? copysignf(0.0f, f) : f; }
#endif

static inline __attribute__((always_inline)) void a16_tile(const a16_ctx *c, int g, int m0, const int mt) {
    const int K = c->K, steps = K / 8, gsteps = c->group_size / 8;
    const size_t step_bytes = c->bits == 4 ? 64 : 128;
    const uint8_t *wg = c->w + (size_t)g * steps * step_bytes;
    const float *sg = c->scale + (size_t)g * c->groups * ROWS;
    const uint16_t *x = c->x + (size_t)m0 * K;
    int n0 = g * ROWS, nn = c->N - n0 < ROWS ? c->N - n0 : ROWS;
#if KI_A16_BF16
    static const int16_t table_words[32] = {
        (int16_t)0xC170, (int16_t)0xC160, (int16_t)0xC150, (int16_t)0xC140, (int16_t)0xC130, (int16_t)0xC120,
        (int16_t)0xC110, (int16_t)0xC100, (int16_t)0xC0E0, (int16_t)0xC0C0, (int16_t)0xC0A0, (int16_t)0xC080,
        (int16_t)0xC040, (int16_t)0xC000, (int16_t)0xBF80, 0, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0,
        0x40E0, 0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170, 0x4180};
    const __m512i table = _mm512_loadu_si512(table_words), nibble = _mm512_set1_epi16(0x000F);
    __m512 out[A16_TT];
    for (int t = 0; t < mt; t++) out[t] = _mm512_setzero_ps();
    for (int grp = 0; grp < c->groups; grp++) {
        size_t zi = ((size_t)g * c->groups + grp) * 32;
        __m512i off = _mm512_setzero_si512(), z0 = off, z1 = off;
        if (c->bits == 4) off = _mm512_loadu_si512((const int16_t *)c->zero + zi);
        else z0 = _mm512_loadu_si512((const int32_t *)c->zero + zi), z1 = _mm512_loadu_si512((const int32_t *)c->zero + zi + 16);
        __m512 acc[A16_TT][4];
        for (int t = 0; t < mt; t++)
            for (int ch = 0; ch < 4; ch++) acc[t][ch] = _mm512_setzero_ps();
        for (int j = grp * gsteps; j < (grp + 1) * gsteps; j++) {
            const uint8_t *wb = wg + j * step_bytes;
            __m512i v = c->bits == 4 ? _mm512_loadu_si512(wb) : _mm512_setzero_si512();
            for (int p = 0; p < 4; p++) {
                __m512bh w;
                if (c->bits == 4) {
                    __m512i idx = _mm512_and_si512(p ? _mm512_srli_epi16(v, 4 * p) : v, nibble);
                    w = (__m512bh)_mm512_permutexvar_epi16(_mm512_add_epi16(idx, off), table);
                } else {
                    const uint8_t *pb = wb + 32 * p;
                    __m512 lo = _mm512_cvtepi32_ps(_mm512_sub_epi32(
                        _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)pb)), z0));
                    __m512 hi = _mm512_cvtepi32_ps(_mm512_sub_epi32(
                        _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(pb + 16))), z1));
                    w = _mm512_cvtne2ps_pbh(hi, lo);
                }
                for (int t = 0; t < mt; t++) {
                    uint32_t pair;
                    memcpy(&pair, x + (size_t)t * K + 8 * j + 2 * p, 4);
                    acc[t][p] = _mm512_dpbf16_ps(acc[t][p], w, (__m512bh)_mm512_set1_epi32((int)pair));
                }
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
                size_t zi = ((size_t)g * c->groups + grp) * 32;
                float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                for (int j = grp * gsteps; j < (grp + 1) * gsteps; j++) {
                    const uint8_t *wb = wg + j * step_bytes;
                    for (int p = 0; p < 4; p++) {
                        float w[2];
                        for (int par = 0; par < 2; par++) {
                            if (c->bits == 4) {
                                uint32_t word;
                                memcpy(&word, wb + 4 * r, 4);
                                int u = (word >> (16 * par + 4 * p)) & 0xF;
                                w[par] = (float)(u + ((const int16_t *)c->zero)[zi + 2 * r] - 15);
                            } else {
                                int q = (int8_t)wb[32 * p + (r / 8) * 16 + (r % 8) * 2 + par];
                                w[par] = (float)(q - ((const int32_t *)c->zero)[zi + (r / 8) * 16 + (r % 8) * 2]);
                            }
                        }
                        const uint16_t *xp = x + (size_t)t * K + 8 * j + 2 * p;
                        acc[p] = a16_ftz(a16_ftz(acc[p] + w[1] * a16_float(xp[1])) + w[0] * a16_float(xp[0]));
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
int ki_a16_linear(const float *x, int M, int K, const uint8_t *w, int bits, const float *scale, const void *zero,
                  int groups, int group_size, int N, float *out) {
    uint16_t *xb = malloc(sizeof(uint16_t) * ((size_t)M * K + 2));
    if (!xb) return -1;
    for (size_t i = 0; i < (size_t)M * K; i++) xb[i] = a16_bf16(x[i]);
    a16_ctx c = {xb, w, scale, zero, out, M, N, K, bits, groups, group_size};
    pthread_mutex_lock(&call_mu);
    parallel(a16_task, &c, (N + ROWS - 1) / ROWS);
    pthread_mutex_unlock(&call_mu);
    free(xb);
    return 0;
}
