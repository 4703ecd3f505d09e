"""Backend registry: every backend by name, the default for a call, and why others were not.

Each backend module defines one `Backend` subclass (`base.py`) and its instance `BACKEND`.
Modules are imported on first use, so a machine without CuPy or Numba never imports them.

    >>> varlen.backends.explain(dtype="float32", head_dim=64, on_device=False)
    [('cpu', None), ('numpy', None),
     ('numba', 'not chosen by default for host arrays (ask for it by name)'),
     ('cupy', 'the cupy backend runs on a CUDA device; the arrays live on the host')]
"""
from __future__ import annotations

import importlib

from .base import Backend, Problem

__all__ = ["Backend", "Problem", "NAMES", "get", "select", "explain"]

NAMES = ("numpy", "cpu", "numba", "cupy")
_MODULES = {"numpy": "numpy_backend", "cpu": "cpu_backend", "numba": "numba_backend",
            "cupy": "cupy_backend"}
# Preference when backend=None: fastest first. Host data goes to the host backends only (the
# Numba simulator accepts host arrays too, but only when asked for by name).
_DEVICE_ORDER = ("cupy", "numba", "numpy")
_HOST_ORDER = ("cpu", "numpy")
# float64 host data stays on the float64 reference (the cpu backend runs it when asked by name)
_HOST_ORDER_FLOAT64 = ("numpy",)


def get(name: str) -> Backend | None:
    """The backend called `name`, or None when its module is not part of this installation."""
    if name not in _MODULES:
        raise ValueError(f"backend={name!r} is not a known backend; expected one of "
                         f"{', '.join(map(repr, NAMES))} or None")
    try:
        module = importlib.import_module(f".{_MODULES[name]}", __name__)
    except ModuleNotFoundError as e:
        if e.name and e.name.endswith(_MODULES[name]):
            return None
        raise
    return module.BACKEND


def _order(call):
    if call.on_device:
        return _DEVICE_ORDER
    return _HOST_ORDER_FLOAT64 if call.dtype == "float64" else _HOST_ORDER


def _reason(name: str, call, on_device: bool) -> str | None:
    """Why `backend=None` would pass over `name` for `call` (None: it would take it)."""
    backend = get(name)
    if backend is None:
        return "not built in this installation"
    why = backend.supports(call)
    if why:
        return why
    if name not in _order(call):
        where = "device" if on_device else "float64 host" if call.dtype == "float64" else "host"
        return f"not chosen by default for {where} arrays (ask for it by name)"
    if not backend.default_eligible:
        return "not chosen by default yet (ask for it by name)"
    return None


def explain(call=None, **problem) -> list[tuple[str, str | None]]:
    """For every backend, in order of preference: `(name, None)` if `backend=None` could pick
    it for this call, else `(name, reason)`. Pass a setup record or the keywords of `Problem`
    (`dtype`, `head_dim`, `head_dim_v` (default `head_dim`), `on_device` (default False))."""
    if call is None:
        problem.setdefault("head_dim_v", problem.get("head_dim"))
        problem.setdefault("on_device", False)
        call = Problem(**problem)
    order = _order(call)
    names = order + tuple(n for n in NAMES if n not in order)
    return [(n, _reason(n, call, call.on_device)) for n in names]


def select(name, call) -> Backend:
    """The backend for `call`: the named one (or an error saying why it cannot run it), or the
    first in order of preference that can, with every other one's reason in the error."""
    if name is not None:
        if not isinstance(name, str):
            raise TypeError(f"backend must be one of {', '.join(map(repr, NAMES))} or None, "
                            f"got {name!r}")
        backend = get(name)
        if backend is None:
            raise ValueError(f"backend={name!r} is not built in this installation")
        why = backend.supports(call)
        if why:
            raise ValueError(f"backend={name!r} cannot run this call: {why}")
        return backend
    for n in _order(call):                    # only the candidates: others are not imported
        if _reason(n, call, call.on_device) is None:
            return get(n)
    raise ValueError("no backend supports this call (" +
                     "; ".join(f"{n}: {why}" for n, why in explain(call)) + ")")
