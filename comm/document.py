"""The document scheme of `partition`: short documents whole on one rank, long ones zigzag over
a few ranks (`DocumentPartition`), placed by their attention work (`document_work`).

The placement is computed on the host from host lengths; the metadata is copied to a device on
use.
"""
from __future__ import annotations

import copy
import math
import threading
import zlib
from collections import OrderedDict
from dataclasses import replace

import numpy as np

from varlen._array import host_copy, to_working
from varlen._setup import working_mask
from varlen.mods import FULL, PARTIAL, split_mask
from varlen.plan import TILE_ROWS, TILE_SEQ, Segments, build_plan, segments_from_cu_seqlens

from .chunked import Partition, _int_arg

__all__ = ["DocumentPartition", "document_work"]


def _document_partition(cu, off, cp_size, num_rows, local_rows, *, mask, max_doc_len, balance,
                        like):
    cu = np.asarray(host_copy(cu))
    off = None if off is None else np.asarray(host_copy(off))
    L = cu[1:].astype(np.int64) - cu[:-1]
    if local_rows is not None:
        local_rows = _int_arg("local_rows", local_rows, 0)
    if like is not None:
        if not isinstance(like, DocumentPartition) or like.cp_size != cp_size or \
                like.batch != L.shape[0]:
            raise ValueError(f"like={like!r} must be a document partition with "
                             f"cp_size={cp_size} and batch={L.shape[0]}")
        groups = like.groups
    else:
        if max_doc_len is not None:
            max_doc_len = _int_arg("max_doc_len", max_doc_len, 0)
        if isinstance(balance, bool) or not isinstance(balance, (int, float)) or balance < 1:
            raise ValueError(f"balance must be a number >= 1, got {balance!r}")
        groups = _document_groups(L, document_work(L, mask), cp_size,
                                  max_doc_len=max_doc_len, balance=float(balance),
                                  capacity=local_rows)
    return DocumentPartition(cu, off, cp_size, num_rows, local_rows, groups=groups)


def _pairs(L, left, right):
    """Visible query-key pairs of a self-attention document of length `L` (int64 arrays) under
    a window `(left, right)` (-1 unbounded): the diagonals `d = j - i` from `-a` to `b` hold
    `L - |d|` pairs each."""
    a = _reach(left, L)
    b = _reach(right, L)
    return np.where(L > 0, (a + b + 1) * L - a * (a + 1) // 2 - b * (b + 1) // 2, 0)


def _reach(w, L):
    """How many diagonals a window side `w` reaches in a document of length `L`."""
    w = np.broadcast_to(np.asarray(w, np.int64), L.shape)
    return np.where(w < 0, np.maximum(L - 1, 0), np.minimum(w, np.maximum(L - 1, 0)))


def document_work(lengths, mask="causal") -> np.ndarray:
    """int64 `[B]`: the attention work (per head) of each document under `mask` (any mask the
    attention calls take; the work the document scheme balances).

    A built-in mask's work is its visible query-key pairs, counted exactly. With a
    `varlen.MaskMod` it is what the kernels will do: the tiles of the mask's tile
    classification (`Plan.tile_classes`, `varlen.mods.classify`) at `WORK_TILE` (or coarser
    for long documents), a FULL tile counting all its pairs and a PARTIAL one half of them,
    an EMPTY one nothing (a chunked or prefix mask makes a long document cheaper than its
    causal shape says)."""
    L = np.asarray(lengths, np.int64)
    base, mask_mod = split_mask(mask)
    m = working_mask(base, L.shape[0], np)
    if mask_mod is not None:
        return _tile_work(L, m, mask_mod)
    left, right, _ = m.fields()
    return _pairs(L, left, right)


WORK_TILE = 16          # tile side of the work estimate under a mask_mod
_WORK_TILES = 256       # ... coarser for long documents: at most this many tiles per side


def _tile_work(L, mask, mask_mod):
    """`document_work` under a mask_mod: a plan of the documents (one segment each) whose tile
    classes say which tiles run, and how."""
    B = L.shape[0]
    if B == 0 or not L.any():
        return np.zeros(B, np.int64)
    tile = max(WORK_TILE, -(-int(L.max()) // _WORK_TILES))
    cu = np.concatenate([[0], np.cumsum(L)]).astype(np.int32)
    seg = segments_from_cu_seqlens(cu, None, int(cu[-1]))
    plan = build_plan(seg, seg, mask, block_m=tile, block_n=tile)
    host = mask_mod.with_aux([np.asarray(host_copy(to_working(a, f"mask_mod aux argument {i}")))
                              for i, a in enumerate(mask_mod.aux)])
    plan = replace(plan, mask_mod=host)
    start, classes = plan.tile_classes("q")
    tiles, sched = plan.q_tiles, plan.q_sched
    used = tiles[:, TILE_SEQ] >= 0
    begin, end = sched[:, 0, 0].astype(np.int64), sched[:, 0, 3].astype(np.int64)
    count = np.where(used, end - begin, 0)
    pair = np.repeat(np.arange(tiles.shape[0]), count)           # query tile of each class
    t = begin[pair] + np.arange(pair.size) - start[pair, 0]      # its key tile
    b = tiles[pair, TILE_SEQ].astype(np.int64)
    cols = np.minimum((t + 1) * tile, L[b]) - t * tile
    area = tiles[pair, TILE_ROWS].astype(np.int64) * cols
    worth = np.where(classes == FULL, 2, np.where(classes == PARTIAL, 1, 0))
    return np.bincount(b, weights=area * worth, minlength=B).astype(np.int64) // 2


ROW_SLACK = 1.25       # default bound on a document partition's rows per rank, times the mean


def _assign(L, work, cp, split, target, capacity, limit=math.inf):
    """Greedy placement. Documents marked `split` go first, heaviest first, each zigzag-split
    over the `g = ceil(work / target)` (at least 2) least loaded ranks with room; then the
    others, heaviest first, each whole on the least loaded rank with room (LPT), unless that
    would take the rank past `limit` work: then split over the fewest least loaded ranks that
    stay within it (or, when none do, that reach the lowest maximum). Returns `(ranks of each
    document: a tuple per document, estimated work per rank)`, or None when `capacity` rows
    per rank cannot hold them."""
    load = [0.0] * cp                                # Python lists: cp is small, B large
    rows = [0] * cp
    groups = [(0,)] * L.shape[0]
    order = np.lexsort((-work, ~split))              # split documents first, heaviest first
    for b in order.tolist():
        n, w = int(L[b]), float(work[b])
        if n == 0:
            continue
        most = min(cp, max(1, n // 2))              # every zigzag chunk keeps a row
        g = 1 if not split[b] else min(most, max(2, math.ceil(w / target)))
        chosen = _members(n, w, g, most, load, rows, capacity, limit)
        if chosen is None:
            return None
        groups[b] = chosen
        g = len(chosen)
        ends = _zigzag_bounds(n, g)
        for j, r in enumerate(chosen):
            rows[r] += sum(ends[c + 1] - ends[c] for c in _zigzag_chunks(j, g))
            load[r] += w / g
    return groups, np.asarray(load)


def _members(n, w, g, most, load, rows, capacity, limit):
    """The ranks (sorted) that take a document of `n` rows and work `w`: the `g` least loaded
    with room, more of them (up to `most`) when rows or `limit` require it."""
    by_load = sorted(range(len(load)), key=load.__getitem__)
    best = None
    for size in range(g, most + 1):
        need = n if size == 1 else -(-n // size) + 1
        chosen = [r for r in by_load if rows[r] + need <= capacity][:size]
        if len(chosen) < size:
            continue
        peak = load[chosen[-1]] + w / size
        if best is None or peak < best[0]:
            best = (peak, chosen)
        if peak <= limit:
            break
    return None if best is None else tuple(sorted(best[1]))


def _zigzag_bounds(n, g):
    """Chunk boundaries of a document of `n` rows cut into `2 g` near-equal chunks (one
    chunk, the whole document, for `g = 1`)."""
    k = 1 if g == 1 else 2 * g
    return [i * n // k for i in range(k + 1)]


def _zigzag_chunks(j, g):
    """The chunks member `j` of a group of `g` ranks holds: zigzag, or the whole document."""
    return (0,) if g == 1 else (j, 2 * g - 1 - j)


def _busiest_sender(L, groups, cp) -> int:
    """Rows the busiest rank sends on the ring: each member of a document's group sends its
    share of the document to every other member."""
    sent = np.zeros(cp, np.int64)
    for n, g in zip(L.tolist(), groups):
        if len(g) > 1:
            sent[list(g)] += n // len(g) * (len(g) - 1)
    return int(sent.max()) if cp else 0


def _document_groups(L, work, cp, *, max_doc_len, balance, capacity):
    """The ranks of each document. With `max_doc_len`, exactly the longer documents are
    split, each over the fewest ranks that hold one rank's share of the work. By default,
    split thresholds from one rank's share of the work down to 1/64 of it (steps of 2^(1/4))
    are tried, and so is splitting only documents that would take a rank past 1.00 to 1.04
    shares; the placement whose busiest rank sends the fewest rows with an estimated max/mean
    work <= `balance` wins (else the best balanced one).

    Without a `capacity` (rows per rank), placements with at most `ROW_SLACK` times the mean
    rows per rank are preferred, so that work balance does not pile short documents' rows on
    the ranks that hold no long one."""
    share = max(float(work.sum()) / cp, 1.0)
    never = np.zeros(L.shape[0], bool)
    if max_doc_len is not None:
        tries = [(L > max_doc_len, share, math.inf)]
    else:
        tries = [(work > t, t, math.inf) for t in (share * 2 ** (-i / 4) for i in range(25))]
        tries += [(never, share, share * f) for f in (1.0, 1.01, 1.02, 1.03, 1.04)]
    caps = [capacity] if capacity is not None else \
        [math.ceil(ROW_SLACK * L.sum() / max(cp, 1)) + 1, np.iinfo(np.int64).max]
    for cap in caps:
        best = None
        for split, target, limit in tries:
            got = _assign(L, work, cp, split, target, cap, limit)
            if got is None:
                continue
            groups, load = got
            imb = float(load.max() / load.mean()) if load.mean() > 0 else 1.0
            key = (imb > balance, imb if imb > balance else _busiest_sender(L, groups, cp))
            if best is None or key < best[0]:
                best = (key, groups)
        if best is not None:
            return best[1]
    raise ValueError(f"local_rows={capacity} is too small: the documents do not fit on "
                     f"{cp} ranks of {capacity} rows")


class DocumentPartition(Partition):
    """The `"document"` scheme (see `partition`): each document lives whole on one rank, or,
    when too heavy for one, is zigzag-split over a small group of ranks.

    Attributes as `Partition`, plus:
        groups: per document, the tuple of ranks holding it (one rank: whole; `g` ranks:
            member `j` holds chunks `j` and `2g-1-j` of `2g` near-equal chunks).
        local_cu_seqlens, chunk: None (each rank has its own layout: see `segments`).
        padded_seqlens: the lengths (documents are not padded; pad rows are a rank's
            trailing rows up to `local_rows`).

    Metadata is computed on the host from host lengths and copied to a device on use.
    """

    def __init__(self, cu, off, cp_size, num_rows, local_rows, *, groups):
        self.xp = np
        self.cp_size = cp_size
        self.scheme = "document"
        self.num_rows = num_rows
        self.cu_seqlens, self.seq_offsets = cu, off
        self.batch = B = int(cu.shape[0] - 1)
        c64 = cu.astype(np.int64)
        L = c64[1:] - c64[:-1]
        self._L = L
        self._start = (c64 if off is None else off.astype(np.int64))[:B]
        self.seqlens = self.padded_seqlens = L.astype(np.int32)
        self.local_cu_seqlens = self.chunk = None
        self.groups = tuple(tuple(g) for g in groups)
        row = np.zeros((cp_size, B, 2), np.int64)
        length = np.zeros((cp_size, B, 2), np.int64)
        pos = np.zeros((cp_size, B, 2), np.int64)
        cursor = np.zeros(cp_size, np.int64)
        for b, g in enumerate(self.groups):
            row[:, b, :] = cursor[:, None]
            ends = _zigzag_bounds(int(L[b]), len(g))
            for j, r in enumerate(g):
                for k, c in enumerate(_zigzag_chunks(j, len(g))):
                    row[r, b, k] = cursor[r]
                    pos[r, b, k] = ends[c]
                    length[r, b, k] = ends[c + 1] - ends[c]
                    cursor[r] += length[r, b, k]
        self._seg = (row, length, pos)
        self.rows_used = tuple(int(x) for x in cursor)
        need = int(cursor.max()) if cp_size else 0
        self.local_rows = need if local_rows is None else _int_arg("local_rows", local_rows, 0)
        if need > self.local_rows:
            raise ValueError(f"local_rows={self.local_rows} is too small: the placement needs "
                             f"{need} rows on rank {int(cursor.argmax())}")
        member = np.zeros((B, cp_size), bool)
        for b, g in enumerate(self.groups):
            if L[b] > 0:
                member[b, list(g)] = True
        self._member = member
        self._reset()

    def _reset(self):
        self._index = {}
        self._twins = {}
        self._routes = {}
        self._steps = OrderedDict()
        self._lock = threading.Lock()

    def on(self, xp) -> "DocumentPartition":
        if xp is self.xp:
            return self
        twin = self._twins.get(xp.__name__)
        if twin is None:
            twin = copy.copy(self)
            twin._reset()
            twin.xp = xp
            self._twins[xp.__name__] = twin
        return twin

    def chunk_ids(self, rank) -> tuple:
        raise ValueError("the document scheme has no fixed chunks; see part.groups and "
                         "part.segments(rank)")

    def segments(self, rank, *, row_offset: int = 0) -> Segments:
        """`Segments` `[B, 2]` of rank `rank`'s shard: a whole document is its first segment
        (position 0), a split one its two zigzag chunks; absent documents have zero-length
        segments."""
        r = self._rank(rank)
        xp = self.xp
        row, length, pos = (xp.asarray(a[r].astype(np.int32)) for a in self._seg)
        return Segments(row=row + np.int32(row_offset), length=length, pos=pos,
                        seqlen=xp.asarray(self.seqlens),
                        num_rows=self.local_rows + row_offset)

    def _host_index(self, r):
        row, length, pos = (a[r] for a in self._seg)
        src = np.zeros(self.local_rows, np.int64)
        p = np.full(self.local_rows, -1, np.int64)
        for b, k in zip(*np.nonzero(length)):
            n = int(length[b, k])
            rows = slice(int(row[b, k]), int(row[b, k]) + n)
            p[rows] = pos[b, k] + np.arange(n)
            src[rows] = self._start[b] + p[rows]
        return src, p >= 0, p

    def _gather_index(self, rank):
        r = self._rank(rank)
        if r not in self._index:
            self._index[r] = tuple(self.xp.asarray(a) for a in self._host_index(r))
        return self._index[r]

    def shared(self, src, dst) -> np.ndarray:
        """Host bool `[B]`: the documents ranks `src` and `dst` both hold (split ones)."""
        return self._member[:, src] & self._member[:, dst]

    def ring_rows(self, src, dst):
        """int64 rows of `src`'s shard that rank `dst` needs as keys: its rows of the
        documents both hold, in document order (empty for `src == dst`: a rank's own keys do
        not travel). Host-known size; the array lives where the metadata does."""
        key = (src, dst)
        if key not in self._routes:
            rows = np.zeros(0, np.int64)
            if src != dst:
                row, length, _ = (a[src] for a in self._seg)
                ranges = [np.arange(row[b, k], row[b, k] + length[b, k])
                          for b in np.flatnonzero(self.shared(src, dst)) for k in range(2)]
                rows = np.concatenate(ranges) if ranges else rows
            self._routes[key] = (rows.shape[0], self.xp.asarray(rows))
        return self._routes[key][1]

    def ring_count(self, src, dst) -> int:
        """How many rows `ring_rows(src, dst)` holds (host)."""
        self.ring_rows(src, dst)
        return self._routes[(src, dst)][0]

    def ring_route(self, step):
        """Ring step `step` for every rank at once, as host arrays of one shape (for collectives
        that move the same shape on every rank, such as JAX's `ppermute`): `(rows, counts)`.
        Rank r sends `rows[r, :counts[r]]`, i.e. `ring_rows(r, (r + step) % cp)`, to rank
        `(r + step) % cp`; `rows` is int64 `[cp, max(counts)]`, padded with `local_rows` (a row
        past every shard)."""
        cp = self.cp_size
        counts = np.array([self.ring_count(r, (r + step) % cp) for r in range(cp)], np.int64)
        rows = np.full((cp, int(counts.max(initial=0))), self.local_rows, np.int64)
        for r in range(cp):
            rows[r, :counts[r]] = host_copy(self.ring_rows(r, (r + step) % cp))
        return rows, counts

    def ring_segments(self, src, dst) -> Segments:
        """Key segments of the compact buffer `k_src[ring_rows(src, dst)]`: `src`'s segments
        of the documents it shares with `dst`, renumbered into the buffer."""
        row, length, pos = (a[src].copy() for a in self._seg)
        keep = self.shared(src, dst) & (src != dst)
        length[~keep] = 0
        n = length.reshape(-1)
        start = np.concatenate([[0], np.cumsum(n)[:-1]]).reshape(row.shape)
        xp = self.xp
        return Segments(row=xp.asarray(start.astype(np.int32)),
                        length=xp.asarray(length.astype(np.int32)),
                        pos=xp.asarray(pos.astype(np.int32)), seqlen=xp.asarray(self.seqlens),
                        num_rows=int(n.sum()))

    def fingerprint(self) -> str:
        h = zlib.crc32(repr(self.groups).encode(), zlib.crc32(
            np.ascontiguousarray(host_copy(self.cu_seqlens)).tobytes()))
        if self.seq_offsets is not None:
            h = zlib.crc32(np.ascontiguousarray(host_copy(self.seq_offsets)).tobytes(), h)
        return (f"document/cp{self.cp_size}/B{self.batch}/T{self.num_rows}/"
                f"local{self.local_rows}/offsets={self.seq_offsets is not None}/crc{h:08x}")
