/* The A16 product on AVX2 and FMA (x86-64-v3, no AVX-512 BF16): a16_linear.c's sums in its order, with float32
 * fused multiply-adds where AVX-512 BF16 has vdpbf16ps (included by a16_linear.c; its ki_a16_linear calls it).
 *
 * The weights are widened to float32 (int8: sign extension; int4: shifts and a mask), the activations rounded to
 * bf16 then widened back to float32 (a shift): each product (q - zero) * bf16(x) has at most 8 x 8 significant bits,
 * exact in float32, so fma(w, x, acc) rounds once as vdpbf16ps's addition does, the odd input's then the even one's
 * into chain p. Two things vdpbf16ps does and an FMA does not: it flushes a subnormal sum to zero, and it rounds a
 * product that overflows to infinity before adding it. Neither can happen when every activation is zero or
 * 2^-119 <= |bf16(x)| < 2^119: each partial sum is then a multiple of 2^-126 (a multiple of the smallest input's
 * last bit times an integer: never subnormal) and |(q - zero) x| < 2^127. A call with any other activation (tinier,
 * huger, infinite or NaN) runs the portable C instead: the same bits on every call.
 *
 * Registers: 16 rows are two 8-lane halves. A tile is mt tokens (<= 8) of one row group; cp chains (pairs) at a
 * time and nh halves at a time, cp * nh * mt <= 8 accumulators (each takes two dependent FMAs a step: eight of
 * them keep both FMA units busy). The chain sums of a16_linear.c's A16_BLOCK steps are kept between chains, so a
 * block's weights come from L1 for each chain. */
#include "kubeinfer_cpu.h"

#if KI_A16_AVX2
/* int4: input 2p or 2p + 1 of each step of 8 is stored times 2^-4p (exact: a16v_round's range for int4 starts at
 * 2^-114, so the scaled value stays normal), its weight taken as (nibble + offset) * 2^4p, straight from the bits
 * where the packed word holds it (a mask, no shift): the same real product, so the same float32 FMA result. */
static const float a16v_step_scale[8] = {1.0f, 1.0f, 0x1p-4f, 0x1p-4f, 0x1p-8f, 0x1p-8f, 0x1p-12f, 0x1p-12f};

/* x [n] -> bf16(x) as floats (a16_bf16's rounding), times a16v_step_scale where `scaled` (n a multiple of 8 then,
 * rows of K inputs); 1 where every value is 0 or lo <= bf16's exponent field <= 245 (lo: 2^-119 or, scaled,
 * 2^-114, at field 8 or 13). */
static int a16v_round(const float *x, size_t n, float *xf, int scaled) {
    const int lo = scaled ? 13 : 8;
    const __m256i one = _mm256_set1_epi32(1), bias = _mm256_set1_epi32(0x7FFF), fmax = _mm256_set1_epi32(0xFF);
    __m256i bad = _mm256_setzero_si256();
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256i u = _mm256_loadu_si256((const __m256i *)(x + i));
        __m256i h = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, bias),
                                                       _mm256_and_si256(_mm256_srli_epi32(u, 16), one)), 16);
        const __m256i e = _mm256_and_si256(_mm256_srli_epi32(h, 7), fmax); /* bf16's exponent field */
        const __m256i ein = _mm256_and_si256(_mm256_srli_epi32(u, 23), fmax);
        const __m256i zero = _mm256_cmpeq_epi32(e, _mm256_setzero_si256());
        /* out of range: the input infinite or NaN, or a nonzero result below 2^-119 (field < 8) or >= 2^119 */
        bad = _mm256_or_si256(bad, _mm256_cmpeq_epi32(ein, fmax));
        bad = _mm256_or_si256(bad, _mm256_andnot_si256(zero, _mm256_cmpgt_epi32(_mm256_set1_epi32(lo), e)));
        bad = _mm256_or_si256(bad, _mm256_cmpgt_epi32(e, _mm256_set1_epi32(245)));
        h = _mm256_andnot_si256(zero, h); /* a16_bf16's subnormals to +0 */
        __m256 f = _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
        if (scaled) f = _mm256_mul_ps(f, _mm256_loadu_ps(a16v_step_scale)); /* i a multiple of 8: a whole step */
        _mm256_storeu_ps(xf + i, f);
    }
    int ok = _mm256_testz_si256(bad, bad);
    for (; i < n; i++) {
        const uint16_t h = a16_bf16(x[i]);
        const int e = (h >> 7) & 0xFF;
        ok &= e == 0 || (e >= lo && e <= 245);
        xf[i] = a16_float(h) * (scaled ? a16v_step_scale[i % 8] : 1.0f);
    }
    return ok;
}

/* Half h (rows 8h.. 8h + 7) of a row group's zero points for group grp, as the int32 to add to the widened weight:
 * int4 nibble + 7 - zero - 15, int8 q - zero; vector loads of the packed zeros (each row twice), no stores (a
 * gather through the stack stalled on store forwarding once a group). */
static inline __attribute__((always_inline)) __m256i a16v_offset(const a16_ctx *c, int g, int grp, int h,
                                                                 const int bits) {
    const size_t zi = ((size_t)g * c->groups + grp) * 32 + 16 * h;
    if (bits == 4) { /* 16 int16, each row's twice: the low one of each int32 lane, sign-extended */
        const __m256i z = _mm256_loadu_si256((const __m256i *)((const int16_t *)c->zero + zi));
        return _mm256_sub_epi32(_mm256_srai_epi32(_mm256_slli_epi32(z, 16), 16), _mm256_set1_epi32(15));
    }
    const int32_t *z = (const int32_t *)c->zero + zi; /* 16 int32, each row's twice: lanes 0, 2, .., 14 */
    const __m256i even = _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6);
    const __m256i lo = _mm256_permutevar8x32_epi32(_mm256_loadu_si256((const __m256i *)z), even);
    const __m256i hi = _mm256_permutevar8x32_epi32(_mm256_loadu_si256((const __m256i *)(z + 8)), even);
    return _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_blend_epi32(lo, hi, 0xF0));
}

/* Pair p of a step's weights (wb), half h, as floats: the even input's (we) and the odd one's (wo). int4: one uint32
 * a row, pair p nibble p of the low (even) and the high (odd) half, from v and vo = v >> 16 (loaded once a step),
 * as (nibble + offset) * 2^4p (off: the offset times 2^4p; the activations scaled to match, a16v_step_scale). */
static inline __attribute__((always_inline)) void a16v_weights(const uint8_t *wb, int p, int h, __m256i off,
                                                               const int bits, __m256i v, __m256i vo, __m256 *we,
                                                               __m256 *wo) {
    if (bits == 4) {
        const __m256i m = _mm256_set1_epi32(0xF << 4 * p);
        *we = _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_and_si256(v, m), off));
        *wo = _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_and_si256(vo, m), off));
    } else { /* 8 rows' (even, odd) bytes: as int16 pairs, one int32 lane a row */
        const __m256i v = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(wb + 32 * p + 16 * h)));
        *we = _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_srai_epi32(_mm256_slli_epi32(v, 16), 16), off));
        *wo = _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_srai_epi32(v, 16), off));
    }
}

/* Row group g times tokens m0.. m0 + mt - 1 (x: c->xf's rows); mt, cp, nh, bits constants where inlined. */
static inline __attribute__((always_inline)) void a16v_tile(const a16_ctx *c, int g, int m0, const int mt,
                                                            const int cp, const int nh, const int bits, int pf) {
    const int K = c->K, steps = K / 8, gsteps = c->group_size / 8;
    const size_t step_bytes = bits == 4 ? 64 : 128, rg_bytes = (size_t)steps * step_bytes;
    const uint8_t *wg = c->w + g * rg_bytes;
    const float *x = c->xf + (size_t)m0 * K;
    const int n0 = g * ROWS, nn = c->N - n0 < ROWS ? c->N - n0 : ROWS;
    for (int h0 = 0; h0 < 2; h0 += nh) {
        __m256 out[2][A16_TT], part[4][2][A16_TT];
        for (int hh = 0; hh < nh; hh++)
            for (int t = 0; t < mt; t++) out[hh][t] = _mm256_setzero_ps();
        for (int grp = 0; grp < c->groups; grp++) {
            __m256i off[2][4]; /* int4: times 2^4p for pair p */
            for (int hh = 0; hh < nh; hh++) {
                off[hh][0] = a16v_offset(c, g, grp, h0 + hh, bits);
                for (int p = 1; p < 4; p++)
                    off[hh][p] = bits == 4 ? _mm256_slli_epi32(off[hh][0], 4 * p) : off[hh][0];
            }
            const int j0 = grp * gsteps, j1 = j0 + gsteps;
            for (int jb = j0; jb < j1; jb += A16_BLOCK) {
                const int je = j1 - jb < A16_BLOCK ? j1 : jb + A16_BLOCK;
                if (pf && h0 == 0) /* the next row group's block: from memory while this one is multiplied */
                    for (const uint8_t *b = wg + rg_bytes + jb * step_bytes; b < wg + rg_bytes + je * step_bytes;
                         b += 64)
                        _mm_prefetch((const char *)b, _MM_HINT_T0);
                for (int p0 = 0; p0 < 4; p0 += cp) {
                    __m256 acc[4][2][A16_TT];
                    for (int q = 0; q < cp; q++)
                        for (int hh = 0; hh < nh; hh++)
                            for (int t = 0; t < mt; t++)
                                acc[q][hh][t] = jb == j0 ? _mm256_setzero_ps() : part[p0 + q][hh][t];
                    for (int j = jb; j < je; j++) {
                        __m256i v[2], vo[2];
                        for (int hh = 0; hh < nh; hh++) {
                            v[hh] = vo[hh] = _mm256_setzero_si256();
                            if (bits == 4) {
                                v[hh] = _mm256_loadu_si256((const __m256i *)(wg + j * step_bytes + 32 * (h0 + hh)));
                                vo[hh] = _mm256_srli_epi32(v[hh], 16);
                            }
                        }
                        for (int q = 0; q < cp; q++) {
                            __m256 we[2], wo[2];
                            for (int hh = 0; hh < nh; hh++)
                                a16v_weights(wg + j * step_bytes, p0 + q, h0 + hh, off[hh][p0 + q], bits, v[hh],
                                             vo[hh], &we[hh], &wo[hh]);
                            const float *xp = x + 8 * j + 2 * (p0 + q);
                            for (int t = 0; t < mt; t++) {
                                const __m256 xe = _mm256_broadcast_ss(xp + (size_t)t * K);
                                const __m256 xo = _mm256_broadcast_ss(xp + (size_t)t * K + 1);
                                for (int hh = 0; hh < nh; hh++)
                                    acc[q][hh][t] =
                                        _mm256_fmadd_ps(we[hh], xe, _mm256_fmadd_ps(wo[hh], xo, acc[q][hh][t]));
                            }
                        }
                    }
                    for (int q = 0; q < cp; q++)
                        for (int hh = 0; hh < nh; hh++)
                            for (int t = 0; t < mt; t++) part[p0 + q][hh][t] = acc[q][hh][t];
                }
            }
            for (int hh = 0; hh < nh; hh++) {
                const __m256 sf = _mm256_loadu_ps(c->scale + ((size_t)g * c->groups + grp) * ROWS + 8 * (h0 + hh));
                for (int t = 0; t < mt; t++) {
                    const __m256 p = _mm256_add_ps(_mm256_add_ps(part[0][hh][t], part[1][hh][t]),
                                                   _mm256_add_ps(part[2][hh][t], part[3][hh][t]));
                    out[hh][t] = _mm256_add_ps(out[hh][t], _mm256_mul_ps(sf, p));
                }
            }
        }
        for (int hh = 0; hh < nh; hh++) {
            const int rows = nn - 8 * (h0 + hh);
            if (rows <= 0) continue;
            const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(rows), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
            for (int t = 0; t < mt; t++)
                _mm256_maskstore_ps(c->out + (size_t)(m0 + t) * c->N + n0 + 8 * (h0 + hh), mask, out[hh][t]);
        }
    }
}

/* One row group, all the tokens: up to 4 in one tile with both halves, more in tiles of A16_TT, a half at a time. */
#define A16V_ROWS(BITS)                                                                                             \
    static __attribute__((noinline)) void a16v_rows_##BITS(const a16_ctx *c, int g, int pf) {                       \
        for (int m0 = 0; m0 < c->M; m0 += A16_TT) {                                                                 \
            const int mt = c->M - m0 < A16_TT ? c->M - m0 : A16_TT, first = pf && m0 == 0;                         \
            switch (mt) {                                                                                           \
                case 1: a16v_tile(c, g, m0, 1, 4, 2, BITS, first); break;                                           \
                case 2: a16v_tile(c, g, m0, 2, 2, 2, BITS, first); break;                                           \
                case 3: a16v_tile(c, g, m0, 3, 1, 2, BITS, first); break;                                           \
                case 4: a16v_tile(c, g, m0, 4, 1, 2, BITS, first); break;                                           \
                case 5: a16v_tile(c, g, m0, 5, 1, 1, BITS, first); break;                                           \
                case 6: a16v_tile(c, g, m0, 6, 1, 1, BITS, first); break;                                           \
                case 7: a16v_tile(c, g, m0, 7, 1, 1, BITS, first); break;                                           \
                default: a16v_tile(c, g, m0, A16_TT, 1, 1, BITS, first); break;                                     \
            }                                                                                                       \
        }                                                                                                           \
    }
A16V_ROWS(4)
A16V_ROWS(8)

/* Work items as a16_task's: pairs of row groups. */
static void a16v_task(const void *ctx, int start, int end) {
    const a16_ctx *c = ctx;
    const int groups = (c->N + ROWS - 1) / ROWS;
    for (int g = 2 * start; g < 2 * end && g < groups; g++) {
        if (c->bits == 4) a16v_rows_4(c, g, g + 1 < groups);
        else a16v_rows_8(c, g, g + 1 < groups);
    }
}
#endif
