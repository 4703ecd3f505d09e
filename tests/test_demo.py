"""The main job: `python -m varlen demo` runs and reports the seeds' cases correctly."""
import re
import subprocess
import sys


def test_demo_runs_and_reports():
    r = subprocess.run([sys.executable, "-m", "varlen", "demo"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "1.9269, 1.9269, 1.9269, 1.9269, 1.9954, 1.9954, 1.9954" in out
    rows = [line for line in out.splitlines() if re.match(r"(seeds|packed)", line)]
    assert len(rows) == 3, out
    for line in rows:
        out_err, grad_err = (float(x) for x in line.split()[-3:-1])
        assert out_err < 1e-2 and grad_err < 3e-2, line
    # the header names no backend: the table's column says which ran (it said "NumPy" while
    # the cpu backend ran)
    backends = {line.split()[-5] for line in rows}
    header = out.splitlines()[0]
    assert "NumPy" not in header and "CuPy" not in header, header
    assert backends <= {"cpu", "numpy", "numba", "cupy", "cupy:mma", "cupy:sm90a"}, backends


def test_cli_rejects_unknown_command():
    r = subprocess.run([sys.executable, "-m", "varlen", "bogus"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and "invalid choice" in r.stderr
