"""Plans: the metadata every kernel consumes, derived from `cu_seqlens`, offsets and the mask.

A plan is built from host-known sizes only (array shapes, `B`, block sizes, optional
`max_seqlen_*` bounds). All per-sequence values stay in the arrays' module (NumPy here, CuPy on
a device), so building a plan never reads device memory on the host. The format is documented
in `docs/plan.md`; in short:

* **Segments** `[B, m]`: runs of packed rows with contiguous global positions. Plain varlen has
  `m = 1` (one segment per sequence); a zigzag context-parallel shard has `m = 2`.
* **Tiles**: every segment is cut into tiles of `block_m` query rows (or `block_n` key rows).
  The tile table has a host-known number of slots; unused slots have `seq = -1`.
* **Schedule**: for each query tile and each key segment of its sequence, four key-tile indices
  `begin <= full_begin <= full_end <= end`: tiles in `[begin, end)` hold a visible pair, tiles in
  `[full_begin, full_end)` hold only visible pairs (no mask arithmetic needed), the rest of
  `[begin, end)` are partially masked, and every tile outside is skipped. The transposed
  schedule (for each key tile, the query tiles of each query segment) drives dK/dV.
* **Row schedule**: the same ranges as packed partner rows, clipped to each partner segment,
  and the segment's `pos - row`: what the CUDA kernels walk, in chunks of any size dividing
  the partner tile, with a compare and an add per chunk.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from ._device_errors import record
from .masks import Mask, as_mask, key_band, query_band

__all__ = ["Segments", "Plan", "KernelView", "build_plan", "plan_from_cu_seqlens",
           "layout_segments", "segments_from_cu_seqlens", "tile_bound", "TILE_FIELDS", "SCHED_FIELDS",
           "ROW_SCHED_FIELDS"]

# Columns of the tile tables `q_tiles` / `k_tiles` (int32 [num_tiles, 5]).
TILE_FIELDS = ("seq", "seg", "row", "rows", "pos")
TILE_SEQ, TILE_SEG, TILE_ROW, TILE_ROWS, TILE_POS = range(5)
# Last axis of the schedules `q_sched` [num_q_tiles, mk, 4] / `k_sched` [num_k_tiles, mq, 4].
SCHED_FIELDS = ("begin", "full_begin", "full_end", "end")
# Last axis of the row schedules `q_row_sched` [num_q_tiles, mk, 5] / `k_row_sched`
# [num_k_tiles, mq, 5]: the schedule's ranges in packed partner rows (each bound
# `row + min(tile * block, length)` of its segment), and `pos - row` of the segment.
ROW_SCHED_FIELDS = ("row_begin", "row_full_begin", "row_full_end", "row_end", "pos_delta")


def _xp(a):
    if isinstance(a, np.ndarray):
        return np
    import cupy
    return cupy


def outside_message(side: str, num_rows: int) -> str:
    """The device error of a sequence that runs past its buffer."""
    return (f"a sequence of cu_seqlens_{side}/seq_offsets_{side} lies outside the {num_rows} "
            f"rows of its buffer (its rows were not computed)")


def overflow_message(side: str, num_slots: int, block: int) -> str:
    """The device error of more tiles than the table's slots (a length past max_seqlen)."""
    return (f"a sequence is longer than max_seqlen_{side}: the tile table has {num_slots} slots "
            f"of {block} rows (rows past them were not computed)")


def _to_numpy(a):
    """Host copy of a plan array (NumPy, CuPy or a Numba device array)."""
    if isinstance(a, np.ndarray):
        return a
    if hasattr(a, "copy_to_host"):
        return a.copy_to_host()
    return a.get()


@dataclass(frozen=True)
class Segments:
    """Rows of a packed `[T, ...]` array grouped into runs with contiguous global positions.

    Attributes (int32 arrays, NumPy or CuPy):
        row: `[B, m]` first packed row of each segment.
        length: `[B, m]` number of valid rows in it (0 for an empty segment).
        pos: `[B, m]` global position (inside its sequence) of the segment's first row.
        seqlen: `[B]` global length of each sequence; positions `>= seqlen` are padding.
        num_rows: `T`, the rows of the packed array the segments index.
    """

    row: object
    length: object
    pos: object
    seqlen: object
    num_rows: int

    @property
    def batch(self) -> int:
        return int(self.row.shape[0])

    @property
    def per_seq(self) -> int:
        return int(self.row.shape[1])

    def covered(self):
        """Bool `[T]`: rows that belong to a segment (the rest are padding)."""
        xp = _xp(self.row)
        T = self.num_rows
        # Difference array over row boundaries: +1 at each start, -1 at each end.
        starts = self.row.reshape(-1).astype(np.int64)
        ends = starts + self.length.reshape(-1).astype(np.int64)
        delta = xp.zeros(T + 1, dtype=np.int64)
        _scatter_add(xp, delta, starts, 1)
        _scatter_add(xp, delta, ends, -1)
        return xp.cumsum(delta[:T]) > 0


def _scatter_add(xp, target, idx, value):
    if xp is np:
        np.add.at(target, idx, value)
    else:
        import cupyx
        cupyx.scatter_add(target, idx, xp.full(idx.shape, value, dtype=target.dtype))


def segments_from_cu_seqlens(cu_seqlens, seq_offsets, num_rows: int, side: str = "") -> Segments:
    """One segment per sequence: rows `[off[b], off[b] + L[b])`, positions from 0.

    Rows are clamped into `[0, num_rows)`, so even unvalidated device metadata cannot make a
    kernel touch memory outside the buffer; rows cut off that way are recorded as a device
    error (`varlen.check_device_errors`), or raised at once on the host.
    """
    xp = _xp(cu_seqlens)
    cu = cu_seqlens.astype(np.int64)
    B = cu.shape[0] - 1
    length = cu[1:] - cu[:-1]
    row = (cu[:-1] if seq_offsets is None else seq_offsets[:B].astype(np.int64))
    fits = xp.clip(xp.minimum(length, num_rows - xp.clip(row, 0, num_rows)), 0, None)
    if B:
        record(xp, ((fits < length) | ((row < 0) & (length > 0))).any(),
               outside_message(side, num_rows))
    row = xp.clip(row, 0, num_rows)
    length = fits
    return Segments(row=row.astype(np.int32).reshape(B, 1),
                    length=length.astype(np.int32).reshape(B, 1),
                    pos=xp.zeros((B, 1), dtype=np.int32),
                    seqlen=(cu[1:] - cu[:-1]).astype(np.int32),
                    num_rows=int(num_rows))


@dataclass(frozen=True, eq=False)
class Plan:
    """Device metadata for one packed batch and mask, reusable by forward, backward and layers.

    Attributes:
        q, k: `Segments` of the query and key arrays.
        window_left, window_right, bottom_right: int32 `[B]` mask policy per sequence.
        block_m, block_n: query and key tile sizes.
        q_tiles: int32 `[num_q_tiles, 5]` (seq, seg, row, rows, pos) per query tile slot.
        q_sched: int32 `[num_q_tiles, mk, 4]` key-tile ranges (begin, full_begin, full_end, end)
            per key segment.
        k_tiles, k_sched: the same for key tiles against query segments (dK/dV).
        fingerprint: what the plan was built from, cheap to compare on the host (set by
            `varlen.plan`; None for plans built from segments directly).
        q_row_sched: int32 `[num_q_tiles, mk, 5]` (row_begin, row_full_begin, row_full_end,
            row_end, pos_delta): `q_sched`'s ranges as packed key rows, clipped to each key
            segment, and the segment's `pos - row` (zeros in unused slots).
        k_row_sched: int32 `[num_k_tiles, mq, 5]`, the same of `k_sched` in query rows.
        Both row schedules are derived from the schedules when not given (`row_schedule`).
        mask_mod: the call's `varlen.MaskMod` (aux arrays where the plan lives) or None. The
            schedule is the built-in mask's; a tile it keeps is skipped, run without mask
            arithmetic or masked by the mask_mod's class of the tile (`varlen.mods.classify`).
    """

    q: Segments
    k: Segments
    window_left: object
    window_right: object
    bottom_right: object
    block_m: int
    block_n: int
    q_tiles: object
    q_sched: object
    k_tiles: object
    k_sched: object
    fingerprint: tuple | None = None
    q_row_sched: object = None
    k_row_sched: object = None
    mask_mod: object = None

    def __post_init__(self):
        if self.q_row_sched is None:
            object.__setattr__(self, "q_row_sched", row_schedule(
                self.q_tiles, self.q_sched, self.k, self.block_n))
        if self.k_row_sched is None:
            object.__setattr__(self, "k_row_sched", row_schedule(
                self.k_tiles, self.k_sched, self.q, self.block_m))

    @property
    def batch(self) -> int:
        return self.q.batch

    @property
    def num_q_tiles(self) -> int:
        return int(self.q_tiles.shape[0])

    @property
    def num_k_tiles(self) -> int:
        return int(self.k_tiles.shape[0])

    @property
    def on_host(self) -> bool:
        """True when the plan's arrays are NumPy arrays (else CuPy or Numba device arrays)."""
        return isinstance(self.q_tiles, np.ndarray)

    def view(self) -> KernelView:
        """The kernel-facing record of this plan (no copy, no host read)."""
        q, k = self.q, self.k
        return KernelView(self.q_tiles, self.q_sched, self.k_tiles, self.k_sched, q.row,
                          q.length, q.pos, k.row, k.length, k.pos, q.seqlen, k.seqlen,
                          self.window_left, self.window_right, self.bottom_right,
                          self.q_row_sched, self.k_row_sched, self.batch,
                          q.per_seq, k.per_seq, self.num_q_tiles, self.num_k_tiles,
                          self.block_m, self.block_n, q.num_rows, k.num_rows)

    def tile_classes(self, side: str = "q"):
        """The class of every partner tile the schedule keeps (host arrays; cached).

        Returns `(start, classes)`: `start` int64 `[num_tiles, m]`, `classes` int8: partner tile
        `t` of the range `[begin, end)` of tile `i` and partner segment `s` has class
        `classes[start[i, s] + t - begin]`, one of `varlen.mods.EMPTY` (skip it), `PARTIAL`
        (evaluate the masks pair by pair) or `FULL` (no mask arithmetic). `side` "q": query
        tiles against key tiles (forward, dQ); "k": key tiles against query tiles (dK/dV). The
        built-in mask's class meets the mask_mod's (interval arithmetic over its graph, O(1)
        per tile pair: `varlen.mods.classify`).
        """
        cache = self.__dict__.setdefault("_classes", {})
        if side not in cache:
            cache[side] = _tile_classes(self.to_host(), side)
        return cache[side]

    def describe(self, *, max_tiles: int = 64) -> str:
        """Each sequence's tiles as text: `█` full, `░` partial, `·` empty (skipped), a row per
        query tile and a column per key tile (as FlexAttention's `BlockMask.to_string()`)."""
        return _describe(self, max_tiles)

    def to_host(self) -> "Plan":
        """A NumPy copy (reads device memory: for tests and inspection)."""
        if self.on_host:
            return self
        h = _to_numpy

        def hs(s):
            return Segments(h(s.row), h(s.length), h(s.pos), h(s.seqlen), s.num_rows)
        return Plan(hs(self.q), hs(self.k), h(self.window_left), h(self.window_right),
                    h(self.bottom_right), self.block_m, self.block_n, h(self.q_tiles),
                    h(self.q_sched), h(self.k_tiles), h(self.k_sched), self.fingerprint,
                    h(self.q_row_sched), h(self.k_row_sched), self.mask_mod)


class KernelView(NamedTuple):
    """Everything a kernel reads of a plan, as one record (`Plan.view()`).

    The CUDA kernels get it as one struct by value (`PlanView` in `kernels_cuda/plan_view.cuh`,
    the same fields in the same order), the Numba kernels as this named tuple, and the NumPy
    walker reads the same fields. Arrays are int32; the sizes are host ints.
    """

    q_tiles: object        # [num_q_tiles, 5] (seq, seg, row, rows, pos); seq -1: unused slot
    q_sched: object        # [num_q_tiles, mk, 4] key-tile ranges per key segment
    k_tiles: object        # [num_k_tiles, 5]
    k_sched: object        # [num_k_tiles, mq, 4] query-tile ranges per query segment
    q_row: object          # [B, mq] first packed row of each query segment
    q_len: object          # [B, mq] rows of each query segment
    q_pos: object          # [B, mq] global position of its first row
    k_row: object          # [B, mk]
    k_len: object          # [B, mk]
    k_pos: object          # [B, mk]
    seqlen_q: object       # [B] global sequence lengths (positions past them are padding)
    seqlen_k: object       # [B]
    window_left: object    # [B] mask policy (masks.MASK_FIELDS)
    window_right: object   # [B]
    bottom_right: object   # [B]
    q_row_sched: object    # [num_q_tiles, mk, 5] q_sched in key rows, and pos - row per segment
    k_row_sched: object    # [num_k_tiles, mq, 5] k_sched in query rows, and pos - row
    batch: int             # B
    mq: int                # query segments per sequence
    mk: int                # key segments per sequence
    num_q_tiles: int
    num_k_tiles: int
    block_m: int
    block_n: int
    rows_q: int            # Tq, rows of the packed query array
    rows_k: int            # Tk

    NUM_ARRAYS = 17

    def map_arrays(self, fn) -> "KernelView":
        """The same view with `fn` applied to every array (move, cast, make contiguous)."""
        n = self.NUM_ARRAYS
        return KernelView(*(fn(a) for a in self[:n]), *self[n:])


def tile_bound(num_rows: int, num_segments: int, block: int, max_seqlen=None) -> int:
    """Host-known upper bound on the tiles of `num_segments` segments over `num_rows` rows.

    Each segment adds at most one ragged tile: `sum ceil(L/b) <= (T + S(b-1)) / b`; with a
    bound `max_seqlen` on each segment, also `S * ceil(max_seqlen / b)`.
    """
    n = (num_rows + num_segments * (block - 1)) // block
    if max_seqlen is not None:
        n = min(n, num_segments * (-(-int(max_seqlen) // block)))
    return max(int(n), 0)


def _tile_table(xp, seg: Segments, block: int, num_slots: int, side: str = ""):
    """int32 `[num_slots, 5]`: which segment and rows each tile slot covers (-1 when unused).

    More tiles than slots (lengths past the `max_seqlen` bound that sized the table) is
    recorded as a device error, or raised at once on the host.
    """
    S = seg.batch * seg.per_seq
    if S == 0:
        table = xp.zeros((num_slots, 5), dtype=np.int32)
        table[:, :TILE_ROW] = -1
        return table
    length = seg.length.reshape(-1).astype(np.int64)
    ntiles = (length + block - 1) // block                            # [S]
    ends = xp.cumsum(ntiles)                                          # inclusive prefix
    record(xp, ends[-1] > num_slots, overflow_message(side, num_slots, block))
    t = xp.arange(num_slots, dtype=np.int64)
    s = xp.searchsorted(ends, t, side="right")                        # segment of slot t
    used = s < S
    s = xp.minimum(s, S - 1)
    offset = (t - (ends[s] - ntiles[s])) * block                      # first row inside segment
    rows = xp.minimum(block, length[s] - offset)
    row = seg.row.reshape(-1).astype(np.int64)[s] + offset
    pos = seg.pos.reshape(-1).astype(np.int64)[s] + offset
    m = seg.per_seq
    table = xp.stack([xp.where(used, s // m, -1), xp.where(used, s % m, -1),
                      xp.where(used, row, 0), xp.where(used, rows, 0),
                      xp.where(used, pos, 0)], axis=1)
    return table.astype(np.int32)


# Tile-range helpers, in coordinates local to a segment of `n` rows cut into tiles of `b`:
# tile t spans [t*b, min((t+1)*b, n) - 1]. All arguments broadcast; int64.

def _first_last_ge(xp, c, n, b, nt):
    """Smallest t whose last row is >= c."""
    return xp.where(c >= n, nt, xp.clip(c // b, 0, nt))


def _count_first_le(xp, d, b, nt):
    """Number of tiles whose first row is <= d."""
    return xp.where(d < 0, 0, xp.minimum(nt, d // b + 1))


def _first_first_ge(xp, e, b, nt):
    """Smallest t whose first row is >= e."""
    return xp.clip(-((-e) // b), 0, nt)


def _count_last_le(xp, f, n, b, nt):
    """Number of tiles whose last row is <= f."""
    return xp.where(f >= n - 1, nt, xp.clip((f + 1) // b, 0, nt))


def _ranges(xp, begin, end, fbegin, fend):
    """Normalise to begin <= full_begin <= full_end <= end; empty ranges collapse."""
    empty = begin >= end
    begin = xp.where(empty, 0, begin)
    end = xp.where(empty, 0, end)
    fbegin = xp.clip(fbegin, begin, end)
    fend = xp.clip(fend, fbegin, end)
    no_full = fbegin >= fend
    fbegin = xp.where(no_full, end, fbegin)
    fend = xp.where(no_full, end, fend)
    return xp.stack([begin, fbegin, fend, end], axis=-1).astype(np.int32)


def _policy(xp, plan_mask, b, q: Segments, k: Segments):
    """`(left, right, shift)` of sequences `b` in int64; `shift = (Lk - Lq) * bottom_right`."""
    left = plan_mask[0].astype(np.int64)[b]
    right = plan_mask[1].astype(np.int64)[b]
    br = plan_mask[2].astype(np.int64)[b]
    shift = (k.seqlen.astype(np.int64)[b] - q.seqlen.astype(np.int64)[b]) * br
    return left, right, shift


def _schedule(xp, tiles, q: Segments, k: Segments, pol, block, band, partner: Segments):
    """For each tile, the partner-tile ranges of each partner segment of its sequence.

    Query tiles (partner: key segments, `band = key_band`) drive forward and dQ; key tiles
    (partner: query segments, `band = query_band`) drive dK/dV.
    """
    if q.batch == 0:            # every slot unused, every range empty (no policy to read)
        return xp.zeros((tiles.shape[0], partner.per_seq, 4), dtype=np.int32)
    used = tiles[:, TILE_SEQ] >= 0
    b = xp.maximum(tiles[:, TILE_SEQ], 0).astype(np.int64)
    p0 = tiles[:, TILE_POS].astype(np.int64)
    p1 = p0 + tiles[:, TILE_ROWS].astype(np.int64) - 1
    left, right, shift = _policy(xp, pol, b, q, k)
    # Visible partners of the tile's first and last row: [lo0, hi0] and [lo1, hi1].
    lo0, hi0 = (e[:, None] for e in band(xp, p0, shift, left, right))
    lo1, hi1 = (e[:, None] for e in band(xp, p1, shift, left, right))
    pos = partner.pos.astype(np.int64)[b]                             # [n, m]
    n = partner.length.astype(np.int64)[b]
    nt = (n + block - 1) // block
    begin = _first_last_ge(xp, lo0 - pos, n, block, nt)
    end = _count_first_le(xp, hi1 - pos, block, nt)
    fbegin = _first_first_ge(xp, lo1 - pos, block, nt)
    fend = _count_last_le(xp, hi0 - pos, n, block, nt)
    end = xp.where(used[:, None], end, 0)
    return _ranges(xp, begin, end, fbegin, fend)


def row_schedule(tiles, sched, partner: Segments, block: int):
    """int32 `[n, m, 5]`: schedule `sched` of tile table `tiles` as packed partner rows.

    For each tile and partner segment (row `r`, `n` rows, position `p`): each range bound `t`
    (a partner-tile index of `block` rows) as the row `r + min(t * block, n)`, so that the
    last range ends at the segment's last row and an empty range stays empty, and `p - r`.
    Unused slots are zeros. NumPy or CuPy arrays (the fused device builder writes the same
    values in `varlen_plan_tiles`); Numba device arrays: computed by the Numba plan kernels.
    """
    xp = _xp(sched)
    num, m = int(sched.shape[0]), int(sched.shape[1])
    if partner.batch == 0 or num == 0:
        return xp.zeros((num, m, len(ROW_SCHED_FIELDS)), dtype=np.int32)
    used = tiles[:, TILE_SEQ] >= 0
    b = xp.maximum(tiles[:, TILE_SEQ], 0).astype(np.int64)
    row = partner.row.astype(np.int64)[b]                              # [num, m]
    length = partner.length.astype(np.int64)[b]
    delta = partner.pos.astype(np.int64)[b] - row
    bounds = row[..., None] + xp.minimum(sched.astype(np.int64) * block, length[..., None])
    table = xp.concatenate([bounds, delta[..., None]], axis=-1)
    return xp.where(used[:, None, None], table, 0).astype(np.int32)


def _policy_arrays(xp, mask: Mask, B: int):
    """The three policy fields as int32 `[B]` arrays in module `xp` (scalars broadcast)."""
    return tuple(xp.full(B, int(f), dtype=np.int32) if np.ndim(f) == 0 else f.astype(np.int32)
                 for f in mask.fields())


def build_plan(q: Segments, k: Segments, mask, *, block_m: int = 64, block_n: int = 64,
               max_seqlen_q=None, max_seqlen_k=None) -> Plan:
    """Build a plan from query and key segments (the general form, used by context parallelism).

    `mask` fields must already be working arrays of the segments' module (or scalars). Array
    code of the segments' module (NumPy or CuPy); a backend may build the same plan with its
    own kernels (`Backend.make_plan`).
    """
    _check_blocks(block_m, block_n)
    if q.batch != k.batch:
        raise ValueError(f"query segments cover {q.batch} sequences but key segments "
                         f"{k.batch}; expected the same batch")
    xp = _xp(q.row)
    mask = as_mask(mask)
    pol = _policy_arrays(xp, mask, q.batch)
    nq = tile_bound(q.num_rows, q.batch * q.per_seq, block_m, max_seqlen_q)
    nk = tile_bound(k.num_rows, k.batch * k.per_seq, block_n, max_seqlen_k)
    q_tiles = _tile_table(xp, q, block_m, nq, "q")
    k_tiles = _tile_table(xp, k, block_n, nk, "k")
    q_sched = _schedule(xp, q_tiles, q, k, pol, block_n, key_band, partner=k)
    k_sched = _schedule(xp, k_tiles, q, k, pol, block_m, query_band, partner=q)
    return Plan(q=q, k=k, window_left=pol[0], window_right=pol[1], bottom_right=pol[2],
                block_m=int(block_m), block_n=int(block_n), q_tiles=q_tiles, q_sched=q_sched,
                k_tiles=k_tiles, k_sched=k_sched,
                q_row_sched=row_schedule(q_tiles, q_sched, k, block_n),
                k_row_sched=row_schedule(k_tiles, k_sched, q, block_m))


def plan_from_cu_seqlens(cu_seqlens_q, cu_seqlens_k, seq_offsets_q, seq_offsets_k,
                         num_rows_q: int, num_rows_k: int, mask, *, block_m: int = 64,
                         block_n: int = 64, max_seqlen_q=None, max_seqlen_k=None) -> Plan:
    """`build_plan` over one segment per sequence of each side (`segments_from_cu_seqlens`).

    int32 `[B+1]` layout arrays of one module; `mask` fields scalars or int32 `[B]` arrays of
    it. Array code, as `build_plan`.
    """
    return build_plan(*layout_segments(cu_seqlens_q, cu_seqlens_k, seq_offsets_q,
                                       seq_offsets_k, num_rows_q, num_rows_k),
                      mask, block_m=block_m, block_n=block_n, max_seqlen_q=max_seqlen_q,
                      max_seqlen_k=max_seqlen_k)


def layout_segments(cu_seqlens_q, cu_seqlens_k, seq_offsets_q, seq_offsets_k, num_rows_q: int,
                    num_rows_k: int) -> tuple:
    """`(q, k)` segments of a single-process layout: one per sequence of each side."""
    return (segments_from_cu_seqlens(cu_seqlens_q, seq_offsets_q, num_rows_q, "q"),
            segments_from_cu_seqlens(cu_seqlens_k, seq_offsets_k, num_rows_k, "k"))


def _check_blocks(block_m, block_n):
    if block_m <= 0 or block_n <= 0:
        raise ValueError(f"block sizes must be positive, got {block_m=} and {block_n=}")


def _tile_classes(plan: Plan, side: str):
    """`Plan.tile_classes` on a host plan."""
    from .mods import FULL, PARTIAL
    if side == "q":
        tiles, sched, partner, block = plan.q_tiles, plan.q_sched, plan.k, plan.block_n
    elif side == "k":
        tiles, sched, partner, block = plan.k_tiles, plan.k_sched, plan.q, plan.block_m
    else:
        raise ValueError(f"side must be 'q' or 'k', got {side!r}")
    n, m = sched.shape[:2]
    begin, fbegin, fend, end = (sched[..., i].astype(np.int64) for i in range(4))
    count = np.where(tiles[:, TILE_SEQ, None] >= 0, end - begin, 0)          # [n, m]
    start = (np.cumsum(count.reshape(-1)) - count.reshape(-1)).reshape(n, m)
    total = int(count.sum())
    pair = np.repeat(np.arange(n * m), count.reshape(-1))
    t = begin.reshape(-1)[pair] + np.arange(total) - start.reshape(-1)[pair]
    classes = np.where((t >= fbegin.reshape(-1)[pair]) & (t < fend.reshape(-1)[pair]),
                       FULL, PARTIAL).astype(np.int8)
    if plan.mask_mod is not None and total:
        classes = np.minimum(classes, _mod_classes(plan, tiles, partner, block, side, pair,
                                                   t, begin, count, m))
    return start, classes


# Partner tiles classified together first: a run's class is its tiles' class unless it is
# PARTIAL, so the cost follows the mask's boundary, not the number of tile pairs.
_RUN = 16


def _mod_classes(plan, tiles, partner, block, side, pair, t, begin, count, m):
    """The mask_mod's class of each kept (tile, partner tile) entry (`pair` = tile * m +
    partner segment, `t` the partner tile): runs of `_RUN` partner tiles first, then the
    tiles of the PARTIAL runs one by one."""
    from .mods import PARTIAL, AuxRanges, classify
    ranges = AuxRanges(plan.mask_mod.aux)
    begin, count = begin.reshape(-1), count.reshape(-1)

    def boxes(p, t0, t1):
        """Classes of tile `p // m` against partner tiles `t0..t1` of segment `p % m`."""
        i, s = p // m, p % m
        b = tiles[i, TILE_SEQ].astype(np.int64)
        own0 = tiles[i, TILE_POS].astype(np.int64)
        own1 = own0 + tiles[i, TILE_ROWS].astype(np.int64) - 1
        pos = partner.pos[b, s].astype(np.int64)
        p0 = pos + t0 * block
        p1 = pos + np.minimum((t1 + 1) * block, partner.length[b, s].astype(np.int64)) - 1
        q0, q1, k0, k1 = (own0, own1, p0, p1) if side == "q" else (p0, p1, own0, own1)
        return classify(plan.mask_mod, b, q0, q1, k0, k1, ranges)

    runs = (count + _RUN - 1) // _RUN                                  # per (tile, segment)
    run_start = np.cumsum(runs) - runs
    run_pair = np.repeat(np.arange(runs.size), runs)
    run_t0 = begin[run_pair] + (np.arange(run_pair.size) - run_start[run_pair]) * _RUN
    run_t1 = np.minimum(run_t0 + _RUN, begin[run_pair] + count[run_pair]) - 1
    out = boxes(run_pair, run_t0, run_t1)[run_start[pair] + (t - begin[pair]) // _RUN]
    fine = np.flatnonzero(out == PARTIAL)
    if fine.size:
        out[fine] = boxes(pair[fine], t[fine], t[fine])
    return out


_GLYPH = {0: "\u00b7", 1: "\u2591", 2: "\u2588"}


def _describe(plan: Plan, max_tiles: int) -> str:
    """`Plan.describe`: one block of text per sequence."""
    h = plan.to_host()
    start, classes = h.tile_classes("q")
    lines = [f"plan: {h.batch} sequence(s), tiles {h.block_m} x {h.block_n}"
             f"{'' if h.mask_mod is None else ', with a mask_mod'}"
             f"  (\u2588 full, \u2591 partial, \u00b7 empty)"]
    used = np.flatnonzero(h.q_tiles[:, TILE_SEQ] >= 0)
    kept = total = 0
    for b in range(h.batch):
        mine = used[h.q_tiles[used, TILE_SEQ] == b]
        nk = [(int(h.k.length[b, s]) + h.block_n - 1) // h.block_n for s in range(h.k.per_seq)]
        width = sum(nk)
        lq, lk = int(h.q.seqlen[b]), int(h.k.seqlen[b])
        lines.append(f"sequence {b}: {lq} queries x {lk} keys, {len(mine)} x {width} tiles")
        for row, i in enumerate(mine):
            cells = []
            for s in range(h.k.per_seq):
                seg = ["\u00b7"] * nk[s]
                bg, en = int(h.q_sched[i, s, 0]), int(h.q_sched[i, s, 3])
                for t in range(bg, en):
                    c = int(classes[start[i, s] + t - bg])
                    seg[t] = _GLYPH[c]
                    kept += c != 0
                total += nk[s]
                cells.extend(seg)
            if row < max_tiles:
                text = "".join(cells[:max_tiles]) + ("\u2026" if len(cells) > max_tiles else "")
                lines.append("  " + text)
        if len(mine) > max_tiles:
            lines.append(f"  \u2026 ({len(mine) - max_tiles} more query tiles)")
    lines.append(f"{kept} of {total} tile pairs computed ({100.0 * kept / max(total, 1):.1f}%)")
    return "\n".join(lines)
