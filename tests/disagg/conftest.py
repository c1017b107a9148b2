"""Fixtures for the PD tests: the marker model, and one set of real PD processes (a prefill
engine with a small pool, a decode engine with a large one, a frontend) shared by the process
tests, which leave it healthy when they restart what they killed."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from transports import NIXL

sys.path.insert(0, str(Path(__file__).parent))

from marker_model import make_marker_model  # noqa: E402
from pd_servers import DECODE_FLAGS, KEYS, PREFILL_FLAGS, PdCluster, PdEngine, PdFrontend  # noqa: E402


@pytest.fixture(scope="session")
def marker_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_marker_model(tmp_path_factory.mktemp("models") / "marker")


@pytest.fixture(scope="session", params=["tcp-stream", NIXL])
def pd_cluster(marker_dir: Path, tmp_path_factory: pytest.TempPathFactory,
               request: pytest.FixtureRequest) -> Iterator[PdCluster]:
    """One cluster per KV transport: every process test runs over the default built-in transport
    (tcp-stream) and over NIXL (skipped, saying why, without the nixl extra; the README's test
    command installs it).
    The ZMQ-frame transport (tcp) runs the in-process handoff and fault tests (test_handoff*.py)."""
    kv_transport: str = request.param
    workdir = tmp_path_factory.mktemp(f"pd-cluster-{kv_transport}")
    transport = ["--kv-transport", kv_transport]
    prefill = PdEngine("prefill", marker_dir, workdir, [*PREFILL_FLAGS, *transport]).start()
    decode = PdEngine("decode", marker_dir, workdir, [*DECODE_FLAGS, *transport]).start()
    prefill.wait_ready()
    decode.wait_ready()
    frontend = PdFrontend([prefill], [decode], marker_dir, workdir, KEYS).start()
    cluster = PdCluster(marker_dir, workdir, prefill, decode, frontend, kv_transport)
    try:
        frontend.wait_healthy()
        yield cluster
    finally:
        cluster.frontend.terminate()
        cluster.prefill.terminate()
        cluster.decode.terminate()


@pytest.fixture(scope="session")
def pd_tp_cluster(marker_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PdCluster]:
    """The incident's cluster with -tp 2 on both engines (each its rank 0 and one worker rank),
    over the default transport: the incident replay under tensor parallelism."""
    workdir = tmp_path_factory.mktemp("pd-tp-cluster")
    flags = ["--kv-transport", "tcp-stream", "--tensor-parallel-size", "2", "--tp-timeout", "20"]
    prefill = PdEngine("prefill", marker_dir, workdir, [*PREFILL_FLAGS, *flags]).start()
    decode = PdEngine("decode", marker_dir, workdir, [*DECODE_FLAGS, *flags]).start()
    cluster = None
    try:
        prefill.wait_ready()
        decode.wait_ready()
        frontend = PdFrontend([prefill], [decode], marker_dir, workdir, KEYS).start()
        cluster = PdCluster(marker_dir, workdir, prefill, decode, frontend, "tcp-stream")
        frontend.wait_healthy()
        yield cluster
    finally:
        if cluster is not None:
            cluster.frontend.terminate()
        prefill.terminate()
        decode.terminate()
