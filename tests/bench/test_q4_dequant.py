"""bench/q4_dequant.c builds without a warning and its kernel's dequantized weights are the
reference's bit for bit (the program checks them before it times anything, and exits 1 if not)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

SOURCE = Path(__file__).resolve().parents[2] / "bench" / "q4_dequant.c"


def _has_avx512_bf16() -> bool:
    return " avx512_bf16" in Path("/proc/cpuinfo").read_text()


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
@pytest.mark.skipif(not _has_avx512_bf16(), reason="the kernel needs AVX512-BF16")
def test_the_q4_kernel_dequantizes_exactly_and_reports_its_time(tmp_path: Path) -> None:
    binary = tmp_path / "q4_dequant"
    subprocess.run(["cc", "-O3", "-march=native", "-fopenmp", "-Wall", "-Wextra", "-Werror", str(SOURCE), "-o",
                    str(binary)], check=True, capture_output=True, timeout=120)
    done = subprocess.run([str(binary), "1", "8"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    results = [json.loads(line) for line in done.stdout.splitlines()]
    assert [r["rows"] for r in results] == [1, 8]
    assert all(r["stack_ms"] > 0 and r["weight_mb"] > 80 for r in results)
    assert subprocess.run([str(binary), "7"], capture_output=True, timeout=60).returncode == 2  # rows it cannot run
