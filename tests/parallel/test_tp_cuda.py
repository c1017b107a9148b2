"""Tensor parallelism on CUDA: each rank on its own GPU, the forward's collectives over nccl
(`parallel/rank_device.py`). Marked gpu (skipped where torch sees no GPU); TP=2 needs two GPUs,
since NCCL refuses two ranks of one group on one device."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_models import make_tiny_model
from torch import nn

from kvseal import LLM, SamplingParams
from kvseal.models.tensor_parallel import WidePartialLinear
from kvseal.ops import select_ops

pytestmark = pytest.mark.gpu
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2,
                              reason="TP=2 on CUDA needs two GPUs (NCCL refuses two ranks on one device)")

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
PROMPTS = [list(range(10, 17)), [20, 21, 22], list(range(30, 60)), list(range(100, 141))]
POOL = dict(kv_cache_tokens=96, max_model_len=64, page_size=4, max_num_batched_tokens=32, dtype="bfloat16",
            device="cuda", tp_timeout_s=60.0)


def test_wide_partials_on_cuda_are_the_float32_sum_of_the_bf16_product() -> None:
    """One GPU suffices: cuBLAS's float32 output of the bfloat16 product, never rounded to bfloat16."""
    torch.manual_seed(0)
    linear = nn.Linear(256, 64, bias=True, dtype=torch.bfloat16, device="cuda")
    x = torch.randn(16, 256, device="cuda").to(torch.bfloat16)
    got = WidePartialLinear(linear, select_ops("off", "cuda"))(x)
    assert got.dtype == torch.float32 and got.device.type == "cuda"
    expected = torch.nn.functional.linear(x.double(), linear.weight.double(), linear.bias.double())
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)


@two_gpus
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tp2_on_two_gpus_is_greedy_equal_to_tp1(tmp_path: Path, arch: str) -> None:
    folder = make_tiny_model(arch, tmp_path / arch)
    one = LLM(str(folder), **POOL)  # type: ignore[arg-type]
    try:
        expected = [o.token_ids for o in one.generate(PROMPTS, GREEDY)]
    finally:
        one.engine.close()
    two = LLM(str(folder), tensor_parallel_size=2, **POOL)  # type: ignore[arg-type]
    try:
        assert two.engine.driver is not None and two.engine.driver.group.forward_backend == "nccl"
        assert [o.token_ids for o in two.generate(PROMPTS, GREEDY)] == expected
        assert two.engine.stats().num_preemptions > 0
        two.engine.check_integrity()
    finally:
        two.engine.close()
