"""What the host backends (`numpy`, `cpu`) share: the questions they answer alike and the
buffers their forward starts from.

A host backend runs on NumPy arrays and host plans, for every float dtype; its forward and
backward are the module functions it names (`run_forward`, `run_backward`), called with the
plan and the arrays the setup step prepared.
"""
from __future__ import annotations

import numpy as np

from .._array import alloc
from ..plan import Plan
from .base import Backend

__all__ = ["HostBackend", "DTYPES", "forward_buffers"]

DTYPES = ("float16", "bfloat16", "float32", "float64")


class HostBackend(Backend):
    """A backend on the host: it declines device arrays and device plans; `forward` and
    `backward` call the subclass's `run_forward` and `run_backward` (static functions with
    the signatures of `Backend.forward` and `Backend.backward`, less `self`)."""

    run_forward = None
    run_backward = None

    def supports(self, call):
        if call.on_device:
            return f"the {self.name} backend runs on the host; the arrays live on a CUDA device"
        if call.dtype not in DTYPES:
            return f"dtype {call.dtype} is not supported (expected one of {', '.join(DTYPES)})"
        return self.supports_host(call)

    def supports_host(self, call) -> str | None:
        """What a subclass adds to `supports` for host arrays of a supported dtype."""
        return None

    def check_plan(self, plan: Plan):
        if not plan.on_host:
            return "its arrays live on a device; build it from host cu_seqlens for host data"
        return None

    def forward(self, plan, q, k, v, *, softmax_scale, softcap, mods=None, dropout=None):
        extra = {"mods": mods} if mods else {}
        if dropout is not None:
            extra["dropout"] = dropout
        return type(self).run_forward(plan, q, k, v, softmax_scale=softmax_scale,
                                      softcap=softcap, **extra)

    def backward(self, plan, dout, q, k, v, out, lse, *, softmax_scale, softcap,
                 deterministic=False, mods=None, dropout=None):
        extra = {"mods": mods} if mods else {}
        if dropout is not None:
            extra["dropout"] = dropout
        return type(self).run_backward(plan, dout, q, k, v, out, lse,
                                       softmax_scale=softmax_scale, softcap=softcap,
                                       deterministic=deterministic, **extra)


def forward_buffers(plan: Plan, q, Dv: int, *, out_dtype, lse_dtype):
    """`(out [Tq, Hq, Dv] in out_dtype, lse [Hq, Tq] in lse_dtype)`, fresh, with the rows
    outside every segment (padding) already written: output 0, lse -inf (no visible key)."""
    Tq, Hq, _ = q.shape
    out = alloc(np, (Tq, Hq, Dv), out_dtype, cached=True)
    lse = alloc(np, (Hq, Tq), lse_dtype, cached=True)
    pad = ~plan.q.covered()
    out[pad] = 0
    lse[:, pad] = -np.inf
    return out, lse
