#!/usr/bin/env bash
# Every check CI runs (.ci/run runs the README's test command, which ends with this script):
# style (ruff), types (mypy), the layering contracts (import-linter, [tool.importlinter] in
# pyproject.toml), then the tests, both tiers, with the 20 slowest listed.
#
#   bash tools/check.sh                        # everything, as CI
#   bash tools/check.sh -m "not integration"   # the same checks, the fast test tier only
set -euo pipefail
cd "$(dirname "$0")/.."
ruff check .
mypy kvseal
lint-imports
python -m pytest -q --durations=20 "$@"
