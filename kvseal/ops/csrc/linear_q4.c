/* bfloat16 linears at one row over a GGUF's Q4_1 blocks, bit-equal to the tile linears.
 *
 * Why. The default model (SmolLM2-135M) ships as a Q4_1 GGUF: blocks of 32 weights along k, each
 * with a float16 scale d and offset m and 4-bit q (5 bits a weight). kvseal serves the bfloat16
 * weights the loader converts them to, bfloat16(float32(d) * q + float32(m)): gguf's numpy
 * dequantization (d * q is exact in float32, the add rounds once) then torch's cast (round to
 * nearest even). A single-stream decode step is the time to read the weights: ~270 MB of
 * bfloat16 tiles against ~85 MB of blocks. This kernel reads the blocks and dequantizes each
 * weight in registers to exactly that bfloat16 value (one FMA: d * q + m rounded once, as the add
 * rounds; vcvtne2ps2bf16 rounds to nearest even, and no weight is a float32 denormal, which it
 * would flush: d * q and m are multiples of float16's 2^-24, so a nonzero sum is at least that),
 * then takes the same dot products in the same order as the tile linears' AVX512-BF16 engine at
 * one row: dot_block with R = 1, S = 8 (linear_tiles.c), k-pair j into accumulator j % 8 by
 * vdpbf16ps against x's pair broadcast, the eight accumulators summed in order 0..7, the bias
 * added and each output rounded once by the same epilogues (tile_stores.h; the threads' schedule
 * and the epilogues are row_blocks.h's, shared with linear_q8.c's Q8_0 lm_head). So every output
 * is bit-equal to kvseal_linear_tiles' (and kvseal_linear_silu_tiles') at one row on that engine.
 *
 * Where. Only at one row (at 8 rows and more the dequantization costs more than the bytes save:
 * bench/q4_dequant.c) and only where the tile linears run on AVX512-BF16 dot products. Where
 * they run on AMX the row kernels answer -1 and compute nothing, and the caller runs the tiles:
 * TDPBF16PS sums in another order, so the blocks' sums would differ from the AMX tiles' in the
 * last bits, and a request's tokens would then depend on whether it decodes alone (the AMX tiles
 * give a row the same sums at any row count). A build without AVX512-BF16 has no row kernels.
 *
 * Layout (kvseal_pack_q4_1). [ceil(n_out / 16)][k_in / 32] blocks of 320 bytes, each 16 features
 * x 32 k: the 16 features' d (float16), their 16 m, then 16 k-pairs of 16 bytes, each byte one
 * feature's q[2p] in its low nibble and q[2p + 1] in its high one, features 0-7 at bytes 0, 1, 4,
 * 5, 8, 9, 12, 13 and 8-15 at the others (so that widening, an unpack and one vcvtne2ps2bf16
 * leave the pair in vdpbf16ps's operand order). Features past n_out have d = m = q = 0.
 *
 * Measured (Zen 4, two threads, 2026-12-07; bench/q4_rows_ab.py, interleaved passes, medians):
 * SmolLM2-135M's 120 decoder linears at one row 4.90-4.99 ms over 66 MB of blocks against
 * 6.19-6.29 ms over 212 MB of tiles; the engine's c=1 decode step 0.90x; served c=1 1.13x the
 * output throughput, one server at a time (docs/BENCHMARKS.md, "What limits speed now"). */

#include "kvseal_ops.h"
#include "row_blocks.h"
#include "tiles.h"

#define Q4_BLOCK_BYTES 320 /* a packed block: 16 features x 32 k */
#define GGUF_Q4_1_BYTES 20 /* a GGUF Q4_1 block: d, m (float16), 16 bytes of nibbles */

/* q[k] of a GGUF Q4_1 block's nibbles: weights 0-15 in the low nibbles of bytes 0-15, weights
   16-31 in their high nibbles. */
static inline int gguf_nibble(const uint8_t *qs, int k) { return k < 16 ? qs[k] & 15 : qs[k - 16] >> 4; }

/* The byte of a packed k-pair that holds feature f's two nibbles: features 0-7 at bytes 0, 1, 4,
   5, 8, 9, 12, 13, features 8-15 at the others (pair_weights' interleave puts them in order). */
static inline int feature_byte(int f) { return f < 8 ? f / 2 * 4 + f % 2 : (f - 8) / 2 * 4 + 2 + f % 2; }

/* One feature's GGUF block as feature f of a packed block. */
static void pack_feature(const uint8_t *gguf, uint8_t *block, int f) {
    memcpy(block + 2 * f, gguf, 2);
    memcpy(block + 32 + 2 * f, gguf + 2, 2);
    for (int p = 0; p < 16; p++)
        block[64 + 16 * p + feature_byte(f)] =
            (uint8_t)(gguf_nibble(gguf + 4, 2 * p) | gguf_nibble(gguf + 4, 2 * p + 1) << 4);
}

void kvseal_pack_q4_1(const uint8_t *blocks, uint8_t *packed, int64_t n_out, int64_t k_in) {
    const int64_t panels = (n_out + 15) / 16, kblocks = k_in / 32;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; p++)
        for (int64_t kb = 0; kb < kblocks; kb++) {
            uint8_t *block = packed + (p * kblocks + kb) * Q4_BLOCK_BYTES;
            memset(block, 0, Q4_BLOCK_BYTES);
            for (int f = 0; f < 16 && p * 16 + f < n_out; f++)
                pack_feature(blocks + ((p * 16 + f) * kblocks + kb) * GGUF_Q4_1_BYTES, block, f);
        }
}

#if KVSEAL_AVX512BF16
/* A block's d and m in a k-pair's lanes (row_feature_lanes). */
struct q4_scales {
    struct row_lanes d, m;
};

static inline struct q4_scales block_scales(const uint8_t *block) {
    return (struct q4_scales){row_feature_lanes(block), row_feature_lanes(block + 32)};
}

/* k-pair p of a block: the 16 features' bfloat16 weights (k, k + 1), bfloat16(d * q + m) each,
   in vdpbf16ps operand order (a tile row's). The bytes widened to 32 bits, their low and high
   nibbles interleaved within each 128-bit lane: bytes 0, 1, 4, 5, 8, 9, 12, 13 give features
   0-7's pairs in order, the others features 8-15's (the packing puts them there). */
static inline __m512bh pair_weights(const uint8_t *block, int p, const struct q4_scales *s) {
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(block + 64 + 16 * p)));
    const __m512i lo = _mm512_and_si512(bytes, _mm512_set1_epi32(15)), hi = _mm512_srli_epi32(bytes, 4);
    const __m512i q0 = _mm512_unpacklo_epi32(lo, hi), q1 = _mm512_unpackhi_epi32(lo, hi);
    return _mm512_cvtne2ps_pbh(_mm512_fmadd_ps(s->d.hi, _mm512_cvtepi32_ps(q1), s->m.hi),
                               _mm512_fmadd_ps(s->d.lo, _mm512_cvtepi32_ps(q0), s->m.lo));
}

/* One panel (16 features) against the row x [k_in]: sums[16] (row_blocks.h's row_panel_fn). */
static void panel_row(const uint16_t *x, int64_t k_in, const uint8_t *panel, float *sums) {
    __m512 acc[ROW_SUMS];
    for (int s = 0; s < ROW_SUMS; s++) acc[s] = _mm512_setzero_ps();
    for (int64_t b = 0; b < k_in / 32; b++) {
        const uint8_t *block = panel + b * Q4_BLOCK_BYTES;
        const struct q4_scales sc = block_scales(block);
        for (int p = 0; p < 16; p++)
            acc[p % ROW_SUMS] =
                _mm512_dpbf16_ps(acc[p % ROW_SUMS], row_pair(x, b * 16 + p), pair_weights(block, p, &sc));
    }
    row_sums_out(acc, sums);
}

/* A panel of k_in / 32 packed blocks. */
static inline int64_t panel_bytes(int64_t k_in) { return k_in / 32 * Q4_BLOCK_BYTES; }

int kvseal_linear_q4_1_row(const uint16_t *x, const uint8_t *packed, const uint16_t *bias, uint16_t *y, int64_t n_out,
                           int64_t k_in, int num_threads) {
    if (kvseal_amx_linears) return -1;
    const struct row_job j = {panel_row, panel_bytes(k_in), x, bias, packed, y, n_out, k_in, 0, NULL, NULL};
    row_blocks_run(&j, (n_out + 15) / 16, num_threads);
    return 0;
}

int kvseal_linear_q4_1_row_f32(const uint16_t *x, const uint8_t *packed, const float *bias, float *y, int64_t n_out,
                               int64_t k_in, int num_threads) {
    if (kvseal_amx_linears) return -1;
    const struct row_job j = {panel_row, panel_bytes(k_in), x, NULL, packed, NULL, n_out, k_in, 0, y, bias};
    row_blocks_run(&j, (n_out + 15) / 16, num_threads);
    return 0;
}

int kvseal_linear_silu_q4_1_row(const uint16_t *x, const uint8_t *packed, uint16_t *act, int64_t inter, int64_t k_in,
                                int num_threads) {
    if (kvseal_amx_linears || inter % 16 != 0) return -1;
    const int64_t half = inter / 16;
    const struct row_job j = {panel_row, panel_bytes(k_in), x, NULL, packed, act, 2 * inter, k_in, half, NULL, NULL};
    row_blocks_run(&j, half, num_threads);
    return 0;
}
#else
int kvseal_linear_q4_1_row(const uint16_t *x, const uint8_t *packed, const uint16_t *bias, uint16_t *y, int64_t n_out,
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
int kvseal_linear_q4_1_row_f32(const uint16_t *x, const uint8_t *packed, const float *bias, float *y, int64_t n_out,
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
int kvseal_linear_silu_q4_1_row(const uint16_t *x, const uint8_t *packed, uint16_t *act, int64_t inter, int64_t k_in,
                                int num_threads) {
    (void)x;
    (void)packed;
    (void)act;
    (void)inter;
    (void)k_in;
    (void)num_threads;
    return -1;
}
#endif
