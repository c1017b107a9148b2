"""The grammar compile pool: tenants served round-robin, each compile under the CPU-time budget,
a compile nobody waits for stopped; real worker processes on the character-level vocabulary.

Each check is also run with the test-only fault that breaks what it guards, and must fail.
No timing is asserted: "B did not wait behind A" is B's grammar arriving while A's are still
pending; "the budget stopped it" and "the cancellation stopped it" are the pool's counters.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator

import pytest
from char_model import make_char_tokenizer
from grammar_schemas import SLOW_SCHEMA, SMALL_SCHEMA, big_schema, small_schema, spec
from processes import wait_for

from kvseal._testing.faults import Fault, inject
from kvseal.config import GrammarConfig
from kvseal.errors import GrammarCompilerUnavailable, GrammarCompileTimeout, InvalidParameter, RequestRejected
from kvseal.structured.compiler import WALL_CAP_FACTOR, GrammarCompilerPool, GrammarPoolStats, GrammarTicket
from kvseal.structured.fair_queue import CompileJob, FairCompileQueue
from kvseal.structured.worker import MAX_NICENESS, NICENESS
from kvseal.types import StructuredOutput

BUDGET_S = 2.0  # CPU seconds: SLOW_SCHEMA needs ~20, big_schema() ~0.1 on this vocabulary
NUM_WORKERS = 2
STOP_DEADLINE_S = BUDGET_S * WALL_CAP_FACTOR + 30.0  # a stopped compile ends well within this


@pytest.fixture(scope="module")
def pool() -> Iterator[GrammarCompilerPool]:
    pool = GrammarCompilerPool(make_char_tokenizer(), 128, (1,), GrammarConfig(BUDGET_S, NUM_WORKERS))
    yield pool
    pool.close()


def _all_ready(pool: GrammarCompilerPool) -> None:
    """Nothing compiles and every slot has its worker (one an earlier test stopped is started
    again; a stopped compile ends after its worker is marked gone, so the order is safe)."""
    pool.compile_now("warm-up", spec(SMALL_SCHEMA))  # starts the pool the first time
    wait_for(lambda: pool.stats().num_running == 0 and pool.stats().num_queued == 0, "the pool to be idle")
    wait_for(lambda: pool.stats().num_workers_ready == NUM_WORKERS, "every grammar worker to be ready", 180)


def _error_of(ticket: GrammarTicket) -> RequestRejected | None:
    try:
        ticket.result()
    except RequestRejected as exc:
        return exc
    return None


def test_workers_run_one_niceness_step_below_the_engine(pool: GrammarCompilerPool) -> None:
    """The slot threads that start the workers run at NICENESS themselves; a worker must not add
    it a second time (it sat at 19 then, and a busy engine starved its compiles past the budget)."""
    _all_ready(pool)
    expected = min(os.getpriority(os.PRIO_PROCESS, 0) + NICENESS, MAX_NICENESS)
    assert [os.getpriority(os.PRIO_PROCESS, pid) for pid in pool.worker_pids()] == [expected] * NUM_WORKERS


# ---- the line: per tenant FIFO, tenants round-robin, one running each ----------------------

def _job(tenant: str, name: str) -> CompileJob:
    return CompileJob(tenant, StructuredOutput("json_schema", name))


def _taken_order(queue: FairCompileQueue, num: int) -> list[str]:
    """Take `num` jobs, each ended before the next take (one worker)."""
    names = []
    for _ in range(num):
        job = queue.take()
        assert job is not None and job.spec.schema is not None
        names.append(job.spec.schema)
        queue.done(job)
    return names


def test_tenants_are_served_round_robin_in_arrival_order_within_each() -> None:
    queue = FairCompileQueue()
    for tenant, name in [("a", "a1"), ("a", "a2"), ("a", "a3"), ("b", "b1"), ("c", "c1"), ("b", "b2")]:
        queue.put(_job(tenant, name))
    assert _taken_order(queue, 6) == ["a1", "b1", "c1", "a2", "b2", "a3"]


def _second_worker_takes(queue: FairCompileQueue) -> str:
    """A's two jobs arrive, then B's; worker 1 takes one and is still on it: what does worker 2 take?"""
    for tenant, name in [("a", "a1"), ("a", "a2"), ("b", "b1")]:
        queue.put(_job(tenant, name))
    first = queue.take()
    assert first is not None and first.spec.schema == "a1"
    second = queue.take()
    assert second is not None and second.spec.schema is not None
    return second.spec.schema


def test_a_tenant_with_a_compile_running_waits_while_another_is_served() -> None:
    assert _second_worker_takes(FairCompileQueue()) == "b1"


def test_the_line_check_fails_with_one_shared_fifo() -> None:
    with inject(Fault.SHARED_GRAMMAR_QUEUE):
        assert _second_worker_takes(FairCompileQueue()) == "a2", "B waits behind A's second job"


def test_a_queued_job_can_be_removed_and_a_closed_line_hands_out_nothing() -> None:
    queue = FairCompileQueue()
    kept, dropped = _job("a", "kept"), _job("b", "dropped")
    queue.put(kept)
    queue.put(dropped)
    assert queue.remove(dropped) and not queue.remove(dropped)
    assert queue.num_queued() == 1
    assert queue.close() == [kept] and queue.take() is None


# ---- fairness with real workers ---------------------------------------------------------------

def _check_small_grammar_does_not_wait(pool: GrammarCompilerPool) -> float:
    """Tenant A's over-budget grammar runs and its big one queues; tenant B's small grammar
    compiles while both of A's are still pending. Returns B's wait (reported, not asserted)."""
    _all_ready(pool)
    slow = pool.compile("alice", spec(SLOW_SCHEMA))
    wait_for(lambda: pool.stats().num_running >= 1, "A's compile to start")
    big = pool.compile("alice", spec(big_schema()))
    started_s = time.monotonic()
    pool.compile_now("bob", spec(small_schema()))
    waited_s = time.monotonic() - started_s
    a_pending = not slow.done() and not big.done()
    for ticket in (slow, big):
        ticket.cancel()  # stop A's compiles now rather than at the budget
    assert a_pending, "tenant B's grammar waited behind tenant A's"
    return waited_s


def test_another_tenants_grammar_does_not_wait_behind_a_slow_one(pool: GrammarCompilerPool) -> None:
    waited_s = _check_small_grammar_does_not_wait(pool)
    print(f"tenant B's small grammar took {waited_s:.3f} s while A's over-budget grammar compiled")


def test_the_fairness_check_fails_with_one_shared_fifo(pool: GrammarCompilerPool) -> None:
    with inject(Fault.SHARED_GRAMMAR_QUEUE), pytest.raises(AssertionError, match="waited behind"):
        _check_small_grammar_does_not_wait(pool)


# ---- the budget ----------------------------------------------------------------------------

def _check_over_budget_is_refused(pool: GrammarCompilerPool, deadline_s: float = STOP_DEADLINE_S) -> None:
    """An over-budget grammar ends in `GrammarCompileTimeout` naming the limit and the flag,
    counted; its worker is replaced and the tenant's next grammar compiles."""
    _all_ready(pool)
    before = pool.stats()
    killed = set(pool.worker_pids())
    ticket = pool.compile("alice", spec(SLOW_SCHEMA))
    try:
        wait_for(ticket.done, "the over-budget compile to be stopped", deadline_s)
    finally:
        ticket.cancel()
    error = _error_of(ticket)
    assert isinstance(error, GrammarCompileTimeout), error
    assert error.code == "grammar_compile_timeout" and error.param == "response_format"
    assert f"{BUDGET_S:g} s" in error.message and "--grammar-compile-timeout-s" in error.message
    assert pool.stats().num_timeouts == before.num_timeouts + 1
    assert pool.compile_now("alice", spec({"type": "object", "properties": {"n": {"type": "integer"}}}))
    assert set(pool.worker_pids()) != killed, "the stopped worker was replaced"


def test_an_over_budget_grammar_is_refused_and_its_worker_replaced(pool: GrammarCompilerPool) -> None:
    _check_over_budget_is_refused(pool)


def test_the_budget_check_fails_without_a_budget(pool: GrammarCompilerPool) -> None:
    with inject(Fault.UNBUDGETED_GRAMMAR_COMPILE), pytest.raises(AssertionError, match="stopped"):
        _check_over_budget_is_refused(pool, deadline_s=BUDGET_S + 4.0)


@contextlib.contextmanager
def _workers_held(pool: GrammarCompilerPool) -> Iterator[None]:
    """Every worker stopped (SIGSTOP), as a worker starved of CPU by a busy host would be:
    wall time passes while its CPU time stands still."""
    pids = pool.worker_pids()
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):  # one the pool stopped (and replaced) meanwhile
                os.kill(pid, signal.SIGCONT)


def test_the_budget_counts_the_workers_cpu_time_not_the_wait(pool: GrammarCompilerPool) -> None:
    """A grammar that needs far less CPU than the budget compiles even when its worker gets no
    CPU for longer than the budget (counted in wall time, it was refused as too complex)."""
    _all_ready(pool)
    before = pool.stats()
    with _workers_held(pool):
        ticket = pool.compile("frank", spec(big_schema()))
        wait_for(lambda: pool.stats().num_running >= 1, "the compile to start")
        time.sleep(BUDGET_S + 1.0)
        assert not ticket.done(), f"the compile ended while its worker was held: {_error_of(ticket)}"
    wait_for(ticket.done, "the compile to end", STOP_DEADLINE_S)
    assert _error_of(ticket) is None and ticket.result() is not None
    assert pool.stats().num_timeouts == before.num_timeouts


def test_a_worker_starved_past_the_wall_clock_cap_is_stopped_and_the_request_told_why() -> None:
    """However small the grammar, a request waits at most `WALL_CAP_FACTOR` times the budget."""
    budget_s = 0.1
    starved = GrammarCompilerPool(make_char_tokenizer(), 128, (1,), GrammarConfig(budget_s, 1))
    try:
        starved.compile_now("warm-up", spec(SMALL_SCHEMA))
        with _workers_held(starved):
            ticket = starved.compile("grace", spec(small_schema()))
            wait_for(ticket.done, "the starved compile to be stopped", budget_s * WALL_CAP_FACTOR + 30)
        error = _error_of(ticket)
        assert isinstance(error, GrammarCompilerUnavailable) and error.http_status == 503, error
        assert "too busy" in error.message and "Retry later" in error.message
        assert f"{budget_s * WALL_CAP_FACTOR:g} s" in error.message and "--grammar-compile-timeout-s" in error.message
        assert starved.stats().num_timeouts == 1
    finally:
        starved.close()


# ---- cancellation ----------------------------------------------------------------------------

def _check_cancel_stops_the_compile(pool: GrammarCompilerPool) -> None:
    """The last waiter of a running compile leaves: the compile is stopped (counted as
    cancelled, not as a timeout) and no compile runs any more."""
    _all_ready(pool)
    before = pool.stats()
    ticket = pool.compile("carol", spec(SLOW_SCHEMA))
    wait_for(lambda: pool.stats().num_running >= 1, "the compile to start")
    ticket.cancel()

    def stopped() -> GrammarPoolStats | None:
        now = pool.stats()
        is_ended = now.num_cancelled > before.num_cancelled or now.num_timeouts > before.num_timeouts
        return now if is_ended else None

    after = wait_for(stopped, "the compile to be stopped", STOP_DEADLINE_S)
    assert (after.num_cancelled, after.num_timeouts) == (before.num_cancelled + 1, before.num_timeouts), after
    wait_for(lambda: pool.stats().num_running == 0, "no compile to run")


def test_a_compile_whose_every_waiter_left_is_stopped(pool: GrammarCompilerPool) -> None:
    _check_cancel_stops_the_compile(pool)


def test_the_cancel_check_fails_when_cancellation_is_ignored(pool: GrammarCompilerPool) -> None:
    with inject(Fault.IGNORE_GRAMMAR_CANCEL), pytest.raises(AssertionError):
        _check_cancel_stops_the_compile(pool)


def test_a_compile_another_request_still_waits_for_keeps_running(pool: GrammarCompilerPool) -> None:
    _all_ready(pool)
    first = pool.compile("dave", spec(SLOW_SCHEMA))
    second = pool.compile("dave", spec(SLOW_SCHEMA))  # the same tenant's same grammar: one compile
    queued = pool.compile("dave", spec(big_schema()))  # behind dave's running compile
    wait_for(lambda: pool.stats().num_running >= 1, "the compile to start")
    before = pool.stats()
    assert before.num_queued == 1
    queued.cancel()
    assert pool.stats().num_queued == 0 and pool.stats().num_cancelled == before.num_cancelled + 1
    first.cancel()
    assert not second.done() and pool.stats().num_cancelled == before.num_cancelled + 1, "one waiter is left"
    second.cancel()
    wait_for(lambda: pool.stats().num_cancelled == before.num_cancelled + 2, "the compile to be stopped")


def test_a_worker_that_dies_mid_compile_is_a_refusal_and_is_replaced(pool: GrammarCompilerPool) -> None:
    _all_ready(pool)
    ticket = pool.compile("erin", spec(SLOW_SCHEMA))
    wait_for(lambda: pool.stats().num_running >= 1, "the compile to start")
    for pid in pool.worker_pids():  # the idle one dies too: it is replaced all the same
        os.kill(pid, signal.SIGKILL)
    wait_for(ticket.done, "the compile to end")
    error = _error_of(ticket)
    assert isinstance(error, InvalidParameter) and "stopped while compiling" in error.message
    _all_ready(pool)


def test_a_closed_pool_refuses_at_once() -> None:
    closed = GrammarCompilerPool(make_char_tokenizer(), 128, (1,), GrammarConfig(BUDGET_S, 1))
    closed.close()
    with pytest.raises(GrammarCompilerUnavailable, match="shutting down"):
        closed.compile_now("alice", spec(SMALL_SCHEMA))
    assert closed.worker_pids() == []
