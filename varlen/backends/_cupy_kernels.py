"""Launchers of the CuPy tensor-core kernels: module cache, grids, arguments.

Every launch goes to the caller's current CuPy stream, reads no device memory on the host and
allocates only the outputs (and the backward's fp32 scratch), so a warmed-up call can be
captured in a CUDA graph. Scalars are cast explicitly (`cupy.int32`, `cupy.float32`): a bare
Python int or float would travel as a 64-bit value and mismatch the kernel's parameter.
"""
from __future__ import annotations

import math
import threading

import numpy as np

from ._cupy_spec import (CONVERT_THREADS, PREPROCESS_WARPS, STATIC_SMEM_LIMIT, KernelSpec,
                         compile_options, module_source)

MAX_GRID_Y = 65535
MAX_CONVERT_BLOCKS = 1 << 16

_lock = threading.Lock()
_modules: dict = {}


class _Module:
    """One RawModule per KernelSpec, compiled on first use; kernel handles per device."""

    def __init__(self, spec: KernelSpec):
        import cupy
        self.spec = spec
        self.raw = cupy.RawModule(code=module_source(), options=compile_options(),
                                  name_expressions=list(spec.name_expressions))
        self._functions = {}

    def function(self, name: str, smem: int):
        import cupy
        key = (name, cupy.cuda.Device().id)
        fn = self._functions.get(key)
        if fn is None:
            fn = self.raw.get_function(name)
            if smem > STATIC_SMEM_LIMIT:
                # Dynamic shared memory above 48 KiB must be opted into per kernel.
                fn.max_dynamic_shared_size_bytes = smem
            self._functions[key] = fn
        return fn


def module(spec: KernelSpec) -> _Module:
    mod = _modules.get(spec)
    if mod is None:
        with _lock:
            mod = _modules.get(spec)
            if mod is None:
                mod = _modules[spec] = _Module(spec)
    return mod


def _i32(x):
    import cupy
    return cupy.int32(x)


def _f32(x):
    import cupy
    return cupy.float32(x)


def _index(a):
    """A plan array as a contiguous int32 CuPy array (no copy when it already is one)."""
    import cupy
    return cupy.ascontiguousarray(a, dtype=cupy.int32)


def _data(a):
    """A contiguous view of an input whose rows are 16-byte aligned (a copy otherwise)."""
    import cupy
    a = cupy.ascontiguousarray(a)
    if a.data.ptr % 16:
        a = a.copy()
    return a


def _zeros(shape, dtype):
    """Zero-filled buffer; bitwise zeros are +0.0 in float16 and bfloat16 alike."""
    import cupy
    return cupy.zeros(shape, dtype=cupy.uint16).view(dtype)


def _policy_args(plan):
    return (_index(plan.q.seqlen), _index(plan.k.seqlen), _index(plan.window_left),
            _index(plan.window_right), _index(plan.bottom_right))


def _check_heads(Hq, Hk):
    if Hq > MAX_GRID_Y:
        raise ValueError(f"Hq={Hq} query heads exceed the grid limit of {MAX_GRID_Y}")


def forward(spec: KernelSpec, plan, q, k, v, softmax_scale: float, softcap: float):
    import cupy
    q, k, v = _data(q), _data(k), _data(v)
    Tq, Hq, D = q.shape
    Hk = k.shape[1]
    _check_heads(Hq, Hk)
    out = _zeros((Tq, Hq, D), q.dtype)
    lse = cupy.full((Hq, Tq), -np.inf, dtype=cupy.float32)
    if plan.num_q_tiles == 0 or Tq == 0:
        return out, lse
    name, threads, smem = spec.kernels()[0]
    fn = module(spec).function(name, smem)
    fn((plan.num_q_tiles, Hq), (threads,),
       (q, k, v, out, lse, _index(plan.q_tiles), _index(plan.q_sched), _index(plan.k.row),
        _index(plan.k.length), _index(plan.k.pos), *_policy_args(plan),
        _i32(plan.k.per_seq), _i32(Tq), _i32(Hq), _i32(Hk), _f32(softmax_scale),
        _f32(softcap)),
       shared_mem=smem)
    return out, lse


def backward(spec: KernelSpec, plan, dout, q, k, v, out, lse, softmax_scale: float,
             softcap: float, deterministic: bool):
    import cupy
    q, k, v, dout, out = _data(q), _data(k), _data(v), _data(dout), _data(out)
    lse = cupy.ascontiguousarray(lse, dtype=cupy.float32)
    Tq, Hq, D = q.shape
    Tk, Hk, _ = k.shape
    _check_heads(Hq, Hk)
    dk = _zeros(k.shape, k.dtype)
    dv = _zeros(v.shape, v.dtype)
    if Tq == 0 or Tk == 0 or (plan.num_q_tiles == 0 and plan.num_k_tiles == 0):
        return _zeros(q.shape, q.dtype), dk, dv
    mod = module(spec)
    (pre_name, pre_threads, _), (dkdv_atomic, dkdv_threads, smem_atomic), \
        (dkdv_plain, _, smem_plain), (dq_name, dq_threads, dq_smem), \
        (conv_name, _, _) = spec.kernels()
    policy = _policy_args(plan)
    scalars = (_i32(Tq), _i32(Hq), _i32(Hk), _f32(softmax_scale), _f32(softcap))

    # FlashAttention-2 preprocessing: delta = rowsum(dO * O), lse in base-2 units.
    delta = cupy.empty((Hq, Tq), dtype=cupy.float32)
    lse2 = cupy.empty((Hq, Tq), dtype=cupy.float32)
    pairs = Tq * Hq
    mod.function(pre_name, 0)((math.ceil(pairs / PREPROCESS_WARPS),), (pre_threads,),
                              (out, dout, lse, delta, lse2, _i32(Tq), _i32(Hq)))

    k_args = (_index(plan.k_tiles), _index(plan.k_sched), _index(plan.q.row),
              _index(plan.q.length), _index(plan.q.pos), *policy, _i32(plan.q.per_seq),
              _i32(plan.block_m // spec.bwd_query_chunk))
    if deterministic:
        dq = _zeros(q.shape, q.dtype)
        if plan.num_k_tiles:
            mod.function(dkdv_plain, smem_plain)(
                (plan.num_k_tiles, Hk), (dkdv_threads,),
                (q, k, v, dout, lse2, delta, dk, dv, _null_pointer(), *k_args, *scalars),
                shared_mem=smem_plain)
        if plan.num_q_tiles:
            mod.function(dq_name, dq_smem)(
                (plan.num_q_tiles, Hq), (dq_threads,),
                (q, k, v, dout, lse2, delta, dq, _index(plan.q_tiles), _index(plan.q_sched),
                 _index(plan.k.row), _index(plan.k.length), _index(plan.k.pos), *policy,
                 _i32(plan.k.per_seq), *scalars),
                shared_mem=dq_smem)
        return dq, dk, dv

    dq_accum = cupy.zeros((Tq, Hq, D), dtype=cupy.float32)
    if plan.num_k_tiles:
        mod.function(dkdv_atomic, smem_atomic)(
            (plan.num_k_tiles, Hk), (dkdv_threads,),
            (q, k, v, dout, lse2, delta, dk, dv, dq_accum, *k_args, *scalars),
            shared_mem=smem_atomic)
    dq = cupy.empty(q.shape, dtype=q.dtype)
    n = dq_accum.size
    blocks = max(1, min(math.ceil(n / CONVERT_THREADS), MAX_CONVERT_BLOCKS))
    mod.function(conv_name, 0)((blocks,), (CONVERT_THREADS,),
                               (dq_accum, dq, cupy.int64(n)))
    return dq, dk, dv


def _null_pointer():
    """A null pointer for a kernel argument the variant never touches (dq_accum without
    atomics): 8 bytes, like the float* it stands for."""
    import cupy
    return cupy.uint64(0)


def _warm_one(spec: KernelSpec) -> str:
    for name, _, smem in spec.kernels():
        module(spec).function(name, smem)
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
