from __future__ import annotations

import contextlib
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

# The Triton kernels (the CUDA backend's) run in the tests on CPU tensors under Triton's
# interpreter. Triton reads TRITON_INTERPRET once, when triton.language is first imported (its
# own @jit helpers, tl.sum's combine function among them, are decorated then), and importing
# transformers' model classes imports triton: so the variable is set here, before any test module
# is collected. A GPU run that wants the compiled kernels sets TRITON_INTERPRET=0 itself.
os.environ.setdefault("TRITON_INTERPRET", "1")
# OpenMP threads (torch's and the native kernels', two per process: `torch.set_num_threads(2)`
# below, `--threads` in the engines) wait for each other passively, as on a host whose cores are
# all taken. The suite runs two workers on two cores, each with engines, ranks and servers of its
# own: a thread spinning at a barrier (OpenMP's default, right for a host that is the engine's
# alone) holds the core the thread it waits for needs, and a decode step of the default model
# took ~1 s instead of ~25 ms. Read by libgomp when it loads (with torch, below, and in every
# process the tests start, which inherit it); it changes no result, only how threads wait.
os.environ.setdefault("OMP_WAIT_POLICY", "passive")

import pytest  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import CONFIGS, make_tiny_model  # noqa: E402

torch.set_num_threads(2)

# Two tiers. The integration tier (`-m integration`) is every test that starts processes of its
# own (servers, engines, PD clusters, grammar workers, compilers, `python -c` probes) or loads the
# default model; the fast tier (`-m "not integration"`, what a contributor runs while working) is
# the rest: in-process, on tiny models. A test is in the integration tier by a fixture that starts
# a process, by its module, by name, or by the `slow` and `sanitizers` markers.
PROCESS_FIXTURES = frozenset({"server", "char_server", "bench_server", "pd_cluster", "pd_tp_cluster"})
PROCESS_MODULES = frozenset({
    "auditlog/test_usage_server.py", "bench/test_bench_serve.py", "bench/test_gpu_bench.py",
    "bench/test_q4_dequant.py", "bench/test_quant_decode_peers.py", "canary/test_kvseal_canary.py",
    "disagg/test_engine_auth_processes.py", "disagg/test_pd_audit.py", "disagg/test_pd_cli.py",
    "disagg/test_pd_incident.py", "disagg/test_pd_kill.py", "disagg/test_pd_structured.py",
    "disagg/test_pd_supervised.py", "disagg/test_pd_tp.py",
    "engine/test_grammar_pool.py", "engine/test_structured.py",
    "ops/test_csrc.py", "ops/test_native_modes.py", "ops/test_packaging.py", "ops/test_sanitizers.py",
    "parallel/test_rank_auth.py", "parallel/test_tensor_parallel.py", "parallel/test_tp_cuda.py",
    "parallel/test_tp_nodes.py",
    "parallel/test_tp_serve.py",
    "server/test_audit_log.py", "server/test_audit_outage.py", "server/test_default_model.py",
    "server/test_door_bounds.py", "server/test_engine_restart.py", "server/test_engine_threads.py",
    "server/test_frontend_guards.py",
    "server/test_grammar_budget.py", "server/test_isolation_events.py", "server/test_lifecycle.py",
    "server/test_parity_structured.py", "server/test_parity_tokenize.py",
    "server/test_prefix_cache_api.py", "server/test_quantization.py", "server/test_tenancy.py",
    "server/test_vllm_request_metrics.py",
    "test_layering.py",
})
PROCESS_TESTS = frozenset({  # in otherwise in-process modules: these start grammar workers or probes
    "disagg/test_handoff_faults.py::test_an_uncompilable_grammar_is_refused_by_decode_before_it_reserves",
    "models/test_loader.py::test_reading_a_config_leaves_transformers_model_loading_unimported",  # a `python -c` probe
})
TESTS_DIR = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    no_cuda = pytest.mark.skip(reason="needs a CUDA device; torch sees none here (bench/gpu/run.sh runs these)")
    for item in items:
        if item.get_closest_marker("gpu") and not torch.cuda.is_available():
            item.add_marker(no_cuda)
        path = item.path.relative_to(TESTS_DIR).as_posix()
        if (PROCESS_FIXTURES & set(getattr(item, "fixturenames", ())) or path in PROCESS_MODULES
                or f"{path}::{item.name.split('[')[0]}" in PROCESS_TESTS
                or item.get_closest_marker("slow") or item.get_closest_marker("sanitizers")):
            item.add_marker(pytest.mark.integration)


LEFT_PROCESS_GRACE_S = 20.0  # an orphaned engine notices its frontend is gone within a second or two


@pytest.fixture(scope="session", autouse=True)
def nothing_left_behind(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The session's temporary folder is TMPDIR for every process the tests start. When the last
    test is done, no process started with it may still run (a server, engine, rank or grammar
    worker a test did not stop, or one that outlived its parent), and no engine socket folder
    (`kvseal-*`) or rank group store (`kvseal-tp-*`) may be left in it, whichever way its server,
    engine or ranks were stopped, SIGKILL included."""
    scratch = tmp_path_factory.mktemp("tmpdir")
    os.environ["TMPDIR"] = str(scratch)
    tempfile.tempdir = None  # this process's next mkdtemp reads TMPDIR again
    yield scratch
    deadline = time.monotonic() + LEFT_PROCESS_GRACE_S
    while (running := _started_with_tmpdir(scratch)) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in running:  # stopped by PID, so that they do not outlive the session either
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    left = sorted(path.name for path in scratch.glob("kvseal-*"))
    assert not running and not left, (f"processes the tests left running: {running}; folders the servers, "
                                      f"engines or ranks left behind in {scratch}: {left}")


def _started_with_tmpdir(scratch: Path) -> dict[int, str]:
    """Live processes (not zombies) whose environment has TMPDIR=scratch: pid -> command line. Not
    this one, nor its own multiprocessing resource tracker (started by the in-process tests that
    spawn engines; it exits with this process, as it does under any program that spawns)."""
    wanted = b"TMPDIR=" + bytes(scratch)
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            if wanted not in (proc / "environ").read_bytes().split(b"\0"):
                continue
            state, parent = (proc / "stat").read_text().rsplit(")", 1)[1].split()[:2]
            command = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            if state == "Z" or (int(parent) == os.getpid() and "multiprocessing.resource_tracker" in command):
                continue
            found[int(proc.name)] = command[:200]
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-models")
    return {arch: make_tiny_model(arch, root / arch) for arch in CONFIGS}


@pytest.fixture(scope="session")
def llama_dir(tiny_model_dirs: dict[str, Path]) -> Path:
    return tiny_model_dirs["llama"]


@pytest.fixture
def make_llm(llama_dir: Path) -> Callable[..., Any]:
    """An offline LLM over the tiny Llama with small pages, so edge cases are hit."""
    from kvseal import LLM

    def make(**kwargs: Any) -> Any:
        defaults: dict[str, Any] = dict(kv_cache_tokens=512, page_size=4, max_num_batched_tokens=32, dtype="float32")
        defaults.update(kwargs)
        model = defaults.pop("model", str(llama_dir))
        return LLM(model, **defaults)

    return make
