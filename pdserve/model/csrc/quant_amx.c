/* ---- many rows against GGUF block weights on AMX bf16 tiles --------------------------
 * Built only into the `amx` variant (in the others this file is empty). quant_linear.py hands
 * it every call above QUANT_GEMV_M_MAX rows (prefill chunks, decode batches over 16) whose
 * weights are all block types (Q4_0 ... Q6_K), BF16 or F16: y = x W^T with W read in place
 * (the parts and row maps of pd_quant_linear). BF16 rows are the tiles' own values (copied
 * into the panel, no rounding); F16 rows are widened (F16C) and rounded to bf16 as a block
 * type's dequantized values are. K need not be a multiple of 32 (BF16/F16 allow any): the
 * panel and the packed x are zero past K.
 *
 * Numerics: x and each dequantized weight value are rounded to bf16 (round to nearest even:
 * bf16 keeps 8 significant bits, |e| <= 2^-8 of the value), the tiles multiply them exactly
 * and add in fp32. Per product the error is at most |x w| (2^-7 + 2^-16), |x w| 2^-8 for BF16
 * weights (not rounded): of the order of the int8 path's, whose activations (llama.cpp's and
 * quant_dot.c's) move x by up to max|x| / 254 over a block (tests/model/test_quant_linear.py
 * and test_safetensors_weights.py hold the bounds).
 *
 * Layout: y^T = W x^T, so the weights are the A operand in their own row order: a panel of
 * panel_rows(K) weight rows (PANEL_BYTES of bf16, 32 to 128 rows) is dequantized once per
 * call into a per-thread bf16 buffer [rows][Kp] (Kp: K rounded up to 32), and an A tile is 16
 * of its rows by 32 k read with the row stride (no transpose). x becomes the B operand once
 * per call: [Mp / 16][Kp / 32] tiles of 16 k pairs by
 * 16 rows (VNNI pairs, 1 KB each, Mp = M rounded up to 32 with zero rows). Each (32 weight
 * rows, 32 x rows) block takes 2 A + 2 B tiles per 32 k into 4 C tiles held over all of K,
 * then stored and written out transposed. The x rows of one block (32 K bf16) stay in L1/L2
 * while every 32-row slice of the panel passes them. */
#include "kernels.h"

#ifdef __AMX_BF16__

#define KB 32 /* k per tile row (32 bf16) */
#define T_F16 1   /* ggml type ids (quant_gemm.c) */
#define T_BF16 30
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

/* x[k, k + 16) with the values at K and past read as 0 (masked: nothing past K is read). */
static inline __m512 load16(const float *x, int64_t k, int64_t K) {
    int64_t n = K - k;
    return _mm512_maskz_loadu_ps(tail_mask(n < 0 ? 0 : n > 16 ? 16 : n), x + k);
}

/* 32 floats from x[k] (zero at K and past) as bf16, rounded to nearest even. */
static inline __m512i bf16x32(const float *x, int64_t k, int64_t K) {
    return (__m512i)_mm512_cvtne2ps_pbh(load16(x, k + 16, K), load16(x, k, K));
}

/* Row m of x (NULL: a zero row) into its column of the B tiles of its row tile. */
static void pack_x_row(const float *x, int64_t m, int64_t K, uint16_t *xs) {
    int64_t nkb = (K + KB - 1) / KB;
    int32_t *col = (int32_t *)(xs + (m / 16) * nkb * 512) + m % 16;
    const __m512i rows = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32(16));
    for (int64_t kb = 0; kb < nkb; kb++, col += 256) {
        __m512i pairs = _mm512_setzero_si512(); /* dword r: k = 2r (low half), 2r + 1 */
        if (x) pairs = bf16x32(x, kb * KB, K);
        _mm512_i32scatter_epi32(col, rows, pairs, 4);
    }
}

/* Bf16 values between panel rows: Kp + KB, so that a tile's 16 rows (Kp * 2 bytes apart, a
 * multiple of 4 KB at K = 2048 or 8192) do not all fall into one L1 set. */
static inline int64_t panel_stride(int64_t Kp) { return Kp + KB; }

/* Weight rows [j0, j0 + pr) as bf16 [pr][panel_stride(Kp)] (rows past N and k past K zero);
 * f32: K floats. A BF16 row is copied as it is; Q4_0, Q4_1, Q8_0, Q4_K and Q6_K rows are
 * decoded straight to bf16 (pd_quant_row_bf16), the others pass through fp32. */
static void fill_panel(const pd_qpart *parts, const int64_t *row_bytes, int64_t j0, int64_t pr,
                       int64_t N, int64_t K, float *f32, uint16_t *panel) {
    int64_t Kp = (K + KB - 1) / KB * KB;
    for (int64_t r = 0; r < pr; r++) {
        uint16_t *dst = panel + r * panel_stride(Kp);
        if (j0 + r >= N) {
            memset(dst, 0, Kp * 2);
            continue;
        }
        int64_t p;
        const uint8_t *row = pd_qrow(parts, row_bytes, j0 + r, &p);
        if (parts[p].type == T_BF16) {
            memcpy(dst, row, K * 2);
            memset(dst + K, 0, (Kp - K) * 2);
            continue;
        }
        if (pd_quant_row_bf16(parts[p].type, row, dst, K) == 0) {
            memset(dst + K, 0, (Kp - K) * 2);
            continue;
        }
        pd_quant_row_f32(parts[p].type, row, f32, K);
        for (int64_t k = 0; k < Kp; k += KB) _mm512_storeu_si512(dst + k, bf16x32(f32, k, K));
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

/* x rows [m0, m0 + 32) against the panel's 32 rows from `w` (K a multiple of 32, row stride
 * panel_stride(K)). */
static void block(const uint16_t *w, const uint16_t *xs, int64_t m0, int64_t K) {
    int64_t nkb = K / KB, ws = panel_stride(K);
    const uint16_t *b0 = xs + (m0 / 16) * nkb * 512, *b1 = b0 + nkb * 512;
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
    for (int64_t kb = 0; kb < nkb; kb++) {
        _tile_loadd(0, w + kb * KB, ws * 2);
        _tile_loadd(1, w + 16 * ws + kb * KB, ws * 2);
        _tile_loadd(2, b0 + kb * 512, 64);
        _tile_loadd(3, b1 + kb * 512, 64);
        _tile_dpbf16ps(4, 0, 2);
        _tile_dpbf16ps(5, 0, 3);
        _tile_dpbf16ps(6, 1, 2);
        _tile_dpbf16ps(7, 1, 3);
    }
}

/* Whether a part of `type` takes the tiles: the block types (rounded to bf16 within the int8
 * path's bound), BF16 (exact) and F16 (rounded as the block types). */
int pd_quant_amx_type(int64_t type) {
    return pd_quant_block_type(type) || type == T_BF16 || type == T_F16;
}

/* y[m, j] (row stride ldy) = x[m] . W[j], x [M, K] contiguous, W the rows of `parts` one
 * after another (as pd_quant_linear). 0, or -1 where AMX is not granted, a part's type is not
 * pd_quant_amx_type (or K not a whole number of its blocks), or a buffer could not be
 * allocated. */
int pd_quant_linear_amx(const float *x, int64_t M, int64_t K, const pd_qpart *parts, int64_t P,
                        float *y, int64_t ldy) {
    if (!pd_amx_ready() || P < 1 || K < 1) return -1;
    int64_t N = 0, row_bytes[P];
    for (int64_t p = 0; p < P; p++) {
        if (!pd_quant_amx_type(parts[p].type)) return -1;
        if ((row_bytes[p] = pd_quant_row_bytes(parts[p].type, K)) < 0) return -1;
        N += parts[p].rows;
    }
    int64_t Kp = (K + KB - 1) / KB * KB;
    int64_t Mp = (M + 31) / 32 * 32, pr = panel_rows(Kp), panels = (N + pr - 1) / pr;
    uint16_t *xs = grown(&x_buf, &x_cap, Mp * Kp * 2);
    if (!xs) return -1;
    int failed = 0;
#pragma omp parallel reduction(| : failed)
    {
#pragma omp for schedule(static)
        for (int64_t m = 0; m < Mp; m++) pack_x_row(m < M ? x + m * K : NULL, m, K, xs);
        uint8_t *scratch = grown(&w_buf, &w_cap, pr * panel_stride(Kp) * 2 + Kp * 4 + 4096);
        failed = !scratch;
        if (scratch) pd_amx_tiles_configure();
        uint16_t *panel = (uint16_t *)scratch;
        float *f32 = (float *)(scratch + pr * panel_stride(Kp) * 2), *c = f32 + Kp;
#pragma omp for schedule(dynamic)
        for (int64_t q = 0; q < panels; q++) {
            if (!scratch) continue;
            int64_t j0 = q * pr;
            fill_panel(parts, row_bytes, j0, pr, N, K, f32, panel);
            for (int64_t m0 = 0; m0 < Mp; m0 += 32)
                for (int64_t s = 0; s < pr && j0 + s < N; s += 32) {
                    block(panel + s * panel_stride(Kp), xs, m0, Kp);
                    store_block(y, ldy, M, N, m0, j0 + s, c);
                }
        }
        if (scratch) _tile_release();
    }
    return failed ? -1 : 0;
}
#endif
