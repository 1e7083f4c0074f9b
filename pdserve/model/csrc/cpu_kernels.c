/* CPU kernels for the two memory-bound parts of decode, where PyTorch's CPU paths leave
 * most of the machine idle (see pdserve/model/native.py for how they are built and used):
 *
 *   pd_linear_panels      y = x W^T (+ b) for decode-sized batches (1..64 rows) on weights
 *                         packed in 24-column panels, fp32 or a lossless compact format
 *                         (4-/8-bit grids of GGUF weights): all threads stream them once.
 *   pd_paged_decode_attn  one query token per sequence against its paged K/V, read in place
 *                         from the cache blocks (no gather copy), GQA heads sharing a K/V
 *                         read; optionally adds each block's attention probability to a
 *                         score row (token dropping).
 *   pd_rmsnorm, pd_add_rmsnorm, pd_rope_qkv_store, pd_silu_mul
 *                         the elementwise rest of a decoder layer, one call each where
 *                         PyTorch dispatches 5-10 small ops (at batch 1 the dispatch, not
 *                         the arithmetic, is the cost).
 *
 * fp32, AVX2 + FMA, OpenMP (the same libgomp PyTorch loaded, so one thread pool). */
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

/* Eight dot products at once: acc[i] holds key i's partial sums; one transposing reduction
 * gives the eight scores (instead of eight horizontal sums). */
static inline __m256 reduce8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5,
                             __m256 a6, __m256 a7) {
    __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
    return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}

/* s[i] = scale * q . k_i for the n keys of one [BS, D] tile. */
static void tile_scores(const float *q, const float *k, int64_t n, int64_t D, float scale,
                        float *s) {
    int64_t i = 0;
    if (D % 8 == 0) {
        for (; i + 8 <= n; i += 8) {
            const float *r = k + i * D;
            __m256 a[8];
            for (int j = 0; j < 8; j++) a[j] = _mm256_setzero_ps();
            for (int64_t d = 0; d < D; d += 8) {
                __m256 qv = _mm256_loadu_ps(q + d);
                for (int j = 0; j < 8; j++)
                    a[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(r + j * D + d), a[j]);
            }
            __m256 sum = reduce8(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]);
            _mm256_storeu_ps(s + i, _mm256_mul_ps(sum, _mm256_set1_ps(scale)));
        }
    }
    for (; i < n; i++) s[i] = dot(q, k + i * D, D) * scale;
}

#ifndef PF_AHEAD
#define PF_AHEAD 3
#endif
/* Ask for the `floats` floats at t (part of a K or V tile) to be brought into cache. */
static inline void prefetch_range(const float *t, int64_t floats) {
    for (int64_t i = 0; i < floats; i += 16) _mm_prefetch((const char *)(t + i), _MM_HINT_T0);
}

/* In place: p[0..len) -> softmax(p). */
static void softmax(float *p, int64_t len) {
    float mx = -INFINITY, sum = 0.f;
    for (int64_t t = 0; t < len; t++) mx = p[t] > mx ? p[t] : mx;
    __m256 m8 = _mm256_set1_ps(mx), s8 = _mm256_setzero_ps();
    int64_t t = 0;
    for (; t + 8 <= len; t += 8) {
        __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(p + t), m8));
        _mm256_storeu_ps(p + t, e);
        s8 = _mm256_add_ps(s8, e);
    }
    sum = hsum(s8);
    for (; t < len; t++) sum += (p[t] = expf(p[t] - mx));
    __m256 inv8 = _mm256_set1_ps(1.f / sum);
    for (t = 0; t + 8 <= len; t += 8) _mm256_storeu_ps(p + t, _mm256_mul_ps(_mm256_loadu_ps(p + t), inv8));
    for (; t < len; t++) p[t] *= 1.f / sum;
}

/* o_g[0..D) += sum_t p_g[t] v_t over the n rows of one V tile, for gg (<= 3) query heads
 * sharing its KV head: p_g = p + g * p_stride, o_g = o + g * D. Per 32 output columns the
 * gg heads' sums sit in 12 registers while the tile's rows stream past, each row loaded once
 * for all gg heads. `ahead`, if set, is a tile to prefetch, a row per row read. */
static inline __attribute__((always_inline)) void
tile_values_32(const float *p, int64_t p_stride, const float *v, int64_t n, int64_t D, float *o,
               const int gg, const float *ahead) {
    for (int64_t d0 = 0; d0 < D; d0 += 32) {
        __m256 a[3][4];
        for (int g = 0; g < 3; g++)
            for (int c = 0; c < 4; c++)
                a[g][c] = g < gg ? _mm256_loadu_ps(o + g * D + d0 + 8 * c) : _mm256_setzero_ps();
        for (int64_t t = 0; t < n; t++) {
            const float *r = v + t * D + d0;
            if (ahead && d0 == 0) prefetch_range(ahead + t * D, D);
            __m256 r0 = _mm256_loadu_ps(r), r1 = _mm256_loadu_ps(r + 8);
            __m256 r2 = _mm256_loadu_ps(r + 16), r3 = _mm256_loadu_ps(r + 24);
            for (int g = 0; g < gg; g++) {
                __m256 w = _mm256_set1_ps(p[g * p_stride + t]);
                a[g][0] = _mm256_fmadd_ps(w, r0, a[g][0]);
                a[g][1] = _mm256_fmadd_ps(w, r1, a[g][1]);
                a[g][2] = _mm256_fmadd_ps(w, r2, a[g][2]);
                a[g][3] = _mm256_fmadd_ps(w, r3, a[g][3]);
            }
        }
        for (int g = 0; g < gg; g++)
            for (int c = 0; c < 4; c++) _mm256_storeu_ps(o + g * D + d0 + 8 * c, a[g][c]);
    }
}

/* The G query heads of one KV head over one V tile: o [G, D] += p [G, (stride)] . v. */
static void tile_values(const float *p, int64_t p_stride, const float *v, int64_t n, int64_t D,
                        int64_t G, float *o, const float *ahead) {
    if (D % 32 == 0) {
        for (int64_t g = 0; g < G; g += 3, ahead = NULL) {
            const float *pg = p + g * p_stride;
            switch (G - g < 3 ? G - g : 3) {
            case 1: tile_values_32(pg, p_stride, v, n, D, o + g * D, 1, ahead); break;
            case 2: tile_values_32(pg, p_stride, v, n, D, o + g * D, 2, ahead); break;
            default: tile_values_32(pg, p_stride, v, n, D, o + g * D, 3, ahead); break;
            }
        }
        return;
    }
    for (int64_t t = 0; t < n; t++)
        for (int64_t g = 0; g < G; g++) axpy(o + g * D, p[g * p_stride + t], v + t * D, D);
}

/* q [B, H, D] with rows q_stride floats apart; cache [num_blocks, 2, KVH, BS, D] (0 = K,
 * 1 = V); tables [B, max_blocks]; context_lens [B]; out [B, H, D]; scores [B, max_blocks]
 * or NULL. Returns 0, or -1 when scratch memory could not be allocated.
 *
 * Memory order is what this kernel is about: a step reads every context's K and V, which
 * sit in scattered blocks. A work item is a whole sequence when there are enough of them
 * to keep every thread busy (else a (sequence, KV head) pair), and it walks its blocks in
 * order, reading each block's K (then V) for all its KV heads as one contiguous run
 * (12 KB for SmolLM2) rather than a 4 KB tile per head — measured ~1.5x faster to stream
 * from DRAM — and asking for the block PF_AHEAD on while it computes, since no hardware
 * prefetcher can guess where the next block is. The G query heads of a KV head share each
 * K/V tile read. Two passes: scores for all of the item's heads, softmax, then the values,
 * accumulated block by block. */
int pd_paged_decode_attn(const float *q, int64_t q_stride, const float *cache,
                         const int64_t *tables, const int64_t *context_lens, float *out,
                         float *scores, int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t BS,
                         int64_t max_blocks, float scale) {
    int64_t G = H / KVH, max_len = max_blocks * BS, tile = BS * D;
    int64_t nh = B >= 4 * omp_get_max_threads() ? KVH : 1; /* KV heads per work item */
    int failed = 0;
#pragma omp parallel
    {
        float *p = malloc(sizeof(float) * nh * G * max_len);
        if (!p) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < B * (KVH / nh); item++) {
            if (!p) continue;
            int64_t b = item / (KVH / nh), h0 = item % (KVH / nh) * nh, len = context_lens[b];
            int64_t nblk = (len + BS - 1) / BS, span = nh * tile, rows = nh * G;
            const int64_t *table = tables + b * max_blocks;
            const float *qb = q + b * q_stride + h0 * G * D;
            float *ob = out + (b * H + h0 * G) * D;
#define KV_RUN(j, kind) (cache + ((table[j] * 2 + (kind)) * KVH + h0) * tile)
            /* scores; the K runs PF_AHEAD on are requested a part per head (past the last K
             * run, the first V runs) */
            for (int64_t a = 1; a < PF_AHEAD && a < nblk; a++) prefetch_range(KV_RUN(a, 0), span);
            int64_t part = (span / rows + 15) / 16 * 16;
            for (int64_t j = 0; j < nblk; j++) {
                int64_t n = len - j * BS < BS ? len - j * BS : BS, a = j + PF_AHEAD;
                const float *ahead = a < nblk ? KV_RUN(a, 0) : a < 2 * nblk ? KV_RUN(a - nblk, 1) : NULL;
                for (int64_t r = 0; r < rows; r++) {
                    if (ahead && r * part < span)
                        prefetch_range(ahead + r * part, r * part + part < span ? part : span - r * part);
                    tile_scores(qb + r * D, KV_RUN(j, 0) + r / G * tile, n, D, scale,
                                p + r * max_len + j * BS);
                }
            }
            for (int64_t r = 0; r < rows; r++) {
                float *pr = p + r * max_len;
                softmax(pr, len);
                if (scores) {
                    for (int64_t j = 0; j < nblk; j++) {
                        float s = 0.f;
                        for (int64_t t = j * BS; t < len && t < (j + 1) * BS; t++) s += pr[t];
#pragma omp atomic
                        scores[b * max_blocks + j] += s;
                    }
                }
            }
            /* values, block by block into ob */
            for (int64_t i = 0; i < rows * D; i++) ob[i] = 0.f;
            for (int64_t j = 0; j < nblk; j++) {
                int64_t n = len - j * BS < BS ? len - j * BS : BS;
                const float *ahead = j + PF_AHEAD < nblk ? KV_RUN(j + PF_AHEAD, 1) : NULL;
                for (int64_t hh = 0; hh < nh; hh++)
                    tile_values(p + hh * G * max_len + j * BS, max_len, KV_RUN(j, 1) + hh * tile,
                                n, D, G, ob + hh * G * D, ahead ? ahead + hh * tile : NULL);
            }
#undef KV_RUN
        }
        free(p);
    }
    return failed ? -1 : 0;
}

/* Threads only for work that repays waking them (a decode batch of 32, not of 1). */
#define PAR_IF(work) if ((work) > (1 << 14))

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

/* ---- small-M GEMM on panel-packed weights --------------------------------------------
 * W [N, K] is packed once into panels of 24 output columns, [ceil(N/24)][K][24] (zero-
 * padded), so that for every k one panel row is three vectors. A micro-kernel keeps a block
 * of up to 4 rows of x times 24 columns in 12 accumulators and, per k, loads the three
 * weight vectors once and broadcasts each x value: 12 FMAs per 3 loads + 4 broadcasts, and
 * a 32-row decode batch is 8 whole blocks (a 6x16 kernel measured the same, wasting 4 rows).
 * At M = 1 the same loop streams the weights at memory speed (no horizontal sums). */
#define PANEL 24
#define MR 4

static inline void store_row(float *y, __m256 v0, __m256 v1, __m256 v2, const float *bias,
                             int64_t ncols) {
    float out[PANEL] __attribute__((aligned(32)));
    _mm256_store_ps(out, v0);
    _mm256_store_ps(out + 8, v1);
    _mm256_store_ps(out + 16, v2);
    for (int64_t j = 0; j < ncols; j++) y[j] = out[j] + (bias ? bias[j] : 0.f);
}

/* Named accumulators (an array of them gets spilled to the stack by gcc); `mr` is a
 * constant at every call, so the rows past it compile away. */
#define ACC(i) __m256 c##i##0 = _mm256_setzero_ps(), c##i##1 = c##i##0, c##i##2 = c##i##0
#define FMA_ROW(i)                                                                           \
    if (mr > i) {                                                                            \
        __m256 xb = _mm256_broadcast_ss(x + i * K + k);                                      \
        c##i##0 = _mm256_fmadd_ps(w0, xb, c##i##0);                                          \
        c##i##1 = _mm256_fmadd_ps(w1, xb, c##i##1);                                          \
        c##i##2 = _mm256_fmadd_ps(w2, xb, c##i##2);                                          \
    }
#define STORE_ROW(i)                                                                         \
    if (mr > i) store_row(y + i * N, c##i##0, c##i##1, c##i##2, bias, ncols)

static inline __attribute__((always_inline)) void
micro(const float *x, int64_t K, const float *wp, const float *bias, float *y, int64_t N,
      int64_t ncols, const int mr, const float *prefetch) {
    ACC(0); ACC(1); ACC(2); ACC(3);
    for (int64_t k = 0; k < K; k++) {
        /* the first row block pulls the next panel in from memory while this one computes
         * (a 96-byte panel row spans two cache lines) */
        if (prefetch) {
            _mm_prefetch((const char *)(prefetch + k * PANEL), _MM_HINT_T0);
            _mm_prefetch((const char *)(prefetch + k * PANEL + 16), _MM_HINT_T0);
        }
        const float *r = wp + k * PANEL;
        __m256 w0 = _mm256_loadu_ps(r), w1 = _mm256_loadu_ps(r + 8), w2 = _mm256_loadu_ps(r + 16);
        FMA_ROW(0) FMA_ROW(1) FMA_ROW(2) FMA_ROW(3)
    }
    STORE_ROW(0); STORE_ROW(1); STORE_ROW(2); STORE_ROW(3);
}

/* ---- lossless compact panel formats ------------------------------------------------
 * Weights dequantized from a GGUF file sit on a grid: every 32 consecutive inputs (k) of
 * one output column are d * q + m with q a 4-bit integer (Q4_1), or d * q with q an int8
 * (Q8_0), d and m fp16 values. panel_codec.py finds that grid (and keeps a matrix in fp32
 * unless every weight round-trips bitwise), stores each panel's q and (d, m) per 32-row k
 * block, and the GEMM expands one panel at a time into a per-thread fp32 buffer that the
 * micro-kernel then reads as it would an fp32 panel. d * q is exact in fp32 (11 + 8 bits),
 * so the expanded weights are bit-identical to the fp32 ones and so is the result; what
 * changes is the bytes streamed from memory per step: 0.75 (Q4) or 1.125 (Q8) per weight
 * instead of 4. Block layouts (one per 32 k of a panel):
 *   PD_Q4A  float d[24], m[24]; uint32 q[32][3] (word g of row k: columns 8g..8g+7,
 *           column 8g+j in bits 4j..4j+3)                                   576 bytes
 *   PD_Q8S  float d[24]; int8 q[32][24]                                     864 bytes */
enum { PD_F32 = 0, PD_Q4A = 1, PD_Q8S = 2 };
#define QBLOCK 32

static void expand_q4a(const uint8_t *src, int64_t K, float *out) {
    const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
    const __m256i nibble = _mm256_set1_epi32(0xF);
    for (int64_t kb = 0; kb < K / QBLOCK; kb++, src += 576) {
        const float *d = (const float *)src, *m = d + PANEL;
        const uint32_t *q = (const uint32_t *)(m + PANEL);
        __m256 d0 = _mm256_loadu_ps(d), d1 = _mm256_loadu_ps(d + 8), d2 = _mm256_loadu_ps(d + 16);
        __m256 m0 = _mm256_loadu_ps(m), m1 = _mm256_loadu_ps(m + 8), m2 = _mm256_loadu_ps(m + 16);
        for (int k = 0; k < QBLOCK; k++, q += 3, out += PANEL) {
#define Q4(g, dg, mg)                                                                         \
    _mm256_store_ps(out + 8 * g,                                                              \
                    _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(                      \
                                        _mm256_srlv_epi32(_mm256_set1_epi32((int)q[g]), shifts), \
                                        nibble)),                                             \
                                    dg, mg))
            Q4(0, d0, m0); Q4(1, d1, m1); Q4(2, d2, m2);
#undef Q4
        }
    }
}

static void expand_q8s(const uint8_t *src, int64_t K, float *out) {
    for (int64_t kb = 0; kb < K / QBLOCK; kb++, src += 864) {
        const float *d = (const float *)src;
        const int8_t *q = (const int8_t *)(d + PANEL);
        __m256 d0 = _mm256_loadu_ps(d), d1 = _mm256_loadu_ps(d + 8), d2 = _mm256_loadu_ps(d + 16);
        for (int k = 0; k < QBLOCK; k++, q += PANEL, out += PANEL) {
#define Q8(g, dg)                                                                             \
    _mm256_store_ps(out + 8 * g, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(         \
                                                   _mm_loadl_epi64((const __m128i *)(q + 8 * g)))), \
                                               dg))
            Q8(0, d0); Q8(1, d1); Q8(2, d2);
#undef Q8
        }
    }
}

/* Bytes of one packed panel of K rows (K a multiple of 32 for the compact formats). */
static inline int64_t panel_bytes(int codec, int64_t K) {
    return codec == PD_Q4A ? K / QBLOCK * 576 : codec == PD_Q8S ? K / QBLOCK * 864 : K * PANEL * 4;
}

/* This thread's expansion buffer, grown on demand and kept (at most K * 24 floats). */
static __thread float *expand_buf;
static __thread int64_t expand_cap;

static float *expansion_buffer(int64_t floats) {
    if (floats > expand_cap) {
        free(expand_buf);
        expand_buf = aligned_alloc(64, (size_t)((floats * 4 + 63) / 64 * 64));
        expand_cap = expand_buf ? floats : 0;
    }
    return expand_buf;
}

/* Panel p of y = x W^T: 24 output columns for all M rows. Returns -1 when this thread's
 * expansion buffer could not be allocated. */
static inline int panel_product(const float *x, const uint8_t *wp, int codec, const float *bias,
                                float *y, int64_t M, int64_t N, int64_t K, int64_t p,
                                int64_t panels) {
    const float *w = (const float *)(wp + p * panel_bytes(codec, K));
    const float *pf = NULL;
    if (codec != PD_F32) {
        float *buf = expansion_buffer(K * PANEL);
        if (!buf) return -1;
        (codec == PD_Q4A ? expand_q4a : expand_q8s)((const uint8_t *)w, K, buf);
        w = buf;
    } else if (p + 1 < panels) {
        pf = w + K * PANEL;
    }
    int64_t n0 = p * PANEL, ncols = N - n0 < PANEL ? N - n0 : PANEL;
    const float *b = bias ? bias + n0 : NULL;
    for (int64_t m = 0; m < M; m += MR) {
        const float *xm = x + m * K;
        float *ym = y + m * N + n0;
        const float *pfm = m == 0 ? pf : NULL;
        switch (M - m < MR ? M - m : MR) {
        case 1: micro(xm, K, w, b, ym, N, ncols, 1, pfm); break;
        case 2: micro(xm, K, w, b, ym, N, ncols, 2, pfm); break;
        case 3: micro(xm, K, w, b, ym, N, ncols, 3, pfm); break;
        default: micro(xm, K, w, b, ym, N, ncols, 4, pfm); break;
        }
    }
    return 0;
}

/* y [M, N] = x [M, K] W^T (+ bias), W panel-packed in `codec` (native.PanelWeight).
 * Returns 0, or -1 when an expansion buffer could not be allocated.
 *
 * Small batches stream the weights from memory: each thread takes one contiguous half, which
 * the hardware prefetcher follows. From 16 rows on the GEMM is compute-bound, and threads
 * take panel pairs as they finish instead: on a shared VM one core often runs slower for a
 * while, and a static split waits for it (batch 32: ~8% faster over a model's GEMMs). */
int pd_linear_panels(const float *x, const void *wp, int64_t codec, const float *bias, float *y,
                     int64_t M, int64_t N, int64_t K) {
    int64_t panels = (N + PANEL - 1) / PANEL;
    int failed = 0;
    if (M >= 16) {
#pragma omp parallel for schedule(dynamic, 2) reduction(| : failed)
        for (int64_t p = 0; p < panels; p++)
            failed |= panel_product(x, wp, (int)codec, bias, y, M, N, K, p, panels);
    } else {
#pragma omp parallel for schedule(static) reduction(| : failed)
        for (int64_t p = 0; p < panels; p++)
            failed |= panel_product(x, wp, (int)codec, bias, y, M, N, K, p, panels);
    }
    return failed ? -1 : 0;
}

/* ---- the decoder layers of a decode-only step ----------------------------------------
 * The calls FusedDecoderLayer would make from Python, made here, for every layer at once:
 * at batch 1 the ~10 Python round trips per layer cost more than the layer's arithmetic
 * besides its GEMMs, and at batch 32 a ctypes call per layer still costs ~5% of a step.
 * x [M, Dm] is the residual stream, updated in place; scratch holds the intermediates
 * (pd_decode_layer_scratch floats). Each layer's four linear weights (QKV, output,
 * gate/up, down) are panel-packed, each in its format; only QKV may have a bias. Returns
 * 0, or -1 when a kernel could not allocate its scratch memory. */
int64_t pd_decode_layer_scratch(int64_t M, int64_t Dm, int64_t H, int64_t KVH, int64_t D,
                                int64_t I) {
    return M * (2 * Dm + (2 * H + 2 * KVH) * D + 3 * I);
}

typedef struct {
    const void *data;
    int64_t codec;
} pd_weight;

/* One layer's parameters and its KV cache (native.PdLayer). */
typedef struct {
    const float *norm1, *norm2, *qkv_bias;
    pd_weight w[4];
    float *cache;
} pd_layer;

/* One layer. Its input is x + *pending (the previous layer's MLP output, not yet added:
 * the add rides along with this layer's first norm), and it leaves its own MLP output in
 * *pending; the caller adds the last one. */
static int decode_layer(float *x, const float **pending, float *scratch, int64_t M,
                        const pd_layer *l, const float *cos, const float *sin,
                        const int64_t *slot_blocks, const int64_t *slot_offsets,
                        const int64_t *tables, const int64_t *context_lens, float *scores,
                        int64_t max_blocks, int64_t Dm, int64_t H, int64_t KVH, int64_t D,
                        int64_t I, int64_t BS, float eps) {
    int64_t nqkv = (H + 2 * KVH) * D;
    float *y = scratch, *qkv = y + M * Dm, *att = qkv + M * nqkv, *o = att + M * H * D;
    float *gu = o + M * Dm, *act = gu + M * 2 * I;
    const pd_weight *w = l->w;
    if (*pending) pd_add_rmsnorm(x, *pending, l->norm1, y, M, Dm, eps);
    else pd_rmsnorm(x, l->norm1, y, M, Dm, eps);
    if (pd_linear_panels(y, w[0].data, w[0].codec, l->qkv_bias, qkv, M, nqkv, Dm)) return -1;
    pd_rope_qkv_store(qkv, cos, sin, l->cache, slot_blocks, slot_offsets, M, H, KVH, D, BS);
    if (pd_paged_decode_attn(qkv, nqkv, l->cache, tables, context_lens, att, scores, M, H, KVH,
                             D, BS, max_blocks, 1.f / sqrtf((float)D)))
        return -1;
    if (pd_linear_panels(att, w[1].data, w[1].codec, NULL, o, M, Dm, H * D)) return -1;
    pd_add_rmsnorm(x, o, l->norm2, y, M, Dm, eps);
    if (pd_linear_panels(y, w[2].data, w[2].codec, NULL, gu, M, 2 * I, Dm)) return -1;
    pd_silu_mul(gu, act, M, I);
    if (pd_linear_panels(act, w[3].data, w[3].codec, NULL, o, M, Dm, I)) return -1;
    *pending = o;
    return 0;
}

/* Layers [0, L) of `layers` in order (the caller passes one at a time when it acts between
 * layers, e.g. to send each layer's KV as soon as it is written). */
int pd_decode_layers(float *x, float *scratch, int64_t M, const pd_layer *layers, int64_t L,
                     const float *cos, const float *sin, const int64_t *slot_blocks,
                     const int64_t *slot_offsets, const int64_t *tables,
                     const int64_t *context_lens, float *scores, int64_t max_blocks, int64_t Dm,
                     int64_t H, int64_t KVH, int64_t D, int64_t I, int64_t BS, float eps) {
    const float *pending = NULL;
    for (int64_t l = 0; l < L; l++)
        if (decode_layer(x, &pending, scratch, M, layers + l, cos, sin, slot_blocks,
                         slot_offsets, tables, context_lens, scores, max_blocks, Dm, H, KVH, D,
                         I, BS, eps))
            return -1;
    if (pending)
        for (int64_t i = 0; i < M * Dm; i++) x[i] += pending[i];
    return 0;
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
