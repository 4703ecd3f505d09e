"""The CPU backend: fused float32 attention tiles on Numba's CPU target, BLAS and threads.

`CpuBackend` answers the `Backend` questions; the launchers below turn a call into the
kernels' working arrays and work lists and run `_cpu_kernels.py` (the method, tile sizes and
threading are described in docs/cpu_backend.md):

1. pack: inputs, read where they lie (a view through its strides), to the working dtype
   (float32 for float16/bfloat16/float32, float64 for float64) in head-group-major layouts,
   non-finite values replaced by 0 and flagged per row;
2. work list: forward items are (chunk of query tiles, key head), backward items (range of
   one sequence's key tiles, key head), sorted longest first by the work the schedule says
   they hold;
3. run on `_cpu_threads.num_threads()` workers, BLAS held single-threaded;
4. unpack into buffers from `varlen._array.alloc`: rows a non-finite value reached are NaN,
   pad rows 0 (lse -inf).

Numba compiles the kernels on the first call of a process that finds no on-disk cache
(`cache=True`, next to the module or under `NUMBA_CACHE_DIR`); later processes load them. A
call that is about to compile says so once (`JitCompileWarning`). Numba is imported on first
use, so this module loads without it.
"""
from __future__ import annotations

import importlib.util
import logging
import os
import threading
import warnings

import numpy as np

from .._array import alloc, host_blocks
from ..masks import key_band
from ..plan import Plan, TILE_ROWS, TILE_SEG, TILE_SEQ
from ._host import DTYPES, HostBackend, forward_buffers

__all__ = ["CpuBackend", "BACKEND", "DTYPES", "release_workspace", "JitCompileWarning"]

LOG2E = 1.4426950408889634          # 1/ln(2)
# Tile products of at least this many multiply-adds (M * N * K) go to BLAS; smaller ones (a
# ragged edge, a length-1 sequence) to the kernels' loops, where a call would cost more.
BLAS_MIN = 16 * 16 * 16
_NO_BLAS = 1 << 62
_chains: dict = {}                   # blas_chains' answer per working dtype
# Rows of a tile product: the forward takes as many consecutive visited key tiles at once as
# fill PRODUCT_KEYS keys, the backward as many query tiles as fill PRODUCT_ROWS queries (per
# head). Plans keep their tiles (what is skipped or masked), the products get larger.
PRODUCT_KEYS = 256
PRODUCT_ROWS = 128
# Stacked query rows (rows x heads of a GQA group) of a forward product.
FORWARD_ROWS = 256
# Backward: a sequence holding more than 1 / BACKWARD_SPLIT of a call's work is cut into up
# to MAX_PARTS ranges of key tiles (items of their own; `backward_items`). Each part but one
# takes a dQ partial of the rows it reaches: at most MAX_PARTS - 1 times the sequence's dQ.
BACKWARD_SPLIT = 8
MAX_PARTS = 4
# A call runs on the numpy backend (float64) when a bound on its products, taken from the
# largest input values, reaches this in its working dtype (a factor 16 below the largest
# finite value: room for the bound's own rounding). docs/semantics.md, "Overflow".
RANGE = {np.dtype(np.float32): 2.0 ** 124, np.dtype(np.float64): 2.0 ** 1020}


def _kernels():
    from . import _cpu_kernels
    return _cpu_kernels


def _threads():
    from . import _cpu_threads
    return _cpu_threads


class JitCompileWarning(UserWarning):
    """The cpu backend is compiling kernels that the on-disk cache does not hold (the first
    call on a machine, or after an upgrade): the call takes about 30 s (README.md)."""


# Compiled kernel sets (pass, working dtype) this process has run.
_compiled = set()
_log = logging.getLogger("varlen")


def _compile_marker(kind: str, wdt) -> str | None:
    """A file beside Numba's cache of the kernels saying that the cache holds `kind`
    ("forward", "backward") for `wdt`, named after what invalidates that cache: the kernels'
    source (its modification time and size, as Numba stamps it), Numba's version and the
    CPU. None where Numba keeps no cache."""
    K = _kernels()
    path = K.forward.stats.cache_path
    if not path:
        return None
    import llvmlite.binding as llvm
    import numba
    st = os.stat(K.__file__)
    stamp = f"{int(st.st_mtime)}-{st.st_size}-{numba.__version__}-{llvm.get_host_cpu_name()}"
    return os.path.join(path, f"varlen-cpu-{kind}-{np.dtype(wdt).name}-{stamp}.compiled")


def _announce_compile(kind: str, wdt):
    """Before the first `kind` call of this process in `wdt`: warn (once) when the on-disk
    cache has not been filled for it yet, since the call then compiles for about 30 s."""
    if (kind, np.dtype(wdt)) in _compiled:
        return
    marker = _compile_marker(kind, wdt)
    if marker is None or not os.path.exists(marker):
        msg = (f"varlen: compiling the cpu backend's {np.dtype(wdt).name} {kind} kernels "
               f"(once per machine, about 30 s; later processes load them from "
               f"{os.path.dirname(marker) if marker else 'nowhere: Numba keeps no cache'})")
        _log.info(msg)
        warnings.warn(msg, JitCompileWarning, stacklevel=4)


def _done_compile(kind: str, wdt):
    """After a `kind` call ran its kernels: the cache holds them now."""
    key = (kind, np.dtype(wdt))
    if key in _compiled:
        return
    _compiled.add(key)
    marker = _compile_marker(kind, wdt)
    if marker is not None and not os.path.exists(marker):
        try:
            with open(marker, "w"):
                pass
        except OSError:
            pass


def _working_dtype(dtype) -> np.dtype:
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


def _as(x, wdt):
    """`x` as the packing kernels read it: itself, a view read where it lies (Numba compiles
    the kernels for its strides), when its dtype is `wdt`; else converted to `wdt` (float16 and
    bfloat16 have no Numba type), row-major."""
    return x if x.dtype == wdt else np.asarray(x).astype(wdt, order="C")


def _view(plan: Plan):
    """The plan's KernelView with every array C-contiguous int32 (one compiled signature)."""
    return _kept(plan, "view", lambda: plan.view().map_arrays(
        lambda a: np.ascontiguousarray(a, dtype=np.int32)))


def _kept(plan: Plan, key, make):
    """`make()`, kept on `plan` under `key` for the next call with it: the work lists and row
    tables below depend only on the plan and the head counts, and a model reuses its plan in
    every layer (as `Plan.tile_classes` keeps its classes). Never written by the kernels."""
    kept = plan.__dict__.setdefault("_cpu_backend", {})
    if key not in kept:
        kept[key] = make()
    return kept[key]


class _Workspace(threading.local):
    """The working arrays a call writes in full before it reads them (packed inputs and their
    flags, the gradient accumulators, zeroed first), kept per calling thread for the next
    call: a fresh buffer of tens of MiB costs a page fault per 4 KiB page on its first write,
    every call, and the faults do not scale with threads. One buffer per name, replaced when a
    call needs another shape or dtype. Never an array a call returns: outputs, lse and
    gradients are new arrays that belong to the caller (their memory may be a block of an
    earlier, dead output: `varlen._array.HostBlocks`)."""

    def __init__(self):
        self.buffers = {}

    def get(self, name: str, shape, dtype):
        shape, dtype = tuple(int(n) for n in shape), np.dtype(dtype)
        buf = self.buffers.get(name)
        if buf is None or buf.shape != shape or buf.dtype != dtype:
            self.buffers.pop(name, None)          # free the old one before the new is made
            buf = self.buffers[name] = alloc(np, shape, dtype)
        return buf

    def clear(self):
        self.buffers.clear()


_workspace = _Workspace()


def release_workspace():
    """Free the calling thread's kept working arrays and the free blocks of dead outputs
    (the next call allocates them again)."""
    _workspace.clear()
    host_blocks.clear()


def _pack(x, G: int, wdt, *, name: str):
    """`x [T, Hk * G, d]` -> (`[Hk, T * G, d]` in `wdt`, bool `[Hk, T * G]` non-finite rows,
    the largest finite `|x|`), workspace arrays of `name` (every element is written)."""
    T, H, d = x.shape
    Hk = H // G
    w = _workspace.get(name, (Hk, T * G, d), wdt)
    flag = _workspace.get(name + "_flag", (Hk, T * G), np.bool_)
    top = _workspace.get(name + "_top", (Hk, T * G), _BITS[wdt])
    _kernels().pack_rows(_as(x, wdt), G, w, flag, top)
    return w, flag, _largest(top, wdt)


def _unpack(acc, nan, shape, dtype):
    """Accumulators `[Hk, T * G, d]` -> a fresh `[T, H, d]` array (`shape`) of `dtype`, NaN on
    flagged rows."""
    out = alloc(np, shape, dtype, cached=True)
    wdt = acc.dtype
    target = out if out.dtype == wdt else alloc(np, shape, wdt, cached=True)
    _kernels().unpack_rows(acc, nan, target)
    if target is not out:
        out[...] = target
    return out


def _scalars(softmax_scale: float, softcap: float):
    """`(c, cap)` of the kernels (float64): scores in the log2 domain are `cap * tanh(s * c)`
    under softcap (`c = scale / softcap`, `cap = softcap * log2(e)`), else `s * c` (`c = scale *
    log2(e)`), from the products `s = q . k` of the unscaled inputs (Q packed times the scale
    would round each element by a factor that is not a power of two: docs/cpu_backend.md,
    "Accuracy")."""
    if softcap > 0:
        return float(softmax_scale / softcap), float(softcap * LOG2E)
    return float(softmax_scale * LOG2E), 0.0


def one_key_rows(plan: Plan) -> np.ndarray:
    """Bool `[Tq]`: the query rows that see exactly one key of their whole sequence (global
    positions and lengths, so under context parallelism too), whose softmax is of one score."""
    q, view = plan.q, plan.view()
    length = np.asarray(q.length, np.int64).reshape(-1)
    seg = np.repeat(np.arange(length.size), length)
    off = np.arange(seg.size) - np.repeat(np.cumsum(length) - length, length)
    rows = np.asarray(q.row, np.int64).reshape(-1)[seg] + off
    pos = np.asarray(q.pos, np.int64).reshape(-1)[seg] + off
    b = seg // q.per_seq
    lq, lk = (np.asarray(x, np.int64)[b] for x in (view.seqlen_q, view.seqlen_k))
    left, right, br = (np.asarray(x, np.int64)[b] for x in (view.window_left,
                                                           view.window_right,
                                                           view.bottom_right))
    lo, hi = key_band(np, pos, (lk - lq) * br, left, right)
    one = np.zeros(q.num_rows, bool)
    one[rows[np.minimum(hi, lk - 1) == np.maximum(lo, 0)]] = True
    return one


# The integer type of a working dtype's bit patterns (the packing kernels' row maxima).
_BITS = {np.dtype(np.float32): np.dtype(np.int32), np.dtype(np.float64): np.dtype(np.int64)}


def _largest(top, wdt) -> float:
    """The largest of the packing kernels' row maxima `top` (bit patterns of values >= 0,
    which order as the values do)."""
    return float(top.view(wdt).max(initial=0.0))


def in_range(wdt, *bounds) -> bool:
    """Every bound below `RANGE[wdt]` (a NaN bound is not)."""
    return all(float(b) < RANGE[np.dtype(wdt)] for b in bounds)


def _score_bound(D, aq, ak, c):
    """Largest |partial sum| of a product `q . k` and of the score it makes (`s * c`)."""
    s = float(D) * aq * ak
    return s * max(1.0, abs(c))


def _numpy():
    from .numpy_backend import BACKEND as numpy
    return numpy


def _longest_first(items, cost):
    return np.ascontiguousarray(items[np.argsort(-cost, kind="stable")], dtype=np.int64)


def forward_items(plan: Plan, Hk: int, G: int):
    """Forward work: `(items, chunks)`. `chunks [n, 2]` (first slot, count) groups consecutive
    query tiles of one segment so that a chunk holds about FORWARD_ROWS stacked rows (a small
    GQA group or MHA gets two or more tiles per product); items are `chunk * Hk + key head`,
    longest first (cost: key rows the schedule visits times the tile's rows)."""
    tiles = plan.q_tiles
    used = np.flatnonzero(tiles[:, TILE_SEQ] >= 0)
    per = max(1, FORWARD_ROWS // (plan.block_m * G))
    segment = tiles[used, TILE_SEQ].astype(np.int64) * plan.q.per_seq + tiles[used, TILE_SEG]
    starts = np.ones(used.size, bool)
    starts[1:] = segment[1:] != segment[:-1]
    group_start = np.maximum.accumulate(np.where(starts, np.arange(used.size), 0))
    starts |= (np.arange(used.size) - group_start) % per == 0
    first = np.flatnonzero(starts)
    count = np.diff(np.append(first, used.size))
    chunks = np.ascontiguousarray(np.stack([used[first], count], axis=1), dtype=np.int64)
    sched = plan.q_sched[used].astype(np.int64)
    keys = (sched[..., 3] - sched[..., 0]).sum(axis=1) * plan.block_n
    cost = np.add.reduceat((keys + 1) * tiles[used, TILE_ROWS], first) if used.size else keys
    items = (np.arange(first.size)[:, None] * Hk + np.arange(Hk)).reshape(-1)
    return _longest_first(items, np.repeat(cost, Hk)), chunks


def backward_items(plan: Plan, Hk: int, G: int):
    """Backward work: `(items, parts)`, items `part * Hk + key head` longest first.

    A part is a range of one sequence's key tile slots. `parts [P, 7]` holds (sequence, first
    slot, end slot, partial, row shift, first row, end row): a sequence is cut into parts of
    about equal work when it alone holds more than 1 / BACKWARD_SPLIT of the call's work, so
    one long document (or few key heads) still gives enough items for the threads. Its parts
    own disjoint dK/dV rows; their dQ rows overlap, so one part (the one touching the most
    query rows) adds into dQ and each other part into its own zeroed partial block, rows
    `[first row, end row)` of the stacked `[Tq * G]` layout at `row + shift` of the partials
    array, added to dQ afterwards in part order (`reduce_partials`). The cut depends only on
    the plan and the head counts, so results stay bitwise identical for any thread count."""
    tiles = plan.k_tiles
    BM = plan.block_m
    used = np.flatnonzero(tiles[:, TILE_SEQ] >= 0)       # a prefix, in sequence order
    seq = tiles[used, TILE_SEQ].astype(np.int64)
    sched = plan.k_sched[used].astype(np.int64)
    begin, end = sched[..., 0], sched[..., 3]
    work = ((end - begin).sum(axis=1) * BM + 1) * tiles[used, TILE_ROWS]
    # query rows each slot reaches, as one range over its query segments
    q_row = np.asarray(plan.q.row, np.int64)[seq]
    q_len = np.asarray(plan.q.length, np.int64)[seq]
    some = end > begin
    big = np.iinfo(np.int64).max
    lo = np.where(some, q_row + begin * BM, big).min(axis=1, initial=big)   # big: none
    hi = np.where(some, q_row + np.minimum(end * BM, q_len), -1).max(axis=1, initial=-1)
    # parts: slot t of a sequence with work W joins part floor(work before t * n / W)
    per_seq = np.bincount(seq, weights=work, minlength=plan.batch)
    slots = np.bincount(seq, minlength=plan.batch)
    target = max(per_seq.sum() * Hk / BACKWARD_SPLIT, 1.0)
    n = np.clip(np.ceil(per_seq / target), 1, np.minimum(MAX_PARTS, np.maximum(slots, 1)))
    before = np.cumsum(work) - work - np.repeat(np.cumsum(per_seq) - per_seq, slots)
    part = np.minimum((before * n[seq] // np.maximum(per_seq[seq], 1)).astype(np.int64),
                      n[seq].astype(np.int64) - 1)
    starts = np.ones(used.size, bool)
    starts[1:] = (seq[1:] != seq[:-1]) | (part[1:] != part[:-1])
    s0 = np.flatnonzero(starts)
    s1 = np.append(s0[1:], used.size)
    p_seq = seq[s0]
    p_lo = np.minimum.reduceat(lo, s0) if s0.size else lo
    p_hi = np.maximum.reduceat(hi, s0) if s0.size else hi
    p_lo = np.where(p_hi > p_lo, p_lo, 0)                  # a part that reaches no row
    p_hi = np.maximum(p_hi, p_lo)
    span = p_hi - p_lo
    p_work = np.add.reduceat(work, s0) if s0.size else work
    # the part of each sequence touching the most rows adds into dQ directly
    direct = np.zeros(s0.size, bool)
    order = np.lexsort((-span, p_seq))
    firsts = np.ones(order.size, bool)
    firsts[1:] = p_seq[order][1:] != p_seq[order][:-1]
    direct[order[firsts]] = True
    partial = ~direct
    size = np.where(partial, span * G, 0)
    off = np.cumsum(size) - size
    shift = np.where(partial, off - p_lo * G, 0)
    parts = np.stack([p_seq, used[s0], used[s1 - 1] + 1, partial, shift, p_lo * G, p_hi * G],
                     axis=1) if s0.size else np.zeros((0, 7), np.int64)
    items = (np.arange(s0.size)[:, None] * Hk + np.arange(Hk)).reshape(-1)
    return (_longest_first(items, np.repeat(p_work, Hk)),
            np.ascontiguousarray(parts, dtype=np.int64))


def _dropout_data(dropout):
    """The kernels' record of a call's dropout (`_cpu_kernels.dropout_rows`), None without:
    `(threshold, seed lo, seed hi, offset)` as uint64 words, the float scale, then the head
    offset (uint64)."""
    if dropout is None:
        return None
    return (np.uint64(dropout.threshold), np.uint64(dropout.key0), np.uint64(dropout.key1),
            np.uint64(dropout.offset), float(dropout.scale), np.uint64(dropout.head_offset))


def _forward(plan: Plan, q, k, v, *, softmax_scale: float, softcap: float, mods=None,
             dropout=None):
    K, th = _kernels(), _threads()
    drop = {} if dropout is None else {"dropout": dropout}
    Hq, Hk, Dv = q.shape[1], k.shape[1], v.shape[2]
    G = Hq // Hk
    wdt = _working_dtype(q.dtype)
    work_out, lse = forward_buffers(plan, q, Dv, out_dtype=wdt, lse_dtype=wdt)
    c, cap = _scalars(softmax_scale, softcap)
    order, chunks = _kept(plan, ("forward", Hk, G), lambda: forward_items(plan, Hk, G))
    rows_max = int(chunks[:, 1].max(initial=1)) * plan.block_m * G
    _announce_compile("forward", wdt)
    with th.worker_scope(order.size) as nw, th.blas_scope(K.BLAS_BOUND) as use_blas:
        Qw, q_flag, aq = _pack(q, G, wdt, name="q")
        Kw, k_flag, ak = _pack(k, 1, wdt, name="k")
        Vw, v_flag, av = _pack(v, 1, wdt, name="v")
        # scores, and the output before it is divided by its row sum (at most Tk)
        fits = in_range(wdt, _score_bound(q.shape[2], aq, ak, c), k.shape[0] * av)
        if fits:
            k_cum = K.flag_prefix(k_flag | v_flag)
            args = (_view(plan), order, chunks, nw, max(1, PRODUCT_KEYS // plan.block_n),
                    rows_max, Qw, Kw, Vw, q_flag, k_cum, c, cap,
                    BLAS_MIN if use_blas else _NO_BLAS, work_out, lse)
            md = None
            if mods:
                md, errors = _mods_data(plan, mods, wdt, "q", softmax_scale, softcap)
            K.forward(*args, md, _dropout_data(dropout))
    if not fits:
        if mods:
            return _wider(_forward, q, (q, k, v), plan, softmax_scale=softmax_scale,
                          softcap=softcap, mods=mods, **drop)
        return _numpy().forward(plan, q, k, v, softmax_scale=softmax_scale, softcap=softcap,
                                **drop)
    if mods:
        _raise_index_errors(errors, plan, Hq)
    _done_compile("forward", wdt)
    return (work_out if work_out.dtype == q.dtype else work_out.astype(q.dtype)), lse


def _backward(plan: Plan, dout, q, k, v, out, lse, *, softmax_scale: float, softcap: float,
              deterministic: bool = False, mods=None, lse_has_sinks: bool = False,
              dropout=None):
    """`(dq, dk, dv)` in the input dtypes (and, when `mods.aux_grads`, the aux gradients:
    `_backward_run`); always deterministic (`deterministic` changes nothing). With
    `lse_has_sinks` no row is taken to have P = 1 because it sees one key."""
    K, th = _kernels(), _threads()
    drop = {} if dropout is None else {"dropout": dropout}
    Tq, Hq, D = q.shape
    Tk, Hk, Dv = k.shape[0], k.shape[1], v.shape[2]
    G = Hq // Hk
    wdt = _working_dtype(q.dtype)
    c, cap = _scalars(softmax_scale, softcap)
    order, parts = _kept(plan, ("backward", Hk, G), lambda: backward_items(plan, Hk, G))
    grads = None
    _announce_compile("backward", wdt)
    with th.worker_scope(order.size) as nw, th.blas_scope(K.BLAS_BOUND) as use_blas:
        Qw, q_flag, aq = _pack(q, G, wdt, name="q")
        Kw, k_flag, ak = _pack(k, 1, wdt, name="k")
        Vw, v_flag, av = _pack(v, 1, wdt, name="v")
        k_flag |= v_flag
        dOw = _workspace.get("dout", (Hk, Tq * G, Dv), wdt)
        delta = _workspace.get("delta", (Hk, Tq * G), wdt)
        lse2 = _workspace.get("lse2", (Hk, Tq * G), wdt)
        lse2_lo = _workspace.get("lse2_lo", (Hk, Tq * G), wdt)
        top = _workspace.get("dout_top", (2, Hk, Tq * G), _BITS[wdt])
        K.pack_grad_rows(_as(dout, wdt), _as(out, wdt), _as(lse, wdt), G, dOw, delta, lse2,
                         lse2_lo, q_flag, top)
        if mods and mods.score is not None:
            _empty_rows_are_not_flagged(q_flag, dout, out, lse, G)
        ado, ao = (_largest(t, wdt) for t in top)
        dp = Dv * ado * (av + ao)                       # |dP| + |delta|
        ds = dp * abs(softmax_scale)                    # |dS| (P <= 1, 1 - tanh^2 <= 1)
        # scores, dP and delta, then dQ, dK and dV (sums over at most Tk keys, Tq * G rows)
        if in_range(wdt, _score_bound(D, aq, ak, c), dp, Tk * ds * ak, Tq * G * ds * aq,
                    Tq * G * ado):
            grads = _backward_run(plan, order, parts, nw, use_blas, Qw, dOw, Kw, Vw, delta,
                                  lse2, lse2_lo, q_flag, k_flag, c, cap, softmax_scale,
                                  softcap, q, k, v, mods, lse_has_sinks, dropout)
    if grads is None:
        if mods or lse_has_sinks:
            return _wider(_backward, q, (dout, q, k, v, out, lse), plan,
                          softmax_scale=softmax_scale, softcap=softcap, mods=mods,
                          lse_has_sinks=lse_has_sinks, **drop)
        return _numpy().backward(plan, dout, q, k, v, out, lse, softmax_scale=softmax_scale,
                                 softcap=softcap, **drop)
    _done_compile("backward", wdt)
    return grads


def _one_key_prefix(plan: Plan, G: int, shortcut: bool):
    """Prefix count `[Tq * G + 1]` of the stacked rows that see one key (`one_key_rows`; none
    without the `shortcut`)."""
    one = one_key_rows(plan) if shortcut else np.zeros(plan.q.num_rows, bool)
    return np.concatenate([[0], np.cumsum(np.repeat(one, G))])


def _empty_rows_are_not_flagged(q_flag, dout, out, lse, G: int):
    """A score_mod may hide every pair of a row: the forward gives it lse -inf (no pair), which
    is not a non-finite input then. Its P is 0 (`pack_grad_rows` sets `lse2 = +inf`), so the
    row's gradients are 0; only a non-finite dout or out still flags it."""
    Tq, Hq, _ = dout.shape
    empty = np.isneginf(lse).T                                               # [Tq, Hq]
    if not empty.any():
        return
    finite = np.isfinite(dout).all(axis=-1) & np.isfinite(out).all(axis=-1)
    clear = (empty & finite).reshape(Tq, Hq // G, G).transpose(1, 0, 2).reshape(Hq // G, -1)
    q_flag[clear] = False


def _backward_run(plan, order, parts, nw, use_blas, Qw, dOw, Kw, Vw, delta, lse2, lse2_lo,
                  q_flag, k_flag, c, cap, softmax_scale, softcap, q, k, v, mods,
                  lse_has_sinks=False, dropout=None):
    """The backward kernels on packed operands: `(dq, dk, dv)`, and `daux` (a tuple: float32
    per float aux of the score_mod, None per other) when `mods.aux_grads`."""
    K = _kernels()
    (Tq, Hq, D), (Tk, Hk, Dv) = q.shape, v.shape
    G = Hq // Hk
    wdt = Qw.dtype
    # rows that see one key of the built-in mask (a mask_mod may hide it, a sink joins it: no
    # such shortcut)
    shortcut = not (mods and mods.mask is not None) and not lse_has_sinks
    one_cum = _kept(plan, ("one_cum", G, shortcut), lambda: _one_key_prefix(plan, G, shortcut))
    q_cum, k_cum = K.flag_prefix(q_flag), K.flag_prefix(k_flag)
    dQ = _workspace.get("dq", (Hk, Tq * G, D), wdt)
    dK = _workspace.get("dk", (Hk, Tk, D), wdt)
    dV = _workspace.get("dv", (Hk, Tk, Dv), wdt)
    K.zero_rows(dQ, dK, dV)
    dq_nan = alloc(np, (Hk, Tq * G), np.bool_, fill=False)
    dk_nan = alloc(np, (Hk, Tk), np.bool_, fill=False)
    # dQ partials of split sequences: zeroed by the part that owns them
    partial = parts[:, 3] != 0
    dq_part = _workspace.get("dq_part", (Hk, int((parts[partial, 6] - parts[partial, 5])
                                                 .sum()), D), wdt)
    view, qstep = _view(plan), max(1, PRODUCT_ROWS // plan.block_m)
    args = (Qw, dOw, Kw, Vw, delta, lse2, lse2_lo, one_cum, q_flag, k_flag, q_cum, k_cum, c, cap,
            float(softmax_scale), BLAS_MIN if use_blas else _NO_BLAS, dQ, dq_part, dK, dV,
            dq_nan, dk_nan)
    daux = None
    dp = _dropout_data(dropout)
    if mods:
        md, errors = _mods_data(plan, mods, wdt, "k", softmax_scale, softcap, backward=True)
        daux = _backward_mods(view, order, nw, qstep, parts, args, md, mods, dp)
        _raise_index_errors(errors, plan, Hq)
    else:
        K.backward(view, order, nw, qstep, parts, *args, None, _NO_AUX_GRADS, dp)
    K.reduce_partials(parts, dQ, dq_part)
    grads = (_unpack(dQ, dq_nan, q.shape, q.dtype), _unpack(dK, dk_nan, k.shape, k.dtype),
             _unpack(dV, dk_nan, v.shape, v.dtype))
    return grads + (daux,) if mods and mods.aux_grads else grads


# --------------------------------------------------------------------------------------------
# User functions (mask_mod, score_mod): `_cpu_mods.py` generates their tile kernels
# --------------------------------------------------------------------------------------------

# The aux gradients of a backward launch are one float64 row per work item (summed in item
# order afterwards: the same bits for any thread count); a call whose rows would pass this
# size runs its items in several launches.
AUX_GRAD_BYTES = 64 << 20
# The aux gradients' rows of a launch that computes none (one row, never written).
_NO_AUX_GRADS = np.zeros((1, 1))


def _mods():
    from . import _cpu_mods
    return _cpu_mods


_neutral = {}


def _neutral_mods():
    """`(mask, score)`: a MaskMod and a ScoreMod that change nothing, whose tile kernels fill
    the function slots of a call that has no mask_mod or no score_mod (never called)."""
    if not _neutral:
        from ..mods import MaskMod, ScoreMod
        _neutral["mods"] = (MaskMod(lambda b, q_idx, k_idx: k_idx >= 0),
                            ScoreMod(lambda score, b, h, q_idx, k_idx: score))
    return _neutral["mods"]


def _mods_data(plan: Plan, mods, wdt, side: str, softmax_scale: float, softcap: float, *,
               backward: bool = False):
    """`(md, errors)`: the kernels' record of the call's user functions (`_cpu_kernels`,
    "User functions") for the walk of `side`, and `[(function, err flag)]` to check after it."""
    M = _mods()
    cstart, cls = plan.tile_classes(side)
    cstart = np.ascontiguousarray(cstart, dtype=np.int64)
    cls = np.ascontiguousarray(cls, dtype=np.int8)
    no_mask, no_score = _neutral_mods()
    mask, score = mods.mask or no_mask, mods.score or no_score
    mpack, spack = M.pack_aux(mask), M.pack_aux(score)
    maux = (*mpack.args(), np.zeros(1, np.int32))
    saux = (*spack.args(), np.zeros(1, np.int32))
    mask_fn = M.mask_tile(mask, wdt)
    if backward:
        md = (cstart, cls, mods.mask is not None, mask_fn, *maux, mods.score is not None,
              M.grad_tile(score, wdt), *saux, float(softcap), bool(mods.aux_grads))
    else:
        md = (cstart, cls, mods.mask is not None, mask_fn, *maux, mods.score is not None,
              M.score_tile(score, wdt), *saux, float(softmax_scale), float(softcap))
    return md, [(mods.mask, maux[3]), (mods.score, saux[3])]


def _raise_index_errors(errors, plan: Plan, heads: int):
    """The IndexError of the first function whose tile kernels read outside an aux array."""
    for mod, err in errors:
        if mod is not None and err[0]:
            raise _mods().find_index_error(mod, plan, heads)


def _backward_mods(view, order, nw, qstep, parts, args, md, mods, dp=None):
    """`backward` with user functions over the work items; the aux gradients (None unless
    `aux_grads`)."""
    K = _kernels()
    if not mods.aux_grads:
        K.backward(view, order, nw, qstep, parts, *args, md, _NO_AUX_GRADS, dp)
        return None
    score = mods.score
    n = _mods().pack_aux(score).num_floats
    per = max(1, AUX_GRAD_BYTES // (8 * max(n, 1)))
    total = np.zeros(max(n, 1))
    for s in range(0, max(order.size, 1), per):
        part = np.ascontiguousarray(order[s:s + per])
        gaux = np.zeros((max(part.size, 1), max(n, 1)))
        K.backward(view, part, min(nw, max(part.size, 1)), qstep, parts, *args, md, gaux, dp)
        total += gaux.sum(axis=0)
    daux = [None] * len(score.aux)
    for i, off in _mods().float_offsets(score.graph, score.aux):
        shape = np.shape(score.aux[i])
        daux[i] = total[off:off + int(np.prod(shape))].reshape(shape).astype(np.float32)
    return tuple(daux)


def _wider(run, q, arrays, plan, **kw):
    """A call with user functions whose magnitudes pass float32's range, run in float64
    (`run`: `_forward` or `_backward`), results in the input dtypes."""
    wide = [np.asarray(a, dtype=np.float64) for a in arrays]
    res = run(plan, *wide, **kw)
    if run is _forward:
        out, lse = res
        return out.astype(q.dtype), lse.astype(np.float32)
    grads = [g.astype(a.dtype) for g, a in zip(res[:3], (arrays[1], arrays[2], arrays[3]))]
    return tuple(grads) + tuple(res[3:])


def blas_chains(dtype) -> bool:
    """Whether this machine's BLAS forms each element of a large product of `dtype` (float32 or
    float64) as one FMA chain along the inner dimension, as the kernels' loops do: then the
    backward's scores are the forward's bit for bit whatever the products' shapes
    (docs/cpu_backend.md, "Accuracy"). Probed once per process on a product past
    `NT_LOOPS_MAX`, inside a BLAS scope. OpenBLAS's Skylake-X kernels chain; its Haswell
    kernels, which it also runs on AMD Zen, do not for float32."""
    dtype = np.dtype(dtype)
    if dtype not in _chains:
        K = _kernels()
        rng = np.random.default_rng(0)
        keys, rows = (rng.standard_normal((n, 64)).astype(dtype) for n in (96, 72))
        scratch = np.empty((K.KBLOCK + 1) * rows.shape[0], dtype)
        got = [np.full((96, 72), np.nan, dtype) for _ in range(2)]
        with _threads().blas_scope(K.BLAS_BOUND) as use_blas:
            for c, blas_min in zip(got, (BLAS_MIN if use_blas else _NO_BLAS, _NO_BLAS)):
                K.mm_nt(keys, rows, c, 0.0, blas_min, scratch)
        _chains[dtype] = bool(np.array_equal(*got))
    return _chains[dtype]


def _numba_missing() -> str | None:
    if importlib.util.find_spec("numba") is None:
        return "numba is not installed (pip install 'varlen[cpu]')"
    return None


def blas_usable() -> bool:
    """The kernels can call BLAS: SciPy's BLAS is bound and threadpoolctl controls it (the
    `[cpu]` extra)."""
    return _numba_missing() is None and _kernels().BLAS_BOUND and _threads().blas_controllable()


class CpuBackend(HostBackend):
    """FlashAttention-2 tiles on the CPU: float32 arithmetic (float64 for float64 inputs),
    BLAS tile products, work items on Numba's threads. Always deterministic: results are
    bitwise identical for any thread count."""

    name = "cpu"
    run_forward = staticmethod(_forward)
    run_backward = staticmethod(_backward)
    runs_mods = frozenset({"mask_mod", "score_mod", "aux_grads"})
    runs_dropout = True

    def forward(self, plan, q, k, v, *, softmax_scale, softcap, mods=None, dropout=None):
        return _forward(plan, q, k, v, softmax_scale=softmax_scale, softcap=softcap,
                        mods=mods or None, dropout=dropout)

    one_key_shortcut = True

    def backward(self, plan, dout, q, k, v, out, lse, *, softmax_scale, softcap,
                 deterministic=False, mods=None, lse_has_sinks=False, dropout=None):
        return _backward(plan, dout, q, k, v, out, lse, softmax_scale=softmax_scale,
                         softcap=softcap, deterministic=deterministic, mods=mods or None,
                         lse_has_sinks=lse_has_sinks, dropout=dropout)

    @property
    def default_eligible(self) -> bool:
        """Chosen by default only with its BLAS tile products: without SciPy and threadpoolctl
        its own loops are slower than the numpy backend (it still runs when asked by name)."""
        return blas_usable()

    def supports_host(self, call):
        return _numba_missing()

    def default_blocks(self, dtype, head_dim):
        # 64 query rows: fine masking and work items; 128 keys: the backward's dK/dV products
        return 64, 128


BACKEND = CpuBackend()
