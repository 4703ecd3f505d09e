"""Kernel variants of the CuPy backend: what to compile, how big it is, how to name it, and the
layout of the structs the kernels take by value.

Pure Python (no CuPy import), so the compile script and the CPU tests use it too. A
`KernelSpec` names one compiled module: a kind (`"fwd"` or `"bwd"`), an element type, a head
dim, the plan's tile sizes and the softcap flag. It validates itself, produces the template
name expressions of its kernels, their launch geometry and dynamic shared memory, and is the
key of the module cache.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from ..kernels_cuda import SOURCE_DIR
from ..plan import KernelView

# Entry file of the CUDA sources (it includes every header in kernels_cuda/).
ENTRY_FILE = "varlen_attention.cu"

DTYPES = {"float16": "__half", "bfloat16": "__nv_bfloat16"}
HEAD_DIMS = (32, 64, 96, 128, 192, 256)
# (block_m, block_n) tile sizes a plan may use with this backend. (64, 64) is varlen.plan's
# default; (128, 64) gives the forward 32 query rows per warp; (128, 128) gives the dK/dV
# kernel 128 keys on 8 warps with query chunks of 64 (FlashAttention-2's backward design point:
# per key, half the dQ atomics and half the Q/dO/lse/delta traffic of BN = 64). In increasing
# size: choose_blocks falls back from the largest down.
BLOCKS = ((64, 64), (128, 64), (128, 128))
# Above this head dim the forward's O accumulators of 16 rows take D / 2 fp32 registers per
# lane (128 at D = 256): a warp holds one m16 tile, so block_m = 64 only, and the dK/dV kernel
# splits the head dim of its dK, dV accumulators over passes (KernelSpec.dkdv_parts).
MAX_WIDE_HEAD_DIM = 128
WIDE_HEAD_BLOCKS = ((64, 64),)
KINDS = ("fwd", "bwd")

WARP_ROWS = 16        # rows of a register tile per warp (mma M)
WARP_SIZE = 32
SMEM_PAD = 8          # elements of padding per shared-memory row (kernels_cuda/common.cuh)
ELEM_BYTES = 2
STATIC_SMEM_LIMIT = 48 * 1024     # above this the kernel attribute must be raised
PREPROCESS_WARPS = 4              # kernels_cuda/bwd_preprocess.cuh
CONVERT_THREADS = 256
STAGES = 2                        # K/V (Q/dO) stages of the backward kernels
FWD_WARPS = 4                     # kernels_cuda/fwd.cuh FwdConfig
FWD_MAX_CHUNK = 64                # keys per step of the forward, at most (FwdConfig::KN_64)
# An A100 SM's shared memory and what the driver reserves per block: the forward takes a third
# K/V stage only where two blocks of it still fit there (FwdConfig::STAGES).
SM_SMEM_A100 = 164 * 1024
SMEM_PER_BLOCK_RESERVED = 1024

# Largest dynamic shared memory per block (opt-in) by architecture: A100 163 KiB,
# H100/H200 227 KiB (CUDA C++ Programming Guide, "Compute capabilities" table). The compile
# budget checks these two; at run time the backend reads the device's own limit (DeviceInfo).
SMEM_BUDGET = {"sm_80": 163 * 1024, "sm_90": 227 * 1024}
ARCHS = tuple(SMEM_BUDGET)
# mma.sync m16n8k16 on bfloat16 operands and cp.async need compute capability 8.0.
MIN_COMPUTE_CAPABILITY = (8, 0)

# The structs of kernels_cuda/plan_view.cuh as aligned NumPy dtypes (C layout: each field at a
# multiple of its size, the whole padded to its largest field); tests/test_cupy_compile.py
# compares them with the C sizeof/offsetof.
# PlanView: KernelView's fields in order, its arrays as 64-bit device addresses.
PLAN_VIEW_DTYPE = np.dtype([(name, np.uint64 if i < KernelView.NUM_ARRAYS else np.int32)
                            for i, name in enumerate(KernelView._fields)], align=True)
CALL_PARAMS_DTYPE = np.dtype([("Hq", np.int32), ("Hk", np.int32), ("softmax_scale", np.float32),
                              ("softcap", np.float32)], align=True)
STRUCT_DTYPES = {"PlanView": PLAN_VIEW_DTYPE, "CallParams": CALL_PARAMS_DTYPE}


class KernelLaunch(NamedTuple):
    """One kernel of a module and its launch geometry."""

    name: str       # template name expression, e.g. varlen_fwd<__half, 64, 64, 64, false>
    threads: int    # per block
    smem: int       # dynamic shared memory per block, bytes


def bwd_query_chunk(head_dim: int, block_n: int) -> int:
    """Query rows per step of the dK/dV kernel of key tiles of `block_n` rows: 64, except with
    64-key tiles 32 for D > 64 and 16 for D > 192, which keep it free of spills (128-key tiles,
    D <= 128 only: 64 on 8 warps)."""
    if block_n == 128:
        return 64
    return 16 if head_dim > 192 else 32 if head_dim > 64 else 64


def _cxx_bool(flag: bool) -> str:
    return "true" if flag else "false"


@dataclass(frozen=True)
class KernelSpec:
    """One compiled variant. Invalid combinations raise ValueError here, before compiling."""

    kind: str            # "fwd" | "bwd"
    dtype: str           # "float16" | "bfloat16"
    head_dim: int
    block_m: int
    block_n: int
    has_softcap: bool

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"KernelSpec.kind={self.kind!r}; expected one of {KINDS}")
        if self.dtype not in DTYPES:
            raise ValueError(f"KernelSpec.dtype={self.dtype!r}; the tensor-core kernels take "
                             f"{', '.join(DTYPES)}")
        if self.head_dim not in HEAD_DIMS:
            raise ValueError(f"KernelSpec.head_dim={self.head_dim}; compiled head dims are "
                             f"{HEAD_DIMS}")
        if (self.block_m, self.block_n) not in BLOCKS:
            raise ValueError(f"KernelSpec blocks ({self.block_m}, {self.block_n}) are not "
                             f"supported; expected one of {BLOCKS}")
        if (self.block_m, self.block_n) not in blocks_for(self.head_dim):
            raise ValueError(f"KernelSpec blocks ({self.block_m}, {self.block_n}) are not "
                             f"supported at head_dim={self.head_dim}: above "
                             f"{MAX_WIDE_HEAD_DIM} a warp's fp32 output accumulators of 16 "
                             f"rows take head_dim / 2 registers, so each warp holds one m16 "
                             f"tile; use (block_m, block_n) = "
                             f"{' or '.join(map(str, blocks_for(self.head_dim)))}")
        if not isinstance(self.has_softcap, bool):
            raise ValueError(f"KernelSpec.has_softcap must be a bool, got {self.has_softcap!r}")
        if self.block_m % self.bwd_query_chunk:
            raise ValueError(f"block_m={self.block_m} does not split into query chunks of "
                             f"{self.bwd_query_chunk}")

    # ---- geometry -----------------------------------------------------------------------

    @property
    def ctype(self) -> str:
        return DTYPES[self.dtype]

    @property
    def stride(self) -> int:
        return self.head_dim + SMEM_PAD

    @property
    def bwd_query_chunk(self) -> int:
        """Query rows per step of the dK/dV kernel (bwd_query_chunk)."""
        return bwd_query_chunk(self.head_dim, self.block_n)

    @property
    def fwd_threads(self) -> int:
        return FWD_WARPS * WARP_SIZE

    @property
    def fwd_chunk(self) -> int:
        """Keys per step of the forward (FwdConfig::KN): at most 64, the chunk of a 64-key tile,
        which is 32 where the fp32 accumulators of 64 keys would take 160 or more registers per
        lane, and at D > 128, where half-tile stages keep two blocks per SM. A 128-key plan
        tile is walked in the chunks of a 64-key one (the same registers)."""
        warp_tiles = self.block_m // (FWD_WARPS * WARP_ROWS)
        acc_regs = warp_tiles * (self.head_dim + 64) // 2
        wide = self.head_dim > MAX_WIDE_HEAD_DIM
        return min(self.block_n, 32 if acc_regs >= 160 or wide else FWD_MAX_CHUNK)

    @property
    def dkdv_parts(self) -> int:
        """Passes of the dK/dV kernel over its query chunks, each accumulating head_dim /
        dkdv_parts columns of dK and dV: 2 at D > 128 (DkdvConfig::D_PARTS)."""
        return 2 if self.head_dim > MAX_WIDE_HEAD_DIM else 1

    def _fwd_smem_bytes(self, stages: int) -> int:
        return (self.block_m + 2 * stages * self.fwd_chunk) * self.stride * ELEM_BYTES

    @property
    def fwd_stages(self) -> int:
        """K/V stages of the forward: 3 where two blocks of them fit an A100 SM, else 2."""
        fits = 2 * (self._fwd_smem_bytes(3) + SMEM_PER_BLOCK_RESERVED) <= SM_SMEM_A100
        return 3 if fits else 2

    @property
    def dkdv_threads(self) -> int:
        return self.block_n // WARP_ROWS * WARP_SIZE

    def fwd_smem(self) -> int:
        """Q [BM] + fwd_stages stages of K and V [fwd_chunk], rows of D + 8 elements."""
        return self._fwd_smem_bytes(self.fwd_stages)

    def dkdv_smem(self) -> int:
        """K, V [BN] + 2 stages of Q, dO [BQ] + dS^T [BN][BQ + 8] + 2 stages of lse2, delta
        (the same at every dkdv_parts: each pass reuses them; both dQ modes)."""
        bq = self.bwd_query_chunk
        elems = (2 * self.block_n + 2 * STAGES * bq) * self.stride + self.block_n * (bq + SMEM_PAD)
        return elems * ELEM_BYTES + 2 * STAGES * bq * 4

    # ---- names --------------------------------------------------------------------------

    @property
    def fwd_block_n(self) -> int:
        """The key tile the forward is compiled for: 64 for plans of 128-key tiles too. The
        forward walks key chunks of at most 64 rows (fwd_chunk) through the plan's row
        schedule, whose bounds do not depend on the key tile, so both kernels would be the same
        code."""
        return min(self.block_n, FWD_MAX_CHUNK)

    def compiled(self) -> "KernelSpec":
        """The spec whose module runs this one: a forward of 128-key tiles runs the module of
        64-key tiles (fwd_block_n); every other spec its own."""
        if self.kind == "fwd" and self.block_n != self.fwd_block_n:
            return KernelSpec(self.kind, self.dtype, self.head_dim, self.block_m,
                              self.fwd_block_n, self.has_softcap)
        return self

    def fwd_name(self) -> str:
        return (f"varlen_fwd<{self.ctype}, {self.head_dim}, {self.block_m}, {self.fwd_block_n}, "
                f"{_cxx_bool(self.has_softcap)}>")

    def dkdv_name(self, ordered_dq: bool = False) -> str:
        """Both dQ modes add dQ in the kernel (ATOMIC_DQ = true); ordered_dq fixes the order."""
        ordered = ", true" if ordered_dq else ""
        return (f"varlen_bwd_dkdv<{self.ctype}, {self.head_dim}, {self.block_n}, "
                f"{self.bwd_query_chunk}, {_cxx_bool(self.has_softcap)}, true{ordered}>")

    def preprocess_name(self) -> str:
        return f"varlen_bwd_preprocess<{self.ctype}, {self.head_dim}>"

    def convert_name(self) -> str:
        return f"varlen_bwd_dq_convert<{self.ctype}>"

    def kernels(self) -> dict:
        """{role: KernelLaunch} of the module's kernels, in launch order; roles "fwd", or
        "preprocess", "dkdv_atomic", "dkdv_ordered" (dQ added in a fixed order: the
        deterministic backward), "dq_convert"."""
        if self.kind == "fwd":
            return {"fwd": KernelLaunch(self.fwd_name(), self.fwd_threads, self.fwd_smem())}
        return {"preprocess": KernelLaunch(self.preprocess_name(), PREPROCESS_WARPS * WARP_SIZE, 0),
                "dkdv_atomic": KernelLaunch(self.dkdv_name(), self.dkdv_threads,
                                            self.dkdv_smem()),
                "dkdv_ordered": KernelLaunch(self.dkdv_name(ordered_dq=True),
                                             self.dkdv_threads, self.dkdv_smem()),
                "dq_convert": KernelLaunch(self.convert_name(), CONVERT_THREADS, 0)}

    @property
    def name_expressions(self) -> tuple:
        return tuple(k.name for k in self.kernels().values())

    @property
    def label(self) -> str:
        return (f"{self.kind}-{self.dtype}-D{self.head_dim}-BM{self.block_m}-BN{self.block_n}"
                f"{'-softcap' if self.has_softcap else ''}")


# The kernels a call runs, by role (KernelSpec.kernels): the forward, the backward with atomic
# dQ, the deterministic backward.
ROLES = {"fwd": ("fwd",), "bwd": ("preprocess", "dkdv_atomic", "dq_convert"),
         "bwd-deterministic": ("preprocess", "dkdv_ordered", "dq_convert")}


@dataclass(frozen=True)
class DeviceInfo:
    """What the backend reads of a GPU, once per device: its compute capability and the largest
    dynamic shared memory one block may opt into (cudaDevAttrMaxSharedMemoryPerBlockOptin;
    99 KiB on sm_86/sm_89, 163 KiB on sm_80, 227 KiB on sm_90)."""

    compute_capability: tuple      # (major, minor)
    smem_optin: int                # bytes
    name: str = ""

    @property
    def arch(self) -> str:
        return f"sm_{self.compute_capability[0]}{self.compute_capability[1]}"

    def describe(self) -> str:
        return f"{self.name} ({self.arch})" if self.name else self.arch


def unsupported_device(device: DeviceInfo) -> str | None:
    """Why the kernels cannot run on `device` at all (None: they can)."""
    if tuple(device.compute_capability) < MIN_COMPUTE_CAPABILITY:
        major, minor = device.compute_capability
        return (f"the GPU is {device.describe()}, compute capability {major}.{minor}; the "
                f"tensor-core kernels need sm_80 or newer (mma.sync on bfloat16, cp.async)")
    return None


def smem_refusal(spec: KernelSpec, device: DeviceInfo, roles=None) -> str | None:
    """None when the kernels of `spec` (those of `roles`, default all) fit the shared memory a
    block may opt into on `device`; else which one does not, naming both sizes."""
    over = [k for role, k in spec.kernels().items()
            if (roles is None or role in roles) and k.smem > device.smem_optin]
    if not over:
        return None
    k = max(over, key=lambda k: k.smem)
    return (f"{k.name} needs {k.smem} B of shared memory per block and {device.describe()} "
            f"allows at most {device.smem_optin} B ({device.smem_optin / 1024:g} KiB)")


def blocks_for(head_dim: int) -> tuple:
    """The BLOCKS a head dim compiles with: (64, 64) only above MAX_WIDE_HEAD_DIM."""
    return WIDE_HEAD_BLOCKS if head_dim > MAX_WIDE_HEAD_DIM else BLOCKS


def choose_blocks(device: DeviceInfo, dtype: str, head_dim: int, preferred: tuple):
    """The plan tiles for `device`: the first of `preferred`, then the other BLOCKS (of those
    `head_dim` compiles with, blocks_for) from the largest down, under which every kernel fits
    its shared memory; else the first under which the forward and the atomic-dQ backward fit
    (the deterministic backward is then refused); None if none does. So (128, 128), which
    needs 155 KiB for dK/dV at D = 128, falls back to (128, 64) on a 99 KiB GPU."""
    allowed = blocks_for(head_dim)
    others = (b for b in reversed(BLOCKS) if b != tuple(preferred))
    order = tuple(b for b in (tuple(preferred), *others) if b in allowed)

    def fits(blocks, role_sets):
        return all(smem_refusal(KernelSpec(kind, dtype, head_dim, *blocks, False), device,
                                ROLES[roles]) is None
                   for kind, roles in role_sets)
    for role_sets in ((("fwd", "fwd"), ("bwd", "bwd"), ("bwd", "bwd-deterministic")),
                      (("fwd", "fwd"), ("bwd", "bwd"))):
        for blocks in order:
            if fits(blocks, role_sets):
                return blocks
    return None


def all_specs():
    """Every variant the backend ships."""
    return [KernelSpec(kind, dtype, d, bm, bn, sc)
            for kind in KINDS for dtype in DTYPES for d in HEAD_DIMS for bm, bn in blocks_for(d)
            for sc in (False, True)]


def source_files():
    return sorted(f for f in os.listdir(SOURCE_DIR) if f.endswith((".cuh", ".cu")))


def source_hash() -> str:
    """Hash of every CUDA source: part of the compile options, so the kernel cache (which
    does not hash included headers) never serves a stale binary."""
    h = hashlib.sha256()
    for name in source_files():
        h.update(name.encode())
        with open(os.path.join(SOURCE_DIR, name), "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:16]


def cuda_include_dirs():
    """CUDA headers (cuda_fp16.h, cuda_bf16.h): $CUDA_HOME/include, $CUDA_PATH/include, or
    the header directory of the nvidia-cuda-runtime wheel."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        root = os.environ.get(var)
        if root and os.path.isfile(os.path.join(root, "include", "cuda_fp16.h")):
            return (os.path.join(root, "include"),)
    try:
        from cuda.pathfinder import find_nvidia_header_directory
        found = find_nvidia_header_directory("cudart")
        if found:
            return (found,)
    except ImportError:
        pass
    return ("/usr/local/cuda/include",)


def compile_options():
    """NVRTC options of every build of the kernels: the runtime's (CuPy adds -arch itself) and
    the compile check's (scripts/compile_kernels.py), so both find the same headers."""
    return ("--use_fast_math", f"-I{SOURCE_DIR}", *(f"-I{d}" for d in cuda_include_dirs()),
            f"-DVARLEN_SOURCE_HASH=0x{source_hash()}")


def module_source() -> str:
    return f'#include "{ENTRY_FILE}"\n'
