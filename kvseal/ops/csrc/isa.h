/* What the build targets, as 0/1 macros the kernels branch on at compile time.
 *
 * The library is compiled on the user's host with -march=native, so these follow the host's
 * CPU; the tests compile every file for each family below (x86-64-v3, an AVX-512 target, an
 * AVX512-BF16 target, an AMX target) whether or not the host can run it. The one runtime
 * choice is AMX's: a build that targets it still asks the kernel for tile data at start-up and
 * runs the AVX512-BF16 code where the process may not use tiles (dispatch.c). */
#ifndef KVSEAL_ISA_H
#define KVSEAL_ISA_H

#if defined(__AVX2__)
#define KVSEAL_AVX2 1
#else
#define KVSEAL_AVX2 0
#endif

#if defined(__AVX512F__)
#define KVSEAL_AVX512F 1
#else
#define KVSEAL_AVX512F 0
#endif

#if defined(__AVX512BW__)
#define KVSEAL_AVX512BW 1
#else
#define KVSEAL_AVX512BW 0
#endif

#if defined(__AVX512BF16__)
#define KVSEAL_AVX512BF16 1
#else
#define KVSEAL_AVX512BF16 0
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define KVSEAL_AMX 1
#else
#define KVSEAL_AMX 0
#endif

#if KVSEAL_AVX2 || KVSEAL_AVX512F
#include <immintrin.h>
#endif

#endif
