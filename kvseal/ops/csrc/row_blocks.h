/* What the one-row linears over a GGUF's blocks share (linear_q4.c: Q4_1, linear_q8.c: Q8_0): a job,
 * the threads' schedule over its panels, and the tile linears' epilogues. Internal.
 *
 * Each kernel packs its blocks in panels of 16 features ([ceil(n_out / 16)][k_in / 32] packed
 * blocks, panel_bytes a panel) and gives a panel_row: one panel against the row x, the 16
 * features' float32 sums exactly as dot_block sums one row on the AVX512-BF16 engine
 * (linear_tiles.c, R = 1, S = ROW_SUMS: k-pair j into accumulator j % ROW_SUMS by vdpbf16ps
 * against x's pair broadcast, row_sums_out adding the accumulators in order). row_blocks_run
 * hands the panels to the threads and writes each panel's sums through the tile linears' own
 * epilogues (tile_stores.h), so each output is rounded as theirs is. */
#ifndef KVSEAL_ROW_BLOCKS_H
#define KVSEAL_ROW_BLOCKS_H

#include <stdint.h>
#include <string.h>

#include "isa.h"

#if KVSEAL_AVX512BF16
#define ROW_SUMS 8 /* accumulators a panel's k-pairs go into: dot_block's S at one row */

/* sums[16] = one packed panel against x [k_in] (see above). */
typedef void (*row_panel_fn)(const uint16_t *x, int64_t k_in, const uint8_t *panel, float *sums);

/* One row through a packed weight: a plain linear writes y [n_out] (+ bias); with `half` > 0 it
   is the MLP's fused gate/up ([2 * half * 16, k_in]) and writes y [half * 16] = silu(gate) * up. */
struct row_job {
    row_panel_fn panel_row;
    int64_t panel_bytes;
    const uint16_t *x, *bias;
    const uint8_t *packed;
    uint16_t *y;
    int64_t n_out, k_in, half;
    float *yf;             /* a plain linear's float32 sums instead of y (the _f32 entry points), or NULL */
    const float *bias_f32; /* their bias, or NULL */
};

/* x's k-pair p (x[2p], x[2p + 1]) in every lane: vdpbf16ps's other operand. */
static inline __m512bh row_pair(const uint16_t *x, int64_t p) {
    int32_t pair;
    memcpy(&pair, x + 2 * p, sizeof pair);
    return (__m512bh)_mm512_set1_epi32(pair);
}

/* 16 float16 at `halves`, one per feature, in a k-pair's lanes (vdpbf16ps operand order): lo
   features 0-7's, each twice in a row, hi features 8-15's. */
struct row_lanes {
    __m512 lo, hi;
};

static inline struct row_lanes row_feature_lanes(const uint8_t *halves) {
    const __m512i dup_lo = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512i dup_hi = _mm512_add_epi32(dup_lo, _mm512_set1_epi32(8));
    const __m512 v = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)halves));
    return (struct row_lanes){_mm512_permutexvar_ps(dup_lo, v), _mm512_permutexvar_ps(dup_hi, v)};
}

/* The accumulators added in order 0..ROW_SUMS-1 (dot_block's order) into sums[16]. */
static inline void row_sums_out(const __m512 *acc, float *sums) {
    __m512 sum = acc[0];
    for (int s = 1; s < ROW_SUMS; s++) sum = _mm512_add_ps(sum, acc[s]);
    _mm512_storeu_ps(sums, sum);
}

/* The job's `steps` steps (panel i of a plain linear; gate panel i with up panel i + half) over
   num_threads threads. */
void row_blocks_run(const struct row_job *j, int64_t steps, int num_threads);
#endif

#endif
