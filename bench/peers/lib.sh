# Shared helpers of the peers scripts (sourced). Servers run in their own process group
# (setsid), bind 127.0.0.1 only, and are stopped by that group's id; every wait is bounded.

PEERS_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
READY_TIMEOUT_S="${READY_TIMEOUT_S:-600}"

# start_server NAME MODEL_DIR PORT LOG -> prints the server's pid (also its process group id)
start_server() {
  local name="$1" model_dir="$2" port="$3" log="$4"
  case "$name" in
    kvseal) setsid "$PEERS_DIR/start_kvseal.sh" "$model_dir" "$port" >"$log" 2>&1 & ;;
    # float32 model, linear weights stored in bf16 (float32 arithmetic): export the model with DTYPE=float32
    kvseal-bf16w) EXTRA_ARGS="--quantization bf16 ${EXTRA_ARGS:-}" DTYPE=float32 \
                    setsid "$PEERS_DIR/start_kvseal.sh" "$model_dir" "$port" >"$log" 2>&1 & ;;
    # the default model's GGUF itself (MODEL_DIR is its bfloat16 export, the same numbers): the
    # engine also holds its Q4_1 blocks for one-row steps where the host runs them (AVX512-BF16)
    kvseal-gguf) setsid "$PEERS_DIR/start_kvseal.sh" "$(default_gguf)" "$port" >"$log" 2>&1 & ;;
    vllm-best) setsid "$PEERS_DIR/start_vllm.sh" "$model_dir" "$port" best >"$log" 2>&1 & ;;
    vllm-bind) setsid "$PEERS_DIR/start_vllm.sh" "$model_dir" "$port" bind >"$log" 2>&1 & ;;
    vllm-default) setsid "$PEERS_DIR/start_vllm.sh" "$model_dir" "$port" default >"$log" 2>&1 & ;;
    *) echo "unknown server $name (kvseal, kvseal-bf16w, kvseal-gguf, vllm-best, vllm-bind, vllm-default)" >&2; return 2 ;;
  esac
  echo $!
}

# default_gguf -> the GGUF file `kvseal serve` serves when no model is named
default_gguf() {
  python -c "from kvseal.model_files import resolve_model_path; print(resolve_model_path(None))"
}

# wait_ready PID PORT: poll /health until 200; fail if the server exits or READY_TIMEOUT_S passes
wait_ready() {
  local pid="$1" port="$2" start=$SECONDS
  while (( SECONDS - start < READY_TIMEOUT_S )); do
    if ! kill -0 "$pid" 2>/dev/null; then echo "server $pid exited during start-up" >&2; return 1; fi
    if curl -sf -o /dev/null "http://127.0.0.1:$port/health"; then
      echo "ready after $(( SECONDS - start )) s"; return 0
    fi
    sleep 2
  done
  echo "server $pid not ready after $READY_TIMEOUT_S s" >&2; return 1
}

# stop_server PID: SIGTERM to its process group, SIGKILL after 60 s
stop_server() {
  local pid="$1" i
  kill -TERM -- "-$pid" 2>/dev/null || return 0
  for i in $(seq 60); do
    kill -0 "$pid" 2>/dev/null || return 0
    sleep 1
  done
  kill -KILL -- "-$pid" 2>/dev/null || true
}
