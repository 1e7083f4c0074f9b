/* ---- small-M GEMM on panel-packed weights --------------------------------------------
 * W [N, K] is packed once into panels of PANEL output columns (three vectors: 24 with AVX2,
 * 48 with AVX-512), [ceil(N/PANEL)][K][PANEL] (zero-padded), so that for every k one panel
 * row is three vectors. A micro-kernel keeps a block of up to MR rows of x times PANEL
 * columns in 3 MR accumulators and, per k, loads the three weight vectors once and
 * broadcasts each x value: 3 MR FMAs per 3 loads + MR broadcasts. AVX2 has 16 registers, so
 * MR = 4 (12 accumulators; a 32-row decode batch is 8 whole blocks, where a 6x16 kernel
 * measured the same, wasting 4 rows); AVX-512 has 32, so MR = 8 (24 accumulators, 4 blocks).
 * At M = 1 the same loop streams the weights at memory speed (no horizontal sums). */
#include "kernels.h"

#ifndef MR
#define MR (VW == 16 ? 8 : 4)
#endif
/* Up to this many rows, compact weights go from their bytes straight into the FMAs
 * (micro_compact). Past it the accumulators leave too few registers for the scales and the
 * spills cost more than the buffer: measured on Q4 at 4 rows with AVX2 (16 registers) 1.45x
 * slower, 3 rows even, 2 rows 0.84x; with AVX-512, 4 rows 0.86x, 8 rows 1.02x. */
#define DIRECT_M_MAX (MR / 2)
/* Rows of k per chunk: a multiple of the compact formats' 32. */
#ifndef KC
#define KC 128
#endif

int64_t pd_panel_width(void) { return PANEL; }

/* The last panel's columns past N are masked off (its padding is never written). */
static inline void store_row(float *y, vf v0, vf v1, vf v2, const float *bias, int64_t ncols) {
    vf v[3] = {v0, v1, v2};
    for (int j = 0; j < 3 && j * VW < ncols; j++) {
        int64_t n = ncols - j * VW;
        if (n >= VW) vstore(y + j * VW, bias ? vadd(v[j], vload(bias + j * VW)) : v[j]);
        else vstore_n(y + j * VW, bias ? vadd(v[j], vload_n(bias + j * VW, n)) : v[j], n);
    }
}

/* Named accumulators (an array of them gets spilled to the stack by gcc); `mr` is a
 * constant at every call, so the rows past it compile away. A k-chunk after the first
 * starts from the sums the previous one left in `acc` (mr x PANEL): each output is still
 * one fp32 sum over k in order, so chunking does not change a bit of the result. */
#define ACC(i)                                                                               \
    vf c##i##0 = vzero(), c##i##1 = c##i##0, c##i##2 = c##i##0;                              \
    if (mr > i && !first) {                                                                  \
        c##i##0 = vload(acc + i * PANEL);                                                    \
        c##i##1 = vload(acc + i * PANEL + VW);                                               \
        c##i##2 = vload(acc + i * PANEL + 2 * VW);                                           \
    }
#define FMA_ROW(i)                                                                           \
    if (mr > i) {                                                                            \
        vf xb = vset1(x[i * ldx + k]);                                                       \
        c##i##0 = vfmadd(w0, xb, c##i##0);                                                   \
        c##i##1 = vfmadd(w1, xb, c##i##1);                                                   \
        c##i##2 = vfmadd(w2, xb, c##i##2);                                                   \
    }
#define STORE_ROW(i)                                                                         \
    if (mr > i && last) store_row(y + i * N, c##i##0, c##i##1, c##i##2, bias, ncols);        \
    if (mr > i && !last) {                                                                   \
        vstore(acc + i * PANEL, c##i##0);                                                    \
        vstore(acc + i * PANEL + VW, c##i##1);                                               \
        vstore(acc + i * PANEL + 2 * VW, c##i##2);                                           \
    }

/* Rows [0, mr) of x (ldx apart) times kc rows of a panel at w, for the chunk that is the
 * first and/or last of k: the last adds the bias and writes y, the others leave their sums
 * in acc. `prefetch`, if set, is kc * pf_step bytes to request from memory meanwhile, a
 * step per k. */
static inline __attribute__((always_inline)) void
micro(const float *x, int64_t ldx, int64_t kc, const float *w, float *acc, int first, int last,
      float *y, int64_t N, const float *bias, int64_t ncols, const int mr, const char *prefetch,
      int64_t pf_step) {
    ACC(0) ACC(1) ACC(2) ACC(3) ACC(4) ACC(5) ACC(6) ACC(7)
    for (int64_t k = 0; k < kc; k++) {
        if (prefetch)
            for (int64_t j = 0; j < pf_step; j += 64)
                _mm_prefetch(prefetch + k * pf_step + j, _MM_HINT_T0);
        const float *r = w + k * PANEL;
        vf w0 = vload(r), w1 = vload(r + VW), w2 = vload(r + 2 * VW);
        FMA_ROW(0) FMA_ROW(1) FMA_ROW(2) FMA_ROW(3) FMA_ROW(4) FMA_ROW(5) FMA_ROW(6) FMA_ROW(7)
    }
    STORE_ROW(0) STORE_ROW(1) STORE_ROW(2) STORE_ROW(3)
    STORE_ROW(4) STORE_ROW(5) STORE_ROW(6) STORE_ROW(7)
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
 *   PD_Q4A  float d[PANEL], m[PANEL]; uint32 q[32][PANEL / 8] (word g of row k: nibble j
 *           in bits 4j..4j+3 holds column 8g+j, or in 48-column panels column
 *           16(g/2) + 2j + g%2: panel_codec._q4_column_order, kernels.h vnibbles)
 *                                                                       24 PANEL bytes
 *   PD_Q8S  float d[PANEL]; int8 q[32][PANEL]                           36 PANEL bytes */

static void expand_q4a(const uint8_t *src, int64_t K, float *out) {
    for (int64_t kb = 0; kb < K / QBLOCK; kb++, src += Q4A_BLOCK) {
        const float *d = (const float *)src, *m = d + PANEL;
        const uint32_t *q = (const uint32_t *)(m + PANEL);
        vf d0 = vload(d), d1 = vload(d + VW), d2 = vload(d + 2 * VW);
        vf m0 = vload(m), m1 = vload(m + VW), m2 = vload(m + 2 * VW);
        for (int k = 0; k < QBLOCK; k++, q += PANEL / 8, out += PANEL) {
            vstore(out, vfmadd(vnibbles(q), d0, m0));
            vstore(out + VW, vfmadd(vnibbles(q + VW / 8), d1, m1));
            vstore(out + 2 * VW, vfmadd(vnibbles(q + 2 * VW / 8), d2, m2));
        }
    }
}

static void expand_q8s(const uint8_t *src, int64_t K, float *out) {
    for (int64_t kb = 0; kb < K / QBLOCK; kb++, src += Q8S_BLOCK) {
        const float *d = (const float *)src;
        const int8_t *q = (const int8_t *)(d + PANEL);
        vf d0 = vload(d), d1 = vload(d + VW), d2 = vload(d + 2 * VW);
        for (int k = 0; k < QBLOCK; k++, q += PANEL, out += PANEL) {
            vstore(out, vmul(vcvt_f32(vbytes(q)), d0));
            vstore(out + VW, vmul(vcvt_f32(vbytes(q + VW)), d1));
            vstore(out + 2 * VW, vmul(vcvt_f32(vbytes(q + 2 * VW)), d2));
        }
    }
}

/* micro() on a compact chunk at w, each weight vector computed in registers as it is
 * needed (the FMA of expand_q4a, the product of expand_q8s: the same fp32 weights, so the
 * same result) instead of being written to the buffer and read back: with a single row block
 * (M <= MR) the expansion is done once per weight either way, and at M = 1 the store and
 * reload were a third of the vector work. kc is a multiple of QBLOCK. */
static inline __attribute__((always_inline)) void
micro_compact(const float *x, int64_t ldx, int64_t kc, const uint8_t *w, const int codec,
              float *acc, int first, int last, float *y, int64_t N, const float *bias,
              int64_t ncols, const int mr, const char *prefetch, int64_t pf_step) {
    ACC(0) ACC(1) ACC(2) ACC(3) ACC(4) ACC(5) ACC(6) ACC(7)
    for (int64_t kb = 0; kb < kc; kb += QBLOCK, w += codec == PD_Q4A ? Q4A_BLOCK : Q8S_BLOCK) {
        const float *d = (const float *)w, *dm = d + PANEL;
        vf d0 = vload(d), d1 = vload(d + VW), d2 = vload(d + 2 * VW);
        vf m0 = vzero(), m1 = m0, m2 = m0;
        if (codec == PD_Q4A) m0 = vload(dm), m1 = vload(dm + VW), m2 = vload(dm + 2 * VW);
        for (int64_t k = kb; k < kb + QBLOCK; k++) {
            if (prefetch)
                for (int64_t j = 0; j < pf_step; j += 64)
                    _mm_prefetch(prefetch + k * pf_step + j, _MM_HINT_T0);
            vf w0, w1, w2;
            if (codec == PD_Q4A) {
                const uint32_t *q = (const uint32_t *)(dm + PANEL) + (k - kb) * (PANEL / 8);
                w0 = vfmadd(vnibbles(q), d0, m0);
                w1 = vfmadd(vnibbles(q + VW / 8), d1, m1);
                w2 = vfmadd(vnibbles(q + 2 * VW / 8), d2, m2);
            } else {
                const int8_t *q = (const int8_t *)dm + (k - kb) * PANEL;
                w0 = vmul(vcvt_f32(vbytes(q)), d0);
                w1 = vmul(vcvt_f32(vbytes(q + VW)), d1);
                w2 = vmul(vcvt_f32(vbytes(q + 2 * VW)), d2);
            }
            FMA_ROW(0) FMA_ROW(1) FMA_ROW(2) FMA_ROW(3) FMA_ROW(4) FMA_ROW(5) FMA_ROW(6) FMA_ROW(7)
        }
    }
    STORE_ROW(0) STORE_ROW(1) STORE_ROW(2) STORE_ROW(3)
    STORE_ROW(4) STORE_ROW(5) STORE_ROW(6) STORE_ROW(7)
}

/* Bytes of one packed panel of K rows (K a multiple of 32 for the compact formats). */
static inline int64_t panel_bytes(int codec, int64_t K) {
    return codec == PD_Q4A ? K / QBLOCK * Q4A_BLOCK : codec == PD_Q8S ? K / QBLOCK * Q8S_BLOCK : K * PANEL * 4;
}

/* This thread's buffer: an expanded chunk (KC x PANEL floats) and the sums carried between
 * chunks (M x PANEL), grown on demand and kept. */
static __thread float *thread_buf;
static __thread int64_t thread_cap;

static float *thread_buffer(int64_t floats) {
    if (floats > thread_cap) {
        free(thread_buf);
        thread_buf = aligned_alloc(64, (size_t)((floats * 4 + 63) / 64 * 64));
        thread_cap = thread_buf ? floats : 0;
    }
    return thread_buf;
}

/* Panel p of y = x W^T: PANEL output columns for all M rows, KC rows of k at a time, so the
 * chunk of weights (expanded or not) stays in L1 while every row block reads it; the first
 * row block asks for the next chunk's bytes (panels lie end to end, so that is the next
 * panel's first chunk after the last), which no hardware prefetcher reliably runs ahead
 * for. Returns -1 when this thread's buffer could not be allocated. */
static inline int panel_product(const float *x, const uint8_t *wp, int codec, const float *bias,
                                float *y, int64_t M, int64_t N, int64_t K, int64_t p) {
    int64_t bytes = panel_bytes(codec, K);
    const uint8_t *panel = wp + p * bytes;
    float *buf = thread_buffer(KC * PANEL + M * PANEL);
    if (!buf) return -1;
    int64_t n0 = p * PANEL, ncols = N - n0 < PANEL ? N - n0 : PANEL;
    const float *b = bias ? bias + n0 : NULL;
    int direct = codec != PD_F32 && M <= DIRECT_M_MAX;
    for (int64_t k0 = 0; k0 < K; k0 += KC) {
        int64_t kc = K - k0 < KC ? K - k0 : KC, step = bytes / K;
        const uint8_t *chunk = panel + k0 * step;
        const float *w = codec == PD_F32 ? (const float *)chunk : buf;
        if (!direct && codec == PD_Q4A) expand_q4a(chunk, kc, buf);
        if (!direct && codec == PD_Q8S) expand_q8s(chunk, kc, buf);
        int first = k0 == 0, last = k0 + kc == K;
        for (int64_t m = 0; m < M; m += MR) {
            const float *xm = x + m * K + k0;
            const char *pf = m == 0 ? (const char *)chunk + kc * step : NULL;
            float *ym = y + m * N + n0, *acc = buf + KC * PANEL + m * PANEL;
            switch (M - m < MR ? M - m : MR) {
#define MICRO(n)                                                                             \
    case n:                                                                                  \
        if (direct && codec == PD_Q4A)                                                       \
            micro_compact(xm, K, kc, chunk, PD_Q4A, acc, first, last, ym, N, b, ncols, n, pf,  \
                          step);                                                             \
        else if (direct)                                                                     \
            micro_compact(xm, K, kc, chunk, PD_Q8S, acc, first, last, ym, N, b, ncols, n, pf,  \
                          step);                                                             \
        else micro(xm, K, kc, w, acc, first, last, ym, N, b, ncols, n, pf, step);            \
        break;
            MICRO(1) MICRO(2) MICRO(3)
#if MR > 4
            MICRO(4) MICRO(5) MICRO(6) MICRO(7)
#endif
            MICRO(MR)
#undef MICRO
            }
        }
    }
    return 0;
}

/* y [M, N] = x [M, K] W^T (+ bias), W panel-packed in `codec` (native.PanelWeight).
 * Returns 0, or -1 when an expansion buffer could not be allocated.
 *
 * Small batches stream the weights from memory: each thread takes one contiguous half, which
 * the hardware prefetcher follows. From 16 rows on the GEMM is compute-bound, and threads
 * take runs of panels as they finish instead: on a shared VM one core often runs slower for
 * a while, and a static split waits for it (batch 32: ~8% faster over a model's GEMMs). A
 * run is at least 48 columns (two AVX2 panels, one AVX-512 panel: an output projection of
 * SmolLM2 has only 12 such) and an eighth of a thread's share: within a run, the chunk each
 * panel_product prefetches after its last is the next panel's first, the one this thread
 * computes next, where with runs of one it would mostly be the other thread's. */
int pd_linear_panels(const float *x, const void *wp, int64_t codec, const float *bias, float *y,
                     int64_t M, int64_t N, int64_t K) {
    int64_t panels = (N + PANEL - 1) / PANEL;
    int64_t run = panels / (8 * omp_get_max_threads());
    int failed = 0;
#ifdef __AMX_BF16__
    if (codec != PD_F32 && M >= AMX_M_MIN && pd_amx_ready())
        return pd_linear_panels_amx(x, wp, codec, bias, y, M, N, K);
#endif
    if (M >= 16) {
#pragma omp parallel for schedule(dynamic, run > 48 / PANEL ? run : 48 / PANEL) reduction(| : failed)
        for (int64_t p = 0; p < panels; p++)
            failed |= panel_product(x, wp, (int)codec, bias, y, M, N, K, p);
    } else {
#pragma omp parallel for schedule(static) reduction(| : failed)
        for (int64_t p = 0; p < panels; p++)
            failed |= panel_product(x, wp, (int)codec, bias, y, M, N, K, p);
    }
    return failed ? -1 : 0;
}
