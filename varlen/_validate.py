"""Input checks. Shape, dtype and device checks always run; value checks (which read
`cu_seqlens` and friends) run when validation is on: by default for host data, never for device
data unless `set_validation(True)` asks for the synchronising read.

The data-free checks read only `.shape`, `.ndim` and `.dtype` (through `spec_of`), so the same
function serves a NumPy array, a PyTorch tensor (fake and meta tensors too), a JAX array or
tracer and a CuPy array: `setup` runs them on the call's arrays, the adapters before their op
or trace, and `Mask` on its fields.
"""
from __future__ import annotations

import contextvars
import math
import numbers
from dataclasses import dataclass

import numpy as np

from ._array import _framework, array_module, bfloat16_dtype, host_copy, to_working
from ._device_errors import record

__all__ = ["set_validation", "validation_enabled", "validation_mode", "Spec", "spec_of",
           "check_specs", "check_qkv", "check_index", "check_policy", "is_policy_scalar",
           "policy_value", "as_index_array", "as_policy_array", "check_layout_values",
           "check_backward_inputs", "check_together", "check_metadata_devices", "check_bound", "scale_and_softcap", "dtype_name",
           "FLOAT_DTYPES", "INT32_MAX"]

FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
INT32_MIN, INT32_MAX = -2**31, 2**31 - 1

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


# --------------------------------------------------------------------------------------------
# Specs: what the data-free checks read of an array
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Spec:
    """Shape, dtype, framework and device of an array, read without touching its data."""

    shape: tuple
    dtype: str                # NumPy's name, or the framework's where NumPy has none (bfloat16)
    kind: str                 # NumPy's dtype kind; "f" for every floating type
    framework: str            # numpy (Python lists and scalars too), torch, jax, cupy, dlpack
    device: str | None        # "cpu", "cuda:0", ...; None where unknown without data (JAX)

    @property
    def ndim(self) -> int:
        return len(self.shape)


def _dtype_info(dtype) -> tuple[str, str]:
    """`(name, kind)` of a NumPy, JAX, CuPy or PyTorch dtype."""
    if type(dtype).__module__ == "torch":          # by name: no NumPy call while torch traces
        name = str(dtype).removeprefix("torch.")
        if name == "bool":
            return name, "b"
        if name.startswith(("int", "uint")):
            return name, name[0]
        return name, "f" if "float" in name else "c" if "complex" in name else "V"
    name = dtype_name(dtype)
    return name, "f" if name in FLOAT_DTYPES else np.dtype(dtype).kind


def _device(x, framework: str):
    if isinstance(x, (np.ndarray, np.generic)):
        return "cpu"
    if framework == "torch":
        return str(x.device)
    if framework == "cupy" or type(x).__module__.split(".")[0] == "cupy":
        return f"cuda:{x.device.id}"
    return None


def spec_of(x, name: str) -> Spec:
    """The `Spec` of `x` (NumPy, PyTorch, JAX, CuPy, a DLPack producer, a list or a number).

    Reads `.shape` and `.dtype` only (of anything that has them), so fake tensors and JAX
    tracers work; lists, numbers and a bare DLPack producer are viewed as an array first.
    Raises a TypeError naming `name` for anything else.
    """
    if isinstance(x, Spec):
        return x
    fw = _framework(x)
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        x = to_working(x, name)
        fw = "numpy" if fw == "python" else fw
    dtype, kind = _dtype_info(x.dtype)
    return Spec(tuple(x.shape), dtype, kind, fw, _device(x, fw))


# --------------------------------------------------------------------------------------------
# Data-free checks
# --------------------------------------------------------------------------------------------

def _check_together(specs: dict):
    """The data arrays come from one framework and live on one device."""
    (first, s0), *rest = specs.items()
    for name, s in rest:
        if s.framework != s0.framework:
            raise TypeError(f"{name} is a {s.framework} array but {first} is a {s0.framework} "
                            f"array; pass the data arrays from one framework")
        if s.device and s0.device and s.device != s0.device:
            raise ValueError(f"{name} is on {s.device} but {first} is on {s0.device}; all "
                             f"arrays must live on one device")


def check_together(named_arrays):
    """`(name, array)` pairs (None skipped) come from one framework and live on one device
    (data-free): the message `check_qkv` gives, for every data array of a call."""
    _check_together({n: spec_of(x, n) for n, x in named_arrays if x is not None})


def check_qkv(q, k, v):
    """Shapes, dtypes, framework and device of q, k, v (data-free: arrays or specs of any
    framework); returns `(Tq, Hq, D, Tk, Hk, Dv)`."""
    specs = {name: spec_of(x, name) for name, x in (("q", q), ("k", k), ("v", v))}
    for name, s in specs.items():
        if s.ndim != 3:
            raise ValueError(f"{name} must be 3-D [T, H, D] (packed THD layout), got shape "
                             f"{s.shape}")
        if s.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name} has dtype {s.dtype}; expected one of "
                            f"{', '.join(FLOAT_DTYPES)}")
    _check_together(specs)
    q, k, v = specs.values()
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype} and "
                        f"{v.dtype}")
    Tq, Hq, D = q.shape
    Tk, Hk, Dk = k.shape
    if Dk != D:
        raise ValueError(f"q.shape={q.shape} and k.shape={k.shape} disagree on head dim")
    if v.shape[0] != Tk:
        raise ValueError(f"k.shape={k.shape} and v.shape={v.shape} disagree on rows; k and v "
                         f"must hold the same tokens")
    if v.shape[1] != Hk:
        raise ValueError(f"k.shape={k.shape} and v.shape={v.shape} disagree on heads")
    if Hq == 0:
        raise ValueError(f"q.shape={q.shape} has no heads; expected Hq >= 1 (a multiple of k's "
                         f"{Hk} heads)")
    if Hk == 0 or Hq % Hk != 0:
        raise ValueError(f"q has {Hq} heads and k has {Hk}; q heads must be a multiple of k "
                         f"heads (GQA/MQA)")
    if D == 0 or v.shape[2] == 0:
        raise ValueError(f"head dims must be positive, got D={D} and Dv={v.shape[2]}")
    return Tq, Hq, D, Tk, Hk, v.shape[2]


def check_index(x, name: str, length=None) -> Spec:
    """A 1-D integer metadata array (`cu_seqlens_*`, `seq_offsets_*`), data-free."""
    s = spec_of(x, name)
    if s.ndim != 1:
        raise ValueError(f"{name} must be a 1-D array, got shape {s.shape}")
    if s.kind not in "iu":
        raise TypeError(f"{name} must hold integers (int32), got dtype {s.dtype}")
    if length is not None and s.shape[0] != length:
        raise ValueError(f"{name} has {s.shape[0]} entries; expected {length}")
    return s


def is_policy_scalar(x) -> bool:
    """A mask field given as one value (a Python or NumPy scalar), not as an array."""
    return isinstance(x, (numbers.Number, np.generic))


def policy_value(name: str, x) -> int:
    """A scalar mask field as an int.

    Windows: `-1` (unbounded) or `0 .. 2**31-1`; a negative window, and one past int32 (which no
    int32 position can reach), is unbounded. `bottom_right`: 0 or 1. Floats, NaN included, are
    refused rather than truncated.
    """
    if not isinstance(x, (numbers.Integral, np.integer, np.bool_)):
        raise TypeError(f"mask.{name} must be an int (or an int32/bool [B] array), got {x!r}")
    v = int(x)
    if name == "bottom_right":
        if v not in (0, 1):
            raise ValueError(f"mask.bottom_right must be True or False (or 0/1), got {x!r}")
        return v
    return v if 0 <= v <= INT32_MAX else -1


def check_policy(x, name: str, batch=None) -> Spec:
    """A mask field given as an array: 0-d or `[batch]`, int or bool (data-free)."""
    s = spec_of(x, f"mask.{name}")
    if s.ndim > 1 or (batch is not None and s.ndim == 1 and s.shape[0] != batch):
        want = "[B]" if batch is None else f"[{batch}]"
        raise ValueError(f"mask.{name} has shape {s.shape}; expected a scalar or {want} (one "
                         f"entry per sequence)")
    if s.kind not in "iub":
        raise TypeError(f"mask.{name} must be int32 or bool, got dtype {s.dtype}")
    return s


def check_specs(q, k, v, cu_seqlens_q, cu_seqlens_k, seq_offsets_q=None, seq_offsets_k=None,
                mask=None) -> int:
    """Every check of a single-process call that needs no data; returns the batch size `B`.

    Works on arrays of any framework and on what stands for them while a framework traces
    (PyTorch fake tensors, JAX tracers), so the adapters run it before their op or trace.
    `mask` is a `varlen.Mask` (or None).
    """
    check_qkv(q, k, v)
    check_metadata_devices(q, cu_seqlens_q, cu_seqlens_k, seq_offsets_q, seq_offsets_k, mask)
    return check_layout_specs(cu_seqlens_q, cu_seqlens_k, seq_offsets_q, seq_offsets_k, mask)


def check_metadata_devices(q, cu_seqlens_q, cu_seqlens_k, seq_offsets_q=None,
                           seq_offsets_k=None, mask=None):
    """Every metadata array lives on q's device or on the host (which moves to q's device),
    data-free: a PyTorch `meta` tensor or another GPU's is an error naming it."""
    want = spec_of(q, "q").device
    named = [("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k),
             ("seq_offsets_q", seq_offsets_q), ("seq_offsets_k", seq_offsets_k),
             *((f"mask.{n}", f) for n, f in (() if mask is None else mask.items())
               if not is_policy_scalar(f))]
    for name, x in named:
        if x is None or want is None:
            continue
        got = spec_of(x, name).device
        if got is not None and got not in (want, "cpu"):
            raise TypeError(f"{name} is on device {got} but q is on {want}; metadata must live "
                            f"on q's device or on the host")


def check_layout_specs(cu_seqlens_q, cu_seqlens_k, seq_offsets_q=None, seq_offsets_k=None,
                       mask=None) -> int:
    """The data-free checks of the layout and mask arguments; returns the batch size `B`."""
    if cu_seqlens_q is None or cu_seqlens_k is None:
        raise TypeError("cu_seqlens_q and cu_seqlens_k are required: int32 [B+1] arrays")
    n = check_index(cu_seqlens_q, "cu_seqlens_q").shape[0]
    if n == 0:
        raise ValueError("cu_seqlens_q is empty; expected [B+1] entries starting at 0")
    n_k = check_index(cu_seqlens_k, "cu_seqlens_k").shape[0]
    if n_k != n:
        raise ValueError(f"cu_seqlens_q has {n} entries and cu_seqlens_k {n_k}; both must be "
                         f"[B+1] for the same B")
    for name, off in (("seq_offsets_q", seq_offsets_q), ("seq_offsets_k", seq_offsets_k)):
        if off is not None:
            check_index(off, name, n)
    for name, f in (() if mask is None else mask.items()):
        if not is_policy_scalar(f):
            check_policy(f, name, n - 1)
    return n - 1


# --------------------------------------------------------------------------------------------
# Working metadata: int32 arrays in the data's module
# --------------------------------------------------------------------------------------------

def _working_meta(x, label: str, xp):
    """`x` as a working array; device metadata with host data is an error."""
    a = to_working(x, label)
    if xp is np and not isinstance(a, np.ndarray):
        raise ValueError(f"{label} lives on a CUDA device but the attention inputs are on the "
                         f"host; pass host metadata with host data")
    return a


def _to_module(a, xp):
    """Host metadata moves to the device when the data is there."""
    return xp.asarray(a) if xp is not np and isinstance(a, np.ndarray) else a


def _index_int32(a, name: str):
    """`a` as int32, its values checked against the int32 range before the cast.

    On the host always; on a device with validation on (a host read), else by device code that
    records the error for `varlen.check_device_errors()`.
    """
    dt = np.dtype(a.dtype)
    if dt == np.int32 or dt.itemsize < 4:
        return a.astype(np.int32, copy=False)
    xp = array_module(a)
    bad = a > INT32_MAX if dt.kind == "u" else (a < INT32_MIN) | (a > INT32_MAX)
    if xp is np or validation_enabled(True):
        where = np.flatnonzero(host_copy(bad))
        if where.size:
            i = int(where[0])
            raise ValueError(f"{name}[{i}]={host_copy(a)[i]} is outside int32 [-2**31, "
                             f"2**31-1 = {INT32_MAX}]: rows are indexed with int32")
    else:
        record(xp, bad.any(), f"{name} holds values outside int32 [-2**31, 2**31-1 = "
                              f"{INT32_MAX}]: rows are indexed with int32")
    return a.astype(np.int32)


def as_index_array(x, name: str, xp, length=None):
    """An int32 1-D metadata array in module `xp` (host metadata moves to the device)."""
    check_index(x, name, length)
    return _to_module(_index_int32(_working_meta(x, name, xp), name), xp)


def _policy_int32(a, name: str):
    """A per-sequence mask field as int32 without a host read (see `policy_value`)."""
    if name == "bottom_right":
        return (a != 0).astype(np.int32)
    dt = np.dtype(a.dtype)
    if dt.kind == "b" or dt.itemsize < 4 or dt == np.int32:
        return a.astype(np.int32)
    xp = array_module(a)
    return xp.where((a < 0) | (a > INT32_MAX), -1, a).astype(np.int32)


def as_policy_array(x, name: str, xp, batch: int):
    """A per-sequence mask field: a scalar stays a scalar (an int), an array becomes int32
    `[B]` in module `xp`."""
    if is_policy_scalar(x):
        return policy_value(name, x)
    if check_policy(x, name, batch).ndim == 0:
        return policy_value(name, host_copy(to_working(x, f"mask.{name}"))[()])
    return _to_module(_policy_int32(_working_meta(x, f"mask.{name}", xp), name), xp)


# --------------------------------------------------------------------------------------------
# Value checks (host reads) and scalars
# --------------------------------------------------------------------------------------------
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
    if value > INT32_MAX:
        raise ValueError(f"{name}={value} is past the int32 limit {INT32_MAX} of row counts")
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
    """`dout` and `out` must be `[Tq, Hq, Dv]` in q's dtype, and `lse` `[Hq, Tq]` float32
    (float64 for float64 inputs), as `attention_forward` returns it (data-free).

    `rows` names the query rows in the messages (`Tq_local` for a context-parallel shard).
    """
    q, v, lse = spec_of(q, "q"), spec_of(v, "v"), spec_of(lse, "lse")
    Tq, Hq, _ = q.shape
    Dv = v.shape[2]
    for name, a in (("dout", dout), ("out", out)):
        a = spec_of(a, name)
        if a.shape != (Tq, Hq, Dv):
            raise ValueError(f"{name} has shape {a.shape}; expected [{rows}, Hq, Dv] = "
                             f"{(Tq, Hq, Dv)}")
        if a.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {a.dtype}; expected q's dtype {q.dtype}")
    if lse.shape != (Hq, Tq):
        raise ValueError(f"lse has shape {lse.shape}; expected [Hq, {rows}] = {(Hq, Tq)}")
    want = "float64" if q.dtype == "float64" else "float32"
    if lse.dtype != want:
        raise TypeError(f"lse has dtype {lse.dtype}; expected {want}, what attention_forward "
                        f"returns for {q.dtype} inputs")
