/* kvseal's native kernels: every function Python may call, and nothing else.
 *
 * The library is built at first start (kvseal/ops/native_build.py) with cffi in API mode: the
 * binding's declarations are this file's (everything below but the preprocessor lines, plus the
 * KVSEAL_ integer #defines), and every kernel source includes it, so a definition that disagrees
 * with its declaration here (an argument's type, their count, the result) fails to compile, and
 * the generated wrapper calls each function through this prototype. From Python a wrong
 * argument count or type (a float32 tensor's pointer where bfloat16 is declared) raises
 * TypeError.
 *
 * Conventions: tensors are passed as pointers to their first element and sizes in elements;
 * rows are contiguous unless a stride is given; bfloat16 is uint16_t (the top half of a
 * float32). num_threads / threads: the OpenMP threads a call may use (torch's own runtime,
 * torch.get_num_threads()). A kernel never reads or writes outside what its comment names.
 * Each family's blocking, what it reads and why is at the top of its source file. */
#ifndef KVSEAL_OPS_H
#define KVSEAL_OPS_H

#include <stdint.h>

/* ---- decode attention over the paged pool (decode_attention.c) ---- */

/* q, out: [rows, kv_heads * group, head_dim]; k, v: one layer of the pool, [kv_heads, num_pages,
   page_size, head_dim]; tables: [rows, table_width] page ids; context_lens: [rows], each >= 1
   and covered by its table. Row b reads its own pages' slots 0..context_lens[b]-1 and nothing
   else. Returns 0, or -1 if scratch memory could not be allocated. */
int kvseal_decode_attention(const float *q, const float *k, const float *v, const int64_t *tables,
                            const int64_t *context_lens, float *out, int64_t rows, int64_t kv_heads, int64_t group,
                            int64_t head_dim, int64_t num_pages, int64_t page_size, int64_t table_width,
                            int64_t max_context, float scale, int num_threads);

/* Where kvseal_decode_attention_bf16 computes its scores: on AMX tiles where the process may use
   them (else as DOT); by AVX512-BF16 dot products where the build has them (else as WIDENED);
   in float32 vectors over K widened a page at a time. */
#define KVSEAL_SCORES_WIDENED 0
#define KVSEAL_SCORES_DOT 1
#define KVSEAL_SCORES_AMX 2

/* The same over a bfloat16 pool: bfloat16 query rows (row b at q + b * q_stride, its heads
   contiguous) and output rows (out + b * out_stride), each output rounded once. Returns as
   kvseal_decode_attention. */
int kvseal_decode_attention_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k, const uint16_t *v,
                                 const int64_t *tables, const int64_t *context_lens, uint16_t *out, int64_t out_stride,
                                 int64_t rows, int64_t kv_heads, int64_t group, int64_t head_dim, int64_t num_pages,
                                 int64_t page_size, int64_t table_width, int64_t max_context, float scale, int scores,
                                 int num_threads);

/* ---- prefill attention: fresh chunks, and one chunk after a cached prefix (prefill_attention.c) ---- */

/* qkv: [rows, row_stride], each row its token's q heads, K heads and V heads (head_dim each,
   after RoPE); starts: [num_chunks] the first row of each chunk, each `length` rows at
   positions prefix..prefix+length-1. out: [rows, num_heads * head_dim]; the chunks' rows are
   written, no other row. head_dim a multiple of 8, num_heads a multiple of kv_heads. With
   prefix > 0 (one chunk only) the chunk also attends to its sequence's pool slots
   0..prefix-1 through its own pages (`table`) in one layer k_pool / v_pool ([kv_heads, pages,
   page_size, head_dim], head_stride elements a KV head); with prefix 0 table, k_pool and v_pool
   are not read (NULL). A chunk reads its own rows of qkv and its own prefix slots, nothing else.
   Returns 0; -1 if scratch memory could not be allocated (out is then incomplete); -3 for a
   prefix with several chunks. */
int kvseal_prefill_attention(const float *qkv, int64_t row_stride, const int64_t *starts, int64_t num_chunks,
                             int64_t length, int64_t num_heads, int64_t kv_heads, int64_t head_dim, float scale,
                             float *out, int64_t prefix, const int64_t *table, const float *k_pool, const float *v_pool,
                             int64_t head_stride, int64_t page_size, int num_threads);

/* The same over bfloat16 rows and pool; -2 where the build has no AVX512-BF16 (nothing computed). */
int kvseal_prefill_attention_bf16(const uint16_t *qkv, int64_t row_stride, const int64_t *starts, int64_t num_chunks,
                                  int64_t length, int64_t num_heads, int64_t kv_heads, int64_t head_dim, float scale,
                                  uint16_t *out, int64_t prefix, const int64_t *table, const uint16_t *k_pool,
                                  const uint16_t *v_pool, int64_t head_stride, int64_t page_size, int num_threads);

/* ---- linears over 16-feature column panels (linear_panels.c, linear_int8.c) ---- */

/* w: [n_out, k_in] float32 row-major (nn.Linear's layout) -> panels [ceil(n_out / 16)][k_in][16],
   zero-padded: float32, bfloat16 (rounded to nearest even) or, from int8 w, int8. */
void kvseal_pack_panels_f32(const float *w, float *panels, int64_t n_out, int64_t k_in);
void kvseal_pack_panels_bf16(const float *w, uint16_t *panels, int64_t n_out, int64_t k_in);
void kvseal_pack_panels_i8(const int8_t *w, int8_t *panels, int64_t n_out, int64_t k_in);

/* y [rows, n_out] = x [rows, k_in] . W^T (+ bias [n_out] unless NULL), float32 arithmetic, W as
   panels. Returns 0, or -1 if a widening buffer could not be allocated (nothing computed). */
int kvseal_linear_f32(const float *x, const float *panels, const float *bias, float *y, int64_t rows, int64_t n_out,
                      int64_t k_in, int num_threads);
int kvseal_linear_bf16(const float *x, const uint16_t *panels, const float *bias, float *y, int64_t rows, int64_t n_out,
                       int64_t k_in, int num_threads);

/* act [rows, inter] = silu(x W_gate^T) * (x W_up^T) in one pass over float32 panels of the fused
   [2 * inter, k_in] gate/up weight, bit-equal to kvseal_linear_f32 then kvseal_silu_mul. Returns
   -1, computing nothing, unless inter % 16 == 0, bias is NULL and rows > 1; else 0. */
int kvseal_linear_silu_f32(const float *x, const float *panels, const float *bias, float *act, int64_t rows,
                           int64_t inter, int64_t k_in, int num_threads);

/* y [rows, n_out] = (x [rows, k_in] . Q^T) * scale [n_out] (+ bias [n_out] unless NULL), Q as
   int8 panels, float32 arithmetic. */
void kvseal_linear_i8(const float *x, const int8_t *panels, const float *scale, const float *bias, float *y,
                      int64_t rows, int64_t n_out, int64_t k_in, int num_threads);

/* ---- bfloat16 linears over AMX's tile layout (linear_tiles.c, dispatch.c) ---- */

/* What runs the tile linears (and the AMX paths of the attention kernels). */
#define KVSEAL_TILES_NONE 0   /* neither: the tile linears answer -1 */
#define KVSEAL_TILES_AVX512 1 /* AVX512-BF16 dot products over the tiles */
#define KVSEAL_TILES_AMX 2    /* AMX tiles */

/* Asks the kernel for AMX tile data for this process where the build targets AMX; the engine
   the tile linears run on from now on. Called once, when the library is loaded. */
int kvseal_tiles_init(void);
/* engine KVSEAL_TILES_AVX512: run on the dot products even where AMX is permitted (tests cover
   both engines on an AMX host); KVSEAL_TILES_AMX: on AMX where permitted. Returns the engine now
   in use. Not while a kernel runs. */
int kvseal_tiles_engine(int engine);

/* w [n_out, k_in] bfloat16 row-major, k_in a multiple of 32 -> tiles [ceil(n_out / 16)][k_in /
   32][16 k-pairs][16 outputs][2], zero past n_out. */
void kvseal_pack_tiles(const uint16_t *w, uint16_t *packed, int64_t n_out, int64_t k_in);
/* y [rows, n_out] = x [rows, k_in] . W^T (+ bias [n_out] unless NULL), bfloat16 in and out,
   float32 sums each rounded once. Returns 0, or -1 where the build has no tile engine. */
/* kvseal_linear_tiles into y, then kvseal_add_rms_norm_bf16(h, y, weight, eps, out): bit-equal
   to the two calls, from 256 rows with the rows split between the threads so that each adds
   and norms the rows it just computed. Returns 0, or -1 where the build has no tile engine. */
int kvseal_linear_tiles_add_norm_bf16(const uint16_t *x, const uint16_t *packed, const uint16_t *bias, uint16_t *y,
                                      uint16_t *h, const uint16_t *weight, float eps, uint16_t *out, int64_t rows,
                                      int64_t n_out, int64_t k_in, int num_threads);
int kvseal_linear_tiles(const uint16_t *x, const uint16_t *packed, const uint16_t *bias, uint16_t *y, int64_t rows,
                        int64_t n_out, int64_t k_in, int num_threads);
/* kvseal_linear_tiles with the float32 sums (+ bias [n_out] float32 unless NULL) written as
   they are, never rounded: y [rows, n_out] float32. Each output rounded to bfloat16 is
   kvseal_linear_tiles' (with the bias rounded to bfloat16). A tensor-parallel rank's
   row-parallel partial sums, added over the ranks before their one rounding. Returns 0, or -1
   where the build has no tile engine. */
int kvseal_linear_tiles_f32(const uint16_t *x, const uint16_t *packed, const float *bias, float *y, int64_t rows,
                            int64_t n_out, int64_t k_in, int num_threads);
/* act [rows, inter] = silu(x W_gate^T) * (x W_up^T) over tiles of the fused [2 * inter, k_in]
   gate/up weight, bit-equal to kvseal_linear_tiles then kvseal_silu_mul_bf16. Returns -1,
   computing nothing, unless inter % 16 == 0 and the build has a tile engine; else 0. */
int kvseal_linear_silu_tiles(const uint16_t *x, const uint16_t *packed, uint16_t *act, int64_t rows, int64_t inter,
                             int64_t k_in, int num_threads);

/* ---- bfloat16 linears at one row over a GGUF's Q4_1 blocks (linear_q4.c) ---- */

/* blocks: a weight [n_out, k_in] as GGUF Q4_1 blocks, [n_out][k_in / 32] of 20 bytes (float16 d,
   float16 m, 16 bytes: q[j] in the low nibble of byte j, q[j + 16] in its high one; w = d * q +
   m), k_in a multiple of 32 -> packed [ceil(n_out / 16)][k_in / 32] blocks of 320 bytes (16
   features x 32 k; linear_q4.c gives the layout), zero past n_out. */
void kvseal_pack_q4_1(const uint8_t *blocks, uint8_t *packed, int64_t n_out, int64_t k_in);
/* y [1, n_out] = x [1, k_in] . W^T (+ bias [n_out] unless NULL), W the bfloat16 weights
   bfloat16(d * q + m) (finite d, m) of packed blocks: bit-equal to kvseal_linear_tiles at one
   row over those weights' tiles on the AVX512-BF16 engine. Returns 0; -1, computing nothing,
   where the tile linears run on AMX or the build has no AVX512-BF16 (the caller runs the tiles). */
int kvseal_linear_q4_1_row(const uint16_t *x, const uint8_t *packed, const uint16_t *bias, uint16_t *y, int64_t n_out,
                           int64_t k_in, int num_threads);
/* kvseal_linear_q4_1_row with the float32 sums (+ bias [n_out] float32 unless NULL) written as
   they are, never rounded: kvseal_linear_tiles_f32's at one row, bit for bit (the tests compare
   the sums themselves, which a rounding to bfloat16 would mostly hide). Returns as
   kvseal_linear_q4_1_row. */
int kvseal_linear_q4_1_row_f32(const uint16_t *x, const uint8_t *packed, const float *bias, float *y, int64_t n_out,
                               int64_t k_in, int num_threads);
/* act [1, inter] = silu(x W_gate^T) * (x W_up^T) over the packed blocks of the fused [2 * inter,
   k_in] gate/up weight: bit-equal to kvseal_linear_silu_tiles at one row on the AVX512-BF16
   engine. Returns -1, computing nothing, where kvseal_linear_q4_1_row does or inter % 16 != 0;
   else 0. */
int kvseal_linear_silu_q4_1_row(const uint16_t *x, const uint8_t *packed, uint16_t *act, int64_t inter, int64_t k_in,
                                int num_threads);

/* ---- bfloat16 linears at one row over a GGUF's Q8_0 blocks (linear_q8.c): the lm_head ---- */

/* blocks: a weight [n_out, k_in] as GGUF Q8_0 blocks, [n_out][k_in / 32] of 34 bytes (float16 d,
   32 int8 q; w = d * q), k_in a multiple of 32 -> packed [ceil(n_out / 16)][k_in / 32] blocks of
   544 bytes (16 features x 32 k; linear_q8.c gives the layout), zero past n_out. */
void kvseal_pack_q8_0(const uint8_t *blocks, uint8_t *packed, int64_t n_out, int64_t k_in);
/* y [1, n_out] = x [1, k_in] . W^T (+ bias [n_out] unless NULL), W the bfloat16 weights
   bfloat16(d * q) (finite d) of packed blocks: bit-equal to kvseal_linear_tiles at one row over
   those weights' tiles on the AVX512-BF16 engine. Returns 0; -1, computing nothing, where the tile
   linears run on AMX or the build has no AVX512-BF16 (the caller runs the tiles). */
int kvseal_linear_q8_0_row(const uint16_t *x, const uint8_t *packed, const uint16_t *bias, uint16_t *y, int64_t n_out,
                           int64_t k_in, int num_threads);
/* kvseal_linear_q8_0_row with the float32 sums (+ bias [n_out] float32 unless NULL) written as
   they are, never rounded: kvseal_linear_tiles_f32's at one row, bit for bit. Returns as
   kvseal_linear_q8_0_row. */
int kvseal_linear_q8_0_row_f32(const uint16_t *x, const uint8_t *packed, const float *bias, float *y, int64_t n_out,
                               int64_t k_in, int num_threads);

/* ---- fused per-layer ops (layer_ops.c) ---- */

/* h [rows, dim] += delta (unless NULL), in place; out [rows, dim] = h / sqrt(mean(h^2) + eps) *
   weight. The bfloat16 twin rounds where transformers' bfloat16 RMSNorm rounds. */
void kvseal_add_rms_norm(float *h, const float *delta, const float *weight, float eps, float *out, int64_t rows,
                         int64_t dim, int num_threads);
void kvseal_add_rms_norm_bf16(uint16_t *h, const uint16_t *delta, const uint16_t *weight, float eps, uint16_t *out,
                              int64_t rows, int64_t dim, int num_threads);

/* gate_up [rows, 2 * inter] (gate, then up) -> out [rows, inter] = silu(gate) * up. */
void kvseal_silu_mul(const float *gate_up, float *out, int64_t rows, int64_t inter, int num_threads);
void kvseal_silu_mul_bf16(const uint16_t *gate_up, uint16_t *out, int64_t rows, int64_t inter, int num_threads);

/* Rotate-half RoPE in place on the first `heads` heads of each row of qkv [rows, row_stride]:
   x * cos + roll(x, head_dim / 2) * signed_sin, cos and signed_sin [rows, head_dim]. */
void kvseal_rope(float *qkv, const float *cos, const float *signed_sin, int64_t rows, int64_t row_stride, int64_t heads,
                 int64_t head_dim);
void kvseal_rope_bf16(uint16_t *qkv, const uint16_t *cos, const uint16_t *signed_sin, int64_t rows, int64_t row_stride,
                      int64_t heads, int64_t head_dim, int num_threads);

/* Store rows of K and V (k_new, v_new: rows row_stride apart, kv_heads * head_dim each) into one
   pool layer [kv_heads, num_slots, head_dim] at slots [rows]. Returns -1, writing nothing, if a
   slot is outside the layer; else 0. */
int kvseal_write_slots(const float *k_new, const float *v_new, int64_t row_stride, const int64_t *slots, float *k_pool,
                       float *v_pool, int64_t rows, int64_t kv_heads, int64_t head_dim, int64_t num_slots);
int kvseal_write_slots_bf16(const uint16_t *k_new, const uint16_t *v_new, int64_t row_stride, const int64_t *slots,
                            uint16_t *k_pool, uint16_t *v_pool, int64_t rows, int64_t kv_heads, int64_t head_dim,
                            int64_t num_slots);

/* ---- every decoder layer of a decode-only step in one call (decode_loop.c) ---- */

/* The pointer table of kvseal_decode_layers: KVSEAL_LAYER_POINTERS per layer, in this order.
   Weights are the linears' panels (or tiles); scales NULL but for int8 panels; biases NULL
   where the linear has none; the norms' weights; the layer's K and V pool; a bfloat16 model's
   linears' Q4_1 blocks (kvseal_pack_q4_1), NULL where it has none (the float32 loop reads none):
   the bfloat16 loops multiply one row by them (kvseal_linear_q4_1_row), else by the tiles. */
enum kvseal_layer_pointer {
    KVSEAL_W_QKV,
    KVSEAL_S_QKV,
    KVSEAL_B_QKV,
    KVSEAL_W_O,
    KVSEAL_S_O,
    KVSEAL_B_O,
    KVSEAL_W_GATE_UP,
    KVSEAL_S_GATE_UP,
    KVSEAL_B_GATE_UP,
    KVSEAL_W_DOWN,
    KVSEAL_S_DOWN,
    KVSEAL_B_DOWN,
    KVSEAL_INPUT_NORM,
    KVSEAL_POST_NORM,
    KVSEAL_K_POOL,
    KVSEAL_V_POOL,
    KVSEAL_Q4_QKV,
    KVSEAL_Q4_O,
    KVSEAL_Q4_GATE_UP,
    KVSEAL_Q4_DOWN,
    KVSEAL_LAYER_POINTERS
};

/* The weights of a float32 model's linears (kvseal_decode_layers' `kind`). */
enum kvseal_panel_kind { KVSEAL_PANELS_F32, KVSEAL_PANELS_BF16, KVSEAL_PANELS_I8 };

/* The sizes of one decode-only step. */
struct kvseal_decode_step {
    int64_t num_layers, rows, hidden, heads, kv_heads, head_dim, inter;
    int64_t num_pages, page_size, table_width, max_context;
    float eps, scale;
    int threads;
};

/* Every layer of a float32 model whose linears are panels of one kind: h [rows, hidden] the
   embedded tokens in, the residual stream out; x [rows, hidden] the final-normed stream out.
   Scratch: qkv [rows, heads * head_dim + 2 * kv_heads * head_dim], q and attn [rows, heads *
   head_dim], tmp [rows, hidden], gate_up [rows, 2 * inter], act [rows, inter]. cos,
   signed_sin: [rows, head_dim]; slots [rows]: where each row's K and V go; tables,
   context_lens: as kvseal_decode_attention. The same kernels as the per-layer forward, in the
   same order, so the result is bit-equal to it. *layers_written counts the layers whose K and
   V were stored. Returns 0; -1 if a slot is outside the pool (nothing written in that layer);
   -2 if a kernel could not allocate its scratch. */
int kvseal_decode_layers(int kind, const struct kvseal_decode_step *step, const void *const *layers,
                         const float *final_norm, float *h, float *x, float *qkv, float *q, float *attn, float *tmp,
                         float *gate_up, float *act, const float *cos, const float *signed_sin, const int64_t *slots,
                         const int64_t *tables, const int64_t *context_lens, int64_t *layers_written);

/* The same for a bfloat16 model whose linears are tiles (no scales): every buffer bfloat16 and
   no q scratch (decode attention reads q in place from the qkv rows). */
int kvseal_decode_layers_bf16(const struct kvseal_decode_step *step, const void *const *layers,
                              const uint16_t *final_norm, uint16_t *h, uint16_t *x, uint16_t *qkv, uint16_t *attn,
                              uint16_t *tmp, uint16_t *gate_up, uint16_t *act, const uint16_t *cos,
                              const uint16_t *signed_sin, const int64_t *slots, const int64_t *tables,
                              const int64_t *context_lens, int64_t *layers_written);

/* A prefill step: fresh chunks in num_groups groups, group g groups[2g] chunks of groups[2g + 1]
   rows each (starts: every chunk's first row, group by group), and num_spans chunks that continue
   a cached prefix (span s: spans[4s .. 4s + 3] = its first row, its rows, its prefix's slots, the
   offset of its pages in span_pages), over the rows after num_decodes decode rows (tables,
   context_lens and the
   step's table_width, max_context as kvseal_decode_layers_bf16; NULL and 0 for none), in the
   bfloat16 loop's buffers plus gate_up [rows, 2 * inter]
   (used where the gate/up has a bias) and the last layer's sampled rows: sampled [num_sampled]
   row indices, hs and xs [num_sampled, hidden] (xs: the final-normed stream out; qkv must hold
   num_sampled x heads * head_dim). Returns as kvseal_decode_layers_bf16. */
int kvseal_prefill_layers_bf16(const struct kvseal_decode_step *step, const void *const *layers,
                               const uint16_t *final_norm, uint16_t *h, uint16_t *x, uint16_t *qkv, uint16_t *attn,
                               uint16_t *tmp, uint16_t *gate_up, uint16_t *act, const uint16_t *cos,
                               const uint16_t *signed_sin, const int64_t *slots, int64_t num_decodes,
                               const int64_t *tables, const int64_t *context_lens, const int64_t *starts,
                               const int64_t *groups, int64_t num_groups, const int64_t *spans, int64_t num_spans,
                               const int64_t *span_pages, const int64_t *sampled, int64_t num_sampled, uint16_t *hs,
                               uint16_t *xs, int64_t *layers_written);

/* ---- the always-on isolation check and the write records' growth (records.c) ---- */

/* The write records of kvseal/kvcache/records.py: page_row [num_pages] the record row of each
   page's owner (KVSEAL_FREE_ROW, or KVSEAL_CACHED_ROW for a page the prefix cache holds),
   page_namespace [num_pages] a cached page's namespace id, row_namespace [num_rows] each row's,
   prefix [num_layers, num_rows] how many leading positions of each row are written per layer. */
#define KVSEAL_FREE_ROW -1
#define KVSEAL_CACHED_ROW -2
struct kvseal_records {
    const int64_t *page_row, *page_namespace, *row_namespace;
    int64_t *prefix;
    int64_t num_pages, page_size, num_layers, num_rows;
};

/* Why a sequence may not run (kvseal_check_forward's refused[i]; 0: it may). */
#define KVSEAL_REFUSE_NO_PAGES 1  /* its row is -1: the request holds no pages */
#define KVSEAL_REFUSE_FOREIGN 2   /* it names a page it may not use (or one outside the pool) */
#define KVSEAL_REFUSE_UNCOVERED 3 /* some layer's written prefix does not reach its first new position */

/* The always-on check (I3, I4) of one forward of num_seqs sequences: sequence i is record row
   rows[i] (-1: none), writes positions from starts[i] on, reads the pages of its block table
   (page_counts[i] of `pages`, the tables one after the other) and writes the slots of its new
   tokens (slot_counts[i] of `slots`). It may run if every page it reads is its own or a cached
   page of its row's namespace, every page it writes is its own, and every layer's prefix
   reaches starts[i]. refused[i] = why not (KVSEAL_REFUSE_*), the first reason in that order, or
   0. Returns how many are refused; -1, reading neither, if the counts are not num_pages pages
   and num_slots slots. */
int64_t kvseal_check_forward(const struct kvseal_records *records, const int64_t *rows, const int64_t *starts,
                             int64_t num_seqs, const int64_t *pages, int64_t num_pages, const int64_t *page_counts,
                             const int64_t *slots, int64_t num_slots, const int64_t *slot_counts, int64_t *refused);

/* One forward's write in layers [layer_begin, layer_end): each row's prefix (rows[i] >= 0) grows
   to ends[i] where it already reaches starts[i] (contiguous growth), else stays. */
void kvseal_advance_prefix(const struct kvseal_records *records, const int64_t *rows, const int64_t *starts,
                           const int64_t *ends, int64_t num_seqs, int64_t layer_begin, int64_t layer_end);

/* ---- the sampler's greedy choice (argmax.c) ---- */

/* out [rows] = the first index of each row's largest value of x [rows, n] (n > 0), or of its
   first NaN: torch.argmax's answer. bfloat16 rows answer as their exact float32 widening. */
void kvseal_argmax_rows(const float *x, int64_t rows, int64_t n, int64_t *out, int num_threads);
void kvseal_argmax_rows_bf16(const uint16_t *x, int64_t rows, int64_t n, int64_t *out, int num_threads);

/* ---- the sampler's random draw (sample.c) ---- */

/* out [rows] = per row r of x [rows, n], the first token whose cumulative weight exceeds
   u[r] * the row's total, weights exp(x / T - max x / T) with 1/T = inv_temperature[r] and a
   -inf logit weighing 0; where top_p[r] < 1, only over the row's top-p nucleus (the heaviest
   tokens whose weight first reaches top_p of the total, ties in index order). Returns 0, or -1
   where some row has a NaN or no token of weight (or the vocabulary is too large, or memory ran
   out): the caller then takes the torch path for the batch. */
int kvseal_draw_rows(const float *x, int64_t rows, int64_t n, const float *inv_temperature, const float *top_p,
                     const double *u, int64_t *out, int num_threads);
int kvseal_draw_rows_bf16(const uint16_t *x, int64_t rows, int64_t n, const float *inv_temperature, const float *top_p,
                          const double *u, int64_t *out, int num_threads);

#endif
