"""Start and watch the engine process (multiprocessing "spawn": torch and fork do not mix)."""

from __future__ import annotations

import multiprocessing
import shutil
import tempfile
from multiprocessing.process import BaseProcess

from kvseal.config import EngineArgs
from kvseal.messages.engine_proc import EngineAddresses, run_engine_process


class EngineProcess:
    """One engine child. Its ZMQ endpoints are IPC sockets in a private temporary folder."""

    def __init__(self, args: EngineArgs, log_level: str) -> None:
        self._args = args
        self._log_level = log_level
        self._dir = tempfile.mkdtemp(prefix="kvseal-")
        self.addresses = EngineAddresses(f"ipc://{self._dir}/to_engine", f"ipc://{self._dir}/from_engine")
        self._proc: BaseProcess | None = None

    def start(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._proc = ctx.Process(target=run_engine_process, args=(self._args, self.addresses, self._log_level),
                                 name="kvseal-engine", daemon=True)
        self._proc.start()

    @property
    def _started(self) -> BaseProcess:
        assert self._proc is not None, "the engine process has not been started"
        return self._proc

    @property
    def pid(self) -> int | None:
        return self._started.pid

    @property
    def sentinel(self) -> int:
        """A file descriptor that becomes readable when the process ends."""
        return self._started.sentinel

    @property
    def exitcode(self) -> int | None:
        return self._started.exitcode

    def is_alive(self) -> bool:
        return self._proc is not None and self._proc.is_alive()

    def kill(self) -> None:
        if self.is_alive():
            self._started.kill()

    def join(self, timeout_s: float | None = None) -> None:
        if self._proc is not None:
            self._proc.join(timeout_s)

    def cleanup(self) -> None:
        shutil.rmtree(self._dir, ignore_errors=True)
