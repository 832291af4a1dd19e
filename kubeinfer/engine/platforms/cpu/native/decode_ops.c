/* The small ops of a decode step, float32 (the norm bf16 too) (included by kernels.c): RMSNorm with its residual add, the gated
 * activation silu(gate) * up, and rotary embeddings in place. One pass over each row instead of torch's 3-8
 * kernels; a batch-1 step makes ~100 of these calls, so each runs on the calling thread alone unless the call
 * is large enough (prefill) for the pool's hand-off to pay.
 *
 * Plain C that -O3 -march=native vectorizes (no intrinsics, so no portable twin is needed); -ffp-contract=off:
 * every product and sum is rounded as torch rounds it.
 * - RMSNorm (float32, or bf16 as torch rounds it): s = x + r (one float add: torch's bits),
 *   y = w * (s * (1 / sqrtf(mean(s * s) + eps))). The sum of
 *   squares is summed in 16 lanes then a tree (torch sums in another order), and torch's rsqrt is its own
 *   vectorized 1 / sqrt: y within a few float32 ulps of torch's (tests/engine/test_cpu_fused_ops.py states the bound).
 * - silu(g) * u = (g / (1 + exp(-g))) * u, torch's formula, with exp below (within 2 ulps of expf; torch's
 *   Sleef exp is within 1): a few ulps of torch.
 * - rotary: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) in float32: the products and sums of
 *   RotaryEmbedding.rotate, so torch's bits. */
#include "kubeinfer_cpu.h"

#define KI_PAR_ELEMS 65536 /* below this many elements a call runs on the calling thread alone */

/* Runs fn over [0, items) on the pool when `elems` pays for the hand-off, else on this thread. */
static void ki_run(task_fn fn, const void *ctx, int items, long elems) {
    if (elems < KI_PAR_ELEMS || pool_active == 1) {
        fn(ctx, 0, items);
        return;
    }
    pthread_mutex_lock(&call_mu);
    parallel(fn, ctx, items);
    pthread_mutex_unlock(&call_mu);
}

/* ------------------------------------------------------------------ RMSNorm
 * float32: y = (s * inv) * w. bf16 (x, residual, weight and y): s = bf16(x + r), y = bf16(w * bf16(s * inv)),
 * each product in float32 and rounded to nearest even, as torch's bf16 ops and RMSNorm._norm do. */
#define KI_NORM_MAX 16384 /* bf16 rows are widened into a stack buffer of this many floats */

typedef struct {
    const void *x, *res, *w;
    void *sum, *out;
    long sx_t, sx_h; /* x's token and head strides, in elements (its last one is 1) */
    int H, N, bf16;
    float eps;
} norm_ctx;

/* 1 / sqrt(mean(v^2) + eps): the squares summed in 16 lanes, then a tree. */
static inline float inv_rms(const float *v, int N, float eps) {
    float acc[16] = {0};
    int i = 0;
    for (; i + 16 <= N; i += 16)
        for (int j = 0; j < 16; j++) acc[j] += v[i + j] * v[i + j];
    for (int j = 0; i < N; i++, j++) acc[j] += v[i] * v[i];
    for (int w = 8; w; w /= 2)
        for (int j = 0; j < w; j++) acc[j] += acc[j + w];
    return 1.0f / sqrtf(acc[0] / (float)N + eps);
}

static void norm_f32_task(const void *ctx, int start, int end) {
    const norm_ctx *c = ctx;
    const int N = c->N;
    const float *w = c->w;
    for (int row = start; row < end; row++) {
        const float *x = (const float *)c->x + (long)(row / c->H) * c->sx_t + (long)(row % c->H) * c->sx_h;
        float *y = (float *)c->out + (long)row * N;
        if (c->res) { /* s = x + r into `sum`, then normalised from there */
            const float *r = (const float *)c->res + (long)row * N;
            float *s = (float *)c->sum + (long)row * N;
            for (int i = 0; i < N; i++) s[i] = x[i] + r[i];
            x = s;
        }
        float inv = inv_rms(x, N, c->eps);
        for (int i = 0; i < N; i++) y[i] = (x[i] * inv) * w[i];
    }
}

static void norm_bf16_task(const void *ctx, int start, int end) {
    const norm_ctx *c = ctx;
    const int N = c->N;
    const uint16_t *w = c->w;
    float v[KI_NORM_MAX];
    for (int row = start; row < end; row++) {
        const uint16_t *x = (const uint16_t *)c->x + (long)(row / c->H) * c->sx_t + (long)(row % c->H) * c->sx_h;
        uint16_t *y = (uint16_t *)c->out + (long)row * N;
        if (c->res) {
            const uint16_t *r = (const uint16_t *)c->res + (long)row * N;
            uint16_t *s = (uint16_t *)c->sum + (long)row * N;
            for (int i = 0; i < N; i++) s[i] = f32_to_bf16(bf16_to_f32(x[i]) + bf16_to_f32(r[i]));
            x = s;
        }
        for (int i = 0; i < N; i++) v[i] = bf16_to_f32(x[i]);
        float inv = inv_rms(v, N, c->eps);
        for (int i = 0; i < N; i++) y[i] = f32_to_bf16(bf16_to_f32(w[i]) * bf16_to_f32(f32_to_bf16(v[i] * inv)));
    }
}

/* x [T, H, N] (strides sx_t, sx_h, 1), w [N]; res, sum (may be NULL together) and out contiguous [T, H, N]; all
 * float32, or all bf16 (`bf16`, N <= KI_NORM_MAX). Returns -1 (nothing written) for a bf16 row too long. */
int ki_rms_norm(const void *x, long sx_t, long sx_h, const void *res, void *sum, const void *w, void *out,
                int T, int H, int N, float eps, int bf16) {
    if (bf16 && N > KI_NORM_MAX) return -1;
    norm_ctx c = {x, res, w, sum, out, sx_t, sx_h, H, N, bf16, eps};
    ki_run(bf16 ? norm_bf16_task : norm_f32_task, &c, T * H, (long)T * H * N);
    return 0;
}

/* ------------------------------------------------------------------ silu(gate) * up */
typedef struct {
    const float *gu; /* [T, stride]: gate in columns [0, I), up in [I, 2I) */
    float *out;      /* [T, I] */
    long stride;
    int I;
} act_ctx;

static void silu_mul_task(const void *ctx, int start, int end) {
    const act_ctx *c = ctx;
    const int I = c->I;
    for (int t = start; t < end; t++) {
        const float *g = c->gu + (long)t * c->stride, *u = g + I;
        float *y = c->out + (long)t * I;
        for (int i = 0; i < I; i++) y[i] = (g[i] / (1.0f + ki_expf(-g[i]))) * u[i];
    }
}

void ki_silu_mul(const float *gu, long stride, float *out, int T, int I) {
    act_ctx c = {gu, out, stride, I};
    ki_run(silu_mul_task, &c, T, (long)T * I * 8); /* exp: ~8x a plain op's work */
}

/* ------------------------------------------------------------------ rotary, in place */
typedef struct {
    float *x;
    const int64_t *pos;
    const float *cos, *sin; /* [max_positions, D / 2] */
    long sx_t, sx_h;
    int H, D;
} rope_ctx;

static void rope_task(const void *ctx, int start, int end) {
    const rope_ctx *c = ctx;
    const int half = c->D / 2;
    for (int t = start; t < end; t++) {
        const float *cs = c->cos + c->pos[t] * half, *sn = c->sin + c->pos[t] * half;
        for (int h = 0; h < c->H; h++) {
            float *x1 = c->x + (long)t * c->sx_t + (long)h * c->sx_h, *x2 = x1 + half;
            for (int i = 0; i < half; i++) {
                float a = x1[i], b = x2[i];
                x1[i] = a * cs[i] - b * sn[i];
                x2[i] = b * cs[i] + a * sn[i];
            }
        }
    }
}

/* x [T, H, D] (strides sx_t, sx_h, 1) rotated in place at positions pos [T]; -1 (nothing written) when a
 * position is outside [0, max_positions). */
int ki_rotary(float *x, long sx_t, long sx_h, const int64_t *pos, const float *cos, const float *sin,
              int max_positions, int T, int H, int D) {
    for (int t = 0; t < T; t++)
        if (pos[t] < 0 || pos[t] >= max_positions) return -1;
    rope_ctx c = {x, pos, cos, sin, sx_t, sx_h, H, D};
    ki_run(rope_task, &c, T, (long)T * H * D);
    return 0;
}
