"""The whole engine on `TritonOps` (the CUDA backend), run here on CPU tensors under Triton's
interpreter: the same greedy tokens and logprobs as the torch ops, through chunked prefill (the
second chunk attends over the pool), decode, and a prefix-cache hit."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvseal import SamplingParams
from kvseal.ops import TorchOps, triton_attention, triton_backend

# tests/ops/conftest.py switched the interpreter on before this import
assert triton_attention.WIDEN_DOTS, "kvseal.ops.triton_attention was imported before TRITON_INTERPRET=1"

SHARED = list(range(30, 62))  # 32 tokens: whole pages, so a second request hits the cache
PROMPTS = [SHARED + [5, 6, 7], list(range(100, 147)), [9, 10], SHARED + [11]]
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2)


def _run(make_llm: Callable[..., Any], model: Path, triton: bool, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    ops = triton_backend.TritonOps() if triton else TorchOps()
    monkeypatch.setattr("kvseal.engine.engine.select_ops", lambda *args, **kwargs: ops)
    llm = make_llm(model=str(model), native="off", enable_prefix_caching=True)
    assert llm.engine.ops is ops
    first = llm.generate(PROMPTS[:3], GREEDY)
    second = llm.generate(PROMPTS[3:], GREEDY)  # shares 32 cached tokens with the first prompt
    llm.engine.check_integrity()
    return [*first, *second]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_triton_ops_give_the_torch_ops_tokens(arch: str, tiny_model_dirs: dict[str, Path],
                                              make_llm: Callable[..., Any], monkeypatch: pytest.MonkeyPatch) -> None:
    expected = _run(make_llm, tiny_model_dirs[arch], False, monkeypatch)
    got = _run(make_llm, tiny_model_dirs[arch], True, monkeypatch)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert got[3].num_cached_tokens > 0, "the last prompt was served after a prefix-cache hit"
    for ours, theirs in zip(got, expected):
        for a, b in zip(ours.logprobs, theirs.logprobs, strict=True):
            assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
            assert all(abs(x - y) < 1e-4 for (_, x), (_, y) in zip(a.top, b.top))
