"""The validated public functions: arrays in from any framework, a backend call, arrays out."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import backends
from ._array import Origin, array_module, common_origin, host_copy, to_working
from ._validate import (as_index_array, as_policy_array, check_backward_inputs, check_bound,
                        check_layout_values, check_qkv, dtype_name, scale_and_softcap,
                        validation_enabled)
from .masks import Mask, as_mask
from .plan import Plan, build_plan, segments_from_cu_seqlens

__all__ = ["attention_forward", "attention_backward", "attention", "make_plan"]


def working_mask(mask, batch: int, xp) -> Mask:
    """The mask with every per-sequence field as a scalar or an int32 `[B]` array in `xp`."""
    m = as_mask(mask)
    names = ("window_left", "window_right", "bottom_right")
    return Mask(*(as_policy_array(f, n, xp, batch) for n, f in zip(names, m.fields())))


def _layout(xp, cu_seqlens_q, cu_seqlens_k, seq_offsets_q, seq_offsets_k):
    cu_q = as_index_array(cu_seqlens_q, "cu_seqlens_q", xp)
    cu_k = as_index_array(cu_seqlens_k, "cu_seqlens_k", xp)
    if cu_q.shape[0] == 0:
        raise ValueError("cu_seqlens_q is empty; expected [B+1] entries starting at 0")
    if cu_q.shape[0] != cu_k.shape[0]:
        raise ValueError(f"cu_seqlens_q has {cu_q.shape[0]} entries and cu_seqlens_k "
                         f"{cu_k.shape[0]}; both must be [B+1] for the same B")
    B = cu_q.shape[0] - 1
    off_q = None if seq_offsets_q is None else as_index_array(
        seq_offsets_q, "seq_offsets_q", xp, length=B + 1)
    off_k = None if seq_offsets_k is None else as_index_array(
        seq_offsets_k, "seq_offsets_k", xp, length=B + 1)
    return B, cu_q, cu_k, off_q, off_k


def make_plan(cu_seqlens_q, cu_seqlens_k, *, seq_offsets_q=None, seq_offsets_k=None,
              mask="full", num_rows_q=None, num_rows_k=None, max_seqlen_q=None,
              max_seqlen_k=None, block_m=64, block_n=64) -> Plan:
    """`varlen.plan`: see its docstring."""
    probe = to_working(cu_seqlens_q, "cu_seqlens_q")
    xp = array_module(probe) if np.ndim(probe) else np
    on_device = xp is not np
    B, cu_q, cu_k, off_q, off_k = _layout(xp, cu_seqlens_q, cu_seqlens_k, seq_offsets_q,
                                          seq_offsets_k)
    max_seqlen_q = check_bound("max_seqlen_q", max_seqlen_q)
    max_seqlen_k = check_bound("max_seqlen_k", max_seqlen_k)
    rows = []
    for side, n, cu, off in (("q", num_rows_q, cu_q, off_q), ("k", num_rows_k, cu_k, off_k)):
        if n is None:
            if on_device:
                raise ValueError(f"num_rows_{side} is required for device cu_seqlens: it sizes "
                                 f"the plan without reading device memory")
            n = int(host_copy(off if off is not None else cu)[-1])
        rows.append(check_bound(f"num_rows_{side}", n))
    for name, blk in (("block_m", block_m), ("block_n", block_n)):
        if not isinstance(blk, (int, np.integer)) or blk <= 0:
            raise ValueError(f"{name} must be a positive int, got {blk!r}")
    if validation_enabled(on_device):
        check_layout_values(cu_q, off_q, rows[0], max_seqlen_q, "q")
        check_layout_values(cu_k, off_k, rows[1], max_seqlen_k, "k")
    return build_plan(segments_from_cu_seqlens(cu_q, off_q, rows[0]),
                      segments_from_cu_seqlens(cu_k, off_k, rows[1]),
                      working_mask(mask, B, xp), block_m=int(block_m), block_n=int(block_n),
                      max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)


@dataclass
class _Call:
    origin: Origin
    q: object
    k: object
    v: object
    plan: Plan
    backend: object
    softmax_scale: float
    softcap: float


def _prepare(q, k, v, cu_seqlens_q, cu_seqlens_k, *, seq_offsets_q, seq_offsets_k, mask,
             softmax_scale, softcap, max_seqlen_q, max_seqlen_k, backend, plan,
             extra=()) -> tuple[_Call, list]:
    origin = common_origin([("q", q), ("k", k), ("v", v), *extra])
    qw, kw, vw = to_working(q, "q"), to_working(k, "k"), to_working(v, "v")
    Tq, Hq, D, Tk, Hk, Dv = check_qkv(qw, kw, vw)
    xp = array_module(qw)
    on_device = xp is not np
    mod = backends.select(backend, dtype=dtype_name(qw.dtype), head_dim=D, head_dim_v=Dv,
                          on_device=on_device)
    B, cu_q, cu_k, off_q, off_k = _layout(xp, cu_seqlens_q, cu_seqlens_k, seq_offsets_q,
                                          seq_offsets_k)
    max_seqlen_q = check_bound("max_seqlen_q", max_seqlen_q)
    max_seqlen_k = check_bound("max_seqlen_k", max_seqlen_k)
    wmask = working_mask(mask, B, xp)
    if validation_enabled(on_device):
        check_layout_values(cu_q, off_q, Tq, max_seqlen_q, "q")
        check_layout_values(cu_k, off_k, Tk, max_seqlen_k, "k")
    if plan is None:
        bm, bn = mod.default_blocks(dtype_name(qw.dtype), D)
        plan = getattr(mod, "make_plan", build_plan)(segments_from_cu_seqlens(cu_q, off_q, Tq),
                          segments_from_cu_seqlens(cu_k, off_k, Tk), wmask, block_m=bm,
                          block_n=bn, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
    else:
        _check_plan(plan, mod, B, Tq, Tk)
        if validation_enabled(on_device):
            _check_plan_matches(plan, segments_from_cu_seqlens(cu_q, off_q, Tq),
                                segments_from_cu_seqlens(cu_k, off_k, Tk), wmask)
    softmax_scale, softcap = scale_and_softcap(softmax_scale, softcap, D)
    extra_w = [to_working(x, n) for n, x in extra]
    return _Call(origin, qw, kw, vw, plan, mod, softmax_scale, softcap), extra_w


def _check_plan(plan, mod, B, Tq, Tk):
    if not isinstance(plan, Plan):
        raise TypeError(f"plan must be a varlen.Plan from varlen.plan(), got "
                        f"{type(plan).__name__}")
    if plan.batch != B:
        raise ValueError(f"plan covers {plan.batch} sequences but cu_seqlens has {B}")
    if plan.q.num_rows != Tq or plan.k.num_rows != Tk:
        raise ValueError(f"plan was built for {plan.q.num_rows} query and {plan.k.num_rows} key "
                         f"rows but q has {Tq} and k has {Tk}")
    why = mod.check_plan(plan)
    if why:
        raise ValueError(f"plan cannot be used by backend {mod.name!r}: {why}")


def _check_plan_matches(plan, q_seg, k_seg, mask):
    """A plan given with the call must describe the call's layout and mask (host reads)."""
    if plan.q.per_seq != 1 or plan.k.per_seq != 1:
        return      # a segment plan (context parallelism) is checked where it is built
    for side, mine, theirs in (("q", plan.q, q_seg), ("k", plan.k, k_seg)):
        for field in ("row", "length", "seqlen"):
            if not np.array_equal(host_copy(getattr(mine, field)),
                                  host_copy(getattr(theirs, field))):
                raise ValueError(f"plan was built for other cu_seqlens_{side}/seq_offsets_{side}"
                                 f" than this call's ({field} differs)")
    have = (plan.window_left, plan.window_right, plan.bottom_right)
    for name, got, want in zip(("window_left", "window_right", "bottom_right"), have,
                               mask.fields()):
        want = want if isinstance(want, int) else host_copy(want)
        if not np.array_equal(host_copy(got), np.broadcast_to(want, (plan.batch,))):
            raise ValueError(f"plan was built for another mask than this call's (mask.{name} "
                             f"differs)")


def attention_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, *, seq_offsets_q=None,
                      seq_offsets_k=None, mask="full", softmax_scale=None, softcap=0.0,
                      max_seqlen_q=None, max_seqlen_k=None, backend=None, plan=None):
    """Attention over a packed variable-length batch. Returns `(out, lse)`.

    Args:
        q: `[Tq, Hq, D]` float16, bfloat16, float32 (or float64 on the NumPy backend).
        k: `[Tk, Hk, D]`, same dtype; `Hq % Hk == 0` (query head h reads key head
            `h // (Hq // Hk)`: GQA/MQA).
        v: `[Tk, Hk, Dv]`, same dtype.
        cu_seqlens_q, cu_seqlens_k: int32 `[B+1]`, start at 0, non-decreasing; sequence b has
            `Lq[b] = cu_seqlens_q[b+1] - cu_seqlens_q[b]` queries (`Lk[b]` keys). Zero lengths
            are legal.
        seq_offsets_q, seq_offsets_k: optional int32 `[B+1]`; sequence b occupies rows
            `[off[b], off[b] + L[b])` (Transformer Engine's `cu_seqlens_*_padded`). Rows not
            covered by a sequence are padding: their output is 0 and they are never keys.
        mask: `"full"`, `"causal"`, `"causal_bottom_right"` or a `varlen.Mask` whose fields are
            scalars or per-sequence `[B]` arrays. Query i sees key j iff
            `(left < 0 or j >= i + s - left) and (right < 0 or j <= i + s + right)` with
            `s = Lk - Lq` when bottom_right else 0. For Lq=2, Lk=5, causal::

                top-left (s=0)     bottom-right (s=3)
                x . . . .          x x x x .
                x x . . .          x x x x x

        softmax_scale: scale of `q @ k^T`, default `1/sqrt(D)`.
        softcap: if > 0, scores become `softcap * tanh(scores / softcap)`.
        max_seqlen_q, max_seqlen_k: optional upper bounds on the lengths (host ints); they
            shrink the tile table and are checked when validation is on.
        backend: `"numpy"`, `"numba"`, `"cupy"` or None (the fastest that supports the call).
        plan: a `varlen.plan(...)` for this layout and mask, reused across calls and layers.

    Returns:
        out: `[Tq, Hq, Dv]` in q's dtype, in the caller's framework and device.
        lse: `[Hq, Tq]` natural-log sum of exp of the scores, float32 (float64 for float64
            inputs); `-inf` for padding rows and for queries with no visible key (whose output
            is 0, never NaN).
    """
    with Origin.of(q).stream_scope():
        call, _ = _prepare(q, k, v, cu_seqlens_q, cu_seqlens_k, seq_offsets_q=seq_offsets_q,
                           seq_offsets_k=seq_offsets_k, mask=mask, softmax_scale=softmax_scale,
                           softcap=softcap, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                           backend=backend, plan=plan)
        out, lse = call.backend.forward(call.plan, call.q, call.k, call.v,
                                        softmax_scale=call.softmax_scale, softcap=call.softcap)
        return call.origin.wrap(out), call.origin.wrap(lse)


def attention_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *,
                       seq_offsets_q=None, seq_offsets_k=None, mask="full", softmax_scale=None,
                       softcap=0.0, max_seqlen_q=None, max_seqlen_k=None, backend=None,
                       plan=None, deterministic=False):
    """Gradients of `sum(out * dout)` with respect to q, k, v. Returns `(dq, dk, dv)`.

    Args:
        dout: `[Tq, Hq, Dv]`, the gradient of the output, q's dtype.
        out, lse: what `attention_forward` returned for these inputs.
        deterministic: bitwise-repeatable accumulation of dQ (device backends use atomics
            otherwise; the NumPy backend is always deterministic).
        The other arguments are those of `attention_forward`, with the same values.

    Padding rows get zero gradients; so do queries with no visible key, and keys no query sees.
    """
    with Origin.of(q).stream_scope():
        return _backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                         seq_offsets_q=seq_offsets_q, seq_offsets_k=seq_offsets_k, mask=mask,
                         softmax_scale=softmax_scale, softcap=softcap,
                         max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                         backend=backend, plan=plan, deterministic=deterministic)


def _backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *, deterministic, **kw):
    call, (dout_w, out_w, lse_w) = _prepare(
        q, k, v, cu_seqlens_q, cu_seqlens_k, extra=(("dout", dout), ("out", out), ("lse", lse)),
        **kw)
    check_backward_inputs(call.q, call.v, dout_w, out_w, lse_w)
    dq, dk, dv = call.backend.backward(call.plan, dout_w, call.q, call.k, call.v, out_w, lse_w,
                                       softmax_scale=call.softmax_scale, softcap=call.softcap,
                                       deterministic=bool(deterministic))
    wrap = call.origin.wrap
    return wrap(dq), wrap(dk), wrap(dv)


def attention(q, k, v, cu_seqlens_q, cu_seqlens_k, **kw):
    """`attention_forward(...)[0]`: the output alone."""
    return attention_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, **kw)[0]
