"""Launchers of the CuPy tensor-core kernels: module cache, grids, arguments.

Every launch goes to the caller's current CuPy stream, reads no device memory on the host and
allocates only the outputs and the backward's fp32 scratch, all through `varlen._array.alloc`,
so a warmed-up call can be captured in a CUDA graph. Nothing is filled before a kernel: the
kernels write every row of their outputs, the rows no tile covers (padding) included: the
forward in "pad blocks" past its tile slots (`pad_blocks`), the backward in its preprocessing.
A forward is one launch, a backward three.

What a kernel reads of the plan travels as one `PlanView` struct by value, filled in one place
(`plan_view_arg`), and the call's heads and scalars as one `CallParams` struct
(`call_params_arg`); the data pointers come before them as typed arguments. A struct argument
is a 0-d NumPy array of the aligned dtype in `_cupy_spec`: CuPy passes a NumPy array of size
one by value, its bytes becoming the kernel parameter (every CuPy since 8; a `numpy.void`
scalar of this size is refused by CuPy 13 and 14). The other scalars are cast explicitly
(`cupy.int32`, `cupy.int64`): a bare Python int would travel as a 64-bit value.
"""
from __future__ import annotations

import threading
from typing import NamedTuple

import numpy as np

from .._array import alloc
from ..plan import KernelView
from ._cupy_spec import (CALL_PARAMS_DTYPE, CONVERT_THREADS, PLAN_VIEW_DTYPE, PREPROCESS_WARPS,
                         STATIC_SMEM_LIMIT, KernelSpec, compile_options, module_source)

MAX_GRID_Y = 65535
# Blocks of the grid-stride kernels (preprocess, dQ conversion): enough to fill any GPU.
MAX_STRIDE_BLOCKS = 1 << 16
# Rows each thread of a pad block takes (kernels_cuda/tile_scheduler.cuh, PAD_ROWS_PER_THREAD).
PAD_ROWS_PER_THREAD = 32

_lock = threading.Lock()
_modules: dict = {}


class _Module:
    """One RawModule per KernelSpec, compiled on first use; kernel handles per device."""

    def __init__(self, spec: KernelSpec):
        import cupy
        self.kernels = spec.kernels()
        self.raw = cupy.RawModule(code=module_source(), options=compile_options(),
                                  name_expressions=list(spec.name_expressions))
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
        """Enqueue kernel `role` of the spec on the current stream."""
        kernel = self.kernels[role]
        self.function(role)(grid, (kernel.threads,), args, shared_mem=kernel.smem)


def module(spec: KernelSpec) -> _Module:
    """The module of `spec`, shared with the specs that compile to the same kernels
    (`KernelSpec.compiled`)."""
    spec = spec.compiled()
    mod = _modules.get(spec)
    if mod is None:
        with _lock:
            mod = _modules.get(spec)
            if mod is None:
                mod = _modules[spec] = _Module(spec)
    return mod


class PlanArg(NamedTuple):
    """The `PlanView` argument of a plan, and the arrays whose addresses it holds."""

    struct: np.ndarray     # 0-d, PLAN_VIEW_DTYPE
    view: KernelView       # keep referenced until the launches are enqueued


def _index(a):
    """A plan array as a contiguous int32 CuPy array (no copy when it already is one)."""
    import cupy
    return cupy.ascontiguousarray(a, dtype=cupy.int32)


def _address(a) -> int:
    """The device address of a CuPy array's first element."""
    return a.data.ptr


def _struct(dtype, values) -> np.ndarray:
    arg = alloc(np, (), dtype, fill=0)
    for name, value in zip(dtype.names, values, strict=True):
        arg[name] = value
    return arg


def plan_view_arg(plan) -> PlanArg:
    """`plan.view()` as the kernels' `PlanView` struct: its arrays as contiguous int32 CuPy
    arrays, passed as their addresses, then its sizes. A converted array lives only in the
    returned view: keep it referenced until the kernels are enqueued."""
    view = plan.view().map_arrays(_index)
    n = view.NUM_ARRAYS
    return PlanArg(_struct(PLAN_VIEW_DTYPE, [*map(_address, view[:n]), *view[n:]]), view)


def call_params_arg(Hq: int, Hk: int, softmax_scale: float, softcap: float) -> np.ndarray:
    """The kernels' `CallParams` struct."""
    return _struct(CALL_PARAMS_DTYPE, (Hq, Hk, softmax_scale, softcap))


def _data(a):
    """A contiguous view of an input whose rows are 16-byte aligned (a copy otherwise)."""
    import cupy
    a = cupy.ascontiguousarray(a)
    if a.data.ptr % 16:
        a = a.copy()
    return a


def _check_heads(Hq: int):
    if Hq > MAX_GRID_Y:
        raise ValueError(f"Hq={Hq} query heads exceed the grid limit of {MAX_GRID_Y}")


def forward(spec: KernelSpec, plan, q, k, v, *, softmax_scale: float, softcap: float):
    """`out [Tq, Hq, D]` (q's dtype, pad rows 0) and `lse [Hq, Tq]` (float32, pad rows -inf).

    One launch, no fill: the forward kernel writes every row of both, its query tiles' rows
    and, in the pad blocks past the tile slots, the rows of no tile. None when Tq == 0.
    """
    import cupy
    q, k, v = _data(q), _data(k), _data(v)
    Tq, Hq, D = q.shape
    Hk = k.shape[1]
    _check_heads(Hq)
    out = alloc(cupy, (Tq, Hq, D), q.dtype)
    lse = alloc(cupy, (Hq, Tq), np.float32)
    if Tq == 0 or Hq == 0:
        return out, lse
    mod = module(spec)
    plan_arg = plan_view_arg(plan)
    mod.launch("fwd", grid=_tile_grid(mod, "fwd", plan.num_q_tiles, Tq, Hq),
               args=(q, k, v, out, lse, plan_arg.struct,
                     call_params_arg(Hq, Hk, softmax_scale, softcap)))
    return out, lse


def backward(spec: KernelSpec, plan, dout, q, k, v, out, lse, *, softmax_scale: float,
             softcap: float, deterministic: bool, dkdv=None):
    """`(dq, dk, dv)` in the input dtype; dQ by fp32 atomics, added in a fixed order when
    `deterministic` (bitwise repeatable).

    `dkdv`, when given, launches the dK/dV step in place of this module's kernels (the sm_90a
    kernel, `_cupy_sm90_bwd`): `dkdv(q, k, v, dout, lse2, delta, dk, dv, dq_accum, dq_order,
    plan_struct, call)`, with the same contract (its key tiles' rows of dk and dv, dQ added to
    the zeroed fp32 `dq_accum`, in the order `dq_order` sets when `deterministic`, else None).

    Three launches, no fill. The preprocessing computes delta and the base-2 lse and writes
    what the next two kernels do not: the zeroed fp32 dQ accumulator, the pad rows of dk and dv
    (rows of no key tile) and, when `deterministic`, the order of the dQ additions (`dq_order`,
    kernels_cuda/bwd_dq_ordered.cuh: zeroed counters, the query tile of each row). Then the
    dK/dV kernel (its key tiles' rows, dQ added to the accumulator; in key-slot order per query
    chunk when `deterministic`), and the dQ conversion (every row of dq). Fewer when Tq or Tk
    is 0.
    """
    import cupy
    q, k, v, dout, out = _data(q), _data(k), _data(v), _data(dout), _data(out)
    lse = cupy.ascontiguousarray(lse, dtype=cupy.float32)
    Tq, Hq, D = q.shape
    Tk, Hk, _ = k.shape
    _check_heads(Hq)
    dq = alloc(cupy, q.shape, q.dtype)
    dk = alloc(cupy, k.shape, k.dtype)
    dv = alloc(cupy, v.shape, v.dtype)
    queries, keys = Tq * Hq > 0, Tk * Hk > 0
    if not (queries or keys):
        return dq, dk, dv
    mod = module(spec)
    plan_arg = plan_view_arg(plan)
    call = call_params_arg(Hq, Hk, softmax_scale, softcap)

    # FlashAttention-2 preprocessing: delta = rowsum(dO * O), lse in base-2 units; the zeroed
    # dQ accumulator, the pad rows, the dQ order.
    delta = alloc(cupy, (Hq, Tq), np.float32)
    lse2 = alloc(cupy, (Hq, Tq), np.float32)
    dq_accum = alloc(cupy, (Tq, Hq, D), np.float32)
    dq_order = alloc(cupy, (Hq + 1, Tq), np.int32) if deterministic else None
    slot_rows = plan.num_q_tiles * plan.block_m if deterministic else 0
    threads = mod.kernels["preprocess"].threads
    items = max(Tq * Hq * threads // PREPROCESS_WARPS, _pad_windows(Tk), slot_rows)
    mod.launch("preprocess", grid=(_stride_blocks(items, threads),),
               args=(out, dout, lse, delta, lse2, dq_accum, dk, dv,
                     _pointer(dq_order), plan_arg.struct, call))
    inputs = (q, k, v, dout, lse2, delta)
    if keys and plan.num_k_tiles:
        if dkdv is not None:
            dkdv(*inputs, dk, dv, dq_accum, _pointer(dq_order), plan_arg.struct, call)
        else:
            role = "dkdv_ordered" if deterministic else "dkdv_atomic"
            mod.launch(role, grid=(plan.num_k_tiles, Hk),
                       args=(*inputs, dk, dv, dq_accum, _pointer(dq_order), plan_arg.struct,
                             call))
    if not queries:
        return dq, dk, dv
    n = dq_accum.size
    mod.launch("dq_convert", grid=(_stride_blocks(n, CONVERT_THREADS),),
               args=(dq_accum, dq, cupy.int64(n)))
    return dq, dk, dv


def _tile_grid(mod: _Module, role: str, num_slots: int, rows: int, heads: int) -> tuple:
    """The grid of a kernel over tile slots that writes the pad rows too (the forward):
    `(num_slots + pad_blocks(...), heads)`."""
    return (num_slots + pad_blocks(rows, heads, mod.kernels[role].threads), heads)


def _pad_windows(rows: int) -> int:
    """Windows of PAD_ROWS_PER_THREAD rows, one per thread, that cover `rows` rows."""
    return -(-rows // PAD_ROWS_PER_THREAD)


def pad_blocks(rows: int, heads: int, threads: int) -> int:
    """Blocks past the tile slots that write the rows of no tile (kernels_cuda/tile_scheduler.cuh,
    pad_window): `threads` windows per block of the grid's `heads` rows, enough for `rows`
    rows."""
    return -(-_pad_windows(rows) // (threads * heads))


def _stride_blocks(items: int, per_block: int) -> int:
    """Blocks of a grid-stride kernel over `items` (any count: the kernel loops in 64-bit)."""
    return max(1, min(-(-items // per_block), MAX_STRIDE_BLOCKS))


def _null_pointer():
    """A null pointer for a kernel argument the variant never touches (dq_accum without
    atomics): 8 bytes, like the float* it stands for."""
    import cupy
    return cupy.uint64(0)


def _pointer(a):
    """`a` as a kernel argument, None as a null pointer."""
    return _null_pointer() if a is None else a


def _warm_one(spec: KernelSpec) -> str:
    mod = module(spec)
    for role in mod.kernels:
        mod.function(role)
    return spec.label


def warm_cache(specs=None, jobs: int = 8):
    """Compile the given variants (default: all) for the current GPU in parallel processes,
    filling CuPy's on-disk kernel cache (`CUPY_CACHE_DIR`) so later processes only load them.
    Returns the labels compiled."""
    from concurrent.futures import ProcessPoolExecutor
    import multiprocessing

    from ._cupy_spec import all_specs
    specs = all_specs() if specs is None else specs
    ctx = multiprocessing.get_context("spawn")      # a CUDA context must not be forked
    with ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
        return list(pool.map(_warm_one, specs))


if __name__ == "__main__":
    import sys
    import time
    t0 = time.time()
    done = warm_cache(jobs=int(sys.argv[1]) if len(sys.argv) > 1 else 8)
    print(f"compiled {len(done)} kernel modules in {time.time() - t0:.0f} s")
