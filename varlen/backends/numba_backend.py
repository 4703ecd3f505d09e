"""The Numba CUDA backend: device plans and portable SIMT attention kernels.

Launchers only; the kernels live in `_numba_kernels.py`. Three kinds of working arrays are
accepted, and results come back as the same kind:

* CuPy arrays (a CUDA device): kernels take them directly and launch on CuPy's current stream
  (through `cuda.external_stream`), outputs are CuPy arrays, nothing is read back to the host.
* Numba device arrays (a CUDA device, or the simulator's fake device): the same, on Numba's
  default stream.
* NumPy arrays (the host): copied to the device (or the simulator) once, run, copied back. This
  is how CI runs the kernels in the Numba CUDA simulator (`NUMBA_ENABLE_CUDASIM=1`).

Every size that shapes a launch (grids, tile-table slots, workspaces) comes from array shapes,
`B`, block sizes and the optional `max_seqlen_*` bounds, never from device values, so plan,
forward and backward run without host synchronisation and can be captured in a CUDA graph.
"""
from __future__ import annotations

import numpy as np

from .._array import bfloat16_dtype, empty as _empty
from ..masks import as_mask
from ..plan import Plan, Segments, tile_bound

name = "numba"
DTYPES = ("float16", "bfloat16", "float32")
MAX_HEAD_DIM = 256
# Tile sizes tried in order by `default_blocks` on a GPU: the first whose shared memory fits.
_GPU_BLOCKS = ((64, 64), (64, 32), (32, 32), (32, 16), (16, 16), (16, 8), (8, 8))
# Tiles in the simulator, which runs one OS thread per CUDA thread.
_SIM_BLOCKS = (16, 16)

__all__ = ["name", "supports", "default_blocks", "check_plan", "make_plan",
           "plan_from_cu_seqlens", "forward", "backward", "simulated"]


def _cuda():
    from numba import cuda
    return cuda


def _k():
    from . import _numba_kernels
    return _numba_kernels


def simulated() -> bool:
    """True when Numba runs CUDA kernels in its CPU simulator."""
    from numba import config
    return bool(getattr(config, "ENABLE_CUDASIM", 0))


def _dtype_name(dtype) -> str:
    bf = bfloat16_dtype()
    if bf is not None and np.dtype(dtype) == bf:
        return "bfloat16"
    return np.dtype(dtype).name


def _is_bf16(dtype) -> bool:
    return _dtype_name(dtype) == "bfloat16"


# --------------------------------------------------------------------------------------------
# Backend interface
# --------------------------------------------------------------------------------------------

def supports(*, dtype, head_dim, head_dim_v, on_device):
    try:
        cuda = _cuda()
    except ImportError:
        return "numba-cuda is not installed (pip install 'numba-cuda[cu13]')"
    if dtype not in DTYPES:
        return f"dtype {dtype} is not supported (expected one of {', '.join(DTYPES)})"
    if max(head_dim, head_dim_v) > MAX_HEAD_DIM:
        return f"head dims {head_dim}/{head_dim_v} exceed {MAX_HEAD_DIM}"
    if simulated():
        if on_device:
            return "the CUDA simulator is on (NUMBA_ENABLE_CUDASIM=1); it runs host arrays only"
        return None
    if not cuda.is_available():
        return "no CUDA device is available to Numba"
    return None


def default_blocks(dtype, head_dim):
    """The largest tiles (of a fixed ladder) whose shared memory fits, assuming Dv = D."""
    ladder = _GPU_BLOCKS
    if simulated():
        ladder = _GPU_BLOCKS[_GPU_BLOCKS.index(_SIM_BLOCKS):]
    for bm, bn in ladder:
        if _k().fits(dtype, head_dim, head_dim, bm, bn) is None:
            return bm, bn
    return ladder[-1]


def check_plan(plan: Plan):
    if plan.block_m > 1024 or plan.block_n > 1024:
        return (f"block_m={plan.block_m} and block_n={plan.block_n} must be <= 1024 (a thread "
                f"per row)")
    if _kind(plan.q_tiles) is None:
        return f"its arrays are {type(plan.q_tiles).__name__}; expected NumPy, CuPy or Numba"
    return None


# --------------------------------------------------------------------------------------------
# Where the arrays live
# --------------------------------------------------------------------------------------------

def _kind(a):
    if isinstance(a, np.ndarray):
        return "host"
    if type(a).__module__.split(".")[0] == "cupy":
        return "cupy"
    if hasattr(a, "copy_to_host"):
        return "numba"
    return None


# CuPy-side workspaces, kept alive per (stream, role, shape, dtype): a captured CUDA graph bakes
# in their addresses, so they must outlive the call that captured them.
_WORKSPACE: dict = {}


class _Ctx:
    """The arrays of one call: their kind, how to allocate beside them, the launch stream."""

    def __init__(self, like):
        self.kind = _kind(like)
        if self.kind is None:
            raise TypeError(f"expected NumPy, CuPy or Numba device arrays, got "
                            f"{type(like).__name__}")
        self.cuda = _cuda()
        self.sim = simulated()
        self.stream = 0
        self.stream_ptr = 0
        if self.kind == "cupy":
            import cupy
            self.cp = cupy
            self.stream_ptr = cupy.cuda.get_current_stream().ptr
            if self.stream_ptr:
                self.stream = self.cuda.external_stream(self.stream_ptr)

    def dev(self, x, name="array"):
        """`x` as a kernel argument of this call (bf16 as its uint16 bits)."""
        kind = _kind(x)
        if kind is not None and _is_bf16(x.dtype):
            x = x.view(np.uint16)
        if self.kind == "host":
            if kind == "host":
                return self.cuda.to_device(np.ascontiguousarray(x))
            if kind == "numba":
                return x
        elif kind == self.kind:
            return x
        where = {"host": "the host", "cupy": "a CUDA device (CuPy)",
                 "numba": "a CUDA device (Numba)"}
        raise ValueError(f"{name} lives on {where.get(kind, type(x).__name__)} but the data "
                         f"lives on {where[self.kind]}; build the plan beside the data")

    def empty(self, shape, dtype):
        dt = np.dtype(np.uint16 if _is_bf16(dtype) else dtype)
        if self.kind == "cupy":
            return _empty(self.cp, shape, dt)
        return self.cuda.device_array(shape, dtype=dt)

    def scratch(self, role, shape, dtype):
        """A workspace that only this call's kernels read (cached per stream on CuPy)."""
        if self.kind != "cupy":
            return self.cuda.device_array(shape, dtype=np.dtype(dtype))
        key = (self.cp.cuda.Device().id, self.stream_ptr, role, tuple(shape), np.dtype(dtype).str)
        buf = _WORKSPACE.get(key)
        if buf is None:
            buf = _WORKSPACE[key] = self.cp.empty(shape, dtype=dtype)
        return buf

    def result(self, a, dtype):
        """A kernel output handed back: host copy in host mode, bf16 view for bf16."""
        if self.kind == "host":
            a = a.copy_to_host()
        if _is_bf16(dtype):
            try:
                a = a.view(bfloat16_dtype())
            except Exception:  # noqa: BLE001
                pass            # a Numba device array without bf16 support stays uint16 bits
        return a

    def launch(self, kernel, grid, block, *args):
        kernel[grid, block, self.stream](*args)

    def grid1d(self, n):
        """(blocks, threads) of a grid-stride launch over `n` items."""
        threads = 32 if self.sim else 256
        cap = 2 if self.sim else 4096
        return max(1, min(cap, -(-n // threads))), threads

    def fill(self, a, value):
        flat = a.reshape(-1)
        n = flat.shape[0]
        if n:
            self.launch(_k().fill, *self.grid1d(n), flat, value)


def _zero(dtype):
    return np.uint16(0) if _is_bf16(dtype) else np.dtype(dtype).type(0)


# --------------------------------------------------------------------------------------------
# Plans on the device
# --------------------------------------------------------------------------------------------

def _policy_field(f, name):
    if isinstance(f, (bool, int, np.integer, np.bool_)):
        return None, int(f)
    if isinstance(f, np.ndarray) and f.ndim == 0:
        return None, int(f)
    if f.ndim != 1:
        raise ValueError(f"mask.{name} has shape {tuple(f.shape)}; expected a scalar or [B]")
    return f, 0


def _device_plan(ctx: _Ctx, q: Segments, k: Segments, mask, *, block_m, block_n,
                 max_seqlen_q, max_seqlen_k) -> Plan:
    """The plan of `build_plan`, computed by kernels; arrays beside `ctx` (device arrays)."""
    K = _k()
    B = q.batch
    mask = as_mask(mask)
    pol = [ctx.empty((B,), np.int32) for _ in range(3)]
    if B:
        fields = [_policy_field(f, n) for f, n in
                  zip(mask.fields(), ("window_left", "window_right", "bottom_right"))]
        srcs = [pol[i] if a is None else ctx.dev(a, f"mask field {i}")
                for i, (a, _) in enumerate(fields)]
        ctx.launch(K.policy_arrays, *ctx.grid1d(B), *srcs,
                   *[int(a is not None) for a, _ in fields], *[v for _, v in fields], *pol)
    sides = {}
    for side, own, part, blk, pblk, ms in (("q", q, k, block_m, block_n, max_seqlen_q),
                                           ("k", k, q, block_n, block_m, max_seqlen_k)):
        S = B * own.per_seq
        n = tile_bound(own.num_rows, S, blk, ms)
        ends = ctx.scratch(f"ends_{side}", (max(S, 1),), np.int64)
        if S:
            threads = 4 if ctx.sim else 256
            ctx.launch(K.tile_scan, 1, threads, own.length, blk, ends)
        tiles = ctx.empty((n, 5), np.int32)
        sched = ctx.empty((n, part.per_seq, 4), np.int32)
        if n:
            threads = min(32 if ctx.sim else 128, n)
            ctx.launch(K.tiles_and_schedule, -(-n // threads), threads, ends, own.row,
                       own.length, own.pos, own.seqlen, part.length, part.pos, part.seqlen,
                       *pol, blk, pblk, int(side == "k"), tiles, sched)
        sides[side] = (tiles, sched)
    return Plan(q=q, k=k, window_left=pol[0], window_right=pol[1], bottom_right=pol[2],
                block_m=int(block_m), block_n=int(block_n), q_tiles=sides["q"][0],
                q_sched=sides["q"][1], k_tiles=sides["k"][0], k_sched=sides["k"][1])


def _check_blocks(block_m, block_n):
    for nm, blk in (("block_m", block_m), ("block_n", block_n)):
        if not isinstance(blk, (int, np.integer)) or not 0 < blk <= 1024:
            raise ValueError(f"{nm} must be an int in [1, 1024] (a thread per row), got {blk!r}")


def _seg_dev(ctx, s: Segments) -> Segments:
    return Segments(*(ctx.dev(a, "plan segments") for a in (s.row, s.length, s.pos, s.seqlen)),
                    s.num_rows)


def _plan_to_host(p: Plan, q=None, k=None) -> Plan:
    h = p.to_host()
    return Plan(q=q or h.q, k=k or h.k, window_left=h.window_left, window_right=h.window_right,
                bottom_right=h.bottom_right, block_m=h.block_m, block_n=h.block_n,
                q_tiles=h.q_tiles, q_sched=h.q_sched, k_tiles=h.k_tiles, k_sched=h.k_sched)


def make_plan(q: Segments, k: Segments, mask, *, block_m: int = 64, block_n: int = 64,
              max_seqlen_q=None, max_seqlen_k=None) -> Plan:
    """`varlen.plan.build_plan` on the device: the same arrays, built by Numba kernels.

    Segment and mask arrays may be CuPy or Numba device arrays (the plan stays there, no host
    synchronisation) or NumPy (built in the device or simulator, returned as NumPy).
    """
    _check_blocks(block_m, block_n)
    if q.batch != k.batch:
        raise ValueError(f"query segments cover {q.batch} sequences but key segments "
                         f"{k.batch}; expected the same batch")
    ctx = _Ctx(q.row)
    kw = dict(block_m=int(block_m), block_n=int(block_n), max_seqlen_q=max_seqlen_q,
              max_seqlen_k=max_seqlen_k)
    if ctx.kind == "host":
        return _plan_to_host(_device_plan(ctx, _seg_dev(ctx, q), _seg_dev(ctx, k), mask, **kw),
                             q, k)
    return _device_plan(ctx, q, k, mask, **kw)


def plan_from_cu_seqlens(cu_seqlens_q, cu_seqlens_k, *, num_rows_q: int, num_rows_k: int,
                         seq_offsets_q=None, seq_offsets_k=None, mask="full",
                         max_seqlen_q=None, max_seqlen_k=None, block_m=None,
                         block_n=None, dtype="float16", head_dim=64) -> Plan:
    """A plan straight from device `cu_seqlens` (CuPy or Numba arrays; NumPy for the simulator).

    Everything runs in kernels: segments, mask policy, tile tables, schedules. `num_rows_*`
    (the packed arrays' row counts) size it; values are never read on the host. Block sizes
    default to `default_blocks(dtype, head_dim)`. int32 `cu_seqlens` and offsets expected.
    """
    if block_m is None or block_n is None:
        bm, bn = default_blocks(dtype, head_dim)
        block_m = bm if block_m is None else block_m
        block_n = bn if block_n is None else block_n
    _check_blocks(block_m, block_n)
    ctx = _Ctx(cu_seqlens_q)
    segs = []
    for side, cu, off, T in (("q", cu_seqlens_q, seq_offsets_q, num_rows_q),
                             ("k", cu_seqlens_k, seq_offsets_k, num_rows_k)):
        B = cu.shape[0] - 1
        cud = ctx.dev(cu, f"cu_seqlens_{side}")
        offd = cud if off is None else ctx.dev(off, f"seq_offsets_{side}")
        arrs = [ctx.empty((B, 1), np.int32) for _ in range(3)] + [ctx.empty((B,), np.int32)]
        if B:
            ctx.launch(_k().segments_from_cu, *ctx.grid1d(B), cud, offd, int(T), *arrs)
        segs.append(Segments(*arrs, int(T)))
    if segs[0].batch != segs[1].batch:
        raise ValueError(f"cu_seqlens_q has {segs[0].batch + 1} entries and cu_seqlens_k "
                         f"{segs[1].batch + 1}; both must be [B+1] for the same B")
    p = _device_plan(ctx, segs[0], segs[1], mask, block_m=int(block_m), block_n=int(block_n),
                     max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
    return p.to_host() if ctx.kind == "host" else p


# --------------------------------------------------------------------------------------------
# Attention
# --------------------------------------------------------------------------------------------

class _PlanArgs:
    """The plan's arrays as kernel arguments of one call."""

    def __init__(self, ctx: _Ctx, plan: Plan):
        d = lambda a: ctx.dev(a, "plan")  # noqa: E731
        self.q_tiles, self.q_sched = d(plan.q_tiles), d(plan.q_sched)
        self.k_tiles, self.k_sched = d(plan.k_tiles), d(plan.k_sched)
        self.q_row, self.q_pos, self.q_len = d(plan.q.row), d(plan.q.pos), d(plan.q.length)
        self.k_row, self.k_pos, self.k_len = d(plan.k.row), d(plan.k.pos), d(plan.k.length)
        self.q_seqlen, self.k_seqlen = d(plan.q.seqlen), d(plan.k.seqlen)
        self.policy = (d(plan.window_left), d(plan.window_right), d(plan.bottom_right))


def _variant(plan: Plan, dtype, D, Dv, softcap):
    K = _k()
    try:
        return K.Variant(_dtype_name(dtype), int(D), int(Dv), plan.block_m, plan.block_n,
                         softcap > 0)
    except ValueError as e:
        raise ValueError(f"plan tiles do not fit the numba kernels: {e}") from None


def _scalars(softmax_scale, softcap):
    return np.float32(softmax_scale), np.float32(softcap if softcap > 0 else 1.0)


def forward(plan: Plan, q, k, v, *, softmax_scale: float, softcap: float):
    """`out [Tq, Hq, Dv]` in q's dtype and float32 `lse [Hq, Tq]`, beside the inputs."""
    K = _k()
    ctx = _Ctx(q)
    Tq, Hq, D = q.shape
    Dv = v.shape[2]
    var = _variant(plan, q.dtype, D, Dv, softcap)
    qd, kd, vd = ctx.dev(q, "q"), ctx.dev(k, "k"), ctx.dev(v, "v")
    p = _PlanArgs(ctx, plan)
    out = ctx.empty((Tq, Hq, Dv), q.dtype)
    lse = ctx.empty((Hq, Tq), np.float32)
    # Pad rows (and rows of tiles with no visible key) keep these: output 0, lse -inf.
    ctx.fill(out, _zero(q.dtype))
    ctx.fill(lse, np.float32(-np.inf))
    if plan.num_q_tiles and Hq:
        ctx.launch(K.forward_kernel(var), (plan.num_q_tiles, Hq), var.block_m, qd, kd, vd,
                   out, lse, p.q_tiles, p.q_sched, p.k_row, p.k_pos, p.k_len, p.q_seqlen,
                   p.k_seqlen, *p.policy, *_scalars(softmax_scale, softcap))
    return ctx.result(out, q.dtype), ctx.result(lse, np.float32)


def backward(plan: Plan, dout, q, k, v, out, lse, *, softmax_scale: float, softcap: float,
             deterministic: bool = False):
    """`(dq, dk, dv)` beside the inputs (FlashAttention-2, Alg. 2).

    dK/dV: one pass over key tiles (`k_sched`), GQA groups reduced in registers. dQ: float32
    atomics from that same pass, or with `deterministic=True` a separate pass over query tiles
    (`q_sched`) whose per-row accumulation order is fixed, so results are bitwise repeatable.
    """
    K = _k()
    ctx = _Ctx(q)
    Tq, Hq, D = q.shape
    Tk, Hk, Dv = v.shape
    dtype = _dtype_name(q.dtype)
    var = _variant(plan, q.dtype, D, Dv, softcap)
    qd, kd, vd = ctx.dev(q, "q"), ctx.dev(k, "k"), ctx.dev(v, "v")
    dod, outd = ctx.dev(dout, "dout"), ctx.dev(out, "out")
    if ctx.kind == "host" and lse.dtype != np.float32:
        lse = lse.astype(np.float32)
    elif ctx.kind == "cupy" and lse.dtype != np.float32:
        lse = lse.astype(np.float32)
    lsed = ctx.dev(lse, "lse")
    p = _PlanArgs(ctx, plan)
    scalars = _scalars(softmax_scale, softcap)
    delta = ctx.scratch("delta", (Hq, Tq), np.float32)
    if Tq * Hq:
        ctx.launch(K.delta_kernel(dtype), *ctx.grid1d(Tq * Hq), outd, dod, delta)
    dk = ctx.empty((Tk, Hk, D), q.dtype)
    dv = ctx.empty((Tk, Hk, Dv), q.dtype)
    ctx.fill(dk, _zero(q.dtype))
    ctx.fill(dv, _zero(q.dtype))
    if deterministic:
        dq = ctx.empty((Tq, Hq, D), q.dtype)
        ctx.fill(dq, _zero(q.dtype))
        dq_acc = ctx.scratch("dq_unused", (1, 1, 1), np.float32)
    elif dtype == "float32":
        dq = dq_acc = ctx.empty((Tq, Hq, D), np.float32)
        ctx.fill(dq_acc, np.float32(0))
    else:
        dq = ctx.empty((Tq, Hq, D), q.dtype)
        dq_acc = ctx.scratch("dq_acc", (Tq, Hq, D), np.float32)
        ctx.fill(dq_acc, np.float32(0))
    if plan.num_k_tiles and Hk:
        ctx.launch(K.dkdv_kernel(var, not deterministic), (plan.num_k_tiles, Hk), var.block_n,
                   qd, kd, vd, dod, lsed, delta, dq_acc, dk, dv, p.k_tiles, p.k_sched, p.q_row,
                   p.q_pos, p.q_len, p.q_seqlen, p.k_seqlen, *p.policy, *scalars)
    if deterministic:
        if plan.num_q_tiles and Hq:
            ctx.launch(K.dq_kernel(var), (plan.num_q_tiles, Hq), var.block_m, qd, kd, vd, dod,
                       lsed, delta, dq, p.q_tiles, p.q_sched, p.k_row, p.k_pos, p.k_len,
                       p.q_seqlen, p.k_seqlen, *p.policy, *scalars)
    elif dq is not dq_acc:
        n = Tq * Hq * D
        if n:
            ctx.launch(K.convert_kernel(dtype), *ctx.grid1d(n), dq_acc.reshape(-1),
                       dq.reshape(-1))
    return (ctx.result(dq, q.dtype), ctx.result(dk, q.dtype), ctx.result(dv, q.dtype))
