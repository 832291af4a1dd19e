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
 * twice), int8 32 int32 (rows 0-7 then 8-15, each twice); scales float32 [row groups][groups][16].
 *
 * Tiling (a16_tiles.c; any tiling gives the same bits): int4, and int8 below 5 tokens, 4 tokens at a time with the
 * 4 chains interleaved (a16_tile4); int8 from 5 tokens, 8 tokens and 2 row groups at a time, chain by chain, each
 * weight vector unpacked once for the 8 tokens (a16_tile8). The first tile of a row group prefetches the next row
 * groups' weights: a decode step's weights come from memory, and at 16 tokens the hardware prefetcher alone left
 * the products 1.3-1.4x slower than on cached weights; on cached weights it costs int4 1-4% at 16 tokens (one more
 * load a step in the first tile of a load-bound loop), nothing at 1 token. Speeds against the kernel before these
 * tilings and the prefetch (benchmarks/RESULTS.md "cpu-a16-kernel", one thread): int4 0.96-1.04x on cached weights,
 * 1.2-1.75x on cold ones (the layers larger than the caches); int8 1.4x at 16 tokens. */
#include "kubeinfer_cpu.h"

#if KI_VNNI && defined(__AVX512BF16__)
#define KI_A16_BF16 1
#else
#define KI_A16_BF16 0
#endif
#define KI_A16_AVX2 (!KI_A16_BF16 && KI_AVX2) /* a16_avx2.c: the same sums with float32 FMAs */

#define A16_TT 8     /* tokens per tile of x (int8: each weight vector, unpacked once, feeds all of them) */
#define A16_BLOCK 16 /* steps a chain runs before the next chain takes over: their x and weights stay in L1 */

typedef struct {
    const uint32_t *x; /* bf16 pairs (even input low), a16_round_x's tiles: int8 A16_TT tokens, int4 one */
    const uint8_t *w;
    const float *scale;
    const void *zero;
    float *out;
    int M, N, K, bits, groups, group_size;
    const float *xf; /* a16_avx2.c: bf16(x) as floats, [M, K] */
} a16_ctx;

int ki_has_a16_bf16(void) { return KI_A16_BF16; }

/* Whether the product runs vector code (AVX-512 BF16 or AVX2 and FMA), not the portable C. */
int ki_has_a16_vector(void) { return KI_A16_BF16 || KI_A16_AVX2; }

/* Calls the AVX2 build ran in portable C (activations outside a16_avx2.c's exact range): tests, inspection. */
static atomic_long a16_portable_calls;
long ki_a16_portable_calls(void) { return atomic_load(&a16_portable_calls); }

/* torch's float -> bfloat16 (round to nearest even; NaN to its quiet NaN); subnormal results to +0. */
static inline uint16_t a16_bf16(float f) {
    union { float f; uint32_t u; } v = {.f = f};
    if ((v.u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
    uint16_t h = (uint16_t)((v.u + 0x7FFFu + ((v.u >> 16) & 1u)) >> 16);
    return (h & 0x7F80) == 0 ? 0 : h;
}

#if KI_A16_BF16
/* x's pair broadcast to a register: gcc would fold it into vdpbf16ps as an embedded broadcast ({1to16}), which
 * ran at a third of the register form's rate on this CPU (Zen 5); the empty asm keeps the vpbroadcastd. */
static inline __attribute__((always_inline)) __m512bh a16_pair(const uint32_t *x) {
    __m512i b = _mm512_set1_epi32((int)*x);
    __asm__("" : "+v"(b));
    return (__m512bh)b;
}

/* a16_bf16 of 16 floats, the same integer operations. */
static inline __m256i a16_bf16_x16(const float *f) {
    const __m512i u = _mm512_loadu_si512(f), one = _mm512_set1_epi32(1);
    __m512i h = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)),
                                                   _mm512_and_si512(_mm512_srli_epi32(u, 16), one)), 16);
    __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF)),
                                            _mm512_set1_epi32(0x7F800000));
    __mmask16 tiny = _mm512_testn_epi32_mask(h, _mm512_set1_epi32(0x7F80));
    h = _mm512_mask_mov_epi32(_mm512_maskz_mov_epi32(~tiny, h), nan, _mm512_set1_epi32(0x7FC0));
    return _mm512_cvtepi32_epi16(h);
}
#else
static inline float a16_float(uint16_t h) {
    union { uint32_t u; float f; } v = {.u = (uint32_t)h << 16};
    return v.f;
}

static inline float a16_ftz(float f) { return fabsf(f) < 0x1p-126f ? copysignf(0.0f, f) : f; }
#endif

/* x [M, K] float -> bf16 pairs in tiles of tt tokens, each [K / 2][the tile's tokens] (tt 1: rows). */
static void a16_round_x(const float *x, int M, int K, uint32_t *xb, int tt) {
    uint32_t row[512];
    for (int m0 = 0; m0 < M; m0 += tt) {
        const int mt = M - m0 < tt ? M - m0 : tt;
        uint32_t *tile = xb + (size_t)m0 * (K / 2);
        for (int t = 0; t < mt; t++)
            for (int k0 = 0; k0 < K; k0 += 1024) { /* 512 pairs at a time through `row` */
                const float *xr = x + (size_t)(m0 + t) * K + k0;
                const int kn = K - k0 < 1024 ? K - k0 : 1024;
                int k = 0;
#if KI_A16_BF16
                for (; k + 16 <= kn; k += 16) _mm256_storeu_si256((__m256i *)(row + k / 2), a16_bf16_x16(xr + k));
#endif
                for (; k < kn; k += 2) row[k / 2] = a16_bf16(xr[k]) | (uint32_t)a16_bf16(xr[k + 1]) << 16;
                uint32_t *dst = tile + (size_t)(k0 / 2) * mt + t;
                for (int i = 0; i < kn / 2; i++) dst[(size_t)i * mt] = row[i];
            }
    }
}

#include "a16_tiles.c"
#include "a16_avx2.c"

/* Work items: pairs of row groups, each with all the tokens. int8 from 5 tokens (unpacking a weight vector takes 7
 * operations): A16_TT tokens at once, chain by chain (a16_tile8), 1.35-1.6x the 4-token tiles at 16 tokens; int4 (4
 * operations), and int8 below 5 tokens: 4 tokens at once (a16_tile4), which the chain-by-chain forms did not beat on
 * this CPU (Zen 5; int4 0.75-0.85x at 16 tokens with 8 or 16 tokens a tile, the unpacked block kept on the stack or
 * two row groups sharing each broadcast; int8 0.75x at 1 token). vdpbf16ps with an embedded broadcast operand
 * ({1to16}, which gcc folds _mm512_set1_epi32 into) ran at a third of the register form's rate here. */
#define A16_CASE8(n) case n: if (R == 2) a16_tile8(c, g, m0, n, 2, pf); else a16_tile8(c, g, m0, n, 1, pf); break;
#define A16_CASE4(n) \
    case n: if (pf) a16_tile4(c, g + r, m0, n, 1, bits); else a16_tile4(c, g + r, m0, n, 0, bits); break;
/* Row groups g.. g + R - 1, 4 tokens at a time (a16_tile4); one function per weight width, apart from a16_tile8's
 * copies, and a copy per prefetch or not: inlined into a16_task with them, the int4 loop tested the width and the
 * prefetch flag each step and kept its pointers on the stack (with the folded loads of a16_tile4's comment, 0.8-0.9x
 * the earlier kernel on cached weights). */
#define A16_ROWS4(BITS)                                                                                             \
    static __attribute__((noinline)) void a16_rows4_##BITS(const a16_ctx *c, int g, int R, int groups) {             \
        const int bits = BITS;                                                                                      \
        for (int r = 0; r < R; r++)                                                                                 \
            for (int m0 = 0; m0 < c->M; m0 += 4) {                                                                  \
                const int pf = m0 == 0 && g + r + 1 < groups;                                                       \
                switch (c->M - m0 < 4 ? c->M - m0 : 4) {                                                            \
                    A16_CASE4(1) A16_CASE4(2) A16_CASE4(3) default: A16_CASE4(4)                                    \
                }                                                                                                   \
            }                                                                                                       \
    }
A16_ROWS4(4)
A16_ROWS4(8)

static void a16_task(const void *ctx, int start, int end) {
    const a16_ctx *c = ctx;
    const int groups = (c->N + ROWS - 1) / ROWS;
    for (int g = 2 * start; g < 2 * end && g < groups; g += 2) {
        const int R = groups - g < 2 ? 1 : 2;
        if (c->bits == 8 && c->M > 4)
            for (int m0 = 0; m0 < c->M; m0 += A16_TT) {
                const int pf = m0 == 0 && g + 2 < groups; /* the first tile prefetches the next row groups */
                switch (c->M - m0 < A16_TT ? c->M - m0 : A16_TT) {
                    A16_CASE8(1) A16_CASE8(2) A16_CASE8(3) A16_CASE8(4) A16_CASE8(5) A16_CASE8(6) A16_CASE8(7)
                    default: A16_CASE8(A16_TT)
                }
            }
        else if (c->bits == 4)
            a16_rows4_4(c, g, R, groups);
        else
            a16_rows4_8(c, g, R, groups);
    }
}

/* x [M, K] float32 (K and group_size multiples of 8, groups * group_size = K) times packed weights -> out [M, N].
 * Each pointer's buffer length in bytes after it. Returns -1 when out of memory, KI_EBOUNDS (nothing written) when
 * the dimensions are not the layout's or do not fit the buffers. */
int ki_a16_linear(const float *x, long x_bytes, int M, int K, const uint8_t *w, long w_bytes, int bits,
                  const float *scale, long scale_bytes, const void *zero, long zero_bytes, int groups, int group_size,
                  int N, float *out, long out_bytes) {
    if (M < 0 || K < 8 || K % 8 || N < 1 || (bits != 4 && bits != 8) || groups < 1 || group_size < 8
        || group_size % 8 || (long)groups * group_size != K || !ki_fits(x_bytes, M, K, 4)
        || !ki_fits(w_bytes, ki_padded_rows(N), (long)K * bits / 8, 1)
        || !ki_fits(scale_bytes, ki_padded_rows(N), groups, 4)
        || !ki_fits(zero_bytes, ki_padded_rows(N) * 2, groups, bits == 4 ? 2 : 4) || !ki_fits(out_bytes, M, N, 4))
        return KI_EBOUNDS;
#if KI_A16_AVX2
    float *xf = malloc(sizeof(float) * ((size_t)M * K + 1));
    if (!xf) return -1;
    if (a16v_round(x, (size_t)M * K, xf, bits == 4)) {
        a16_ctx v = {NULL, w, scale, zero, out, M, N, K, bits, groups, group_size, xf};
        pthread_mutex_lock(&call_mu);
        parallel(a16v_task, &v, ((N + ROWS - 1) / ROWS + 1) / 2);
        pthread_mutex_unlock(&call_mu);
        free(xf);
        return 0;
    }
    free(xf); /* an activation outside a16_avx2.c's exact range: the portable C below */
    atomic_fetch_add(&a16_portable_calls, 1);
#endif
    uint32_t *xb = malloc(sizeof(uint32_t) * ((size_t)M * K / 2 + 1));
    if (!xb) return -1;
    a16_round_x(x, M, K, xb, bits == 8 && M > 4 ? A16_TT : 1); /* a16_tile4 reads rows: tiles of one token */
    a16_ctx c = {xb, w, scale, zero, out, M, N, K, bits, groups, group_size, NULL};
    pthread_mutex_lock(&call_mu);
    parallel(a16_task, &c, ((N + ROWS - 1) / ROWS + 1) / 2);
    pthread_mutex_unlock(&call_mu);
    free(xb);
    return 0;
}
