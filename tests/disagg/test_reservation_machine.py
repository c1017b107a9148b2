"""A hypothesis state machine over decode's reservation table on a real engine with the prefix
cache on: requests of several tenants that share prefixes run (and publish pages), others are
reserved on their cache hits, committed, released, expired, aborted. After every step the
engine's integrity holds with the reservations as holders (reader counts, namespaces, owners),
every reservation's hit is cached pages of its own namespace that it reads, and after draining
every page is free or cached with no reader."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from kvseal import SamplingParams
from kvseal.config import EngineArgs
from kvseal.disagg.reservations import Reservation, ReservationTable
from kvseal.disagg.tcp import TcpReceiver
from kvseal.engine.engine import LLMEngine
from kvseal.kvcache.prefix_cache import namespace_of

PAGE = 4
PREFIXES = [list(range(100, 113)), list(range(120, 141))]
MACHINE_SETTINGS = settings(max_examples=25, stateful_step_count=30, deadline=None,
                            suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


class ReservationMachine(RuleBasedStateMachine):
    model_dir: Path

    def __init__(self) -> None:
        super().__init__()
        self.engine = LLMEngine(EngineArgs(model=str(self.model_dir), kv_cache_tokens=96, max_model_len=64,
                                           page_size=PAGE, max_num_batched_tokens=16, max_num_seqs=4,
                                           check_kv=True, dtype="float32"))
        kv = self.engine.kv
        self.table = ReservationTable(kv, TcpReceiver(kv.pool, self.engine.model_config.num_layers, "test"), 60.0)
        self.counter = 0

    def _prompt(self, prefix: int, suffix_len: int) -> list[int]:
        return PREFIXES[prefix] + list(range(200, 200 + suffix_len))

    @rule(prefix=st.integers(0, 1), suffix_len=st.integers(0, 6), tenant=st.integers(0, 2))
    def run_colocated(self, prefix: int, suffix_len: int, tenant: int) -> None:
        """A request that computes (and publishes) the prompt in this engine."""
        self.counter += 1
        self.engine.add_request(f"c{self.counter}", self._prompt(prefix, suffix_len),
                                SamplingParams(max_tokens=3, temperature=0), tenant=f"t{tenant}")

    @rule(prefix=st.integers(0, 1), suffix_len=st.integers(0, 6), tenant=st.integers(0, 2))
    def reserve(self, prefix: int, suffix_len: int, tenant: int) -> None:
        self.counter += 1
        name = f"t{tenant}"
        self.table.add(Reservation(f"r{self.counter}", name, self._prompt(prefix, suffix_len),
                                   SamplingParams(max_tokens=3, temperature=0), b"frontend"))
        self.table.place_waiting()

    def _placed(self) -> list[Reservation]:
        return [r for r in (self.table.by_request(i) for i in sorted(self.table.request_ids())) if r is not None]

    @precondition(lambda self: len(self.table) > 0)
    @rule(data=st.data())
    def commit(self, data: st.DataObject) -> None:
        """What a verified commit does: record [hit, prompt) in every layer, run the request."""
        r = data.draw(st.sampled_from(self._placed()))
        for layer in range(self.engine.model_config.num_layers):
            self.engine.kv.record_written(r.request_id, layer, r.num_cached_tokens, r.num_prompt_tokens)
        self.table.take(r)
        self.engine.add_prefilled(r.request_id, r.tenant, r.prompt_token_ids, r.params, 7, None,
                                  torch.Generator().get_state(), r.num_cached_tokens)

    @precondition(lambda self: len(self.table) > 0)
    @rule(data=st.data(), reason=st.sampled_from(["aborted", "prefill_refused", "identity_mismatch"]))
    def release(self, data: st.DataObject, reason: str) -> None:
        r = data.draw(st.sampled_from(self._placed()))
        assert self.table.release(r, reason), "the TCP receiver confirms a cancel at once"
        self.table.place_waiting()

    @rule()
    def expire_all(self) -> None:
        for r in self.table.expired(now_s=float("inf")):
            self.table.release(r, "expired")
        self.table.place_waiting()

    @rule()
    def step(self) -> None:
        for out in self.engine.step():
            assert out.error is None, out.error
        self.table.place_waiting()

    @invariant()
    def integrity(self) -> None:
        self.engine.check_integrity(self.table.request_ids())
        allocator = self.engine.kv.allocator
        for r in self._placed():
            num_hit = r.num_cached_tokens // PAGE
            assert r.num_cached_tokens % PAGE == 0 and r.num_cached_tokens < r.num_prompt_tokens
            assert allocator.num_shared_pages_of(r.request_id) == num_hit
            for page in r.pages[:num_hit]:
                cached = allocator.cached_page(page)
                assert cached is not None and cached.namespace == namespace_of(r.tenant) and cached.num_readers >= 1

    def teardown(self) -> None:
        for r in self._placed():
            self.table.release(r, "teardown")
        for _ in range(500):
            if not self.engine.has_unfinished():
                break
            self.engine.step()
        assert not self.engine.has_unfinished() and len(self.table) == 0
        self.engine.check_integrity()
        allocator = self.engine.kv.allocator
        assert self.engine.kv.num_free_pages == allocator.num_pages, "every page free or cached with no reader"
        assert all(allocator.cached_page(p).num_readers == 0 for p in allocator.cached_namespaces())  # type: ignore[union-attr]


@pytest.fixture
def machine(llama_dir: Path) -> type[ReservationMachine]:
    ReservationMachine.model_dir = llama_dir
    return ReservationMachine


def test_reservation_state_machine(machine: type[ReservationMachine]) -> None:
    run_state_machine_as_test(machine, settings=MACHINE_SETTINGS)
