"""The mma.sync implementation (`cupy:mma`, sm_80 and newer): its variants and launchers.

A forward is one launch, a backward three. Every launch goes to the caller's current CuPy
stream, reads no device memory on the host and allocates only the outputs and the backward's
fp32 scratch, all through `varlen._array.alloc`, so a warmed-up call can be captured in a CUDA
graph. Nothing is filled before a kernel: the kernels write every row of their outputs, the
rows no tile covers (padding) included: the forward in "pad blocks" past its tile slots
(`pad_blocks`), the backward in its preprocessing.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..._array import alloc
from . import launch as L
from .mods import (ModHooks, aux_grad_buffers, aux_grads_result, error_flag, hooks_for,
                   record_errors)
from .traits import (BLOCKS, KINDS, MAX_WIDE_HEAD_DIM, WARP_ROWS, WARP_SIZE, DeviceInfo,
                     KernelLaunch, Variant, blocks_for, cxx_bool, head_dim_v_refusal,
                     mma_dkdv_smem, mma_fwd_smem, smem_refusal, smem_stride, tile_size)

PREPROCESS_WARPS = 4              # kernels_cuda/bwd_preprocess.cuh
CONVERT_THREADS = 256
# Rows each thread of a pad block takes (kernels_cuda/tile_scheduler.cuh, PAD_ROWS_PER_THREAD).
PAD_ROWS_PER_THREAD = 32


@dataclass(frozen=True)
class KernelSpec(Variant):
    """One compiled variant of the mma.sync kernels: a kind (`"fwd"` or `"bwd"`), an element
    type, a head dim, the plan's tiles, the softcap flag, the call's mask_mod and score_mod
    (`mods.ModHooks`, None without: the module is compiled with their generated code) and the
    head dim of v (`head_dim_v`, None: `head_dim`; a pair of `traits.HEAD_DIM_V_PAIRS`
    otherwise) and the dropout flag (`dropout`: the forward and dK/dV kernels with their
    DROPOUT template argument; the call's seed, offset and p reach them as values, in the
    params); the kernels' own steps come from `traits.tile_size` (those of `head_dim`: V's
    rows lie in the shared-memory rows of K's width). Invalid combinations raise ValueError
    here, before compiling."""

    kind: str            # "fwd" | "bwd"
    dtype: str           # "float16" | "bfloat16"
    head_dim: int
    block_m: int
    block_n: int
    softcap: bool
    mods: ModHooks | None = None
    head_dim_v: int | None = None
    dropout: bool = False

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"KernelSpec.kind={self.kind!r}; expected one of {KINDS}")
        self.check_common()
        if not isinstance(self.dropout, bool):
            raise ValueError(f"KernelSpec.dropout must be a bool, got {self.dropout!r}")
        if self.head_dim_v is None:
            object.__setattr__(self, "head_dim_v", self.head_dim)
        why = head_dim_v_refusal(self.head_dim, self.head_dim_v, "mma")
        if why:
            raise ValueError(f"KernelSpec: {why}")
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
        if self.block_m % self.tiles.query_chunk:
            raise ValueError(f"block_m={self.block_m} does not split into query chunks of "
                             f"{self.tiles.query_chunk}")

    # ---- geometry -----------------------------------------------------------------------

    def tiles_of(self, kind: str):
        """`traits.tile_size` of pass `kind` ("fwd" | "bwd") at this variant's tiles."""
        return tile_size(kind, "mma", self.dtype, self.head_dim, self.block_m, self.block_n)

    @property
    def tiles(self):
        return self.tiles_of(self.kind)

    @property
    def stride(self) -> int:
        return smem_stride(self.head_dim)

    @property
    def bwd_query_chunk(self) -> int:
        """Query rows per step of the dK/dV kernel."""
        return self.tiles_of("bwd").query_chunk

    @property
    def fwd_chunk(self) -> int:
        """Keys per step of the forward; a 128-key plan tile is walked in the chunks of a
        64-key one (the same registers)."""
        return self.tiles_of("fwd").key_chunk

    @property
    def fwd_stages(self) -> int:
        """K/V stages of the forward."""
        return self.tiles_of("fwd").stages

    @property
    def dkdv_parts(self) -> int:
        """Passes of the dK/dV kernel over its query chunks, each accumulating head_dim /
        dkdv_parts columns of dK and dV: 2 at D > 128 (DkdvConfig::D_PARTS)."""
        return 2 if self.head_dim > MAX_WIDE_HEAD_DIM else 1

    @property
    def fwd_threads(self) -> int:
        return 4 * WARP_SIZE

    @property
    def dkdv_threads(self) -> int:
        return self.block_n // WARP_ROWS * WARP_SIZE

    def fwd_smem(self) -> int:
        return mma_fwd_smem(self.block_m, self.fwd_chunk, self.head_dim, self.fwd_stages)

    def dkdv_smem(self) -> int:
        return mma_dkdv_smem(self.block_n, self.bwd_query_chunk, self.head_dim)

    # ---- names --------------------------------------------------------------------------

    @property
    def fwd_block_n(self) -> int:
        """The key tile the forward is compiled for: its key chunk's multiple of 64 at most, so
        plans of 128-key tiles run the module of 64-key tiles (the forward walks key chunks
        through the plan's row schedule, whose bounds do not depend on the key tile)."""
        return min(self.block_n, 64)

    def compiled(self) -> "KernelSpec":
        """The spec whose module runs this one: a forward of 128-key tiles runs the module of
        64-key tiles (fwd_block_n); every other spec its own."""
        if self.kind == "fwd" and self.block_n != self.fwd_block_n:
            return KernelSpec(self.kind, self.dtype, self.head_dim, self.block_m,
                              self.fwd_block_n, self.softcap, self.mods, self.head_dim_v,
                              self.dropout)
        return self

    @property
    def _dv(self) -> str:
        """The trailing DV and DROPOUT template arguments: none (their defaults, D and false)
        when head_dim_v == head_dim without dropout, so those kernels keep their names."""
        if self.dropout:
            return f", {self.head_dim_v}, true"
        return "" if self.head_dim_v == self.head_dim else f", {self.head_dim_v}"

    def fwd_name(self) -> str:
        """`varlen_fwd<T, D, BM, BN, HAS_SOFTCAP, KN, STAGES[, DV[, DROPOUT]]>`: the key chunk
        and stages of `traits.tile_size`, which FwdConfig checks."""
        return (f"varlen_fwd<{self.ctype}, {self.head_dim}, {self.block_m}, {self.fwd_block_n}, "
                f"{cxx_bool(self.softcap)}, {self.fwd_chunk}, {self.fwd_stages}{self._dv}>")

    def dkdv_name(self, ordered_dq: bool = False) -> str:
        """`varlen_bwd_dkdv<T, D, BN, BQ, HAS_SOFTCAP, ATOMIC_DQ, ORDERED_DQ[, DV[, DROPOUT]]>`,
        BQ the query chunk of `traits.tile_size`. Both dQ modes add dQ in the kernel
        (ATOMIC_DQ = true); ordered_dq fixes the order."""
        ordered = f", {cxx_bool(ordered_dq)}" if ordered_dq or self._dv else ""
        return (f"varlen_bwd_dkdv<{self.ctype}, {self.head_dim}, {self.block_n}, "
                f"{self.bwd_query_chunk}, {cxx_bool(self.softcap)}, true{ordered}{self._dv}>")

    def preprocess_name(self) -> str:
        dv = "" if self.head_dim_v == self.head_dim else f", {self.head_dim_v}"
        return f"varlen_bwd_preprocess<{self.ctype}, {self.head_dim}{dv}>"

    def convert_name(self) -> str:
        return f"varlen_bwd_dq_convert<{self.ctype}, {self.head_dim}>"

    def kernels(self) -> dict:
        """{role: KernelLaunch} of the module's kernels, in launch order; roles "fwd", or
        "preprocess", "dkdv_atomic", "dkdv_ordered" (dQ added in a fixed order: the
        deterministic backward), "dq_convert"."""
        if self.kind == "fwd":
            return {"fwd": KernelLaunch(self.fwd_name(), self.fwd_threads, self.fwd_smem())}
        return {"preprocess": KernelLaunch(self.preprocess_name(), PREPROCESS_WARPS * WARP_SIZE,
                                           0),
                "dkdv_atomic": KernelLaunch(self.dkdv_name(), self.dkdv_threads,
                                            self.dkdv_smem()),
                "dkdv_ordered": KernelLaunch(self.dkdv_name(ordered_dq=True),
                                             self.dkdv_threads, self.dkdv_smem()),
                "dq_convert": KernelLaunch(self.convert_name(), CONVERT_THREADS, 0)}

    @property
    def label(self) -> str:
        dv = f"-Dv{self.head_dim_v}" if self.head_dim_v != self.head_dim else ""
        return (f"{self.kind}-{self.dtype}-D{self.head_dim}{dv}-BM{self.block_m}-BN{self.block_n}"
                f"{'-softcap' if self.softcap else ''}"
                f"{'-dropout' if self.dropout else ''}"
                f"{'-' + self.mods.label if self.mods else ''}")


# The kernels a call runs, by role (KernelSpec.kernels): the forward, the backward with atomic
# dQ, the deterministic backward.
ROLES = {"fwd": ("fwd",), "bwd": ("preprocess", "dkdv_atomic", "dq_convert"),
         "bwd-deterministic": ("preprocess", "dkdv_ordered", "dq_convert")}


def spec_for(plan, q, *, kind: str, softcap: float, mods=None, v=None,
             dropout=None) -> KernelSpec:
    """The compiled variant that runs `kind` ("fwd"/"bwd") for this plan and input (`v`: its
    head dim is head_dim_v; None: q's), the call's `mods` (`varlen.mods.Mods` or None) and
    its `dropout` (`varlen.dropout.Dropout` or None)."""
    from ..._validate import dtype_name
    return KernelSpec(kind, dtype_name(q.dtype), int(q.shape[2]), plan.block_m, plan.block_n,
                      softcap > 0, hooks_for(mods, backward=kind == "bwd"),
                      None if v is None else int(v.shape[2]), dropout is not None)


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
    """Every variant the implementation ships: each head dim with head_dim_v == head_dim, then
    the (head_dim, head_dim_v) pairs of `traits.HEAD_DIM_V_PAIRS`; without dropout, then with."""
    from .traits import DTYPES, HEAD_DIM_V_PAIRS, HEAD_DIMS
    dims = [(d, d) for d in HEAD_DIMS] + list(HEAD_DIM_V_PAIRS)
    return [KernelSpec(kind, dtype, d, bm, bn, sc, None, dv, drop)
            for drop in (False, True) for kind in KINDS for dtype in DTYPES for d, dv in dims
            for bm, bn in blocks_for(d) for sc in (False, True)]


def module(spec: KernelSpec) -> L.Module:
    """The module of `spec`, shared with the specs that compile to the same kernels
    (`KernelSpec.compiled`)."""
    return L.module(spec.compiled())


def forward(spec: KernelSpec, plan, q, k, v, *, softmax_scale: float, softcap: float,
            mods=None, dropout=None):
    """`out [Tq, Hq, Dv]` (q's dtype, pad rows 0) and `lse [Hq, Tq]` (float32, pad rows -inf);
    Dv = v.shape[2], spec.head_dim_v.

    One launch, no fill: the forward kernel writes every row of both, its query tiles' rows
    and, in the pad blocks past the tile slots, the rows of no tile. None when Tq == 0. q, k
    and v are read where they lie (`launch.data`: views whose last dim is contiguous and rows
    16-byte aligned). `mods`: the call's mask_mod and score_mod (those `spec` was made for),
    their aux arrays in the params; an out-of-range aux index is recorded for
    `varlen.check_device_errors()` (a zeroed flag and an or after the launch). `dropout`: the
    call's `varlen.dropout.Dropout` (`spec.dropout` set) or None.
    """
    import cupy
    q, k, v = L.data(q, "q"), L.data(k, "k"), L.data(v, "v")
    Tq, Hq, _ = q.shape
    Hk, Dv = k.shape[1], v.shape[2]
    L.check_heads(Hq)
    out = alloc(cupy, (Tq, Hq, Dv), q.dtype)
    lse = alloc(cupy, (Hq, Tq), np.float32)
    if Tq == 0 or Hq == 0:
        return out, lse
    mod = module(spec)
    plan_arg = L.plan_view_arg(plan)          # referenced until the launch is enqueued
    err = error_flag(mods)
    params = L.fwd_params_arg(plan_arg, L.call_params_arg(Hq, Hk, softmax_scale, softcap),
                              q=q, k=k, v=v, out=out, lse=lse, mods=mods, mod_err=err,
                              dropout=dropout)
    mod.launch("fwd", grid=_tile_grid(mod, "fwd", plan.num_q_tiles, Tq, Hq), args=(params,))
    record_errors(err)
    return out, lse


def backward(spec: KernelSpec, plan, dout, q, k, v, out, lse, *, softmax_scale: float,
             softcap: float, deterministic: bool, dkdv=None, mods=None, dropout=None):
    """`(dq, dk, dv)` in the input dtype; dQ by fp32 atomics, added in a fixed order when
    `deterministic` (bitwise repeatable).

    `dkdv`, when given, launches the dK/dV step in place of this module's kernels (the sm_90a
    kernel, `sm90.backward`): `dkdv(params, q, k, v, dout)`, `params` the `BwdParams` struct
    of the three launches, with the same contract (its key tiles' rows of dk and dv, dQ added
    to the zeroed fp32 `dq_accum`, in the order `dq_order` sets when `deterministic`, else
    null). q, k, v, dout and out are read where they lie (`launch.data`; out element by
    element, so only its last dim must be contiguous).

    `mods`: as `forward`'s (the dK/dV kernel recomputes P with them and multiplies dS by the
    score_mod's derivative). With `mods.aux_grads` it also adds dS * d(score_mod)/d(aux) into
    zeroed buffers (`mods.aux_grad_buffers`: float32 atomics, or with `deterministic` 64-bit
    fixed-point words, `varlen.backends._aux_fixed`) and returns them as a fourth result in
    float32 (`mods.aux_grads_result`, which converts the words on the device).
    `dropout`: the forward's (the dK/dV kernel draws the same keep bits again).

    Three launches, no fill. The preprocessing computes delta and the base-2 lse and writes
    what the next two kernels do not: the zeroed fp32 dQ accumulator, the pad rows of dk and dv
    (rows of no key tile) and, when `deterministic`, the order of the dQ additions (`dq_order`,
    kernels_cuda/bwd_dq_ordered.cuh: zeroed counters, the query tile of each row). Then the
    dK/dV kernel (its key tiles' rows, dQ added to the accumulator; in key-slot order per query
    chunk when `deterministic`), and the dQ conversion (every row of dq). Fewer when Tq or Tk
    is 0.
    """
    import cupy
    q, k, v, dout = L.data(q, "q"), L.data(k, "k"), L.data(v, "v"), L.data(dout, "dout")
    out, lse = L.data(out, "out", align=1), L.data(lse, "lse", align=1)
    if lse.dtype != np.float32:
        lse = lse.astype(cupy.float32)
    Tq, Hq, D = q.shape
    Tk, Hk, _ = k.shape
    L.check_heads(Hq)
    dq = alloc(cupy, q.shape, q.dtype)
    dk = alloc(cupy, k.shape, k.dtype)
    dv = alloc(cupy, v.shape, v.dtype)
    queries, keys = Tq * Hq > 0, Tk * Hk > 0
    grads = aux_grad_buffers(mods, deterministic=deterministic)

    def result():
        if grads is None:
            return dq, dk, dv
        return dq, dk, dv, aux_grads_result(mods, grads, deterministic=deterministic)
    if not (queries or keys):
        return result()
    mod = module(spec)

    # FlashAttention-2 preprocessing: delta = rowsum(dO * O), lse in base-2 units; the zeroed
    # dQ accumulator, the pad rows, the dQ order.
    delta = alloc(cupy, (Hq, Tq), np.float32)
    lse2 = alloc(cupy, (Hq, Tq), np.float32)
    dq_accum = alloc(cupy, (Tq, Hq, D), np.float32)
    dq_order = alloc(cupy, (Hq + 1, Tq), np.int32) if deterministic else None
    plan_arg = L.plan_view_arg(plan)          # referenced until the launches are enqueued
    err = error_flag(mods) if keys and plan.num_k_tiles else None
    params = L.bwd_params_arg(plan_arg, L.call_params_arg(Hq, Hk, softmax_scale, softcap),
                              q=q, k=k, v=v, out=out, dout=dout, lse=lse, lse2=lse2,
                              delta=delta, dq_accum=dq_accum, dq_order=dq_order, dq=dq, dk=dk,
                              dv=dv, mods=mods, mod_err=err, aux_grads=grads, dropout=dropout)
    slot_rows = plan.num_q_tiles * plan.block_m if deterministic else 0
    threads = mod.kernels["preprocess"].threads
    items = max(Tq * Hq * threads // PREPROCESS_WARPS, _pad_windows(Tk), slot_rows)
    mod.launch("preprocess", grid=(L.stride_blocks(items, threads),), args=(params,))
    if keys and plan.num_k_tiles:
        if dkdv is not None:
            dkdv(params, q, k, v, dout)
        else:
            role = "dkdv_ordered" if deterministic else "dkdv_atomic"
            mod.launch(role, grid=(plan.num_k_tiles, Hk), args=(params,))
        record_errors(err)
    if not queries:
        return result()
    # a block per query row (grid-stride), its threads over the row's Hq * D elements
    mod.launch("dq_convert", grid=(L.stride_blocks(Tq, 1),), args=(params,))
    return result()


def _tile_grid(mod: L.Module, role: str, num_slots: int, rows: int, heads: int) -> tuple:
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

    specs = all_specs() if specs is None else specs
    ctx = multiprocessing.get_context("spawn")      # a CUDA context must not be forked
    with ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
        return list(pool.map(_warm_one, specs))


def main(argv=None) -> int:
    """`python -m varlen.backends.cupy.mma [JOBS]`: every variant into CuPy's kernel cache for
    the current GPU (JOBS processes, default 8)."""
    import sys
    import time
    argv = sys.argv[1:] if argv is None else argv
    try:
        import cupy  # noqa: F401
    except ImportError as e:
        print(f"python -m varlen.backends.cupy.mma: CuPy is not importable ({e}); it compiles "
              f"the kernels for this machine's GPU (pip install 'varlen[cuda13]' or "
              f"'varlen[cuda12]')", file=sys.stderr)
        return 2
    t0 = time.time()
    done = warm_cache(jobs=int(argv[0]) if argv else 8)
    print(f"compiled {len(done)} kernel modules in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    import sys
    sys.exit(main())
