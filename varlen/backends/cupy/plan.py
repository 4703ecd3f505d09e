"""The plan builder of the CuPy backend (`kernels_cuda/plan_build.cuh`): a plan of CuPy arrays
in two launches, the same int32 arrays as `varlen.plan`'s array code, bit for bit (the array
code on CuPy arrays, about 260 array operations, stays available as `varlen.plan.build_plan`
for comparison).

1. `varlen_plan_scan`, one block: the segments of each side (from `cu_seqlens`/offsets, or
   given), the three mask policy arrays, and per side the prefix sum of tiles per segment.
2. `varlen_plan_tiles`, a grid over every tile slot of both sides: tile tables, schedules and
   row schedules.

Every size comes from the host: `B`, the rows of the packed arrays, the block sizes and the
`varlen.plan.tile_bound` slots (with `max_seqlen_*` when given); nothing is read back, so a plan
can be built inside a captured CUDA graph. What those sizes drop (a sequence past its buffer,
more tiles than slots) the scan kernel sets in `varlen._device_errors`'s flags for the message
`varlen.plan` records, directly, so `varlen.check_device_errors()` reports the same errors.
Host (NumPy) arrays, as the host emulation passes them, get fresh flags that are raised at
once, as `varlen.plan` raises them on the host.

Everything the kernels read and write travels as one `PlanBuildParams` struct by value, filled
in `_params` (its NumPy twin `PLAN_BUILD_DTYPE` has the C layout;
tests/emulation/test_plan_device.py compares them).
"""
from __future__ import annotations

import threading

import numpy as np

from ..._array import alloc
from ..._device_errors import accumulator, record
from ...masks import Mask
from . import launch as L
from ...plan import (ROW_SCHED_FIELDS, SCHED_FIELDS, TILE_FIELDS, Plan, Segments,
                    outside_message, overflow_message, tile_bound)

KERNELS = ("varlen_plan_scan", "varlen_plan_tiles")
SOURCE = '#include "plan_build.cuh"\n'
SCAN_THREADS = 256                 # the one block of varlen_plan_scan
SCAN_SMEM_PER_THREAD = 2 * 8 + 4   # two int64 chunk sums and the error bits
TILE_THREADS = 128
MAX_TILE_BLOCKS = 4096             # varlen_plan_tiles is grid-stride beyond this

_U64, _I32 = np.uint64, np.int32
PLAN_SIDE_DTYPE = np.dtype(
    [(name, _U64) for name in ("cu", "off", "row", "len", "pos", "seqlen", "ends", "tiles",
                               "sched", "row_sched", "outside", "overflow")]
    + [(name, _I32) for name in ("num_rows", "m", "block", "num_slots")], align=True)
PLAN_BUILD_DTYPE = np.dtype([("q", PLAN_SIDE_DTYPE), ("k", PLAN_SIDE_DTYPE),
                             ("mask_in", _U64, (3,)), ("mask_value", _I32, (3,)),
                             ("mask_out", _U64, (3,)), ("batch", _I32)], align=True)

_lock = threading.Lock()
# "module": the RawModule of SOURCE; (kernel name, device id): its kernel on that device.
_modules: dict = {}


def _function(name: str):
    """Kernel `name` of the plan module on the current device (compiled on first use)."""
    import cupy

    from .compile import compile_options
    key = (name, cupy.cuda.Device().id)
    fn = _modules.get(key)
    if fn is None:
        with _lock:
            if "module" not in _modules:
                _modules["module"] = cupy.RawModule(code=SOURCE, options=compile_options(),
                                                    name_expressions=list(KERNELS))
            fn = _modules[key] = _modules["module"].get_function(name)
    return fn


def _on_host(a) -> bool:
    return isinstance(a, np.ndarray)


class _Side:
    """The arrays of one side of the plan being built."""

    def __init__(self, batch, m, num_rows, block, slots, partner_m, *, cu=None, off=None,
                 segments=None):
        import cupy
        self.num_rows, self.m, self.block, self.slots = num_rows, m, block, slots
        self.cu = None if cu is None else L.index_array(cu)
        self.off = self.cu if off is None or cu is None else L.index_array(off)
        if segments is None:
            self.seg_arrays = [alloc(cupy, (batch, 1), np.int32) for _ in range(3)]
            self.seg_arrays.append(alloc(cupy, (batch,), np.int32))
        else:
            self.seg_arrays = [L.index_array(a) for a in (segments.row, segments.length,
                                                   segments.pos, segments.seqlen)]
        self.ends = alloc(cupy, (max(batch * m, 1),), np.int64)
        self.tiles = alloc(cupy, (slots, len(TILE_FIELDS)), np.int32)
        self.sched = alloc(cupy, (slots, partner_m, len(SCHED_FIELDS)), np.int32)
        self.row_sched = alloc(cupy, (slots, partner_m, len(ROW_SCHED_FIELDS)), np.int32)

    def segments(self) -> Segments:
        return Segments(*self.seg_arrays, num_rows=int(self.num_rows))

    def write_struct(self, rec, outside, overflow):
        """This side's `PlanSide` fields into `rec` (flag addresses given)."""
        for field, a in zip(("cu", "off", "row", "len", "pos", "seqlen", "ends", "tiles",
                             "sched", "row_sched"), (self.cu, self.off, *self.seg_arrays,
                                                     self.ends, self.tiles, self.sched,
                                                     self.row_sched)):
            rec[field] = L.address(a)
        rec["outside"], rec["overflow"] = outside, overflow
        rec["num_rows"], rec["m"], rec["block"], rec["num_slots"] = (
            self.num_rows, self.m, self.block, self.slots)


def _flags(host: bool, messages):
    """Addresses of one bool flag per message, and the host flags to raise after the launches
    (device: the `varlen._device_errors` accumulators themselves, nothing to raise here)."""
    if host:
        flags = np.zeros(len(messages), dtype=bool)
        return [L.address(flags) + i for i in range(len(messages))], flags
    import cupy
    return [L.address(accumulator(cupy, msg)) for msg in messages], None


def _build(q: _Side, k: _Side, mask: Mask, batch: int, *, host: bool, block_m, block_n):
    """Launch both kernels over sides `q` and `k`; the plan of their arrays."""
    import cupy
    messages = [outside_message("q", q.num_rows), outside_message("k", k.num_rows),
                overflow_message("q", q.slots, block_m), overflow_message("k", k.slots, block_n)]
    addresses, host_flags = _flags(host, messages)
    params = alloc(np, (), PLAN_BUILD_DTYPE, fill=0)
    built_from_cu = q.cu is not None
    q.write_struct(params["q"], addresses[0] if built_from_cu else 0, addresses[2])
    k.write_struct(params["k"], addresses[1] if built_from_cu else 0, addresses[3])
    policy, keep = [], []
    for f, value in enumerate(mask.fields()):
        if np.ndim(value) == 0:
            params["mask_value"][f] = int(value)
        else:
            if tuple(value.shape) != (batch,):
                raise ValueError(f"mask field {f} has shape {tuple(value.shape)}; expected a "
                                 f"scalar or [{batch}]")
            keep.append(L.index_array(value))
            params["mask_in"][f] = L.address(keep[-1])
        policy.append(alloc(cupy, (batch,), np.int32))
        params["mask_out"][f] = L.address(policy[-1])
    params["batch"] = batch
    if batch:
        _function(KERNELS[0])((1,), (SCAN_THREADS,), (params,),
                              shared_mem=SCAN_THREADS * SCAN_SMEM_PER_THREAD)
    slots = q.slots + k.slots
    if slots:
        blocks = min(-(-slots // TILE_THREADS), MAX_TILE_BLOCKS)
        _function(KERNELS[1])((blocks,), (TILE_THREADS,), (params,))
    if host_flags is not None:
        # The order varlen.plan raises them in: segments q, k, then tile tables q, k.
        for flag, msg in zip(host_flags, messages):
            record(np, flag, msg)
    return Plan(q=q.segments(), k=k.segments(), window_left=policy[0], window_right=policy[1],
                bottom_right=policy[2], block_m=block_m, block_n=block_n, q_tiles=q.tiles,
                q_sched=q.sched, k_tiles=k.tiles, k_sched=k.sched, q_row_sched=q.row_sched,
                k_row_sched=k.row_sched)


def plan_from_cu_seqlens(cu_q, cu_k, off_q, off_k, num_rows_q: int, num_rows_k: int,
                         mask: Mask, *, block_m: int, block_n: int, max_seqlen_q=None,
                         max_seqlen_k=None) -> Plan:
    """`varlen.plan.plan_from_cu_seqlens` in two launches: int32 `[B+1]` layout arrays (one
    segment per sequence), `mask` fields scalars or `[B]` arrays beside them."""
    batch = int(cu_q.shape[0]) - 1
    if int(cu_k.shape[0]) - 1 != batch:
        raise ValueError(f"cu_seqlens_q has {cu_q.shape[0]} entries and cu_seqlens_k "
                         f"{cu_k.shape[0]}; both must be [B+1] for the same B")
    nq = tile_bound(num_rows_q, batch, block_m, max_seqlen_q)
    nk = tile_bound(num_rows_k, batch, block_n, max_seqlen_k)
    q = _Side(batch, 1, num_rows_q, block_m, nq, 1, cu=cu_q, off=off_q)
    k = _Side(batch, 1, num_rows_k, block_n, nk, 1, cu=cu_k, off=off_k)
    return _build(q, k, mask, batch, host=_on_host(cu_q), block_m=block_m, block_n=block_n)


def build_plan(q: Segments, k: Segments, mask: Mask, *, block_m: int, block_n: int,
               max_seqlen_q=None, max_seqlen_k=None) -> Plan:
    """`varlen.plan.build_plan` of given segments (any segments per sequence, as context
    parallelism makes them) in two launches; the plan keeps `q` and `k` themselves."""
    batch = q.batch
    nq = tile_bound(q.num_rows, batch * q.per_seq, block_m, max_seqlen_q)
    nk = tile_bound(k.num_rows, batch * k.per_seq, block_n, max_seqlen_k)
    qs = _Side(batch, q.per_seq, q.num_rows, block_m, nq, k.per_seq, segments=q)
    ks = _Side(batch, k.per_seq, k.num_rows, block_n, nk, q.per_seq, segments=k)
    plan = _build(qs, ks, mask, batch, host=_on_host(q.row), block_m=block_m, block_n=block_n)
    return Plan(q=q, k=k, window_left=plan.window_left, window_right=plan.window_right,
                bottom_right=plan.bottom_right, block_m=block_m, block_n=block_n,
                q_tiles=plan.q_tiles, q_sched=plan.q_sched, k_tiles=plan.k_tiles,
                k_sched=plan.k_sched, q_row_sched=plan.q_row_sched,
                k_row_sched=plan.k_row_sched)
