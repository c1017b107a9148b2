"""The engine's handle on one grammar worker process (`kvseal/structured/worker.py`).

Started once and kept (importing xgrammar costs seconds), asked to judge one grammar at a
time, killed by its own PID when its compile runs over the budget or nobody waits for it any
more, then started again. Every wait here is bounded by the caller's deadline.
"""

from __future__ import annotations

import logging
import os
import select
import subprocess
import sys
import time
from pathlib import Path

from kvseal.structured.msgs import (
    FrameError,
    FromWorkerMsg,
    GrammarJudgedMsg,
    JudgeGrammarMsg,
    WorkerReadyMsg,
    WorkerSetupMsg,
    read_from_worker,
    write_frame,
)

logger = logging.getLogger("kvseal.structured")

KILL_WAIT_S = 10.0  # a SIGKILLed process is reaped within this (it cannot refuse)
_CLOCK_TICKS_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100  # /proc's unit of CPU time


class WorkerFailed(Exception):
    """The worker did not start in time, or exited (or broke the protocol) while it had work."""


class GrammarWorker:
    def __init__(self, setup: WorkerSetupMsg) -> None:
        self._setup = setup
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def start(self, deadline_s: float) -> None:
        """Start the process and wait until it is ready, or until `deadline_s` (monotonic)."""
        self._proc = subprocess.Popen([sys.executable, "-m", "kvseal.structured.worker"], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, bufsize=0, close_fds=True, env=_worker_env())
        try:
            self._write(self._setup)
            ready = self._read(deadline_s)
        except WorkerFailed:
            self.kill()
            raise
        if not isinstance(ready, WorkerReadyMsg):
            self.kill()
            raise WorkerFailed("the grammar worker did not start in time" if ready is None else
                               f"the grammar worker answered {type(ready).__name__} instead of ready")

    def cpu_s(self) -> float | None:
        """The CPU seconds (user and system) the worker process has used, or None where the
        system does not say (no `/proc`) or the process is gone."""
        if self._proc is None:
            return None
        try:
            stat = Path(f"/proc/{self._proc.pid}/stat").read_text()
        except OSError:
            return None
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": field 3, the state, on
        return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS_S  # fields 14 and 15: utime, stime

    def send(self, msg: JudgeGrammarMsg) -> None:
        self._write(msg)

    def poll(self, timeout_s: float) -> GrammarJudgedMsg | None:
        """The answer to the grammar sent, if it arrives within `timeout_s`; else None."""
        answer = self._read(time.monotonic() + max(timeout_s, 0.0))
        if answer is not None and not isinstance(answer, GrammarJudgedMsg):
            raise WorkerFailed(f"the grammar worker sent {type(answer).__name__} instead of a verdict")
        return answer

    def kill(self) -> None:
        """SIGKILL (its own PID only) and reap; a no-op if it is not running."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.kill()
        try:
            proc.wait(timeout=KILL_WAIT_S)
        except subprocess.TimeoutExpired:
            logger.error("grammar worker %d did not exit after SIGKILL", proc.pid)
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                pipe.close()

    def _write(self, msg: WorkerSetupMsg | JudgeGrammarMsg) -> None:
        assert self._proc is not None and self._proc.stdin is not None, "a started worker"
        try:
            write_frame(self._proc.stdin.fileno(), msg)
        except OSError as exc:
            raise WorkerFailed(f"the grammar worker is gone: {exc}") from None

    def _read(self, deadline_s: float) -> FromWorkerMsg | None:
        assert self._proc is not None and self._proc.stdout is not None, "a started worker"
        fd = self._proc.stdout.fileno()
        readable, _, _ = select.select([fd], [], [], max(deadline_s - time.monotonic(), 0.0))
        if not readable:
            return None
        try:
            return read_from_worker(fd)
        except (FrameError, OSError) as exc:
            raise WorkerFailed(f"the grammar worker stopped (exit status {self._proc.poll()}): {exc}") from None


def _worker_env() -> dict[str, str]:
    """The engine's environment, with this kvseal first on the path: the worker runs the same
    code as the engine that starts it (a source checkout as much as an installed package)."""
    root = str(Path(__file__).resolve().parents[2])  # where the kvseal package is
    path = os.environ.get("PYTHONPATH")
    return os.environ | {"PYTHONPATH": root if not path else os.pathsep.join([root, path])}
