"""What every launch of this backend shares: the structs the kernels take by value, the data
arguments, the module cache and the grids of the grid-stride kernels.

What a kernel reads of the plan travels as one `PlanView` struct by value (`plan_view_arg`),
and the call's heads and scalars as one `CallParams` struct (`call_params_arg`); the data
pointers come before them as typed arguments. A struct argument is a 0-d NumPy array of the
aligned dtype below: CuPy passes a NumPy array of size one by value, its bytes becoming the
kernel parameter (every CuPy since 8; a `numpy.void` scalar of this size is refused by CuPy 13
and 14). The other scalars are cast explicitly (`cupy.int32`, `cupy.int64`): a bare Python
int would travel as a 64-bit value.

`address(a)` and `data(a)` are the two places a launch touches a device array's memory: the
host emulation of the kernels (tests) replaces both with their host-array forms.
"""
from __future__ import annotations

import threading
from typing import NamedTuple

import numpy as np

from ..._array import alloc
from ...plan import KernelView
from .traits import STATIC_SMEM_LIMIT

# The structs of kernels_cuda/plan_view.cuh as aligned NumPy dtypes (C layout: each field at a
# multiple of its size, the whole padded to its largest field); tests/compile/test_cupy_compile.py
# compares them with the C sizeof/offsetof.
# PlanView: KernelView's fields in order, its arrays as 64-bit device addresses.
PLAN_VIEW_DTYPE = np.dtype([(name, np.uint64 if i < KernelView.NUM_ARRAYS else np.int32)
                            for i, name in enumerate(KernelView._fields)], align=True)
CALL_PARAMS_DTYPE = np.dtype([("Hq", np.int32), ("Hk", np.int32), ("softmax_scale", np.float32),
                              ("softcap", np.float32)], align=True)
STRUCT_DTYPES = {"PlanView": PLAN_VIEW_DTYPE, "CallParams": CALL_PARAMS_DTYPE}

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


def data(a):
    """A contiguous view of an input whose rows are 16-byte aligned (a copy otherwise)."""
    import cupy
    a = cupy.ascontiguousarray(a)
    if a.data.ptr % 16:
        a = a.copy()
    return a


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


def pointer(a):
    """`a` as a kernel argument; None as a null pointer of 8 bytes, like the pointer it stands
    for (an argument the variant never touches)."""
    import cupy
    return cupy.uint64(0) if a is None else a


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

        from .compile import compile_options, module_source
        self.kernels = variant.kernels()
        self.raw = cupy.RawModule(code=module_source(), options=compile_options(),
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
