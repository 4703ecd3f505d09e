"""The sm_90a implementation (`cupy:sm90a`, H100/H200): wgmma, TMA, mbarriers, warp
specialisation (kernels_cuda/fwd_sm90.cuh, bwd_sm90.cuh; docs/hopper.md).

**Forward.** `varlen_fwd_sm90` is persistent: a grid of at most (SMs x `CTAS_PER_SM`) blocks
(`persistent_grid`; the runtime says how many SMs the device has), each looping with a static
stride over the work items (query tile slot, head) in reverse slot order, as `varlen_fwd`
takes them (a sequence's heaviest tiles first under a causal mask). It reads the same
`FwdParams` as the mma.sync forward and three CUDA tensor maps over q, k, v where they lie
(3D: (D, H, T) innermost first, their head and row strides, boxes of 64 head-dim columns x 1
head x BM rows for q, KN rows for k and v, 128B swizzle, zero fill past row T). KN, the key
chunk of the pipeline, comes from `traits.tile_size`.

GQA packing: where the query heads outnumber the key heads (Hq / Hk = G > 1) and short
sequences leave the rows of a query tile mostly empty, the kernel packs P query heads of one
key head (P a power of two dividing G, at most `MAX_PACK`) into the M of a tile of BM / P
positions: row r of the tile is position r / P of head r % P, loaded by one TMA box of
(64, P, BM / P) elements. Each K/V chunk is then loaded once for P heads. The kernel reads a
plan of BM / P-row query tiles, built from the call's plan (`packed_plan`, kept while the plan
lives). `choose_pack` picks P from the plan's shape alone (no device read).

**Backward.** `backward` runs what `mma.backward` runs: the preprocessing (delta, lse2, and with
`deterministic` the order of the dQ additions), then `varlen_bwd_dkdv_sm90` in place of the
mma.sync dK/dV kernel (dK, dV and dQ by fp32 reductions into the same `dq_accum`, in a fixed
order with `deterministic`), then the dQ conversion; the first and last are the mma.sync
module's kernels, unchanged. It reads four tensor maps (q, k, v, dout; boxes of BQ = 64 rows for
q and dout, BN rows for k and v).

**Runtime.** Both are compiled by NVRTC for `sm_90a` (CuPy would pick the architecture from
the device, without the `a` suffix that wgmma and setmaxnreg need) and loaded as cubins kept on
disk between processes (`compile.cubin_path`; `python -m varlen.backends.cupy.sm90 [WORKERS]`
builds every variant the backend dispatches in parallel, as the GPU check does first); the
tensor maps come from the driver's `cuTensorMapEncodeTiled`. A `Runtime` does both; the host
emulation of the kernels (tests) supplies its own through `use_runtime`.
"""
from __future__ import annotations

import dataclasses
import os
import sys
import time
import weakref
from dataclasses import dataclass

import numpy as np

from ..._array import alloc
from . import launch as L
from .mods import ModHooks, error_flag, hooks_for, module_source, record_errors
from .traits import (ELEM_BYTES, SM90_FWD_HEAD_DIM_V_PAIRS, SM90_HEAD_DIMS, SM90_STAGES,
                     SMEM_PAD, WG_ROWS, KernelLaunch, Variant, cxx_bool, head_dim_v_refusal,
                     sm90_backward_refusal, tile_size)

ARCH = "sm_90a"
WG_THREADS = 128              # a warpgroup
BOX_COLS = 64                 # head-dim columns per TMA box: 128 bytes, the 128B swizzle width
FWD_BARRIERS = 2 + 5 * SM90_STAGES  # q_full, q_empty; k_full, v_full, ready, k_empty, v_empty
# With a mask_mod the forward's two tables of the key chunks' classes (a byte per chunk, the
# first CLASS_TABLE of an item: kernels_cuda/mask.cuh, ClassTable) and their two barriers each
CLASS_TABLE = 2048
CLASS_BARRIERS = 4
BWD_BARRIERS = 2 + 3 * SM90_STAGES
SPLIT_HEAD_DIM = 256          # from this D two backward consumers split the head dim's columns
CHUNK_BYTES = 24              # StagedChunk: the query chunk a backward stage holds
# Blocks of the kernel an SM holds: its register file (`__launch_bounds__(threads, 1)`: 255
# registers x 256 threads, 168 x 384) takes all 64 K registers of an SM.
CTAS_PER_SM = 1
SMEM_ALIGN = 1024             # slack to round the shared window up to the 128B swizzle's repeat
OPTIN_SMEM = 227 * 1024
TENSOR_MAP_DTYPE = np.dtype([("opaque", np.uint64, 16)])      # CUtensorMap, 128 bytes
# GQA packing: at most 8 query heads per position in a tile (FwdSm90Config::PACK), each doubling
# of P taken only when it raises the estimated fill of the tiles' rows by PACK_GAIN or more
PACKS = (1, 2, 4, 8)
MAX_PACK = PACKS[-1]
PACK_GAIN = 1.1
FWD_KERNEL = "varlen_fwd_sm90"
# The forward's key chunk with a call's mask_mod or score_mod (`fwd_spec_for`)
MODS_KEY_CHUNK = 64
BWD_KERNEL = "varlen_bwd_dkdv_sm90"


class _Sm90Variant(Variant):
    """What both kernels' variants share: their head dims, the shared-memory check, the kernel
    by role, the name (the kernel template and `template_args`) and the label."""

    HEAD_DIMS = SM90_HEAD_DIMS
    KERNEL = ""             # the kernel template

    @property
    def name(self) -> str:
        return f"{self.KERNEL}<{', '.join(map(str, self.template_args))}>"

    def _label(self, kind, *parts, **flags) -> str:
        """`KIND-sm90a-dtype-PARTS`, then the name of each flag that is set."""
        return "-".join([kind, "sm90a", self.dtype, *parts,
                         *(flag for flag, on in flags.items() if on)])

    def check_smem(self):
        if self.smem > OPTIN_SMEM:
            raise ValueError(f"{self}: {self.smem} B of shared memory exceed {OPTIN_SMEM}")

    def kernels(self) -> dict:
        return {self.ROLE: KernelLaunch(self.name, self.threads, self.smem)}


@dataclass(frozen=True)
class FwdSpec(_Sm90Variant):
    """One variant of `varlen_fwd_sm90`: element type, head dim, the kernel's query rows per tile
    (the plan's query tiles when `pack` is 1, else block_m / pack positions), the plan's key
    tiles, softcap, the kernel's key chunk (None: `traits.tile_size`'s), the query heads
    packed per position, the call's mask_mod and score_mod (`mods.ModHooks`, None without:
    the cubin is built with their generated code) and the head dim of v and out (`head_dim_v`,
    None: `head_dim`; else a pair of `traits.SM90_FWD_HEAD_DIM_V_PAIRS`)."""

    ROLE = "fwd"
    KERNEL = FWD_KERNEL
    # D = 192 with head_dim_v = 128 only
    HEAD_DIMS = tuple(sorted({*SM90_HEAD_DIMS, *(d for d, _ in SM90_FWD_HEAD_DIM_V_PAIRS)}))
    dtype: str          # "float16" | "bfloat16"
    head_dim: int
    block_m: int
    block_n: int        # the plan's key tiles
    softcap: bool
    key_chunk: int | None = None
    pack: int = 1
    mods: ModHooks | None = None
    head_dim_v: int | None = None

    def __post_init__(self):
        if self.head_dim_v is None:
            object.__setattr__(self, "head_dim_v", self.head_dim)
        if self.key_chunk is None:
            object.__setattr__(self, "key_chunk", tile_size(
                "fwd", "sm90a", self.dtype, self.head_dim, self.block_m, self.block_n).key_chunk)
        self.check_common()
        why = head_dim_v_refusal(self.head_dim, self.head_dim_v, "sm90a")
        if why is None and self.head_dim not in SM90_HEAD_DIMS and \
                self.head_dim_v == self.head_dim:
            why = (f"head_dim={self.head_dim} is compiled with (head_dim, head_dim_v) in "
                   f"{SM90_FWD_HEAD_DIM_V_PAIRS} only")
        if why:
            raise ValueError(f"FwdSpec: {why}")
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
        self.check_smem()

    @property
    def threads(self) -> int:
        """A producer warpgroup and one consumer warpgroup per 64 query rows."""
        return WG_THREADS * (1 + self.block_m // WG_ROWS)

    @property
    def smem(self) -> int:
        """Q [BM][D], STAGES x K [KN][D] and V [KN][Dv], the output stage [BM][Dv + 8], the
        mbarriers (FwdSm90Config's layout), with a mask_mod the class tables, and 1 KiB to align
        the window."""
        e = ELEM_BYTES
        data = (self.block_m + SM90_STAGES * self.key_chunk) * self.head_dim * e
        data += SM90_STAGES * self.key_chunk * self.head_dim_v * e
        data += self.block_m * (self.head_dim_v + SMEM_PAD) * e
        classes = 8 * CLASS_BARRIERS + 2 * CLASS_TABLE if self.mods and self.mods.mask else 0
        return -(-data // 8) * 8 + 8 * FWD_BARRIERS + classes + SMEM_ALIGN

    @property
    def template_args(self) -> tuple:
        """`varlen_fwd_sm90<T, D, BM, BN, HAS_SOFTCAP, KN, PACK[, DV]>`: DV (head_dim_v) only
        where it differs from D (its default), so the other kernels keep their names."""
        dv = (self.head_dim_v,) if self.head_dim_v != self.head_dim else ()
        return (self.ctype, self.head_dim, self.block_m, self.block_n, cxx_bool(self.softcap),
                self.key_chunk, self.pack, *dv)

    @property
    def label(self) -> str:
        dv = [f"Dv{self.head_dim_v}"] if self.head_dim_v != self.head_dim else []
        return self._label("fwd", f"D{self.head_dim}", *dv, f"BM{self.block_m}",
                           f"BN{self.block_n}",
                           f"KN{self.key_chunk}", f"P{self.pack}",
                           *([self.mods.label] if self.mods else []), softcap=self.softcap)

    @property
    def source(self) -> str | None:
        """The module source of its cubin (`compile.cubin_path`): None, the kernels alone,
        without a mask_mod or score_mod."""
        return module_source(self.mods) if self.mods else None

    @property
    def plan_block_m(self) -> int:
        """The query tiles of the plan the kernel reads: block_m / pack positions."""
        return self.block_m // self.pack


@dataclass(frozen=True)
class BwdSpec(_Sm90Variant):
    """One variant of `varlen_bwd_dkdv_sm90`: element type, head dim, key tile, softcap,
    whether dQ is added in a fixed order (`deterministic=True`), and the call's mask_mod
    (`mods.ModHooks`, None without: the cubin is built with its generated code, as
    `FwdSpec`'s; never a score_mod, which `mods.refusal` refuses here)."""

    ROLE = "dkdv"
    KERNEL = BWD_KERNEL
    dtype: str          # "float16" | "bfloat16"
    head_dim: int
    block_n: int
    softcap: bool
    ordered_dq: bool = False
    mods: ModHooks | None = None

    def __post_init__(self):
        self.check_common()
        if self.block_n not in (64, 128):
            raise ValueError(f"{self.block_n=}: one or two consumer warpgroups of 64 key rows")
        if self.mods is not None and self.mods.score:
            raise ValueError(f"{self.mods=}: the sm_90a backward runs a mask_mod, no score_mod")
        if self.head_dim >= SPLIT_HEAD_DIM and self.block_n != WG_ROWS:
            raise ValueError(f"{self.block_n=} at D = {self.head_dim}: the sm_90a backward's two "
                             f"consumer warpgroups split the columns of a {WG_ROWS}-key tile")
        self.check_smem()

    @property
    def query_chunk(self) -> int:
        return tile_size("bwd", "sm90a", self.dtype, self.head_dim, None,
                         self.block_n).query_chunk

    @property
    def consumers(self) -> int:
        """Consumer warpgroups: one per 64 key rows, two (one per half of the columns) at
        D = 256."""
        return self.block_n // WG_ROWS * (2 if self.head_dim >= SPLIT_HEAD_DIM else 1)

    @property
    def threads(self) -> int:
        """A producer warpgroup and the consumers."""
        return WG_THREADS * (1 + self.consumers)

    @property
    def smem(self) -> int:
        """K, V [BN][D], STAGES x (Q, dO) [BQ][D], dS [BQ][64] per consumer, STAGES x (lse2,
        delta) [BQ] and the stage's chunk, the mbarriers (BwdSm90Config's layout), and 1 KiB to
        align the window."""
        e, bq = ELEM_BYTES, self.query_chunk
        data = (2 * self.block_n + 2 * SM90_STAGES * bq) * self.head_dim * e
        data += self.consumers * bq * WG_ROWS * e + SM90_STAGES * (2 * bq * 4 + CHUNK_BYTES)
        return data + 8 * BWD_BARRIERS + SMEM_ALIGN

    @property
    def template_args(self) -> tuple:
        return (self.ctype, self.head_dim, self.block_n, self.query_chunk,
                cxx_bool(self.softcap), cxx_bool(self.ordered_dq))

    @property
    def label(self) -> str:
        return self._label("bwd", f"D{self.head_dim}", f"BN{self.block_n}",
                           *([self.mods.label] if self.mods else []),
                           softcap=self.softcap, ordered=self.ordered_dq)

    @property
    def source(self) -> str | None:
        """The module source of its cubin, as `FwdSpec.source`."""
        return module_source(self.mods) if self.mods else None


def fwd_spec_for(plan, q, softcap: float, mods=None, v=None) -> FwdSpec:
    """The unpacked forward variant for a call with `plan` (its query tiles are the kernel's
    rows), `mods` (`varlen.mods.Mods` or None) and values `v` (its head dim is head_dim_v;
    None: q's). With user functions the key chunk is `MODS_KEY_CHUNK`: their per-pair
    arithmetic beside S of 128 keys spilled (76 B at D = 64)."""
    hooks = hooks_for(mods)
    return FwdSpec(str(q.dtype), int(q.shape[2]), int(plan.block_m), int(plan.block_n),
                   bool(softcap > 0), key_chunk=MODS_KEY_CHUNK if hooks else None, mods=hooks,
                   head_dim_v=None if v is None else int(v.shape[2]))


def bwd_spec_for(plan, q, softcap: float, deterministic: bool = False, v=None,
                 mods=None) -> BwdSpec:
    """The dK/dV variant for a call with `plan`, values `v` (None: q's head dim) and `mods`
    (`varlen.mods.Mods` or None; a score_mod is refused before: `mods.refusal`)."""
    why = None if v is None else sm90_backward_refusal(int(q.shape[2]), int(v.shape[2]))
    if why:
        raise ValueError(why)
    spec = BwdSpec(str(q.dtype), int(q.shape[2]), int(plan.block_n), bool(softcap > 0),
                   bool(deterministic), hooks_for(mods))
    if plan.block_m % spec.query_chunk:
        raise ValueError(f"{plan.block_m=} does not split into query chunks of "
                         f"{spec.query_chunk}")
    return spec


def row_fill(num_rows: int, num_segments: int, tile_rows: int) -> float:
    """Estimated share of the rows of the query tiles that hold a query: `num_rows` packed rows
    in `num_segments` segments cut into tiles of `tile_rows` rows, with the lengths unknown (on
    the device): the expected tiles when each segment ends in a tile filled uniformly at random,
    T / b + S (b - 1) / (2 b), at least one per segment, at most the plan's bound
    (`varlen.plan.tile_bound`). Decoding (T = S) fills 1 / b. 1 without rows."""
    from ...plan import tile_bound
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
    (`pack` 1: `plan` itself), built once per plan by the plan kernels (no host read)."""
    if pack == 1:
        return plan
    per_plan = _packed_plans.setdefault(plan, {})
    if pack not in per_plan:
        from ...masks import Mask
        from .plan import build_plan
        mask = Mask(window_left=plan.window_left, window_right=plan.window_right,
                    bottom_right=plan.bottom_right)
        per_plan[pack] = build_plan(plan.q, plan.k, mask, block_m=plan.block_m // pack,
                                    block_n=plan.block_n)
    return per_plan[pack]


_work_ordered = weakref.WeakKeyDictionary()


def work_ordered_plan(plan):
    """`plan` with its query tile slots in ascending order of work, for the sm_90a forward,
    which takes its work items from the last slot on (`WorkItem`): so the items run in
    descending order of work and the static stride of the persistent grid bounds the spread of
    the blocks' finishing times by one item (docs/hopper.md, "The persistent loop"). A slot's
    work is its visible key tiles (q_sched's `end - begin` summed over the key segments);
    equal work keeps slot order, unused slots (no work) come first. The same tiles, schedules
    and row schedules, permuted together on the device (no host read), once per plan object;
    everything else is `plan`'s."""
    got = _work_ordered.get(plan)
    if got is None:
        sched = plan.q_sched
        work = (sched[:, :, 3] - sched[:, :, 0]).astype("int64").sum(axis=1)
        slots = work.shape[0]
        # unique keys: the order does not depend on the sort's stability
        index = (work * 0 + 1).cumsum() - 1           # 0 .. slots - 1, where work lies
        order = (work * slots + index).argsort()
        got = _work_ordered[plan] = dataclasses.replace(
            plan, q_tiles=plan.q_tiles[order], q_sched=sched[order],
            q_row_sched=plan.q_row_sched[order])
    return got


def persistent_grid(work_items: int, sm_count: int) -> int:
    """Blocks of the persistent grid: one per work item up to `CTAS_PER_SM` per SM, at least one
    (it also writes the pad rows)."""
    return max(1, min(work_items, sm_count * CTAS_PER_SM))


def map_layout(a, box_rows: int, box_heads: int = 1):
    """The tensor map of a [T, H, D] array whose last dim is contiguous as (dims, byte strides
    of dims 1 and 2, box), innermost first: its own head and row strides (`launch.strides`;
    multiples of 16 bytes, positive: `launch.data(..., tma=True)`), boxes of 64 columns of
    `box_heads` heads of `box_rows` rows."""
    T, H, D = a.shape
    e = a.dtype.itemsize
    row, head = L.strides(a)
    return (D, H, T), (head * e, row * e), (BOX_COLS, box_heads, box_rows)


# cuTensorMapEncodeTiled's element types (CUtensorMapDataType) of the dtypes a map may have
TENSOR_MAP_TYPES = {"float16": "FLOAT16", "bfloat16": "BFLOAT16", "float32": "FLOAT32",
                    "uint16": "UINT16"}


def tiled_args(address: int, dtype, dims, strides, box, swizzle: int = 3,
               nan_fill: bool = False) -> tuple:
    """The arguments of the driver's `cuTensorMapEncodeTiled` (cuda-bindings) for a map of
    len(dims) dimensions at device `address`: `dims` and `box` innermost first, `strides` the
    byte strides of dims 1.. as `cuuint64_t`, the box and element strides (1) as `cuuint32_t`
    (the bindings refuse plain ints in those lists), no interleave, `swizzle` a
    CUtensorMapSwizzle (3: 128B), out-of-bounds elements zero (`nan_fill`: NaN)."""
    from cuda.bindings import driver as cu
    name = dtype.name if hasattr(dtype, "name") else np.dtype(dtype).name
    if name not in TENSOR_MAP_TYPES:
        raise ValueError(f"a tensor map of {name} elements: one of {tuple(TENSOR_MAP_TYPES)}")
    fill = cu.CUtensorMapFloatOOBfill
    return (getattr(cu.CUtensorMapDataType, f"CU_TENSOR_MAP_DATA_TYPE_{TENSOR_MAP_TYPES[name]}"),
            len(dims), address, [cu.cuuint64_t(x) for x in dims],
            [cu.cuuint64_t(x) for x in strides], [cu.cuuint32_t(x) for x in box],
            [cu.cuuint32_t(1)] * len(dims),
            cu.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
            cu.CUtensorMapSwizzle(swizzle),
            cu.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
            fill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NAN_REQUEST_ZERO_FMA if nan_fill
            else fill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)


def encode_args(a, box_rows: int, box_heads: int = 1) -> tuple:
    """`tiled_args` of the map of a [T, H, D] CuPy array (`map_layout`): 128B swizzle, zero
    fill."""
    dims, strides, box = map_layout(a, box_rows, box_heads)
    return tiled_args(a.data.ptr, a.dtype, dims, strides, box)


def encode_tensor_map(args: tuple) -> np.ndarray:
    """The driver's `cuTensorMapEncodeTiled(*args)` (`tiled_args`) as the 128-byte kernel
    argument (`TENSOR_MAP_DTYPE`); a RuntimeError naming the dims and box if it refuses."""
    from cuda.bindings import driver as cu
    err, tmap = cu.cuTensorMapEncodeTiled(*args)
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuTensorMapEncodeTiled(dims={[int(x) for x in args[3]]}, "
                           f"strides={[int(x) for x in args[4]]}, "
                           f"box={[int(x) for x in args[5]]}) failed: {err}")
    arg = np.zeros((), TENSOR_MAP_DTYPE)
    arg["opaque"] = np.asarray(tmap.opaque, dtype=np.uint64)
    return arg


class Runtime:
    """Compiles the kernels for sm_90a with NVRTC, loads the cubin into CuPy and makes tensor
    maps with the CUDA driver (needs a Hopper GPU, cupy and cuda-bindings).

    The interface every runtime of these launches has: `prepare(spec)` before a launch's tensor
    maps, `tensor_map(a, box_rows, box_heads)`, `sm_count()`, `launch(spec, grid=, args=)`."""

    def __init__(self):
        self._functions = {}
        self._sm_counts = {}

    def prepare(self, spec) -> None:
        """Nothing to do before the tensor maps on a GPU."""

    def function(self, spec):
        """The loaded kernel of `spec` (a forward or backward spec: its `name`, `smem`)."""
        if spec not in self._functions:
            import cupy

            from .compile import cubin_path
            path, lowered = cubin_path(spec.name, ARCH, getattr(spec, "source", None))
            fn = cupy.RawModule(path=path).get_function(lowered)
            fn.max_dynamic_shared_size_bytes = spec.smem
            self._functions[spec] = fn
        return self._functions[spec]

    def tensor_map(self, a, box_rows: int, box_heads: int = 1) -> np.ndarray:
        return encode_tensor_map(encode_args(a, box_rows, box_heads))

    def sm_count(self) -> int:
        """The current device's SMs (`cudaDevAttrMultiProcessorCount`), read once per device
        (`Device.attributes` queries every attribute)."""
        import cupy
        dev = cupy.cuda.Device()
        if dev.id not in self._sm_counts:
            self._sm_counts[dev.id] = int(dev.attributes["MultiProcessorCount"])
        return self._sm_counts[dev.id]

    def launch(self, spec, *, grid, args):
        self.function(spec)(grid, (spec.threads,), args, shared_mem=spec.smem)


_runtime = None


def runtime():
    global _runtime
    if _runtime is None:
        _runtime = Runtime()
    return _runtime


def use_runtime(rt) -> None:
    """Route the launches of both kernels through `rt` (None: the GPU's `Runtime`)."""
    global _runtime
    _runtime = rt


def compile_report(specs) -> dict:
    """NVRTC build of `specs` for sm_90a: {name: {registers, spill_stores, spill_loads,
    static_smem, smem, threads, warnings}}. `registers` is ptxas' allocation at entry (the cap
    of `__launch_bounds__(threads, 1)`); setmaxnreg then moves registers from the producer to
    the consumer warpgroups. `warnings` lists the log's warning lines (C7508: setmaxnreg
    ignored). One build per module source (specs with a mask_mod or score_mod have their own,
    `FwdSpec.source`); keyed by name, so give specs of one source at a time to tell apart
    variants that differ only in it."""
    from .compile import build_program, parse_ptxas_log
    specs = list(specs)
    report = {}
    for source in dict.fromkeys(getattr(s, "source", None) for s in specs):
        mine = [s for s in specs if getattr(s, "source", None) == source]
        _, lowered, log = build_program([spec.name for spec in mine], ARCH, source)
        usage = parse_ptxas_log(log)
        warnings = [line for line in log.splitlines() if "warning" in line.lower()]
        report.update({s.name: {**usage[lowered[s.name]], "smem": s.smem, "threads": s.threads,
                                "warnings": warnings} for s in mine})
    return report


def dispatched_specs() -> list:
    """The sm_90a variants the backend runs with its default plan tiles on an H100/H200
    (`traits.default_blocks`: (128, 64) at D = 64, (128, 128) at D = 128, (64, 64) at
    D = 256): the forward with 1, 2, 4 and 8 heads packed per position and the dK/dV kernel in
    both dQ modes, each dtype, with and without a softcap; the forward of the (head_dim,
    head_dim_v) pairs of `traits.SM90_FWD_HEAD_DIM_V_PAIRS` ((64, 64) tiles at 192 / 128)."""
    from .traits import DTYPES, default_blocks
    specs = []
    for d in SM90_HEAD_DIMS:
        bm, bn = default_blocks(d)
        for dtype in DTYPES:
            for softcap in (False, True):
                specs += [FwdSpec(dtype, d, bm, bn, softcap, pack=p) for p in PACKS]
                specs += [BwdSpec(dtype, d, bn, softcap, ordered) for ordered in (False, True)]
    for d, dv in SM90_FWD_HEAD_DIM_V_PAIRS:
        bm, bn = default_blocks(d)
        specs += [FwdSpec(dtype, d, bm, bn, softcap, pack=p, head_dim_v=dv)
                  for dtype in DTYPES for softcap in (False, True) for p in PACKS]
    return specs


def warm(workers: int, specs=None) -> int:
    """Builds the cubins of `specs` (default `dispatched_specs()`) into the cache with `workers`
    processes; returns how many there are."""
    from concurrent.futures import ProcessPoolExecutor

    from .compile import cubin_path
    names = [s.name for s in (dispatched_specs() if specs is None else specs)]
    with ProcessPoolExecutor(max(1, workers)) as pool:
        for _ in pool.map(cubin_path, names):
            pass
    return len(names)


def forward(plan, q, k, v, *, softmax_scale: float, softcap: float, pack: int | None = None,
            mods=None):
    """`out [Tq, Hq, Dv]` (q's dtype, pad rows 0; Dv = v.shape[2]) and `lse [Hq, Tq]`
    (float32, pad rows -inf), as `mma.forward`, by the sm_90a kernel: one launch of
    `persistent_grid` blocks over num_q_tiles x Hq / pack work items, no fill (the blocks also
    write the rows of no tile).
    `pack`: query heads per position in a tile (`pack_for`; None: `choose_pack`). q, k and v
    are read where they lie (`launch.data` with the tensor maps' rules). `mods`: the call's
    mask_mod and score_mod, as in `mma.forward` (a packed row's score_mod sees its own head)."""
    import cupy
    q, k, v = (L.data(a, name, tma=True) for a, name in ((q, "q"), (k, "k"), (v, "v")))
    Tq, Hq, _ = q.shape
    Hk, Dv = k.shape[1], v.shape[2]
    L.check_heads(Hq)
    spec = fwd_spec_for(plan, q, softcap, mods, v)
    pack = pack_for(plan, Tq, Hq, Hk, spec.block_m, pack)
    spec = dataclasses.replace(spec, pack=pack)
    out = alloc(cupy, (Tq, Hq, Dv), q.dtype)
    lse = alloc(cupy, (Hq, Tq), np.float32)
    if Tq == 0 or Hq == 0:
        return out, lse
    rt = runtime()
    rt.prepare(spec)
    kplan = work_ordered_plan(packed_plan(plan, pack))
    plan_arg = L.plan_view_arg(kplan)         # referenced until the launch is enqueued
    err = error_flag(mods)
    params = L.fwd_params_arg(plan_arg, L.call_params_arg(Hq, Hk, softmax_scale, softcap),
                              q=q, k=k, v=v, out=out, lse=lse, mods=mods, mod_err=err)
    maps = (rt.tensor_map(q, spec.plan_block_m, pack), rt.tensor_map(k, spec.key_chunk),
            rt.tensor_map(v, spec.key_chunk))
    grid = persistent_grid(int(kplan.num_q_tiles) * (Hq // pack), rt.sm_count())
    rt.launch(spec, grid=(grid, 1), args=(*maps, params))
    record_errors(err)
    return out, lse


def backward(plan, dout, q, k, v, out, lse, *, softmax_scale: float, softcap: float,
             deterministic: bool = False, mods=None):
    """`(dq, dk, dv)` in the input dtype, as `mma.backward`: dq [Tq, Hq, D], dk and dv
    [Tk, Hk, D]; pad rows and rows without a visible pair 0; dQ's additions in a fixed order
    with `deterministic` (bitwise repeatable). The same three launches, `varlen_bwd_dkdv_sm90`
    in place of the mma.sync dK/dV kernel. q, k, v and dout are read where they lie
    (`launch.data` with the tensor maps' rules), out where the preprocessing can. `mods`: the
    call's mask_mod, as in `mma.backward` (a score_mod is refused before: `mods.refusal`); an
    out-of-range aux index is flagged as there."""
    from . import mma
    spec = bwd_spec_for(plan, q, softcap, deterministic, v, mods)
    # the preprocessing and the conversion depend on the element type and head dim only
    aux = mma.KernelSpec("bwd", spec.dtype, spec.head_dim, 64, 64, False)
    q, k, v, dout = (L.data(a, name, tma=True)
                     for a, name in ((q, "q"), (k, "k"), (v, "v"), (dout, "dout")))

    def dkdv(params, q, k, v, dout):
        rt = runtime()
        rt.prepare(spec)
        maps = (rt.tensor_map(q, spec.query_chunk), rt.tensor_map(k, spec.block_n),
                rt.tensor_map(v, spec.block_n), rt.tensor_map(dout, spec.query_chunk))
        rt.launch(spec, grid=(plan.num_k_tiles, k.shape[1]), args=(*maps, params))

    return mma.backward(aux, plan, dout, q, k, v, out, lse, softmax_scale=softmax_scale,
                        softcap=softcap, deterministic=bool(deterministic), dkdv=dkdv,
                        mods=mods)


def main(argv=None) -> int:
    """`python -m varlen.backends.cupy.sm90 [WORKERS]`: every dispatched variant into the
    cubin cache (WORKERS processes, default the CPU count)."""
    from .compile import cache_dir
    argv = sys.argv[1:] if argv is None else argv
    try:
        from cuda.bindings import nvrtc  # noqa: F401
    except ImportError as e:
        print(f"python -m varlen.backends.cupy.sm90: NVRTC is not importable ({e}); it builds "
              f"the sm_90a cubins (pip install 'varlen[compile]', or a CUDA extra)",
              file=sys.stderr)
        return 2
    workers = int(argv[0]) if argv else (os.cpu_count() or 1)
    t0 = time.perf_counter()
    n = warm(workers)
    print(f"{n} sm_90a kernels in {cache_dir()} ({time.perf_counter() - t0:.0f} s, "
          f"{workers} processes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
