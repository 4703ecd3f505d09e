"""Test configuration shared by the whole suite.

* Fresh output buffers are NaN-filled (`varlen.set_nan_fill(True)`), so an unwritten row fails.
* Numba kernels run on a GPU when one is usable, else in the CUDA simulator. The choice is made
  here, before anything imports numba (`NUMBA_ENABLE_CUDASIM` is read at import time), by
  asking the driver through ctypes.
* Tests marked `gpu` need a real CUDA device and are skipped without one.
"""
import ctypes
import os
import sys


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
# is imported from the repository root, here and in every process a test starts.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p)

HAS_GPU = _gpu_usable()
if not HAS_GPU:
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
os.environ.setdefault("CUPY_CACHE_IN_MEMORY", "1")

import pytest  # noqa: E402

import varlen  # noqa: E402

varlen.set_nan_fill(True)


def pytest_collection_modifyitems(config, items):
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


def pytest_report_header(config):
    return (f"varlen: GPU={'yes' if HAS_GPU else 'no'}, "
            f"NUMBA_ENABLE_CUDASIM={os.environ.get('NUMBA_ENABLE_CUDASIM', '0')}")
