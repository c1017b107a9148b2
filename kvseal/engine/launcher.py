"""Start and watch the engine process (multiprocessing "spawn": torch and fork do not mix).

The colocated frontend<->engine link (I9) is ZMQ over `ipc://` sockets that the frontend binds
in a private folder (mode 0700, owned by the server's user; `private_socket_dir`): reaching a
socket takes search permission on that folder, so only the server's own user (and root) can
connect, and file permissions are the authentication there. CURVE would add nothing on this
link: whoever passes that check runs as the server's user (or root) and can already read both
processes' memory (ptrace, /proc/PID/mem), secrets included; and the sockets are not reachable
from another host. The PD engine links are TCP, reachable by any local user, hence CURVE.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from multiprocessing.process import BaseProcess

from kvseal.config import EngineArgs
from kvseal.engine.process import EngineAddresses, run_engine_process
from kvseal.engine.supervisor import spawn_context


class EngineProcess:
    """One engine child. Its ZMQ endpoints are IPC sockets in a private temporary folder."""

    def __init__(self, args: EngineArgs, log_level: str) -> None:
        self._args = args
        self._log_level = log_level
        self._dir = private_socket_dir()
        self.addresses = EngineAddresses(f"ipc://{self._dir}/to_engine", f"ipc://{self._dir}/from_engine", self._dir)
        self._proc: BaseProcess | None = None
        self._num_starts = 0

    def new_inbox(self) -> str:
        """A fresh address for the frontend's messages to the next process started (a restart):
        nothing the frontend queued for a dead engine can reach its successor."""
        self.addresses = EngineAddresses(f"ipc://{self._dir}/to_engine.{self._num_starts}",
                                         self.addresses.from_engine, self._dir)
        return self.addresses.to_engine

    def start(self) -> None:
        ctx = spawn_context()
        self._proc = ctx.Process(target=run_engine_process, args=(self._args, self.addresses, self._log_level),
                                 name="kvseal-engine", daemon=True)
        self._proc.start()
        self._num_starts += 1

    @property
    def _started(self) -> BaseProcess:
        assert self._proc is not None, "the engine process has not been started"
        return self._proc

    @property
    def pid(self) -> int | None:
        return self._started.pid

    @property
    def num_starts(self) -> int:
        """Processes started so far: the one running now is the `num_starts`-th."""
        return self._num_starts

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
        if self._proc is not None and self._proc.pid is not None:  # (a start a signal cut short has none)
            self._proc.join(timeout_s)

    def cleanup(self) -> None:
        shutil.rmtree(self._dir, ignore_errors=True)


def private_socket_dir() -> str:
    """A new folder only this user may enter (0700): the engine's IPC sockets live there."""
    path = tempfile.mkdtemp(prefix="kvseal-")  # created 0700, whatever the umask
    info = os.stat(path)
    if stat.S_IMODE(info.st_mode) != 0o700 or info.st_uid != os.getuid():
        shutil.rmtree(path, ignore_errors=True)
        raise RuntimeError(f"the engine's socket folder {path} is not private (mode "
                           f"{stat.S_IMODE(info.st_mode):o}, owner {info.st_uid}); refusing to put its sockets there")
    return path
