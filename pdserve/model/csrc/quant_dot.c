/* ---- Integer dot products of GGUF weight rows with int8 activations ------------------
 * For few input rows (decode), pd_quant_linear (quant_gemm.c) quantizes each input row once
 * per call to int8 and takes every weight row against it with 8-bit integer multiplies
 * (`maddubs`: 32 u8 x s8 products summed in pairs, `madd`: pairs of those summed into 32-bit
 * lanes, with a sub-block's scale as the second factor), converting to float once per block.
 * Dequantizing to fp32 and multiplying with fp32 activations spends ~10 vector ops per 8 or
 * 16 values and is bound by them; this spends ~2 per 32 values and is bound by the bytes read.
 *
 * One quantized activation row (pd_q8_row_bytes), each part 64-byte aligned:
 *   q256 int8 [K]    per 256 values: d = max|x| / 127, q = round-to-nearest-even(x * 127/max)
 *   q32  int8 [K]    the same per 32 values
 *   d256 f32 [K/256], d32 f32 [K/32], bsum int16 [K/16] (sum of each 16 q256 values)
 *   sum32 int16 [K/32] (sum of each 32 q32 values), bsum32 int16 [K/32] (of each 32 q256 values)
 *   q4k  int8 [K]    q256 with each 128 values' 32-value quarters in the order 0, 2, 1, 3:
 *                    the order in which 64 bytes of Q4_K nibbles hold their values (below)
 * The 256-value form serves the K-quants (their scales multiply integer sub-block sums; a
 * min or an offset is one multiply by the bsums), the 32-value form Q8_0, whose own scale
 * changes every 32 values. Every |x - q d| <= d / 2, so a weight row's dot product moves by
 * at most sum |w_i| d / 2 over each block (tests/model/test_quant_linear.py). The code is
 * AVX2 (`maddubs`, `madd`), with 512-bit forms of the kernels in the AVX-512 builds; the VNNI
 * builds (avx512vnni and amx: AVX512_VNNI; avx2vnni: AVX-VNNI, the same instructions
 * VEX-encoded, 256-bit only) fuse madd and its add into `vpdpwssd`, and maddubs + madd by ones
 * into `vpdpbusd`: the same integers, so bit-identical to the builds without VNNI. */
#include "kernels.h"

enum { Q8_0 = 8, Q4_K = 12, Q6_K = 14 };

static inline int64_t up64(int64_t n) { return (n + 63) / 64 * 64; }

/* Whether `type` has an integer dot product with K-value rows. */
int pd_q8_dot_type(int64_t type, int64_t K) {
    if (type == Q8_0) return K % 32 == 0;
    return (type == Q4_K || type == Q6_K) && K % 256 == 0;
}

int64_t pd_q8_row_bytes(int64_t K) {
    return 3 * up64(K) + up64(K / 256 * 4) + up64(K / 32 * 4) + up64(K / 16 * 2) + 2 * up64(K / 32 * 2);
}

typedef struct {
    int8_t *q256, *q32;
    float *d256, *d32;
    int16_t *bsum, *sum32, *bsum32;
    int8_t *q4k;
} q8row;

static q8row q8_parts(void *base, int64_t K) {
    char *p = base;
    q8row r;
    r.q256 = (int8_t *)p, p += up64(K);
    r.q32 = (int8_t *)p, p += up64(K);
    r.d256 = (float *)p, p += up64(K / 256 * 4);
    r.d32 = (float *)p, p += up64(K / 32 * 4);
    r.bsum = (int16_t *)p, p += up64(K / 16 * 2);
    r.sum32 = (int16_t *)p, p += up64(K / 32 * 2);
    r.bsum32 = (int16_t *)p, p += up64(K / 32 * 2);
    r.q4k = (int8_t *)p;
    return r;
}

/* n (a multiple of 8) values of x to int8 with one scale, stored to *d. */
static void quantize_block(const float *x, int64_t n, int8_t *q, float *d) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 amax = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 8) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)));
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    float mx = _mm_cvtss_f32(m);
    *d = mx / 127.f;
    __m256 id = _mm256_set1_ps(mx > 0.f ? 127.f / mx : 0.f);
    for (int64_t i = 0; i < n; i += 8) {
        __m256i v = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i), id));
        __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
        _mm_storel_epi64((__m128i *)(q + i), _mm_packs_epi16(w, w));
    }
}

/* x [K] (K a multiple of 32) to its quantized row at `out` (pd_q8_row_bytes(K) bytes). */
void pd_q8_quantize(const float *x, int64_t K, void *out) {
    q8row r = q8_parts(out, K);
    for (int64_t b = 0; b < K / 32; b++) {
        quantize_block(x + 32 * b, 32, r.q32 + 32 * b, r.d32 + b);
        int sum = 0;
        for (int i = 0; i < 32; i++) sum += r.q32[32 * b + i];
        r.sum32[b] = (int16_t)sum;
    }
    for (int64_t b = 0; b < K / 256; b++) quantize_block(x + 256 * b, 256, r.q256 + 256 * b, r.d256 + b);
    for (int64_t s = 0; s < K / 256 * 16; s++) {
        int sum = 0;
        for (int i = 0; i < 16; i++) sum += r.q256[16 * s + i];
        r.bsum[s] = (int16_t)sum;
    }
    for (int64_t b = 0; b < K / 32; b++) r.bsum32[b] = (int16_t)(r.bsum[2 * b] + r.bsum[2 * b + 1]);
    static const int quarter[4] = {0, 2, 1, 3};
    for (int64_t i = 0; i < K; i += 32)
        memcpy(r.q4k + i, r.q256 + (i & ~127) + 32 * quarter[(i >> 5) & 3], 32);
}

static inline float fp16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* acc + a . b in 16-bit pairs (madd), as one vpdpwssd where the build has VNNI: the same
 * integers, wrapping alike, so results are bit-identical either way. dot4_256(u, s): sums of
 * 4 u8 x s8 products in 32-bit lanes, vpdpbusd, or maddubs (exact where no pair of products
 * passes 16 bits: |u| <= 128, |s| <= 127) and madd by ones. */
#if defined(__AVX512VNNI__)
#define madd_acc512(acc, a, b) _mm512_dpwssd_epi32(acc, a, b)
#define madd_acc256(acc, a, b) _mm256_dpwssd_epi32(acc, a, b)
#define dot4_256(u, s) _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s)
#elif defined(__AVXVNNI__)
#define madd_acc256(acc, a, b) _mm256_dpwssd_avx_epi32(acc, a, b)
#define dot4_256(u, s) _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s)
#else
#define madd_acc512(acc, a, b) _mm512_add_epi32(acc, _mm512_madd_epi16(a, b))
#define madd_acc256(acc, a, b) _mm256_add_epi32(acc, _mm256_madd_epi16(a, b))
#define dot4_256(u, s) _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1))
#endif

static inline __m256i ld(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }

static inline int u16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return h;
}

/* Bytes ahead of the block being read that the kernels prefetch, the lines of one block per
 * block: a decode step streams every weight from memory once, and a prefetch spread over the
 * arithmetic keeps the loads in flight while it runs, where a whole row's lines asked for at
 * once stall it on the fill buffers (K-quant rows of 2048 values streamed from DRAM, 2
 * threads: ~15% less time than a row prefetched ahead; docs/cpu-kernels.md). A prefetch never
 * faults, so the lines past a tensor's end cost nothing but the read. */
#define DOT_PF_BYTES 4096
static inline __attribute__((always_inline)) void prefetch_ahead(const uint8_t *b, int block_bytes) {
    const char *p = (const char *)b + DOT_PF_BYTES; /* gcc drops a loop of prefetches */
    _mm_prefetch(p, _MM_HINT_T0);
    if (block_bytes > 64) _mm_prefetch(p + 64, _MM_HINT_T0);
    if (block_bytes > 128) _mm_prefetch(p + 128, _MM_HINT_T0);
    if (block_bytes > 192) _mm_prefetch(p + 192, _MM_HINT_T0);
}

static inline float hsum_ps(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* Each kernel takes one weight row against R <= ROWS_MAX activation rows at once: the weight's
 * bytes are unpacked once (nibbles, high bits, scales) and every row's products taken from the
 * same registers. Row r's arithmetic is the same whatever R is (its own accumulators, in the
 * same order), so a row's result does not depend on the batch it is in. The kernels are
 * inlined with R a constant (q8_dot_rows), so the per-row arrays stay in registers. */
#define ROWS_MAX 4
#define ROWS_INLINE static inline __attribute__((always_inline))

/* Q8_0 [d, int8 qs32] against the 32-value form: |w| times x with w's sign, so the
 * unsigned-by-signed multiply takes two signed operands. A block is little work beside the
 * FMA's latency, so even and odd blocks sum in two chains (one input row streaming 71 MB: 1.03x,
 * hot in cache 1.10x; Zen 3, 2 threads). */
ROWS_INLINE void dot_q8_0(const uint8_t *b, const q8row *x, int R, int64_t nb, float *out) {
    __m256 acc[2][ROWS_MAX]; /* blocks 2i and 2i + 1: two chains of FMAs, not one */
    for (int r = 0; r < R; r++) acc[0][r] = acc[1][r] = _mm256_setzero_ps();
    for (int64_t j = 0; j < nb; j += 2) {
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            if (j + h == nb) break;
            const uint8_t *bh = b + 34 * (j + h);
            prefetch_ahead(bh, 34);
            __m256i w = ld(bh + 2), aw = _mm256_sign_epi8(w, w);
            float d = fp16(bh);
            for (int r = 0; r < R; r++) {
                __m256i sx = _mm256_sign_epi8(ld(x[r].q32 + 32 * (j + h)), w);
                __m256 s = _mm256_cvtepi32_ps(dot4_256(aw, sx)); /* |w| <= 128, |x| <= 127 */
                acc[h][r] = _mm256_fmadd_ps(s, _mm256_set1_ps(d * x[r].d32[j + h]), acc[h][r]);
            }
        }
    }
    for (int r = 0; r < R; r++) out[r] = hsum_ps(_mm256_add_ps(acc[0][r], acc[1][r]));
}

/* The 8 scales and 8 mins of a Q4_K block's 12 packed bytes, as bytes, by 32-bit word ops
 * (kept in registers: byte stores read back as one vector would stall store forwarding). */
static inline void scales_mins_k4(const uint8_t *s, uint64_t *sc, uint64_t *mn) {
    uint32_t u[3];
    memcpy(u, s, 12);
    const uint32_t m6 = 0x3f3f3f3f, m4 = 0x0f0f0f0f, m2 = 0x03030303;
    *sc = (u[0] & m6) | (uint64_t)((u[2] & m4) | (((u[0] >> 6) & m2) << 4)) << 32;
    *mn = (u[1] & m6) | (uint64_t)(((u[2] >> 4) & m4) | (((u[1] >> 6) & m2) << 4)) << 32;
}

#ifndef __AVX512BW__
/* Q4_K [d, dmin, sc12, qs128]: value = d sc_j q - dmin m_j over sub-block j of 32; chunk c
 * of qs holds sub-block 2c in its low nibbles and 2c + 1 in its high ones. */
ROWS_INLINE void dot_q4_k(const uint8_t *b, const q8row *x, int R, int64_t nb, float *out) {
    __m256 acc[ROWS_MAX], mins[ROWS_MAX];
    for (int r = 0; r < R; r++) acc[r] = mins[r] = _mm256_setzero_ps();
    const __m256i m4 = _mm256_set1_epi8(15);
    for (int64_t j = 0; j < nb; j++, b += 144) {
        prefetch_ahead(b, 144);
        const uint8_t *qs = b + 16;
        uint64_t sc, mn;
        scales_mins_k4(b + 4, &sc, &mn);
        __m256i isum[ROWS_MAX];
        for (int r = 0; r < R; r++) isum[r] = _mm256_setzero_si256();
        for (int c = 0; c < 4; c++) {
            __m256i q = ld(qs + 32 * c);
            __m256i lo = _mm256_and_si256(q, m4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
            __m256i slo = _mm256_set1_epi16((short)((sc >> 16 * c) & 0xff));
            __m256i shi = _mm256_set1_epi16((short)((sc >> (16 * c + 8)) & 0xff));
            for (int r = 0; r < R; r++) {
                const int8_t *xq = x[r].q256 + 256 * j + 64 * c;
                isum[r] = madd_acc256(isum[r], _mm256_maddubs_epi16(lo, ld(xq)), slo);
                isum[r] = madd_acc256(isum[r], _mm256_maddubs_epi16(hi, ld(xq + 32)), shi);
            }
        }
        /* each min twice against the 16 bsums: min_k (bsum_2k + bsum_2k+1) in lane k */
        __m128i mn8 = _mm_cvtsi64_si128((long long)mn);
        __m256i mnv = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(mn8, mn8));
        float d = fp16(b), dmin = fp16(b + 2);
        for (int r = 0; r < R; r++) {
            __m256i msum = _mm256_madd_epi16(mnv, ld(x[r].bsum + 16 * j));
            float dx = x[r].d256[j];
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_set1_ps(d * dx), acc[r]);
            mins[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(msum), _mm256_set1_ps(dmin * dx), mins[r]);
        }
    }
    for (int r = 0; r < R; r++) out[r] = hsum_ps(acc[r]) - hsum_ps(mins[r]);
}

/* Q6_K [ql128, qh64, int8 sc16, d]: value = d sc_i (q - 32) over sub-block i of 16, q the
 * low nibble of ql (or its high one) with two bits of qh above it; 32 values at 32 g (half
 * h = g / 4, k = g % 4) as q6_k_half (kernels.h) assembles them. The -32 is one integer
 * multiply by the bsums. */
ROWS_INLINE void dot_q6_k(const uint8_t *b, const q8row *x, int R, int64_t nb, float *out) {
    __m256 acc[ROWS_MAX];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t j = 0; j < nb; j++, b += 210) {
        prefetch_ahead(b, 210);
        const int8_t *sc = (const int8_t *)(b + 192);
        __m256i isum[ROWS_MAX];
        for (int r = 0; r < R; r++) isum[r] = _mm256_setzero_si256();
        for (int h = 0; h < 2; h++) {
            __m256i q[4];
            q6_k_half(b, h, q);
            for (int k = 0; k < 4; k++) {
                int g = 4 * h + k;
                __m256i s = _mm256_set_m128i(_mm_set1_epi16(sc[2 * g + 1]), _mm_set1_epi16(sc[2 * g]));
                for (int r = 0; r < R; r++) {
                    __m256i p = _mm256_maddubs_epi16(q[k], ld(x[r].q256 + 256 * j + 32 * g));
                    isum[r] = madd_acc256(isum[r], p, s);
                }
            }
        }
        float d = fp16(b + 208);
        __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)sc));
        for (int r = 0; r < R; r++) { /* - 32 sc_i bsum_i, spread over 8 lanes */
            __m256i off = _mm256_madd_epi16(sc16, ld(x[r].bsum + 16 * j));
            __m256i v = _mm256_sub_epi32(isum[r], _mm256_slli_epi32(off, 5));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), _mm256_set1_ps(d * x[r].d256[j]), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) out[r] = hsum_ps(acc[r]);
}

#else
/* The AVX-512 build: the same integer steps 64 values a vector, two vectors at once: their sums
 * of 4 products packed to 16 bits, each 16-bit lane's scale picked from the block's scales by
 * a permute. */

/* Sums of 4 u8 x s8 products in 32-bit lanes: vpdpbusd, or maddubs (|u| <= 128, |s| <= 127:
 * no pair saturates) and madd by ones; the same integers either way. */
static inline __m512i dot4_u8s8(__m512i u, __m512i s) {
#ifdef __AVX512VNNI__
    return _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, s);
#else
    return _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1));
#endif
}

/* Q4_K, 128 values a step: 64 bytes of qs (chunks 2p, 2p + 1) hold sub-blocks 4p and 4p + 2 in
 * their low nibbles, 4p + 1 and 4p + 3 in their high ones, which q4k's order matches. Each
 * half's sums of 4 (at most 4 * 15 * 127) packed to 16 bits (packs interleaves the two per
 * 128-bit lane: sub-blocks 4p | 4p + 1 in lanes 0-1, 4p + 2 | 4p + 3 in lanes 2-3) and
 * multiplied by their scales in one madd: a multiply per 8 products where maddubs took one
 * per 2. */
ROWS_INLINE void dot_q4_k(const uint8_t *b, const q8row *x, int R, int64_t nb, float *out) {
    __m512 acc[ROWS_MAX];
    __m256 mins[ROWS_MAX];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps(), mins[r] = _mm256_setzero_ps();
    const __m512i m4 = _mm512_set1_epi8(15);
    __m512i pick[2];
    for (int p = 0; p < 2; p++) {
        uint16_t idx[32];
        for (int i = 0; i < 32; i++) idx[i] = (uint16_t)(4 * p + (i / 8 >= 2 ? 2 : 0) + (i % 8) / 4);
        pick[p] = _mm512_loadu_si512(idx);
    }
    for (int64_t j = 0; j < nb; j++, b += 144) {
        prefetch_ahead(b, 144);
        const uint8_t *qs = b + 16;
        uint64_t sc, mn;
        scales_mins_k4(b + 4, &sc, &mn);
        __m512i scv = _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)sc)));
        __m512i isum[ROWS_MAX];
        for (int r = 0; r < R; r++) isum[r] = _mm512_setzero_si512();
        for (int p = 0; p < 2; p++) {
            __m512i q = _mm512_loadu_si512(qs + 64 * p);
            __m512i lo = _mm512_and_si512(q, m4), hi = _mm512_and_si512(_mm512_srli_epi16(q, 4), m4);
            __m512i s = _mm512_permutexvar_epi16(pick[p], scv);
            for (int r = 0; r < R; r++) {
                const int8_t *xq = x[r].q4k + 256 * j + 128 * p;
                __m512i a = dot4_u8s8(lo, _mm512_loadu_si512(xq));
                __m512i h = dot4_u8s8(hi, _mm512_loadu_si512(xq + 64));
                isum[r] = madd_acc512(isum[r], _mm512_packs_epi32(a, h), s);
            }
        }
        /* each min twice against the 16 bsums: min_k (bsum_2k + bsum_2k+1) in lane k */
        __m128i mn8 = _mm_cvtsi64_si128((long long)mn);
        __m256i mnv = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(mn8, mn8));
        uint32_t dpair; /* d and dmin converted together, each times dx in one multiply */
        memcpy(&dpair, b, 4);
        __m128 dd = _mm_cvtph_ps(_mm_cvtsi32_si128((int)dpair));
        for (int r = 0; r < R; r++) {
            __m256i msum = _mm256_madd_epi16(mnv, ld(x[r].bsum + 16 * j));
            __m128 s = _mm_mul_ps(dd, _mm_set1_ps(x[r].d256[j]));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), _mm512_broadcastss_ps(s), acc[r]);
            mins[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(msum), _mm256_broadcastss_ps(_mm_movehdup_ps(s)), mins[r]);
        }
    }
    for (int r = 0; r < R; r++) out[r] = _mm512_reduce_add_ps(acc[r]) - hsum_ps(mins[r]);
}

/* Q6_K, 128 values (half h) a step: the sums of 4 of groups 0-1 and 2-3 (at most 4 * 63 * 127)
 * packed, so 128-bit lane k holds sub-blocks 8h + k and 8h + 4 + k. */
ROWS_INLINE void dot_q6_k(const uint8_t *b, const q8row *x, int R, int64_t nb, float *out) {
    __m512 acc[ROWS_MAX];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    const __m512i m4 = _mm512_set1_epi8(15), m2 = _mm512_set1_epi8(0x30);
    /* high bits to bits 4-5: groups k = 0 | 1 shift qh left by 4 | 2, k = 2 | 3 right by 0 | 2 */
    const __m512i left = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
    const __m512i right = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
    __m512i pick[2];
    for (int h = 0; h < 2; h++) {
        uint16_t idx[32];
        for (int i = 0; i < 32; i++) idx[i] = (uint16_t)(8 * h + i / 8 + 4 * ((i % 8) / 4));
        pick[h] = _mm512_loadu_si512(idx);
    }
    for (int64_t j = 0; j < nb; j++, b += 210) {
        prefetch_ahead(b, 210);
        const uint8_t *ql = b, *qh = b + 128;
        const int8_t *sc = (const int8_t *)(b + 192);
        __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)sc));
        __m512i scv = _mm512_castsi256_si512(sc16);
        __m512i isum[ROWS_MAX];
        for (int r = 0; r < R; r++) isum[r] = _mm512_setzero_si512();
        for (int h = 0; h < 2; h++) {
            __m512i l = _mm512_loadu_si512(ql + 64 * h), hh = _mm512_broadcast_i64x4(ld(qh + 32 * h));
            /* (low nibbles & 15) | (high bits & 0x30): a bitwise select on m4 (0xCA) */
            __m512i q01 = _mm512_ternarylogic_epi32(m4, l, _mm512_and_si512(_mm512_sllv_epi16(hh, left), m2), 0xCA);
            __m512i q23 = _mm512_ternarylogic_epi32(m4, _mm512_srli_epi16(l, 4),
                                                    _mm512_and_si512(_mm512_srlv_epi16(hh, right), m2), 0xCA);
            __m512i s = _mm512_permutexvar_epi16(pick[h], scv);
            for (int r = 0; r < R; r++) {
                const int8_t *xq = x[r].q256 + 256 * j + 128 * h;
                __m512i a = dot4_u8s8(q01, _mm512_loadu_si512(xq));
                __m512i c = dot4_u8s8(q23, _mm512_loadu_si512(xq + 64));
                isum[r] = madd_acc512(isum[r], _mm512_packs_epi32(a, c), s);
            }
        }
        float d = fp16(b + 208);
        for (int r = 0; r < R; r++) { /* - 32 sc_i bsum_i, spread over the low 8 lanes */
            __m256i off = _mm256_slli_epi32(_mm256_madd_epi16(sc16, ld(x[r].bsum + 16 * j)), 5);
            __m512i v = _mm512_sub_epi32(isum[r], _mm512_zextsi256_si512(off));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), _mm512_set1_ps(d * x[r].d256[j]), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) out[r] = _mm512_reduce_add_ps(acc[r]);
}

/* Q8_0, two blocks a vector: |w| against x negated where w < 0 (no 512-bit sign_epi8), each
 * block's 8 lanes of sums of 4 times its own d * dx; an odd last block as the AVX2 kernel. */
ROWS_INLINE void dot_q8_0_512(const uint8_t *b, const q8row *x, int R, int64_t nb, float *out) {
    __m512 acc[ROWS_MAX];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    const __m512i halves = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    int64_t j = 0;
    for (; j + 2 <= nb; j += 2, b += 68) {
        prefetch_ahead(b, 68);
        __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(ld(b + 2)), ld(b + 36), 1);
        __m512i aw = _mm512_abs_epi8(w);
        __mmask64 neg = _mm512_movepi8_mask(w);
        __m128 d = _mm_cvtph_ps(_mm_insert_epi16(_mm_cvtsi32_si128(u16(b)), u16(b + 34), 1));
        for (int r = 0; r < R; r++) {
            __m512i xq = _mm512_loadu_si512(x[r].q32 + 32 * j);
            __m512i sx = _mm512_mask_sub_epi8(xq, neg, _mm512_setzero_si512(), xq);
            __m128 s = _mm_mul_ps(d, _mm_castpd_ps(_mm_load_sd((const double *)(x[r].d32 + j))));
            __m512 sv = _mm512_permutexvar_ps(halves, _mm512_castps128_ps512(s));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot4_u8s8(aw, sx)), sv, acc[r]);
        }
    }
    float tail[ROWS_MAX] = {0};
    if (j < nb) {
        q8row last[ROWS_MAX];
        for (int r = 0; r < R; r++) last[r] = x[r], last[r].q32 += 32 * j, last[r].d32 += j;
        dot_q8_0(b, last, R, 1, tail);
    }
    for (int r = 0; r < R; r++) out[r] = _mm512_reduce_add_ps(acc[r]) + tail[r];
}
#endif

ROWS_INLINE void q8_dot_n(int64_t type, const uint8_t *row, const q8row *x, int R, int64_t K,
                          float *out) {
    switch (type) {
#ifdef __AVX512BW__
    case Q8_0: dot_q8_0_512(row, x, R, K / 32, out); return;
#else
    case Q8_0: dot_q8_0(row, x, R, K / 32, out); return;
#endif
    case Q4_K: dot_q4_k(row, x, R, K / 256, out); return;
    case Q6_K: dot_q6_k(row, x, R, K / 256, out); return;
    }
}

/* R (1..ROWS_MAX) rows with R a constant in each copy of q8_dot_n. */
static void q8_dot_rows(int64_t type, const uint8_t *row, const q8row *x, int R, int64_t K,
                        float *out) {
    switch (R) {
    case 1: q8_dot_n(type, row, x, 1, K, out); return;
    case 2: q8_dot_n(type, row, x, 2, K, out); return;
    case 3: q8_dot_n(type, row, x, 3, K, out); return;
    default: q8_dot_n(type, row, x, ROWS_MAX, K, out); return;
    }
}

/* y[m * ldy] = the dot product of one K-value weight row of `type` (pd_q8_dot_type) with
 * quantized activation row m (pd_q8_quantize, rows `xqb` bytes apart) for m < M. */
void pd_q8_dot(int64_t type, const uint8_t *row, const void *xq, int64_t xqb, int64_t M,
               int64_t K, float *y, int64_t ldy) {
    q8row x[ROWS_MAX];
    float out[ROWS_MAX];
    for (int64_t m = 0; m < M; m += ROWS_MAX) {
        int R = M - m < ROWS_MAX ? (int)(M - m) : ROWS_MAX;
        for (int r = 0; r < R; r++) x[r] = q8_parts((char *)xq + (m + r) * xqb, K);
        q8_dot_rows(type, row, x, R, K, out);
        for (int r = 0; r < R; r++) y[(m + r) * ldy] = out[r];
    }
}

/* ---- K-quant rows eight at a time (the AVX2 builds) ------------------------------------
 * Many input rows (prefill chunks, batches over 16) against Q4_K or Q6_K weights. The one-row
 * kernels above unpack a block's nibbles and scales once for up to 4 input rows, but still
 * spend per (weight row, input row) a madd and an add for every 32 products and the block's
 * float work: about as many instructions as the multiplies. Here 8 weight rows are packed (per
 * call, into a per-thread buffer) so that each 32-byte vector holds 4 consecutive values of
 * each of the 8 rows as bytes: one broadcast of 4 activation bytes feeds 8 rows in one
 * maddubs, and a block's float work is one vector for 8 rows. llama.cpp also interleaves
 * Q4_K rows eight at a time, once at load (ggml-cpu's repack.cpp, a private copy of the
 * weights); here the GGUF stays the only copy and the packing is paid once per call for all
 * its rows. On Zen 3 a loop of maddubs and add alone runs 2.2-2.5x faster than with a
 * broadcast per maddubs (bench_kernels.py prints both), so where a part has 16 rows in a row
 * two packed groups take each broadcast (G = 2: 1.10-1.24x over one group at 17-512 rows).
 *
 * A packed Q4_K block (TILE_BLOCK bytes) for sub-block s (0-7) and 4-value step k (0-7):
 *   q     [8][8][32] u8     bytes 4r..4r+3 of q[s][k]: values 32s + 4k .. +3 of row r
 *   sc    [8][16] int16     lanes 2r, 2r+1 of sc[s]: row r's 6-bit scale of sub-block s
 *   mn    [4][16] int16     lanes 2r, 2r+1 of mn[p]: row r's mins of sub-blocks 2p, 2p+1
 *   d, dmin [8] float       each row's
 * A sub-block's 8 maddubs sum in 16 bits (at most 8 * 2 * 15 * 127 = 30480), then one madd
 * applies the 8 rows' scales.
 *
 * A packed Q6_K block (TILE6_BLOCK bytes) for sub-block s (0-15) and step k (0-3):
 *   q     [16][4][32] u8    bytes 4r..4r+3 of q[s][k]: row r's 6-bit values 16s + 4k .. +3
 *   sc    [16][16] int16    lanes 2r, 2r+1 of sc[s]: row r's scale of sub-block s
 *   off   [8][16] int16     lanes 2r, 2r+1 of off[p]: row r's scales of sub-blocks 2p, 2p+1
 *   d     [8] float
 * Two maddubs sum in 16 bits (at most 2 * 2 * 63 * 127 = 32004), a madd per two; the -32 of
 * every value is one madd per two sub-blocks against the bsums, as in the one-row kernel.
 *
 * A packed Q8_0 block (TILE8_BLOCK bytes) for step k (0-7), each weight w plus 128 in nibbles:
 *   hi    [8][32] u8        bytes 4r..4r+3 of hi[k]: (w + 128) >> 4 of row r's values 4k .. +3
 *   lo    [8][32] u8        the same, (w + 128) & 15
 *   d     [8] float
 * w . x = 16 (hi . x) + lo . x - 128 sum(x): each nibble's 8 maddubs sum in 16 bits (at most
 * 30480) from one broadcast, and sum(x) is the quantized row's sum32.
 * Results are the one-row kernels' integers summed in another order: equal up to float
 * rounding, and the same for a row in any call that takes this path. */
#ifndef __AVX512BW__
#define TILE_ROWS 8
#define TILE_Q (8 * 8 * 32)
#define TILE_BLOCK (TILE_Q + 8 * 16 * 2 + 4 * 16 * 2 + 2 * 8 * 4)
#define TILE6_Q (16 * 4 * 32)
#define TILE6_BLOCK (TILE6_Q + 16 * 16 * 2 + 8 * 16 * 2 + 8 * 4)
#define TILE8_BLOCK (2 * 8 * 32 + 8 * 4)

/* The most groups of eight rows of `type` one pd_q8_tile_dot takes (0: the type has no tiles). */
int pd_q8_tile_type(int64_t type, int64_t K) {
    if (type == Q8_0) return K % 32 == 0;
    return (type == Q4_K || type == Q6_K) && K % 256 == 0 ? 2 : 0;
}

/* The buffer one pd_q8_tile_pack of one group of eight rows of any tile type needs: Q8_0's,
 * whose 256 values take the most bytes. */
_Static_assert(8 * TILE8_BLOCK >= TILE_BLOCK && 8 * TILE8_BLOCK >= TILE6_BLOCK, "Q8_0 packs the most");
int64_t pd_q8_tile_bytes(int64_t K) { return K / 32 * TILE8_BLOCK; }

/* v[i] (8 dwords each) transposed to out (8 vectors of 32 bytes): dword k of vector i is dword
 * i of v[k]. */
static inline void transpose8_epi32(const __m256i *v, uint8_t *out) {
    __m256i t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_epi32(v[i], v[i + 1]);
        t[i + 1] = _mm256_unpackhi_epi32(v[i], v[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]);
        u[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);
        u[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]);
        u[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int i = 0; i < 4; i++) {
        _mm256_storeu_si256((__m256i *)(out + 32 * i), _mm256_permute2x128_si256(u[i], u[i + 4], 0x20));
        _mm256_storeu_si256((__m256i *)(out + 32 * (i + 4)), _mm256_permute2x128_si256(u[i], u[i + 4], 0x31));
    }
}

/* rows[0..8): eight Q4_K rows of K values, packed for tile_q4_k at `out`. */
static void pack_q4_k(const uint8_t *const *rows, int64_t K, uint8_t *out) {
    const __m256i m4 = _mm256_set1_epi8(15);
    for (int64_t j = 0; j < K / 256; j++, out += TILE_BLOCK) {
        int16_t *sc = (int16_t *)(out + TILE_Q), *mn = sc + 8 * 16;
        float *d = (float *)(mn + 4 * 16), *dmin = d + 8;
        for (int r = 0; r < TILE_ROWS; r++) {
            const uint8_t *b = rows[r] + 144 * j;
            uint64_t s8, m8;
            scales_mins_k4(b + 4, &s8, &m8);
            d[r] = fp16(b), dmin[r] = fp16(b + 2);
            for (int s = 0; s < 8; s++)
                sc[16 * s + 2 * r] = sc[16 * s + 2 * r + 1] = (int16_t)((s8 >> 8 * s) & 0xff);
            for (int p = 0; p < 4; p++) {
                mn[16 * p + 2 * r] = (int16_t)((m8 >> 16 * p) & 0xff);
                mn[16 * p + 2 * r + 1] = (int16_t)((m8 >> (16 * p + 8)) & 0xff);
            }
        }
        for (int c = 0; c < 4; c++) /* chunk c: sub-block 2c in low nibbles, 2c + 1 in high */
            for (int h = 0; h < 2; h++) {
                __m256i v[8];
                for (int r = 0; r < TILE_ROWS; r++) {
                    __m256i q = ld(rows[r] + 144 * j + 16 + 32 * c);
                    v[r] = _mm256_and_si256(h ? _mm256_srli_epi16(q, 4) : q, m4);
                }
                transpose8_epi32(v, out + (2 * c + h) * 8 * 32);
            }
    }
}

/* rows[0..8): eight Q6_K rows of K values, packed for tile_q6_k at `out`. */
static void pack_q6_k(const uint8_t *const *rows, int64_t K, uint8_t *out) {
    uint8_t q[TILE_ROWS][256] __attribute__((aligned(32))); /* each row's values as bytes */
    for (int64_t j = 0; j < K / 256; j++, out += TILE6_BLOCK) {
        int16_t *sc = (int16_t *)(out + TILE6_Q), *off = sc + 16 * 16;
        float *d = (float *)(off + 8 * 16);
        /* row r's scales: as int16 pairs (off), and each alone twice (sc), one 8x8 transpose
         * of dwords each */
        __m256i pairs[TILE_ROWS], lo[TILE_ROWS], hi[TILE_ROWS];
        for (int r = 0; r < TILE_ROWS; r++) {
            const uint8_t *b = rows[r] + 210 * j;
            d[r] = fp16(b + 208);
            __m256i s16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b + 192)));
            __m256i a = _mm256_unpacklo_epi16(s16, s16), c = _mm256_unpackhi_epi16(s16, s16);
            pairs[r] = s16;
            lo[r] = _mm256_permute2x128_si256(a, c, 0x20), hi[r] = _mm256_permute2x128_si256(a, c, 0x31);
        }
        transpose8_epi32(lo, (uint8_t *)sc);
        transpose8_epi32(hi, (uint8_t *)(sc + 8 * 16));
        transpose8_epi32(pairs, (uint8_t *)off);
        for (int r = 0; r < TILE_ROWS; r++) {
            const uint8_t *b = rows[r] + 210 * j;
            for (int h = 0; h < 2; h++) {
                __m256i v[4];
                q6_k_half(b, h, v);
                for (int k = 0; k < 4; k++) _mm256_store_si256((__m256i *)(q[r] + 32 * (4 * h + k)), v[k]);
            }
        }
        for (int g = 0; g < 8; g++) { /* 32 values: sub-blocks 2g (steps 0-3), 2g + 1 (4-7) */
            __m256i v[8];
            for (int r = 0; r < TILE_ROWS; r++) v[r] = ld(q[r] + 32 * g);
            transpose8_epi32(v, out + g * 8 * 32);
        }
    }
}

/* rows[0..8): eight Q8_0 rows of K values, packed for tile_q8_0 at `out`. */
static void pack_q8_0(const uint8_t *const *rows, int64_t K, uint8_t *out) {
    const __m256i m4 = _mm256_set1_epi8(15), top = _mm256_set1_epi8((char)0x80);
    for (int64_t j = 0; j < K / 32; j++, out += TILE8_BLOCK) {
        __m256i hi[TILE_ROWS], lo[TILE_ROWS];
        float *d = (float *)(out + 2 * 8 * 32);
        for (int r = 0; r < TILE_ROWS; r++) {
            const uint8_t *b = rows[r] + 34 * j;
            __m256i u = _mm256_xor_si256(ld(b + 2), top); /* w + 128 */
            hi[r] = _mm256_and_si256(_mm256_srli_epi16(u, 4), m4), lo[r] = _mm256_and_si256(u, m4);
            d[r] = fp16(b);
        }
        transpose8_epi32(hi, out);
        transpose8_epi32(lo, out + 8 * 32);
    }
}

/* out[G * r + g] (8 lanes: rows 8g..8g+7) = the G packed groups' dot products with input row
 * r; group g's pack at pack + g * gap. */
ROWS_INLINE void tile_q4_k(const uint8_t *pack, int64_t gap, int G, const q8row *x, int R, int64_t nb,
                           __m256 *out) {
    __m256 acc[ROWS_MAX][2];
    for (int r = 0; r < R; r++)
        for (int g = 0; g < G; g++) acc[r][g] = _mm256_setzero_ps();
    for (int64_t j = 0; j < nb; j++, pack += TILE_BLOCK) {
        __m256i isum[ROWS_MAX][2];
        for (int r = 0; r < R; r++)
            for (int g = 0; g < G; g++) isum[r][g] = _mm256_setzero_si256();
        for (int s = 0; s < 8; s++) {
            __m256i s16[ROWS_MAX][2];
            for (int r = 0; r < R; r++)
                for (int g = 0; g < G; g++) s16[r][g] = _mm256_setzero_si256();
            /* unrolled fully, gcc sums the 32 products as a tree and spills half of them */
#pragma GCC unroll 4
            for (int k = 0; k < 8; k++) {
                __m256i w[2];
                for (int g = 0; g < G; g++) w[g] = ld(pack + g * gap + (8 * s + k) * 32);
                for (int r = 0; r < R; r++) { /* one broadcast for the G groups */
                    int32_t xv;
                    memcpy(&xv, x[r].q256 + 256 * j + 32 * s + 4 * k, 4);
                    __m256i xb = _mm256_set1_epi32(xv);
                    for (int g = 0; g < G; g++)
                        s16[r][g] = _mm256_add_epi16(s16[r][g], _mm256_maddubs_epi16(w[g], xb));
                }
            }
            for (int g = 0; g < G; g++) {
                __m256i scv = ld(pack + g * gap + TILE_Q + 32 * s);
                for (int r = 0; r < R; r++) isum[r][g] = madd_acc256(isum[r][g], s16[r][g], scv);
            }
        }
        for (int r = 0; r < R; r++) {
            __m256i bsv[4]; /* the sums of sub-blocks 2p, 2p + 1 */
            for (int p = 0; p < 4; p++) {
                int32_t pair;
                memcpy(&pair, x[r].bsum32 + 8 * j + 2 * p, 4);
                bsv[p] = _mm256_set1_epi32(pair);
            }
            __m256 dx = _mm256_set1_ps(x[r].d256[j]);
            for (int g = 0; g < G; g++) {
                const int16_t *mn = (const int16_t *)(pack + g * gap + TILE_Q) + 8 * 16;
                const float *d = (const float *)(mn + 4 * 16);
                __m256i msum = _mm256_setzero_si256();
                for (int p = 0; p < 4; p++) msum = madd_acc256(msum, ld(mn + 16 * p), bsv[p]);
                acc[r][g] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r][g]), _mm256_mul_ps(_mm256_loadu_ps(d), dx), acc[r][g]);
                acc[r][g] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(msum), _mm256_mul_ps(_mm256_loadu_ps(d + 8), dx), acc[r][g]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int g = 0; g < G; g++) out[G * r + g] = acc[r][g];
}

/* tile_q4_k's for packed Q6_K rows. */
ROWS_INLINE void tile_q6_k(const uint8_t *pack, int64_t gap, int G, const q8row *x, int R, int64_t nb,
                           __m256 *out) {
    __m256 acc[ROWS_MAX][2];
    for (int r = 0; r < R; r++)
        for (int g = 0; g < G; g++) acc[r][g] = _mm256_setzero_ps();
    for (int64_t j = 0; j < nb; j++, pack += TILE6_BLOCK) {
        __m256i isum[ROWS_MAX][2];
        for (int r = 0; r < R; r++)
            for (int g = 0; g < G; g++) isum[r][g] = _mm256_setzero_si256();
        for (int s = 0; s < 16; s++) {
            __m256i scv[2];
            for (int g = 0; g < G; g++) scv[g] = ld(pack + g * gap + TILE6_Q + 32 * s);
#pragma GCC unroll 1 /* rolled: gcc's full unroll spilled in tile_q4_k */
            for (int k = 0; k < 4; k += 2) {
                __m256i w0[2], w1[2];
                for (int g = 0; g < G; g++) {
                    w0[g] = ld(pack + g * gap + (4 * s + k) * 32);
                    w1[g] = ld(pack + g * gap + (4 * s + k + 1) * 32);
                }
                for (int r = 0; r < R; r++) { /* two broadcasts for the G groups */
                    int32_t x0, x1;
                    memcpy(&x0, x[r].q256 + 256 * j + 16 * s + 4 * k, 4);
                    memcpy(&x1, x[r].q256 + 256 * j + 16 * s + 4 * k + 4, 4);
                    __m256i b0 = _mm256_set1_epi32(x0), b1 = _mm256_set1_epi32(x1);
                    for (int g = 0; g < G; g++) {
                        __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(w0[g], b0), _mm256_maddubs_epi16(w1[g], b1));
                        isum[r][g] = madd_acc256(isum[r][g], p, scv[g]);
                    }
                }
            }
        }
        for (int r = 0; r < R; r++) { /* - 32 sc_s bsum_s */
            const int16_t *bs = x[r].bsum + 16 * j;
            __m256i pairs[8];
            for (int p = 0; p < 8; p++) {
                int32_t pair; /* bsums 2p, 2p + 1 as one dword */
                memcpy(&pair, bs + 2 * p, 4);
                pairs[p] = _mm256_set1_epi32(pair);
            }
            __m256 dx = _mm256_set1_ps(x[r].d256[j]);
            for (int g = 0; g < G; g++) {
                const int16_t *off = (const int16_t *)(pack + g * gap + TILE6_Q) + 16 * 16;
                const float *d = (const float *)(off + 8 * 16);
                __m256i o = _mm256_setzero_si256();
                for (int p = 0; p < 8; p++) o = madd_acc256(o, ld(off + 16 * p), pairs[p]);
                __m256i v = _mm256_sub_epi32(isum[r][g], _mm256_slli_epi32(o, 5));
                acc[r][g] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), _mm256_mul_ps(_mm256_loadu_ps(d), dx), acc[r][g]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int g = 0; g < G; g++) out[G * r + g] = acc[r][g];
}

/* out[r] (8 lanes: the 8 rows) = the packed Q8_0 rows' dot products with input row r. */
ROWS_INLINE void tile_q8_0(const uint8_t *pack, const q8row *x, int R, int64_t nb, __m256 *out) {
    const __m256i sixteen = _mm256_set1_epi16(16), ones = _mm256_set1_epi16(1);
    __m256 acc[ROWS_MAX];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t j = 0; j < nb; j++, pack += TILE8_BLOCK) {
        __m256i h16[ROWS_MAX], l16[ROWS_MAX];
        for (int r = 0; r < R; r++) h16[r] = l16[r] = _mm256_setzero_si256();
#pragma GCC unroll 4
        for (int k = 0; k < 8; k++) {
            __m256i wh = ld(pack + 32 * k), wl = ld(pack + 8 * 32 + 32 * k);
            for (int r = 0; r < R; r++) { /* one broadcast for both nibbles */
                int32_t xv;
                memcpy(&xv, x[r].q32 + 32 * j + 4 * k, 4);
                __m256i xb = _mm256_set1_epi32(xv);
                h16[r] = _mm256_add_epi16(h16[r], _mm256_maddubs_epi16(wh, xb));
                l16[r] = _mm256_add_epi16(l16[r], _mm256_maddubs_epi16(wl, xb));
            }
        }
        __m256 dv = _mm256_loadu_ps((const float *)(pack + 2 * 8 * 32));
        for (int r = 0; r < R; r++) { /* 16 hi + lo - 128 sum(x) */
            __m256i v = madd_acc256(_mm256_madd_epi16(h16[r], sixteen), l16[r], ones);
            v = _mm256_sub_epi32(v, _mm256_set1_epi32(128 * x[r].sum32[j]));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), _mm256_mul_ps(dv, _mm256_set1_ps(x[r].d32[j])), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) out[r] = acc[r];
}

/* Bytes between two packed groups of `type` (pd_q8_tile_pack, pd_q8_tile_dot). */
static int64_t tile_gap(int64_t type, int64_t K) {
    return type == Q8_0 ? K / 32 * TILE8_BLOCK : K / 256 * (type == Q6_K ? TILE6_BLOCK : TILE_BLOCK);
}

ROWS_INLINE void tile_rows(int64_t type, const uint8_t *pack, int64_t gap, int G, const q8row *x, int R,
                           int64_t nb, __m256 *out) {
    if (type == Q8_0)
        tile_q8_0(pack, x, R, nb, out);
    else if (G == 2 && type == Q6_K)
        tile_q6_k(pack, gap, 2, x, R, nb, out);
    else if (G == 2)
        tile_q4_k(pack, gap, 2, x, R, nb, out);
    else if (type == Q6_K)
        tile_q6_k(pack, gap, 1, x, R, nb, out);
    else
        tile_q4_k(pack, gap, 1, x, R, nb, out);
}

void pd_q8_tile_pack(int64_t type, const uint8_t *const *rows, int64_t G, int64_t K, uint8_t *out) {
    for (int64_t g = 0; g < G; g++)
        (type == Q8_0 ? pack_q8_0 : type == Q6_K ? pack_q6_k : pack_q4_k)(rows + 8 * g, K, out + g * tile_gap(type, K));
}

/* y[m * 8G + i] = packed row i (pd_q8_tile_pack of `type`, G <= 2 groups of eight) . quantized
 * input row m (rows `xqb` bytes apart), m < M. */
void pd_q8_tile_dot(int64_t type, const uint8_t *pack, int64_t G, const void *xq, int64_t xqb, int64_t M,
                    int64_t K, float *y) {
    q8row x[ROWS_MAX];
    __m256 out[ROWS_MAX * 2];
    int64_t gap = tile_gap(type, K), nb = type == Q8_0 ? K / 32 : K / 256;
    /* Two groups of Q4_K and one of Q8_0 take 3 input rows a pass: with 4, their sums in 16
     * bits (8) and in 32 (4-8) outgrow the 16 registers. Zen 3, 8192x2048, one thread: two Q4_K
     * groups took 1.06-1.16x the time of one at 17-512 rows, with 3 1.10-1.24x less; Q8_0 with 3
     * rows 1.20-1.31x faster than with 4 */
    int step = (G == 2 && type == Q4_K) || type == Q8_0 ? 3 : ROWS_MAX;
    for (int64_t m = 0; m < M; m += step) {
        int R = M - m < step ? (int)(M - m) : step;
        for (int r = 0; r < R; r++) x[r] = q8_parts((char *)xq + (m + r) * xqb, K);
        switch (R) {
        case 1: tile_rows(type, pack, gap, (int)G, x, 1, nb, out); break;
        case 2: tile_rows(type, pack, gap, (int)G, x, 2, nb, out); break;
        case 3: tile_rows(type, pack, gap, (int)G, x, 3, nb, out); break;
        default: tile_rows(type, pack, gap, (int)G, x, ROWS_MAX, nb, out); break;
        }
        for (int r = 0; r < R * G; r++) _mm256_storeu_ps(y + (m * G + r) * TILE_ROWS, out[r]);
    }
}
#else
int pd_q8_tile_type(int64_t type, int64_t K) { return (void)type, (void)K, 0; }
int64_t pd_q8_tile_bytes(int64_t K) { return (void)K, 0; }
void pd_q8_tile_pack(int64_t type, const uint8_t *const *rows, int64_t G, int64_t K, uint8_t *out) {
    (void)type, (void)rows, (void)G, (void)K, (void)out;
}
void pd_q8_tile_dot(int64_t type, const uint8_t *pack, int64_t G, const void *xq, int64_t xqb, int64_t M,
                    int64_t K, float *y) {
    (void)type, (void)pack, (void)G, (void)xq, (void)xqb, (void)M, (void)K, (void)y;
}
#endif
