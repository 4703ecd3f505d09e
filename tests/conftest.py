"""Test configuration shared by the whole suite.

* Tiers. Every test gets exactly one tier marker, registered in setup.cfg: the one it carries
  itself (on the test, or its module's `pytestmark`), else its folder's:

  | folder               | tier           | what runs                                          |
  | -------------------- | -------------- | -------------------------------------------------- |
  | `tests/emulation/`   | `emulation`    | the CUDA kernels through the host emulation (g++), |
  |                      |                | ThreadSanitizer, schedules, mutation sites         |
  | `tests/compile/`     | `compile`      | NVRTC/NVVM builds and their budgets                |
  | `tests/multiprocess/`| `multiprocess` | mpiexec, torchrun and gloo ranks, multi-device JAX |
  | `tests/gpu/`         | `gpu`          | needs a CUDA GPU; skipped without one              |
  | anything else        | `quick`        | the rest (`slow` where a test says so)             |

  A test marked `gpu` anywhere is of the `gpu` tier. `smoke` marks the one case per emulated
  kernel family, multiprocess launch and compiler that the default run adds to `quick`
  (setup.cfg's `addopts`: `-m "quick or smoke or gpu"`); `-m "not gpu"` with
  VARLEN_TEST_CASES=full is CI's run (.ci/run). The size of the sweeps: `helpers.cases`.
* `--cupy-backend NAME` (default `cupy`): the `backend=` the CuPy GPU tests name
  (`cupy_backend` fixture), e.g. `cupy:sm90a` or `cupy:mma`.
* Fresh output buffers are NaN-filled (`varlen.set_nan_fill(True)`), so an unwritten row fails.
* Numba kernels run on a GPU when one is usable, else in the CUDA simulator. The choice is made
  here, before anything imports numba (`NUMBA_ENABLE_CUDASIM` is read at import time), by
  asking the driver through ctypes.
"""
import ctypes
import os
import sys
from pathlib import Path


def _gpu_usable() -> bool:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    if lib.cuInit(0) != 0:
        return False
    n = ctypes.c_int(0)
    return lib.cuDeviceGetCount(ctypes.byref(n)) == 0 and n.value > 0


# The test machinery outside the package (`emulation/`, the host emulation of the CUDA kernels)
# is imported from the repository root, and `helpers` from here, in this process and in every
# process a test starts.
TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
for path in (str(TESTS), str(ROOT)):
    if path not in sys.path:
        sys.path.insert(0, path)
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (str(ROOT), str(TESTS), os.environ.get("PYTHONPATH", "")) if p)

HAS_GPU = _gpu_usable()
if not HAS_GPU:
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
os.environ.setdefault("CUPY_CACHE_IN_MEMORY", "1")

import pytest  # noqa: E402

import varlen  # noqa: E402

varlen.set_nan_fill(True)

TIERS = ("quick", "emulation", "compile", "multiprocess", "slow", "gpu")
FOLDER_TIERS = {"emulation": "emulation", "compile": "compile", "multiprocess": "multiprocess",
                "gpu": "gpu"}


def tier_of(item) -> str:
    """The tier of a collected test: its own tier marker (`gpu` first), else its folder's."""
    own = [t for t in TIERS if item.get_closest_marker(t) is not None]
    if "gpu" in own:
        return "gpu"
    if len(own) > 1:
        raise pytest.UsageError(f"{item.nodeid} is marked with the tiers {own}; give it one")
    if own:
        return own[0]
    parts = Path(str(item.path)).resolve().relative_to(TESTS).parts
    return FOLDER_TIERS.get(parts[0], "quick")


def pytest_addoption(parser):
    parser.addoption("--cupy-backend", default="cupy",
                     help="the backend= of the CuPy GPU tests: cupy (the family, default), or "
                          "one implementation, cupy:sm90a or cupy:mma")


def pytest_configure(config):
    name = config.getoption("--cupy-backend")
    try:
        varlen.backends.get(name)
    except ValueError as e:
        raise pytest.UsageError(f"--cupy-backend: {e}") from None
    if name != "cupy" and not name.startswith("cupy:"):
        raise pytest.UsageError(f"--cupy-backend={name!r}: the cupy family or one of its "
                                f"implementations (cupy:NAME)")


@pytest.fixture(scope="session")
def cupy_backend(request) -> str:
    """The CuPy backend the GPU tests name (`--cupy-backend`)."""
    return request.config.getoption("--cupy-backend")


@pytest.fixture(scope="session")
def cpu_kernels_compiled():
    """The `cpu` backend's kernels compiled (or loaded from their disk cache) for float32 and
    float64, forward and backward, before a test runs them inside in-process ranks: a first
    compile takes about 30 s per dtype on two cores, longer under load, and would otherwise
    count against the ranks' 60 s wait."""
    import numpy as np

    from varlen.backends import get
    if get("cpu") is None:
        return
    cu = np.array([0, 3], np.int32)
    for dt in (np.float32, np.float64):
        q = np.ones((3, 1, 8), dt)
        out, lse = varlen.attention_forward(q, q, q, cu, cu, backend="cpu")
        varlen.attention_backward(q, q, q, q, out, lse, cu, cu, backend="cpu")


@pytest.fixture(autouse=True)
def _cpu_kernels_before_ranks(request):
    """Context-parallel tests run their ranks in threads of one process (`local_group`), whose
    waits time out: their first cpu-backend call must not be the one that compiles."""
    if request.module.__name__.split(".")[-1].startswith(("test_comm_", "test_cp_")):
        request.getfixturevalue("cpu_kernels_compiled")


_TIER_OF = {}                           # nodeid -> tier
_TIER_SECONDS = {}                      # tier -> [tests run, seconds]


@pytest.hookimpl(tryfirst=True)         # before `-m` deselects by these markers
def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        tier = tier_of(item)
        if item.get_closest_marker(tier) is None:
            item.add_marker(tier)
        item.user_properties.append(("tier", tier))         # in a --junitxml report
        _TIER_OF[item.nodeid] = tier
        if tier == "gpu" and not HAS_GPU:
            item.add_marker(skip)


def pytest_runtest_logreport(report):
    tier = _TIER_OF.get(report.nodeid)
    if tier is not None:
        count = _TIER_SECONDS.setdefault(tier, [0, 0.0])
        count[0] += report.when == "call"
        count[1] += report.duration


def pytest_terminal_summary(terminalreporter):
    """Each tier's tests and seconds (setup, call and teardown), so that every run records
    them."""
    if _TIER_SECONDS:
        terminalreporter.write_sep("=", "seconds by tier")
        for tier in TIERS:
            if tier in _TIER_SECONDS:
                n, seconds = _TIER_SECONDS[tier]
                terminalreporter.write_line(f"{tier:>12}: {seconds:8.1f} s in {n} tests")


def pytest_report_header(config):
    from helpers import CASES_SIZE
    return (f"varlen: GPU={'yes' if HAS_GPU else 'no'}, "
            f"NUMBA_ENABLE_CUDASIM={os.environ.get('NUMBA_ENABLE_CUDASIM', '0')}, "
            f"VARLEN_TEST_CASES={CASES_SIZE}")
