#!/usr/bin/env bash
# kvseal on one GPU, end to end, in under 8 minutes (the deadlines below add up to 480 s): install the wheels brought along, the
# gpu-marked tests, greedy parity against transformers, throughput against transformers with the
# decode roofline, and an isolation canary against `serve` and `serve --pd` (tcp-stream).
# Everything lands in $OUT (default ./out-gpu). See bench/gpu/README.md.
#
#   bash bench/gpu/run.sh            # on the GPU machine
#   bash bench/gpu/run.sh --dry-run  # anywhere: tiny sizes on the CPU, to check the plumbing
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
export OUT=${OUT:-$ROOT/out-gpu}
mkdir -p "$OUT"
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
DRY=""
DEVICE=cuda
if [ "${1:-}" = "--dry-run" ]; then DRY="--dry-run"; DEVICE=cpu; fi
LOG=$OUT/run.log
: >"$LOG"
status=0

step() {  # step NAME SECONDS COMMAND...: run with a deadline, log it, remember a failure
    local name=$1 limit=$2; shift 2
    echo "=== $name ($(date -u +%T), limit ${limit}s): $*" | tee -a "$LOG"
    local start=$SECONDS
    timeout --kill-after=10 "$limit" "$@" >>"$LOG" 2>&1
    local rc=$?
    echo "=== $name: exit $rc after $((SECONDS - start)) s" | tee -a "$LOG"
    [ $rc -eq 0 ] || status=1
}

# 1. the wheels of kvseal's runtime dependencies this machine lacks (no index is reachable)
WHEELS=$ROOT/bench/gpu/wheels
if [ -z "$DRY" ] && [ -d "$WHEELS" ]; then
    missing=$(python bench/gpu/missing.py)
    echo "missing here: ${missing:-none}" | tee -a "$LOG"
    if [ -n "$missing" ]; then
        step install 45 python -m pip install --no-index --find-links "$WHEELS" $missing
    fi
fi
step environment 20 python -c "import json, sys; sys.path.insert(0, 'bench/gpu'); import common; print(json.dumps(common.environment()))"

# 2. the gpu-marked tests (the compiled Triton kernels: no interpreter)
GPU_TESTS="tests/engine/test_device.py tests/kvcache/test_device_checks.py tests/disagg/test_stream_staging.py tests/test_gpu_memory_plan.py tests/parallel/test_tp_cuda.py"
step gpu-tests 100 env TRITON_INTERPRET=0 python -m pytest -q -p no:cacheprovider -m gpu -rA \
    --junitxml="$OUT/gpu-tests.xml" $GPU_TESTS

# 3. greedy parity with transformers; 4. throughput and the roofline; 5. the canary
step parity 60 python bench/gpu/parity.py --device $DEVICE $DRY
step throughput 140 python bench/gpu/throughput.py --device $DEVICE $DRY
step canary 100 python bench/gpu/canary.py --device $DEVICE ${DRY:+--requests 16}
step summary 15 python bench/gpu/summary.py
echo "run.sh: $([ $status -eq 0 ] && echo every step passed || echo a step failed: see $LOG)" | tee -a "$LOG"
exit $status
