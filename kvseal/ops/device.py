"""The engine's device: `--device auto|cpu|cuda` decided against what torch sees, and what it
has (for the start-up log and the GPU pool's arithmetic)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvseal.errors import ConfigError

GIB = 2**30


def resolve_device(requested: str) -> str:
    """"cpu" or "cuda" for `--device`: auto is CUDA when torch sees a GPU. ConfigError for cuda
    where torch sees none (a CPU build of torch, no driver, no visible device)."""
    if requested == "cpu":
        return "cpu"
    has_cuda = torch.cuda.is_available()
    if requested == "auto":
        return "cuda" if has_cuda else "cpu"
    if requested != "cuda":
        raise ConfigError(f"device must be auto, cpu or cuda; got {requested!r}")
    if not has_cuda:
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise ConfigError(f"--device cuda: torch {torch.__version__} ({build}) sees no CUDA device "
                          f"(CUDA_VISIBLE_DEVICES={_visible_devices()!r}); run on a host with a GPU and a CUDA build "
                          f"of torch, or pass --device cpu (or auto)")
    return "cuda"


def _visible_devices() -> str | None:
    import os

    return os.environ.get("CUDA_VISIBLE_DEVICES")


@dataclass(frozen=True)
class DeviceInfo:
    """One device as the start-up log names it."""

    name: str  # "cpu", or the GPU's name
    total_bytes: int | None  # the GPU's memory (None on the CPU: the pool is sized by --kv-cache-memory)
    free_bytes: int | None  # free when asked

    @classmethod
    def of(cls, device: str) -> DeviceInfo:
        if device == "cpu":
            return cls("cpu", None, None)
        free, total = torch.cuda.mem_get_info()
        return cls(torch.cuda.get_device_name(), total, free)

    def describe(self) -> str:
        if self.total_bytes is None or self.free_bytes is None:
            return self.name
        return f"{self.name}, {self.total_bytes / GIB:.1f} GiB ({self.free_bytes / GIB:.1f} GiB free)"
