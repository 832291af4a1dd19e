/* The tile kernels of a16_linear.c (included by it), in the summation order of its docstring; which runs where:
 * a16_linear.c's a16_task. */
#include "kubeinfer_cpu.h"

/* bf16(i - 15), i = 0..31: int4 weights through vpermw, indexed by nibble + 7 - zero. */
static const int16_t a16_table[32] = {
    (int16_t)0xC170, (int16_t)0xC160, (int16_t)0xC150, (int16_t)0xC140, (int16_t)0xC130, (int16_t)0xC120,
    (int16_t)0xC110, (int16_t)0xC100, (int16_t)0xC0E0, (int16_t)0xC0C0, (int16_t)0xC0A0, (int16_t)0xC080,
    (int16_t)0xC040, (int16_t)0xC000, (int16_t)0xBF80, 0, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0,
    0x40E0, 0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170, 0x4180};

#if !KI_A16_BF16
/* The portable twin of one output: row r of row group rg (its weights from wr) for one token whose pair i (inputs 2i
 * and 2i + 1, the even one in the low half) is pairs[i * stride]; the vector tiles' operations in their order. */
static float a16_portable_out(const a16_ctx *c, int bits, const uint8_t *wr, int rg, int r, const uint32_t *pairs,
                              size_t stride) {
    const int gsteps = c->group_size / 8;
    const size_t step_bytes = bits == 4 ? 64 : 128;
    const float *sg = c->scale + (size_t)rg * c->groups * ROWS;
    float o = 0.0f;
    for (int grp = 0; grp < c->groups; grp++) {
        size_t zi = ((size_t)rg * c->groups + grp) * 32;
        float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (int j = grp * gsteps; j < (grp + 1) * gsteps; j++) {
            const uint8_t *wb = wr + j * step_bytes;
            for (int p = 0; p < 4; p++) {
                float w[2];
                for (int par = 0; par < 2; par++) {
                    if (bits == 4) {
                        uint32_t word;
                        memcpy(&word, wb + 4 * r, 4);
                        int u = (word >> (16 * par + 4 * p)) & 0xF;
                        w[par] = (float)(u + ((const int16_t *)c->zero)[zi + 2 * r] - 15);
                    } else {
                        int q = (int8_t)wb[32 * p + (r / 8) * 16 + (r % 8) * 2 + par];
                        w[par] = (float)(q - ((const int32_t *)c->zero)[zi + (r / 8) * 16 + (r % 8) * 2]);
                    }
                }
                uint32_t xp = pairs[(size_t)(4 * j + p) * stride];
                acc[p] = a16_ftz(a16_ftz(acc[p] + w[1] * a16_float((uint16_t)(xp >> 16)))
                                 + w[0] * a16_float((uint16_t)xp));
            }
        }
        float p = (acc[0] + acc[1]) + (acc[2] + acc[3]);
        o = o + sg[grp * ROWS + r] * p;
    }
    return o;
}
#endif

/* a16_tile4: up to 4 tokens (x in rows), the 4 chains interleaved: each step's weight vector unpacked once per 4
 * tokens, 16 accumulators. */
static inline __attribute__((always_inline)) void a16_tile4(const a16_ctx *c, int g, int m0, const int mt,
                                                            const int pf, const int bits) {
    const int K = c->K, steps = K / 8;
    const size_t step_bytes = bits == 4 ? 64 : 128;
    const uint8_t *wg = c->w + (size_t)g * steps * step_bytes;
    int n0 = g * ROWS, nn = c->N - n0 < ROWS ? c->N - n0 : ROWS;
#if KI_A16_BF16
    const int gsteps = c->group_size / 8;
    const float *sg = c->scale + (size_t)g * c->groups * ROWS;
    const uint16_t *x = (const uint16_t *)c->x + (size_t)m0 * K; /* rows of bf16 */
    const __m512i table = _mm512_loadu_si512(a16_table), nibble = _mm512_set1_epi16(0x000F);
    const size_t pf_off = (size_t)steps * step_bytes;
    __m512 out[4];
    for (int t = 0; t < mt; t++) out[t] = _mm512_setzero_ps();
    for (int grp = 0; grp < c->groups; grp++) {
        size_t zi = ((size_t)g * c->groups + grp) * 32;
        __m512i off = _mm512_setzero_si512(), z0 = off, z1 = off;
        if (bits == 4) off = _mm512_loadu_si512((const int16_t *)c->zero + zi);
        else z0 = _mm512_loadu_si512((const int32_t *)c->zero + zi), z1 = _mm512_loadu_si512((const int32_t *)c->zero + zi + 16);
        __m512 acc[4][4];
        for (int t = 0; t < mt; t++)
            for (int ch = 0; ch < 4; ch++) acc[t][ch] = _mm512_setzero_ps();
        for (int j = grp * gsteps; j < (grp + 1) * gsteps; j++) {
            const uint8_t *wb = wg + j * step_bytes;
            if (pf) { /* the next row group's step j: its weights come from memory while these are multiplied */
                _mm_prefetch((const char *)(wb + pf_off), _MM_HINT_T0);
                if (bits == 8) _mm_prefetch((const char *)(wb + pf_off + 64), _MM_HINT_T0);
            }
            __m512i v = bits == 4 ? _mm512_loadu_si512(wb) : _mm512_setzero_si512();
            /* v in a register: gcc folds the load into each shift (vpsrlw $4, (mem)), 4 loads a step where 1 does,
             * and the loads (broadcasts of x, the prefetch) bound this loop: 0.8x on cached weights at 16 tokens */
            __asm__("" : "+v"(v));
            for (int p = 0; p < 4; p++) {
                __m512bh w;
                if (bits == 4) {
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
        for (int r = 0; r < nn; r++)
            c->out[(size_t)(m0 + t) * c->N + n0 + r] =
                a16_portable_out(c, bits, wg, g, r, c->x + (size_t)(m0 + t) * (K / 2), 1);
#endif
}

/* a16_tile8: up to A16_TT tokens (x in tiles of pairs), R row groups. */
#if KI_A16_BF16
/* Pair p of step j of a row group, as 32 bf16 words (rows 0-15 x even, odd input). */
static inline __attribute__((always_inline)) __m512bh a16_weights(const uint8_t *wb, int bits, int p, __m512i off,
                                                                  __m512i z0, __m512i z1, __m512i table) {
    if (bits == 4) {
        __m512i v = _mm512_loadu_si512(wb);
        __m512i idx = _mm512_and_si512(p ? _mm512_srli_epi16(v, 4 * p) : v, _mm512_set1_epi16(0x000F));
        return (__m512bh)_mm512_permutexvar_epi16(_mm512_add_epi16(idx, off), table);
    }
    const uint8_t *pb = wb + 32 * p;
    __m512 lo = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)pb)), z0));
    __m512 hi = _mm512_cvtepi32_ps(_mm512_sub_epi32(
        _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(pb + 16))), z1));
    return _mm512_cvtne2ps_pbh(hi, lo);
}
#endif

/* Row groups g.. g + R - 1 for the tile's mt tokens. Each chain runs A16_BLOCK steps at a time, one accumulator a
 * token and row group, each weight vector unpacked once for the mt tokens and each broadcast pair of x feeding the
 * R row groups (loads, not the products, bounded one row group at a time); cp chains at once where few tokens would
 * leave the accumulators' latency bare. Each chain's sums are in the order of the file's docstring. */
static inline __attribute__((always_inline)) void a16_tile8(const a16_ctx *c, int g, int m0, const int mt, const int R,
                                                            int pf) {
    const int K = c->K, steps = K / 8;
    const size_t step_bytes = c->bits == 4 ? 64 : 128, rg_bytes = (size_t)steps * step_bytes;
    const uint8_t *wg = c->w + g * rg_bytes;
    const uint32_t *xt = c->x + (size_t)m0 * (K / 2); /* the tile's pairs, [K / 2][mt] */
#if KI_A16_BF16
    const int gsteps = c->group_size / 8;
    const __m512i table = _mm512_loadu_si512(a16_table);
    const int cp = R * mt <= 4 ? 4 : R * mt <= 8 ? 2 : 1; /* chains at once: cp * R * mt accumulators, <= 16 */
    __m512 out[2][A16_TT], part[4][2][A16_TT];
    for (int r = 0; r < R; r++)
        for (int t = 0; t < mt; t++) out[r][t] = _mm512_setzero_ps();
    for (int grp = 0; grp < c->groups; grp++) {
        __m512i off[2], z0[2], z1[2];
        for (int r = 0; r < R; r++) {
            size_t zi = ((size_t)(g + r) * c->groups + grp) * 32;
            off[r] = z0[r] = z1[r] = _mm512_setzero_si512();
            if (c->bits == 4) off[r] = _mm512_loadu_si512((const int16_t *)c->zero + zi);
            else z0[r] = _mm512_loadu_si512((const int32_t *)c->zero + zi),
                 z1[r] = _mm512_loadu_si512((const int32_t *)c->zero + zi + 16);
        }
        const int j0 = grp * gsteps, j1 = j0 + gsteps;
        for (int jb = j0; jb < j1; jb += A16_BLOCK) {
            const int je = j1 - jb < A16_BLOCK ? j1 : jb + A16_BLOCK;
            if (pf) /* the next row groups' block: from memory while this one is multiplied */
                for (const uint8_t *b = wg + R * rg_bytes + jb * step_bytes; b < wg + R * rg_bytes + je * step_bytes;
                     b += 64)
                    for (int r = 0; r < R; r++) _mm_prefetch((const char *)(b + r * rg_bytes), _MM_HINT_T0);
            for (int p0 = 0; p0 < 4; p0 += cp) {
                __m512 acc[4][2][A16_TT];
                for (int q = 0; q < cp; q++)
                    for (int r = 0; r < R; r++)
                        for (int t = 0; t < mt; t++)
                            acc[q][r][t] = jb == j0 ? _mm512_setzero_ps() : part[p0 + q][r][t];
                for (int j = jb; j < je; j++)
                    for (int q = 0; q < cp; q++) {
                        __m512bh w[2];
                        for (int r = 0; r < R; r++)
                            w[r] = a16_weights(wg + r * rg_bytes + j * step_bytes, c->bits, p0 + q, off[r], z0[r],
                                               z1[r], table);
                        const uint32_t *xp = xt + (size_t)(4 * j + p0 + q) * mt;
                        for (int t = 0; t < mt; t++) {
                            __m512bh b = a16_pair(xp + t); /* one broadcast for the R row groups */
                            for (int r = 0; r < R; r++) acc[q][r][t] = _mm512_dpbf16_ps(acc[q][r][t], w[r], b);
                        }
                    }
                for (int q = 0; q < cp; q++)
                    for (int r = 0; r < R; r++)
                        for (int t = 0; t < mt; t++) part[p0 + q][r][t] = acc[q][r][t];
            }
        }
        for (int r = 0; r < R; r++) {
            __m512 sf = _mm512_loadu_ps(c->scale + ((size_t)(g + r) * c->groups + grp) * ROWS);
            for (int t = 0; t < mt; t++) {
                __m512 p = _mm512_add_ps(_mm512_add_ps(part[0][r][t], part[1][r][t]),
                                         _mm512_add_ps(part[2][r][t], part[3][r][t]));
                out[r][t] = _mm512_add_ps(out[r][t], _mm512_mul_ps(sf, p));
            }
        }
    }
    for (int r = 0; r < R; r++) {
        int n0 = (g + r) * ROWS, nn = c->N - n0 < ROWS ? c->N - n0 : ROWS;
        __mmask16 mask = (__mmask16)((1u << nn) - 1);
        for (int t = 0; t < mt; t++) _mm512_mask_storeu_ps(c->out + (size_t)(m0 + t) * c->N + n0, mask, out[r][t]);
    }
#else
    for (int rg = g; rg < g + R; rg++) {
        int n0 = rg * ROWS, nn = c->N - n0 < ROWS ? c->N - n0 : ROWS;
        for (int t = 0; t < mt; t++)
            for (int r = 0; r < nn; r++)
                c->out[(size_t)(m0 + t) * c->N + n0 + r] =
                    a16_portable_out(c, c->bits, wg + (rg - g) * rg_bytes, rg, r, xt + t, mt);
    }
#endif
}


