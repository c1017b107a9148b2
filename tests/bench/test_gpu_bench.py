"""The cheap parts of `bench/gpu/run.sh` (its whole dry run takes minutes: README): the script
parses, the dependency probe names nothing on a machine with kvseal's dependencies, and the
summary reads the helpers' JSON files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GPU = ROOT / "bench" / "gpu"


def test_the_script_parses() -> None:
    subprocess.run(["bash", "-n", str(GPU / "run.sh")], check=True)


def test_the_probe_finds_every_dependency_here() -> None:
    out = subprocess.run([sys.executable, str(GPU / "missing.py")], check=True, capture_output=True, text=True)
    assert out.stdout.strip() == ""


def test_the_summary_reads_the_helpers_results(tmp_path: Path) -> None:
    (tmp_path / "parity.json").write_text(json.dumps({"all_equal": False, "results": [
        {"model": "tiny-llama", "all_equal": True}, {"model": "llama-1b", "all_equal": False}]}))
    row = {"concurrency": 32, "kvseal": {"output_tokens_per_s": 2000.0, "decode_step_ms_median": 9.5},
           "transformers": {"output_tokens_per_s": 500.0}, "speedup_vs_transformers": 4.0,
           "roofline_step_ms": 3.8, "step_over_roofline": 2.5}
    (tmp_path / "throughput.json").write_text(json.dumps({"copy_bandwidth_gb_s": 4200.0,
                                                         "shapes": [{"shape": "llama-8b", "rows": [row]}]}))
    env = {**os.environ, "OUT": str(tmp_path), "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, str(GPU / "summary.py")], check=True, env=env, capture_output=True)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["parity"] == {"tiny-llama": True, "llama-1b": False} and summary["parity_all_equal"] is False
    assert summary["canary_passed"] is None  # no canary.json: not run, not "passed"
    assert summary["throughput"] == [{"shape": "llama-8b", "concurrency": 32, "kvseal_tok_s": 2000.0,
                                      "transformers_tok_s": 500.0, "speedup": 4.0, "decode_step_ms": 9.5,
                                      "roofline_step_ms": 3.8, "step_over_roofline": 2.5}]
