#!/usr/bin/env bash
# GPU check of the CuPy backend that fits a short GPU window: at most 390 s of step limits
# (6.5 minutes) on one H100/H200, for a bare GPU machine with this repository checked out (no
# network needed). One screen of verdict at the end.
#
#   scripts/gpu_check.sh            # the mma.sync kernels (backend "cupy:mma")
#   scripts/gpu_check.sh --cupy     # the same (scripts/gpu_check_cupy.sh)
#   scripts/gpu_check.sh --sm90a    # the sm_90a kernels (H100/H200 only; docs/hopper.md), and
#                                   # the mma.sync kernels beside them for parity and timing
#   scripts/gpu_check.sh --numba    # the Numba suite instead: tests/numba, the other `gpu`
#                                   # tests, scripts/bench_numba.py --quick
#
# Output under $OUT when set, else ./gpu_check_out:
#   verdict.txt    the screen printed last: each step's status, seconds, limit and last line or
#                  reason, the timing table, the verdict
#   summary.json   {"gpu", "mode", "seconds", "limits_s", "finished", "hang", "verdict",
#                  "steps": [{"step", "status", "rc", "seconds", "limit", "gpu", "reason"}]},
#                  rewritten after every step, so a run cut short still leaves one
#   results.jsonl  one JSON line per probe answer and per measured figure, appended (and
#                  flushed) the moment it exists (scripts/gpu_probe.py, scripts/gpu_timing.py)
#   logs/          every step's log (STEP.log) and junit XML, written while the step runs, so
#                  a run cut short from outside still leaves them
# A step's status is pass, fail, timeout (killed at its limit), hang (a GPU step killed at its
# limit, or a test killed by the per-test timeout), skipped (with the reason: ncu cannot read
# counters, no compute-sanitizer, or an earlier hang) or not-run (an earlier step stopped the
# run). Exit status 0 only if no step failed, timed out or hung. Without a usable GPU the
# script says so, writes summary.json with "gpu": false and exits 0.
#
# Steps, in this order, each under its own limit (seconds; --sm90a / default):
#   probes        30/30  nvidia-smi, then scripts/gpu_probe.py: the versions (python, numpy,
#                        CuPy, torch, cuda-bindings, NVRTC, the driver), the compute capability
#                        (--sm90a: anything but 9.0 stops the run here), a torch bf16 tensor
#                        through DLPack into CuPy, and the driver's cuTensorMapEncodeTiled on a
#                        bf16 [T, H, 128] array through varlen's own encode (boxes (64, 1, 128)
#                        and (64, 4, 32))
#   install       20/20  an editable install of the checkout (no download), and any wheels in
#                        $WHEELS (default ./.whl) into a private folder
#   warm          55/60  scripts/gpu_warm.py: every module a later step launches, compiled in
#                        parallel processes before any timed GPU step (--sm90a: the sm_90a
#                        cubins, the mma.sync modules at D 64/128 and the default tiles, the
#                        backward's preprocessing/conversion modules at every sm_90a head dim, the plan
#                        kernels; default: every mma.sync module and the plan kernels; both: the
#                        primitives' harness cubin). A timeout here is not a hang: what it did
#                        not build compiles later
#   primitives    25/25  the `gpu` half of tests/emulation/test_sm90_primitives.py: the sm_90a
#                        primitives one at a time (wgmma, TMA boxes, mbarriers, named barriers,
#                        stmatrix, an attention tile, the warp-specialised pipeline), the test
#                        bodies and expectations the emulation tier runs; skipped (default mode)
#                        when the probed GPU is not sm_90; per-test timeout as below
#   kernel_tests  50/70  --sm90a: tests/gpu/test_sm90_gpu.py; default: tests/gpu/test_cupy_gpu.py
#                        but its parity cases and its aux-gradient case (a score_mod module of
#                        its own to compile); per-test timeout $GPU_CHECK_TEST_TIMEOUT (20 s,
#                        scripts/pytest_watchdog.py: it fires even inside a CUDA call)
#   parity_sm90a  40/-   tests/gpu/test_cupy_gpu.py reference parity (bf16 and fp16, D 64/128),
#                        determinism, graph capture, the caller's stream on cupy:sm90a
#   parity_mma    25/40  its reference parity (bf16 and fp16, D 64/128) on cupy:mma
#   timing        70/65  scripts/gpu_timing.py: the bf16 matmul peak, then sm90a (--sm90a only),
#                        mma, SDPA flash and SDPA cuDNN at 8k and 16k tokens per sequence,
#                        causal and full (bf16, D 128, 16 heads, 16k tokens), CUDA events, no
#                        torch.compile, each figure into results.jsonl as it is measured, every
#                        full-size output against SDPA's; the model of each path beside it
#   ncu_fwd       20/20  ncu --section SpeedOfLight on one forward launch (8k, full), skipped
#   ncu_bwd       20/20  with the reason when ncu is absent or cannot read the counters; then
#                        the same on one dK/dV launch
#   memcheck      35/40  compute-sanitizer --tool memcheck on
#                        tests/gpu/test_cupy_gpu.py::test_one_small_case_per_kernel
# Passing --sm90a is what makes the sm_90a kernels the default on sm_90 (docs/hopper.md,
# "Dispatch"). Limits add up to 390 s in both modes (--numba: install 20, numba_tests 150, gpu_tests 60,
# bench_numba 50). Steps from primitives on are GPU steps: after the first hang every later
# GPU step is skipped, saying which step hung, so a hang costs its own limit only (a hanging
# primitive stops the run before any kernel launches).
#
# Environment (the overrides let tests/test_gpu_check.py dry-run the whole script against a
# stub GPU in seconds; none is needed on a GPU machine):
#   OUT                        where the results go (default ./gpu_check_out)
#   PYTHON                     the interpreter (default python3, else python)
#   WHEELS                     wheels to install offline (default ./.whl)
#   GPU_CHECK_LIMIT_<step>     that step's limit in seconds, e.g. GPU_CHECK_LIMIT_timing=5
#   GPU_CHECK_CMD_<step>       that step's command, run by bash -c in the checkout (with PY,
#                              OUT_DIR, CUPY_BACKEND, LOGS exported), e.g.
#                              GPU_CHECK_CMD_install=true
#   GPU_CHECK_TEST_TIMEOUT     the per-test timeout of the pytest steps (default 20 s)
#   GPU_CHECK_KILL_AFTER       seconds between a limit's TERM and its KILL (default 5)
#   GPU_CHECK_JOBS             processes of the warm-up (default the CPU count)
#   VARLEN_POLL_LIMIT          the kernels' poll limit (below; 0 builds them without it)
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
WORK="$(mktemp -d "${TMPDIR:-/tmp}/varlen_gpu_check.XXXXXX")"      # scratch
SITE="$WORK/site"                                                 # carried wheels go here
mkdir -p "$OUT_DIR"
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
LOGS="$OUT_DIR/logs"
rm -rf "$LOGS"
mkdir -p "$LOGS"
cd "$ROOT" || exit 1
: >"$OUT_DIR/results.jsonl"
export PYTHONUNBUFFERED=1
export CUPY_BACKEND=cupy:mma
[ "$MODE" = sm90a ] && CUPY_BACKEND=cupy:sm90a
export CUPY_CACHE_DIR="${CUPY_CACHE_DIR:-${TMPDIR:-/tmp}/varlen_cupy_cache}"
export CUPY_CACHE_IN_MEMORY=0       # the steps reuse the modules the warm-up compiled
export VARLEN_SM90A_CACHE="${VARLEN_SM90A_CACHE:-${TMPDIR:-/tmp}/varlen_sm90a_cache}"
# Every wait of the kernels on another thread (mbarrier phases, the ordered-dQ turn) prints
# where it waited and traps after this many polls, so a hang ends its launch with a diagnosis
# (kernels_cuda/common.cuh; a define of every build here, so these modules are cached apart
# from the default ones). 2^24 polls. A poll costs at least ~20 ns (an mbarrier try_wait that
# answers at once: a shared-memory round trip; the dQ counter's ld.acquire.gpu is an L2 round
# trip, ~0.5 us), so the limit fires no sooner than 0.3 s into one wait, while the longest
# legitimate wait is shorter than the longest launch here: the 16k-token causal backward,
# ~5.5 TFLOP, under 50 ms even at 150 TFLOP/s. A failing try_wait may suspend the thread a
# system-dependent while first; up to 1 us a poll, a hang reports within 17 s, inside the
# per-test timeout; beyond that the watchdog ends the test first. The trap costs the sm_90a
# backward at D 128 and 256 spills (docs/hopper.md, "Hangs"): time it again with the limit 0.
export VARLEN_POLL_LIMIT="${VARLEN_POLL_LIMIT-16777216}"
PY="${PYTHON:-python3}"
command -v "$PY" >/dev/null || PY=python
WHEELS="${WHEELS:-$ROOT/.whl}"
TEST_TIMEOUT="${GPU_CHECK_TEST_TIMEOUT:-20}"
KILL_AFTER="${GPU_CHECK_KILL_AFTER:-5}"
JOBS="${GPU_CHECK_JOBS:-$(nproc 2>/dev/null || echo 8)}"
SKIP_RC=75                          # a step's "nothing to do here" (it prints "SKIP: why")
export PY WHEELS SITE WORK OUT_DIR LOGS ROOT TEST_TIMEOUT JOBS SKIP_RC MODE
T0=$(date +%s)

STEPS=()           # one JSON object per step, in order
LIMITS_SUM=0
HANG=""            # the first hang: later GPU steps are skipped with it as the reason
STOP=""            # a reason that stops every later step

json_str() {  # a JSON string of $1 (one line)
    local s=${1//\\/\\\\}
    s=${s//\"/\\\"}
    s=${s//$'\t'/ }
    s=${s//$'\r'/}
    printf '"%s"' "${s//$'\n'/ }"
}

record() {  # name status rc seconds limit gpu(true|false) reason
    local fields="\"step\": \"$1\", \"status\": \"$2\", \"rc\": $3, \"seconds\": $4"
    STEPS+=("{$fields, \"limit\": $5, \"gpu\": $6, \"reason\": $(json_str "$7")}")
    write_summary true false
}

write_summary() {  # gpu(true|false) finished(true|false) [verdict]
    local joined
    joined=$(IFS=,; echo "${STEPS[*]:-}")
    printf '{"gpu": %s, "mode": "%s", "seconds": %s, "limits_s": %s, "finished": %s, ' \
        "$1" "$MODE" "$(( $(date +%s) - T0 ))" "$LIMITS_SUM" "$2" >"$OUT_DIR/summary.json.tmp"
    printf '"hang": %s, "verdict": %s, "steps": [%s]}\n' \
        "$(json_str "$HANG")" "$(json_str "${3:-}")" "$joined" >>"$OUT_DIR/summary.json.tmp"
    mv "$OUT_DIR/summary.json.tmp" "$OUT_DIR/summary.json"
}

limit_of() {  # step default
    local var="GPU_CHECK_LIMIT_$1"
    echo "${!var:-$2}"
}

# The per-test timeout of the pytest steps: scripts/pytest_watchdog.py, the interpreter's
# faulthandler timer (a C thread: it fires even while a CUDA call holds the GIL, where
# pytest-timeout's Python-level timer may not), which prints the stacks and ends the process.
PYTEST_TIMEOUT_ARGS="-p pytest_watchdog --watchdog-timeout=$TEST_TIMEOUT"
export PYTHONPATH="$ROOT/scripts${PYTHONPATH:+:$PYTHONPATH}"
export PYTEST_TIMEOUT_ARGS
# what the watchdog prints when a test runs past its timeout (and pytest-timeout's mark)
TEST_TIMEOUT_MARK='Timeout \([0-9:.]+\)!|^\++ Timeout \++'

run_step() {  # name default_limit gpu(0|1) command...
    local name="$1" limit gpu="$3" override t0 rc status reason="" log="$LOGS/$1.log"
    limit=$(limit_of "$1" "$2")
    shift 3
    LIMITS_SUM=$((LIMITS_SUM + limit))
    local gpu_json=false
    [ "$gpu" = 1 ] && gpu_json=true
    if [ -n "$STOP" ]; then
        echo "== $name: not run ($STOP)"
        record "$name" not-run 0 0 "$limit" "$gpu_json" "$STOP"
        return 0
    fi
    if [ "$gpu" = 1 ] && [ -n "$HANG" ]; then
        echo "== $name: skipped (after the hang in $HANG)"
        record "$name" skipped 0 0 "$limit" "$gpu_json" "skipped: $HANG hung"
        return 0
    fi
    override="GPU_CHECK_CMD_$name"
    [ -n "${!override:-}" ] && set -- bash -c "${!override}"
    echo "== $name (limit ${limit}s): $*"
    t0=$(date +%s)
    timeout --kill-after="$KILL_AFTER" "$limit" "$@" >"$log" 2>&1
    rc=$?
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        echo "TIMEOUT: killed at its limit of ${limit}s" >>"$log"
        status=timeout
        reason="killed at its limit of ${limit}s"
        if [ "$gpu" = 1 ]; then
            status=hang
            HANG="$name (killed at its limit of ${limit}s)"
        fi
    elif grep -qE "$TEST_TIMEOUT_MARK" "$log"; then
        local test
        test=$(grep -oE '[A-Za-z0-9_./-]+\.py::[^ ]+' "$log" | tail -n 1)
        status=hang
        reason="a test ran past the per-test timeout of ${TEST_TIMEOUT}s: ${test:-?}"
        HANG="$name (${test:-a test} past ${TEST_TIMEOUT}s)"
    elif [ "$rc" -eq 0 ]; then
        status=pass
    elif [ "$rc" -eq "$SKIP_RC" ]; then
        status=skipped
        reason=$(grep -m1 '^SKIP: ' "$log" | cut -c7-)
        reason="${reason:-no reason given}"
    else
        status=fail
    fi
    record "$name" "$status" "$rc" "$(( $(date +%s) - t0 ))" "$limit" "$gpu_json" "$reason"
    tail -n 3 "$log"
    echo "== $name: $status (rc=$rc)"
    return 0
}

gpu_present() {  # nvidia-smi lists a GPU, else the driver counts one
    if command -v nvidia-smi >/dev/null 2>&1; then
        nvidia-smi -L 2>/dev/null | grep -q '^GPU ' && return 0
    fi
    "$PY" - <<'EOF'
import ctypes, sys
try:
    lib = ctypes.CDLL("libcuda.so.1")
except OSError:
    sys.exit(1)
n = ctypes.c_int(0)
ok = lib.cuInit(0) == 0 and lib.cuDeviceGetCount(ctypes.byref(n)) == 0 and n.value > 0
sys.exit(0 if ok else 1)
EOF
}

if ! gpu_present; then
    echo "gpu_check: no usable CUDA GPU; nothing to run (the CPU suite covers the emulation)"
    write_summary false true "no GPU"
    cat "$OUT_DIR/summary.json"
    exit 0
fi

# ---- the step commands ----------------------------------------------------------------------

probes() {  # the machine, the versions and the probes; exit 2: not the GPU this mode needs
    date -u
    nvidia-smi || echo "nvidia-smi: not found"
    local need=()
    [ "$MODE" = sm90a ] && need=(--require-sm90)
    "$PY" scripts/gpu_probe.py --json "$OUT_DIR/results.jsonl" ${need[@]+"${need[@]}"}
}

install_checkout() {  # varlen.comm and varlen.kernels_cuda are mapped in by setup.cfg
    if ! "$PY" -c "import varlen.comm, varlen.kernels_cuda" >/dev/null 2>&1; then
        "$PY" -m pip install -q --no-deps --no-build-isolation -e . || return 1
    fi
    if compgen -G "$WHEELS/*.whl" >/dev/null; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade \
            --target "$SITE" "$WHEELS"/*.whl || return 1
    fi
    "$PY" -c "import varlen.comm, varlen.kernels_cuda; print('varlen importable')"
}

gpu_pytest() {  # pytest with the per-test timeout and the names of the tests it runs; a run
                # in which no test passed (all skipped, none selected) fails
    local out rc
    out=$(mktemp "$WORK/pytest.XXXXXX")
    # shellcheck disable=SC2086
    "$PY" -m pytest -v -rfEs -p no:cacheprovider $PYTEST_TIMEOUT_ARGS "$@" 2>&1 | tee "$out"
    rc=${PIPESTATUS[0]}
    [ "$rc" -eq 0 ] || return "$rc"
    if ! grep -qE "[0-9]+ passed" "$out"; then
        echo "no test passed (all skipped or none selected)"
        return 5
    fi
}

primitives() {  # the sm_90a primitives alone, before any kernel; an sm_90 GPU only
    local cc
    cc=$(grep -o '"compute_capability": "[0-9]*"' "$OUT_DIR/results.jsonl" 2>/dev/null \
        | head -n 1 | tr -dc '0-9')
    if [ -n "$cc" ] && [ "$cc" != 90 ]; then
        echo "SKIP: compute capability $cc; the sm_90a primitives need 9.0"
        return "$SKIP_RC"
    fi
    gpu_pytest -m gpu tests/emulation/test_sm90_primitives.py --junitxml="$LOGS/primitives.xml"
}

kernel_tests() {
    if [ "$MODE" = sm90a ]; then
        gpu_pytest -m gpu tests/gpu/test_sm90_gpu.py --junitxml="$LOGS/kernel_tests.xml"
    else
        gpu_pytest tests/gpu/test_cupy_gpu.py --cupy-backend=cupy:mma \
            -k "not matches_reference and not aux_grads and not mask_mod" \
            --junitxml="$LOGS/kernel_tests.xml"
    fi
}

parity() {  # backend [-k expression]
    gpu_pytest tests/gpu/test_cupy_gpu.py --cupy-backend="$1" -k "$2" \
        --junitxml="$LOGS/parity_${1#cupy:}.xml"
}

timing() {
    local runners=mma,sdpa-flash,sdpa-cudnn
    [ "$MODE" = sm90a ] && runners=sm90a,$runners
    "$PY" scripts/gpu_timing.py --runners "$runners" --json "$OUT_DIR/results.jsonl"
}

ncu_sol() {  # fwd|bwd: the speed-of-light sections of one launch of the mode's kernels
    local ncu kernel log rc runner=${CUPY_BACKEND#cupy:}
    local refused="ERR_NVGPUCTRPERM|LibraryNotLoaded|Failed to initialize|not supported|permission"
    ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu \
        2>/dev/null | head -n 1)
    if [ -z "$ncu" ]; then
        echo "SKIP: ncu not found (PATH, /usr/local/cuda/bin, /opt/nvidia)"
        return "$SKIP_RC"
    fi
    # the mode's own kernels only run in its steps: a name prefix tells them apart
    case "$1/$runner" in
        fwd/sm90a) kernel=varlen_fwd_sm90 ;;
        bwd/sm90a) kernel=varlen_bwd_dkdv_sm90 ;;
        fwd/*) kernel=varlen_fwd ;;
        bwd/*) kernel=varlen_bwd_dkdv ;;
    esac
    log=$("$ncu" --clock-control none --section SpeedOfLight -k "regex:$kernel" -c 1 \
        "$PY" scripts/gpu_timing.py --launch "$1" --runners "$runner" 2>&1)
    rc=$?
    echo "$log"
    if grep -qiE "$refused" <<<"$log"; then
        echo "SKIP: ncu cannot read the counters here: $(grep -m1 -iE "$refused" <<<"$log" | cut -c1-120)"
        return "$SKIP_RC"
    fi
    [ "$rc" -eq 0 ] || return "$rc"
    grep -q "SM Frequency\|Duration\|Throughput" <<<"$log" || { echo "ncu profiled nothing"; return 4; }
}

find_sanitizer() {  # $COMPUTE_SANITIZER, the PATH, the CUDA toolkit, then the wheels
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

memcheck() {  # the small case under compute-sanitizer; it must run, not skip
    local san log rc
    san=$(find_sanitizer) || { echo "SKIP: compute-sanitizer not found (PATH, CUDA_HOME, wheels)"; return "$SKIP_RC"; }
    log=$("$san" --tool memcheck --error-exitcode 3 --print-limit 20 "$PY" -m pytest -q -x \
        -p no:cacheprovider --cupy-backend="$CUPY_BACKEND" \
        "tests/gpu/test_cupy_gpu.py::test_one_small_case_per_kernel" 2>&1)
    rc=$?
    echo "compute-sanitizer: $san"
    echo "$log"
    if grep -q "Device not supported" <<<"$log"; then
        echo "SKIP: compute-sanitizer refuses this device: Device not supported"
        return "$SKIP_RC"
    fi
    [ "$rc" -eq 0 ] || return "$rc"
    grep -q "1 passed" <<<"$log" || { echo "the case did not run"; return 4; }
}

export -f probes install_checkout gpu_pytest primitives kernel_tests parity timing ncu_sol find_sanitizer \
    memcheck

# ---- the steps ------------------------------------------------------------------------------

if [ "$MODE" = numba ]; then
    run_step install 20 0 bash -c install_checkout
    [ -d "$SITE" ] && export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    run_step numba_tests 150 1 "$PY" -m pytest -q -rfEs tests/numba \
        --junitxml="$LOGS/numba_tests.xml"
    run_step gpu_tests 60 1 "$PY" -m pytest -q -rfEs -m gpu tests --ignore=tests/numba \
        --ignore=tests/gpu/test_cupy_gpu.py --junitxml="$LOGS/gpu_tests.xml"
    run_step bench_numba 50 1 "$PY" scripts/bench_numba.py --quick --json "$LOGS/bench_numba.json"
else
    sm90=0
    [ "$MODE" = sm90a ] && sm90=1
    run_step probes 30 0 bash -c probes
    if [ "$sm90" = 1 ] && grep -q "not an sm_90 GPU" "$LOGS/probes.log" 2>/dev/null; then
        STOP="not an sm_90 GPU: the sm_90a kernels cannot run here"
    fi
    run_step install 20 0 bash -c install_checkout
    [ -d "$SITE" ] && export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    run_step warm $((sm90 ? 55 : 60)) 0 "$PY" scripts/gpu_warm.py --mode "$MODE" --jobs "$JOBS"
    run_step primitives 25 1 bash -c primitives
    run_step kernel_tests $((sm90 ? 50 : 70)) 1 bash -c kernel_tests
    if [ "$sm90" = 1 ]; then
        run_step parity_sm90a 40 1 bash -c 'parity "$0" "$1"' cupy:sm90a \
            "matches_reference or deterministic or graph_capture or callers_stream"
    fi
    run_step parity_mma $((sm90 ? 25 : 40)) 1 bash -c 'parity "$0" "$1"' cupy:mma \
        "matches_reference"
    run_step timing $((sm90 ? 70 : 65)) 1 bash -c timing
    run_step ncu_fwd 20 1 bash -c 'ncu_sol fwd'
    run_step ncu_bwd 20 1 bash -c 'ncu_sol bwd'
    run_step memcheck $((sm90 ? 35 : 40)) 1 bash -c memcheck
fi

# ---- verdict: one screen ----------------------------------------------------------------------
bad=0
for s in ${STEPS[@]+"${STEPS[@]}"}; do
    case "$s" in *'"status": "fail"'*|*'"status": "timeout"'*|*'"status": "hang"'*) bad=$((bad + 1)) ;; esac
done
if [ -n "$STOP" ]; then
    VERDICT="FAIL ($STOP)"
elif [ "$bad" -eq 0 ]; then
    VERDICT="PASS"
else
    VERDICT="FAIL ($bad step(s)${HANG:+; hang in $HANG})"
fi
{
    echo "================ gpu_check verdict ($MODE, $(( $(date +%s) - T0 )) s, limits ${LIMITS_SUM} s) ================"
    grep -m2 -E "NVIDIA|Driver Version" "$LOGS/probes.log" 2>/dev/null | cut -c1-100
    printf '%-13s %-8s %4s %5s  %s\n' step status s limit "reason or last line"
    for s in ${STEPS[@]+"${STEPS[@]}"}; do
        name=$(sed 's/.*"step": "\([^"]*\)".*/\1/' <<<"$s")
        st=$(sed 's/.*"status": "\([^"]*\)".*/\1/' <<<"$s")
        secs=$(sed 's/.*"seconds": \([0-9]*\).*/\1/' <<<"$s")
        lim=$(sed 's/.*"limit": \([0-9]*\).*/\1/' <<<"$s")
        why=$(sed 's/.*"reason": "\(.*\)"}$/\1/' <<<"$s")
        [ -n "$why" ] || why=$(grep -v '^\s*$' "$LOGS/$name.log" 2>/dev/null | tail -n 1)
        printf '%-13s %-8s %4s %5s  %s\n' "$name" "$st" "$secs" "$lim" "${why:0:58}"
    done
    [ -s "$OUT_DIR/results.jsonl" ] && timeout 20 "$PY" scripts/gpu_timing.py \
        --table "$OUT_DIR/results.jsonl" 2>&1 | head -n 24
    echo "VERDICT: $VERDICT"
} | tee "$OUT_DIR/verdict.txt"
write_summary true true "$VERDICT"
[ "$VERDICT" = PASS ]
