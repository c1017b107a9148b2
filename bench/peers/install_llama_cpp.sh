#!/usr/bin/env bash
# Install llama-cpp-python (built from source for this CPU) in its own virtual environment.
#
# Usage: bench/peers/install_llama_cpp.sh [VENV_DIR]     (default: ~/.venvs/llama-cpp)
# Env:   LLAMA_CPP_VERSION (default: newest), PYTHON (default python3)
# Needs a C/C++ compiler and cmake (pip builds the wheel; a few minutes on 2 cores).
set -euo pipefail
VENV="${1:-$HOME/.venvs/llama-cpp}"
PY="${PYTHON:-python3}"
SPEC="llama-cpp-python${LLAMA_CPP_VERSION:+==$LLAMA_CPP_VERSION}"
if [[ ! -x "$VENV/bin/python" ]]; then "$PY" -m venv "$VENV"; fi
"$VENV/bin/python" -m pip install --upgrade pip
CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=ON}" "$VENV/bin/python" -m pip install "$SPEC"
"$VENV/bin/python" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__)"
