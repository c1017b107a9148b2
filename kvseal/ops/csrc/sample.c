/* The sampler's random draw for rows that ask for temperature, and top-p, but not top-k: passes
 * over a row's logits as they are instead of torch's widening copy, division, softmax, sort (for
 * top-p) and two-level search. A 32-row step over the default model's 49,152-token vocabulary:
 * 4.6 -> 0.45 ms at temperature 1, ~55 -> ~5 ms with top_p 0.95 (bench/sampler_speed.py).
 *
 * A row's weights are w_i = exp(x_i / T - max_j x_j / T); a -inf logit (a token that the grammar
 * mask, a logit_bias or the min_tokens ban removed) weighs exactly 0, never exp's floor. The
 * token drawn is the first whose cumulative weight exceeds u * sum(w), u in [0, 1) the row's
 * own uniform (the caller draws it from the request's generator): the same inverse-CDF rule as
 * the torch path (kvseal/ops/torch_sampling.py), in the same two levels: the block of
 * SAMPLE_BLOCK tokens where the target falls (block sums accumulated in double), then the token
 * inside it. The weights are float32 exps (vec.h, relative error ~1e-7), so this path and torch's
 * agree on every draw except where u falls within rounding of a boundary between two tokens.
 *
 * Top-p keeps the smallest set of the heaviest tokens whose weight reaches top_p * sum(w), as
 * the torch path's sort does (a token is kept while the weight of the heavier ones before it is
 * below that), ties taken in index order. No sort of the vocabulary: a positive float's bits
 * order as its value, so two histograms of weight by bits (2,048 buckets on the exponent and 3
 * mantissa bits, then 2,048 on the next 11 bits inside the bucket the boundary falls in) leave
 * only the few tokens of one bucket to sort. The draw then runs over the kept tokens in index
 * order (any fixed order samples exactly).
 * Called by NativeOps.draw_rows. */

#include "kvseal_ops.h"
#include "vec.h"

#define SAMPLE_BLOCK 512       /* a multiple of 16 */
#define SAMPLE_MAX_BLOCKS 1024 /* 524,288 tokens: a larger vocabulary takes the torch path */

static inline v16 weights16(v16 x, float inv_t, float top) {
    const v16i removed = x == (v16){0} - INFINITY;
    const v16 w = exp_v16(x * inv_t - top);
    return (v16)(~removed & (v16i)w);
}

static inline v16 max16(v16 a, v16 b) {
    const v16i greater = a > b; /* lanes: -1 where true */
    return (v16)((greater & (v16i)a) | (~greater & (v16i)b));
}

static inline float weight1(float x, float inv_t, float top) { return x == -INFINITY ? 0.0f : exp_s(x * inv_t - top); }

/* A row's largest logit, NAN where the row has a NaN. */
#define DEFINE_TOP(NAME, T, LOAD16, AT)          \
    static float NAME(const T *x, int64_t n) {   \
        v16 most = (v16){0} - INFINITY;          \
        v16i nan = {0};                          \
        int64_t i = 0;                           \
        for (; i + 16 <= n; i += 16) {           \
            const v16 v = LOAD16(x + i);         \
            nan |= (v16i)(v != v);               \
            most = max16(most, v);               \
        }                                        \
        float top = -INFINITY;                   \
        for (int l = 0; l < 16; l++) {           \
            if (nan[l]) return NAN;              \
            top = most[l] > top ? most[l] : top; \
        }                                        \
        for (; i < n; i++) {                     \
            const float v = AT(x, i);            \
            if (v != v) return NAN;              \
            top = v > top ? v : top;             \
        }                                        \
        return top;                              \
    }

/* One row at temperature alone: the token drawn, or -1 where the row has a NaN, a +inf or no
   token of nonzero weight (the caller then takes the torch path, which answers those rows as torch does). */
#define DEFINE_DRAW(NAME, T, LOAD16, AT, TOP)                                                                  \
    static int64_t NAME(const T *x, int64_t n, float inv_t, double u) {                                        \
        double sums[SAMPLE_MAX_BLOCKS];                                                                        \
        const int64_t num_blocks = (n + SAMPLE_BLOCK - 1) / SAMPLE_BLOCK;                                      \
        float top = TOP(x, n);                                                                                 \
        if (top != top || isinf(top)) return -1;                                                               \
        top *= inv_t;                                                                                          \
        double total = 0.0;                                                                                    \
        for (int64_t b = 0; b < num_blocks; b++) {                                                             \
            const int64_t begin = b * SAMPLE_BLOCK, end = begin + SAMPLE_BLOCK < n ? begin + SAMPLE_BLOCK : n; \
            int64_t t = begin;                                                                                 \
            v16 acc = {0};                                                                                     \
            for (; t + 16 <= end; t += 16) acc += weights16(LOAD16(x + t), inv_t, top);                        \
            double sum = hsum8(fold16(acc));                                                                   \
            for (; t < end; t++) sum += weight1(AT(x, t), inv_t, top);                                         \
            sums[b] = sum;                                                                                     \
            total += sum;                                                                                      \
        }                                                                                                      \
        const double target = u * total;                                                                       \
        double before = 0.0;                                                                                   \
        int64_t b = 0, last_block = -1;                                                                        \
        for (; b < num_blocks; b++) {                                                                          \
            if (sums[b] > 0) last_block = b;                                                                   \
            if (before + sums[b] > target) break;                                                              \
            before += sums[b];                                                                                 \
        }                                                                                                      \
        if (last_block < 0) return -1;                                                                         \
        if (b == num_blocks) { /* rounding left the target at the total: the last block with mass */           \
            b = last_block;                                                                                    \
            before = total - sums[b];                                                                          \
        }                                                                                                      \
        const int64_t begin = b * SAMPLE_BLOCK, end = begin + SAMPLE_BLOCK < n ? begin + SAMPLE_BLOCK : n;     \
        int64_t last = -1;                                                                                     \
        for (int64_t t = begin; t < end; t++) {                                                                \
            const float w = weight1(AT(x, t), inv_t, top);                                                     \
            if (w > 0) {                                                                                       \
                last = t;                                                                                      \
                before += w;                                                                                   \
                if (before > target) return t;                                                                 \
            }                                                                                                  \
        }                                                                                                      \
        return last; /* rounding left the target past the block's own sum: its last token of mass */           \
    }
#define F32_AT(x, t) ((x)[t])
#define BF16_AT(x, t) widen_bf16_1((x)[t])
DEFINE_TOP(row_top, float, load16, F32_AT)
DEFINE_TOP(row_top_bf16, uint16_t, load16_bf16, BF16_AT)
DEFINE_DRAW(draw_row, float, load16, F32_AT, row_top)
DEFINE_DRAW(draw_row_bf16, uint16_t, load16_bf16, BF16_AT, row_top_bf16)

/* A row's weights into w [n]; returns their sum, or -1 where the row has a NaN or no weight. */
#define DEFINE_WEIGHTS(NAME, T, LOAD16, AT, TOP)                              \
    static double NAME(const T *x, int64_t n, float inv_t, float *w) {        \
        float top = TOP(x, n);                                                \
        if (top != top || isinf(top)) return -1.0;                            \
        top *= inv_t;                                                         \
        double total = 0.0;                                                   \
        for (int64_t b = 0; b < n; b += SAMPLE_BLOCK) {                       \
            const int64_t end = b + SAMPLE_BLOCK < n ? b + SAMPLE_BLOCK : n;  \
            int64_t t = b;                                                    \
            v16 acc = {0};                                                    \
            for (; t + 16 <= end; t += 16) {                                  \
                const v16 v = weights16(LOAD16(x + t), inv_t, top);           \
                store16(w + t, v);                                            \
                acc += v;                                                     \
            }                                                                 \
            double sum = hsum8(fold16(acc));                                  \
            for (; t < end; t++) sum += w[t] = weight1(AT(x, t), inv_t, top); \
            total += sum;                                                     \
        }                                                                     \
        return total > 0 ? total : -1.0;                                      \
    }
DEFINE_WEIGHTS(row_weights, float, load16, F32_AT, row_top)
DEFINE_WEIGHTS(row_weights_bf16, uint16_t, load16_bf16, BF16_AT, row_top_bf16)

#define NUCLEUS_BUCKETS 2048

static inline uint32_t weight_bits(float w) {
    uint32_t bits;
    memcpy(&bits, &w, sizeof bits);
    return bits;
}

/* The boundary bucket of a histogram walked from the heaviest bucket down: the first whose
   weight brings `*above` (the weight of the heavier buckets) to `want`, -1 if none does; an
   empty bucket is never the boundary. */
static int boundary_bucket(const double *mass, double want, double *above) {
    for (int b = NUCLEUS_BUCKETS - 1; b >= 0; b--) {
        if (mass[b] > 0 && *above + mass[b] >= want) return b;
        *above += mass[b];
    }
    return -1;
}

struct ranked {
    float w;
    int64_t i;
};

static int heavier_first(const void *a, const void *b) { /* weight descending, then index ascending */
    const struct ranked *x = a, *y = b;
    if (x->w != y->w) return x->w > y->w ? -1 : 1;
    return (x->i > y->i) - (x->i < y->i);
}

/* The draw over w [n] (sum `total`) cut to its top-p nucleus; -1 where memory runs out. */
static int64_t draw_nucleus(const float *w, int64_t n, double total, float top_p, double u) {
    const double want = (double)top_p * total;
    double mass[NUCLEUS_BUCKETS] = {0}, above = 0.0;
    for (int64_t i = 0; i < n; i++)
        if (w[i] > 0) mass[weight_bits(w[i]) >> 20] += w[i];
    /* the kept tokens: bits >> 9 above `key`, and those of `key` ranked up to (cut_w, cut_i) */
    uint32_t key = 0;
    float cut_w = 0.0f;
    int64_t cut_i = n;
    const int b1 = boundary_bucket(mass, want, &above);
    if (b1 >= 0) {
        memset(mass, 0, sizeof mass);
        for (int64_t i = 0; i < n; i++)
            if (w[i] > 0 && (int)(weight_bits(w[i]) >> 20) == b1) mass[(weight_bits(w[i]) >> 9) & 0x7FF] += w[i];
        const int b2 = boundary_bucket(mass, want, &above);
        key = ((uint32_t)b1 << 11) | (uint32_t)(b2 < 0 ? 0 : b2);
        int64_t count = 0;
        for (int64_t i = 0; i < n; i++) count += w[i] > 0 && weight_bits(w[i]) >> 9 == key;
        struct ranked *ties = malloc((size_t)(count > 0 ? count : 1) * sizeof *ties);
        if (ties == NULL) return -1;
        count = 0;
        for (int64_t i = 0; i < n; i++)
            if (w[i] > 0 && weight_bits(w[i]) >> 9 == key) ties[count++] = (struct ranked){w[i], i};
        qsort(ties, (size_t)count, sizeof *ties, heavier_first);
        for (int64_t j = 0; j < count && (above < want || above == 0.0); j++) { /* the heaviest always */
            above += ties[j].w;
            cut_w = ties[j].w;
            cut_i = ties[j].i;
        }
        if (cut_i == n) cut_w = INFINITY; /* none of this bucket is kept */
        free(ties);
    } /* else rounding: the buckets' sum never reached top_p of the total; every token is kept */
#define KEPT(i)                       \
    (w[i] > 0                         \
     && (weight_bits(w[i]) >> 9 > key \
         || (weight_bits(w[i]) >> 9 == key && (w[i] > cut_w || (w[i] == cut_w && (i) <= cut_i)))))
    double kept = 0.0;
    for (int64_t i = 0; i < n; i++)
        if (KEPT(i)) kept += w[i];
    const double target = u * kept;
    double before = 0.0;
    int64_t last = -1;
    for (int64_t i = 0; i < n; i++) {
        if (!KEPT(i)) continue;
        last = i;
        before += w[i];
        if (before > target) return i;
    }
#undef KEPT
    return last; /* rounding left the target at the kept total: the last kept token */
}

/* One row: temperature alone in one pass, or with top-p through a buffer of its weights. */
static int64_t draw_one(const void *x, int bf16, int64_t n, float inv_t, float top_p, double u) {
    if (top_p >= 1.0f) return bf16 ? draw_row_bf16(x, n, inv_t, u) : draw_row(x, n, inv_t, u);
    float *w = malloc((size_t)n * sizeof *w);
    if (w == NULL) return -1;
    const double total = bf16 ? row_weights_bf16(x, n, inv_t, w) : row_weights(x, n, inv_t, w);
    const int64_t token = total > 0 ? draw_nucleus(w, n, total, top_p, u) : -1;
    free(w);
    return token;
}

static int draw_rows(const void *x, int bf16, int64_t rows, int64_t n, const float *inv_temperature, const float *top_p,
                     const double *u, int64_t *out, int num_threads) {
    if ((n + SAMPLE_BLOCK - 1) / SAMPLE_BLOCK > SAMPLE_MAX_BLOCKS) return -1;
    const size_t row_bytes = (size_t)n * (bf16 ? sizeof(uint16_t) : sizeof(float));
    int failed = 0;
#pragma omp parallel for num_threads(rows >= 2 ? num_threads : 1) schedule(static) reduction(| : failed)
    for (int64_t r = 0; r < rows; r++) {
        out[r] = draw_one((const char *)x + (size_t)r * row_bytes, bf16, n, inv_temperature[r], top_p[r], u[r]);
        failed |= out[r] < 0;
    }
    return failed ? -1 : 0;
}

int kvseal_draw_rows(const float *x, int64_t rows, int64_t n, const float *inv_temperature, const float *top_p,
                     const double *u, int64_t *out, int num_threads) {
    return draw_rows(x, 0, rows, n, inv_temperature, top_p, u, out, num_threads);
}

int kvseal_draw_rows_bf16(const uint16_t *x, int64_t rows, int64_t n, const float *inv_temperature, const float *top_p,
                          const double *u, int64_t *out, int num_threads) {
    return draw_rows(x, 1, rows, n, inv_temperature, top_p, u, out, num_threads);
}
