#!/usr/bin/env bash
# Start `kvseal serve` on 127.0.0.1 in the foreground (the driver backgrounds it).
#
# Usage: bench/peers/start_kvseal.sh MODEL_DIR PORT
# Env:   SERVED_NAME (default smollm2), KV_MEMORY (default 2GiB), DTYPE (default bfloat16),
#        MAX_MODEL_LEN (default 2048), PAGE_SIZE (default 16), KVSEAL (default: kvseal),
#        EXTRA_ARGS (more `kvseal serve` flags, e.g. "--api-keys keys.json")
# The same KV_MEMORY / DTYPE / MAX_MODEL_LEN / PAGE_SIZE go to `kvseal plan` in the driver, so
# the pool the server reports can be checked against the plan.
set -euo pipefail
MODEL_DIR="$1"; PORT="$2"
exec ${KVSEAL:-kvseal} serve --model "$MODEL_DIR" --served-model-name "${SERVED_NAME:-smollm2}" \
  --host 127.0.0.1 --port "$PORT" --dtype "${DTYPE:-bfloat16}" --kv-cache-memory "${KV_MEMORY:-2GiB}" \
  --max-model-len "${MAX_MODEL_LEN:-2048}" --page-size "${PAGE_SIZE:-16}" ${EXTRA_ARGS:-}
