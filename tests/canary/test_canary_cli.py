"""`kvseal canary` refuses bad usage with exit 2 before it sends a request."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvseal.cli import main


@pytest.mark.parametrize("report", ["", "no-folder/report.json"])
def test_a_report_path_that_cannot_be_written_is_refused_before_the_run(tmp_path: Path, report: str,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps(["k1", "k2"]))
    path = tmp_path / report
    assert main(["canary", "--base-url", "http://127.0.0.1:9", "--keys", str(keys), "--report", str(path)]) == 2
    assert f"--report {path}" in capsys.readouterr().err
