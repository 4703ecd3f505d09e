"""Threads of the `cpu` backend: how many workers, and BLAS kept single-threaded inside them.

Workers: `numba.get_num_threads()`, which follows `NUMBA_NUM_THREADS` and
`numba.set_num_threads`, capped by `OMP_NUM_THREADS` when that is set and `NUMBA_NUM_THREADS`
is not. With threadpoolctl installed, Numba's pool is also registered as a threadpoolctl
library (`user_api="numba"`), so `threadpoolctl.threadpool_limits(n)` limits the backend too.

BLAS: a tile product inside a work item must run in the calling thread (a multi-threaded BLAS
call is neither faster there nor bitwise reproducible: OpenBLAS splits a long inner dimension
at other points when it runs on several threads), so each call holds every BLAS library
threadpoolctl finds at one thread for its duration (`blas_scope`), whichever thread makes the
call. Without threadpoolctl, or when it finds no BLAS library, the kernels use their own loops
for every tile product.
"""
from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import threading

__all__ = ["num_threads", "worker_scope", "blas_scope", "blas_controllable"]

_lock = threading.Lock()
_depth = 0
_registered = False


def _threadpoolctl():
    try:
        import threadpoolctl
    except ImportError:
        return None
    return threadpoolctl


def _register_numba_controller():
    """Let `threadpoolctl.threadpool_limits` reach Numba's thread pool (once)."""
    global _registered
    tpc = _threadpoolctl()
    if _registered or tpc is None or not hasattr(tpc, "register"):
        return
    _registered = True
    import numba
    numba.get_num_threads()           # launches the pool: its library is loaded from here on

    class NumbaController(tpc.LibController):
        user_api = "numba"
        internal_api = "numba"
        # the threading layers' shared libraries (numba/np/ufunc/*pool*.so)
        filename_prefixes = ("omppool", "workqueue", "tbbpool")

        def get_num_threads(self):
            return numba.get_num_threads()

        def set_num_threads(self, num_threads):
            limit = numba.config.NUMBA_NUM_THREADS
            numba.set_num_threads(max(1, min(int(num_threads), limit)))

        def get_version(self):
            return numba.__version__

    tpc.register(NumbaController)


def num_threads() -> int:
    """Workers for the next call (see the module docstring)."""
    import numba
    _register_numba_controller()
    n = numba.get_num_threads()
    omp = os.environ.get("OMP_NUM_THREADS", "")
    if "NUMBA_NUM_THREADS" not in os.environ and omp.strip().isdigit() and int(omp) > 0:
        n = min(n, int(omp))
    return max(1, n)


@contextlib.contextmanager
def worker_scope(items: int):
    """Yields the number of workers for `items` work items (no more workers than items) and
    holds Numba's thread count at it for the call; the setting is per calling thread."""
    import numba
    n = max(1, min(num_threads(), items))
    old = numba.get_num_threads()
    numba.set_num_threads(n)
    try:
        yield n
    finally:
        numba.set_num_threads(old)


class _OpenBLASThreads:
    """`openblas_get_num_threads` / `openblas_set_num_threads` of one loaded pthreads OpenBLAS,
    called directly. Its thread count is process-wide, but threadpoolctl lets only the first
    Python thread that limits it change it ("controlling thread") and silently ignores the
    others: a call made from any other thread ran its tile products on several BLAS threads."""

    def __init__(self, filepath: str):
        lib = ctypes.CDLL(filepath, mode=getattr(os, "RTLD_NOLOAD", 0))
        self.get = self.set = None
        # the affixes threadpoolctl knows (scipy-openblas wheels: prefix scipy_, ILP64: 64_)
        for prefix, suffix in itertools.product(("", "scipy_"), ("", "64_", "_64")):
            get = getattr(lib, f"{prefix}openblas_get_num_threads{suffix}", None)
            set_ = getattr(lib, f"{prefix}openblas_set_num_threads{suffix}", None)
            if get is not None and set_ is not None:
                get.restype, set_.argtypes = ctypes.c_int, [ctypes.c_int]
                self.get, self.set = get, set_
                return


class _LibThreads:
    """The thread count of one BLAS library, read and set from any thread: directly for a
    pthreads OpenBLAS, through threadpoolctl's controller for the others (MKL, BLIS: their
    limits are process-wide and threadpoolctl sets them from any thread)."""

    def __init__(self, lib_controller):
        self.lib = lib_controller
        self.direct = None
        if (lib_controller.internal_api == "openblas"
                and getattr(lib_controller, "threading_layer", None) != "openmp"):
            try:
                direct = _OpenBLASThreads(lib_controller.filepath)
            except OSError:
                direct = None
            self.direct = direct if direct is not None and direct.get is not None else None

    def get(self) -> int:
        return int(self.direct.get() if self.direct else self.lib.get_num_threads())

    def set(self, n: int):
        if self.direct:
            self.direct.set(int(n))
        else:
            self.lib.set_num_threads(int(n))


def _blas_libraries():
    """Every BLAS library in this process as `_LibThreads`, found once by threadpoolctl after
    the kernels' BLAS and SciPy's are loaded (a search made before would not see them);
    None without threadpoolctl or when it finds none."""
    global _libraries
    tpc = _threadpoolctl()
    if tpc is None:
        return None
    if _libraries is None:
        from . import _cpu_kernels  # noqa: F401  (loads the kernels' BLAS)
        try:
            import scipy.linalg.cython_blas  # noqa: F401  (and SciPy's, when it is not that)
        except ImportError:
            pass
        controller = tpc.ThreadpoolController().select(user_api="blas")
        _libraries = [_LibThreads(lib) for lib in controller.lib_controllers]
    return _libraries or None


_libraries = None


def blas_controllable() -> bool:
    """True when threadpoolctl finds a BLAS library that can be held at one thread."""
    global _controllable
    if _controllable is None:
        try:
            _controllable = _blas_libraries() is not None
        except ImportError:
            _controllable = False
    return _controllable


_controllable = None


@contextlib.contextmanager
def blas_scope(bound: bool):
    """Yields True when the kernels may call BLAS: `bound` (the kernels found SciPy's BLAS)
    and every BLAS library is held at one thread until the outermost scope exits (scopes of
    concurrent calls from several threads nest: the last one out restores the counts the
    first one found)."""
    global _depth, _saved
    usable = False
    if bound:
        with _lock:
            if _depth == 0:
                libs = _blas_libraries() or []
                _saved = [(lib, lib.get()) for lib in libs]
                for lib, _ in _saved:
                    lib.set(1)
            _depth += 1
            usable = bool(_saved)
    try:
        yield usable
    finally:
        if bound:
            with _lock:
                _depth -= 1
                if _depth == 0:
                    for lib, n in _saved:
                        lib.set(n)
                    _saved = []


_saved = []
