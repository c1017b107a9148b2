"""The bfloat16 forward with the native ops (`dtype=bfloat16`, what `dtype=auto` picks on CPUs that
multiply bfloat16 natively; each kernel is held to its torch op in tests/ops): the engine's logits
stay within bfloat16 rounding of transformers' bfloat16 forward on the same weights, with the
tile linears and without them. Skipped without a C compiler."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from built_kernels import HAS_TILES, needs_kernels
from torch import nn
from transformers import AutoModelForCausalLM

from kvseal import LLM, SamplingParams
from kvseal.models.llama import CausalLM
from kvseal.ops.native_backend import NativeOps
from kvseal.ops.native_linears import TileLinear
from kvseal.ops.torch_linears import PackedLinear, onednn_bf16

pytestmark = needs_kernels
BF16 = torch.bfloat16
ULP = 2.0**-7  # one bfloat16 ulp, relative (8 significant bits)


def test_the_bf16_engine_runs_native_with_packed_linears(llama_dir: Path) -> None:
    """Tiles where this CPU and build run them (AMX or AVX512-BF16), else oneDNN's packing where
    it multiplies bfloat16, else plain linears."""
    model = LLM(str(llama_dir), kv_cache_tokens=256, page_size=4, dtype="bfloat16").engine.runner.model
    assert isinstance(model, CausalLM) and model.ops.name == "native"
    linears = [m for m in model.modules() if isinstance(m, (torch.nn.Linear, PackedLinear, TileLinear))]
    kind = TileLinear if HAS_TILES else PackedLinear if onednn_bf16() else torch.nn.Linear
    assert linears and all(isinstance(m, kind) for m in linears)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "qwen3"])  # qwen3: head_dim 32, the paged kernel
@pytest.mark.parametrize("linears", ["tiles", "fallback"])  # fallback: a CPU without AVX512-BF16 (oneDNN or nn.Linear)
def test_bf16_logits_within_rounding_of_transformers(arch: str, linears: str, tiny_model_dirs: dict[str, Path],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The logits of a prefill and of each decode step after it, against transformers' bfloat16
    forward of the same tokens (teacher-forced: both see kvseal's tokens)."""
    from kvseal.engine.batch import build_forward_batch
    from kvseal.types import Request, ScheduledChunk

    if linears == "tiles" and not HAS_TILES:
        pytest.skip("no tile linears here (CPU or build)")
    if linears == "fallback":  # the native ops with torch's bfloat16 linears
        real = NativeOps.linear

        def no_tiles(self: NativeOps, linear: nn.Linear, weight_dtype: torch.dtype) -> nn.Module:
            return self.fallback.linear(linear, weight_dtype) if linear.weight.dtype == BF16 \
                else real(self, linear, weight_dtype)

        monkeypatch.setattr(NativeOps, "linear", no_tiles)
    engine = LLM(str(tiny_model_dirs[arch]), kv_cache_tokens=256, page_size=4, dtype="bfloat16").engine
    assert any(isinstance(m, TileLinear) for m in engine.runner.model.modules()) == (linears == "tiles")
    prompt, steps = list(range(30, 75)), 6
    request = Request("r", "t", prompt, SamplingParams(max_tokens=steps))
    engine.kv.reserve("r", "t", len(prompt) + steps)
    ours, tokens, chunk = [], list(prompt), len(prompt)
    for _ in range(steps):
        prepared = build_forward_batch([ScheduledChunk(request, chunk)], engine.kv)
        with engine.kv.recording(prepared.writes):
            logits = engine.runner.run(prepared.batch).logits[-1]
        ours.append(logits)
        tokens.append(int(logits.argmax()))
        request.num_computed_tokens += chunk
        request.output_token_ids.append(tokens[-1])
        chunk = 1
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dirs[arch], dtype=BF16).eval()
    with torch.no_grad():
        theirs = model(torch.tensor([tokens])).logits[0, len(prompt) - 1:-1].float()
    scale = theirs.abs().max().item()
    torch.testing.assert_close(torch.stack(ours), theirs, rtol=0, atol=4 * ULP * scale)
