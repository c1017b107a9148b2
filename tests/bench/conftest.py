"""One tiny-model kvseal server with two tenants, shared by the bench smoke tests."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "server"))

from server_process import ServerProcess  # noqa: E402
from tiny_server_model import make_server_model  # noqa: E402

BENCH_KEYS = {"key-short": {"tenant": "short"}, "key-long": {"tenant": "long"},
              "key-ops": {"tenant": "ops", "admin": True}}


@pytest.fixture(scope="session")
def bench_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_server_model(tmp_path_factory.mktemp("bench-models") / "tiny-llama")


@pytest.fixture(scope="session")
def bench_server(bench_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = ServerProcess(bench_model_dir, tmp_path_factory.mktemp("bench-server"), keys=BENCH_KEYS)
    proc.start()
    yield proc
    proc.terminate()
