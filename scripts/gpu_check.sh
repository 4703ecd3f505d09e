#!/usr/bin/env bash
# GPU check of the CuPy backend, in under 8 minutes on one H100/H200, for a bare GPU machine
# with this repository checked out (no network needed). One screen of verdict at the end.
#
#   scripts/gpu_check.sh            # the CuPy check below; verdict.txt, summary.json,
#                                   # bench.json and logs.tar.gz (every step's log) under $OUT
#                                   # when set, else ./gpu_check_out
#   scripts/gpu_check.sh --cupy     # the same (scripts/gpu_check_cupy.sh)
#   scripts/gpu_check.sh --numba    # the Numba suite instead: tests/numba, the other `gpu`
#                                   # tests, scripts/bench_numba.py --quick
#   scripts/gpu_check.sh --sm90a    # the sm_90a kernels (H100/H200 only; docs/hopper.md):
#                                   # steps sm90_* below, bench_sm90a.json
#
# Steps, each under its own timeout (a hang costs that step, not the run; limits add up to
# 450 s):
#   install     an editable install of the checkout (no download), and any wheels found in
#               $WHEELS (default ./.whl: e.g. nvidia-cuda-sanitizer-api) into a private folder
#   warm_cache  every kernel variant compiled for this GPU in parallel (CuPy's disk cache)
#   sanitizer_{memcheck,racecheck,synccheck,initcheck}
#               compute-sanitizer on one small case that runs every kernel once
#               (tests/gpu/test_cupy_gpu.py::test_one_small_case_per_kernel)
#   gpu_tests   tests/gpu/test_cupy_gpu.py: parity, determinism, graphs, streams, a multi-wave grid,
#               rows past 2**31 elements, large magnitudes, the tensor-core and special-function
#               model of the host emulation against this GPU
#   bench       scripts/perf_model.py --measure: torch SDPA (flash, cuDNN), varlen_attn and
#               compiled flex_attention against this backend at 8k and 16k tokens per sequence
#               (bf16, D=128, 16 heads; parity-gated), with the measured bf16 matmul peak, each
#               figure beside the performance model's prediction (docs/cupy_backend.md)
# --sm90a (limits add up to 490 s; every step runs the implementation backend="cupy:sm90a"):
#   install      as above
#   sm90_device  compute capability 9.0 (else nothing more runs, and the check fails)
#   sm90_warm    every sm_90a variant the backend dispatches, built by NVRTC in parallel into
#                the cubin cache (python -m varlen.backends.cupy.sm90)
#   sm90_tests   tests/gpu/test_sm90_gpu.py: the emulated cases' batches through the cubins
#                and the driver's tensor maps
#   sm90_parity  tests/gpu/test_cupy_gpu.py's reference parity (GQA packing chosen as it falls),
#                deterministic repeatability, graph capture and the callers' stream
#   sm90_{memcheck,synccheck}
#                compute-sanitizer on tests/gpu/test_cupy_gpu.py::test_one_small_case_per_kernel
#   sm90_bench   scripts/perf_model.py --measure: the sm_90a kernels as the cupy runner against
#                torch SDPA, varlen_attn and compiled flex_attention (bf16, D=128, 8k and 16k)
# Passing it is what makes the sm_90a kernels the default on sm_90 (docs/hopper.md,
# "Dispatch").
# summary.json lists each step's exit status and duration; verdict.txt is the screen printed
# last. Exit status 0 only if every step passed. Without a usable GPU the script says so,
# writes summary.json with "gpu": false and exits 0.
set -u

MODE=cupy
case "${1:-}" in
    --cupy|"") ;;
    --numba) MODE=numba ;;
    --sm90a) MODE=sm90a ;;
    *) echo "usage: $0 [--cupy | --numba | --sm90a]" >&2; exit 2 ;;
esac

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT_DIR="${OUT:-$ROOT/gpu_check_out}"
LOGS="$(mktemp -d "${TMPDIR:-/tmp}/varlen_gpu_check.XXXXXX")"      # packed at the end
SITE="$LOGS/site"                                                 # carried wheels go here
mkdir -p "$OUT_DIR"
cd "$ROOT" || exit 1
export PYTHONUNBUFFERED=1
export CUPY_BACKEND="${CUPY_BACKEND:-cupy}"
export CUPY_CACHE_DIR="${CUPY_CACHE_DIR:-${TMPDIR:-/tmp}/varlen_cupy_cache}"
export CUPY_CACHE_IN_MEMORY=0       # the tests reuse the kernels warm_cache compiled
PY="${PYTHON:-python3}"
command -v "$PY" >/dev/null || PY=python
WHEELS="${WHEELS:-$ROOT/.whl}"
export PY WHEELS SITE
T0=$(date +%s)

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
    timeout --kill-after=10 "$limit" "$@" >"$LOGS/$name.log" 2>&1
    rc=$?
    [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && echo "TIMEOUT after ${limit}s" >>"$LOGS/$name.log"
    record "$name" "$rc" "$(( $(date +%s) - t0 ))"
    tail -n 3 "$LOGS/$name.log"
    echo "== $name: rc=$rc"
    return "$rc"
}

write_summary() {  # gpu(true|false)
    local joined
    joined=$(IFS=,; echo "${STEPS[*]:-}")
    printf '{"gpu": %s, "mode": "%s", "seconds": %s, "steps": [%s]}\n' "$1" "$MODE" \
        "$(( $(date +%s) - T0 ))" "$joined" >"$OUT_DIR/summary.json"
    tar czf "$OUT_DIR/logs.tar.gz" -C "$LOGS" --exclude=./site . 2>/dev/null
}


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
    echo "gpu_check: no usable CUDA GPU; nothing to run (the CPU suite covers the emulation)"
    write_summary false
    cat "$OUT_DIR/summary.json"
    exit 0
fi

# the machine's versions: only once there is a GPU (importing the frameworks takes 30-40 s)
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
} >"$LOGS/machine.txt" 2>&1

# ---- install: the checkout (varlen.comm and varlen.kernels_cuda are mapped into the package by
# setup.cfg, so a source tree needs an editable install) and carried wheels, all offline.
install_checkout() {
    if ! "$PY" -c "import varlen.comm, varlen.kernels_cuda" >/dev/null 2>&1; then
        "$PY" -m pip install -q --no-deps --no-build-isolation -e . || return 1
    fi
    if compgen -G "$WHEELS/*.whl" >/dev/null; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade \
            --target "$SITE" "$WHEELS"/*.whl || return 1
    fi
    "$PY" -c "import varlen.comm, varlen.kernels_cuda; print('varlen importable')"
}
export -f install_checkout
run_step install 30 bash -c install_checkout
[ -d "$SITE" ] && export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"

# compute-sanitizer: $COMPUTE_SANITIZER, the PATH, the CUDA toolkit, then the
# nvidia-cuda-sanitizer-api wheel (nvidia/cu13/compute-sanitizer/ or, for CUDA 12,
# nvidia/cuda_sanitizer_api/compute-sanitizer/ in site-packages or the carried wheels' folder).
find_sanitizer() {
    local c
    for c in "${COMPUTE_SANITIZER:-}" "$(command -v compute-sanitizer 2>/dev/null)" \
             "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer" \
             /usr/local/cuda/compute-sanitizer/compute-sanitizer; do
        [ -n "$c" ] && [ -x "$c" ] && { echo "$c"; return 0; }
    done
    "$PY" - "$SITE" <<'EOF'
import glob, os, site, sys
roots = [sys.argv[1], *site.getsitepackages(), site.getusersitepackages()]
for root in roots:
    for pattern in ("nvidia/*/compute-sanitizer/compute-sanitizer",
                    "nvidia/*/bin/compute-sanitizer"):
        for path in sorted(glob.glob(os.path.join(root, pattern))):
            if os.access(path, os.X_OK):
                print(path)
                sys.exit(0)
sys.exit(1)
EOF
}

sanitize() {  # tool: the small case under compute-sanitizer; it must run, not skip
              # ($CUPY_BACKEND names the implementation: cupy, or cupy:sm90a)
    local log rc
    log=$("$SANITIZER" --tool "$1" --error-exitcode 3 --print-limit 20 "$PY" -m pytest -q -x \
        --cupy-backend="$CUPY_BACKEND" "tests/gpu/test_cupy_gpu.py::test_one_small_case_per_kernel" 2>&1)
    rc=$?
    echo "compute-sanitizer: $SANITIZER"
    echo "$log"
    [ "$rc" -eq 0 ] || return "$rc"
    grep -q "1 passed" <<<"$log" || { echo "the case did not run"; return 4; }
}
export -f sanitize

sanitizer_steps() {  # prefix limit tool...: a step PREFIX_TOOL per tool, or one failed step
                     # `sanitizer` when compute-sanitizer is nowhere to be found
    local prefix="$1" limit="$2" tool
    shift 2
    SANITIZER="$(find_sanitizer)"
    if [ -z "$SANITIZER" ]; then
        echo "compute-sanitizer not found (PATH, CUDA_HOME, wheels)" >"$LOGS/sanitizer.log"
        record sanitizer 1 0
        return
    fi
    export SANITIZER
    for tool in "$@"; do
        run_step "${prefix}_$tool" "$limit" bash -c 'sanitize "$0"' "$tool"
    done
}

sm90_device() {  # compute capability 9.0, or the sm_90a kernels cannot run here
    "$PY" -c 'import cupy, sys
cc = cupy.cuda.Device().compute_capability
print("compute capability", cc, "(the sm_90a kernels need 90)")
sys.exit(cc != "90")'
}
export -f sm90_device

if [ "$MODE" = sm90a ] && ! run_step sm90_device 20 bash -c sm90_device; then
    echo "gpu_check --sm90a: not an sm_90 GPU; nothing else runs"
elif [ "$MODE" = sm90a ]; then
    export CUPY_BACKEND=cupy:sm90a
    export VARLEN_SM90A_CACHE="${VARLEN_SM90A_CACHE:-${TMPDIR:-/tmp}/varlen_sm90a_cache}"
    run_step sm90_warm 50 "$PY" -m varlen.backends.cupy.sm90 16
    run_step sm90_tests 120 "$PY" -m pytest -q -rfEs -m gpu tests/gpu/test_sm90_gpu.py \
        --junitxml="$LOGS/sm90_tests.xml"
    grep -q "[0-9] passed" "$LOGS/sm90_tests.log" || record sm90_tests_ran 5 0
    run_step sm90_parity 100 "$PY" -m pytest -q -rfEs --cupy-backend="$CUPY_BACKEND" tests/gpu/test_cupy_gpu.py \
        -k "matches_reference or deterministic or graph_capture or callers_stream" \
        --junitxml="$LOGS/sm90_parity.xml"
    grep -q "[0-9] passed" "$LOGS/sm90_parity.log" || record sm90_parity_ran 5 0
    sanitizer_steps sm90 40 memcheck synccheck
    run_step sm90_bench 90 "$PY" scripts/perf_model.py --measure --backend "$CUPY_BACKEND" \
        --json "$OUT_DIR/bench_sm90a.json"
    grep -q "^predicted vs measured" "$LOGS/sm90_bench.log" || record sm90_bench_ran 5 0
elif [ "$MODE" = numba ]; then
    # Limits add up to 260 s.
    run_step numba_tests 150 "$PY" -m pytest -q -rfEs tests/numba \
        --junitxml="$LOGS/numba_tests.xml"
    run_step gpu_tests 60 "$PY" -m pytest -q -rfEs -m gpu tests --ignore=tests/numba \
        --ignore=tests/gpu/test_cupy_gpu.py --junitxml="$LOGS/gpu_tests.xml"
    run_step bench_numba 50 "$PY" scripts/bench_numba.py --quick --json "$LOGS/bench_numba.json"
else
    run_step warm_cache 60 "$PY" -m varlen.backends.cupy.mma 16
    sanitizer_steps sanitizer 35 memcheck racecheck synccheck initcheck
    run_step gpu_tests 120 "$PY" -m pytest -q -rfEs -s tests/gpu/test_cupy_gpu.py \
        --junitxml="$LOGS/gpu_tests.xml"
    grep -q "[0-9] passed" "$LOGS/gpu_tests.log" || record gpu_tests_ran 5 0
    run_step bench 100 "$PY" scripts/perf_model.py --measure --json "$OUT_DIR/bench.json"
    grep -q "^predicted vs measured" "$LOGS/bench.log" || record bench_ran 5 0
fi

# ---- verdict: one screen
{
    echo "================ gpu_check verdict ($MODE, $(( $(date +%s) - T0 )) s) ================"
    grep -E "NVIDIA|Driver Version" "$LOGS/machine.txt" | head -n 2
    printf '%-22s %5s %6s  %s\n' step rc seconds "last line"
    for s in ${STEPS[@]+"${STEPS[@]}"}; do
        name=$(echo "$s" | sed 's/.*"step": "\([^"]*\)".*/\1/')
        rc=$(echo "$s" | sed 's/.*"rc": \([0-9]*\).*/\1/')
        secs=$(echo "$s" | sed 's/.*"seconds": \([0-9]*\).*/\1/')
        last=$(grep -v '^\s*$' "$LOGS/$name.log" 2>/dev/null | tail -n 1 | cut -c1-60)
        printf '%-22s %5s %6s  %s\n' "$name" "$rc" "$secs" "$last"
    done
    for b in bench sm90_bench; do
        [ -f "$LOGS/$b.log" ] && sed -n '/^predicted vs measured/,$p' "$LOGS/$b.log"
    done
    grep -ho "mma: .*\|ex2 max .*" "$LOGS/gpu_tests.log" 2>/dev/null
    failed=0
    for s in ${STEPS[@]+"${STEPS[@]}"}; do
        case "$s" in *'"rc": 0,'*) ;; *) failed=$((failed + 1)) ;; esac
    done
    if [ "$failed" -eq 0 ]; then echo "VERDICT: PASS"; else echo "VERDICT: FAIL ($failed step(s))"; fi
} | tee "$OUT_DIR/verdict.txt" "$LOGS/verdict.txt"
write_summary true
grep -q "^VERDICT: PASS" "$OUT_DIR/verdict.txt"
