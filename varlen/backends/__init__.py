"""Backend registry.

A backend is a module with: `name`, `supports(*, dtype, head_dim, head_dim_v, on_device)`
(None when it can run the call, else the reason), `default_blocks(dtype, head_dim)`,
`check_plan(plan)` (None or the reason a plan's tiles do not fit), `forward(plan, q, k, v, *,
softmax_scale, softcap)` and `backward(plan, dout, q, k, v, out, lse, *, softmax_scale, softcap,
deterministic)`. Device backends import their frameworks lazily; a backend whose framework is
missing reports it through `supports`.
"""
from __future__ import annotations

import importlib

NAMES = ("numpy", "numba", "cupy")
_MODULES = {"numpy": "numpy_backend", "numba": "numba_backend", "cupy": "cupy_backend"}
# Preference when backend=None: fastest first. Host data always goes to NumPy by default (the
# Numba simulator accepts host arrays too, but only when asked for by name).
_ORDER = ("cupy", "numba", "numpy")
_HOST_ORDER = ("numpy",)


def load(name: str):
    if name not in _MODULES:
        raise ValueError(f"backend={name!r} is not a known backend; expected one of "
                         f"{', '.join(map(repr, NAMES))} or None")
    try:
        return importlib.import_module(f".{_MODULES[name]}", __name__)
    except ModuleNotFoundError as e:
        if e.name and e.name.endswith(_MODULES[name]):
            return None
        raise


def select(name, *, dtype, head_dim, head_dim_v, on_device):
    """The backend module for a call: the named one (or an error saying why it cannot run),
    or the fastest that supports it."""
    kw = dict(dtype=dtype, head_dim=head_dim, head_dim_v=head_dim_v, on_device=on_device)
    if name is not None:
        mod = load(name)
        if mod is None:
            raise ValueError(f"backend={name!r} is not built in this installation")
        why = mod.supports(**kw)
        if why:
            raise ValueError(f"backend={name!r} cannot run this call: {why}")
        return mod
    reasons = []
    for cand in (_ORDER if on_device else _HOST_ORDER):
        mod = load(cand)
        if mod is None:
            continue
        if not getattr(mod, "DEFAULT_ELIGIBLE", True):
            reasons.append(f"{cand}: not chosen by default yet (ask for it by name)")
            continue
        why = mod.supports(**kw)
        if not why:
            return mod
        reasons.append(f"{cand}: {why}")
    raise ValueError("no backend supports this call (" + "; ".join(reasons) + ")")


def available(on_device: bool):
    """Names of the backends that can run some call on the host or on a device."""
    out = []
    for cand in _ORDER:
        mod = load(cand)
        if mod is not None and any(
                not mod.supports(dtype=dt, head_dim=64, head_dim_v=64, on_device=on_device)
                for dt in ("float32", "float16", "bfloat16")):
            out.append(cand)
    return out
