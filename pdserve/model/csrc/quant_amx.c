/* ---- many rows against GGUF block weights on AMX bf16 tiles --------------------------
 * Built only into the `amx` variant (in the others this file is empty). quant_linear.py hands
 * it every call above QUANT_GEMV_M_MAX rows (prefill chunks, decode batches over 16) whose
 * weights are all block types (Q4_0 ... Q6_K): y = x W^T with W read in place (the parts and
 * row maps of pd_quant_linear).
 *
 * Numerics: x and each dequantized weight value are rounded to bf16 (round to nearest even,
 * |e| <= 2^-9 of the value each), the tiles multiply them exactly and add in fp32. Per product
 * the error is at most |x w| (2^-8 + 2^-18), below the int8 path's bound: llama.cpp's (and
 * quant_dot.c's) int8 activations move x by up to max|x| / 254 over a block, and
 * |x| (2^-8 + 2^-18) < max|x| / 254 (tests/model/test_quant_linear.py holds both bounds).
 *
 * Layout: y^T = W x^T, so the weights are the A operand in their own row order: a panel of
 * panel_rows(K) weight rows (PANEL_BYTES of bf16, 32 to 128 rows) is dequantized once per
 * call into a per-thread bf16 buffer [rows][K], and an A tile is 16 of its rows by 32 k read with the row stride (no
 * transpose). x becomes the B operand once per call: [Mp / 16][K / 32] tiles of 16 k pairs by
 * 16 rows (VNNI pairs, 1 KB each, Mp = M rounded up to 32 with zero rows). Each (32 weight
 * rows, 32 x rows) block takes 2 A + 2 B tiles per 32 k into 4 C tiles held over all of K,
 * then stored and written out transposed. The x rows of one block (32 K bf16) stay in L1/L2
 * while every 32-row slice of the panel passes them. */
#include "kernels.h"

#ifdef __AMX_BF16__

#define KB 32 /* k per tile row (32 bf16) */
#ifndef PANEL_BYTES
#define PANEL_BYTES (512 << 10) /* bf16 bytes of weight rows dequantized per panel */
#endif

/* Weight rows per panel: PANEL_BYTES of bf16 rows, 32 to 128 (a multiple of 32). */
static int64_t panel_rows(int64_t K) {
    int64_t rows = PANEL_BYTES / (K * 2) / 32 * 32;
    return rows < 32 ? 32 : rows > 128 ? 128 : rows;
}

static __thread void *x_buf, *w_buf;
static __thread int64_t x_cap, w_cap;

static void *grown(void **buf, int64_t *cap, int64_t bytes) {
    if (bytes > *cap) {
        free(*buf);
        *buf = aligned_alloc(64, (size_t)((bytes + 63) / 64 * 64));
        *cap = *buf ? bytes : 0;
    }
    return *buf;
}

/* Row m of x (NULL: a zero row) into its column of the B tiles of its row tile. */
static void pack_x_row(const float *x, int64_t m, int64_t K, uint16_t *xs) {
    int64_t nkb = K / KB;
    int32_t *col = (int32_t *)(xs + (m / 16) * nkb * 512) + m % 16;
    const __m512i rows = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32(16));
    for (int64_t kb = 0; kb < nkb; kb++, col += 256) {
        __m512i pairs = _mm512_setzero_si512(); /* dword r: k = 2r (low half), 2r + 1 */
        if (x)
            pairs = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + kb * KB + 16),
                                                 _mm512_loadu_ps(x + kb * KB));
        _mm512_i32scatter_epi32(col, rows, pairs, 4);
    }
}

/* Weight rows [j0, j0 + pr) as bf16 [pr][K] (rows past N zero); f32: K floats. */
static void fill_panel(const pd_qpart *parts, const int64_t *row_bytes, int64_t j0, int64_t pr,
                       int64_t N, int64_t K, float *f32, uint16_t *panel) {
    for (int64_t r = 0; r < pr; r++) {
        uint16_t *dst = panel + r * K;
        if (j0 + r >= N) {
            memset(dst, 0, K * 2);
            continue;
        }
        int64_t p;
        const uint8_t *row = pd_qrow(parts, row_bytes, j0 + r, &p);
        pd_quant_row_f32(parts[p].type, row, f32, K);
        for (int64_t k = 0; k < K; k += 32)
            _mm512_storeu_si512(dst + k, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(f32 + k + 16),
                                                                      _mm512_loadu_ps(f32 + k)));
    }
}

/* C tiles 4-7 (weight rows w0 + 16 a, x rows of tile t + b: tile 4 + 2 a + b) written into
 * y transposed, rows < M and columns < N only. */
static void store_block(float *y, int64_t ldy, int64_t M, int64_t N, int64_t m0, int64_t w0,
                        float *c) {
    _tile_stored(4, c, 64);
    _tile_stored(5, c + 256, 64);
    _tile_stored(6, c + 512, 64);
    _tile_stored(7, c + 768, 64);
    for (int a = 0; a < 2; a++)
        for (int b = 0; b < 2; b++) {
            const float *t = c + (2 * a + b) * 256; /* [16 weight rows][16 x rows] */
            for (int i = 0; i < 16 && m0 + 16 * b + i < M; i++) {
                float *out = y + (m0 + 16 * b + i) * ldy + w0 + 16 * a;
                int64_t n = N - (w0 + 16 * a);
                for (int r = 0; r < 16 && r < n; r++) out[r] = t[r * 16 + i];
            }
        }
}

/* x rows [m0, m0 + 32) against the panel's 32 rows from `w` (row stride K). */
static void block(const uint16_t *w, const uint16_t *xs, int64_t m0, int64_t K) {
    int64_t nkb = K / KB;
    const uint16_t *b0 = xs + (m0 / 16) * nkb * 512, *b1 = b0 + nkb * 512;
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
    for (int64_t kb = 0; kb < nkb; kb++) {
        _tile_loadd(0, w + kb * KB, K * 2);
        _tile_loadd(1, w + 16 * K + kb * KB, K * 2);
        _tile_loadd(2, b0 + kb * 512, 64);
        _tile_loadd(3, b1 + kb * 512, 64);
        _tile_dpbf16ps(4, 0, 2);
        _tile_dpbf16ps(5, 0, 3);
        _tile_dpbf16ps(6, 1, 2);
        _tile_dpbf16ps(7, 1, 3);
    }
}

/* y[m, j] (row stride ldy) = x[m] . W[j], x [M, K] contiguous, W the rows of `parts` one
 * after another (as pd_quant_linear). 0, or -1 where AMX is not granted, K is not a multiple
 * of 32, a part is not a block type, or a buffer could not be allocated. */
int pd_quant_linear_amx(const float *x, int64_t M, int64_t K, const pd_qpart *parts, int64_t P,
                        float *y, int64_t ldy) {
    if (!pd_amx_ready() || P < 1 || K % KB) return -1;
    int64_t N = 0, row_bytes[P];
    for (int64_t p = 0; p < P; p++) {
        if (!pd_quant_block_type(parts[p].type)) return -1;
        if ((row_bytes[p] = pd_quant_row_bytes(parts[p].type, K)) < 0) return -1;
        N += parts[p].rows;
    }
    int64_t Mp = (M + 31) / 32 * 32, pr = panel_rows(K), panels = (N + pr - 1) / pr;
    uint16_t *xs = grown(&x_buf, &x_cap, Mp * K * 2);
    if (!xs) return -1;
    int failed = 0;
#pragma omp parallel reduction(| : failed)
    {
#pragma omp for schedule(static)
        for (int64_t m = 0; m < Mp; m++) pack_x_row(m < M ? x + m * K : NULL, m, K, xs);
        uint8_t *scratch = grown(&w_buf, &w_cap, pr * K * 2 + K * 4 + 4096);
        failed = !scratch;
        if (scratch) pd_amx_tiles_configure();
        uint16_t *panel = (uint16_t *)scratch;
        float *f32 = (float *)(scratch + pr * K * 2), *c = f32 + K;
#pragma omp for schedule(dynamic)
        for (int64_t q = 0; q < panels; q++) {
            if (!scratch) continue;
            int64_t j0 = q * pr;
            fill_panel(parts, row_bytes, j0, pr, N, K, f32, panel);
            for (int64_t m0 = 0; m0 < Mp; m0 += 32)
                for (int64_t s = 0; s < pr && j0 + s < N; s += 32) {
                    block(panel + s * K, xs, m0, K);
                    store_block(y, ldy, M, N, m0, j0 + s, c);
                }
        }
        if (scratch) _tile_release();
    }
    return failed ? -1 : 0;
}
#endif
