/* The sampler's greedy choice: the row-wise argmax of a step's logits, torch.argmax's answer.
 * torch's CPU argmax walks a [32, 49,152] logits block (a 32-row decode step) one element at a
 * time: 1.8 ms of the step, against 0.16 ms here. bfloat16 logits are read as they are, each
 * value widened exactly, so a greedy row never needs a float32 copy of the logits. */

#include "kvseal_ops.h"
#include "vec.h"

/* Row-wise argmax of x [rows, n] into out [rows], torch.argmax's answer: the first index of
   the largest value, or of the first NaN if the row has one. Eight lanes each keep the first
   index of their own largest value (a strict >), then the lanes holding the row's largest
   value give the smallest index. torch's CPU argmax walks a [32, 49,152] logits block (a
   32-row decode step's greedy choice) one element at a time: 1.8 ms, against 0.16 ms here. */
#define DEFINE_ARGMAX(NAME, T, LOAD8, AT)                                             \
    static int64_t NAME(const T *x, int64_t n) {                                      \
        int64_t best = 0, i = 1;                                                      \
        if (n >= 8) {                                                                 \
            v8 bv = LOAD8(x);                                                         \
            v8i bi = {0, 1, 2, 3, 4, 5, 6, 7}, idx = bi, nan = (v8i)(bv != bv);       \
            for (i = 8; i + 8 <= n; i += 8) {                                         \
                const v8 v = LOAD8(x + i);                                            \
                idx += 8;                                                             \
                const v8i gt = (v8i)(v > bv);                                         \
                nan |= (v8i)(v != v);                                                 \
                bv = (v8)(((v8i)v & gt) | ((v8i)bv & ~gt));                           \
                bi = (idx & gt) | (bi & ~gt);                                         \
            }                                                                         \
            int any_nan = 0;                                                          \
            for (int j = 0; j < 8; j++) any_nan |= nan[j] != 0;                       \
            if (any_nan) /* the first NaN is in the part the lanes covered */         \
                for (int64_t t = 0; t < i; t++)                                       \
                    if (AT(x, t) != AT(x, t)) return t;                               \
            float top = bv[0]; /* no NaN in the lanes: every comparison is ordered */ \
            for (int j = 1; j < 8; j++) top = bv[j] > top ? bv[j] : top;              \
            best = i;                                                                 \
            for (int j = 0; j < 8; j++)                                               \
                if (bv[j] == top && bi[j] < best) best = bi[j];                       \
        } else if (AT(x, 0) != AT(x, 0)) {                                            \
            return 0;                                                                 \
        }                                                                             \
        for (; i < n; i++) {                                                          \
            if (AT(x, i) != AT(x, i)) return i;                                       \
            if (AT(x, i) > AT(x, best)) best = i;                                     \
        }                                                                             \
        return best;                                                                  \
    }
#define F32_AT(x, t) ((x)[t])
#define BF16_AT(x, t) widen_bf16_1((x)[t])
DEFINE_ARGMAX(argmax_row, float, load8, F32_AT)
/* over bfloat16 rows, each value widened exactly: the argmax of the row converted to float32 */
DEFINE_ARGMAX(argmax_row_bf16, uint16_t, load8_bf16, BF16_AT)

void kvseal_argmax_rows(const float *x, int64_t rows, int64_t n, int64_t *out, int num_threads) {
#pragma omp parallel for num_threads(rows >= 2 ? num_threads : 1) schedule(static)
    for (int64_t r = 0; r < rows; r++) out[r] = argmax_row(x + r * n, n);
}

void kvseal_argmax_rows_bf16(const uint16_t *x, int64_t rows, int64_t n, int64_t *out, int num_threads) {
#pragma omp parallel for num_threads(rows >= 2 ? num_threads : 1) schedule(static)
    for (int64_t r = 0; r < rows; r++) out[r] = argmax_row_bf16(x + r * n, n);
}
