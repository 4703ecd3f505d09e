"""Attention sinks: one learnable logit per query head that joins every row's softmax.

With `sinks[h]` (gpt-oss), a row of query head h normalises over its visible keys and one extra
logit that contributes no value (not scaled, not soft-capped):

    lse' = log(exp(lse) + exp(sinks[h]))        out' = out * exp(lse - lse')

where `(out, lse)` is the row's attention over its keys alone. That is the merge of two partial
results over disjoint key sets (`varlen.comm`'s `merge_partial`), the sink being a part of its
own with output 0; so every backend, and every context-parallel method after its final merge,
adds it the same way: here, once per row, after the kernels. A row with no visible key gets
out 0 and lse = sinks[h]; padding rows keep out 0 and lse -inf.

The backward needs nothing of the kernels: given the forward's `lse'` and `out'`, their
`P = exp(s - lse')` is already normalised with the sink in, and `D = rowsum(dout * out')` is the
same; the sink's own gradient is

    dsinks[h] = -sum over rows of exp(sinks[h] - lse') * D,

accumulated in float32 (float64 for float64 data) by a fixed-order reduction: bitwise
repeatable on every backend.
"""
from __future__ import annotations

import numpy as np

from ._array import array_module, to_working
from ._validate import check_together, dtype_name

__all__ = ["working_sinks", "add_sinks", "sink_grads"]


def working_sinks(sinks, q, heads_q: int, xp):
    """`sinks` as a working float array `[Hq]` of `xp` (float32, float64 for float64 q), checked
    to come from q's framework and device; None stays None."""
    if sinks is None:
        return None
    check_together([("q", q), ("sinks", sinks)])
    w = to_working(sinks, "sinks")
    if array_module(w) is not xp:
        raise TypeError(f"sinks lives on the {'device' if xp is np else 'host'} but q on the "
                        f"{'host' if xp is np else 'device'}")
    name = dtype_name(w.dtype)
    if name not in ("float16", "bfloat16", "float32", "float64"):
        raise TypeError(f"sinks must be a float array (one logit per query head), got dtype "
                        f"{name}")
    if tuple(w.shape) != (heads_q,):
        raise ValueError(f"sinks must have shape [Hq] = [{heads_q}] (one logit per query head), "
                         f"got {list(w.shape)}")
    acc = np.float64 if dtype_name(to_working(q, "q").dtype) == "float64" else np.float32
    return xp.ascontiguousarray(w.astype(acc))


def add_sinks(out, lse, sinks, valid, xp=None):
    """`(out', lse')`: the sinks joined to a finished forward's rows.

    out `[T, Hq, Dv]`, lse `[Hq, T]`, sinks `[Hq]`, valid bool `[T]` (rows that hold a token;
    the others, padding, are left as they are). Returns arrays of out's and lse's dtypes; the
    arithmetic runs in sinks' dtype. NaN rows stay NaN. `xp`: the arrays' module (default:
    NumPy or CuPy, from `out`; `jax.numpy` inside a traced function).
    """
    xp = xp or array_module(out)
    acc = sinks.dtype
    with np.errstate(all="ignore"):
        lse_a = lse.astype(acc)
        s = sinks[:, None]
        top = xp.maximum(lse_a, s)
        m = xp.where(xp.isneginf(top), acc.type(0), top)
        w_row, w_sink = xp.exp(lse_a - m), xp.exp(s - m)
        total = w_row + w_sink
        seen = total > 0
        safe = xp.where(seen, total, acc.type(1))
        new_lse = xp.where(seen & valid[None, :], m + xp.log(safe), lse_a)
        # padding rows keep their output (weight 1); one pass over out
        weight = xp.where(valid[None, :], w_row / safe, acc.type(1)).T[:, :, None]
        new_out = (out * weight.astype(out.dtype)) if out.dtype == acc else \
            (out.astype(acc) * weight).astype(out.dtype)
    return new_out, new_lse.astype(lse.dtype)


def sink_grads(dout, out, lse, sinks, valid, xp=None):
    """`dsinks [Hq]` (sinks' dtype) of `sum(out * dout)`, from the forward's `out` and `lse`
    (sinks included): `-sum_rows exp(sinks[h] - lse) * rowsum(dout * out)`. Padding rows (not
    `valid`) add nothing whatever they hold; a row whose `dout * out` is not finite makes its
    head's gradient NaN (as `varlen.reference` says). `xp` as for `add_sinks`."""
    xp = xp or array_module(out)
    acc = sinks.dtype
    with np.errstate(all="ignore"):
        d = xp.einsum("thd,thd->ht", dout.astype(acc, copy=False),
                      out.astype(acc, copy=False))                       # [Hq, T]
        d = xp.where(xp.isfinite(d), d, acc.type(np.nan))
        lse_a = lse.astype(acc)
        p = xp.where(xp.isneginf(lse_a), acc.type(0), xp.exp(sinks[:, None] - lse_a))
        return -xp.where(valid[None, :], p * d, acc.type(0)).sum(axis=1)
