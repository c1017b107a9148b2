"""Real processes for tests (`kvseal serve`, `kvseal engine`): start one on a free loopback
port, wait until it is ready, stop it by its own PID.

Every wait is bounded: a process that does not become ready, or does not exit after SIGTERM,
fails the test instead of hanging it. Faults go on through `tests/fault_launcher.py` (in the
engine processes too); nothing else here changes what the process does.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

READY_DEADLINE_S = 180.0  # start-up: loading a model on a loaded 2-core host
WAIT_DEADLINE_S = 60.0  # anything else: a request, a drain, an exit
FAULT_LAUNCHER = Path(__file__).parent / "fault_launcher.py"
LOG_TAIL_CHARS = 4000


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def process_gone(pid: int) -> bool:
    """No process has this PID (signal 0 only asks whether one exists)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def wait_for(condition: Callable[[], Any], what: str, deadline_s: float = WAIT_DEADLINE_S) -> Any:
    """Poll `condition` until it returns something truthy; fail after the deadline."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        result = condition()
        if result:
            return result
        time.sleep(0.05)
    raise AssertionError(f"timed out after {deadline_s:.0f} s waiting for {what}")


def kvseal_argv(args: list[str], faults: list[str] | None = None) -> list[str]:
    """The command line of `kvseal ARGS`; with `faults` (names, may be ["none"]) through the launcher."""
    if faults is None:
        return [sys.executable, "-m", "kvseal.cli", *args]
    return [sys.executable, str(FAULT_LAUNCHER), ",".join(faults), "--", *args]


def health_status(url: str) -> int:
    """The status of GET {url}/health; 0 while nothing answers."""
    try:
        return httpx.get(f"{url}/health", timeout=5).status_code
    except httpx.TransportError:
        return 0


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a JSON-lines file such as a server's audit log ([] before it exists)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line]


class LoggedProcess:
    """One process with its stdout and stderr in a log file, stopped by its own PID."""

    def __init__(self, name: str, argv: list[str], log_path: Path, *, new_session: bool = False) -> None:
        self.name = name
        self.argv = argv
        self.log_path = log_path
        self._new_session = new_session  # the leader of a new process group (its children included)
        self.proc: subprocess.Popen[bytes] | None = None

    def spawn(self, *, append: bool = False) -> None:
        """Start it; `append` keeps the log of an earlier run (a restart)."""
        with open(self.log_path, "ab" if append else "wb") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=self._new_session)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def assert_running(self) -> None:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"{self.name} exited with {self.proc.returncode}:\n{self.log()[-LOG_TAIL_CHARS:]}")

    def wait_until_healthy(self, url: str, status: int = 200, deadline_s: float = READY_DEADLINE_S) -> None:
        """Wait until {url}/health answers `status`; fail at once if the process exits first."""
        def check() -> bool:
            self.assert_running()
            return health_status(url) == status
        wait_for(check, f"{self.name} /health to answer {status} (log: {self.log_path})", deadline_s)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=WAIT_DEADLINE_S)

    def stop(self, deadline_s: float = WAIT_DEADLINE_S) -> int | None:
        """SIGTERM, then the exit status; None if it had to be SIGKILLed after `deadline_s`."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=deadline_s)
        except subprocess.TimeoutExpired:
            self.kill()
            return None

    def terminate(self) -> int:
        """SIGTERM, then the exit status (SIGKILL and fail if it does not exit in time)."""
        status = self.stop()
        if status is None:
            raise AssertionError(f"{self.name} did not exit within {WAIT_DEADLINE_S:.0f} s of SIGTERM")
        return status
