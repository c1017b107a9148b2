/* Linears over 16-feature column panels: y = x W^T (+ bias), float32 arithmetic, W packed once
 * at start-up (kvseal_pack_panels_f32 / _bf16) in place of the nn.Linear weight (one copy).
 *
 * Layout. For each block of 16 output features a [K][16] slab: the 16 features' weights for
 * k = 0..K-1 side by side, the last panel zero-padded. One slab row is two 8-lane vectors, so
 * the kernel broadcasts one x value and multiplies it into 16 outputs at once: MR x 16
 * accumulators in registers (MR <= 6), no horizontal sums, the slab read in order.
 *
 * Blocking. Rows go in blocks of 96 (a block of x stays in L2 while every panel passes over
 * it). One row (single-stream decode, which streams every weight once) runs four independent
 * chains over K so the stream of weights never waits on an FMA. Rows beyond six are split into
 * nearly equal passes over each slab. The hardware prefetcher alone does not keep the memory
 * stream busy while a pass computes, so the first pass prefetches its own slab 32 lines ahead
 * and the later passes (which read the slab from cache) prefetch the slab the thread computes
 * next: with two passes (7-12 rows) only the first half of it (one short pass cannot bring a
 * whole slab, and asking for more than the core's miss buffers hold stalls it; the next slab's
 * first pass fetches the rest), with three or more (13 rows and up) the later passes split it
 * between them in order (see panel_rows for the measurements).
 *
 * Threads. Panels are handed out in runs of consecutive panels (about 16 runs per row block on
 * two threads) from a shared counter as they come free: on a host whose cores the frontend
 * shares, a preempted thread holds no fixed share for the others to wait on, and each thread
 * streams the weights sequentially. A thread claims its next run before computing a run's last
 * panel, so the slab it prefetches is the one it computes next (2-256 rows: 0.90-0.95x the time
 * of `schedule(dynamic, 2)`). The sums are the same whichever thread computes a panel.
 *
 * Weights. float32 panels, or bfloat16 panels (`--quantization bf16`, a float32 model: half the
 * bytes per decode step, exactly transformers' float32 forward with the linear weights rounded
 * to bfloat16): one row reads them widened on the fly, several rows widen each slab once into a
 * float32 buffer and run the float32 kernels on it, so the conversion is paid once per slab, not
 * once per row block. The entry points and the packing are compiled once per weight type from
 * linear_panels_typed.h.
 *
 * The MLP's gate/up + SiLU (kvseal_linear_silu_f32). With float32 panels, more than one row and
 * an intermediate size that is a multiple of 16, gate panel q and up panel inter/16 + q hold the
 * same 16 features, so a thread computes both for a row block into two 96 x 16 buffers on its
 * stack and writes silu(g) * u: the [rows, 2 * inter] intermediate is never written nor read
 * back, and there is no separate SiLU pass (0.91-0.93x a 2,048-token prefill step). The sums and
 * the SiLU are the two-pass path's, so the result is bit-equal to it.
 *
 * Measured against oneDNN's packed weights: 1.1-2x faster at one row and 1.1-1.5x at 32-256
 * rows (docs/benchmarks-archive.md, round 5).
 *
 * Called through PanelLinear (kvseal/ops/native_linears.py), which kvseal/models/packed.py puts in
 * place of every decoder linear and the lm_head of a float32 model; without these kernels the
 * same linears use oneDNN's packed layout (PackedLinear, kvseal/ops/torch_linears.py). */

#include "kvseal_ops.h"
#include "panels.h"

static inline float identity_f32(float f) { return f; }
static inline const float *widen_f32(const float *slab, float *buffer, int64_t n) {
    (void)buffer;
    (void)n;
    return slab;
}
static inline const float *widen_bf16(const uint16_t *slab, float *buffer, int64_t n) {
    for (int64_t i = 0; i < n; i += 8) store8(buffer + i, load8_bf16(slab + i));
    return buffer;
}

/* MR rows of x against one float32 slab: 2 * MR accumulators, one broadcast per (row, k). Each k
   step also prefetches the line at `pf + k * pf_step` (see panel_rows). */
#define DEFINE_PANEL_KERNEL(MR)                                                                                 \
    static void panel_##MR(const float *x, int64_t ldx, const float *slab, int64_t k_in, float *y, int64_t ldy, \
                           int64_t nr, const float *bias, const char *pf, int64_t pf_step) {                    \
        v8 a0[MR], a1[MR];                                                                                      \
        for (int i = 0; i < MR; i++) {                                                                          \
            a0[i] = (v8){0};                                                                                    \
            a1[i] = (v8){0};                                                                                    \
        }                                                                                                       \
        for (int64_t k = 0; k < k_in; k++) {                                                                    \
            __builtin_prefetch(pf + k * pf_step);                                                               \
            const v8 w0 = load8(slab + k * 16), w1 = load8(slab + k * 16 + 8);                                  \
            for (int i = 0; i < MR; i++) {                                                                      \
                const float s = x[i * ldx + k];                                                                 \
                a0[i] += s * w0;                                                                                \
                a1[i] += s * w1;                                                                                \
            }                                                                                                   \
        }                                                                                                       \
        store_block(y, ldy, a0, a1, MR, nr, bias);                                                              \
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
    const int64_t later_step = half_of_f32  ? next_step / 2
                               : passes > 2 ? (next_step + passes - 2) / (passes - 1)
                                            : next_step;
    const int64_t share = passes > 2 ? later_step * k_in : 0; /* bytes of `next` per later pass */
    int64_t m = m0;
    for (int64_t i = 0; i < passes; i++) {
        const int64_t mr = (m_end - m + passes - i - 1) / (passes - i); /* ceil(rows left / passes left) */
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
        if (next != NULL) {
            pf = (const char *)next + i * share;
            pf_step = later_step;
        }
    }
}

#define PANELS_PASTE(a, b) a##_##b
#define PANELS_NAME(a, b) PANELS_PASTE(a, b)
#define PANELS_FN(name) PANELS_NAME(name, SFX)

/* float32 panels */
#define SFX f32
#define WTYPE float
#define LOADW load8
#define CONVERT identity_f32
#define WIDENS 0
#define WIDEN widen_f32
#include "linear_panels_typed.h"
#undef SFX
#undef WTYPE
#undef LOADW
#undef CONVERT
#undef WIDENS
#undef WIDEN

/* bfloat16 panels */
#define SFX bf16
#define WTYPE uint16_t
#define LOADW load8_bf16
#define CONVERT to_bf16
#define WIDENS 1
#define WIDEN widen_bf16
#include "linear_panels_typed.h"

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
        int64_t handed_out = 0; /* pairs claimed so far, `chunk` at a time */
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
