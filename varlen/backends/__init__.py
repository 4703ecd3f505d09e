"""Backend registry: every backend and implementation by name, the default for a call, and why
the others were not.

Each backend module defines one `Backend` subclass (`base.py`) and its instance `BACKEND`. A
backend with more than one implementation (the CuPy backend: `cupy:sm90a`, `cupy:mma`) lists
them in `BACKEND.implementations`, in its order of preference; each is a `Backend` of its own
that `backend=` can name. Modules are imported on first use, so a machine without CuPy or Numba
never imports them.

    >>> varlen.backends.explain(dtype="float32", head_dim=64, on_device=False)
    [('cpu', None), ('numpy', None),
     ('numba', 'not chosen by default for host arrays (ask for it by name)'),
     ('cupy', 'the cupy backend runs on a CUDA device; the arrays live on the host'),
     ('cupy:sm90a', 'the cupy:sm90a backend runs on a CUDA device; ...'),
     ('cupy:mma', 'the cupy:mma backend runs on a CUDA device; ...')]
"""
from __future__ import annotations

import importlib

from .base import Backend, Problem

__all__ = ["Backend", "Problem", "NAMES", "get", "select", "select_planner", "explain",
           "names"]

NAMES = ("numpy", "cpu", "numba", "cupy")
_MODULES = {"numpy": "numpy_backend", "cpu": "cpu_backend", "numba": "numba_backend",
            "cupy": "cupy"}
# Preference when backend=None: fastest first. Host data goes to the host backends only (the
# Numba simulator accepts host arrays too, but only when asked for by name).
_DEVICE_ORDER = ("cupy", "numba", "numpy")
_HOST_ORDER = ("cpu", "numpy")
# float64 host data stays on the float64 reference (the cpu backend runs it when asked by name)
_HOST_ORDER_FLOAT64 = ("numpy",)


def _family(name: str) -> str:
    return name.split(":", 1)[0]


def _module_backend(family: str) -> Backend | None:
    """The `BACKEND` of a backend module, None when it is not part of this installation."""
    module_name = _MODULES[family]
    try:
        module = importlib.import_module(f".{module_name}", __name__)
    except ModuleNotFoundError as e:
        if e.name and e.name.endswith(module_name):
            return None
        raise
    return module.BACKEND


def names() -> tuple:
    """Every value `backend=` accepts: the backends and their implementations, in the order
    `explain` lists them for device arrays."""
    out = []
    for n in NAMES:
        out.append(n)
        backend = _module_backend(n)
        out += [i.name for i in getattr(backend, "implementations", ())]
    return tuple(out)


def _unknown(name) -> str:
    return (f"backend={name!r} is not a known backend; expected one of "
            f"{', '.join(map(repr, names()))} or None")


def get(name: str) -> Backend | None:
    """The backend or implementation called `name` (`"cupy"`, `"cupy:mma"`), or None when its
    module is not part of this installation."""
    if not isinstance(name, str) or _family(name) not in _MODULES:
        raise ValueError(_unknown(name))
    backend = _module_backend(_family(name))
    if backend is None or name == backend.name:
        return backend
    found = next((i for i in getattr(backend, "implementations", ()) if i.name == name), None)
    if found is None:
        raise ValueError(_unknown(name))
    return found


def _order(call):
    if call.on_device:
        return _DEVICE_ORDER
    return _HOST_ORDER_FLOAT64 if call.dtype == "float64" else _HOST_ORDER


def _cannot(backend: Backend, call) -> str | None:
    """Why `backend` cannot run `call` at all (its arrays, dtype, sizes, user functions,
    dropout)."""
    return (backend.supports(call) or backend.supports_mods(call) or
            backend.supports_dropout(call))


def _reason(backend: Backend, call, order, family: Backend | None = None) -> str | None:
    """Why `backend=None` would pass over `backend` (an implementation of `family`, when given)
    for `call` (None: it would take it)."""
    why = _cannot(backend, call)
    if why:
        return why
    if _family(backend.name) not in order:
        where = ("device" if call.on_device else
                 "float64 host" if call.dtype == "float64" else "host")
        return f"not chosen by default for {where} arrays (ask for it by name)"
    for b in (family, backend):
        if b is not None and not b.default_eligible:
            return f"not chosen by default yet (ask for it by name: backend={backend.name!r})"
    return None


def explain(call=None, **problem) -> list[tuple[str, str | None]]:
    """For every backend, in order of preference, and after each its implementations:
    `(name, None)` if `backend=None` could pick it for this call, else `(name, reason)`. Pass a
    setup record or the keywords of `Problem` (`dtype`, `head_dim`, `head_dim_v` (default
    `head_dim`), `on_device` (default False))."""
    if call is None:
        problem.setdefault("head_dim_v", problem.get("head_dim"))
        problem.setdefault("on_device", False)
        call = Problem(**problem)
    order = _order(call)
    rows = []
    for n in order + tuple(n for n in NAMES if n not in order):
        backend = _module_backend(n)
        if backend is None:
            rows.append((n, "not built in this installation"))
            continue
        rows.append((n, _reason(backend, call, order)))
        rows += [(i.name, _reason(i, call, order, family=backend))
                 for i in getattr(backend, "implementations", ())]
    return rows


def select(name, call) -> Backend:
    """The backend for `call`: the named one (or an error saying why it cannot run it), or the
    first in order of preference that can, with every other one's reason in the error."""
    if name is not None:
        if not isinstance(name, str):
            raise TypeError(f"backend must be one of {', '.join(map(repr, NAMES))} (or an "
                            f"implementation such as 'cupy:mma') or None, got {name!r}")
        backend = get(name)
        if backend is None:
            raise ValueError(f"backend={name!r} is not built in this installation")
        why = _cannot(backend, call)
        if why:
            raise ValueError(f"backend={name!r} cannot run this call: {why}")
        return backend
    order = _order(call)
    for n in order:                           # only the candidates: others are not imported
        backend = _module_backend(n)
        if backend is not None and _reason(backend, call, order) is None:
            return backend
    raise ValueError("no backend supports this call (" +
                     "; ".join(f"{n}: {why}" for n, why in explain(call) if ":" not in n) + ")")


def select_planner(name, on_device: bool) -> Backend:
    """The backend whose plan builder builds a plan of layout arrays that live on a device (or
    on the host): the named one, or the first of the default order that can build there
    (`Backend.can_plan`): CuPy's fused kernels, then Numba's kernels, on a device; array code
    on the host."""
    if name is not None:
        backend = get(name) if isinstance(name, str) else None
        if backend is None:
            raise ValueError(f"backend={name!r} is not built in this installation"
                             if isinstance(name, str) else _unknown(name))
        why = backend.can_plan(on_device)
        if why:
            raise ValueError(f"backend={name!r} cannot build this plan: {why}")
        return backend
    order = _DEVICE_ORDER if on_device else _HOST_ORDER
    whys = []
    for n in order:
        backend = _module_backend(n)
        why = "not built in this installation" if backend is None else backend.can_plan(on_device)
        if why is None:
            return backend
        whys.append(f"{n}: {why}")
    raise ValueError("no backend builds this plan (" + "; ".join(whys) + ")")
