/* The elementwise rest of a decoder layer, and greedy sampling (see kernels.h). */
#include "kernels.h"

static void rmsnorm_row(const float *x, const float *w, float *y, int64_t D, float eps) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= D; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        acc = _mm256_fmadd_ps(v, v, acc);
    }
    float ss = hsum(acc);
    for (; i < D; i++) ss += x[i] * x[i];
    float inv = 1.f / sqrtf(ss / (float)D + eps);
    for (i = 0; i < D; i++) y[i] = w[i] * (x[i] * inv);
}

/* y = w * x / rms(x), row by row: x, y [M, D]. */
void pd_rmsnorm(const float *x, const float *w, float *y, int64_t M, int64_t D, float eps) {
#pragma omp parallel for PAR_IF(M * D)
    for (int64_t m = 0; m < M; m++) rmsnorm_row(x + m * D, w, y + m * D, D, eps);
}

/* The residual stream: x += add, then y = rmsnorm(x). */
void pd_add_rmsnorm(float *x, const float *add, const float *w, float *y, int64_t M, int64_t D,
                    float eps) {
#pragma omp parallel for PAR_IF(M * D)
    for (int64_t m = 0; m < M; m++) {
        float *xm = x + m * D;
        const float *am = add + m * D;
        for (int64_t i = 0; i < D; i++) xm[i] += am[i];
        rmsnorm_row(xm, w, y + m * D, D, eps);
    }
}

static inline void rope_row(float *x, const float *c, const float *s, int64_t D) {
    int64_t half = D / 2;
    for (int64_t i = 0; i < half; i++) {
        float a = x[i], b = x[i + half];
        x[i] = a * c[i] - b * s[i];
        x[i + half] = b * c[i + half] + a * s[i + half];
    }
}

/* qkv [T, (H + 2 KVH) D] as the fused projection left it: rotate q and k in place (rotate-
 * half RoPE; cos, sin [T, D] are each token's rows), then store k and v at each token's
 * cache slot (cache [num_blocks, 2, KVH, BS, D]). */
void pd_rope_qkv_store(float *qkv, const float *cos, const float *sin, float *cache,
                       const int64_t *slot_blocks,
                       const int64_t *slot_offsets, int64_t T, int64_t H, int64_t KVH, int64_t D,
                       int64_t BS) {
    int64_t row = (H + 2 * KVH) * D;
#pragma omp parallel for PAR_IF(T * row)
    for (int64_t t = 0; t < T; t++) {
        float *r = qkv + t * row;
        const float *c = cos + t * D, *s = sin + t * D;
        for (int64_t h = 0; h < H + KVH; h++) rope_row(r + h * D, c, s, D);
        const float *k = r + H * D, *v = k + KVH * D;
        for (int64_t h = 0; h < KVH; h++) {
            float *kd = cache + (((slot_blocks[t] * 2 + 0) * KVH + h) * BS + slot_offsets[t]) * D;
            float *vd = cache + (((slot_blocks[t] * 2 + 1) * KVH + h) * BS + slot_offsets[t]) * D;
            for (int64_t i = 0; i < D; i++) {
                kd[i] = k[h * D + i];
                vd[i] = v[h * D + i];
            }
        }
    }
}

/* gate_up [M, 2I] (gate | up) -> y [M, I] = silu(gate) * up. */
void pd_silu_mul(const float *gate_up, float *y, int64_t M, int64_t I) {
#pragma omp parallel for PAR_IF(M * I * 8)
    for (int64_t m = 0; m < M; m++) {
        const float *g = gate_up + m * 2 * I, *u = g + I;
        float *ym = y + m * I;
        int64_t i = 0;
        for (; i + 8 <= I; i += 8) {
            __m256 gv = _mm256_loadu_ps(g + i);
            __m256 den = _mm256_add_ps(_mm256_set1_ps(1.f), exp256(_mm256_sub_ps(_mm256_setzero_ps(), gv)));
            _mm256_storeu_ps(ym + i, _mm256_mul_ps(_mm256_div_ps(gv, den), _mm256_loadu_ps(u + i)));
        }
        for (; i < I; i++) ym[i] = g[i] / (1.f + expf(-g[i])) * u[i];
    }
}

/* ---- greedy sampling ------------------------------------------------------------------
 * out[m] = argmax of row m of x [M, N], with torch.argmax's answer on every input: the first
 * maximal index, and a NaN counts as larger than everything (the first NaN wins). torch's
 * CPU argmax reads [32, 49152] logits on one thread at ~3 GB/s, 1.5% of a decode step. */
static int64_t argmax_row(const float *x, int64_t N) {
    __m256 mx = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= N; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        mx = _mm256_max_ps(mx, v);
    }
    float m = -INFINITY, lanes[8];
    _mm256_storeu_ps(lanes, mx);
    for (int j = 0; j < 8; j++) m = lanes[j] > m ? lanes[j] : m;
    int has_nan = _mm256_movemask_ps(nan) != 0;
    for (int64_t j = i; j < N; j++) {
        has_nan |= x[j] != x[j];
        m = x[j] > m ? x[j] : m;
    }
    int64_t j = 0;
    if (has_nan) {
        while (x[j] == x[j]) j++;
        return j;
    }
    for (__m256 mv = _mm256_set1_ps(m); j + 8 <= N; j += 8) {
        int hits = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + j), mv, _CMP_EQ_OQ));
        if (hits) return j + __builtin_ctz(hits);
    }
    for (; j < N; j++)
        if (x[j] == m) return j;
    return 0; /* N == 0 */
}

void pd_argmax_rows(const float *x, int64_t M, int64_t N, int64_t *out) {
#pragma omp parallel for PAR_IF(M * N)
    for (int64_t m = 0; m < M; m++) out[m] = argmax_row(x + m * N, N);
}
