/* bfloat16 linears at one row over a GGUF's Q8_0 blocks, bit-equal to the tile linears: the lm_head.
 *
 * Why. The default model (SmolLM2-135M) ships its embedding table, which is also its lm_head (tied
 * embeddings), as Q8_0: blocks of 32 weights along k, each with a float16 scale d and 32 int8 q
 * (8.5 bits a weight). kvseal serves the bfloat16 weights the loader converts them to,
 * bfloat16(float32(d) * q): gguf's numpy dequantization, then torch's cast (round to nearest
 * even). At one row the lm_head is ~20% of a decode step's bytes: 56.6 MB of bfloat16 tiles
 * against 30.1 MB of blocks. This kernel reads the blocks and dequantizes each weight in
 * registers to exactly that bfloat16 value: the product d * q is exact in float32 (d has at most
 * 11 significant bits, q at most 7, and |d * q| <= 65504 * 128), so the one rounding is the cast's,
 * which vcvtne2ps2bf16 makes (round to nearest even). It flushes float32 denormals, but no weight
 * is one: a nonzero product is a multiple of float16's 2^-24. (A d that is infinite or NaN, which
 * the quantizer never writes, gives NaN or infinite weights both ways; their NaNs' payload bits
 * may differ.) The dot products are then the tile linears' at one row on the AVX512-BF16 engine,
 * in the same order, and each output rounded by the same epilogue (row_blocks.h), so every
 * output is bit-equal to kvseal_linear_tiles' there.
 *
 * Where. Only at one row, and only where the tile linears run on AVX512-BF16 dot products: on AMX
 * the row kernel answers -1 and computes nothing, as linear_q4.c's (whose docstring says why), and
 * a build without AVX512-BF16 has no row kernel.
 *
 * Layout (kvseal_pack_q8_0). [ceil(n_out / 16)][k_in / 32] blocks of 544 bytes, each 16 features
 * x 32 k: the 16 features' d (float16), then 16 k-pairs of 32 bytes, feature f's q[2p], q[2p + 1]
 * at bytes 2f, 2f + 1 of pair p (so that widening each half and one vcvtne2ps2bf16 leave the pair
 * in vdpbf16ps's operand order). Features past n_out have d = q = 0.
 *
 * Measured (Zen 4, two threads, 2026-12-07; bench/q4_rows_ab.py, interleaved passes, medians; the
 * host shared): SmolLM2-135M's lm_head at one row, out of cache, 1.29-1.41 ms over 30.1 MB of
 * blocks against 1.46-2.05 ms over 56.6 MB of tiles (0.69-0.95x; bound by the dequantization's
 * arithmetic, the tiles by memory); the engine's c=1 decode step 0.94-0.99x the step with the
 * Q4_1 blocks alone; served c=1 1.04x the output throughput (docs/BENCHMARKS.md, "What limits
 * speed now"). */

#include "kvseal_ops.h"
#include "row_blocks.h"
#include "tiles.h"

#define Q8_BLOCK_BYTES 544 /* a packed block: 16 features' d, then 16 k-pairs x 16 features x 2 q */
#define GGUF_Q8_0_BYTES 34 /* a GGUF Q8_0 block: d (float16), 32 int8 q */

void kvseal_pack_q8_0(const uint8_t *blocks, uint8_t *packed, int64_t n_out, int64_t k_in) {
    const int64_t panels = (n_out + 15) / 16, kblocks = k_in / 32;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; p++)
        for (int64_t kb = 0; kb < kblocks; kb++) {
            uint8_t *block = packed + (p * kblocks + kb) * Q8_BLOCK_BYTES;
            memset(block, 0, Q8_BLOCK_BYTES);
            for (int f = 0; f < 16 && p * 16 + f < n_out; f++) {
                const uint8_t *gguf = blocks + ((p * 16 + f) * kblocks + kb) * GGUF_Q8_0_BYTES;
                memcpy(block + 2 * f, gguf, 2);
                for (int pair = 0; pair < 16; pair++) memcpy(block + 32 + 32 * pair + 2 * f, gguf + 2 + 2 * pair, 2);
            }
        }
}

#if KVSEAL_AVX512BF16
/* k-pair p of a block: the 16 features' bfloat16 weights (k, k + 1), bfloat16(d * q) each, in
   vdpbf16ps operand order (a tile row's): features 0-7's pairs from the pair's first 16 bytes,
   features 8-15's from the others. */
static inline __m512bh pair_weights(const uint8_t *block, int p, const struct row_lanes *d) {
    const uint8_t *q = block + 32 + 32 * p;
    const __m512 q0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q)));
    const __m512 q1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 16))));
    return _mm512_cvtne2ps_pbh(_mm512_mul_ps(d->hi, q1), _mm512_mul_ps(d->lo, q0));
}

/* One panel (16 features) against the row x [k_in]: sums[16] (row_blocks.h's row_panel_fn). */
static void panel_row(const uint16_t *x, int64_t k_in, const uint8_t *panel, float *sums) {
    __m512 acc[ROW_SUMS];
    for (int s = 0; s < ROW_SUMS; s++) acc[s] = _mm512_setzero_ps();
    for (int64_t b = 0; b < k_in / 32; b++) {
        const uint8_t *block = panel + b * Q8_BLOCK_BYTES;
        const struct row_lanes d = row_feature_lanes(block);
        for (int p = 0; p < 16; p++)
            acc[p % ROW_SUMS] =
                _mm512_dpbf16_ps(acc[p % ROW_SUMS], row_pair(x, b * 16 + p), pair_weights(block, p, &d));
    }
    row_sums_out(acc, sums);
}

/* A panel of k_in / 32 packed blocks. */
static inline int64_t panel_bytes(int64_t k_in) { return k_in / 32 * Q8_BLOCK_BYTES; }

int kvseal_linear_q8_0_row(const uint16_t *x, const uint8_t *packed, const uint16_t *bias, uint16_t *y, int64_t n_out,
                           int64_t k_in, int num_threads) {
    if (kvseal_amx_linears) return -1;
    const struct row_job j = {panel_row, panel_bytes(k_in), x, bias, packed, y, n_out, k_in, 0, NULL, NULL};
    row_blocks_run(&j, (n_out + 15) / 16, num_threads);
    return 0;
}

int kvseal_linear_q8_0_row_f32(const uint16_t *x, const uint8_t *packed, const float *bias, float *y, int64_t n_out,
                               int64_t k_in, int num_threads) {
    if (kvseal_amx_linears) return -1;
    const struct row_job j = {panel_row, panel_bytes(k_in), x, NULL, packed, NULL, n_out, k_in, 0, y, bias};
    row_blocks_run(&j, (n_out + 15) / 16, num_threads);
    return 0;
}
#else
int kvseal_linear_q8_0_row(const uint16_t *x, const uint8_t *packed, const uint16_t *bias, uint16_t *y, int64_t n_out,
                           int64_t k_in, int num_threads) {
    (void)x;
    (void)packed;
    (void)bias;
    (void)y;
    (void)n_out;
    (void)k_in;
    (void)num_threads;
    return -1;
}
int kvseal_linear_q8_0_row_f32(const uint16_t *x, const uint8_t *packed, const float *bias, float *y, int64_t n_out,
                               int64_t k_in, int num_threads) {
    (void)x;
    (void)packed;
    (void)bias;
    (void)y;
    (void)n_out;
    (void)k_in;
    (void)num_threads;
    return -1;
}
#endif
