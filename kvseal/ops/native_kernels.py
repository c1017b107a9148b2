"""The loaded native kernels: one checked call per entry point of `csrc/kvseal_ops.h`.

Each method checks what the C cannot (dtypes, shapes, contiguity, bounds), then calls the
kernel with typed pointers (a tensor of another dtype than the prototype names is a TypeError
from cffi, never a wrong read). `NativeOps` (`native_backend.py`) decides where they apply;
the kernel tests call them directly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvseal.hugepages import huge_empty
from kvseal.ops.native_build import BuildConfig, BuiltLibrary, load_once

# the C element type of each tensor dtype a kernel takes
_POINTERS = {torch.float32: "float *", torch.bfloat16: "uint16_t *", torch.int64: "int64_t *",
             torch.int8: "int8_t *", torch.float64: "double *", torch.uint8: "uint8_t *"}
_ROW_DTYPES = (torch.float32, torch.bfloat16)
TILE_K_MULTIPLE = 32  # the tile linears' input width must be a multiple of this (one tile's k-step)
Q4_1_BLOCK_BYTES = 20  # a GGUF Q4_1 block: float16 d and m, 32 nibbles
Q4_1_PACKED_BYTES = 320  # a packed block: 16 features x 32 k (`kvseal_pack_q4_1`)
Q8_0_BLOCK_BYTES = 34  # a GGUF Q8_0 block: float16 d, 32 int8 q
Q8_0_PACKED_BYTES = 544  # a packed block: 16 features x 32 k (`kvseal_pack_q8_0`)


@dataclass(frozen=True)
class CachedPrefix:
    """The keys before a chunk that continues a sequence: its first `length` slots in the pool,
    through its own pages (`pages`, int64), in one layer's K and V ([kv_heads, num_pages,
    page_size, head_dim], contiguous, the rows' dtype)."""

    length: int
    pages: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor


def prefix_pages(pages: torch.Tensor, length: int, page_size: int, num_pages: int) -> torch.Tensor:
    """The pages a prefill kernel reads for a cached prefix of `length` slots: the first
    ceil(length / page_size) of `pages`, each checked to be a page of a pool of `num_pages`
    (the kernel reads those slots, nothing else of the pool). TypeError for pages that are not
    1-D int64; IndexError for a prefix longer than its pages or a page outside the pool."""
    if pages.dtype != torch.int64 or pages.dim() != 1:
        raise TypeError("the cached prefix's pages must be a contiguous 1-D int64 tensor")
    if length > pages.numel() * page_size:
        raise IndexError("the cached prefix is longer than its pages")
    used = pages[: -(-length // page_size)]
    if used.numel() and (int(used.min()) < 0 or int(used.max()) >= num_pages):
        raise IndexError("a page of the cached prefix is outside the pool")
    return used


class NativeKernels:
    """The compiled kernels of one build (`native_build.load_once`)."""

    def __init__(self, built: BuiltLibrary) -> None:
        self.built = built
        self.lib: Any = built.module.lib
        self.ffi: Any = built.module.ffi
        self._cast = self.ffi.cast
        self.NULL = self.ffi.NULL
        # the header's tile engines: AMX, AVX512-BF16 dot products over the same tiles (a CPU or
        # process without AMX), or none (the tile linears refuse)
        self.TILES_NONE, self.TILES_AVX512, self.TILES_AMX = (
            int(self.lib.KVSEAL_TILES_NONE), int(self.lib.KVSEAL_TILES_AVX512), int(self.lib.KVSEAL_TILES_AMX))
        # what runs the tile linears (and the attention kernels' AMX paths) from start-up on
        self.tile_engine: int = self.lib.kvseal_tiles_init()

    @classmethod
    def load(cls, config: BuildConfig) -> NativeKernels:
        """The kernels of `config`, built or found in the cache once per process."""
        built = load_once(config)
        kernels = _instances.get(built.path)
        if kernels is None:
            kernels = _instances[built.path] = cls(built)
        return kernels

    def set_tile_engine(self, engine: int) -> int:
        """Run the tile linears on `engine` (TILES_AVX512 also on an AMX host; TILES_AMX where
        permitted); the engine now in use. Not while a kernel runs."""
        return int(self.lib.kvseal_tiles_engine(engine))

    def ptr(self, t: torch.Tensor | None) -> Any:
        """A typed pointer to t's first element (NULL for None)."""
        return self.NULL if t is None else self._cast(_POINTERS[t.dtype], t.data_ptr())

    # ---- attention

    def decode_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tables: torch.Tensor,
                         context_lens: torch.Tensor, max_context: int, scores: int | None = None) -> torch.Tensor:
        """q: [B, heads, head_dim]; k, v: one layer of the pool, [kv_heads, pages, page_size,
        head_dim], contiguous, float32 (q computed in float32) or bfloat16 (q bfloat16 too, each
        row's heads contiguous, rows at any stride; scores: the header's KVSEAL_SCORES_*, default
        AMX); tables: [B, width] int64; context_lens: [B] int64 -> [B, heads, head_dim] in q's
        dtype. Row b reads slots 0..context_lens[b]-1 of its own pages only."""
        if k.dtype != v.dtype or k.dtype not in _ROW_DTYPES or tables.dtype != torch.int64 \
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
            status = self.lib.kvseal_decode_attention_bf16(
                self.ptr(q), q.stride(0), self.ptr(k), self.ptr(v), self.ptr(tables), self.ptr(context_lens),
                self.ptr(out), num_heads * head_dim, *sizes,
                self.lib.KVSEAL_SCORES_AMX if scores is None else scores, threads)
        else:
            dtype = q.dtype
            q = q.to(torch.float32).contiguous()
            out = torch.empty_like(q)
            status = self.lib.kvseal_decode_attention(self.ptr(q), self.ptr(k), self.ptr(v), self.ptr(tables),
                                                      self.ptr(context_lens), self.ptr(out), *sizes, threads)
            out = out.to(dtype)
        if status != 0:
            raise MemoryError("decode attention kernel could not allocate its score scratch")
        return out

    def has_prefill_attention(self, dtype: torch.dtype) -> bool:
        """Whether this build has the prefill attention kernel over rows of `dtype` (bfloat16
        needs AVX512-BF16)."""
        return dtype == torch.float32 or (dtype == torch.bfloat16 and self.tile_engine != self.TILES_NONE)

    def prefill_attention(self, qkv: torch.Tensor, starts: torch.Tensor, length: int, num_heads: int,
                          num_kv_heads: int, head_dim: int, out: torch.Tensor,
                          prefix: CachedPrefix | None = None) -> None:
        """Causal attention of the chunks whose first rows are `starts` ([num_chunks] int64, each
        chunk `length` rows at positions 0..length-1) over their own rows of qkv, written into
        their rows of out. qkv: [rows, width] contiguous, each row q heads, K heads, V heads
        (head_dim each); out: [rows, num_heads, head_dim] contiguous; both float32 or both
        bfloat16 (`has_prefill_attention`). head_dim must be a multiple of 8. With `prefix` (one
        chunk only) the chunk is at positions prefix.length.. and also attends to the prefix's
        slots 0..prefix.length-1 of its own pages, and to nothing else in the pool. Raises
        MemoryError if the kernel could not allocate its scratch."""
        rows, width = qkv.shape
        if qkv.dtype not in _ROW_DTYPES or out.dtype != qkv.dtype or starts.dtype != torch.int64 \
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
        pool: tuple[Any, ...] = (0, self.NULL, self.NULL, self.NULL, 0, 1)
        if prefix is not None and prefix.length > 0:
            pool = self._prefix_arguments(prefix, qkv.dtype, num_kv_heads, head_dim, starts.numel())
        kernel = self.lib.kvseal_prefill_attention if qkv.dtype == torch.float32 \
            else self.lib.kvseal_prefill_attention_bf16
        status = kernel(self.ptr(qkv), width, self.ptr(starts), starts.numel(), length, num_heads, num_kv_heads,
                        head_dim, head_dim**-0.5, self.ptr(out), *pool, torch.get_num_threads())
        if status == -2:
            raise RuntimeError("bfloat16 prefill attention: this build has no AVX512-BF16")
        if status != 0:
            raise MemoryError("prefill attention kernel could not allocate its panels or scratch")

    def _prefix_arguments(self, prefix: CachedPrefix, dtype: torch.dtype, num_kv_heads: int, head_dim: int,
                          num_chunks: int) -> tuple[Any, ...]:
        """The kernel's (prefix, table, K, V, head stride, page size) for a checked CachedPrefix."""
        k, v, pages = prefix.k, prefix.v, prefix.pages
        if num_chunks != 1:
            raise ValueError("prefill attention after a cached prefix takes one chunk a call")
        if k.dtype != dtype or v.dtype != dtype or k.shape != v.shape or k.dim() != 4 or k.shape[0] != num_kv_heads \
                or k.shape[3] != head_dim or not (k.is_contiguous() and v.is_contiguous()):
            raise TypeError("the cached prefix's K and V must be contiguous [kv_heads, pages, page_size, head_dim] "
                            "layers of the rows' dtype")
        if not pages.is_contiguous():
            raise TypeError("the cached prefix's pages must be a contiguous 1-D int64 tensor")
        num_pages, page_size = k.shape[1], k.shape[2]
        prefix_pages(pages, prefix.length, page_size, num_pages)
        return prefix.length, self.ptr(pages), self.ptr(k), self.ptr(v), num_pages * page_size * head_dim, page_size

    # ---- linears

    def pack_panels(self, weight: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """weight: [N, K] float32 -> its panels, [ceil(N / 16), K, 16] of `dtype` (float32, or
        bfloat16 rounded to nearest even), a new tensor."""
        if weight.dtype != torch.float32 or weight.dim() != 2:
            raise TypeError(f"panels are packed from a 2-D float32 weight, got {weight.dtype} {tuple(weight.shape)}")
        if dtype not in _ROW_DTYPES:
            raise TypeError(f"panels hold float32 or bfloat16, not {dtype}")
        weight = weight.detach().contiguous()
        n_out, k_in = weight.shape
        panels = huge_empty(((n_out + 15) // 16, k_in, 16), dtype)
        pack = self.lib.kvseal_pack_panels_f32 if dtype == torch.float32 else self.lib.kvseal_pack_panels_bf16
        pack(self.ptr(weight), self.ptr(panels), n_out, k_in)
        return panels

    def linear_panels(self, x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None,
                      n_out: int) -> torch.Tensor:
        """x: [..., K] float32; panels from `pack_panels` (either dtype) -> [..., n_out] = x W^T
        (+ bias), float32 arithmetic."""
        k_in = panels.shape[1]
        if x.dtype != torch.float32 or x.shape[-1] != k_in:
            raise TypeError(f"expected float32 [..., {k_in}] activations, got {x.dtype} {tuple(x.shape)}")
        rows = x.reshape(-1, k_in).contiguous()
        out = torch.empty((rows.shape[0], n_out), dtype=torch.float32)
        if rows.shape[0]:
            linear = self.lib.kvseal_linear_f32 if panels.dtype == torch.float32 else self.lib.kvseal_linear_bf16
            status = linear(self.ptr(rows), self.ptr(panels), self.ptr(bias), self.ptr(out), rows.shape[0], n_out,
                            k_in, torch.get_num_threads())
            if status != 0:
                raise MemoryError("the panel linear could not allocate its widening buffer")
        return out.view(*x.shape[:-1], n_out)

    def pack_tiles(self, weight: torch.Tensor) -> torch.Tensor:
        """weight: [N, K] bfloat16, K a multiple of 32 -> its tiles, [ceil(N / 16), K / 32, 16,
        16, 2] bfloat16 (a new tensor; `kvseal_pack_tiles` gives the layout)."""
        if weight.dtype != torch.bfloat16 or weight.dim() != 2 or weight.shape[1] % TILE_K_MULTIPLE:
            raise TypeError(f"tiles hold a 2-D bfloat16 weight of width a multiple of {TILE_K_MULTIPLE}, "
                            f"got {weight.dtype} {tuple(weight.shape)}")
        weight = weight.detach().contiguous()
        n_out, k_in = weight.shape
        packed = huge_empty(((n_out + 15) // 16, k_in // TILE_K_MULTIPLE, 16, 16, 2), torch.bfloat16)
        self.lib.kvseal_pack_tiles(self.ptr(weight), self.ptr(packed), n_out, k_in)
        return packed

    def linear_tiles(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                     n_out: int) -> torch.Tensor:
        """x: [..., K] bfloat16; packed from `pack_tiles` -> [..., n_out] bfloat16 = x W^T (+ bias),
        float32 sums rounded once, on AMX or AVX512-BF16 (`tile_engine`). RuntimeError where
        this build has neither."""
        return self._tiles_call(self.lib.kvseal_linear_tiles, x, packed, bias, n_out, torch.bfloat16)

    def linear_tiles_f32(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                         n_out: int) -> torch.Tensor:
        """`linear_tiles` with its float32 sums (+ bias, float32) returned as they are, never
        rounded: x [..., K] bfloat16 -> [..., n_out] float32. Rounded to bfloat16, each output is
        `linear_tiles`' (bias rounded to bfloat16). RuntimeError where this build has no tile engine."""
        return self._tiles_call(self.lib.kvseal_linear_tiles_f32, x, packed, bias, n_out, torch.float32)

    def _tiles_call(self, kernel: Any, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n_out: int,
                    dtype: torch.dtype) -> torch.Tensor:
        """One tile linear whose output and bias are `dtype`."""
        k_in = packed.shape[1] * TILE_K_MULTIPLE
        if x.dtype != torch.bfloat16 or x.shape[-1] != k_in:
            raise TypeError(f"expected bfloat16 [..., {k_in}] activations, got {x.dtype} {tuple(x.shape)}")
        if bias is not None and (bias.dtype != dtype or bias.shape != (n_out,) or not bias.is_contiguous()):
            raise TypeError(f"the tile linear takes a contiguous {dtype} [n_out] bias")
        rows = x.reshape(-1, k_in).contiguous()
        out = torch.empty((rows.shape[0], n_out), dtype=dtype)
        if rows.shape[0] and kernel(self.ptr(rows), self.ptr(packed), self.ptr(bias), self.ptr(out), rows.shape[0],
                                    n_out, k_in, torch.get_num_threads()):
            raise RuntimeError("tile linear: this build has neither AMX nor AVX512-BF16")
        return out.view(*x.shape[:-1], n_out)

    def linear_silu(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                    inter: int) -> torch.Tensor | None:
        """silu(x W_gate^T) * (x W_up^T) [rows, inter] in one pass over the fused [2 * inter, K]
        gate/up weight: float32 panels (`pack_panels`; float32 x, bit-equal to `linear_panels`
        then `silu_mul`) or tiles (`pack_tiles`; bfloat16 x, bit-equal to `linear_tiles` then
        `silu_mul`). None where that pass does not apply (bfloat16 panels; a bias, inter not a
        multiple of 16, or one row of float32, which the kernels decline), so the caller runs
        the two passes."""
        tiles = packed.dim() == 5
        dtype = torch.bfloat16 if tiles else torch.float32
        k_in = packed.shape[1] * (TILE_K_MULTIPLE if tiles else 1)
        if packed.dtype != dtype or packed.shape[0] != -(-2 * inter // 16) or x.dim() != 2 or bias is not None:
            return None
        if _row_dtype("linear_silu", x) != dtype or x.shape[1] != k_in:
            raise TypeError(f"expected {dtype} [rows, {k_in}] activations, got {x.dtype} {tuple(x.shape)}")
        out = torch.empty((x.shape[0], inter), dtype=dtype)
        threads = torch.get_num_threads()
        if tiles:
            status = self.lib.kvseal_linear_silu_tiles(self.ptr(x), self.ptr(packed), self.ptr(out), x.shape[0],
                                                       inter, k_in, threads)
        else:
            status = self.lib.kvseal_linear_silu_f32(self.ptr(x), self.ptr(packed), self.NULL, self.ptr(out),
                                                     x.shape[0], inter, k_in, threads)
        return out if status == 0 else None

    def pack_q4_1(self, blocks: torch.Tensor) -> torch.Tensor:
        """blocks: a weight [N, K] as GGUF Q4_1 blocks, [N, K / 32, 20] uint8 -> the row kernels'
        blocks, [ceil(N / 16), K / 32, 320] uint8 (a new tensor; `kvseal_pack_q4_1` gives the
        layout)."""
        return self._pack_blocks(blocks, "Q4_1", Q4_1_BLOCK_BYTES, Q4_1_PACKED_BYTES, self.lib.kvseal_pack_q4_1)

    def pack_q8_0(self, blocks: torch.Tensor) -> torch.Tensor:
        """blocks: a weight [N, K] as GGUF Q8_0 blocks, [N, K / 32, 34] uint8 -> the row kernel's
        blocks, [ceil(N / 16), K / 32, 544] uint8 (a new tensor; `kvseal_pack_q8_0` gives the
        layout)."""
        return self._pack_blocks(blocks, "Q8_0", Q8_0_BLOCK_BYTES, Q8_0_PACKED_BYTES, self.lib.kvseal_pack_q8_0)

    def _pack_blocks(self, blocks: torch.Tensor, kind: str, block_bytes: int, packed_bytes: int,
                     pack: Any) -> torch.Tensor:
        if blocks.dtype != torch.uint8 or blocks.dim() != 3 or blocks.shape[2] != block_bytes:
            raise TypeError(f"{kind} blocks are [N, K / 32, {block_bytes}] uint8, got {blocks.dtype} "
                            f"{tuple(blocks.shape)}")
        blocks = blocks.contiguous()
        n_out, k_in = blocks.shape[0], blocks.shape[1] * TILE_K_MULTIPLE
        packed = huge_empty(((n_out + 15) // 16, blocks.shape[1], packed_bytes), torch.uint8)
        pack(self.ptr(blocks), self.ptr(packed), n_out, k_in)
        return packed

    def linear_q4_1_row(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                        n_out: int) -> torch.Tensor | None:
        """x: [1, K] bfloat16; packed from `pack_q4_1` -> [1, n_out] bfloat16 = x W^T (+ bias), W
        the blocks' bfloat16 weights: bit-equal to `linear_tiles` over W's tiles on the AVX512-BF16
        engine. None where the kernel declines (the tiles run on AMX, or the build has no
        AVX512-BF16): the caller runs the tiles."""
        k_in = self._row_width(x, packed, -(-n_out // 16), "Q4_1", Q4_1_PACKED_BYTES)
        return self._row_linear(self.lib.kvseal_linear_q4_1_row, x, packed, bias, n_out, k_in)

    def linear_q8_0_row(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                        n_out: int) -> torch.Tensor | None:
        """x: [1, K] bfloat16; packed from `pack_q8_0` -> [1, n_out] bfloat16 = x W^T (+ bias), W
        the blocks' bfloat16 weights: bit-equal to `linear_tiles` over W's tiles on the AVX512-BF16
        engine. None where the kernel declines (as `linear_q4_1_row`): the caller runs the tiles."""
        k_in = self._row_width(x, packed, -(-n_out // 16), "Q8_0", Q8_0_PACKED_BYTES)
        return self._row_linear(self.lib.kvseal_linear_q8_0_row, x, packed, bias, n_out, k_in)

    def _row_linear(self, kernel: Any, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n_out: int,
                    k_in: int) -> torch.Tensor | None:
        if bias is not None and (bias.dtype != torch.bfloat16 or bias.shape != (n_out,) or not bias.is_contiguous()):
            raise TypeError("a row linear over blocks takes a contiguous bfloat16 [n_out] bias")
        out = torch.empty((1, n_out), dtype=torch.bfloat16)
        status = kernel(self.ptr(x), self.ptr(packed), self.ptr(bias), self.ptr(out), n_out, k_in,
                        torch.get_num_threads())
        return out if status == 0 else None

    def linear_silu_q4_1_row(self, x: torch.Tensor, packed: torch.Tensor, inter: int) -> torch.Tensor | None:
        """silu(x W_gate^T) * (x W_up^T) [1, inter] over the packed blocks of the fused [2 * inter,
        K] gate/up weight: bit-equal to `linear_silu` over its tiles on the AVX512-BF16 engine.
        None where the kernel declines (as `linear_q4_1_row`, or inter not a multiple of 16)."""
        k_in = self._row_width(x, packed, -(-2 * inter // 16), "Q4_1", Q4_1_PACKED_BYTES)
        out = torch.empty((1, inter), dtype=torch.bfloat16)
        status = self.lib.kvseal_linear_silu_q4_1_row(self.ptr(x), self.ptr(packed), self.ptr(out), inter, k_in,
                                                      torch.get_num_threads())
        return out if status == 0 else None

    @staticmethod
    def _row_width(x: torch.Tensor, packed: torch.Tensor, panels: int, kind: str, packed_bytes: int) -> int:
        """K of a row kernel's call, checked: x one contiguous bfloat16 row of width K, packed
        [panels, K / 32, packed_bytes] uint8."""
        k_in = packed.shape[1] * TILE_K_MULTIPLE
        if packed.dtype != torch.uint8 or packed.shape != (panels, k_in // TILE_K_MULTIPLE, packed_bytes) \
                or not packed.is_contiguous():
            raise TypeError(f"expected packed {kind} blocks [{panels}, K / 32, {packed_bytes}] uint8")
        if x.dtype != torch.bfloat16 or x.shape != (1, k_in) or not x.is_contiguous():
            raise TypeError(f"expected one contiguous bfloat16 row [1, {k_in}], got {x.dtype} {tuple(x.shape)}")
        return k_in

    def pack_panels_i8(self, qweight: torch.Tensor) -> torch.Tensor:
        """qweight: [N, K] int8 -> its panels, [ceil(N / 16), K, 16] int8 (a new tensor)."""
        if qweight.dtype != torch.int8 or qweight.dim() != 2:
            raise TypeError(f"int8 panels hold a 2-D int8 weight, got {qweight.dtype} {tuple(qweight.shape)}")
        qweight = qweight.detach().contiguous()
        n_out, k_in = qweight.shape
        panels = huge_empty(((n_out + 15) // 16, k_in, 16), torch.int8)
        self.lib.kvseal_pack_panels_i8(self.ptr(qweight), self.ptr(panels), n_out, k_in)
        return panels

    def linear_i8(self, x: torch.Tensor, panels: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                  n_out: int) -> torch.Tensor:
        """x: [..., K] float32; panels from `pack_panels_i8`; scale: [n_out] float32 (one per
        output channel); bias: [n_out] float32 or None -> [..., n_out] = (x Q^T) * scale (+ bias)."""
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
            self.lib.kvseal_linear_i8(self.ptr(rows), self.ptr(panels), self.ptr(scale), self.ptr(bias),
                                      self.ptr(out), rows.shape[0], n_out, k_in, torch.get_num_threads())
        return out.view(*x.shape[:-1], n_out)

    # ---- fused per-layer ops

    def add_rms_norm(self, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                     out: torch.Tensor) -> None:
        """h [rows, dim] += delta (unless None), in place; out [rows, dim] = RMSNorm(h) * weight.
        float32, or bfloat16 rounded as transformers' bfloat16 RMSNorm rounds."""
        dtype = _row_dtype("add_rms_norm", h, weight, out, *(() if delta is None else (delta,)))
        rows, dim = h.shape
        if out.shape != h.shape or weight.shape != (dim,) or (delta is not None and delta.shape != h.shape):
            raise ValueError("add_rms_norm: shapes disagree")
        kernel = self.lib.kvseal_add_rms_norm if dtype == torch.float32 else self.lib.kvseal_add_rms_norm_bf16
        kernel(self.ptr(h), self.ptr(delta), self.ptr(weight), eps, self.ptr(out), rows, dim, torch.get_num_threads())

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [rows, 2 * inter] (gate, then up) -> silu(gate) * up, [rows, inter], in gate_up's
        dtype (bfloat16: silu(gate) rounded before the product, as torch rounds it)."""
        dtype = _row_dtype("silu_mul", gate_up)
        rows, width = gate_up.shape
        out = torch.empty((rows, width // 2), dtype=dtype)
        kernel = self.lib.kvseal_silu_mul if dtype == torch.float32 else self.lib.kvseal_silu_mul_bf16
        kernel(self.ptr(gate_up), self.ptr(out), rows, width // 2, torch.get_num_threads())
        return out

    def rope_(self, qkv: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, heads: int,
              head_dim: int) -> None:
        """Rotate-half RoPE in place on the first `heads` heads of each row of qkv [rows, width];
        cos, signed_sin: [rows, head_dim] (`RotaryEmbedding.cos_sin`, flattened), qkv's dtype."""
        dtype = _row_dtype("rope", qkv, cos, signed_sin)
        rows, width = qkv.shape
        if heads * head_dim > width or cos.shape != (rows, head_dim) or signed_sin.shape != (rows, head_dim):
            raise ValueError("rope: shapes disagree")
        pointers = (self.ptr(qkv), self.ptr(cos), self.ptr(signed_sin), rows, width, heads, head_dim)
        if dtype == torch.float32:
            self.lib.kvseal_rope(*pointers)
        else:
            self.lib.kvseal_rope_bf16(*pointers, torch.get_num_threads())

    def write_slots(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, k_pool: torch.Tensor,
                    v_pool: torch.Tensor) -> None:
        """Store K and V rows (k, v: [rows, kv_heads, head_dim], each row's heads contiguous, both
        rows `row_stride` elements apart, as the K and V column blocks of the fused qkv rows
        are) into one pool layer [kv_heads, pages, page_size, head_dim] of their dtype at
        `slots` [rows] int64. Raises IndexError, writing nothing, for a slot outside the layer."""
        dtype = _row_dtype("write_slots", k_pool, v_pool)
        if slots.dtype != torch.int64 or not slots.is_contiguous() or slots.shape != (k.shape[0],):
            raise TypeError("write_slots takes one contiguous int64 slot per row")
        kv_heads, num_pages, page_size, head_dim = k_pool.shape
        if not takes_kv_rows(k, v, k_pool, v_pool):
            raise ValueError(f"write_slots takes {dtype} K and V rows of one row stride, each row's "
                             f"[{kv_heads}, {head_dim}] heads contiguous")
        kernel = self.lib.kvseal_write_slots if dtype == torch.float32 else self.lib.kvseal_write_slots_bf16
        status = kernel(self.ptr(k), self.ptr(v), k.stride(0), self.ptr(slots), self.ptr(k_pool), self.ptr(v_pool),
                        k.shape[0], kv_heads, head_dim, num_pages * page_size)
        if status != 0:
            raise IndexError("a KV slot is outside the pool layer")

    # ---- the sampler

    def argmax_rows(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, n] float32 or bfloat16 -> [rows] int64, what `x.argmax(dim=-1)` gives (first
        index of the largest value; the first NaN where a row has one). bfloat16 rows answer as
        their exact float32 widening would, without making it."""
        dtype = _row_dtype("argmax_rows", x)
        if x.dim() != 2 or x.shape[1] == 0:
            raise ValueError(f"argmax_rows takes a [rows, n > 0] tensor, got {tuple(x.shape)}")
        out = torch.empty(x.shape[0], dtype=torch.int64)
        kernel = self.lib.kvseal_argmax_rows if dtype == torch.float32 else self.lib.kvseal_argmax_rows_bf16
        kernel(self.ptr(x), x.shape[0], x.shape[1], self.ptr(out), torch.get_num_threads())
        return out

    def draw_rows(self, x: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
                  u: torch.Tensor) -> torch.Tensor | None:
        """x [rows, n] float32 or bfloat16 logits, temperature [rows] (> 0), top_p [rows] (1: no
        cut), u [rows] in [0, 1) -> [rows] int64 (`csrc/sample.c`), or None where a row has a NaN
        or no token of weight."""
        dtype = _row_dtype("draw_rows", x)
        rows = x.shape[0]
        if x.dim() != 2 or x.shape[1] == 0 or any(t.shape != (rows,) for t in (temperature, top_p, u)):
            raise ValueError(f"draw_rows takes [rows, n > 0] logits and one temperature, top_p and u per row, "
                             f"got {tuple(x.shape)}, {tuple(temperature.shape)}, {tuple(top_p.shape)}, "
                             f"{tuple(u.shape)}")
        inverse = (1.0 / temperature.to(torch.float32)).contiguous()
        nucleus = top_p.to(torch.float32).contiguous()
        draws = u.to(torch.float64).contiguous()
        out = torch.empty(rows, dtype=torch.int64)
        kernel = self.lib.kvseal_draw_rows if dtype == torch.float32 else self.lib.kvseal_draw_rows_bf16
        status = kernel(self.ptr(x), rows, x.shape[1], self.ptr(inverse), self.ptr(nucleus), self.ptr(draws),
                        self.ptr(out), torch.get_num_threads())
        return out if status == 0 else None


_instances: dict[Any, NativeKernels] = {}


def takes_kv_rows(k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor) -> bool:
    """Whether `write_slots` takes these K and V rows for this pool layer: one dtype, each row's
    heads contiguous in the pool's [kv_heads, head_dim] shape, k and v rows equally far apart."""
    kv_heads, head_dim = k_pool.shape[0], k_pool.shape[3]
    return k.dtype == v.dtype == k_pool.dtype == v_pool.dtype and k.dim() == 3 and k.shape == v.shape \
        and k.shape[1:] == (kv_heads, head_dim) and k.stride()[1:] == (head_dim, 1) == v.stride()[1:] \
        and k.stride(0) == v.stride(0) and k_pool.shape == v_pool.shape \
        and k_pool.is_contiguous() and v_pool.is_contiguous()


def unpack_panels_i8(panels: torch.Tensor, n_out: int) -> torch.Tensor:
    """The [n_out, K] int8 weight that `pack_panels_i8` packed (a new tensor)."""
    count, k_in, _ = panels.shape
    return panels.permute(0, 2, 1).reshape(count * 16, k_in)[:n_out].contiguous()


def _row_dtype(name: str, *tensors: torch.Tensor) -> torch.dtype:
    """The one dtype of `tensors` (float32 or bfloat16), all contiguous; TypeError otherwise."""
    dtype = tensors[0].dtype
    for t in tensors:
        if t.dtype != dtype or dtype not in _ROW_DTYPES or not t.is_contiguous():
            raise TypeError(f"{name} takes contiguous float32 or bfloat16 tensors of one dtype, "
                            f"got {t.dtype} {tuple(t.stride())} beside {dtype}")
    return dtype
