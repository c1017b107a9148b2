"""Start a real `kvseal serve` (optionally with test-only faults on) for a canary test.

The server binds 127.0.0.1 on a free port, is waited for with a deadline, and is stopped by
its own PID (SIGTERM, then SIGKILL if it does not exit).
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

READY_DEADLINE_S = 180.0
EXIT_DEADLINE_S = 60.0
FAULT_LAUNCHER = Path(__file__).resolve().parents[1] / "fault_launcher.py"
# The copy model's canary requests fit one 256-token page, the page FOREIGN_PAGE swaps.
ENGINE_FLAGS = ["--dtype", "float32", "--kv-cache-tokens", "8192", "--page-size", "256", "--max-model-len", "512"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class KvsealServer:
    def __init__(self, model_dir: Path, workdir: Path, keys: dict[str, dict[str, object]],
                 faults: list[str] | None = None, extra_args: list[str] | None = None) -> None:
        self.port = free_port()
        self.log_path = workdir / "server.log"
        keys_path = workdir / "server-keys.json"
        keys_path.write_text(json.dumps(keys))
        serve = ["serve", "--model", str(model_dir), "--port", str(self.port), "--api-keys", str(keys_path),
                 "--audit-log", str(workdir / "audit.jsonl"), *ENGINE_FLAGS, *(extra_args or [])]
        if faults:
            self.argv = [sys.executable, str(FAULT_LAUNCHER), ",".join(faults), "--", *serve]
        else:
            self.argv = [sys.executable, "-m", "kvseal.cli", *serve]
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> KvsealServer:
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT)
        end = time.monotonic() + READY_DEADLINE_S
        while not self._is_ready():
            if time.monotonic() > end:
                self.__exit__()
                raise AssertionError(f"kvseal did not become ready in {READY_DEADLINE_S:.0f} s:\n{self.log()}")
            time.sleep(0.1)
        return self

    def _is_ready(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"kvseal exited with {self.proc.returncode} during start-up:\n{self.log()}")
        try:
            return httpx.get(f"{self.url}/health", timeout=5).status_code == 200
        except httpx.TransportError:
            return False

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def __exit__(self, *exc: object) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=EXIT_DEADLINE_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=EXIT_DEADLINE_S)
