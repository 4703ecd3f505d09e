"""What every launch of this backend shares: the structs the kernels take by value, the data
arguments, the module cache and the grids of the grid-stride kernels.

Every kernel takes one params struct of its family by value (kernels_cuda/params.cuh: the
forward's `FwdParams`, the backward's `BwdParams`), filled here in one place (`fwd_params_arg`,
`bwd_params_arg`): each array's device address and the row and head strides, in elements,
where it lies; the plan's `PlanView` (`plan_view_arg`) and the call's `CallParams`
(`call_params_arg`) as members. The sm_90a kernels take their tensor maps before it. A struct
argument is a 0-d NumPy array of the aligned dtype below: CuPy passes a NumPy array of size one
by value, its bytes becoming the kernel parameter (every CuPy since 8; a `numpy.void` scalar of
this size is refused by CuPy 13 and 14).

`data(a, name)` decides whether an input is read where it lies: a view is, when its last dim is
contiguous and, for the inputs the kernels copy in 16-byte chunks (cp.async, TMA), its address
and its other strides are multiples of 16 bytes; otherwise it is copied, packed, with a
`RuntimeWarning` naming it and why (once per argument and reason). `address(a)` and `data(a)`
are the two places a launch touches a device array's memory: the host emulation of the kernels
(tests) replaces `address` with its host form and wraps `data`.
"""
from __future__ import annotations

import threading
import warnings
from typing import NamedTuple

import numpy as np

from ..._array import alloc
from ...plan import KernelView
from .mods import MOD_AUX_DTYPE, MOD_PARAMS_DTYPE, mod_params_arg, module_source
from .traits import STATIC_SMEM_LIMIT

# The structs of kernels_cuda/plan_view.cuh and params.cuh as aligned NumPy dtypes (C layout:
# each field at a multiple of its size, the whole padded to its largest field);
# tests/compile/test_cupy_compile.py compares them with the C sizeof/offsetof.
# PlanView: KernelView's fields in order, its arrays as 64-bit device addresses.
PLAN_VIEW_DTYPE = np.dtype([(name, np.uint64 if i < KernelView.NUM_ARRAYS else np.int32)
                            for i, name in enumerate(KernelView._fields)], align=True)
CALL_PARAMS_DTYPE = np.dtype([("Hq", np.int32), ("Hk", np.int32), ("softmax_scale", np.float32),
                              ("softcap", np.float32)], align=True)
STRIDES_DTYPE = np.dtype([("row", np.int32), ("head", np.int32)], align=True)
DROPOUT_PARAMS_DTYPE = np.dtype([("seed_lo", np.uint32), ("seed_hi", np.uint32),
                                 ("offset", np.uint32), ("threshold", np.uint32),
                                 ("scale", np.float32), ("head_offset", np.uint32)],
                                align=True)
# Strides are 32-bit (params.cuh; the offsets computed from them 64-bit): a view whose rows or
# heads lie further apart is copied.
MAX_STRIDE = 2 ** 31 - 1


def _params_dtype(arrays, strided):
    """A params struct: the addresses of `arrays`, the Strides fields `strided` ({field: the
    array whose strides it holds}), lse's stride, the plan, the call, the aux arrays of its
    mask_mod and score_mod (`mods.MOD_PARAMS_DTYPE`) and its dropout."""
    return np.dtype([(name, np.uint64) for name in arrays]
                    + [(field, STRIDES_DTYPE) for field in strided]
                    + [("lse_stride", np.int64), ("plan", PLAN_VIEW_DTYPE),
                       ("call", CALL_PARAMS_DTYPE), ("mods", MOD_PARAMS_DTYPE),
                       ("dropout", DROPOUT_PARAMS_DTYPE)], align=True)


FWD_ARRAYS = ("q", "k", "v", "out", "lse")
FWD_STRIDED = {f"{name}_strides": name for name in ("q", "k", "v", "out")}
BWD_ARRAYS = ("q", "k", "v", "out", "dout", "lse", "lse2", "delta", "dq_accum", "dq_order", "dq",
              "dk", "dv")
BWD_STRIDED = {f"{name}_strides": name for name in ("q", "k", "v", "out", "dout", "dq", "dk",
                                                    "dv")}
FWD_PARAMS_DTYPE = _params_dtype(FWD_ARRAYS, FWD_STRIDED)
BWD_PARAMS_DTYPE = _params_dtype(BWD_ARRAYS, BWD_STRIDED)
STRUCT_DTYPES = {"PlanView": PLAN_VIEW_DTYPE, "CallParams": CALL_PARAMS_DTYPE,
                 "Strides": STRIDES_DTYPE, "DropoutParams": DROPOUT_PARAMS_DTYPE,
                 "ModAux": MOD_AUX_DTYPE, "ModParams": MOD_PARAMS_DTYPE,
                 "FwdParams": FWD_PARAMS_DTYPE, "BwdParams": BWD_PARAMS_DTYPE}
# cp.async and ldmatrix move 16-byte chunks, TMA boxes start at 16-byte aligned addresses: the
# alignment of a row of an input they read, and of its row and head strides, in bytes.
CHUNK_ALIGN = 16

MAX_GRID_Y = 65535
# Blocks of the grid-stride kernels (preprocess, dQ conversion): enough to fill any GPU.
MAX_STRIDE_BLOCKS = 1 << 16


class PlanArg(NamedTuple):
    """The `PlanView` argument of a plan, and the arrays whose addresses it holds."""

    struct: np.ndarray     # 0-d, PLAN_VIEW_DTYPE
    view: KernelView       # keep referenced until the launches are enqueued


def address(a) -> int:
    """The device address of a CuPy array's first element (0 for None)."""
    return 0 if a is None else a.data.ptr


# (argument, reason) pairs already warned about in this process: each is said once.
_warned: set = set()


def _copy_reason(a, align: int, tma: bool) -> tuple | None:
    """(reason key, why) when the kernels cannot read `a` where it lies, else None. Strides
    of dims of size 1 are never used and not judged."""
    e = a.dtype.itemsize
    shape, strides = a.shape, a.strides
    if a.ndim and shape[-1] > 1 and strides[-1] != e:
        return "last dim", f"its last dim is not contiguous (strides {strides} bytes)"
    outer = [s for n, s in zip(shape[:-1], strides[:-1]) if n > 1]
    if a.ndim == 3 and any(abs(s // e) > MAX_STRIDE for s in outer):
        return "stride", (f"its strides {tuple(s // e for s in strides)} elements exceed the "
                          f"kernels' 32-bit strides")
    if tma and any(s <= 0 for s in outer):
        return "tensor map", (f"its strides {strides} bytes are not all positive, as a tensor "
                              f"map's are")
    if align > e and a.size:
        if address(a) % align:
            return "address", f"its first element is not {align}-byte aligned"
        if any(s % align for s in outer):
            return "strides", f"its strides {strides} bytes are not multiples of {align}"
    return None


def data(a, name: str, *, align: int = CHUNK_ALIGN, tma: bool = False):
    """Input `name` as the kernels read it: `a` itself, a view read where it lies, when its
    last dim is contiguous, the strides of a [T, H, D] array at most 2^31 - 1 elements
    (`Strides`, 32-bit) and, with `align` (bytes), its first element and its other strides multiples of `align` (rows that cp.async or TMA copy in 16-byte chunks; `align=1` for an
    input read element by element); with `tma`, its strides are positive too (a tensor map's
    are unsigned; sm_90a). Otherwise a packed copy, and a RuntimeWarning naming `name` and
    why, once per argument and reason (`_warned`)."""
    why = _copy_reason(a, align, tma)
    if why is None:
        return a
    key, reason = why
    if (name, key) not in _warned:
        _warned.add((name, key))
        warnings.warn(f"{name}: {reason}; copied", RuntimeWarning, stacklevel=3)
    import cupy
    copy = cupy.ascontiguousarray(a)
    if copy is a or address(copy) % CHUNK_ALIGN:     # a contiguous view, misaligned
        copy = copy.copy()
    return copy


def index_array(a):
    """A plan or layout array as a contiguous int32 CuPy array (no copy when it already is)."""
    import cupy
    return cupy.ascontiguousarray(a, dtype=cupy.int32)


def struct(dtype, values) -> np.ndarray:
    arg = alloc(np, (), dtype, fill=0)
    for name, value in zip(dtype.names, values, strict=True):
        arg[name] = value
    return arg


def plan_view_arg(plan) -> PlanArg:
    """`plan.view()` as the kernels' `PlanView` struct: its arrays as contiguous int32 CuPy
    arrays, passed as their addresses, then its sizes. A converted array lives only in the
    returned view: keep it referenced until the kernels are enqueued."""
    view = plan.view().map_arrays(index_array)
    n = view.NUM_ARRAYS
    return PlanArg(struct(PLAN_VIEW_DTYPE, [*(address(a) for a in view[:n]), *view[n:]]), view)


def call_params_arg(Hq: int, Hk: int, softmax_scale: float, softcap: float) -> np.ndarray:
    """The kernels' `CallParams` struct."""
    return struct(CALL_PARAMS_DTYPE, (Hq, Hk, softmax_scale, softcap))


def dropout_params_arg(dropout) -> np.ndarray:
    """The kernels' `DropoutParams` of a call's `varlen.dropout.Dropout` (None: all zero, never
    read by kernels compiled without dropout): values, so a new seed or offset recompiles
    nothing."""
    if dropout is None:
        return np.zeros((), DROPOUT_PARAMS_DTYPE)
    return struct(DROPOUT_PARAMS_DTYPE, (dropout.key0, dropout.key1, dropout.offset,
                                         dropout.threshold, dropout.scale,
                                         dropout.head_offset))


def strides(a) -> tuple:
    """(row, head) strides in elements of a [T, H, D] array (0, 0 for None). A dim of size 1
    gets its packed stride: the kernels never step along it, and a tensor map is given only
    multiples of 16 bytes."""
    if a is None:
        return 0, 0
    T, H, D = a.shape
    e = a.dtype.itemsize
    row, head = (s // e for s in a.strides[:2])
    return (row if T > 1 else H * D), (head if H > 1 else D)


def _params_arg(dtype, strided, plan_arg: PlanArg, call, arrays: dict, mods=None,
                mod_err=None, aux_grads=None, dropout=None) -> np.ndarray:
    arg = alloc(np, (), dtype, fill=0)
    for name, a in arrays.items():
        arg[name] = address(a)
    for field, name in strided.items():
        arg[field] = strides(arrays[name])
    lse = arrays["lse"]
    arg["lse_stride"] = 0 if lse is None else (lse.strides[0] // lse.dtype.itemsize
                                               if lse.shape[0] > 1 else lse.shape[1])
    arg["plan"] = plan_arg.struct
    arg["call"] = call
    arg["mods"] = mod_params_arg(mods, mod_err, address, aux_grads)
    arg["dropout"] = dropout_params_arg(dropout)
    return arg


def fwd_params_arg(plan_arg: PlanArg, call, *, q, k, v, out, lse, mods=None,
                   mod_err=None, dropout=None) -> np.ndarray:
    """The forward kernels' `FwdParams`: q, k, v [T, H, D] where they lie (`data`), out and
    lse, the plan's struct (`plan_view_arg`), `CallParams` (`call_params_arg`), the aux
    arrays of the call's `mods` with the flag `mod_err` (`mods.mod_params_arg`) and its
    `dropout` (`dropout_params_arg`)."""
    return _params_arg(FWD_PARAMS_DTYPE, FWD_STRIDED, plan_arg, call,
                       dict(q=q, k=k, v=v, out=out, lse=lse), mods, mod_err, dropout=dropout)


def bwd_params_arg(plan_arg: PlanArg, call, *, q, k, v, out, dout, lse, lse2, delta, dq_accum,
                   dq_order, dq, dk, dv, mods=None, mod_err=None,
                   aux_grads=None, dropout=None) -> np.ndarray:
    """The backward kernels' `BwdParams` (every field; None: a null pointer, an argument the
    kernels of this launch never touch); `aux_grads`: the score_mod's aux gradient buffers;
    `dropout`: as `fwd_params_arg`'s."""
    return _params_arg(BWD_PARAMS_DTYPE, BWD_STRIDED, plan_arg, call,
                       dict(q=q, k=k, v=v, out=out, dout=dout, lse=lse, lse2=lse2, delta=delta,
                            dq_accum=dq_accum, dq_order=dq_order, dq=dq, dk=dk, dv=dv),
                       mods, mod_err, aux_grads, dropout)


def check_heads(Hq: int):
    if Hq > MAX_GRID_Y:
        raise ValueError(f"Hq={Hq} query heads exceed the grid limit of {MAX_GRID_Y}")


def stride_blocks(items: int, per_block: int) -> int:
    """Blocks of a grid-stride kernel over `items` (any count: the kernel loops in 64-bit)."""
    return max(1, min(-(-items // per_block), MAX_STRIDE_BLOCKS))


class Module:
    """One RawModule per variant, compiled by NVRTC on first use (CuPy picks the device's
    architecture); kernel handles per device."""

    def __init__(self, variant):
        import cupy

        from .compile import compile_options
        self.kernels = variant.kernels()
        self.raw = cupy.RawModule(code=module_source(getattr(variant, "mods", None)),
                                  options=compile_options(),
                                  name_expressions=list(variant.name_expressions))
        self._functions = {}

    def function(self, role: str):
        import cupy
        key = (role, cupy.cuda.Device().id)
        fn = self._functions.get(key)
        if fn is None:
            kernel = self.kernels[role]
            fn = self.raw.get_function(kernel.name)
            if kernel.smem > STATIC_SMEM_LIMIT:
                # Dynamic shared memory above 48 KiB must be opted into per kernel.
                fn.max_dynamic_shared_size_bytes = kernel.smem
            self._functions[key] = fn
        return fn

    def launch(self, role: str, *, grid: tuple, args: tuple):
        """Enqueue kernel `role` of the variant on the current stream."""
        kernel = self.kernels[role]
        self.function(role)(grid, (kernel.threads,), args, shared_mem=kernel.smem)


_lock = threading.Lock()
_modules: dict = {}


def module(variant) -> Module:
    """The module of `variant` (compiled once per process)."""
    mod = _modules.get(variant)
    if mod is None:
        with _lock:
            mod = _modules.get(variant)
            if mod is None:
                mod = _modules[variant] = Module(variant)
    return mod
