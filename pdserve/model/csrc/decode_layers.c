/* ---- the decoder layers of a decode-only step ----------------------------------------
 * The calls FusedDecoderLayer would make from Python, made here, for every layer at once:
 * at batch 1 the ~10 Python round trips per layer cost more than the layer's arithmetic
 * besides its GEMMs, and at batch 32 a ctypes call per layer still costs ~5% of a step.
 * x [M, Dm] is the residual stream, updated in place; scratch holds the intermediates
 * (pd_decode_layer_scratch floats). Each layer's four linear weights (QKV, output,
 * gate/up, down) are panel-packed, each in its format, or GGUF weights read in place, on
 * the kernel QuantLinear.forward picks for M rows: pd_quant_linear (int8 activations up to
 * int8_m_max rows), or above the weight's own gemv_m_max rows, for PD_GGUF_AMX weights, AMX
 * bf16 tiles (pd_quant_linear_amx); only QKV may have a bias. Returns 0, or -1 when a kernel could not
 * allocate its scratch memory. */
#include "kernels.h"

int64_t pd_decode_layer_scratch(int64_t M, int64_t Dm, int64_t H, int64_t KVH, int64_t D,
                                int64_t I) {
    return M * (2 * Dm + (2 * H + 2 * KVH) * D + 3 * I);
}

typedef struct {
    const void *data;
    int64_t codec;
} pd_weight;

/* y [M, N] = x [M, K] W^T (+ bias) for either kind of weight. */
static int linear(const float *x, const pd_weight *w, const float *bias, float *y, int64_t M,
                  int64_t N, int64_t K, int64_t int8_m_max) {
    if (w->codec != PD_GGUF && w->codec != PD_GGUF_AMX)
        return pd_linear_panels(x, w->data, w->codec, bias, y, M, N, K);
    const pd_qlinear *q = w->data;
    int rc;
    if (M <= q->gemv_m_max || w->codec == PD_GGUF)
        rc = pd_quant_linear(x, M, K, q->parts, q->n, y, N, int8_m_max);
#ifdef __AMX_BF16__
    else rc = pd_quant_linear_amx(x, M, K, q->parts, q->n, y, N);
#else
    else rc = -1; /* quant_linear.py marks no weight PD_GGUF_AMX on a build without AMX */
#endif
    if (rc) return -1;
    if (bias)
        for (int64_t m = 0; m < M; m++)
            for (int64_t j = 0; j < N; j++) y[m * N + j] += bias[j];
    return 0;
}

/* One layer's parameters and its KV cache (native.PdLayer). q_norm/k_norm: Qwen3's per-head
 * norms (NULL for the families without them). */
typedef struct {
    const float *norm1, *norm2, *qkv_bias;
    pd_weight w[4];
    float *cache;
    const float *q_norm, *k_norm;
} pd_layer;

/* One layer. Its input is x + *pending (the previous layer's MLP output, not yet added:
 * the add rides along with this layer's first norm), and it leaves its own MLP output in
 * *pending; the caller adds the last one. */
static int decode_layer(float *x, const float **pending, float *scratch, int64_t M,
                        const pd_layer *l, const float *cos, const float *sin,
                        const int64_t *slot_blocks, const int64_t *slot_offsets,
                        const int64_t *tables, const int64_t *context_lens, float *scores,
                        int64_t max_blocks, int64_t Dm, int64_t H, int64_t KVH, int64_t D,
                        int64_t I, int64_t BS, float eps, int64_t int8_m_max) {
    int64_t nqkv = (H + 2 * KVH) * D;
    float *y = scratch, *qkv = y + M * Dm, *att = qkv + M * nqkv, *o = att + M * H * D;
    float *gu = o + M * Dm, *act = gu + M * 2 * I;
    const pd_weight *w = l->w;
    if (*pending) pd_add_rmsnorm(x, *pending, l->norm1, y, M, Dm, eps);
    else pd_rmsnorm(x, l->norm1, y, M, Dm, eps);
    if (linear(y, &w[0], l->qkv_bias, qkv, M, nqkv, Dm, int8_m_max)) return -1;
    if (l->q_norm) pd_qk_norm(qkv, l->q_norm, l->k_norm, M, H, KVH, D, eps);
    pd_rope_qkv_store(qkv, cos, sin, l->cache, slot_blocks, slot_offsets, M, H, KVH, D, BS);
    if (pd_paged_decode_attn(qkv, nqkv, l->cache, tables, context_lens, att, scores, M, H, KVH,
                             D, BS, max_blocks, 1.f / sqrtf((float)D)))
        return -1;
    if (linear(att, &w[1], NULL, o, M, Dm, H * D, int8_m_max)) return -1;
    pd_add_rmsnorm(x, o, l->norm2, y, M, Dm, eps);
    if (linear(y, &w[2], NULL, gu, M, 2 * I, Dm, int8_m_max)) return -1;
    pd_silu_mul(gu, act, M, I);
    if (linear(act, &w[3], NULL, o, M, Dm, I, int8_m_max)) return -1;
    *pending = o;
    return 0;
}

/* Layers [0, L) of `layers` in order (the caller passes one at a time when it acts between
 * layers, e.g. to send each layer's KV as soon as it is written). */
int pd_decode_layers(float *x, float *scratch, int64_t M, const pd_layer *layers, int64_t L,
                     const float *cos, const float *sin, const int64_t *slot_blocks,
                     const int64_t *slot_offsets, const int64_t *tables,
                     const int64_t *context_lens, float *scores, int64_t max_blocks, int64_t Dm,
                     int64_t H, int64_t KVH, int64_t D, int64_t I, int64_t BS, float eps,
                     int64_t int8_m_max) {
    const float *pending = NULL;
    for (int64_t l = 0; l < L; l++)
        if (decode_layer(x, &pending, scratch, M, layers + l, cos, sin, slot_blocks,
                         slot_offsets, tables, context_lens, scores, max_blocks, Dm, H, KVH, D,
                         I, BS, eps, int8_m_max))
            return -1;
    if (pending)
        for (int64_t i = 0; i < M * Dm; i++) x[i] += pending[i];
    return 0;
}
