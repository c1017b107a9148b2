"""The KV pool on a GPU (`--gpu-memory-utilization`): the arithmetic as pure functions with given
numbers, `kvseal plan --device cuda` printing the engine's figures, the weights counted from a
config equal to what the loaded model holds, and (on a GPU) the engine's pool from them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from kvseal import ConfigError
from kvseal.capacity import GIB, GpuMemoryPlan, KvCapacity
from kvseal.cli import main
from kvseal.config import EngineArgs
from kvseal.engine.gpu_memory import model_bytes, profiling_batch
from kvseal.kvcache.pool import KVPool
from kvseal.models.loader import load_model, plan_config


def test_the_pool_is_the_budget_less_weights_and_activations() -> None:
    plan = GpuMemoryPlan(free_bytes=100 * GIB, utilization=0.9, weights_bytes=16 * GIB,
                         activation_peak_bytes=2 * GIB)
    assert plan.budget_bytes == 90 * GIB
    assert plan.kv_bytes == plan.require_room() == 72 * GIB
    cap = EngineArgs(device="cuda", page_size=16).capacity(_cfg(), plan.kv_bytes)
    assert cap.num_pages == 72 * GIB // cap.page_bytes


def test_no_room_left_is_refused_naming_every_number() -> None:
    plan = GpuMemoryPlan(free_bytes=20 * GIB, utilization=0.5, weights_bytes=9 * GIB, activation_peak_bytes=2 * GIB)
    with pytest.raises(ConfigError) as info:
        plan.require_room()
    message = str(info.value)
    for figure in ("20.00 GiB free", "gpu_memory_utilization 0.5", "10.00 GiB", "9.00 GiB of weights",
                   "2.00 GiB", "--gpu-memory-utilization", "--max-num-batched-tokens"):
        assert figure in message


def test_the_pool_sized_by_the_gpu_still_must_hold_max_model_len() -> None:
    cfg = _cfg()
    args = EngineArgs(device="cuda", page_size=16, max_model_len=128)
    per_token = args.capacity(cfg, GIB).bytes_per_token
    with pytest.raises(ConfigError, match="the KV cache pool holds 64 tokens but max_model_len is 128"):
        args.resolve(cfg, 64 * per_token)
    cache, _ = args.resolve(cfg, 128 * per_token)
    assert (cache.kv_cache_tokens, cache.device) == (128, "cuda")


def test_kv_cache_memory_or_tokens_size_the_pool_on_a_gpu_too() -> None:
    assert EngineArgs(device="cuda").is_pool_sized_by_device
    assert not EngineArgs(device="cuda", kv_cache_memory="1GiB").is_pool_sized_by_device
    assert not EngineArgs(device="cuda", kv_cache_tokens=4096).is_pool_sized_by_device
    assert not EngineArgs(device="cpu").is_pool_sized_by_device
    cfg = _cfg()
    default = EngineArgs(device="cpu", dtype="float32").capacity(cfg)
    assert default.kv_memory_bytes == 2 * GIB  # the CPU's default budget when nothing is given


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_weights_counted_from_the_config_are_what_the_model_holds(arch: str,
                                                                   tiny_model_dirs: dict[str, Path]) -> None:
    cfg = plan_config(tiny_model_dirs[arch])
    model = load_model(tiny_model_dirs[arch], torch.float32).model
    assert cfg.weight_bytes("float32") == model_bytes(model)
    assert cfg.weight_bytes("bfloat16") == model_bytes(model.to(torch.bfloat16))


def test_plan_prints_the_engine_arithmetic(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "config.json").write_text(LLAMA_8B)
    rc = main(["plan", "--model", str(tmp_path), "--device", "cuda", "--gpu-memory", "139GiB",
               "--activation-memory", "2GiB", "--max-model-len", "8192"])
    out = capsys.readouterr().out
    assert rc == 0, out
    cfg = plan_config(tmp_path)
    expected = GpuMemoryPlan(139 * GIB, 0.9, cfg.weight_bytes("bfloat16"), 2 * GIB)
    cap = KvCapacity.for_dims(32, 8, 128, 2, 16).with_memory(expected.kv_bytes)
    assert f"{expected.kv_bytes:,} bytes" in out and f"{cap.num_pages:,} pages = {cap.pool_tokens:,} tokens" in out
    assert "bfloat16 (2 bytes)" in out  # auto on CUDA
    assert "14.96 GiB" in out  # Llama-3-8B's 8.03e9 parameters in bfloat16


def test_plan_refuses_a_gpu_too_small_for_the_weights(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "config.json").write_text(LLAMA_8B)
    rc = main(["plan", "--model", str(tmp_path), "--device", "cuda", "--gpu-memory", "16GiB",
               "--max-model-len", "8192"])
    assert rc == 1 and "REFUSED: no GPU memory is left for the KV pool" in capsys.readouterr().out
    assert main(["plan", "--model", str(tmp_path), "--device", "cuda", "--max-model-len", "8192"]) == 2
    assert "give --gpu-memory" in capsys.readouterr().err


def test_the_profiling_forward_is_a_full_step_of_one_fresh_prompt(llama_dir: Path) -> None:
    """The batch the GPU's activation peak is measured with (here on the CPU): a full step's
    tokens as one fresh prompt whose last rows are sampled, through the model into a scratch pool."""
    model = load_model(llama_dir, torch.float32).model
    batch = profiling_batch(num_tokens=40, num_sampled=8, page_size=16, device=torch.device("cpu"))
    pool = KVPool(model.config.num_layers, 3, 16, model.config.num_kv_heads, model.config.head_dim, torch.float32)
    logits = model(batch, pool)
    assert logits.shape == (8, model.config.vocab_size) and torch.isfinite(logits).all()
    assert batch.logits_indices.tolist() == list(range(32, 40))
    assert pool.k[0].flatten(1, 2)[:, :40].abs().sum() > 0  # every token's KV went to the scratch pool


@pytest.mark.gpu
def test_the_engine_sizes_its_pool_from_the_gpu(make_llm: Callable[..., Any], llama_dir: Path) -> None:
    llm = make_llm(device="cuda", kv_cache_tokens=None, gpu_memory_utilization=0.01, max_model_len=256)
    engine = llm.engine
    plan = engine.gpu_memory
    assert plan is not None and plan.weights_bytes == model_bytes(engine.runner.model)
    assert plan.activation_peak_bytes > 0
    cap = EngineArgs(device="cuda", dtype="float32", page_size=4).capacity(engine.model_config, plan.kv_bytes)
    assert engine.cache_config.num_pages == cap.num_pages
    assert engine.kv.pool.num_bytes <= plan.kv_bytes


def _cfg() -> Any:
    from transformers import LlamaConfig

    from kvseal.config import ModelConfig

    return ModelConfig.from_hf(LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256))


LLAMA_8B = ('{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, '
            '"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, '
            '"num_key_value_heads": 8, "rms_norm_eps": 1e-5, "max_position_embeddings": 8192, '
            '"rope_theta": 500000.0, "tie_word_embeddings": false, "eos_token_id": 128001}')
