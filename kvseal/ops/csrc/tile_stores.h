/* The tile linears' epilogues: a 16-feature tile of float32 sums out as bfloat16 rows (+ bias), or
 * as float32 rows (+ float32 bias), or a gate tile and an up tile out as silu(gate) * up. Shared by linear_tiles.c and
 * linear_q4.c, so that the Q4_1 row kernel rounds its sums exactly as the tile linears round theirs. Internal. */
#ifndef KVSEAL_TILE_STORES_H
#define KVSEAL_TILE_STORES_H

#include <stdint.h>

#include "isa.h"
#include "vec.h"

#if KVSEAL_AVX512BF16
/* rows of a 16-column float32 tile (+ bias) into bfloat16 y, nr <= 16 valid columns: one
   vcvtneps2bf16 a row (round to nearest even; NaN stays NaN). */
static inline __attribute__((always_inline)) void store_tile_rows(const float *c, int rows, const uint16_t *bias,
                                                                  uint16_t *y, int64_t ldy, int64_t nr) {
    const __mmask16 mask = (__mmask16)((1u << nr) - 1u);
    const __m512 b =
        bias == NULL
            ? _mm512_setzero_ps()
            : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, bias)), 16));
    for (int r = 0; r < rows; r++) {
        const __m256bh out = _mm512_cvtneps_pbh(_mm512_add_ps(_mm512_loadu_ps(c + r * 16), b));
        _mm256_mask_storeu_epi16(y + r * ldy, mask, (__m256i)out);
    }
}

/* store_tile_rows without the rounding: rows of the float32 tile (+ float32 bias) into float32 y. */
static inline __attribute__((always_inline)) void store_tile_rows_f32(const float *c, int rows, const float *bias,
                                                                      float *y, int64_t ldy, int64_t nr) {
    const __mmask16 mask = (__mmask16)((1u << nr) - 1u);
    const __m512 b = bias == NULL ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(mask, bias);
    for (int r = 0; r < rows; r++)
        _mm512_mask_storeu_ps(y + r * ldy, mask, _mm512_add_ps(_mm512_loadu_ps(c + r * 16), b));
}

/* silu(gate) * up rows from a gate tile and an up tile (float32 sums), rounded as the two-pass
   path rounds: gate and up to bfloat16 (the linear's output), silu(gate) to bfloat16, the product. */
static inline __attribute__((always_inline)) void store_silu_rows(const float *gate, const float *up, int rows,
                                                                  uint16_t *act, int64_t ld) {
    const v16 one = (v16){0} + 1.0f;
    for (int r = 0; r < rows; r++) {
        const v16 g = round16_bf16(load16(gate + r * 16)), u = round16_bf16(load16(up + r * 16));
        store16_bf16(act + r * ld, round16_bf16(silu_mul16(g, one)) * u);
    }
}

#endif

#endif
