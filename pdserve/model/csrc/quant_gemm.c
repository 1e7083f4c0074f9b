/* ---- GGUF weights in their own block layout ------------------------------------------
 * y = x W^T for W [N, K] stored as a GGUF tensor stores it: each row K / QK blocks of one
 * ggml type, read in place (the caller maps the file). A row is dequantized to fp32 once
 * into a per-thread buffer (at most K floats: L1/L2) and multiplied with every input row,
 * so no fp32 copy of W ever exists and batch rows share each dequantization. Numerically
 * this is the `gguf` package's dequantize followed by a matmul, up to summation order.
 *
 * Block layouts (ggml's, as gguf/quants.py reads them; d/dmin/m are fp16):
 *   Q4_0 [d, qs16]            v_i = d (q_i - 8),   q_i = qs[i] & 15, q_{i+16} = qs[i] >> 4
 *   Q4_1 [d, m, qs16]         v_i = d q_i + m
 *   Q5_0 [d, qh32b, qs16]     q_i |= bit i of qh << 4,   v_i = d (q_i - 16)
 *   Q5_1 [d, m, qh32b, qs16]  v_i = d q_i + m
 *   Q8_0 [d, int8 qs32]       v_i = d qs_i
 *   Q4_K [d, dmin, sc12, qs128]         8 sub-blocks of 32, 6-bit scale/min each; chunk c
 *        of 32 bytes holds sub-block 2c in its low nibbles and 2c+1 in its high ones
 *   Q5_K [d, dmin, sc12, qh32, qs128]   Q4_K plus bit j of qh[i] as the 5th bit of
 *        sub-block j's value i
 *   Q6_K [ql128, qh64, int8 sc16, d]    16 sub-blocks of 16, v = d sc (q - 32)
 *   F32, F16, BF16                      one value per element
 * pd_quant_linear returns 0, or -1 for an unknown type or a failed allocation. */
#include "kernels.h"

enum {
    T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8,
    T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14, T_BF16 = 30,
};

static inline float h2f(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* Values per block and bytes per block of `type` (0 for a type not handled here). */
static void block_shape(int64_t type, int64_t *qk, int64_t *bytes) {
    switch (type) {
    case T_F32: *qk = 1, *bytes = 4; return;
    case T_F16: case T_BF16: *qk = 1, *bytes = 2; return;
    case T_Q4_0: *qk = 32, *bytes = 18; return;
    case T_Q4_1: *qk = 32, *bytes = 20; return;
    case T_Q5_0: *qk = 32, *bytes = 22; return;
    case T_Q5_1: *qk = 32, *bytes = 24; return;
    case T_Q8_0: *qk = 32, *bytes = 34; return;
    case T_Q4_K: *qk = 256, *bytes = 144; return;
    case T_Q5_K: *qk = 256, *bytes = 176; return;
    case T_Q6_K: *qk = 256, *bytes = 210; return;
    default: *qk = 0, *bytes = 0;
    }
}

/* VW bytes widened to 32-bit lanes (zero-extended), and lane-wise integer helpers. */
#ifdef __AVX512F__
static inline vi vu8(const uint8_t *q) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)q)); }
#define vi_and _mm512_and_si512
#define vi_or _mm512_or_si512
#define vi_srli _mm512_srli_epi32
#define vi_srlv _mm512_srlv_epi32
static inline vi vi_iota(int first) {
    return _mm512_add_epi32(_mm512_set1_epi32(first),
                            _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
}
#else
static inline vi vu8(const uint8_t *q) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)q)); }
#define vi_and _mm256_and_si256
#define vi_or _mm256_or_si256
#define vi_srli _mm256_srli_epi32
#define vi_srlv _mm256_srlv_epi32
static inline vi vi_iota(int first) {
    return _mm256_add_epi32(_mm256_set1_epi32(first), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
#endif
/* Where dequantized values go: stored to the row buffer `base`, or (x != NULL: a single
 * input row) multiplied with x at the same offset into `acc` without being stored. */
typedef struct {
    int dot;      /* a constant where the row functions are inlined: no branch remains */
    intptr_t dx;  /* bytes from a position in the row buffer to the same one in x */
    vf acc;
} sink;

/* scale * q + bias for VW integer lanes q, at `out` (a position in the row buffer). */
static inline __attribute__((always_inline)) void vaffine(sink *s, vi q, float scale,
                                                          float bias, float *out) {
    vf v = vfmadd(vcvt_f32(q), vset1(scale), vset1(bias));
    if (s->dot) s->acc = vfmadd(v, vload((const float *)((const char *)out + s->dx)), s->acc);
    else vstore(out, v);
}

/* 16 bytes of nibbles: low ones to out[0..16), high ones to out[16..32). */
static inline __attribute__((always_inline)) void nibbles32(sink *s, const uint8_t *qs, float scale, float bias, float *out) {
    vi m15 = vi_set1(15);
    for (int i = 0; i < 16; i += VW) {
        vi q = vu8(qs + i);
        vaffine(s, vi_and(q, m15), scale, bias, out + i);
        vaffine(s, vi_srli(q, 4), scale, bias, out + 16 + i);
    }
}

static inline __attribute__((always_inline)) void row_q4_0(const uint8_t *b, float *out, int64_t nb, sink *s) {
    for (int64_t j = 0; j < nb; j++, b += 18, out += 32) {
        float d = h2f(b);
        nibbles32(s, b + 2, d, -8.f * d, out);
    }
}

static inline __attribute__((always_inline)) void row_q4_1(const uint8_t *b, float *out, int64_t nb, sink *s) {
    for (int64_t j = 0; j < nb; j++, b += 20, out += 32) nibbles32(s, b + 4, h2f(b), h2f(b + 2), out);
}

/* Q5_0 / Q5_1: `hdr` bytes of fp16 before the 32 high bits. */
static inline __attribute__((always_inline)) void row_q5(const uint8_t *b, float *out, int64_t nb, int has_min, sink *s) {
    int64_t hdr = has_min ? 4 : 2, bytes = hdr + 20;
    vi m15 = vi_set1(15), one = vi_set1(1);
    for (int64_t j = 0; j < nb; j++, b += bytes, out += 32) {
        uint32_t qh;
        memcpy(&qh, b + hdr, 4);
        const uint8_t *qs = b + hdr + 4;
        float d = h2f(b), bias = has_min ? h2f(b + 2) : -16.f * d;
        vi h = vi_set1((int)qh);
        for (int i = 0; i < 16; i += VW) { /* bit i of qh is value i's 5th bit */
            vi q = vu8(qs + i);
            vi hlo = vi_slli(vi_and(vi_srlv(h, vi_iota(i)), one), 4);
            vi hhi = vi_slli(vi_and(vi_srlv(h, vi_iota(i + 16)), one), 4);
            vaffine(s, vi_or(vi_and(q, m15), hlo), d, bias, out + i);
            vaffine(s, vi_or(vi_srli(q, 4), hhi), d, bias, out + 16 + i);
        }
    }
}

static inline __attribute__((always_inline)) void row_q8_0(const uint8_t *b, float *out, int64_t nb, sink *s) {
    for (int64_t j = 0; j < nb; j++, b += 34, out += 32) {
        float d = h2f(b);
        const int8_t *qs = (const int8_t *)(b + 2);
        for (int i = 0; i < 32; i += VW) vaffine(s, vbytes(qs + i), d, 0.f, out + i);
    }
}

/* The 6-bit scale and min of sub-block j of a Q4_K/Q5_K block (12 packed bytes). */
static inline void scale_min_k4(const uint8_t *s, int j, uint8_t *sc, uint8_t *m) {
    if (j < 4) {
        *sc = s[j] & 63, *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
        *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* Q4_K (qh NULL) or Q5_K. */
static inline __attribute__((always_inline)) void row_k45(const uint8_t *b, float *out, int64_t nb, int five, sink *s) {
    int64_t bytes = five ? 176 : 144;
    vi m15 = vi_set1(15), one = vi_set1(1);
    for (int64_t j = 0; j < nb; j++, b += bytes, out += 256) {
        float d = h2f(b), dmin = h2f(b + 2);
        const uint8_t *scales = b + 4, *qh = five ? b + 16 : NULL, *qs = b + (five ? 48 : 16);
        for (int c = 0; c < 4; c++) { /* sub-blocks 2c (low nibbles) and 2c + 1 (high) */
            uint8_t sc0, m0, sc1, m1;
            scale_min_k4(scales, 2 * c, &sc0, &m0);
            scale_min_k4(scales, 2 * c + 1, &sc1, &m1);
            float *o = out + 64 * c;
            for (int i = 0; i < 32; i += VW) {
                vi q = vu8(qs + 32 * c + i), lo = vi_and(q, m15), hi = vi_srli(q, 4);
                if (qh) {
                    vi h = vu8(qh + i);
                    lo = vi_or(lo, vi_slli(vi_and(vi_srli(h, 2 * c), one), 4));
                    hi = vi_or(hi, vi_slli(vi_and(vi_srli(h, 2 * c + 1), one), 4));
                }
                vaffine(s, lo, d * sc0, -dmin * m0, o + i);
                vaffine(s, hi, d * sc1, -dmin * m1, o + 32 + i);
            }
        }
    }
}

static inline __attribute__((always_inline)) void row_q6_k(const uint8_t *b, float *out, int64_t nb, sink *s) {
    vi m15 = vi_set1(15), m3 = vi_set1(3);
    for (int64_t j = 0; j < nb; j++, b += 210, out += 256) {
        const uint8_t *ql = b, *qh = b + 128;
        const int8_t *sc = (const int8_t *)(b + 192);
        float d = h2f(b + 208);
        for (int g = 0; g < 8; g++) { /* 32 values at 32 g: half h, group k of it */
            int h = g / 4, k = g % 4;
            const uint8_t *lo = ql + 64 * h + 32 * (k & 1), *hi = qh + 32 * h;
            for (int i = 0; i < 32; i += VW) {
                vi q = vi_and(vi_srli(vu8(lo + i), 4 * (k >> 1)), m15);
                q = vi_or(q, vi_slli(vi_and(vi_srli(vu8(hi + i), 2 * k), m3), 4));
                float ds = d * sc[(32 * g + i) / 16]; /* 16 values a scale */
                vaffine(s, q, ds, -32.f * ds, out + 32 * g + i);
            }
        }
    }
}

/* Q6_K to fp32 in the buffer (no dot product): each 32-value group's 6-bit values assembled
 * 32 at a time in byte ops (q6_k_half, as quant_dot.c), then widened VW at a time; ~2x fewer ops
 * than row_q6_k's per-lane assembly, which AMX tiles' panels (quant_amx.c) wait on. */
static inline __attribute__((always_inline)) void row_q6_k_store(const uint8_t *b, float *out, int64_t nb) {
    uint8_t q[128] __attribute__((aligned(32)));
    for (int64_t j = 0; j < nb; j++, b += 210, out += 256) {
        const int8_t *sc = (const int8_t *)(b + 192);
        float d = h2f(b + 208);
        for (int h = 0; h < 2; h++) { /* values 128 h + 32 k: group k of half h */
            __m256i g[4];
            q6_k_half(b, h, g);
            for (int k = 0; k < 4; k++) _mm256_store_si256((__m256i *)(q + 32 * k), g[k]);
            for (int i = 0; i < 128; i += VW) {
                float ds = d * sc[(128 * h + i) / 16]; /* 16 values a scale */
                vstore(out + 128 * h + i, vfmadd(vcvt_f32(vu8(q + i)), vset1(ds), vset1(-32.f * ds)));
            }
        }
    }
}

static void row_f16(const uint8_t *b, float *out, int64_t k) {
    const uint16_t *h = (const uint16_t *)b;
    int64_t i = 0;
    for (; i + 8 <= k; i += 8)
        _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
    for (; i < k; i++) out[i] = _cvtsh_ss(h[i]);
}

static void row_bf16(const uint8_t *b, float *out, int64_t k) {
    const uint16_t *h = (const uint16_t *)b;
    for (int64_t i = 0; i < k; i++) {
        uint32_t bits = (uint32_t)h[i] << 16;
        memcpy(out + i, &bits, 4);
    }
}

/* One row of K values of `type` to fp32 in `out`, or with `dot` (block types only) its dot
 * product with x, returned, nothing stored. Inlined into the two callers below, so each has
 * its own copy of every row function with `dot` a constant. */
static inline __attribute__((always_inline)) float dequant_row_any(
    int64_t type, const uint8_t *row, float *out, int64_t K, const float *x, int dot) {
    sink snk = {dot, (intptr_t)x - (intptr_t)out, vzero()}, *s = &snk;
    switch (type) {
    case T_F32: memcpy(out, row, K * sizeof(float)); break;
    case T_F16: row_f16(row, out, K); break;
    case T_BF16: row_bf16(row, out, K); break;
    case T_Q4_0: row_q4_0(row, out, K / 32, s); break;
    case T_Q4_1: row_q4_1(row, out, K / 32, s); break;
    case T_Q5_0: row_q5(row, out, K / 32, 0, s); break;
    case T_Q5_1: row_q5(row, out, K / 32, 1, s); break;
    case T_Q8_0: row_q8_0(row, out, K / 32, s); break;
    case T_Q4_K: row_k45(row, out, K / 256, 0, s); break;
    case T_Q5_K: row_k45(row, out, K / 256, 1, s); break;
    case T_Q6_K:
        if (dot) row_q6_k(row, out, K / 256, s);
        else row_q6_k_store(row, out, K / 256);
        break;
    }
    return dot ? vhsum(snk.acc) : 0.f;
}

static void dequant_row(int64_t type, const uint8_t *row, float *out, int64_t K) {
    dequant_row_any(type, row, out, K, out, 0);
}

/* x . row for the block types; `buf` (K floats) only anchors the offsets, nothing is stored. */
static float dequant_row_dot(int64_t type, const uint8_t *row, float *buf, int64_t K,
                             const float *x) {
    return dequant_row_any(type, row, buf, K, x, 1);
}

/* Whether dequant_row_dot can take for `type` (the block types; not F32/F16/BF16). */
static inline int fuses(int64_t type) { return type != T_F32 && type != T_F16 && type != T_BF16; }

/* Row `row` of a `type` weight to fp32 (quant_amx.c's tiles start from it); 0, or -1 for a
 * type not handled. */
int pd_quant_row_f32(int64_t type, const void *row, float *out, int64_t K) {
    if (pd_quant_row_bytes(type, K) < 0) return -1;
    dequant_row(type, (const uint8_t *)row, out, K);
    return 0;
}

#ifdef __AMX_BF16__
/* ---- rows straight to bf16, for the AMX tiles' panels (quant_amx.c) ------------------
 * A tile call of 17-64 rows dequantizes every weight once per call, and that is most of its
 * time: each value is computed as dequant_row computes it (the same fp32 FMA) and rounded to
 * bf16 in registers, where the fp32 row buffer's store, reload and masked conversion took
 * about as long again. Same bf16 values as pd_quant_row_f32 then rounding (tested). */

/* lo and hi (16 fp32 each) rounded to nearest even bf16 at dst[0..16) and dst[16..32). */
static inline __attribute__((always_inline)) void store_bf16x32(uint16_t *dst, __m512 lo, __m512 hi) {
    _mm512_storeu_si512(dst, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
}

static inline __attribute__((always_inline)) __m512 affine16(__m512i q, float scale, float bias) {
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), _mm512_set1_ps(scale), _mm512_set1_ps(bias));
}

/* Q4_0 (bias -8 d) and Q4_1 (bias m): low nibbles to out[0..16), high ones to out[16..32). */
static void row_q4_bf16(const uint8_t *b, uint16_t *out, int64_t nb, int has_min) {
    const __m512i m15 = _mm512_set1_epi32(15);
    int64_t bytes = has_min ? 20 : 18;
    for (int64_t j = 0; j < nb; j++, b += bytes, out += 32) {
        float d = h2f(b), bias = has_min ? h2f(b + 2) : -8.f * d;
        __m512i q = vu8(b + (has_min ? 4 : 2));
        store_bf16x32(out, affine16(_mm512_and_si512(q, m15), d, bias),
                      affine16(_mm512_srli_epi32(q, 4), d, bias));
    }
}

static void row_q8_0_bf16(const uint8_t *b, uint16_t *out, int64_t nb) {
    for (int64_t j = 0; j < nb; j++, b += 34, out += 32) {
        float d = h2f(b);
        const int8_t *qs = (const int8_t *)(b + 2);
        store_bf16x32(out, affine16(vbytes(qs), d, 0.f), affine16(vbytes(qs + 16), d, 0.f));
    }
}

static void row_q4_k_bf16(const uint8_t *b, uint16_t *out, int64_t nb) {
    const __m512i m15 = _mm512_set1_epi32(15);
    for (int64_t j = 0; j < nb; j++, b += 144, out += 256) {
        float d = h2f(b), dmin = h2f(b + 2);
        for (int c = 0; c < 4; c++) { /* sub-blocks 2c (low nibbles) and 2c + 1 (high) */
            uint8_t sc0, m0, sc1, m1;
            scale_min_k4(b + 4, 2 * c, &sc0, &m0);
            scale_min_k4(b + 4, 2 * c + 1, &sc1, &m1);
            __m512i q0 = vu8(b + 16 + 32 * c), q1 = vu8(b + 16 + 32 * c + 16);
            float s0 = d * sc0, b0 = -dmin * m0, s1 = d * sc1, b1 = -dmin * m1;
            store_bf16x32(out + 64 * c, affine16(_mm512_and_si512(q0, m15), s0, b0),
                          affine16(_mm512_and_si512(q1, m15), s0, b0));
            store_bf16x32(out + 64 * c + 32, affine16(_mm512_srli_epi32(q0, 4), s1, b1),
                          affine16(_mm512_srli_epi32(q1, 4), s1, b1));
        }
    }
}

static void row_q6_k_bf16(const uint8_t *b, uint16_t *out, int64_t nb) {
    for (int64_t j = 0; j < nb; j++, b += 210, out += 256) {
        const int8_t *sc = (const int8_t *)(b + 192);
        float d = h2f(b + 208);
        for (int h = 0; h < 2; h++) { /* values 128 h + 32 k: group k of half h */
            __m256i g[4];
            q6_k_half(b, h, g);
            for (int k = 0; k < 4; k++) {
                float d0 = d * sc[(128 * h + 32 * k) / 16], d1 = d * sc[(128 * h + 32 * k) / 16 + 1];
                __m512i lo = _mm512_cvtepu8_epi32(_mm256_castsi256_si128(g[k]));
                __m512i hi = _mm512_cvtepu8_epi32(_mm256_extracti128_si256(g[k], 1));
                store_bf16x32(out + 128 * h + 32 * k, affine16(lo, d0, -32.f * d0),
                              affine16(hi, d1, -32.f * d1));
            }
        }
    }
}

/* Row `row` of K values of `type` as bf16 in `out`: 0, or -1 where `type` has no such
 * decoder here (the caller goes through pd_quant_row_f32) or K is not whole blocks. */
int pd_quant_row_bf16(int64_t type, const void *row, uint16_t *out, int64_t K) {
    if (pd_quant_row_bytes(type, K) < 0) return -1;
    const uint8_t *b = row;
    switch (type) {
    case T_Q4_0: row_q4_bf16(b, out, K / 32, 0); return 0;
    case T_Q4_1: row_q4_bf16(b, out, K / 32, 1); return 0;
    case T_Q8_0: row_q8_0_bf16(b, out, K / 32); return 0;
    case T_Q4_K: row_q4_k_bf16(b, out, K / 256); return 0;
    case T_Q6_K: row_q6_k_bf16(b, out, K / 256); return 0;
    default: return -1;
    }
}
#endif

/* Whether `type` is a block type (each value rounded to bf16 loses at most what int8
 * activations do: quant_amx.c). */
int pd_quant_block_type(int64_t type) {
    int64_t qk, bytes;
    block_shape(type, &qk, &bytes);
    return qk > 1;
}

/* Bytes of one K-value row of `type`, or -1 when the type is not handled or K is not a
 * whole number of its blocks. */
int64_t pd_quant_row_bytes(int64_t type, int64_t K) {
    int64_t qk, bytes;
    block_shape(type, &qk, &bytes);
    if (qk == 0 || K % qk) return -1;
    return K / qk * bytes;
}

/* out[i] = row r_i of W as fp32 [n, K], r_i = rows[i] (rows != NULL) or first + i. */
int pd_quant_rows(const void *w, int64_t type, int64_t K, const int64_t *rows, int64_t first,
                  int64_t n, float *out) {
    int64_t rb = pd_quant_row_bytes(type, K);
    if (rb < 0) return -1;
#pragma omp parallel for schedule(static) PAR_IF(n * K)
    for (int64_t i = 0; i < n; i++) {
        int64_t r = rows ? rows[i] : first + i;
        dequant_row(type, (const uint8_t *)w + r * rb, out + i * K, K);
    }
    return 0;
}

/* Bytes ahead of the row being read that each row's loop prefetches (whole rows: the row
 * that far ahead, in the first part's row size, in the thread's order, through the row map). A decode step streams every
 * weight from memory once, and on these VMs the hardware prefetcher leaves the integer dot
 * products waiting on it: 8192x2048, one thread, weights streamed from DRAM, Q4_K/Q6_K/Q8_0
 * took 1.4-1.7x less time with it (docs/cpu-kernels.md). */
#define PF_BYTES 4096


/* Rows of int8 activations per pass over the weights when more than this many take them
 * (QUANT_GEMV_M_MAX raised past 16, the kernels without AMX): K = 2048 takes ~6.7 KB a
 * quantized row, so 64 of them (~430 KB) stay in L2 while every weight row passes them. */
#ifndef Q8_M_BLOCK
#define Q8_M_BLOCK 64
#endif

/* Bytes of weight rows a thread claims at a time. Rows split statically wait at the region's
 * end for the slowest thread, and on a host whose cores also run the router, the client and
 * other processes, a preempted thread holds half the rows; claimed in chunks, the running
 * thread takes them over and the region waits for one chunk at most (~4 us of reading). */
#ifndef CLAIM_BYTES
#define CLAIM_BYTES (64 << 10)
#endif

/* Input rows a tile call takes at most: past the caches, the quantized rows that every group of
 * weight rows reads again stream from memory. Larger calls split into near-equal blocks, each
 * packing the weights again, every block over TILE_M_MIN rows (a row's result the same in any
 * call). Zen 3, 2048x8192, 2 threads, 2048 rows in one call took 1.39-1.44x the time of blocks
 * of 512 (Q8_0, Q4_K); blocks of 256 were 1.02-1.09x faster again, and the same at 512 rows. */
#ifndef TILE_M_BLOCK
#define TILE_M_BLOCK 256
#endif

/* Input rows from which Q4_K and Q6_K weights take the eight-row tiles (quant_dot.c, AVX2 builds): above
 * the 16 rows whose results the one-row kernel keeps identical in any batch. */
#ifndef TILE_M_MIN
#define TILE_M_MIN 17
#endif

/* What every row of one pd_quant_linear call shares. */
typedef struct {
    const float *x;
    const uint8_t *xq;
    int64_t xqb, M, K;
    const pd_qpart *flat;
    const int64_t *row_bytes, *dots;
    int64_t N, dist;
    const int64_t *cols;
    float *y;
    int64_t ldy;
} row_args;

/* y[m, col(j)] = x[m] . W[j] for every m, W[j] the j-th weight row in memory order; buf holds
 * K floats (the row dequantized). */
static void row_product(const row_args *a, int64_t j, float *buf) {
    int64_t p, pa, ahead = j + a->dist, col = a->cols ? a->cols[j] : j, M = a->M, K = a->K;
    const float *x = a->x;
    float *y = a->y;
    int64_t ldy = a->ldy, type;
    const uint8_t *row = pd_qrow(a->flat, a->row_bytes, j, &p);
    type = a->flat[p].type;
    if (a->dots[p]) { /* the integer kernels prefetch as they go (quant_dot.c) */
        pd_q8_dot(type, row, a->xq, a->xqb, M, K, y + col, ldy);
        return;
    }
    if (ahead < a->N) {
        const char *next = (const char *)pd_qrow(a->flat, a->row_bytes, ahead, &pa);
        for (int64_t o = 0; o < a->row_bytes[pa]; o += 64) _mm_prefetch(next + o, _MM_HINT_T0);
    }
    if (M == 1 && fuses(type)) { /* one input row: nothing stored */
        y[col] = dequant_row_dot(type, row, buf, K, x);
        return;
    }
    dequant_row(type, row, buf, K);
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) { /* four x rows per pass over buf */
        const float *x0 = x + m * K, *x1 = x0 + K, *x2 = x1 + K, *x3 = x2 + K;
        vf a0 = vzero(), a1 = vzero(), a2 = vzero(), a3 = vzero();
        int64_t k = 0;
        for (; k + VW <= K; k += VW) {
            vf wv = vload(buf + k);
            a0 = vfmadd(wv, vload(x0 + k), a0);
            a1 = vfmadd(wv, vload(x1 + k), a1);
            a2 = vfmadd(wv, vload(x2 + k), a2);
            a3 = vfmadd(wv, vload(x3 + k), a3);
        }
        float s[4] = {vhsum(a0), vhsum(a1), vhsum(a2), vhsum(a3)};
        for (; k < K; k++)
            for (int t = 0; t < 4; t++) s[t] += buf[k] * x[(m + t) * K + k];
        for (int t = 0; t < 4; t++) y[(m + t) * ldy + col] = s[t];
    }
    for (; m < M; m++) y[m * ldy + col] = dot(buf, x + m * K, K);
}

/* Groups of eight weight rows one tile call takes at most (pd_q8_tile_type). */
#define TILE_GROUPS_MAX 2

/* How many groups of eight rows from memory-order row j take the tiles together: up to the
 * part's type's most (pd_q8_tile_type: 2 for Q4_K and Q6_K, whose groups share each broadcast
 * of the activations, 1 for Q8_0) where rows j..j+8G-1 are one part's rows that take int8
 * activations, else 0. */
static int tile_groups(const row_args *a, int64_t j, int64_t end) {
    int64_t p, q;
    if (j % 8 || j + 8 > end) return 0;
    pd_qrow(a->flat, a->row_bytes, j, &p);
    int most = a->dots[p] ? pd_q8_tile_type(a->flat[p].type, a->K) : 0;
    if (!most) return 0;
    pd_qrow(a->flat, a->row_bytes, j + 7, &q);
    if (q != p) return 0;
    if (most < 2 || j % 16 || j + 16 > end) return 1; /* two groups start at a multiple of 16 */
    pd_qrow(a->flat, a->row_bytes, j + 15, &q);
    return q == p ? 2 : 1;
}

/* Rows j..j+8G-1 (tile_groups) packed into `pack` and taken against every input row at once. */
static void tile_product(const row_args *a, int64_t j, int G, uint8_t *pack, float *ty) {
    int64_t p, n = 8 * G;
    const uint8_t *rows[8 * TILE_GROUPS_MAX];
    for (int i = 0; i < n; i++) rows[i] = pd_qrow(a->flat, a->row_bytes, j + i, &p);
    pd_q8_tile_pack(a->flat[p].type, rows, G, a->K, pack);
    pd_q8_tile_dot(a->flat[p].type, pack, G, a->xq, a->xqb, a->M, a->K, ty);
    if (!a->cols) { /* adjacent outputs of each row stored at once (a row's line once) */
        for (int64_t m = 0; m < a->M; m++) memcpy(a->y + m * a->ldy + j, ty + m * n, n * sizeof(float));
        return;
    }
    for (int64_t m = 0; m < a->M; m++)
        for (int i = 0; i < n; i++) a->y[m * a->ldy + a->cols[j + i]] = ty[m * n + i];
}

/* The output column of each weight row in memory order (parts one after another), where a
 * part has a row map, else NULL (*failed set if it could not allocate). The rows are taken in
 * memory order and their results scattered: llama.cpp's Q/K order read through the map visits
 * every other row of a head and then the rest, which the prefetches do not follow (3B Q8_0,
 * 2 threads: the fused QKV took 1.37x the time of memory order). */
static int64_t *memory_order_columns(const pd_qpart *parts, int64_t P, int64_t N, int *failed) {
    int mapped = 0;
    for (int64_t p = 0; p < P; p++) mapped |= parts[p].rowmap != NULL;
    int64_t *cols = mapped ? malloc(N * sizeof(int64_t)) : NULL;
    if (mapped && !cols) *failed = 1;
    if (!cols) return NULL;
    for (int64_t p = 0, first = 0; p < P; first += parts[p++].rows)
        for (int64_t r = 0; r < parts[p].rows; r++)
            cols[first + (parts[p].rowmap ? parts[p].rowmap[r] : r)] = first + r;
    return cols;
}

/* y[m, j] (row stride ldy) = x[m] . W[j] for the rows W of `parts` [P] one after another;
 * x [M, K] contiguous. All output rows of all parts are split across the threads in one
 * parallel region; each thread dequantizes its rows once and takes every x row against each.
 * With M <= int8_m_max, the parts whose type has an integer dot product (quant_dot.c) take
 * each x row quantized to int8 once instead. */
int pd_quant_linear(const float *x, int64_t M, int64_t K, const pd_qpart *parts, int64_t P,
                    float *y, int64_t ldy, int64_t int8_m_max) {
    if (P < 1) return -1;
    /* tiles: some part takes the eight-row tiles; tile_all: every part does */
    int64_t N = 0, int8 = 0, tiles = 0, tile_all = 1, row_bytes[P], dots[P];
    for (int64_t p = 0; p < P; p++) {
        if ((row_bytes[p] = pd_quant_row_bytes(parts[p].type, K)) < 0) return -1;
        N += parts[p].rows;
        int8 |= dots[p] = M <= int8_m_max && pd_q8_dot_type(parts[p].type, K);
        int tiled = M >= TILE_M_MIN && dots[p] && pd_q8_tile_type(parts[p].type, K);
        tiles |= tiled, tile_all &= tiled;
    }
    /* int8 rows in near-equal blocks: a block's stay in L2 (the one-row kernel) or the caches
     * (the tiles: each block over TILE_M_BLOCK / 2 rows, each packing the weights again) */
    int64_t block = tile_all ? TILE_M_BLOCK : Q8_M_BLOCK;
    if (M > block && M <= int8_m_max) {
        int64_t blocks = (M + block - 1) / block;
        for (int64_t b = 0, m = 0; b < blocks; b++) {
            int64_t n = M * (b + 1) / blocks - m;
            if (pd_quant_linear(x + m * K, n, K, parts, P, y + m * ldy, ldy, int8_m_max)) return -1;
            m += n;
        }
        return 0;
    }
    int64_t xqb = pd_q8_row_bytes(K);
    uint8_t *xq = NULL;
    if (int8) {
        if (!(xq = aligned_alloc(64, M * xqb))) return -1;
        for (int64_t m = 0; m < M; m++) pd_q8_quantize(x + m * K, K, xq + m * xqb);
    }
    int64_t dist = (PF_BYTES + row_bytes[0] - 1) / row_bytes[0]; /* rows ahead to prefetch */
    int failed = 0;
    int64_t *cols = memory_order_columns(parts, P, N, &failed);
    if (failed) {
        free(xq);
        return -1;
    }
    pd_qpart flat[P]; /* the parts without their row maps: rows in memory order */
    for (int64_t p = 0; p < P; p++) flat[p] = parts[p], flat[p].rowmap = NULL;
    int64_t chunk = CLAIM_BYTES / row_bytes[0] > 0 ? CLAIM_BYTES / row_bytes[0] : 1;
    if (tiles) chunk = (chunk + 8 * TILE_GROUPS_MAX - 1) / (8 * TILE_GROUPS_MAX) * (8 * TILE_GROUPS_MAX);
    row_args a = {x, xq, xqb, M, K, flat, row_bytes, dots, N, dist, cols, y, ldy};
#pragma omp parallel PAR_IF(N * K)
    {
        float *buf = aligned_alloc(64, ((K * sizeof(float) + 63) / 64) * 64);
        uint8_t *pack = tiles ? aligned_alloc(64, (TILE_GROUPS_MAX * pd_q8_tile_bytes(K) + 63) / 64 * 64) : NULL;
        float *ty = tiles ? aligned_alloc(64, (M * 8 * TILE_GROUPS_MAX * sizeof(float) + 63) / 64 * 64) : NULL;
        int ok = buf && (!tiles || (pack && ty));
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t c = 0; c < (N + chunk - 1) / chunk; c++) {
            int64_t end = (c + 1) * chunk < N ? (c + 1) * chunk : N;
            for (int64_t j = c * chunk; ok && j < end; j++) {
                int G = tiles ? tile_groups(&a, j, end) : 0;
                if (G) {
                    tile_product(&a, j, G, pack, ty);
                    j += 8 * G - 1;
                } else {
                    row_product(&a, j, buf);
                }
            }
        }
        free(buf);
        free(pack);
        free(ty);
    }
    free(cols);
    free(xq);
    return failed ? -1 : 0;
}
