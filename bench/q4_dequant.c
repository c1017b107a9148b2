/* What reading the default model's Q4_1 blocks would cost, kept bit-equal to its bfloat16 weights.
 *
 * SmolLM2-135M ships as a Q4_1 GGUF: blocks of 32 weights along k, each with a float16 scale d
 * and offset m and 4-bit q (5 bits a weight, ~3.2x fewer bytes than bfloat16). kvseal serves its
 * bfloat16 dequantization, bfloat16(d * q + m). A kernel that read the blocks and still produced
 * the bfloat16 model's sums would dequantize each weight in registers to exactly that bfloat16
 * value (one FMA: d * q is exact in float32, so the FMA rounds once, as float32 d * q + m does;
 * then round to nearest even) and multiply with the same vdpbf16ps as the tile linears' dot
 * engine. This times that, over the stack of SmolLM2's linears (30 layers' q/k/v, o, gate/up,
 * down and the lm_head, distinct weights, read from memory) on two threads, two ways:
 *   1 row: each pair of k dequantized into one vdpbf16ps operand and used at once;
 *   R rows (a multiple of 8): each 16-feature panel dequantized once into a bfloat16 buffer,
 *   then every row's dot products over it.
 * Compare with the bfloat16 tile linears over the same stack (bench/linears_ab.py --dtype
 * bfloat16). Needs AVX512-BF16; the weights are random (the timing does not depend on them).
 *
 *   cc -O3 -march=native -fopenmp bench/q4_dequant.c -o /tmp/q4_dequant && /tmp/q4_dequant 1 8 32
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* A block: 16 features x 32 k. 16 d and 16 m (float16), then 16 k-pairs of 16 bytes: byte f
   (features 0-7) and byte 8 + f (features 8-15) hold q[f][2p] in the low nibble and q[f][2p + 1]
   in the high one, so that one vcvtne2ps2bf16 leaves the pair in vdpbf16ps's operand order. */
#define BLOCK_BYTES 320
#define THREADS 2
#define ROUNDS 15

struct dequant {
    __m512i dup_lo, dup_hi, shifts, fifteen;
    __m128i bytes_lo, bytes_hi;
};

static struct dequant dequant_constants(void) {
    struct dequant c;
    c.dup_lo = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    c.dup_hi = _mm512_add_epi32(c.dup_lo, _mm512_set1_epi32(8));
    c.shifts = _mm512_set_epi32(4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0);
    c.fifteen = _mm512_set1_epi32(15);
    c.bytes_lo = _mm_set_epi8(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    c.bytes_hi = _mm_set_epi8(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8);
    return c;
}

/* A block's d and m, each feature's twice in a row (features 0-7 in d0/m0, 8-15 in d1/m1): the
   lanes of a pair of k in vdpbf16ps operand order. */
struct scales {
    __m512 d0, d1, m0, m1;
};

static inline struct scales block_scales(const struct dequant *c, const uint8_t *block) {
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)block));
    const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(block + 32)));
    return (struct scales){_mm512_permutexvar_ps(c->dup_lo, d), _mm512_permutexvar_ps(c->dup_hi, d),
                           _mm512_permutexvar_ps(c->dup_lo, m), _mm512_permutexvar_ps(c->dup_hi, m)};
}

/* k-pair p of a block: the 16 features' bfloat16 weights (k, k + 1), in vdpbf16ps operand order. */
static inline __m512bh pair_weights(const struct dequant *c, const uint8_t *block, int p, const struct scales *s) {
    const __m128i raw = _mm_loadu_si128((const __m128i *)(block + 64 + 16 * p));
    const __m512i q0 = _mm512_and_si512(
        _mm512_srlv_epi32(_mm512_cvtepu8_epi32(_mm_shuffle_epi8(raw, c->bytes_lo)), c->shifts), c->fifteen);
    const __m512i q1 = _mm512_and_si512(
        _mm512_srlv_epi32(_mm512_cvtepu8_epi32(_mm_shuffle_epi8(raw, c->bytes_hi)), c->shifts), c->fifteen);
    return _mm512_cvtne2ps_pbh(_mm512_fmadd_ps(s->d1, _mm512_cvtepi32_ps(q1), s->m1),
                               _mm512_fmadd_ps(s->d0, _mm512_cvtepi32_ps(q0), s->m0));
}

/* One panel (16 features) against x [rows, k]: y [rows, 16] (row stride ldy). */
static void panel(const struct dequant *c, const uint16_t *x, int64_t k, const uint8_t *w, float *y, int rows,
                  int64_t ldy, __m512bh *buffer) {
    for (int64_t b = 0; b < k / 32; b++) {
        const uint8_t *block = w + b * BLOCK_BYTES;
        const struct scales sc = block_scales(c, block);
        for (int p = 0; p < 16; p++) buffer[b * 16 + p] = pair_weights(c, block, p, &sc);
    }
    for (int r0 = 0; r0 < rows; r0 += 8) {
        __m512 even[8], odd[8];
        for (int r = 0; r < 8; r++) even[r] = odd[r] = _mm512_setzero_ps();
        for (int64_t kp = 0; kp < k / 2; kp += 2)
            for (int r = 0; r < 8; r++) {
                int32_t a, b;
                memcpy(&a, x + (r0 + r) * k + 2 * kp, sizeof a);
                memcpy(&b, x + (r0 + r) * k + 2 * kp + 2, sizeof b);
                even[r] = _mm512_dpbf16_ps(even[r], (__m512bh)_mm512_set1_epi32(a), buffer[kp]);
                odd[r] = _mm512_dpbf16_ps(odd[r], (__m512bh)_mm512_set1_epi32(b), buffer[kp + 1]);
            }
        for (int r = 0; r < 8; r++) _mm512_storeu_ps(y + (r0 + r) * ldy, _mm512_add_ps(even[r], odd[r]));
    }
}

/* One panel against one row, each pair dequantized and used at once. */
static void panel_one_row(const struct dequant *c, const uint16_t *x, int64_t k, const uint8_t *w, float *y) {
    __m512 even = _mm512_setzero_ps(), odd = _mm512_setzero_ps();
    for (int64_t b = 0; b < k / 32; b++) {
        const uint8_t *block = w + b * BLOCK_BYTES;
        const struct scales sc = block_scales(c, block);
        for (int p = 0; p < 16; p += 2) {
            int32_t a, b2;
            memcpy(&a, x + b * 32 + 2 * p, sizeof a);
            memcpy(&b2, x + b * 32 + 2 * p + 2, sizeof b2);
            even = _mm512_dpbf16_ps(even, (__m512bh)_mm512_set1_epi32(a), pair_weights(c, block, p, &sc));
            odd = _mm512_dpbf16_ps(odd, (__m512bh)_mm512_set1_epi32(b2), pair_weights(c, block, p + 1, &sc));
        }
    }
    _mm512_storeu_ps(y, _mm512_add_ps(even, odd));
}

/* y [rows, n] = x [rows, k] . W^T, W as n / 16 panels of k / 32 blocks; panels split over the
   threads, each prefetching (into L2) the panel two ahead of the one it works on. */
static void linear(const uint16_t *x, int64_t k, int64_t n, const uint8_t *w, float *y, int rows) {
    const int64_t panels = n / 16, panel_bytes = k / 32 * BLOCK_BYTES;
#pragma omp parallel num_threads(THREADS)
    {
        const struct dequant c = dequant_constants();
        __m512bh buffer[1536 / 2];
#pragma omp for schedule(static)
        for (int64_t i = 0; i < panels; i++) {
            if (i + 2 < panels)
                for (int64_t at = 0; at < panel_bytes; at += 64)
                    __builtin_prefetch(w + (i + 2) * panel_bytes + at, 0, 2);
            if (rows == 1) panel_one_row(&c, x, k, w + i * panel_bytes, y + i * 16);
            else panel(&c, x, k, w + i * panel_bytes, y + i * 16, rows, n, buffer);
        }
    }
}

/* bfloat16(d * q + m) as the reference dequantization computes it: float32 d * q (exact), + m
   rounded once, then to nearest even. */
static uint16_t reference_weight(const uint8_t *block, int f, int kk) {
    const float d = _cvtsh_ss(((const uint16_t *)block)[f]), m = _cvtsh_ss(((const uint16_t *)block)[16 + f]);
    const uint8_t byte = block[64 + 16 * (kk / 2) + f];
    const int q = kk % 2 ? byte >> 4 : byte & 15;
    const float w = d * (float)q + m;
    uint32_t bits;
    memcpy(&bits, &w, sizeof bits);
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

/* The kernel's dequantized weights of every block of one panel equal the reference's, bit for bit. */
static int weights_are_exact(const uint8_t *w, int64_t k) {
    const struct dequant c = dequant_constants();
    for (int64_t b = 0; b < k / 32; b++) {
        const uint8_t *block = w + b * BLOCK_BYTES;
        const struct scales sc = block_scales(&c, block);
        for (int p = 0; p < 16; p++) {
            uint16_t got[32];
            const __m512bh pair = pair_weights(&c, block, p, &sc);
            memcpy(got, &pair, sizeof got);
            for (int f = 0; f < 16; f++)
                if (got[2 * f] != reference_weight(block, f, 2 * p)
                    || got[2 * f + 1] != reference_weight(block, f, 2 * p + 1))
                    return 0;
        }
    }
    return 1;
}

static double seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
    static const int64_t layer[4][2] = {{576, 960}, {576, 576}, {576, 3072}, {1536, 576}}; /* k, n */
    enum { LINEARS = 30 * 4 + 1 };
    uint8_t *weights[LINEARS];
    int64_t ks[LINEARS], ns[LINEARS];
    size_t total = 0;
    srand(1);
    for (int i = 0; i < LINEARS; i++) {
        ks[i] = i < LINEARS - 1 ? layer[i % 4][0] : 576; /* the last: the lm_head, 49,152 x 576 */
        ns[i] = i < LINEARS - 1 ? layer[i % 4][1] : 49152;
        const size_t bytes = (size_t)(ns[i] / 16) * (size_t)(ks[i] / 32) * BLOCK_BYTES;
        weights[i] = aligned_alloc(64, bytes);
        for (size_t j = 0; j < bytes; j++) weights[i][j] = (uint8_t)rand();
        for (size_t block = 0; block < bytes; block += BLOCK_BYTES) /* finite, modest d and m */
            for (int f = 0; f < 32; f++) ((uint16_t *)(weights[i] + block))[f] = (uint16_t)(0x2000 + (rand() & 0x3ff));
        total += bytes;
    }
    if (!weights_are_exact(weights[LINEARS - 2], ks[LINEARS - 2])) {
        fprintf(stderr, "the dequantized weights differ from bfloat16(d * q + m)\n");
        return 1;
    }
    uint16_t *x = aligned_alloc(64, 32 * 1536 * sizeof(uint16_t));
    float *y = aligned_alloc(64, (size_t)32 * 49152 * sizeof(float));
    for (int i = 0; i < 32 * 1536; i++) x[i] = (uint16_t)(0x3f80 + (rand() & 0x7f)); /* bfloat16 in [1, 2) */
    for (int a = 1; a < (argc > 1 ? argc : 2); a++) {
        const int rows = argc > 1 ? atoi(argv[a]) : 1;
        if (rows != 1 && (rows < 8 || rows > 32 || rows % 8)) {
            fprintf(stderr, "rows: 1, 8, 16, 24 or 32 (got %s)\n", argv[a]);
            return 2;
        }
        double best = 1e9;
        for (int round = 0; round < ROUNDS; round++) {
            const double t = seconds();
            for (int i = 0; i < LINEARS; i++) linear(x, ks[i], ns[i], weights[i], y, rows);
            const double took = seconds() - t;
            best = took < best ? took : best;
        }
        printf("{\"rows\": %d, \"stack_ms\": %.2f, \"weight_mb\": %.1f, \"threads\": %d}\n", rows, best * 1e3,
               (double)total / 1e6, THREADS);
    }
    return 0;
}
