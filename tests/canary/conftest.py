"""Fixtures for the canary tests: the hand-built copy model, keys files, running `kvseal canary`."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from copy_model import make_copy_model  # noqa: E402

from kvseal.cli import main  # noqa: E402


@pytest.fixture(scope="session")
def copy_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_copy_model(tmp_path_factory.mktemp("models") / "copy-model")


def write_keys(folder: Path, keys: list[str]) -> Path:
    path = folder / "canary-keys.json"
    path.write_text(json.dumps(keys))
    return path


@pytest.fixture
def run_canary(tmp_path: Path) -> Callable[..., tuple[int, dict[str, Any]]]:
    """Run `kvseal canary` in-process with these flags; return (exit status, JSON report)."""
    def run(base_url: str, keys: list[str], *flags: str) -> tuple[int, dict[str, Any]]:
        report_path = tmp_path / "report.json"
        argv = ["canary", "--base-url", base_url, "--keys", str(write_keys(tmp_path, keys)),
                "--report", str(report_path), "--no-progress", *flags]
        status = main(argv)
        return status, json.loads(report_path.read_text())

    return run
