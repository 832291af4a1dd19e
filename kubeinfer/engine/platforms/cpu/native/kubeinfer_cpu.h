/* The native CPU library's interface: every exported ki_* function and the constants its callers share.
 * Every .c file includes it, so the compiler checks each definition against its declaration here; bindings.py
 * declares the same functions for ctypes (tests/engine/test_cpu_native_header.py checks the two agree).
 * Buffers are passed with their length in bytes after them; a product refuses dimensions that do not fit. */
#ifndef KUBEINFER_CPU_H
#define KUBEINFER_CPU_H

#include <stddef.h>
#include <stdint.h>

#define KI_EBOUNDS (-3) /* a product's dimensions do not fit its buffers: nothing read or written */

typedef struct ki_view ki_view;   /* decoder_layer.c: one attention window's step metadata */
typedef struct ki_layer ki_layer; /* decoder_layer.c: one decoder layer's weights and shapes */

/* kernels.c: the thread pool, the W8A8 product and per-token int8 quantization */
int ki_has_vnni(void);
int ki_level(void); /* the x86-64 level this library was built for: 4, 3, or 0 (portable) */
int ki_init(int threads, long spin_us);
int ki_w8a8(const int8_t *q, long q_bytes, const float *sx, long sx_bytes, int M, int K, const uint8_t *w,
            long w_bytes, const float *sw, long sw_bytes, int N, float *out, long out_bytes);
int ki_quantize_token_int8(const float *x, long x_bytes, int M, int K, int8_t *q, long q_bytes, float *scale,
                           long scale_bytes);

/* kernels_q8_0.c: llama.cpp's arithmetic for weight-only int8 / int4 */
void ki_quantize_q8_0(const float *x, int M, int K, int8_t *q, float *d, int32_t *s);
int ki_q8_0_linear(const float *x, long x_bytes, int M, int K, const uint8_t *w, long w_bytes, int bits,
                   const float *scale, long scale_bytes, const int32_t *offset, long offset_bytes, int groups,
                   int group_size, int N, float *out, long out_bytes);

/* a16_linear.c: the exact A16 product */
int ki_has_a16_bf16(void);
int ki_has_a16_vector(void);    /* the A16 product has a vector path in this build (AVX-512 BF16 or AVX2) */
long ki_a16_portable_calls(void); /* A16 calls that ran the portable C (activations out of the exact range) */
int ki_a16_linear(const float *x, long x_bytes, int M, int K, const uint8_t *w, long w_bytes, int bits,
                  const float *scale, long scale_bytes, const void *zero, long zero_bytes, int groups,
                  int group_size, int N, float *out, long out_bytes);

/* w4a8_linear.c: int4 weights times int8 activations */
int ki_w4a8(const int8_t *q, long q_bytes, const float *sx, long sx_bytes, int M, int K, const uint8_t *w,
            long w_bytes, const float *sw, long sw_bytes, int groups, int group_size, int N, float *out,
            long out_bytes);
int ki_w4a8_f32(const float *x, long x_bytes, int M, int K, const uint8_t *w, long w_bytes, const float *sw,
                long sw_bytes, int groups, int group_size, int N, float *out, long out_bytes);

/* f32_linear.c: float32 products of small batches */
int ki_f32_linear(const float *x, long x_bytes, int M, int K, const float *w, long w_bytes, int N, float *out,
                  long out_bytes, int threads);
int ki_f32_grouped_linear(const float *x, long x_bytes, int M, int K, const float *w, long w_bytes, int E, int N,
                          const int32_t *ends, long ends_bytes, float *out, long out_bytes, int threads);

/* attention.c: decode attention over the paged KV cache */
int ki_decode_attention(const char *q, long q_stride, int q_bf16, const char *k, const char *v, long kv_stride,
                        const int64_t *slots, char *k_cache, char *v_cache, int kind, const float *lut,
                        const int64_t *tables, long table_stride, const int64_t *lens, int B, int H, int Hkv, int D,
                        int block_size, int window, float scale, char *out);

/* decode_ops.c: a decode step's norms, activation and rotary */
int ki_rms_norm(const void *x, long sx_t, long sx_h, const void *res, void *sum, const void *w, void *out, int T,
                int H, int N, float eps, int bf16);
void ki_silu_mul(const float *gu, long stride, float *out, int T, int I);
int ki_rotary(float *x, long sx_t, long sx_h, const int64_t *pos, const float *cos, const float *sin,
              int max_positions, int T, int H, int D);

/* decoder_layer.c: whole decoder layers of a decode step */
void ki_round_to_cache(const float *src, int n, int type, char *dst);
size_t ki_decoder_scratch_floats(const ki_layer *L);
int ki_decoder_layers(const ki_layer *layers, int n, const ki_view *views, char *const *caches, int block_size,
                      int cache_type, const float *lut, const float *x, const float *res, const int64_t *pos, int T,
                      float *scratch, long scratch_bytes, float *x_out, float *res_out, long io_bytes);

#endif
