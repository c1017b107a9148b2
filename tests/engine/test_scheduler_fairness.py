"""Fairness between tenants: decodes first, a capped prefill chunk per request, the prefill
budget shared between tenants, and every tenant but the one with the least prefill left held to
its fair share of work while another tenant has requests in flight. Everything is counted in
steps, tokens and token-equivalents of work, never in time."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvseal import SamplingParams
from kvseal.config import EngineArgs, ModelConfig, SchedulerConfig
from kvseal.engine.scheduler import TENANT_LINGER_S, chunk_cost, num_tokens_left, share_prefill_budget, tokens_within
from kvseal.engine_args import add_engine_arguments, engine_args_from
from kvseal.errors import ConfigError
from kvseal.types import Request

LONG = 120  # tokens in a tenant-A prompt: many steps of prefill at the caps below
BUDGET = 32
CAP = 8


def _long_prompt(i: int) -> list[int]:
    return [3 + (7 * i + j) % 500 for j in range(LONG)]


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def _record_steps(engine: Any) -> list[list[tuple[str, str, int]]]:
    """Wrap the real scheduler so every step's chunks are kept as (request id, tenant, tokens)."""
    steps: list[list[tuple[str, str, int]]] = []
    schedule = engine.scheduler.schedule

    def recording() -> Any:
        out = schedule()
        steps.append([(c.request.request_id, c.request.tenant, c.num_new_tokens) for c in out.chunks])
        return out

    engine.scheduler.schedule = recording
    return steps


def _is_prefilling(engine: Any, request_id: str) -> bool:
    request = engine.find(request_id)
    return request is not None and request.num_computed_tokens < request.num_prompt_tokens


def _steps_to_first_token(engine: Any, request_id: str, max_steps: int = 200) -> int:
    for step in range(1, max_steps + 1):
        outs = engine.step()
        engine.check_integrity()
        if any(o.request_id == request_id and o.new_token_ids for o in outs):
            return step
    raise AssertionError(f"{request_id} produced no token in {max_steps} steps")


@pytest.fixture
def make_engine(make_llm: Callable[..., Any]) -> Callable[..., Any]:
    def make(**kwargs: Any) -> Any:
        defaults = {"kv_cache_tokens": 1024, "max_num_batched_tokens": BUDGET, "max_prefill_chunk_tokens": CAP}
        return make_llm(**{**defaults, **kwargs}).engine

    return make


def _start_long_prefills(engine: Any, num_long: int, tenant: str = "A") -> list[str]:
    ids = [f"long{i}" for i in range(num_long)]
    for i, request_id in enumerate(ids):
        engine.add_request(request_id, _long_prompt(i), _params(4), tenant=tenant)
    engine.step()
    engine.step()
    assert all(_is_prefilling(engine, i) for i in ids), "the long prompts are still in prefill"
    return ids


@pytest.mark.parametrize("prompt_len", [6, 8, 20, 40])
def test_short_request_of_another_tenant_gets_its_first_token_in_bounded_steps(
        make_engine: Callable[..., Any], prompt_len: int) -> None:
    engine = make_engine()
    cap = engine.scheduler_config.max_prefill_chunk_tokens
    assert cap == CAP
    longs = _start_long_prefills(engine, 4)
    engine.add_request("short", list(range(10, 10 + prompt_len)), _params(4), tenant="B")
    steps = _steps_to_first_token(engine, "short")
    # B's share is half the budget and each of its chunks at most the cap: ceil(len / cap) steps.
    assert steps == math.ceil(prompt_len / min(cap, BUDGET // 2))
    assert any(_is_prefilling(engine, i) for i in longs), "A's prompts were still prefilling meanwhile"


def test_a_tenant_with_many_long_prompts_gets_its_share_not_the_budget(make_engine: Callable[..., Any]) -> None:
    engine = make_engine(max_prefill_chunk_tokens=BUDGET)  # no per-request cap: only the tenant share
    steps = _record_steps(engine)
    _start_long_prefills(engine, 3)
    engine.add_request("b-long", _long_prompt(9)[:48], _params(2), tenant="B")
    while _is_prefilling(engine, "b-long"):
        engine.step()
        engine.check_integrity()
    shared = [s for s in steps[2:] if {t for _, t, _ in s} == {"A", "B"}]
    assert len(shared) == 48 // (BUDGET // 2)  # A's oldest prompt is still prefilling throughout
    for chunks in shared:
        assert sum(n for _, t, n in chunks if t == "B") == BUDGET // 2
        assert sum(n for _, t, n in chunks if t == "A") == BUDGET // 2


def test_decodes_run_every_step_while_long_prefills_are_in_progress(make_engine: Callable[..., Any]) -> None:
    # Eleven tenants with a long prompt each, older than the decodes: their prefill shares
    # alone would leave the decoding tenant fewer tokens than it has decodes.
    engine = make_engine(kv_cache_tokens=2048)
    longs = [f"long{i}" for i in range(11)]
    for i, request_id in enumerate(longs):
        engine.add_request(request_id, _long_prompt(i), _params(2), tenant=f"A{i}")
    engine.step()
    decodes = [f"dec{i}" for i in range(3)]
    for i, request_id in enumerate(decodes):
        engine.add_request(request_id, list(range(20 + i, 24 + i)), _params(60), tenant="D")
    while any(_is_prefilling(engine, i) for i in decodes):
        engine.step()
    assert all(_is_prefilling(engine, i) for i in longs)
    num_steps = 0
    while any(_is_prefilling(engine, i) for i in longs):
        outs = {o.request_id for o in engine.step() if o.new_token_ids}
        engine.check_integrity()
        assert set(decodes) <= outs, f"a decode was held back in step {num_steps}"
        num_steps += 1
        assert num_steps < 100
    assert num_steps >= 10, "the long prefills really took many steps"


def test_chunk_cap_and_budget_hold_under_preemption(make_engine: Callable[..., Any]) -> None:
    cap, budget = 5, 12
    engine = make_engine(kv_cache_tokens=96, max_model_len=96, max_num_batched_tokens=budget,
                         max_prefill_chunk_tokens=cap, max_num_seqs=6)
    steps = _record_steps(engine)
    lengths = [70, 9, 40, 3, 55, 17, 26, 1]
    for i, n in enumerate(lengths):
        engine.add_request(f"r{i}", list(range(5, 5 + n)), _params(1 + i % 5 * 4), tenant=f"t{i % 3}")
    for _ in range(400):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            assert out.error is None, out.error
        engine.check_integrity()
    assert not engine.has_unfinished()
    assert engine.stats().num_preemptions > 0, "the pool is small enough to preempt"
    for chunks in steps:
        assert sum(n for _, _, n in chunks) <= budget
        assert all(1 <= n <= cap for _, _, n in chunks)
        assert len({r for r, _, _ in chunks}) == len(chunks)


def test_greedy_output_is_the_same_under_the_cap_and_contention(make_llm: Callable[..., Any]) -> None:
    prompts = [_long_prompt(i) for i in range(3)] + [list(range(40, 52))]
    alone = [make_llm().generate([p], _params(6))[0].token_ids for p in prompts]
    llm = make_llm(max_num_batched_tokens=12, max_prefill_chunk_tokens=3, kv_cache_tokens=1024)
    together = [o.token_ids for o in llm.generate(prompts, _params(6))]
    assert together == alone


def _requests(spec: list[tuple[int, int]]) -> list[Request]:
    return [Request(f"r{i}", f"t{tenant}", [3] * num_tokens, SamplingParams())
            for i, (tenant, num_tokens) in enumerate(spec)]


@settings(max_examples=300, deadline=None)
@given(spec=st.lists(st.tuples(st.integers(0, 3), st.integers(1, 60)), max_size=12),
       budget=st.integers(0, 64), cap=st.integers(1, 64))
def test_share_prefill_budget_is_capped_work_conserving_and_max_min_fair(
        spec: list[tuple[int, int]], budget: int, cap: int) -> None:
    requests = _requests(spec)
    grants = share_prefill_budget(requests, budget, cap)
    wants = {r.request_id: min(num_tokens_left(r), cap) for r in requests}
    assert all(0 < grants[i] <= wants[i] for i in grants)
    assert sum(grants.values()) == min(budget, sum(wants.values()))  # never above budget, nothing left idle
    got = {r.tenant: 0 for r in requests}
    demand = dict(got)
    for r in requests:
        got[r.tenant] += grants.get(r.request_id, 0)
        demand[r.tenant] += wants[r.request_id]
    for tenant, n in got.items():
        if n < demand[tenant]:  # an unsatisfied tenant has at least everyone else's share, less 1
            assert all(other <= n + 1 for other in got.values()), (got, demand)
    for tenant in got:  # inside a tenant, oldest first: only the last granted request may be partial
        ids = [r.request_id for r in requests if r.tenant == tenant]
        partial = [i for i in ids if 0 < grants.get(i, 0) < wants[i]]
        granted = [i for i in ids if i in grants]
        assert granted == ids[:len(granted)] and partial in ([], granted[-1:])


def test_oldest_request_always_gets_budget_left_by_decodes() -> None:
    requests = _requests([(t, 50) for t in range(5)])
    assert share_prefill_budget(requests, 3, 8) == {"r0": 1, "r1": 1, "r2": 1}


def test_cap_defaults_to_512_or_the_budget_and_is_validated() -> None:
    assert EngineArgs().resolved_max_prefill_chunk_tokens == 512
    assert EngineArgs(max_num_batched_tokens=8192).resolved_max_prefill_chunk_tokens == 512
    assert EngineArgs(max_num_batched_tokens=3).resolved_max_prefill_chunk_tokens == 3
    assert EngineArgs(max_prefill_chunk_tokens=100).resolved_max_prefill_chunk_tokens == 100
    assert SchedulerConfig(64, 32, 4, 32).max_prefill_chunk_tokens == 32
    with pytest.raises(ConfigError, match="exceeds max_num_batched_tokens=32"):
        SchedulerConfig(64, 32, 4, 33)
    with pytest.raises(ConfigError, match="max_prefill_chunk_tokens must be >= 1"):
        SchedulerConfig(64, 32, 4, 0)
    for bad in ("64", 2.5, True):
        with pytest.raises(ConfigError, match="whole number of tokens"):
            EngineArgs(max_prefill_chunk_tokens=bad)  # type: ignore[arg-type]


def test_cap_larger_than_budget_fails_at_start_up(make_llm: Callable[..., Any]) -> None:
    with pytest.raises(ConfigError, match="a chunk must fit in one step's budget"):
        make_llm(max_num_batched_tokens=16, max_prefill_chunk_tokens=17)


def test_engine_flag() -> None:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    assert engine_args_from(parser.parse_args([])).max_prefill_chunk_tokens is None
    args = engine_args_from(parser.parse_args(["--max-prefill-chunk-tokens", "64"]))
    assert args.max_prefill_chunk_tokens == 64


def test_waiting_requests_take_no_share_while_every_seat_is_taken(make_engine: Callable[..., Any]) -> None:
    engine = make_engine(max_num_seqs=1, max_prefill_chunk_tokens=BUDGET)
    steps = _record_steps(engine)
    engine.add_request("long", _long_prompt(0), _params(2), tenant="A")
    engine.add_request("short", [5, 6, 7], _params(2), tenant="B")
    while _is_prefilling(engine, "long"):
        engine.step()
    # From the second step on (the long request holds the only seat) it gets the whole budget.
    assert steps[0] == [("long", "A", BUDGET - 3)]  # both were waiting: B's 3 tokens were planned too
    done = BUDGET - 3
    for chunks in steps[1:]:
        assert chunks == [("long", "A", min(BUDGET, LONG - done))]
        done += chunks[0][2]
    assert _steps_to_first_token(engine, "short") <= 3  # the long request's last token, then the short one


# -- fair shares: work counted with attention, short steps while another tenant waits ----------


def _record_work(engine: Any) -> list[dict[str, float]]:
    """Wrap the real scheduler so every step's prefill work per tenant (`chunk_cost`) is kept."""
    steps: list[dict[str, float]] = []
    schedule = engine.scheduler.schedule
    k = engine.scheduler_config.attention_cost_context

    def recording() -> Any:
        out = schedule()
        work: dict[str, float] = {}
        for c in out.chunks:
            if num_tokens_left(c.request) > 1:  # decodes are not held to shares
                work[c.request.tenant] = work.get(c.request.tenant, 0) + chunk_cost(c.start_pos, c.num_new_tokens, k)
        steps.append(work)
        return out

    engine.scheduler.schedule = recording
    return steps


@settings(max_examples=400, deadline=None)
@given(start=st.integers(0, 10_000), cost=st.floats(0, 5_000), k=st.integers(1, 10_000))
def test_tokens_within_is_the_most_tokens_a_cost_buys(start: int, cost: float, k: int) -> None:
    n = tokens_within(start, cost, k)
    assert n >= 0 and chunk_cost(start, n, k) <= cost < chunk_cost(start, n + 1, k)


def test_chunk_cost_counts_attention_by_context() -> None:
    assert chunk_cost(0, 1, 100) == 1.01  # one token at context 1
    assert chunk_cost(0, 10, 100) == 10 + 55 / 100
    assert chunk_cost(90, 10, 100) == 10 + (900 + 55) / 100
    assert chunk_cost(5, 0, 100) == 0


def test_attention_cost_context_of_smollm2_is_its_linears_over_attention_per_pair() -> None:
    from transformers import LlamaConfig

    smollm2 = ModelConfig.from_hf(LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                              num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                                              architectures=["LlamaForCausalLM"]))
    # per layer: q, o 576x576; k, v 576x192; gate, up, down 576x1536 = 3,538,944 multiply-adds a
    # token, against 2 x 9 heads x 64 = 1,152 a (query, key) pair
    assert smollm2.attention_cost_context(torch.float32) == 3072
    assert smollm2.attention_cost_context(torch.bfloat16) == 1536


@settings(max_examples=300, deadline=None)
@given(spec=st.lists(st.tuples(st.integers(0, 3), st.integers(1, 60), st.integers(0, 400)), max_size=12),
       budget=st.integers(0, 64), cap=st.integers(1, 64), k=st.integers(1, 500),
       caps=st.dictionaries(st.sampled_from(["t0", "t1", "t2", "t3"]), st.integers(1, 40)))
def test_a_capped_tenant_gets_at_most_its_fair_share_of_work(
        spec: list[tuple[int, int, int]], budget: int, cap: int, k: int, caps: dict[str, int]) -> None:
    requests = _requests([(tenant, n + done) for tenant, n, done in spec])
    for request, (_, _, done) in zip(requests, spec):
        request.num_computed_tokens = done
    grants = share_prefill_budget(requests, budget, cap, None, caps, k)
    assert sum(grants.values()) <= budget
    by_tenant: dict[str, list[Request]] = {}
    for r in requests:
        assert 0 < grants.get(r.request_id, 1) <= min(num_tokens_left(r), cap)
        if r.request_id in grants:
            by_tenant.setdefault(r.tenant, []).append(r)
    for tenant, granted in by_tenant.items():
        ids = [r.request_id for r in requests if r.tenant == tenant]
        assert [r.request_id for r in granted] == ids[:len(granted)], "oldest first inside a tenant"
        if tenant in caps:
            work = sum(chunk_cost(r.num_computed_tokens, grants[r.request_id], k) for r in granted)
            assert work <= caps[tenant] or (len(granted) == 1 and grants[granted[0].request_id] == 1)
    if sum(grants.values()) < budget:  # budget left over: every uncapped tenant got all it wanted
        for r in requests:
            if r.tenant not in caps:
                assert grants.get(r.request_id) == min(num_tokens_left(r), cap)


def test_a_tenant_alone_is_not_held_to_a_fair_share(make_engine: Callable[..., Any]) -> None:
    engine = make_engine(fair_share_tokens=4, max_prefill_chunk_tokens=BUDGET)
    steps = _record_steps(engine)
    _start_long_prefills(engine, 2)
    assert [sum(n for _, _, n in chunks) for chunks in steps] == [BUDGET, BUDGET]


def test_while_another_tenant_decodes_a_long_prefill_advances_by_its_fair_share(
        make_engine: Callable[..., Any]) -> None:
    share = 8
    engine = make_engine(fair_share_tokens=share, max_prefill_chunk_tokens=BUDGET, kv_cache_tokens=2048)
    now = [0.0]
    engine.scheduler.clock = lambda: now[0]
    work = _record_work(engine)
    longs = _start_long_prefills(engine, 2)
    engine.add_request("b-chat", [5, 6, 7, 8], _params(12), tenant="B")
    for _ in range(6):  # B decodes: every step holds A to its share, yet A advances
        before = [engine.find(i).num_computed_tokens for i in longs]
        outs = {o.request_id for o in engine.step() if o.new_token_ids}
        engine.check_integrity()
        assert "b-chat" in outs
        assert 0 < work[-1]["A"] <= share
        assert [engine.find(i).num_computed_tokens for i in longs] != before
    # B's new prompt takes all it needs at once (B has the least prefill left), and A adds a
    # quarter of its share to that step
    engine.add_request("b-new", list(range(40, 60)), _params(2), tenant="B")
    assert _steps_to_first_token(engine, "b-new") == 1
    assert work[-1]["B"] >= 20 and 0 < work[-1]["A"] <= share // 4
    assert all(_is_prefilling(engine, i) for i in longs)
    while engine.find("b-chat") is not None or engine.find("b-new") is not None:
        engine.step()
    # B's next prompt usually follows within milliseconds: A stays held while B lingers...
    now[0] += TENANT_LINGER_S * 0.9
    engine.step()
    assert work[-1]["A"] <= share
    now[0] += TENANT_LINGER_S * 0.2  # ...and once B is gone, A alone gets the whole budget
    engine.step()
    assert sum(work[-1].values()) > BUDGET - 1


def test_without_fair_shares_a_long_prefill_takes_the_budget_beside_a_decode(
        make_engine: Callable[..., Any]) -> None:
    """The contrast to the test above: with the share out of reach, A's steps are long."""
    engine = make_engine(fair_share_tokens=10**9, max_prefill_chunk_tokens=BUDGET, kv_cache_tokens=2048)
    steps = _record_steps(engine)
    _start_long_prefills(engine, 2)
    engine.add_request("b-chat", [5, 6, 7, 8], _params(30), tenant="B")
    engine.step()
    engine.step()
    assert sum(n for _, t, n in steps[-1] if t == "A") == BUDGET - 1


def test_fair_share_is_validated_and_has_a_flag() -> None:
    assert EngineArgs().fair_share_tokens == 256
    for bad in (0, -3, "64", 2.5, True):
        with pytest.raises(ConfigError, match="fair_share_tokens must be a whole number"):
            EngineArgs(fair_share_tokens=bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="fair_share_tokens must be >= 1"):
        SchedulerConfig(64, 32, 4, 32, 0)
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    assert engine_args_from(parser.parse_args(["--fair-share-tokens", "64"])).fair_share_tokens == 64
