"""Every entry point: a full `--help`, one-line argument errors (exit 2, no traceback), outputs
where they are asked for, progress on long runs, and the benchmark's parity gate."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"


def run(args, cwd=ROOT, timeout=120):
    cmd = [sys.executable, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd)


def script(name):
    return str(SCRIPTS / name)


def load_script(name):
    spec = importlib.util.spec_from_file_location(name.removesuffix(".py"), SCRIPTS / name)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _cupy_sees_a_gpu() -> bool:
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001 - no CuPy, driver or device
        return False


HELP = {
    "varlen": (["-m", "varlen", "--help"], "demo"),
    "varlen-demo": (["-m", "varlen", "demo", "--help"], "default backend"),
    "comm": (["-m", "varlen.comm", "--help"], "demo"),
    "comm-demo": (["-m", "varlen.comm", "demo", "--help"], "--ranks"),
    "bench": ([script("bench.py"), "--help"], "--runners"),
    "bench_numba": ([script("bench_numba.py"), "--help"], "Method:"),
    "compile_kernels": ([script("compile_kernels.py"), "--help"], "--only"),
    "cp_balance": ([script("cp_balance.py"), "--help"], "--out"),
    "gpu_timing": ([script("gpu_timing.py"), "--help"], "--runners"),
    "gpu_warm": ([script("gpu_warm.py"), "--help"], "--mode"),
    "gpu_probe": ([script("gpu_probe.py"), "--help"], "--require-sm90"),
}


@pytest.mark.parametrize("args, expect", list(HELP.values()), ids=list(HELP))
def test_help_exits_0_with_usage(args, expect):
    r = run(args)
    assert r.returncode == 0, f"{args}: exit {r.returncode}\n{r.stderr}"
    assert r.stdout.startswith("usage:"), r.stdout
    assert expect in r.stdout, f"{args}: {expect!r} not in the help:\n{r.stdout}"


BAD = {
    "comm-ranks-0": (["-m", "varlen.comm", "demo", "--ranks", "0"], "--ranks"),
    "comm-ranks-text": (["-m", "varlen.comm", "demo", "--ranks", "two"], "--ranks"),
    "comm-backend-bogus": (["-m", "varlen.comm", "demo", "--backend", "bogus"], "bogus"),
    "comm-backend-cupy-on-host": (["-m", "varlen.comm", "demo", "--backend", "cupy"],
                                  "backend='cupy'"),
    "comm-nccl-without-gpu": (["-m", "varlen.comm", "demo", "--comm", "nccl"], "--comm nccl"),
    "comm-no-command": (["-m", "varlen.comm"], "command"),
    "varlen-bogus-command": (["-m", "varlen", "bogus"], "invalid choice"),
    "bench-runner-bogus": ([script("bench.py"), "--runners", "cupy,bogus"], "bogus"),
    "bench-tokens-0": ([script("bench.py"), "--tokens", "0"], "--tokens"),
    "bench_numba-unknown": ([script("bench_numba.py"), "--bogus"], "--bogus"),
    "compile-jobs-0": ([script("compile_kernels.py"), "--jobs", "0"], "--jobs"),
    "compile-only-nothing": ([script("compile_kernels.py"), "--only", "nope"], "nope"),
    "gpu_timing-runner-bogus": ([script("gpu_timing.py"), "--runners", "mma,flex"], "flex"),
    "gpu_timing-iters-0": ([script("gpu_timing.py"), "--iters", "0"], "--iters"),
    "gpu_warm-jobs-0": ([script("gpu_warm.py"), "--mode", "cupy", "--jobs", "0"], "--jobs"),
    "cp_balance-cp-0": ([script("cp_balance.py"), "--cp", "2", "0"], "--cp"),
    "cp_balance-mask": ([script("cp_balance.py"), "--mask", "sliding:x"], "sliding:x"),
    "cp_balance-heads": ([script("cp_balance.py"), "--heads", "6", "4"], "--heads"),
    # a file name made a folder of that name
    "cp_balance-out-file": ([script("cp_balance.py"), "--out", "x.png"], "--out x.png"),
}


@pytest.mark.parametrize("args, expect", list(BAD.values()), ids=list(BAD))
def test_bad_argument_is_one_line_exit_2(args, expect):
    if "nccl" in args and _cupy_sees_a_gpu():
        pytest.skip("CuPy sees a GPU: --comm nccl is valid here")
    r = run(args)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, f"{args}: exit {r.returncode}\n{r.stderr}"
    assert "Traceback" not in r.stderr, r.stderr
    assert len(lines) == 1, f"{args}: {len(lines)} lines on stderr:\n{r.stderr}"
    assert "error:" in lines[0] and expect in lines[0], lines[0]


def test_cp_balance_writes_a_plot_per_cp_into_out(tmp_path):
    out, cwd = tmp_path / "results", tmp_path / "cwd"
    cwd.mkdir()
    r = run([script("cp_balance.py"), "--tokens", "2048", "--mean", "128", "--cp", "3", "2",
             "--dist", "uniform", "one-long", "--out", str(out)], cwd=cwd)
    assert r.returncode == 0, r.stderr
    want = {"cp_balance-cp2.png", "cp_balance-cp3.png", "cp_balance.json"}
    assert {p.name for p in out.iterdir()} == want, sorted(out.iterdir())
    assert all((out / n).stat().st_size > 0 for n in want)
    assert not list(cwd.iterdir()), f"wrote into the working directory: {list(cwd.iterdir())}"
    res = json.loads((out / "cp_balance.json").read_text())["results"]
    assert sorted({row["cp"] for row in res["uniform"]}) == [2, 3]


def test_cp_balance_default_out_is_a_results_folder():
    args = load_script("cp_balance.py").parse_args([])
    assert args.out.resolve() != ROOT and ROOT / "out" in args.out.resolve().parents, args.out


def test_compile_kernels_json_shows_progress():
    pytest.importorskip("cuda.bindings.nvrtc", reason="needs cuda-bindings (NVRTC)")
    r = run([script("compile_kernels.py"), "--json", "--only", "fwd-float16-D64-BM64-BN64",
             "--arch", "sm_80", "--jobs", "1"])
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert [(row["kernel"], row["arch"]) for row in rows] == [
        ("varlen_fwd<__half, 64, 64, 64, false, 64, 3>", "sm_80")], rows
    assert "compiling 1 kernel(s)" in r.stderr and "[1/1] sm_80" in r.stderr, r.stderr


# scripts/bench.py needs a GPU to measure; its steps run here on stand-ins for the runners.

class _FakeTorch:
    bfloat16 = "bfloat16"

    class cuda:
        @staticmethod
        def empty_cache():
            pass


@pytest.fixture
def bench(monkeypatch):
    mod = load_script("bench.py")
    calls = []

    def runner(name):
        def make(torch, data, *rest, **kw):
            calls.append(kw.get("backend", name))
            return (lambda: None), (lambda: None), f"out-of-{kw.get('backend', name)}"
        return make
    monkeypatch.setattr(mod, "Data", lambda *a: None)
    monkeypatch.setattr(mod, "run_cupy", runner("cupy"))
    monkeypatch.setattr(mod, "run_sdpa", runner("sdpa"))
    monkeypatch.setattr(mod, "run_flex", runner("flex"))
    mod.calls = calls
    mod.new_bench = lambda: mod.Bench(_FakeTorch, lambda fn: 1e-3, 100.0, 2, 64)
    return mod


def test_bench_reports_no_cupy_figure_when_parity_fails(bench, monkeypatch):
    def parity_small(*a):
        bench.calls.append("parity")
        raise AssertionError("off by one")
    monkeypatch.setattr(bench, "parity_small", parity_small)
    b = bench.new_bench()
    entry = bench.run_workload(b, ("w", [64, 33], [True, False]), ["cupy", "sdpa-flash"],
                               lambda *a: None)
    assert bench.calls == ["parity", "sdpa"], bench.calls
    assert entry["parity"].startswith("FAILED") and b.failed
    assert "parity" in entry["runners"]["cupy"]["error"], entry["runners"]["cupy"]
    assert entry["runners"]["sdpa-flash"]["fwd+bwd"]["tflops"] > 0


def test_bench_drops_a_figure_that_disagrees_with_flex(bench, monkeypatch):
    monkeypatch.setattr(bench, "parity_small", lambda *a: bench.calls.append("parity"))

    def parity_full(torch, ours, ref):
        raise AssertionError(f"{ours} vs {ref}")
    monkeypatch.setattr(bench, "parity_full", parity_full)
    b = bench.new_bench()
    entry = bench.run_workload(b, ("w", [64], [True]), ["cupy", "flex"], lambda *a: None)
    assert bench.calls == ["parity", "cupy", "flex"], bench.calls
    assert "cupy" not in entry["runners"] and b.failed, entry
    assert entry["parity"].startswith("FAILED: cupy"), entry["parity"]
    assert "_out" not in entry


def test_bench_summary_marks_missing_figures(bench):
    results = [dict(workload="w1", runners={"cupy": {"fwd+bwd": {"tflops": 12.5}},
                                            "flex": {"error": "x"}})]
    head, row = bench.summary_lines(results, ["cupy", "flex"])
    assert head.split() == ["workload", "cupy", "flex"]
    assert row.split()[:3] == ["w1", "12.5", "-"], row
