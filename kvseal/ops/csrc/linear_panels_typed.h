/* The entry points of the panel linears for one weight type, included once per type by
 * linear_panels.c with these defined: SFX (the names' suffix), WTYPE (the panels' element),
 * LOADW (8 weights as float32 lanes), CONVERT (float32 -> WTYPE), WIDENS (1 where several rows
 * widen each slab once into a float32 buffer) and WIDEN (that widening; the slab itself for
 * float32). PANELS_FN(name) is name_SFX. */

/* One row (single-stream decode): four independent chains over k hide the FMA latency. */
static void PANELS_FN(panel_row)(const float *x, const WTYPE *slab, int64_t k_in, float *y, int64_t nr,
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
        a[0] += s * LOADW(slab + k * 16);
        a[1] += s * LOADW(slab + k * 16 + 8);
    }
    const v8 r0 = (a[0] + a[2]) + (a[4] + a[6]), r1 = (a[1] + a[3]) + (a[5] + a[7]);
    store_block(y, 0, &r0, &r1, 1, nr, bias);
}

/* y [M, N] = x [M, K] . W^T (+ bias [N] unless NULL); W as panels (PANELS_FN(kvseal_pack_panels)). Rows
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
int PANELS_FN(kvseal_linear)(const float *x, const WTYPE *panels, const float *bias, float *y, int64_t rows,
                             int64_t n_out, int64_t k_in, int num_threads) {
    const int64_t count = (n_out + 15) / 16;
    if (rows == 1) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
        for (int64_t p = 0; p < count; p++) {
            const int64_t nr = n_out - p * 16 < 16 ? n_out - p * 16 : 16;
            PANELS_FN(panel_row)(x, panels + p * k_in * 16, k_in, y + p * 16, nr, bias == NULL ? NULL : bias + p * 16);
        }
        return 0;
    }
    const int64_t chunk = count / (8 * num_threads) > 1 ? count / (8 * num_threads) : 1;
    int failed = 0;
    for (int64_t m0 = 0; m0 < rows && !failed; m0 += 96) {
        const int64_t m_end = m0 + 96 < rows ? m0 + 96 : rows;
        int64_t handed_out = 0; /* panels claimed so far, `chunk` at a time */
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
        {
            float *buffer = WIDENS ? malloc(sizeof(float) * 16 * k_in) : NULL;
            if (WIDENS && buffer == NULL) failed = 1;
            int64_t p = WIDENS && buffer == NULL ? count : __atomic_fetch_add(&handed_out, chunk, __ATOMIC_RELAXED);
            int64_t end = p + chunk < count ? p + chunk : count;
            while (p < count) {
                const int last = p + 1 >= end;
                const int64_t next = last ? __atomic_fetch_add(&handed_out, chunk, __ATOMIC_RELAXED) : p + 1;
                const float *slab = WIDEN(panels + p * k_in * 16, buffer, 16 * k_in);
                panel_rows(x, slab, bias, y, m0, m_end, p, n_out, k_in, next < count ? panels + next * k_in * 16 : NULL,
                           16 * (int64_t)sizeof(WTYPE));
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
void PANELS_FN(kvseal_pack_panels)(const float *w, WTYPE *panels, int64_t n_out, int64_t k_in) {
    const int64_t count = (n_out + 15) / 16;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < count; p++)
        for (int64_t k = 0; k < k_in; k++)
            for (int64_t j = 0; j < 16; j++) {
                const int64_t n = p * 16 + j;
                panels[(p * k_in + k) * 16 + j] = CONVERT(n < n_out ? w[n * k_in + k] : 0.0f);
            }
}
