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
 * added and each output rounded once by the same epilogues (tile_stores.h). So every output is
 * bit-equal to kvseal_linear_tiles' (and kvseal_linear_silu_tiles') at one row on that engine.
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
 * 6.19-6.29 ms over 212 MB of tiles; the engine's c=1 decode step 0.90x; served c=1 (the
 * frontend sharing the two cores) no gain beyond the noise (docs/BENCHMARKS.md, "What limits
 * speed now"). */

#include <omp.h>

#include "kvseal_ops.h"
#include "tile_stores.h"
#include "tiles.h"

#define Q4_BLOCK_BYTES 320 /* a packed block: 16 features x 32 k */
#define GGUF_Q4_1_BYTES 20 /* a GGUF Q4_1 block: d, m (float16), 16 bytes of nibbles */
#define Q4_SUMS 8          /* accumulators a panel's k-pairs go into: dot_block's S at one row */

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
/* The dequantization's constant vectors. */
struct q4_constants {
    __m512i dup_lo, dup_hi, fifteen;
};

static struct q4_constants q4_constants(void) {
    struct q4_constants c;
    c.dup_lo = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    c.dup_hi = _mm512_add_epi32(c.dup_lo, _mm512_set1_epi32(8));
    c.fifteen = _mm512_set1_epi32(15);
    return c;
}

/* A block's d and m, each feature's twice in a row (features 0-7 in d0/m0, 8-15 in d1/m1): the
   lanes of a k-pair in vdpbf16ps operand order. */
struct q4_scales {
    __m512 d0, d1, m0, m1;
};

static inline struct q4_scales block_scales(const struct q4_constants *c, const uint8_t *block) {
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)block));
    const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(block + 32)));
    return (struct q4_scales){_mm512_permutexvar_ps(c->dup_lo, d), _mm512_permutexvar_ps(c->dup_hi, d),
                              _mm512_permutexvar_ps(c->dup_lo, m), _mm512_permutexvar_ps(c->dup_hi, m)};
}

/* k-pair p of a block: the 16 features' bfloat16 weights (k, k + 1), bfloat16(d * q + m) each,
   in vdpbf16ps operand order (a tile row's). The bytes widened to 32 bits, their low and high
   nibbles interleaved within each 128-bit lane: bytes 0, 1, 4, 5, 8, 9, 12, 13 give features
   0-7's pairs in order, the others features 8-15's (the packing puts them there). */
static inline __m512bh pair_weights(const struct q4_constants *c, const uint8_t *block, int p,
                                    const struct q4_scales *s) {
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(block + 64 + 16 * p)));
    const __m512i lo = _mm512_and_si512(bytes, c->fifteen), hi = _mm512_srli_epi32(bytes, 4);
    const __m512i q0 = _mm512_unpacklo_epi32(lo, hi), q1 = _mm512_unpackhi_epi32(lo, hi);
    return _mm512_cvtne2ps_pbh(_mm512_fmadd_ps(s->d1, _mm512_cvtepi32_ps(q1), s->m1),
                               _mm512_fmadd_ps(s->d0, _mm512_cvtepi32_ps(q0), s->m0));
}

/* One panel (16 features) against the row x [k_in]: sums[16], float32, as dot_block sums one row
   (k-pair j into accumulator j % Q4_SUMS, the accumulators added in order). */
static inline void panel_row(const struct q4_constants *c, const uint16_t *x, int64_t k_in, const uint8_t *panel,
                             float *sums) {
    __m512 acc[Q4_SUMS];
    for (int s = 0; s < Q4_SUMS; s++) acc[s] = _mm512_setzero_ps();
    for (int64_t b = 0; b < k_in / 32; b++) {
        const uint8_t *block = panel + b * Q4_BLOCK_BYTES;
        const struct q4_scales sc = block_scales(c, block);
        for (int p = 0; p < 16; p++) {
            int32_t pair;
            memcpy(&pair, x + b * 32 + 2 * p, sizeof pair);
            acc[p % Q4_SUMS] =
                _mm512_dpbf16_ps(acc[p % Q4_SUMS], (__m512bh)_mm512_set1_epi32(pair), pair_weights(c, block, p, &sc));
        }
    }
    __m512 sum = acc[0];
    for (int s = 1; s < Q4_SUMS; s++) sum = _mm512_add_ps(sum, acc[s]);
    _mm512_storeu_ps(sums, sum);
}

/* One row through a Q4_1 weight: a plain linear writes y [n_out] (+ bias); with `half` > 0 it
   is the MLP's fused gate/up ([2 * half * 16, k_in]) and writes y [half * 16] = silu(gate) * up. */
struct q4_job {
    const uint16_t *x, *bias;
    const uint8_t *packed;
    uint16_t *y;
    int64_t n_out, k_in, half;
    float *yf;             /* a plain linear's float32 sums instead of y (kvseal_linear_q4_1_row_f32), or NULL */
    const float *bias_f32; /* their bias, or NULL */
};

/* Job step i: panel i of a plain linear, or gate panel i with up panel i + half, out. */
static inline void q4_step(const struct q4_job *j, const struct q4_constants *c, int64_t i) {
    const int64_t panel_bytes = j->k_in / 32 * Q4_BLOCK_BYTES;
    float sums[16], up[16];
    panel_row(c, j->x, j->k_in, j->packed + i * panel_bytes, sums);
    if (j->half > 0) {
        panel_row(c, j->x, j->k_in, j->packed + (i + j->half) * panel_bytes, up);
        store_silu_rows(sums, up, 1, j->y + i * 16, j->half * 16);
        return;
    }
    const int64_t nr = j->n_out - i * 16 < 16 ? j->n_out - i * 16 : 16;
    if (j->yf != NULL)
        store_tile_rows_f32(sums, 1, j->bias_f32 == NULL ? NULL : j->bias_f32 + i * 16, j->yf + i * 16, j->n_out, nr);
    else store_tile_rows(sums, 1, j->bias == NULL ? NULL : j->bias + i * 16, j->y + i * 16, j->n_out, nr);
}

/* The step d after step i in a thread's stream: the rest of its run (to end), then the run it
   claimed next ([next, next_end)); -1 past both. */
static inline int64_t stream_ahead(int64_t i, int64_t d, int64_t end, int64_t next, int64_t next_end) {
    if (i + d < end) return i + d;
    const int64_t at = next + (i + d - end);
    return at < next_end ? at : -1;
}

/* The job's steps handed to the threads in short runs from a shared counter as they come free
   (about 8 a thread, as the tile linears hand out their pairs), each thread claiming its next
   run before it works on the one in hand and prefetching into L2 the weights of the step two
   ahead in its own stream. An even static split (bench/q4_dequant.c's) left the other thread
   waiting at the end of each linear whenever the frontend took a core: this kernel is bound by
   its arithmetic, not its bytes. */
static void q4_run(const struct q4_job *j, int64_t steps, int num_threads) {
    const int64_t panel_bytes = j->k_in / 32 * Q4_BLOCK_BYTES;
    const int64_t run = steps / (8 * num_threads) > 1 ? steps / (8 * num_threads) : 1;
    int64_t handed_out = 0;
#pragma omp parallel num_threads(num_threads)
    {
        const struct q4_constants c = q4_constants();
        int64_t first = __atomic_fetch_add(&handed_out, run, __ATOMIC_RELAXED);
        while (first < steps) {
            const int64_t next = __atomic_fetch_add(&handed_out, run, __ATOMIC_RELAXED);
            const int64_t end = first + run < steps ? first + run : steps;
            const int64_t next_end = next + run < steps ? next + run : steps;
            for (int64_t i = first; i < end; i++) {
                const int64_t ahead = stream_ahead(i, 2, end, next, next_end);
                for (int64_t at = 0; ahead >= 0 && at < panel_bytes; at += 64) {
                    __builtin_prefetch(j->packed + ahead * panel_bytes + at, 0, 2);
                    if (j->half > 0) __builtin_prefetch(j->packed + (ahead + j->half) * panel_bytes + at, 0, 2);
                }
                q4_step(j, &c, i);
            }
            first = next;
        }
    }
}

int kvseal_linear_q4_1_row(const uint16_t *x, const uint8_t *packed, const uint16_t *bias, uint16_t *y, int64_t n_out,
                           int64_t k_in, int num_threads) {
    if (kvseal_amx_linears) return -1;
    const struct q4_job j = {x, bias, packed, y, n_out, k_in, 0, NULL, NULL};
    q4_run(&j, (n_out + 15) / 16, num_threads);
    return 0;
}

int kvseal_linear_q4_1_row_f32(const uint16_t *x, const uint8_t *packed, const float *bias, float *y, int64_t n_out,
                               int64_t k_in, int num_threads) {
    if (kvseal_amx_linears) return -1;
    const struct q4_job j = {x, NULL, packed, NULL, n_out, k_in, 0, y, bias};
    q4_run(&j, (n_out + 15) / 16, num_threads);
    return 0;
}

int kvseal_linear_silu_q4_1_row(const uint16_t *x, const uint8_t *packed, uint16_t *act, int64_t inter, int64_t k_in,
                                int num_threads) {
    if (kvseal_amx_linears || inter % 16 != 0) return -1;
    const struct q4_job j = {x, NULL, packed, act, 2 * inter, k_in, inter / 16, NULL, NULL};
    q4_run(&j, inter / 16, num_threads);
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
