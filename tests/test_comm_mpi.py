"""Real `mpiexec` ranks on the CPU: the MPI group, the NumPy backend, float64.

Each launch runs every case and method valid for its size in one job
(`tests/comm_workers/run_cases.py`) and compares each rank's shard of out, lse, dq, dk, dv
with the shard of the single-process reference. A hang becomes a subprocess timeout.
"""
import contextlib
import glob
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytest.importorskip("mpi4py")

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "comm_workers" / "run_cases.py"
MPIEXEC = shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or shutil.which("mpiexec")

pytestmark = [pytest.mark.mpi,
              pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not found")]


def _mpiexec(n, args, tmp_path, timeout=150):
    env = dict(os.environ, PYTHONUNBUFFERED="1", TMPDIR=str(tmp_path))
    t = time.perf_counter()
    r = subprocess.run([MPIEXEC, "-n", str(n), *args], capture_output=True, text=True,
                       timeout=timeout, cwd=ROOT, env=env)
    return r, time.perf_counter() - t


@pytest.mark.parametrize("n", [2, 3, 4])
def test_cases_under_mpiexec(n, tmp_path):
    # `python -m mpi4py` turns an uncaught exception on any rank into MPI_Abort.
    r, _ = _mpiexec(n, [sys.executable, "-m", "mpi4py", str(WORKER), "cases"], tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"OK size={n}" in r.stdout, r.stdout + r.stderr


def _hydra_leftovers():
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "hydra_hwloc_xmlfile_*")))


def test_fault_on_one_rank_ends_the_job(tmp_path):
    # Plain `python` (no mpi4py abort hook): the group's own abort must end every rank.
    before = _hydra_leftovers()
    r, elapsed = _mpiexec(2, [sys.executable, str(WORKER), "fault"], tmp_path, timeout=60)
    for f in _hydra_leftovers() - before:        # MPICH's launcher leaves one after an abort
        with contextlib.suppress(OSError):
            os.remove(f)
    out = r.stdout + r.stderr
    assert r.returncode != 0, out
    assert "injected fault on rank 1" in r.stderr, out
    assert "UNREACHABLE" not in r.stdout, out
    assert elapsed < 30, f"the job took {elapsed:.1f} s to end"


def test_demo_under_mpiexec(tmp_path):
    r, _ = _mpiexec(2, [sys.executable, "-m", "varlen.comm", "demo"], tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "1.9269" in r.stdout and "1.9954" in r.stdout, r.stdout
    assert "rank 0:   local row 3 is padding" in r.stdout, r.stdout
    assert "OK: max error against full attention" in r.stdout, r.stdout
