"""PyTorch adapter: `varlen_attention`, a differentiable `torch.library` custom op.

    import varlen.torch
    out = varlen.torch.varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, mask="causal")
    out.sum().backward()

Two custom ops carry the work, `torch.ops.varlen.attention_forward` and
`torch.ops.varlen.attention_backward`; both call the validated public functions
(`varlen.attention_forward` / `varlen.attention_backward`) and hold no attention math. Their fake
implementations give output shapes and dtypes, so `torch.compile(fullgraph=True)` traces through
them without graph breaks, and `register_autograd` wires the backward op into autograd.

CPU tensors run on the NumPy backend (zero-copy through `Tensor.numpy()`); CUDA tensors on the
fastest GPU backend, on the tensor's device and PyTorch's current stream (which the core API
makes CuPy's current stream), so the call is ordered with the surrounding PyTorch work and never
synchronises the host. See `docs/frameworks.md`.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import numpy as np
import torch

from ._api import attention_backward, attention_forward
from ._array import bfloat16_dtype
from ._setup import static_scalars
from ._validate import check_qkv
from .masks import Mask, as_mask

__all__ = ["varlen_attention"]

_MASK_FIELDS = ("window_left", "window_right", "bottom_right")


# --------------------------------------------------------------------------------------------
# The custom ops
# --------------------------------------------------------------------------------------------

def _mask(arrays, scalars) -> Mask:
    """Rebuild the `Mask` from its op arguments: a tensor where given, else the int."""
    return Mask(*(s if a is None else a for a, s in zip(arrays, scalars)))


def _on_device_of(x: torch.Tensor):
    """CuPy's current device := `x`'s CUDA device (a no-op for CPU tensors).

    The core API makes PyTorch's current stream CuPy's current stream for torch inputs, so
    DLPack exchanges and launches are ordered on it without host synchronisation; CuPy launches
    on its current device, which must be the tensor's.
    """
    if x.device.type != "cuda":
        return contextlib.nullcontext()
    import cupy
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    return cupy.cuda.Device(index)


@torch.library.custom_op("varlen::attention_forward", mutates_args=())
def _forward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                cu_seqlens_k: torch.Tensor, seq_offsets_q: Optional[torch.Tensor],
                seq_offsets_k: Optional[torch.Tensor], window_left: Optional[torch.Tensor],
                window_right: Optional[torch.Tensor], bottom_right: Optional[torch.Tensor],
                window_left_int: int, window_right_int: int, bottom_right_int: int,
                softmax_scale: Optional[float], softcap: float, max_seqlen_q: Optional[int],
                max_seqlen_k: Optional[int], backend: Optional[str],
                deterministic: bool) -> tuple[torch.Tensor, torch.Tensor]:
    # `deterministic` only matters to the backward; it is an input here so that the autograd
    # context can read it.
    mask = _mask((window_left, window_right, bottom_right),
                 (window_left_int, window_right_int, bottom_right_int))
    with _on_device_of(q):
        out, lse = attention_forward(
            q, k, v, cu_seqlens_q, cu_seqlens_k, seq_offsets_q=seq_offsets_q,
            seq_offsets_k=seq_offsets_k, mask=mask, softmax_scale=softmax_scale,
            softcap=softcap, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
            backend=backend)
    # The fake implementation promises contiguous outputs; hold the real one to it.
    return out.contiguous(), lse.contiguous()


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


@_forward_op.register_fake
def _forward_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, seq_offsets_q, seq_offsets_k,
                  window_left, window_right, bottom_right, window_left_int, window_right_int,
                  bottom_right_int, softmax_scale, softcap, max_seqlen_q, max_seqlen_k, backend,
                  deterministic):
    Tq, Hq, _ = q.shape
    out = q.new_empty((Tq, Hq, v.shape[2]))
    lse = q.new_empty((Hq, Tq), dtype=_lse_dtype(q.dtype))
    return out, lse


@torch.library.custom_op("varlen::attention_backward", mutates_args=())
def _backward_op(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 out: torch.Tensor, lse: torch.Tensor, cu_seqlens_q: torch.Tensor,
                 cu_seqlens_k: torch.Tensor, seq_offsets_q: Optional[torch.Tensor],
                 seq_offsets_k: Optional[torch.Tensor], window_left: Optional[torch.Tensor],
                 window_right: Optional[torch.Tensor], bottom_right: Optional[torch.Tensor],
                 window_left_int: int, window_right_int: int, bottom_right_int: int,
                 softmax_scale: Optional[float], softcap: float, max_seqlen_q: Optional[int],
                 max_seqlen_k: Optional[int], backend: Optional[str],
                 deterministic: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    mask = _mask((window_left, window_right, bottom_right),
                 (window_left_int, window_right_int, bottom_right_int))
    with _on_device_of(q):
        grads = attention_backward(
            dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seq_offsets_q=seq_offsets_q,
            seq_offsets_k=seq_offsets_k, mask=mask, softmax_scale=softmax_scale,
            softcap=softcap, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
            backend=backend, deterministic=deterministic)
    return tuple(g.contiguous() for g in grads)


@_backward_op.register_fake
def _backward_fake(dout, q, k, v, *args):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


# Inputs of the forward op after q, k, v (metadata and flags): they get no gradient.
_NUM_META_INPUTS = 16


def _setup_context(ctx, inputs, output):
    q, k, v, cu_q, cu_k, off_q, off_k, wl, wr, br = inputs[:10]
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, off_q, off_k, wl, wr, br)
    ctx.flags = inputs[10:]
    # lse is returned for inspection and LSE merging; it carries no gradient.
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse, *meta = ctx.saved_tensors
    # The incoming gradient may be an expanded (stride-0) view, e.g. from `out.sum()`.
    dq, dk, dv = _backward_op(dout.contiguous(), q, k, v, out, lse, *meta, *ctx.flags)
    return (dq, dk, dv) + (None,) * _NUM_META_INPUTS


_forward_op.register_autograd(_backward, setup_context=_setup_context)


# --------------------------------------------------------------------------------------------
# The public function
# --------------------------------------------------------------------------------------------

def _np_dtype(dtype: torch.dtype):
    """The NumPy dtype of a torch dtype, for the core's dtype checks (bfloat16: ml_dtypes)."""
    if dtype == torch.bfloat16:
        return bfloat16_dtype() or np.dtype("V2")
    try:
        return np.dtype(str(dtype).removeprefix("torch."))
    except TypeError:
        return np.dtype("V1")     # float8 and friends: rejected by the check as a non-float dtype


class _Spec:
    """Shape and dtype of a tensor in the form the core's `check_qkv` reads (no data)."""

    def __init__(self, x: torch.Tensor):
        self.shape = tuple(x.shape)
        self.ndim = x.dim()
        self.dtype = _np_dtype(x.dtype)


def _tensor_arg(x, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def _index_tensor(x, name: str, length=None) -> Optional[torch.Tensor]:
    """An integer 1-D metadata tensor (arrays and lists are turned into one, int32)."""
    if x is None:
        return None
    if not isinstance(x, torch.Tensor):
        a = np.asarray(x)
        if a.dtype.kind not in "iu":
            raise TypeError(f"{name} must hold integers (int32), got dtype {a.dtype}")
        x = torch.from_numpy(a.astype(np.int32))
    if x.dim() != 1:
        raise ValueError(f"{name} must be a 1-D array, got shape {tuple(x.shape)}")
    if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
        raise TypeError(f"{name} must hold integers (int32), got dtype {x.dtype}")
    if length is not None and x.shape[0] != length:
        raise ValueError(f"{name} has {x.shape[0]} entries; expected {length}")
    return x


def _mask_args(mask, batch: int):
    """`mask` as three optional tensors and three ints (a tensor overrides its int)."""
    m = as_mask(mask)
    arrays, scalars = [], []
    for name, f in zip(_MASK_FIELDS, m.fields()):
        if isinstance(f, (bool, int, np.integer, np.bool_)):
            arrays.append(None)
            scalars.append(int(f))
            continue
        if not isinstance(f, torch.Tensor):
            a = np.asarray(f)
            if a.ndim == 0:
                arrays.append(None)
                scalars.append(int(a))
                continue
            if a.dtype.kind not in "iub":
                raise TypeError(f"mask.{name} must be int32 or bool, got dtype {a.dtype}")
            f = torch.from_numpy(a.astype(np.int32))
        if f.dim() > 1 or (f.dim() == 1 and f.shape[0] != batch):
            raise ValueError(f"mask.{name} has shape {tuple(f.shape)}; expected a scalar or "
                             f"[{batch}] (one entry per sequence)")
        if f.dtype.is_floating_point or f.dtype.is_complex:
            raise TypeError(f"mask.{name} must be int32 or bool, got dtype {f.dtype}")
        arrays.append(f)
        scalars.append(0)
    return arrays, scalars


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, *, seq_offsets_q=None,
                     seq_offsets_k=None, mask="full", softmax_scale=None, softcap=0.0,
                     max_seqlen_q=None, max_seqlen_k=None, backend=None, deterministic=False,
                     return_lse=False):
    """Attention over a packed variable-length batch, differentiable in q, k and v.

    Args:
        q: `[Tq, Hq, D]` float16, bfloat16, float32 (float64 on the CPU).
        k: `[Tk, Hk, D]`, q's dtype and device; `Hq % Hk == 0` (query head h reads key head
            `h // (Hq // Hk)`: GQA/MQA).
        v: `[Tk, Hk, Dv]`, q's dtype and device.
        cu_seqlens_q, cu_seqlens_k: int32 `[B+1]` tensors on q's device, start at 0,
            non-decreasing; sequence b has `Lq[b] = cu_seqlens_q[b+1] - cu_seqlens_q[b]`
            queries (`Lk[b]` keys). Zero lengths are legal.
        seq_offsets_q, seq_offsets_k: optional int32 `[B+1]`; sequence b occupies rows
            `[off[b], off[b] + L[b])`. Rows outside every sequence are padding: output 0,
            gradient 0, never a key.
        mask: `"full"`, `"causal"`, `"causal_bottom_right"` or a `varlen.Mask` whose fields are
            Python ints or int32/bool `[B]` tensors (one policy per sequence). Query i sees
            key j iff `(left < 0 or j >= i + s - left) and (right < 0 or j <= i + s + right)`
            with `s = Lk - Lq` when bottom_right else 0. For Lq=2, Lk=5, causal::

                top-left (s=0)     bottom-right (s=3)
                x . . . .          x x x x .
                x x . . .          x x x x x

        softmax_scale: float, scale of `q @ k^T`; default `1/sqrt(D)`.
        softcap: float; if > 0, scores become `softcap * tanh(scores / softcap)`.
        max_seqlen_q, max_seqlen_k: optional host ints bounding the lengths (smaller tile
            tables; checked when validation is on).
        backend: `"numpy"`, `"numba"`, `"cupy"` or None (NumPy for CPU tensors, the fastest
            GPU backend for CUDA tensors).
        deterministic: bool, bitwise-repeatable backward (device backends accumulate dQ with
            atomics otherwise).
        return_lse: also return the log-sum-exp.

    Returns:
        out: `[Tq, Hq, Dv]` in q's dtype and device.
        lse (with `return_lse=True`): `[Hq, Tq]` natural-log sum of exp of the scores, float32
            (float64 for float64 inputs); `-inf` for padding rows and for queries with no
            visible key (whose output is 0, never NaN). It carries no gradient.
    """
    q, k, v = _tensor_arg(q, "q"), _tensor_arg(k, "k"), _tensor_arg(v, "v")
    check_qkv(_Spec(q), _Spec(k), _Spec(v))
    for name, x in (("k", k), ("v", v)):
        if x.device != q.device:
            raise ValueError(f"{name} is on {x.device} but q is on {q.device}; all arrays "
                             f"must live on one device")
    cu_q = _index_tensor(cu_seqlens_q, "cu_seqlens_q")
    if cu_q.shape[0] == 0:
        raise ValueError("cu_seqlens_q is empty; expected [B+1] entries starting at 0")
    n = cu_q.shape[0]
    cu_k = _index_tensor(cu_seqlens_k, "cu_seqlens_k")
    if cu_k.shape[0] != n:
        raise ValueError(f"cu_seqlens_q has {n} entries and cu_seqlens_k {cu_k.shape[0]}; "
                         f"both must be [B+1] for the same B")
    off_q = _index_tensor(seq_offsets_q, "seq_offsets_q", n)
    off_k = _index_tensor(seq_offsets_k, "seq_offsets_k", n)
    arrays, scalars = _mask_args(mask, n - 1)
    softmax_scale, softcap, max_seqlen_q, max_seqlen_k, backend, deterministic = static_scalars(
        softmax_scale, softcap, max_seqlen_q, max_seqlen_k, backend, deterministic)
    out, lse = _forward_op(q, k, v, cu_q, cu_k, off_q, off_k, *arrays, *scalars, softmax_scale,
                           float(softcap), max_seqlen_q, max_seqlen_k, backend,
                           bool(deterministic))
    return (out, lse) if return_lse else out
