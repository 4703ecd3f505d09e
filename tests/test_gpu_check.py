"""scripts/gpu_check.sh on a machine without a GPU: its steps (order, limits, the tests they
name), and dry runs of the whole script against a stub GPU (a fake nvidia-smi, ncu and
compute-sanitizer on PATH, step commands replaced through GPU_CHECK_CMD_<step>) with steps that
pass, a test that hangs, a step killed at its limit and one that times out, each in seconds."""
from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
import time

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
SCRIPT = os.path.join(ROOT, "scripts", "gpu_check.sh")
sys.path.insert(0, os.path.join(ROOT, "scripts"))

STEPS = {"sm90a": ["probes", "install", "warm", "primitives", "kernel_tests", "parity_sm90a",
                   "parity_mma", "timing", "ncu_fwd", "ncu_bwd", "memcheck"],
         "cupy": ["probes", "install", "warm", "primitives", "kernel_tests", "parity_mma",
                  "timing", "ncu_fwd", "ncu_bwd", "memcheck"],
         "numba": ["install", "numba_tests", "gpu_tests", "bench_numba"]}
GPU_STEPS_FROM = {"sm90a": "primitives", "cupy": "primitives", "numba": "numba_tests"}
PRIMITIVE_TESTS = "tests/emulation/test_sm90_primitives.py"
BUDGET_S = 390


def _script() -> str:
    with open(SCRIPT) as f:
        return f.read()


def _has_gpu() -> bool:
    import ctypes
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    n = ctypes.c_int(0)
    return lib.cuInit(0) == 0 and lib.cuDeviceGetCount(ctypes.byref(n)) == 0 and n.value > 0


def _exe(path, text):
    path.write_text("#!/usr/bin/env bash\n" + text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


@pytest.fixture
def stub(tmp_path):
    """A stub GPU machine: fake nvidia-smi, ncu (which cannot read counters) and
    compute-sanitizer on PATH; tiny test files that pass and that hang."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    _exe(bin_ / "nvidia-smi", 'if [ "${1:-}" = -L ]; then echo "GPU 0: NVIDIA H100 80GB HBM3 '
         '(UUID: GPU-stub)"; else echo "| NVIDIA-SMI 580.1  Driver Version: 580.159.04 |"; '
         'echo "|   0  NVIDIA H100 80GB HBM3 |"; fi\n')
    record = '[ -n "${STUB_CALLS:-}" ] && printf "%s\\n" "$(basename "$0") $*" >>"$STUB_CALLS"\n'
    _exe(bin_ / "ncu", record + 'echo "==ERROR== Failed to initialize the profiler: '
         'LibraryNotLoaded"\nexit 1\n')
    _exe(bin_ / "compute-sanitizer", record + 'echo "========= COMPUTE-SANITIZER"\n'
         'echo "1 passed in 0.1s"; echo "========= ERROR SUMMARY: 0 errors"\n')
    tests = tmp_path / "stub_tests"
    tests.mkdir()
    (tests / "test_ok.py").write_text("def test_ok():\n    pass\n")
    (tests / "test_hang.py").write_text(
        "import time\n\ndef test_first():\n    pass\n\ndef test_kernel_never_returns():\n"
        "    time.sleep(60)\n\ndef test_after():\n    pass\n")
    out = tmp_path / "out"
    figures = ("from gpu_timing import Results; r = Results(sys.argv[1]); "
               "r.write(kind='matmul_peak', tflops=790.0); "
               "r.write(kind='check', workload='L8192-causal', runner='sm90a', max_diff=1e-3, "
               "scale=4.0, ok=True); "
               "r.write(kind='timing', workload='L8192-causal', runner='sm90a', phase='fwd', "
               "seconds=0.002, tflops=512.0, pct_of_peak=64.8, model_tflops=660.0); "
               "r.write(kind='timing', workload='L8192-causal', runner='sdpa-flash', "
               "phase='fwd', seconds=0.003, tflops=345.0, pct_of_peak=43.7, model_tflops=None)")
    env = {**os.environ, "PATH": f"{bin_}:{os.environ['PATH']}", "OUT": str(out),
           "PYTHON": sys.executable, "GPU_CHECK_KILL_AFTER": "1",
           "GPU_CHECK_TEST_TIMEOUT": "2", "COMPUTE_SANITIZER": str(bin_ / "compute-sanitizer"),
           "TMPDIR": str(tmp_path),
           # steps that pass, through the script's own functions where they need no GPU
           "GPU_CHECK_CMD_probes": ("nvidia-smi; echo 'probe tensor_map: ok'; printf "
                                    "'{\"kind\": \"probe\", \"probe\": \"tensor_map\", "
                                    "\"ok\": true}\\n' >>\"$OUT_DIR/results.jsonl\""),
           "GPU_CHECK_CMD_install": "echo varlen importable",
           "GPU_CHECK_CMD_warm": "echo warm-up done",
           "GPU_CHECK_CMD_primitives": "echo '37 passed'",
           "GPU_CHECK_CMD_kernel_tests": f"gpu_pytest {tests / 'test_ok.py'}",
           "GPU_CHECK_CMD_parity_sm90a": "echo '12 passed'",
           "GPU_CHECK_CMD_parity_mma": "echo '8 passed'",
           "GPU_CHECK_CMD_timing": (f'"$PY" -c "import sys; sys.path.insert(0, \'scripts\'); '
                                    f'{figures}" "$OUT_DIR/results.jsonl"')}
    for k in [k for k in env if k.startswith("GPU_CHECK_LIMIT_")]:
        del env[k]
    return {"env": env, "out": out, "tests": tests}


def _run(stub, mode, **env):
    t0 = time.monotonic()
    proc = subprocess.run(["bash", SCRIPT, f"--{mode}"], env={**stub["env"], **env},
                          capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - t0
    out = stub["out"]
    summary = json.loads((out / "summary.json").read_text())
    results = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    steps = {s["step"]: s for s in summary["steps"]}
    return proc, elapsed, summary, steps, results, (out / "verdict.txt").read_text()


@pytest.mark.parametrize("mode", ["sm90a", "cupy", "numba"])
def test_the_steps_their_order_and_limits(mode, stub):
    """Every step in the order of the GPU window, each with a limit, adding up to 6.5 minutes
    at most; the GPU steps are the ones from the kernel tests on."""
    env = {f"GPU_CHECK_CMD_{s}": "true" for s in STEPS[mode]}
    proc, elapsed, summary, steps, _, verdict = _run(stub, mode, **env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [s["step"] for s in summary["steps"]] == STEPS[mode]
    assert all(s["limit"] > 0 and s["status"] == "pass" for s in summary["steps"]), summary
    assert sum(s["limit"] for s in summary["steps"]) == summary["limits_s"] <= BUDGET_S
    first_gpu = STEPS[mode].index(GPU_STEPS_FROM[mode])
    assert [s["gpu"] for s in summary["steps"]] == [i >= first_gpu for i in
                                                     range(len(STEPS[mode]))]
    assert summary["finished"] is True and summary["verdict"] == "PASS"
    assert verdict.rstrip().endswith("VERDICT: PASS") and len(verdict.splitlines()) <= 40


def test_every_command_runs_under_a_limit():
    """The steps' commands run only through run_step (`timeout`); nothing else in the script
    launches pytest, the timing, ncu or compute-sanitizer."""
    text = _script()
    body = text[text.index("# ---- the steps ---"):]
    calls = re.findall(r"^\s*run_step (\w+) (\$\(\([^)]*\)\)|\S+) ([01]) ", body, re.M)
    assert {c[0] for c in calls} >= set(STEPS["sm90a"]) | set(STEPS["cupy"])
    for name, limit, _ in calls:
        assert re.fullmatch(r"\d+|\$\(\(sm90 \? \d+ : \d+\)\)", limit), (name, limit)
    outside = [line for line in body.splitlines()
               if re.search(r"pytest|gpu_timing\.py (?!--table)|\bncu\b|compute-sanitizer", line)
               and "run_step" not in line and not re.search(r"\btimeout \d+ ", line)
               and not line.lstrip().startswith("#")]
    assert not outside, outside
    assert 'timeout --kill-after="$KILL_AFTER" "$limit" "$@"' in text


def test_a_test_step_where_nothing_passed_fails(stub):
    """A pytest step whose tests were all skipped (no GPU stack where the script thought there
    was one) fails rather than passing on nothing."""
    (stub["tests"] / "test_skip.py").write_text(
        "import pytest\n\ndef test_skipped():\n    pytest.skip('no cupy')\n")
    proc, elapsed, summary, steps, results, verdict = _run(
        stub, "cupy", GPU_CHECK_CMD_kernel_tests=f"gpu_pytest {stub['tests'] / 'test_skip.py'}")
    assert steps["kernel_tests"]["status"] == "fail" and steps["kernel_tests"]["rc"] == 5
    assert "no test passed" in verdict and proc.returncode == 1
    assert steps["timing"]["status"] == "pass"           # a failure is not a hang


def test_a_dry_run_that_passes(stub):
    """Probes, tests, parity and timing pass; ncu cannot read the counters (skipped with the
    reason); memcheck runs the small case. The verdict shows the figures with the model of the
    path that ran, and results.jsonl holds each figure."""
    proc, elapsed, summary, steps, results, verdict = _run(stub, "sm90a")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert elapsed < 60
    assert {s: steps[s]["status"] for s in STEPS["sm90a"]} == {
        **{s: "pass" for s in STEPS["sm90a"]}, "ncu_fwd": "skipped", "ncu_bwd": "skipped"}
    assert "counters" in steps["ncu_fwd"]["reason"] and "LibraryNotLoaded" in \
        steps["ncu_bwd"]["reason"]
    kinds = [r["kind"] for r in results]
    assert kinds == ["probe", "matmul_peak", "check", "timing", "timing"], kinds
    assert summary["gpu"] is True and summary["hang"] == "" and summary["verdict"] == "PASS"
    assert "NVIDIA H100" in verdict and "VERDICT: PASS" in verdict
    row = next(line for line in verdict.splitlines() if line.startswith("L8192-causal"))
    assert re.search(r"fwd\s+512\s+345\s+660", row), verdict
    assert "mdl sm90a" in verdict and "mdl mma" not in verdict
    names = set(os.listdir(stub["out"] / "logs"))
    assert {f"{s}.log" for s in STEPS["sm90a"]} <= names, names


def test_a_test_that_hangs_stops_the_gpu_steps(stub):
    """A kernel test that never returns is ended by the per-test timeout, and every later GPU
    step is skipped with the reason instead of running to its own limit; a warm-up that runs
    past its limit (not a GPU step) is a timeout and stops nothing."""
    proc, elapsed, summary, steps, results, verdict = _run(
        stub, "sm90a", GPU_CHECK_CMD_warm="sleep 60", GPU_CHECK_LIMIT_warm="1",
        GPU_CHECK_CMD_kernel_tests=f"gpu_pytest {stub['tests'] / 'test_hang.py'}")
    assert proc.returncode == 1
    assert elapsed < 60
    assert steps["warm"]["status"] == "timeout" and steps["warm"]["rc"] in (124, 137)
    assert "limit of 1s" in steps["warm"]["reason"]
    hung = steps["kernel_tests"]
    assert hung["status"] == "hang" and "test_kernel_never_returns" in hung["reason"], hung
    assert hung["seconds"] < 30
    later = STEPS["sm90a"][STEPS["sm90a"].index("kernel_tests") + 1:]
    for s in later:
        assert steps[s]["status"] == "skipped" and steps[s]["seconds"] == 0, steps[s]
        assert "kernel_tests" in steps[s]["reason"] and "hung" in steps[s]["reason"]
    assert [r["kind"] for r in results] == ["probe"]       # nothing timed after the hang
    assert summary["hang"].startswith("kernel_tests")
    assert summary["verdict"].startswith("FAIL (2 step(s); hang in kernel_tests")
    assert "VERDICT: FAIL" in verdict and "skipped: kernel_tests" in verdict


def test_a_hanging_primitive_stops_the_run_before_any_kernel(stub):
    """A primitive test that never returns (a wgmma or TMA layout that deadlocks a barrier)
    ends its step at the per-test timeout, and the kernel tests, parity, timing, profiles and
    memcheck are skipped with the reason."""
    proc, elapsed, summary, steps, results, verdict = _run(
        stub, "sm90a", GPU_CHECK_CMD_primitives=f"gpu_pytest {stub['tests'] / 'test_hang.py'}")
    assert proc.returncode == 1 and elapsed < 60
    assert steps["primitives"]["status"] == "hang", steps["primitives"]
    assert "test_kernel_never_returns" in steps["primitives"]["reason"]
    for s in STEPS["sm90a"][STEPS["sm90a"].index("primitives") + 1:]:
        assert steps[s]["status"] == "skipped" and "primitives" in steps[s]["reason"], steps[s]
    assert summary["hang"].startswith("primitives")


def test_the_primitives_step_skips_a_gpu_that_is_not_sm90(stub):
    """Default mode on a GPU the probes found to be of another compute capability: the step
    says why it did not run and the kernel tests go on."""
    probe = ("printf '{\"kind\": \"probe\", \"probe\": \"device\", \"ok\": true, "
             "\"compute_capability\": \"80\"}\\n' >>\"$OUT_DIR/results.jsonl\"")
    env = {k: v for k, v in stub["env"].items() if k != "GPU_CHECK_CMD_primitives"}
    proc = subprocess.run(["bash", SCRIPT, "--cupy"], env={**env, "GPU_CHECK_CMD_probes": probe},
                          capture_output=True, text=True, timeout=120)
    steps = {s["step"]: s for s in json.loads((stub["out"] / "summary.json").read_text())["steps"]}
    assert steps["primitives"]["status"] == "skipped", (steps["primitives"], proc.stdout)
    assert "compute capability 80" in steps["primitives"]["reason"]
    assert steps["kernel_tests"]["status"] == "pass"


def test_a_step_killed_at_its_limit_stops_the_gpu_steps(stub):
    """A GPU step that never ends (no per-test timeout inside it) is killed at its limit and
    counts as the hang; the figures written before the step was killed stay."""
    proc, elapsed, summary, steps, results, verdict = _run(
        stub, "cupy", GPU_CHECK_LIMIT_timing="2",
        GPU_CHECK_CMD_timing=(stub["env"]["GPU_CHECK_CMD_timing"] + "; sleep 60"))
    assert proc.returncode == 1
    assert elapsed < 60
    assert [steps[s]["status"] for s in STEPS["cupy"]] == [
        "pass"] * 6 + ["hang", "skipped", "skipped", "skipped"]
    assert steps["timing"]["rc"] in (124, 137) and steps["timing"]["seconds"] <= 4
    assert steps["memcheck"]["reason"] == "skipped: timing (killed at its limit of 2s) hung"
    assert [r["kind"] for r in results] == ["probe", "matmul_peak", "check", "timing", "timing"]
    assert "512" in verdict                                 # the figures it reached
    log = (stub["out"] / "logs" / "timing.log").read_text()
    assert "TIMEOUT: killed at its limit of 2s" in log


def test_a_gpu_that_is_not_sm90_stops_the_sm90a_run(stub):
    proc, elapsed, summary, steps, _, verdict = _run(
        stub, "sm90a", GPU_CHECK_CMD_probes="echo 'not an sm_90 GPU: compute capability 80'; "
                                            "exit 2")
    assert proc.returncode == 1
    assert steps["probes"]["status"] == "fail"
    assert all(steps[s]["status"] == "not-run" for s in STEPS["sm90a"][1:]), steps
    assert "not an sm_90 GPU" in summary["verdict"]


def test_the_watchdog_fires_while_the_gil_is_held(tmp_path):
    """A test blocked in C code that holds the GIL (as a CUDA wait may) is still ended at the
    per-test timeout, with the mark the script reads; the tests before it passed."""
    mark = re.search(r"TEST_TIMEOUT_MARK='([^']+)'", _script())[1]
    (tmp_path / "test_gil.py").write_text(
        "import re\n\ndef test_first():\n    pass\n\ndef test_blocked_in_c():\n"
        "    re.match(r'(a+)+$', 'a' * 40 + 'b')   # catastrophic backtracking, GIL held\n")
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider",
                           "-p", "pytest_watchdog", "--watchdog-timeout=1", "test_gil.py"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": os.path.join(ROOT, "scripts")})
    assert time.monotonic() - t0 < 30
    assert proc.returncode == 1
    log = proc.stdout + proc.stderr
    assert re.search(mark, log, re.M), log
    assert "test_first PASSED" in log and "test_gil.py::test_blocked_in_c" in log
    assert re.search(mark, "+" * 35 + " Timeout " + "+" * 36)     # pytest-timeout's too


@pytest.mark.parametrize("mode", ["--sm90a", "--cupy"])
def test_without_a_gpu_it_says_so_and_passes(mode, tmp_path):
    if _has_gpu():
        pytest.skip("this machine has a GPU: the check would run")
    env = {**os.environ, "OUT": str(tmp_path), "PATH": "/usr/bin:/bin",
           "PYTHON": sys.executable}
    proc = subprocess.run(["bash", SCRIPT, mode], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "no usable CUDA GPU" in proc.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["gpu"] is False and summary["mode"] == mode[2:] and summary["steps"] == []


def test_an_unknown_mode_is_refused(tmp_path):
    proc = subprocess.run(["bash", SCRIPT, "--sm80"], env={**os.environ, "OUT": str(tmp_path)},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--sm90a" in proc.stderr


def test_the_parity_and_kernel_steps_select_tests_that_exist():
    """The parity steps' -k expressions select tests of tests/gpu/test_cupy_gpu.py (collected
    here, skipped without a GPU), bf16 and fp16 at D 64 and 128; the sm_90a kernel step's file
    holds `gpu` tests."""
    text = _script()
    exprs = re.findall(r"parity \"\$0\" \"\$1\"' (cupy:\w+) \\\s*\"([^\"]+)\"", text)
    assert [b for b, _ in exprs] == ["cupy:sm90a", "cupy:mma"], exprs
    for backend, expr in exprs:
        proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                               "tests/gpu/test_cupy_gpu.py", "-k", expr], cwd=ROOT,
                              capture_output=True, text=True, timeout=300)
        collected = [line for line in proc.stdout.splitlines() if "::" in line]
        for w in re.split(r"\s+or\s+", expr):
            assert any(w in line for line in collected), f"-k {w!r} selects nothing"
        reference = [line for line in collected if "matches_reference" in line]
        for dtype in ("float16", "bfloat16"):
            for d in ("64", "128"):
                assert any(dtype in line and f"-{d}-" in line for line in reference), (
                    backend, dtype, d, reference[:3])
    with open(os.path.join(ROOT, "tests", "gpu", "test_sm90_gpu.py")) as f:
        assert "pytest.mark.gpu" in f.read()
    assert "tests/gpu/test_sm90_gpu.py" in text
    # the primitives step: `-m gpu` selects the GPU runner's half of the primitive tests
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "gpu",
                           PRIMITIVE_TESTS], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    collected = [line for line in proc.stdout.splitlines() if "::" in line]
    assert len(collected) >= 30 and all("[gpu" in line for line in collected), proc.stdout
    assert PRIMITIVE_TESTS in text


def test_the_results_file_gets_each_figure_at_once(tmp_path, monkeypatch):
    """gpu_timing.Results appends one flushed JSON line per figure (a reader sees it before the
    next is measured); the table reads a file cut short, and names failed checks."""
    import gpu_timing
    path = tmp_path / "results.jsonl"
    monkeypatch.setenv("VARLEN_POLL_LIMIT", "16777216")
    out = gpu_timing.Results(str(path))
    out.write(kind="matmul_peak", tflops=800.0)
    # each figure names the build it came from (a poll-limit build's sm_90a backward spills)
    assert json.loads(path.read_text()) == {"kind": "matmul_peak", "tflops": 800.0,
                                            "poll_limit": 16777216}
    out.write(kind="timing", workload="L16384-full", runner="mma", phase="bwd", seconds=0.01,
              tflops=280.0, pct_of_peak=35.0, model_tflops=309.0)
    out.write(kind="check", workload="L16384-full", runner="mma", max_diff=0.5, scale=4.0,
              ok=False)
    with open(path, "a") as f:
        f.write('{"kind": "timing", "workl')                 # killed mid-line
    text = gpu_timing.table(gpu_timing.read(str(path)))
    assert re.search(r"L16384-full\s+bwd\s+280\s+309", text), text
    assert "FAILED full-size check: L16384-full mma" in text
    assert [w[0] for w in gpu_timing.workloads()] == [
        "L8192-causal", "L8192-full", "L16384-causal", "L16384-full"]
    assert all(sum(w[1]) == gpu_timing.TOKENS for w in gpu_timing.workloads())


@pytest.mark.parametrize("argv, match", [
    (["--runners", "sm90a,flex"], "flex"),
    (["--iters", "0"], "--iters"),
    (["--launch", "fwd", "--runners", "sdpa-flash"], "CuPy runner"),
])
def test_the_timing_script_refuses_bad_arguments(argv, match, capsys):
    import gpu_timing
    with pytest.raises(SystemExit) as e:
        gpu_timing.main(argv)
    assert e.value.code == 2 and match in capsys.readouterr().err


def test_the_warm_up_covers_what_the_steps_launch():
    """--sm90a: every dispatched sm_90a cubin, the mma.sync modules of the parity and timing
    steps, and the sm_90a backward's auxiliary modules at each of its head dims."""
    import gpu_warm
    from varlen.backends.cupy import mma, sm90
    from varlen.backends.cupy.traits import SM90_HEAD_DIMS, default_blocks
    assert gpu_warm.sm90_specs("sm90a") == sm90.dispatched_specs()
    assert gpu_warm.sm90_specs("cupy") == []
    specs = gpu_warm.mma_specs("sm90a")
    for dtype in ("float16", "bfloat16"):
        for d in SM90_HEAD_DIMS:
            assert mma.KernelSpec("bwd", dtype, d, 64, 64, False) in specs
        for d in (64, 128):
            for kind in ("fwd", "bwd"):
                for softcap in (False, True):
                    assert mma.KernelSpec(kind, dtype, d, *default_blocks(d), softcap) in specs
    assert len(specs) == len(set(specs)) < len(mma.all_specs()) // 4
    cupy = gpu_warm.mma_specs("cupy")
    assert cupy == [s for s in mma.all_specs() if not s.dropout] + gpu_warm.dropout_specs()
    assert {s.compiled() for s in gpu_warm.dropout_specs()} <= set(mma.all_specs())


def test_the_probe_answers_each_question_on_a_line_of_its_own(tmp_path):
    """Without a GPU stack every probe still answers, as a failure with its reason, and the
    versions come first; it needs no installed varlen (it runs before the install step)."""
    pytest.importorskip("numpy")
    try:
        import cupy  # noqa: F401
        pytest.skip("CuPy is importable here: the probes would run")
    except ImportError:
        pass
    path = tmp_path / "results.jsonl"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "gpu_probe.py"),
                           "--json", str(path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["probe"] for r in lines] == ["versions", "device", "dlpack_bf16", "tensor_map"]
    assert lines[0]["ok"] is True and "nvrtc" in lines[0] and "cupy" in lines[0]
    assert all(r["ok"] is False and "cupy" in r["error"] for r in lines[1:])
    for name in ("device", "dlpack_bf16", "tensor_map"):
        assert f"probe {name}: FAILED" in proc.stdout


@pytest.mark.parametrize("mode", ["sm90a", "cupy"])
def test_the_default_commands(mode, stub, tmp_path):
    """No step overridden, the interpreter a stand-in that records its arguments: each step
    runs the scripts and options it is documented to, with the per-test timeout on every
    pytest step and the mode's backend."""
    calls = tmp_path / "calls.txt"
    fake = tmp_path / "fake_python"
    _exe(fake, f'printf "%s\\n" "$*" >>{calls}\n'
         'case "$*" in *pytest*) echo "1 passed in 0.1s" ;; esac\n')
    env = {k: v for k, v in stub["env"].items() if not k.startswith("GPU_CHECK_CMD_")}
    env.update(PYTHON=str(fake), GPU_CHECK_JOBS="6", STUB_CALLS=str(calls))
    proc = subprocess.run(["bash", SCRIPT, f"--{mode}"], env=env, capture_output=True,
                          text=True, timeout=120)
    summary = json.loads((stub["out"] / "summary.json").read_text())
    assert [s["step"] for s in summary["steps"]] == STEPS[mode], proc.stdout
    lines = calls.read_text().splitlines()
    out = str(stub["out"])
    backend = "cupy:sm90a" if mode == "sm90a" else "cupy:mma"
    expected = [
        f"scripts/gpu_probe.py --json {out}/results.jsonl"
        + (" --require-sm90" if mode == "sm90a" else ""),
        "-c import varlen.comm, varlen.kernels_cuda; print('varlen importable')",
        f"scripts/gpu_warm.py --mode {mode} --jobs 6",
        "-m pytest -v -rfEs -p no:cacheprovider -p pytest_watchdog --watchdog-timeout=2 -m gpu "
        f"{PRIMITIVE_TESTS}"]
    if mode == "sm90a":
        expected.append("-m pytest -v -rfEs -p no:cacheprovider -p pytest_watchdog "
                        "--watchdog-timeout=2 -m gpu tests/gpu/test_sm90_gpu.py")
        expected.append("--cupy-backend=cupy:sm90a -k matches_reference or deterministic or "
                        "graph_capture or callers_stream")
    else:
        expected.append("-p pytest_watchdog --watchdog-timeout=2 tests/gpu/test_cupy_gpu.py "
                        "--cupy-backend=cupy:mma -k not matches_reference")
    expected += [
        "tests/gpu/test_cupy_gpu.py --cupy-backend=cupy:mma -k matches_reference --junitxml",
        "scripts/gpu_timing.py --runners " + ("sm90a," if mode == "sm90a" else "")
        + f"mma,sdpa-flash,sdpa-cudnn --json {out}/results.jsonl",
        "ncu --clock-control none --section SpeedOfLight -k regex:varlen_fwd"
        + ("_sm90" if mode == "sm90a" else "") + f" -c 1 {fake} scripts/gpu_timing.py --launch "
        f"fwd --runners {backend[5:]}",
        "ncu --clock-control none --section SpeedOfLight -k regex:varlen_bwd_dkdv"
        + ("_sm90" if mode == "sm90a" else "") + f" -c 1 {fake} scripts/gpu_timing.py --launch "
        f"bwd --runners {backend[5:]}",
        f"compute-sanitizer --tool memcheck --error-exitcode 3 --print-limit 20 {fake} -m "
        f"pytest -q -x -p no:cacheprovider --cupy-backend={backend} "
        "tests/gpu/test_cupy_gpu.py::test_one_small_case_per_kernel"]
    at = 0
    for want in expected:
        hit = next((i for i in range(at, len(lines)) if want in lines[i]), None)
        assert hit is not None, f"{want!r} not called (in order) among:\n" + "\n".join(lines)
        at = hit + 1
    assert [s["status"] for s in summary["steps"]][-3:] == ["skipped", "skipped", "pass"]


def test_the_kernels_are_built_with_the_poll_limit(stub, monkeypatch):
    """Every step runs with VARLEN_POLL_LIMIT exported (2^24 polls, the figure the script
    justifies), which makes it a define of every kernel build, so the modules of such a run
    are cached apart from the default ones; 0 or unset leaves the options as they were, and
    anything else is refused naming the variable."""
    from varlen.backends.cupy import compile as cupy_compile
    steps = STEPS["sm90a"]
    env = {f"GPU_CHECK_CMD_{s}": f'echo "limit=$VARLEN_POLL_LIMIT"' for s in steps}
    proc = subprocess.run(["bash", SCRIPT, "--sm90a"],
                          env={k: v for k, v in {**stub["env"], **env}.items()
                               if k != "VARLEN_POLL_LIMIT"},
                          capture_output=True, text=True, timeout=120)
    for s in steps:
        log = (stub["out"] / "logs" / f"{s}.log").read_text()
        assert "limit=16777216" in log, f"{s}: {log[-500:]}\n{proc.stdout[-1000:]}"
    assert re.search(r"2\^24 polls", _script())
    monkeypatch.delenv("VARLEN_POLL_LIMIT", raising=False)
    plain = cupy_compile.compile_options()
    assert not any("VARLEN_POLL_LIMIT" in o for o in plain)
    monkeypatch.setenv("VARLEN_POLL_LIMIT", "0")
    assert cupy_compile.compile_options() == plain
    monkeypatch.setenv("VARLEN_POLL_LIMIT", "16777216")
    assert cupy_compile.compile_options() == (*plain, "-DVARLEN_POLL_LIMIT=16777216")
    for bad in ("-1", "many", str(2**31)):
        monkeypatch.setenv("VARLEN_POLL_LIMIT", bad)
        with pytest.raises(ValueError, match="VARLEN_POLL_LIMIT"):
            cupy_compile.compile_options()
