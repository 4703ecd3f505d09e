"""Run the CuPy backend's CUDA kernels on a CPU, through a host emulation, for testing.

    python -m varlen.backends._cupy_emulation [--quick]

The kernel sources are compiled with g++ (`-DVARLEN_HOST_EMULATION`, see
`kernels_cuda/host_emulation.cuh`): one OS thread per CUDA thread, warp-collective PTX
primitives (ldmatrix, mma.sync, shuffles) emulated from the PTX ISA's fragment layouts. The
real launchers of `_cupy_kernels.py` drive them: a stand-in `cupy` module turns each kernel
launch into a call of the emulated kernel with the very argument tuple a GPU launch would
get, passed as a GPU launch passes it (a pointer to each argument's bytes; the `PlanView` and
`CallParams` structs by value), each argument's size checked against its parameter's. So
argument order, struct layouts, scalar types, grids, shared-memory sizes (and the >48 KiB
opt-in) are exercised too. Fresh buffers are NaN-filled; results are compared with the
float64 reference (`varlen.testing`, STYLE.md tolerances).

This checks the kernels' logic (fragment indexing, schedule walking, masks, online softmax,
backward algebra, pad rows), not timing, races or register budgets; it is slow (seconds per
block) and only for small batches. It replaces `sys.modules["cupy"]`, so run it in its own
process (the CI test does).
"""
from __future__ import annotations

import ctypes
import hashlib
import math
import os
import re
import subprocess
import sys
import tempfile
import time
import types

import numpy as np

from .._array import set_nan_fill
from ..kernels_cuda import SOURCE_DIR
from . import _cupy_spec

ENTRY = os.path.join(SOURCE_DIR, "host_emulation_entry.cu")
BUILD_DIR = os.environ.get("VARLEN_EMULATION_DIR",
                           os.path.join(tempfile.gettempdir(), "varlen_host_emulation"))
STATIC_SMEM_LIMIT = _cupy_spec.STATIC_SMEM_LIMIT
EMULATED_SMEM = 256 * 1024          # size of the emulation's shared-memory buffer

_libs: dict = {}


def _build(T, D, BM, BN, BQ, SC):
    key = (T, D, BM, BN, BQ, SC)
    if key in _libs:
        return _libs[key]
    os.makedirs(BUILD_DIR, exist_ok=True)
    tag = hashlib.sha256(f"{key}{_cupy_spec.source_hash()}".encode()).hexdigest()[:16]
    path = os.path.join(BUILD_DIR, f"varlen_emu_{tag}.so")
    if not os.path.exists(path):
        tmp = f"{path}.{os.getpid()}.tmp"
        cmd = [os.environ.get("CXX", "g++"), "-x", "c++", "-std=c++20", "-O1", "-pthread",
               "-shared", "-fPIC", "-DVARLEN_HOST_EMULATION", f"-I{SOURCE_DIR}",
               f"-DEMU_T={T}", f"-DEMU_D={D}", f"-DEMU_BM={BM}", f"-DEMU_BN={BN}",
               f"-DEMU_BQ={BQ}", f"-DEMU_SC={SC}", ENTRY, "-o", tmp]
        subprocess.run(cmd, check=True)
        os.replace(tmp, path)
    lib = _libs[key] = ctypes.CDLL(path)
    return lib


class _Kernel:
    """Stands for a CuPy RawKernel: same call signature; runs the emulated kernel.

    Arguments reach it as a GPU launch passes them: an array of pointers, one per kernel
    parameter, each to that argument's bytes (a device array's address, a scalar's value, a
    struct's bytes), and the entry point calls the kernel with every parameter by value. Each
    argument's size must equal its parameter's `sizeof`, so a struct whose dtype does not
    match the C struct, a missing argument or a 64-bit scalar for an `int` is refused.
    """

    MAX_PARAMS = 32

    def __init__(self, name: str, block_m: int):
        self.name = name
        self.max_dynamic_shared_size_bytes = 0
        kind, args = re.fullmatch(r"(\w+)<(.*)>", name).groups()
        a = [x.strip() for x in args.split(",")]
        T, D, BM, BN, SC = a[0], 64, block_m, 64, "false"
        if kind in ("varlen_fwd", "varlen_bwd_dq"):
            D, BM, BN, SC = int(a[1]), int(a[2]), int(a[3]), a[4]
        elif kind == "varlen_bwd_dkdv":
            D, BN, SC = int(a[1]), int(a[2]), a[4]
            kind += "_atomic" if a[5] == "true" else ""
        elif kind == "varlen_bwd_preprocess":
            D = int(a[1])
        elif kind != "varlen_bwd_dq_convert":
            raise AssertionError(f"unknown kernel {name}")
        bq = int(a[3]) if kind.startswith("varlen_bwd_dkdv") else (32 if D > 64 else 64)
        self.lib = _build(T, D, BM, BN, bq, SC)
        self.key = kind.encode()
        sizes = (ctypes.c_size_t * self.MAX_PARAMS)()
        n = self.lib.emu_param_sizes(self.key, sizes)
        assert n >= 0, f"{name}: no entry point {kind} in the emulation"
        self.param_sizes = list(sizes[:n])

    def __call__(self, grid, block, args, shared_mem=0, stream=None):
        assert shared_mem <= EMULATED_SMEM, f"{self.name}: {shared_mem} B of shared memory"
        if shared_mem > STATIC_SMEM_LIMIT:
            assert self.max_dynamic_shared_size_bytes >= shared_mem, (
                f"{self.name}: {shared_mem} B dynamic shared memory without the opt-in")
        if len(args) != len(self.param_sizes):
            raise TypeError(f"{self.name}: {len(args)} arguments for "
                            f"{len(self.param_sizes)} parameters")
        values = [self._bytes_of(i, a, size)
                  for i, (a, size) in enumerate(zip(args, self.param_sizes))]
        params = (ctypes.c_void_p * len(values))(*(ctypes.addressof(v) for v in values))
        grid = tuple(grid) + (1,) * (2 - len(grid))
        self.lib.emu_launch(self.key, ctypes.c_uint(grid[0]), ctypes.c_uint(grid[1]),
                            ctypes.c_uint(block[0]), params)

    def _bytes_of(self, i, a, size):
        """Argument i as the bytes CuPy would pass, in a buffer aligned for any parameter."""
        if isinstance(a, np.ndarray) and a.dtype.names is not None:
            # A NumPy array of size one travels by value: a struct.
            assert a.size == 1, f"{self.name}: argument {i} is a struct array of {a.size}"
            raw = a.tobytes()
            value = (ctypes.c_uint64 * -(-len(raw) // 8))()
            ctypes.memmove(value, raw, len(raw))
            what = f"{len(raw)} bytes of dtype {a.dtype}"
            got = len(raw)
        elif isinstance(a, np.ndarray):
            assert a.flags.c_contiguous, f"{self.name}: argument {i} is not contiguous"
            value, what = ctypes.c_void_p(a.ctypes.data), "a pointer"
            got = ctypes.sizeof(value)
        elif isinstance(a, (np.int32, np.float32, np.int64, np.uint64)):
            value = np.ctypeslib.as_ctypes_type(a.dtype)(a.item())
            what = f"a {a.dtype} scalar"
            got = ctypes.sizeof(value)
        else:
            raise TypeError(f"{self.name}: argument {i} of type {type(a).__name__} has no "
                            f"fixed size on the kernel's side")
        if got != size:
            raise TypeError(f"{self.name}: argument {i} is {what} ({got} B) but the kernel's "
                            f"parameter has {size} B")
        return value


def _host_data(a):
    """`_cupy_kernels._data` for host arrays: contiguous, 16-byte aligned (the emulated
    cp.async checks the alignment of every global address, as the GPU requires)."""
    a = np.ascontiguousarray(a)
    if a.ctypes.data % 16:
        a = a.copy()
    return a


class _Device:
    """The emulated GPU as `cupy.cuda.Device` describes it: sm_90 with 227 KiB of opt-in shared
    memory per block (the emulation's buffer holds EMULATED_SMEM)."""

    compute_capability = "90"
    attributes = {"MaxSharedMemoryPerBlockOptin": 227 * 1024}

    def __init__(self, device=None):
        self.id = 0


def install_fake_cupy(block_m: int):
    """Replace `cupy` by NumPy plus an emulating RawModule (this process only)."""
    fake = types.ModuleType("cupy")
    for n in ("int32", "float32", "int64", "uint64", "uint16", "zeros", "full", "empty",
              "ascontiguousarray", "ndarray"):
        setattr(fake, n, getattr(np, n))

    class RawModule:
        def __init__(self, code=None, options=(), name_expressions=()):
            self.names = list(name_expressions)

        def get_function(self, name):
            assert name in self.names, f"{name} is not among the name expressions"
            return _Kernel(name, block_m)

    fake.RawModule = RawModule
    fake.cuda = types.SimpleNamespace(Device=_Device, runtime=types.SimpleNamespace(
        getDeviceProperties=lambda device_id: {"name": b"host emulation"}))
    sys.modules["cupy"] = fake
    from . import _cupy_kernels
    _cupy_kernels._modules.clear()
    _cupy_kernels._data = _host_data                 # host arrays have no device pointer
    _cupy_kernels._address = lambda a: a.ctypes.data
    set_nan_fill(True)                               # an unwritten output element shows
    return fake


def run_case(label, lengths_q, lengths_k, *, Hq, Hk, D, dtype, mask, gaps, softcap, block_m,
             seed=0):
    """Forward and both backward modes of one batch through the emulated kernels, checked
    against the float64 reference. Raises AssertionError on a mismatch."""
    import varlen
    from ..testing import check_against_reference, make_batch
    from .cupy_backend import BACKEND
    install_fake_cupy(block_m)
    rng = np.random.default_rng(seed)
    b = make_batch(rng, lengths_q, lengths_k, Hq=Hq, Hk=Hk, D=D, dtype=dtype, mask=mask,
                   gaps=gaps)
    plan = varlen.plan(b.cu_q, b.cu_k, seq_offsets_q=b.off_q, seq_offsets_k=b.off_k,
                       mask=b.mask, num_rows_q=b.q.shape[0], num_rows_k=b.k.shape[0],
                       block_m=block_m, block_n=64)
    scale = 1.0 / math.sqrt(D)
    out, lse = BACKEND.forward(plan, b.q, b.k, b.v, softmax_scale=scale, softcap=softcap)
    for det in (False, True):
        grads = BACKEND.backward(plan, b.dout, b.q, b.k, b.v, out, lse,
                                      softmax_scale=scale, softcap=softcap, deterministic=det)
        check_against_reference(b, out, lse, grads, softcap=softcap,
                                label=f"{label} (emulated, deterministic={det})")


def run_cp_case(label="CP2-zigzag-segments-fp16-D64", cp_size=2, seed=0):
    """Context-parallel segment plans (two query segments per sequence, all-gathered keys:
    2 * cp_size key segments) through the emulated kernels, against the NumPy backend on the
    same plan, for every rank."""
    from .. import comm
    from ..masks import Mask
    from ..plan import build_plan
    from . import cupy_backend, numpy_backend
    install_fake_cupy(64)
    cu = np.array([0, 37, 37, 200, 290], np.int32)
    part = comm.partition(cu, cp_size, "zigzag")
    mask = Mask(window_left=np.array([-1, -1, 30, -1], np.int32),
                window_right=np.array([0, -1, 0, 5], np.int32),
                bottom_right=np.array([0, 0, 1, 0], np.int32))
    rng = np.random.default_rng(seed)
    Hq, Hk, D = 4, 2, 64
    scale = 1.0 / math.sqrt(D)
    for rank in range(cp_size):
        plan = build_plan(part.segments(rank), part.gathered_segments(), mask, block_m=64,
                          block_n=64)
        q, dout = (rng.standard_normal((plan.q.num_rows, Hq, D)).astype(np.float16)
                   for _ in range(2))
        k, v = (rng.standard_normal((plan.k.num_rows, Hk, D)).astype(np.float16)
                for _ in range(2))
        f64 = [x.astype(np.float64) for x in (dout, q, k, v)]
        ref_backend, backend = numpy_backend.BACKEND, cupy_backend.BACKEND
        ref_out, ref_lse = ref_backend.forward(plan, *f64[1:], softmax_scale=scale, softcap=0.0)
        ref = (ref_out, *ref_backend.backward(plan, f64[0], *f64[1:], ref_out, ref_lse,
                                              softmax_scale=scale, softcap=0.0))
        out, lse = backend.forward(plan, q, k, v, softmax_scale=scale, softcap=0.0)
        for det in (False, True):
            got = (out, *backend.backward(plan, dout, q, k, v, out, lse, softmax_scale=scale,
                                          softcap=0.0, deterministic=det))
            for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
                err = float(np.abs(a.astype(np.float64) - b).max())
                bound = 2.0 ** -7 * float(np.abs(b).max()) + 2.0 ** -10
                assert err <= bound, (f"{label} rank {rank} {name} (deterministic={det}): "
                                      f"max error {err:.3e} > {bound:.3e}")
        finite = np.isfinite(ref_lse)
        assert np.array_equal(np.isfinite(lse), finite), f"{label} rank {rank}: lse -inf rows"
        assert np.abs(lse[finite] - ref_lse[finite]).max() <= 1e-2, f"{label} rank {rank}: lse"


def main(argv=None) -> int:
    quick = "--quick" in (argv if argv is not None else sys.argv[1:])
    ok = True
    from ._emulation_cases import cases
    todo = [(c["label"], run_case, c) for c in cases(quick)]
    if not quick:
        todo.append(("CP2-zigzag-segments-fp16-D64", run_cp_case, {}))
    for label, fn, case in todo:
        t0 = time.time()
        try:
            fn(**case)
            print(f"ok      {label} ({time.time() - t0:.0f} s)", flush=True)
        except AssertionError as e:
            ok = False
            print(f"FAILED  {label}: {e}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
