"""Decode attention over the paged pool in one C loop, reading K and V in place.

The torch formulation (`models/attention.py`) has to copy every decode row's K out of the pool
each layer before its score matmul can run (no torch op takes a dot product through a page
table), and then runs ~8 small ops per layer. This kernel walks each row's own pages slot by
slot instead: scores, softmax and the weighted sum of V for one (row, KV head) in one pass over
that row's context, in float32, split over torch's OpenMP threads.

What it reads: for row b, only slots 0 .. context_lens[b]-1 through the row's own block table,
the same slots the torch path attends to, and nothing past them (no padding at all). The
isolation checks that run before every forward (`engine/batch.py`) are unchanged.

Build: plain C (no torch headers), compiled once per host with the system's C compiler
(`cc`, or $CC) into the user's cache (`$XDG_CACHE_HOME/kvseal/native/<hash>/`), in about a
second, then loaded with ctypes. It links torch's own OpenMP runtime (libgomp is already loaded
by torch and is matched by its soname), so the kernel's threads are torch's threads. Without a
compiler, or if the build fails, `decode_attention_kernel()` returns None (logged once) and the
torch formulation runs instead.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import torch

logger = logging.getLogger("kvseal")

_SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef float v8 __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

static inline v8 load8(const float *p) { v8 r; memcpy(&r, p, sizeof r); return r; }
static inline void store8(float *p, v8 x) { memcpy(p, &x, sizeof x); }
static inline float hsum8(v8 x) { return ((x[0] + x[4]) + (x[1] + x[5])) + ((x[2] + x[6]) + (x[3] + x[7])); }

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

static inline v8 exp_v(v8 x) {
    const v8i low = x < -87.0f;  /* lanes: -1 where true */
    x = (v8)((low & (v8i)((v8){0} - 87.0f)) | (~low & (v8i)x));
    const v8i n = __builtin_convertvector(x * 1.44269504f - 0.5f, v8i);
    const v8 nf = __builtin_convertvector(n, v8);
    const v8 r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
    return EXP_POLY(r) * (v8)((n + 127) << 23);
}

/* Softmax in place over s[0..n-1]; returns nothing, s holds the probabilities. */
static void softmax(float *s, int64_t n) {
    float top = s[0], sum = 0.0f;
    for (int64_t t = 1; t < n; t++) top = s[t] > top ? s[t] : top;
    int64_t t = 0;
    v8 acc = {0};
    for (; t + 8 <= n; t += 8) { v8 e = exp_v(load8(s + t) - top); store8(s + t, e); acc += e; }
    sum = hsum8(acc);
    for (; t < n; t++) { s[t] = exp_s(s[t] - top); sum += s[t]; }
    const float inv = 1.0f / sum;
    for (t = 0; t < n; t++) s[t] *= inv;
}

/* One (row, KV head) with head_dim = 8 * NV: its `group` query heads attend to slots 0..ctx-1
   of the row's pages. scores: scratch of group * ctx floats. Four slots at a time per head,
   so four independent accumulator chains keep the FMA units busy. */
#define DEFINE_ATTEND(NV)                                                                       \
static void attend_##NV(const float *q, const float *k_head, const float *v_head,               \
                        const int64_t *table, int64_t ctx, int64_t group, int64_t page_size,    \
                        float scale, float *scores, float *out) {                               \
    const int64_t hd = 8 * NV;                                                                  \
    for (int64_t t0 = 0; t0 < ctx; t0 += page_size) {                                           \
        const int64_t n = ctx - t0 < page_size ? ctx - t0 : page_size;                          \
        const float *kp = k_head + table[t0 / page_size] * page_size * hd;                      \
        for (int64_t j = 0; j < group; j++) {                                                   \
            const float *qj = q + j * hd;                                                       \
            float *sj = scores + j * ctx + t0;                                                  \
            int64_t i = 0;                                                                      \
            for (; i + 4 <= n; i += 4) {                                                        \
                v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};                                      \
                const float *k0 = kp + i * hd;                                                  \
                for (int c = 0; c < NV; c++) {                                                  \
                    v8 qv = load8(qj + 8 * c);                                                  \
                    a0 += qv * load8(k0 + 8 * c);                                               \
                    a1 += qv * load8(k0 + hd + 8 * c);                                          \
                    a2 += qv * load8(k0 + 2 * hd + 8 * c);                                      \
                    a3 += qv * load8(k0 + 3 * hd + 8 * c);                                      \
                }                                                                               \
                sj[i] = scale * hsum8(a0); sj[i + 1] = scale * hsum8(a1);                       \
                sj[i + 2] = scale * hsum8(a2); sj[i + 3] = scale * hsum8(a3);                   \
            }                                                                                   \
            for (; i < n; i++) {                                                                \
                v8 a0 = {0};                                                                    \
                for (int c = 0; c < NV; c++) a0 += load8(qj + 8 * c) * load8(kp + i * hd + 8 * c); \
                sj[i] = scale * hsum8(a0);                                                      \
            }                                                                                   \
        }                                                                                       \
    }                                                                                           \
    for (int64_t j = 0; j < group; j++) softmax(scores + j * ctx, ctx);                         \
    for (int64_t j = 0; j < group; j++) {                                                       \
        v8 o[NV];                                                                               \
        for (int c = 0; c < NV; c++) o[c] = (v8){0};                                            \
        const float *sj = scores + j * ctx;                                                     \
        for (int64_t t0 = 0; t0 < ctx; t0 += page_size) {                                       \
            const int64_t n = ctx - t0 < page_size ? ctx - t0 : page_size;                      \
            const float *vp = v_head + table[t0 / page_size] * page_size * hd;                  \
            for (int64_t i = 0; i < n; i++) {                                                   \
                const float w = sj[t0 + i];                                                     \
                for (int c = 0; c < NV; c++) o[c] += w * load8(vp + i * hd + 8 * c);            \
            }                                                                                   \
        }                                                                                       \
        for (int c = 0; c < NV; c++) store8(out + j * hd + 8 * c, o[c]);                        \
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

/* q, out: [rows, kv_heads * group, head_dim]; k, v: [kv_heads, num_pages, page_size, head_dim];
   tables: [rows, table_width] page ids; context_lens: [rows], each >= 1 and covered by its table.
   Returns 0, or -1 if scratch memory could not be allocated. */
int kvseal_decode_attention(const float *q, const float *k, const float *v, const int64_t *tables,
                            const int64_t *context_lens, float *out, int64_t rows, int64_t kv_heads,
                            int64_t group, int64_t head_dim, int64_t num_pages, int64_t page_size,
                            int64_t table_width, int64_t max_context, float scale, int num_threads) {
    int failed = 0;
    const int64_t head_stride = num_pages * page_size * head_dim;
    #pragma omp parallel num_threads(num_threads) reduction(|:failed)
    {
        float *scores = malloc(sizeof(float) * group * max_context);
        if (scores == NULL) failed = 1;
        #pragma omp for collapse(2) schedule(dynamic, 1)
        for (int64_t b = 0; b < rows; b++)
            for (int64_t h = 0; h < kv_heads; h++) {
                if (scores == NULL) continue;
                const int64_t first = (b * kv_heads + h) * group * head_dim;
                const float *qh = q + first, *kh = k + h * head_stride, *vh = v + h * head_stride;
                const int64_t *table = tables + b * table_width, ctx = context_lens[b];
                float *oh = out + first;
                if (head_dim == 32) attend_4(qh, kh, vh, table, ctx, group, page_size, scale, scores, oh);
                else if (head_dim == 64) attend_8(qh, kh, vh, table, ctx, group, page_size, scale, scores, oh);
                else if (head_dim == 128) attend_16(qh, kh, vh, table, ctx, group, page_size, scale, scores, oh);
                else attend_any(qh, kh, vh, table, ctx, group, head_dim, page_size, scale, scores, oh);
            }
        free(scores);
    }
    return failed ? -1 : 0;
}
"""

_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]
_lock = threading.Lock()
_loaded: dict[str, Callable[..., int] | None] = {}


def decode_attention_kernel() -> Callable[..., int] | None:
    """The compiled `kvseal_decode_attention`, built at first use; None if it cannot be built."""
    with _lock:
        if "decode" not in _loaded:
            _loaded["decode"] = _load()
        return _loaded["decode"]


def _load() -> Callable[..., int] | None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        logger.warning("no C compiler (cc/gcc): decode attention uses the torch formulation (K gathered)")
        return None
    try:
        library = _build(compiler)
        function = ctypes.CDLL(str(library)).kvseal_decode_attention
    except subprocess.CalledProcessError as error:
        logger.warning("decode attention kernel did not build (%s): using the torch formulation\n%s",
                       error, error.stderr.decode(errors="replace")[-2000:])
        return None
    except (OSError, subprocess.TimeoutExpired) as error:
        logger.warning("decode attention kernel did not build or load (%s): using the torch formulation", error)
        return None
    function.restype = ctypes.c_int
    function.argtypes = ([ctypes.c_void_p] * 6 + [ctypes.c_int64] * 8 + [ctypes.c_float, ctypes.c_int])
    logger.info("decode attention: native kernel %s (K and V read in place)", library)
    return function


def _build(compiler: str) -> Path:
    """Compile once per (source, flags, compiler, CPU) into the user's cache; reuse after."""
    key = hashlib.sha256("\n".join([_SOURCE, *_FLAGS, compiler, _cpu_flags()]).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvseal" / "native" / key
    library = cache / "decode_attention.so"
    if library.exists():
        return library
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        source = Path(tmp) / "decode_attention.c"
        source.write_text(_SOURCE)
        built = Path(tmp) / "decode_attention.so"
        subprocess.run([compiler, *_FLAGS, str(source), "-o", str(built), "-lm"], check=True,
                       capture_output=True, timeout=120)
        os.replace(built, library)  # atomic: a concurrent builder sees the whole file or none
    return library


def _cpu_flags() -> str:
    """The CPU's feature flags (the build uses -march=native), so a shared cache never serves
    a library built for another CPU."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def run_decode_attention(kernel: Callable[..., int], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         tables: torch.Tensor, context_lens: torch.Tensor, max_context: int) -> torch.Tensor:
    """q: [B, heads, head_dim] (computed in float32); k, v: one layer of the pool, [kv_heads, pages, page_size,
    head_dim] float32; tables: [B, width] int64; context_lens: [B] int64 -> [B, heads, head_dim]."""
    if k.dtype != torch.float32 or v.dtype != torch.float32 or tables.dtype != torch.int64 \
            or context_lens.dtype != torch.int64 or not (k.is_contiguous() and v.is_contiguous()):
        raise TypeError("the decode attention kernel takes a contiguous float32 pool and int64 tables")
    dtype = q.dtype
    q, tables, context_lens = q.to(torch.float32).contiguous(), tables.contiguous(), context_lens.contiguous()
    out = torch.empty_like(q)
    rows, num_heads, head_dim = q.shape
    kv_heads, num_pages, page_size, _ = k.shape
    status = kernel(q.data_ptr(), k.data_ptr(), v.data_ptr(), tables.data_ptr(), context_lens.data_ptr(),
                    out.data_ptr(), rows, kv_heads, num_heads // kv_heads, head_dim, num_pages, page_size,
                    tables.shape[1], max_context, head_dim**-0.5, torch.get_num_threads())
    if status != 0:
        raise MemoryError("decode attention kernel could not allocate its score scratch")
    return out.to(dtype)
