"""Fixtures shared by the model tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvseal.models.native import TILES_AMX, TILES_AVX512, native_library


@pytest.fixture(params=["amx", "avx512-bf16"])
def tile_engine(request: pytest.FixtureRequest) -> Iterator[str]:
    """Each engine of the tile linears this CPU and build can run, in turn: AMX, and the
    AVX512-BF16 dot products a CPU without AMX runs (also run on an AMX host, by choice). The
    process's engine is put back after the test."""
    library = native_library()
    wanted = TILES_AMX if request.param == "amx" else TILES_AVX512
    if library is None or library.tile_engine < wanted:
        pytest.skip(f"the tile linears cannot run on {request.param} here (CPU or build)")
    assert library.set_tile_engine(wanted) == wanted
    try:
        yield request.param
    finally:
        library.set_tile_engine(library.tile_engine)
