#!/usr/bin/env bash
# Re-resolves constraints.txt, the lock that the README's set-up commands and CI install with
# (`pip install -c constraints.txt ...`), from pyproject.toml and today's releases.
#
#   bash tools/refresh_lock.sh [TORCH_WHEELS_DIR]     # default /opt/wheels
#
# torch 2.13.0 is a CPU build that is not on PyPI: it is read from TORCH_WHEELS_DIR, so the
# resolver sees the CPU wheel's dependencies (a resolver run against PyPI alone would pull the
# CUDA build's). After a refresh, run the README's test command; commit the lock only if it passes.
set -euo pipefail
cd "$(dirname "$0")/.."
torch_wheels=${1:-/opt/wheels}
command -v uv >/dev/null || pip install 'uv==0.13.9'
{
  cat <<'HEADER'
# kvseal's lock: every package of `pip install -e '.[test,bench]'` at the version CI last passed with.
# The README's commands install with `-c constraints.txt`; pyproject.toml keeps the compatible ranges
# for installs as a library. tests/test_lock.py fails when this file and pyproject.toml disagree.
# Refresh (one command): bash tools/refresh_lock.sh
# Known incompatibility: pytest 9.2.0 removed Item._nodeid, which schemathesis 4.32.5's pytest
# plugin reads (tests/server/test_schema_fuzz.py fails); pyproject bounds pytest <9.2, hence 9.1.1.
HEADER
  uv pip compile pyproject.toml --all-extras --find-links "$torch_wheels" \
    --python-version 3.11 --python-platform x86_64-manylinux_2_28 \
    --custom-compile-command "bash tools/refresh_lock.sh" --quiet --no-header
} > constraints.txt.new
mv constraints.txt.new constraints.txt
echo "constraints.txt: $(grep -c '==' constraints.txt) pinned packages"
