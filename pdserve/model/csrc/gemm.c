/* ---- small-M GEMM on panel-packed weights --------------------------------------------
 * W [N, K] is packed once into panels of 24 output columns, [ceil(N/24)][K][24] (zero-
 * padded), so that for every k one panel row is three vectors. A micro-kernel keeps a block
 * of up to 4 rows of x times 24 columns in 12 accumulators and, per k, loads the three
 * weight vectors once and broadcasts each x value: 12 FMAs per 3 loads + 4 broadcasts, and
 * a 32-row decode batch is 8 whole blocks (a 6x16 kernel measured the same, wasting 4 rows).
 * At M = 1 the same loop streams the weights at memory speed (no horizontal sums). */
#include "kernels.h"

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
