"""Start a real `kvseal serve` (optionally with test-only faults on) for a canary test.

The server binds 127.0.0.1 on a free port, is waited for with a deadline, and is stopped by
its own PID (SIGTERM, then SIGKILL if it does not exit).
"""

from __future__ import annotations

import json
from pathlib import Path

from processes import LoggedProcess, free_port, kvseal_argv

EXIT_DEADLINE_S = 60.0
# The copy model's canary requests fit one 256-token page, the page FOREIGN_PAGE swaps. The dtype
# is the default one (auto: bfloat16 with its AMX linears and kernels where the CPU has them,
# float32 elsewhere): the isolation checks must hold in the configuration people run.
ENGINE_FLAGS = ["--dtype", "auto", "--kv-cache-tokens", "8192", "--page-size", "256", "--max-model-len", "512"]


class KvsealServer(LoggedProcess):
    def __init__(self, model_dir: Path, workdir: Path, keys: dict[str, dict[str, object]],
                 faults: list[str] | None = None, extra_args: list[str] | None = None) -> None:
        self.port = free_port()
        keys_path = workdir / "server-keys.json"
        keys_path.write_text(json.dumps(keys))
        serve = ["serve", "--model", str(model_dir), "--port", str(self.port), "--api-keys", str(keys_path),
                 "--audit-log", str(workdir / "audit.jsonl"), *ENGINE_FLAGS, *(extra_args or [])]
        super().__init__("kvseal", kvseal_argv(serve, faults or None), workdir / "server.log")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> KvsealServer:
        self.spawn()
        try:
            self.wait_until_healthy(self.url)
        except AssertionError:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            self.stop(EXIT_DEADLINE_S)  # SIGKILL after the deadline
