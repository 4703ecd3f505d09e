"""scripts/gpu_check.sh on a machine without a GPU, and what its sm_90a mode runs: the steps
must name tests and options that exist, so that the one run a GPU gets is not lost to a stale
selection."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
SCRIPT = os.path.join(ROOT, "scripts", "gpu_check.sh")


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


@pytest.mark.parametrize("mode", ["--sm90a", "--cupy"])
def test_without_a_gpu_it_says_so_and_passes(mode, tmp_path):
    if _has_gpu():
        pytest.skip("this machine has a GPU: the check would run")
    proc = subprocess.run(["bash", SCRIPT, mode], env={**os.environ, "OUT": str(tmp_path)},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "no usable CUDA GPU" in proc.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["gpu"] is False and summary["mode"] == mode[2:]
    # said first: nothing imports the frameworks (30-40 s) before the GPU probe
    import tarfile
    with tarfile.open(tmp_path / "logs.tar.gz") as logs:
        names = {os.path.basename(n) for n in logs.getnames()}
    assert "machine.txt" not in names, names


def test_an_unknown_mode_is_refused(tmp_path):
    proc = subprocess.run(["bash", SCRIPT, "--sm80"], env={**os.environ, "OUT": str(tmp_path)},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--sm90a" in proc.stderr


def test_the_sm90a_steps_select_tests_that_exist():
    """The sm_90a parity step's -k expression selects tests of tests/gpu/test_cupy_gpu.py
    (collected here, skipped without a GPU), and the files its test step names hold `gpu`
    tests."""
    text = _script()
    block = text[text.index('if [ "$MODE" = sm90a ]'):text.index('elif [ "$MODE" = numba ]')]
    assert "CUPY_BACKEND=cupy:sm90a" in block and "varlen.backends.cupy.sm90" in block
    assert '--cupy-backend="$CUPY_BACKEND" tests/gpu/test_cupy_gpu.py' in block
    assert '--backend "$CUPY_BACKEND"' in block
    assert "VARLEN_CUPY_PATH" not in text
    expr = re.search(r'tests/gpu/test_cupy_gpu.py \\\s*-k "([^"]+)"', block)[1]
    words = [w for w in re.split(r"\s+or\s+", expr)]
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                           "tests/gpu/test_cupy_gpu.py", "-k", expr], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    collected = [line for line in proc.stdout.splitlines() if "::" in line]
    for w in words:
        assert any(w in line for line in collected), f"-k {w!r} selects nothing: {proc.stdout}"
    for path in ("tests/gpu/test_sm90_gpu.py",):
        assert path in block
        with open(os.path.join(ROOT, path)) as f:
            assert "pytest.mark.gpu" in f.read(), path


def test_the_benchmark_holds_the_sm90a_kernels_to_their_targets():
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import perf_model
    assert perf_model.measured_targets("cupy") == {"fwd": 350.0, "bwd": 250.0}
    assert perf_model.measured_targets("cupy:sm90a") == {"fwd": 600.0, "bwd": 450.0}
    report = {"bf16_matmul_peak_tflops": 800.0, "cupy_backend": "cupy:sm90a", "results": [
        {"workload": "uniform-L8192-full", "runners": {"cupy": {"fwd": {"tflops": 610.0}}}}]}
    text = perf_model.comparison(report, perf_model.table())
    assert "sm_90a kernels" in text
    assert re.search(r"uniform-L8192-full\s+fwd\s+\d+\s+\d+\s+600\s+610", text), text
