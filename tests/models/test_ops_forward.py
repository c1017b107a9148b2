"""The engine's forward with the native ops against the same engine with the torch ops
(`--native off`), float32: the same greedy tokens, logprobs to float32 tolerance; and the MLP's
one-pass gate/up + SiLU kernel against its two passes, bit-equal. Skipped without a C compiler."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from built_kernels import needs_kernels

from kvseal.ops.native_kernels import NativeKernels
from kvseal.types import SamplingParams

pytestmark = needs_kernels


def test_native_forward_equals_the_torch_forward(make_llm: Callable[..., Any]) -> None:
    """Greedy tokens and logprobs with the native fused ops against the same engine with torch ops
    (mixed prefill and decode steps: chunks of 32 tokens)."""
    prompts = [list(range(20, 32)), list(range(50, 90)), [7, 8]]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=0)
    llm = make_llm()
    assert llm.engine.runner.model.ops.name == "native", "a float32 engine runs the native ops"
    fused = llm.generate(prompts, params)
    plain_llm = make_llm(native="off")
    assert plain_llm.engine.runner.model.ops.name == "torch"
    plain = plain_llm.generate(prompts, params)
    for a, b in zip(fused, plain):
        assert a.token_ids == b.token_ids
        assert a.logprobs is not None and b.logprobs is not None
        torch.testing.assert_close(torch.tensor([lp.logprob for lp in a.logprobs]),
                                   torch.tensor([lp.logprob for lp in b.logprobs]), rtol=0, atol=1e-4)




def test_prefill_runs_the_mlp_in_one_pass_and_the_tokens_do_not_change(make_llm: Callable[..., Any],
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2)
    prompts = [list(range(10, 40)), list(range(50, 61))]
    fused_calls: list[int] = []
    one_pass = NativeKernels.linear_silu

    def counted(self: NativeKernels, *args: Any) -> torch.Tensor | None:
        out = one_pass(self, *args)
        fused_calls.append(0 if out is None else out.shape[0])
        return out

    monkeypatch.setattr(NativeKernels, "linear_silu", counted)
    fused = make_llm().generate(prompts, params)
    assert max(fused_calls) > 1, "a prefill step's MLP ran in the one-pass kernel"
    monkeypatch.setattr(NativeKernels, "linear_silu", lambda *args: None)  # the two passes everywhere
    two_pass = make_llm().generate(prompts, params)
    for a, b in zip(fused, two_pass):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs  # bit-equal, so equal logprobs
