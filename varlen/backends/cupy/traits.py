"""What the CuPy kernels take and how big they are: element types, head dims, the GPU, and the
one home of tile sizes (`tile_size`).

Pure Python (no CuPy import), so the compile check and the CPU tests use it too. Every tile a
kernel of this backend runs with comes from `tile_size(kind, impl, dtype, head_dim, ...)`:
the plan's query and key tiles (`block_m`, `block_n`) and the kernel's own steps inside them
(the forward's key chunk and K/V stages, the dK/dV kernel's query chunk). The variants
(`mma.KernelSpec`, `sm90.FwdSpec`, `sm90.BwdSpec`) read them from there and pass them to the
CUDA templates, whose configs check them with `static_assert` and never choose their own.

A variant follows one protocol (`Variant`): a frozen dataclass that validates itself in
`__post_init__`, names its kernels (`kernels()`: role -> `KernelLaunch`, the template name
expression, threads, dynamic shared memory) and keys the module cache.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

DTYPES = {"float16": "__half", "bfloat16": "__nv_bfloat16"}
HEAD_DIMS = (32, 64, 96, 128, 192, 256)
# (head_dim, head_dim_v) pairs with head_dim_v < head_dim the mma.sync kernels are compiled and
# budget-checked for (multi-head latent attention: DeepSeek's 192 / 128): V, out, dO and dV
# have head_dim_v columns, which lie in the shared-memory rows of K and Q, so the tiles and
# shared memory are those of head_dim. Every head_dim of HEAD_DIMS takes head_dim_v ==
# head_dim.
HEAD_DIM_V_PAIRS = ((192, 128), (128, 64))
IMPLEMENTATIONS = ("mma", "sm90a")
KINDS = ("fwd", "bwd")

# (block_m, block_n) plan tiles the mma.sync kernels take, in increasing size. (64, 64) is
# varlen.plan's default; (128, 64) gives the forward 32 query rows per warp; (128, 128) gives
# the dK/dV kernel 128 keys on 8 warps with query chunks of 64 (FlashAttention-2's backward
# design point: per key, half the dQ atomics and half the Q/dO/lse/delta traffic of BN = 64).
BLOCKS = ((64, 64), (128, 64), (128, 128))
# Above this head dim the forward's O accumulators of 16 rows take D / 2 fp32 registers per
# lane (128 at D = 256): a warp holds one m16 tile, so block_m = 64 only, and the dK/dV kernel
# splits the head dim of its dK, dV accumulators over passes (`dkdv_parts`).
MAX_WIDE_HEAD_DIM = 128
WIDE_HEAD_BLOCKS = ((64, 64),)
# The plan tiles by default: (128, 64); (128, 128) at the head dims where scripts/perf_model.py
# predicts the dK/dV kernel faster with 128-key tiles (by more than its margin, on H100 and
# A100; docs/cupy_backend.md, "Performance model"); the forward runs both in the same key
# chunks. (64, 64) above D = 128, the only tiles there.
DEFAULT_BLOCKS = (128, 64)
DEFAULT_BLOCKS_BY_HEAD_DIM = {96: (128, 128), 128: (128, 128)}

WARP_ROWS = 16        # rows of a register tile per warp (mma M)
WARP_SIZE = 32
SMEM_PAD = 8          # elements of padding per shared-memory row (kernels_cuda/common.cuh)
ELEM_BYTES = 2
STATIC_SMEM_LIMIT = 48 * 1024     # above this the kernel attribute must be raised
FWD_WARPS = 4                     # kernels_cuda/fwd.cuh FwdConfig
FWD_MAX_CHUNK = 64                # keys per step of the mma.sync forward, at most
BWD_STAGES = 2                    # Q/dO stages of the mma.sync dK/dV kernel
# An A100 SM's shared memory and what the driver reserves per block: the forward takes a third
# K/V stage only where two blocks of it still fit there.
SM_SMEM_A100 = 164 * 1024
SMEM_PER_BLOCK_RESERVED = 1024

# The sm_90a kernels (wgmma, TMA): D 64, 128, 256; query rows per consumer warpgroup (wgmma M)
# and the backward's query chunk (wgmma N of S^T, M of dQ).
SM90_HEAD_DIMS = (64, 128, 256)
# (head_dim, head_dim_v) pairs with head_dim_v < head_dim of the sm_90a forward (its backward
# takes head_dim_v == head_dim only): 192 / 128, key chunks of 64.
SM90_FWD_HEAD_DIM_V_PAIRS = ((192, 128),)
WG_ROWS = 64
SM90_BWD_QUERY_CHUNK = 64
SM90_STAGES = 2

# Largest dynamic shared memory per block (opt-in) by architecture: A100 163 KiB,
# H100/H200 227 KiB (CUDA C++ Programming Guide, "Compute capabilities" table). The compile
# budget checks these two; at run time the backend reads the device's own limit (DeviceInfo).
SMEM_BUDGET = {"sm_80": 163 * 1024, "sm_90": 227 * 1024}
ARCHS = tuple(SMEM_BUDGET)
# mma.sync m16n8k16 on bfloat16 operands and cp.async need compute capability 8.0; wgmma and
# TMA exactly 9.0 (sm_90a code runs on no other).
MIN_COMPUTE_CAPABILITY = (8, 0)
SM90_COMPUTE_CAPABILITY = (9, 0)


class Tiles(NamedTuple):
    """The tiles one kernel runs with (`tile_size`)."""

    block_m: int        # query rows of a plan tile
    block_n: int        # key rows of a plan tile
    key_chunk: int      # keys per step of the forward
    query_chunk: int    # query rows per step of the dK/dV kernel
    stages: int         # K/V stages of the forward (Q/dO stages of the backward)


def head_dim_v_refusal(head_dim: int, head_dim_v: int, impl: str = "mma") -> str | None:
    """Why implementation `impl` ("mma" | "sm90a") has no kernels for `head_dim_v` beside
    `head_dim` (None: it has; for "sm90a", its forward: `sm90_backward_refusal` says what its
    backward takes; `head_dim` itself is checked elsewhere)."""
    if head_dim_v == head_dim:
        return None
    if impl == "sm90a":
        if (head_dim, head_dim_v) in SM90_FWD_HEAD_DIM_V_PAIRS:
            return None
        return (f"(head_dim, head_dim_v)=({head_dim}, {head_dim_v}) is not compiled: the sm_90a "
                f"forward takes head_dim_v == head_dim or (head_dim, head_dim_v) in "
                f"{SM90_FWD_HEAD_DIM_V_PAIRS}, its backward head_dim_v == head_dim (cupy:mma "
                f"runs {HEAD_DIM_V_PAIRS})")
    if (head_dim, head_dim_v) not in HEAD_DIM_V_PAIRS:
        return (f"(head_dim, head_dim_v)=({head_dim}, {head_dim_v}) is not compiled: the "
                f"mma.sync kernels take head_dim_v == head_dim or (head_dim, head_dim_v) in "
                f"{HEAD_DIM_V_PAIRS}")
    return None


def sm90_backward_refusal(head_dim: int, head_dim_v: int) -> str | None:
    """Why the sm_90a backward has no kernel for `head_dim_v` beside `head_dim` (None: it
    has)."""
    if head_dim_v == head_dim:
        return None
    return (f"head_dim_v={head_dim_v} differs from head_dim={head_dim}: the sm_90a backward "
            f"takes head_dim_v == head_dim (cupy:mma runs the backward of (head_dim, "
            f"head_dim_v) in {HEAD_DIM_V_PAIRS})")


def blocks_for(head_dim: int) -> tuple:
    """The plan tiles the mma.sync kernels compile with: (64, 64) only above
    MAX_WIDE_HEAD_DIM."""
    return WIDE_HEAD_BLOCKS if head_dim > MAX_WIDE_HEAD_DIM else BLOCKS


def default_blocks(head_dim: int) -> tuple:
    """The plan tiles of a call at `head_dim` before the GPU is asked (`choose_blocks`)."""
    allowed = blocks_for(head_dim)
    preferred = DEFAULT_BLOCKS_BY_HEAD_DIM.get(head_dim, DEFAULT_BLOCKS)
    return preferred if preferred in allowed else allowed[0]


def tile_size(kind: str, impl: str, dtype: str, head_dim: int, block_m: int | None = None,
              block_n: int | None = None) -> Tiles:
    """The tiles of kernel `kind` ("fwd" | "bwd") of implementation `impl` ("mma" | "sm90a")
    for `dtype` and `head_dim`, inside plan tiles (`block_m`, `block_n`) (None: the default,
    `default_blocks`).

    mma.sync forward: key chunks of 64, or 32 where the fp32 accumulators O and S of 64 keys
        would take 160 or more registers per lane (D = 96 and 128 at BM = 128) and above
        D = 128 (half-tile stages keep two blocks per SM); never more than the key tile. Three
        K/V stages where two blocks of them fit an A100 SM, else two.
    mma.sync dK/dV: query chunks of 64; with 64-key tiles 32 above D = 64 and 16 above
        D = 192 (free of spills); two Q/dO stages.
    sm_90a forward: key chunks of 128 rows up to D = 128 (two 64-row plan tiles or one of 128),
        64 at D = 256; two stages.
    sm_90a dK/dV: query chunks of 64 (wgmma N); two stages.
    """
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r}; expected one of {KINDS}")
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"impl={impl!r}; expected one of {IMPLEMENTATIONS}")
    bm, bn = default_blocks(head_dim)
    bm = bm if block_m is None else int(block_m)
    bn = bn if block_n is None else int(block_n)
    if impl == "sm90a":
        key_chunk = 128 if head_dim <= 128 else 64
        return Tiles(bm, bn, key_chunk, SM90_BWD_QUERY_CHUNK, SM90_STAGES)
    warp_tiles = max(1, bm // (FWD_WARPS * WARP_ROWS))
    acc_regs = warp_tiles * (head_dim + 64) // 2
    wide = head_dim > MAX_WIDE_HEAD_DIM
    key_chunk = min(bn, 32 if acc_regs >= 160 or wide else FWD_MAX_CHUNK)
    query_chunk = 64 if bn == 128 else 16 if head_dim > 192 else 32 if head_dim > 64 else 64
    if kind == "bwd":
        return Tiles(bm, bn, key_chunk, query_chunk, BWD_STAGES)
    fits_three = 2 * (mma_fwd_smem(bm, key_chunk, head_dim, 3)
                      + SMEM_PER_BLOCK_RESERVED) <= SM_SMEM_A100
    return Tiles(bm, bn, key_chunk, query_chunk, 3 if fits_three else 2)


def smem_stride(head_dim: int) -> int:
    """Elements per shared-memory row of the mma.sync kernels (`smem_stride<D>`)."""
    return head_dim + SMEM_PAD


def mma_fwd_smem(block_m: int, key_chunk: int, head_dim: int, stages: int) -> int:
    """Q [BM] + `stages` stages of K and V [key_chunk], rows of D + 8 elements."""
    return (block_m + 2 * stages * key_chunk) * smem_stride(head_dim) * ELEM_BYTES


def mma_dkdv_smem(block_n: int, query_chunk: int, head_dim: int) -> int:
    """K, V [BN] + 2 stages of Q, dO [BQ] + dS^T [BN][BQ + 8] + 2 stages of lse2, delta
    (the same at every dkdv_parts: each pass reuses them; both dQ modes)."""
    elems = ((2 * block_n + 2 * BWD_STAGES * query_chunk) * smem_stride(head_dim)
             + block_n * (query_chunk + SMEM_PAD))
    return elems * ELEM_BYTES + 2 * BWD_STAGES * query_chunk * 4


class KernelLaunch(NamedTuple):
    """One kernel of a module and its launch geometry."""

    name: str       # template name expression, e.g. varlen_fwd<__half, 64, 64, 64, false, ...>
    threads: int    # per block
    smem: int       # dynamic shared memory per block, bytes


class Variant:
    """What every compiled variant of this backend has, mixed into its frozen dataclass: an
    element type (`dtype`) and a head dim (`head_dim`) checked by `check_common` (called first
    in the dataclass's `__post_init__`, which then checks its tiles), a softcap flag
    (`softcap`), and its kernels by role (`kernels()`)."""

    HEAD_DIMS = HEAD_DIMS

    def check_common(self):
        kind = type(self).__name__
        if self.dtype not in DTYPES:
            raise ValueError(f"{kind}.dtype={self.dtype!r}; the tensor-core kernels take "
                             f"{', '.join(DTYPES)}")
        if self.head_dim not in self.HEAD_DIMS:
            raise ValueError(f"{kind}.head_dim={self.head_dim}; compiled head dims are "
                             f"{self.HEAD_DIMS}")
        if not isinstance(self.softcap, bool):
            raise ValueError(f"{kind}.softcap must be a bool, got {self.softcap!r}")

    @property
    def ctype(self) -> str:
        return DTYPES[self.dtype]

    def kernels(self) -> dict:
        """{role: KernelLaunch} in launch order."""
        raise NotImplementedError

    @property
    def name_expressions(self) -> tuple:
        return tuple(k.name for k in self.kernels().values())


def cxx_bool(flag: bool) -> str:
    return "true" if flag else "false"


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
    """Why the mma.sync kernels cannot run on `device` at all (None: they can)."""
    if tuple(device.compute_capability) < MIN_COMPUTE_CAPABILITY:
        major, minor = device.compute_capability
        return (f"the GPU is {device.describe()}, compute capability {major}.{minor}; the "
                f"tensor-core kernels need sm_80 or newer (mma.sync on bfloat16, cp.async)")
    return None


def smem_refusal(variant: Variant, device: DeviceInfo, roles=None) -> str | None:
    """None when the kernels of `variant` (those of `roles`, default all) fit the shared memory
    a block may opt into on `device`; else which one does not, naming both sizes."""
    over = [k for role, k in variant.kernels().items()
            if (roles is None or role in roles) and k.smem > device.smem_optin]
    if not over:
        return None
    k = max(over, key=lambda k: k.smem)
    return (f"{k.name} needs {k.smem} B of shared memory per block and {device.describe()} "
            f"allows at most {device.smem_optin} B ({device.smem_optin / 1024:g} KiB)")
