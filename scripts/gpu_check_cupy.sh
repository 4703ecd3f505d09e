#!/usr/bin/env bash
# GPU check of the CuPy backend: kernel cache warm-up, the GPU test suite, a short benchmark.
#
#   scripts/gpu_check_cupy.sh       # logs and JSON under $OUT/cupy when $OUT is set, else
#                                   # ./gpu_check_out/cupy; exit status 0 only if all passed
#
# Steps, each under its own timeout (3.5 minutes at most in all):
#   1. compile every kernel variant for this GPU in parallel processes (CuPy disk cache)
#   2. tests/test_cupy_gpu.py: parity with the float64 reference, determinism, graph capture
#   3. scripts/bench.py --quick (parity-gated; flex_attention and numba only in the full run)
# Without a usable GPU it says so and exits 0.
set -u

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT_DIR="${OUT:-$ROOT/gpu_check_out}/cupy"
mkdir -p "$OUT_DIR"
cd "$ROOT" || exit 1
export PYTHONUNBUFFERED=1
export CUPY_CACHE_DIR="${CUPY_CACHE_DIR:-${TMPDIR:-/tmp}/varlen_cupy_cache}"
PY="${PYTHON:-python}"

if ! "$PY" -c "import cupy, sys; sys.exit(0 if cupy.cuda.runtime.getDeviceCount() > 0 else 1)" \
        >/dev/null 2>&1; then
    echo "gpu_check_cupy: no usable CUDA GPU; nothing to run"
    exit 0
fi

STATUS=0
STEPS=()
run_step() {  # name timeout_s command...
    local name="$1" limit="$2" t0 rc
    shift 2
    t0=$(date +%s)
    echo "== cupy/$name (limit ${limit}s): $*"
    timeout --kill-after=10 "$limit" "$@" >"$OUT_DIR/$name.log" 2>&1
    rc=$?
    STEPS+=("{\"step\": \"$name\", \"rc\": $rc, \"seconds\": $(( $(date +%s) - t0 ))}")
    tail -n 3 "$OUT_DIR/$name.log"
    echo "== cupy/$name: rc=$rc"
    [ "$rc" -eq 0 ] || STATUS=1
}

run_step warm_cache 60 "$PY" -m varlen.backends._cupy_kernels 12
run_step tests 90 "$PY" -m pytest -q -rfEs tests/test_cupy_gpu.py \
    --junitxml="$OUT_DIR/tests.xml"
run_step bench 60 "$PY" scripts/bench.py --quick --tokens 8192 --iters 3 \
    --runners cupy,sdpa-flash,sdpa-cudnn,varlen --json "$OUT_DIR/bench.json"

joined=$(IFS=,; echo "${STEPS[*]}")
printf '{"steps": [%s]}\n' "$joined" >"$OUT_DIR/summary.json"
cat "$OUT_DIR/summary.json"
exit "$STATUS"
