/* The sampler's random draw for rows that ask for temperature alone (no top-k, no top-p): one
 * pass over a row's logits instead of torch's widening copy, division, softmax and two-level
 * search (4.6 ms of a 32-row step over the default model's 49,152-token vocabulary).
 *
 * A row's weights are w_i = exp(x_i / T - max_j x_j / T); a -inf logit (a token that the grammar
 * mask, a logit_bias or the min_tokens ban removed) weighs exactly 0, never exp's floor. The
 * token drawn is the first whose cumulative weight exceeds u * sum(w), u in [0, 1) the row's
 * own uniform (the caller draws it from the request's generator): the same inverse-CDF rule as
 * the torch path (kvseal/ops/torch_sampling.py), in the same two levels: the block of
 * SAMPLE_BLOCK tokens where the target falls (block sums accumulated in double), then the token
 * inside it. The weights are float32 exps (vec.h, relative error ~1e-7), so this path and torch's
 * agree on every draw except where u falls within rounding of a boundary between two tokens.
 * Called by NativeOps.draw_rows. */

#include "kvseal_ops.h"
#include "vec.h"

#define SAMPLE_BLOCK 512       /* a multiple of 16 */
#define SAMPLE_MAX_BLOCKS 1024 /* 524,288 tokens: a larger vocabulary takes the torch path */

static inline v16 weights16(v16 x, float inv_t, float top) {
    const v16i removed = x == (v16){0} - INFINITY;
    const v16 w = exp_v16(x * inv_t - top);
    return (v16)(~removed & (v16i)w);
}

static inline v16 max16(v16 a, v16 b) {
    const v16i greater = a > b; /* lanes: -1 where true */
    return (v16)((greater & (v16i)a) | (~greater & (v16i)b));
}

static inline float weight1(float x, float inv_t, float top) { return x == -INFINITY ? 0.0f : exp_s(x * inv_t - top); }

/* One row: the token drawn, or -1 where the row has a NaN or no token of nonzero weight (the
   caller then takes the torch path, which answers those rows as torch does). */
#define DEFINE_DRAW(NAME, T, LOAD16, AT)                                                                       \
    static int64_t NAME(const T *x, int64_t n, float inv_t, double u) {                                        \
        double sums[SAMPLE_MAX_BLOCKS];                                                                        \
        const int64_t num_blocks = (n + SAMPLE_BLOCK - 1) / SAMPLE_BLOCK;                                      \
        v16 most = (v16){0} - INFINITY;                                                                        \
        v16i nan = {0};                                                                                        \
        int64_t i = 0;                                                                                         \
        for (; i + 16 <= n; i += 16) {                                                                         \
            const v16 v = LOAD16(x + i);                                                                       \
            nan |= (v16i)(v != v);                                                                             \
            most = max16(most, v);                                                                             \
        }                                                                                                      \
        float top = -INFINITY;                                                                                 \
        for (int l = 0; l < 16; l++) {                                                                         \
            if (nan[l]) return -1;                                                                             \
            top = most[l] > top ? most[l] : top;                                                               \
        }                                                                                                      \
        for (; i < n; i++) {                                                                                   \
            const float v = AT(x, i);                                                                          \
            if (v != v) return -1;                                                                             \
            top = v > top ? v : top;                                                                           \
        }                                                                                                      \
        if (top == -INFINITY) return -1;                                                                       \
        top *= inv_t;                                                                                          \
        double total = 0.0;                                                                                    \
        for (int64_t b = 0; b < num_blocks; b++) {                                                             \
            const int64_t begin = b * SAMPLE_BLOCK, end = begin + SAMPLE_BLOCK < n ? begin + SAMPLE_BLOCK : n; \
            int64_t t = begin;                                                                                 \
            v16 acc = {0};                                                                                     \
            for (; t + 16 <= end; t += 16) acc += weights16(LOAD16(x + t), inv_t, top);                        \
            double sum = hsum8(fold16(acc));                                                                   \
            for (; t < end; t++) sum += weight1(AT(x, t), inv_t, top);                                         \
            sums[b] = sum;                                                                                     \
            total += sum;                                                                                      \
        }                                                                                                      \
        const double target = u * total;                                                                       \
        double before = 0.0;                                                                                   \
        int64_t b = 0, last_block = -1;                                                                        \
        for (; b < num_blocks; b++) {                                                                          \
            if (sums[b] > 0) last_block = b;                                                                   \
            if (before + sums[b] > target) break;                                                              \
            before += sums[b];                                                                                 \
        }                                                                                                      \
        if (last_block < 0) return -1;                                                                         \
        if (b == num_blocks) { /* rounding left the target at the total: the last block with mass */           \
            b = last_block;                                                                                    \
            before = total - sums[b];                                                                          \
        }                                                                                                      \
        const int64_t begin = b * SAMPLE_BLOCK, end = begin + SAMPLE_BLOCK < n ? begin + SAMPLE_BLOCK : n;     \
        int64_t last = -1;                                                                                     \
        for (int64_t t = begin; t < end; t++) {                                                                \
            const float w = weight1(AT(x, t), inv_t, top);                                                     \
            if (w > 0) {                                                                                       \
                last = t;                                                                                      \
                before += w;                                                                                   \
                if (before > target) return t;                                                                 \
            }                                                                                                  \
        }                                                                                                      \
        return last; /* rounding left the target past the block's own sum: its last token of mass */           \
    }
#define F32_AT(x, t) ((x)[t])
#define BF16_AT(x, t) widen_bf16_1((x)[t])
DEFINE_DRAW(draw_row, float, load16, F32_AT)
DEFINE_DRAW(draw_row_bf16, uint16_t, load16_bf16, BF16_AT)

int kvseal_draw_rows(const float *x, int64_t rows, int64_t n, const float *inv_temperature, const double *u,
                     int64_t *out, int num_threads) {
    if ((n + SAMPLE_BLOCK - 1) / SAMPLE_BLOCK > SAMPLE_MAX_BLOCKS) return -1;
    int failed = 0;
#pragma omp parallel for num_threads(rows >= 2 ? num_threads : 1) schedule(static) reduction(| : failed)
    for (int64_t r = 0; r < rows; r++) {
        out[r] = draw_row(x + r * n, n, inv_temperature[r], u[r]);
        failed |= out[r] < 0;
    }
    return failed ? -1 : 0;
}

int kvseal_draw_rows_bf16(const uint16_t *x, int64_t rows, int64_t n, const float *inv_temperature, const double *u,
                          int64_t *out, int num_threads) {
    if ((n + SAMPLE_BLOCK - 1) / SAMPLE_BLOCK > SAMPLE_MAX_BLOCKS) return -1;
    int failed = 0;
#pragma omp parallel for num_threads(rows >= 2 ? num_threads : 1) schedule(static) reduction(| : failed)
    for (int64_t r = 0; r < rows; r++) {
        out[r] = draw_row_bf16(x + r * n, n, inv_temperature[r], u[r]);
        failed |= out[r] < 0;
    }
    return failed ? -1 : 0;
}
