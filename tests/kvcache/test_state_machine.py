"""Hypothesis state machines over the allocator alone and over the whole engine.

After every step: free + owned + cached = total, no page has two owners, cached pages' reader
counts and namespaces agree, waiting requests hold no pages, every holder is a running
request. Requests of several tenants share prompt prefixes: a prefix-cache hit only ever
comes from the same tenant's earlier tokens. After draining: the whole pool is allocatable.
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

SHARED_PREFIXES = [list(range(100, 112)), list(range(120, 141))]
MACHINE_SETTINGS = settings(max_examples=30, stateful_step_count=30, deadline=None,
                            suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


class AllocatorMachine(RuleBasedStateMachine):
    requests = Bundle("requests")

    def __init__(self) -> None:
        super().__init__()
        self.allocator = PageAllocator(12)
        self.expected: dict[str, int] = {}
        self.counter = 0

    @rule(target=requests, num_pages=st.integers(0, 6), consecutive=st.booleans())
    def allocate(self, num_pages: int, consecutive: bool) -> str:
        request_id = f"r{self.counter}"
        self.counter += 1
        if self.allocator.can_allocate(num_pages):
            self.allocator.evict(num_pages - self.allocator.num_unused_pages)
            tenant = f"tenant{self.counter % 3}"
            pages = self.allocator.allocate(request_id, tenant, num_pages, namespace=tenant, consecutive=consecutive)
            assert len(pages) == num_pages
            self.expected[request_id] = num_pages
        return request_id

    @rule(request_id=requests, num_pages=st.integers(1, 4), consecutive=st.booleans())
    def append(self, request_id: str, num_pages: int, consecutive: bool) -> None:
        if self.allocator.can_append(request_id, num_pages):
            self.allocator.evict(num_pages - self.allocator.num_unused_pages)
            pages = self.allocator.append(request_id, num_pages, consecutive)
            assert len(set(pages)) == num_pages
            self.expected[request_id] += num_pages

    @rule(request_id=consumes(requests))
    def free(self, request_id: str) -> None:
        freed = self.allocator.free(request_id)
        assert len(freed) == self.expected.pop(request_id, 0)
        assert all(self.allocator.owner_of(p) is None for p in freed)

    @rule(request_id=requests, key=st.integers(0, 5))
    def publish(self, request_id: str, key: int) -> None:
        namespace = self.allocator.namespace_of(request_id)
        if namespace is None or self.expected.get(request_id, 0) == 0:
            return
        if self.allocator.publish(request_id, (namespace, bytes([key]))) is not None:
            self.expected[request_id] -= 1

    @rule(target=requests, tenant=st.integers(0, 2), keys=st.lists(st.integers(0, 5), max_size=3))
    def share(self, tenant: int, keys: list[int]) -> str:
        request_id = f"r{self.counter}"
        self.counter += 1
        pages = [self.allocator.lookup((f"tenant{tenant}", bytes([k]))) for k in keys]
        if None not in pages and len(set(pages)) == len(pages):
            self.allocator.share(request_id, f"tenant{tenant}", f"tenant{tenant}", pages)  # type: ignore[arg-type]
            self.expected[request_id] = 0
        return request_id

    @rule(num_pages=st.integers(1, 4))
    def evict(self, num_pages: int) -> None:
        before = self.allocator.num_free_pages
        evicted = self.allocator.evict(num_pages)
        assert self.allocator.num_free_pages == before and all(self.allocator.cached_page(p) is None for p in evicted)

    @invariant()
    def integrity(self) -> None:
        self.allocator.check_integrity()
        assert self.allocator.num_owned_pages == sum(self.expected.values())
        for request_id, n in self.expected.items():
            pages = self.allocator.own_pages_of(request_id)
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
        self.tokens: dict[str, tuple[str, list[int]]] = {}  # request id -> (tenant, prompt + output so far)

    @rule(prompt_len=st.integers(1, 70), max_tokens=st.integers(1, 12), greedy=st.booleans())
    def add(self, prompt_len: int, max_tokens: int, greedy: bool) -> None:
        request_id = f"q{self.counter}"
        self.counter += 1
        params = SamplingParams(max_tokens=max_tokens, temperature=0 if greedy else 1.0, seed=self.counter)
        free_before = self.engine.kv.num_free_pages
        try:
            self._add(request_id, list(range(3, 3 + prompt_len)), params, f"t{self.counter % 3}")
        except ContextLengthExceeded:
            assert prompt_len + max_tokens > 64
            assert self.engine.kv.num_free_pages == free_before
            return

    @rule(prefix=st.sampled_from([SHARED_PREFIXES[0], SHARED_PREFIXES[1]]), suffix_len=st.integers(0, 9),
          tenant=st.integers(0, 2), max_tokens=st.integers(1, 10))
    def add_sharing(self, prefix: list[int], suffix_len: int, tenant: int, max_tokens: int) -> None:
        """Prompts that begin with one of a few shared prefixes, from several tenants."""
        request_id = f"q{self.counter}"
        self.counter += 1
        params = SamplingParams(max_tokens=max_tokens, temperature=0)
        self._add(request_id, prefix + list(range(200, 200 + suffix_len)), params, f"t{tenant}")

    def _add(self, request_id: str, prompt: list[int], params: SamplingParams, tenant: str) -> None:
        self.engine.add_request(request_id, prompt, params, tenant=tenant)
        self.live.add(request_id)
        self.tokens[request_id] = (tenant, list(prompt))

    def _check_hit(self, out: Any) -> None:
        """A hit of c tokens needs an earlier request of the same tenant whose tokens begin alike."""
        tenant, tokens = self.tokens[out.request_id]
        tokens.extend(out.new_token_ids)
        hit = out.num_cached_tokens
        if hit:
            head = out.prompt_token_ids[:hit]
            assert any(t == tenant and other != out.request_id and seen[:hit] == head
                       for other, (t, seen) in self.tokens.items()), f"{out.request_id}: a hit of another tenant"

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
            self._check_hit(out)
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
