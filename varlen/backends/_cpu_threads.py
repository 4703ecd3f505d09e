"""Threads of the `cpu` backend: how many workers, and BLAS kept single-threaded inside them.

Workers: `numba.get_num_threads()`, which follows `NUMBA_NUM_THREADS` and
`numba.set_num_threads`, capped by `OMP_NUM_THREADS` when that is set and `NUMBA_NUM_THREADS`
is not. With threadpoolctl installed, Numba's pool is also registered as a threadpoolctl
library (`user_api="numba"`), so `threadpoolctl.threadpool_limits(n)` limits the backend too.

BLAS: a tile product inside a work item must run in the calling thread (a multi-threaded BLAS
call is neither faster there nor bitwise reproducible), so each call holds every BLAS library
threadpoolctl finds at one thread for its duration (`blas_scope`). Without threadpoolctl, or
when it finds no BLAS library, the kernels use their own loops for every tile product.
"""
from __future__ import annotations

import contextlib
import os
import threading

__all__ = ["num_threads", "worker_scope", "blas_scope", "blas_controllable"]

_lock = threading.Lock()
_depth = 0
_limiter = None
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


def _blas_controller():
    """threadpoolctl's controller of the BLAS libraries in this process, made once, after the
    kernels' BLAS and SciPy's are loaded (a controller made before would not see them)."""
    global _controller
    tpc = _threadpoolctl()
    if tpc is None:
        return None
    if _controller is None:
        from . import _cpu_kernels  # noqa: F401  (loads the kernels' BLAS)
        try:
            import scipy.linalg.cython_blas  # noqa: F401  (and SciPy's, when it is not that)
        except ImportError:
            pass
        _controller = tpc.ThreadpoolController().select(user_api="blas")
    return _controller if _controller.lib_controllers else None


_controller = None


def blas_controllable() -> bool:
    """True when threadpoolctl finds a BLAS library it can hold at one thread."""
    global _controllable
    if _controllable is None:
        try:
            _controllable = _blas_controller() is not None
        except ImportError:
            _controllable = False
    return _controllable


_controllable = None


@contextlib.contextmanager
def blas_scope(bound: bool):
    """Yields True when the kernels may call BLAS: `bound` (the kernels found SciPy's BLAS)
    and every BLAS library is held at one thread until the outermost scope exits."""
    global _depth, _limiter
    usable = False
    if bound:
        with _lock:
            if _depth == 0:
                ctl = _blas_controller()
                _limiter = None if ctl is None else ctl.limit(limits=1)
            _depth += 1
            usable = _limiter is not None
    try:
        yield usable
    finally:
        if bound:
            with _lock:
                _depth -= 1
                if _depth == 0 and _limiter is not None:
                    _limiter.restore_original_limits()
                    _limiter = None
