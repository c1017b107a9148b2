/* The threads' schedule of the one-row linears over a GGUF's blocks (row_blocks.h; linear_q4.c,
 * linear_q8.c), and each step's epilogue: the tile linears' (tile_stores.h). */

#include <omp.h>

#include "row_blocks.h"
#include "tile_stores.h"

#if KVSEAL_AVX512BF16
/* Job step i: panel i of a plain linear, or gate panel i with up panel i + half, out. */
static inline void row_step(const struct row_job *j, int64_t i) {
    float sums[16], up[16];
    j->panel_row(j->x, j->k_in, j->packed + i * j->panel_bytes, sums);
    if (j->half > 0) {
        j->panel_row(j->x, j->k_in, j->packed + (i + j->half) * j->panel_bytes, up);
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
   waiting at the end of each linear whenever the frontend took a core: these kernels are bound
   by their arithmetic, not their bytes. */
void row_blocks_run(const struct row_job *j, int64_t steps, int num_threads) {
    const int64_t panel_bytes = j->panel_bytes;
    const int64_t run = steps / (8 * num_threads) > 1 ? steps / (8 * num_threads) : 1;
    int64_t handed_out = 0;
#pragma omp parallel num_threads(num_threads)
    {
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
                row_step(j, i);
            }
            first = next;
        }
    }
}
#endif
