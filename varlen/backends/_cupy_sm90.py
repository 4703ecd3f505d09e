"""Launcher of the sm_90a forward kernel (`kernels_cuda/fwd_sm90.cuh`): wgmma, TMA, mbarriers.

Opt-in only: the mma.sync kernels of `_cupy_kernels.py` stay the default everywhere. With
`VARLEN_CUPY_PATH=sm90a` in the environment (`selected()`), the CuPy backend's forward runs
this kernel instead of `_cupy_kernels.forward` on a compute capability 9.0 GPU and refuses any
other (see docs/hopper.md, "The sm_90a forward"); the backward's sm_90a kernel has
its own launcher, `_cupy_sm90_bwd`.

The kernel is persistent: a grid of at most (SMs x `CTAS_PER_SM`) blocks (`persistent_grid`; the
runtime says how many SMs the device has), each looping with a static stride over the work
items (query tile slot, head) in reverse slot order, as `varlen_fwd` takes them (a sequence's
heaviest tiles first under a causal mask). It reads the same `PlanView` and `CallParams` as
`varlen_fwd` and three CUDA tensor maps over the packed q, k, v (3D: (D, H, T) innermost
first, boxes of 64 head-dim columns x 1 head x BM rows for q, KN rows for k and v, 128B
swizzle, zero fill past row T). KN, the key chunk of the kernel's pipeline, is 128 rows at
D <= 128 (two of the plan's 64-row key tiles, or one of 128) and 64 at D = 256
(`default_key_chunk`). It is compiled by NVRTC for `sm_90a` (CuPy would pick the architecture
from the device, without the `a` suffix that wgmma and setmaxnreg need) and loaded as a cubin;
the tensor maps come from the driver's `cuTensorMapEncodeTiled`. A `Runtime` does both;
`EmulatedRuntime` runs the kernel through the host emulation instead, on a stand-in device of
`EMULATED_SM_COUNT` SMs (tests/test_sm90_forward.py).
"""
from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

import numpy as np

from .._array import alloc
from . import _cupy_spec

ENV_PATH = "VARLEN_CUPY_PATH"
ARCH = "sm_90a"
WG_THREADS = 128              # a warpgroup
WG_ROWS = 64                  # query rows per consumer warpgroup (wgmma M)
BOX_COLS = 64                 # head-dim columns per TMA box: 128 bytes, the 128B swizzle width
STAGES = 2                    # K/V ring (FwdSm90Config::STAGES)
NUM_BARRIERS = 2 + 5 * STAGES  # q_full, q_empty; k_full, v_full, ready, k_empty, v_empty per stage
# Blocks of the kernel an SM holds: its register file (`__launch_bounds__(threads, 1)`: 255
# registers x 256 threads, 168 x 384) takes all 64 K registers of an SM.
CTAS_PER_SM = 1
# The SMs of the emulation's stand-in device (`EmulatedRuntime`): few, so that its blocks loop
# over several work items each.
EMULATED_SM_COUNT = 3
SMEM_ALIGN = 1024             # slack to round the shared window up to the 128B swizzle's repeat
SWIZZLE_128B = 3              # CU_TENSOR_MAP_SWIZZLE_128B
OPTIN_SMEM = 227 * 1024
TENSOR_MAP_DTYPE = np.dtype([("opaque", np.uint64, 16)])      # CUtensorMap, 128 bytes


def selected() -> bool:
    """Whether the environment asks for the sm_90a forward (`VARLEN_CUPY_PATH=sm90a`)."""
    return os.environ.get(ENV_PATH, "") == "sm90a"


def default_key_chunk(head_dim: int) -> int:
    """Key rows per pipeline step (`sm90_key_chunk` of fwd_sm90.cuh): 128 where two K/V stages
    of them fit beside Q and the output stage (D <= 128), else 64."""
    return 128 if head_dim <= 128 else 64


@dataclass(frozen=True)
class Sm90Spec:
    """One variant of `varlen_fwd_sm90`: element type, head dim, plan tile sizes, softcap, and
    the kernel's key chunk (None: `default_key_chunk`)."""

    dtype: str          # "float16" | "bfloat16"
    head_dim: int
    block_m: int
    block_n: int        # the plan's key tiles
    softcap: bool
    key_chunk: int | None = None

    def __post_init__(self):
        if self.key_chunk is None:
            object.__setattr__(self, "key_chunk", default_key_chunk(self.head_dim))
        if self.dtype not in _cupy_spec.DTYPES:
            raise ValueError(f"{self.dtype=}: the sm_90a forward takes float16 or bfloat16")
        if self.head_dim not in (64, 128, 256):
            raise ValueError(f"{self.head_dim=}: the sm_90a forward takes D = 64, 128 or 256")
        if self.block_m not in (64, 128):
            raise ValueError(f"{self.block_m=}: one or two consumer warpgroups of 64 rows")
        if self.block_n not in (64, 128):
            raise ValueError(f"{self.block_n=}: plan key tiles of 64 or 128 rows")
        if self.key_chunk not in (64, 128):
            raise ValueError(f"{self.key_chunk=}: key chunks of 64 or 128 rows (wgmma N)")
        if self.block_n % self.key_chunk and self.key_chunk != 2 * self.block_n:
            raise ValueError(f"{self.key_chunk=} with {self.block_n=}: a key chunk is a part of "
                             "a plan tile or two of them")
        if self.smem > OPTIN_SMEM:
            raise ValueError(f"{self}: {self.smem} B of shared memory exceed {OPTIN_SMEM}")

    @property
    def ctype(self) -> str:
        return _cupy_spec.DTYPES[self.dtype]

    @property
    def threads(self) -> int:
        """A producer warpgroup and one consumer warpgroup per 64 query rows."""
        return WG_THREADS * (1 + self.block_m // WG_ROWS)

    @property
    def smem(self) -> int:
        """Q [BM][D], STAGES x (K, V) [KN][D], the output stage [BM][D + 8], the mbarriers
        (FwdSm90Config's layout), and 1 KiB to align the window."""
        e = _cupy_spec.ELEM_BYTES
        data = (self.block_m + 2 * STAGES * self.key_chunk) * self.head_dim * e
        data += self.block_m * (self.head_dim + _cupy_spec.SMEM_PAD) * e
        return -(-data // 8) * 8 + 8 * NUM_BARRIERS + SMEM_ALIGN

    @property
    def name(self) -> str:
        return (f"varlen_fwd_sm90<{self.ctype}, {self.head_dim}, {self.block_m}, "
                f"{self.block_n}, {'true' if self.softcap else 'false'}, {self.key_chunk}>")


def spec_for(plan, q, softcap: float) -> Sm90Spec:
    return Sm90Spec(str(q.dtype), int(q.shape[2]), int(plan.block_m), int(plan.block_n),
                    bool(softcap > 0))


def persistent_grid(work_items: int, sm_count: int) -> int:
    """Blocks of the persistent grid: one per work item up to `CTAS_PER_SM` per SM, at least one
    (it also writes the pad rows)."""
    return max(1, min(work_items, sm_count * CTAS_PER_SM))


def map_layout(a, box_rows: int):
    """The tensor map of a packed [T, H, D] array as (dims, byte strides of dims 1 and 2, box),
    innermost first."""
    T, H, D = a.shape
    e = a.dtype.itemsize
    return (D, H, T), (D * e, H * D * e), (BOX_COLS, 1, box_rows)


class Runtime:
    """Compiles the kernels for sm_90a with NVRTC, loads the cubin into CuPy and makes tensor
    maps with the CUDA driver (needs a Hopper GPU, cupy and cuda-bindings)."""

    def __init__(self):
        self._functions = {}
        self._sm_counts = {}

    def function(self, spec: Sm90Spec):
        if spec not in self._functions:
            import tempfile
            import cupy
            cubin, lowered, _ = _compile([spec])
            path = os.path.join(tempfile.mkdtemp(prefix="varlen_sm90_"), "fwd.cubin")
            with open(path, "wb") as f:
                f.write(cubin)
            fn = cupy.RawModule(path=path).get_function(lowered[spec.name])
            fn.max_dynamic_shared_size_bytes = spec.smem
            self._functions[spec] = fn
        return self._functions[spec]

    def tensor_map(self, a, box_rows: int) -> np.ndarray:
        from cuda.bindings import driver as cu
        dims, strides, box = map_layout(a, box_rows)
        err, tmap = cu.cuTensorMapEncodeTiled(
            cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 if a.dtype.name == "bfloat16"
            else cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
            3, a.data.ptr, list(dims), list(strides), list(box), [1, 1, 1],
            cu.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
            cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
            cu.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
            cu.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
        if err != cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuTensorMapEncodeTiled({a.shape=}, {box=}) failed: {err}")
        arg = np.zeros((), TENSOR_MAP_DTYPE)
        arg["opaque"] = np.asarray(tmap.opaque, dtype=np.uint64)
        return arg

    def sm_count(self) -> int:
        """The current device's SMs (`cudaDevAttrMultiProcessorCount`), read once per device
        (`Device.attributes` queries every attribute)."""
        import cupy
        dev = cupy.cuda.Device()
        if dev.id not in self._sm_counts:
            self._sm_counts[dev.id] = int(dev.attributes["MultiProcessorCount"])
        return self._sm_counts[dev.id]

    def launch(self, spec: Sm90Spec, *, grid, args):
        self.function(spec)(grid, (spec.threads,), args, shared_mem=spec.smem)


def _compile(specs):
    """NVRTC build of `specs` for sm_90a in one program: (cubin, {name: lowered name}, log)."""
    from ._cupy_compile import build_program
    return build_program([spec.name for spec in specs], ARCH)


def compile_report(specs) -> dict:
    """NVRTC build of `specs` for sm_90a: {name: {registers, spill_stores, spill_loads,
    static_smem, smem, threads, warnings}}. `registers` is ptxas' allocation at entry (the cap
    of `__launch_bounds__(threads, 1)`); setmaxnreg then moves registers from the producer to
    the consumer warpgroups. `warnings` lists the log's warning lines (C7508: setmaxnreg
    ignored)."""
    from ._cupy_compile import parse_ptxas_log
    specs = list(specs)
    _, lowered, log = _compile(specs)
    usage = parse_ptxas_log(log)
    warnings = [line for line in log.splitlines() if "warning" in line.lower()]
    return {s.name: {**usage[lowered[s.name]], "smem": s.smem, "threads": s.threads,
                     "warnings": warnings} for s in specs}


class EmulatedRuntime:
    """The same launches through the host emulation (`_cupy_emulation`): the kernel compiled
    with g++, one OS thread per CUDA thread, its tensor maps made by the emulation's
    `make_tensor_map`. Use after `_cupy_emulation.install_fake_cupy` (host arrays)."""

    MAX_PARAMS = 16
    ENTRY = b"varlen_fwd_sm90"          # the kernel's name in the emulation's sm90 table

    def __init__(self, sm_count: int = EMULATED_SM_COUNT):
        self._sm_count = sm_count
        self.grids = []                 # the grid of each launch, in order

    def sm_count(self) -> int:
        """The stand-in device's SMs: `EMULATED_SM_COUNT` unless the constructor was told."""
        return self._sm_count

    def _build_args(self, spec: Sm90Spec) -> tuple:
        """`_cupy_emulation._build`'s (type, D, BM, BN, BQ, softcap) of the build holding the
        kernel of `spec`."""
        assert spec.key_chunk == default_key_chunk(spec.head_dim), (
            f"{spec.name}: the emulation builds the default key chunk only")
        bq = 32 if spec.head_dim > 64 else 64
        return (spec.ctype, spec.head_dim, spec.block_m, spec.block_n, bq,
                "true" if spec.softcap else "false")

    def entry(self, spec) -> bytes:
        """The kernel of `spec` in the emulation's sm90 table."""
        return self.ENTRY

    def _lib(self, spec):
        from ._cupy_emulation import LANDING, _build, _mode
        lib = _build(*self._build_args(spec))
        # VARLEN_EMULATION_SCHEDULE picks when TMA copies land and wgmma operands are read
        # (seeded by VARLEN_EMULATION_SEED), with the threads free-running: warpgroup
        # collectives and mbarrier waits cannot run one warp at a time
        race, schedule, seed, strict_banks, _ = _mode()
        lib.emu_configure(ctypes.c_int(LANDING[schedule or ("random" if race else "wait")]),
                          ctypes.c_int(0), ctypes.c_ulonglong(seed), ctypes.c_int(strict_banks))
        return lib

    def tensor_map(self, a, box_rows: int) -> np.ndarray:
        dims, strides, box = map_layout(a, box_rows)
        arg = np.zeros((), TENSOR_MAP_DTYPE)
        lib = self._lib_any
        lib.emu_sm90_tensor_map(
            ctypes.c_void_p(a.ctypes.data), ctypes.c_int(3), ctypes.c_int(a.dtype.itemsize),
            (ctypes.c_uint64 * 3)(*dims), (ctypes.c_uint64 * 2)(*strides),
            (ctypes.c_uint32 * 3)(*box), ctypes.c_int(SWIZZLE_128B),
            ctypes.c_void_p(arg.ctypes.data))
        return arg

    def prepare(self, spec):
        self._lib_any = self._lib(spec)

    def launch(self, spec, *, grid, args):
        from ._cupy_emulation import OPTIN_SMEM as EMU_OPTIN, _Kernel
        lib = self._lib(spec)
        key = self.entry(spec)
        sizes = (ctypes.c_size_t * self.MAX_PARAMS)()
        n = lib.emu_sm90_param_sizes(key, sizes)
        assert n == len(args), f"{spec.name}: {len(args)} arguments for {n} parameters"
        assert spec.smem <= EMU_OPTIN, f"{spec.name}: {spec.smem} B of shared memory"
        # _Kernel._bytes_of: each argument as the bytes a GPU launch passes, size-checked
        # (tensor maps copied to 64-byte aligned buffers: the parameter type is alignas(64))
        fake = _Kernel.__new__(_Kernel)
        fake.name = spec.name
        values = [fake._bytes_of(i, a, size) for i, (a, size) in enumerate(zip(args, sizes))]
        addresses, keep = [], []
        for v in values:
            addr, size = ctypes.addressof(v), ctypes.sizeof(v)
            if size == TENSOR_MAP_DTYPE.itemsize:
                buf = (ctypes.c_char * (size + 64))()
                keep.append(buf)
                addr = -(-ctypes.addressof(buf) // 64) * 64
                ctypes.memmove(addr, ctypes.addressof(v), size)
            addresses.append(addr)
        params = (ctypes.c_void_p * n)(*addresses)
        self.grids.append(tuple(grid))
        rc = lib.emu_sm90_launch(key, ctypes.c_uint(grid[0]), ctypes.c_uint(grid[1]),
                                 ctypes.c_uint(spec.threads), ctypes.c_size_t(spec.smem), params)
        assert rc == 0, f"{spec.name}: no such entry point in the emulation"


_runtime = None


def runtime():
    global _runtime
    if _runtime is None:
        _runtime = Runtime()
    return _runtime


def use_runtime(rt) -> None:
    """Route launches through `rt` (EmulatedRuntime in the tests)."""
    global _runtime
    _runtime = rt


def forward(plan, q, k, v, *, softmax_scale: float, softcap: float):
    """`out [Tq, Hq, D]` (q's dtype, pad rows 0) and `lse [Hq, Tq]` (float32, pad rows -inf),
    as `_cupy_kernels.forward`, by the sm_90a kernel: one launch of `persistent_grid` blocks
    over num_q_tiles x Hq work items, no fill (the blocks also write the rows of no tile)."""
    import cupy
    from ._cupy_kernels import _check_heads, _data, call_params_arg, plan_view_arg
    q, k, v = _data(q), _data(k), _data(v)
    Tq, Hq, D = q.shape
    Hk = k.shape[1]
    _check_heads(Hq)
    spec = spec_for(plan, q, softcap)
    out = alloc(cupy, (Tq, Hq, D), q.dtype)
    lse = alloc(cupy, (Hq, Tq), np.float32)
    if Tq == 0 or Hq == 0:
        return out, lse
    rt = runtime()
    if hasattr(rt, "prepare"):
        rt.prepare(spec)
    plan_arg = plan_view_arg(plan)
    maps = (rt.tensor_map(q, spec.block_m), rt.tensor_map(k, spec.key_chunk),
            rt.tensor_map(v, spec.key_chunk))
    grid = persistent_grid(int(plan.num_q_tiles) * Hq, rt.sm_count())
    rt.launch(spec, grid=(grid, 1),
              args=(*maps, out, lse, plan_arg.struct,
                    call_params_arg(Hq, Hk, softmax_scale, softcap)))
    return out, lse
