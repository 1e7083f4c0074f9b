/* The elementwise rest of a decoder layer, and greedy sampling (see kernels.h). */
#include "kernels.h"

static void rmsnorm_row(const float *x, const float *w, float *y, int64_t D, float eps) {
    float inv = 1.f / sqrtf(dot(x, x, D) / (float)D + eps);
    for (int64_t i = 0; i < D; i++) y[i] = w[i] * (x[i] * inv);
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

/* Qwen3's per-head norms: each q head of qkv [T, (H + 2 KVH) D] RMS-normalized over its D
 * values with q_w, each k head with k_w, in place (before RoPE). */
void pd_qk_norm(float *qkv, const float *q_w, const float *k_w, int64_t T, int64_t H,
                int64_t KVH, int64_t D, float eps) {
    int64_t row = (H + 2 * KVH) * D;
#pragma omp parallel for PAR_IF(T * row)
    for (int64_t t = 0; t < T; t++) {
        float *r = qkv + t * row;
        for (int64_t h = 0; h < H + KVH; h++)
            rmsnorm_row(r + h * D, h < H ? q_w : k_w, r + h * D, D, eps);
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
        for (; i + VW <= I; i += VW) {
            vf gv = vload(g + i);
            vf den = vadd(vset1(1.f), vexp(vsub(vzero(), gv)));
            vstore(ym + i, vmul(vdiv(gv, den), vload(u + i)));
        }
        for (; i < I; i++) ym[i] = g[i] / (1.f + expf(-g[i])) * u[i];
    }
}

/* ---- greedy sampling ------------------------------------------------------------------
 * out[m] = argmax of row m of x [M, N], with torch.argmax's answer on every input: the first
 * maximal index, and a NaN counts as larger than everything (the first NaN wins). torch's
 * CPU argmax reads [32, 49152] logits on one thread at ~3 GB/s, 1.5% of a decode step. */
static int64_t argmax_row(const float *x, int64_t N) {
    vf mx = vset1(-INFINITY);
    int has_nan = 0;
    int64_t i = 0;
    for (; i + VW <= N; i += VW) {
        vf v = vload(x + i);
        has_nan |= vcmp_bits(v, v, _CMP_UNORD_Q);
        mx = vmax(mx, v);
    }
    float m = -INFINITY, lanes[VW];
    vstore(lanes, mx);
    for (int j = 0; j < VW; j++) m = lanes[j] > m ? lanes[j] : m;
    for (int64_t j = i; j < N; j++) {
        has_nan |= x[j] != x[j];
        m = x[j] > m ? x[j] : m;
    }
    int64_t j = 0;
    if (has_nan) {
        while (x[j] == x[j]) j++;
        return j;
    }
    for (vf mv = vset1(m); j + VW <= N; j += VW) {
        int hits = vcmp_bits(vload(x + j), mv, _CMP_EQ_OQ);
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
