"""The KV pool reserved before the engine process imports torch (`kvseal.kvcache.reserve`): its
dimensions are the ones the engine resolves, the engine adopts it only when it is exactly its
pool (else releases it: thread stopped, memory unmapped), and it is made only where the engine
runs a one-process CPU pool."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from kvseal.config import EngineArgs
from kvseal.engine.engine import LLMEngine
from kvseal.errors import ConfigError
from kvseal.kvcache.pool import KVPool
from kvseal.kvcache.reserve import PoolGeometry, PoolReservation, early_geometry, reserve_cpu_pool
from kvseal.models.loader import folder_config
from kvseal.types import SamplingParams


def _args(model: Path, **changes: object) -> EngineArgs:
    flags: dict[str, object] = dict(model=str(model), device="cpu", dtype="float32", kv_cache_memory="1MiB",
                                    max_model_len=64, page_size=4) | changes
    return EngineArgs(**flags)  # type: ignore[arg-type]


def _resolved(args: EngineArgs) -> PoolGeometry:
    """The pool the engine resolves once torch and transformers have read the model."""
    cfg = folder_config(args.model)
    cache, _ = args.resolve(cfg)
    return PoolGeometry(cfg.num_layers, cache.num_pages, cache.page_size, cfg.num_kv_heads, cfg.head_dim,
                        str(cache.dtype).removeprefix("torch."))


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_the_early_geometry_is_the_pool_the_engine_resolves(tiny_model_dirs: dict[str, Path], arch: str) -> None:
    """qwen3's head_dim is not hidden_size / heads, qwen2's config.json leaves it out."""
    for args in (_args(tiny_model_dirs[arch]), _args(tiny_model_dirs[arch], dtype="bfloat16", kv_cache_tokens=200)):
        assert early_geometry(args) == _resolved(args)


def _greedy(engine: LLMEngine) -> list[int]:
    engine.add_request("r", [5, 9, 14, 3, 7, 22, 8], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    while True:
        for out in engine.step():
            if out.finished:
                return out.token_ids


def test_the_engine_adopts_a_reservation_of_its_pool(llama_dir: Path) -> None:
    args = _args(llama_dir)
    reservation = reserve_cpu_pool(args)
    assert reservation is not None
    engine = LLMEngine(args, pool_reservation=reservation)
    pool = engine.kv.pool
    assert pool.reserved is reservation and pool.observer is engine.kv.records
    assert [t.data_ptr() for t in (*pool.k, *pool.v)] == [m.address for m in reservation.mappings]
    assert not any(bool(t.any()) for t in (*pool.k, *pool.v))
    assert _greedy(engine) == _greedy(LLMEngine(args))  # the same tokens as a pool of its own


def test_a_reservation_of_another_pool_is_released_and_the_engine_builds_its_own(llama_dir: Path) -> None:
    args = _args(llama_dir)
    other = reserve_cpu_pool(replace(args, kv_cache_memory="2MiB"))
    assert other is not None and other.geometry != _resolved(args)
    engine = LLMEngine(args, pool_reservation=other)
    assert engine.kv.pool.reserved is None
    assert all(m.region.closed for m in other.mappings), "its memory is unmapped"
    with pytest.raises(RuntimeError, match="released"):
        other.wait()
    assert len(_greedy(engine)) == 6


def test_an_engine_that_cannot_start_releases_the_reservation_and_says_why(llama_dir: Path) -> None:
    args = _args(llama_dir, max_model_len=100_000)  # past the model's 256 positions: resolve() refuses it
    reservation = reserve_cpu_pool(args)
    assert reservation is not None
    with pytest.raises(ConfigError, match="max_position_embeddings"):
        LLMEngine(args, pool_reservation=reservation)
    assert all(m.region.closed for m in reservation.mappings)


def test_a_pool_refuses_a_reservation_of_other_dimensions(llama_dir: Path) -> None:
    geometry = _resolved(_args(llama_dir))
    reservation = PoolReservation(geometry)
    with pytest.raises(ValueError, match="not this pool"):
        KVPool(geometry.num_layers, geometry.num_pages + 1, geometry.page_size, geometry.num_kv_heads,
               geometry.head_dim, torch.float32, reserved=reservation)
    with pytest.raises(ValueError, match="not this pool"):
        KVPool(*(getattr(geometry, f) for f in ("num_layers", "num_pages", "page_size", "num_kv_heads", "head_dim")),
               torch.bfloat16, reserved=reservation)
    reservation.release()


def test_a_released_reservation_has_stopped_writing_before_its_memory_goes() -> None:
    """Released while its thread writes (16 mappings of 16 MiB): were the memory unmapped under
    the thread, this process would die of SIGSEGV."""
    reservation = PoolReservation(PoolGeometry(8, 4096, 16, 2, 64, "bfloat16"))
    reservation.release()
    assert all(m.region.closed for m in reservation.mappings)
    reservation.release()  # a second release has nothing left to do


def test_no_reservation_where_the_engine_runs_no_one_process_cpu_pool(llama_dir: Path, tmp_path: Path) -> None:
    assert early_geometry(_args(llama_dir)) is not None
    assert early_geometry(_args(llama_dir, device="cuda")) is None
    assert early_geometry(_args(llama_dir, tensor_parallel_size=2)) is None
    unconverted = tmp_path / "model.gguf"  # no converted folder for it yet: its dimensions are unknown
    unconverted.write_bytes(b"GGUF")
    assert early_geometry(_args(unconverted)) is None
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "config.json").write_text('{"num_hidden_layers": 2, "hidden_size": 64}')
    assert early_geometry(_args(partial)) is None
    assert early_geometry(_args(tmp_path / "missing")) is None
