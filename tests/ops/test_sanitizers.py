"""The kernel tests once more, on kernels built with AddressSanitizer and UndefinedBehaviorSanitizer
(`-fsanitize=address,undefined`, every UB finding fatal), in a subprocess that preloads the
compiler's libasan (Python itself is not instrumented) with leak detection off (Python and
torch keep memory to the end by design). Selected with `-m sanitizers`; skipped where the
compiler cannot build a sanitized shared object. First the harness is shown to fail: a kernel
called on a row longer than its tensor must be reported."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvseal.ops.native_build import SANITIZE, BuildConfig

pytestmark = pytest.mark.sanitizers

ROOT = Path(__file__).resolve().parents[2]
# the kernel-level tests (an engine builds its own, unsanitized, kernels), the decode loop on
# the tests' kernels in an engine, and the write records' kernels
KERNEL_TESTS = ["tests/ops/test_decode_attention.py", "tests/ops/test_prefill_attention.py",
                "tests/ops/test_layer_ops.py", "tests/ops/test_linears.py", "tests/ops/test_linear_q4.py",
                "tests/ops/test_linear_q8.py",
                "tests/ops/test_decode_loop.py::test_the_test_kernels_loop_equals_their_per_layer_ops",
                "tests/kvcache/test_record_kernels.py",
                "tests/engine/test_sampler.py::test_the_native_draw_agrees_with_torchs_and_reads_bfloat16_as_its_widening"]
PROBE = """
import sys
sys.path.insert(0, "tests")
import torch
from built_kernels import KERNELS, SANITIZED
assert SANITIZED and KERNELS is not None
x, out = torch.randn(4, 100), torch.empty(4, dtype=torch.int64)
KERNELS.lib.kvseal_argmax_rows(KERNELS.ptr(x), 4, 164, KERNELS.ptr(out), 1)  # the last row read past x
print("not reported")
"""


@pytest.fixture(scope="module")
def sanitized_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The environment of a process that loads the sanitized kernels; skips where there are none."""
    compiler = shutil.which(BuildConfig.from_environment().compiler)
    if compiler is None:
        pytest.skip("no C compiler")
    probe = tmp_path_factory.mktemp("sanitizers")
    (probe / "probe.c").write_text("int kvseal_probe(int x) { return x + 1; }\n")
    built = subprocess.run([compiler, *SANITIZE, "-shared", "-fPIC", "probe.c", "-o", "probe.so"], cwd=probe,
                           capture_output=True, text=True, timeout=120)
    libasan = subprocess.run([compiler, "-print-file-name=libasan.so"], capture_output=True, text=True,
                             timeout=60).stdout.strip()
    if built.returncode != 0 or not Path(libasan).is_absolute():
        pytest.skip(f"{compiler} builds no sanitized shared objects here: {built.stderr.strip()[-500:]}")
    return {**os.environ, "KVSEAL_TEST_SANITIZED_KERNELS": "1", "LD_PRELOAD": libasan,
            "ASAN_OPTIONS": "detect_leaks=0", "UBSAN_OPTIONS": "print_stacktrace=1",
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def test_a_read_past_a_tensor_is_reported(sanitized_env: dict[str, str]) -> None:
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=sanitized_env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode != 0 and "not reported" not in done.stdout
    # a read past x's 1,600 bytes: a 64-byte vector load that starts inside it is an "unknown-crash"
    # at the region's end, a narrower one a "heap-buffer-overflow"; either way ASan names the region
    assert "ERROR: AddressSanitizer" in done.stderr and "to the right of 1600-byte region" in done.stderr, \
        done.stderr[-3000:]


def test_the_kernel_tests_pass_under_asan_and_ubsan(sanitized_env: dict[str, str]) -> None:
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *KERNEL_TESTS],
                          cwd=ROOT, env=sanitized_env, capture_output=True, text=True, timeout=900)
    report = done.stdout[-4000:] + done.stderr[-4000:]
    assert done.returncode == 0, report
    assert "Sanitizer" not in done.stderr and " passed" in done.stdout, report
