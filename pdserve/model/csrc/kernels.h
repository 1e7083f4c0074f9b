/* The native CPU kernels: plain C (OpenMP), built into one shared library per instruction
 * set on first use and loaded with ctypes by pdserve/model/native.py. They cover what
 * PyTorch's CPU paths do slowly at decode time, where each step is small and memory-bound:
 *
 *   gemm.c           pd_linear_panels: y = x W^T (+ b) for decode-sized batches (1..64
 *                    rows) on weights packed in PANEL-column panels, fp32 or a lossless
 *                    compact format (the 4-/8-bit grids of GGUF weights).
 *   attention.c      pd_paged_decode_attn: one query token per sequence against its paged
 *                    K/V, read in place from the cache blocks, GQA heads sharing each read;
 *                    optionally each block's attention probability (token dropping).
 *   elementwise.c    pd_rmsnorm, pd_add_rmsnorm, pd_rope_qkv_store, pd_silu_mul: the rest
 *                    of a decoder layer, one call each where PyTorch dispatches 5-10 small
 *                    ops; pd_argmax_rows for greedy sampling.
 *   decode_layers.c  pd_decode_layers: every decoder layer of a decode-only step in one call.
 *
 * fp32 throughout; OpenMP is the libgomp PyTorch loaded, so one thread pool. The same
 * sources build twice (docs/cpu-kernels.md): with -mavx2 -mfma the vectors below are 8
 * floats wide, with -mavx512f ... (__AVX512F__ defined) 16, and the kernels are written
 * against this header's `vf` operations, so both builds share every line of them. A panel
 * row is three vectors in either build (24 or 48 columns). */
#ifndef PDSERVE_KERNELS_H
#define PDSERVE_KERNELS_H

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Q6_K [ql128, qh64, int8 sc16, d]: half h of a block's four 32-value groups, each 6-bit value
 * (0..63) in a byte: group k's low nibbles from ql + 64 h + 32 (k & 1), shifted by 4 (k >> 1),
 * and two bits from qh + 32 h shifted by 2 k. Shared by the int8 dot (quant_dot.c) and the
 * store to fp32 (quant_gemm.c). */
static inline __attribute__((always_inline)) void q6_k_half(const uint8_t *b, int h, __m256i q[4]) {
    const __m256i m4 = _mm256_set1_epi8(15), m2 = _mm256_set1_epi8(0x30);
    __m256i l0 = _mm256_loadu_si256((const __m256i *)(b + 64 * h));
    __m256i l1 = _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32));
    __m256i hh = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
    q[0] = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_and_si256(_mm256_slli_epi16(hh, 4), m2));
    q[1] = _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_and_si256(_mm256_slli_epi16(hh, 2), m2));
    q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), _mm256_and_si256(hh, m2));
    q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                           _mm256_and_si256(_mm256_srli_epi16(hh, 2), m2));
}

#ifdef __AVX512F__
#define VW 16
typedef __m512 vf;
typedef __m512i vi;
#define vzero _mm512_setzero_ps
#define vset1 _mm512_set1_ps
#define vload _mm512_loadu_ps
#define vstore _mm512_storeu_ps
#define vadd _mm512_add_ps
#define vsub _mm512_sub_ps
#define vmul _mm512_mul_ps
#define vdiv _mm512_div_ps
#define vmax _mm512_max_ps
#define vmin _mm512_min_ps
#define vfmadd _mm512_fmadd_ps
#define vfnmadd _mm512_fnmadd_ps
#define vhsum _mm512_reduce_add_ps
#define vround(x) _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define vcvt_i32 _mm512_cvtps_epi32
#define vcvt_f32 _mm512_cvtepi32_ps
#define vi_set1 _mm512_set1_epi32
#define vi_add _mm512_add_epi32
#define vi_slli _mm512_slli_epi32
#define vcast_f32 _mm512_castsi512_ps
/* Bit i set where lane i of a `pred` b holds. */
#define vcmp_bits(a, b, pred) ((int)_mm512_cmp_ps_mask(a, b, pred))
static inline __mmask16 tail_mask(int64_t n) { return (__mmask16)((1u << n) - 1); }
/* The first n (< VW) lanes; the rest read as 0 and are not written. */
static inline vf vload_n(const float *p, int64_t n) { return _mm512_maskz_loadu_ps(tail_mask(n), p); }
static inline void vstore_n(float *p, vf v, int64_t n) { _mm512_mask_storeu_ps(p, tail_mask(n), v); }
/* The low and high 8 lanes added: a 16-lane partial sum folded onto 8. */
static inline __m256 vfold8(vf v) {
    return _mm256_add_ps(_mm512_castps512_ps256(v),
                         _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}
/* 4-bit values q[0..16) as exact floats: 16 nibbles in two 32-bit words, lane 2j in bits
 * 4j..4j+3 of the first, lane 2j+1 in those of the second (the PD_Q4A layout of 48-column
 * panels, gemm.c): one 64-bit broadcast, no lane insert; each lane's nibble shifted to its
 * low bits, where a permute (which reads only the low 4 bits of an index) looks up
 * 0.f..15.f: two vector ops where mask and convert took three. */
static inline vf vnibbles(const uint32_t *q) {
    int64_t pair;
    __builtin_memcpy(&pair, q, sizeof pair);
    vi shifts = _mm512_setr_epi32(0, 0, 4, 4, 8, 8, 12, 12, 16, 16, 20, 20, 24, 24, 28, 28);
    vf values = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    return _mm512_permutexvar_ps(_mm512_srlv_epi32(_mm512_set1_epi64(pair), shifts), values);
}
static inline vi vbytes(const int8_t *q) { return _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q)); }
#else
#define VW 8
typedef __m256 vf;
typedef __m256i vi;
#define vzero _mm256_setzero_ps
#define vset1 _mm256_set1_ps
#define vload _mm256_loadu_ps
#define vstore _mm256_storeu_ps
#define vadd _mm256_add_ps
#define vsub _mm256_sub_ps
#define vmul _mm256_mul_ps
#define vdiv _mm256_div_ps
#define vmax _mm256_max_ps
#define vmin _mm256_min_ps
#define vfmadd _mm256_fmadd_ps
#define vfnmadd _mm256_fnmadd_ps
#define vround(x) _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define vcvt_i32 _mm256_cvtps_epi32
#define vcvt_f32 _mm256_cvtepi32_ps
#define vi_set1 _mm256_set1_epi32
#define vi_add _mm256_add_epi32
#define vi_slli _mm256_slli_epi32
#define vcast_f32 _mm256_castsi256_ps
#define vcmp_bits(a, b, pred) _mm256_movemask_ps(_mm256_cmp_ps(a, b, pred))
static inline float vhsum(vf v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_hadd_ps(s, s);
    s = _mm_hadd_ps(s, s);
    return _mm_cvtss_f32(s);
}
static inline vi tail_mask(int64_t n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
static inline vf vload_n(const float *p, int64_t n) { return _mm256_maskload_ps(p, tail_mask(n)); }
static inline void vstore_n(float *p, vf v, int64_t n) { _mm256_maskstore_ps(p, tail_mask(n), v); }
static inline __m256 vfold8(vf v) { return v; }
static inline vf vnibbles(const uint32_t *q) {
    vi shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
    return vcvt_f32(_mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)q[0]), shifts),
                                     _mm256_set1_epi32(0xF)));
}
static inline vi vbytes(const int8_t *q) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)q)); }
#endif

/* Output columns per packed weight panel (native.py reads it back with pd_panel_width). */
#define PANEL (3 * VW)

/* The packed weight formats (gemm.c): fp32 panels, or the lossless compact blocks of 32 k.
 * PD_GGUF is no panel format: a pd_weight of that codec points to a pd_qlinear, GGUF weights
 * read in place (quant_gemm.c), which pd_decode_layers hands to pd_quant_linear; PD_GGUF_AMX
 * the same, above its gemv_m_max rows on AMX bf16 tiles (quant_amx.c). */
enum { PD_F32 = 0, PD_Q4A = 1, PD_Q8S = 2, PD_GGUF = 3, PD_GGUF_AMX = 4 };
#define QBLOCK 32
#define Q4A_BLOCK (24 * PANEL)
#define Q8S_BLOCK (36 * PANEL)

/* e^x lane by lane: x = n ln2 + r with |r| <= ln2/2, e^r by a degree-6 polynomial (the
 * classic Cephes expf coefficients), 2^n built in the exponent bits. Relative error ~2e-7,
 * like libm's expf, at a fraction of the cost of scalar calls. */
static inline vf vexp(vf x) {
    x = vmin(vmax(x, vset1(-87.3f)), vset1(88.3f));
    vf n = vround(vmul(x, vset1(1.44269504088896341f)));
    vf r = vfnmadd(n, vset1(0.693359375f), x);
    r = vfnmadd(n, vset1(-2.12194440e-4f), r);
    vf y = vset1(1.9875691500e-4f);
    y = vfmadd(y, r, vset1(1.3981999507e-3f));
    y = vfmadd(y, r, vset1(8.3334519073e-3f));
    y = vfmadd(y, r, vset1(4.1665795894e-2f));
    y = vfmadd(y, r, vset1(1.6666665459e-1f));
    y = vfmadd(y, r, vset1(5.0000001201e-1f));
    y = vfmadd(y, vmul(r, r), vadd(r, vset1(1.f)));
    vi e = vi_slli(vi_add(vcvt_i32(n), vi_set1(127)), 23);
    return vmul(y, vcast_f32(e));
}

static inline float dot(const float *a, const float *b, int64_t d) {
    vf acc = vzero();
    int64_t i = 0;
    for (; i + VW <= d; i += VW) acc = vfmadd(vload(a + i), vload(b + i), acc);
    if (i < d) acc = vfmadd(vload_n(a + i, d - i), vload_n(b + i, d - i), acc);
    return vhsum(acc);
}

static inline void axpy(float *y, float a, const float *x, int64_t d) {
    vf av = vset1(a);
    int64_t i = 0;
    for (; i + VW <= d; i += VW) vstore(y + i, vfmadd(av, vload(x + i), vload(y + i)));
    if (i < d) vstore_n(y + i, vfmadd(av, vload_n(x + i, d - i), vload_n(y + i, d - i)), d - i);
}

/* Threads only for work that repays waking them (a decode batch of 32, not of 1). */
#define PAR_IF(work) if ((work) > (1 << 14))

int pd_linear_panels(const float *x, const void *wp, int64_t codec, const float *bias, float *y,
                     int64_t M, int64_t N, int64_t K);
int pd_paged_decode_attn(const float *q, int64_t q_stride, const float *cache,
                         const int64_t *tables, const int64_t *context_lens, float *out,
                         float *scores, int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t BS,
                         int64_t max_blocks, float scale);
#ifdef __AMX_BF16__
/* From this many rows on, compact-panel GEMMs run on AMX tiles (gemm_amx.c). */
#ifndef AMX_M_MIN
#define AMX_M_MIN 16
#endif
int pd_amx_ready(void);
int pd_linear_panels_amx(const float *x, const void *wp, int64_t codec, const float *bias,
                         float *y, int64_t M, int64_t N, int64_t K);
#endif
void pd_rmsnorm(const float *x, const float *w, float *y, int64_t M, int64_t D, float eps);
void pd_add_rmsnorm(float *x, const float *add, const float *w, float *y, int64_t M, int64_t D,
                    float eps);
void pd_qk_norm(float *qkv, const float *q_w, const float *k_w, int64_t T, int64_t H,
                int64_t KVH, int64_t D, float eps);
void pd_rope_qkv_store(float *qkv, const float *cos, const float *sin, float *cache,
                       const int64_t *slot_blocks, const int64_t *slot_offsets, int64_t T,
                       int64_t H, int64_t KVH, int64_t D, int64_t BS);
void pd_silu_mul(const float *gate_up, float *y, int64_t M, int64_t I);
/* quant_gemm.c: GGUF weights in their own block layout. One weight of a fused linear
 * (native.PdQuantPart): its rows fill the next `rows` output columns, row j read from
 * rowmap[j] (rowmap != NULL, e.g. to undo llama.cpp's Q/K row order) or j. */
typedef struct {
    const void *w;
    int64_t type, rows;
    const int64_t *rowmap;
} pd_qpart;
/* A whole fused linear (native.PdQuantLinear): its parts [n], and the most rows a call takes
 * on pd_quant_linear before AMX tiles (PD_GGUF_AMX; QuantLinear.gemv_m_max). */
typedef struct {
    const pd_qpart *parts;
    int64_t n, gemv_m_max;
} pd_qlinear;
int pd_quant_linear(const float *x, int64_t M, int64_t K, const pd_qpart *parts, int64_t P,
                    float *y, int64_t ldy, int64_t int8_m_max);
int64_t pd_quant_row_bytes(int64_t type, int64_t K);
int pd_quant_row_f32(int64_t type, const void *row, float *out, int64_t K);
#ifdef __AMX_BF16__
int pd_quant_row_bf16(int64_t type, const void *row, uint16_t *out, int64_t K);
#endif
int pd_quant_block_type(int64_t type);
/* The address of row j of a fused weight (rows of `parts` one after another, part p's
 * `row_bytes[p]` bytes each), and its part in *p_out. */
static inline const uint8_t *pd_qrow(const pd_qpart *parts, const int64_t *row_bytes, int64_t j,
                                     int64_t *p_out) {
    int64_t p = 0, r = j;
    while (r >= parts[p].rows) r -= parts[p++].rows;
    if (parts[p].rowmap) r = parts[p].rowmap[r];
    *p_out = p;
    return (const uint8_t *)parts[p].w + r * row_bytes[p];
}
#ifdef __AMX_BF16__
/* gemm_amx.c: palette 1, eight 16x64-byte tiles, on the calling thread. */
void pd_amx_tiles_configure(void);
/* quant_amx.c: many rows against GGUF block weights on AMX bf16 tiles. */
int pd_quant_linear_amx(const float *x, int64_t M, int64_t K, const pd_qpart *parts, int64_t P,
                        float *y, int64_t ldy);
#endif
/* quant_dot.c: GGUF weight rows against int8-quantized activation rows. */
int pd_q8_dot_type(int64_t type, int64_t K);
int64_t pd_q8_row_bytes(int64_t K);
void pd_q8_quantize(const float *x, int64_t K, void *out);
void pd_q8_dot(int64_t type, const uint8_t *row, const void *xq, int64_t xqb, int64_t M,
               int64_t K, float *y, int64_t ldy);
/* Eight weight rows packed for many input rows (the AVX2 builds; elsewhere no type has it). */
int pd_q8_tile_type(int64_t type, int64_t K);
int64_t pd_q8_tile_bytes(int64_t K);
void pd_q8_tile_pack(int64_t type, const uint8_t *const *rows, int64_t G, int64_t K, uint8_t *out);
void pd_q8_tile_dot(int64_t type, const uint8_t *pack, int64_t G, const void *xq, int64_t xqb, int64_t M,
                    int64_t K, float *y);

#endif
