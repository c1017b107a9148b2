/* bfloat16 linears over weights in AMX's tile layout: y = x W^T (+ bias), x and y bfloat16,
 * float32 sums, each output rounded once (vcvtneps2bf16).
 *
 * Layout. The weight is packed once ([ceil(N/16)][K/32] tiles of 16 k-pairs x 16 outputs x 2,
 * the layout TDPBF16PS reads, zero-padded past N); K must be a multiple of 32.
 *
 * Blocking. Each step computes 32 rows x 2 panels (a panel pair) over every k, blocked as a
 * GEMM: groups of panel pairs stay in L2 (TILE_GROUP_BYTES, _AMX) while every 32-row chunk passes
 * over them, so the weights come from memory once, and a chunk's rows stay in L1 across the
 * group's pairs (on AMX the weight tiles of such passes load with the hint that keeps them out of
 * L1, load_weight_tile). Threads claim runs of consecutive pairs from a shared counter, so each streams its
 * weights in order: below 256 rows short runs (about 8 a thread), so a thread the frontend
 * preempts holds no fixed share for the other to wait on; from 256 rows one run a thread, since
 * every run re-reads all the rows. At decode sizes (<= 32 rows) a thread claims its next run
 * before it works on the one in hand, and the run's last pair prefetches the next run's first
 * weights.
 *
 * Two engines compute a step (dispatch.c picks one at start-up):
 *   AMX (Sapphire Rapids and later, where the process may use tile data): 2 x 2 tiles per 32-k
 *     step; a chunk's outputs go out a row or two at a time between the next chunk's tile
 *     products, so the vector ports convert and store while the tiles compute. At 1-32 rows a
 *     pass over SmolLM2-135M's 270 MB of weights takes 10.5-13.4 ms (the memory's bandwidth)
 *     against oneDNN's 14.6-17.8 ms; at 2,048 rows 0.9x oneDNN's time
 *     (docs/benchmarks-archive.md, rounds 10 and 20).
 *   AVX512-BF16 (CPUs without AMX, such as AMD's Zen 4 and 5): one 64-byte tile row is exactly
 *     VDPBF16PS's operand (16 outputs' k-pairs) against x's pair broadcast: 8 rows x 2 panels
 *     in 16 accumulators, few-row blocks splitting k over more accumulators, the first chunk of
 *     rows prefetching the next pair's weights into L2 a line per k-pair, its row blocks
 *     dividing those lines between them so the prefetch spreads over the whole chunk. On a Zen 5
 *     host it matches oneDNN at 2,048 rows and takes 0.7-0.86x its time at 8-32 rows (round 11).
 * A build without AVX512-BF16 has neither: the entry points answer -1 and the ops layer keeps
 * torch's linears (PackedLinear where oneDNN multiplies bfloat16, else nn.Linear). Called
 * through TileLinear (kvseal/ops/native_linears.py) for a bfloat16 model's decoder linears and
 * lm_head whose input width is a multiple of 32.
 *
 * The MLP's gate/up + SiLU (kvseal_linear_silu_tiles): each gate panel paired with the up panel
 * of the same features, the epilogue rounding gate and up to bfloat16 (the linear's output),
 * silu(gate) to bfloat16, then the product, as the two passes round: bit-equal to them, with the
 * [rows, 2 * inter] intermediate never written. */

#include <omp.h>

#include "kvseal_ops.h"
#include "tile_stores.h"
#include "tiles.h"
#include "vec.h"

void kvseal_pack_tiles(const uint16_t *w, uint16_t *packed, int64_t n_out, int64_t k_in) {
    const int64_t panels = (n_out + 15) / 16, kblocks = k_in / 32;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; p++)
        for (int64_t kb = 0; kb < kblocks; kb++)
            for (int64_t kk = 0; kk < 16; kk++)
                for (int64_t n = 0; n < 16; n++)
                    for (int64_t i = 0; i < 2; i++) {
                        const int64_t row = p * 16 + n, col = kb * 32 + 2 * kk + i;
                        const int64_t at = (((p * kblocks + kb) * 16 + kk) * 16 + n) * 2 + i;
                        packed[at] = row < n_out ? w[row * k_in + col] : 0;
                    }
}

#if KVSEAL_AVX512BF16
/* One row block of the dot-product engine: R rows of x against panels b0 and b1 over every k,
   sums into c0 and c1 (16 floats a row). A B tile's 64-byte row is 16 outputs' (k, k + 1)
   weight pairs, exactly vdpbf16ps's operand, against x's pair broadcast. S accumulators per
   row and panel take alternate k-pairs, so that a block of few rows (decode) still has enough
   independent sums in flight to hide the instruction's latency. p0, p1 (unless NULL): panels to
   prefetch so that the next panels' weights come from memory while these are multiplied: their
   line of k-pair k for every k with k % shares == share (the chunk's row blocks divide the
   lines between them). Into L2 (prefetcht1), not L1: on a Zen 4 host the L1 requests held the
   core's few L1 miss buffers, which the demand loads of the pair in hand then waited on, while
   the weights of the next pair need to be near, not in L1, when its pass starts (the lines
   arrive in L1 by the hardware prefetcher as the pass streams them). The stack of SmolLM2's
   linears from memory (bench/linears_ab.py --dtype bfloat16, 16 alternating rounds): 0.87x the
   time at 8 rows, 0.88x at 16, 1.0x at 1 and 32; the engine's c=8 decode step 0.825x, a
   2,048-token prefill step 0.997x (bench/engine_ab.py). */
static inline __attribute__((always_inline)) void dot_block(const uint16_t *a, int64_t k_in, const uint16_t *b0,
                                                            const uint16_t *b1, const int R, const int S, float *c0,
                                                            float *c1, const uint16_t *p0, const uint16_t *p1,
                                                            int share, int shares) {
    __m512 acc0[16], acc1[16]; /* R * S <= 16 */
    for (int i = 0; i < R * S; i++) {
        acc0[i] = _mm512_setzero_ps();
        acc1[i] = _mm512_setzero_ps();
    }
    int turn = 0;
    for (int64_t kp = 0; kp < k_in / 2; kp += S)
        for (int s = 0; s < S; s++) {
            const __m512bh w0 = (__m512bh)_mm512_loadu_si512(b0 + (kp + s) * 32);
            const __m512bh w1 = (__m512bh)_mm512_loadu_si512(b1 + (kp + s) * 32);
            if (p0 != NULL) {
                if (turn == share) {
                    __builtin_prefetch(p0 + (kp + s) * 32, 0, 2);
                    __builtin_prefetch(p1 + (kp + s) * 32, 0, 2);
                }
                if (++turn == shares) turn = 0;
            }
            for (int r = 0; r < R; r++) {
                int32_t pair;
                memcpy(&pair, a + r * k_in + 2 * (kp + s), sizeof pair);
                const __m512bh xr = (__m512bh)_mm512_set1_epi32(pair);
                acc0[r * S + s] = _mm512_dpbf16_ps(acc0[r * S + s], xr, w0);
                acc1[r * S + s] = _mm512_dpbf16_ps(acc1[r * S + s], xr, w1);
            }
        }
    for (int r = 0; r < R; r++) {
        __m512 s0 = acc0[r * S], s1 = acc1[r * S];
        for (int s = 1; s < S; s++) {
            s0 = _mm512_add_ps(s0, acc0[r * S + s]);
            s1 = _mm512_add_ps(s1, acc1[r * S + s]);
        }
        _mm512_storeu_ps(c0 + r * 16, s0);
        _mm512_storeu_ps(c1 + r * 16, s1);
    }
}

/* amx_chunk on AVX512-BF16 dot products: the same four sums (c[0], c[1]: rows 0-15 and 16-31
   against panel b0; c[2], c[3] against b1), in row blocks of 8 (16 accumulators). Without a
   second panel, b0 stands in for it and the caller stores only c[0], c[1]. The row blocks
   prefetch next0 and next1 (unless NULL) between them, every block an equal share of the
   lines spread over its whole pass: one block issuing them all in its first quarter of the
   chunk (32 rows) left the stream to wait (a 32-row decode stack of SmolLM2's linears,
   weights out of cache: 0.935x the time). */
static void dot_chunk(const uint16_t *a, int64_t k_in, const uint16_t *b0, const uint16_t *b1, int rows, int two,
                      float c[4][256], const uint16_t *next0, const uint16_t *next1) {
    if (!two) b1 = b0;
    const int blocks = (rows + 7) / 8;
    for (int m = 0; m < rows; m += 8) {
        const uint16_t *x = a + m * k_in;
        const int share = m / 8;
        float *c0 = c[m / 16] + (m % 16) * 16, *c1 = c[2 + m / 16] + (m % 16) * 16;
        switch (rows - m < 8 ? rows - m : 8) {
            case 1: dot_block(x, k_in, b0, b1, 1, 8, c0, c1, next0, next1, share, blocks); break;
            case 2: dot_block(x, k_in, b0, b1, 2, 4, c0, c1, next0, next1, share, blocks); break;
            case 3: dot_block(x, k_in, b0, b1, 3, 2, c0, c1, next0, next1, share, blocks); break;
            case 4: dot_block(x, k_in, b0, b1, 4, 2, c0, c1, next0, next1, share, blocks); break;
            case 5: dot_block(x, k_in, b0, b1, 5, 1, c0, c1, next0, next1, share, blocks); break;
            case 6: dot_block(x, k_in, b0, b1, 6, 1, c0, c1, next0, next1, share, blocks); break;
            case 7: dot_block(x, k_in, b0, b1, 7, 1, c0, c1, next0, next1, share, blocks); break;
            default: dot_block(x, k_in, b0, b1, 8, 1, c0, c1, next0, next1, share, blocks); break;
        }
    }
}

/* Bytes of weights a thread keeps in L2 while every row chunk passes over them (AMX hosts have
   2 MiB of L2 a core, Zen 4 and 5 1 MiB). On AMX the thread's pairs are split into equal groups
   under that size: every group re-reads all of x, so a last group of a pair or two cost a whole
   pass (a 2,048-row, K = 1,536 linear on two threads: 9 pairs a thread went as 5 + 4 with 512 KiB;
   with 1 MiB and equal groups, 9; with the streamed weight tiles, a 2,048-token prefill step
   0.946x). */
#define TILE_GROUP_BYTES (512 * 1024)
#define TILE_GROUP_BYTES_AMX (1024 * 1024)
/* Rows of x a tile product takes at once (two row tiles): a chunk. */
#define TILE_CHUNK_ROWS 32

/* One tile product: x [rows, k_in] against packed panels. A plain linear writes y [rows, n_out]
   (+ bias); with `half` > 0 it is the MLP's fused gate/up weight ([2 * half * 16, k_in]) and
   writes act [rows, half * 16] = silu(gate) * up instead, each panel of gate paired with the up
   panel of the same features. */
struct tile_job {
    const uint16_t *x, *packed, *bias;
    uint16_t *y;
    int64_t rows, n_out, k_in, half;
    float *yf;             /* a plain linear's float32 outputs instead of y (kvseal_linear_tiles_f32), or NULL */
    const float *bias_f32; /* its bias, or NULL */
};

/* A chunk whose tiles are computed (c[0], c[1]: panel a's row tiles; c[2], c[3]: panel b's)
   and whose outputs are not all out yet. The dot-product engine writes them at once; on AMX
   they go out a row or two at a time between the next chunk's tile products, which run on
   their own unit while the vector ports convert and store. c == NULL: none. */
struct pending_chunk {
    float (*c)[256];
    int64_t m0, a, b;
    int r0, r1, two, done; /* done: rows of the chunk already out */
};

/* The pending chunk's rows [p->done, until) out, a row tile's share at a time: each linear
   output + bias rounded once, or a fused gate/up's silu(gate) * up. Inlined, with the row stores
   below, into the tile loop that calls it between k steps: as a call (its prologue, the SiLU's
   constants loaded afresh) it cost 2-4% of the tile linears' time. */
static inline __attribute__((always_inline)) void pending_rows(const struct tile_job *j, struct pending_chunk *p,
                                                               int until) {
    const int rows = p->r0 + p->r1;
    if (until > rows) until = rows;
    while (p->done < until) {
        const int tile = p->done < p->r0 ? 0 : 1, first = tile ? p->done - p->r0 : p->done;
        const int end = tile || until < p->r0 ? until : p->r0, count = end - p->done;
        const int64_t m = p->m0 + p->done;
        if (j->half > 0) {
            const int64_t ld = j->half * 16;
            store_silu_rows(p->c[tile] + first * 16, p->c[2 + tile] + first * 16, count, j->y + m * ld + p->a * 16, ld);
        } else {
            for (int t = 0; t < 1 + p->two; t++) {
                const int64_t pt = t ? p->b : p->a, nr = j->n_out - pt * 16 < 16 ? j->n_out - pt * 16 : 16;
                if (j->yf != NULL) {
                    store_tile_rows_f32(p->c[2 * t + tile] + first * 16, count,
                                        j->bias_f32 == NULL ? NULL : j->bias_f32 + pt * 16,
                                        j->yf + m * j->n_out + pt * 16, j->n_out, nr);
                    continue;
                }
                store_tile_rows(p->c[2 * t + tile] + first * 16, count, j->bias == NULL ? NULL : j->bias + pt * 16,
                                j->y + m * j->n_out + pt * 16, j->n_out, nr);
            }
        }
        p->done = end;
    }
}

#if KVSEAL_AMX
/* A weight tile: where several row chunks pass over the same panels (prefill), loaded with the
   hint that it is reused from L2 but not soon (TILELOADDT1), so that it does not push the chunk's
   rows of x out of L1; they are reused by every pair of the group, the weights only by the next
   chunk. With plain loads both came from L2, whose bandwidth (two A and two B tiles for four tile
   products) held the 32-row x 576 tile products at 2.4 TFLOPS; streamed: 2.9-3.2 TFLOPS (two
   threads, 2,048 rows; with K = 1,536 a chunk's rows never fit L1 and it makes no difference),
   a 2,048-token prefill step 0.94x. At decode sizes each weight tile is read once, from memory:
   plain loads, as before. */
#define load_weight_tile(tile, from, streamed)            \
    do {                                                  \
        if (streamed) _tile_stream_loadd(tile, from, 64); \
        else _tile_loadd(tile, from, 64);                 \
    } while (0)

/* One 32-row chunk of x (a; r1 rows in its second row tile) against panel b0 and, if two,
   panel b1, over every k: the four sums into c; the pending chunk's rows go out between the
   k steps (all of them by the end). */
static void amx_chunk_overlapped(const uint16_t *a, int64_t k_in, const uint16_t *b0, const uint16_t *b1, int r1,
                                 int two, float c[4][256], const struct tile_job *j, struct pending_chunk *p) {
    const int64_t kblocks = k_in / 32;
    const int streamed = j->rows > TILE_CHUNK_ROWS;
    const int rows = p->c == NULL ? 0 : p->r0 + p->r1;
    const int per_step = (int)((rows + kblocks - 1) / kblocks);
    _tile_zero(0);
    _tile_zero(2);
    if (r1) {
        _tile_zero(1);
        _tile_zero(3);
    }
    for (int64_t kb = 0; kb < kblocks; kb++) {
        _tile_loadd(4, a + kb * 32, k_in * 2);
        load_weight_tile(6, b0 + kb * 512, streamed);
        _tile_dpbf16ps(0, 4, 6);
        if (r1) {
            _tile_loadd(5, a + 16 * k_in + kb * 32, k_in * 2);
            _tile_dpbf16ps(1, 5, 6);
        }
        if (two) {
            load_weight_tile(7, b1 + kb * 512, streamed);
            _tile_dpbf16ps(2, 4, 7);
            if (r1) _tile_dpbf16ps(3, 5, 7);
        }
        if (p->done < rows) pending_rows(j, p, p->done + per_step);
    }
    if (p->c != NULL) pending_rows(j, p, rows);
    _tile_stored(0, c[0], 64);
    _tile_stored(2, c[2], 64);
    if (r1) {
        _tile_stored(1, c[1], 64);
        _tile_stored(3, c[3], 64);
    }
}
#else
static void amx_chunk_overlapped(const uint16_t *a, int64_t k_in, const uint16_t *b0, const uint16_t *b1, int r1,
                                 int two, float c[4][256], const struct tile_job *j, struct pending_chunk *p) {
    (void)a;
    (void)k_in;
    (void)b0;
    (void)b1;
    (void)r1;
    (void)two;
    (void)c;
    (void)j;
    (void)p;
}
#endif

/* Pairs [i_begin, i_end) for rows [0, rows): pair i is panels (2i, 2i + 1) of a plain linear,
   (i, i + half) of a fused gate/up. Blocked as a GEMM: pairs in groups whose weights stay in
   L2 while every 32-row chunk passes over them (the weights come from memory once), and a
   chunk's rows stay in L1 across the group's pairs. after: the first pair of the thread's next
   run (-1: none); with at most TILE_CHUNK_ROWS rows (one chunk: decode) the last pair prefetches
   it, so that a run does not start on weights still in memory. */
static void tile_pairs(const struct tile_job *j, int64_t i_begin, int64_t i_end, int amx, int64_t after) {
    const int one_chunk = j->rows <= TILE_CHUNK_ROWS;
    float c[2][4][256]; /* on AMX: the chunk being computed, and the one whose outputs go out meanwhile */
    int cur = 0;
    struct pending_chunk pending = {0};
    int conf0 = -1, conf1 = -1;
    const int64_t panels = (j->n_out + 15) / 16, kblocks = j->k_in / 32, pair_bytes = 2 * j->k_in * 32;
    const int64_t fit = (amx ? TILE_GROUP_BYTES_AMX : TILE_GROUP_BYTES) / pair_bytes, most = fit > 1 ? fit : 1;
    const int64_t pairs = i_end - i_begin, groups = (pairs + most - 1) / most;
    const int64_t group = amx && groups > 1 ? (pairs + groups - 1) / groups : most;
    for (int64_t g = i_begin; g < i_end; g += group) {
        const int64_t g_end = g + group < i_end ? g + group : i_end;
        for (int64_t m0 = 0; m0 < j->rows; m0 += TILE_CHUNK_ROWS) {
            const int r0 = j->rows - m0 < 16 ? (int)(j->rows - m0) : 16;
            const int r1 = j->rows - m0 <= 16 ? 0 : (j->rows - m0 < 32 ? (int)(j->rows - m0 - 16) : 16);
            if (amx && (r0 != conf0 || r1 != conf1)) {
                configure_tiles(r0, r1);
                conf0 = r0;
                conf1 = r1;
            }
            for (int64_t i = g; i < g_end; i++) {
                const int64_t a = j->half > 0 ? i : 2 * i, b = j->half > 0 ? i + j->half : 2 * i + 1;
                const int two = b < panels;
                const uint16_t *x = j->x + m0 * j->k_in, *b0 = j->packed + a * kblocks * 512;
                const uint16_t *b1 = j->packed + b * kblocks * 512;
                if (amx) {
                    amx_chunk_overlapped(x, j->k_in, b0, b1, r1, two, c[cur], j, &pending);
                    pending = (struct pending_chunk){c[cur], m0, a, b, r0, r1, two, 0};
                    cur ^= 1;
                } else { /* the first chunk of rows prefetches the next pair's weights */
                    const int64_t n = one_chunk && i + 1 == i_end ? after : i + 1;
                    const int64_t na = j->half > 0 ? n : 2 * n, nb = j->half > 0 ? n + j->half : 2 * n + 1;
                    const int ahead = m0 == 0 && (one_chunk ? n >= 0 : n < g_end);
                    dot_chunk(x, j->k_in, b0, b1, r0 + r1, two, c[0], ahead ? j->packed + na * kblocks * 512 : NULL,
                              ahead ? j->packed + (nb < panels ? nb : na) * kblocks * 512 : NULL);
                    struct pending_chunk whole = {c[0], m0, a, b, r0, r1, two, 0};
                    pending_rows(j, &whole, r0 + r1);
                }
            }
        }
    }
    if (pending.c != NULL) pending_rows(j, &pending, pending.r0 + pending.r1);
}

/* The job's pairs handed to the threads in runs of consecutive pairs from a shared counter as
   they come free, so each thread streams its weights in order. At decode sizes the runs are
   short (about 8 a thread, rounded down: 18 pairs, o_proj's and down_proj's in SmolLM2, go as
   18 runs of one pair, not 9 of two that split 5 + 4 between two threads; a 32-row stack of
   linears 0.97x the time on a Zen 4 host): on a host whose cores the frontend shares, a
   preempted thread then holds no fixed half for the other to wait on. From TILE_SPLIT_ROWS
   rows on each thread takes one contiguous half: every run re-reads all the rows, which short
   runs would multiply. At decode sizes (one chunk of rows) each thread takes its next run
   before it works on the one in hand, so that it can prefetch the next run's first weights
   (tile_pairs' `after`); with two halves, claiming ahead would take the other thread's half. */
#define TILE_SPLIT_ROWS 256
static void tile_run(const struct tile_job *j, int64_t pairs, int num_threads) {
    const int64_t short_run = pairs / (8 * num_threads) > 1 ? pairs / (8 * num_threads) : 1;
    const int64_t run = j->rows >= TILE_SPLIT_ROWS ? (pairs + num_threads - 1) / num_threads : short_run;
    const int amx = kvseal_amx_linears;
    int64_t handed_out = 0;
    const int claim_ahead = j->rows <= TILE_CHUNK_ROWS;
#pragma omp parallel num_threads(num_threads)
    {
        int used = 0;
        int64_t i = __atomic_fetch_add(&handed_out, run, __ATOMIC_RELAXED);
        while (i < pairs && j->rows > 0) {
            const int64_t next = claim_ahead ? __atomic_fetch_add(&handed_out, run, __ATOMIC_RELAXED) : -1;
            tile_pairs(j, i, i + run < pairs ? i + run : pairs, amx, next < pairs ? next : -1);
            used = 1;
            i = claim_ahead ? next : __atomic_fetch_add(&handed_out, run, __ATOMIC_RELAXED);
        }
        if (used && amx) tile_release();
    }
}

/* y [rows, n_out] = x [rows, k_in] . W^T (+ bias [n_out] unless NULL), all bfloat16; W packed by
   kvseal_pack_tiles. Returns 0 (k_in % 32 is the caller's to check). */
int kvseal_linear_tiles(const uint16_t *x, const uint16_t *packed, const uint16_t *bias, uint16_t *y, int64_t rows,
                        int64_t n_out, int64_t k_in, int num_threads) {
    const struct tile_job j = {x, packed, bias, y, rows, n_out, k_in, 0, NULL, NULL};
    tile_run(&j, ((n_out + 15) / 16 + 1) / 2, num_threads);
    return 0;
}

/* y = x W^T (+ bias) as kvseal_linear_tiles, then h += y and out = RMSNorm(h) * weight as
   kvseal_add_rms_norm_bf16 (the residual add and norm after a decoder layer's o_proj or
   down_proj), bit-equal to the two calls. From TILE_SPLIT_ROWS rows the threads split the rows
   instead of the panel pairs, each multiplying its chunks by every pair and then adding and
   norming the rows it just wrote, from its own cache; the separate norm read each row from
   memory, half of them written by the other core. Each thread reads the whole weight (a
   2,048-token step: o_proj + norm 0.80 -> 0.66 ms, down_proj + norm 1.51 -> 1.45 ms). Fewer rows
   run the two calls (the weight read twice would cost more there). Returns 0. */
int kvseal_linear_tiles_add_norm_bf16(const uint16_t *x, const uint16_t *packed, const uint16_t *bias, uint16_t *y,
                                      uint16_t *h, const uint16_t *weight, float eps, uint16_t *out, int64_t rows,
                                      int64_t n_out, int64_t k_in, int num_threads) {
    if (rows < TILE_SPLIT_ROWS || num_threads < 2) {
        kvseal_linear_tiles(x, packed, bias, y, rows, n_out, k_in, num_threads);
        kvseal_add_rms_norm_bf16(h, y, weight, eps, out, rows, n_out, num_threads);
        return 0;
    }
    const int64_t pairs = ((n_out + 15) / 16 + 1) / 2, chunks = (rows + TILE_CHUNK_ROWS - 1) / TILE_CHUNK_ROWS;
    const int amx = kvseal_amx_linears;
#pragma omp parallel num_threads(num_threads)
    {
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t r0 = chunks * t / nt * TILE_CHUNK_ROWS, r_end = chunks * (t + 1) / nt * TILE_CHUNK_ROWS;
        const int64_t r1 = r_end < rows ? r_end : rows;
        if (r1 > r0) {
            const struct tile_job mine = {x + r0 * k_in, packed, bias, y + r0 * n_out, r1 - r0,
                                          n_out,         k_in,   0,    NULL,           NULL};
            tile_pairs(&mine, 0, pairs, amx, -1);
            if (amx) tile_release();
            for (int64_t r = r0; r < r1; r++)
                add_rms_norm_row_bf16(h + r * n_out, y + r * n_out, weight, eps, out + r * n_out, n_out);
        }
    }
    return 0;
}

/* kvseal_linear_tiles, the float32 sums (+ float32 bias) written unrounded into y. Returns 0. */
int kvseal_linear_tiles_f32(const uint16_t *x, const uint16_t *packed, const float *bias, float *y, int64_t rows,
                            int64_t n_out, int64_t k_in, int num_threads) {
    const struct tile_job j = {x, packed, NULL, NULL, rows, n_out, k_in, 0, y, bias};
    tile_run(&j, ((n_out + 15) / 16 + 1) / 2, num_threads);
    return 0;
}

/* act [rows, inter] = silu(x W_gate^T) * (x W_up^T) in one pass over the MLP's fused gate/up
   weight (packed [2 * inter, k_in], no bias), bit-equal to kvseal_linear_tiles then
   kvseal_silu_mul_bf16: the [rows, 2 * inter] intermediate is never written. Returns -1,
   computing nothing, unless inter is a multiple of 16 (gate and up panels then hold the same
   features); else 0. */
int kvseal_linear_silu_tiles(const uint16_t *x, const uint16_t *packed, uint16_t *act, int64_t rows, int64_t inter,
                             int64_t k_in, int num_threads) {
    if (inter % 16 != 0) return -1;
    const struct tile_job j = {x, packed, NULL, act, rows, 2 * inter, k_in, inter / 16, NULL, NULL};
    tile_run(&j, inter / 16, num_threads);
    return 0;
}
#else
int kvseal_linear_tiles_add_norm_bf16(const uint16_t *x, const uint16_t *packed, const uint16_t *bias, uint16_t *y,
                                      uint16_t *h, const uint16_t *weight, float eps, uint16_t *out, int64_t rows,
                                      int64_t n_out, int64_t k_in, int num_threads) {
    (void)x;
    (void)packed;
    (void)bias;
    (void)y;
    (void)h;
    (void)weight;
    (void)eps;
    (void)out;
    (void)rows;
    (void)n_out;
    (void)k_in;
    (void)num_threads;
    return -1;
}
int kvseal_linear_tiles(const uint16_t *x, const uint16_t *packed, const uint16_t *bias, uint16_t *y, int64_t rows,
                        int64_t n_out, int64_t k_in, int num_threads) {
    (void)x;
    (void)packed;
    (void)bias;
    (void)y;
    (void)rows;
    (void)n_out;
    (void)k_in;
    (void)num_threads;
    return -1;
}
int kvseal_linear_tiles_f32(const uint16_t *x, const uint16_t *packed, const float *bias, float *y, int64_t rows,
                            int64_t n_out, int64_t k_in, int num_threads) {
    (void)x;
    (void)packed;
    (void)bias;
    (void)y;
    (void)rows;
    (void)n_out;
    (void)k_in;
    (void)num_threads;
    return -1;
}
int kvseal_linear_silu_tiles(const uint16_t *x, const uint16_t *packed, uint16_t *act, int64_t rows, int64_t inter,
                             int64_t k_in, int num_threads) {
    (void)x;
    (void)packed;
    (void)act;
    (void)rows;
    (void)inter;
    (void)k_in;
    (void)num_threads;
    return -1;
}
#endif
