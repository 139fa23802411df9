#!/usr/bin/env bash
# One call on the GPU machine: carried wheels, build, GPU tests, benchmarks.
# Usage (from the repo root, on the device): bash benchmarks/gpu_session.sh [tests|bench|all]
# Logs go to $OUT (default /tmp/stpipe-out). Each stage has its own time limit so a hang
# in one cannot eat the whole call.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/stpipe-out}
mkdir -p "$OUT"
what=${1:-all}
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
{
    date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python3 -m pip install --no-build-isolation --no-deps -e . 2>&1 | tail -3
    python3 -m stpipe info
} > "$OUT/setup.log" 2>&1
cat "$OUT/setup.log"
if [ "$what" = tests ] || [ "$what" = all ]; then
    timeout "${TEST_LIMIT:-420}" python3 -m pytest -m gpu -q -rfEs -p no:cacheprovider \
        ${TESTS:-tests} 2>&1 | tee "$OUT/gpu-tests.log" | tail -40
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
    for b in ${BENCHES:-planner transfer train_skipgram prefetch compat_speedtorch}; do
        [ -f "benchmarks/$b.py" ] || continue
        echo "== benchmarks/$b.py ${BENCH_ARGS:-}" | tee -a "$OUT/bench.log"
        extra=""
        [ "$b" != planner ] && extra="--out $OUT"
        [ "$b" = planner ] && extra="--json $OUT/planner.json"
        timeout "${BENCH_LIMIT:-300}" python3 "benchmarks/$b.py" $extra ${BENCH_ARGS:-} 2>&1 \
            | tee -a "$OUT/bench.log" | tail -60
    done
fi
