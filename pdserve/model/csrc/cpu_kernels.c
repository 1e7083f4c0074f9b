/* CPU kernels for the two memory-bound parts of decode, where PyTorch's CPU paths leave
 * most of the machine idle (see pdserve/model/native.py for how they are built and used):
 *
 *   pd_linear_small_m     y = x W^T (+ b) for a few rows of x (batch-1..8 decode): every
 *                         weight row is read once from memory, by all threads.
 *   pd_paged_decode_attn  one query token per sequence against its paged K/V, read in place
 *                         from the cache blocks (no gather copy), GQA heads sharing a K/V
 *                         read; optionally adds each block's attention probability to a
 *                         score row (token dropping).
 *
 * fp32, AVX2 + FMA, OpenMP (the same libgomp PyTorch loaded, so one thread pool). */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_hadd_ps(s, s);
    s = _mm_hadd_ps(s, s);
    return _mm_cvtss_f32(s);
}

/* y[m, n], y[m, n+1] for every row m: the two weight rows stay in L1 while x's rows pass. */
static void row_pair(const float *x, const float *w0, const float *w1, const float *bias,
                     float *y, int64_t M, int64_t N, int64_t K, int64_t n) {
    for (int64_t m0 = 0; m0 < M; m0 += 4) {
        int mm = M - m0 < 4 ? (int)(M - m0) : 4;
        const float *xm = x + m0 * K;
        __m256 a0[4], a1[4];
        for (int m = 0; m < 4; m++) a0[m] = a1[m] = _mm256_setzero_ps();
        int64_t k = 0;
        for (; k + 8 <= K; k += 8) {
            __m256 v0 = _mm256_loadu_ps(w0 + k), v1 = _mm256_loadu_ps(w1 + k);
            for (int m = 0; m < mm; m++) {
                __m256 xv = _mm256_loadu_ps(xm + m * K + k);
                a0[m] = _mm256_fmadd_ps(v0, xv, a0[m]);
                a1[m] = _mm256_fmadd_ps(v1, xv, a1[m]);
            }
        }
        for (int m = 0; m < mm; m++) {
            float s0 = hsum(a0[m]), s1 = hsum(a1[m]);
            for (int64_t j = k; j < K; j++) {
                s0 += w0[j] * xm[m * K + j];
                s1 += w1[j] * xm[m * K + j];
            }
            if (bias) {
                s0 += bias[n];
                s1 += bias[n + 1];
            }
            y[(m0 + m) * N + n] = s0;
            if (w1 != w0) y[(m0 + m) * N + n + 1] = s1;
        }
    }
}

void pd_linear_small_m(const float *x, const float *w, const float *bias, float *y,
                       int64_t M, int64_t N, int64_t K) {
    int64_t pairs = (N + 1) / 2;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < pairs; p++) {
        int64_t n = 2 * p;
        const float *w0 = w + n * K;
        const float *w1 = n + 1 < N ? w0 + K : w0; /* odd N: the last row alone */
        row_pair(x, w0, w1, bias, y, M, N, K, n);
    }
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

/* q [B, H, D]; cache [num_blocks, 2, KVH, BS, D] (0 = K, 1 = V); tables [B, max_blocks];
 * context_lens [B]; out [B, H, D]; scores [B, max_blocks] or NULL. Returns 0, or -1 when
 * scratch memory could not be allocated. */
int pd_paged_decode_attn(const float *q, const float *cache, const int64_t *tables,
                         const int64_t *context_lens, float *out, float *scores, int64_t B,
                         int64_t H, int64_t KVH, int64_t D, int64_t BS, int64_t max_blocks,
                         float scale) {
    int64_t G = H / KVH, max_len = max_blocks * BS;
    int failed = 0;
#pragma omp parallel
    {
        float *p = malloc(sizeof(float) * G * max_len);
        if (!p) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < B * KVH; item++) {
            if (!p) continue;
            int64_t b = item / KVH, h = item % KVH, len = context_lens[b];
            const int64_t *table = tables + b * max_blocks;
            const float *qb = q + (b * H + h * G) * D;
            /* scores: every key of the context against the G query heads of this KV head */
            for (int64_t t = 0; t < len; t++) {
                const float *k = cache + (((table[t / BS] * 2 + 0) * KVH + h) * BS + t % BS) * D;
                for (int64_t g = 0; g < G; g++) p[g * len + t] = dot(qb + g * D, k, D) * scale;
            }
            for (int64_t g = 0; g < G; g++) {
                float *pg = p + g * len, mx = -INFINITY, sum = 0.f;
                for (int64_t t = 0; t < len; t++) mx = pg[t] > mx ? pg[t] : mx;
                for (int64_t t = 0; t < len; t++) sum += (pg[t] = expf(pg[t] - mx));
                float inv = 1.f / sum;
                for (int64_t t = 0; t < len; t++) pg[t] *= inv;
                if (scores) {
                    for (int64_t j = 0; j * BS < len; j++) {
                        float s = 0.f;
                        for (int64_t t = j * BS; t < len && t < (j + 1) * BS; t++) s += pg[t];
#pragma omp atomic
                        scores[b * max_blocks + j] += s;
                    }
                }
            }
            /* values: each V row is read once and added to the G outputs that share it */
            float *o = out + (b * H + h * G) * D;
            for (int64_t i = 0; i < G * D; i++) o[i] = 0.f;
            for (int64_t t = 0; t < len; t++) {
                const float *v = cache + (((table[t / BS] * 2 + 1) * KVH + h) * BS + t % BS) * D;
                for (int64_t g = 0; g < G; g++) axpy(o + g * D, p[g * len + t], v, D);
            }
        }
        free(p);
    }
    return failed ? -1 : 0;
}
