/* The sampler's greedy choice: the row-wise argmax of a step's logits, torch.argmax's answer.
 * torch's CPU argmax walks a [32, 49,152] logits block (a 32-row decode step) one element at a
 * time: 1.8 ms of the step. bfloat16 logits are read as they are, each value widened exactly, so
 * a greedy row never needs a float32 copy of the logits. Called by NativeOps.argmax_rows: the
 * sampler's whole batch when every row is plain greedy, and the greedy rows of a mixed batch. */

#include "kvseal_ops.h"
#include "vec.h"

/* Row-wise argmax of x [rows, n] into out [rows], torch.argmax's answer: the first index of
   the largest value, or of the first NaN if the row has one. Four 16-lane vectors (64 lanes, in
   four independent compare-and-select chains, so the loop is not held up by one chain's
   latency) each keep the first index of their own largest value (a strict >: a lane sees its
   elements in index order), then the lanes holding the row's largest value give the smallest
   index. A 32-row decode step's [32, 49,152] bfloat16 logits: 0.52 ms on one thread in eight
   lanes and one chain, ~0.1 ms here. */
#define ARGMAX_CHAINS 4
#define ARGMAX_LANES (16 * ARGMAX_CHAINS)
#define DEFINE_ARGMAX(NAME, T, LOAD16, AT)                                               \
    static int64_t NAME(const T *x, int64_t n) {                                         \
        int64_t best = 0, i = 1;                                                         \
        if (n >= ARGMAX_LANES) {                                                         \
            v16 bv[ARGMAX_CHAINS];                                                       \
            v16i bi[ARGMAX_CHAINS], idx[ARGMAX_CHAINS], nan = {0};                       \
            for (int c = 0; c < ARGMAX_CHAINS; c++) {                                    \
                bv[c] = LOAD16(x + 16 * c);                                              \
                for (int l = 0; l < 16; l++) bi[c][l] = 16 * c + l;                      \
                idx[c] = bi[c];                                                          \
                nan |= (v16i)(bv[c] != bv[c]);                                           \
            }                                                                            \
            for (i = ARGMAX_LANES; i + ARGMAX_LANES <= n; i += ARGMAX_LANES)             \
                for (int c = 0; c < ARGMAX_CHAINS; c++) {                                \
                    const v16 v = LOAD16(x + i + 16 * c);                                \
                    idx[c] += ARGMAX_LANES;                                              \
                    const v16i gt = (v16i)(v > bv[c]);                                   \
                    nan |= (v16i)(v != v);                                               \
                    bv[c] = (v16)(((v16i)v & gt) | ((v16i)bv[c] & ~gt));                 \
                    bi[c] = (idx[c] & gt) | (bi[c] & ~gt);                               \
                }                                                                        \
            int any_nan = 0;                                                             \
            for (int l = 0; l < 16; l++) any_nan |= nan[l] != 0;                         \
            if (any_nan) /* the first NaN is in the part the lanes covered */            \
                for (int64_t t = 0; t < i; t++)                                          \
                    if (AT(x, t) != AT(x, t)) return t;                                  \
            float top = bv[0][0]; /* no NaN in the lanes: every comparison is ordered */ \
            for (int c = 0; c < ARGMAX_CHAINS; c++)                                      \
                for (int l = 0; l < 16; l++) top = bv[c][l] > top ? bv[c][l] : top;      \
            best = i;                                                                    \
            for (int c = 0; c < ARGMAX_CHAINS; c++)                                      \
                for (int l = 0; l < 16; l++)                                             \
                    if (bv[c][l] == top && bi[c][l] < best) best = bi[c][l];             \
        } else if (AT(x, 0) != AT(x, 0)) {                                               \
            return 0;                                                                    \
        }                                                                                \
        for (; i < n; i++) {                                                             \
            if (AT(x, i) != AT(x, i)) return i;                                          \
            if (AT(x, i) > AT(x, best)) best = i;                                        \
        }                                                                                \
        return best;                                                                     \
    }
#define F32_AT(x, t) ((x)[t])
#define BF16_AT(x, t) widen_bf16_1((x)[t])
DEFINE_ARGMAX(argmax_row, float, load16, F32_AT)
/* over bfloat16 rows, each value widened exactly: the argmax of the row converted to float32 */
DEFINE_ARGMAX(argmax_row_bf16, uint16_t, load16_bf16, BF16_AT)

void kvseal_argmax_rows(const float *x, int64_t rows, int64_t n, int64_t *out, int num_threads) {
#pragma omp parallel for num_threads(rows >= 2 ? num_threads : 1) schedule(static)
    for (int64_t r = 0; r < rows; r++) out[r] = argmax_row(x + r * n, n);
}

void kvseal_argmax_rows_bf16(const uint16_t *x, int64_t rows, int64_t n, int64_t *out, int num_threads) {
#pragma omp parallel for num_threads(rows >= 2 ? num_threads : 1) schedule(static)
    for (int64_t r = 0; r < rows; r++) out[r] = argmax_row_bf16(x + r * n, n);
}
