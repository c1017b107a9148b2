/* Causal attention of prefill chunks: chunks that start at position 0 ("fresh"), and one chunk
 * that continues a cached prefix.
 *
 * What it reads. A fresh chunk attends only to its own tokens, so the kernel reads the fused qkv
 * rows of the forward in place (after RoPE) instead of the pool: for one group of equal-length
 * chunks, the q, K and V columns of each chunk's own rows, and nothing else (no pool, no other
 * chunk's or sequence's rows). A chunk after a cached prefix also reads its sequence's own pool
 * slots 0..prefix-1 through its own pages (fresh_kv is the one place a key or value is
 * addressed). It writes each chunk's output rows in place and no other row. Tests:
 * tests/ops/test_prefill_attention.py, with every other row of qkv and slot of the pool NaN.
 *
 * How it blocks (float32). Like the panel linears: each (chunk, KV head)'s K^T is packed once
 * into 16-key panels shared by the group's query heads; scores for 6 query rows x 16 keys run in
 * 12 accumulators (q broadcast), 12 x 16 in 16-lane vectors where the build targets AVX-512; a
 * query block computes only the key panels it can causally see; O = P V runs as 6 (12) rows x
 * 16 features over V packed the same way (16-feature panels, keys in order: ~4% faster than
 * reading V in place at its 3,840-byte row stride), two 16-feature panels a pass with AVX-512.
 * Tasks are (chunk, KV head, query block), each (chunk, KV head)'s blocks heaviest first, so the
 * last tasks are the light ones. It replaces gathered q/k/v and a causal SDPA.
 *
 * bfloat16 rows (kvseal_prefill_attention_bf16, where the build has AVX512-BF16). K is packed in
 * head-dim pairs (the tile layout, each pair moved as one 32-bit word) and the scores are
 * AVX512-BF16 dot products with q copied a row at a time; the softmax and P V are float32 over V
 * widened exactly, each output rounded once. Where the tile linears run on AMX and head_dim is a
 * multiple of 64 it runs on AMX tiles instead (fresh_block_amx): blocks of 16 query rows of one
 * head, the scores as 16 x 16 C tiles over the same K panels (already the B-tile layout), the
 * scale, causal softmax and rounding of the probabilities to bfloat16 in one row pass (as SDPA's
 * flash attention rounds them on these CPUs), P V against V packed per chunk and KV head into B
 * tiles of 32 keys x 16 features, each output scaled by 1 / sum and rounded once: 60 against
 * SDPA's 92 ms for a 2,048-token step's 30 layers. Without AMX the dot-product kernel takes
 * under half of SDPA's bfloat16 time. (For other head dims on AMX hosts SDPA is the faster and
 * the ops layer sends those chunks there, NativeOps.sdpa_leads_fresh_prefill in
 * kvseal/ops/native_backend.py; a build without AVX512-BF16 runs the float32 kernel on rows
 * widened once per layer.)
 *
 * One driver (fresh_attention) runs every variant: a pack and a block function, the block's row
 * count and the per-thread tile set-up per kernel (struct fresh_kernel).
 *
 * Called by NativeOps.fresh_attention and NativeOps.prefix_attention (kvseal/ops/native_backend.py);
 * dtypes and head sizes these kernels do not take run torch's SDPA (kvseal/ops/torch_attention.py). */

#include "kvseal_ops.h"
#include "tiles.h"
#include "vec.h"

/* Query rows per block: 6 rows x 16 keys or features in 12 8-lane accumulators (AVX2), 12 rows
   x 16 in 12 16-lane ones where the build targets AVX-512 (half the instructions a block). */
#if KVSEAL_AVX512F
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
static void pack_query_block(const float *q, int64_t row_stride, int64_t mr, int64_t head_dim, float scale, float *qb) {
    for (int64_t i = 0; i < FRESH_ROWS; i++) {
        if (i >= mr) {
            memset(qb + i * head_dim, 0, head_dim * sizeof(float));
            continue;
        }
        for (int64_t d = 0; d < head_dim; d++) qb[i * head_dim + d] = scale * q[i * row_stride + d];
    }
}

#if KVSEAL_AVX512F
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
                                                                 const float *panel1, int64_t k_in, v16 *a0, v16 *a1) {
    for (int i = 0; i < FRESH_ROWS; i++) {
        a0[i] = (v16){0};
        a1[i] = (v16){0};
    }
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
static void block_scores(const float *qb, const float *panels, int64_t count, int64_t head_dim, float *s, int64_t lds) {
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
    for (int i = 0; i < FRESH_ROWS; i++) {
        a0[i] = (v8){0};
        a1[i] = (v8){0};
    }
    for (int64_t k = 0; k < k_in; k++) {
        const v8 w0 = load8(panel + k * 16), w1 = load8(panel + k * 16 + 8);
        for (int i = 0; i < FRESH_ROWS; i++) {
            const float s = x[i * ldx + k];
            a0[i] += s * w0;
            a1[i] += s * w1;
        }
    }
}

/* s [FRESH_ROWS][lds] = qb . K^T over key panels 0..count-1. */
static void block_scores(const float *qb, const float *panels, int64_t count, int64_t head_dim, float *s, int64_t lds) {
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
    for (t = 0; t < whole; t += VL) {
        const vl e = exp_vl(load_vl(s + t) - top);
        store_vl(s + t, e);
        acc += e;
    }
    if (t < seen) { /* the last, partial vector: lanes past pos are masked to exactly 0 */
        vli lane;
        for (int i = 0; i < VL; i++) lane[i] = i;
        const vli keep = lane < (vli){0} + (int32_t)(seen - t);
        const vl e = (vl)(keep & (vli)exp_vl(load_vl(s + t) - top));
        store_vl(s + t, e);
        acc += e;
        t += VL;
    }
    for (; t < n; t += VL) store_vl(s + t, (vl){0});
    return 1.0f / hsum_vl(acc);
}

/* Rows 0..mr-1 of out (out_stride apart) = inv[i] * sum over t < n of p[i][t] * V[t], V as the
   panels of pack_panels_f32 (`length` keys each), 16 features at a time; a last panel of 8
   features (head_dim % 16 == 8) stores only those 8. */
static void block_values(const float *p, int64_t lds, const float *vp, int64_t length, int64_t n, int64_t head_dim,
                         const float *inv, int64_t mr, float *out, int64_t out_stride) {
    int64_t f = 0;
#if KVSEAL_AVX512F
    for (; f + 32 <= head_dim; f += 32) { /* two panels a pass: half the broadcasts of p */
        v16 a0[FRESH_ROWS], a1[FRESH_ROWS];
        block_rows_x32(p, lds, vp + f * length, vp + (f + 16) * length, n, a0, a1);
        for (int64_t i = 0; i < mr; i++) {
            store16(out + i * out_stride + f, a0[i] * inv[i]);
            store16(out + i * out_stride + f + 16, a1[i] * inv[i]);
        }
    }
#endif
    for (; f < head_dim; f += 16) {
#if KVSEAL_AVX512F
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
    const int64_t n = sh->prefix + first + mr; /* the keys the block's last row sees */
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
static void pack_panels_f32(const struct fresh_shape *sh, const void *qkv, int64_t start, int64_t kvh, void *panels_out,
                            float *vpanels) {
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
    int64_t key_bytes, scratch_floats; /* scratch: per block row, scratch_floats x head_dim + 2 x lds floats */
    int64_t rows;                      /* query rows a block */
    int64_t (*vpanel_floats)(int64_t keys, int64_t head_dim); /* a (chunk, KV head)'s packed V */
    int (*begin)(void); /* per thread before its blocks (NULL: nothing); returns 1 if end must run */
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
    if (sh.prefix > 0 && num_chunks != 1) return -3; /* one table: one chunk after a prefix a call */
    char *panels = malloc(pairs * panel_bytes);
    float *vpanels = malloc(sizeof(float) * pairs * vpanel_floats);
    if (panels == NULL || vpanels == NULL) {
        free(panels);
        free(vpanels);
        return -1;
    }
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
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
    free(panels);
    free(vpanels);
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
                             float *out, int64_t prefix, const int64_t *table, const float *k_pool, const float *v_pool,
                             int64_t head_stride, int64_t page_size, int num_threads) {
    static const struct fresh_kernel f32 = {pack_panels_f32, fresh_block,   sizeof(float), 1,
                                            FRESH_ROWS,      float_vpanels, NULL,          NULL};
    const int64_t keys = prefix + length;
    const struct fresh_shape sh = {row_stride,
                                   length,
                                   num_heads,
                                   kv_heads,
                                   head_dim,
                                   (keys + 15) / 16 * 16,
                                   scale,
                                   prefix,
                                   head_stride,
                                   page_size,
                                   table,
                                   (const char *)k_pool,
                                   (const char *)v_pool};
    return fresh_attention(&f32, &sh, qkv, starts, num_chunks, out, num_threads);
}

#if KVSEAL_AVX512BF16
/* The bfloat16 twin: K as 16-key panels of head-dim pairs ([ceil(length / 16)][head_dim / 2][16][2],
   the tile layout, zero past the last key) for VDPBF16PS, V widened into float32 panels. */
static void pack_key_panels_bf16(const struct fresh_shape *sh, const void *qkv, int64_t start, int64_t kvh,
                                 void *panels_out) {
    const int64_t keys = sh->prefix + sh->length, hd = sh->head_dim;
    uint32_t *pairs = panels_out; /* a head-dim pair (two bfloat16) is one 32-bit word */
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
static void fresh_block_bf16(const struct fresh_shape *sh, const void *qkv_rows, int64_t start, int64_t kvh, int64_t b,
                             const void *panels_in, const float *vpanels, float *scratch, void *out_rows) {
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

#if KVSEAL_AMX
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
static void pack_panels_amx(const struct fresh_shape *sh, const void *qkv, int64_t start, int64_t kvh, void *panels_out,
                            float *vpanels) {
    const int64_t keys = sh->prefix + sh->length, hd = sh->head_dim, fts = hd / 16;
    pack_key_panels_bf16(sh, qkv, start, kvh, panels_out);
    uint16_t *tiles = (uint16_t *)vpanels;
    /* lanes 2c and 2c + 1 of a tile row: feature c of the even key, then of the odd key */
    const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                           21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
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
    if (t < seen) { /* the last, partial vector: lanes past pos are exactly 0 */
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
static void fresh_block_amx(const struct fresh_shape *sh, const void *qkv_rows, int64_t start, int64_t kvh, int64_t b,
                            const void *panels_in, const float *vpanels, float *scratch, void *out_rows) {
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
        for (int64_t p = 0; p < key_panels; p += 4) { /* four independent sums in flight */
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
                if (count > 1) {
                    _tile_loadd(7, k + hd * 16 + kb * 512, 64);
                    _tile_dpbf16ps(1, 4, 7);
                }
                if (count > 2) {
                    _tile_loadd(6, k + 2 * hd * 16 + kb * 512, 64);
                    _tile_dpbf16ps(2, 4, 6);
                }
                if (count > 3) {
                    _tile_loadd(7, k + 3 * hd * 16 + kb * 512, 64);
                    _tile_dpbf16ps(3, 4, 7);
                }
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
int kvseal_prefill_attention_bf16(const uint16_t *qkv, int64_t row_stride, const int64_t *starts, int64_t num_chunks,
                                  int64_t length, int64_t num_heads, int64_t kv_heads, int64_t head_dim, float scale,
                                  uint16_t *out, int64_t prefix, const int64_t *table, const uint16_t *k_pool,
                                  const uint16_t *v_pool, int64_t head_stride, int64_t page_size, int num_threads) {
    static const struct fresh_kernel bf16 = {
        pack_panels_bf16, fresh_block_bf16, sizeof(uint16_t), 2, FRESH_ROWS, float_vpanels, NULL, NULL};
    const int64_t keys = prefix + length;
    struct fresh_shape sh = {row_stride,
                             length,
                             num_heads,
                             kv_heads,
                             head_dim,
                             (keys + 15) / 16 * 16,
                             scale,
                             prefix,
                             head_stride,
                             page_size,
                             table,
                             (const char *)k_pool,
                             (const char *)v_pool};
#if KVSEAL_AMX
    static const struct fresh_kernel amx = {pack_panels_amx, fresh_block_amx, sizeof(uint16_t), 2,
                                            AMX_FRESH_ROWS,  amx_vpanels,     amx_fresh_begin,  tile_release};
    if (kvseal_amx_linears && head_dim % 64 == 0) {
        sh.lds = (keys + 31) / 32 * 32; /* the probabilities are read as tiles of 32 keys */
        return fresh_attention(&amx, &sh, qkv, starts, num_chunks, out, num_threads);
    }
#endif
    return fresh_attention(&bf16, &sh, qkv, starts, num_chunks, out, num_threads);
}
#else
int kvseal_prefill_attention_bf16(const uint16_t *qkv, int64_t row_stride, const int64_t *starts, int64_t num_chunks,
                                  int64_t length, int64_t num_heads, int64_t kv_heads, int64_t head_dim, float scale,
                                  uint16_t *out, int64_t prefix, const int64_t *table, const uint16_t *k_pool,
                                  const uint16_t *v_pool, int64_t head_stride, int64_t page_size, int num_threads) {
    (void)qkv;
    (void)row_stride;
    (void)starts;
    (void)num_chunks;
    (void)length;
    (void)num_heads;
    (void)kv_heads;
    (void)head_dim;
    (void)scale;
    (void)out;
    (void)prefix;
    (void)table;
    (void)k_pool;
    (void)v_pool;
    (void)head_stride;
    (void)page_size;
    (void)num_threads;
    return -2;
}
#endif
