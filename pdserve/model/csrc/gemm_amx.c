/* ---- the panel GEMM on AMX bf16 tiles, for the compact formats ----------------------
 * Built only into the `amx` variant (-mamx-tile -mamx-bf16 -mavx512bf16, native.py); in the
 * others this file is empty. pd_linear_panels hands it batches of AMX_M_MIN rows or more on
 * PD_Q4A / PD_Q8S panels, the same 48-column panels the AVX-512 path reads at M = 1 (one
 * packed copy serves both).
 *
 * Why it is faithful to fp32: within a 32-row k block of a column, w = d q + m with q an
 * integer of at most 8 bits, exact in bf16. Each x is split into three bf16 terms,
 * hi = bf16(x), mid = bf16(x - hi), lo = bf16(x - hi - mid), which add up to x exactly
 * (8 + 8 + 8 significant bits cover fp32's 24; every difference is exact), so every product
 * x q that the tiles form is exact in fp32, and
 *     sum_k x_k w_k = d * S + m * R,   S = sum_k x_k q_k (tiles),  R = sum_k x_k (fp32),
 * per block; only the order of the fp32 additions differs from the AVX-512 kernel (results
 * differ from it at rounding level, test_amx_gemm bounds them against float64).
 *
 * Shapes: A tiles are 16 rows of x by 32 k (one block) per term, B tiles 32 k by 16
 * columns in VNNI pairs (row r holds k = 2r, 2r+1 of each column), so one 48-column panel
 * block is three B tiles, unpacked from its nibbles/bytes into a per-thread buffer and held
 * in tile registers while every 16-row tile of x (in passes of ROW_TILES) uses them. Per
 * (row tile, block): 9 tdpbf16ps into zeroed C tiles, stored, then folded into fp32 sums
 * with AVX-512 FMAs. x is split once per call into hi/mid/lo A tiles (zero rows pad M to a
 * multiple of 16) and block sums. */
#define _DEFAULT_SOURCE /* syscall() under -std=c11 */
#include "kernels.h"

#ifdef __AMX_BF16__
#include <sys/syscall.h>
#include <unistd.h>

#define TILE_ROWS 16
#define TILE_COLS 16                            /* fp32 outputs per C tile row */
#define B_TILE (TILE_ROWS * 2 * TILE_COLS)      /* bf16 per B tile (1 KB) */
#define A_TILE (TILE_ROWS * QBLOCK)             /* bf16 per A tile (1 KB) */
/* Rows per pass over the weights: their split x (6 K bytes a row) stays in L2 while every
 * panel is unpacked once per pass. */
#ifndef ROW_TILES
#define ROW_TILES 8
#endif
#define SPLITS 3 /* bf16 terms per x (two lose ~2^-17: docs/cpu-kernels.md) */

static int amx_permitted;

/* Asks Linux for the AMX tile state for this process (off by default since 5.16). */
int pd_amx_init(void) {
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */))
        return -1;
    amx_permitted = 1;
    return 0;
}

int pd_amx_ready(void) { return amx_permitted; }

int64_t pd_amx_m_min(void) { return AMX_M_MIN; }

/* Palette 1, all eight tiles 16 rows of 64 bytes. Loaded at the start of each thread's
 * share of a call (another library, e.g. oneDNN's bf16 kernels, may have configured the
 * tiles differently on the same thread), released at its end. */
void pd_amx_tiles_configure(void) {
    struct {
        uint8_t palette, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } __attribute__((packed, aligned(64))) cfg = {.palette = 1};
    for (int i = 0; i < 8; i++) cfg.colsb[i] = 64, cfg.rows[i] = TILE_ROWS;
    /* GCC does not count ldtilecfg as reading cfg: without this the stores above are dropped
     * once the function is not inlined (tiles unconfigured: the first tile op faults) */
    __asm__ volatile("" : : "r"(&cfg) : "memory");
    _tile_loadconfig(&cfg);
}

/* 16 small integers (as floats) of k = 2r and 2r+1 as one VNNI row: lane n's low half is
 * bf16(a_n), high half bf16(b_n). A small integer's fp32 ends in 16 zero bits, so its bf16
 * is its top half, no rounding. */
static inline __m512i vnni_pair(__m512 a, __m512 b) {
    return _mm512_or_si512(_mm512_srli_epi32(_mm512_castps_si512(a), 16),
                           _mm512_and_si512(_mm512_castps_si512(b),
                                            _mm512_set1_epi32((int)0xFFFF0000)));
}

/* The three B tiles of one 32-k block of a panel, [3][B_TILE] bf16. */
static void unpack_block(const uint8_t *src, int codec, uint16_t *out) {
    const float *d = (const float *)src;
    for (int j = 0; j < 3; j++, out += B_TILE)
        for (int r = 0; r < TILE_ROWS; r++) {
            __m512i row;
            if (codec == PD_Q4A) {
                const uint32_t *q = (const uint32_t *)(d + 2 * PANEL) + 2 * j;
                row = vnni_pair(vnibbles(q + 2 * r * (PANEL / 8)),
                                vnibbles(q + (2 * r + 1) * (PANEL / 8)));
            } else {
                const int8_t *q = (const int8_t *)(d + PANEL) + TILE_COLS * j;
                row = vnni_pair(vcvt_f32(vbytes(q + 2 * r * PANEL)),
                                vcvt_f32(vbytes(q + (2 * r + 1) * PANEL)));
            }
            _mm512_store_si512(out + r * 2 * TILE_COLS, row);
        }
}

/* Row i of x as hi/mid/lo bf16 in the A tiles of its row tile (xs: [Mp / 16][K / 32]
 * [SPLITS][16 rows][32 k], each tile 1 KB contiguous), and its block sums rs [K / 32]. */
static inline uint16_t *a_row(uint16_t *xs, int64_t i, int64_t nb) {
    return xs + (i / TILE_ROWS) * nb * SPLITS * A_TILE + (i % TILE_ROWS) * QBLOCK;
}

static void split_row(const float *x, int64_t i, int64_t K, uint16_t *xs, float *rs) {
    uint16_t *row = a_row(xs, i, K / QBLOCK);
    for (int64_t k = 0; k < K; k += 16) {
        __m512 v = _mm512_loadu_ps(x + k);
        uint16_t *dst = row + (k / QBLOCK) * SPLITS * A_TILE + k % QBLOCK;
        for (int s = 0; s < SPLITS; s++) {
            __m256bh h = _mm512_cvtneps_pbh(v);
            _mm256_storeu_si256((__m256i *)(dst + s * A_TILE), (__m256i)h);
            v = _mm512_sub_ps(v, _mm512_cvtpbh_ps(h));
        }
        if (k % QBLOCK == 0)
            rs[k / QBLOCK] = _mm512_reduce_add_ps(
                _mm512_add_ps(_mm512_loadu_ps(x + k), _mm512_loadu_ps(x + k + 16)));
    }
}

/* Sums of a (row tile, block): acc [16][PANEL] += d * S + m * R (m: NULL for PD_Q8S). */
static inline void fold(float *acc, const float *S, const float *d, const float *m,
                        const float *rs, int64_t rs_step) {
    for (int j = 0; j < 3; j++) {
        __m512 dj = _mm512_loadu_ps(d + j * TILE_COLS);
        __m512 mj = m ? _mm512_loadu_ps(m + j * TILE_COLS) : _mm512_setzero_ps();
        for (int r = 0; r < TILE_ROWS; r++) {
            float *a = acc + r * PANEL + j * TILE_COLS;
            __m512 v = _mm512_fmadd_ps(dj, _mm512_load_ps(S + (j * TILE_ROWS + r) * TILE_COLS),
                                       _mm512_load_ps(a));
            if (m) v = _mm512_fmadd_ps(mj, _mm512_set1_ps(rs[r * rs_step]), v);
            _mm512_store_ps(a, v);
        }
    }
}

/* C tile c = sum over the three terms of A (tiles 0-2) times B tile b. */
#define DOT3(c, b)                                                                           \
    _tile_zero(c);                                                                           \
    _tile_dpbf16ps(c, 0, b);                                                                 \
    _tile_dpbf16ps(c, 1, b);                                                                 \
    _tile_dpbf16ps(c, 2, b)

/* Panel p for rows [t0, t0 + rows) (ROW_TILES tiles at most: their sums, acc [rows][PANEL],
 * stay in L1); each block's B tiles are unpacked once per call and held in tiles 3-5 for
 * every row tile. scratch: B tiles (3 KB), S (3 C tiles), acc. */
static void panel_amx(const uint16_t *xs, const float *rs, const uint8_t *wp, int codec,
                      const float *bias, float *y, int64_t M, int64_t t0, int64_t rows,
                      int64_t N, int64_t K, int64_t p, uint16_t *bt, float *S, float *acc) {
    int64_t nb = K / QBLOCK, block = codec == PD_Q4A ? Q4A_BLOCK : Q8S_BLOCK;
    const uint8_t *panel = wp + p * nb * block;
    int64_t n0 = p * PANEL, ncols = N - n0 < PANEL ? N - n0 : PANEL;
    for (int64_t i = 0; i < rows * PANEL; i += 16) _mm512_store_ps(acc + i, _mm512_setzero_ps());
    for (int64_t g = 0; g < nb; g++) {
        const float *d = (const float *)(panel + g * block);
        unpack_block(panel + g * block, codec, bt);
        _tile_loadd(3, bt, 64);
        _tile_loadd(4, bt + B_TILE, 64);
        _tile_loadd(5, bt + 2 * B_TILE, 64);
        for (int64_t t = t0; t < t0 + rows; t += TILE_ROWS) {
            const uint16_t *a = xs + ((t / TILE_ROWS) * nb + g) * SPLITS * A_TILE;
            _tile_loadd(0, a, 64);
            _tile_loadd(1, a + A_TILE, 64);
            _tile_loadd(2, a + 2 * A_TILE, 64);
            DOT3(6, 3);
            _tile_stored(6, S, 64);
            DOT3(7, 4);
            _tile_stored(7, S + 256, 64);
            DOT3(6, 5);
            _tile_stored(6, S + 512, 64);
            fold(acc + (t - t0) * PANEL, S, d, codec == PD_Q4A ? d + PANEL : NULL,
                 rs + t * nb + g, nb);
        }
    }
    for (int64_t r = 0; r < rows && t0 + r < M; r++)
        for (int64_t c = 0; c < ncols; c += 16) {
            __mmask16 mask = ncols - c >= 16 ? 0xFFFF : tail_mask(ncols - c);
            __m512 v = _mm512_load_ps(acc + r * PANEL + c);
            if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, bias + n0 + c));
            _mm512_mask_storeu_ps(y + (t0 + r) * N + n0 + c, mask, v);
        }
}

static __thread void *split_buf, *tile_buf;
static __thread int64_t split_cap, tile_cap;

static void *grown(void **buf, int64_t *cap, int64_t bytes) {
    if (bytes > *cap) {
        free(*buf);
        *buf = aligned_alloc(64, (size_t)((bytes + 63) / 64 * 64));
        *cap = *buf ? bytes : 0;
    }
    return *buf;
}

/* pd_linear_panels for codec PD_Q4A / PD_Q8S, K a multiple of 32, on AMX (pd_amx_ready). */
int pd_linear_panels_amx(const float *x, const void *wp, int64_t codec, const float *bias,
                         float *y, int64_t M, int64_t N, int64_t K) {
    int64_t Mp = (M + TILE_ROWS - 1) / TILE_ROWS * TILE_ROWS, nb = K / QBLOCK;
    int64_t panels = (N + PANEL - 1) / PANEL;
    uint8_t *buf = grown(&split_buf, &split_cap, SPLITS * Mp * K * 2 + Mp * nb * 4);
    if (!buf) return -1;
    uint16_t *xs = (uint16_t *)buf;
    float *rs = (float *)(buf + SPLITS * Mp * K * 2);
    int failed = 0;
#pragma omp parallel reduction(| : failed)
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < Mp; i++) {
            if (i < M) split_row(x + i * K, i, K, xs, rs + i * nb);
            else {
                for (int64_t g = 0; g < nb * SPLITS; g++)
                    memset(a_row(xs, i, nb) + g * A_TILE, 0, QBLOCK * 2);
                memset(rs + i * nb, 0, nb * 4);
            }
        }
        int64_t bt_bytes = 3 * B_TILE * 2, acc_bytes = ROW_TILES * TILE_ROWS * PANEL * 4;
        uint8_t *scratch = grown(&tile_buf, &tile_cap, bt_bytes + 3 * 1024 + acc_bytes);
        failed = !scratch;
        if (scratch) pd_amx_tiles_configure();
        for (int64_t t0 = 0; t0 < Mp; t0 += ROW_TILES * TILE_ROWS) {
            int64_t rows = Mp - t0 < ROW_TILES * TILE_ROWS ? Mp - t0 : ROW_TILES * TILE_ROWS;
#pragma omp for schedule(dynamic)
            for (int64_t p = 0; p < panels; p++)
                if (scratch)
                    panel_amx(xs, rs, (const uint8_t *)wp, (int)codec, bias, y, M, t0, rows, N,
                              K, p, (uint16_t *)scratch, (float *)(scratch + bt_bytes),
                              (float *)(scratch + bt_bytes + 3 * 1024));
        }
        if (scratch) _tile_release();
    }
    return failed ? -1 : 0;
}
#endif
