#!/usr/bin/env bash
# Every check CI runs (.ci/run runs the README's test command, which ends with this script):
# style (ruff), types (mypy), the layering contracts (import-linter, [tool.importlinter] in
# pyproject.toml), then the tests, both tiers, with the 20 slowest listed. The tests run on two
# pytest-xdist workers, a whole module at a time each (module-scoped servers start once); `-n 0`
# after the script's name runs them in one process.
#
#   bash tools/check.sh                        # everything, as CI
#   bash tools/check.sh -m "not integration"   # the same checks, the fast test tier only
set -euo pipefail
cd "$(dirname "$0")/.."
ruff check .
mypy kvseal
lint-imports
python -m pytest -q -n 2 --dist loadfile --durations=20 "$@"
