"""Input checks. Shape, dtype and device checks always run; value checks (which read
`cu_seqlens` and friends) run when validation is on: by default for host data, never for device
data unless `set_validation(True)` asks for the synchronising read.
"""
from __future__ import annotations

import contextvars
import math
import numbers

import numpy as np

from ._array import bfloat16_dtype, host_copy, to_working

__all__ = ["set_validation", "validation_enabled", "validation_mode", "check_qkv",
           "as_index_array", "as_policy_array", "check_layout_values", "check_backward_inputs",
           "check_bound", "scale_and_softcap", "dtype_name", "FLOAT_DTYPES"]

FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")

# --------------------------------------------------------------------------------------------
# The validation mode: per thread and per context
# --------------------------------------------------------------------------------------------

# None: host data only; True: always (device data: synchronising reads); False: never.
_MODE: contextvars.ContextVar = contextvars.ContextVar("varlen_validation", default=None)


class _Previous:
    """What `set_validation` returns: the previous mode (it compares equal to it) and a context
    manager that restores it on exit."""

    __slots__ = ("mode",)

    def __init__(self, mode):
        self.mode = mode

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        _MODE.set(self.mode)
        return False

    def __eq__(self, other):
        return self.mode == (other.mode if isinstance(other, _Previous) else other)

    def __hash__(self):
        return hash(self.mode)

    def __bool__(self):
        return bool(self.mode)

    def __repr__(self):
        return repr(self.mode)


def set_validation(enabled):
    """Turn value checks on (`True`), off (`False`) or back to the default (`None`).

    The default checks host (NumPy) inputs and skips checks that would need a host read of
    device memory, so device calls stay free of synchronisation. The mode belongs to the
    current thread and `contextvars` context (a new thread starts from the default), so one
    thread's setting never reaches another thread's calls.

    Returns the previous mode (equal to `True`, `False` or `None`; pass it back to restore it),
    which is also a context manager::

        with varlen.set_validation(False):
            ...                                     # the previous mode is back on exit
    """
    if isinstance(enabled, _Previous):
        enabled = enabled.mode
    if not (enabled is None or isinstance(enabled, (bool, np.bool_))):
        raise TypeError(f"set_validation expects True, False or None, got {enabled!r}")
    previous = _Previous(_MODE.get())
    _MODE.set(None if enabled is None else bool(enabled))
    return previous


def validation_mode():
    """The current thread's and context's mode: True, False or None (the default)."""
    return _MODE.get()


def validation_enabled(on_device: bool) -> bool:
    mode = _MODE.get()
    return (not on_device) if mode is None else mode


def dtype_name(dtype) -> str:
    dt = np.dtype(dtype)
    bf = bfloat16_dtype()
    if bf is not None and dt == bf:
        return "bfloat16"
    return dt.name


def check_qkv(q, k, v):
    """Shapes and dtypes of q, k, v; returns `(Tq, Hq, D, Tk, Hk, Dv)`."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 3:
            raise ValueError(f"{name} must be 3-D [T, H, D] (packed THD layout), got shape "
                             f"{tuple(x.shape)}")
        dn = dtype_name(x.dtype)
        if dn not in FLOAT_DTYPES:
            raise TypeError(f"{name} has dtype {dn}; expected one of {', '.join(FLOAT_DTYPES)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share one dtype, got {dtype_name(q.dtype)}, "
                        f"{dtype_name(k.dtype)} and {dtype_name(v.dtype)}")
    Tq, Hq, D = q.shape
    Tk, Hk, Dk = k.shape
    if Dk != D:
        raise ValueError(f"q.shape={tuple(q.shape)} and k.shape={tuple(k.shape)} disagree on "
                         f"head dim")
    if v.shape[0] != Tk:
        raise ValueError(f"k.shape={tuple(k.shape)} and v.shape={tuple(v.shape)} disagree on "
                         f"rows; k and v must hold the same tokens")
    if v.shape[1] != Hk:
        raise ValueError(f"k.shape={tuple(k.shape)} and v.shape={tuple(v.shape)} disagree on "
                         f"heads")
    if Hk == 0 or Hq % Hk != 0:
        raise ValueError(f"q has {Hq} heads and k has {Hk}; q heads must be a multiple of k "
                         f"heads (GQA/MQA)")
    if D == 0 or v.shape[2] == 0:
        raise ValueError(f"head dims must be positive, got D={D} and Dv={v.shape[2]}")
    return Tq, Hq, D, Tk, Hk, v.shape[2]


def as_index_array(x, name: str, xp, length=None):
    """An int32 1-D metadata array in module `xp` (host metadata moves to the device)."""
    a = to_working(x, name)
    if a.ndim != 1:
        raise ValueError(f"{name} must be a 1-D array, got shape {tuple(a.shape)}")
    if np.dtype(a.dtype).kind not in "iu":
        raise TypeError(f"{name} must hold integers (int32), got dtype {dtype_name(a.dtype)}")
    if length is not None and a.shape[0] != length:
        raise ValueError(f"{name} has {a.shape[0]} entries; expected {length}")
    if xp is np and not isinstance(a, np.ndarray):
        raise ValueError(f"{name} lives on a CUDA device but the attention inputs are on the "
                         f"host; pass host metadata with host data")
    if xp is not np and isinstance(a, np.ndarray):
        a = xp.asarray(a)
    return a.astype(np.int32, copy=False)


def as_policy_array(x, name: str, xp, batch: int):
    """A per-sequence mask field: a scalar stays a scalar, an array becomes int32 `[B]`."""
    if isinstance(x, (bool, int, np.integer, np.bool_)):
        return int(x)
    a = to_working(x, f"mask.{name}")
    if a.ndim == 0:
        return int(host_copy(a))
    if a.ndim != 1 or a.shape[0] != batch:
        raise ValueError(f"mask.{name} has shape {tuple(a.shape)}; expected a scalar or "
                         f"[{batch}] (one entry per sequence)")
    if np.dtype(a.dtype).kind not in "iub":
        raise TypeError(f"mask.{name} must be int32 or bool, got dtype {dtype_name(a.dtype)}")
    if xp is np and not isinstance(a, np.ndarray):
        raise ValueError(f"mask.{name} lives on a CUDA device but the attention inputs are on "
                         f"the host")
    if xp is not np and isinstance(a, np.ndarray):
        a = xp.asarray(a)
    return a.astype(np.int32)


def check_layout_values(cu, off, num_rows: int, max_seqlen=None, side: str = "", *,
                        rows_name=None):
    """Value checks of one side's layout (host reads).

    `side` ("q", "k" or "") suffixes the argument names (`cu_seqlens_q`, `seq_offsets_q`);
    `rows_name` says what `num_rows` counts, for the messages.
    """
    sfx = f"_{side}" if side else ""
    cu_name, off_name = f"cu_seqlens{sfx}", f"seq_offsets{sfx}"
    if rows_name is None:
        rows_name = f"the {num_rows} rows of {'k/v' if side == 'k' else 'q'}"
    c = host_copy(cu).astype(np.int64)
    if c.shape[0] == 0:
        raise ValueError(f"{cu_name} is empty; expected [B+1] entries starting at 0")
    if c[0] != 0:
        raise ValueError(f"{cu_name}[0] is {c[0]}; cu_seqlens must start at 0")
    lengths = np.diff(c)
    if (lengths < 0).any():
        b = int(np.argmax(lengths < 0))
        raise ValueError(f"{cu_name} must be non-decreasing, but {cu_name}[{b + 1}]={c[b + 1]} "
                         f"< {cu_name}[{b}]={c[b]}")
    if max_seqlen is not None and lengths.size and lengths.max() > max_seqlen:
        b = int(np.argmax(lengths))
        raise ValueError(f"sequence {b} has {lengths[b]} rows but max_seqlen{sfx}={max_seqlen}")
    if off is None:
        if c[-1] > num_rows:
            raise ValueError(f"{cu_name}[-1]={c[-1]} exceeds {rows_name}")
        return
    o = host_copy(off).astype(np.int64)
    if o[0] < 0:
        raise ValueError(f"{off_name}[0]={o[0]} is negative")
    room = np.diff(o)
    if (room < lengths).any():
        b = int(np.argmax(room < lengths))
        raise ValueError(f"{off_name} is too tight: sequence {b} has {lengths[b]} rows but "
                         f"{off_name}[{b + 1}] - {off_name}[{b}] = {room[b]}")
    if o[-1] > num_rows:
        raise ValueError(f"{off_name}[-1]={o[-1]} exceeds {rows_name}")


def check_bound(name: str, value):
    """An optional host-known bound (`max_seqlen_*`, `num_rows_*`): None or an int >= 0."""
    if value is None:
        return None
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 0:
        raise TypeError(f"{name} must be a non-negative int (a host-known bound), got {value!r}")
    return int(value)


def scale_and_softcap(softmax_scale, softcap, head_dim=None):
    """`(softmax_scale, softcap)` as checked floats; the scale defaults to `1/sqrt(head_dim)`
    (it stays None when the head dim is not known yet)."""
    if softmax_scale is None and head_dim is not None:
        softmax_scale = 1.0 / math.sqrt(head_dim)
    if softmax_scale is not None:
        if not isinstance(softmax_scale, numbers.Real) or isinstance(softmax_scale, bool):
            raise TypeError(f"softmax_scale must be a float, got {softmax_scale!r}")
        softmax_scale = float(softmax_scale)
        if not math.isfinite(softmax_scale):
            raise ValueError(f"softmax_scale must be finite, got {softmax_scale}")
    softcap = softcap or 0.0
    if not isinstance(softcap, numbers.Real) or isinstance(softcap, bool):
        raise TypeError(f"softcap must be a float, got {softcap!r}")
    softcap = float(softcap)
    if not (softcap >= 0.0 and math.isfinite(softcap)):
        raise ValueError(f"softcap must be a finite number >= 0 (0 disables it), got {softcap}")
    return softmax_scale, softcap


def check_backward_inputs(q, v, dout, out, lse, rows: str = "Tq"):
    """`dout` and `out` must be `[Tq, Hq, Dv]` in q's dtype and `lse` floating `[Hq, Tq]`.

    `rows` names the query rows in the messages (`Tq_local` for a context-parallel shard).
    """
    Tq, Hq, _ = q.shape
    Dv = v.shape[2]
    for name, a in (("dout", dout), ("out", out)):
        if tuple(a.shape) != (Tq, Hq, Dv):
            raise ValueError(f"{name} has shape {tuple(a.shape)}; expected [{rows}, Hq, Dv] = "
                             f"{(Tq, Hq, Dv)}")
        if a.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {dtype_name(a.dtype)}; expected q's dtype "
                            f"{dtype_name(q.dtype)}")
    if tuple(lse.shape) != (Hq, Tq):
        raise ValueError(f"lse has shape {tuple(lse.shape)}; expected [Hq, {rows}] = "
                         f"{(Hq, Tq)}")
    if np.dtype(lse.dtype).kind != "f":
        raise TypeError(f"lse must be floating point, got {dtype_name(lse.dtype)}")
