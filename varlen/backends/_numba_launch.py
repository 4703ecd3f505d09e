"""Launchers of the Numba kernels: where the arrays live, allocation, streams, grids.

The layout of the CuPy side: `numba_backend.py` (the `Backend`) → here (one `Context` per call,
tile sizes, grids, the plan as one `KernelView` record) → `_numba_kernels.py` (kernels).

Three kinds of working arrays are accepted, and results come back as the same kind:

* CuPy arrays (a CUDA device): kernels take them directly and launch on CuPy's current stream
  (through `cuda.external_stream`), outputs are CuPy arrays, nothing is read back to the host.
  A view (a transposed or sliced array) is read where it lies: the kernels index every array
  through its strides (Numba compiles them for the array's layout).
* Numba device arrays (a CUDA device, or the simulator's fake device): the same, on Numba's
  default stream.
* NumPy arrays (the host): copied to the device (or the simulator) once, run, copied back; a
  view is packed on the way (a transfer moves one contiguous buffer). This is how CI runs the
  kernels in the Numba CUDA simulator (`NUMBA_ENABLE_CUDASIM=1`).

Every size that shapes a launch (grids, tile-table slots, workspaces) comes from array shapes,
`B`, block sizes and the optional `max_seqlen_*` bounds, never from device values, so plan,
forward and backward run without host synchronisation and can be captured in a CUDA graph.
What such sizes would drop (a sequence past its buffer, more tiles than the bound allows) is
set in device flags by the plan kernels and handed to `varlen._device_errors`.
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
from numba import config, cuda

from .._array import alloc, bfloat16_dtype, nan_fill_enabled
from .._device_errors import record
from ..masks import MASK_FIELDS, as_mask
from ..plan import KernelView, Plan, Segments, tile_bound
from . import _aux_fixed as FX
from . import _numba_kernels as K


def simulated() -> bool:
    """True when Numba runs CUDA kernels in its CPU simulator (`NUMBA_ENABLE_CUDASIM=1`)."""
    return bool(getattr(config, "ENABLE_CUDASIM", 0))


def _is_bf16(dtype) -> bool:
    bf = bfloat16_dtype()
    return bf is not None and np.dtype(dtype) == bf


def _storage(dtype) -> np.dtype:
    """The element type kernels see: bf16 travels as its uint16 bits."""
    return np.dtype(np.uint16) if _is_bf16(dtype) else np.dtype(dtype)


def _element(dtype, value):
    """`value` as one element of an array of `dtype` as kernels see it (bf16: its bits)."""
    if _is_bf16(dtype):
        return np.array(value, np.float32).astype(bfloat16_dtype()).view(np.uint16)[()]
    return np.dtype(dtype).type(value)


def kind_of(a):
    if isinstance(a, np.ndarray):
        return "host"
    if type(a).__module__.split(".")[0] == "cupy":
        return "cupy"
    if hasattr(a, "copy_to_host"):
        return "numba"
    return None


_WHERE = {"host": "the host", "cupy": "a CUDA device (CuPy)", "numba": "a CUDA device (Numba)"}
# CuPy-side workspaces, kept alive per (device, stream, role, shape, dtype): a captured CUDA
# graph bakes in their addresses, so they must outlive the call that captured them.
_WORKSPACE: dict = {}


class Context:
    """The arrays of one call: their kind, how to allocate beside them, the launch stream."""

    def __init__(self, like):
        self.kind = kind_of(like)
        if self.kind is None:
            raise TypeError(f"expected NumPy, CuPy or Numba device arrays, got "
                            f"{type(like).__name__}")
        self.sim = simulated()
        self.stream = 0
        self.stream_ptr = 0
        if self.kind == "cupy":
            import cupy
            self.cp = cupy
            self.stream_ptr = cupy.cuda.get_current_stream().ptr
            if self.stream_ptr:
                self.stream = cuda.external_stream(self.stream_ptr)

    def dev(self, x, name="array"):
        """`x` as a kernel argument of this call (bf16 as its uint16 bits)."""
        kind = kind_of(x)
        if kind is not None and _is_bf16(x.dtype):
            x = x.view(np.uint16)
        if self.kind == "host" and kind == "host":
            # the copy to the device packs a view: a transfer moves one contiguous buffer
            return cuda.to_device(np.ascontiguousarray(x))
        if kind == self.kind or (self.kind == "host" and kind == "numba"):
            return x
        raise ValueError(f"{name} lives on {_WHERE.get(kind, type(x).__name__)} but the data "
                         f"lives on {_WHERE[self.kind]}; build the plan beside the data")

    def view(self, plan: Plan) -> KernelView:
        """The plan's kernel record with its arrays as kernel arguments of this call."""
        return plan.view().map_arrays(lambda a: self.dev(a, "plan"))

    def alloc(self, shape, dtype, fill=None):
        """A new array beside the data, every element `fill`; `fill=None` leaves it unwritten,
        NaN in test mode (`nan_fill_enabled()`) so an element no kernel writes shows."""
        if fill is None and nan_fill_enabled() and (_is_bf16(dtype) or
                                                    np.dtype(dtype).kind == "f"):
            fill = np.nan
        value = None if fill is None else _element(dtype, fill)
        if self.kind == "cupy":
            return alloc(self.cp, shape, _storage(dtype), value)
        a = cuda.device_array(shape, dtype=_storage(dtype))
        if value is not None:
            self.fill(a, value)
        return a

    def scratch(self, role, shape, dtype):
        """A workspace only this call's kernels read (on CuPy, cached per device and stream)."""
        if self.kind != "cupy":
            return self.alloc(shape, dtype)
        key = (self.cp.cuda.Device().id, self.stream_ptr, role, tuple(shape), np.dtype(dtype).str)
        buf = _WORKSPACE.get(key)
        if buf is None:
            buf = _WORKSPACE[key] = self.alloc(shape, dtype)
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
        threads = max(1, min(32, n)) if self.sim else 256
        cap = 2 if self.sim else 4096
        return max(1, min(cap, -(-n // threads))), threads

    def fill(self, a, value):
        flat = a.reshape(-1)
        if flat.shape[0]:
            self.launch(K.fill, *self.grid1d(flat.shape[0]), flat, value)

    def flag(self):
        """A device error flag: one int32, 0 until a kernel sets it."""
        return self.alloc((1,), np.int32, fill=0)

    def record(self, flag, message: str, host_error=ValueError):
        """Hand a flag to `varlen._device_errors`: on the host it raises `host_error` at once
        (the copy back reads it anyway), on a device it is kept for
        `varlen.check_device_errors()`."""
        if self.kind == "host":
            if flag.copy_to_host()[0] != 0:
                raise host_error(message)
        elif self.kind == "cupy":
            record(self.cp, flag[0] != 0, message, host_error)
        else:
            record(_NumbaFlags(self), flag, message, host_error)


class _DeviceFlag:
    """A 0-d bool accumulator in a Numba device array, as `check_device_errors()` reads it."""

    def __init__(self, ctx: Context):
        self.ctx = ctx
        self.a = ctx.flag()

    def item(self) -> bool:
        return bool(self.a.copy_to_host()[0])

    def fill(self, value):
        self.ctx.fill(self.a, np.int32(bool(value)))


class _NumbaFlags:
    """What `varlen._device_errors.record` asks of an array module, for flags in Numba device
    arrays: the device (keyed apart from CuPy's), a zero accumulator, an in-place or. Nothing
    is read on the host until `check_device_errors()`."""

    def __init__(self, ctx: Context):
        self.ctx = ctx
        dev = ("numba", getattr(cuda.get_current_device(), "id", 0))
        self.cuda = SimpleNamespace(Device=lambda: SimpleNamespace(id=dev))

    def zeros(self, shape, dtype):
        return _DeviceFlag(self.ctx)

    def logical_or(self, acc, flag, out):
        self.ctx.launch(K.or_flag, 1, 1, out.a, flag)


# --------------------------------------------------------------------------------------------
# Plans on the device
# --------------------------------------------------------------------------------------------

def check_blocks(block_m, block_n):
    for nm, blk in (("block_m", block_m), ("block_n", block_n)):
        if not isinstance(blk, (int, np.integer)) or not 0 < blk <= 1024:
            raise ValueError(f"{nm} must be an int in [1, 1024] (a thread per row), got {blk!r}")


def segments(ctx: Context, cu, off, num_rows: int, side: str) -> Segments:
    """`varlen.plan.segments_from_cu_seqlens` by a kernel: one segment per sequence; a
    sequence outside the buffer is a device error, as there."""
    B = cu.shape[0] - 1
    cud = ctx.dev(cu, f"cu_seqlens_{side}")
    offd = cud if off is None else ctx.dev(off, f"seq_offsets_{side}")
    arrs = [ctx.alloc((B, 1), np.int32) for _ in range(3)] + [ctx.alloc((B,), np.int32)]
    if B:
        outside = ctx.flag()
        ctx.launch(K.segments_from_cu, *ctx.grid1d(B), cud, offd, int(num_rows), *arrs, outside)
        ctx.record(outside, f"a sequence of cu_seqlens_{side}/seq_offsets_{side} lies outside "
                            f"the {num_rows} rows of its buffer (its rows were not computed)")
    return Segments(*arrs, int(num_rows))


def segments_on_device(ctx: Context, s: Segments) -> Segments:
    return Segments(*(ctx.dev(a, "plan segments") for a in (s.row, s.length, s.pos, s.seqlen)),
                    s.num_rows)


def _policy(ctx: Context, mask, B: int):
    """The mask policy as three int32 `[B]` arrays beside the data (scalars broadcast)."""
    out = []
    for name, f in zip(MASK_FIELDS, as_mask(mask).fields()):
        if np.ndim(f) == 0:
            out.append(ctx.alloc((B,), np.int32, fill=int(f)))
            continue
        if f.ndim != 1:
            raise ValueError(f"mask.{name} has shape {tuple(f.shape)}; expected a scalar or [B]")
        dst = ctx.alloc((B,), np.int32)
        if B:
            ctx.launch(K.to_int32, *ctx.grid1d(B), ctx.dev(f, f"mask.{name}"), dst)
        out.append(dst)
    return out


def _tiles(ctx: Context, side, own: Segments, part: Segments, seq_mask, blk, part_blk,
           max_seqlen):
    """The tile table and schedule of one side (`q`: query tiles against key segments); more
    tiles than its slots (lengths past `max_seqlen`) is a device error, as in `varlen.plan`."""
    S = own.batch * own.per_seq
    n = tile_bound(own.num_rows, S, blk, max_seqlen)
    ends = ctx.scratch(f"ends_{side}", (max(S, 1),), np.int64)
    if S:
        overflow = ctx.flag()
        ctx.launch(K.tile_scan, 1, 4 if ctx.sim else 256, own.length, blk, n, ends, overflow)
        ctx.record(overflow, f"a sequence is longer than max_seqlen_{side}: the tile table has "
                             f"{n} slots of {blk} rows (rows past them were not computed)")
    tiles = ctx.alloc((n, 5), np.int32)
    sched = ctx.alloc((n, part.per_seq, 4), np.int32)
    row_sched = ctx.alloc((n, part.per_seq, 5), np.int32)
    if n:
        threads = min(32 if ctx.sim else 128, n)
        ctx.launch(K.tiles_and_schedule, -(-n // threads), threads, ends, own.row,
                   own.length, own.pos, part.row, part.length, part.pos, seq_mask, blk,
                   part_blk, int(side == "k"), tiles, sched, row_sched)
    return tiles, sched, row_sched


def device_plan(ctx: Context, q: Segments, k: Segments, mask, *, block_m, block_n,
                max_seqlen_q, max_seqlen_k) -> Plan:
    """The plan of `build_plan`, computed by kernels; its arrays beside `ctx`'s data (device)."""
    pol = _policy(ctx, mask, q.batch)
    seq_mask = K.SeqMask(*pol, q.seqlen, k.seqlen)
    q_tiles, q_sched, q_row_sched = _tiles(ctx, "q", q, k, seq_mask, block_m, block_n,
                                           max_seqlen_q)
    k_tiles, k_sched, k_row_sched = _tiles(ctx, "k", k, q, seq_mask, block_n, block_m,
                                           max_seqlen_k)
    return Plan(q=q, k=k, window_left=pol[0], window_right=pol[1], bottom_right=pol[2],
                block_m=int(block_m), block_n=int(block_n), q_tiles=q_tiles, q_sched=q_sched,
                k_tiles=k_tiles, k_sched=k_sched, q_row_sched=q_row_sched,
                k_row_sched=k_row_sched)


# --------------------------------------------------------------------------------------------
# Attention
# --------------------------------------------------------------------------------------------

def _scalars(softmax_scale, softcap):
    return np.float32(softmax_scale), np.float32(softcap if softcap > 0 else 1.0)


def dropout_args(dropout) -> tuple:
    """The kernels' dropout record (`_numba_kernels.dropout_keys`) of a `varlen.dropout.Dropout`:
    `(threshold, seed lo, seed hi, offset)` as uint32, `scale` as float32 and the global query
    head of local head 0 (`Dropout.head_offset`, under Ulysses) as uint32: plain kernel
    arguments (a new seed or offset runs the same compiled kernel, with no host read). A call
    without dropout passes zeros, which a kernel compiled without HAS_DROPOUT never reads."""
    if dropout is None:
        return (np.uint32(0),) * 4 + (np.float32(1.0), np.uint32(0))
    return (np.uint32(dropout.threshold), np.uint32(dropout.key0), np.uint32(dropout.key1),
            np.uint32(dropout.offset), np.float32(dropout.scale), np.uint32(dropout.head_offset))


class UserArgs:
    """The kernel arguments of a call's user functions (`varlen.mods.Mods`): per function the
    tuple its generated code reads, `(aux arrays..., err)`, with a fresh error flag (a flag
    alone for a function the call lacks); `grads`, the aux gradients: flat float32, or with
    `fixed` (deterministic=True) uint64 fixed-point words `[n, WORDS]` (`_aux_fixed`)."""

    def __init__(self, ctx: Context, mods, *, aux_grads: bool = False, fixed: bool = False):
        self.ctx = ctx
        self.fixed = fixed
        self.mask_mod = None if mods is None else mods.mask
        self.score_mod = None if mods is None else mods.score
        self.mask = self._args(self.mask_mod, "mask_mod")
        self.score = self._args(self.score_mod, "score_mod")
        self.grads = self.score
        if aux_grads:
            shape, dtype = ((lambda n: (n, FX.WORDS)), np.uint64) if fixed else \
                ((lambda n: (n,)), np.float32)
            self.grads = tuple(
                ctx.alloc(shape(int(a.size) if kind == "float" else 1), dtype, fill=0)
                for (kind, _, _), a in zip(self.score_mod.graph.aux, self.score_mod.aux))

    def _args(self, mod, role):
        if mod is None:
            # the stub the kernels call instead never touches it
            return (self.ctx.scratch("no_user_fn", (1,), np.int32),)
        aux = tuple(self.ctx.dev(_readable(a), f"{role} aux argument {i}")
                    for i, a in enumerate(mod.aux))
        return aux + (self.ctx.flag(),)

    def check(self):
        """An aux index out of range (clamped on the device): an IndexError at once for host
        data, else recorded for `varlen.check_device_errors()`."""
        for mod, args in ((self.mask_mod, self.mask), (self.score_mod, self.score)):
            if mod is not None:
                self.ctx.record(args[-1], f"{mod.role} reads one of its aux arrays at an index "
                                          f"out of range (the kernels clamped it)", IndexError)

    def aux_grads(self) -> tuple:
        """Per score_mod aux: its gradient (float32, the aux's shape) or None; fixed-point
        words converted by a kernel, an entry out of their range recorded (`ctx.record`)."""
        result = []
        for (kind, _, _), a, g in zip(self.score_mod.graph.aux, self.score_mod.aux, self.grads):
            if kind != "float":
                result.append(None)
                continue
            if self.fixed:
                words, g = g, self.ctx.alloc((int(a.size),), np.float32)
                err = self.ctx.flag()
                if g.size:
                    self.ctx.launch(K.aux_fixed_kernel, *self.ctx.grid1d(g.size), words, g, err)
                self.ctx.record(err, FX.RANGE_ERROR, OverflowError)
            result.append(self.ctx.result(g, np.float32).reshape(a.shape))
        return tuple(result)


def _readable(a):
    """An aux array as kernels read it: bf16 (no Numba type) widened to float32."""
    if _is_bf16(a.dtype):
        return a.astype(np.float32)
    return a


def forward(var: K.Variant, plan: Plan, q, k, v, *, softmax_scale: float, softcap: float,
            mods=None, dropout=None):
    """`out [Tq, Hq, Dv]` in q's dtype and float32 `lse [Hq, Tq]`, beside the inputs; with
    `dropout` (a `var.has_dropout` variant) the output of the dropped probabilities."""
    ctx = Context(q)
    Tq, Hq, _ = q.shape
    # Pad rows (and rows that see no key) keep these: output 0, lse -inf.
    out = ctx.alloc((Tq, Hq, var.head_dim_v), q.dtype, fill=0)
    lse = ctx.alloc((Hq, Tq), np.float32, fill=-np.inf)
    user = UserArgs(ctx, mods)
    if plan.num_q_tiles and Hq:
        ctx.launch(K.forward_kernel(var), (plan.num_q_tiles, Hq), var.block_m, ctx.dev(q, "q"),
                   ctx.dev(k, "k"), ctx.dev(v, "v"), out, lse, ctx.view(plan),
                   *_scalars(softmax_scale, softcap), user.mask, user.score,
                   dropout_args(dropout))
    user.check()
    return ctx.result(out, q.dtype), ctx.result(lse, np.float32)


def _dq_buffers(ctx: Context, q, var: K.Variant, deterministic: bool):
    """`(dq, dq_acc)`: the dQ output and the float32 array the atomics add into."""
    if deterministic:
        # dq_kernel writes dQ itself; the dK/dV kernel gets a placeholder it never touches.
        placeholder = ctx.scratch("dq_unused", (1, 1, 1), np.float32)
        return ctx.alloc(q.shape, q.dtype, fill=0), placeholder
    if var.dtype == "float32":
        dq = ctx.alloc(q.shape, np.float32, fill=0)
        return dq, dq
    dq_acc = ctx.scratch("dq_acc", q.shape, np.float32)
    ctx.fill(dq_acc, np.float32(0))
    return ctx.alloc(q.shape, q.dtype), dq_acc


def backward(var: K.Variant, plan: Plan, dout, q, k, v, out, lse, *, softmax_scale: float,
             softcap: float, deterministic: bool, mods=None, dropout=None):
    """`(dq, dk, dv)` beside the inputs (FlashAttention-2, Alg. 2), and with
    `var.fns.aux_grads` the score_mod's aux gradients as a fourth result (`UserArgs`; in
    fixed point, bitwise repeatable, with `deterministic`). With
    `dropout`, the forward's keep set is drawn again (nothing of it was stored)."""
    ctx = Context(q)
    user = UserArgs(ctx, mods, aux_grads=var.fns.aux_grads, fixed=deterministic)
    Tq, Hq, _ = q.shape
    Hk = k.shape[1]
    if ctx.kind != "numba" and lse.dtype != np.float32:
        lse = lse.astype(np.float32)
    data = [ctx.dev(a, n) for a, n in ((q, "q"), (k, "k"), (v, "v"), (dout, "dout"),
                                       (lse, "lse"))]
    delta = ctx.scratch("delta", (Hq, Tq), np.float32)
    if Tq * Hq:
        ctx.launch(K.delta_kernel(var.dtype), *ctx.grid1d(Tq * Hq), ctx.dev(out, "out"),
                   data[3], delta)
    # Pad rows and keys no query sees keep 0.
    dk = ctx.alloc(k.shape, k.dtype, fill=0)
    dv = ctx.alloc(v.shape, v.dtype, fill=0)
    dq, dq_acc = _dq_buffers(ctx, q, var, deterministic)
    view = ctx.view(plan)
    scalars = _scalars(softmax_scale, softcap)
    drop = dropout_args(dropout)
    if plan.num_k_tiles and Hk:
        ctx.launch(K.dkdv_kernel(var, not deterministic), (plan.num_k_tiles, Hk), var.block_n,
                   *data, delta, dq_acc, dk, dv, view, *scalars, user.mask, user.score,
                   user.grads, drop)
    if deterministic and plan.num_q_tiles and Hq:
        ctx.launch(K.dq_kernel(var), (plan.num_q_tiles, Hq), var.block_m, *data, delta, dq,
                   view, *scalars, user.mask, user.score, drop)
    elif not deterministic and dq is not dq_acc and dq.size:
        ctx.launch(K.convert_kernel(var.dtype), *ctx.grid1d(dq.size), dq_acc.reshape(-1),
                   dq.reshape(-1))
    user.check()
    grads = ctx.result(dq, q.dtype), ctx.result(dk, q.dtype), ctx.result(dv, q.dtype)
    return (*grads, user.aux_grads()) if var.fns.aux_grads else grads
