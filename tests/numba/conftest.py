"""The Numba backend's suite: one set of tests for the CUDA simulator (CPU) and a GPU.

The root conftest picks the simulator before numba is imported when no GPU is usable; the
test modules read the mode from `numba_testing.SIM`. Here:

* The PTX compile pass (`compile_check.py`) runs in a subprocess with the simulator off; it is
  started as soon as the suite is collected, if `test_numba_ptx.py` is among the tests
  selected, so it compiles while the simulated tests run, and `test_numba_ptx.py` collects its
  result.
"""
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
_COMPILE = {}


def pytest_collection_finish(session):
    # after `-m` and `-k` have deselected: only when a test of test_numba_ptx.py will run
    if any(item.nodeid.split("::")[0].endswith("test_numba_ptx.py") for item in session.items):
        start_compile_check()


def start_compile_check():
    """Start the PTX compile subprocess once (stdout to a temporary file)."""
    if "proc" in _COMPILE:
        return _COMPILE
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    out = tempfile.TemporaryFile(mode="w+")
    err = tempfile.TemporaryFile(mode="w+")
    _COMPILE.update(out=out, err=err, proc=subprocess.Popen(
        [sys.executable, str(HERE / "compile_check.py")], stdout=out, stderr=err, env=env,
        cwd=str(ROOT)))
    return _COMPILE


def pytest_unconfigure(config):
    proc = _COMPILE.get("proc")
    if proc is not None and proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="session")
def compile_check():
    return start_compile_check()
