"""KV capacity arithmetic (docs/ARCHITECTURE.md, "Configuration (I2)"), shared by start-up (I2) and `kvseal plan`.

bytes per token = 2 (K and V) x layers x kv_heads_per_rank x head_dim x bytes per element
pool tokens     = floor(kv memory / page bytes) x page_size

A tensor-parallel engine serving a PD role (`kvseal engine --role`, tp > 1) also holds, on rank
0, a staging pool of the same pages with every KV head (the wire carries full pages:
`kvseal/parallel/handoff.py`). Its budget then pays for both on rank 0:
pool pages = floor(kv memory / (page bytes + staging page bytes)).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from kvseal.errors import ConfigError

if TYPE_CHECKING:
    import torch

GIB = 2**30
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value: str | int) -> int:
    """'64GiB' -> 68719476736. Accepts plain non-negative integers and SI/IEC suffixes."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ConfigError(f"a size cannot be negative, got {value}; write e.g. 64GiB, 500MB or 1073741824")
        return value
    if not isinstance(value, str):
        raise ConfigError(f"cannot read {value!r} as a size; write e.g. 64GiB, 500MB or 1073741824")
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", value)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ConfigError(f"cannot read {value!r} as a size; write e.g. 64GiB, 500MB or 1073741824")
    return int(float(match.group(1)) * _UNITS[unit])


# Most full-length requests --kv-headroom may ask the pool to hold: far past any batch, and keeps
# max_model_len x headroom a token count an int holds.
MAX_KV_HEADROOM = 10_000.0


def check_headroom(headroom: float) -> float:
    """kv_headroom must be a number from 1 to MAX_KV_HEADROOM (how many full-length requests the pool holds)."""
    if isinstance(headroom, bool) or not isinstance(headroom, (int, float)) or not math.isfinite(headroom) \
            or not 1.0 <= headroom <= MAX_KV_HEADROOM:
        raise ConfigError(f"kv_headroom must be a number from 1.0 to {MAX_KV_HEADROOM:g}, got {headroom!r}; it is "
                          f"how many full-length requests the KV pool must hold, e.g. 1.0 (the default) or 2.0")
    return float(headroom)


def check_kv_heads_split(num_kv_heads: int, tp: int) -> None:
    """The KV heads split over `tp` ranks: fewer ranks than heads split them as evenly as they go
    (`kvseal.models.tensor_parallel`); more ranks replicate each head, so tp must be a multiple of
    the heads. (The engine also checks that each head's query group splits over its replicas.)"""
    if tp > num_kv_heads and tp % num_kv_heads:
        raise ConfigError(f"tensor_parallel_size={tp} exceeds the model's {num_kv_heads} KV heads, so each KV head "
                          f"is replicated; that needs tp to be a multiple of the KV heads. Use tensor_parallel_size "
                          f"<= {num_kv_heads} or a multiple of it")


# Bytes per element of each dtype the KV cache may hold (no torch needed: `kvseal plan` and the
# frontend import this module).
ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def bytes_per_element(dtype: torch.dtype | str) -> int:
    """Of a torch dtype or its name ("bfloat16")."""
    return ELEMENT_BYTES[str(dtype).removeprefix("torch.")]


@dataclass(frozen=True)
class KvCapacity:
    num_layers: int
    num_kv_heads_per_rank: int
    head_dim: int
    element_bytes: int
    page_size: int
    num_pages: int = 0
    kv_memory_bytes: int | None = None
    staging_kv_heads: int = 0  # rank 0's staging pool of a PD role under TP: every KV head; else 0

    @classmethod
    def for_dims(cls, num_layers: int, num_kv_heads: int, head_dim: int, element_bytes: int,
                 page_size: int, tp: int = 1, pd_role: bool = False) -> KvCapacity:
        """pd_role: the engine serves a PD role (its rank 0 stages full pages when tp > 1)."""
        if min(num_layers, num_kv_heads, head_dim, element_bytes, page_size, tp) < 1:
            raise ConfigError("layers, kv heads, head_dim, page_size and tp must all be >= 1")
        check_kv_heads_split(num_kv_heads, tp)
        return cls(num_layers, math.ceil(num_kv_heads / tp), head_dim, element_bytes, page_size,
                   staging_kv_heads=num_kv_heads if pd_role and tp > 1 else 0)

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads_per_rank * self.head_dim * self.element_bytes

    @property
    def page_bytes(self) -> int:
        return self.bytes_per_token * self.page_size

    @property
    def staging_page_bytes(self) -> int:
        """One page of rank 0's staging pool (0 where there is none)."""
        return 2 * self.num_layers * self.staging_kv_heads * self.head_dim * self.element_bytes * self.page_size

    @property
    def staging_bytes(self) -> int:
        return self.num_pages * self.staging_page_bytes

    @property
    def pool_tokens(self) -> int:
        return self.num_pages * self.page_size

    def with_memory(self, kv_memory_bytes: int) -> KvCapacity:
        """A pool of as many whole pages as `kv_memory_bytes` holds; at least one, or ConfigError."""
        per_page = self.page_bytes + self.staging_page_bytes
        if kv_memory_bytes < per_page:
            staging = f", plus {self.staging_page_bytes} bytes of rank 0's PD staging pool" \
                if self.staging_page_bytes else ""
            raise ConfigError(
                f"kv_cache_memory={kv_memory_bytes} bytes holds no KV page: one page of {self.page_size} tokens "
                f"takes {self.page_bytes} bytes ({self.bytes_per_token} bytes per token){staging}. Give the KV "
                f"cache more memory (e.g. kv_cache_memory=2GiB) or size it in tokens with kv_cache_tokens"
            )
        return replace(self, num_pages=kv_memory_bytes // per_page, kv_memory_bytes=kv_memory_bytes)

    def with_tokens(self, kv_cache_tokens: int) -> KvCapacity:
        """A pool of whole pages holding at least `kv_cache_tokens` (>= 1) tokens."""
        if isinstance(kv_cache_tokens, bool) or not isinstance(kv_cache_tokens, int) or kv_cache_tokens < 1:
            raise ConfigError(
                f"kv_cache_tokens must be a whole number of tokens >= 1, got {kv_cache_tokens!r}; give at least "
                f"max_model_len tokens, or leave it unset to size the pool from kv_cache_memory"
            )
        return replace(self, num_pages=math.ceil(kv_cache_tokens / self.page_size))

    def fits(self, max_model_len: int, headroom: float = 1.0) -> bool:
        return self.pool_tokens >= max_model_len * check_headroom(headroom)

    def require_fits(self, max_model_len: int, headroom: float = 1.0) -> None:
        """I2: refuse a pool that cannot hold one full-length request (times headroom)."""
        if self.fits(max_model_len, headroom):
            return
        needed = math.ceil(max_model_len * headroom)
        fitting = int(self.pool_tokens / headroom)
        lower = f", lower max_model_len to {fitting}, or pass max_model_len=auto to clamp the context to the pool" \
            if fitting >= 1 else ""
        raise ConfigError(
            f"the KV cache pool holds {self.pool_tokens} tokens but max_model_len is "
            f"{max_model_len} (x headroom {headroom} = {needed} tokens needed) at "
            f"{self.bytes_per_token} bytes per token. Fix: give the KV cache at least "
            f"{needed * self.bytes_per_token} bytes (kv_cache_tokens >= {needed}){lower}."
        )


@dataclass(frozen=True)
class GpuMemoryPlan:
    """The KV pool on a GPU (`--gpu-memory-utilization`), shared by start-up and `kvseal plan`:

    budget = free device memory at start-up (before the weights load) x utilization
    KV pool = budget - weights - activation peak (a profiling forward of a full step's tokens)

    The engine measures the weights and the peak; `kvseal plan` estimates the peak
    (`estimate_activation_bytes`) and counts the weights from the config (`weight_bytes`).
    """

    free_bytes: int
    utilization: float
    weights_bytes: int
    activation_peak_bytes: int

    @property
    def budget_bytes(self) -> int:
        return int(self.free_bytes * self.utilization)

    @property
    def kv_bytes(self) -> int:
        """What is left for the KV pool (negative: nothing, and start-up is refused)."""
        return self.budget_bytes - self.weights_bytes - self.activation_peak_bytes

    def require_room(self) -> int:
        """`kv_bytes`, or ConfigError naming the numbers where nothing is left for the pool."""
        if self.kv_bytes > 0:
            return self.kv_bytes
        raise ConfigError(
            f"no GPU memory is left for the KV pool: {self.free_bytes / GIB:.2f} GiB free x gpu_memory_utilization "
            f"{self.utilization} = {self.budget_bytes / GIB:.2f} GiB, less {self.weights_bytes / GIB:.2f} GiB of "
            f"weights and an activation peak of {self.activation_peak_bytes / GIB:.2f} GiB. Fix: raise "
            f"--gpu-memory-utilization, lower --max-num-batched-tokens (the activation peak), free the GPU, or use a "
            f"smaller model or dtype"
        )

    def rows(self) -> list[tuple[str, str]]:
        """The figures as `kvseal plan` prints them and the engine logs them."""
        return [
            ("GPU memory free", f"{self.free_bytes / GIB:.2f} GiB x gpu_memory_utilization {self.utilization} "
                                f"= {self.budget_bytes / GIB:.2f} GiB"),
            ("weights", f"{self.weights_bytes / GIB:.2f} GiB"),
            ("activation peak", f"{self.activation_peak_bytes / GIB:.2f} GiB"),
            ("left for the KV pool", f"{self.kv_bytes / GIB:.2f} GiB ({self.kv_bytes:,} bytes)"),
        ]



def weight_bytes(vocab_size: int, hidden: int, intermediate: int, num_layers: int, num_heads: int,
                 num_kv_heads: int, head_dim: int, element_bytes: int, tied_embeddings: bool,
                 attention_bias: bool = False, qk_norm: bool = False, o_bias: bool = False) -> int:
    """A Llama-family decoder's parameter bytes (what the engine's model holds), from its config."""
    q, kv = num_heads * head_dim, num_kv_heads * head_dim
    attention = hidden * (q + 2 * kv) + q * hidden + (q + 2 * kv if attention_bias else 0) \
        + (hidden if o_bias else 0) + (2 * head_dim if qk_norm else 0)
    layer = attention + 3 * hidden * intermediate + 2 * hidden
    embeddings = vocab_size * hidden * (1 if tied_embeddings else 2)
    return (embeddings + num_layers * layer + hidden) * element_bytes


def estimate_activation_bytes(num_tokens: int, hidden: int, intermediate: int, num_heads: int, num_kv_heads: int,
                              head_dim: int, vocab_size: int, num_seqs: int, element_bytes: int) -> int:
    """An upper estimate of one step's activation peak for `kvseal plan` (the engine measures
    it): a layer's live tensors for `num_tokens` tokens (the residual stream and its norm, the
    fused qkv rows, attention's output, the gate/up rows and their product) and the float32
    logits of `num_seqs` sampled rows, twice (the sampler's copies)."""
    qkv = (num_heads + 2 * num_kv_heads) * head_dim
    per_token = 3 * hidden + qkv + num_heads * head_dim + 3 * intermediate
    return num_tokens * per_token * element_bytes + 2 * num_seqs * vocab_size * 4
