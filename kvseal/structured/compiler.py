"""Grammar compilation off the engine loop: budgeted, fair across tenants, cancellable, and
cached per tenant.

A compile runs in two steps. A worker process (`structured/worker.py`) compiles the grammar
first, under the budget (`GrammarConfig.compile_timeout_s` of the worker's CPU time, and
thirty times that in wall time: `CompileBudget`): xgrammar's compile cannot be interrupted from
Python, so a compile that runs over is stopped by killing the worker (SIGKILL, its own PID),
which is replaced, and the request gets a 400 (`GrammarCompileTimeout`; a 503 where the wall
time ran out first: the host, not the schema, was the problem). A grammar the worker
compiled in time is then compiled again here, on the same slot's thread, for the engine to
use: that compile does the same work the worker just finished within the budget.
(Shipping the worker's compiled grammar back instead costs more: xgrammar 0.2.8's
`CompiledGrammar.serialize_json` repeats the whole automaton once per rule, so its size grows
with the square of the schema; measured on a 49K vocabulary, a 50-property schema compiles in
26 ms but serializes to 17 MB in 0.65 s and takes 0.27 s to read back.)

Fairness (`structured/fair_queue.py`): `num_workers` slots, each a worker process and a
thread; compiles wait per tenant, first in first out, and tenants are served round-robin with
at most one compile each running, so one tenant's grammars never queue ahead of another's.

Cancellation: every request that waits holds a `GrammarTicket`; when the last one is cancelled
(abort, disconnect, shutdown) a queued compile is dropped and a running worker compile is
stopped at once (the worker killed and replaced), so a client that leaves cannot keep a
worker busy.

Cache (I5): keyed by tenant first, like the prefix cache's namespace: a hit can only come
from the same tenant's earlier request, so its speed tells no tenant what another one sent.
xgrammar's own compiler cache, which would be shared by all tenants, is switched off. The
cache holds `CACHE_ENTRIES` grammars in all; past that, the least recently used grammar of the
tenant holding the most goes, so a tenant sending many distinct grammars evicts its own first
and never costs another tenant, holding fewer, a recompile of its grammars.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvseal._testing.faults import Fault, is_active
from kvseal.config import GrammarConfig
from kvseal.errors import (
    GrammarCompilerUnavailable,
    GrammarCompileTimeout,
    InvalidParameter,
    RequestRejected,
)
from kvseal.structured.fair_queue import CompileJob, FairCompileQueue
from kvseal.structured.grammars import compile_spec, new_compiler
from kvseal.structured.msgs import GrammarJudgedMsg, JudgeGrammarMsg, WorkerSetupMsg
from kvseal.structured.schema import describe_error
from kvseal.structured.worker import NICENESS
from kvseal.structured.workers import GrammarWorker, WorkerFailed
from kvseal.types import StructuredOutput

logger = logging.getLogger("kvseal.structured")

CACHE_ENTRIES = 256  # compiled grammars kept, over all tenants (evicted from the one holding the most)
WORKER_START_S = 120.0  # importing xgrammar (and torch) on a loaded host
CANCEL_CHECK_S = 0.02  # how often a slot waiting on its worker looks for cancellation (and its CPU time)
# A compile waits at most this many times its CPU budget, however starved its worker: at nice 10
# a worker gets ~10% of a core beside one busy task at nice 0 (CFS weights 110 against 1024),
# ~5% beside two, so a budget's worth of CPU arrives within ~20 times it on a busy host.
WALL_CAP_FACTOR = 30.0
CLOSE_WAIT_S = 5.0

CacheKey = tuple[str, str, str | None]


@dataclass(frozen=True)
class GrammarPoolStats:
    """The compile pool's state, for /metrics (`EngineStats.grammar`)."""

    num_workers_ready: int = 0  # worker processes started and idle or compiling
    num_running: int = 0  # compiles in a worker or in their second, engine-side step
    num_queued: int = 0  # compiles waiting for a worker
    num_timeouts: int = 0  # compiles stopped at the time budget (refused with a 400) since start
    num_cancelled: int = 0  # compiles dropped or stopped because every waiting request left


class GrammarTicket:
    """One request's wait for its compiled grammar. Call `cancel` if the request ends before
    it took the result: the compile is stopped once no request waits for it."""

    def __init__(self, core: _PoolCore, job: CompileJob) -> None:
        self._core = core
        self._job = job
        self._is_cancelled = False

    def done(self) -> bool:
        return self._job.finished.is_set()

    def result(self) -> Any:
        """The compiled grammar, waiting for it; raises the `RequestRejected` that refused it
        (`InvalidParameter`, `GrammarCompileTimeout`, `GrammarCompilerUnavailable`)."""
        self._job.finished.wait()
        if self._job.error is not None:
            raise self._job.error
        return self._job.compiled

    def cancel(self) -> None:
        if not self._is_cancelled:
            self._is_cancelled = True
            self._core.release(self._job)


class GrammarCompilerPool:
    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...],
                 config: GrammarConfig | None = None) -> None:
        self._core = _PoolCore(tokenizer, vocab_size, eos_token_ids, config or GrammarConfig())
        # An engine dropped without close() still stops its workers (they hold no reference to this).
        self._finalizer = weakref.finalize(self, self._core.close)

    @property
    def num_compiles(self) -> int:
        """Grammars actually compiled (cache misses), for tests and logs."""
        return self._core.num_compiles

    def compile(self, tenant: str, spec: StructuredOutput) -> GrammarTicket:
        """A ticket for the xgrammar `CompiledGrammar` of `spec`, shared only within `tenant`."""
        return self._core.compile(tenant, spec)

    def compile_now(self, tenant: str, spec: StructuredOutput) -> Any:
        """Blocking form, for the offline API (there is no loop to keep free). Raises the
        `RequestRejected` that refused the grammar."""
        return self.compile(tenant, spec).result()

    def stats(self) -> GrammarPoolStats:
        return self._core.stats()

    def worker_pids(self) -> list[int]:
        """The worker processes now running (for tests)."""
        return self._core.worker_pids()

    def close(self) -> None:
        """Stop every worker; compiles still waiting are refused."""
        self._finalizer()


class _PoolCore:
    """The pool's state, shared by its slots' threads (which must not keep the pool alive)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...],
                 config: GrammarConfig) -> None:
        self.config = config
        self.vocab_size = vocab_size
        self.queue = FairCompileQueue()
        self.num_compiles = 0
        self.is_closed = False
        self._tokenizer = tokenizer
        self._eos_token_ids = list(eos_token_ids)
        self._tokenizer_info: Any = None  # xgrammar TokenizerInfo, built by the first slot that needs it
        self._setup: WorkerSetupMsg | None = None
        self._info_lock = threading.Lock()
        self._lock = threading.Lock()
        self._cache: dict[str, OrderedDict[CacheKey, CompileJob]] = {}  # per tenant, least recently used first
        self._num_cached = 0
        self._slots: list[_Slot] = []
        self._num_running = 0
        self._num_timeouts = 0
        self._num_cancelled = 0

    def compile(self, tenant: str, spec: StructuredOutput) -> GrammarTicket:
        key = (tenant, spec.kind, spec.schema)
        with self._lock:
            cached = self._cache.setdefault(tenant, OrderedDict())
            job = cached.get(key)
            if job is not None and job.error is None and not job.is_abandoned:
                job.num_waiters += 1
                cached.move_to_end(key)
                return GrammarTicket(self, job)
            self._num_cached += key not in cached
            job = cached[key] = CompileJob(tenant, spec)
            cached.move_to_end(key)
            while self._num_cached > CACHE_ENTRIES:
                self._evict_one(tenant)
            self.num_compiles += 1
            self._start_slots()
        if not self.queue.put(job):  # closed: nothing will compile it
            self.finish(job, error=GrammarCompilerUnavailable("the engine is shutting down"))
        return GrammarTicket(self, job)

    def release(self, job: CompileJob) -> None:
        """One waiter of `job` left; with none left the compile is dropped or stopped."""
        if is_active(Fault.IGNORE_GRAMMAR_CANCEL):
            return
        with self._lock:
            job.num_waiters -= 1
            if job.num_waiters > 0 or job.finished.is_set():
                return
            job.is_abandoned = True
            self._forget(job)
        if self.queue.remove(job):  # still queued; a running one is stopped by its slot
            self.finish_cancelled(job)

    def finish(self, job: CompileJob, compiled: Any = None, error: RequestRejected | None = None) -> None:
        with self._lock:
            job.compiled, job.error = compiled, error
            if error is not None:
                self._forget(job)  # the next request with this grammar compiles it again
            job.finished.set()

    def finish_cancelled(self, job: CompileJob) -> None:
        with self._lock:
            self._num_cancelled += 1
        self.finish(job, error=InvalidParameter("the request ended before its grammar compiled"))

    def finish_timeout(self, job: CompileJob, starved: bool) -> None:
        with self._lock:
            self._num_timeouts += 1
        budget_s = self.config.compile_timeout_s
        self.finish(job, error=starved_error(job.spec, budget_s) if starved else timeout_error(job.spec, budget_s))

    def set_running(self, delta: int) -> None:
        with self._lock:
            self._num_running += delta

    def worker_setup(self) -> WorkerSetupMsg:
        self.tokenizer_info()
        assert self._setup is not None
        return self._setup

    def tokenizer_info(self) -> Any:
        """xgrammar's description of the vocabulary, built once (reading the vocabulary takes time)."""
        with self._info_lock:
            if self._tokenizer_info is None:
                self._tokenizer_info = grammar_vocabulary(self._tokenizer, self.vocab_size, self._eos_token_ids)
                self._setup = WorkerSetupMsg(self._tokenizer_info.serialize_json(), self.vocab_size)
            return self._tokenizer_info

    def stats(self) -> GrammarPoolStats:
        with self._lock:
            return GrammarPoolStats(sum(slot.is_ready for slot in self._slots), self._num_running,
                                    self.queue.num_queued(), self._num_timeouts, self._num_cancelled)

    def worker_pids(self) -> list[int]:
        with self._lock:
            return [pid for slot in self._slots if (pid := slot.worker_pid) is not None]

    def close(self) -> None:
        with self._lock:
            self.is_closed = True
            slots = list(self._slots)
        for job in self.queue.close():
            self.finish(job, error=GrammarCompilerUnavailable("the engine is shutting down"))
        for slot in slots:
            slot.join(CLOSE_WAIT_S)

    def _start_slots(self) -> None:
        """Called under the lock at the first compile: every slot starts its worker now, in
        parallel, so the pool is at full strength after one worker start."""
        if self._slots or self.is_closed:
            return
        self._slots = [_Slot(self, index) for index in range(self.config.num_workers)]
        for slot in self._slots:
            slot.start()

    def _evict_one(self, adding: str) -> None:
        """Under the lock: drop the least recently used grammar of the tenant holding the most
        (of `adding`, the tenant whose grammar is being added, among those holding as many)."""
        tenant = max(self._cache, key=lambda name: (len(self._cache[name]), name == adding))
        self._cache[tenant].popitem(last=False)
        self._drop_one(tenant)

    def _forget(self, job: CompileJob) -> None:
        key = (job.tenant, job.spec.kind, job.spec.schema)
        cached = self._cache.get(job.tenant)
        if cached is not None and cached.get(key) is job:
            del cached[key]
            self._drop_one(job.tenant)

    def _drop_one(self, tenant: str) -> None:
        self._num_cached -= 1
        if not self._cache[tenant]:
            del self._cache[tenant]


class _Slot:
    """One worker process and the thread that feeds it, one compile at a time."""

    def __init__(self, core: _PoolCore, index: int) -> None:
        self._core = core
        self._worker: GrammarWorker | None = None
        self._compiler: Any = None  # the engine-side xgrammar compiler of this slot
        self.is_ready = False
        self._thread = threading.Thread(target=self._run, name=f"kvseal-grammar-{index}", daemon=True)

    @property
    def worker_pid(self) -> int | None:
        return self._worker.pid if self._worker is not None and self.is_ready else None

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout_s: float) -> None:
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    def _run(self) -> None:
        _lower_thread_priority()  # its engine-side compiles yield to the forward passes, as the worker's do
        try:
            while not self._core.is_closed:
                self._ensure_worker()  # before taking: a job goes to a slot whose worker is ready
                job = self._core.queue.take()
                if job is None:
                    return
                failure = self._ensure_worker()  # it may have died while idle
                self._core.set_running(+1)
                try:
                    self._serve(job, failure)
                finally:
                    self._core.set_running(-1)
                    self._core.queue.done(job)
        finally:
            self._stop_worker()

    def _ensure_worker(self) -> str | None:
        """Start the worker if it is not running; None, or why it could not start."""
        if self._worker is not None and self._worker.is_running:
            return None
        self.is_ready = False
        started_s = time.monotonic()
        try:
            self._worker = GrammarWorker(self._core.worker_setup())
            self._worker.start(started_s + WORKER_START_S)
        except Exception as exc:  # WorkerFailed, or the vocabulary xgrammar could not describe
            logger.error("could not start a grammar worker process: %s", exc)
            self._worker = None
            return str(exc)
        logger.info("grammar worker %s started in %.2f s", self._worker.pid, time.monotonic() - started_s)
        self.is_ready = True
        return None

    def _stop_worker(self) -> None:
        self.is_ready = False
        if self._worker is not None:
            self._worker.kill()
            self._worker = None

    def _serve(self, job: CompileJob, failure: str | None) -> None:
        if failure is not None:
            self._core.finish(job, error=GrammarCompilerUnavailable(
                f"structured output is unavailable: the engine could not start a grammar compiler ({failure}); "
                f"retry, and tell the operator if it persists"))
            return
        verdict = self._judge(job)
        if verdict is None:
            return  # stopped (budget, cancellation, shutdown) and finished by `_judge`
        if verdict.error is not None:
            self._core.finish(job, error=compile_error(job.spec, verdict.error))
        elif job.is_abandoned:
            self._core.finish_cancelled(job)
        else:
            self._compile_here(job)

    def _judge(self, job: CompileJob) -> GrammarJudgedMsg | None:
        """The worker's verdict on the job's grammar; None if the compile was stopped."""
        assert self._worker is not None, "a slot serves only with its worker running"
        budget_s = None if is_active(Fault.UNBUDGETED_GRAMMAR_COMPILE) else self._core.config.compile_timeout_s
        try:
            budget = CompileBudget(self._worker, budget_s)
            self._worker.send(JudgeGrammarMsg(job.spec.kind, job.spec.schema))
            while True:
                stop = self._why_stop(job, budget)
                if stop is not None:
                    self._stop_compile(job, stop)
                    return None
                verdict = self._worker.poll(budget.wait_s())
                if verdict is not None:
                    return verdict
        except WorkerFailed as exc:
            logger.error("grammar worker failed on a grammar of tenant %s: %s", job.tenant, exc)
            self._stop_worker()
            self._core.finish(job, error=compile_error(job.spec, "the grammar compiler process stopped while "
                                                                  "compiling it"))
            return None

    def _why_stop(self, job: CompileJob, budget: CompileBudget) -> str | None:
        if self._core.is_closed:
            return "closed"
        if job.is_abandoned:
            return "cancelled"
        return budget.why_spent()

    def _stop_compile(self, job: CompileJob, why: str) -> None:
        """Kill the worker in the middle of `job` (it is started again for the next job)."""
        self._stop_worker()
        budget_s = self._core.config.compile_timeout_s
        if why == "timeout":
            logger.warning("a grammar of tenant %s used its %g s of compile CPU time; its worker was stopped",
                           job.tenant, budget_s)
            self._core.finish_timeout(job, starved=False)
        elif why == "starved":
            logger.warning("a grammar of tenant %s did not compile within %g s (its worker got too little CPU on "
                           "this busy host); its worker was stopped", job.tenant, budget_s * WALL_CAP_FACTOR)
            self._core.finish_timeout(job, starved=True)
        elif why == "cancelled":
            self._core.finish_cancelled(job)
        else:
            self._core.finish(job, error=GrammarCompilerUnavailable("the engine is shutting down"))

    def _compile_here(self, job: CompileJob) -> None:
        """The engine's own compile of a grammar the worker compiled within the budget."""
        if self._compiler is None:
            self._compiler = new_compiler(self._core.tokenizer_info())
        try:
            compiled = compile_spec(self._compiler, self._core.vocab_size, job.spec.kind, job.spec.schema)
        except (RuntimeError, ValueError) as exc:
            self._core.finish(job, error=compile_error(job.spec, describe_error(exc)))
            return
        self._core.finish(job, compiled=compiled)


class CompileBudget:
    """One compile's budget, counted in the worker's own CPU time: what the grammar costs to
    compile, whatever else keeps the host's cores busy. Counted in wall time, a worker at nice
    10 beside a busy engine (about a tenth of a core) stopped ordinary schemas as too complex,
    so whether a request was refused depended on other tenants' load. The wait is still
    bounded in wall time (`WALL_CAP_FACTOR` times the budget): a worker starved for that long
    is stopped as over budget too. Where the system does not report a process's CPU time, the
    budget counts wall time. `budget_s` None (a test-only fault) sets no budget."""

    def __init__(self, worker: GrammarWorker, budget_s: float | None) -> None:
        self._worker = worker
        self._budget_s = budget_s
        self._cpu_start_s = worker.cpu_s()
        self._wall_start_s = time.monotonic()

    def _wall_s(self) -> float:
        return time.monotonic() - self._wall_start_s

    def spent_s(self) -> float:
        """Seconds of the budget used: the worker's CPU time since the compile was sent."""
        cpu_s = self._worker.cpu_s()
        if self._cpu_start_s is None or cpu_s is None:
            return self._wall_s()
        return cpu_s - self._cpu_start_s

    def why_spent(self) -> str | None:
        """"timeout" (the CPU budget is used up), "starved" (the wall-clock cap passed first), or None."""
        if self._budget_s is None:
            return None
        if self.spent_s() >= self._budget_s:
            return "timeout"
        return "starved" if self._wall_s() >= self._budget_s * WALL_CAP_FACTOR else None

    def wait_s(self) -> float:
        """How long to wait for the worker's answer before looking again."""
        if self._budget_s is None:
            return CANCEL_CHECK_S
        return max(min(CANCEL_CHECK_S, self._budget_s * WALL_CAP_FACTOR - self._wall_s()), 0.0)


def grammar_vocabulary(tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> Any:
    """xgrammar's view of the vocabulary, with every special token (BOS, UNK, chat markers, ...)
    given no text, so no grammar allows one. xgrammar would otherwise match them as the text
    they are written as (`<s>` spells "<s>", `<|im_end|>` is a valid JSON string's content), yet
    the output text drops them: an answer would not be what its grammar allowed. EOS still ends
    a grammar, as its stop token."""
    import xgrammar

    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                   stop_token_ids=list(eos_token_ids) or None)
    special = set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    vocab: list[bytes | str] = [""] * vocab_size
    for text, token_id in tokenizer.get_vocab().items():
        if token_id < vocab_size and token_id not in special:
            vocab[token_id] = text
    return xgrammar.TokenizerInfo.from_vocab_and_metadata(vocab, info.dump_metadata())


def _lower_thread_priority() -> None:
    """This thread only (Linux schedules threads as tasks; elsewhere nothing changes)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), os.getpriority(os.PRIO_PROCESS, 0) + NICENESS)
    except (AttributeError, OSError):
        pass


# The request field each kind of grammar comes from, and what an error calls that grammar. A
# served JSON Schema may also come from guided_json (the door names that field for its errors).
_PARAMS = {"tool_call": "tools", "tool_calls": "tools", "qwen3_coder_call": "tools", "json_object": "response_format",
           "json_schema": "response_format", "regex": "guided_regex", "choice": "guided_choice",
           "grammar": "guided_grammar"}
_NAMES = {"tool_call": "the tool call grammar (from the tools' parameters)",
          "tool_calls": "the tool call grammar (from the tools' parameters)",
          "qwen3_coder_call": "the tool call grammar (from the tools' parameters)",
          "json_object": "the response_format grammar", "json_schema": "the response_format grammar",
          "regex": "the regex grammar (guided_regex, structured_outputs.regex)",
          "choice": "the choice grammar (guided_choice, structured_outputs.choice)",
          "grammar": "the EBNF grammar (guided_grammar, structured_outputs.grammar)"}


def param_of(spec: StructuredOutput) -> str:
    """The request field a grammar came from, for the 400's `param`."""
    return _PARAMS[spec.kind]


def compile_error(spec: StructuredOutput, problem: str) -> InvalidParameter:
    return InvalidParameter(f"cannot compile {_NAMES[spec.kind]}: {problem}", param=param_of(spec))


def timeout_error(spec: StructuredOutput, timeout_s: float) -> GrammarCompileTimeout:
    return GrammarCompileTimeout(
        f"compiling {_NAMES[spec.kind]} took more than {timeout_s:g} s of CPU time, this server's limit "
        f"(--grammar-compile-timeout-s), and was stopped. Send a smaller or simpler schema (fewer optional "
        f"properties, less nesting) or grammar.", param=param_of(spec))


def starved_error(spec: StructuredOutput, timeout_s: float) -> GrammarCompilerUnavailable:
    """A 503, not a 400: the schema was not shown to be too costly, the host was too busy."""
    return GrammarCompilerUnavailable(
        f"the server is too busy to compile {_NAMES[spec.kind]} now: its compile got too little CPU time in "
        f"{timeout_s * WALL_CAP_FACTOR:g} s (it may use {timeout_s:g} s of CPU time, --grammar-compile-timeout-s) "
        f"and was stopped. Retry later.")


def compiled_or_raise(ticket: GrammarTicket) -> Any:
    """The compiled grammar of a finished ticket, or the `RequestRejected` naming the problem."""
    return ticket.result()
