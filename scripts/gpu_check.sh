#!/usr/bin/env bash
# GPU check: the GPU test suites and short benchmarks, in under 8 minutes.
#
#   scripts/gpu_check.sh            # every step; logs and JSON under $OUT when set, else
#                                   # ./gpu_check_out
#   scripts/gpu_check.sh --cupy     # steps 1 and 5 only (scripts/gpu_check_cupy.sh)
#
# Steps (each under its own timeout, so the whole run stays below 8 minutes):
#   1. machine header (nvidia-smi, library versions)            -> machine.txt
#   2. the Numba suite on the GPU (kernels at real sizes, graphs) -> numba_tests.{log,xml}
#   3. every other test marked `gpu`                             -> gpu_tests.{log,xml}
#   4. the Numba benchmark (parity-checked, CUDA events)         -> bench_numba.{log,json}
#   5. the CuPy backend, when CuPy sees the GPU: kernel cache warm-up in parallel processes,
#      tests/test_cupy_gpu.py (parity, determinism, graph capture), scripts/bench.py --quick
#      (parity-gated)                                            -> cupy/{warm_cache,tests,bench}.*
# summary.json lists each step's exit status and duration, and whether CuPy saw the GPU; the
# exit status is 0 only if every step passed. Without a usable GPU the script says so, writes
# summary.json with "gpu": false and exits 0.
# Later issues append their steps below; keep the total under the limit.
set -u

ONLY_CUPY=false
case "${1:-}" in
    --cupy) ONLY_CUPY=true ;;
    "") ;;
    *) echo "usage: $0 [--cupy]" >&2; exit 2 ;;
esac

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT_DIR="${OUT:-$ROOT/gpu_check_out}"
mkdir -p "$OUT_DIR/cupy"
cd "$ROOT" || exit 1
export PYTHONUNBUFFERED=1
export CUPY_CACHE_DIR="${CUPY_CACHE_DIR:-${TMPDIR:-/tmp}/varlen_cupy_cache}"
PY="${PYTHON:-python}"

STEPS=()
record() {  # name rc seconds
    STEPS+=("{\"step\": \"$1\", \"rc\": $2, \"seconds\": $3}")
}

run_step() {  # name timeout_s command...
    local name="$1" limit="$2"
    shift 2
    local t0 rc
    t0=$(date +%s)
    echo "== $name (limit ${limit}s): $*"
    timeout --kill-after=10 "$limit" "$@" >"$OUT_DIR/$name.log" 2>&1
    rc=$?
    record "$name" "$rc" "$(( $(date +%s) - t0 ))"
    tail -n 3 "$OUT_DIR/$name.log"
    echo "== $name: rc=$rc"
}

write_summary() {  # gpu(true|false) cupy(true|false)
    local joined
    joined=$(IFS=,; echo "${STEPS[*]:-}")
    printf '{"gpu": %s, "cupy": %s, "steps": [%s]}\n' "$1" "$2" "$joined" \
        >"$OUT_DIR/summary.json"
    cat "$OUT_DIR/summary.json"
}

{
    date -u
    command -v nvidia-smi >/dev/null && nvidia-smi || echo "nvidia-smi: not found"
    "$PY" - <<'EOF'
import importlib, platform
print("python", platform.python_version())
for m in ("numpy", "numba", "numba_cuda", "cupy", "torch", "jax", "ml_dtypes"):
    try:
        print(m, getattr(importlib.import_module(m), "__version__", "?"))
    except Exception as e:
        print(m, "unavailable:", type(e).__name__)
EOF
} >"$OUT_DIR/machine.txt" 2>&1

if ! "$PY" - <<'EOF'
import ctypes, sys
try:
    lib = ctypes.CDLL("libcuda.so.1")
except OSError:
    sys.exit(1)
n = ctypes.c_int(0)
ok = lib.cuInit(0) == 0 and lib.cuDeviceGetCount(ctypes.byref(n)) == 0 and n.value > 0
sys.exit(0 if ok else 1)
EOF
then
    echo "gpu_check: no usable CUDA GPU; nothing to run (the CPU suite covers the simulator)"
    write_summary false false
    exit 0
fi

# varlen.comm and varlen.kernels_cuda live at the top of the repository and are mapped into the
# package by setup.cfg: a source checkout needs an editable install (local, no download).
if ! "$PY" -c "import varlen.comm, varlen.kernels_cuda" >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-deps --no-build-isolation -e . >"$OUT_DIR/install.log" 2>&1 \
        || { echo "gpu_check: editable install failed (see install.log)"; exit 1; }
fi

# Limits add up to 470 s, inside the 8-minute budget.
if ! "$ONLY_CUPY"; then
    run_step numba_tests 150 "$PY" -m pytest -q -rfEs tests/numba \
        --junitxml="$OUT_DIR/numba_tests.xml"
    run_step gpu_tests 60 "$PY" -m pytest -q -rfEs -m gpu tests --ignore=tests/numba \
        --ignore=tests/test_cupy_gpu.py --junitxml="$OUT_DIR/gpu_tests.xml"
    run_step bench_numba 50 "$PY" scripts/bench_numba.py --quick --json "$OUT_DIR/bench_numba.json"
fi
CUPY=false
if "$PY" -c "import cupy, sys; sys.exit(0 if cupy.cuda.runtime.getDeviceCount() > 0 else 1)" \
        >/dev/null 2>&1; then
    CUPY=true
    run_step cupy/warm_cache 60 "$PY" -m varlen.backends._cupy_kernels 12
    run_step cupy/tests 90 "$PY" -m pytest -q -rfEs tests/test_cupy_gpu.py \
        --junitxml="$OUT_DIR/cupy/tests.xml"
    run_step cupy/bench 60 "$PY" scripts/bench.py --quick --tokens 8192 --iters 3 \
        --runners cupy,sdpa-flash,sdpa-cudnn,varlen --json "$OUT_DIR/cupy/bench.json"
else
    echo "gpu_check: CuPy sees no GPU (or is not installed); CuPy steps skipped"
fi

write_summary true "$CUPY"
for s in ${STEPS[@]+"${STEPS[@]}"}; do
    case "$s" in *'"rc": 0,'*) ;; *) exit 1 ;; esac
done
exit 0
