"""Real PD processes for tests: `kvseal engine --role ...` and `kvseal serve --prefill --decode`,
each run through `tests/fault_launcher.py` (so a test can switch faults on in one of them),
on free loopback ports, every link authenticated with key files `kvseal keys generate` wrote
(`LinkKeyFiles`). Every wait is bounded; processes are stopped by PID."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from processes import (
    READY_DEADLINE_S,
    WAIT_DEADLINE_S,
    LoggedProcess,
    free_port,
    health_status,
    kvseal_argv,
    read_jsonl,
    wait_for,
)

from kvseal.disagg.link_keys import KeyPair, generate_keys, load_key_pair

KEYS = {"key-alice": {"tenant": "alice"}, "key-bob": {"tenant": "bob"}, "key-mallory": {"tenant": "mallory"},
        "key-ops": {"tenant": "ops", "admin": True}}  # /metrics needs an admin key
# The incident's shape: prefill's pool and limit are smaller than decode's. Small prefill chunks
# keep a request in prefill for many steps (the kill tests need that window).
PREFILL_FLAGS = ["--kv-cache-tokens", "256", "--max-model-len", "256", "--max-num-batched-tokens", "8"]
DECODE_FLAGS = ["--kv-cache-tokens", "1024", "--max-model-len", "1024"]


ENGINE_FLAGS = ["--dtype", "float32", "--page-size", "4", "--max-num-batched-tokens", "256"]


@dataclass(frozen=True)
class LinkKeyFiles:
    """One deployment's key files: `frontend`, `prefill` (every prefill engine proves it) and
    `decode`, written once per folder by the same code as `kvseal keys generate`."""

    folder: Path

    NAMES = ("frontend", "prefill", "decode")

    @classmethod
    def in_folder(cls, workdir: Path) -> LinkKeyFiles:
        keys = cls(workdir / "link-keys")
        if not keys.public("frontend").exists():
            generate_keys(keys.folder, list(cls.NAMES))
        return keys

    def public(self, name: str) -> Path:
        return self.folder / f"{name}.key"

    def secret(self, name: str) -> Path:
        return self.folder / f"{name}.key_secret"

    def pair(self, name: str) -> KeyPair:
        return load_key_pair(self.secret(name))

    def engine_flags(self, role: str) -> list[str]:
        flags = ["--link-key", str(self.secret(role)), "--frontend-keys", str(self.public("frontend"))]
        return [*flags, "--peer-keys", str(self.public("prefill"))] if role == "decode" else flags

    def frontend_flags(self, num_prefill: int, num_decode: int) -> list[str]:
        return ["--link-key", str(self.secret("frontend")),
                "--prefill-keys", ",".join([str(self.public("prefill"))] * num_prefill),
                "--decode-keys", ",".join([str(self.public("decode"))] * num_decode)]


class Proc(LoggedProcess):
    def __init__(self, name: str, args: list[str], workdir: Path, faults: str = "none") -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        super().__init__(name, kvseal_argv(args, [faults]), workdir / f"{name}.log")

    def start(self) -> Proc:
        self.spawn(append=True)  # a restart keeps the earlier run's log
        return self


class PdEngine(Proc):
    def __init__(self, role: str, model_dir: Path, workdir: Path, flags: list[str], faults: str = "none",
                 port: int | None = None) -> None:
        self.role = role
        self.address = f"127.0.0.1:{port or free_port()}"
        self.keys = LinkKeyFiles.in_folder(workdir)
        super().__init__(f"{role}-{self.address.rpartition(':')[2]}",
                         ["engine", "--role", role, "--listen", self.address, "--model", str(model_dir),
                          *ENGINE_FLAGS, *self.keys.engine_flags(role), *flags], workdir, faults)

    def wait_ready(self) -> PdEngine:
        def ready() -> bool:
            self.assert_running()
            return "kvseal engine ready" in self.log()
        wait_for(ready, f"{self.name} to be ready (log {self.log_path})", READY_DEADLINE_S)
        return self

    def restart(self) -> PdEngine:
        """Kill and start again at the same address (a new instance)."""
        self.kill()
        return self.start()


class PdFrontend(Proc):
    def __init__(self, prefill: list[PdEngine], decode: list[PdEngine], model_dir: Path, workdir: Path,
                 keys: dict[str, Any], faults: str = "none", extra: list[str] | None = None) -> None:
        self.port = free_port()
        self.audit_path = workdir / f"audit-{self.port}.jsonl"
        keys_path = workdir / "keys.json"
        keys_path.parent.mkdir(parents=True, exist_ok=True)
        keys_path.write_text(json.dumps(keys))
        link_keys = LinkKeyFiles.in_folder(workdir)
        super().__init__(f"frontend-{self.port}",
                         ["serve", "--prefill", ",".join(e.address for e in prefill),
                          "--decode", ",".join(e.address for e in decode), "--model", str(model_dir),
                          "--port", str(self.port), "--audit-log", str(self.audit_path), "--api-keys",
                          str(keys_path), *link_keys.frontend_flags(len(prefill), len(decode)), *(extra or [])],
                         workdir, faults)
        self.model_name = model_dir.name

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def health(self) -> int:
        return health_status(self.url)

    def wait_healthy(self, status: int = 200) -> PdFrontend:
        self.wait_until_healthy(self.url, status)
        return self

    def audit_records(self) -> list[dict[str, Any]]:
        return read_jsonl(self.audit_path)

    def metrics(self) -> str:
        response = httpx.get(f"{self.url}/metrics", timeout=10, headers={"authorization": "Bearer key-ops"})
        assert response.status_code == 200, response.text
        return response.text

    def metric(self, name: str, **labels: str) -> float:
        """Sum of `name` over series whose labels include `labels` (0 when there is none yet;
        the metric family itself must exist)."""
        text = self.metrics()
        assert f"# TYPE {name} " in text, f"no metric {name} in /metrics"
        total = 0.0
        for match in re.finditer(rf"^{re.escape(name)}\{{([^}}]*)\}} (\S+)$", text, re.MULTILINE):
            found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1)))
            if all(found.get(k) == v for k, v in labels.items()):
                total += float(match.group(2))
        return total


def engine_integrity(engine: PdEngine) -> Any:
    """Ask a running engine for its `IntegrityReportMsg` over a DEALER of our own (proving the
    frontend key: only a frontend may ask)."""
    import zmq

    from kvseal.disagg.link_auth import secure_client
    from kvseal.disagg.msgs import IntegrityCheckMsg, IntegrityReportMsg, decode, encode

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    address = engine.address
    try:
        secure_client(sock, engine.keys.pair("frontend"), engine.keys.pair(engine.role).public)
        sock.connect(f"tcp://{address}")
        sock.send(encode(IntegrityCheckMsg()))
        for _ in range(200):
            if not sock.poll(int(WAIT_DEADLINE_S * 1000 / 200)):
                continue
            msg = decode(sock.recv())
            if isinstance(msg, IntegrityReportMsg):
                return msg
        raise AssertionError(f"no integrity report from {address}")
    finally:
        sock.close()
        ctx.term()


def assert_engines_clean(*engines: PdEngine) -> None:
    """Each engine's invariants hold and its pool has drained back to all free."""
    for engine in engines:
        def drained(engine: PdEngine = engine) -> Any:
            report = engine_integrity(engine)
            return report if report.num_pages_used == 0 and report.num_unfinished == 0 else None
        report = wait_for(drained, f"{engine.name} to drain its pool")
        assert report.error is None, f"{engine.name}: {report.error}"
        assert report.num_reservations == 0


@dataclass
class PdCluster:
    marker_dir: Path
    workdir: Path
    prefill: PdEngine
    decode: PdEngine
    frontend: PdFrontend
    kv_transport: str = "tcp"

    def replace_prefill(self, faults: str, flags: list[str] | None = None) -> PdEngine:
        """Stop the prefill engine and start another at the same address, with `faults` (and
        `flags` instead of PREFILL_FLAGS)."""
        self.prefill.terminate()
        port = int(self.prefill.address.rpartition(":")[2])
        self.prefill = PdEngine("prefill", self.marker_dir, self.workdir,
                                [*(flags or PREFILL_FLAGS), "--kv-transport", self.kv_transport], faults, port=port)
        return self.prefill.start().wait_ready()
