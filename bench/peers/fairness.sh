#!/usr/bin/env bash
# Tenant fairness on kvseal: the short tenant's p99 TTFT alone vs while another tenant sends
# long prompts (`kvseal bench serve --fairness`).
#
# Usage: bench/peers/fairness.sh OUT_DIR
# Env:   SERVER (default kvseal; vllm-best/vllm-default also work, with no tenant separation),
#        LONG_INPUT_LEN (default 4096), LONG_CONCURRENCY (default 2), LONG_OUTPUT_LEN (default 16),
#        NUM_PROMPTS (default 64), CONCURRENCY (short tenant, default 4), INPUT_LEN / OUTPUT_LEN
#        (short tenant, default 256 / 32), PORT (default 18200), KV_MEMORY (default 2GiB),
#        DTYPE (default bfloat16), MAX_MODEL_LEN (default 8192), PAGE_SIZE (default 16)
# Writes OUT_DIR/fairness-<server>.json and OUT_DIR/fairness-<server>.log.
set -euo pipefail
source "$(dirname "$0")/lib.sh"

OUT="$(mkdir -p "$1" && cd "$1" && pwd)"
SERVER="${SERVER:-kvseal}"
PORT="${PORT:-18200}"
export KV_MEMORY="${KV_MEMORY:-2GiB}" DTYPE="${DTYPE:-bfloat16}" MAX_MODEL_LEN="${MAX_MODEL_LEN:-8192}"
export PAGE_SIZE="${PAGE_SIZE:-16}" SERVED_NAME=smollm2
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-${KV_MEMORY%GiB}}"

MODEL_DIR="$OUT/model"
[[ -f "$MODEL_DIR/config.json" ]] || python "$PEERS_DIR/export_model.py" "$MODEL_DIR" --dtype "$DTYPE"

if [[ "$SERVER" == kvseal ]]; then
  # two tenants, one key each; start_kvseal.sh passes EXTRA_ARGS on to `kvseal serve`
  echo '{"key-short": {"tenant": "short"}, "key-long": {"tenant": "long"},
        "key-ops": {"tenant": "ops", "admin": true}}' >"$OUT/keys.json"
  export EXTRA_ARGS="--api-keys $OUT/keys.json"
fi

pid=$(start_server "$SERVER" "$MODEL_DIR" "$PORT" "$OUT/fairness-$SERVER.log")
trap 'stop_server '"$pid" EXIT
wait_ready "$pid" "$PORT"
kvseal bench serve --base-url "http://127.0.0.1:$PORT/v1" --model smollm2 --tokenizer "$MODEL_DIR" \
  --api-key key-short --fairness --long-api-key key-long \
  --long-input-len "${LONG_INPUT_LEN:-4096}" --long-output-len "${LONG_OUTPUT_LEN:-16}" \
  --long-concurrency "${LONG_CONCURRENCY:-2}" --num-prompts "${NUM_PROMPTS:-64}" \
  --concurrency "${CONCURRENCY:-4}" --input-len "${INPUT_LEN:-256}" --output-len "${OUTPUT_LEN:-32}" \
  --server-pid "$pid" --admin-key key-ops --label "$SERVER" --result-json "$OUT/fairness-$SERVER.json"
