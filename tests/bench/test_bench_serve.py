"""Smoke tests of `kvseal bench serve` / `plot` against a real kvseal server on a tiny model.

Counts and key names only: no timing is asserted.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from server_process import ENGINE_FLAGS, ServerProcess

from kvseal.cli import main

VLLM_KEYS = ["completed", "total_input_tokens", "total_output_tokens", "request_throughput", "output_throughput",
             "total_token_throughput", "duration"] + [
    f"{stat}_{name}_ms" for name in ("ttft", "tpot", "itl", "e2el") for stat in ("mean", "median", "std", "p99")]
NUM_PROMPTS, INPUT_LEN, OUTPUT_LEN = 6, 16, 8


def run_bench(server: ServerProcess, model_dir: Path, out: Path, *extra: str) -> dict[str, Any]:
    argv = ["bench", "serve", "--base-url", server.base_url, "--model", server.model_name, "--api-key", "key-short",
            "--tokenizer", str(model_dir), "--num-prompts", str(NUM_PROMPTS), "--input-len", str(INPUT_LEN),
            "--output-len", str(OUTPUT_LEN), "--no-progress", "--result-json", str(out), *extra]
    assert main(argv) == 0
    return json.loads(out.read_text())


def test_serve_reports_vllm_keys_and_consistent_counts(bench_server: ServerProcess, bench_model_dir: Path,
                                                       tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = run_bench(bench_server, bench_model_dir, tmp_path / "c3.json", "--concurrency", "3", "--label", "kvseal")
    assert "Serving Benchmark Result" in capsys.readouterr().out
    assert all(key in result for key in VLLM_KEYS), [k for k in VLLM_KEYS if k not in result]
    assert result["completed"] == NUM_PROMPTS and result["failed"] == 0 and result["errors"] == []
    assert result["total_input_tokens"] == NUM_PROMPTS * INPUT_LEN
    assert result["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN
    assert result["output_lens"] == [OUTPUT_LEN] * NUM_PROMPTS and result["input_lens"] == [INPUT_LEN] * NUM_PROMPTS
    assert result["max_concurrency"] == 3 and result["label"] == "kvseal"
    # one chunk per token on kvseal: output_len - 1 gaps per request
    assert [len(gaps) for gaps in result["itls"]] == [OUTPUT_LEN - 1] * NUM_PROMPTS
    assert result["output_throughput"] == pytest.approx(result["total_output_tokens"] / result["duration"])
    assert 0 < result["mean_ttft_ms"] <= result["mean_e2el_ms"]


def test_server_memory_and_kv_pool_match_plan(bench_server: ServerProcess, bench_model_dir: Path, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_server.proc is not None
    result = run_bench(bench_server, bench_model_dir, tmp_path / "mem.json", "--concurrency", "2",
                       "--server-pid", str(bench_server.proc.pid), "--admin-key", "key-ops")
    assert result["peak_rss_bytes"] > 0 and result["server_pid"] == bench_server.proc.pid
    # Sampled every 0.5 s: a fast run may see the pool idle at every sample, so only the range
    # is certain; a None would mean /metrics was not read (the admin key path).
    assert result["peak_kv_pages_used"] is not None and 0 <= result["peak_kv_pages_used"] <= result["kv_pages_total"]
    capsys.readouterr()
    flags = dict(zip(ENGINE_FLAGS[::2], ENGINE_FLAGS[1::2]))
    assert main(["plan", "--model", str(bench_model_dir), "--dtype", flags["--dtype"], "--kv-cache-tokens",
                 flags["--kv-cache-tokens"], "--page-size", flags["--page-size"], "--max-model-len",
                 flags["--max-model-len"]]) == 0
    planned = re.search(r"^pool\s+([\d,]+) pages", capsys.readouterr().out, re.MULTILINE)
    assert planned, "kvseal plan prints the pool size"
    assert result["kv_pages_total"] == int(planned.group(1).replace(",", ""))


def test_request_rate_mode(bench_server: ServerProcess, bench_model_dir: Path, tmp_path: Path) -> None:
    result = run_bench(bench_server, bench_model_dir, tmp_path / "rate.json", "--request-rate", "50", "--seed", "3")
    assert result["completed"] == NUM_PROMPTS and result["request_rate"] == 50.0
    assert result["max_concurrency"] is None


def test_fairness_mode_reports_both_tenants(bench_server: ServerProcess, bench_model_dir: Path, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    result = run_bench(bench_server, bench_model_dir, tmp_path / "fair.json", "--concurrency", "2", "--fairness",
                       "--long-api-key", "key-long", "--long-input-len", "256", "--long-output-len", "4",
                       "--long-concurrency", "1", "--long-max-requests", "3")
    assert result["mode"] == "fairness"
    assert result["short_alone"]["completed"] == NUM_PROMPTS and result["completed"] == NUM_PROMPTS
    assert result["p99_ttft_ratio"] == pytest.approx(
        result["short_with_long_p99_ttft_ms"] / result["short_alone_p99_ttft_ms"])
    long = result["long_tenant"]
    assert 1 <= long["completed"] <= 3 and long["failed"] == 0
    assert long["total_input_tokens"] == 256 * long["completed"]
    assert long["total_output_tokens"] == 4 * long["completed"]
    assert "ratio" in capsys.readouterr().out


def test_bad_api_key_fails_with_clear_error(bench_server: ServerProcess, bench_model_dir: Path, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "serve", "--base-url", bench_server.base_url, "--model", bench_server.model_name,
            "--api-key", "not-a-key", "--tokenizer", str(bench_model_dir), "--num-prompts", "2", "--input-len", "4",
            "--output-len", "2", "--no-progress"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "test request" in err and "HTTP 401" in err


def test_long_tenant_options_need_fairness_mode(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "serve", "--base-url", "http://127.0.0.1:9/v1", "--model", "m", "--long-input-len", "64"]
    assert main(argv) == 2
    assert "--long-input-len only applies to the fairness mode" in capsys.readouterr().err


def test_plot_writes_png(bench_server: ServerProcess, bench_model_dir: Path, tmp_path: Path) -> None:
    paths = []
    for c in (1, 2):
        out = tmp_path / f"c{c}.json"
        run_bench(bench_server, bench_model_dir, out, "--concurrency", str(c), "--label", "kvseal")
        paths.append(str(out))
    png = tmp_path / "plot.png"
    assert main(["bench", "plot", *paths, "-o", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
