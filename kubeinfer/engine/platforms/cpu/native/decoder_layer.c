/* Whole Llama-family decoder layers of a decode step in one call (#included at the end of kernels.c;
 * cpu_decoder.py prepares the descriptors and calls it, native_decode.py decides when).
 *
 * Each layer is the per-module native path's calls, in its order and with its arguments, so the same bits:
 * ki_rms_norm (input norm, the residual add inside), ki_q8_0_linear (fused qkv) plus its bias, the optional
 * per-head q / k norms (Qwen3), ki_rotary, ki_decode_attention (the step's K/V written first), ki_q8_0_linear
 * (o_proj) plus bias, ki_rms_norm (post norm, the residual add), ki_q8_0_linear (gate_up) plus bias,
 * ki_silu_mul, ki_q8_0_linear (down) plus bias. A bias is added as torch's `out + bias` (one float add).
 * What saves time is only what is no longer between them: ~40 us of Python a layer at batch 1.
 * A cache in another type than float32 (bf16, fp8 e4m3 / e5m2): the step's K/V rows are rounded to it first, as
 * kv_cache_dtype.to_cache_dtype rounds them in the per-module path (kd_to_cache), so the cache gets the same bytes. */
#include "kubeinfer_cpu.h"

typedef struct {
    const uint8_t *w;
    const float *scale, *bias; /* bias: NULL for none */
    const void *offset;        /* int32 offsets (llama.cpp's arithmetic), or float zeros (a16: the exact A16 product) */
    int bits, groups, group_size, N, K, a16; /* a16: 0 llama.cpp's arithmetic, 1 the A16 product, 2 W4A8 (no offset) */
    long w_bytes, scale_bytes, bias_bytes, offset_bytes; /* the buffers' lengths (the products check against them) */
} ki_proj;

typedef struct ki_view {              /* the step's attention metadata for one window */
    const int64_t *slots, *tables, *lens;
    long table_stride;
    int window;                       /* <= 0: none */
} ki_view;

typedef struct ki_layer {
    ki_proj qkv, o, gate_up, down;
    const float *in_norm, *post_norm, *q_norm, *k_norm; /* q_norm, k_norm: NULL for none */
    const float *cos, *sin;           /* [max_positions, D / 2] */
    float in_eps, post_eps, q_eps, k_eps, scale;
    int H, Hkv, D, hidden, inter, max_positions, view;
} ki_layer;

/* One product as NativeIntMethod.apply (a16 1: A16Method.apply, 2: W4A8Method.apply): out [T, N] = x [T, K]
 * times the packed weight, then + bias. */
static int kd_project(const ki_proj *p, const float *x, int T, float *out) {
    int group_size = p->groups == 1 ? p->K : p->group_size;
    const long xb = 4L * T * p->K, ob = 4L * T * p->N; /* the layer's own scratch, sized from the same fields */
    int status = p->a16 == 2 ? ki_w4a8_f32(x, xb, T, p->K, p->w, p->w_bytes, p->scale, p->scale_bytes, p->groups,
                                           group_size, p->N, out, ob)
               : p->a16 ? ki_a16_linear(x, xb, T, p->K, p->w, p->w_bytes, p->bits, p->scale, p->scale_bytes, p->offset,
                                        p->offset_bytes, p->groups, group_size, p->N, out, ob)
                        : ki_q8_0_linear(x, xb, T, p->K, p->w, p->w_bytes, p->bits, p->scale, p->scale_bytes,
                                         p->offset, p->offset_bytes, p->groups, group_size, p->N, out, ob);
    if (status == 0 && p->bias)
        for (long t = 0; t < T; t++)
            for (int n = 0; n < p->N; n++) out[t * p->N + n] += p->bias[n];
    return status;
}

static inline size_t kd_round(size_t n) { return (n + 15) & ~(size_t)15; } /* 64-byte aligned regions */

/* One float in an 8-bit float of M mantissa bits and exponent bias B, as torch's cast after to_cache_dtype's clamp
 * to the type's largest finite value: round to nearest even, subnormals included; a NaN is 0x7F with its sign
 * (torch's, both types). Plain float and integer arithmetic: the same bits in both builds. */
static inline uint8_t kd_fp8(float x, int M, int B, float limit) {
    x = x > limit ? limit : x < -limit ? -limit : x; /* (a NaN compares false: kept) */
    union { float f; uint32_t u; } v = {.f = x};
    const uint8_t sign = (uint8_t)(v.u >> 24) & 0x80u;
    v.u &= 0x7FFFFFFFu;
    if (v.u > 0x7F800000u) return sign | 0x7Fu;
    if (v.u < (uint32_t)(128 - B) << 23) { /* below the smallest normal: in units of the smallest subnormal */
        union { float f; uint32_t u; } unit = {.u = (uint32_t)(127 + 23 - (B - 1 + M)) << 23};
        union { float f; uint32_t u; } sum = {.f = v.f + unit.f}; /* the float add rounds to nearest even */
        return sign | (uint8_t)(sum.u - unit.u);
    }
    const int shift = 23 - M;
    v.u += ((v.u >> shift) & 1u) + (1u << (shift - 1)) - 1u;
    return sign | (uint8_t)((v.u >> shift) - ((uint32_t)(127 - B) << M));
}

/* T rows of n floats (`stride` apart) in the cache's type (1 bf16, 2 fp8 e4m3, 3 fp8 e5m2), packed rows in dst. */
static void kd_to_cache(const float *src, long stride, int T, int n, int type, char *dst) {
    for (int t = 0; t < T; t++) {
        const float *row = src + (size_t)t * stride;
        if (type == 1) {
            uint16_t *out = (uint16_t *)dst + (size_t)t * n;
            for (int i = 0; i < n; i++) out[i] = f32_to_bf16(row[i]);
        } else {
            uint8_t *out = (uint8_t *)dst + (size_t)t * n;
            for (int i = 0; i < n; i++)
                out[i] = type == 2 ? kd_fp8(row[i], 3, 7, 448.0f) : kd_fp8(row[i], 2, 15, 57344.0f);
        }
    }
}

/* n floats in a cache type (1 bf16, 2 fp8 e4m3, 3 fp8 e5m2) as the layers round K/V: for tests against torch. */
void ki_round_to_cache(const float *src, int n, int type, char *dst) { kd_to_cache(src, n, 1, n, type, dst); }

/* Floats of scratch a layer needs per token (decoder_scratch in cpu_decoder.py sizes it as the max of these). */
size_t ki_decoder_scratch_floats(const ki_layer *L) {
    size_t qd = (size_t)L->H * L->D, kvd = (size_t)L->Hkv * L->D;
    return kd_round(L->hidden) + kd_round(L->qkv.N) + kd_round(qd) + 2 * kd_round(kvd) + kd_round(qd)
           + kd_round(L->hidden) + kd_round(L->gate_up.N) + kd_round(L->inter) + kd_round(kvd);
}

/* Whether a layer's projections are the shapes its dimensions say (their products check their own buffers), each
 * bias holds N floats, and its hidden size is the run's: the scratch and the [T, hidden] buffers are sized by them. */
static int kd_layer_fits(const ki_layer *L, int hidden) {
    const ki_proj *p[4] = {&L->qkv, &L->o, &L->gate_up, &L->down};
    const long k[4] = {L->hidden, (long)L->H * L->D, L->hidden, L->inter};
    const long n[4] = {(long)(L->H + 2 * L->Hkv) * L->D, L->hidden, 2L * L->inter, L->hidden};
    if (L->hidden != hidden || L->H < 1 || L->Hkv < 1 || L->D < 2 || L->inter < 1) return 0;
    for (int i = 0; i < 4; i++)
        if (p[i]->K != k[i] || p[i]->N != n[i] || (p[i]->bias && !ki_fits(p[i]->bias_bytes, p[i]->N, 1, 4))) return 0;
    return 1;
}

/* Layers [0, n) of a decode step of T tokens (one a sequence). x [T, hidden]: the first layer's input; res: the
 * residual before it (NULL at the model's first layer: the residual is x). Writes the last layer's output to
 * x_out and the residual to res_out (both [T, hidden], neither x nor res). caches: 2n pointers (each layer's K
 * then V cache, [blocks, block_size, Hkv, D] of cache_type: 0 float32, 1 bf16, 2 fp8 e4m3, 3 fp8 e5m2, as
 * ki_decode_attention's kinds; lut: the 8-bit types' byte values, as it takes them); views: the step's metadata
 * per window; scratch: T times the max of ki_decoder_scratch_floats, 64-byte aligned, scratch_bytes long; x, res,
 * x_out and res_out each io_bytes long. Returns 0; -1 out of memory; -2 a position outside the rotary tables
 * (nothing of that layer's attention done); KI_EBOUNDS, before anything is written, where a layer's dimensions do
 * not fit the buffers (or later, nothing written past a buffer, where a product's packed weights do not). */
int ki_decoder_layers(const ki_layer *layers, int n, const ki_view *views, char *const *caches, int block_size,
                      int cache_type, const float *lut, const float *x, const float *res, const int64_t *pos, int T,
                      float *scratch, long scratch_bytes, float *x_out, float *res_out, long io_bytes) {
    if (n < 1 || T < 0 || !ki_fits(io_bytes, T, layers[0].hidden, 4)) return KI_EBOUNDS;
    for (int l = 0; l < n; l++)
        if (!kd_layer_fits(&layers[l], layers[0].hidden)
            || !ki_fits(scratch_bytes, T, (long)ki_decoder_scratch_floats(&layers[l]), 4))
            return KI_EBOUNDS;
    for (int l = 0; l < n; l++) {
        const ki_layer *L = &layers[l];
        const int hidden = L->hidden, H = L->H, Hkv = L->Hkv, D = L->D, qkv_n = L->qkv.N;
        const size_t qd = (size_t)H * D, kvd = (size_t)Hkv * D;
        float *h = scratch, *qkv = h + T * kd_round(hidden), *qn = qkv + T * kd_round(qkv_n);
        float *kn = qn + T * kd_round(qd), *vn = kn + T * kd_round(kvd), *att = vn + T * kd_round(kvd);
        float *o = att + T * kd_round(qd), *gu = o + T * kd_round(hidden), *act = gu + T * kd_round(L->gate_up.N);
        char *kc = (char *)(act + T * kd_round(L->inter)); /* K then V rows in the cache's type (<= 2 bytes each) */
        const float *in = l ? x_out : x, *r = l ? res_out : res;
        if (r) {
            ki_rms_norm(in, hidden, hidden, r, res_out, L->in_norm, h, T, 1, hidden, L->in_eps, 0);
        } else {
            ki_rms_norm(in, hidden, hidden, NULL, NULL, L->in_norm, h, T, 1, hidden, L->in_eps, 0);
            memcpy(res_out, in, sizeof(float) * (size_t)T * hidden);
        }
        int status;
        if ((status = kd_project(&L->qkv, h, T, qkv))) return status;
        const float *q = qkv, *k = qkv + qd, *v = k + kvd;
        long q_stride = qkv_n, kv_stride = qkv_n;
        if (L->q_norm) { /* Attention.forward's Qwen3 path: normed q and k new tensors, v and k made alike */
            ki_rms_norm(qkv, qkv_n, D, NULL, NULL, L->q_norm, qn, T, H, D, L->q_eps, 0);
            ki_rms_norm(qkv + qd, qkv_n, D, NULL, NULL, L->k_norm, kn, T, Hkv, D, L->k_eps, 0);
            for (int t = 0; t < T; t++) memcpy(vn + t * kvd, v + (size_t)t * qkv_n, sizeof(float) * kvd);
            if (ki_rotary(qn, qd, D, pos, L->cos, L->sin, L->max_positions, T, H, D)
                || ki_rotary(kn, kvd, D, pos, L->cos, L->sin, L->max_positions, T, Hkv, D))
                return -2;
            q = qn, k = kn, v = vn, q_stride = qd, kv_stride = kvd;
        } else if (ki_rotary(qkv, qkv_n, D, pos, L->cos, L->sin, L->max_positions, T, H + Hkv, D)) {
            return -2; /* q and k side by side in each row: one pass over H + Hkv heads */
        }
        const ki_view *m = &views[L->view];
        const char *kw = (const char *)k, *vw = (const char *)v;
        if (cache_type) { /* cpu_attention.decode's to_cache_dtype: packed rows, Hkv * D elements apart */
            char *vc = kc + (size_t)T * kvd * (cache_type == 1 ? 2 : 1);
            kd_to_cache(k, kv_stride, T, (int)kvd, cache_type, kc);
            kd_to_cache(v, kv_stride, T, (int)kvd, cache_type, vc);
            kw = kc, vw = vc, kv_stride = (long)kvd;
        }
        if (ki_decode_attention((const char *)q, q_stride, 0, kw, vw, kv_stride, m->slots, caches[2 * l],
                                caches[2 * l + 1], cache_type, lut, m->tables, m->table_stride,
                                m->lens, T, H, Hkv, D, block_size, m->window, L->scale, (char *)att))
            return -1;
        if ((status = kd_project(&L->o, att, T, o))) return status;
        ki_rms_norm(o, hidden, hidden, res_out, res_out, L->post_norm, h, T, 1, hidden, L->post_eps, 0);
        if ((status = kd_project(&L->gate_up, h, T, gu))) return status;
        ki_silu_mul(gu, L->gate_up.N, act, T, L->inter);
        if ((status = kd_project(&L->down, act, T, x_out))) return status;
    }
    return 0;
}
