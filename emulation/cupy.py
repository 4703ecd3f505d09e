"""Run the CuPy backend's CUDA kernels on a CPU, through a host emulation, for testing.

    python -m emulation [--quick | --strict] [--race]
                                              [--schedule wait|issue|random] [--seeds 0,1,2]

The kernel sources are compiled with g++ (`-DVARLEN_HOST_EMULATION`, see
`kernels_cuda/host_emulation.cuh`): one OS thread per CUDA thread, warp-collective PTX
primitives (ldmatrix, mma.sync, shuffles) emulated from the PTX ISA's fragment layouts. The
real launchers of `varlen.backends.cupy` drive them: a stand-in `cupy` module turns each kernel
launch into a call of the emulated kernel with the very argument tuple a GPU launch would
get, passed as a GPU launch passes it (a pointer to each argument's bytes; the `FwdParams` or
`BwdParams` struct, and the sm_90a kernels' tensor maps, by value), each argument's size
checked against its parameter's. So argument order, struct layouts, scalar types, grids,
shared-memory sizes (and the >48 KiB opt-in) are exercised too, and the launchers' choice of
reading a view where it lies (`launch.data`, run on the host arrays). Fresh buffers are NaN-filled; results are compared with the
float64 reference (`varlen.testing`, STYLE.md tolerances).

Besides the kernels' logic (fragment indexing, schedule walking, masks, online softmax,
backward algebra, pad rows), every run checks what a GPU would trip over: shared memory of
exactly the launch's size ending at a guard page (an overrun faults), all 32 lanes at the same
ldmatrix/mma/shfl call site, 16-byte alignment, ldmatrix bank conflicts (the padding
invariant; cp.async conflicts are counted and printed), and cp.async destinations poisoned
with NaN at issue. Opt-in modes (also as environment variables, which the launched kernels of
any process read):

* `--race` (`VARLEN_EMULATION_RACE=1`): built with ThreadSanitizer; a data race between
  emulated threads (a missing `__syncthreads`, a prefetch into a stage still being read) stops
  the run with a report naming the kernel and block. The process re-executes itself with the
  TSan runtime preloaded. Copies land at random points unless `--schedule` says otherwise.
* `--schedule wait|issue|random` (`VARLEN_EMULATION_SCHEDULE`): when cp.async copies land (at
  the retiring wait, at issue, or at a seeded random synchronisation point in between); without
  `--race` the warps of a block also run one at a time between barriers, in a seeded permuted
  order. `--seeds` (`VARLEN_EMULATION_SEED`) lists the seeds each case runs with.
* `--strict`: the cases made for these modes (every kernel reaches three partner chunks per
  block, a query tile without keys); `VARLEN_EMULATION_STRICT_BANKS=1` makes a cp.async bank
  conflict fatal; `VARLEN_EMULATION_SOURCE_DIR` compiles kernel sources from another directory
  (emulation/mutations.py).

Not timing, register budgets or hardware rounding; it is slow (seconds per block, about four
times that under TSan) and only for small batches. It replaces `sys.modules["cupy"]`, so run it in
its own process (the CI tests do).
"""
from __future__ import annotations

import collections
import contextlib
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

from varlen._array import set_nan_fill
from varlen.backends.cupy import launch as cupy_launch
from varlen.backends.cupy import traits
from varlen.backends.cupy.compile import ENTRY_FILE, POLL_LIMIT_ENV, poll_limit
from varlen.kernels_cuda import SOURCE_DIR

# The emulation's own headers (host_emulation*.cuh) and entry points: never part of the product.
EMULATION_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cuda")

BUILD_DIR = os.environ.get("VARLEN_EMULATION_DIR",
                           os.path.join(tempfile.gettempdir(), "varlen_host_emulation"))
STATIC_SMEM_LIMIT = traits.STATIC_SMEM_LIMIT
OPTIN_SMEM = 227 * 1024             # the emulated sm_90's opt-in shared memory per block
LANDING = {"wait": 0, "issue": 1, "random": 2}     # hostemu::Landing
TSAN_FLAGS = ("-fsanitize=thread", "-fno-builtin")
TSAN_OPTIONS = "halt_on_error=1 exitcode=66 history_size=7 report_signal_unsafe=0"

_libs: dict = {}
# Kernel launches of this process, by kernel name (tests count the launches of a step).
launches: collections.Counter = collections.Counter()
# Host reads of the stand-in's device arrays made under `watch_host_reads`, by kind.
host_reads: collections.Counter = collections.Counter()
_watching = False
# The plan kernels (kernels_cuda/plan_build.cuh) have no template arguments: every variant's
# library holds them, so they run in that of this variant.
PLAN_KERNEL_VARIANT = ("__half", 64, 64, 64, 64, "false")


def _mode():
    """The emulation mode of this process, from the environment: (race, schedule, seed,
    strict cp.async banks, source directory)."""
    env = os.environ.get
    schedule = env("VARLEN_EMULATION_SCHEDULE", "")
    assert schedule in ("", *LANDING), f"VARLEN_EMULATION_SCHEDULE={schedule!r}: one of {LANDING}"
    return (env("VARLEN_EMULATION_RACE", "0") == "1", schedule,
            int(env("VARLEN_EMULATION_SEED", "0")),
            env("VARLEN_EMULATION_STRICT_BANKS", "0") == "1",
            env("VARLEN_EMULATION_SOURCE_DIR", SOURCE_DIR))


def tsan_runtime() -> str:
    """Path of the compiler's ThreadSanitizer runtime (preloaded by race mode)."""
    out = subprocess.run([os.environ.get("CXX", "g++"), "-print-file-name=libtsan.so"],
                         capture_output=True, text=True, check=True).stdout.strip()
    return os.path.realpath(out)


def tsan_loaded() -> bool:
    with open("/proc/self/maps") as f:
        return "libtsan" in f.read()


def _sources_hash(source_dir):
    h = hashlib.sha256()
    for folder in (source_dir, EMULATION_DIR):
        for name in sorted(os.listdir(folder)):
            if name.endswith((".cuh", ".cu")):
                with open(os.path.join(folder, name), "rb") as f:
                    h.update(name.encode() + f.read())
    return h.hexdigest()[:16]


def _compile_command(source, out, flags, source_dir, defines=()):
    """g++ of `source` against the kernel sources in `source_dir` and the emulation headers."""
    return [os.environ.get("CXX", "g++"), "-x", "c++", "-std=c++20", "-O1", "-pthread",
            "-shared", "-fPIC", *flags, "-DVARLEN_HOST_EMULATION", f"-I{source_dir}",
            f"-I{EMULATION_DIR}", *defines, source, "-o", out]


def _build(T, D, BM, BN, BQ, SC, KN=None, STAGES=None, KN90=None, prelude="", DV=None,
           DROP=False):
    """The library of variant (T, D, BM, BN, BQ, SC): every kernel's entry point, with the
    tiles the launchers pass as template arguments (None: `traits.tile_size`'s): `KN` and
    `STAGES` of the mma.sync forward, `KN90` of the sm_90a forward. `prelude`: what a module's
    source puts ahead of the kernels (a call's generated mask_mod and score_mod,
    `varlen.backends.cupy.mods`), included first. `DV`: head_dim_v (None: D). `DROP`: the
    mma.sync kernels with dropout (their DROPOUT template argument)."""
    race, schedule, seed, strict_banks, source_dir = _mode()
    mma = traits.tile_size("fwd", "mma", "float16", D, BM, BN)
    KN = mma.key_chunk if KN is None else KN
    STAGES = mma.stages if STAGES is None else STAGES
    KN90 = traits.tile_size("fwd", "sm90a", "float16", D, BM, BN).key_chunk if KN90 is None \
        else KN90
    DV = D if DV is None else DV
    limit = poll_limit()
    key = (T, D, BM, BN, BQ, SC, KN, STAGES, KN90, prelude, race, source_dir, DV, limit, DROP)
    if key not in _libs:
        if race and not tsan_loaded():
            raise RuntimeError("VARLEN_EMULATION_RACE=1 needs the ThreadSanitizer runtime "
                               f"preloaded: LD_PRELOAD={tsan_runtime()} (or use --race)")
        os.makedirs(BUILD_DIR, exist_ok=True)
        flags = TSAN_FLAGS if race else ()
        dv_tag = "" if DV == D else f"DV{DV}"       # the D == DV libraries keep their tags
        dv_tag += f"poll{limit}" if limit else ""
        dv_tag += "DROP" if DROP else ""
        tag = hashlib.sha256(f"{key[:10]}{flags}{_sources_hash(source_dir)}{dv_tag}".encode())
        path = os.path.join(BUILD_DIR, f"varlen_emu_{tag.hexdigest()[:16]}.so")
        if not os.path.exists(path):
            tmp = f"{path}.{os.getpid()}.tmp"
            defines = (f"-DEMU_T={T}", f"-DEMU_D={D}", f"-DEMU_BM={BM}", f"-DEMU_BN={BN}",
                       f"-DEMU_BQ={BQ}", f"-DEMU_SC={SC}", f"-DEMU_KN={KN}",
                       f"-DEMU_STAGES={STAGES}", f"-DEMU_KN90={KN90}", f"-DEMU_DV={DV}",
                       f"-D{POLL_LIMIT_ENV}={limit}", f"-DEMU_DROP={int(DROP)}")
            if prelude:
                header = f"{path[:-3]}_prelude.cuh"
                with open(header, "w") as f:
                    f.write(prelude)
                defines += ("-include", header)
            cmd = _compile_command(os.path.join(EMULATION_DIR, "host_emulation_entry.cu"), tmp,
                                   flags, source_dir, defines)
            subprocess.run(cmd, check=True)
            os.replace(tmp, path)
        _libs[key] = ctypes.CDLL(path)
    lib = _libs[key]
    # Race mode keeps the threads free-running (a turnstile would order every access for TSan).
    lib.emu_configure(ctypes.c_int(LANDING[schedule or ("random" if race else "wait")]),
                      ctypes.c_int(bool(schedule) and not race), ctypes.c_ulonglong(seed),
                      ctypes.c_int(strict_banks))
    return lib


def bank_counts():
    """Summed over the kernels run so far: ldmatrix phases, their extra wavefronts (bank
    conflicts), cp.async quarter-warp writes, their extra wavefronts."""
    total = np.zeros(4, np.uint64)
    for lib in _libs.values():
        out = (ctypes.c_ulonglong * 4)()
        lib.emu_bank_counts(out)
        total += np.array(out[:], np.uint64)
    return [int(x) for x in total]


def user_mask_calls():
    """Summed over the kernels run so far: the pairs a mask_mod was evaluated on (each counter
    once: builds loaded together may share one)."""
    counts = {}
    for lib in _libs.values():
        lib.emu_user_mask_calls.restype = ctypes.c_ulonglong
        lib.emu_user_mask_counter.restype = ctypes.c_void_p
        counts[lib.emu_user_mask_counter()] = int(lib.emu_user_mask_calls())
    return sum(counts.values())


class _Kernel:
    """Stands for a CuPy RawKernel: same call signature; runs the emulated kernel.

    Arguments reach it as a GPU launch passes them: an array of pointers, one per kernel
    parameter, each to that argument's bytes (a device array's address, a scalar's value, a
    struct's bytes), and the entry point calls the kernel with every parameter by value. Each
    argument's size must equal its parameter's `sizeof`, so a struct whose dtype does not
    match the C struct, a missing argument or a 64-bit scalar for an `int` is refused.
    """

    MAX_PARAMS = 32

    def __init__(self, name: str, block_m: int, block_n: int = 64, prelude: str = "",
                 dv: int | None = None, drop: bool = False):
        self.name = name
        self.prelude = prelude
        self.max_dynamic_shared_size_bytes = 0
        from varlen.backends.cupy.plan import KERNELS as PLAN_KERNELS
        if name in PLAN_KERNELS:
            self._bind(name, *PLAN_KERNEL_VARIANT)
            return
        kind, args = re.fullmatch(r"(\w+)<(.*)>", name).groups()
        a = [x.strip() for x in args.split(",")]
        T, D, BM, BN, SC = a[0], 64, block_m, block_n, "false"
        tiles = {}
        # head_dim_v: a trailing template argument where it differs from D, else the module's
        # (`dv`: the dQ conversion, which has none, runs in the library of its module's DV)
        if kind == "varlen_fwd":
            D, BM, BN, SC = int(a[1]), int(a[2]), int(a[3]), a[4]
            tiles = dict(KN=int(a[5]), STAGES=int(a[6]))
            dv = int(a[7]) if a[7:] else None
            drop = a[8:9] == ["true"]
        elif kind == "varlen_bwd_dkdv":
            D, BN, SC = int(a[1]), int(a[2]), a[4]
            # ordered dQ (a 7th argument, true) is atomic dQ in a fixed order
            kind += "_ordered" if a[6:7] == ["true"] else "_atomic" if a[5] == "true" else ""
            dv = int(a[7]) if a[7:] else None
            drop = a[8:9] == ["true"]
        elif kind == "varlen_bwd_preprocess":
            D = int(a[1])
            dv = int(a[2]) if a[2:] else None
        elif kind == "varlen_bwd_dq_convert":
            D = int(a[1])
        else:
            raise AssertionError(f"unknown kernel {name}")
        # the dK/dV kernel's query chunk everywhere, so that one library serves the variant
        bq = (int(a[3]) if kind.startswith("varlen_bwd_dkdv")
              else traits.tile_size("bwd", "mma", "float16", D, 64, BN).query_chunk)
        # the preprocessing and dQ conversion (no dropout of their own) run in the library of
        # their module's kernels (`drop`)
        self._bind(kind, T, D, BM, BN, bq, SC, DV=dv, DROP=drop, **tiles)

    def _bind(self, kind, T, D, BM, BN, bq, SC, **tiles):
        """The entry point `kind` of the library of variant (T, D, BM, BN, bq, SC) (`tiles`:
        `_build`'s)."""
        name = self.name
        self.lib = _build(T, D, BM, BN, bq, SC, **tiles, prelude=self.prelude)
        self.key = kind.encode()
        sizes = (ctypes.c_size_t * self.MAX_PARAMS)()
        n = self.lib.emu_param_sizes(self.key, sizes)
        assert n >= 0, f"{name}: no entry point {kind} in the emulation"
        self.param_sizes = list(sizes[:n])

    def __call__(self, grid, block, args, shared_mem=0, stream=None):
        launches[self.name] += 1
        assert shared_mem <= OPTIN_SMEM, f"{self.name}: {shared_mem} B of shared memory"
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
        rc = self.lib.emu_launch(self.key, ctypes.c_uint(grid[0]), ctypes.c_uint(grid[1]),
                                 ctypes.c_uint(block[0]), ctypes.c_size_t(shared_mem), params)
        check_launch(self.name, rc)

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
        elif isinstance(a, (np.int32, np.uint32, np.float32, np.int64, np.uint64)):
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


class LaunchError(RuntimeError):
    """An emulated launch that failed as a GPU launch fails: a thread trapped (`__trap`, after
    the kernel's printf), and the launch stopped (CUDA_ERROR_LAUNCH_FAILED on a GPU)."""


def check_launch(name: str, rc: int) -> None:
    """Raise for an emulated launch's return code (emu_launch: 0 done, 1 trapped, -1 unknown)."""
    if rc == 1:
        raise LaunchError(f"{name}: the launch failed: a thread trapped (its message is on "
                          "stdout and stderr above)")
    assert rc == 0, f"{name}: no such entry point in the emulation"


def _counted(name: str, kind: str):
    """The ndarray method `name`, counted as a host read of `kind` (`DeviceArray`)."""
    def method(self, *args):
        self._read(kind)
        return getattr(np.ndarray, name)(self, *args)
    method.__name__ = name
    return method


class DeviceArray(np.ndarray):
    """A device array of the stand-in cupy: a NumPy array that counts in `host_reads`, under
    `watch_host_reads`, every way the host takes its values as CuPy would copy them from a
    GPU: `get()` (and `cupy.asnumpy`), `item()`, `tolist()`, iteration, and conversion to a
    Python bool, int, float or index. As in CuPy, an element or a reduction is a 0-d array,
    not a NumPy scalar, so `int(a[0])` and `float(a.max())` count too."""

    def _read(self, kind):
        if _watching:
            host_reads[kind] += 1

    def get(self, stream=None):
        self._read("get")
        return np.array(self.view(np.ndarray))

    item, tolist = _counted("item", "item"), _counted("tolist", "tolist")
    __iter__, __bool__ = _counted("__iter__", "iter"), _counted("__bool__", "bool")
    __int__, __float__ = _counted("__int__", "int"), _counted("__float__", "float")
    __index__ = _counted("__index__", "index")

    def __getitem__(self, key):
        r = super().__getitem__(key)
        return np.asarray(r).view(DeviceArray) if isinstance(r, np.generic) else r

    def __array_wrap__(self, array, context=None, return_scalar=False):
        return super().__array_wrap__(array, context, False)


def _device(a):
    """`a` as a `DeviceArray` under `watch_host_reads` (else unchanged)."""
    return a.view(DeviceArray) if _watching and type(a) is np.ndarray else a


@contextlib.contextmanager
def watch_host_reads():
    """Counts host reads of the stand-in's device arrays inside (yields `host_reads`, cleared):
    its allocations, `ascontiguousarray` and the launchers' inputs become `DeviceArray`s, and
    so does any array the caller views as one."""
    global _watching
    host_reads.clear()
    _watching = True
    try:
        yield host_reads
    finally:
        _watching = False


# The launchers' policy for their inputs (a view read where it lies, else a packed copy and a
# warning), which the stand-in runs on host arrays.
_launch_data = cupy_launch.data


def _host_data(a, name, **kw):
    """`launch.data` for host arrays: the launchers' own policy, on the host addresses (the
    emulated cp.async and TMA check the alignment of every global address, as the GPU does),
    the result a stand-in device array."""
    return _device(_launch_data(a, name, **kw))


class _Device:
    """The emulated GPU as `cupy.cuda.Device` describes it: sm_90 with 227 KiB of opt-in shared
    memory per block; each emulated block gets exactly the size its launch asks for)."""

    compute_capability = "90"
    attributes = {"MaxSharedMemoryPerBlockOptin": OPTIN_SMEM}

    def __init__(self, device=None):
        self.id = 0


# Blocks of a grid-stride kernel (preprocessing, dQ conversion) in the emulation: a GPU gets up
# to `launch.MAX_STRIDE_BLOCKS`, enough to fill it; here each block's threads are started and
# joined, which for thousands of near-empty blocks cost minutes. Few blocks also make the kernels'
# stride loops take several passes, which every case then checks.
STRIDE_BLOCKS = 37


def install_fake_cupy(block_m: int, block_n: int = 64):
    """Replace `cupy` by NumPy plus an emulating RawModule (this process only), for plans of
    tiles (block_m, block_n)."""
    fake = types.ModuleType("cupy")
    for n in ("int32", "float32", "float64", "int64", "uint64", "uint16", "ndarray", "where"):
        setattr(fake, n, getattr(np, n))

    # Counted as CuPy runs them: zeros, and full with 0, are a cudaMemsetAsync; full with any
    # other value is CuPy's fill kernel.
    def zeros(shape, dtype=float):
        launches["memset"] += 1
        return _device(np.zeros(shape, dtype))

    def full(shape, fill_value, dtype=None):
        launches["memset" if np.ndim(fill_value) == 0 and fill_value == 0 else "fill"] += 1
        return _device(np.full(shape, fill_value, dtype))

    def asnumpy(a, stream=None):
        if _watching:
            host_reads["asnumpy"] += 1
        return np.array(np.asarray(a))
    fake.zeros, fake.full, fake.asnumpy = zeros, full, asnumpy
    fake.empty = lambda shape, dtype=float: _device(np.empty(shape, dtype))
    fake.ascontiguousarray = lambda a, dtype=None: _device(np.ascontiguousarray(a, dtype))

    class RawModule:
        def __init__(self, code=None, options=(), name_expressions=()):
            self.names = list(name_expressions)
            self.prelude = module_prelude(code or "")

        def get_function(self, name):
            assert name in self.names, f"{name} is not among the name expressions"
            return _Kernel(name, block_m, block_n, self.prelude, _module_dv(self.names),
                           _module_drop(self.names))

    fake.RawModule = RawModule
    fake.logical_or = np.logical_or                  # varlen._device_errors.record
    fake.cuda = types.SimpleNamespace(Device=_Device, runtime=types.SimpleNamespace(
        getDeviceProperties=lambda device_id: {"name": b"host emulation"}))
    sys.modules["cupy"] = fake
    from varlen.backends.cupy import plan as cupy_plan
    cupy_launch._modules.clear()
    cupy_plan._modules.clear()
    cupy_launch.data = _host_data                    # host arrays as stand-in device arrays
    cupy_launch.MAX_STRIDE_BLOCKS = STRIDE_BLOCKS
    cupy_launch.address = lambda a: 0 if a is None else a.ctypes.data
    set_nan_fill(True)                               # an unwritten output element shows
    return fake


def _module_dv(names) -> int | None:
    """head_dim_v of a module of the mma.sync backward, from its preprocessing kernel's name
    (`varlen_bwd_preprocess<T, D, DV>`; None: D)."""
    for name in names:
        m = re.fullmatch(r"varlen_bwd_preprocess<\w+, \d+, (\d+)>", name)
        if m:
            return int(m.group(1))
    return None


def _module_drop(names) -> bool:
    """Whether a module's kernels run dropout (a last template argument `true` of its forward
    or dK/dV kernel: `mma.KernelSpec.dropout`)."""
    for name in names:
        m = re.fullmatch(r"varlen_(?:fwd|bwd_dkdv)<(.*)>", name)
        if m and [x.strip() for x in m.group(1).split(",")][8:9] == ["true"]:
            return True
    return False


def module_prelude(code: str) -> str:
    """What a module's source puts ahead of its `#include` of the kernels' entry file (a call's
    mask_mod and score_mod): "" for the kernels alone."""
    include = f'#include "{ENTRY_FILE}"'
    return code[:code.rindex(include)] if include in code else ""


def run_case(label, lengths_q, lengths_k, *, Hq, Hk, D, dtype, mask, gaps, softcap, block_m,
             block_n=64, garbage=1e4, seed=0, Dv=None):
    """Forward and both backward modes of one batch through the emulated kernels, checked
    against the float64 reference; `garbage` fills the pad rows (make_batch); `Dv`: head_dim_v
    (None: D). Raises AssertionError on a mismatch."""
    import varlen
    from varlen.backends.cupy import BACKEND
    from varlen.testing import check_against_reference, make_batch
    install_fake_cupy(block_m, block_n)
    rng = np.random.default_rng(seed)
    b = make_batch(rng, lengths_q, lengths_k, Hq=Hq, Hk=Hk, D=D, Dv=Dv, dtype=dtype, mask=mask,
                   gaps=gaps, garbage=garbage)
    plan = varlen.plan(b.cu_q, b.cu_k, seq_offsets_q=b.off_q, seq_offsets_k=b.off_k,
                       mask=b.mask, num_rows_q=b.q.shape[0], num_rows_k=b.k.shape[0],
                       block_m=block_m, block_n=block_n)
    scale = 1.0 / math.sqrt(D)
    out, lse = BACKEND.forward(plan, b.q, b.k, b.v, softmax_scale=scale, softcap=softcap)
    for det in (False, True):
        grads = BACKEND.backward(plan, b.dout, b.q, b.k, b.v, out, lse,
                                      softmax_scale=scale, softcap=softcap, deterministic=det)
        check_against_reference(b, out, lse, grads, softcap=softcap,
                                label=f"{label} (emulated, deterministic={det})")


def cp_case_ranks(cp_size=2, seed=0):
    """A context-parallel batch of segment plans: zigzag over 4 sequences (one empty), causal and
    per-sequence windows, two query segments per sequence against all-gathered keys (2 *
    cp_size key segments, out of row order). Yields, rank by rank, `(rank, plan, q, k, v,
    dout)` (float16, Hq = 4, Hk = 2, D = 64)."""
    from varlen import comm
    from varlen.masks import Mask
    from varlen.plan import build_plan
    cu = np.array([0, 37, 37, 200, 290], np.int32)
    part = comm.partition(cu, cp_size, "zigzag")
    mask = Mask(window_left=np.array([-1, -1, 30, -1], np.int32),
                window_right=np.array([0, -1, 0, 5], np.int32),
                bottom_right=np.array([0, 0, 1, 0], np.int32))
    rng = np.random.default_rng(seed)
    Hq, Hk, D = 4, 2, 64
    for rank in range(cp_size):
        plan = build_plan(part.segments(rank), part.gathered_segments(), mask, block_m=64,
                          block_n=64)
        q, dout = (rng.standard_normal((plan.q.num_rows, Hq, D)).astype(np.float16)
                   for _ in range(2))
        k, v = (rng.standard_normal((plan.k.num_rows, Hk, D)).astype(np.float16)
                for _ in range(2))
        yield rank, plan, q, k, v, dout


def numpy_reference(plan, q, k, v, dout, **kw) -> dict:
    """out, lse, dq, dk and dv of the NumPy backend on `plan`, in float64: what the CuPy
    backend's passes on the same plan (segments out of row order, say) are held to
    (`assert_near`)."""
    from varlen.backends import numpy_backend
    ref = numpy_backend.BACKEND
    q, k, v, dout = (x.astype(np.float64) for x in (q, k, v, dout))
    out, lse = ref.forward(plan, q, k, v, **kw)
    return dict(zip(("out", "lse", "dq", "dk", "dv"),
                    (out, lse, *ref.backward(plan, dout, q, k, v, out, lse, **kw))))


def assert_near(label, got: dict, want: dict) -> None:
    """Each array of `got` within 2^-7 of the largest magnitude of `want`'s of its name plus
    2^-10; lse with the same -inf rows and the others within 1e-2."""
    for name, a in got.items():
        w = want[name]
        if name == "lse":
            finite = np.isfinite(w)
            assert np.array_equal(np.isfinite(a), finite), f"{label} lse: -inf rows differ"
            assert np.abs(a[finite] - w[finite]).max(initial=0.0) <= 1e-2, f"{label} lse"
            continue
        err = float(np.abs(a.astype(np.float64) - w).max(initial=0.0))
        bound = 2.0 ** -7 * float(np.abs(w).max(initial=0.0)) + 2.0 ** -10
        assert err <= bound, f"{label} {name}: max error {err:.3e} > {bound:.3e}"


def run_cp_case(label="CP2-zigzag-segments-fp16-D64", cp_size=2, seed=0):
    """Context-parallel segment plans (cp_case_ranks) through the emulated kernels, against the
    NumPy backend on the same plan, for every rank."""
    from varlen.backends import cupy as cupy_backend
    install_fake_cupy(64)
    backend = cupy_backend.BACKEND
    for rank, plan, q, k, v, dout in cp_case_ranks(cp_size, seed):
        kw = dict(softmax_scale=1.0 / math.sqrt(q.shape[2]), softcap=0.0)
        want = numpy_reference(plan, q, k, v, dout, **kw)
        out, lse = backend.forward(plan, q, k, v, **kw)
        assert_near(f"{label} rank {rank}", dict(out=out, lse=lse), want)
        for det in (False, True):
            grads = backend.backward(plan, dout, q, k, v, out, lse, deterministic=det, **kw)
            assert_near(f"{label} rank {rank} (deterministic={det})",
                        dict(zip(("dq", "dk", "dv"), grads)), want)


def strict_cases():
    """Batches for the race, schedule and mutation runs: every kernel's blocks meet at least three
    partner chunks (the barrier that ends a loop step only matters from the third: the prefetch
    issued in step two refills the stage of step one), partially masked and ragged chunks, GQA
    (the dK/dV blocks loop over two query heads, with atomic dQ), and a query tile without a
    visible key (its own tile's copies are drained after an empty loop).

    The first case's forward keeps Q in registers, whose load waits for Q's copies before any
    chunk, so the drain after an empty loop only matters where Q is read from shared memory:
    the second case (a softcap at D = 64, BM = 128, FwdConfig::q_in_regs), whose keyless tile
    stages its output through Q's rows while, without the drain, Q's copies may still land.
    Its last sequence has keys but no queries: a key tile without query chunks, whose dK and dV
    (zero) are staged through the rows of K and V still in flight without the dK/dV drain.

    The third case runs D = 256, where the dK/dV kernel walks its query chunks twice (two
    halves of the head dim) and only the first walk adds dQ, whose barriers otherwise also
    release the stage: in the second walk only the barrier that ends a loop step does."""
    return [dict(label="B2-strict-3chunks-causal_br-fp16-D64", lengths_q=[80, 20],
                 lengths_k=[200, 0], Hq=2, Hk=1, D=64, dtype="float16",
                 mask="causal_bottom_right", gaps=True, softcap=0.0, block_m=64),
            dict(label="B2-strict-keyless-softcap-fp16-D64-BM128", lengths_q=[20, 20, 0],
                 lengths_k=[40, 0, 30], Hq=2, Hk=1, D=64, dtype="float16",
                 mask="causal_bottom_right", gaps=True, softcap=30.0, block_m=128),
            dict(label="B2-strict-D256-two-walks-fp16", lengths_q=[130, 20],
                 lengths_k=[60, 0], Hq=1, Hk=1, D=256, dtype="float16", mask="full",
                 gaps=True, softcap=0.0, block_m=64)]


def _parse(argv):
    import argparse
    p = argparse.ArgumentParser(prog="python -m emulation")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--quick", action="store_true", help="the CI case only")
    which.add_argument("--strict", action="store_true", help="the race/schedule cases")
    p.add_argument("--race", action="store_true", help="ThreadSanitizer build")
    p.add_argument("--schedule", choices=tuple(LANDING), help="when cp.async copies land; "
                   "warps one at a time in a seeded order (without --race)")
    p.add_argument("--seeds", default=None, help="comma-separated seeds, each case once per seed")
    p.add_argument("--fail-fast", action="store_true", help="stop at the first failing case")
    return p.parse_args(argv)


def _reexec_with_tsan(argv):
    """Runs this module again with the TSan runtime preloaded (it must be loaded first)."""
    env = dict(os.environ, LD_PRELOAD=tsan_runtime(), VARLEN_EMULATION_RACE="1",
               TSAN_OPTIONS=os.environ.get("TSAN_OPTIONS", TSAN_OPTIONS))
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, "-m", "emulation", *argv],
              env)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parse(argv)
    if args.race and not tsan_loaded():
        _reexec_with_tsan(argv)
    if args.race:
        os.environ["VARLEN_EMULATION_RACE"] = "1"
    if args.schedule:
        os.environ["VARLEN_EMULATION_SCHEDULE"] = args.schedule
    seeds = ([int(x) for x in args.seeds.split(",")] if args.seeds is not None
             else [int(os.environ.get("VARLEN_EMULATION_SEED", "0"))])
    ok = True
    from .cases import cases
    todo = [(c["label"], run_case, c)
            for c in (strict_cases() if args.strict else cases(args.quick))]
    if not (args.quick or args.strict):
        todo.append(("CP2-zigzag-segments-fp16-D64", run_cp_case, {}))
    race, schedule, _, _, _ = _mode()
    mode = " ".join(x for x in ("race" if race else "", f"schedule={schedule}" if schedule
                                else "") if x)
    for seed in seeds:
        os.environ["VARLEN_EMULATION_SEED"] = str(seed)
        for label, fn, case in todo:
            t0 = time.time()
            name = f"{label} [{mode} seed={seed}]" if mode else label
            try:
                fn(**case)
                print(f"ok      {name} ({time.time() - t0:.0f} s)", flush=True)
            except AssertionError as e:
                ok = False
                print(f"FAILED  {name}: {e}", flush=True)
                if args.fail_fast:
                    return 1
    ldsm, ldsm_x, copies, copies_x = bank_counts()
    print(f"bank conflicts: ldmatrix {ldsm_x} extra wavefronts in {ldsm} phases, cp.async "
          f"{copies_x} in {copies} quarter-warp writes", flush=True)
    return 0 if ok else 1


def build_harness(path, *, race=False):
    """Compile a test harness through the kernels' emulation build and load it: a `.cu` file
    that includes kernel headers (found in the kernel source directory) and whose `extern "C"`
    entry points launch its kernels with `launch` (host_emulation.cuh). Same compiler and flags
    as the kernels (`race`: ThreadSanitizer, which needs the runtime preloaded); cached by the
    harness's and the kernel sources' contents. Returns the `ctypes.CDLL`."""
    source_dir = _mode()[4]
    os.makedirs(BUILD_DIR, exist_ok=True)
    flags = TSAN_FLAGS if race else ()
    with open(path, "rb") as f:
        tag = hashlib.sha256(f.read() + f"{flags}{_sources_hash(source_dir)}".encode())
    stem = os.path.splitext(os.path.basename(path))[0]
    out = os.path.join(BUILD_DIR, f"{stem}_{tag.hexdigest()[:16]}.so")
    if not os.path.exists(out):
        tmp = f"{out}.{os.getpid()}.tmp"
        cmd = _compile_command(os.path.abspath(path), tmp, flags, source_dir)
        subprocess.run(cmd, check=True)
        os.replace(tmp, out)
    return ctypes.CDLL(out)


# sm90::TensorMap of the emulation (emulation/cuda/host_emulation_sm90.cuh): CUtensorMap's 128 bytes.
TENSOR_MAP_TAG = 0x746D61703930
TENSOR_MAP_DTYPE = np.dtype({
    "names": ["tag", "global_address", "dims", "strides", "box", "rank", "elem_bytes",
              "swizzle", "nan_fill"],
    "formats": ["<u8", "<u8", ("<u8", 3), ("<u8", 2), ("<u4", 3), "<u4", "<u4", "<u4", "<u4"],
    "offsets": [0, 8, 16, 40, 56, 68, 72, 76, 80], "itemsize": 128})
SWIZZLE_BYTES = {0: 0, 1: 32, 2: 64, 3: 128}        # CUtensorMapSwizzle -> bytes


def tensor_map(array, box, swizzle=0, nan_fill=False):
    """The emulation's tensor map of a host array, as `cuTensorMapEncodeTiled` describes one on
    a GPU (element strides 1, no interleave): a NumPy struct array of size one, which the
    stand-in RawKernel passes by value like the 128-byte CUtensorMap.

    array: 2 or 3 dimensions, the last contiguous, 16-byte aligned, the other strides multiples
        of 16 bytes. box: elements per dimension, innermost (last axis) first, each 1..256.
    swizzle: CUtensorMapSwizzle (0 none, 1 32B, 2 64B, 3 128B); a swizzled box's inner
        dimension must span exactly the swizzle width. nan_fill: out-of-bounds elements NaN
        (CU_TENSOR_MAP_FLOAT_OOB_FILL_NAN_REQUEST_ZERO_FMA) instead of zero.
    """
    a = np.asarray(array)
    rank, size = a.ndim, a.itemsize
    if rank not in (2, 3) or len(box) != rank:
        raise ValueError(f"{a.shape=} and {box=}: 2 or 3 dimensions, one box size each")
    if a.strides[-1] != size or a.ctypes.data % 16 or any(s % 16 for s in a.strides[:-1]):
        raise ValueError(f"{a.strides=} at address {a.ctypes.data:#x}: the last axis must be "
                         "contiguous, the address and other strides multiples of 16 bytes")
    if any(not 1 <= b <= 256 for b in box) or box[0] * size % 16:
        raise ValueError(f"{box=}: sizes 1..256, the inner one a multiple of 16 bytes")
    if swizzle not in SWIZZLE_BYTES or (swizzle and box[0] * size != SWIZZLE_BYTES[swizzle]):
        raise ValueError(f"{swizzle=} with an inner box of {box[0] * size} bytes: a swizzled "
                         "box's rows must be exactly the swizzle width")
    dims = list(a.shape[::-1]) + [1] * (3 - rank)
    strides = list(a.strides[::-1][1:])
    if rank == 2:
        strides.append(strides[0] * dims[1])
    m = np.zeros(1, TENSOR_MAP_DTYPE)
    m["tag"], m["global_address"], m["rank"], m["elem_bytes"] = TENSOR_MAP_TAG, a.ctypes.data, \
        rank, size
    m["dims"], m["strides"] = dims, strides
    m["box"] = list(box) + [1] * (3 - rank)
    m["swizzle"], m["nan_fill"] = swizzle, int(nan_fill)
    return m


if __name__ == "__main__":
    sys.exit(main())
