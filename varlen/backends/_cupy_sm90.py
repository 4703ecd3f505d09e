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
from the device, without the `a` suffix that wgmma and setmaxnreg need) and loaded as a cubin,
kept on disk between processes (`cubin_path`; `python -m varlen.backends._cupy_sm90 [WORKERS]`
builds every variant the CuPy backend dispatches in parallel, as the GPU check does first);
the tensor maps come from the driver's `cuTensorMapEncodeTiled`. A `Runtime` does both;
`EmulatedRuntime` runs the kernel through the host emulation instead, on a stand-in device of
`EMULATED_SM_COUNT` SMs (tests/test_sm90_forward.py).

GQA packing: where the query heads outnumber the key heads (Hq / Hk = G > 1) and short
sequences leave the rows of a query tile mostly empty, the kernel packs P query heads of one key
head (P a power of two dividing G, at most `MAX_PACK`) into the M of a tile of BM / P positions:
row r of the tile is position r / P of head r % P, loaded by one TMA box of (64, P, BM / P)
elements. Each K/V chunk is then loaded once for P heads. The kernel reads a plan of BM / P-row
query tiles, built from the call's plan (`packed_plan`, kept while the plan lives). `choose_pack`
picks P from the plan's shape alone (no device read).
"""
from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import os
import sys
import tempfile
import time
import weakref
from dataclasses import dataclass

import numpy as np

from .._array import alloc
from . import _cupy_spec

ENV_PATH = "VARLEN_CUPY_PATH"
CACHE_ENV = "VARLEN_SM90A_CACHE"      # where sm_90a cubins are kept (default: under the temp dir)
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
# GQA packing: at most 8 query heads per position in a tile (FwdSm90Config::PACK), each doubling
# of P taken only when it raises the estimated fill of the tiles' rows by PACK_GAIN or more
PACKS = (1, 2, 4, 8)
MAX_PACK = PACKS[-1]
PACK_GAIN = 1.1


# Whether the sm_90a kernels run by default on a compute capability 9.0 GPU (VARLEN_CUPY_PATH
# unset): not until scripts/gpu_check.sh --sm90a has passed on one (docs/hopper.md, "The GPU
# side"); then True, and VARLEN_CUPY_PATH=mma keeps the mma.sync kernels there.
DEFAULT_ON_SM90 = False
PATHS = ("", "sm90a", "mma")


def path() -> str:
    """`VARLEN_CUPY_PATH`: "" (unset: the default for the GPU), "sm90a" (the sm_90a kernels,
    refusing any other GPU) or "mma" (the mma.sync kernels)."""
    value = os.environ.get(ENV_PATH, "")
    if value not in PATHS:
        raise ValueError(f"{ENV_PATH}={value!r}: expected 'sm90a', 'mma' or unset")
    return value


def selected() -> bool:
    """Whether the environment names the sm_90a kernels (`VARLEN_CUPY_PATH=sm90a`)."""
    return path() == "sm90a"


def by_default(compute_capability) -> bool:
    """Whether the sm_90a kernels run with VARLEN_CUPY_PATH unset: on a compute capability
    (9, 0) GPU once DEFAULT_ON_SM90 says the GPU check has passed. `compute_capability`: a
    callable giving the GPU's (None without one), asked only when the default can apply."""
    if not DEFAULT_ON_SM90 or path():
        return False
    cc = compute_capability()
    return cc is not None and tuple(cc) == (9, 0)


def default_key_chunk(head_dim: int) -> int:
    """Key rows per pipeline step (`sm90_key_chunk` of fwd_sm90.cuh): 128 where two K/V stages
    of them fit beside Q and the output stage (D <= 128), else 64."""
    return 128 if head_dim <= 128 else 64


@dataclass(frozen=True)
class Sm90Spec:
    """One variant of `varlen_fwd_sm90`: element type, head dim, the kernel's query rows per tile
    (the plan's query tiles when `pack` is 1, else block_m / pack positions), the plan's key
    tiles, softcap, the kernel's key chunk (None: `default_key_chunk`) and the query heads
    packed per position."""

    dtype: str          # "float16" | "bfloat16"
    head_dim: int
    block_m: int
    block_n: int        # the plan's key tiles
    softcap: bool
    key_chunk: int | None = None
    pack: int = 1

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
        if self.pack not in PACKS:
            raise ValueError(f"{self.pack=}: {PACKS} query heads per position")
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
                f"{self.block_n}, {'true' if self.softcap else 'false'}, {self.key_chunk}, "
                f"{self.pack}>")

    @property
    def plan_block_m(self) -> int:
        """The query tiles of the plan the kernel reads: block_m / pack positions."""
        return self.block_m // self.pack


def spec_for(plan, q, softcap: float) -> Sm90Spec:
    """The unpacked variant for a call with `plan` (its query tiles are the kernel's rows)."""
    return Sm90Spec(str(q.dtype), int(q.shape[2]), int(plan.block_m), int(plan.block_n),
                    bool(softcap > 0))


def row_fill(num_rows: int, num_segments: int, tile_rows: int) -> float:
    """Estimated share of the rows of the query tiles that hold a query: `num_rows` packed rows
    in `num_segments` segments cut into tiles of `tile_rows` rows, with the lengths unknown (on
    the device): the expected tiles when each segment ends in a tile filled uniformly at random,
    T / b + S (b - 1) / (2 b), at least one per segment, at most the plan's bound
    (`varlen.plan.tile_bound`). Decoding (T = S) fills 1 / b. 1 without rows."""
    from ..plan import tile_bound
    if not num_rows or not num_segments:
        return 1.0
    b = tile_rows
    expected = max(num_segments, num_rows / b + num_segments * (b - 1) / (2 * b))
    return num_rows / (min(expected, tile_bound(num_rows, num_segments, b)) * b)


def choose_pack(num_rows: int, num_segments: int, group: int, block_m: int) -> int:
    """Query heads to pack per position (1: none) for `group` query heads per key head and
    `block_m` rows per tile: P doubles while P divides the group, P <= MAX_PACK, and the
    estimated fill of the tiles' rows (`row_fill` with tiles of block_m / P positions) grows by
    PACK_GAIN or more. Long sequences fill their tiles either way and stay unpacked (a packed
    tile spans fewer positions, so a causal diagonal wastes more of its key chunks); short ones
    pack: one position per sequence (decoding) packs as far as the group allows."""
    p = 1
    while (2 * p <= MAX_PACK and group % (2 * p) == 0 and block_m % (2 * p) == 0
           and row_fill(num_rows, num_segments, block_m // (2 * p))
           >= PACK_GAIN * row_fill(num_rows, num_segments, block_m // p)):
        p *= 2
    return p


def pack_for(plan, num_rows: int, Hq: int, Hk: int, block_m: int, pack: int | None = None) -> int:
    """The query heads a call packs per position: `pack` checked (it must divide Hq / Hk and
    `block_m`, the kernel's rows per tile), or `choose_pack`'s for the plan's shape."""
    group = Hq // Hk if Hk else 1
    if pack is None:
        return choose_pack(num_rows, plan.batch * plan.q.per_seq, group, block_m)
    if pack not in PACKS or group % pack or block_m % pack:
        raise ValueError(f"{pack=}: the query heads packed per position must be one of {PACKS} "
                         f"and divide Hq / Hk = {group} and block_m = {block_m}")
    return pack


# plan -> {pack: the plan of block_m / pack query rows}, kept while the plan lives
_packed_plans = weakref.WeakKeyDictionary()


def packed_plan(plan, pack: int):
    """The plan of `plan`'s segments and mask with query tiles of plan.block_m / pack rows
    (`pack` 1: `plan` itself), built once per plan (device kernels, no host read)."""
    if pack == 1:
        return plan
    per_plan = _packed_plans.setdefault(plan, {})
    if pack not in per_plan:
        from ..masks import Mask
        from ..plan import build_plan
        mask = Mask(window_left=plan.window_left, window_right=plan.window_right,
                    bottom_right=plan.bottom_right)
        per_plan[pack] = build_plan(plan.q, plan.k, mask, block_m=plan.block_m // pack,
                                    block_n=plan.block_n)
    return per_plan[pack]


def persistent_grid(work_items: int, sm_count: int) -> int:
    """Blocks of the persistent grid: one per work item up to `CTAS_PER_SM` per SM, at least one
    (it also writes the pad rows)."""
    return max(1, min(work_items, sm_count * CTAS_PER_SM))


def map_layout(a, box_rows: int, box_heads: int = 1):
    """The tensor map of a packed [T, H, D] array as (dims, byte strides of dims 1 and 2, box),
    innermost first: boxes of 64 columns of `box_heads` heads of `box_rows` rows."""
    T, H, D = a.shape
    e = a.dtype.itemsize
    return (D, H, T), (D * e, H * D * e), (BOX_COLS, box_heads, box_rows)


def encode_args(a, box_rows: int, box_heads: int = 1) -> tuple:
    """The arguments of the driver's `cuTensorMapEncodeTiled` (cuda-bindings) for the map of a
    packed [T, H, D] CuPy array (`map_layout`): the dims and strides as `cuuint64_t`, the box and
    element strides as `cuuint32_t` (the bindings refuse plain ints in those lists), 128B
    swizzle, zero fill."""
    from cuda.bindings import driver as cu
    dims, strides, box = map_layout(a, box_rows, box_heads)
    return (cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 if a.dtype.name == "bfloat16"
            else cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
            3, a.data.ptr, [cu.cuuint64_t(x) for x in dims], [cu.cuuint64_t(x) for x in strides],
            [cu.cuuint32_t(x) for x in box], [cu.cuuint32_t(1)] * 3,
            cu.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
            cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
            cu.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
            cu.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)


class Runtime:
    """Compiles the kernels for sm_90a with NVRTC, loads the cubin into CuPy and makes tensor
    maps with the CUDA driver (needs a Hopper GPU, cupy and cuda-bindings)."""

    def __init__(self):
        self._functions = {}
        self._sm_counts = {}

    def function(self, spec):
        """The loaded kernel of `spec` (a forward or backward spec: its `name`, `smem`)."""
        if spec not in self._functions:
            import cupy
            path, lowered = cubin_path(spec.name)
            fn = cupy.RawModule(path=path).get_function(lowered)
            fn.max_dynamic_shared_size_bytes = spec.smem
            self._functions[spec] = fn
        return self._functions[spec]

    def tensor_map(self, a, box_rows: int, box_heads: int = 1) -> np.ndarray:
        from cuda.bindings import driver as cu
        err, tmap = cu.cuTensorMapEncodeTiled(*encode_args(a, box_rows, box_heads))
        if err != cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuTensorMapEncodeTiled({a.shape=}, "
                               f"{map_layout(a, box_rows, box_heads)=}) failed: {err}")
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


def cache_dir() -> str:
    """The folder of the sm_90a cubins: $VARLEN_SM90A_CACHE, else varlen_sm90a_cache in the
    temp dir."""
    return os.environ.get(CACHE_ENV) or os.path.join(tempfile.gettempdir(), "varlen_sm90a_cache")


def _write_atomically(path: str, data: bytes) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def cubin_path(name: str) -> tuple:
    """(path of the sm_90a cubin holding kernel `name`, its lowered name), from `cache_dir()`:
    keyed by the name, NVRTC's version and the build options (which carry the hash of every
    kernel source, `_cupy_spec.source_hash`), built by NVRTC when missing. Files are written
    under a temporary name and renamed, so processes building at once never read half a file."""
    from cuda.bindings import nvrtc
    from ._cupy_compile import build_program, program_options
    _, major, minor = nvrtc.nvrtcVersion()
    key = hashlib.sha256("\0".join([name, f"nvrtc {major}.{minor}", *program_options(ARCH)])
                         .encode()).hexdigest()[:32]
    folder = cache_dir()
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{key}.cubin")
    name_path = os.path.join(folder, f"{key}.name")
    if not (os.path.exists(path) and os.path.exists(name_path)):
        cubin, lowered, _ = build_program([name], ARCH)
        _write_atomically(name_path, lowered[name].encode())
        _write_atomically(path, cubin)
    with open(name_path) as f:
        return path, f.read()


def dispatched_specs() -> list:
    """The sm_90a variants the CuPy backend runs under `VARLEN_CUPY_PATH=sm90a` with its default
    plan tiles on an H100/H200 ((128, 64) at D = 64, (128, 128) at D = 128, (64, 64) at D = 256):
    the forward with 1, 2, 4 and 8 heads packed per position and the dK/dV kernel in both dQ
    modes, each dtype, with and without a softcap."""
    from . import _cupy_sm90_bwd
    from .cupy_backend import _default_blocks_for
    specs = []
    for d in (64, 128, 256):
        bm, bn = _default_blocks_for(d)
        for dtype in _cupy_spec.DTYPES:
            for softcap in (False, True):
                specs += [Sm90Spec(dtype, d, bm, bn, softcap, pack=p) for p in PACKS]
                specs += [_cupy_sm90_bwd.BwdSm90Spec(dtype, d, bn, softcap, ordered)
                          for ordered in (False, True)]
    return specs


def warm(workers: int, specs=None) -> int:
    """Builds the cubins of `specs` (default `dispatched_specs()`) into the cache with `workers`
    processes; returns how many there are."""
    from concurrent.futures import ProcessPoolExecutor
    names = [s.name for s in (dispatched_specs() if specs is None else specs)]
    with ProcessPoolExecutor(max(1, workers)) as pool:
        for _ in pool.map(cubin_path, names):
            pass
    return len(names)


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
        return self.ENTRY if spec.pack == 1 else self.ENTRY + b"_pack%d" % spec.pack

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

    def tensor_map(self, a, box_rows: int, box_heads: int = 1) -> np.ndarray:
        dims, strides, box = map_layout(a, box_rows, box_heads)
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


def main(argv=None) -> int:
    """`python -m varlen.backends._cupy_sm90 [WORKERS]`: every dispatched variant into the
    cubin cache (WORKERS processes, default the CPU count)."""
    argv = sys.argv[1:] if argv is None else argv
    workers = int(argv[0]) if argv else (os.cpu_count() or 1)
    t0 = time.perf_counter()
    n = warm(workers)
    print(f"{n} sm_90a kernels in {cache_dir()} ({time.perf_counter() - t0:.0f} s, "
          f"{workers} processes)")
    return 0


def forward(plan, q, k, v, *, softmax_scale: float, softcap: float, pack: int | None = None):
    """`out [Tq, Hq, D]` (q's dtype, pad rows 0) and `lse [Hq, Tq]` (float32, pad rows -inf),
    as `_cupy_kernels.forward`, by the sm_90a kernel: one launch of `persistent_grid` blocks
    over num_q_tiles x Hq / pack work items, no fill (the blocks also write the rows of no
    tile). `pack`: query heads per position in a tile (`pack_for`; None: `choose_pack`)."""
    import cupy
    from ._cupy_kernels import _check_heads, _data, call_params_arg, plan_view_arg
    q, k, v = _data(q), _data(k), _data(v)
    Tq, Hq, D = q.shape
    Hk = k.shape[1]
    _check_heads(Hq)
    spec = spec_for(plan, q, softcap)
    pack = pack_for(plan, Tq, Hq, Hk, spec.block_m, pack)
    spec = dataclasses.replace(spec, pack=pack)
    out = alloc(cupy, (Tq, Hq, D), q.dtype)
    lse = alloc(cupy, (Hq, Tq), np.float32)
    if Tq == 0 or Hq == 0:
        return out, lse
    rt = runtime()
    if hasattr(rt, "prepare"):
        rt.prepare(spec)
    kplan = packed_plan(plan, pack)
    plan_arg = plan_view_arg(kplan)
    maps = (rt.tensor_map(q, spec.plan_block_m, pack), rt.tensor_map(k, spec.key_chunk),
            rt.tensor_map(v, spec.key_chunk))
    grid = persistent_grid(int(kplan.num_q_tiles) * (Hq // pack), rt.sm_count())
    rt.launch(spec, grid=(grid, 1),
              args=(*maps, out, lse, plan_arg.struct,
                    call_params_arg(Hq, Hk, softmax_scale, softcap)))
    return out, lse


if __name__ == "__main__":
    sys.exit(main())
