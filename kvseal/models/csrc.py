"""C sources of the native kernels (`models/native.py` compiles them into one library).

Plain C with GCC vector extensions, no torch headers: the library is built on the user's host
with `cc -O3 -march=native -fopenmp`, so the same source vectorizes for AVX2 or AVX-512.
Every function takes raw pointers and sizes; the Python wrappers in `models/native.py` check
dtypes, shapes and contiguity before calling.
"""

PRELUDE = r"""
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

typedef float v8 __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

static inline v8 load8(const float *p) { v8 r; memcpy(&r, p, sizeof r); return r; }
static inline void store8(float *p, v8 x) { memcpy(p, &x, sizeof x); }
static inline float hsum8(v8 x) { return ((x[0] + x[4]) + (x[1] + x[5])) + ((x[2] + x[6]) + (x[3] + x[7])); }

/* 16 lanes: one AVX-512 register (two AVX2 registers where the CPU has no AVX-512). */
typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

static inline v16 load16(const float *p) { v16 r; memcpy(&r, p, sizeof r); return r; }
static inline void store16(float *p, v16 x) { memcpy(p, &x, sizeof x); }
static inline v8 fold16(v16 x) {
    return __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7)
           + __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
}

/* bfloat16 <-> float32: bf16 is the top half of a float32. Narrowing rounds to nearest even
   and turns NaN into the quiet NaN 0x7FC0, as torch's conversion does (a plain rounding add
   could carry a NaN's payload into the exponent and make it infinite). */
typedef uint16_t v8u16 __attribute__((vector_size(16)));
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef uint16_t v16u16 __attribute__((vector_size(32)));
typedef uint32_t v16u __attribute__((vector_size(64)));

static inline float widen_bf16_1(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}
static inline uint16_t to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    return f != f ? 0x7FC0 : (uint16_t)((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}
static inline float round_bf16_1(float f) { return widen_bf16_1(to_bf16(f)); }
/* loadN_bf16: N bfloat16 as float32 lanes; roundN_bf16: lanes rounded to bfloat16, still
   float32; storeN_bf16: lanes rounded and stored as bfloat16. */
#define DEFINE_BF16_LANES(N)                                                                    \
static inline v##N load##N##_bf16(const uint16_t *p) {                                          \
    v##N##u16 raw;                                                                              \
    memcpy(&raw, p, sizeof raw);                                                                \
    return (v##N)(__builtin_convertvector(raw, v##N##i) << 16);                                 \
}                                                                                               \
static inline v##N round##N##_bf16(v##N x) {                                                    \
    const v##N##u bits = (v##N##u)x, nan = (v##N##u)(x != x);                                   \
    const v##N##u rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;               \
    return (v##N)((rounded & ~nan) | (nan & 0x7FC00000u));                                      \
}                                                                                               \
static inline void store##N##_bf16(uint16_t *p, v##N x) {                                       \
    const v##N##u16 out = __builtin_convertvector((v##N##u)round##N##_bf16(x) >> 16, v##N##u16); \
    memcpy(p, &out, sizeof out);                                                                \
}
DEFINE_BF16_LANES(8)
#if defined(__AVX512BF16__)
/* With AVX512-BF16 the 16-lane narrowing is one vcvtneps2bf16: round to nearest even, as
   above, in one instruction instead of seven. It differs from the portable form only where
   torch's conversion never reaches in practice: a NaN keeps its sign (and stays a NaN), and
   float32 values under bfloat16's normal range (|x| < 2^-126) become zero. */
static inline v16 load16_bf16(const uint16_t *p) {
    v16u16 raw;
    memcpy(&raw, p, sizeof raw);
    return (v16)(__builtin_convertvector(raw, v16i) << 16);
}
static inline v16 round16_bf16(v16 x) {
    const __m256i narrow = (__m256i)_mm512_cvtneps_pbh((__m512)x);
    return (v16)_mm512_slli_epi32(_mm512_cvtepu16_epi32(narrow), 16);
}
static inline void store16_bf16(uint16_t *p, v16 x) {
    const __m256i narrow = (__m256i)_mm512_cvtneps_pbh((__m512)x);
    memcpy(p, &narrow, sizeof narrow);
}
#else
DEFINE_BF16_LANES(16)
#endif
"""

ATTENTION = r"""
/* exp(x) for x <= 0 (scores minus their maximum): Cephes' expf polynomial, relative error
   ~1e-7; below -87 it returns ~1e-38 where the true value is smaller still (weight ~0).
   x * log2(e) - 0.5 truncated rounds to the nearest integer for x <= 0. */
#define EXP_POLY(r) ((((((1.9875691500e-4f * (r) + 1.3981999507e-3f) * (r) + 8.3334519073e-3f) * (r) \
    + 4.1665795894e-2f) * (r) + 1.6666665459e-1f) * (r) + 5.0000001201e-1f) * (r) * (r) + (r) + 1.0f)

static inline float exp_s(float x) {
    x = x < -87.0f ? -87.0f : x;
    const int32_t n = (int32_t)(x * 1.44269504f - 0.5f);
    const float r = x - (float)n * 0.693359375f + (float)n * 2.12194440e-4f;
    const int32_t bits = (n + 127) << 23;
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return EXP_POLY(r) * two_n;
}

/* exp_v (8 lanes) and exp_v16 (16 lanes): exp_s lane by lane. */
#define DEFINE_EXP(NAME, VF, VI)                                                                \
static inline VF NAME(VF x) {                                                                   \
    const VI low = x < -87.0f;  /* lanes: -1 where true */                                      \
    x = (VF)((low & (VI)((VF){0} - 87.0f)) | (~low & (VI)x));                                   \
    const VI n = __builtin_convertvector(x * 1.44269504f - 0.5f, VI);                           \
    const VF nf = __builtin_convertvector(n, VF);                                               \
    const VF r = x - nf * 0.693359375f + nf * 2.12194440e-4f;                                   \
    return EXP_POLY(r) * (VF)((n + 127) << 23);                                                 \
}
DEFINE_EXP(exp_v, v8, v8i)
DEFINE_EXP(exp_v16, v16, v16i)

/* VL float lanes: 16 where the build targets AVX-512 (one register), else 8 (one AVX2
   register); the softmaxes below run in vectors of VL. */
#if defined(__AVX512F__)
#define VL 16
typedef v16 vl;
typedef v16i vli;
#define load_vl load16
#define store_vl store16
#define exp_vl exp_v16
static inline float hsum_vl(vl x) { return hsum8(fold16(x)); }
#else
#define VL 8
typedef v8 vl;
typedef v8i vli;
#define load_vl load8
#define store_vl store8
#define exp_vl exp_v
static inline float hsum_vl(vl x) { return hsum8(x); }
#endif
static inline vl max_vl(vl a, vl b) {
    const vli greater = a > b;  /* lanes: -1 where true */
    return (vl)((greater & (vli)a) | (~greater & (vli)b));
}

/* Softmax in place over s[0..n-1]; returns nothing, s holds the probabilities. */
static void softmax(float *s, int64_t n) {
    float top = s[0], sum = 0.0f;
    int64_t t = 1;
    if (n >= VL) {  /* the maximum is exact in any order */
        vl m = load_vl(s);
        for (t = VL; t + VL <= n; t += VL) m = max_vl(load_vl(s + t), m);
        for (int i = 0; i < VL; i++) top = m[i] > top ? m[i] : top;
    }
    for (; t < n; t++) top = s[t] > top ? s[t] : top;
    t = 0;
    vl acc = {0};
    for (; t + VL <= n; t += VL) { vl e = exp_vl(load_vl(s + t) - top); store_vl(s + t, e); acc += e; }
    sum = hsum_vl(acc);
    for (; t < n; t++) { s[t] = exp_s(s[t] - top); sum += s[t]; }
    const float inv = 1.0f / sum;
    for (t = 0; t < n; t++) s[t] *= inv;
}

/* Pages are scattered through the pool, and the hardware prefetcher stops at each page's end:
   the kernels ask for the next page while they work on the current one. */
static inline void prefetch_page(const void *page, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch((const char *)page + i);
}

/* scale * hsum8 of a, b, c and d into out[0..3], each summed in hsum8's order (bit-equal to it). */
static inline void hsum8x4(v8 a, v8 b, v8 c, v8 d, float scale, float *out) {
    const v8 ab = __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11)
                  + __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15);  /* x0+x4 .. x3+x7 of a, of b */
    const v8 cd = __builtin_shufflevector(c, d, 0, 1, 2, 3, 8, 9, 10, 11)
                  + __builtin_shufflevector(c, d, 4, 5, 6, 7, 12, 13, 14, 15);
    const v8 x = __builtin_shufflevector(ab, cd, 0, 2, 8, 10, 4, 6, 12, 14)
                 + __builtin_shufflevector(ab, cd, 1, 3, 9, 11, 5, 7, 13, 15);  /* a a c c b b d d */
    out[0] = scale * (x[0] + x[1]); out[1] = scale * (x[4] + x[5]);
    out[2] = scale * (x[2] + x[3]); out[3] = scale * (x[6] + x[7]);
}

/* Scores of slots 0..n-1 of one K page for JB (<= 3) query heads q_j = q + j * hd, into
   scores[j * ctx + i]: four slots at a time for every head at once, so each K vector is loaded
   once for the JB heads and the 4 * JB accumulators are as many independent FMA chains (one
   head at a time, four chains eight FMAs deep waited on the FMA latency). Each score is summed
   in the order of one slot and one head at a time (then hsum8), so the result is the same. */
#define DEFINE_PAGE_SCORES(NV, JB)                                                              \
static inline void page_scores_##NV##_##JB(const float *q, const float *kp, int64_t n, float scale, \
                                           float *scores, int64_t ctx) {                        \
    const int64_t hd = 8 * NV;                                                                  \
    int64_t i = 0;                                                                              \
    for (; i + 4 <= n; i += 4) {                                                                \
        v8 acc[JB][4];                                                                          \
        for (int j = 0; j < JB; j++) for (int s = 0; s < 4; s++) acc[j][s] = (v8){0};           \
        const float *k0 = kp + i * hd;                                                          \
        for (int c = 0; c < NV; c++) {                                                          \
            const v8 k_0 = load8(k0 + 8 * c), k_1 = load8(k0 + hd + 8 * c);                     \
            const v8 k_2 = load8(k0 + 2 * hd + 8 * c), k_3 = load8(k0 + 3 * hd + 8 * c);        \
            for (int j = 0; j < JB; j++) {                                                      \
                const v8 qv = load8(q + j * hd + 8 * c);                                        \
                acc[j][0] += qv * k_0; acc[j][1] += qv * k_1;                                   \
                acc[j][2] += qv * k_2; acc[j][3] += qv * k_3;                                   \
            }                                                                                   \
        }                                                                                       \
        for (int j = 0; j < JB; j++)                                                            \
            hsum8x4(acc[j][0], acc[j][1], acc[j][2], acc[j][3], scale, scores + j * ctx + i);   \
    }                                                                                           \
    for (; i < n; i++)                                                                          \
        for (int j = 0; j < JB; j++) {                                                          \
            v8 a0 = {0};                                                                        \
            for (int c = 0; c < NV; c++) a0 += load8(q + j * hd + 8 * c) * load8(kp + i * hd + 8 * c); \
            scores[j * ctx + i] = scale * hsum8(a0);                                            \
        }                                                                                       \
}

/* One (row, KV head) with head_dim = 8 * NV: its `group` query heads attend to slots 0..ctx-1
   of the row's pages. scores: scratch of group * ctx floats; out holds each head's running PV
   sums between pages. Both passes go page by page with every query head over a page before
   the next page (a 4 KB page stays in L1 for the group: one head at a time read every V page
   from L2 once per head), each head's sums over the slots in order, as one head at a time
   would sum them. Pages are scattered and the hardware prefetcher stops at each page's end,
   so the kernels ask for the page after next as they go, and the last two K pages ask for the
   first two V pages. */
#define DEFINE_ATTEND(NV)                                                                       \
DEFINE_PAGE_SCORES(NV, 1)                                                                       \
DEFINE_PAGE_SCORES(NV, 2)                                                                       \
DEFINE_PAGE_SCORES(NV, 3)                                                                       \
static void attend_##NV(const float *q, const float *k_head, const float *v_head,               \
                        const int64_t *table, int64_t ctx, int64_t group, int64_t page_size,    \
                        float scale, float *scores, float *out) {                               \
    const int64_t hd = 8 * NV, page_floats = page_size * hd, page_bytes = page_floats * (int64_t)sizeof(float); \
    const int64_t pages = (ctx + page_size - 1) / page_size;                                    \
    for (int64_t p = 0; p < pages; p++) {                                                       \
        const int64_t t0 = p * page_size, n = ctx - t0 < page_size ? ctx - t0 : page_size;      \
        if (p == 0 && pages > 1) prefetch_page(k_head + table[1] * page_floats, page_bytes);    \
        if (p + 2 < pages) prefetch_page(k_head + table[p + 2] * page_floats, page_bytes);      \
        else if (p + 2 - pages < pages) prefetch_page(v_head + table[p + 2 - pages] * page_floats, page_bytes); \
        const float *kp = k_head + table[p] * page_floats;                                      \
        for (int64_t j0 = 0; j0 < group; j0 += 3) {                                             \
            const float *qj = q + j0 * hd;                                                      \
            float *sj = scores + j0 * ctx + t0;                                                 \
            if (group - j0 >= 3) page_scores_##NV##_3(qj, kp, n, scale, sj, ctx);               \
            else if (group - j0 == 2) page_scores_##NV##_2(qj, kp, n, scale, sj, ctx);          \
            else page_scores_##NV##_1(qj, kp, n, scale, sj, ctx);                               \
        }                                                                                       \
    }                                                                                           \
    for (int64_t j = 0; j < group; j++) softmax(scores + j * ctx, ctx);                         \
    for (int64_t j = 0; j < group * hd; j += 8) store8(out + j, (v8){0});                       \
    for (int64_t p = 0; p < pages; p++) {                                                       \
        const int64_t t0 = p * page_size, n = ctx - t0 < page_size ? ctx - t0 : page_size;      \
        if (p + 2 < pages) prefetch_page(v_head + table[p + 2] * page_floats, page_bytes);      \
        const float *vp = v_head + table[p] * page_floats;                                      \
        for (int64_t j = 0; j < group; j++) {                                                   \
            v8 o[NV];                                                                           \
            for (int c = 0; c < NV; c++) o[c] = load8(out + j * hd + 8 * c);                    \
            const float *sj = scores + j * ctx + t0;                                            \
            for (int64_t i = 0; i < n; i++) {                                                   \
                const float w = sj[i];                                                          \
                for (int c = 0; c < NV; c++) o[c] += w * load8(vp + i * hd + 8 * c);            \
            }                                                                                   \
            for (int c = 0; c < NV; c++) store8(out + j * hd + 8 * c, o[c]);                    \
        }                                                                                       \
    }                                                                                           \
}
DEFINE_ATTEND(4)
DEFINE_ATTEND(8)
DEFINE_ATTEND(16)

/* Any head_dim: plain loops. */
static void attend_any(const float *q, const float *k_head, const float *v_head, const int64_t *table,
                       int64_t ctx, int64_t group, int64_t hd, int64_t page_size, float scale,
                       float *scores, float *out) {
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
    int dot_scores;  /* bfloat16 pool: scores by AVX512-BF16 dot products where the build has them */
};
/* amx: whether the thread has AMX tiles configured for the task (see `begin`). */
typedef void (*attend_task)(const struct decode_args *a, int64_t b, int64_t h, float *scratch, int amx);

/* Every (row, KV head) of the call, split over the threads, each with `scratch_floats` of
   scratch. Each thread calls begin() (unless NULL) before its tasks, passing what it returns to
   them, and end() after them if begin returned nonzero. Returns 0, or -1 if scratch could not
   be allocated. */
static int decode_attention_rows(const struct decode_args *a, int64_t rows, int64_t kv_heads,
                                 int64_t scratch_floats, int num_threads, attend_task task,
                                 int (*begin)(void), void (*end)(void)) {
    int failed = 0;
    #pragma omp parallel num_threads(num_threads) reduction(|:failed)
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

/* q, out: [rows, kv_heads * group, head_dim]; k, v: [kv_heads, num_pages, page_size, head_dim];
   tables: [rows, table_width] page ids; context_lens: [rows], each >= 1 and covered by its table.
   Returns 0, or -1 if scratch memory could not be allocated. */
int kvseal_decode_attention(const float *q, const float *k, const float *v, const int64_t *tables,
                            const int64_t *context_lens, float *out, int64_t rows, int64_t kv_heads,
                            int64_t group, int64_t head_dim, int64_t num_pages, int64_t page_size,
                            int64_t table_width, int64_t max_context, float scale, int num_threads) {
    const int64_t width = kv_heads * group * head_dim;
    const struct decode_args a = {q, k, v, tables, context_lens, out, width, width, group, head_dim,
                                  num_pages * page_size * head_dim, page_size, table_width, scale};
    return decode_attention_rows(&a, rows, kv_heads, group * max_context, num_threads, attend_task_f32, NULL, NULL);
}
"""

# Decode attention over a bfloat16 pool. The float32 kernels above read K and V from the pool in
# place; bfloat16 rows must be widened first, and widening a row once per query head (a
# group of three to seven) costs more than the arithmetic. So each V row is widened once, in
# registers, and multiplied into the sums of several query heads at a time; the scores come
# from AVX512-BF16 dot products (or AMX tiles) over K in place, or where the CPU has neither,
# from a K page widened once into a float32 page in L1, four slots' sums reduced together.
ATTENTION_BF16 = r"""
/* out[0..3] = scale * (the sums of a, b, c, d's lanes) */
static inline void sums4(v8 a, v8 b, v8 c, v8 d, float scale, float *out) {
    const v8 ab = __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11)
                  + __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15);  /* a's 4 partial sums, b's 4 */
    const v8 cd = __builtin_shufflevector(c, d, 0, 1, 2, 3, 8, 9, 10, 11)
                  + __builtin_shufflevector(c, d, 4, 5, 6, 7, 12, 13, 14, 15);
    const v8 x = __builtin_shufflevector(ab, cd, 0, 1, 8, 9, 4, 5, 12, 13)
                 + __builtin_shufflevector(ab, cd, 2, 3, 10, 11, 6, 7, 14, 15);  /* a a c c b b d d */
    out[0] = scale * (x[0] + x[1]); out[1] = scale * (x[4] + x[5]);
    out[2] = scale * (x[2] + x[3]); out[3] = scale * (x[6] + x[7]);
}
static void widen_rows(const uint16_t *src, float *dst, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) store8(dst + i, load8_bf16(src + i));
    for (; i < n; i++) dst[i] = widen_bf16_1(src[i]);
}

#if defined(__AVX512BF16__)
static inline __m512 pair_sum(__m512 a, __m512 b, __m512i lo, __m512i hi) {
    return _mm512_add_ps(_mm512_permutex2var_ps(a, lo, b), _mm512_permutex2var_ps(a, hi, b));
}

/* Lane s of the result = the sum of acc[s]'s 16 lanes: four rounds, each pairing vectors and
   halving the partial sums each one holds. */
static inline __m512 sum_lanes16(const __m512 *acc) {
    const __m512i l1 = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
    const __m512i h1 = _mm512_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    const __m512i l2 = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
    const __m512i h2 = _mm512_setr_epi32(4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    const __m512i l3 = _mm512_setr_epi32(0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29);
    const __m512i h3 = _mm512_setr_epi32(2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    const __m512i l4 = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i h4 = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    __m512 r1[8], r2[4], r3[2];
    for (int i = 0; i < 8; i++) r1[i] = pair_sum(acc[2 * i], acc[2 * i + 1], l1, h1);
    for (int i = 0; i < 4; i++) r2[i] = pair_sum(r1[2 * i], r1[2 * i + 1], l2, h2);
    for (int i = 0; i < 2; i++) r3[i] = pair_sum(r2[2 * i], r2[2 * i + 1], l3, h3);
    return pair_sum(r3[0], r3[1], l4, h4);
}

/* scores[s] = scale * (K page row s . q) for the page's first n <= 16 slots, both read as
   bfloat16 in place (VDPBF16PS: exact products, float32 sums); slots n.. are not read. */
static inline __attribute__((always_inline)) void dot_page_scores(const uint16_t *k_page, int64_t n,
                                                                  const uint16_t *q, int64_t hd, float scale,
                                                                  float *scores) {
    __m512 acc[16];
    for (int s = 0; s < 16; s++) acc[s] = _mm512_setzero_ps();
    if (n == 16) {  /* a whole page: every trip count is a constant */
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
    (void)k_page; (void)n; (void)q; (void)hd; (void)scale; (void)scores;
}
#endif

/* 32 bfloat16 at p -> two 16-lane float32 vectors, widened exactly. With AVX-512 one load and
   two interleaves (each dword takes a bfloat16 as its high half), the lanes in the interleaves'
   order: w[0] holds elements 0-3, 8-11, 16-19, 24-27 and w[1] the others. Sums over such
   vectors are lane-wise, so store32_widened puts the elements back in order at the end. */
#if defined(__AVX512BW__)
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
static inline void widen32_bf16(const uint16_t *p, v16 *w) { w[0] = load16_bf16(p); w[1] = load16_bf16(p + 16); }
static inline void store32_widened(float *out, const v16 *w) { store16(out, w[0]); store16(out + 16, w[1]); }
#endif

/* out [G, head_dim] float32 = the G query heads' softmaxed scores (head j's at scores + j *
   lds) times V, head_dim = 16 * NV, over the pages of `table` up to ctx. Each V row is widened
   from bfloat16 in registers once and multiplied into all G heads' sums, each sum accumulated
   slot by slot in context order (so the result is the same as one head at a time). The next
   page is prefetched while this one is read. */
#define DEFINE_VALUES_BF16(NV, G)                                                               \
static inline void values_bf16_##NV##_##G(const uint16_t *v_head, const int64_t *table, int64_t ctx, \
                                          int64_t page_size, const float *scores, int64_t lds,  \
                                          float *out) {                                          \
    const int64_t hd = 16 * NV, elems = page_size * hd;                                          \
    v16 o[G][NV];                                                                               \
    for (int j = 0; j < G; j++)                                                                 \
        for (int c = 0; c < NV; c++) o[j][c] = (v16){0};                                         \
    for (int64_t t0 = 0; t0 < ctx; t0 += page_size) {                                           \
        const int64_t n = ctx - t0 < page_size ? ctx - t0 : page_size, p = t0 / page_size;      \
        if (t0 + page_size < ctx) prefetch_page(v_head + table[p + 1] * elems, 2 * elems);      \
        const uint16_t *vp = v_head + table[p] * elems;                                         \
        for (int64_t i = 0; i < n; i++) {                                                       \
            v16 v[NV];                                                                          \
            for (int c = 0; c < NV; c += 2) widen32_bf16(vp + i * hd + 16 * c, v + c);          \
            for (int j = 0; j < G; j++) {                                                       \
                const float s = scores[j * lds + t0 + i];                                       \
                for (int c = 0; c < NV; c++) o[j][c] += s * v[c];                                \
            }                                                                                   \
        }                                                                                       \
    }                                                                                           \
    for (int j = 0; j < G; j++)                                                                 \
        for (int c = 0; c < NV; c += 2) store32_widened(out + j * hd + 16 * c, o[j] + c);       \
}
/* Query heads a values pass takes at once: their sums and one V row stay in registers (32
   AVX-512 registers; 16 AVX2 registers hold half as many 16-lane vectors). */
#if defined(__AVX512F__)
#define VALUES_HEADS(NV) ((NV) <= 4 ? 4 : 2)
#else
#define VALUES_HEADS(NV) ((NV) <= 2 ? 2 : 1)
#endif
#define DEFINE_VALUES_BF16_ALL(NV) \
    DEFINE_VALUES_BF16(NV, 1) DEFINE_VALUES_BF16(NV, 2) DEFINE_VALUES_BF16(NV, 3) DEFINE_VALUES_BF16(NV, 4)
DEFINE_VALUES_BF16_ALL(2)
DEFINE_VALUES_BF16_ALL(4)
DEFINE_VALUES_BF16_ALL(8)

/* One (row, KV head) with head_dim = 16 * NV: q [group, head_dim] float32; page: scratch of
   page_size * head_dim floats; scores: group * ctx floats; out [group, head_dim] float32. Two
   passes, as the float32 kernel: scores over every page, softmax, then the weighted sum of V
   (values_bf16, VALUES_HEADS query heads at a time). While a page's scores are computed, the
   next K page is prefetched, and this V page into L2 for the second pass. The scores come from
   AMX tiles (q_tiles), AVX512-BF16 dot products over the bfloat16 q and K in place (q_dot), or
   else K widened a page at a time. */
#define DEFINE_ATTEND_BF16(NV)                                                                  \
static void attend_bf16_##NV(const float *q, const uint16_t *k_head, const uint16_t *v_head,    \
                             const int64_t *table, int64_t ctx, int64_t group, int64_t page_size, \
                             float scale, float *page, float *scores, float *out,               \
                             const uint16_t *q_tiles, const uint16_t *q_dot) {                  \
    const int64_t hd = 16 * NV, elems = page_size * hd;                                          \
    for (int64_t t0 = 0; t0 < ctx; t0 += page_size) {                                           \
        const int64_t n = ctx - t0 < page_size ? ctx - t0 : page_size, p = t0 / page_size;      \
        if (t0 + page_size < ctx) prefetch_page(k_head + table[p + 1] * elems, 2 * elems);      \
        for (int64_t i = 0; i < 2 * n * hd; i += 64)                                            \
            __builtin_prefetch((const char *)(v_head + table[p] * elems) + i, 0, 2);            \
        if (q_tiles != NULL) {                                                                  \
            amx_page_scores(k_head + table[p] * elems, n, q_tiles, hd, group, scale, scores + t0, ctx, \
                            (uint16_t *)page);                                                  \
            continue;                                                                           \
        }                                                                                       \
        if (q_dot != NULL) {                                                                    \
            for (int64_t j = 0; j < group; j++)                                                 \
                dot_page_scores(k_head + table[p] * elems, n, q_dot + j * hd, hd, scale,        \
                                scores + j * ctx + t0);                                         \
            continue;                                                                           \
        }                                                                                       \
        widen_rows(k_head + table[p] * elems, page, n * hd);                                    \
        for (int64_t j = 0; j < group; j++) {                                                   \
            const float *qj = q + j * hd;                                                       \
            float *sj = scores + j * ctx + t0;                                                  \
            int64_t i = 0;                                                                      \
            for (; i + 4 <= n; i += 4) {                                                        \
                v16 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};                                     \
                const float *k0 = page + i * hd;                                                \
                for (int c = 0; c < NV; c++) {                                                  \
                    const v16 qv = load16(qj + 16 * c);                                         \
                    a0 += qv * load16(k0 + 16 * c);                                             \
                    a1 += qv * load16(k0 + hd + 16 * c);                                        \
                    a2 += qv * load16(k0 + 2 * hd + 16 * c);                                    \
                    a3 += qv * load16(k0 + 3 * hd + 16 * c);                                    \
                }                                                                               \
                sums4(fold16(a0), fold16(a1), fold16(a2), fold16(a3), scale, sj + i);           \
            }                                                                                   \
            for (; i < n; i++) {                                                                \
                v16 a0 = {0};                                                                   \
                for (int c = 0; c < NV; c++) a0 += load16(qj + 16 * c) * load16(page + i * hd + 16 * c); \
                sj[i] = scale * hsum8(fold16(a0));                                              \
            }                                                                                   \
        }                                                                                       \
    }                                                                                           \
    for (int64_t j = 0; j < group; j++) softmax(scores + j * ctx, ctx);                         \
    const int64_t block = VALUES_HEADS(NV);                                                     \
    for (int64_t j0 = 0; j0 < group; j0 += block) {                                             \
        const float *p = scores + j0 * ctx;                                                     \
        float *o = out + j0 * hd;                                                               \
        switch (group - j0 < block ? group - j0 : block) {                                      \
            case 1: values_bf16_##NV##_1(v_head, table, ctx, page_size, p, ctx, o); break;      \
            case 2: values_bf16_##NV##_2(v_head, table, ctx, page_size, p, ctx, o); break;      \
            case 3: values_bf16_##NV##_3(v_head, table, ctx, page_size, p, ctx, o); break;      \
            default: values_bf16_##NV##_4(v_head, table, ctx, page_size, p, ctx, o); break;     \
        }                                                                                       \
    }                                                                                           \
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
    uint16_t *q_tiles = NULL;  /* AMX scores: the query heads as B tiles, after the page scratch */
    if (amx && a->group <= 16 && bf16_paged(hd) && ps <= 16) {
        q_tiles = (uint16_t *)(rest + 16 * hd);
        pack_query_tiles(qh, a->group, hd, q_tiles);
    }
    const uint16_t *q_dot = q_tiles == NULL && a->dot_scores && bf16_paged(hd) && ps <= 16 ? qh : NULL;
    widen_rows(qh, qf, n);
    if (hd == 32) attend_bf16_2(qf, kh, vh, table, ctx, a->group, ps, a->scale, rest, scores, of, q_tiles, q_dot);
    else if (hd == 64) attend_bf16_4(qf, kh, vh, table, ctx, a->group, ps, a->scale, rest, scores, of, q_tiles, q_dot);
    else if (hd == 128) attend_bf16_8(qf, kh, vh, table, ctx, a->group, ps, a->scale, rest, scores, of, q_tiles, q_dot);
    else {  /* !bf16_paged: the row's context, slot by slot, into [2, ctx, head_dim] floats, one "page" of ctx slots */
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

/* The same over a bfloat16 pool, with bfloat16 query rows read in place (row b at q + b *
   q_stride: the q columns of the fused qkv rows) and bfloat16 output rows (out + b * out_stride),
   each output rounded once from its float32 sum. scores: where the scores are computed:
   SCORES_AMX on AMX tiles where the process may use them, else as SCORES_DOT; SCORES_DOT by
   AVX512-BF16 dot products where the build has them, else as SCORES_WIDENED; SCORES_WIDENED in
   16-lane float32 vectors over K widened a page at a time (what a CPU without either runs). */
#define SCORES_WIDENED 0
#define SCORES_DOT 1
#define SCORES_AMX 2
int kvseal_decode_attention_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k, const uint16_t *v,
                                 const int64_t *tables, const int64_t *context_lens, uint16_t *out,
                                 int64_t out_stride, int64_t rows, int64_t kv_heads, int64_t group,
                                 int64_t head_dim, int64_t num_pages, int64_t page_size, int64_t table_width,
                                 int64_t max_context, float scale, int scores, int num_threads) {
#if defined(__AVX512BF16__)
    const int dot = scores >= SCORES_DOT;
#else
    const int dot = 0;
#endif
    const struct decode_args a = {q, k, v, tables, context_lens, out, q_stride, out_stride, group, head_dim,
                                  num_pages * page_size * head_dim, page_size, table_width, scale, dot};
    return decode_attention_rows(&a, rows, kv_heads, bf16_scratch_floats(group, head_dim, page_size, max_context),
                                 num_threads, attend_task_bf16, scores == SCORES_AMX ? amx_attention_begin : NULL,
                                 amx_attention_end);
}
"""

# y = x W^T (+ bias) with float32 arithmetic, W held in column panels: for each block of 16
# output features, a [K][16] slab (the 16 features' weights for k = 0..K-1 side by side, the
# last panel zero-padded). One slab row is two 8-lane vectors, so the kernel broadcasts one x
# value and multiplies it into 16 outputs at once: MR x 16 accumulators in registers, no
# horizontal sums, the slab read in order. Two weight types: float32 panels (`_f32`) and
# bfloat16 panels (`_bf16`: half the bytes to stream). A single row (decode at batch 1, which
# streams every weight once) reads the panels as they are; several rows widen each bfloat16
# slab once into a float32 buffer and run the float32 kernels on it, so the conversion is paid
# once per slab, not once per row block. The row-1 kernel, the entry point and the packing are
# generated for both types from one template.
_LINEAR_TEMPLATE = r"""
/* One row (single-stream decode): four independent chains over k hide the FMA latency. */
static void panel_row_SFX(const float *x, const WTYPE *slab, int64_t k_in, float *y, int64_t nr,
                          const float *bias) {
    v8 a[8];
    for (int i = 0; i < 8; i++) a[i] = (v8){0};
    int64_t k = 0;
    for (; k + 4 <= k_in; k += 4)
        for (int u = 0; u < 4; u++) {
            const float s = x[k + u];
            a[2 * u] += s * LOADW(slab + (k + u) * 16);
            a[2 * u + 1] += s * LOADW(slab + (k + u) * 16 + 8);
        }
    for (; k < k_in; k++) {
        const float s = x[k];
        a[0] += s * LOADW(slab + k * 16); a[1] += s * LOADW(slab + k * 16 + 8);
    }
    const v8 r0 = (a[0] + a[2]) + (a[4] + a[6]), r1 = (a[1] + a[3]) + (a[5] + a[7]);
    store_block(y, 0, &r0, &r1, 1, nr, bias);
}

/* y [M, N] = x [M, K] . W^T (+ bias [N] unless NULL); W as panels (kvseal_pack_panels_SFX). Rows
   go in blocks of 96 (a block of x stays in L2 while every panel passes over it); panels are
   handed to the threads in runs of `chunk` consecutive panels (about 16 runs per block on two
   threads) from a shared counter as they come free: on a host whose cores are shared with
   the frontend, a thread that is preempted does not hold the others at the end of the block
   with a static share still to do, and each thread still streams the weights in long
   sequential runs. A thread claims its next run before computing a run's last panel, so
   panel_rows always prefetches the slab the thread really computes next (with
   `schedule(dynamic, 2)` it prefetched p + 1, the other thread's panel half the time).
   Against `dynamic, 2`, in one process, alternating (`bench/linears_ab.py`): 0.90-0.95x the
   time at 2-256 rows. The sums are the same whichever thread computes a panel. Returns -1 if
   a thread's widening buffer could not be allocated (nothing is computed then), else 0. */
int kvseal_linear_SFX(const float *x, const WTYPE *panels, const float *bias, float *y,
                      int64_t rows, int64_t n_out, int64_t k_in, int num_threads) {
    const int64_t count = (n_out + 15) / 16;
    if (rows == 1) {
        #pragma omp parallel for num_threads(num_threads) schedule(static)
        for (int64_t p = 0; p < count; p++) {
            const int64_t nr = n_out - p * 16 < 16 ? n_out - p * 16 : 16;
            panel_row_SFX(x, panels + p * k_in * 16, k_in, y + p * 16, nr, bias == NULL ? NULL : bias + p * 16);
        }
        return 0;
    }
    const int64_t chunk = count / (8 * num_threads) > 1 ? count / (8 * num_threads) : 1;
    int failed = 0;
    for (int64_t m0 = 0; m0 < rows && !failed; m0 += 96) {
        const int64_t m_end = m0 + 96 < rows ? m0 + 96 : rows;
        int64_t handed_out = 0;  /* panels claimed so far, `chunk` at a time */
        #pragma omp parallel num_threads(num_threads) reduction(|:failed)
        {
            float *buffer = WIDENS ? malloc(sizeof(float) * 16 * k_in) : NULL;
            if (WIDENS && buffer == NULL) failed = 1;
            int64_t p = WIDENS && buffer == NULL ? count : __atomic_fetch_add(&handed_out, chunk, __ATOMIC_RELAXED);
            int64_t end = p + chunk < count ? p + chunk : count;
            while (p < count) {
                const int last = p + 1 >= end;
                const int64_t next = last ? __atomic_fetch_add(&handed_out, chunk, __ATOMIC_RELAXED) : p + 1;
                const float *slab = WIDEN(panels + p * k_in * 16, buffer, 16 * k_in);
                panel_rows(x, slab, bias, y, m0, m_end, p, n_out, k_in,
                           next < count ? panels + next * k_in * 16 : NULL, 16 * (int64_t)sizeof(WTYPE));
                if (last) end = next + chunk < count ? next + chunk : count;
                p = next;
            }
            free(buffer);
        }
    }
    return failed ? -1 : 0;
}

/* w: [N, K] float32 row-major (nn.Linear's layout) -> panels [ceil(N / 16)][K][16] of WTYPE,
   zero-padded (CONVERT: the float32 -> WTYPE conversion). */
void kvseal_pack_panels_SFX(const float *w, WTYPE *panels, int64_t n_out, int64_t k_in) {
    const int64_t count = (n_out + 15) / 16;
    #pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < count; p++)
        for (int64_t k = 0; k < k_in; k++)
            for (int64_t j = 0; j < 16; j++) {
                const int64_t n = p * 16 + j;
                panels[(p * k_in + k) * 16 + j] = CONVERT(n < n_out ? w[n * k_in + k] : 0.0f);
            }
}
"""

LINEAR = r"""

/* Store MR rows of a 16-wide result block (nr <= 16 valid columns), adding the bias if any. */
static inline void store_block(float *y, int64_t ldy, const v8 *a0, const v8 *a1, int mr, int64_t nr,
                               const float *bias) {
    v8 b0 = {0}, b1 = {0};
    if (bias != NULL) {
        float bb[16] = {0};
        memcpy(bb, bias, sizeof(float) * nr);
        b0 = load8(bb); b1 = load8(bb + 8);
    }
    for (int i = 0; i < mr; i++) {
        if (nr == 16) { store8(y + i * ldy, a0[i] + b0); store8(y + i * ldy + 8, a1[i] + b1); }
        else {
            float t[16];
            store8(t, a0[i] + b0); store8(t + 8, a1[i] + b1);
            memcpy(y + i * ldy, t, sizeof(float) * nr);
        }
    }
}

static inline float identity_f32(float f) { return f; }
static inline const float *widen_f32(const float *slab, float *buffer, int64_t n) {
    (void)buffer; (void)n;
    return slab;
}
static inline const float *widen_bf16(const uint16_t *slab, float *buffer, int64_t n) {
    for (int64_t i = 0; i < n; i += 8) store8(buffer + i, load8_bf16(slab + i));
    return buffer;
}

/* MR rows of x against one float32 slab: 2 * MR accumulators, one broadcast per (row, k). Each k
   step also prefetches the line at `pf + k * pf_step` (see panel_rows). */
#define DEFINE_PANEL_KERNEL(MR)                                                                 \
static void panel_##MR(const float *x, int64_t ldx, const float *slab, int64_t k_in,           \
                       float *y, int64_t ldy, int64_t nr, const float *bias, const char *pf,    \
                       int64_t pf_step) {                                                       \
    v8 a0[MR], a1[MR];                                                                          \
    for (int i = 0; i < MR; i++) { a0[i] = (v8){0}; a1[i] = (v8){0}; }                          \
    for (int64_t k = 0; k < k_in; k++) {                                                        \
        __builtin_prefetch(pf + k * pf_step);                                                   \
        const v8 w0 = load8(slab + k * 16), w1 = load8(slab + k * 16 + 8);                      \
        for (int i = 0; i < MR; i++) { const float s = x[i * ldx + k]; a0[i] += s * w0; a1[i] += s * w1; } \
    }                                                                                           \
    store_block(y, ldy, a0, a1, MR, nr, bias);                                                  \
}
DEFINE_PANEL_KERNEL(1)
DEFINE_PANEL_KERNEL(2)
DEFINE_PANEL_KERNEL(3)
DEFINE_PANEL_KERNEL(4)
DEFINE_PANEL_KERNEL(5)
DEFINE_PANEL_KERNEL(6)

/* Rows m0..m_end-1 of x (row stride k_in) against the float32 slab of panel p; y has row stride
   n_out. Up to 6 rows are one pass over the slab; more rows are several passes of nearly equal
   size. The hardware prefetcher alone does not keep the memory stream busy while a pass
   computes (measured: 6 to 32 rows ran 5-14% slower without software prefetch), so the first
   pass prefetches its own slab PREFETCH_AHEAD lines ahead, and every later pass, which reads
   the slab from cache, prefetches `next` (the slab this thread takes next, next_step bytes per
   k; NULL if none). With two passes (7-12 rows) the second one asks for only the first half
   of a float32 `next`: one pass over the slab is too short for memory to bring a whole slab,
   and a core that asks for more than its miss buffers hold waits on them instead of
   computing; the next slab's first pass fetches the rest ahead of itself. Measured at 8 and
   12 rows: 0.91x and 0.93x the time of a whole slab (a quarter: 0.97x, 1.01x; none: 1.02x,
   1.08x; three quarters: 0.92x, 0.94x). With three or more passes (13 rows and up) the later
   passes split `next` between them, in order, each asking for its share (1 / (passes - 1)):
   when each one asked for the whole of it, the second pass stalled on the miss buffers as
   above and the rest found it already in flight. Measured against that (`bench/linears_ab.py`,
   alternating, medians of 12-16 pairs): 0.88-0.92x the time at 16 rows, 0.84-0.96x at 32,
   0.92x at 48, 0.95x at 96 and 0.94x at 256, while 8 rows (unchanged) read 0.96-1.00x. */
#define PREFETCH_AHEAD 32
static void panel_rows(const float *x, const float *slab, const float *bias, float *y, int64_t m0, int64_t m_end,
                       int64_t p, int64_t n_out, int64_t k_in, const void *next, int64_t next_step) {
    const int64_t nr = n_out - p * 16 < 16 ? n_out - p * 16 : 16;
    const float *pb = bias == NULL ? NULL : bias + p * 16;
    float *yp = y + p * 16;
    const char *pf = (const char *)slab + PREFETCH_AHEAD * 64;
    int64_t pf_step = 64;
    const int64_t rows = m_end - m0, passes = (rows + 5) / 6;
    const int half_of_f32 = passes == 2 && next_step == 16 * (int64_t)sizeof(float);
    const int64_t later_step = half_of_f32 ? next_step / 2
                             : passes > 2 ? (next_step + passes - 2) / (passes - 1) : next_step;
    const int64_t share = passes > 2 ? later_step * k_in : 0;  /* bytes of `next` per later pass */
    int64_t m = m0;
    for (int64_t i = 0; i < passes; i++) {
        const int64_t mr = (m_end - m + passes - i - 1) / (passes - i);  /* ceil(rows left / passes left) */
        const float *xm = x + m * k_in;
        float *ym = yp + m * n_out;
        switch (mr) {
            case 1: panel_1(xm, k_in, slab, k_in, ym, n_out, nr, pb, pf, pf_step); break;
            case 2: panel_2(xm, k_in, slab, k_in, ym, n_out, nr, pb, pf, pf_step); break;
            case 3: panel_3(xm, k_in, slab, k_in, ym, n_out, nr, pb, pf, pf_step); break;
            case 4: panel_4(xm, k_in, slab, k_in, ym, n_out, nr, pb, pf, pf_step); break;
            case 5: panel_5(xm, k_in, slab, k_in, ym, n_out, nr, pb, pf, pf_step); break;
            default: panel_6(xm, k_in, slab, k_in, ym, n_out, nr, pb, pf, pf_step); break;
        }
        m += mr;
        if (next != NULL) { pf = (const char *)next + i * share; pf_step = later_step; }
    }
}
""" + "".join(
    _LINEAR_TEMPLATE.replace("SFX", suffix).replace("WTYPE", wtype).replace("LOADW", load)
    .replace("CONVERT", convert).replace("WIDENS", widens).replace("WIDEN", "widen_" + suffix)
    for suffix, wtype, load, convert, widens in (("f32", "float", "load8", "identity_f32", "0"),
                                                 ("bf16", "uint16_t", "load8_bf16", "to_bf16", "1")))

# The small per-layer ops of the float32 forward, fused so that each is one pass and one call:
# residual add + RMSNorm, SiLU(gate) * up, and rotate-half RoPE in place on the q and k heads.
OPS = r"""
/* h [rows, dim] += delta (unless NULL); out = h / sqrt(mean(h^2) + eps) * weight.
   The sum of squares runs in float32, as torch's rms_norm does for float32 input. */
void kvseal_add_rms_norm(float *h, const float *delta, const float *weight, float eps, float *out,
                         int64_t rows, int64_t dim, int num_threads) {
    #pragma omp parallel for num_threads(rows >= 64 ? num_threads : 1) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        float *hr = h + r * dim, *o = out + r * dim;
        const float *dr = delta == NULL ? NULL : delta + r * dim;
        v8 acc = {0};
        int64_t i = 0;
        for (; i + 8 <= dim; i += 8) {
            v8 x = load8(hr + i);
            if (dr != NULL) { x += load8(dr + i); store8(hr + i, x); }
            acc += x * x;
        }
        float sum = hsum8(acc);
        for (; i < dim; i++) {
            if (dr != NULL) hr[i] += dr[i];
            sum += hr[i] * hr[i];
        }
        const float rstd = 1.0f / sqrtf(sum / (float)dim + eps);
        for (i = 0; i + 8 <= dim; i += 8) store8(o + i, load8(hr + i) * rstd * load8(weight + i));
        for (; i < dim; i++) o[i] = hr[i] * rstd * weight[i];
    }
}

/* Row-wise argmax of x [rows, n] into out [rows], torch.argmax's answer: the first index of
   the largest value, or of the first NaN if the row has one. Eight lanes each keep the first
   index of their own largest value (a strict >), then the lanes holding the row's largest
   value give the smallest index. torch's CPU argmax walks a [32, 49,152] logits block (a
   32-row decode step's greedy choice) one element at a time: 1.8 ms, against 0.16 ms here. */
#define DEFINE_ARGMAX(NAME, T, LOAD8, AT)                                                       \
static int64_t NAME(const T *x, int64_t n) {                                                    \
    int64_t best = 0, i = 1;                                                                    \
    if (n >= 8) {                                                                               \
        v8 bv = LOAD8(x);                                                                       \
        v8i bi = {0, 1, 2, 3, 4, 5, 6, 7}, idx = bi, nan = (v8i)(bv != bv);                     \
        for (i = 8; i + 8 <= n; i += 8) {                                                       \
            const v8 v = LOAD8(x + i);                                                          \
            idx += 8;                                                                           \
            const v8i gt = (v8i)(v > bv);                                                       \
            nan |= (v8i)(v != v);                                                               \
            bv = (v8)(((v8i)v & gt) | ((v8i)bv & ~gt));                                         \
            bi = (idx & gt) | (bi & ~gt);                                                       \
        }                                                                                       \
        int any_nan = 0;                                                                        \
        for (int j = 0; j < 8; j++) any_nan |= nan[j] != 0;                                     \
        if (any_nan)  /* the first NaN is in the part the lanes covered */                      \
            for (int64_t t = 0; t < i; t++) if (AT(x, t) != AT(x, t)) return t;                 \
        float top = bv[0];  /* no NaN in the lanes: every comparison is ordered */              \
        for (int j = 1; j < 8; j++) top = bv[j] > top ? bv[j] : top;                            \
        best = i;                                                                               \
        for (int j = 0; j < 8; j++) if (bv[j] == top && bi[j] < best) best = bi[j];             \
    } else if (AT(x, 0) != AT(x, 0)) {                                                          \
        return 0;                                                                               \
    }                                                                                           \
    for (; i < n; i++) {                                                                        \
        if (AT(x, i) != AT(x, i)) return i;                                                     \
        if (AT(x, i) > AT(x, best)) best = i;                                                   \
    }                                                                                           \
    return best;                                                                                \
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

/* 1 / d for 16 lanes: with AVX-512, vrcp14ps and one Newton step (~2^-23 relative, a quarter
   of a division's cost); elsewhere a division. */
static inline v16 recip16(v16 d) {
#if defined(__AVX512F__)
    const v16 r = (v16)_mm512_rcp14_ps((__m512)d);
    return r * (2.0f - d * r);
#else
    return 1.0f / d;
#endif
}
#define DIVIDE(a, b) ((a) / (b))
#define TIMES_RECIP16(a, b) ((a) * recip16(b))

/* silu(x) * u, silu(x) = x * sigmoid(x) with sigmoid from exp(-|x|) (never overflows). The
   float32 ops divide (8 lanes); the bfloat16 ops (16 lanes) take recip16, whose last-bit
   differences vanish in the rounding to bfloat16 but for a few ulp-boundary cases. */
#define DEFINE_SILU_MUL(NAME, VF, VI, EXP, QUOTIENT)                                            \
static inline VF NAME(VF x, VF u) {                                                             \
    const VI negative = x < 0.0f;                                                               \
    const VF t = EXP((VF)((VI)x | ((VI){0} + INT32_MIN)));  /* exp(-|x|): sign bit set */       \
    const VF one = (VF){0} + 1.0f;                                                              \
    const VF numer = (VF)((negative & (VI)t) | (~negative & (VI)one));                          \
    return QUOTIENT(x * numer, one + t) * u;                                                    \
}
DEFINE_SILU_MUL(silu_mul8, v8, v8i, exp_v, DIVIDE)
DEFINE_SILU_MUL(silu_mul16, v16, v16i, exp_v16, TIMES_RECIP16)

/* gate_up [rows, 2 * inter] (gate, then up) -> out [rows, inter] = silu(gate) * up. */
void kvseal_silu_mul(const float *gate_up, float *out, int64_t rows, int64_t inter, int num_threads) {
    #pragma omp parallel for num_threads(rows >= 16 ? num_threads : 1) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate_up + r * 2 * inter, *u = g + inter;
        float *o = out + r * inter;
        int64_t i = 0;
        for (; i + 8 <= inter; i += 8) store8(o + i, silu_mul8(load8(g + i), load8(u + i)));
        for (; i < inter; i++) {
            const float x = g[i], t = exp_s(x < 0.0f ? x : -x);
            o[i] = x * (x < 0.0f ? t : 1.0f) / (1.0f + t) * u[i];
        }
    }
}

/* act [rows, inter] = silu(x W_gate^T) * (x W_up^T) in one pass, for float32 gate/up panels
   (kvseal_pack_panels_f32 of the fused [2 * inter, K] weight). It runs where inter is a
   multiple of 16 (gate panel q and up panel inter / 16 + q then hold the same 16 features),
   there is no bias and rows > 1 (one row goes to the linear's four-chain path); elsewhere it
   computes nothing and returns -1, and the caller runs the two passes. Else it returns 0. Panel
   pairs go to the threads in runs as in kvseal_linear_f32; per 96-row block a pair's gate and
   up sums land in two 96 x 16 buffers on the thread's stack and leave as silu(g) * u, so the
   [rows, 2 * inter] intermediate is never written nor read back (at 2,048 rows, 25 MB per
   layer) and there is no separate SiLU pass. The sums and the SiLU are those of the two-pass
   path (kvseal_linear_f32 then kvseal_silu_mul): the result is bit-equal. */
int kvseal_linear_silu_f32(const float *x, const float *panels, const float *bias, float *act, int64_t rows,
                           int64_t inter, int64_t k_in, int num_threads) {
    if (inter % 16 != 0 || bias != NULL || rows < 2) return -1;
    const int64_t pairs = inter / 16;
    const int64_t chunk = pairs / (8 * num_threads) > 1 ? pairs / (8 * num_threads) : 1;
    for (int64_t m0 = 0; m0 < rows; m0 += 96) {
        const int64_t block = m0 + 96 < rows ? 96 : rows - m0;
        const float *xb = x + m0 * k_in;
        int64_t handed_out = 0;  /* pairs claimed so far, `chunk` at a time */
        #pragma omp parallel num_threads(num_threads)
        {
            float g[96 * 16], u[96 * 16];
            int64_t q = __atomic_fetch_add(&handed_out, chunk, __ATOMIC_RELAXED);
            int64_t end = q + chunk < pairs ? q + chunk : pairs;
            while (q < pairs) {
                const int last = q + 1 >= end;
                const int64_t next = last ? __atomic_fetch_add(&handed_out, chunk, __ATOMIC_RELAXED) : q + 1;
                const float *gate = panels + q * k_in * 16, *up = panels + (pairs + q) * k_in * 16;
                panel_rows(xb, gate, NULL, g, 0, block, 0, 16, k_in, up, 64);
                panel_rows(xb, up, NULL, u, 0, block, 0, 16, k_in, next < pairs ? panels + next * k_in * 16 : NULL, 64);
                for (int64_t m = 0; m < block; m++) {
                    float *o = act + (m0 + m) * inter + q * 16;
                    store8(o, silu_mul8(load8(g + m * 16), load8(u + m * 16)));
                    store8(o + 8, silu_mul8(load8(g + m * 16 + 8), load8(u + m * 16 + 8)));
                }
                if (last) end = next + chunk < pairs ? next + chunk : pairs;
                q = next;
            }
        }
    }
    return 0;
}

/* Rotate-half RoPE in place on the first `heads` heads of each row of qkv [rows, row_stride]
   (q heads then k heads, head_dim each): x * cos + roll(x, head_dim / 2) * signed_sin, where
   cos and signed_sin are [rows, head_dim] (sin with its first half negated). */
void kvseal_rope(float *qkv, const float *cos, const float *signed_sin, int64_t rows, int64_t row_stride,
                 int64_t heads, int64_t head_dim) {
    const int64_t half = head_dim / 2;
    for (int64_t r = 0; r < rows; r++) {
        const float *c = cos + r * head_dim, *s = signed_sin + r * head_dim;
        for (int64_t h = 0; h < heads; h++) {
            float *x = qkv + r * row_stride + h * head_dim;
            int64_t i = 0;
            for (; i + 8 <= half; i += 8) {
                const v8 lo = load8(x + i), hi = load8(x + half + i);
                store8(x + i, lo * load8(c + i) + hi * load8(s + i));
                store8(x + half + i, hi * load8(c + half + i) + lo * load8(s + half + i));
            }
            for (; i < half; i++) {
                const float lo = x[i], hi = x[half + i];
                x[i] = lo * c[i] + hi * s[i];
                x[half + i] = hi * c[half + i] + lo * s[half + i];
            }
        }
    }
}

/* Store new tokens' K and V into one layer of the pool: k_new, v_new rows of qkv (row stride
   row_stride, kv_heads * head_dim elements each); pool layer [kv_heads, num_slots, head_dim], of
   elements `elem_bytes` wide. Returns -1, writing nothing, if any slot is outside the layer. */
static int write_slots(const char *k_new, const char *v_new, int64_t row_stride, const int64_t *slots,
                       char *k_pool, char *v_pool, int64_t rows, int64_t kv_heads, int64_t head_dim,
                       int64_t num_slots, int64_t elem_bytes) {
    for (int64_t r = 0; r < rows; r++)
        if (slots[r] < 0 || slots[r] >= num_slots) return -1;
    const int64_t head_bytes = head_dim * elem_bytes;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t h = 0; h < kv_heads; h++) {
            const int64_t at = (h * num_slots + slots[r]) * head_bytes;
            const int64_t from = (r * row_stride + h * head_dim) * elem_bytes;
            memcpy(k_pool + at, k_new + from, head_bytes);
            memcpy(v_pool + at, v_new + from, head_bytes);
        }
    return 0;
}

int kvseal_write_slots(const float *k_new, const float *v_new, int64_t row_stride, const int64_t *slots,
                       float *k_pool, float *v_pool, int64_t rows, int64_t kv_heads, int64_t head_dim,
                       int64_t num_slots) {
    return write_slots((const char *)k_new, (const char *)v_new, row_stride, slots, (char *)k_pool, (char *)v_pool,
                       rows, kv_heads, head_dim, num_slots, sizeof(float));
}

int kvseal_write_slots_bf16(const uint16_t *k_new, const uint16_t *v_new, int64_t row_stride, const int64_t *slots,
                            uint16_t *k_pool, uint16_t *v_pool, int64_t rows, int64_t kv_heads, int64_t head_dim,
                            int64_t num_slots) {
    return write_slots((const char *)k_new, (const char *)v_new, row_stride, slots, (char *)k_pool, (char *)v_pool,
                       rows, kv_heads, head_dim, num_slots, sizeof(uint16_t));
}
"""

# The per-layer ops of the bfloat16 forward (a bfloat16 model: activations, weights and KV pool
# in bfloat16; its linears are oneDNN's). Each computes in float32 and rounds to bfloat16 where
# torch's bfloat16 formulation of the same op rounds (`models/llama.py`, as transformers
# computes it), so a result equals that formulation's up to the order of float32 sums (the
# norm's sum of squares) and the last bits of exp (SiLU) before rounding.
BF16_OPS = r"""
/* h [rows, dim] += delta (unless NULL), rounded to bfloat16, in place; out = bf16(bf16(h *
   rstd) * weight), rstd = 1 / sqrt(mean(h^2) + eps) over h in float32: transformers'
   `weight * (h.float() * rsqrt(var + eps)).to(bfloat16)`. */
void kvseal_add_rms_norm_bf16(uint16_t *h, const uint16_t *delta, const uint16_t *weight, float eps,
                              uint16_t *out, int64_t rows, int64_t dim, int num_threads) {
    #pragma omp parallel for num_threads(rows >= 64 ? num_threads : 1) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        uint16_t *hr = h + r * dim, *o = out + r * dim;
        const uint16_t *dr = delta == NULL ? NULL : delta + r * dim;
        v16 acc = {0};
        int64_t i = 0;
        for (; i + 16 <= dim; i += 16) {
            v16 x = load16_bf16(hr + i);
            if (dr != NULL) { x = round16_bf16(x + load16_bf16(dr + i)); store16_bf16(hr + i, x); }
            acc += x * x;
        }
        float sum = hsum8(fold16(acc));
        for (; i < dim; i++) {
            if (dr != NULL) hr[i] = to_bf16(widen_bf16_1(hr[i]) + widen_bf16_1(dr[i]));
            sum += widen_bf16_1(hr[i]) * widen_bf16_1(hr[i]);
        }
        const float rstd = 1.0f / sqrtf(sum / (float)dim + eps);
        for (i = 0; i + 16 <= dim; i += 16)
            store16_bf16(o + i, round16_bf16(load16_bf16(hr + i) * rstd) * load16_bf16(weight + i));
        for (; i < dim; i++) o[i] = to_bf16(round_bf16_1(widen_bf16_1(hr[i]) * rstd) * widen_bf16_1(weight[i]));
    }
}

/* gate_up [rows, 2 * inter] (gate, then up) -> out [rows, inter] = bf16(bf16(silu(gate)) * up). */
void kvseal_silu_mul_bf16(const uint16_t *gate_up, uint16_t *out, int64_t rows, int64_t inter, int num_threads) {
    const v16 one = (v16){0} + 1.0f;
    #pragma omp parallel for num_threads(rows >= 16 ? num_threads : 1) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *g = gate_up + r * 2 * inter, *u = g + inter;
        uint16_t *o = out + r * inter;
        int64_t i = 0;
        for (; i + 16 <= inter; i += 16)
            store16_bf16(o + i, round16_bf16(silu_mul16(load16_bf16(g + i), one)) * load16_bf16(u + i));
        for (; i < inter; i++) {
            const float x = widen_bf16_1(g[i]), t = exp_s(x < 0.0f ? x : -x);
            o[i] = to_bf16(round_bf16_1(x * (x < 0.0f ? t : 1.0f) / (1.0f + t)) * widen_bf16_1(u[i]));
        }
    }
}

/* Rotate-half RoPE in place on the first `heads` heads of each row of qkv [rows, row_stride]:
   bf16(bf16(x * cos) + bf16(roll(x, head_dim / 2) * signed_sin)), cos and signed_sin [rows,
   head_dim] bfloat16 (`RotaryEmbedding.apply` in bfloat16, op by op). */
void kvseal_rope_bf16(uint16_t *qkv, const uint16_t *cos, const uint16_t *signed_sin, int64_t rows,
                      int64_t row_stride, int64_t heads, int64_t head_dim, int num_threads) {
    const int64_t half = head_dim / 2;
    #pragma omp parallel for num_threads(rows >= 64 ? num_threads : 1) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *c = cos + r * head_dim, *s = signed_sin + r * head_dim;
        for (int64_t h = 0; h < heads; h++) {
            uint16_t *x = qkv + r * row_stride + h * head_dim;
            int64_t i = 0;
            for (; i + 16 <= half; i += 16) {
                const v16 lo = load16_bf16(x + i), hi = load16_bf16(x + half + i);
                store16_bf16(x + i, round16_bf16(lo * load16_bf16(c + i)) + round16_bf16(hi * load16_bf16(s + i)));
                store16_bf16(x + half + i, round16_bf16(hi * load16_bf16(c + half + i))
                                           + round16_bf16(lo * load16_bf16(s + half + i)));
            }
            for (; i < half; i++) {
                const float lo = widen_bf16_1(x[i]), hi = widen_bf16_1(x[half + i]);
                x[i] = to_bf16(round_bf16_1(lo * widen_bf16_1(c[i])) + round_bf16_1(hi * widen_bf16_1(s[i])));
                x[half + i] = to_bf16(round_bf16_1(hi * widen_bf16_1(c[half + i]))
                                      + round_bf16_1(lo * widen_bf16_1(s[half + i])));
            }
        }
    }
}
"""


# Weight-only int8: y = (x Q^T) * scale (+ bias) in float32, Q held in the same 16-feature column
# panels as LINEAR's, one byte a weight ([K][16] int8 per panel). Each slab row's 16 bytes become
# two 8-lane float vectors (sign-extend, convert: vpmovsxbd + vcvtdq2ps on AVX2) and are FMA'd exactly as
# the float32 kernel does; the per-output-channel scale multiplies the sums once, at the store.
# A decode step reads a quarter of the float32 bytes. Appended after LINEAR (uses store_block).
INT8_LINEAR = r"""
/* 8 int8 weights -> 8 floats (exact: |q| <= 127). GCC 12 scalarizes __builtin_convertvector
   from an 8-byte int8 vector (a byte at a time through general registers), so on x86 with AVX2
   the two instructions are asked for by name: vpmovsxbd (sign-extend 8 bytes to 8 int32) and
   vcvtdq2ps; elsewhere the portable conversion. */
#if defined(__AVX2__)
#include <immintrin.h>
static inline v8 load8_i8(const int8_t *p) {
    return (v8)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
#else
typedef int8_t v8b __attribute__((vector_size(8)));
static inline v8 load8_i8(const int8_t *p) {
    v8b b;
    memcpy(&b, p, sizeof b);
    return __builtin_convertvector(__builtin_convertvector(b, v8i), v8);
}
#endif

/* w: [N, K] int8 row-major -> panels: [ceil(N / 16)][K][16] int8, zero-padded. */
void kvseal_pack_panels_i8(const int8_t *w, int8_t *panels, int64_t n_out, int64_t k_in) {
    const int64_t count = (n_out + 15) / 16;
    #pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < count; p++)
        for (int64_t k = 0; k < k_in; k++)
            for (int64_t j = 0; j < 16; j++) {
                const int64_t n = p * 16 + j;
                panels[(p * k_in + k) * 16 + j] = n < n_out ? w[n * k_in + k] : 0;
            }
}

/* Scale MR rows of sums by the panel's nr (<= 16) channel scales, then store_block (bias). */
static inline void store_block_i8(float *y, int64_t ldy, v8 *a0, v8 *a1, int mr, int64_t nr,
                                  const float *scale, const float *bias) {
    float sc[16] = {0};
    memcpy(sc, scale, sizeof(float) * nr);
    const v8 s0 = load8(sc), s1 = load8(sc + 8);
    for (int i = 0; i < mr; i++) { a0[i] *= s0; a1[i] *= s1; }
    store_block(y, ldy, a0, a1, mr, nr, bias);
}

/* MR rows of x against one int8 panel: each slab row converted once, used by MR rows. */
#define DEFINE_PANEL_KERNEL_I8(MR)                                                              \
static void panel_i8_##MR(const float *x, int64_t ldx, const int8_t *slab, int64_t k_in,       \
                          float *y, int64_t ldy, int64_t nr, const float *scale, const float *bias) { \
    v8 a0[MR], a1[MR];                                                                          \
    for (int i = 0; i < MR; i++) { a0[i] = (v8){0}; a1[i] = (v8){0}; }                          \
    for (int64_t k = 0; k < k_in; k++) {                                                        \
        const v8 w0 = load8_i8(slab + k * 16), w1 = load8_i8(slab + k * 16 + 8);                \
        for (int i = 0; i < MR; i++) { const float s = x[i * ldx + k]; a0[i] += s * w0; a1[i] += s * w1; } \
    }                                                                                           \
    store_block_i8(y, ldy, a0, a1, MR, nr, scale, bias);                                        \
}
DEFINE_PANEL_KERNEL_I8(1)
DEFINE_PANEL_KERNEL_I8(2)
DEFINE_PANEL_KERNEL_I8(3)
DEFINE_PANEL_KERNEL_I8(4)
DEFINE_PANEL_KERNEL_I8(5)
DEFINE_PANEL_KERNEL_I8(6)

/* One row (single-stream decode): four independent chains over k, the slab read in order (16
   bytes per k; the next 512 bytes prefetched, so the stream never waits on a conversion). */
static void panel_i8_row(const float *x, const int8_t *slab, int64_t k_in, float *y, int64_t nr,
                         const float *scale, const float *bias) {
    v8 a[8];
    for (int i = 0; i < 8; i++) a[i] = (v8){0};
    int64_t k = 0;
    for (; k + 4 <= k_in; k += 4) {
        __builtin_prefetch(slab + (k + 32) * 16);
        for (int u = 0; u < 4; u++) {
            const float s = x[k + u];
            a[2 * u] += s * load8_i8(slab + (k + u) * 16);
            a[2 * u + 1] += s * load8_i8(slab + (k + u) * 16 + 8);
        }
    }
    for (; k < k_in; k++) {
        const float s = x[k];
        a[0] += s * load8_i8(slab + k * 16); a[1] += s * load8_i8(slab + k * 16 + 8);
    }
    v8 r0 = (a[0] + a[2]) + (a[4] + a[6]), r1 = (a[1] + a[3]) + (a[5] + a[7]);
    store_block_i8(y, 0, &r0, &r1, 1, nr, scale, bias);
}

/* Rows m0..m_end-1 of x (row stride k_in) against int8 panel p; y has row stride n_out. */
static void panel_i8_rows(const float *x, const int8_t *slab, const float *scale, const float *bias, float *y,
                          int64_t m0, int64_t m_end, int64_t p, int64_t n_out, int64_t k_in) {
    const int64_t nr = n_out - p * 16 < 16 ? n_out - p * 16 : 16;
    const float *ps = scale + p * 16, *pb = bias == NULL ? NULL : bias + p * 16;
    float *yp = y + p * 16;
    int64_t m = m0;
    for (; m + 6 <= m_end; m += 6) panel_i8_6(x + m * k_in, k_in, slab, k_in, yp + m * n_out, n_out, nr, ps, pb);
    switch (m_end - m) {
        case 1: panel_i8_1(x + m * k_in, k_in, slab, k_in, yp + m * n_out, n_out, nr, ps, pb); break;
        case 2: panel_i8_2(x + m * k_in, k_in, slab, k_in, yp + m * n_out, n_out, nr, ps, pb); break;
        case 3: panel_i8_3(x + m * k_in, k_in, slab, k_in, yp + m * n_out, n_out, nr, ps, pb); break;
        case 4: panel_i8_4(x + m * k_in, k_in, slab, k_in, yp + m * n_out, n_out, nr, ps, pb); break;
        case 5: panel_i8_5(x + m * k_in, k_in, slab, k_in, yp + m * n_out, n_out, nr, ps, pb); break;
        default: break;
    }
}

/* y [M, N] = (x [M, K] . Q^T) * scale [N] (+ bias [N] unless NULL); Q as int8 panels
   (kvseal_pack_panels_i8). Same blocking and thread split as kvseal_linear_f32. */
void kvseal_linear_i8(const float *x, const int8_t *panels, const float *scale, const float *bias, float *y,
                      int64_t rows, int64_t n_out, int64_t k_in, int num_threads) {
    const int64_t count = (n_out + 15) / 16;
    if (rows == 1) {
        #pragma omp parallel for num_threads(num_threads) schedule(static)
        for (int64_t p = 0; p < count; p++) {
            const int64_t nr = n_out - p * 16 < 16 ? n_out - p * 16 : 16;
            panel_i8_row(x, panels + p * k_in * 16, k_in, y + p * 16, nr, scale + p * 16,
                         bias == NULL ? NULL : bias + p * 16);
        }
        return;
    }
    for (int64_t m0 = 0; m0 < rows; m0 += 96) {
        const int64_t m_end = m0 + 96 < rows ? m0 + 96 : rows;
        #pragma omp parallel for num_threads(num_threads) schedule(static)
        for (int64_t p = 0; p < count; p++)
            panel_i8_rows(x, panels + p * k_in * 16, scale, bias, y, m0, m_end, p, n_out, k_in);
    }
}
"""

# bfloat16 linears over weights in AMX's tile layout: y = x W^T (+ bias), x and y bfloat16,
# float32 sums, each output rounded once. The weight is packed once ([ceil(N/16)][K/32] tiles of
# 16 k-pairs x 16 outputs x 2, the layout TDPBF16PS reads, zero-padded past N); K must be a
# multiple of 32. Panel pairs are handed to the threads in runs, so each streams its weights in
# order, and each step computes 32 rows x 2 panels over every k, blocked as a GEMM (groups of
# panels stay in L2 while every 32-row chunk passes over them). Two engines compute a step:
# - AMX (Sapphire Rapids and later, where the process may use tile data): 2 x 2 tiles, a chunk's
#   outputs written out between the next chunk's tile products. At one to 32 rows (decode) the
#   weights stream at the memory's bandwidth (a pass over SmolLM2-135M's 270 MB: 10.5-13.4 ms
#   against oneDNN's 14.6-17.8 ms on the round-10 host); at 2,048 rows 0.9x oneDNN's time
#   (docs/BENCHMARKS.md, rounds 10 and 20).
# - AVX512-BF16 (CPUs without AMX, such as AMD's Zen 4 and 5): VDPBF16PS, whose operand is one
#   64-byte tile row (16 outputs' k-pairs) against x's pair broadcast, 8 rows x 2 panels in 16
#   accumulators (docs/BENCHMARKS.md, round 11).
# Compiled where the compiler targets AVX512-BF16; elsewhere the entry points answer -1 and the
# model keeps oneDNN's linears.
TILE_LINEARS = r"""
/* w [N, K] bfloat16 row-major (nn.Linear's layout) -> packed tiles (see above). */
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

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define KVSEAL_AMX 1
#endif

#if defined(__AVX512BF16__)
#include <immintrin.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

/* amx_permitted: the kernel lets this process use AMX tile data (ARCH_REQ_XCOMP_PERM for
   XFEATURE_XTILEDATA; the permission is per process, so every OpenMP thread has it).
   amx_linears: the tile linears run on AMX, else on AVX512-BF16 dot products. */
static int amx_permitted = 0, amx_linears = 0;

/* The engine the tile linears run on from now on: 2 = AMX where this build targets it and the
   process may use it, else 1 = AVX512-BF16 dot products over the same tiles. */
int kvseal_tiles_init(void) {
#ifdef KVSEAL_AMX
    amx_permitted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
#endif
    amx_linears = amx_permitted;
    return amx_linears ? 2 : 1;
}

/* engine 1: run the tile linears on the dot products even where AMX is permitted (so tests
   cover both engines on an AMX host); 2: on AMX where permitted. Returns the engine now in use.
   Not while a linear runs. */
int kvseal_tiles_engine(int engine) {
    amx_linears = engine == 2 && amx_permitted;
    return amx_linears ? 2 : 1;
}

/* rows of a 16-column float32 tile (+ bias) into bfloat16 y, nr <= 16 valid columns: one
   vcvtneps2bf16 a row (round to nearest even; NaN stays NaN). */
static void store_tile_rows(const float *c, int rows, const uint16_t *bias, uint16_t *y, int64_t ldy, int64_t nr) {
    const __mmask16 mask = (__mmask16)((1u << nr) - 1u);
    const __m512 b = bias == NULL ? _mm512_setzero_ps()
        : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, bias)), 16));
    for (int r = 0; r < rows; r++) {
        const __m256bh out = _mm512_cvtneps_pbh(_mm512_add_ps(_mm512_loadu_ps(c + r * 16), b));
        _mm256_mask_storeu_epi16(y + r * ldy, mask, (__m256i)out);
    }
}

/* One row block of the dot-product engine: R rows of x against panels b0 and b1 over every k,
   sums into c0 and c1 (16 floats a row). A B tile's 64-byte row is 16 outputs' (k, k + 1)
   weight pairs, exactly vdpbf16ps's operand, against x's pair broadcast. S accumulators per
   row and panel take alternate k-pairs, so that a block of few rows (decode) still has enough
   independent sums in flight to hide the instruction's latency. p0, p1 (unless NULL): panels to
   prefetch into L1 so that the next panels' weights come from memory while these are
   multiplied: their line of k-pair k for every k with k % shares == share (the chunk's row
   blocks divide the lines between them). */
static inline __attribute__((always_inline)) void dot_block(const uint16_t *a, int64_t k_in, const uint16_t *b0,
                                                            const uint16_t *b1, const int R, const int S,
                                                            float *c0, float *c1, const uint16_t *p0,
                                                            const uint16_t *p1, int share, int shares) {
    __m512 acc0[16], acc1[16];  /* R * S <= 16 */
    for (int i = 0; i < R * S; i++) { acc0[i] = _mm512_setzero_ps(); acc1[i] = _mm512_setzero_ps(); }
    int turn = 0;
    for (int64_t kp = 0; kp < k_in / 2; kp += S)
        for (int s = 0; s < S; s++) {
            const __m512bh w0 = (__m512bh)_mm512_loadu_si512(b0 + (kp + s) * 32);
            const __m512bh w1 = (__m512bh)_mm512_loadu_si512(b1 + (kp + s) * 32);
            if (p0 != NULL) {
                if (turn == share) {
                    __builtin_prefetch(p0 + (kp + s) * 32, 0, 3);
                    __builtin_prefetch(p1 + (kp + s) * 32, 0, 3);
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

/* Bytes of weights a thread keeps in L2 while every row chunk passes over them. */
#define TILE_GROUP_BYTES (512 * 1024)

#ifdef KVSEAL_AMX
struct tile_config { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; };

/* LDTILECFG reads all 64 bytes (a set reserved byte faults), but GCC 12 does not model that
   read and drops the zeroing stores: the barrier keeps every byte written. */
static inline void load_tile_config(const struct tile_config *c) {
    __asm__ volatile("" : : "m"(*c) : "memory");
    _tile_loadconfig(c);
}

/* Tiles 0-3: C (row tile 0 and 1 of panel p, then of p + 1); 4, 5: A (row tiles 0, 1); 6, 7: B
   (panels p, p + 1). r1 = 0: one row tile, tiles 1, 3, 5 unused. */
static void configure_tiles(int r0, int r1) {
    struct tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    const int rows[8] = {r0, r1, r0, r1, r0, r1, 16, 16};
    for (int t = 0; t < 8; t++) { c.rows[t] = (uint8_t)rows[t]; c.colsb[t] = rows[t] ? 64 : 0; }
    load_tile_config(&c);
}

static void tile_release(void) { _tile_release(); }

/* Tiles 0..count-1 as 16 rows x 64 bytes, the rest unused. */
static void configure_full_tiles(int count) {
    struct tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < count; t++) { c.rows[t] = 16; c.colsb[t] = 64; }
    load_tile_config(&c);
}

/* Decode attention's scores on tiles (csrc.ATTENTION_BF16): tile 0 = C (16 slots x 16 query
   heads), 1 = A (a K page's 16 slots x 32 dims), 2 = B (the query heads' 32-dim slice, dims in
   pairs). Returns 1 with the tiles configured for this thread, 0 where AMX is not permitted. */
static int amx_attention_begin(void) {
    if (!amx_permitted) return 0;
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
static void amx_page_scores(const uint16_t *k_page, int64_t n, const uint16_t *q_tiles, int64_t head_dim,
                            int64_t group, float scale, float *scores, int64_t ctx, uint16_t *pad) {
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
#else
static void configure_tiles(int r0, int r1) { (void)r0; (void)r1; }
static void tile_release(void) {}
#endif

/* One tile product: x [rows, k_in] against packed panels. A plain linear writes y [rows, n_out]
   (+ bias); with `half` > 0 it is the MLP's fused gate/up weight ([2 * half * 16, k_in]) and
   writes act [rows, half * 16] = silu(gate) * up instead, each panel of gate paired with the up
   panel of the same features. */
struct tile_job {
    const uint16_t *x, *packed, *bias;
    uint16_t *y;
    int64_t rows, n_out, k_in, half;
};

/* silu(gate) * up rows from a gate tile and an up tile (float32 sums), rounded as the two-pass
   path rounds: gate and up to bfloat16 (the linear's output), silu(gate) to bfloat16, the product. */
static void store_silu_rows(const float *gate, const float *up, int rows, uint16_t *act, int64_t ld) {
    const v16 one = (v16){0} + 1.0f;
    for (int r = 0; r < rows; r++) {
        const v16 g = round16_bf16(load16(gate + r * 16)), u = round16_bf16(load16(up + r * 16));
        store16_bf16(act + r * ld, round16_bf16(silu_mul16(g, one)) * u);
    }
}

/* A chunk whose tiles are computed (c[0], c[1]: panel a's row tiles; c[2], c[3]: panel b's)
   and whose outputs are not all out yet. The dot-product engine writes them at once; on AMX
   they go out a row or two at a time between the next chunk's tile products, which run on
   their own unit while the vector ports convert and store. c == NULL: none. */
struct pending_chunk {
    float (*c)[256];
    int64_t m0, a, b;
    int r0, r1, two, done;  /* done: rows of the chunk already out */
};

/* The pending chunk's rows [p->done, until) out, a row tile's share at a time: each linear
   output + bias rounded once, or a fused gate/up's silu(gate) * up. */
static void pending_rows(const struct tile_job *j, struct pending_chunk *p, int until) {
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
                store_tile_rows(p->c[2 * t + tile] + first * 16, count, j->bias == NULL ? NULL : j->bias + pt * 16,
                                j->y + m * j->n_out + pt * 16, j->n_out, nr);
            }
        }
        p->done = end;
    }
}

#ifdef KVSEAL_AMX
/* One 32-row chunk of x (a; r1 rows in its second row tile) against panel b0 and, if two,
   panel b1, over every k: the four sums into c; the pending chunk's rows go out between the
   k steps (all of them by the end). */
static void amx_chunk_overlapped(const uint16_t *a, int64_t k_in, const uint16_t *b0, const uint16_t *b1, int r1,
                                 int two, float c[4][256], const struct tile_job *j, struct pending_chunk *p) {
    const int64_t kblocks = k_in / 32;
    const int rows = p->c == NULL ? 0 : p->r0 + p->r1;
    const int per_step = (int)((rows + kblocks - 1) / kblocks);
    _tile_zero(0); _tile_zero(2);
    if (r1) { _tile_zero(1); _tile_zero(3); }
    for (int64_t kb = 0; kb < kblocks; kb++) {
        _tile_loadd(4, a + kb * 32, k_in * 2);
        _tile_loadd(6, b0 + kb * 512, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (r1) { _tile_loadd(5, a + 16 * k_in + kb * 32, k_in * 2); _tile_dpbf16ps(1, 5, 6); }
        if (two) {
            _tile_loadd(7, b1 + kb * 512, 64);
            _tile_dpbf16ps(2, 4, 7);
            if (r1) _tile_dpbf16ps(3, 5, 7);
        }
        if (p->done < rows) pending_rows(j, p, p->done + per_step);
    }
    if (p->c != NULL) pending_rows(j, p, rows);
    _tile_stored(0, c[0], 64); _tile_stored(2, c[2], 64);
    if (r1) { _tile_stored(1, c[1], 64); _tile_stored(3, c[3], 64); }
}
#else
static void amx_chunk_overlapped(const uint16_t *a, int64_t k_in, const uint16_t *b0, const uint16_t *b1, int r1,
                                 int two, float c[4][256], const struct tile_job *j, struct pending_chunk *p) {
    (void)a; (void)k_in; (void)b0; (void)b1; (void)r1; (void)two; (void)c; (void)j; (void)p;
}
#endif

/* Pairs [i_begin, i_end) for rows [0, rows): pair i is panels (2i, 2i + 1) of a plain linear,
   (i, i + half) of a fused gate/up. Blocked as a GEMM: pairs in groups whose weights stay in
   L2 while every 32-row chunk passes over them (the weights come from memory once), and a
   chunk's rows stay in L1 across the group's pairs. after: the first pair of the thread's next
   run (-1: none); with at most TILE_CHUNK_ROWS rows (one chunk: decode) the last pair prefetches
   it, so that a run does not start on weights still in memory. */
#define TILE_CHUNK_ROWS 32
static void tile_pairs(const struct tile_job *j, int64_t i_begin, int64_t i_end, int amx, int64_t after) {
    const int one_chunk = j->rows <= TILE_CHUNK_ROWS;
    float c[2][4][256];  /* on AMX: the chunk being computed, and the one whose outputs go out meanwhile */
    int cur = 0;
    struct pending_chunk pending = {0};
    int conf0 = -1, conf1 = -1;
    const int64_t panels = (j->n_out + 15) / 16, kblocks = j->k_in / 32, pair_bytes = 2 * j->k_in * 32;
    const int64_t group = TILE_GROUP_BYTES / pair_bytes > 1 ? TILE_GROUP_BYTES / pair_bytes : 1;
    for (int64_t g = i_begin; g < i_end; g += group) {
        const int64_t g_end = g + group < i_end ? g + group : i_end;
        for (int64_t m0 = 0; m0 < j->rows; m0 += TILE_CHUNK_ROWS) {
            const int r0 = j->rows - m0 < 16 ? (int)(j->rows - m0) : 16;
            const int r1 = j->rows - m0 <= 16 ? 0 : (j->rows - m0 < 32 ? (int)(j->rows - m0 - 16) : 16);
            if (amx && (r0 != conf0 || r1 != conf1)) { configure_tiles(r0, r1); conf0 = r0; conf1 = r1; }
            for (int64_t i = g; i < g_end; i++) {
                const int64_t a = j->half > 0 ? i : 2 * i, b = j->half > 0 ? i + j->half : 2 * i + 1;
                const int two = b < panels;
                const uint16_t *x = j->x + m0 * j->k_in, *b0 = j->packed + a * kblocks * 512;
                const uint16_t *b1 = j->packed + b * kblocks * 512;
                if (amx) {
                    amx_chunk_overlapped(x, j->k_in, b0, b1, r1, two, c[cur], j, &pending);
                    pending = (struct pending_chunk){c[cur], m0, a, b, r0, r1, two, 0};
                    cur ^= 1;
                } else {  /* the first chunk of rows prefetches the next pair's weights */
                    const int64_t n = one_chunk && i + 1 == i_end ? after : i + 1;
                    const int64_t na = j->half > 0 ? n : 2 * n, nb = j->half > 0 ? n + j->half : 2 * n + 1;
                    const int ahead = m0 == 0 && (one_chunk ? n >= 0 : n < g_end);
                    dot_chunk(x, j->k_in, b0, b1, r0 + r1, two, c[0],
                              ahead ? j->packed + na * kblocks * 512 : NULL,
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
   short (about 8 a thread): on a host whose cores the frontend shares, a preempted thread then
   holds no fixed half for the other to wait on. From TILE_SPLIT_ROWS rows on each thread takes
   one contiguous half: every run re-reads all the rows, which short runs would multiply. At
   decode sizes (one chunk of rows) each thread takes its next run before it works on the one in
   hand, so that it can prefetch the next run's first weights (tile_pairs' `after`); with two
   halves, claiming ahead would take the other thread's half. */
#define TILE_SPLIT_ROWS 256
static void tile_run(const struct tile_job *j, int64_t pairs, int num_threads) {
    const int64_t runs = j->rows >= TILE_SPLIT_ROWS ? num_threads : 8 * num_threads;
    const int64_t run = (pairs + runs - 1) / runs;
    const int amx = amx_linears;
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
int kvseal_linear_tiles(const uint16_t *x, const uint16_t *packed, const uint16_t *bias, uint16_t *y,
                        int64_t rows, int64_t n_out, int64_t k_in, int num_threads) {
    const struct tile_job j = {x, packed, bias, y, rows, n_out, k_in, 0};
    tile_run(&j, ((n_out + 15) / 16 + 1) / 2, num_threads);
    return 0;
}

/* act [rows, inter] = silu(x W_gate^T) * (x W_up^T) in one pass over the MLP's fused gate/up
   weight (packed [2 * inter, k_in], no bias), bit-equal to kvseal_linear_tiles then
   kvseal_silu_mul_bf16: the [rows, 2 * inter] intermediate is never written. Returns -1,
   computing nothing, unless inter is a multiple of 16 (gate and up panels then hold the same
   features); else 0. */
int kvseal_linear_silu_tiles(const uint16_t *x, const uint16_t *packed, uint16_t *act, int64_t rows,
                             int64_t inter, int64_t k_in, int num_threads) {
    if (inter % 16 != 0) return -1;
    const struct tile_job j = {x, packed, NULL, act, rows, 2 * inter, k_in, inter / 16};
    tile_run(&j, inter / 16, num_threads);
    return 0;
}
#else
int kvseal_tiles_init(void) { return 0; }
int kvseal_tiles_engine(int engine) { (void)engine; return 0; }
int kvseal_linear_tiles(const uint16_t *x, const uint16_t *packed, const uint16_t *bias, uint16_t *y,
                        int64_t rows, int64_t n_out, int64_t k_in, int num_threads) {
    (void)x; (void)packed; (void)bias; (void)y; (void)rows; (void)n_out; (void)k_in; (void)num_threads;
    return -1;
}
int kvseal_linear_silu_tiles(const uint16_t *x, const uint16_t *packed, uint16_t *act, int64_t rows,
                             int64_t inter, int64_t k_in, int num_threads) {
    (void)x; (void)packed; (void)act; (void)rows; (void)inter; (void)k_in; (void)num_threads;
    return -1;
}
#endif

/* Decode attention's AMX scores (csrc.ATTENTION_BF16) where the build has no AMX: never begun. */
#ifndef KVSEAL_AMX
static int amx_attention_begin(void) { return 0; }
static void amx_attention_end(void) {}
static void pack_query_tiles(const uint16_t *q, int64_t group, int64_t head_dim, uint16_t *tiles) {
    (void)q; (void)group; (void)head_dim; (void)tiles;
}
static void amx_page_scores(const uint16_t *k_page, int64_t n, const uint16_t *q_tiles, int64_t head_dim,
                            int64_t group, float scale, float *scores, int64_t ctx, uint16_t *pad) {
    (void)k_page; (void)n; (void)q_tiles; (void)head_dim; (void)group; (void)scale; (void)scores; (void)ctx;
    (void)pad;
}
#endif
"""

# Every decoder layer of a decode-only step in one call (`models/decode_loop.py`): the same
# kernels the Python native forward calls one by one, in the same order on the same buffers,
# so the result is bit-equal; what goes is ~20 Python and ctypes calls per layer.
DECODE_LOOP = r"""
enum { W_QKV, S_QKV, B_QKV, W_O, S_O, B_O, W_GATE_UP, S_GATE_UP, B_GATE_UP, W_DOWN, S_DOWN, B_DOWN,
       INPUT_NORM, POST_NORM, K_POOL, V_POOL, LAYER_POINTERS };

/* One linear with the model's weight kind: 0 float32 panels, 1 bfloat16 panels, 2 int8 panels
   with per-channel scales. Returns the kernel's status (0: done). */
static int loop_linear(int kind, const void *const *w, int which, const float *x, float *y,
                       int64_t rows, int64_t n_out, int64_t k_in, int threads) {
    const float *bias = w[which + 2], *scale = w[which + 1];
    if (kind == 0) return kvseal_linear_f32(x, w[which], bias, y, rows, n_out, k_in, threads);
    if (kind == 1) return kvseal_linear_bf16(x, w[which], bias, y, rows, n_out, k_in, threads);
    kvseal_linear_i8(x, w[which], scale, bias, y, rows, n_out, k_in, threads);
    return 0;
}

/* layers: num_layers x LAYER_POINTERS pointers (weights, scales or NULL, biases or NULL, the two
   norms' weights, the layer's K and V pool [kv_heads, num_pages, page_size, head_dim]).
   h [rows, hidden]: the embedded tokens in, the residual stream out; x [rows, hidden]: the
   final-normed stream out. Scratch: qkv [rows, qkv_width], q and attn [rows, heads * head_dim],
   tmp [rows, hidden], gate_up [rows, 2 * inter], act [rows, inter]. cos, signed_sin: [rows,
   head_dim]; slots [rows]: where each row's K and V go; tables, context_lens: as
   kvseal_decode_attention. *layers_written counts the layers whose K and V were stored.
   Returns 0; -1 if a slot is outside the pool (nothing written in that layer); -2 if a kernel
   could not allocate its scratch. */
int kvseal_decode_layers(int kind, int64_t num_layers, const void *const *layers, const float *final_norm,
                         float eps, float *h, float *x, float *qkv, float *q, float *attn, float *tmp,
                         float *gate_up, float *act, const float *cos, const float *signed_sin,
                         const int64_t *slots, const int64_t *tables, const int64_t *context_lens, int64_t rows,
                         int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t inter,
                         int64_t num_pages, int64_t page_size, int64_t table_width, int64_t max_context,
                         float scale, int threads, int64_t *layers_written) {
    const int64_t q_size = heads * head_dim, kv_size = kv_heads * head_dim, width = q_size + 2 * kv_size;
    *layers_written = 0;
    kvseal_add_rms_norm(h, NULL, layers[INPUT_NORM], eps, x, rows, hidden, threads);
    for (int64_t l = 0; l < num_layers; l++) {
        const void *const *w = layers + l * LAYER_POINTERS;
        float *k_pool = (float *)w[K_POOL], *v_pool = (float *)w[V_POOL];
        if (loop_linear(kind, w, W_QKV, x, qkv, rows, width, hidden, threads)) return -2;
        kvseal_rope(qkv, cos, signed_sin, rows, width, heads + kv_heads, head_dim);
        if (kvseal_write_slots(qkv + q_size, qkv + q_size + kv_size, width, slots, k_pool, v_pool, rows, kv_heads,
                               head_dim, num_pages * page_size)) return -1;
        *layers_written = l + 1;
        for (int64_t r = 0; r < rows; r++) memcpy(q + r * q_size, qkv + r * width, sizeof(float) * q_size);
        if (kvseal_decode_attention(q, k_pool, v_pool, tables, context_lens, attn, rows, kv_heads, heads / kv_heads,
                                    head_dim, num_pages, page_size, table_width, max_context, scale, threads))
            return -2;
        if (loop_linear(kind, w, W_O, attn, tmp, rows, hidden, q_size, threads)) return -2;
        kvseal_add_rms_norm(h, tmp, w[POST_NORM], eps, x, rows, hidden, threads);
        if (kind != 0 || kvseal_linear_silu_f32(x, w[W_GATE_UP], w[B_GATE_UP], act, rows, inter, hidden, threads)) {
            if (loop_linear(kind, w, W_GATE_UP, x, gate_up, rows, 2 * inter, hidden, threads)) return -2;
            kvseal_silu_mul(gate_up, act, rows, inter, threads);
        }
        if (loop_linear(kind, w, W_DOWN, act, tmp, rows, hidden, inter, threads)) return -2;
        const float *next_norm = l + 1 < num_layers ? (const float *)w[LAYER_POINTERS + INPUT_NORM] : final_norm;
        kvseal_add_rms_norm(h, tmp, next_norm, eps, x, rows, hidden, threads);
    }
    return 0;
}

/* The same for a bfloat16 model whose linears are AMX-packed (kvseal_pack_tiles; the pointer
   table's scale slots NULL): h, x, qkv, attn, tmp, gate_up, act, cos and signed_sin bfloat16,
   the pool bfloat16; decode attention reads q in place from the qkv rows. The same kernels as
   the per-layer bfloat16 forward, in the same order. Returns as kvseal_decode_layers. */
int kvseal_decode_layers_bf16(int64_t num_layers, const void *const *layers, const uint16_t *final_norm, float eps,
                              uint16_t *h, uint16_t *x, uint16_t *qkv, uint16_t *attn, uint16_t *tmp,
                              uint16_t *gate_up, uint16_t *act, const uint16_t *cos, const uint16_t *signed_sin,
                              const int64_t *slots, const int64_t *tables, const int64_t *context_lens,
                              int64_t rows, int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim,
                              int64_t inter, int64_t num_pages, int64_t page_size, int64_t table_width,
                              int64_t max_context, float scale, int threads, int64_t *layers_written) {
    const int64_t q_size = heads * head_dim, kv_size = kv_heads * head_dim, width = q_size + 2 * kv_size;
    *layers_written = 0;
    kvseal_add_rms_norm_bf16(h, NULL, layers[INPUT_NORM], eps, x, rows, hidden, threads);
    for (int64_t l = 0; l < num_layers; l++) {
        const void *const *w = layers + l * LAYER_POINTERS;
        uint16_t *k_pool = (uint16_t *)w[K_POOL], *v_pool = (uint16_t *)w[V_POOL];
        if (kvseal_linear_tiles(x, w[W_QKV], w[B_QKV], qkv, rows, width, hidden, threads)) return -2;
        kvseal_rope_bf16(qkv, cos, signed_sin, rows, width, heads + kv_heads, head_dim, threads);
        if (kvseal_write_slots_bf16(qkv + q_size, qkv + q_size + kv_size, width, slots, k_pool, v_pool, rows,
                                    kv_heads, head_dim, num_pages * page_size)) return -1;
        *layers_written = l + 1;
        if (kvseal_decode_attention_bf16(qkv, width, k_pool, v_pool, tables, context_lens, attn, q_size, rows,
                                         kv_heads, heads / kv_heads, head_dim, num_pages, page_size, table_width,
                                         max_context, scale, SCORES_AMX, threads)) return -2;
        if (kvseal_linear_tiles(attn, w[W_O], w[B_O], tmp, rows, hidden, q_size, threads)) return -2;
        kvseal_add_rms_norm_bf16(h, tmp, w[POST_NORM], eps, x, rows, hidden, threads);
        if (w[B_GATE_UP] != NULL || kvseal_linear_silu_tiles(x, w[W_GATE_UP], act, rows, inter, hidden, threads)) {
            if (kvseal_linear_tiles(x, w[W_GATE_UP], w[B_GATE_UP], gate_up, rows, 2 * inter, hidden, threads))
                return -2;
            kvseal_silu_mul_bf16(gate_up, act, rows, inter, threads);
        }
        if (kvseal_linear_tiles(act, w[W_DOWN], w[B_DOWN], tmp, rows, hidden, inter, threads)) return -2;
        const uint16_t *next_norm = l + 1 < num_layers ? (const uint16_t *)w[LAYER_POINTERS + INPUT_NORM] : final_norm;
        kvseal_add_rms_norm_bf16(h, tmp, next_norm, eps, x, rows, hidden, threads);
    }
    return 0;
}
"""

# Causal attention of prefill chunks that start at position 0 (`models/attention.py`,
# `FreshPrefills`), blocked like the panel linears: each (chunk, KV head)'s K^T is packed once
# into 16-key panels shared by the group's query heads, scores for 6 query rows x 16 keys run
# in 12 accumulators (q broadcast), and O = P V runs as 6 rows x 16 features over V packed the
# same way (16-feature panels, keys in order: measured ~4% faster than reading V in place at
# its 3,840-byte row stride). A query block computes only the key panels it can see.
PREFILL_ATTENTION = r"""
/* Query rows per block: 6 rows x 16 keys or features in 12 8-lane accumulators (AVX2), 12 rows
   x 16 in 12 16-lane ones where the build targets AVX-512 (half the instructions a block). */
#if defined(__AVX512F__)
#define FRESH_ROWS 12
#else
#define FRESH_ROWS 6
#endif

/* The sizes of one call: qkv rows (q heads, then K heads, then V heads, head_dim each) are
   row_stride floats apart; out rows are num_heads * head_dim floats apart; every chunk is
   `length` tokens; lds: a score row's stride (the keys rounded up to whole panels). */
struct fresh_shape {
    int64_t row_stride, length, num_heads, kv_heads, head_dim, lds;
    float scale;
    /* A chunk after a cached prefix: keys 0..prefix-1 are the sequence's own slots in the pool
       (k_pool / v_pool: [kv_heads, pages, page_size, head_dim], head_stride elements a KV
       head; `table` its pages), the chunk's rows are keys prefix.. (0: a fresh chunk). */
    int64_t prefix, head_stride, page_size;
    const int64_t *table;
    const char *k_pool, *v_pool;
};

/* Key (v = 0) or value (v = 1) t of KV head kvh for the chunk whose first row is `start`, of
   elem-byte elements: t < prefix from the sequence's own pool slot (its table's page), else
   the chunk's row start + t - prefix. Nothing else is ever addressed. */
static const char *fresh_kv(const struct fresh_shape *sh, const char *qkv, int64_t elem, int64_t start, int64_t kvh,
                            int64_t t, int v) {
    if (t < sh->prefix) {
        const int64_t slot = sh->table[t / sh->page_size] * sh->page_size + t % sh->page_size;
        return (v ? sh->v_pool : sh->k_pool) + (kvh * sh->head_stride + slot * sh->head_dim) * elem;
    }
    const int64_t column = (sh->num_heads + v * sh->kv_heads + kvh) * sh->head_dim;
    return qkv + ((start + t - sh->prefix) * sh->row_stride + column) * elem;
}

/* qb [FRESH_ROWS][head_dim] = scale * the mr query rows at q (row_stride apart); rows mr.. are 0. */
static void pack_query_block(const float *q, int64_t row_stride, int64_t mr, int64_t head_dim, float scale,
                             float *qb) {
    for (int64_t i = 0; i < FRESH_ROWS; i++) {
        if (i >= mr) { memset(qb + i * head_dim, 0, head_dim * sizeof(float)); continue; }
        for (int64_t d = 0; d < head_dim; d++) qb[i * head_dim + d] = scale * q[i * row_stride + d];
    }
}

#if defined(__AVX512F__)
/* a [FRESH_ROWS] = rows x (ldx apart) . panel over k < k_in, one 16-wide panel row per k: 12
   16-lane accumulators, one broadcast of x per (row, k), one panel load per k. */
static inline __attribute__((always_inline)) void block_rows_x16(const float *x, int64_t ldx, const float *panel,
                                                                 int64_t k_in, v16 *a) {
    for (int i = 0; i < FRESH_ROWS; i++) a[i] = (v16){0};
    for (int64_t k = 0; k < k_in; k++) {
        const v16 w = load16(panel + k * 16);
        for (int i = 0; i < FRESH_ROWS; i++) a[i] += x[i * ldx + k] * w;
    }
}

/* block_rows_x16 over two panels at once (24 accumulators): each x broadcast feeds both, and
   each output's sum runs over k in the same order. */
static inline __attribute__((always_inline)) void block_rows_x32(const float *x, int64_t ldx, const float *panel0,
                                                                 const float *panel1, int64_t k_in, v16 *a0,
                                                                 v16 *a1) {
    for (int i = 0; i < FRESH_ROWS; i++) { a0[i] = (v16){0}; a1[i] = (v16){0}; }
    for (int64_t k = 0; k < k_in; k++) {
        const v16 w0 = load16(panel0 + k * 16), w1 = load16(panel1 + k * 16);
        for (int i = 0; i < FRESH_ROWS; i++) {
            const float s = x[i * ldx + k];
            a0[i] += s * w0;
            a1[i] += s * w1;
        }
    }
}

/* s [FRESH_ROWS][lds] = qb . K^T over key panels 0..count-1. */
static void block_scores(const float *qb, const float *panels, int64_t count, int64_t head_dim, float *s,
                         int64_t lds) {
    for (int64_t p = 0; p < count; p++) {
        v16 a[FRESH_ROWS];
        block_rows_x16(qb, head_dim, panels + p * head_dim * 16, head_dim, a);
        for (int i = 0; i < FRESH_ROWS; i++) store16(s + i * lds + p * 16, a[i]);
    }
}
#else
/* a0, a1 [FRESH_ROWS] = rows x (ldx apart) . panel over k < k_in, one 16-wide panel row per k:
   12 accumulators, one broadcast of x per (row, k), two panel loads per k. */
static inline __attribute__((always_inline)) void block_6x16(const float *x, int64_t ldx, const float *panel,
                                                             int64_t k_in, v8 *a0, v8 *a1) {
    for (int i = 0; i < FRESH_ROWS; i++) { a0[i] = (v8){0}; a1[i] = (v8){0}; }
    for (int64_t k = 0; k < k_in; k++) {
        const v8 w0 = load8(panel + k * 16), w1 = load8(panel + k * 16 + 8);
        for (int i = 0; i < FRESH_ROWS; i++) {
            const float s = x[i * ldx + k];
            a0[i] += s * w0; a1[i] += s * w1;
        }
    }
}

/* s [FRESH_ROWS][lds] = qb . K^T over key panels 0..count-1. */
static void block_scores(const float *qb, const float *panels, int64_t count, int64_t head_dim, float *s,
                         int64_t lds) {
    for (int64_t p = 0; p < count; p++) {
        v8 a0[FRESH_ROWS], a1[FRESH_ROWS];
        block_6x16(qb, head_dim, panels + p * head_dim * 16, head_dim, a0, a1);
        for (int i = 0; i < FRESH_ROWS; i++) {
            store8(s + i * lds + p * 16, a0[i]);
            store8(s + i * lds + p * 16 + 8, a1[i]);
        }
    }
}
#endif

/* The scores s[0..n-1] of the query at position pos -> unnormalized probabilities: exp(s - max)
   over keys 0..pos, exactly 0 for keys pos+1..n-1 (later tokens: masked). Returns 1 / their sum.
   Vectors of VL lanes; a score row holds whole 16-key panels, so the last vector stays in it. */
static float causal_row(float *s, int64_t pos, int64_t n) {
    const int64_t seen = pos + 1, whole = seen / VL * VL;
    int64_t t = 0;
    vl top_v = (vl){0} + s[0];
    for (; t < whole; t += VL) top_v = max_vl(load_vl(s + t), top_v);
    float top = top_v[0];
    for (int i = 1; i < VL; i++) top = top_v[i] > top ? top_v[i] : top;
    for (; t < seen; t++) top = s[t] > top ? s[t] : top;
    vl acc = {0};
    for (t = 0; t < whole; t += VL) { const vl e = exp_vl(load_vl(s + t) - top); store_vl(s + t, e); acc += e; }
    if (t < seen) {  /* the last, partial vector: lanes past pos are masked to exactly 0 */
        vli lane;
        for (int i = 0; i < VL; i++) lane[i] = i;
        const vli keep = lane < (vli){0} + (int32_t)(seen - t);
        const vl e = (vl)(keep & (vli)exp_vl(load_vl(s + t) - top));
        store_vl(s + t, e); acc += e; t += VL;
    }
    for (; t < n; t += VL) store_vl(s + t, (vl){0});
    return 1.0f / hsum_vl(acc);
}

/* Rows 0..mr-1 of out (out_stride apart) = inv[i] * sum over t < n of p[i][t] * V[t], V as the
   panels of pack_panels_f32 (`length` keys each), 16 features at a time; a last panel of 8
   features (head_dim % 16 == 8) stores only those 8. */
static void block_values(const float *p, int64_t lds, const float *vp, int64_t length, int64_t n,
                         int64_t head_dim, const float *inv, int64_t mr, float *out, int64_t out_stride) {
    int64_t f = 0;
#if defined(__AVX512F__)
    for (; f + 32 <= head_dim; f += 32) {  /* two panels a pass: half the broadcasts of p */
        v16 a0[FRESH_ROWS], a1[FRESH_ROWS];
        block_rows_x32(p, lds, vp + f * length, vp + (f + 16) * length, n, a0, a1);
        for (int64_t i = 0; i < mr; i++) {
            store16(out + i * out_stride + f, a0[i] * inv[i]);
            store16(out + i * out_stride + f + 16, a1[i] * inv[i]);
        }
    }
#endif
    for (; f < head_dim; f += 16) {
#if defined(__AVX512F__)
        v16 a[FRESH_ROWS];
        block_rows_x16(p, lds, vp + f * length, n, a);
        for (int64_t i = 0; i < mr; i++) {
            const v16 o = a[i] * inv[i];
            if (f + 16 <= head_dim) store16(out + i * out_stride + f, o);
            else memcpy(out + i * out_stride + f, &o, 8 * sizeof(float));
        }
#else
        v8 a0[FRESH_ROWS], a1[FRESH_ROWS];
        block_6x16(p, lds, vp + f * length, n, a0, a1);
        for (int64_t i = 0; i < mr; i++) {
            store8(out + i * out_stride + f, a0[i] * inv[i]);
            if (f + 16 <= head_dim) store8(out + i * out_stride + f + 8, a1[i] * inv[i]);
        }
#endif
    }
}

/* One task: query rows FRESH_ROWS * b .. (those inside the chunk) of every query head of KV head
   kvh, for the chunk whose first row is `start`. It reads q of its own rows and K and V (through
   `panels` and `vpanels`, packed from this chunk's rows) of keys 0 .. the block's last row only:
   the chunk's own tokens, never another chunk's. scratch: FRESH_ROWS * (head_dim + lds) floats. */
static void fresh_block(const struct fresh_shape *sh, const void *qkv_rows, int64_t start, int64_t kvh, int64_t b,
                        const void *panels, const float *vpanels, float *scratch, void *out_rows) {
    const float *qkv = qkv_rows;
    float *out = out_rows;
    const int64_t hd = sh->head_dim, group = sh->num_heads / sh->kv_heads, out_stride = sh->num_heads * hd;
    const int64_t first = b * FRESH_ROWS, left = sh->length - first, mr = left < FRESH_ROWS ? left : FRESH_ROWS;
    const int64_t n = sh->prefix + first + mr;  /* the keys the block's last row sees */
    float *qb = scratch, *s = scratch + FRESH_ROWS * hd, inv[FRESH_ROWS];
    for (int64_t j = 0; j < group; j++) {
        const int64_t h = kvh * group + j;
        pack_query_block(qkv + (start + first) * sh->row_stride + h * hd, sh->row_stride, mr, hd, sh->scale, qb);
        block_scores(qb, panels, (n + 15) / 16, hd, s, sh->lds);
        for (int64_t i = 0; i < mr; i++) inv[i] = causal_row(s + i * sh->lds, sh->prefix + first + i, n);
        block_values(s, sh->lds, vpanels, sh->prefix + sh->length, n, hd, inv, mr,
                     out + (start + first) * out_stride + h * hd, out_stride);
    }
}

/* The keys (prefix + length of them, fresh_kv) of KV head kvh -> K^T as 16-key panels
   [ceil(keys / 16)][head_dim][16] and V as 16-feature panels [ceil(head_dim / 16)][keys][16];
   slots past the last key and features past head_dim are 0. */
static void pack_panels_f32(const struct fresh_shape *sh, const void *qkv, int64_t start, int64_t kvh,
                            void *panels_out, float *vpanels) {
    const int64_t keys = sh->prefix + sh->length, hd = sh->head_dim;
    float *panels = panels_out;
    for (int64_t p = 0; p < (keys + 15) / 16; p++)
        for (int64_t j = 0; j < 16; j++) {
            const int64_t t = p * 16 + j;
            const float *k = t < keys ? (const float *)fresh_kv(sh, qkv, sizeof(float), start, kvh, t, 0) : NULL;
            for (int64_t d = 0; d < hd; d++) panels[(p * hd + d) * 16 + j] = k != NULL ? k[d] : 0.0f;
        }
    for (int64_t t = 0; t < keys; t++) {
        const float *v = (const float *)fresh_kv(sh, qkv, sizeof(float), start, kvh, t, 1);
        int64_t f = 0;
        for (; f + 16 <= hd; f += 16) memcpy(vpanels + f * keys + t * 16, v + f, 16 * sizeof(float));
        for (; f < hd; f += 16)
            for (int64_t j = 0; j < 16; j++) vpanels[f * keys + t * 16 + j] = f + j < hd ? v[f + j] : 0.0f;
    }
}

/* A prefill attention over rows of one element type: how a (chunk, KV head)'s K and V are
   packed (K panels of key_bytes an element, V as float32 panels), and one task. */
struct fresh_kernel {
    void (*pack)(const struct fresh_shape *sh, const void *qkv, int64_t start, int64_t kvh, void *panels,
                 float *vpanels);
    void (*block)(const struct fresh_shape *sh, const void *qkv, int64_t start, int64_t kvh, int64_t b,
                  const void *panels, const float *vpanels, float *scratch, void *out);
    int64_t key_bytes, scratch_floats;  /* scratch: per block row, scratch_floats x head_dim + 2 x lds floats */
    int64_t rows;  /* query rows a block */
    int64_t (*vpanel_floats)(int64_t keys, int64_t head_dim);  /* a (chunk, KV head)'s packed V */
    int (*begin)(void);  /* per thread before its blocks (NULL: nothing); returns 1 if end must run */
    void (*end)(void);
};

/* V as 16-feature float32 panels (pack_panels_f32, pack_panels_bf16). */
static int64_t float_vpanels(int64_t keys, int64_t head_dim) { return (head_dim + 15) / 16 * 16 * keys; }

/* The call for either element type (see kvseal_prefill_attention). */
static int fresh_attention(const struct fresh_kernel *kern, const struct fresh_shape *shape, const void *qkv,
                           const int64_t *starts, int64_t num_chunks, void *out, int num_threads) {
    const struct fresh_shape sh = *shape;
    const int64_t kv_heads = sh.kv_heads, head_dim = sh.head_dim, keys = sh.prefix + sh.length;
    const int64_t pairs = num_chunks * kv_heads, blocks = (sh.length + kern->rows - 1) / kern->rows;
    const int64_t panel_bytes = (keys + 15) / 16 * 16 * head_dim * kern->key_bytes;
    const int64_t vpanel_floats = kern->vpanel_floats(keys, head_dim);
    if (sh.prefix > 0 && num_chunks != 1) return -3;  /* one table: one chunk after a prefix a call */
    char *panels = malloc(pairs * panel_bytes);
    float *vpanels = malloc(sizeof(float) * pairs * vpanel_floats);
    if (panels == NULL || vpanels == NULL) { free(panels); free(vpanels); return -1; }
    int failed = 0;
    #pragma omp parallel num_threads(num_threads) reduction(|:failed)
    {
        #pragma omp for schedule(static)
        for (int64_t pr = 0; pr < pairs; pr++)
            kern->pack(&sh, qkv, starts[pr / kv_heads], pr % kv_heads, panels + pr * panel_bytes,
                       vpanels + pr * vpanel_floats);
        float *scratch = malloc(sizeof(float) * kern->rows * (kern->scratch_floats * head_dim + 2 * sh.lds));
        if (scratch == NULL) failed = 1;
        const int began = kern->begin != NULL && kern->begin();
        #pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < pairs * blocks; task++) {
            if (scratch == NULL) continue;
            const int64_t pr = task / blocks, b = blocks - 1 - task % blocks;
            kern->block(&sh, qkv, starts[pr / kv_heads], pr % kv_heads, b, panels + pr * panel_bytes,
                        vpanels + pr * vpanel_floats, scratch, out);
        }
        if (began) kern->end();
        free(scratch);
    }
    free(panels); free(vpanels);
    return failed ? -1 : 0;
}

/* qkv: [rows, row_stride] float32, each row its token's q heads, K heads and V heads (head_dim
   each, side by side, after RoPE); starts: [num_chunks] the first row of each chunk, each chunk
   `length` rows at positions 0..length-1. out: [rows, num_heads * head_dim]; the chunks' rows
   are written, no other row. head_dim must be a multiple of 8 and num_heads a multiple of
   kv_heads. Isolation: a chunk's queries read the q, K and V of that chunk's own rows and of no
   other row of qkv (nothing else is read at all: no pool). Tasks are (chunk, KV head, query
   block), each (chunk, KV head)'s blocks heaviest first, so the last tasks are the light ones.
   Returns 0, or -1 if scratch memory could not be allocated (out is then incomplete). */
int kvseal_prefill_attention(const float *qkv, int64_t row_stride, const int64_t *starts, int64_t num_chunks,
                             int64_t length, int64_t num_heads, int64_t kv_heads, int64_t head_dim, float scale,
                             float *out, int64_t prefix, const int64_t *table, const void *k_pool,
                             const void *v_pool, int64_t head_stride, int64_t page_size, int num_threads) {
    static const struct fresh_kernel f32 = {pack_panels_f32, fresh_block, sizeof(float), 1, FRESH_ROWS, float_vpanels,
                                            NULL, NULL};
    const int64_t keys = prefix + length;
    const struct fresh_shape sh = {row_stride, length, num_heads, kv_heads, head_dim, (keys + 15) / 16 * 16, scale,
                                   prefix, head_stride, page_size, table, k_pool, v_pool};
    return fresh_attention(&f32, &sh, qkv, starts, num_chunks, out, num_threads);
}

#if defined(__AVX512BF16__)
/* The bfloat16 twin: K as 16-key panels of head-dim pairs ([ceil(length / 16)][head_dim / 2][16][2],
   the tile layout, zero past the last key) for VDPBF16PS, V widened into float32 panels. */
static void pack_key_panels_bf16(const struct fresh_shape *sh, const void *qkv, int64_t start, int64_t kvh,
                                 void *panels_out) {
    const int64_t keys = sh->prefix + sh->length, hd = sh->head_dim;
    uint32_t *pairs = panels_out;  /* a head-dim pair (two bfloat16) is one 32-bit word */
    for (int64_t p = 0; p < (keys + 15) / 16; p++)
        for (int64_t j = 0; j < 16; j++) {
            const int64_t t = p * 16 + j;
            uint32_t *to = pairs + p * (hd / 2) * 16 + j;
            if (t >= keys) {
                for (int64_t dp = 0; dp < hd / 2; dp++) to[dp * 16] = 0;
                continue;
            }
            const uint16_t *k = (const uint16_t *)fresh_kv(sh, qkv, 2, start, kvh, t, 0);
            for (int64_t dp = 0; dp < hd / 2; dp++) memcpy(to + dp * 16, k + 2 * dp, sizeof(uint32_t));
        }
}

static void pack_panels_bf16(const struct fresh_shape *sh, const void *qkv, int64_t start, int64_t kvh,
                             void *panels_out, float *vpanels) {
    const int64_t keys = sh->prefix + sh->length, hd = sh->head_dim;
    pack_key_panels_bf16(sh, qkv, start, kvh, panels_out);
    for (int64_t t = 0; t < keys; t++) {
        const uint16_t *v = (const uint16_t *)fresh_kv(sh, qkv, 2, start, kvh, t, 1);
        int64_t f = 0;
        for (; f + 16 <= hd; f += 16) store16(vpanels + f * keys + t * 16, load16_bf16(v + f));
        for (; f < hd; f += 16)
            for (int64_t j = 0; j < 16; j++)
                vpanels[f * keys + t * 16 + j] = f + j < hd ? widen_bf16_1(v[f + j]) : 0.0f;
    }
}

/* fresh_block over bfloat16 rows: the scores as FRESH_ROWS x 16 dot products of q's head-dim pairs
   (broadcast, read in place) against a key panel, times scale; softmax and P V in float32 as the
   float32 kernel; each output rounded once into the bfloat16 out rows. scratch: FRESH_ROWS *
   (2 * head_dim + lds) floats: the scores, the float32 outputs, the block's q rows (zero past
   the chunk). */
static void fresh_block_bf16(const struct fresh_shape *sh, const void *qkv_rows, int64_t start, int64_t kvh,
                             int64_t b, const void *panels_in, const float *vpanels, float *scratch, void *out_rows) {
    const uint16_t *qkv = qkv_rows, *panels = panels_in;
    uint16_t *out = out_rows;
    const int64_t hd = sh->head_dim, group = sh->num_heads / sh->kv_heads, out_stride = sh->num_heads * hd;
    const int64_t first = b * FRESH_ROWS, left = sh->length - first, mr = left < FRESH_ROWS ? left : FRESH_ROWS;
    const int64_t n = sh->prefix + first + mr;
    float *s = scratch, *ob = scratch + FRESH_ROWS * sh->lds, inv[FRESH_ROWS];
    uint16_t *qb = (uint16_t *)(ob + FRESH_ROWS * hd);
    for (int64_t j = 0; j < group; j++) {
        const int64_t h = kvh * group + j;
        for (int64_t i = 0; i < FRESH_ROWS; i++) {
            if (i < mr) memcpy(qb + i * hd, qkv + (start + first + i) * sh->row_stride + h * hd, hd * sizeof(uint16_t));
            else memset(qb + i * hd, 0, hd * sizeof(uint16_t));
        }
        for (int64_t p = 0; p < (n + 15) / 16; p++) {
            const uint16_t *panel = panels + p * hd * 16;
            __m512 a[FRESH_ROWS];
            for (int i = 0; i < FRESH_ROWS; i++) a[i] = _mm512_setzero_ps();
            for (int64_t dp = 0; dp < hd / 2; dp++) {
                const __m512bh w = (__m512bh)_mm512_loadu_si512(panel + dp * 32);
                for (int i = 0; i < FRESH_ROWS; i++) {
                    int32_t pair;
                    memcpy(&pair, qb + i * hd + 2 * dp, sizeof pair);
                    a[i] = _mm512_dpbf16_ps(a[i], (__m512bh)_mm512_set1_epi32(pair), w);
                }
            }
            for (int i = 0; i < FRESH_ROWS; i++)
                _mm512_storeu_ps(s + i * sh->lds + p * 16, _mm512_mul_ps(a[i], _mm512_set1_ps(sh->scale)));
        }
        for (int64_t i = 0; i < mr; i++) inv[i] = causal_row(s + i * sh->lds, sh->prefix + first + i, n);
        block_values(s, sh->lds, vpanels, sh->prefix + sh->length, n, hd, inv, mr, ob, hd);
        for (int64_t i = 0; i < mr; i++) {
            uint16_t *o = out + (start + first + i) * out_stride + h * hd;
            int64_t d = 0;
            for (; d + 16 <= hd; d += 16) store16_bf16(o + d, load16(ob + i * hd + d));
            for (; d < hd; d++) o[d] = to_bf16(ob[i * hd + d]);
        }
    }
}

#ifdef KVSEAL_AMX
/* The same attention on AMX tiles, for head dims that are a multiple of 64 (used where the tile
   linears run on AMX). A block is 16 query rows of one head. Scores: a C tile of 16 rows x 16
   keys, the rows' q as A tiles (32 dims each) against the K panels of pack_key_panels_bf16 (the
   B-tile layout already), four key panels at a time. The float32 softmax is the other kernels'.
   P V: the unnormalized probabilities rounded once to bfloat16 (as SDPA's flash attention does
   on these CPUs) as A tiles of 32 keys, against V packed into B tiles of 32 keys (in pairs) x 16
   features, four C tiles (64 features) a pass; each output scaled by 1 / sum and rounded once.
   Tiles: 0-3 C, 4 A, 6 and 7 B, all 16 rows x 64 bytes. */
#define AMX_FRESH_ROWS 16

static int64_t amx_vpanels(int64_t keys, int64_t head_dim) { return (keys + 31) / 32 * 32 * head_dim / 2; }

/* K as pack_key_panels_bf16; V as [ceil(keys / 32)][head_dim / 16][16 key pairs][16 features][2]
   bfloat16 (one 1 KiB B tile each), zero past the last key. */
static void pack_panels_amx(const struct fresh_shape *sh, const void *qkv, int64_t start, int64_t kvh,
                            void *panels_out, float *vpanels) {
    const int64_t keys = sh->prefix + sh->length, hd = sh->head_dim, fts = hd / 16;
    pack_key_panels_bf16(sh, qkv, start, kvh, panels_out);
    uint16_t *tiles = (uint16_t *)vpanels;
    /* lanes 2c and 2c + 1 of a tile row: feature c of the even key, then of the odd key */
    const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                           23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    for (int64_t t = 0; t < (keys + 31) / 32 * 32; t += 2) {
        const uint16_t *even = t < keys ? (const uint16_t *)fresh_kv(sh, qkv, 2, start, kvh, t, 1) : NULL;
        const uint16_t *odd = t + 1 < keys ? (const uint16_t *)fresh_kv(sh, qkv, 2, start, kvh, t + 1, 1) : NULL;
        uint16_t *row = tiles + (t / 32) * fts * 512 + (t % 32 / 2) * 32;
        for (int64_t ft = 0; ft < fts; ft++) {
            const __m256i zero = _mm256_setzero_si256();
            const __m256i e = even != NULL ? _mm256_loadu_si256((const __m256i *)(even + ft * 16)) : zero;
            const __m256i o = odd != NULL ? _mm256_loadu_si256((const __m256i *)(odd + ft * 16)) : zero;
            const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(e), o, 1);
            _mm512_storeu_si512(row + ft * 512, _mm512_permutexvar_epi16(pairs, both));
        }
    }
}

/* causal_row over raw scores, scaled on the way and written as bfloat16: p[0..end-1] = exp(scale
   * s - scale * max) over keys 0..pos, each rounded once, exactly 0 from pos + 1 to end (a
   multiple of 32). Returns 1 / the sum of the unrounded values. */
static float causal_row_bf16(const float *s, int64_t pos, int64_t end, float scale, uint16_t *p) {
    const int64_t seen = pos + 1, whole = seen / 16 * 16;
    int64_t t = 0;
    v16 top_v = (v16){0} + s[0];
    for (; t < whole; t += 16) top_v = max_vl(load16(s + t), top_v);
    float top = top_v[0];
    for (int i = 1; i < 16; i++) top = top_v[i] > top ? top_v[i] : top;
    for (; t < seen; t++) top = s[t] > top ? s[t] : top;
    const float shift = scale * top;
    v16 acc = {0};
    for (t = 0; t < whole; t += 16) {
        const v16 e = exp_vl(load16(s + t) * scale - shift);
        store16_bf16(p + t, e);
        acc += e;
    }
    if (t < seen) {  /* the last, partial vector: lanes past pos are exactly 0 */
        v16i lane;
        for (int i = 0; i < 16; i++) lane[i] = i;
        const v16i keep = lane < (v16i){0} + (int32_t)(seen - t);
        const v16 e = (v16)(keep & (v16i)exp_vl(load16(s + t) * scale - shift));
        store16_bf16(p + t, e);
        acc += e;
        t += 16;
    }
    for (; t < end; t += 16) memset(p + t, 0, 16 * sizeof(uint16_t));
    return 1.0f / hsum_vl(acc);
}

static int amx_fresh_begin(void) {
    configure_full_tiles(8);
    return 1;
}

/* fresh_block_bf16's task on tiles: query rows 16 b .. of every query head of KV head kvh. It
   reads the same rows and keys (keys 0 .. the block's last row). scratch: 16 x lds float32
   scores, 16 x 64 float32 outputs, 16 x lds bfloat16 probabilities, 16 x head_dim bfloat16 q. */
static void fresh_block_amx(const struct fresh_shape *sh, const void *qkv_rows, int64_t start, int64_t kvh,
                            int64_t b, const void *panels_in, const float *vpanels, float *scratch, void *out_rows) {
    const uint16_t *qkv = qkv_rows, *panels = panels_in, *vt = (const uint16_t *)vpanels;
    uint16_t *out = out_rows;
    const int64_t hd = sh->head_dim, group = sh->num_heads / sh->kv_heads, out_stride = sh->num_heads * hd;
    const int64_t first = b * AMX_FRESH_ROWS, left = sh->length - first;
    const int64_t mr = left < AMX_FRESH_ROWS ? left : AMX_FRESH_ROWS;
    const int64_t n = sh->prefix + first + mr, key_panels = (n + 15) / 16, key_blocks = (n + 31) / 32;
    const int64_t lds = sh->lds, fts = hd / 16;
    float *s = scratch, *ob = s + 16 * lds, inv[AMX_FRESH_ROWS];
    uint16_t *pb = (uint16_t *)(ob + 16 * 64), *qb = pb + 16 * lds;
    for (int64_t j = 0; j < group; j++) {
        const int64_t h = kvh * group + j;
        for (int64_t i = 0; i < 16; i++) {
            if (i < mr) memcpy(qb + i * hd, qkv + (start + first + i) * sh->row_stride + h * hd, hd * sizeof(uint16_t));
            else memset(qb + i * hd, 0, hd * sizeof(uint16_t));
        }
        for (int64_t p = 0; p < key_panels; p += 4) {  /* four independent sums in flight */
            const int64_t count = key_panels - p < 4 ? key_panels - p : 4;
            const uint16_t *k = panels + p * hd * 16;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int64_t kb = 0; kb < hd / 32; kb++) {
                _tile_loadd(4, qb + kb * 32, hd * 2);
                _tile_loadd(6, k + kb * 512, 64);
                _tile_dpbf16ps(0, 4, 6);
                if (count > 1) { _tile_loadd(7, k + hd * 16 + kb * 512, 64); _tile_dpbf16ps(1, 4, 7); }
                if (count > 2) { _tile_loadd(6, k + 2 * hd * 16 + kb * 512, 64); _tile_dpbf16ps(2, 4, 6); }
                if (count > 3) { _tile_loadd(7, k + 3 * hd * 16 + kb * 512, 64); _tile_dpbf16ps(3, 4, 7); }
            }
            _tile_stored(0, s + p * 16, lds * 4);
            if (count > 1) _tile_stored(1, s + (p + 1) * 16, lds * 4);
            if (count > 2) _tile_stored(2, s + (p + 2) * 16, lds * 4);
            if (count > 3) _tile_stored(3, s + (p + 3) * 16, lds * 4);
        }
        for (int64_t i = 0; i < 16; i++) {
            float *row = s + i * lds;
            uint16_t *prow = pb + i * lds;
            if (i >= mr) memset(prow, 0, key_blocks * 32 * sizeof(uint16_t));
            else inv[i] = causal_row_bf16(row, sh->prefix + first + i, key_blocks * 32, sh->scale, prow);
        }
        for (int64_t f0 = 0; f0 < fts; f0 += 4) {
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int64_t kb = 0; kb < key_blocks; kb++) {
                const uint16_t *v = vt + (kb * fts + f0) * 512;
                _tile_loadd(4, pb + kb * 32, lds * 2);
                _tile_loadd(6, v, 64);
                _tile_dpbf16ps(0, 4, 6);
                _tile_loadd(7, v + 512, 64);
                _tile_dpbf16ps(1, 4, 7);
                _tile_loadd(6, v + 1024, 64);
                _tile_dpbf16ps(2, 4, 6);
                _tile_loadd(7, v + 1536, 64);
                _tile_dpbf16ps(3, 4, 7);
            }
            _tile_stored(0, ob, 256);
            _tile_stored(1, ob + 16, 256);
            _tile_stored(2, ob + 32, 256);
            _tile_stored(3, ob + 48, 256);
            for (int64_t i = 0; i < mr; i++) {
                uint16_t *o = out + (start + first + i) * out_stride + h * hd + f0 * 16;
                for (int64_t d = 0; d < 64; d += 16) store16_bf16(o + d, load16(ob + i * 64 + d) * inv[i]);
            }
        }
    }
}
#endif

/* kvseal_prefill_attention over bfloat16 qkv rows and bfloat16 out rows: the same reads (each
   chunk's own rows only) and the same float32 softmax; the scores' products are exact and summed
   in float32, P V in float32 over V widened exactly, each output rounded once. Where the tile
   linears run on AMX and head_dim is a multiple of 64 it runs on tiles (fresh_block_amx: P
   rounded to bfloat16 before P V). Returns as kvseal_prefill_attention, or -2 where the build
   has no AVX512-BF16 (nothing computed). */
int kvseal_prefill_attention_bf16(const uint16_t *qkv, int64_t row_stride, const int64_t *starts,
                                  int64_t num_chunks, int64_t length, int64_t num_heads, int64_t kv_heads,
                                  int64_t head_dim, float scale, uint16_t *out, int64_t prefix,
                                  const int64_t *table, const void *k_pool, const void *v_pool, int64_t head_stride,
                                  int64_t page_size, int num_threads) {
    static const struct fresh_kernel bf16 = {pack_panels_bf16, fresh_block_bf16, sizeof(uint16_t), 2, FRESH_ROWS,
                                             float_vpanels, NULL, NULL};
    const int64_t keys = prefix + length;
    struct fresh_shape sh = {row_stride, length, num_heads, kv_heads, head_dim, (keys + 15) / 16 * 16, scale,
                             prefix, head_stride, page_size, table, k_pool, v_pool};
#ifdef KVSEAL_AMX
    static const struct fresh_kernel amx = {pack_panels_amx, fresh_block_amx, sizeof(uint16_t), 2, AMX_FRESH_ROWS,
                                            amx_vpanels, amx_fresh_begin, tile_release};
    if (amx_linears && head_dim % 64 == 0) {
        sh.lds = (keys + 31) / 32 * 32;  /* the probabilities are read as tiles of 32 keys */
        return fresh_attention(&amx, &sh, qkv, starts, num_chunks, out, num_threads);
    }
#endif
    return fresh_attention(&bf16, &sh, qkv, starts, num_chunks, out, num_threads);
}
#else
int kvseal_prefill_attention_bf16(const uint16_t *qkv, int64_t row_stride, const int64_t *starts,
                                  int64_t num_chunks, int64_t length, int64_t num_heads, int64_t kv_heads,
                                  int64_t head_dim, float scale, uint16_t *out, int64_t prefix,
                                  const int64_t *table, const void *k_pool, const void *v_pool, int64_t head_stride,
                                  int64_t page_size, int num_threads) {
    (void)qkv; (void)row_stride; (void)starts; (void)num_chunks; (void)length; (void)num_heads; (void)kv_heads;
    (void)head_dim; (void)scale; (void)out; (void)prefix; (void)table; (void)k_pool; (void)v_pool;
    (void)head_stride; (void)page_size; (void)num_threads;
    return -2;
}
#endif
"""
