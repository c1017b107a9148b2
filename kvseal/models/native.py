"""Native float32 kernels: decode attention over the paged pool and the linears, in C.

**Decode attention.** The torch formulation (`models/attention.py`) has to copy every decode
row's K out of the pool each layer before its score matmul can run (no torch op takes a dot
product through a page table), and then runs ~8 small ops per layer. The kernel walks each
row's own pages slot by slot instead: scores, softmax and the weighted sum of V for one (row,
KV head) in one pass over that row's context, in float32, split over torch's OpenMP threads.
What it reads: for row b, only slots 0 .. context_lens[b]-1 through the row's own block table,
the same slots the torch path attends to, and nothing past them (no padding at all). The
isolation checks that run before every forward (`engine/batch.py`) are unchanged.

**Fresh prefill attention.** Chunks that start at position 0 attend only to their own tokens,
so `kvseal_prefill_attention` (`csrc.PREFILL_ATTENTION`) reads the fused qkv rows of the
forward in place (after RoPE) instead of the pool: for one group of equal-length chunks, the
q, K and V columns of each chunk's own rows, and nothing else (no pool, no other chunk's or
sequence's rows). It is blocked like the panel linears (K^T packed once per chunk and KV head
into 16-key panels, 6 query rows x 16 keys per register block, only the causally visible key
panels), writes each chunk's output rows in place and replaces gathered q/k/v and a causal SDPA.

**Linears.** `kvseal_linear_f32` multiplies by a weight held in 16-feature column panels
(`csrc.LINEAR`), packed once at start-up in place of the nn.Linear weight (one copy). It is
measured against oneDNN's packed weights and MKL in docs/BENCHMARKS.md ("Round 5").
`kvseal_linear_i8` (`csrc.INT8_LINEAR`) is its weight-only int8 twin for `--quantization int8`:
the same panels holding int8 weights, converted to float32 in registers, float32 activations,
one scale per output channel applied to the sums.

Build: plain C (no torch headers, `models/csrc.py`), compiled once per host with the system's
C compiler (`cc`, or $CC) into the user's cache (`$XDG_CACHE_HOME/kvseal/native/<hash>/`), in
about a second, then loaded with ctypes. It links torch's own OpenMP runtime (libgomp is
already loaded by torch and is matched by its soname), so the kernels' threads are torch's
threads. Without a compiler, or if the build fails, `native_library()` returns None (logged
once) and the torch formulations run instead (oneDNN-packed linears, gathered attention).
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
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from kvseal.hugepages import huge_empty
from kvseal.models import csrc

logger = logging.getLogger("kvseal")


def library_source(sources: ModuleType) -> str:
    """The C translation unit of a `csrc`-like module's sections (this tree's `csrc`, or another
    tree's for `bench/linears_ab.py`)."""
    tiles = getattr(sources, "TILE_LINEARS", getattr(sources, "AMX", ""))  # named AMX before round 11
    return "\n".join([sources.PRELUDE, sources.ATTENTION, sources.LINEAR, sources.OPS, getattr(sources, "BF16_OPS", ""),
                      sources.INT8_LINEAR, tiles, getattr(sources, "ATTENTION_BF16", ""), sources.DECODE_LOOP,
                      sources.PREFILL_ATTENTION])


_SOURCE = library_source(csrc)
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]
_lock = threading.Lock()
_loaded: dict[str, NativeLibrary | None] = {}
_P = ctypes.c_void_p
_I = ctypes.c_int64


@dataclass(frozen=True)
class NativeLibrary:
    """The compiled kernels (ctypes functions with their argument types set)."""

    decode_attention: Callable[..., int]
    pack_panels: Callable[..., None]
    linear_f32: Callable[..., int]
    pack_panels_bf16: Callable[..., None]
    linear_bf16: Callable[..., int]
    add_rms_norm: Callable[..., None]
    silu_mul: Callable[..., None]
    rope: Callable[..., None]
    write_slots: Callable[..., int]
    pack_panels_i8: Callable[..., None]
    linear_i8: Callable[..., None]
    decode_layers: Callable[..., int]
    prefill_attention: Callable[..., int]
    argmax_rows: Callable[..., None]
    argmax_rows_bf16: Callable[..., None]
    linear_silu: Callable[..., int]
    # bfloat16 twins (a bfloat16 model's forward)
    decode_attention_bf16: Callable[..., int]
    add_rms_norm_bf16: Callable[..., None]
    silu_mul_bf16: Callable[..., None]
    rope_bf16: Callable[..., None]
    write_slots_bf16: Callable[..., int]
    prefill_attention_bf16: Callable[..., int]  # answers -2 where the build has no AVX512-BF16
    # bfloat16 linears over weights in AMX's tile layout, and the bfloat16 decode loop over them
    pack_tiles: Callable[..., None]
    linear_tiles: Callable[..., int]
    linear_silu_tiles: Callable[..., int]
    decode_layers_bf16: Callable[..., int]
    # what runs the tile linears: TILES_AMX, TILES_AVX512 (AVX512-BF16 dot products over the
    # same tiles: a CPU or process without AMX), or TILES_NONE (linear_tiles answers -1)
    tile_engine: int
    set_tile_engine: Callable[..., int]


def native_library() -> NativeLibrary | None:
    """The compiled kernels, built at first use; None if they cannot be built."""
    with _lock:
        if "lib" not in _loaded:
            _loaded["lib"] = _load()
        return _loaded["lib"]


def decode_attention_kernel(dtype: torch.dtype = torch.float32) -> Callable[..., int] | None:
    """The compiled decode attention over a pool of `dtype` (`kvseal_decode_attention` for
    float32, `kvseal_decode_attention_bf16` for bfloat16); None for another dtype or if the
    library cannot be built."""
    library = native_library()
    if library is None or dtype not in (torch.float32, torch.bfloat16):
        return None
    return library.decode_attention if dtype == torch.float32 else library.decode_attention_bf16


def prefill_attention_kernel(dtype: torch.dtype = torch.float32) -> Callable[..., int] | None:
    """The compiled fresh-prefill attention over qkv rows of `dtype`: `kvseal_prefill_attention`
    (float32) or `kvseal_prefill_attention_bf16` (bfloat16, where the build has AVX512-BF16);
    None for another dtype, or if the library cannot be built."""
    library = native_library()
    if library is None or dtype not in (torch.float32, torch.bfloat16):
        return None
    if dtype == torch.bfloat16:
        return library.prefill_attention_bf16 if library.tile_engine != TILES_NONE else None
    return library.prefill_attention


def sdpa_leads_fresh_prefill(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether a fresh prefill of `dtype` is faster in torch's SDPA than in the native kernel:
    bfloat16 where AMX runs the tile linears and the head dim is not a multiple of 64. There
    SDPA's flash attention multiplies on AMX tiles (oneDNN's brgemm) and the native kernel on
    AVX512-BF16 dot products: 101 against 140 ms for a 2,048-token step's 30 layers
    (docs/BENCHMARKS.md, round 20). For head dims that are a multiple of 64 the native kernel
    runs on AMX tiles itself (`fresh_block_amx`: 60 against 92 ms, round 22). Without AMX the
    native kernel takes under half of SDPA's time (round 11)."""
    library = native_library()
    amx = dtype == torch.bfloat16 and library is not None and library.tile_engine == TILES_AMX
    return amx and head_dim % 64 != 0


def _load(source: str = _SOURCE) -> NativeLibrary | None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        logger.warning("no C compiler (cc/gcc): native kernels off (torch attention and linears)")
        return None
    try:
        path = _build(compiler, source)
        handle = ctypes.CDLL(str(path))
    except subprocess.CalledProcessError as error:
        logger.warning("native kernels did not build (%s): using the torch formulations\n%s",
                       error, error.stderr.decode(errors="replace")[-2000:])
        return None
    except (OSError, subprocess.TimeoutExpired) as error:
        logger.warning("native kernels did not build or load (%s): using the torch formulations", error)
        return None
    attention = handle.kvseal_decode_attention
    attention.restype = ctypes.c_int
    attention.argtypes = [_P] * 6 + [_I] * 8 + [ctypes.c_float, ctypes.c_int]
    packs, linears = [], []
    for suffix in ("f32", "bf16"):
        pack = getattr(handle, f"kvseal_pack_panels_{suffix}")
        pack.restype, pack.argtypes = None, [_P, _P, _I, _I]
        linear = getattr(handle, f"kvseal_linear_{suffix}")
        linear.restype, linear.argtypes = ctypes.c_int, [_P] * 4 + [_I] * 3 + [ctypes.c_int]
        packs.append(pack)
        linears.append(linear)
    norm = handle.kvseal_add_rms_norm
    norm.restype, norm.argtypes = None, [_P] * 3 + [ctypes.c_float, _P, _I, _I, ctypes.c_int]
    silu = handle.kvseal_silu_mul
    silu.restype, silu.argtypes = None, [_P, _P, _I, _I, ctypes.c_int]
    rope = handle.kvseal_rope
    rope.restype, rope.argtypes = None, [_P] * 3 + [_I] * 4
    write = handle.kvseal_write_slots
    write.restype, write.argtypes = ctypes.c_int, [_P, _P, _I, _P, _P, _P, _I, _I, _I, _I]
    pack_i8 = handle.kvseal_pack_panels_i8
    pack_i8.restype, pack_i8.argtypes = None, [_P, _P, _I, _I]
    linear_i8 = handle.kvseal_linear_i8
    linear_i8.restype, linear_i8.argtypes = None, [_P] * 5 + [_I] * 3 + [ctypes.c_int]
    loop = handle.kvseal_decode_layers
    loop.restype = ctypes.c_int
    loop.argtypes = [ctypes.c_int, _I, _P, _P, ctypes.c_float, *[_P] * 13, *[_I] * 10, ctypes.c_float, ctypes.c_int, _P]
    prefill = handle.kvseal_prefill_attention
    prefill.restype = ctypes.c_int
    prefill.argtypes = [_P, _I, _P, *[_I] * 5, ctypes.c_float, _P, _I, _P, _P, _P, _I, _I, ctypes.c_int]
    argmax = handle.kvseal_argmax_rows
    argmax.restype, argmax.argtypes = None, [_P, _I, _I, _P, ctypes.c_int]
    argmax_bf16 = handle.kvseal_argmax_rows_bf16
    argmax_bf16.restype, argmax_bf16.argtypes = None, [_P, _I, _I, _P, ctypes.c_int]
    linear_silu = handle.kvseal_linear_silu_f32
    linear_silu.restype, linear_silu.argtypes = ctypes.c_int, [_P, _P, _P, _P, _I, _I, _I, ctypes.c_int]
    logger.info("native kernels: %s (decode attention reads K and V in place; panel linears; fused ops)", path)
    return NativeLibrary(attention, packs[0], linears[0], packs[1], linears[1], norm, silu, rope, write, pack_i8,
                         linear_i8, loop, prefill, argmax, argmax_bf16, linear_silu, **_bf16_functions(handle))


def _bf16_functions(handle: ctypes.CDLL) -> dict[str, Any]:
    """The bfloat16 kernels by NativeLibrary's field names, with their argument types set."""
    attention = handle.kvseal_decode_attention_bf16
    attention.restype = ctypes.c_int
    attention.argtypes = [_P, _I, _P, _P, _P, _P, _P, *[_I] * 9, ctypes.c_float, ctypes.c_int, ctypes.c_int]
    norm = handle.kvseal_add_rms_norm_bf16
    norm.restype, norm.argtypes = None, [_P] * 3 + [ctypes.c_float, _P, _I, _I, ctypes.c_int]
    silu = handle.kvseal_silu_mul_bf16
    silu.restype, silu.argtypes = None, [_P, _P, _I, _I, ctypes.c_int]
    rope = handle.kvseal_rope_bf16
    rope.restype, rope.argtypes = None, [_P] * 3 + [_I] * 4 + [ctypes.c_int]
    write = handle.kvseal_write_slots_bf16
    write.restype, write.argtypes = ctypes.c_int, [_P, _P, _I, _P, _P, _P, _I, _I, _I, _I]
    pack = handle.kvseal_pack_tiles
    pack.restype, pack.argtypes = None, [_P, _P, _I, _I]
    linear = handle.kvseal_linear_tiles
    linear.restype, linear.argtypes = ctypes.c_int, [_P] * 4 + [_I] * 3 + [ctypes.c_int]
    linear_silu = handle.kvseal_linear_silu_tiles
    linear_silu.restype, linear_silu.argtypes = ctypes.c_int, [_P, _P, _P, _I, _I, _I, ctypes.c_int]
    prefill = handle.kvseal_prefill_attention_bf16
    prefill.restype = ctypes.c_int
    prefill.argtypes = [_P, _I, _P, *[_I] * 5, ctypes.c_float, _P, _I, _P, _P, _P, _I, _I, ctypes.c_int]
    loop = handle.kvseal_decode_layers_bf16
    loop.restype = ctypes.c_int
    loop.argtypes = [_I, _P, _P, ctypes.c_float, *[_P] * 12, *[_I] * 10, ctypes.c_float, ctypes.c_int, _P]
    handle.kvseal_tiles_init.restype = ctypes.c_int
    engine = handle.kvseal_tiles_init()
    handle.kvseal_tiles_engine.restype, handle.kvseal_tiles_engine.argtypes = ctypes.c_int, [ctypes.c_int]
    return dict(decode_attention_bf16=attention, add_rms_norm_bf16=norm, silu_mul_bf16=silu, rope_bf16=rope,
                write_slots_bf16=write, prefill_attention_bf16=prefill, pack_tiles=pack, linear_tiles=linear,
                linear_silu_tiles=linear_silu, decode_layers_bf16=loop, tile_engine=engine,
                set_tile_engine=handle.kvseal_tiles_engine)


def _build(compiler: str, source_text: str) -> Path:
    """Compile once per (source, flags, compiler, CPU) into the user's cache; reuse after."""
    key = hashlib.sha256("\n".join([source_text, *_FLAGS, compiler, _cpu_flags()]).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvseal" / "native" / key
    library = cache / "kvseal_native.so"
    if library.exists():
        return library
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        source = Path(tmp) / "kvseal_native.c"
        source.write_text(source_text)
        built = Path(tmp) / "kvseal_native.so"
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


SCORES_WIDENED, SCORES_DOT, SCORES_AMX = 0, 1, 2  # run_decode_attention's `scores` (csrc.ATTENTION_BF16)


def run_decode_attention(kernel: Callable[..., int], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         tables: torch.Tensor, context_lens: torch.Tensor, max_context: int,
                         scores: int = SCORES_AMX) -> torch.Tensor:
    """q: [B, heads, head_dim]; k, v: one layer of the pool, [kv_heads, pages, page_size, head_dim],
    contiguous, float32 (`kvseal_decode_attention`; q is computed in float32) or bfloat16
    (`kvseal_decode_attention_bf16`; q bfloat16 too, each row's heads contiguous, rows at any
    stride; scores: where its scores are computed, SCORES_AMX (AMX tiles where the process may
    use them, else as SCORES_DOT), SCORES_DOT (AVX512-BF16 dot products where built, else as
    SCORES_WIDENED) or SCORES_WIDENED (float32 vectors over K widened a page at a time));
    tables: [B, width] int64; context_lens: [B] int64 -> [B, heads, head_dim] in q's dtype."""
    if k.dtype != v.dtype or k.dtype not in (torch.float32, torch.bfloat16) or tables.dtype != torch.int64 \
            or context_lens.dtype != torch.int64 or not (k.is_contiguous() and v.is_contiguous()):
        raise TypeError("the decode attention kernel takes a contiguous float32 or bfloat16 pool and int64 tables")
    tables, context_lens = tables.contiguous(), context_lens.contiguous()
    rows, num_heads, head_dim = q.shape
    kv_heads, num_pages, page_size, _ = k.shape
    sizes = (rows, kv_heads, num_heads // kv_heads, head_dim, num_pages, page_size, tables.shape[1], max_context,
             head_dim**-0.5)
    threads = torch.get_num_threads()
    if k.dtype == torch.bfloat16:
        if q.dtype != torch.bfloat16:
            raise TypeError(f"a bfloat16 pool takes bfloat16 queries, got {q.dtype}")
        if q.stride(2) != 1 or q.stride(1) != head_dim:
            q = q.contiguous()
        out = torch.empty(q.shape, dtype=torch.bfloat16)
        status = kernel(q.data_ptr(), q.stride(0), k.data_ptr(), v.data_ptr(), tables.data_ptr(),
                        context_lens.data_ptr(), out.data_ptr(), num_heads * head_dim, *sizes, scores, threads)
    else:
        dtype = q.dtype
        q = q.to(torch.float32).contiguous()
        out = torch.empty_like(q)
        status = kernel(q.data_ptr(), k.data_ptr(), v.data_ptr(), tables.data_ptr(), context_lens.data_ptr(),
                        out.data_ptr(), *sizes, threads)
        out = out.to(dtype)
    if status != 0:
        raise MemoryError("decode attention kernel could not allocate its score scratch")
    return out


@dataclass(frozen=True)
class CachedPrefix:
    """The keys before a chunk that continues a sequence: its first `length` slots in the pool,
    through its own pages (`pages`, int64), in one layer's K and V ([kv_heads, num_pages,
    page_size, head_dim], contiguous, the rows' dtype)."""

    length: int
    pages: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor


def run_prefill_attention(kernel: Callable[..., int], qkv: torch.Tensor, starts: torch.Tensor, length: int,
                          num_heads: int, num_kv_heads: int, head_dim: int, out: torch.Tensor,
                          prefix: CachedPrefix | None = None) -> None:
    """Causal attention of the chunks whose first rows are `starts` ([num_chunks] int64, each
    chunk `length` rows at positions 0..length-1) over their own rows of qkv, written into
    their rows of out. qkv: [rows, width] contiguous, each row q heads, K heads, V heads
    (head_dim each); out: [rows, num_heads, head_dim] contiguous; both float32, or both bfloat16
    (the kernel `prefill_attention_kernel(torch.bfloat16)` gives). head_dim must be a multiple of
    8. With `prefix` (one chunk only) the chunk is at positions prefix.length.. and also attends
    to the prefix's slots 0..prefix.length-1 of its own pages, and to nothing else in the pool.
    Raises MemoryError if the kernel could not allocate its scratch."""
    rows, width = qkv.shape
    if qkv.dtype not in (torch.float32, torch.bfloat16) or out.dtype != qkv.dtype or starts.dtype != torch.int64 \
            or not (qkv.is_contiguous() and out.is_contiguous() and starts.is_contiguous()):
        raise TypeError("the prefill attention kernel takes contiguous float32 or bfloat16 rows (out of the same "
                        "dtype) and int64 starts")
    if head_dim % 8 or num_heads % num_kv_heads or width < (num_heads + 2 * num_kv_heads) * head_dim \
            or out.shape != (rows, num_heads, head_dim) or starts.dim() != 1:
        raise ValueError("prefill attention: shapes disagree (or head_dim is not a multiple of 8)")
    if starts.numel() == 0 or length == 0:
        return
    if int(starts.min()) < 0 or int(starts.max()) + length > rows:
        raise IndexError("a prefill chunk runs past the rows of qkv")
    pool: tuple[int, int, int, int, int, int] = (0, 0, 0, 0, 0, 1)
    if prefix is not None and prefix.length > 0:
        pool = _prefix_arguments(prefix, qkv.dtype, num_kv_heads, head_dim, starts.numel())
    status = kernel(qkv.data_ptr(), width, starts.data_ptr(), starts.numel(), length, num_heads, num_kv_heads,
                    head_dim, head_dim**-0.5, out.data_ptr(), *pool, torch.get_num_threads())
    if status == -2:
        raise RuntimeError("bfloat16 prefill attention: this build has no AVX512-BF16")
    if status != 0:
        raise MemoryError("prefill attention kernel could not allocate its panels or scratch")


def pack_panels(library: NativeLibrary, weight: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """weight: [N, K] float32 -> its panels, [ceil(N / 16), K, 16] of `dtype` (float32, or
    bfloat16 rounded to nearest even), a new tensor."""
    if weight.dtype != torch.float32 or weight.dim() != 2:
        raise TypeError(f"panels are packed from a 2-D float32 weight, got {weight.dtype} {tuple(weight.shape)}")
    if dtype not in _PANEL_DTYPES:
        raise TypeError(f"panels hold float32 or bfloat16, not {dtype}")
    weight = weight.detach().contiguous()
    n_out, k_in = weight.shape
    panels = huge_empty(((n_out + 15) // 16, k_in, 16), dtype)
    pack = library.pack_panels if dtype == torch.float32 else library.pack_panels_bf16
    pack(weight.data_ptr(), panels.data_ptr(), n_out, k_in)
    return panels


_PANEL_DTYPES = (torch.float32, torch.bfloat16)


def linear_panels(library: NativeLibrary, x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None,
                  n_out: int) -> torch.Tensor:
    """x: [..., K] float32; panels from `pack_panels` (either dtype) -> [..., n_out] = x W^T
    (+ bias), float32 arithmetic."""
    k_in = panels.shape[1]
    if x.dtype != torch.float32 or x.shape[-1] != k_in:
        raise TypeError(f"expected float32 [..., {k_in}] activations, got {x.dtype} {tuple(x.shape)}")
    rows = x.reshape(-1, k_in).contiguous()
    out = torch.empty((rows.shape[0], n_out), dtype=torch.float32)
    if rows.shape[0]:
        linear = library.linear_f32 if panels.dtype == torch.float32 else library.linear_bf16
        status = linear(rows.data_ptr(), panels.data_ptr(), 0 if bias is None else bias.data_ptr(),
                        out.data_ptr(), rows.shape[0], n_out, k_in, torch.get_num_threads())
        if status != 0:
            raise MemoryError("the panel linear could not allocate its widening buffer")
    return out.view(*x.shape[:-1], n_out)


_ROW_DTYPES = (torch.float32, torch.bfloat16)


TILE_K_MULTIPLE = 32  # the tile linears' input width must be a multiple of this (one tile's k-step)
TILES_NONE, TILES_AVX512, TILES_AMX = 0, 1, 2  # NativeLibrary.tile_engine


def pack_tiles(library: NativeLibrary, weight: torch.Tensor) -> torch.Tensor:
    """weight: [N, K] bfloat16, K a multiple of 32 -> its tiles, [ceil(N / 16), K / 32, 16,
    16, 2] bfloat16 (a new tensor; `kvseal_pack_tiles` gives the layout)."""
    if weight.dtype != torch.bfloat16 or weight.dim() != 2 or weight.shape[1] % TILE_K_MULTIPLE:
        raise TypeError(f"tiles hold a 2-D bfloat16 weight of width a multiple of {TILE_K_MULTIPLE}, "
                        f"got {weight.dtype} {tuple(weight.shape)}")
    weight = weight.detach().contiguous()
    n_out, k_in = weight.shape
    packed = huge_empty(((n_out + 15) // 16, k_in // TILE_K_MULTIPLE, 16, 16, 2), torch.bfloat16)
    library.pack_tiles(weight.data_ptr(), packed.data_ptr(), n_out, k_in)
    return packed


def linear_tiles(library: NativeLibrary, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                 n_out: int) -> torch.Tensor:
    """x: [..., K] bfloat16; packed from `pack_tiles` -> [..., n_out] bfloat16 = x W^T (+ bias),
    float32 sums rounded once, on AMX or AVX512-BF16 (`tile_engine`). RuntimeError where this
    build has neither."""
    k_in = packed.shape[1] * TILE_K_MULTIPLE
    if x.dtype != torch.bfloat16 or x.shape[-1] != k_in:
        raise TypeError(f"expected bfloat16 [..., {k_in}] activations, got {x.dtype} {tuple(x.shape)}")
    if bias is not None and (bias.dtype != torch.bfloat16 or bias.shape != (n_out,) or not bias.is_contiguous()):
        raise TypeError("the tile linear takes a contiguous bfloat16 [n_out] bias")
    rows = x.reshape(-1, k_in).contiguous()
    out = torch.empty((rows.shape[0], n_out), dtype=torch.bfloat16)
    bias_ptr = 0 if bias is None else bias.data_ptr()
    if rows.shape[0] and library.linear_tiles(rows.data_ptr(), packed.data_ptr(), bias_ptr, out.data_ptr(),
                                              rows.shape[0], n_out, k_in, torch.get_num_threads()):
        raise RuntimeError("tile linear: this build has neither AMX nor AVX512-BF16")
    return out.view(*x.shape[:-1], n_out)


def _row_dtype(name: str, *tensors: torch.Tensor) -> torch.dtype:
    """The one dtype of `tensors` (float32 or bfloat16), all contiguous; TypeError otherwise."""
    dtype = tensors[0].dtype
    for t in tensors:
        if t.dtype != dtype or dtype not in _ROW_DTYPES or not t.is_contiguous():
            raise TypeError(f"{name} takes contiguous float32 or bfloat16 tensors of one dtype, "
                            f"got {t.dtype} {tuple(t.stride())} beside {dtype}")
    return dtype


def _check_rows(name: str, *tensors: torch.Tensor) -> None:
    if _row_dtype(name, *tensors) != torch.float32:
        raise TypeError(f"{name} takes float32 tensors")


def add_rms_norm(library: NativeLibrary, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                 eps: float, out: torch.Tensor) -> None:
    """h [rows, dim] += delta (unless None), in place; out [rows, dim] = RMSNorm(h) * weight.
    float32, or bfloat16 rounded as transformers' bfloat16 RMSNorm rounds."""
    dtype = _row_dtype("add_rms_norm", h, weight, out, *(() if delta is None else (delta,)))
    rows, dim = h.shape
    if out.shape != h.shape or weight.shape != (dim,) or (delta is not None and delta.shape != h.shape):
        raise ValueError("add_rms_norm: shapes disagree")
    kernel = library.add_rms_norm if dtype == torch.float32 else library.add_rms_norm_bf16
    kernel(h.data_ptr(), 0 if delta is None else delta.data_ptr(), weight.data_ptr(), eps, out.data_ptr(), rows, dim,
           torch.get_num_threads())


def argmax_rows(library: NativeLibrary, x: torch.Tensor) -> torch.Tensor:
    """x [rows, n] float32 or bfloat16 -> [rows] int64, what `x.argmax(dim=-1)` gives (first
    index of the largest value; the first NaN where a row has one). bfloat16 rows answer as
    their exact float32 widening would, without making it."""
    dtype = _row_dtype("argmax_rows", x)
    if x.dim() != 2 or x.shape[1] == 0:
        raise ValueError(f"argmax_rows takes a [rows, n > 0] tensor, got {tuple(x.shape)}")
    out = torch.empty(x.shape[0], dtype=torch.int64)
    kernel = library.argmax_rows if dtype == torch.float32 else library.argmax_rows_bf16
    kernel(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr(), torch.get_num_threads())
    return out


def silu_mul(library: NativeLibrary, gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [rows, 2 * inter] (gate, then up) -> silu(gate) * up, [rows, inter], in gate_up's
    dtype (bfloat16: silu(gate) rounded before the product, as torch rounds it)."""
    dtype = _row_dtype("silu_mul", gate_up)
    rows, width = gate_up.shape
    out = torch.empty((rows, width // 2), dtype=dtype)
    kernel = library.silu_mul if dtype == torch.float32 else library.silu_mul_bf16
    kernel(gate_up.data_ptr(), out.data_ptr(), rows, width // 2, torch.get_num_threads())
    return out


def _prefix_arguments(prefix: CachedPrefix, dtype: torch.dtype, num_kv_heads: int, head_dim: int,
                      num_chunks: int) -> tuple[int, int, int, int, int, int]:
    """The kernel's (prefix, table, K, V, head stride, page size) for a checked CachedPrefix."""
    k, v, pages = prefix.k, prefix.v, prefix.pages
    if num_chunks != 1:
        raise ValueError("prefill attention after a cached prefix takes one chunk a call")
    if k.dtype != dtype or v.dtype != dtype or k.shape != v.shape or k.dim() != 4 or k.shape[0] != num_kv_heads \
            or k.shape[3] != head_dim or not (k.is_contiguous() and v.is_contiguous()):
        raise TypeError("the cached prefix's K and V must be contiguous [kv_heads, pages, page_size, head_dim] "
                        "layers of the rows' dtype")
    if pages.dtype != torch.int64 or pages.dim() != 1 or not pages.is_contiguous():
        raise TypeError("the cached prefix's pages must be a contiguous 1-D int64 tensor")
    num_pages, page_size = k.shape[1], k.shape[2]
    if prefix.length > pages.numel() * page_size:
        raise IndexError("the cached prefix is longer than its pages")
    used = pages[: -(-prefix.length // page_size)]
    if int(used.min()) < 0 or int(used.max()) >= num_pages:
        raise IndexError("a page of the cached prefix is outside the pool")
    return prefix.length, pages.data_ptr(), k.data_ptr(), v.data_ptr(), num_pages * page_size * head_dim, page_size


def linear_silu(library: NativeLibrary, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                inter: int) -> torch.Tensor | None:
    """silu(x W_gate^T) * (x W_up^T) [rows, inter] in one pass over the fused [2 * inter, K]
    gate/up weight: float32 panels (`pack_panels`; float32 x, bit-equal to `linear_panels` then
    `silu_mul`) or tiles (`pack_tiles`; bfloat16 x, bit-equal to `linear_tiles` then
    `silu_mul`). None where that pass does not apply (bfloat16 panels; a bias, inter not a
    multiple of 16, or one row of float32, which the kernels decline), so the caller runs the
    two passes."""
    tiles = packed.dim() == 5
    dtype = torch.bfloat16 if tiles else torch.float32
    k_in = packed.shape[1] * (TILE_K_MULTIPLE if tiles else 1)
    if packed.dtype != dtype or packed.shape[0] != -(-2 * inter // 16) or x.dim() != 2 or bias is not None:
        return None
    if _row_dtype("linear_silu", x) != dtype or x.shape[1] != k_in:
        raise TypeError(f"expected {dtype} [rows, {k_in}] activations, got {x.dtype} {tuple(x.shape)}")
    out = torch.empty((x.shape[0], inter), dtype=dtype)
    if tiles:
        status = library.linear_silu_tiles(x.data_ptr(), packed.data_ptr(), out.data_ptr(), x.shape[0], inter, k_in,
                                           torch.get_num_threads())
    else:
        status = library.linear_silu(x.data_ptr(), packed.data_ptr(), 0, out.data_ptr(), x.shape[0], inter, k_in,
                                     torch.get_num_threads())
    return out if status == 0 else None


def rope_(library: NativeLibrary, qkv: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
          heads: int, head_dim: int) -> None:
    """Rotate-half RoPE in place on the first `heads` heads of each row of qkv [rows, width];
    cos, signed_sin: [rows, head_dim] (`RotaryEmbedding.cos_sin`, flattened), qkv's dtype."""
    dtype = _row_dtype("rope", qkv, cos, signed_sin)
    rows, width = qkv.shape
    if heads * head_dim > width or cos.shape != (rows, head_dim) or signed_sin.shape != (rows, head_dim):
        raise ValueError("rope: shapes disagree")
    pointers = (qkv.data_ptr(), cos.data_ptr(), signed_sin.data_ptr(), rows, width, heads, head_dim)
    if dtype == torch.float32:
        library.rope(*pointers)
    else:
        library.rope_bf16(*pointers, torch.get_num_threads())


def write_slots(library: NativeLibrary, qkv: torch.Tensor, k_offset: int, v_offset: int, slots: torch.Tensor,
                k_pool: torch.Tensor, v_pool: torch.Tensor) -> None:
    """Store the K and V columns of qkv [rows, width] (starting at k_offset / v_offset,
    kv_heads * head_dim each) into one pool layer [kv_heads, pages, page_size, head_dim] of qkv's
    dtype at `slots` [rows] int64. Raises IndexError, writing nothing, for a slot outside the layer."""
    dtype = _row_dtype("write_slots", qkv, k_pool, v_pool)
    if slots.dtype != torch.int64 or not slots.is_contiguous() or slots.shape != (qkv.shape[0],):
        raise TypeError("write_slots takes one contiguous int64 slot per row")
    kv_heads, num_pages, page_size, head_dim = k_pool.shape
    width = kv_heads * head_dim
    if v_pool.shape != k_pool.shape or v_offset + width > qkv.shape[1] or k_offset + width > v_offset:
        raise ValueError("write_slots: shapes disagree")
    base, size = qkv.data_ptr(), qkv.element_size()
    kernel = library.write_slots if dtype == torch.float32 else library.write_slots_bf16
    status = kernel(base + size * k_offset, base + size * v_offset, qkv.shape[1], slots.data_ptr(), k_pool.data_ptr(),
                    v_pool.data_ptr(), qkv.shape[0], kv_heads, head_dim, num_pages * page_size)
    if status != 0:
        raise IndexError("a KV slot is outside the pool layer")


def pack_panels_i8(library: NativeLibrary, qweight: torch.Tensor) -> torch.Tensor:
    """qweight: [N, K] int8 -> its panels, [ceil(N / 16), K, 16] int8 (a new tensor)."""
    if qweight.dtype != torch.int8 or qweight.dim() != 2:
        raise TypeError(f"int8 panels hold a 2-D int8 weight, got {qweight.dtype} {tuple(qweight.shape)}")
    qweight = qweight.detach().contiguous()
    n_out, k_in = qweight.shape
    panels = huge_empty(((n_out + 15) // 16, k_in, 16), torch.int8)
    library.pack_panels_i8(qweight.data_ptr(), panels.data_ptr(), n_out, k_in)
    return panels


def unpack_panels_i8(panels: torch.Tensor, n_out: int) -> torch.Tensor:
    """The [n_out, K] int8 weight that `pack_panels_i8` packed (a new tensor)."""
    count, k_in, _ = panels.shape
    return panels.permute(0, 2, 1).reshape(count * 16, k_in)[:n_out].contiguous()


def linear_i8(library: NativeLibrary, x: torch.Tensor, panels: torch.Tensor, scale: torch.Tensor,
              bias: torch.Tensor | None, n_out: int) -> torch.Tensor:
    """x: [..., K] float32; panels from `pack_panels_i8`; scale: [n_out] float32 (one per output
    channel); bias: [n_out] float32 or None -> [..., n_out] = (x Q^T) * scale (+ bias)."""
    k_in = panels.shape[1]
    if x.dtype != torch.float32 or x.shape[-1] != k_in:
        raise TypeError(f"expected float32 [..., {k_in}] activations, got {x.dtype} {tuple(x.shape)}")
    vectors = [scale] if bias is None else [scale, bias]
    if panels.dtype != torch.int8 or not panels.is_contiguous() or panels.shape[0] * 16 < n_out \
            or any(v.dtype != torch.float32 or v.shape != (n_out,) or not v.is_contiguous() for v in vectors):
        raise TypeError("the int8 kernel takes contiguous int8 panels and float32 [n_out] scales and bias")
    rows = x.reshape(-1, k_in).contiguous()
    out = torch.empty((rows.shape[0], n_out), dtype=torch.float32)
    if rows.shape[0]:
        library.linear_i8(rows.data_ptr(), panels.data_ptr(), scale.data_ptr(),
                          0 if bias is None else bias.data_ptr(), out.data_ptr(), rows.shape[0], n_out, k_in,
                          torch.get_num_threads())
    return out.view(*x.shape[:-1], n_out)
