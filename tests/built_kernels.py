"""The native kernels the tests use: built once per session (or found in the cache), or None
where they cannot be built (the tests that need them skip; the torch ops run everywhere).

`KVSEAL_TEST_SANITIZED_KERNELS=1` (set only by tests/ops/test_sanitizers.py for its subprocess;
kvseal itself never reads it) builds them with AddressSanitizer and UBSan instead."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from kvseal.kvcache.records import RecordKernels
from kvseal.ops.native_backend import NativeOps
from kvseal.ops.native_build import BuildConfig, NativeBuildError
from kvseal.ops.native_kernels import NativeKernels
from kvseal.ops.torch_backend import TorchOps

SANITIZED = os.environ.get("KVSEAL_TEST_SANITIZED_KERNELS") == "1"
BUILD = BuildConfig.from_environment().with_sanitizers() if SANITIZED else BuildConfig.from_environment()


def _load() -> NativeKernels | None:
    try:
        return NativeKernels.load(BUILD)
    except NativeBuildError:
        if SANITIZED:
            raise
        return None


KERNELS = _load()
HAS_TILES = KERNELS is not None and KERNELS.tile_engine != KERNELS.TILES_NONE
needs_kernels = pytest.mark.skipif(KERNELS is None, reason="no C compiler: the native kernels are not built")
needs_tiles = pytest.mark.skipif(not HAS_TILES, reason="no tile linears here (CPU or build without AVX512-BF16)")


def kernels() -> NativeKernels:
    assert KERNELS is not None, "mark the test needs_kernels"
    return KERNELS


def native_ops() -> NativeOps:
    return NativeOps(kernels(), TorchOps())


@pytest.fixture(params=["amx", "avx512-bf16"])
def tile_engine(request: pytest.FixtureRequest) -> Iterator[str]:
    """Each engine of the tile linears this CPU and build can run, in turn: AMX, and the
    AVX512-BF16 dot products a CPU without AMX runs (also run on an AMX host, by choice). The
    process's engine is put back after the test."""
    if KERNELS is None:
        pytest.skip("no C compiler: the native kernels are not built")
    wanted = KERNELS.TILES_AMX if request.param == "amx" else KERNELS.TILES_AVX512
    if KERNELS.tile_engine < wanted:
        pytest.skip(f"the tile linears cannot run on {request.param} here (CPU or build)")
    assert KERNELS.set_tile_engine(wanted) == wanted
    try:
        yield request.param
    finally:
        KERNELS.set_tile_engine(KERNELS.tile_engine)


@pytest.fixture(params=["torch", "native"])
def record_kernels(request: pytest.FixtureRequest) -> RecordKernels | None:
    """The write records' kernels in turn: none (the records' torch ops), then the native ones
    (`csrc/records.c`) the engine hands them where it runs the C ops."""
    if request.param == "torch":
        return None
    if KERNELS is None:
        pytest.skip("no C compiler: the native kernels are not built")
    return native_ops().record_kernels()
