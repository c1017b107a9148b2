"""Hypothesis state machines over the allocator alone and over the whole engine.

After every step: free + owned = total, no page has two owners, waiting requests hold no
pages, every owner is a running request. After draining: the whole pool is free.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, precondition, rule

from kvseal import ContextLengthExceeded, SamplingParams
from kvseal.kvcache.allocator import PageAllocator

MACHINE_SETTINGS = settings(max_examples=50, stateful_step_count=30, deadline=None,
                            suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


class AllocatorMachine(RuleBasedStateMachine):
    requests = Bundle("requests")

    def __init__(self) -> None:
        super().__init__()
        self.allocator = PageAllocator(12)
        self.expected: dict[str, int] = {}
        self.counter = 0

    @rule(target=requests, num_pages=st.integers(0, 6))
    def allocate(self, num_pages: int) -> str:
        request_id = f"r{self.counter}"
        self.counter += 1
        if self.allocator.can_allocate(num_pages):
            pages = self.allocator.allocate(request_id, f"tenant{self.counter % 3}", num_pages)
            assert len(pages) == num_pages
            self.expected[request_id] = num_pages
        return request_id

    @rule(request_id=requests, num_pages=st.integers(1, 4))
    def append(self, request_id: str, num_pages: int) -> None:
        if self.allocator.can_append(request_id, num_pages):
            self.allocator.append(request_id, num_pages)
            self.expected[request_id] += num_pages

    @rule(request_id=consumes(requests))
    def free(self, request_id: str) -> None:
        freed = self.allocator.free(request_id)
        assert len(freed) == self.expected.pop(request_id, 0)
        assert all(self.allocator.owner_of(p) is None for p in freed)

    @invariant()
    def integrity(self) -> None:
        self.allocator.check_integrity()
        assert self.allocator.num_owned_pages == sum(self.expected.values())
        for request_id, n in self.expected.items():
            pages = self.allocator.pages_of(request_id)
            assert len(pages) == n and all(self.allocator.owner_of(p).request_id == request_id for p in pages)


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


class EngineMachine(RuleBasedStateMachine):
    """Random adds (some over-long), steps and aborts against a small pool that preempts."""

    model_dir: Path

    def __init__(self) -> None:
        super().__init__()
        from kvseal import LLM

        self.llm = LLM(str(self.model_dir), kv_cache_tokens=64, max_model_len=64, page_size=4,
                       max_num_batched_tokens=12, max_num_seqs=4, check_kv=True, dtype="float32")
        self.engine = self.llm.engine
        self.live: set[str] = set()
        self.finished: dict[str, Any] = {}
        self.counter = 0

    @rule(prompt_len=st.integers(1, 70), max_tokens=st.integers(1, 12), greedy=st.booleans())
    def add(self, prompt_len: int, max_tokens: int, greedy: bool) -> None:
        request_id = f"q{self.counter}"
        self.counter += 1
        params = SamplingParams(max_tokens=max_tokens, temperature=0 if greedy else 1.0, seed=self.counter)
        free_before = self.engine.kv.num_free_pages
        try:
            self.engine.add_request(request_id, list(range(3, 3 + prompt_len)), params, tenant=f"t{self.counter % 3}")
        except ContextLengthExceeded:
            assert prompt_len + max_tokens > 64
            assert self.engine.kv.num_free_pages == free_before
            return
        self.live.add(request_id)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.live)))
        out = self.engine.abort(request_id, "test abort")
        assert out is not None and out.finish_reason.value == "abort"
        assert not self.engine.kv.allocator.owns(request_id)
        self.live.discard(request_id)

    @rule()
    def step(self) -> None:
        for out in self.engine.step():
            assert out.error is None, out.error
            if out.finished:
                self.live.discard(out.request_id)
                assert not self.engine.kv.allocator.owns(out.request_id)

    @invariant()
    def integrity(self) -> None:
        self.engine.check_integrity()
        running = {r.request_id for r in self.engine.scheduler.running}
        waiting = {r.request_id for r in self.engine.scheduler.waiting}
        assert running | waiting == self.live and not running & waiting

    def teardown(self) -> None:
        for _ in range(2000):
            if not self.engine.has_unfinished():
                break
            for out in self.engine.step():
                assert out.error is None, out.error
        assert not self.engine.has_unfinished()
        assert self.engine.kv.num_free_pages == self.engine.kv.allocator.num_pages
        self.engine.check_integrity()


@pytest.fixture
def engine_machine(llama_dir: Path) -> type[EngineMachine]:
    EngineMachine.model_dir = llama_dir
    return EngineMachine


def test_engine_state_machine(engine_machine: type[EngineMachine]) -> None:
    from hypothesis.stateful import run_state_machine_as_test

    run_state_machine_as_test(engine_machine, settings=MACHINE_SETTINGS)
