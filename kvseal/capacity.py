"""KV capacity arithmetic (DESIGN §4), shared by start-up (I2) and `kvseal plan`.

bytes per token = 2 (K and V) x layers x kv_heads_per_rank x head_dim x bytes per element
pool tokens     = floor(kv memory / page bytes) x page_size
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace

import torch

from kvseal.errors import ConfigError

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value: str | int) -> int:
    """'64GiB' -> 68719476736. Accepts plain integers and SI/IEC suffixes."""
    if isinstance(value, int):
        return value
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", value)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ConfigError(f"cannot read {value!r} as a size; write e.g. 64GiB, 500MB or 1073741824")
    return int(float(match.group(1)) * _UNITS[unit])


def bytes_per_element(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class KvCapacity:
    num_layers: int
    num_kv_heads_per_rank: int
    head_dim: int
    element_bytes: int
    page_size: int
    num_pages: int = 0
    kv_memory_bytes: int | None = None

    @classmethod
    def for_dims(cls, num_layers: int, num_kv_heads: int, head_dim: int, element_bytes: int,
                 page_size: int, tp: int = 1) -> KvCapacity:
        if min(num_layers, num_kv_heads, head_dim, element_bytes, page_size, tp) < 1:
            raise ConfigError("layers, kv heads, head_dim, page_size and tp must all be >= 1")
        return cls(num_layers, math.ceil(num_kv_heads / tp), head_dim, element_bytes, page_size)

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads_per_rank * self.head_dim * self.element_bytes

    @property
    def page_bytes(self) -> int:
        return self.bytes_per_token * self.page_size

    @property
    def pool_tokens(self) -> int:
        return self.num_pages * self.page_size

    def with_memory(self, kv_memory_bytes: int) -> KvCapacity:
        return replace(self, num_pages=kv_memory_bytes // self.page_bytes, kv_memory_bytes=kv_memory_bytes)

    def with_tokens(self, kv_cache_tokens: int) -> KvCapacity:
        """A pool of whole pages holding at least `kv_cache_tokens` tokens."""
        return replace(self, num_pages=math.ceil(kv_cache_tokens / self.page_size))

    def fits(self, max_model_len: int, headroom: float = 1.0) -> bool:
        return self.pool_tokens >= max_model_len * headroom

    def require_fits(self, max_model_len: int, headroom: float = 1.0) -> None:
        """I2: refuse a pool that cannot hold one full-length request (times headroom)."""
        if self.fits(max_model_len, headroom):
            return
        needed = math.ceil(max_model_len * headroom)
        raise ConfigError(
            f"the KV cache pool holds {self.pool_tokens} tokens but max_model_len is "
            f"{max_model_len} (x headroom {headroom} = {needed} tokens needed) at "
            f"{self.bytes_per_token} bytes per token. Fix: give the KV cache at least "
            f"{needed * self.bytes_per_token} bytes (kv_cache_tokens >= {needed}), lower "
            f"max_model_len to {int(self.pool_tokens / headroom)}, or pass max_model_len=auto "
            f"to clamp the context to the pool."
        )
