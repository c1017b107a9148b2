/* The small per-layer ops of the forward, each fused into one pass and one call: the residual
 * add with the RMSNorm that follows it, SiLU(gate) * up, rotate-half RoPE in place on the q and
 * k heads of the fused qkv rows, and the store of K and V from those rows into the pool.
 *
 * The residual stream is updated in place; the K/V store checks every slot against the layer
 * before writing any (a slot outside it: -1, nothing written), and the caller records the write
 * for the isolation checks (KVPool.write_by) as the torch store does.
 *
 * float32: the sum of squares in float32, as torch's rms_norm; SiLU from exp(-|x|) (never
 * overflows) with a division; RoPE as x * cos + roll(x) * signed_sin.
 *
 * bfloat16 (a bfloat16 model: activations, weights and pool in bfloat16): each op computes in
 * float32 and rounds to bfloat16 exactly where torch's bfloat16 formulation of the same op (and
 * transformers) rounds, so a result equals that formulation's up to the order of float32 sums
 * (the norm's sum of squares) and the last bits of exp (SiLU) before rounding. Where the build
 * targets AVX512-BF16 the 16-lane rounding is one vcvtneps2bf16 (round to nearest even, as
 * torch; it differs only in a NaN's sign and in flushing results below bfloat16's normal range
 * to zero, which torch's conversion never reaches in practice); SiLU takes recip16 (vrcp14ps and
 * a Newton step with AVX-512), whose last-bit differences vanish in the rounding but for a few
 * ulp-boundary cases.
 *
 * Called by NativeOps.add_rms_norm, gate_up_silu (the SiLU pass where the linear's own fused
 * kernel declines), rope_ and write_kv (kvseal/ops/native_backend.py), and by the decode loop. */

#include "kvseal_ops.h"
#include "vec.h"

/* ---- float32 ---- */

/* h [rows, dim] += delta (unless NULL); out = h / sqrt(mean(h^2) + eps) * weight.
   The sum of squares runs in float32, as torch's rms_norm does for float32 input. */
void kvseal_add_rms_norm(float *h, const float *delta, const float *weight, float eps, float *out, int64_t rows,
                         int64_t dim, int num_threads) {
#pragma omp parallel for num_threads(rows >= 64 ? num_threads : 1) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        float *hr = h + r * dim, *o = out + r * dim;
        const float *dr = delta == NULL ? NULL : delta + r * dim;
        v8 acc = {0};
        int64_t i = 0;
        for (; i + 8 <= dim; i += 8) {
            v8 x = load8(hr + i);
            if (dr != NULL) {
                x += load8(dr + i);
                store8(hr + i, x);
            }
            acc += x * x;
        }
        float sum = hsum8(acc);
        for (; i < dim; i++) {
            if (dr != NULL) hr[i] += dr[i];
            sum += hr[i] * hr[i];
        }
        const float rstd = 1.0f / sqrtf(sum / (float)dim + eps);
        for (i = 0; i + 8 <= dim; i += 8) store8(o + i, load8(hr + i) * rstd * load8(weight + i));
        for (; i < dim; i++) o[i] = hr[i] * rstd * weight[i];
    }
}

/* gate_up [rows, 2 * inter] (gate, then up) -> out [rows, inter] = silu(gate) * up. */
void kvseal_silu_mul(const float *gate_up, float *out, int64_t rows, int64_t inter, int num_threads) {
#pragma omp parallel for num_threads(rows >= 16 ? num_threads : 1) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate_up + r * 2 * inter, *u = g + inter;
        float *o = out + r * inter;
        int64_t i = 0;
        for (; i + 8 <= inter; i += 8) store8(o + i, silu_mul8(load8(g + i), load8(u + i)));
        for (; i < inter; i++) {
            const float x = g[i], t = exp_s(x < 0.0f ? x : -x);
            o[i] = x * (x < 0.0f ? t : 1.0f) / (1.0f + t) * u[i];
        }
    }
}

/* Rotate-half RoPE in place on the first `heads` heads of each row of qkv [rows, row_stride]
   (q heads then k heads, head_dim each): x * cos + roll(x, head_dim / 2) * signed_sin, where
   cos and signed_sin are [rows, head_dim] (sin with its first half negated). */
void kvseal_rope(float *qkv, const float *cos, const float *signed_sin, int64_t rows, int64_t row_stride, int64_t heads,
                 int64_t head_dim) {
    const int64_t half = head_dim / 2;
    for (int64_t r = 0; r < rows; r++) {
        const float *c = cos + r * head_dim, *s = signed_sin + r * head_dim;
        for (int64_t h = 0; h < heads; h++) {
            float *x = qkv + r * row_stride + h * head_dim;
            int64_t i = 0;
            for (; i + 8 <= half; i += 8) {
                const v8 lo = load8(x + i), hi = load8(x + half + i);
                store8(x + i, lo * load8(c + i) + hi * load8(s + i));
                store8(x + half + i, hi * load8(c + half + i) + lo * load8(s + half + i));
            }
            for (; i < half; i++) {
                const float lo = x[i], hi = x[half + i];
                x[i] = lo * c[i] + hi * s[i];
                x[half + i] = hi * c[half + i] + lo * s[half + i];
            }
        }
    }
}

/* Store new tokens' K and V into one layer of the pool: k_new, v_new rows of qkv (row stride
   row_stride, kv_heads * head_dim elements each); pool layer [kv_heads, num_slots, head_dim], of
   elements `elem_bytes` wide. Returns -1, writing nothing, if any slot is outside the layer. */
static int write_slots(const char *k_new, const char *v_new, int64_t row_stride, const int64_t *slots, char *k_pool,
                       char *v_pool, int64_t rows, int64_t kv_heads, int64_t head_dim, int64_t num_slots,
                       int64_t elem_bytes) {
    for (int64_t r = 0; r < rows; r++)
        if (slots[r] < 0 || slots[r] >= num_slots) return -1;
    const int64_t head_bytes = head_dim * elem_bytes;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t h = 0; h < kv_heads; h++) {
            const int64_t at = (h * num_slots + slots[r]) * head_bytes;
            const int64_t from = (r * row_stride + h * head_dim) * elem_bytes;
            memcpy(k_pool + at, k_new + from, head_bytes);
            memcpy(v_pool + at, v_new + from, head_bytes);
        }
    return 0;
}

int kvseal_write_slots(const float *k_new, const float *v_new, int64_t row_stride, const int64_t *slots, float *k_pool,
                       float *v_pool, int64_t rows, int64_t kv_heads, int64_t head_dim, int64_t num_slots) {
    return write_slots((const char *)k_new, (const char *)v_new, row_stride, slots, (char *)k_pool, (char *)v_pool,
                       rows, kv_heads, head_dim, num_slots, sizeof(float));
}

int kvseal_write_slots_bf16(const uint16_t *k_new, const uint16_t *v_new, int64_t row_stride, const int64_t *slots,
                            uint16_t *k_pool, uint16_t *v_pool, int64_t rows, int64_t kv_heads, int64_t head_dim,
                            int64_t num_slots) {
    return write_slots((const char *)k_new, (const char *)v_new, row_stride, slots, (char *)k_pool, (char *)v_pool,
                       rows, kv_heads, head_dim, num_slots, sizeof(uint16_t));
}

/* ---- bfloat16 ---- */

/* h [rows, dim] += delta (unless NULL), rounded to bfloat16, in place; out = bf16(bf16(h *
   rstd) * weight), rstd = 1 / sqrt(mean(h^2) + eps) over h in float32: transformers'
   `weight * (h.float() * rsqrt(var + eps)).to(bfloat16)`. */
void kvseal_add_rms_norm_bf16(uint16_t *h, const uint16_t *delta, const uint16_t *weight, float eps, uint16_t *out,
                              int64_t rows, int64_t dim, int num_threads) {
#pragma omp parallel for num_threads(rows >= 64 ? num_threads : 1) schedule(static)
    for (int64_t r = 0; r < rows; r++)
        add_rms_norm_row_bf16(h + r * dim, delta == NULL ? NULL : delta + r * dim, weight, eps, out + r * dim, dim);
}

/* gate_up [rows, 2 * inter] (gate, then up) -> out [rows, inter] = bf16(bf16(silu(gate)) * up). */
void kvseal_silu_mul_bf16(const uint16_t *gate_up, uint16_t *out, int64_t rows, int64_t inter, int num_threads) {
    const v16 one = (v16){0} + 1.0f;
#pragma omp parallel for num_threads(rows >= 16 ? num_threads : 1) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *g = gate_up + r * 2 * inter, *u = g + inter;
        uint16_t *o = out + r * inter;
        int64_t i = 0;
        for (; i + 16 <= inter; i += 16)
            store16_bf16(o + i, round16_bf16(silu_mul16(load16_bf16(g + i), one)) * load16_bf16(u + i));
        for (; i < inter; i++) {
            const float x = widen_bf16_1(g[i]), t = exp_s(x < 0.0f ? x : -x);
            o[i] = to_bf16(round_bf16_1(x * (x < 0.0f ? t : 1.0f) / (1.0f + t)) * widen_bf16_1(u[i]));
        }
    }
}

/* Rotate-half RoPE in place on the first `heads` heads of each row of qkv [rows, row_stride]:
   bf16(bf16(x * cos) + bf16(roll(x, head_dim / 2) * signed_sin)), cos and signed_sin [rows,
   head_dim] bfloat16 (`RotaryEmbedding.apply` in bfloat16, op by op). */
void kvseal_rope_bf16(uint16_t *qkv, const uint16_t *cos, const uint16_t *signed_sin, int64_t rows, int64_t row_stride,
                      int64_t heads, int64_t head_dim, int num_threads) {
    const int64_t half = head_dim / 2;
#pragma omp parallel for num_threads(rows >= 64 ? num_threads : 1) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *c = cos + r * head_dim, *s = signed_sin + r * head_dim;
        for (int64_t h = 0; h < heads; h++) {
            uint16_t *x = qkv + r * row_stride + h * head_dim;
            int64_t i = 0;
            for (; i + 16 <= half; i += 16) {
                const v16 lo = load16_bf16(x + i), hi = load16_bf16(x + half + i);
                store16_bf16(x + i, round16_bf16(lo * load16_bf16(c + i)) + round16_bf16(hi * load16_bf16(s + i)));
                store16_bf16(x + half + i, round16_bf16(hi * load16_bf16(c + half + i))
                                               + round16_bf16(lo * load16_bf16(s + half + i)));
            }
            for (; i < half; i++) {
                const float lo = widen_bf16_1(x[i]), hi = widen_bf16_1(x[half + i]);
                x[i] = to_bf16(round_bf16_1(lo * widen_bf16_1(c[i])) + round_bf16_1(hi * widen_bf16_1(s[i])));
                x[half + i] = to_bf16(round_bf16_1(hi * widen_bf16_1(c[half + i]))
                                      + round_bf16_1(lo * widen_bf16_1(s[half + i])));
            }
        }
    }
}
