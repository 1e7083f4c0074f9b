/* Paged decode attention (see kernels.h). */
#include "kernels.h"

/* Eight dot products at once: acc[i] holds key i's partial sums (folded to 8 lanes); one
 * transposing reduction gives the eight scores (instead of eight horizontal sums). */
static inline __m256 reduce8(const vf *a) {
    __m256 a0 = vfold8(a[0]), a1 = vfold8(a[1]), a2 = vfold8(a[2]), a3 = vfold8(a[3]);
    __m256 a4 = vfold8(a[4]), a5 = vfold8(a[5]), a6 = vfold8(a[6]), a7 = vfold8(a[7]);
    __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
    return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}

/* s[i] = scale * q . k_i for the n keys of one [BS, D] tile. */
static void tile_scores(const float *q, const float *k, int64_t n, int64_t D, float scale,
                        float *s) {
    int64_t i = 0;
    if (D % VW == 0) {
        for (; i + 8 <= n; i += 8) {
            const float *r = k + i * D;
            vf a[8];
            for (int j = 0; j < 8; j++) a[j] = vzero();
            for (int64_t d = 0; d < D; d += VW) {
                vf qv = vload(q + d);
                for (int j = 0; j < 8; j++) a[j] = vfmadd(qv, vload(r + j * D + d), a[j]);
            }
            _mm256_storeu_ps(s + i, _mm256_mul_ps(reduce8(a), _mm256_set1_ps(scale)));
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
    float mx = -INFINITY, sum = 0.f, lanes[VW];
    vf mv = vset1(mx), sv = vzero();
    int64_t t = 0;
    for (; t + VW <= len; t += VW) mv = vmax(vload(p + t), mv);
    vstore(lanes, mv);
    for (int j = 0; j < VW; j++) mx = lanes[j] > mx ? lanes[j] : mx;
    for (; t < len; t++) mx = p[t] > mx ? p[t] : mx;
    mv = vset1(mx);
    t = 0;
    for (; t + VW <= len; t += VW) {
        vf e = vexp(vsub(vload(p + t), mv));
        vstore(p + t, e);
        sv = vadd(sv, e);
    }
    sum = vhsum(sv);
    for (; t < len; t++) sum += (p[t] = expf(p[t] - mx));
    vf inv = vset1(1.f / sum);
    for (t = 0; t + VW <= len; t += VW) vstore(p + t, vmul(vload(p + t), inv));
    for (; t < len; t++) p[t] *= 1.f / sum;
}

/* o_g[0..D) += sum_t p_g[t] v_t over the n rows of one V tile, for gg (<= 3) query heads
 * sharing its KV head: p_g = p + g * p_stride, o_g = o + g * D. Per 4 vectors of output
 * columns (32 or 64) the gg heads' sums sit in 12 registers while the tile's rows stream
 * past, each row loaded once for all gg heads. `ahead`, if set, is a tile to prefetch, a
 * row per row read. */
static inline __attribute__((always_inline)) void
tile_values_4v(const float *p, int64_t p_stride, const float *v, int64_t n, int64_t D, float *o,
               const int gg, const float *ahead) {
    for (int64_t d0 = 0; d0 < D; d0 += 4 * VW) {
        vf a[3][4];
        for (int g = 0; g < 3; g++)
            for (int c = 0; c < 4; c++)
                a[g][c] = g < gg ? vload(o + g * D + d0 + VW * c) : vzero();
        for (int64_t t = 0; t < n; t++) {
            const float *r = v + t * D + d0;
            if (ahead && d0 == 0) prefetch_range(ahead + t * D, D);
            vf r0 = vload(r), r1 = vload(r + VW), r2 = vload(r + 2 * VW), r3 = vload(r + 3 * VW);
            for (int g = 0; g < gg; g++) {
                vf w = vset1(p[g * p_stride + t]);
                a[g][0] = vfmadd(w, r0, a[g][0]);
                a[g][1] = vfmadd(w, r1, a[g][1]);
                a[g][2] = vfmadd(w, r2, a[g][2]);
                a[g][3] = vfmadd(w, r3, a[g][3]);
            }
        }
        for (int g = 0; g < gg; g++)
            for (int c = 0; c < 4; c++) vstore(o + g * D + d0 + VW * c, a[g][c]);
    }
}

/* The G query heads of one KV head over one V tile: o [G, D] += p [G, (stride)] . v. */
static void tile_values(const float *p, int64_t p_stride, const float *v, int64_t n, int64_t D,
                        int64_t G, float *o, const float *ahead) {
    if (D % (4 * VW) == 0) {
        for (int64_t g = 0; g < G; g += 3, ahead = NULL) {
            const float *pg = p + g * p_stride;
            switch (G - g < 3 ? G - g : 3) {
            case 1: tile_values_4v(pg, p_stride, v, n, D, o + g * D, 1, ahead); break;
            case 2: tile_values_4v(pg, p_stride, v, n, D, o + g * D, 2, ahead); break;
            default: tile_values_4v(pg, p_stride, v, n, D, o + g * D, 3, ahead); break;
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
