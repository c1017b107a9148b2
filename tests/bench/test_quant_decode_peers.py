"""bench/quant.py's llama.cpp peer for single-stream decode: how it is chosen, and the
node-llama-cpp runner itself where bench/peers/install_llama_cpp_node.sh has installed it.

No timing is asserted: only that each runner reports what the benchmark reads.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH / "peers"))

import quant as quant_bench  # noqa: E402
from single_stream import LLAMA_CPP_NODE_RUNNER  # noqa: E402

NODE_DIR = Path(os.environ.get("KVSEAL_LLAMA_NODE_DIR", Path.home() / ".venvs" / "llamacpp-node"))


def _ns(**over: object) -> argparse.Namespace:
    base = {"llama": "auto", "llama_python": None, "llama_node_dir": "/nonexistent", "timeout_s": 60.0}
    return argparse.Namespace(**{**base, **over})


def test_llama_is_skipped_with_the_reason_when_no_runner_is_installed(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    if quant_bench.llama_python(None) is not None:
        pytest.skip("llama_cpp is importable here: auto picks it")
    assert quant_bench.llama_runner(_ns(llama="node", llama_node_dir=str(tmp_path))) is None
    out = capsys.readouterr().out
    assert "llama.cpp skipped" in out and str(tmp_path) in out and "install_llama_cpp_node.sh" in out


def test_none_skips_llama_cpp_silently(capsys: pytest.CaptureFixture[str]) -> None:
    assert quant_bench.llama_runner(_ns(llama="none", llama_node_dir=str(NODE_DIR))) is None
    assert capsys.readouterr().out == ""


def test_node_is_chosen_when_installed(tmp_path: Path) -> None:
    (tmp_path / "node_modules" / "node-llama-cpp").mkdir(parents=True)
    if quant_bench.llama_python(None) is not None:
        pytest.skip("llama_cpp is importable here: auto picks it")
    chosen = quant_bench.llama_runner(_ns(llama="auto", llama_node_dir=str(tmp_path)))
    assert chosen is not None and chosen[0] == f"node-llama-cpp ({tmp_path})"


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("node") is None or not (NODE_DIR / "node_modules" / "node-llama-cpp").is_dir(),
                    reason="node-llama-cpp not installed (bench/peers/install_llama_cpp_node.sh)")
def test_node_runner_decodes_the_default_gguf_greedily() -> None:
    gguf = quant_bench.default_gguf()
    args = {"gguf": gguf, "prompt": list(range(1000, 1016)), "prompt_len": 16, "output_len": 6, "threads": 1}
    done = subprocess.run(["node", str(LLAMA_CPP_NODE_RUNNER), str(NODE_DIR), json.dumps(args)], capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["prefill_s"] > 0 and result["decode_tok_s"] > 0 and result["threads"] == 1
    assert result["llama_cpp"].startswith("ggml-org/llama.cpp@") and "AVX" in result["system_info"]


def test_node_runner_refuses_missing_arguments() -> None:
    if shutil.which("node") is None:
        pytest.skip("no node")
    done = subprocess.run(["node", str(LLAMA_CPP_NODE_RUNNER)], capture_output=True, text=True, timeout=60,
                          check=False)
    assert done.returncode == 2 and "usage:" in done.stderr
