"""I8 in PD mode: the audit-log outage of tests/server/audit_outage.py against `kvseal serve
--pd` (a frontend over a prefill and a decode engine). Answers are withheld while the log
fails, new requests refused, bad input still a 400, and the frontend recovers by itself; a
failed write never reaches its engine receive loops (the run would end in 500s or hang)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from pd_servers import ENGINE_FLAGS, Proc
from processes import free_port

sys.path.insert(0, str(Path(__file__).parent.parent / "server"))
from audit_outage import Outage, linked_audit_log, play_outage  # noqa: E402
from tiny_server_model import make_server_model  # noqa: E402

KEYS = {"key-alice": {"tenant": "alice"}, "key-ops": {"tenant": "ops", "admin": True}}
FLAGS = [*ENGINE_FLAGS, "--kv-cache-tokens", "1024", "--max-model-len", "512"]


def test_a_failing_audit_log_withholds_answers_and_recovers_in_pd_mode(tmp_path: Path) -> None:
    model = make_server_model(tmp_path / "tiny")
    link, real = linked_audit_log(tmp_path / "audit")
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps(KEYS))
    port = free_port()
    argv = ["serve", "--pd", "--model", str(model), "--port", str(port), "--api-keys", str(keys),
            "--audit-log", str(link), *FLAGS]
    server = Proc("serve-pd", argv, tmp_path).start()
    url = f"http://127.0.0.1:{port}"
    try:
        server.wait_until_healthy(url)
        play_outage(Outage(url, link, real, "key-alice", "key-ops"))
        server.assert_running()
        assert "receive loop" not in server.log() and "routing a message" not in server.log()
    finally:
        assert server.terminate() == 0
