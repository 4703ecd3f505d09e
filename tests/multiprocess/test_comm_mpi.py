"""Real `mpiexec` ranks on the CPU: the MPI group, the NumPy backend, float64.

Each launch runs every case and method valid for its size in one job
(`tests/comm_workers/run_cases.py`; the document scheme's: `tests/test_comm_document.py`) and
compares each rank's shard of out, lse, dq, dk, dv with the shard of the single-process
reference. A hang becomes a subprocess timeout. The failure modes run on 2 ranks with a 2-5 s
group timeout: every one must end every rank.
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

from helpers import cases

pytest.importorskip("mpi4py")

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "comm_workers" / "run_cases.py"
MPIEXEC = shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or shutil.which("mpiexec")

pytestmark = [pytest.mark.mpi,
              pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not found")]


def _mpiexec(n, args, tmp_path, timeout=150, launcher=()):
    env = dict(os.environ, PYTHONUNBUFFERED="1", TMPDIR=str(tmp_path))
    t = time.perf_counter()
    r = subprocess.run([MPIEXEC, *launcher, "-n", str(n), *args], capture_output=True,
                       text=True, timeout=timeout, cwd=ROOT, env=env)
    return r, time.perf_counter() - t


@pytest.mark.parametrize("n", cases([pytest.param(2, marks=pytest.mark.smoke), 3, 4], [2]))
def test_cases_under_mpiexec(n, tmp_path):
    # `python -m mpi4py` turns an uncaught exception on any rank into MPI_Abort.
    r, _ = _mpiexec(n, [sys.executable, "-m", "mpi4py", str(WORKER), "cases"], tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"OK size={n}" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize("n", cases([2, 3, 4], [2]))
def test_document_cases_under_mpiexec(n, tmp_path):
    """The document scheme's cases and methods (tests/test_comm_document.py, its worker)."""
    worker = ROOT / "tests" / "test_comm_document.py"
    r, _ = _mpiexec(n, [sys.executable, "-m", "mpi4py", str(worker)], tmp_path, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"OK document size={n}" in r.stdout, r.stdout + r.stderr


@pytest.fixture
def aborted_job():
    """Remove what MPICH's launcher leaves in the temp folder after an aborted job."""
    def leftovers():
        return set(glob.glob(os.path.join(tempfile.gettempdir(), "hydra_hwloc_xmlfile_*")))
    before = leftovers()
    yield
    for f in leftovers() - before:
        with contextlib.suppress(OSError):
            os.remove(f)


def test_fault_on_one_rank_ends_the_job(tmp_path, aborted_job):
    # Plain `python` (no mpi4py abort hook): the group's own abort must end every rank.
    r, elapsed = _mpiexec(2, [sys.executable, str(WORKER), "fault"], tmp_path, timeout=60)
    out = r.stdout + r.stderr
    assert r.returncode != 0, out
    assert "injected fault on rank 1" in r.stderr, out
    assert "UNREACHABLE" not in r.stdout, out
    assert elapsed < 30, f"the job took {elapsed:.1f} s to end"


@pytest.mark.parametrize("mode", ["validation", "shapes"])
def test_ranks_called_differently_all_raise_the_same_error(mode, tmp_path):
    # validation: rank 0 has validation off, rank 1 on. shapes: validation off everywhere,
    # rank 1's shards are float32 with twice the heads, the same bytes as rank 0's.
    r, _ = _mpiexec(2, [sys.executable, "-m", "mpi4py", str(WORKER), mode, "5"], tmp_path,
                    timeout=30)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    for rank in (0, 1):
        assert f"rank {rank}: OK {mode}" in r.stdout, out


def test_rank_that_fails_before_the_call_is_named_when_the_wait_times_out(tmp_path,
                                                                          aborted_job):
    # Plain `python`: rank 1 raises before attention and then waits in MPI_Finalize.
    r, elapsed = _mpiexec(2, [sys.executable, str(WORKER), "late", "2"], tmp_path, timeout=60)
    out = f"rc={r.returncode} after {elapsed:.1f} s\n{r.stdout}{r.stderr}"
    assert r.returncode != 0, out
    assert "rank 1 fails before the call" in r.stderr, out
    assert "rank 0 waited 2 s for rank 1" in r.stderr, out
    assert "UNREACHABLE" not in r.stdout, out
    assert elapsed < 25, out


def test_rank_that_vanishes_ends_the_job_with_an_error(tmp_path, aborted_job):
    # Rank 1 calls os._exit(0) mid-ring. By default MPICH's launcher then kills the others
    # and reports rc 0 (see docs/context_parallel.md); with -disable-auto-cleanup they keep
    # running, and the group's timeout ends them with an error naming rank 1.
    r, elapsed = _mpiexec(2, [sys.executable, str(WORKER), "vanish", "2"], tmp_path,
                          timeout=60, launcher=("-disable-auto-cleanup",))
    out = f"rc={r.returncode} after {elapsed:.1f} s\n{r.stdout}{r.stderr}"
    assert r.returncode != 0, out
    assert "rank 0 waited 2 s for rank 1" in r.stderr, out
    assert "UNREACHABLE" not in r.stdout, out
    assert elapsed < 25, out


def test_demo_under_mpiexec(tmp_path):
    r, _ = _mpiexec(2, [sys.executable, "-m", "varlen.comm", "demo"], tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "1.9269" in r.stdout and "1.9954" in r.stdout, r.stdout
    assert "rank 0:   local row 3 is padding" in r.stdout, r.stdout
    assert "OK: max error against full attention" in r.stdout, r.stdout
