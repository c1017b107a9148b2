/* Weight-only int8 linears (`--quantization int8`, float32 models): y = (x Q^T) * scale (+ bias)
 * in float32, Q held in the same 16-feature column panels as the float32 linears', one byte a
 * weight ([K][16] int8 per panel), one scale per output channel.
 *
 * Each slab row's 16 bytes become two 8-lane float vectors (sign-extend, convert: vpmovsxbd +
 * vcvtdq2ps with AVX2) and are FMA'd exactly as the float32 kernel does; the scale multiplies
 * the sums once, at the store, then the bias is added. A decode step reads a quarter of the
 * float32 bytes: 1.6-2.7x faster than torch's int8pack at one row on AVX2. One row runs four
 * independent chains over K with the next 512 bytes prefetched; more rows go in 6-row blocks,
 * 96-row blocks of x, panels split statically over the threads.
 *
 * Packed by kvseal_pack_panels_i8 and called through Int8PanelLinear (kvseal/ops/native_linears.py).
 * A bfloat16 model, or an engine without these kernels, multiplies the same int8 weights with
 * torch's _weight_int8pack_mm instead (Int8PackLinear, kvseal/ops/torch_linears.py). */

#include "kvseal_ops.h"
#include "panels.h"

/* 8 int8 weights -> 8 floats (exact: |q| <= 127). GCC 12 scalarizes __builtin_convertvector
   from an 8-byte int8 vector (a byte at a time through general registers), so on x86 with AVX2
   the two instructions are asked for by name: vpmovsxbd (sign-extend 8 bytes to 8 int32) and
   vcvtdq2ps; elsewhere the portable conversion. */
#if KVSEAL_AVX2
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
static inline void store_block_i8(float *y, int64_t ldy, v8 *a0, v8 *a1, int mr, int64_t nr, const float *scale,
                                  const float *bias) {
    float sc[16] = {0};
    memcpy(sc, scale, sizeof(float) * nr);
    const v8 s0 = load8(sc), s1 = load8(sc + 8);
    for (int i = 0; i < mr; i++) {
        a0[i] *= s0;
        a1[i] *= s1;
    }
    store_block(y, ldy, a0, a1, mr, nr, bias);
}

/* MR rows of x against one int8 panel: each slab row converted once, used by MR rows. */
#define DEFINE_PANEL_KERNEL_I8(MR)                                                                                  \
    static void panel_i8_##MR(const float *x, int64_t ldx, const int8_t *slab, int64_t k_in, float *y, int64_t ldy, \
                              int64_t nr, const float *scale, const float *bias) {                                  \
        v8 a0[MR], a1[MR];                                                                                          \
        for (int i = 0; i < MR; i++) {                                                                              \
            a0[i] = (v8){0};                                                                                        \
            a1[i] = (v8){0};                                                                                        \
        }                                                                                                           \
        for (int64_t k = 0; k < k_in; k++) {                                                                        \
            const v8 w0 = load8_i8(slab + k * 16), w1 = load8_i8(slab + k * 16 + 8);                                \
            for (int i = 0; i < MR; i++) {                                                                          \
                const float s = x[i * ldx + k];                                                                     \
                a0[i] += s * w0;                                                                                    \
                a1[i] += s * w1;                                                                                    \
            }                                                                                                       \
        }                                                                                                           \
        store_block_i8(y, ldy, a0, a1, MR, nr, scale, bias);                                                        \
    }
DEFINE_PANEL_KERNEL_I8(1)
DEFINE_PANEL_KERNEL_I8(2)
DEFINE_PANEL_KERNEL_I8(3)
DEFINE_PANEL_KERNEL_I8(4)
DEFINE_PANEL_KERNEL_I8(5)
DEFINE_PANEL_KERNEL_I8(6)

/* One row (single-stream decode): four independent chains over k, the slab read in order (16
   bytes per k; the next 512 bytes prefetched, so the stream never waits on a conversion). */
static void panel_i8_row(const float *x, const int8_t *slab, int64_t k_in, float *y, int64_t nr, const float *scale,
                         const float *bias) {
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
        a[0] += s * load8_i8(slab + k * 16);
        a[1] += s * load8_i8(slab + k * 16 + 8);
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
