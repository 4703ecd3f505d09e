"""Numba CUDA kernels: plan building, FlashAttention-2 forward and backward, small utilities.

Every kernel here runs unchanged on a GPU and in the Numba CUDA simulator, which shapes how
they are written (see `docs/numba_backend.md`):

* no warp intrinsics: reductions go through shared memory, or are avoided altogether by giving
  each thread one query (or key) row and its whole softmax state;
* no `numba.cuda.libdevice` calls (NaN in the simulator): only `math.*`;
* no bfloat16 type: bf16 data travels as `uint16` and is widened by a 16-bit shift, through a
  one-element local array reinterpreted with `.view` (a register move on the GPU);
* every `cuda.shared.array` on its own source line (the simulator keys them by line), and only
  in kernels: device functions get the shared tiles as arguments;
* barriers are reached by every thread of a block: loop bounds that contain a barrier are
  block-uniform, and per-thread work is predicated instead.

Two rules hold in every kernel (`docs/numba_backend.md`):

* Address arithmetic is 64-bit. Numba widens integer arithmetic to int64 and indexes arrays in
  int64; loop counters and values read from the int32 plan arrays are cast to int64 before
  any arithmetic (`tests/numba/compile_check.py` checks the typed kernels for narrower ones).
* Non-finite values reach exactly the rows that may see them (`docs/semantics.md`): pairs the
  mask hides are skipped, never multiplied by 0, and a pair whose operands are not all finite
  flags its row, which writes NaN at the end.

The attention kernels read the plan as one record, `varlen.plan.KernelView` (its arrays on the
device), and are built from named device-function steps: stage a tile, score it, mask it,
update the online softmax or the gradients, store. Each is specialised per `Variant` (dtype,
head dims, tile sizes, softcap) by a cached factory whose closure constants become
compile-time constants, per user function (`UserFns`: mask_mod and score_mod by graph
digest) and per dropout (HAS_DROPOUT: the Philox draws are compiled in only then; the seed,
offset, threshold and scale are kernel arguments, so a new seed runs the same code). Launches
live in `_numba_launch.py`.
"""
from __future__ import annotations

import functools
import math
from collections import namedtuple
from dataclasses import dataclass, field

import numpy as np
from numba import cuda, float32, float64, int32, int64, uint16, uint32, uint64

from ..dropout import ROUNDS
from ..masks import MASK_FIELDS, UNBOUNDED
from ..mods.evaluate import EMPTY, FULL
from ..plan import TILE_POS, TILE_ROW, TILE_ROWS, TILE_SEG, TILE_SEQ
from . import _aux_fixed as FX
from ._philox import philox_bump, philox_round, philox_sequence_key

DTYPES = ("float16", "bfloat16", "float32")
# Threads of the single-block prefix-sum kernel (its shared scratch is sized by this).
SCAN_THREADS = 1024
# Static shared memory a kernel may use without an opt-in attribute.
SHARED_BYTES = 48 * 1024
NEG_INF = np.float32(-np.inf)
NAN = np.float32(np.nan)
# Last axis of the schedules, in the order of `varlen.plan.SCHED_FIELDS`.
SCHED_BEGIN, SCHED_FULL_BEGIN, SCHED_FULL_END, SCHED_END = range(4)

# What the plan kernels read of the mask: the policy arrays and the sequence lengths, under the
# names `KernelView` gives them, so `seq_mask` reads either record.
SeqMask = namedtuple("SeqMask", (*MASK_FIELDS, "seqlen_q", "seqlen_k"))


# --------------------------------------------------------------------------------------------
# bfloat16 as uint16 bits
# --------------------------------------------------------------------------------------------

@cuda.jit(device=True)
def bf16_to_f32(bits):
    """Widen bf16 bits to float32: the 16 bits are the top half of the float32 pattern."""
    buf = cuda.local.array(1, uint32)
    buf[0] = uint32(bits) << uint32(16)
    return buf.view(np.float32)[0]


@cuda.jit(device=True)
def f32_to_bf16(x):
    """Round float32 to bf16 bits, nearest-even; NaN stays a (quiet) NaN."""
    buf = cuda.local.array(1, float32)
    buf[0] = x
    u = buf.view(np.uint32)[0]
    if (u & uint32(0x7FFFFFFF)) > uint32(0x7F800000):
        return uint16(0x7FC0)
    u = u + uint32(0x7FFF) + ((u >> uint32(16)) & uint32(1))
    return uint16(u >> uint32(16))


@cuda.jit(device=True)
def _ld3_bf16(a, i, j, k):
    return bf16_to_f32(a[i, j, k])


@cuda.jit(device=True)
def _ld3(a, i, j, k):
    return float32(a[i, j, k])


@cuda.jit(device=True)
def _st3_bf16(a, i, j, k, x):
    a[i, j, k] = f32_to_bf16(x)


@cuda.jit(device=True)
def _st3(a, i, j, k, x):
    a[i, j, k] = x


@cuda.jit(device=True)
def _st1_bf16(a, i, x):
    a[i] = f32_to_bf16(x)


@cuda.jit(device=True)
def _st1(a, i, x):
    a[i] = x


def _io(dtype: str):
    """(load3, store3, store1) device functions for arrays of `dtype` (bf16 as uint16)."""
    if dtype == "bfloat16":
        return _ld3_bf16, _st3_bf16, _st1_bf16
    return _ld3, _st3, _st1


# --------------------------------------------------------------------------------------------
# The mask predicate: the device form of `varlen.masks.visible`, `key_band`, `query_band`
# --------------------------------------------------------------------------------------------

@cuda.jit(device=True)
def seq_mask(rec, b):
    """`(left, right, shift)` of sequence `b` in int64, `shift = (Lk - Lq) * bottom_right`.

    `rec` is a `KernelView` or a `SeqMask`: anything with the policy arrays and lengths.
    """
    shift = (int64(rec.seqlen_k[b]) - int64(rec.seqlen_q[b])) * int64(rec.bottom_right[b])
    return int64(rec.window_left[b]), int64(rec.window_right[b]), shift


@cuda.jit(device=True)
def visible(i, j, pol):
    """Query at global position `i` sees key `j` under `pol = seq_mask(...)`."""
    left, right, shift = pol
    return (left < 0 or j >= i + shift - left) and (right < 0 or j <= i + shift + right)


@cuda.jit(device=True)
def key_band(i, pol):
    """`(lo, hi)`: query position `i` sees exactly the keys `lo <= j <= hi`."""
    left, right, shift = pol
    lo = -UNBOUNDED if left < 0 else i + shift - left
    hi = UNBOUNDED if right < 0 else i + shift + right
    return lo, hi


@cuda.jit(device=True)
def query_band(j, pol):
    """`(lo, hi)`: key position `j` is seen by exactly the queries `lo <= i <= hi`."""
    left, right, shift = pol
    lo = -UNBOUNDED if right < 0 else j - shift - right
    hi = UNBOUNDED if left < 0 else j - shift + left
    return lo, hi


# --------------------------------------------------------------------------------------------
# User functions: a MaskMod and a ScoreMod as device functions (`varlen.mods`)
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class UserFns:
    """The user functions a kernel variant calls, named by graph digest (the cache key: equal
    functions share kernels); the graphs ride along uncompared.

    Their device functions are generated from the graphs (`varlen.mods.codegen`) in the packed
    form: `mask(b, q_idx, k_idx, args)`, `score(score, b, h, q_idx, k_idx, args)` with
    `args = (aux arrays..., err)`, one tuple kernel argument per function.
    """

    mask: str = ""            # MaskMod digest, "" for none: HAS_MASK_MOD
    score: str = ""           # ScoreMod digest, "" for none: HAS_SCORE_MOD
    aux_grads: bool = False   # the dK/dV pass scatters the score_mod's aux gradients
    graphs: tuple = field(default=(None, None), compare=False, repr=False)

    def __post_init__(self):
        if self.aux_grads and not self.score:
            raise ValueError("UserFns.aux_grads needs a score_mod")

    @classmethod
    def of(cls, mods) -> "UserFns":
        """The functions of a `varlen.mods.Mods` (None or empty: none)."""
        if not mods:
            return cls()
        m, s = mods.mask, mods.score
        return cls(m.digest if m is not None else "", s.digest if s is not None else "",
                   bool(mods.aux_grads) and s is not None,
                   (None if m is None else m.graph, None if s is None else s.graph))


@cuda.jit(device=True)
def _sees_all(b, i, j, args):
    return True


@cuda.jit(device=True)
def _full_class(b, q0, q1, k0, k1, args):
    return FULL


@cuda.jit(device=True)
def _same_score(s, b, h, i, j, args):
    return s


@cuda.jit(device=True)
def _d_one(s, b, h, i, j, args):
    return 1.0


@cuda.jit(device=True)
def _no_scatter(ds, s, b, h, i, j, args, grads):
    pass


@cuda.jit(device=True)
def _clamp(i, n):
    """An aux index clamped into `[0, n)`, as the generated loads clamp theirs."""
    return min(max(int64(i), int64(0)), int64(n) - 1)


def _flat_index(index_fns):
    """`flat(s, b, h, i, j, args, a)`: the row-major element of `a` that a load with these
    per-dimension index functions reads, each index clamped into its dimension."""
    last = index_fns[-1]
    DIM = len(index_fns) - 1
    if DIM == 0:
        @cuda.jit(device=True)
        def flat(s, b, h, i, j, args, a):
            return _clamp(last(s, b, h, i, j, args), a.shape[0])
        return flat
    inner = _flat_index(index_fns[:-1])

    @cuda.jit(device=True)
    def flat_nd(s, b, h, i, j, args, a):
        return (inner(s, b, h, i, j, args, a) * int64(a.shape[DIM]) +
                _clamp(last(s, b, h, i, j, args), a.shape[DIM]))
    return flat_nd


# Deterministic aux gradients: integer atomics into fixed-point words (`_aux_fixed`).
_FX_SCALE = float64(2.0 ** FX.HI_BITS)               # HI units, and LO units per HI unit
_FX_LIMIT = float64(FX.LIMIT)
_FX_LIMIT_WORD = uint64(FX.LIMIT)
_FX_FLAGS = FX.FLAGS
_FX_NAN, _FX_POS_INF, _FX_NEG_INF, _FX_RANGE = (uint64(x) for x in (FX.NAN, FX.POS_INF,
                                                                        FX.NEG_INF, FX.RANGE))


@cuda.jit(device=True)
def _fixed_word_add(words, e, w, x):
    """words[e, w] += x; the addition that takes the word to 2^63 or past flags RANGE."""
    if x != uint64(0):
        old = cuda.atomic.add(words, (e, w), x)
        if uint64(old + x) >= _FX_LIMIT_WORD:
            cuda.atomic.or_(words, (e, _FX_FLAGS), _FX_RANGE)


@cuda.jit(device=True)
def fixed_add(words, e, g):
    """Adds the float32 `g` (nonzero) to entry `e` of the words `[n, WORDS]`
    (kernels_cuda/aux_fixed.cuh's fixed_add)."""
    if g != g:
        cuda.atomic.or_(words, (e, _FX_FLAGS), _FX_NAN)
        return
    a = abs(float64(g)) * _FX_SCALE                   # exact
    if a >= _FX_LIMIT:      # an infinity, or one contribution past the range
        bit = _FX_RANGE
        if math.isinf(a):
            bit = _FX_POS_INF if g > 0 else _FX_NEG_INF
        cuda.atomic.or_(words, (e, _FX_FLAGS), bit)
        return
    hi = math.floor(a)
    side = 2 if g < 0 else 0
    _fixed_word_add(words, e, side, uint64(hi))
    _fixed_word_add(words, e, side + 1, uint64(math.floor((a - hi) * _FX_SCALE + 0.5)))


@cuda.jit(device=True)
def _aux_fixed_entry(words, out, err, e):
    # each word < 2^63: exact as int64, and so is the difference
    hi = float64(int64(words[e, FX.POS_HI]) - int64(words[e, FX.NEG_HI]))
    lo = float64(int64(words[e, FX.POS_LO]) - int64(words[e, FX.NEG_LO]))
    value = hi * (1.0 / _FX_SCALE) + lo * (1.0 / (_FX_SCALE * _FX_SCALE))
    flags = words[e, _FX_FLAGS]
    pos = (flags & _FX_POS_INF) != uint64(0)
    neg = (flags & _FX_NEG_INF) != uint64(0)
    if pos:
        value = math.inf
    elif neg:
        value = -math.inf
    if (flags & (_FX_NAN | _FX_RANGE)) != uint64(0) or (pos and neg):
        value = math.nan
    if (flags & _FX_RANGE) != uint64(0):
        err[0] = 1
    out[e] = float32(value)


@cuda.jit
def aux_fixed_kernel(words, out, err):
    """out[e] = the float32 sum of entry e's fixed-point words (`_aux_fixed.to_float32`);
    err[0] = 1 when an entry set RANGE (that entry NaN). A grid-stride loop."""
    for e in range(cuda.grid(1), out.size, cuda.gridsize(1)):
        _aux_fixed_entry(words, out, err, e)


def _scatter_step(prev, slot: int, d_fn, flat, fixed: bool):
    """`prev`, then `grads[slot][flat] += ds * d_fn` for one load of float aux array `slot`:
    its share of the aux gradient (`ScoreMod.d_aux`); float32 atomics, or with `fixed` the
    deterministic fixed-point words (`fixed_add`; `grads[slot]` uint64 `[n, WORDS]`)."""
    SLOT, FIXED = slot, fixed

    @cuda.jit(device=True)
    def scatter(ds, s, b, h, i, j, args, grads):
        prev(ds, s, b, h, i, j, args, grads)
        g = float32(ds * d_fn(s, b, h, i, j, args))
        if g != float32(0.0):
            e = flat(s, b, h, i, j, args, args[SLOT])
            if FIXED:
                fixed_add(grads[SLOT], e, g)
            else:
                cuda.atomic.add(grads[SLOT], e, g)
    return scatter


@functools.lru_cache(maxsize=None)
def user_functions(fns: UserFns, fixed: bool = False):
    """`(mask, score, d_score, scatter, mask_class)` device functions of `fns`; stubs for what
    it lacks (every pair seen, the score unchanged, derivative 1, no scatter, every tile FULL).

    `mask_class(b, q0, q1, k0, k1, args)` is the mask_mod's class of the box of queries
    `[q0, q1]` and keys `[k0, k1]` (`varlen.mods.class_graph`: interval arithmetic, O(1) per
    tile, computed alike by every thread of a block).

    `scatter(ds, s, b, h, i, j, args, grads)` adds `ds * d(score_mod)/d(aux[index])` of each
    float aux load at its (clamped) index into `grads[aux number]`, a flat float32 array, or
    with `fixed` (deterministic=True) its uint64 fixed-point words `[n, WORDS]`.
    """
    from ..mods import class_graph
    from ..mods.codegen import numba_function
    from ..mods.derive import aux_derivatives, derivative
    from ..mods.graph import Graph

    def compiled(graph):
        return numba_function(graph, cuda=True, packed=True, float32=True)

    mask_graph, score_graph = fns.graphs
    mask = compiled(mask_graph) if fns.mask else _sees_all
    mask_class = (numba_function(class_graph(mask_graph), cuda=True, packed=True)
                  if fns.mask else _full_class)
    score, d_score, scatter = _same_score, _d_one, _no_scatter
    if fns.score:
        score = compiled(score_graph)
        d_score = compiled(derivative(score_graph, "score"))
    if fns.aux_grads:
        g = score_graph
        for load, d_graph in aux_derivatives(g):
            index = [compiled(Graph(arg, g.leaves, g.aux, f"{g.role}_index"))
                     for arg in load.args]
            scatter = _scatter_step(scatter, load.value, compiled(d_graph), _flat_index(index),
                                    fixed)
    return mask, score, d_score, scatter, mask_class


@functools.lru_cache(maxsize=None)
def _mask_tile(fns: UserFns):
    """`(mask_keys, mask_queries, tile_class)`: one thread's row of a tile pair under the
    built-in predicate (partial tiles only) and, where the tile's class is PARTIAL, the
    mask_mod, into a float32 row `m_r` (0 seen, -inf hidden); each returns whether the row
    sees any pair of the tile. `tile_class` is `user_functions`' `mask_class`."""
    mask, *_, tile_class = user_functions(fns)

    @cuda.jit(device=True)
    def mask_keys(m_r, n, partial, cls, b, i, j0, pol, mask_args):
        """Query `i` against the n keys at positions j0 + j (tile class `cls`)."""
        any_seen = False
        for j in range(n):
            seen = ((not partial or visible(i, j0 + j, pol)) and
                    (cls == FULL or mask(b, i, j0 + j, mask_args)))
            m_r[j] = float32(0.0) if seen else NEG_INF
            any_seen = any_seen or seen
        return any_seen

    @cuda.jit(device=True)
    def mask_queries(m_r, n, partial, cls, b, i0, j, pol, mask_args):
        """Key `j` against the n queries at positions i0 + i (tile class `cls`)."""
        any_seen = False
        for i in range(n):
            seen = ((not partial or visible(i0 + i, j, pol)) and
                    (cls == FULL or mask(b, i0 + i, j, mask_args)))
            m_r[i] = float32(0.0) if seen else NEG_INF
            any_seen = any_seen or seen
        return any_seen
    return mask_keys, mask_queries, tile_class


# --------------------------------------------------------------------------------------------
# Dropout: the keep bits of `varlen.dropout` (Philox 4x32-10), drawn again wherever needed
# --------------------------------------------------------------------------------------------

# The round and key schedule are those of the `cpu` backend's kernels (`_philox.py`).
_philox_round = cuda.jit(device=True)(philox_round)
_philox_bump = cuda.jit(device=True)(philox_bump)
_philox_sequence_key = cuda.jit(device=True)(philox_sequence_key)


@cuda.jit(device=True)
def philox4x32_10(c0, c1, c2, c3, k0, k1):
    """The four uint32 words of Philox 4x32-10 of counter `(c0, c1, c2, c3)` under key
    `(k0, k1)` (`varlen.dropout.philox4x32_10`, bit for bit), the round keys in registers."""
    for r in range(ROUNDS):
        c0, c1, c2, c3 = _philox_round(c0, c1, c2, c3, k0, k1)
        if r < ROUNDS - 1:
            k0, k1 = _philox_bump(k0, k1)
    return np.uint32(c0), np.uint32(c1), np.uint32(c2), np.uint32(c3)


@cuda.jit(device=True)
def _lane(words, lane):
    """Word `lane` (0..3) of a Philox output."""
    if lane == 0:
        return words[0]
    if lane == 1:
        return words[1]
    if lane == 2:
        return words[2]
    return words[3]


@cuda.jit(device=True)
def dropout_keys(d_r, n, b, h, i, j0, drop):
    """d_r[j] = the dropout factor of query `i` (head `h`, sequence `b`) and the n keys at
    positions j0 + j: `scale` where the pair is kept, 0 where it is dropped. One Philox draw
    per four keys (counter `(j >> 2, i, h + head offset, offset)`, word `j & 3`). `drop =
    (threshold, seed lo, seed hi, offset, scale, head offset)`: uint32 words and a float32 scale
    (`_numba_launch`); the head offset makes `h` the global query head (`Dropout.head_offset`)."""
    thr, k0, seed_hi, off, scale, h0 = drop
    k1 = _philox_sequence_key(seed_hi, b)
    ci, ch = np.uint32(i), np.uint32(h + h0)
    words = (np.uint32(0), np.uint32(0), np.uint32(0), np.uint32(0))
    for j in range(n):
        pos = j0 + j
        if j == 0 or (pos & 3) == 0:
            words = philox4x32_10(np.uint32(pos >> 2), ci, ch, off, k0, k1)
        d_r[j] = scale if _lane(words, pos & 3) >= thr else float32(0.0)


@cuda.jit(device=True)
def dropout_queries(d_r, n, b, h, i0, j, drop):
    """d_r[i] = the dropout factor of key `j` and the n queries at positions i0 + i (head
    `h`, sequence `b`), as `dropout_keys`; the query is a counter word, so one draw per pair."""
    thr, k0, seed_hi, off, scale, h0 = drop
    k1 = _philox_sequence_key(seed_hi, b)
    cj, ch, lane = np.uint32(j >> 2), np.uint32(h + h0), j & 3
    for i in range(n):
        words = philox4x32_10(cj, np.uint32(i0 + i), ch, off, k0, k1)
        d_r[i] = scale if _lane(words, lane) >= thr else float32(0.0)


# --------------------------------------------------------------------------------------------
# Utilities: fills, casts, conversion
# --------------------------------------------------------------------------------------------

@cuda.jit
def fill(a, value):
    """a[:] = value over a 1-D array (grid-stride)."""
    start, step = cuda.grid(1), cuda.gridsize(1)
    for i in range(start, a.shape[0], step):
        a[i] = value


@cuda.jit
def to_int32(src, dst):
    """dst[:] = src[:] as int32 over 1-D arrays (grid-stride): a mask field of any int/bool."""
    start, step = cuda.grid(1), cuda.gridsize(1)
    for i in range(start, dst.shape[0], step):
        dst[i] = int32(src[i])


@cuda.jit
def or_flag(dst, src):
    """dst[0] = 1 if src[0] is set: an error flag folded into an accumulator (one thread)."""
    if cuda.grid(1) == 0 and src[0] != 0:
        dst[0] = 1


@functools.lru_cache(maxsize=None)
def convert_kernel(dtype: str):
    """dst[:] = src[:] (float32 -> dtype), both 1-D."""
    _, _, st1 = _io(dtype)

    def _convert(src, dst):
        start, step = cuda.grid(1), cuda.gridsize(1)
        for i in range(start, dst.shape[0], step):
            st1(dst, i, src[i])
    return cuda.jit(_convert)


@functools.lru_cache(maxsize=None)
def delta_kernel(dtype: str):
    """FlashAttention-2 backward preprocess: delta[h, i] = sum_d dO[i, h, d] * O[i, h, d]."""
    ld3, _, _ = _io(dtype)

    def _delta(out, dout, delta):
        start, step = cuda.grid(1), cuda.gridsize(1)
        Hq, Dv = out.shape[1], out.shape[2]
        for idx in range(start, out.shape[0] * Hq, step):
            row = idx // Hq
            i_h = idx - row * Hq
            acc = float32(0.0)
            for d in range(Dv):
                acc += ld3(out, row, i_h, d) * ld3(dout, row, i_h, d)
            delta[i_h, row] = acc
    return cuda.jit(_delta)


# --------------------------------------------------------------------------------------------
# Plan kernels (the device twin of `varlen.plan.build_plan`)
# --------------------------------------------------------------------------------------------

@cuda.jit
def segments_from_cu(cu, off, num_rows, row, length, pos, seqlen, outside):
    """One segment per sequence: rows [off[b], off[b] + L[b]) clamped into [0, num_rows).

    `off` is `cu` itself when there are no separate offsets. A sequence the clamp cuts sets
    `outside[0]` (its rows would be dropped: a device error, as in `varlen.plan`).
    """
    b = cuda.grid(1)
    if b >= seqlen.shape[0]:
        return
    L = int64(cu[b + 1]) - int64(cu[b])
    r0 = int64(off[b])
    r = min(max(r0, 0), num_rows)
    n = max(min(L, num_rows - r), 0)
    if n < L or (r0 < 0 and L > 0):
        outside[0] = 1
    row[b, 0] = r
    length[b, 0] = n
    pos[b, 0] = 0
    seqlen[b] = L


@cuda.jit
def tile_scan(length, block, num_slots, ends, overflow):
    """ends[s] = sum_{u <= s} ceil(length[u] / block) over the flattened [B, m] segments.

    One block: each thread sums a chunk serially, thread 0 scans the chunk totals. More tiles
    than the table's `num_slots` sets `overflow[0]` (the tiles past them would be dropped).
    """
    part = cuda.shared.array(SCAN_THREADS, int64)
    tid = int64(cuda.threadIdx.x)
    nthreads = int64(cuda.blockDim.x)
    m = length.shape[1]
    S = length.shape[0] * m
    chunk = (S + nthreads - 1) // nthreads
    lo = min(tid * chunk, S)
    hi = min(lo + chunk, S)
    acc = int64(0)
    for s in range(lo, hi):
        acc += (int64(length[s // m, s % m]) + block - 1) // block
    part[tid] = acc
    cuda.syncthreads()
    if tid == 0:
        run = int64(0)
        for t in range(nthreads):
            x = part[t]
            part[t] = run
            run += x
        if run > num_slots:
            overflow[0] = 1
    cuda.syncthreads()
    acc = part[tid]
    for s in range(lo, hi):
        acc += (int64(length[s // m, s % m]) + block - 1) // block
        ends[s] = acc


# Tile-range helpers in coordinates local to a segment of `n` rows cut into tiles of `b`
# (tile t spans [t*b, min((t+1)*b, n) - 1]); the same closed forms as `varlen.plan`.

@cuda.jit(device=True)
def _first_last_ge(c, n, b, nt):
    """Smallest t whose last row is >= c."""
    return nt if c >= n else min(max(c // b, 0), nt)


@cuda.jit(device=True)
def _count_first_le(d, b, nt):
    """Number of tiles whose first row is <= d."""
    return 0 if d < 0 else min(nt, d // b + 1)


@cuda.jit(device=True)
def _first_first_ge(e, b, nt):
    """Smallest t whose first row is >= e."""
    return min(max(-((-e) // b), 0), nt)


@cuda.jit(device=True)
def _count_last_le(f, n, b, nt):
    """Number of tiles whose last row is <= f."""
    return nt if f >= n - 1 else min(max((f + 1) // b, 0), nt)


@cuda.jit(device=True)
def _tile_ranges(band0, band1, n, b):
    """`(begin, full_begin, full_end, end)` of the partner tiles of a tile whose first and last
    rows see the partner rows `band0`, `band1` (local to a partner segment of `n` rows cut into
    tiles of `b`); empty ranges collapse as in `varlen.plan._ranges`."""
    nt = (n + b - 1) // b
    begin = _first_last_ge(band0[0], n, b, nt)
    end = _count_first_le(band1[1], b, nt)
    fbegin = _first_first_ge(band1[0], b, nt)
    fend = _count_last_le(band0[1], n, b, nt)
    if begin >= end:
        begin = 0
        end = 0
    fbegin = min(max(fbegin, begin), end)
    fend = min(max(fend, fbegin), end)
    if fbegin >= fend:
        fbegin = end
        fend = end
    return begin, fbegin, fend, end


@cuda.jit(device=True)
def _segment_of(ends, S, t):
    """`searchsorted(ends[:S], t, side="right")`: the flattened segment holding tile slot `t`."""
    lo = 0
    hi = S
    while lo < hi:
        mid = (lo + hi) // 2
        if ends[mid] <= t:
            lo = mid + 1
        else:
            hi = mid
    return lo


@cuda.jit(device=True)
def _write_tile(tiles, t, b, sg, row, rows, pos):
    tiles[t, TILE_SEQ] = b
    tiles[t, TILE_SEG] = sg
    tiles[t, TILE_ROW] = row
    tiles[t, TILE_ROWS] = rows
    tiles[t, TILE_POS] = pos


@cuda.jit
def tiles_and_schedule(ends, seg_row, seg_len, seg_pos, part_row, part_len, part_pos, mask,
                       block, part_block, is_k, tiles, sched, row_sched):
    """One thread per tile slot: its (seq, seg, row, rows, pos), its partner-tile ranges and
    the same ranges as packed partner rows with the segment's `pos - row` (`plan.row_schedule`).

    For query tiles (`is_k == 0`) the partners are key tiles, reached through `key_band`; for
    key tiles they are query tiles, through `query_band`. `mask` is a `SeqMask`.
    """
    t = cuda.grid(1)
    if t >= tiles.shape[0]:
        return
    m = seg_row.shape[1]
    s = _segment_of(ends, seg_row.shape[0] * m, t)
    if s >= seg_row.shape[0] * m:
        _write_tile(tiles, t, -1, -1, 0, 0, 0)
        for i in range(sched.shape[1]):
            for f in range(4):
                sched[t, i, f] = 0
            for f in range(5):
                row_sched[t, i, f] = 0
        return
    b = s // m
    sg = s - b * m
    L = int64(seg_len[b, sg])
    offset = (t - (ends[s] - (L + block - 1) // block)) * block
    rows = min(int64(block), L - offset)
    p0 = int64(seg_pos[b, sg]) + offset
    _write_tile(tiles, t, b, sg, int64(seg_row[b, sg]) + offset, rows, p0)
    pol = seq_mask(mask, b)
    band0 = query_band(p0, pol) if is_k else key_band(p0, pol)
    band1 = query_band(p0 + rows - 1, pol) if is_k else key_band(p0 + rows - 1, pol)
    for i in range(sched.shape[1]):
        ppos = int64(part_pos[b, i])
        r = _tile_ranges((band0[0] - ppos, band0[1] - ppos), (band1[0] - ppos, band1[1] - ppos),
                         int64(part_len[b, i]), part_block)
        prow = int64(part_row[b, i])
        plen = int64(part_len[b, i])
        for f in range(4):
            sched[t, i, f] = r[f]
            row_sched[t, i, f] = prow + min(int64(r[f]) * part_block, plen)
        row_sched[t, i, 4] = ppos - prow


# --------------------------------------------------------------------------------------------
# Attention: variants
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Variant:
    """One compiled specialisation of the attention kernels.

    Threads per block: `block_m` for the forward and dQ kernels (one query row each),
    `block_n` for dK/dV (one key row each). Tiles are staged in float32 shared memory.
    """

    dtype: str          # of q, k, v (DTYPES)
    head_dim: int       # D: of q and k
    head_dim_v: int     # Dv: of v and the output
    block_m: int        # query rows per tile: threads of the forward and dQ kernels
    block_n: int        # key rows per tile: threads of the dK/dV kernel
    has_softcap: bool   # HAS_SOFTCAP
    fns: UserFns = UserFns()    # mask_mod / score_mod (HAS_MASK_MOD, HAS_SCORE_MOD)
    has_dropout: bool = False   # HAS_DROPOUT: attention dropout (`varlen.dropout`)

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"Variant.dtype={self.dtype!r}; expected one of {DTYPES}")
        for name in ("head_dim", "head_dim_v", "block_m", "block_n"):
            if getattr(self, name) <= 0:
                raise ValueError(f"Variant.{name}={getattr(self, name)} must be positive")
        if self.block_m > 1024 or self.block_n > 1024:
            raise ValueError(f"{self.block_m=} and {self.block_n=}: one thread per row, so "
                             f"each must be <= 1024")
        need = self.shared_bytes()
        if need > SHARED_BYTES:
            raise ValueError(f"tiles block_m={self.block_m}, block_n={self.block_n} with head "
                             f"dims {self.head_dim}/{self.head_dim_v} need {need} bytes of "
                             f"shared memory (> {SHARED_BYTES}); use smaller blocks")

    def shared_bytes(self) -> int:
        """Static shared memory of the largest kernel (dK/dV with the dQ reduction tile)."""
        BM, BN, D, DV = self.block_m, self.block_n, self.head_dim, self.head_dim_v
        fwd = BN * (D + DV)
        dkdv = BN * D + BM * (D + DV) + 2 * BM + BM * (BN + 1)
        return 4 * max(fwd, dkdv)


def fits(dtype: str, head_dim: int, head_dim_v: int, block_m: int, block_n: int) -> str | None:
    """None when these tiles can run, else why not."""
    try:
        Variant(dtype, head_dim, head_dim_v, block_m, block_n, False)
    except ValueError as e:
        return str(e)
    return None


# --------------------------------------------------------------------------------------------
# Attention: steps shared by the kernels
# --------------------------------------------------------------------------------------------

@cuda.jit(device=True)
def tile_of(tiles, t):
    """`(seq, first row, rows, first position)` of tile slot `t` (seq -1: unused slot)."""
    return (tiles[t, TILE_SEQ], int64(tiles[t, TILE_ROW]), int64(tiles[t, TILE_ROWS]),
            int64(tiles[t, TILE_POS]))


@cuda.jit(device=True)
def thread_row(tiles, t, tid):
    """Row `tid` of tile slot `t`: `(seq, packed row, position, valid)`; seq -1: unused slot."""
    b, row0, rows, pos0 = tile_of(tiles, t)
    return b, row0 + tid, pos0 + tid, tid < rows


@cuda.jit(device=True)
def tile_positions(tiles, t):
    """`(first, last)` position of the rows of tile slot `t` (used slots only)."""
    _, _, rows, pos0 = tile_of(tiles, t)
    return int64(pos0), int64(pos0) + rows - 1


@cuda.jit(device=True)
def _segment_and_ranges(rows, pos, length, sched, b, t, i):
    return ((int64(rows[b, i]), int64(pos[b, i]), int64(length[b, i])),
            (int64(sched[t, i, SCHED_BEGIN]), int64(sched[t, i, SCHED_FULL_BEGIN]),
             int64(sched[t, i, SCHED_FULL_END]), int64(sched[t, i, SCHED_END])))


@cuda.jit(device=True)
def partner(view, of_key_tile, b, t, i):
    """Partner segment `i` of query tile `t` (key tile if `of_key_tile`) of sequence `b`:
    `(first row, first position, rows)` and the schedule's `(begin, full_begin, full_end,
    end)` partner-tile indices."""
    if of_key_tile:
        return _segment_and_ranges(view.q_row, view.q_pos, view.q_len, view.k_sched, b, t, i)
    return _segment_and_ranges(view.k_row, view.k_pos, view.k_len, view.q_sched, b, t, i)


@cuda.jit(device=True)
def tile_in(seg, i, block):
    """`(first row, rows, first position)` of tile `i` of a partner segment `seg`."""
    off = int64(i) * block
    return seg[0] + off, min(int64(block), seg[2] - off), seg[1] + off


@cuda.jit(device=True)
def is_partial(ranges, i):
    """Tile `i` of a schedule entry holds masked pairs (outside `[full_begin, full_end)`)."""
    return i < ranges[1] or i >= ranges[2]


@cuda.jit(device=True)
def dot(a, b):
    """sum_d a[d] * b[d] in float32 over the length of `a`."""
    acc = float32(0.0)
    for d in range(a.shape[0]):
        acc += a[d] * b[d]
    return acc


@cuda.jit(device=True)
def axpy(y, alpha, x):
    """y[:] += alpha * x[:]."""
    for d in range(y.shape[0]):
        y[d] += alpha * x[d]


@cuda.jit(device=True)
def zero(a):
    for d in range(a.shape[0]):
        a[d] = 0.0


@cuda.jit(device=True)
def all_finite(a):
    for d in range(a.shape[0]):
        if not math.isfinite(a[d]):
            return False
    return True


@cuda.jit(device=True)
def stage_stats(lse_s, dl_s, lse, delta, head, bos, n, tid, nthreads):
    """lse and delta of query rows [bos, bos + n) of head `head` into shared memory."""
    for r in range(tid, n, nthreads):
        lse_s[r] = lse[head, bos + r]
        dl_s[r] = delta[head, bos + r]


@functools.lru_cache(maxsize=None)
def _softmax_update(has_dropout: bool):
    HAS_DROPOUT = has_dropout

    @cuda.jit(device=True)
    def softmax_update(acc, s_r, v_s, d_r, n, m_i, l_i):
        """One tile of the online softmax (FlashAttention-2, Alg. 1, lines 9-10): rescale the
        accumulator to the new row max, add `exp(s - m) @ V` over the keys with a score (-inf:
        hidden, skipped so that their values take no part); returns the new `(m, l)`. With
        HAS_DROPOUT, `d_r` holds the row's dropout factors (`dropout_keys`): they weigh the
        values, not the row sum `l` (FlashAttention 2: lse is that of the undropped softmax)."""
        m_new = m_i
        for j in range(n):
            m_new = max(m_new, s_r[j])
        if m_new == NEG_INF:
            return m_i, l_i
        alpha = math.exp(m_i - m_new)
        l_i = l_i * alpha
        for d in range(acc.shape[0]):
            acc[d] = acc[d] * alpha
        for j in range(n):
            if s_r[j] > NEG_INF:
                p = math.exp(s_r[j] - m_new)
                l_i += p
                if HAS_DROPOUT:
                    p = p * d_r[j]
                axpy(acc, p, v_s[j])
        return m_new, l_i
    return softmax_update


@cuda.jit(device=True)
def add_dq(dq_acc, ds_s, k_s, row0, n, cols, head, tid, nthreads):
    """dQ[row0 + i] += dS[i, :cols] @ K[:cols], one query row per thread, float32 atomics.

    dS is 0 exactly for the pairs the mask hides, which are skipped (a select: their keys may
    hold anything), and NaN for a seen pair with a non-finite operand, which the row reports.
    """
    for i in range(tid, n, nthreads):
        for d in range(k_s.shape[1]):
            x = float32(0.0)
            for j in range(cols):
                if ds_s[i, j] != 0.0:
                    x += ds_s[i, j] * k_s[j, d]
            if x != 0.0:
                cuda.atomic.add(dq_acc, (row0 + i, head, d), x)


@functools.lru_cache(maxsize=None)
def _rows(dtype: str):
    """`(stage, load_row, store_row)`: float32 rows in and out of `[T, H, D]` arrays of `dtype`."""
    ld3, st3, _ = _io(dtype)

    @cuda.jit(device=True)
    def stage(dst, src, bos, n, head, tid, nthreads):
        """dst[r, :] = src[bos + r, head, :] for r < n, the block's threads striding over dst."""
        cols = dst.shape[1]
        for idx in range(tid, dst.shape[0] * cols, nthreads):
            r = idx // cols
            if r < n:
                dst[r, idx - r * cols] = ld3(src, bos + r, head, idx - r * cols)

    @cuda.jit(device=True)
    def load_row(dst, src, row, head):
        for d in range(dst.shape[0]):
            dst[d] = ld3(src, row, head, d)

    @cuda.jit(device=True)
    def store_row(dst, row, head, src, scale):
        for d in range(src.shape[0]):
            st3(dst, row, head, d, src[d] * scale)
    return stage, load_row, store_row


@functools.lru_cache(maxsize=None)
def _logit(has_softcap: bool):
    """`logit(x, scale, softcap) -> (s, th)`: the score of a raw dot product `x`, with
    `s = c * tanh(x * scale / c)` and `th` the tanh under softcap, else `s = x * scale`, 0."""
    HAS_SOFTCAP = has_softcap

    @cuda.jit(device=True)
    def logit(x, scale, softcap):
        x = x * scale
        th = float32(0.0)
        if HAS_SOFTCAP:
            th = math.tanh(x / softcap)
            x = softcap * th
        return x, th
    return logit


@functools.lru_cache(maxsize=None)
def _pair_grad(has_softcap: bool, fns: UserFns, scatter_aux: bool, fixed: bool = False):
    logit = _logit(has_softcap)
    HAS_SCORE_MOD = bool(fns.score)
    SCATTER = scatter_aux and fns.aux_grads
    _, score_mod, d_score, scatter, _ = user_functions(fns, fixed and SCATTER)

    @cuda.jit(device=True)
    def pair_grad(x, dp, lse_i, delta_i, scale, softcap, b, h, i, j, score_args, grads):
        """`(ok, p, dS)` of one visible pair (query `i`, key `j` of sequence `b`, query head
        `h`) from `x = q . k` and `dp = dO . v` (FlashAttention-2, Alg. 2: `p = exp(s - lse)`,
        `dS = p (dP - delta)`; the score_mod's d/d(score) and, under softcap, d/dx
        c*tanh(x/c) = 1 - th^2 scale dS). With SCATTER, `dS` before those factors goes into
        the aux gradients (`grads`; in fixed point with `fixed`). `ok` is False when an
        operand is not finite: a NaN or inf in q, k, dO, v (through the dots), O (through
        delta) or lse, including lse = -inf, which no row that sees a key has, or a score_mod
        value NaN or +inf. Then `p` and `dS` are NaN, and so is what the pair adds to the aux
        gradients, as in the reference. A pair the score_mod hides (-inf) takes no part,
        whatever its operands and the row's lse (-inf when it hides all of them):
        `p = dS = 0`."""
        s, th = logit(x, scale, softcap)
        if HAS_SCORE_MOD:
            sm = float32(score_mod(s, b, h, i, j, score_args))
            if sm == NEG_INF:
                return True, float32(0.0), float32(0.0)
            if not (math.isfinite(x) and math.isfinite(dp) and math.isfinite(delta_i) and
                    math.isfinite(sm) and math.isfinite(lse_i)):
                if SCATTER:
                    scatter(NAN, s, b, h, i, j, score_args, grads)
                return False, NAN, NAN
            p = math.exp(sm - lse_i)
            ds = p * (dp - delta_i)
            if SCATTER:
                scatter(ds, s, b, h, i, j, score_args, grads)
            ds = ds * float32(d_score(s, b, h, i, j, score_args))
        else:
            if not (math.isfinite(x) and math.isfinite(dp) and math.isfinite(delta_i) and
                    math.isfinite(lse_i)):
                return False, NAN, NAN
            p = math.exp(s - lse_i)
            ds = p * (dp - delta_i)
        return True, p, ds * (float32(1.0) - th * th) * scale
    return pair_grad


# --------------------------------------------------------------------------------------------
# Attention kernels
# --------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _score_tile(has_softcap: bool, fns: UserFns):
    logit = _logit(has_softcap)
    HAS_MASK_MOD, HAS_SCORE_MOD = bool(fns.mask), bool(fns.score)
    score_mod = user_functions(fns)[1]

    @cuda.jit(device=True)
    def score_tile(s_r, q_r, k_s, n, partial, b, h, i, j0, pol, scale, softcap, score_args):
        """s_r[j] = logit(q . k_j), then the score_mod, for the n staged keys (positions
        j0 + j) that query `i` of sequence `b`, head `h`, sees; -inf for the others. The
        built-in predicate is evaluated on partial tiles only; with a mask_mod, s_r holds
        the row's mask on entry (`mask_keys`: 0 seen, -inf hidden), which replaces it.

        Returns whether a key it sees gives a non-finite `q . k` (a NaN or inf in q or in that
        key's k, checked before softcap's tanh could hide it) or a score_mod value NaN or
        +inf: the row reports NaN, and the key's score stays -inf so that nothing of it enters
        the softmax. A score_mod value -inf hides the pair, whatever its operands.
        """
        bad = False
        for j in range(n):
            if HAS_MASK_MOD:
                hidden = s_r[j] == NEG_INF
            else:
                hidden = partial and not visible(i, j0 + j, pol)
            s_r[j] = NEG_INF
            if hidden:
                continue
            x = dot(q_r, k_s[j])
            s = logit(x, scale, softcap)[0]
            ok = math.isfinite(x) and math.isfinite(s)
            if HAS_SCORE_MOD:
                s = float32(score_mod(s, b, h, i, j0 + j, score_args))
                if s == NEG_INF:
                    continue
                ok = ok and math.isfinite(s)
            if ok:
                s_r[j] = s
            else:
                bad = True
        return bad
    return score_tile


@functools.lru_cache(maxsize=None)
def forward_kernel(var: Variant):
    """FlashAttention-2 forward (Alg. 1) over the plan's query tiles; grid (q tiles, Hq).

    `mask_args`, `score_args`: the user functions' `(aux arrays..., err)` (`UserFns`; a
    one-flag tuple for a function the variant lacks). `drop`: the dropout record
    (`dropout_keys`), read only with HAS_DROPOUT.
    """
    BM, BN, D, DV = var.block_m, var.block_n, var.head_dim, var.head_dim_v
    HAS_MASK_MOD = bool(var.fns.mask)
    HAS_DROPOUT = var.has_dropout
    DR = BN if HAS_DROPOUT else 1
    stage, load_row, store_row = _rows(var.dtype)
    score_tile = _score_tile(var.has_softcap, var.fns)
    mask_keys, _, tile_class = _mask_tile(var.fns)
    softmax_update = _softmax_update(HAS_DROPOUT)

    def _forward(q, k, v, out, lse, view, scale, softcap, mask_args, score_args, drop):
        # [BN, D] key tile, [BN, DV] value tile
        k_s = cuda.shared.array((BN, D), float32)
        v_s = cuda.shared.array((BN, DV), float32)
        # [D] this thread's query row, [DV] its output accumulator, [BN] its scores of a tile
        # and (with dropout) its dropout factors
        q_r = cuda.local.array(D, float32)
        acc = cuda.local.array(DV, float32)
        s_r = cuda.local.array(BN, float32)
        d_r = cuda.local.array(DR, float32)
        i_t, i_h, tid = cuda.blockIdx.x, cuda.blockIdx.y, cuda.threadIdx.x
        b, row, pos, valid = thread_row(view.q_tiles, i_t, tid)
        if b < 0:
            return
        q_first, q_last = tile_positions(view.q_tiles, i_t)
        i_kh = i_h // (q.shape[1] // k.shape[1])
        pol = seq_mask(view, b)
        m_i, l_i = NEG_INF, float32(0.0)
        bad = False
        zero(acc)
        if valid:
            load_row(q_r, q, row, i_h)
        for i_seg in range(view.mk):
            seg, ranges = partner(view, False, b, i_t, i_seg)
            for i_n in range(ranges[0], ranges[3]):
                row_n, n, pos_n = tile_in(seg, i_n, BN)
                partial = is_partial(ranges, i_n)
                if HAS_MASK_MOD:
                    # The mask_mod's class of the tile (the same in every thread): EMPTY is
                    # skipped; otherwise the row's mask goes into s_r, the mask_mod evaluated
                    # in a PARTIAL tile only, where the barrier that frees the previous tile
                    # also says whether any row of the block sees a key of this one.
                    cls = tile_class(int64(b), q_first, q_last, pos_n, pos_n + n - 1,
                                     mask_args)
                    if cls == EMPTY:
                        continue
                    seen = False
                    if valid:
                        seen = mask_keys(s_r, n, partial, cls, int64(b), pos, pos_n, pol,
                                         mask_args)
                    if cuda.syncthreads_or(int32(seen)) == 0:
                        continue
                else:
                    cuda.syncthreads()      # the previous tile is consumed
                stage(k_s, k, row_n, n, i_kh, tid, BM)
                stage(v_s, v, row_n, n, i_kh, tid, BM)
                cuda.syncthreads()
                if valid:
                    bad |= score_tile(s_r, q_r, k_s, n, partial, int64(b), int64(i_h), pos,
                                      pos_n, pol, scale, softcap, score_args)
                    if HAS_DROPOUT:
                        dropout_keys(d_r, n, int64(b), int64(i_h), pos, pos_n, drop)
                    m_i, l_i = softmax_update(acc, s_r, v_s, d_r, n, m_i, l_i)
        if valid:
            # out = acc / l, lse = m + log l (Alg. 1, line 12). A non-finite value the row sees
            # (in q or a key's k, flagged by score_tile; in a value row, which leaves acc
            # non-finite) makes both NaN; a row that saw no key keeps 0 and -inf.
            bad = bad or not all_finite(acc)
            seen = l_i > 0.0
            inv = NAN if bad else (float32(1.0) / l_i if seen else float32(0.0))
            store_row(out, row, i_h, acc, inv)
            lse[i_h, row] = NAN if bad else (m_i + math.log(l_i) if seen else NEG_INF)
    return cuda.jit(_forward)


@functools.lru_cache(maxsize=None)
def _key_grads(has_softcap: bool, atomic_dq: bool, fns: UserFns, has_dropout: bool):
    pair_grad = _pair_grad(has_softcap, fns, True, fixed=not atomic_dq)
    ATOMIC_DQ = atomic_dq
    HAS_MASK_MOD = bool(fns.mask)
    HAS_DROPOUT = has_dropout

    @cuda.jit(device=True)
    def key_grads(dk_r, dv_r, k_r, v_r, q_s, do_s, lse_s, dl_s, ds_s, m_r, d_r, n, tid, i0, j,
                  partial, b, h, pol, scale, softcap, score_args, grads):
        """dK, dV of key `j` (this thread's row) over the n staged query rows at positions
        i0 + i (query head `h`); with ATOMIC_DQ, each pair's dS into ds_s[i, tid] for the dQ
        reduction (0 for pairs the mask hides). With a mask_mod, `m_r` holds the key's mask
        (`mask_queries`), which replaces the built-in predicate. With HAS_DROPOUT, `d_r` holds
        the key's dropout factors over the queries (`dropout_queries`): dV takes P times the
        factor, dP the factor (FlashAttention 2's backward). Returns whether a query that
        sees the key brought a non-finite operand (`pair_grad`): then dK and dV of the key are
        NaN, and so is that pair's dS."""
        bad = False
        for i in range(n):
            ds = float32(0.0)
            if HAS_MASK_MOD:
                seen = m_r[i] == 0.0
            else:
                seen = not partial or visible(i0 + i, j, pol)
            if seen:
                dp = dot(do_s[i], v_r)
                if HAS_DROPOUT:
                    dp = dp * d_r[i]
                ok, p, ds = pair_grad(dot(q_s[i], k_r), dp, lse_s[i], dl_s[i],
                                      scale, softcap, b, h, i0 + i, j, score_args, grads)
                if ok and p != 0.0:
                    # p = 0: a pair the score_mod hides, whose rows may hold anything
                    axpy(dv_r, p * d_r[i] if HAS_DROPOUT else p, do_s[i])
                    axpy(dk_r, ds, q_s[i])
                bad = bad or not ok
            if ATOMIC_DQ:
                ds_s[i, tid] = ds
        return bad
    return key_grads


@functools.lru_cache(maxsize=None)
def dkdv_kernel(var: Variant, atomic_dq: bool):
    """FlashAttention-2 backward (Alg. 2) over the plan's key tiles; grid (k tiles, Hk).

    Each thread owns one key row: its dK and dV sum every query head of its GQA group (no
    reduction pass). With `atomic_dq`, each tile pair's dS is staged in shared memory and
    dS @ K of each query row is added to the float32 `dq_acc` by atomics.
    """
    BM, BN, D, DV = var.block_m, var.block_n, var.head_dim, var.head_dim_v
    ATOMIC_DQ = atomic_dq
    DS_M, DS_N = (BM, BN + 1) if atomic_dq else (1, 1)    # +1: no bank conflicts on rows
    HAS_MASK_MOD = bool(var.fns.mask)
    MR = BM if HAS_MASK_MOD else 1
    HAS_DROPOUT = var.has_dropout
    DR = BM if HAS_DROPOUT else 1
    stage, load_row, store_row = _rows(var.dtype)
    key_grads = _key_grads(var.has_softcap, atomic_dq, var.fns, HAS_DROPOUT)
    _, mask_queries, tile_class = _mask_tile(var.fns)

    def _dkdv(q, k, v, dout, lse, delta, dq_acc, dk, dv, view, scale, softcap, mask_args,
              score_args, grads, drop):
        # [BN, D] keys of this tile; [BM, D] queries, [BM, DV] output gradients, [BM] lse and
        # delta of a query tile; [BM, BN] dS of the tile pair, for the dQ reduction
        k_s = cuda.shared.array((BN, D), float32)
        q_s = cuda.shared.array((BM, D), float32)
        do_s = cuda.shared.array((BM, DV), float32)
        lse_s = cuda.shared.array(BM, float32)
        dl_s = cuda.shared.array(BM, float32)
        ds_s = cuda.shared.array((DS_M, DS_N), float32)
        # [DV] this thread's value row; [D], [DV] its gradient accumulators; [BM] its key's
        # mask over a query tile (with a mask_mod) and its dropout factors (with dropout)
        v_r = cuda.local.array(DV, float32)
        dk_r = cuda.local.array(D, float32)
        dv_r = cuda.local.array(DV, float32)
        m_r = cuda.local.array(MR, float32)
        d_r = cuda.local.array(DR, float32)
        i_t, i_kh, tid = cuda.blockIdx.x, cuda.blockIdx.y, cuda.threadIdx.x
        b, bos, cols, pos0 = tile_of(view.k_tiles, i_t)
        if b < 0:
            return
        G = q.shape[1] // k.shape[1]
        valid = tid < cols
        pol = seq_mask(view, b)
        stage(k_s, k, bos, cols, i_kh, tid, BN)
        zero(dk_r)
        zero(dv_r)
        zero(v_r)
        bad = False
        if valid:
            load_row(v_r, v, bos + tid, i_kh)
        for i_h in range(i_kh * G, i_kh * G + G):
            for i_seg in range(view.mq):
                seg, ranges = partner(view, True, b, i_t, i_seg)
                for i_m in range(ranges[0], ranges[3]):
                    row_m, n, pos_m = tile_in(seg, i_m, BM)
                    partial = is_partial(ranges, i_m)
                    if HAS_MASK_MOD:
                        # as in the forward: an EMPTY query tile is skipped, the key's mask
                        # goes into m_r, and a query tile that no key of the block sees is
                        # skipped
                        cls = tile_class(int64(b), pos_m, pos_m + n - 1, pos0,
                                         pos0 + cols - 1, mask_args)
                        if cls == EMPTY:
                            continue
                        seen = False
                        if valid:
                            seen = mask_queries(m_r, n, partial, cls, int64(b), pos_m,
                                                pos0 + tid, pol, mask_args)
                        if cuda.syncthreads_or(int32(seen)) == 0:
                            continue
                    else:
                        cuda.syncthreads()  # the previous query tile (and dS) is consumed
                    stage(q_s, q, row_m, n, i_h, tid, BN)
                    stage(do_s, dout, row_m, n, i_h, tid, BN)
                    stage_stats(lse_s, dl_s, lse, delta, i_h, row_m, n, tid, BN)
                    cuda.syncthreads()
                    if valid:
                        if HAS_DROPOUT:
                            dropout_queries(d_r, n, int64(b), int64(i_h), pos_m, pos0 + tid,
                                            drop)
                        bad |= key_grads(dk_r, dv_r, k_s[tid], v_r, q_s, do_s, lse_s, dl_s,
                                         ds_s, m_r, d_r, n, tid, pos_m, pos0 + tid, partial,
                                         int64(b), int64(i_h), pol, scale, softcap,
                                         score_args, grads)
                    if ATOMIC_DQ:
                        cuda.syncthreads()
                        add_dq(dq_acc, ds_s, k_s, row_m, n, cols, i_h, tid, BN)
        if valid:
            # x * NaN is NaN for every x: a flagged key's rows become NaN
            keep = NAN if bad else float32(1.0)
            store_row(dk, bos + tid, i_kh, dk_r, keep)
            store_row(dv, bos + tid, i_kh, dv_r, keep)
    return cuda.jit(_dkdv)


@functools.lru_cache(maxsize=None)
def _query_grads(has_softcap: bool, fns: UserFns, has_dropout: bool):
    pair_grad = _pair_grad(has_softcap, fns, False)
    HAS_MASK_MOD = bool(fns.mask)
    HAS_DROPOUT = has_dropout

    @cuda.jit(device=True)
    def query_grads(dq_r, q_r, do_r, k_s, v_s, m_r, d_r, n, lse_i, dl_i, i, j0, partial, b, h,
                    pol, scale, softcap, score_args):
        """dQ of query `i` (this thread's row, head `h`) over the n staged keys at positions
        j0 + j; with a mask_mod, `m_r` holds the row's mask (`mask_keys`); with HAS_DROPOUT,
        `d_r` the row's dropout factors (`dropout_keys`), which weigh dP. Returns whether a
        pair it sees holds a non-finite operand (`pair_grad`)."""
        bad = False
        for j in range(n):
            if HAS_MASK_MOD:
                seen = m_r[j] == 0.0
            else:
                seen = not partial or visible(i, j0 + j, pol)
            if seen:
                dp = dot(do_r, v_s[j])
                if HAS_DROPOUT:
                    dp = dp * d_r[j]
                ok, _, ds = pair_grad(dot(q_r, k_s[j]), dp, lse_i, dl_i, scale,
                                      softcap, b, h, i, j0 + j, score_args, score_args)
                if ok and ds != 0.0:
                    # dS = 0 for a pair the score_mod hides, whose key may hold anything
                    axpy(dq_r, ds, k_s[j])
                bad = bad or not ok
        return bad
    return query_grads


@functools.lru_cache(maxsize=None)
def dq_kernel(var: Variant):
    """Deterministic dQ over the plan's query tiles; grid (q tiles, Hq), one row per thread."""
    BM, BN, D, DV = var.block_m, var.block_n, var.head_dim, var.head_dim_v
    HAS_MASK_MOD = bool(var.fns.mask)
    MR = BN if HAS_MASK_MOD else 1
    HAS_DROPOUT = var.has_dropout
    DR = BN if HAS_DROPOUT else 1
    stage, load_row, store_row = _rows(var.dtype)
    query_grads = _query_grads(var.has_softcap, var.fns, HAS_DROPOUT)
    mask_keys, _, tile_class = _mask_tile(var.fns)

    def _dq(q, k, v, dout, lse, delta, dq, view, scale, softcap, mask_args, score_args, drop):
        # [BN, D] key tile, [BN, DV] value tile
        k_s = cuda.shared.array((BN, D), float32)
        v_s = cuda.shared.array((BN, DV), float32)
        # [D] query row, [DV] output-gradient row, [D] dQ accumulator; [BN] the row's mask
        # over a key tile (with a mask_mod) and its dropout factors (with dropout)
        q_r = cuda.local.array(D, float32)
        do_r = cuda.local.array(DV, float32)
        dq_r = cuda.local.array(D, float32)
        m_r = cuda.local.array(MR, float32)
        d_r = cuda.local.array(DR, float32)
        i_t, i_h, tid = cuda.blockIdx.x, cuda.blockIdx.y, cuda.threadIdx.x
        b, row, pos, valid = thread_row(view.q_tiles, i_t, tid)
        if b < 0:
            return
        q_first, q_last = tile_positions(view.q_tiles, i_t)
        i_kh = i_h // (q.shape[1] // k.shape[1])
        pol = seq_mask(view, b)
        lse_i, dl_i = NEG_INF, float32(0.0)
        bad = False
        zero(dq_r)
        if valid:
            lse_i, dl_i = lse[i_h, row], delta[i_h, row]
            load_row(q_r, q, row, i_h)
            load_row(do_r, dout, row, i_h)
        for i_seg in range(view.mk):
            seg, ranges = partner(view, False, b, i_t, i_seg)
            for i_n in range(ranges[0], ranges[3]):
                row_n, n, pos_n = tile_in(seg, i_n, BN)
                partial = is_partial(ranges, i_n)
                if HAS_MASK_MOD:            # as in the forward
                    cls = tile_class(int64(b), q_first, q_last, pos_n, pos_n + n - 1,
                                     mask_args)
                    if cls == EMPTY:
                        continue
                    seen = False
                    if valid:
                        seen = mask_keys(m_r, n, partial, cls, int64(b), pos, pos_n, pol,
                                         mask_args)
                    if cuda.syncthreads_or(int32(seen)) == 0:
                        continue
                else:
                    cuda.syncthreads()
                stage(k_s, k, row_n, n, i_kh, tid, BM)
                stage(v_s, v, row_n, n, i_kh, tid, BM)
                cuda.syncthreads()
                if valid:
                    if HAS_DROPOUT:
                        dropout_keys(d_r, n, int64(b), int64(i_h), pos, pos_n, drop)
                    bad |= query_grads(dq_r, q_r, do_r, k_s, v_s, m_r, d_r, n, lse_i, dl_i, pos,
                                       pos_n, partial, int64(b), int64(i_h), pol, scale,
                                       softcap, score_args)
        if valid:
            store_row(dq, row, i_h, dq_r, NAN if bad else float32(1.0))
    return cuda.jit(_dq)
