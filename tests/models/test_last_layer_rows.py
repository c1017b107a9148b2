"""The last decoder layer's tail (o_proj, MLP, final norm) runs on the sampled tokens only
(`llama._sampled_rows`): every other token of a prefill chunk needs only the K/V that the
layer's qkv projection writes for all of them. Checked on the native float32 forward and on
the torch one (bfloat16, and Qwen3's per-head q/k norms), against the same forward with
every row carried through: the same tokens, logprobs equal to float rounding, and the tail
of the last layer seeing one row per sampled request."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvseal.models import llama
from kvseal.types import SamplingParams

PROMPTS = [list(range(20, 45)), list(range(50, 90)), [7, 8, 9], list(range(100, 117))]
PARAMS = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=3)


def _rows_into_last_mlp(llm: Any) -> list[int]:
    """Record how many rows each call of the last layer's down_proj gets."""
    seen: list[int] = []
    down = llm.engine.runner.model.model.layers[-1].mlp.down_proj
    down.register_forward_hook(lambda module, args, out: seen.append(args[0].shape[0]))
    return seen


@pytest.mark.parametrize("arch, dtype", [("llama", "float32"), ("qwen3", "float32"), ("llama", "bfloat16")])
def test_tail_of_last_layer_on_sampled_rows_only(make_llm: Callable[..., Any], tiny_model_dirs: dict[str, Path],
                                                 monkeypatch: pytest.MonkeyPatch, arch: str, dtype: str) -> None:
    model = str(tiny_model_dirs[arch])
    # the layer-by-layer forward, whose modules the hooks see, on every host: where the native
    # loop takes these steps whole (a CPU without AMX runs the tiny model's bfloat16 prefill
    # attention natively) it trims the tail itself (tests/ops/test_decode_loop.py)
    monkeypatch.setattr(llama.CausalLM, "decode_loop", lambda self: None)
    trimmed = make_llm(model=model, dtype=dtype, max_num_batched_tokens=64)
    seen = _rows_into_last_mlp(trimmed)
    out = trimmed.generate(PROMPTS, PARAMS)
    # the first step prefills 25 + 39 of the 40 tokens (the budget is 64): one sampled row;
    # the second finishes prompt 2 and prefills prompts 3 and 4 with prompt 1's first decode
    assert seen[:2] == [1, 4], seen
    assert all(n <= len(PROMPTS) for n in seen)

    monkeypatch.setattr(llama, "_sampled_rows", lambda batch: None)  # every row through the tail
    full = make_llm(model=model, dtype=dtype, max_num_batched_tokens=64)
    full_seen = _rows_into_last_mlp(full)
    reference = full.generate(PROMPTS, PARAMS)
    assert full_seen[:2] == [64, 1 + 1 + 3 + 17], full_seen  # the fault is live: all rows went through
    tolerance = 1e-4 if dtype == "float32" else 5e-2
    for a, b in zip(out, reference):
        assert a.token_ids == b.token_ids
        assert a.logprobs is not None and b.logprobs is not None
        for x, y in zip(a.logprobs, b.logprobs):
            assert x.token_id == y.token_id
            assert abs(x.logprob - y.logprob) <= tolerance


def test_a_step_with_no_sampled_row_runs_no_tail(make_llm: Callable[..., Any]) -> None:
    """A step of middle chunks only (a prompt longer than the budget) samples nothing: the
    last layer's MLP gets zero rows and the step returns no logits, yet the prompt's K/V is
    complete (the request then decodes as the untrimmed forward would)."""
    llm = make_llm(max_num_batched_tokens=16)
    seen = _rows_into_last_mlp(llm)
    prompt = list(range(30, 70))  # 40 tokens: chunks of 16, 16, 8
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    got = llm.generate([prompt], params)[0].token_ids
    assert seen[:3] == [0, 0, 1], seen
    one_step = make_llm(max_num_batched_tokens=64).generate([prompt], params)[0].token_ids  # no chunking
    assert got == one_step
