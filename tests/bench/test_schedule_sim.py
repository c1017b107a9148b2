"""bench/schedule_sim.py: the real scheduler on a modelled clock (no wall-clock timing here)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parents[2] / "bench"))

from schedule_sim import StepCost, simulate  # noqa: E402

ONE_SECOND_PER_PREFILL_TOKEN = StepCost(base_s=0.0, decode_s=0.0, prefill_s=1.0)


def _prompts(num: int, length: int) -> list[list[int]]:
    return [[10 + i] * length for i in range(num)]


def test_a_burst_is_prefilled_first_come_first_served(make_llm: Callable[..., Any]) -> None:
    """Four 16-token prompts at once under a 16-token budget: one prompt completes per step, in
    arrival order, instead of all four advancing together and finishing last together."""
    llm = make_llm(max_num_batched_tokens=16, max_prefill_chunk_tokens=16)
    result = simulate(llm.engine, _prompts(4, 16), 1, 4, ONE_SECOND_PER_PREFILL_TOKEN)
    assert result["ttft_groups_s"] == [(16.0, 1), (32.0, 1), (48.0, 1), (64.0, 1)]
    assert result["p99_ttft_s"] == 64.0 and result["mean_ttft_s"] == 40.0


def test_a_prompt_seen_before_is_a_prefix_cache_hit_on_the_modelled_clock(make_llm: Callable[..., Any]) -> None:
    llm = make_llm(max_num_batched_tokens=32, max_prefill_chunk_tokens=32)
    prompts = _prompts(1, 16)
    first = simulate(llm.engine, prompts, 1, 1, ONE_SECOND_PER_PREFILL_TOKEN)
    again = simulate(llm.engine, prompts, 1, 1, ONE_SECOND_PER_PREFILL_TOKEN)
    assert first["p99_ttft_s"] == 16.0
    assert again["p99_ttft_s"] < first["p99_ttft_s"]  # only the tokens past the cached full pages run
