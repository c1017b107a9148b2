"""A short isolation canary against a real `kvseal serve` on the device, colocated and
`--pd --kv-transport tcp-stream`: 8 tenants, the tests' copy model (it repeats whatever its
context holds, so a leak would show as another tenant's marker). Writes canary.json: each run's
verdict, outcomes and the server's own evidence (its allocator idle after the run)."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from common import ROOT, write_json

sys.path.insert(0, str(ROOT / "tests" / "canary"))

from copy_model import make_copy_model  # noqa: E402
from kvseal_server import KvsealServer  # noqa: E402

from kvseal.cli import main as kvseal_main  # noqa: E402

KEYS = [f"canary-key-{i}" for i in range(8)]
ADMIN_KEY = "canary-admin-key"  # reads /metrics: the server's own evidence joins the report


def run(name: str, model: Path, workdir: Path, device: str, requests: int, extra: list[str]) -> dict[str, Any]:
    workdir.mkdir()
    server_keys: dict[str, dict[str, object]] = {k: {"tenant": f"t{i}"} for i, k in enumerate(KEYS)}
    server_keys[ADMIN_KEY] = {"tenant": "ops", "admin": True}
    keys_path = workdir / "canary-keys.json"
    keys_path.write_text(json.dumps(KEYS))
    report_path = workdir / "report.json"
    # float32: the copy model's codes are exact there; the device's default dtype is bfloat16
    flags = ["--device", device, "--dtype", "float32", *extra]
    with KvsealServer(model, workdir, server_keys, extra_args=flags) as server:
        status = kvseal_main(["canary", "--base-url", server.url, "--keys", str(keys_path), "--requests",
                              str(requests), "--max-tokens", "8", "--seed", "1", "--report", str(report_path),
                              "--admin-key", ADMIN_KEY, "--no-progress"])
    report = json.loads(report_path.read_text())
    return {"server": name, "flags": flags, "exit_status": status, "verdict": report.get("verdict"),
            "leaks": len(report.get("leaks", [])), "outcomes": report.get("requests_by_outcome"),
            "server_evidence": report.get("server_evidence"),
            "server_log_tail": (workdir / "server.log").read_text()[-1500:] if status else ""}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--requests", type=int, default=40)
    ns = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = make_copy_model(Path(tmp) / "copy-model")
        results = [run("serve", model, Path(tmp) / "serve", ns.device, ns.requests, []),
                   run("pd", model, Path(tmp) / "pd", ns.device, ns.requests, ["--pd", "--kv-transport", "tcp-stream"])]
    write_json("canary.json", {"device": ns.device, "passed": all(r["exit_status"] == 0 for r in results),
                               "runs": results})


if __name__ == "__main__":
    main()
