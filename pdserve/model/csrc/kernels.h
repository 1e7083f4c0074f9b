/* The native CPU kernels: plain C (AVX2 + FMA, OpenMP), built into one shared library on
 * first use and loaded with ctypes by pdserve/model/native.py. They cover what PyTorch's CPU
 * paths do slowly at decode time, where each step is small and memory-bound:
 *
 *   gemm.c           pd_linear_panels: y = x W^T (+ b) for decode-sized batches (1..64
 *                    rows) on weights packed in 24-column panels, fp32 or a lossless compact
 *                    format (the 4-/8-bit grids of GGUF weights).
 *   attention.c      pd_paged_decode_attn: one query token per sequence against its paged
 *                    K/V, read in place from the cache blocks, GQA heads sharing each read;
 *                    optionally each block's attention probability (token dropping).
 *   elementwise.c    pd_rmsnorm, pd_add_rmsnorm, pd_rope_qkv_store, pd_silu_mul: the rest
 *                    of a decoder layer, one call each where PyTorch dispatches 5-10 small
 *                    ops; pd_argmax_rows for greedy sampling.
 *   decode_layers.c  pd_decode_layers: every decoder layer of a decode-only step in one call.
 *
 * fp32 throughout; OpenMP is the libgomp PyTorch loaded, so one thread pool. This header
 * holds the SIMD helpers the files share and the kernels they call in one another. */
#ifndef PDSERVE_KERNELS_H
#define PDSERVE_KERNELS_H

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_hadd_ps(s, s);
    s = _mm_hadd_ps(s, s);
    return _mm_cvtss_f32(s);
}

/* e^x for 8 floats: x = n ln2 + r with |r| <= ln2/2, e^r by a degree-6 polynomial (the
 * classic Cephes expf coefficients), 2^n built in the exponent bits. Relative error ~2e-7,
 * like libm's expf, at a fraction of the cost of eight scalar calls. */
static inline __m256 exp256(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

static inline float dot(const float *a, const float *b, int64_t d) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= d; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    float s = hsum(acc);
    for (; i < d; i++) s += a[i] * b[i];
    return s;
}

static inline void axpy(float *y, float a, const float *x, int64_t d) {
    __m256 av = _mm256_set1_ps(a);
    int64_t i = 0;
    for (; i + 8 <= d; i += 8)
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(av, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    for (; i < d; i++) y[i] += a * x[i];
}

/* Threads only for work that repays waking them (a decode batch of 32, not of 1). */
#define PAR_IF(work) if ((work) > (1 << 14))

int pd_linear_panels(const float *x, const void *wp, int64_t codec, const float *bias, float *y,
                     int64_t M, int64_t N, int64_t K);
int pd_paged_decode_attn(const float *q, int64_t q_stride, const float *cache,
                         const int64_t *tables, const int64_t *context_lens, float *out,
                         float *scores, int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t BS,
                         int64_t max_blocks, float scale);
void pd_rmsnorm(const float *x, const float *w, float *y, int64_t M, int64_t D, float eps);
void pd_add_rmsnorm(float *x, const float *add, const float *w, float *y, int64_t M, int64_t D,
                    float eps);
void pd_rope_qkv_store(float *qkv, const float *cos, const float *sin, float *cache,
                       const int64_t *slot_blocks, const int64_t *slot_offsets, int64_t T,
                       int64_t H, int64_t KVH, int64_t D, int64_t BS);
void pd_silu_mul(const float *gate_up, float *y, int64_t M, int64_t I);

#endif
