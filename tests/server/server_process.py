"""Run the real `kvseal serve` as a subprocess on a free loopback port, for tests.

Waiting is bounded everywhere: a server that does not become ready, a request that does
not end, or a process that does not exit fails the test instead of hanging it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx
import openai
from processes import LoggedProcess, free_port, kvseal_argv, read_jsonl, wait_for

from kvseal.model_files import DEFAULT_MODEL_FILE

ENGINE_FLAGS = ["--dtype", "float32", "--kv-cache-tokens", "2048", "--page-size", "4", "--max-model-len", "512",
                "--max-num-batched-tokens", "256"]
# The isolation tests run in both: the default configuration (what operators run) and checked mode.
ISOLATION_MODES = {"default": [], "check_kv": ["--check-kv"]}
MAX_MODEL_LEN = 512
MAX_BODY_BYTES = 1024 * 1024
KEYS = {
    "key-alice": {"tenant": "alice"},
    "key-bob": {"tenant": "bob"},
    "key-limited": {"tenant": "limited", "max_concurrent_requests": 1},
    "key-capped": {"tenant": "capped", "max_tokens": 32},
    "key-fuzz": {"tenant": "fuzz", "max_tokens": 8},
    "key-ops": {"tenant": "ops", "admin": True},
}


def client_for(server: ServerProcess, key: str) -> openai.OpenAI:
    """The official client, without its automatic retries (tests want every status as it is)."""
    return openai.OpenAI(base_url=server.base_url, api_key=key, max_retries=0, timeout=60)


class ServerProcess(LoggedProcess):
    def __init__(self, model_dir: Path | None, workdir: Path, *, keys: dict[str, Any] | None = None,
                 extra_args: list[str] | None = None, faults: list[str] | None = None,
                 own_process_group: bool = False) -> None:
        """`model_dir` None serves the default model (no --model flag). `faults` runs it through
        tests/fault_launcher.py with those fault switches on (in the engine process too);
        `own_process_group` starts it as the leader of a new process group (engine included)."""
        workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.audit_path = workdir / "audit.jsonl"
        args = ["--port", str(self.port), "--audit-log", str(self.audit_path), *ENGINE_FLAGS, *(extra_args or [])]
        if model_dir is not None:
            args += ["--model", str(model_dir)]
        if keys is not None:
            keys_path = workdir / "keys.json"
            keys_path.write_text(json.dumps(keys))
            args += ["--api-keys", str(keys_path)]
        super().__init__("the server", kvseal_argv(["serve", *args], faults), workdir / "server.log",
                         new_session=own_process_group)
        self.admin_key = next((k for k, v in (keys or {}).items() if v.get("admin")), None)
        self.model_name = model_dir.name if model_dir is not None else Path(DEFAULT_MODEL_FILE).stem

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def start(self) -> ServerProcess:
        self.spawn()
        try:
            self.wait_until_healthy(self.url)
        except AssertionError:
            self.kill()  # one that never became ready is not left running (its engine exits with it)
            raise
        return self

    @property
    def engine_pid(self) -> int:
        match = re.search(r"engine pid (\d+)", self.log())
        assert match, "the ready line names the engine pid"
        return int(match.group(1))

    def audit_records(self) -> list[dict[str, Any]]:
        return read_jsonl(self.audit_path)

    def audit_for(self, request_id: str) -> dict[str, Any]:
        """The one audit record of a request, once written (fails if there are several)."""
        def find() -> list[dict[str, Any]]:
            return [r for r in self.audit_records() if r.get("request_id") == request_id]

        records = wait_for(find, f"the audit record of {request_id}")
        assert len(records) == 1, f"{len(records)} audit records for {request_id}"
        return records[0]

    def metrics_text(self) -> str:
        headers = {"Authorization": f"Bearer {self.admin_key}"} if self.admin_key else None
        response = httpx.get(f"{self.url}/metrics", headers=headers, timeout=10)
        assert response.status_code == 200, response.text
        return response.text

    def metric(self, name: str) -> float:
        text = self.metrics_text()
        match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
        assert match, f"metric {name} not in /metrics"
        return float(match.group(1))
