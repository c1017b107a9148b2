"""A grammar worker process: `python -m kvseal.structured.worker`, started by the engine.

It compiles one structured-output grammar at a time, as the engine asks, and says whether it
compiled and how long it took. xgrammar's compile cannot be interrupted from Python, so the
engine enforces the time budget by killing this process (SIGKILL) and starting another.

Contract: the protocol runs on stdin/stdout only (`structured/msgs.py`); anything else that
writes to stdout is sent to stderr, which is the engine's log. The worker exits when the
engine closes its stdin, and on its own within `PARENT_CHECK_S` once the engine process is
gone, even in the middle of a compile (a compile must never outlive its engine). It runs
`NICENESS` below the engine's priority, once: the engine threads that start workers run at
that priority themselves, and a thread's priority is what its child process starts with.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any

from kvseal.structured.grammars import compile_spec, new_compiler
from kvseal.structured.msgs import (
    GrammarJudgedMsg,
    JudgeGrammarMsg,
    WorkerReadyMsg,
    WorkerSetupMsg,
    read_to_worker,
    write_frame,
)
from kvseal.structured.schema import describe_error

PARENT_CHECK_S = 0.2
# Compiles yield the CPU to the engine's forward passes: a busy core must not stall the
# engine's threads (each op waits for all of them) and so every tenant's decode steps.
NICENESS = 10
MAX_NICENESS = 19  # the lowest priority Linux gives


def main() -> int:
    protocol_out = os.dup(1)
    os.dup2(2, 1)  # stray prints (a library's) go to the log, never into the protocol
    _yield_to_the_engine(os.getppid())
    _exit_with_parent(os.getppid())
    setup = read_to_worker(0)
    if not isinstance(setup, WorkerSetupMsg):
        return 2
    import xgrammar

    compiler = new_compiler(xgrammar.TokenizerInfo.deserialize_json(setup.tokenizer_info_json))
    write_frame(protocol_out, WorkerReadyMsg(os.getpid()))
    while isinstance(msg := read_to_worker(0), JudgeGrammarMsg):
        write_frame(protocol_out, judge(compiler, setup.vocab_size, msg))
    return 0


def _yield_to_the_engine(engine_pid: int) -> None:
    """Niceness `NICENESS` above the engine's main thread (Linux: a process's PID is its main
    thread's), never more: a worker started by a slot thread already runs there, and nicing it
    again put it at 19, where a busy engine left a compile ~1.5% of a core instead of ~10%."""
    target = min(os.getpriority(os.PRIO_PROCESS, engine_pid) + NICENESS, MAX_NICENESS)
    if os.getpriority(os.PRIO_PROCESS, 0) < target:
        os.setpriority(os.PRIO_PROCESS, 0, target)


def judge(compiler: Any, vocab_size: int, msg: JudgeGrammarMsg) -> GrammarJudgedMsg:
    started_s = time.monotonic()
    try:
        compile_spec(compiler, vocab_size, msg.kind, msg.schema)
    except (RuntimeError, ValueError) as exc:
        return GrammarJudgedMsg(describe_error(exc), time.monotonic() - started_s)
    return GrammarJudgedMsg(None, time.monotonic() - started_s)


def _exit_with_parent(parent_pid: int) -> None:
    """A daemon thread that ends the process once it is re-parented (the engine died). The
    compile releases the GIL, so this runs during one."""
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_CHECK_S)
        os._exit(1)

    threading.Thread(target=watch, name="kvseal-grammar-parent-watch", daemon=True).start()


if __name__ == "__main__":
    sys.exit(main())
