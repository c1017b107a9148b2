/* Every decoder layer of a decode-only step in one call: the same kernels the per-layer forward
 * calls one by one, in the same order on the same buffers, so the result is bit-equal; what goes
 * is ~20 Python calls per layer (4-6 ms of a ~33 ms single-stream step on SmolLM2-135M).
 *
 * A float32 model's linears must all be panels of one kind (float32, bfloat16-stored or int8,
 * enum kvseal_panel_kind), a bfloat16 model's all tiles; models with per-head q/k norms (Qwen3)
 * or other linears keep the per-layer path. The K/V writes are the same bounds-checked kernel
 * (a slot outside the pool: -1, nothing written in that layer), and *layers_written tells the
 * caller which layers to record (KVPool.write_layers_by), so the next step's isolation checks
 * see the same coverage as after the per-layer path. The bfloat16 loop reads q in place from
 * the qkv rows, and multiplies a single row by a layer's Q4_1 blocks where the table has them
 * and the row kernel takes the call (linear_q4.c: bit-equal to the tiles it stands for).
 *
 * Driven by kvseal/ops/native_decode_loop.py (NativeOps.decode_loop), which CausalLM.forward
 * calls for a step whose every row decodes one token. */

#include <string.h>

#include "kvseal_ops.h"

/* One linear with the model's weight kind (enum kvseal_panel_kind). Returns the kernel's status
   (0: done). */
static int loop_linear(int kind, const void *const *w, int which, const float *x, float *y, int64_t rows, int64_t n_out,
                       int64_t k_in, int threads) {
    const float *bias = w[which + 2], *scale = w[which + 1];
    if (kind == KVSEAL_PANELS_F32) return kvseal_linear_f32(x, w[which], bias, y, rows, n_out, k_in, threads);
    if (kind == KVSEAL_PANELS_BF16) return kvseal_linear_bf16(x, w[which], bias, y, rows, n_out, k_in, threads);
    kvseal_linear_i8(x, w[which], scale, bias, y, rows, n_out, k_in, threads);
    return 0;
}

int kvseal_decode_layers(int kind, const struct kvseal_decode_step *step, const void *const *layers,
                         const float *final_norm, float *h, float *x, float *qkv, float *q, float *attn, float *tmp,
                         float *gate_up, float *act, const float *cos, const float *signed_sin, const int64_t *slots,
                         const int64_t *tables, const int64_t *context_lens, int64_t *layers_written) {
    const int64_t num_layers = step->num_layers, rows = step->rows, hidden = step->hidden, heads = step->heads;
    const int64_t kv_heads = step->kv_heads, head_dim = step->head_dim, inter = step->inter;
    const int64_t num_pages = step->num_pages, page_size = step->page_size, table_width = step->table_width;
    const int64_t max_context = step->max_context;
    const float eps = step->eps, scale = step->scale;
    const int threads = step->threads;
    const int64_t q_size = heads * head_dim, kv_size = kv_heads * head_dim, width = q_size + 2 * kv_size;
    *layers_written = 0;
    kvseal_add_rms_norm(h, NULL, layers[KVSEAL_INPUT_NORM], eps, x, rows, hidden, threads);
    for (int64_t l = 0; l < num_layers; l++) {
        const void *const *w = layers + l * KVSEAL_LAYER_POINTERS;
        float *k_pool = (float *)w[KVSEAL_K_POOL], *v_pool = (float *)w[KVSEAL_V_POOL];
        if (loop_linear(kind, w, KVSEAL_W_QKV, x, qkv, rows, width, hidden, threads)) return -2;
        kvseal_rope(qkv, cos, signed_sin, rows, width, heads + kv_heads, head_dim);
        if (kvseal_write_slots(qkv + q_size, qkv + q_size + kv_size, width, slots, k_pool, v_pool, rows, kv_heads,
                               head_dim, num_pages * page_size))
            return -1;
        *layers_written = l + 1;
        for (int64_t r = 0; r < rows; r++) memcpy(q + r * q_size, qkv + r * width, sizeof(float) * q_size);
        if (kvseal_decode_attention(q, k_pool, v_pool, tables, context_lens, attn, rows, kv_heads, heads / kv_heads,
                                    head_dim, num_pages, page_size, table_width, max_context, scale, threads))
            return -2;
        if (loop_linear(kind, w, KVSEAL_W_O, attn, tmp, rows, hidden, q_size, threads)) return -2;
        kvseal_add_rms_norm(h, tmp, w[KVSEAL_POST_NORM], eps, x, rows, hidden, threads);
        if (kind != KVSEAL_PANELS_F32
            || kvseal_linear_silu_f32(x, w[KVSEAL_W_GATE_UP], w[KVSEAL_B_GATE_UP], act, rows, inter, hidden, threads)) {
            if (loop_linear(kind, w, KVSEAL_W_GATE_UP, x, gate_up, rows, 2 * inter, hidden, threads)) return -2;
            kvseal_silu_mul(gate_up, act, rows, inter, threads);
        }
        if (loop_linear(kind, w, KVSEAL_W_DOWN, act, tmp, rows, hidden, inter, threads)) return -2;
        const float *next_norm =
            l + 1 < num_layers ? (const float *)w[KVSEAL_LAYER_POINTERS + KVSEAL_INPUT_NORM] : final_norm;
        kvseal_add_rms_norm(h, tmp, next_norm, eps, x, rows, hidden, threads);
    }
    return 0;
}

/* A bfloat16 loop's linear (weights at w[tiles], its bias at w[tiles + 2]): one row over the
   layer's Q4_1 blocks (w[q4]) where it has them and the row kernel takes the call (the tiles on
   AVX512-BF16: bit-equal, linear_q4.c), else the tiles. Returns the kernel's status (0: done). */
static int loop_tiles(const void *const *w, int tiles, int q4, const uint16_t *x, uint16_t *y, int64_t rows,
                      int64_t n_out, int64_t k_in, int threads) {
    if (rows == 1 && w[q4] != NULL && kvseal_linear_q4_1_row(x, w[q4], w[tiles + 2], y, n_out, k_in, threads) == 0)
        return 0;
    return kvseal_linear_tiles(x, w[tiles], w[tiles + 2], y, rows, n_out, k_in, threads);
}

/* loop_tiles into y, then h += y and out = RMSNorm(h) * weight: kvseal_linear_tiles_add_norm_bf16,
   which below 256 rows is these two calls. */
static int loop_tiles_add_norm(const void *const *w, int tiles, int q4, const uint16_t *x, uint16_t *y, uint16_t *h,
                               const uint16_t *weight, float eps, uint16_t *out, int64_t rows, int64_t n_out,
                               int64_t k_in, int threads) {
    if (rows == 1 && w[q4] != NULL && kvseal_linear_q4_1_row(x, w[q4], w[tiles + 2], y, n_out, k_in, threads) == 0) {
        kvseal_add_rms_norm_bf16(h, y, weight, eps, out, rows, n_out, threads);
        return 0;
    }
    return kvseal_linear_tiles_add_norm_bf16(x, w[tiles], w[tiles + 2], y, h, weight, eps, out, rows, n_out, k_in,
                                             threads);
}

/* The MLP's fused gate/up + SiLU in one pass (no bias): over the Q4_1 blocks at one row where
   they take it, else the tiles. Returns -1, computing nothing, where neither takes it. */
static int loop_silu(const void *const *w, const uint16_t *x, uint16_t *act, int64_t rows, int64_t inter, int64_t k_in,
                     int threads) {
    if (rows == 1 && w[KVSEAL_Q4_GATE_UP] != NULL
        && kvseal_linear_silu_q4_1_row(x, w[KVSEAL_Q4_GATE_UP], act, inter, k_in, threads) == 0)
        return 0;
    return kvseal_linear_silu_tiles(x, w[KVSEAL_W_GATE_UP], act, rows, inter, k_in, threads);
}

int kvseal_decode_layers_bf16(const struct kvseal_decode_step *step, const void *const *layers,
                              const uint16_t *final_norm, uint16_t *h, uint16_t *x, uint16_t *qkv, uint16_t *attn,
                              uint16_t *tmp, uint16_t *gate_up, uint16_t *act, const uint16_t *cos,
                              const uint16_t *signed_sin, const int64_t *slots, const int64_t *tables,
                              const int64_t *context_lens, int64_t *layers_written) {
    /* every row a decode row, no chunk, every row's stream out in x */
    return kvseal_prefill_layers_bf16(step, layers, final_norm, h, x, qkv, attn, tmp, gate_up, act, cos, signed_sin,
                                      slots, step->rows, tables, context_lens, NULL, NULL, 0, NULL, 0, NULL, NULL, 0,
                                      NULL, NULL, layers_written);
}

/* A step of fresh prefill chunks, after num_decodes decode rows or none, every layer in one call:
   rows 0..num_decodes-1 decode one token each (tables, context_lens: as kvseal_decode_attention),
   then the chunks, in num_groups groups of equal lengths (group g: groups[2g] chunks of
   groups[2g + 1] tokens; starts: each chunk's first row, group by group; a chunk's tokens at
   positions 0..length-1), then num_spans chunks that continue a cached prefix (spans as in
   kvseal_ops.h: each attends to its own rows and its prefix's slots through its own pages), as the
   per-layer forward runs it: the same kernels in the same order (the prefill attention over each
   chunk's own rows, one call a group, one a span), and the last layer's tail (o_proj, MLP,
   final norm) on the `num_sampled` sampled rows only, gathered into hs and xs. A 256-token
   prompt's step spends ~5 ms of ~50 in the per-layer forward's ~20 Python calls a layer.
   Returns as kvseal_decode_layers_bf16 (-2 also where the build has no bfloat16 prefill
   attention); the final-normed rows are in xs ([num_sampled, hidden]), or with sampled NULL
   every row's in x (the decode loop: kvseal_decode_layers_bf16 is this with every row a decode
   row; below 256 rows the o_proj and down_proj calls are the two calls they fuse). */
int kvseal_prefill_layers_bf16(const struct kvseal_decode_step *step, const void *const *layers,
                               const uint16_t *final_norm, uint16_t *h, uint16_t *x, uint16_t *qkv, uint16_t *attn,
                               uint16_t *tmp, uint16_t *gate_up, uint16_t *act, const uint16_t *cos,
                               const uint16_t *signed_sin, const int64_t *slots, int64_t num_decodes,
                               const int64_t *tables, const int64_t *context_lens, const int64_t *starts,
                               const int64_t *groups, int64_t num_groups, const int64_t *spans, int64_t num_spans,
                               const int64_t *span_pages, const int64_t *sampled, int64_t num_sampled, uint16_t *hs,
                               uint16_t *xs, int64_t *layers_written) {
    const int64_t num_layers = step->num_layers, rows = step->rows, hidden = step->hidden, heads = step->heads;
    const int64_t kv_heads = step->kv_heads, head_dim = step->head_dim, inter = step->inter;
    const int64_t num_pages = step->num_pages, page_size = step->page_size, num_slots = num_pages * page_size;
    const float eps = step->eps, scale = step->scale;
    const int threads = step->threads;
    const int64_t q_size = heads * head_dim, kv_size = kv_heads * head_dim, width = q_size + 2 * kv_size;
    *layers_written = 0;
    kvseal_add_rms_norm_bf16(h, NULL, layers[KVSEAL_INPUT_NORM], eps, x, rows, hidden, threads);
    for (int64_t l = 0; l < num_layers; l++) {
        const void *const *w = layers + l * KVSEAL_LAYER_POINTERS;
        if (loop_tiles(w, KVSEAL_W_QKV, KVSEAL_Q4_QKV, x, qkv, rows, width, hidden, threads)) return -2;
        kvseal_rope_bf16(qkv, cos, signed_sin, rows, width, heads + kv_heads, head_dim, threads);
        uint16_t *k_pool = (uint16_t *)w[KVSEAL_K_POOL], *v_pool = (uint16_t *)w[KVSEAL_V_POOL];
        if (kvseal_write_slots_bf16(qkv + q_size, qkv + q_size + kv_size, width, slots, k_pool, v_pool, rows, kv_heads,
                                    head_dim, num_slots))
            return -1;
        *layers_written = l + 1;
        if (num_decodes > 0
            && kvseal_decode_attention_bf16(qkv, width, k_pool, v_pool, tables, context_lens, attn, q_size, num_decodes,
                                            kv_heads, heads / kv_heads, head_dim, num_pages, page_size,
                                            step->table_width, step->max_context, scale, KVSEAL_SCORES_AMX, threads))
            return -2;
        for (int64_t g = 0, first = 0; g < num_groups; first += groups[2 * g], g++)
            if (kvseal_prefill_attention_bf16(qkv, width, starts + first, groups[2 * g], groups[2 * g + 1], heads,
                                              kv_heads, head_dim, scale, attn, 0, NULL, NULL, NULL, 0, 1, threads))
                return -2;
        for (int64_t s = 0; s < num_spans; s++) {
            const int64_t *span = spans + 4 * s; /* first row, rows, prefix slots, pages offset */
            if (kvseal_prefill_attention_bf16(qkv, width, span, 1, span[1], heads, kv_heads, head_dim, scale, attn,
                                              span[2], span_pages + span[3], k_pool, v_pool, num_slots * head_dim,
                                              page_size, threads))
                return -2;
        }
        int64_t n = rows;
        uint16_t *hn = h, *xn = x, *an = attn;
        if (l + 1 == num_layers && sampled != NULL) { /* only the sampled rows' stream from here on */
            for (int64_t i = 0; i < num_sampled; i++) {
                memcpy(qkv + i * q_size, attn + sampled[i] * q_size, sizeof(uint16_t) * q_size);
                memcpy(hs + i * hidden, h + sampled[i] * hidden, sizeof(uint16_t) * hidden);
            }
            n = num_sampled, hn = hs, xn = xs, an = qkv;
        }
        if (loop_tiles_add_norm(w, KVSEAL_W_O, KVSEAL_Q4_O, an, tmp, hn, w[KVSEAL_POST_NORM], eps, xn, n, hidden,
                                q_size, threads))
            return -2;
        if (w[KVSEAL_B_GATE_UP] != NULL || loop_silu(w, xn, act, n, inter, hidden, threads)) {
            if (loop_tiles(w, KVSEAL_W_GATE_UP, KVSEAL_Q4_GATE_UP, xn, gate_up, n, 2 * inter, hidden, threads))
                return -2;
            kvseal_silu_mul_bf16(gate_up, act, n, inter, threads);
        }
        const uint16_t *next_norm =
            l + 1 < num_layers ? (const uint16_t *)w[KVSEAL_LAYER_POINTERS + KVSEAL_INPUT_NORM] : final_norm;
        if (loop_tiles_add_norm(w, KVSEAL_W_DOWN, KVSEAL_Q4_DOWN, act, tmp, hn, next_norm, eps, xn, n, hidden, inter,
                                threads))
            return -2;
    }
    return 0;
}
