/* Decode attention over the paged pool: one query token per row, against its own context.
 *
 * What it reads. For row b, only slots 0..context_lens[b]-1 through the row's own block table
 * (the same slots the torch formulation attends to), and nothing past them: no padding at all.
 * A partial last page is never read past the context (the AMX path copies it into a scratch
 * tile with zero rows). The isolation checks that run before every forward are the engine's;
 * tests/ops/test_decode_attention.py holds the kernel to this with every other slot NaN.
 *
 * Why. The torch formulation copies every decode row's K out of the pool each layer before its
 * score matmul can run (no torch op takes a dot product through a page table), then runs about
 * eight small ops per layer. This walks each row's pages slot by slot instead: scores, softmax
 * and the weighted sum of V for one (row, KV head) in one pass over that row's context, split
 * over torch's OpenMP threads, (row, KV head) tasks handed out dynamically.
 *
 * float32 pool (kvseal_decode_attention). Both passes go page by page with every query head of
 * the KV group over a page before the next one: four slots' scores for up to three of the
 * group's heads at once (each K vector loaded once for them, twelve independent FMA chains),
 * each head's PV sums kept in the output between pages. A 4 KB page is read into L1 once per
 * group, and each sum keeps the order of one head at a time. Pages are scattered and the
 * hardware prefetcher stops at each page's end, so the kernel asks for the page after next as
 * it goes, and the last two K pages ask for the first two V pages. Head dims 32, 64 and 128
 * have unrolled kernels; any other runs plain loops.
 *
 * bfloat16 pool (kvseal_decode_attention_bf16). The query heads are read in place from the fused
 * qkv rows (any row stride), the outputs rounded once to bfloat16. Widening a bfloat16 row once
 * per query head (a group of three to seven) would cost more than the arithmetic, so the values
 * pass widens each V row once, in registers, and multiplies it into the sums of up to four query
 * heads at a time (two at head_dim 128, fewer on AVX2 builds), each sum still taken slot by slot
 * in context order; with AVX-512 a row's 32 bfloat16 widen by one load and two interleaves
 * (widen32_bf16), the sums kept in the interleaves' lane order and put back once per task. The
 * scores, by the `scores` argument, each way falling back to the next where the CPU, build or
 * process lacks it (so the tests run every path):
 *   AMX: a page's scores for all the group's query heads are one TDPBF16PS per 32 dims (the K
 *     page as the A tile, the query heads packed once per task as B tiles); each query head's
 *     column of the C tile leaves by one gather and masked store.
 *   DOT: each slot's score is VDPBF16PS over the bfloat16 K row and query head in place, 16
 *     slots' sums reduced together; slots past the context are not read.
 *   WIDENED: each page's K rows up to the context's end are widened once into a float32 page in
 *     L1 and every query head of the group runs over it in 16-lane vectors, four slots' scores
 *     reduced together (a CPU without AVX512-BF16).
 * With every page in L2, 30 layers at 32 rows took 5.9 ms (8.2 before the values pass widened
 * once per row and the AMX scores left by gather); over 30 layers' pools from memory 0.92x the
 * earlier time (bench/attention_ab.py).
 *
 * Called by NativeOps.decode_attention (kvseal/ops/native_backend.py) and the decode loop
 * (decode_loop.c). Pools of another dtype run the torch formulation (kvseal/ops/torch_attention.py:
 * batched matmuls over gathered pages, V read in place by an embedding bag in float32). */

#include "kvseal_ops.h"
#include "tiles.h"
#include "vec.h"

/* Softmax in place over s[0..n-1]; returns nothing, s holds the probabilities. */
static void softmax(float *s, int64_t n) {
    float top = s[0], sum = 0.0f;
    int64_t t = 1;
    if (n >= VL) { /* the maximum is exact in any order */
        vl m = load_vl(s);
        for (t = VL; t + VL <= n; t += VL) m = max_vl(load_vl(s + t), m);
        for (int i = 0; i < VL; i++) top = m[i] > top ? m[i] : top;
    }
    for (; t < n; t++) top = s[t] > top ? s[t] : top;
    t = 0;
    vl acc = {0};
    for (; t + VL <= n; t += VL) {
        vl e = exp_vl(load_vl(s + t) - top);
        store_vl(s + t, e);
        acc += e;
    }
    sum = hsum_vl(acc);
    for (; t < n; t++) {
        s[t] = exp_s(s[t] - top);
        sum += s[t];
    }
    const float inv = 1.0f / sum;
    for (t = 0; t < n; t++) s[t] *= inv;
}

/* scale * hsum8 of a, b, c and d into out[0..3], each summed in hsum8's order (bit-equal to it). */
static inline void hsum8x4(v8 a, v8 b, v8 c, v8 d, float scale, float *out) {
    const v8 ab = __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11)
                  + __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15); /* x0+x4 .. x3+x7 of a, of b */
    const v8 cd = __builtin_shufflevector(c, d, 0, 1, 2, 3, 8, 9, 10, 11)
                  + __builtin_shufflevector(c, d, 4, 5, 6, 7, 12, 13, 14, 15);
    const v8 x = __builtin_shufflevector(ab, cd, 0, 2, 8, 10, 4, 6, 12, 14)
                 + __builtin_shufflevector(ab, cd, 1, 3, 9, 11, 5, 7, 13, 15); /* a a c c b b d d */
    out[0] = scale * (x[0] + x[1]);
    out[1] = scale * (x[4] + x[5]);
    out[2] = scale * (x[2] + x[3]);
    out[3] = scale * (x[6] + x[7]);
}

/* Scores of slots 0..n-1 of one K page for JB (<= 3) query heads q_j = q + j * hd, into
   scores[j * ctx + i]: four slots at a time for every head at once, so each K vector is loaded
   once for the JB heads and the 4 * JB accumulators are as many independent FMA chains (one
   head at a time, four chains eight FMAs deep waited on the FMA latency). Each score is summed
   in the order of one slot and one head at a time (then hsum8), so the result is the same. */
#define DEFINE_PAGE_SCORES(NV, JB)                                                                                     \
    static inline void page_scores_##NV##_##JB(const float *q, const float *kp, int64_t n, float scale, float *scores, \
                                               int64_t ctx) {                                                          \
        const int64_t hd = 8 * NV;                                                                                     \
        int64_t i = 0;                                                                                                 \
        for (; i + 4 <= n; i += 4) {                                                                                   \
            v8 acc[JB][4];                                                                                             \
            for (int j = 0; j < JB; j++)                                                                               \
                for (int s = 0; s < 4; s++) acc[j][s] = (v8){0};                                                       \
            const float *k0 = kp + i * hd;                                                                             \
            for (int c = 0; c < NV; c++) {                                                                             \
                const v8 k_0 = load8(k0 + 8 * c), k_1 = load8(k0 + hd + 8 * c);                                        \
                const v8 k_2 = load8(k0 + 2 * hd + 8 * c), k_3 = load8(k0 + 3 * hd + 8 * c);                           \
                for (int j = 0; j < JB; j++) {                                                                         \
                    const v8 qv = load8(q + j * hd + 8 * c);                                                           \
                    acc[j][0] += qv * k_0;                                                                             \
                    acc[j][1] += qv * k_1;                                                                             \
                    acc[j][2] += qv * k_2;                                                                             \
                    acc[j][3] += qv * k_3;                                                                             \
                }                                                                                                      \
            }                                                                                                          \
            for (int j = 0; j < JB; j++)                                                                               \
                hsum8x4(acc[j][0], acc[j][1], acc[j][2], acc[j][3], scale, scores + j * ctx + i);                      \
        }                                                                                                              \
        for (; i < n; i++)                                                                                             \
            for (int j = 0; j < JB; j++) {                                                                             \
                v8 a0 = {0};                                                                                           \
                for (int c = 0; c < NV; c++) a0 += load8(q + j * hd + 8 * c) * load8(kp + i * hd + 8 * c);             \
                scores[j * ctx + i] = scale * hsum8(a0);                                                               \
            }                                                                                                          \
    }

/* One (row, KV head) with head_dim = 8 * NV: its `group` query heads attend to slots 0..ctx-1
   of the row's pages. scores: scratch of group * ctx floats; out holds each head's running PV
   sums between pages. Both passes go page by page with every query head over a page before
   the next page (a 4 KB page stays in L1 for the group: one head at a time read every V page
   from L2 once per head), each head's sums over the slots in order, as one head at a time
   would sum them. Pages are scattered and the hardware prefetcher stops at each page's end,
   so the kernels ask for the page after next as they go, and the last two K pages ask for the
   first two V pages. */
#define DEFINE_ATTEND(NV)                                                                                            \
    DEFINE_PAGE_SCORES(NV, 1)                                                                                        \
    DEFINE_PAGE_SCORES(NV, 2)                                                                                        \
    DEFINE_PAGE_SCORES(NV, 3)                                                                                        \
    static void attend_##NV(const float *q, const float *k_head, const float *v_head, const int64_t *table,          \
                            int64_t ctx, int64_t group, int64_t page_size, float scale, float *scores, float *out) { \
        const int64_t hd = 8 * NV, page_floats = page_size * hd, page_bytes = page_floats * (int64_t)sizeof(float);  \
        const int64_t pages = (ctx + page_size - 1) / page_size;                                                     \
        for (int64_t p = 0; p < pages; p++) {                                                                        \
            const int64_t t0 = p * page_size, n = ctx - t0 < page_size ? ctx - t0 : page_size;                       \
            if (p == 0 && pages > 1) prefetch_page(k_head + table[1] * page_floats, page_bytes);                     \
            if (p + 2 < pages) prefetch_page(k_head + table[p + 2] * page_floats, page_bytes);                       \
            else if (p + 2 - pages < pages) prefetch_page(v_head + table[p + 2 - pages] * page_floats, page_bytes);  \
            const float *kp = k_head + table[p] * page_floats;                                                       \
            for (int64_t j0 = 0; j0 < group; j0 += 3) {                                                              \
                const float *qj = q + j0 * hd;                                                                       \
                float *sj = scores + j0 * ctx + t0;                                                                  \
                if (group - j0 >= 3) page_scores_##NV##_3(qj, kp, n, scale, sj, ctx);                                \
                else if (group - j0 == 2) page_scores_##NV##_2(qj, kp, n, scale, sj, ctx);                           \
                else page_scores_##NV##_1(qj, kp, n, scale, sj, ctx);                                                \
            }                                                                                                        \
        }                                                                                                            \
        for (int64_t j = 0; j < group; j++) softmax(scores + j * ctx, ctx);                                          \
        for (int64_t j = 0; j < group * hd; j += 8) store8(out + j, (v8){0});                                        \
        for (int64_t p = 0; p < pages; p++) {                                                                        \
            const int64_t t0 = p * page_size, n = ctx - t0 < page_size ? ctx - t0 : page_size;                       \
            if (p + 2 < pages) prefetch_page(v_head + table[p + 2] * page_floats, page_bytes);                       \
            const float *vp = v_head + table[p] * page_floats;                                                       \
            for (int64_t j = 0; j < group; j++) {                                                                    \
                v8 o[NV];                                                                                            \
                for (int c = 0; c < NV; c++) o[c] = load8(out + j * hd + 8 * c);                                     \
                const float *sj = scores + j * ctx + t0;                                                             \
                for (int64_t i = 0; i < n; i++) {                                                                    \
                    const float w = sj[i];                                                                           \
                    for (int c = 0; c < NV; c++) o[c] += w * load8(vp + i * hd + 8 * c);                             \
                }                                                                                                    \
                for (int c = 0; c < NV; c++) store8(out + j * hd + 8 * c, o[c]);                                     \
            }                                                                                                        \
        }                                                                                                            \
    }
DEFINE_ATTEND(4)
DEFINE_ATTEND(8)
DEFINE_ATTEND(16)

/* Any head_dim: plain loops. */
static void attend_any(const float *q, const float *k_head, const float *v_head, const int64_t *table, int64_t ctx,
                       int64_t group, int64_t hd, int64_t page_size, float scale, float *scores, float *out) {
    for (int64_t t = 0; t < ctx; t++) {
        const float *kr = k_head + (table[t / page_size] * page_size + t % page_size) * hd;
        for (int64_t j = 0; j < group; j++) {
            float acc = 0.0f;
            for (int64_t d = 0; d < hd; d++) acc += q[j * hd + d] * kr[d];
            scores[j * ctx + t] = scale * acc;
        }
    }
    for (int64_t j = 0; j < group; j++) softmax(scores + j * ctx, ctx);
    memset(out, 0, sizeof(float) * group * hd);
    for (int64_t t = 0; t < ctx; t++) {
        const float *vr = v_head + (table[t / page_size] * page_size + t % page_size) * hd;
        for (int64_t j = 0; j < group; j++)
            for (int64_t d = 0; d < hd; d++) out[j * hd + d] += scores[j * ctx + t] * vr[d];
    }
}

/* One decode attention call (kvseal_decode_attention, kvseal_decode_attention_bf16). Row b's
   query heads start at q + b * q_stride and its output heads at out + b * out_stride (elements
   of the pool's type); K and V are [kv_heads, num_pages, page_size, head_dim], head_stride
   elements per KV head. */
struct decode_args {
    const void *q, *k, *v;
    const int64_t *tables, *context_lens;
    void *out;
    int64_t q_stride, out_stride, group, head_dim, head_stride, page_size, table_width;
    float scale;
    int dot_scores; /* bfloat16 pool: scores by AVX512-BF16 dot products where the build has them */
};
/* amx: whether the thread has AMX tiles configured for the task (see `begin`). */
typedef void (*attend_task)(const struct decode_args *a, int64_t b, int64_t h, float *scratch, int amx);

/* Every (row, KV head) of the call, split over the threads, each with `scratch_floats` of
   scratch. Each thread calls begin() (unless NULL) before its tasks, passing what it returns to
   them, and end() after them if begin returned nonzero. Returns 0, or -1 if scratch could not
   be allocated. */
static int decode_attention_rows(const struct decode_args *a, int64_t rows, int64_t kv_heads, int64_t scratch_floats,
                                 int num_threads, attend_task task, int (*begin)(void), void (*end)(void)) {
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *scratch = malloc(sizeof(float) * scratch_floats);
        const int amx = begin != NULL && begin();
        if (scratch == NULL) failed = 1;
#pragma omp for collapse(2) schedule(dynamic, 1)
        for (int64_t b = 0; b < rows; b++)
            for (int64_t h = 0; h < kv_heads; h++)
                if (scratch != NULL) task(a, b, h, scratch, amx);
        if (amx) end();
        free(scratch);
    }
    return failed ? -1 : 0;
}

/* Task (b, h) over a float32 pool, in place: scratch holds the scores. */
static void attend_task_f32(const struct decode_args *a, int64_t b, int64_t h, float *scratch, int amx) {
    (void)amx;
    const int64_t hd = a->head_dim, first = b * a->q_stride + h * a->group * hd, ctx = a->context_lens[b];
    const float *qh = (const float *)a->q + first;
    const float *kh = (const float *)a->k + h * a->head_stride, *vh = (const float *)a->v + h * a->head_stride;
    const int64_t *table = a->tables + b * a->table_width;
    float *oh = (float *)a->out + first;
    if (hd == 32) attend_4(qh, kh, vh, table, ctx, a->group, a->page_size, a->scale, scratch, oh);
    else if (hd == 64) attend_8(qh, kh, vh, table, ctx, a->group, a->page_size, a->scale, scratch, oh);
    else if (hd == 128) attend_16(qh, kh, vh, table, ctx, a->group, a->page_size, a->scale, scratch, oh);
    else attend_any(qh, kh, vh, table, ctx, a->group, hd, a->page_size, a->scale, scratch, oh);
}

int kvseal_decode_attention(const float *q, const float *k, const float *v, const int64_t *tables,
                            const int64_t *context_lens, float *out, int64_t rows, int64_t kv_heads, int64_t group,
                            int64_t head_dim, int64_t num_pages, int64_t page_size, int64_t table_width,
                            int64_t max_context, float scale, int num_threads) {
    const int64_t width = kv_heads * group * head_dim;
    const struct decode_args a = {q,
                                  k,
                                  v,
                                  tables,
                                  context_lens,
                                  out,
                                  width,
                                  width,
                                  group,
                                  head_dim,
                                  num_pages * page_size * head_dim,
                                  page_size,
                                  table_width,
                                  scale,
                                  0};
    return decode_attention_rows(&a, rows, kv_heads, group * max_context, num_threads, attend_task_f32, NULL, NULL);
}

/* ---- AMX scores ---- */

#if KVSEAL_AMX
/* Decode attention's scores on tiles: tile 0 = C (16 slots x 16 query
   heads), 1 = A (a K page's 16 slots x 32 dims), 2 = B (the query heads' 32-dim slice, dims in
   pairs). Returns 1 with the tiles configured for this thread, 0 where AMX is not permitted. */
static int amx_attention_begin(void) {
    if (!kvseal_amx_permitted) return 0;
    configure_full_tiles(3);
    return 1;
}
static void amx_attention_end(void) { _tile_release(); }

/* q [group <= 16, head_dim] bfloat16 -> head_dim / 32 B tiles [16 dim pairs][16 heads][2],
   heads past the group zero. */
static void pack_query_tiles(const uint16_t *q, int64_t group, int64_t head_dim, uint16_t *tiles) {
    memset(tiles, 0, sizeof(uint16_t) * head_dim * 16);
    for (int64_t j = 0; j < group; j++)
        for (int64_t d = 0; d < head_dim; d++)
            tiles[(d / 32) * 512 + (d % 32 / 2) * 32 + j * 2 + d % 2] = q[j * head_dim + d];
}

/* Column j < group of each C tile in c (its 16 slots, 16 floats apart), times scale, into
   scores[j * ctx + s] for the tile's first n slots. */
static inline void store_page_scores(const float *c, int64_t n, int64_t group, float scale, float *scores,
                                     int64_t ctx) {
    const __m512i column = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                              _mm512_set1_epi32(16));
    const __mmask16 slots = (__mmask16)((1u << n) - 1u);
    for (int64_t j = 0; j < group; j++)
        _mm512_mask_storeu_ps(scores + j * ctx, slots,
                              _mm512_mul_ps(_mm512_set1_ps(scale), _mm512_i32gather_ps(column, c + j, 4)));
}

/* scores[j * ctx + s] = scale * (K page row s . q_j) for the page's first n <= 16 slots (float32
   sums of exact bfloat16 products). A partial page is copied into `pad` ([16, head_dim]) with
   zero rows after the n slots: slots past the context are never read. */
static void amx_page_scores(const uint16_t *k_page, int64_t n, const uint16_t *q_tiles, int64_t head_dim, int64_t group,
                            float scale, float *scores, int64_t ctx, uint16_t *pad) {
    const uint16_t *a = k_page;
    if (n < 16) {
        memcpy(pad, k_page, sizeof(uint16_t) * n * head_dim);
        memset(pad + n * head_dim, 0, sizeof(uint16_t) * (16 - n) * head_dim);
        a = pad;
    }
    float c[256];
    _tile_zero(0);
    for (int64_t kb = 0; kb < head_dim / 32; kb++) {
        _tile_loadd(1, a + kb * 32, head_dim * 2);
        _tile_loadd(2, q_tiles + kb * 512, 64);
        _tile_dpbf16ps(0, 1, 2);
    }
    _tile_stored(0, c, 64);
    store_page_scores(c, n, group, scale, scores, ctx);
}
#else /* no AMX in the build: the AMX scores are never begun */
static int amx_attention_begin(void) { return 0; }
static void amx_attention_end(void) {}
static void pack_query_tiles(const uint16_t *q, int64_t group, int64_t head_dim, uint16_t *tiles) {
    (void)q;
    (void)group;
    (void)head_dim;
    (void)tiles;
}
static void amx_page_scores(const uint16_t *k_page, int64_t n, const uint16_t *q_tiles, int64_t head_dim, int64_t group,
                            float scale, float *scores, int64_t ctx, uint16_t *pad) {
    (void)k_page;
    (void)n;
    (void)q_tiles;
    (void)head_dim;
    (void)group;
    (void)scale;
    (void)scores;
    (void)ctx;
    (void)pad;
}
#endif

/* ---- bfloat16 pool ---- */

/* out[0..3] = scale * (the sums of a, b, c, d's lanes) */
static inline void sums4(v8 a, v8 b, v8 c, v8 d, float scale, float *out) {
    const v8 ab = __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11)
                  + __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15); /* a's 4 partial sums, b's 4 */
    const v8 cd = __builtin_shufflevector(c, d, 0, 1, 2, 3, 8, 9, 10, 11)
                  + __builtin_shufflevector(c, d, 4, 5, 6, 7, 12, 13, 14, 15);
    const v8 x = __builtin_shufflevector(ab, cd, 0, 1, 8, 9, 4, 5, 12, 13)
                 + __builtin_shufflevector(ab, cd, 2, 3, 10, 11, 6, 7, 14, 15); /* a a c c b b d d */
    out[0] = scale * (x[0] + x[1]);
    out[1] = scale * (x[4] + x[5]);
    out[2] = scale * (x[2] + x[3]);
    out[3] = scale * (x[6] + x[7]);
}
static void widen_rows(const uint16_t *src, float *dst, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) store8(dst + i, load8_bf16(src + i));
    for (; i < n; i++) dst[i] = widen_bf16_1(src[i]);
}

#if KVSEAL_AVX512BF16
/* Lane s of the result = the sum of acc[s]'s 16 lanes. Four rounds, each pairing vectors and
   halving the partial sums each holds: the first two shuffle within 128-bit lanes (unpacks), so
   that each 128-bit lane then holds four vectors' sums over it, and only the last two cross
   lanes (whole 128-bit lanes moved). On a Zen 4 host this took a page's scores (16 slots,
   head_dim 64, in L1) from 18.4 to 14.4 ns against four rounds of two-source permutes. */
static inline __m512 sum_lanes16(const __m512 *acc) {
    __m512 t[8], u[4], v[2];
    for (int i = 0; i < 8; i++) /* 128-bit lane k: acc[2i] and acc[2i+1] over lanes 4k..4k+3, as 2 + 2 */
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(acc[2 * i], acc[2 * i + 1]),
                             _mm512_unpackhi_ps(acc[2 * i], acc[2 * i + 1]));
    for (int i = 0; i < 4; i++) { /* 128-bit lane k: acc[4i..4i+3], each summed over lanes 4k..4k+3 */
        const __m512d a = _mm512_castps_pd(t[2 * i]), b = _mm512_castps_pd(t[2 * i + 1]);
        u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    for (int i = 0; i < 2; i++) /* 128-bit lanes: u[2i] over lanes 0-7 and 8-15, then u[2i+1] the same */
        v[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(v[0], v[1], 0x88), _mm512_shuffle_f32x4(v[0], v[1], 0xdd));
}

/* scores[s] = scale * (K page row s . q) for the page's first n <= 16 slots, both read as
   bfloat16 in place (VDPBF16PS: exact products, float32 sums); slots n.. are not read. */
static inline __attribute__((always_inline)) void dot_page_scores(const uint16_t *k_page, int64_t n, const uint16_t *q,
                                                                  int64_t hd, float scale, float *scores) {
    __m512 acc[16];
    for (int s = 0; s < 16; s++) acc[s] = _mm512_setzero_ps();
    if (n == 16) { /* a whole page: every trip count is a constant */
        for (int s = 0; s < 16; s++)
            for (int64_t c = 0; c < hd / 32; c++)
                acc[s] = _mm512_dpbf16_ps(acc[s], (__m512bh)_mm512_loadu_si512(k_page + s * hd + 32 * c),
                                          (__m512bh)_mm512_loadu_si512(q + 32 * c));
    } else {
        for (int64_t s = 0; s < n; s++)
            for (int64_t c = 0; c < hd / 32; c++)
                acc[s] = _mm512_dpbf16_ps(acc[s], (__m512bh)_mm512_loadu_si512(k_page + s * hd + 32 * c),
                                          (__m512bh)_mm512_loadu_si512(q + 32 * c));
    }
    _mm512_mask_storeu_ps(scores, (__mmask16)((1u << n) - 1u), _mm512_mul_ps(sum_lanes16(acc), _mm512_set1_ps(scale)));
}
#else
static inline void dot_page_scores(const uint16_t *k_page, int64_t n, const uint16_t *q, int64_t hd, float scale,
                                   float *scores) {
    (void)k_page;
    (void)n;
    (void)q;
    (void)hd;
    (void)scale;
    (void)scores;
}
#endif

/* 32 bfloat16 at p -> two 16-lane float32 vectors, widened exactly. With AVX-512 one load and
   two interleaves (each dword takes a bfloat16 as its high half), the lanes in the interleaves'
   order: w[0] holds elements 0-3, 8-11, 16-19, 24-27 and w[1] the others. Sums over such
   vectors are lane-wise, so store32_widened puts the elements back in order at the end. */
#if KVSEAL_AVX512BW
static inline void widen32_bf16(const uint16_t *p, v16 *w) {
    const __m512i raw = _mm512_loadu_si512(p), zero = _mm512_setzero_si512();
    w[0] = (v16)_mm512_unpacklo_epi16(zero, raw);
    w[1] = (v16)_mm512_unpackhi_epi16(zero, raw);
}
static inline void store32_widened(float *out, const v16 *w) {
    const __m512i first = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
    const __m512i second = _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11, 10, 9, 8);
    store16(out, (v16)_mm512_permutex2var_ps((__m512)w[0], first, (__m512)w[1]));
    store16(out + 16, (v16)_mm512_permutex2var_ps((__m512)w[0], second, (__m512)w[1]));
}
#else
static inline void widen32_bf16(const uint16_t *p, v16 *w) {
    w[0] = load16_bf16(p);
    w[1] = load16_bf16(p + 16);
}
static inline void store32_widened(float *out, const v16 *w) {
    store16(out, w[0]);
    store16(out + 16, w[1]);
}
#endif

/* out [G, head_dim] float32 = the G query heads' softmaxed scores (head j's at scores + j *
   lds) times V, head_dim = 16 * NV, over the pages of `table` up to ctx. Each V row is widened
   from bfloat16 in registers once and multiplied into all G heads' sums, each sum accumulated
   slot by slot in context order (so the result is the same as one head at a time). The next
   page is prefetched while this one is read, unless hw_runs and it follows this one in memory
   (see attend_bf16). */
#define DEFINE_VALUES_BF16(NV, G)                                                                              \
    static inline void values_bf16_##NV##_##G(const uint16_t *v_head, const int64_t *table, int64_t ctx,       \
                                              int64_t page_size, const float *scores, int64_t lds, float *out, \
                                              int hw_runs) {                                                   \
        const int64_t hd = 16 * NV, elems = page_size * hd;                                                    \
        v16 o[G][NV];                                                                                          \
        for (int j = 0; j < G; j++)                                                                            \
            for (int c = 0; c < NV; c++) o[j][c] = (v16){0};                                                   \
        for (int64_t t0 = 0; t0 < ctx; t0 += page_size) {                                                      \
            const int64_t n = ctx - t0 < page_size ? ctx - t0 : page_size, p = t0 / page_size;                 \
            if (t0 + page_size < ctx && !(hw_runs && table[p + 1] == table[p] + 1))                            \
                prefetch_page(v_head + table[p + 1] * elems, 2 * elems);                                       \
            const uint16_t *vp = v_head + table[p] * elems;                                                    \
            for (int64_t i = 0; i < n; i++) {                                                                  \
                v16 v[NV];                                                                                     \
                for (int c = 0; c < NV; c += 2) widen32_bf16(vp + i * hd + 16 * c, v + c);                     \
                for (int j = 0; j < G; j++) {                                                                  \
                    const float s = scores[j * lds + t0 + i];                                                  \
                    for (int c = 0; c < NV; c++) o[j][c] += s * v[c];                                          \
                }                                                                                              \
            }                                                                                                  \
        }                                                                                                      \
        for (int j = 0; j < G; j++)                                                                            \
            for (int c = 0; c < NV; c += 2) store32_widened(out + j * hd + 16 * c, o[j] + c);                  \
    }
/* Query heads a values pass takes at once: their sums and one V row stay in registers (32
   AVX-512 registers; 16 AVX2 registers hold half as many 16-lane vectors). */
#if KVSEAL_AVX512F
#define VALUES_HEADS(NV) ((NV) <= 4 ? 4 : 2)
#else
#define VALUES_HEADS(NV) ((NV) <= 2 ? 2 : 1)
#endif
#define DEFINE_VALUES_BF16_ALL(NV) \
    DEFINE_VALUES_BF16(NV, 1) DEFINE_VALUES_BF16(NV, 2) DEFINE_VALUES_BF16(NV, 3) DEFINE_VALUES_BF16(NV, 4)
DEFINE_VALUES_BF16_ALL(2)
DEFINE_VALUES_BF16_ALL(4)
DEFINE_VALUES_BF16_ALL(8)

/* How far ahead (in pages) the scores pass asks for a K page into L2 where the page does not
   follow the one before it in memory (see attend_bf16). */
#define K_PAGES_AHEAD 16
/* Into L2: the K page `d` pages into the row's table, unless it follows page d - 1 in memory. */
static inline void prefetch_scattered_k(const uint16_t *k_head, const int64_t *table, int64_t d, int64_t elems) {
    if (table[d] != table[d - 1] + 1)
        for (int64_t i = 0; i < 2 * elems; i += 64)
            __builtin_prefetch((const char *)(k_head + table[d] * elems) + i, 0, 2);
}

/* One (row, KV head) with head_dim = 16 * NV: q [group, head_dim] float32; page: scratch of
   page_size * head_dim floats; scores: group * ctx floats; out [group, head_dim] float32. Two
   passes, as the float32 kernel: scores over every page, softmax, then the weighted sum of V
   (values_bf16, VALUES_HEADS query heads at a time). While a page's scores are computed, the
   next K page is prefetched, and this V page into L2 for the second pass. The scores come from
   AMX tiles (q_tiles), AVX512-BF16 dot products over the bfloat16 q and K in place (q_dot), or
   else K widened a page at a time.
   Without AMX scores (hw_runs) a page that follows the one before it in memory is left to the
   hardware prefetcher: a request's prompt pages are one consecutive run of the pool (allocated
   at once), and on a Zen 4 host the software prefetches of such runs stalled the core on full
   miss buffers (16% of the kernel's samples on the prefetch instructions) for lines the
   hardware would bring anyway. The pages decode steps append, interleaved with the other
   requests', are still asked for. bench/attention_ab.py --dtype bfloat16 --prompt-pages 16,
   that host: 0.93-0.95x the time at 32 rows (320 and 640 slots), 8 rows 1.0x (320) and 0.96x
   (640); every page a row's own run: 0.94x at 32 rows. The AMX path, not measured with it, keeps
   every prefetch.
   Those appended pages lie one per decode step, each as far from the last as the batch has rows,
   so one page ahead into L1 left the core waiting on most of them (perf: a fifth of the kernel's
   samples on the first load of a page). Without AMX scores they are also asked for into L2
   K_PAGES_AHEAD pages ahead (and the first K_PAGES_AHEAD of them as the row starts): same
   benchmark, that host, 0.85x the time at 8 and 32 rows with 640 slots, 0.90-0.94x with 320. */
#define DEFINE_ATTEND_BF16(NV)                                                                                         \
    static void attend_bf16_##NV(const float *q, const uint16_t *k_head, const uint16_t *v_head, const int64_t *table, \
                                 int64_t ctx, int64_t group, int64_t page_size, float scale, float *page,              \
                                 float *scores, float *out, const uint16_t *q_tiles, const uint16_t *q_dot) {          \
        const int64_t hd = 16 * NV, elems = page_size * hd;                                                            \
        const int hw_runs = q_tiles == NULL;                                                                           \
        if (hw_runs)                                                                                                   \
            for (int64_t d = 1; d < K_PAGES_AHEAD && d * page_size < ctx; d++)                                         \
                prefetch_scattered_k(k_head, table, d, elems);                                                         \
        for (int64_t t0 = 0; t0 < ctx; t0 += page_size) {                                                              \
            const int64_t n = ctx - t0 < page_size ? ctx - t0 : page_size, p = t0 / page_size;                         \
            if (t0 + page_size < ctx && !(hw_runs && table[p + 1] == table[p] + 1))                                    \
                prefetch_page(k_head + table[p + 1] * elems, 2 * elems);                                               \
            if (hw_runs && t0 + K_PAGES_AHEAD * page_size < ctx)                                                       \
                prefetch_scattered_k(k_head, table, p + K_PAGES_AHEAD, elems);                                         \
            if (!(hw_runs && p > 0 && table[p] == table[p - 1] + 1))                                                   \
                for (int64_t i = 0; i < 2 * n * hd; i += 64)                                                           \
                    __builtin_prefetch((const char *)(v_head + table[p] * elems) + i, 0, 2);                           \
            if (q_tiles != NULL) {                                                                                     \
                amx_page_scores(k_head + table[p] * elems, n, q_tiles, hd, group, scale, scores + t0, ctx,             \
                                (uint16_t *)page);                                                                     \
                continue;                                                                                              \
            }                                                                                                          \
            if (q_dot != NULL) {                                                                                       \
                for (int64_t j = 0; j < group; j++)                                                                    \
                    dot_page_scores(k_head + table[p] * elems, n, q_dot + j * hd, hd, scale, scores + j * ctx + t0);   \
                continue;                                                                                              \
            }                                                                                                          \
            widen_rows(k_head + table[p] * elems, page, n * hd);                                                       \
            for (int64_t j = 0; j < group; j++) {                                                                      \
                const float *qj = q + j * hd;                                                                          \
                float *sj = scores + j * ctx + t0;                                                                     \
                int64_t i = 0;                                                                                         \
                for (; i + 4 <= n; i += 4) {                                                                           \
                    v16 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};                                                        \
                    const float *k0 = page + i * hd;                                                                   \
                    for (int c = 0; c < NV; c++) {                                                                     \
                        const v16 qv = load16(qj + 16 * c);                                                            \
                        a0 += qv * load16(k0 + 16 * c);                                                                \
                        a1 += qv * load16(k0 + hd + 16 * c);                                                           \
                        a2 += qv * load16(k0 + 2 * hd + 16 * c);                                                       \
                        a3 += qv * load16(k0 + 3 * hd + 16 * c);                                                       \
                    }                                                                                                  \
                    sums4(fold16(a0), fold16(a1), fold16(a2), fold16(a3), scale, sj + i);                              \
                }                                                                                                      \
                for (; i < n; i++) {                                                                                   \
                    v16 a0 = {0};                                                                                      \
                    for (int c = 0; c < NV; c++) a0 += load16(qj + 16 * c) * load16(page + i * hd + 16 * c);           \
                    sj[i] = scale * hsum8(fold16(a0));                                                                 \
                }                                                                                                      \
            }                                                                                                          \
        }                                                                                                              \
        for (int64_t j = 0; j < group; j++) softmax(scores + j * ctx, ctx);                                            \
        const int64_t block = VALUES_HEADS(NV);                                                                        \
        for (int64_t j0 = 0; j0 < group; j0 += block) {                                                                \
            const float *p = scores + j0 * ctx;                                                                        \
            float *o = out + j0 * hd;                                                                                  \
            switch (group - j0 < block ? group - j0 : block) {                                                         \
                case 1: values_bf16_##NV##_1(v_head, table, ctx, page_size, p, ctx, o, hw_runs); break;                \
                case 2: values_bf16_##NV##_2(v_head, table, ctx, page_size, p, ctx, o, hw_runs); break;                \
                case 3: values_bf16_##NV##_3(v_head, table, ctx, page_size, p, ctx, o, hw_runs); break;                \
                default: values_bf16_##NV##_4(v_head, table, ctx, page_size, p, ctx, o, hw_runs); break;               \
            }                                                                                                          \
        }                                                                                                              \
    }
DEFINE_ATTEND_BF16(2)
DEFINE_ATTEND_BF16(4)
DEFINE_ATTEND_BF16(8)

/* Whether the 16-lane kernels take this head_dim. */
static inline int bf16_paged(int64_t head_dim) { return head_dim == 32 || head_dim == 64 || head_dim == 128; }

/* Scratch floats per task: q and out heads, scores, a widened page (or a padded bfloat16 K page
   for the AMX scores) and the query tiles; for a head_dim the 16-lane kernels do not take, the
   row's whole context widened instead. */
static int64_t bf16_scratch_floats(int64_t group, int64_t head_dim, int64_t page_size, int64_t max_context) {
    const int64_t page = (page_size > 16 ? page_size : 16) * head_dim, tiles = head_dim / 32 * 256;
    const int64_t widened = bf16_paged(head_dim) ? page + tiles : 2 * max_context * head_dim;
    return group * (max_context + 2 * head_dim) + widened;
}

/* Task (b, h) over a bfloat16 pool: the row's query heads of KV head h widened into scratch,
   attended, and the output heads rounded back to bfloat16. */
static void attend_task_bf16(const struct decode_args *a, int64_t b, int64_t h, float *scratch, int amx) {
    const int64_t hd = a->head_dim, n = a->group * hd, ctx = a->context_lens[b], ps = a->page_size;
    const uint16_t *qh = (const uint16_t *)a->q + b * a->q_stride + h * n;
    const uint16_t *kh = (const uint16_t *)a->k + h * a->head_stride, *vh = (const uint16_t *)a->v + h * a->head_stride;
    const int64_t *table = a->tables + b * a->table_width;
    float *qf = scratch, *of = scratch + n, *scores = scratch + 2 * n, *rest = scores + a->group * ctx;
    uint16_t *oh = (uint16_t *)a->out + b * a->out_stride + h * n;
    uint16_t *q_tiles = NULL; /* AMX scores: the query heads as B tiles, after the page scratch */
    if (amx && a->group <= 16 && bf16_paged(hd) && ps <= 16) {
        q_tiles = (uint16_t *)(rest + 16 * hd);
        pack_query_tiles(qh, a->group, hd, q_tiles);
    }
    const uint16_t *q_dot = q_tiles == NULL && a->dot_scores && bf16_paged(hd) && ps <= 16 ? qh : NULL;
    widen_rows(qh, qf, n);
    if (hd == 32) attend_bf16_2(qf, kh, vh, table, ctx, a->group, ps, a->scale, rest, scores, of, q_tiles, q_dot);
    else if (hd == 64) attend_bf16_4(qf, kh, vh, table, ctx, a->group, ps, a->scale, rest, scores, of, q_tiles, q_dot);
    else if (hd == 128) attend_bf16_8(qf, kh, vh, table, ctx, a->group, ps, a->scale, rest, scores, of, q_tiles, q_dot);
    else { /* !bf16_paged: the row's context, slot by slot, into [2, ctx, head_dim] floats, one "page" of ctx slots */
        const int64_t zero = 0;
        for (int64_t t = 0; t < ctx; t++) {
            const int64_t at = (table[t / ps] * ps + t % ps) * hd;
            widen_rows(kh + at, rest + t * hd, hd);
            widen_rows(vh + at, rest + (ctx + t) * hd, hd);
        }
        attend_any(qf, rest, rest + ctx * hd, &zero, ctx, a->group, hd, ctx, a->scale, scores, of);
    }
    for (int64_t i = 0; i < n; i++) oh[i] = to_bf16(of[i]);
}

int kvseal_decode_attention_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k, const uint16_t *v,
                                 const int64_t *tables, const int64_t *context_lens, uint16_t *out, int64_t out_stride,
                                 int64_t rows, int64_t kv_heads, int64_t group, int64_t head_dim, int64_t num_pages,
                                 int64_t page_size, int64_t table_width, int64_t max_context, float scale, int scores,
                                 int num_threads) {
#if KVSEAL_AVX512BF16
    const int dot = scores >= KVSEAL_SCORES_DOT;
#else
    const int dot = 0;
#endif
    const struct decode_args a = {q,
                                  k,
                                  v,
                                  tables,
                                  context_lens,
                                  out,
                                  q_stride,
                                  out_stride,
                                  group,
                                  head_dim,
                                  num_pages * page_size * head_dim,
                                  page_size,
                                  table_width,
                                  scale,
                                  dot};
    return decode_attention_rows(&a, rows, kv_heads, bf16_scratch_floats(group, head_dim, page_size, max_context),
                                 num_threads, attend_task_bf16,
                                 scores == KVSEAL_SCORES_AMX ? amx_attention_begin : NULL, amx_attention_end);
}
