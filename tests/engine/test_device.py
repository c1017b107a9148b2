"""`--device auto|cpu|cuda` and `--attention-backend`: what is decided at start-up, what is refused,
and the same engine on every device. The CUDA tests are `gpu`-marked (they skip without a GPU);
the device-generic code runs here on CPU tensors, the Triton backend under Triton's interpreter."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from kvseal import ConfigError, SamplingParams
from kvseal.cli import build_parser
from kvseal.config import EngineArgs
from kvseal.engine_args import engine_args_from
from kvseal.ops import select_ops
from kvseal.ops.device import DeviceInfo, resolve_device

GREEDY = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
PROMPTS = [list(range(30, 62)) + [5, 6], list(range(100, 119)), [9, 10]]
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where torch sees no GPU")


def test_auto_is_the_cpu_where_torch_sees_no_gpu() -> None:
    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cpu") == "cpu"


@no_cuda
def test_cuda_without_a_gpu_is_a_clear_start_up_error(make_llm: Callable[..., Any]) -> None:
    with pytest.raises(ConfigError, match=r"--device cuda: torch .* sees no CUDA device.*--device cpu"):
        make_llm(device="cuda", model="/nonexistent-model")  # refused before any weight is read


def test_a_bad_device_or_backend_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="device must be one of auto, cpu, cuda"):
        EngineArgs(device="tpu")
    with pytest.raises(ConfigError, match="attention_backend must be one of auto, triton"):
        EngineArgs(attention_backend="flash")
    with pytest.raises(ConfigError, match="fraction in"):
        EngineArgs(gpu_memory_utilization=1.5)


def test_auto_dtype_is_bfloat16_on_cuda_and_a_given_dtype_stays() -> None:
    assert EngineArgs(device="cuda").dtype == "bfloat16"
    assert EngineArgs().on_device("cuda").dtype == "bfloat16"
    assert EngineArgs(dtype="float32").on_device("cuda").dtype == "float32"
    assert EngineArgs(dtype="float16", device="cuda").dtype == "float16"
    copied = EngineArgs(**vars(EngineArgs()))  # what `kvseal generate` hands LLM(...)
    assert copied.on_device("cuda").dtype == "bfloat16"


@pytest.mark.parametrize("command", ["generate", "serve", "engine"])
def test_every_engine_command_takes_the_device_flags(command: str) -> None:
    parser = build_parser()
    extra = {"generate": ["hello"], "serve": [], "engine": ["--role", "prefill", "--listen", "127.0.0.1:1"]}[command]
    ns, _ = parser.parse_known_args([command, *extra, "--device", "cpu", "--attention-backend", "triton",
                                     "--gpu-memory-utilization", "0.5"])
    args = engine_args_from(ns)
    assert (args.device, args.attention_backend, args.gpu_memory_utilization) == ("cpu", "triton", 0.5)


def test_native_require_on_cuda_is_refused_before_anything_loads() -> None:
    with pytest.raises(ConfigError, match="CPU kernels; on --device cuda the Triton backend runs"):
        select_ops("require", "cuda")


def test_the_triton_backend_on_cpu_needs_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    import triton

    assert select_ops("off", "cpu", attention_backend="triton").name == "triton"
    monkeypatch.setattr(triton.knobs.runtime, "interpret", False)
    with pytest.raises(ConfigError, match="TRITON_INTERPRET=1"):
        select_ops("off", "cpu", attention_backend="triton")


def test_the_engine_logs_its_device_and_pool(make_llm: Callable[..., Any], caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("INFO", logger="kvseal"):
        llm = make_llm(device="cpu")
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("kvseal engine:"))
    assert "device=cpu (cpu)" in line and f"kv_pool_bytes={llm.engine.kv.pool.num_bytes}" in line
    assert DeviceInfo.of("cpu").describe() == "cpu"


def _tokens(make_llm: Callable[..., Any], model: Path, **kwargs: Any) -> list[list[int]]:
    llm = make_llm(model=str(model), native="off", **kwargs)
    outputs = llm.generate(PROMPTS, GREEDY)
    llm.engine.check_integrity()
    return [o.token_ids for o in outputs]


def test_attention_backend_triton_runs_through_the_dispatch_on_cpu(make_llm: Callable[..., Any],
                                                                   llama_dir: Path) -> None:
    llm = make_llm(native="off", attention_backend="triton", device="cpu")
    assert llm.engine.ops.name == "triton"
    assert _tokens(make_llm, llama_dir, attention_backend="triton") == _tokens(make_llm, llama_dir)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_cuda_gives_the_cpu_tokens(arch: str, make_llm: Callable[..., Any], tiny_model_dirs: dict[str, Path]) -> None:
    model = tiny_model_dirs[arch]
    on_gpu = make_llm(model=str(model), device="cuda", dtype="float32")
    assert on_gpu.engine.kv.pool.k[0].device.type == "cuda"
    assert on_gpu.engine.kv.records.page_row.device.type == "cuda"
    assert next(on_gpu.engine.runner.model.parameters()).device.type == "cuda"
    got = [o.token_ids for o in on_gpu.generate(PROMPTS, GREEDY)]
    on_gpu.engine.check_integrity()
    assert got == _tokens(make_llm, model, device="cpu", dtype="float32")


@pytest.mark.gpu
def test_seeded_sampling_is_the_same_on_cuda_and_cpu(make_llm: Callable[..., Any], llama_dir: Path) -> None:
    params = SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, top_k=50, seed=7, ignore_eos=True,
                            repetition_penalty=1.1, logprobs=2)
    cpu = make_llm(device="cpu", native="off").generate(PROMPTS, params)
    cuda = make_llm(device="cuda").generate(PROMPTS, params)
    assert [o.token_ids for o in cuda] == [o.token_ids for o in cpu]
