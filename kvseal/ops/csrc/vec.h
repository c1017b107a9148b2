/* Vector types and the arithmetic every kernel family shares: loads and stores, bfloat16
 * conversions, exp, SiLU, softmax's lane helpers. Plain C with GCC vector extensions: the same
 * source vectorizes for AVX2 (8 float lanes a register) and AVX-512 (16). Internal to the
 * library; Python calls only what kvseal_ops.h declares. */
#ifndef KVSEAL_VEC_H
#define KVSEAL_VEC_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "isa.h"

/* A 16-lane vector is returned in two AVX2 registers where the build has no AVX-512; GCC notes
   that this ABI differs from an AVX-512 build's. Every such function here is static inline and
   never crosses a translation unit, so the note does not apply. */
#pragma GCC diagnostic ignored "-Wpsabi"

typedef float v8 __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

static inline v8 load8(const float *p) {
    v8 r;
    memcpy(&r, p, sizeof r);
    return r;
}
static inline void store8(float *p, v8 x) { memcpy(p, &x, sizeof x); }
static inline float hsum8(v8 x) { return ((x[0] + x[4]) + (x[1] + x[5])) + ((x[2] + x[6]) + (x[3] + x[7])); }

/* 16 lanes: one AVX-512 register (two AVX2 registers where the CPU has no AVX-512). */
typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

static inline v16 load16(const float *p) {
    v16 r;
    memcpy(&r, p, sizeof r);
    return r;
}
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
#define DEFINE_BF16_LANES(N)                                                                         \
    static inline v##N load##N##_bf16(const uint16_t *p) {                                           \
        v##N##u16 raw;                                                                               \
        memcpy(&raw, p, sizeof raw);                                                                 \
        return (v##N)(__builtin_convertvector(raw, v##N##i) << 16);                                  \
    }                                                                                                \
    static inline v##N round##N##_bf16(v##N x) {                                                     \
        const v##N##u bits = (v##N##u)x, nan = (v##N##u)(x != x);                                    \
        const v##N##u rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;                \
        return (v##N)((rounded & ~nan) | (nan & 0x7FC00000u));                                       \
    }                                                                                                \
    static inline void store##N##_bf16(uint16_t *p, v##N x) {                                        \
        const v##N##u16 out = __builtin_convertvector((v##N##u)round##N##_bf16(x) >> 16, v##N##u16); \
        memcpy(p, &out, sizeof out);                                                                 \
    }
DEFINE_BF16_LANES(8)
#if KVSEAL_AVX512BF16
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

/* exp(x) for x <= 0 (scores minus their maximum): Cephes' expf polynomial, relative error
   ~1e-7; below -87 it returns ~1e-38 where the true value is smaller still (weight ~0).
   x * log2(e) - 0.5 truncated rounds to the nearest integer for x <= 0. */
#define EXP_POLY(r)                                                                                            \
    ((((((1.9875691500e-4f * (r) + 1.3981999507e-3f) * (r) + 8.3334519073e-3f) * (r) + 4.1665795894e-2f) * (r) \
       + 1.6666665459e-1f)                                                                                     \
          * (r)                                                                                                \
      + 5.0000001201e-1f)                                                                                      \
         * (r) * (r)                                                                                           \
     + (r) + 1.0f)

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
#define DEFINE_EXP(NAME, VF, VI)                                          \
    static inline VF NAME(VF x) {                                         \
        const VI low = x < -87.0f; /* lanes: -1 where true */             \
        x = (VF)((low & (VI)((VF){0} - 87.0f)) | (~low & (VI)x));         \
        const VI n = __builtin_convertvector(x * 1.44269504f - 0.5f, VI); \
        const VF nf = __builtin_convertvector(n, VF);                     \
        const VF r = x - nf * 0.693359375f + nf * 2.12194440e-4f;         \
        return EXP_POLY(r) * (VF)((n + 127) << 23);                       \
    }
DEFINE_EXP(exp_v, v8, v8i)
DEFINE_EXP(exp_v16, v16, v16i)

/* VL float lanes: 16 where the build targets AVX-512 (one register), else 8 (one AVX2
   register); the softmaxes run in vectors of VL. */
#if KVSEAL_AVX512F
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
    const vli greater = a > b; /* lanes: -1 where true */
    return (vl)((greater & (vli)a) | (~greater & (vli)b));
}

/* Pages are scattered through the pool, and the hardware prefetcher stops at each page's end:
   the kernels ask for the next page while they work on the current one. */
static inline void prefetch_page(const void *page, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch((const char *)page + i);
}

/* 1 / d for 16 lanes: with AVX-512, vrcp14ps and one Newton step (~2^-23 relative, a quarter
   of a division's cost); elsewhere a division. */
static inline v16 recip16(v16 d) {
#if KVSEAL_AVX512F
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
#define DEFINE_SILU_MUL(NAME, VF, VI, EXP, QUOTIENT)                                         \
    static inline VF NAME(VF x, VF u) {                                                      \
        const VI negative = x < 0.0f;                                                        \
        const VF t = EXP((VF)((VI)x | ((VI){0} + INT32_MIN))); /* exp(-|x|): sign bit set */ \
        const VF one = (VF){0} + 1.0f;                                                       \
        const VF numer = (VF)((negative & (VI)t) | (~negative & (VI)one));                   \
        return QUOTIENT(x * numer, one + t) * u;                                             \
    }
DEFINE_SILU_MUL(silu_mul8, v8, v8i, exp_v, DIVIDE)
DEFINE_SILU_MUL(silu_mul16, v16, v16i, exp_v16, TIMES_RECIP16)

/* One row of the bfloat16 residual add + RMSNorm: hr [dim] += dr (unless NULL), rounded to
   bfloat16, in place; o = bf16(bf16(hr * rstd) * weight), rstd = 1 / sqrt(mean(hr^2) + eps) in
   float32 (transformers' bfloat16 RMSNorm). kvseal_add_rms_norm_bf16 runs it over rows, and the
   tile linear whose outputs it adds (kvseal_linear_tiles_add_norm_bf16) on rows it just wrote. */
static inline void add_rms_norm_row_bf16(uint16_t *hr, const uint16_t *dr, const uint16_t *weight, float eps,
                                         uint16_t *o, int64_t dim) {
    v16 acc = {0};
    int64_t i = 0;
    for (; i + 16 <= dim; i += 16) {
        v16 x = load16_bf16(hr + i);
        if (dr != NULL) {
            x = round16_bf16(x + load16_bf16(dr + i));
            store16_bf16(hr + i, x);
        }
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

#endif
