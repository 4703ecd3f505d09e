"""Chunk partitions of a packed batch over context-parallel ranks: zigzag (load-balanced) and
contiguous. `Partition` is also the base of the document scheme's `DocumentPartition`.

Every sequence `b` of global length `L[b]` is padded to `P[b]`, a multiple of `2 * cp` (zigzag)
or `cp` (contiguous), and cut into equal chunks of `c[b] = P[b] / (2 * cp)` rows (or `P[b] / cp`):

    zigzag, cp = 2, L = 7 -> P = 8, c = 2:    positions 0 1 | 2 3 | 4 5 | 6 [7]
                                              chunk      0  |  1  |  2  |  3
    rank 0 holds chunks 0 and 3: positions 0 1 6 [7]      rank 1 holds chunks 1 and 2: 2 3 4 5

Rank `r` holds chunks `r` and `2 * cp - 1 - r` of every sequence, so under a causal mask every
rank does the same work. Position 7 above is a pad row: it is not part of any segment, so the
kernels never use it as a key and write output 0 / lse -inf / gradient 0 for it. Every rank's
local array has the same number of rows (`local_rows`), which is what the ring needs.

With `seq_offsets` (Transformer Engine's `cu_seqlens_padded`), sequence `b` occupies global rows
`[off[b], off[b] + L[b])` and its padded length is its room `off[b+1] - off[b]` rounded up to a
multiple of the chunk count, so an input already padded as Transformer Engine expects keeps its
layout. Rows between `off[b] + L[b]` and `off[b+1]` are padding whatever they hold.

Everything is computed with the metadata's array module (NumPy or CuPy), so a device partition
never reads device memory on the host once `num_rows` (and optionally `local_rows`) are given.
"""
from __future__ import annotations

import threading
import zlib
from collections import OrderedDict

import numpy as np

from varlen._array import array_module, common_origin, host_copy, to_working
from varlen._validate import validation_enabled
from varlen.plan import Segments

__all__ = ["Partition", "local_rows_bound", "CHUNK_SCHEMES"]

# Chunk schemes: every sequence padded and cut into equal chunks, the same on every rank.
CHUNK_SCHEMES = ("zigzag", "contiguous")


def _int_arg(name, value, minimum):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


def _chunks(scheme: str, cp_size: int) -> int:
    return 2 * cp_size if scheme == "zigzag" else cp_size


def local_rows_bound(num_rows: int, batch: int, cp_size: int, scheme: str = "zigzag") -> int:
    """Host-known upper bound on `local_rows` for `batch` sequences in `num_rows` global rows.

    Each sequence gains fewer than `chunks` pad rows, so the padded total is at most
    `num_rows + batch * (chunks - 1)`, rounded down to a multiple of `chunks`.
    """
    if scheme == "document":
        raise ValueError("the document scheme has no bound from the sizes alone: its "
                         "local_rows is a capacity the placement respects; pass one (e.g. "
                         "ceil(1.25 * num_rows / cp_size))")
    n = _chunks(scheme, cp_size)
    return (num_rows + batch * (n - 1)) // n * (n // cp_size)


class Partition:
    """Which global rows each context-parallel rank holds, and the segments its kernels need.

    Attributes:
        cp_size, scheme, batch (`B`), num_rows (global rows `T`), local_rows (rows per rank).
        seqlens: int32 `[B]` global lengths `L`; positions `>= L[b]` are padding.
        padded_seqlens: int32 `[B]` padded lengths `P` (multiples of the chunk count).
        chunk: int32 `[B]` rows per chunk, `P / (2*cp)` (zigzag) or `P / cp` (contiguous).
        local_cu_seqlens: int32 `[B+1]`: sequence b occupies local rows
            `[local_cu_seqlens[b], local_cu_seqlens[b+1])` on every rank (valid rows first in
            each chunk, then its pad rows).
    """

    def __init__(self, cu, off, cp_size, scheme, num_rows, local_rows):
        xp = array_module(cu)
        self.xp = xp
        self.cp_size = cp_size
        self.scheme = scheme
        self.num_rows = num_rows
        self.cu_seqlens = cu
        self.seq_offsets = off
        self.batch = B = int(cu.shape[0] - 1)
        n = _chunks(scheme, cp_size)
        c64 = cu.astype(np.int64)
        L = c64[1:] - c64[:-1]
        room = L if off is None else xp.maximum(off[1:].astype(np.int64) - off[:-1], L)
        P = (room + n - 1) // n * n
        self._L, self._chunk = L, P // n
        self._start = (c64 if off is None else off.astype(np.int64))[:B]
        self.seqlens = L.astype(np.int32)
        self.padded_seqlens = P.astype(np.int32)
        self.chunk = self._chunk.astype(np.int32)
        local_cu = xp.zeros(B + 1, dtype=np.int64)
        local_cu[1:] = xp.cumsum(P // cp_size)
        self._local_cu = local_cu
        self.local_cu_seqlens = local_cu.astype(np.int32)
        on_device = xp is not np
        if local_rows is None:
            local_rows = (local_rows_bound(num_rows, B, cp_size, scheme) if on_device
                          else int(local_cu[-1]))
        self.local_rows = _int_arg("local_rows", local_rows, 0)
        if validation_enabled(on_device) and int(host_copy(local_cu)[-1]) > self.local_rows:
            raise ValueError(f"local_rows={self.local_rows} is too small: the padded "
                             f"sequences need {int(host_copy(local_cu)[-1])} rows per rank")
        self._index = {}
        self._twins = {}
        # Step plans by (key partition, rank, method, backend, blocks, mask fingerprint), see
        # `step_plans`; the ranks of an in-process group share this object, hence the lock.
        self._steps = OrderedDict()
        self._lock = threading.Lock()

    def on(self, xp) -> "Partition":
        """This partition with its metadata in array module `xp` (NumPy or CuPy).

        A host partition used with device data is copied to the device once (a host-to-device
        copy, no synchronisation) and cached; a device partition is never read back.
        """
        if xp is self.xp:
            return self
        if self.xp is not np:
            raise ValueError("the partition's cu_seqlens live on a CUDA device but the data "
                             "is on the host; build the partition from host cu_seqlens")
        twin = self._twins.get(xp.__name__)
        if twin is None:
            off = None if self.seq_offsets is None else xp.asarray(self.seq_offsets)
            twin = Partition(xp.asarray(self.cu_seqlens), off, self.cp_size, self.scheme,
                             self.num_rows, self.local_rows)
            self._twins[xp.__name__] = twin
        return twin

    def __repr__(self):
        return (f"Partition(scheme={self.scheme!r}, cp_size={self.cp_size}, batch={self.batch}, "
                f"num_rows={self.num_rows}, local_rows={self.local_rows})")

    # ----------------------------------------------------------------------------------------
    # What the kernels need
    # ----------------------------------------------------------------------------------------

    def _rank(self, rank):
        if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or \
                not 0 <= rank < self.cp_size:
            raise ValueError(f"rank must be an int in [0, {self.cp_size}), got {rank!r}")
        return int(rank)

    def chunk_ids(self, rank) -> tuple:
        """The chunks rank `rank` holds, in local order."""
        r = self._rank(rank)
        if self.scheme == "zigzag":
            return (r, 2 * self.cp_size - 1 - r)
        return (r,)

    def segments(self, rank, *, row_offset: int = 0) -> Segments:
        """`Segments` `[B, m]` of rank `rank`'s shard (m = 2 zigzag, 1 contiguous).

        Each segment is one chunk: its valid rows (global positions `pos ...`) come first;
        its pad rows (positions `>= L`) are left out, which makes them padding for the kernels.
        `row_offset` shifts the rows (for a buffer that holds several ranks' shards).
        """
        xp = self.xp
        ids = xp.asarray(np.asarray(self.chunk_ids(rank), dtype=np.int64))
        c = self._chunk[:, None]
        pos = c * ids[None, :]                                          # [B, m]
        row = self._local_cu[:-1, None] + c * xp.arange(ids.shape[0])[None, :] + row_offset
        length = xp.clip(self._L[:, None] - pos, 0, c)
        return Segments(row=row.astype(np.int32), length=length.astype(np.int32),
                        pos=pos.astype(np.int32), seqlen=self.seqlens,
                        num_rows=self.local_rows + row_offset)

    def gathered_segments(self, ranks=None) -> Segments:
        """Segments `[B, n*m]` of the concatenation of the shards of `ranks` (default all, in
        rank order: `cp * local_rows` rows, the layout of an all-gather)."""
        xp = self.xp
        ranks = range(self.cp_size) if ranks is None else [self._rank(r) for r in ranks]
        parts = [self.segments(r, row_offset=i * self.local_rows) for i, r in enumerate(ranks)]
        cat = lambda f: xp.concatenate([getattr(s, f) for s in parts], axis=1)  # noqa: E731
        return Segments(row=cat("row"), length=cat("length"), pos=cat("pos"),
                        seqlen=self.seqlens, num_rows=len(parts) * self.local_rows)

    def _gather_index(self, rank):
        """Per local row: its global row (clamped) and whether it is a valid token."""
        r = self._rank(rank)
        if r in self._index:
            return self._index[r]
        xp = self.xp
        B = self.batch
        t = xp.arange(self.local_rows, dtype=np.int64)
        if B == 0:
            res = (xp.zeros(self.local_rows, np.int64), xp.zeros(self.local_rows, bool),
                   xp.full(self.local_rows, -1, np.int64))
            self._index[r] = res
            return res
        b = xp.searchsorted(self._local_cu[1:], t, side="right")       # sequence of row t
        inside = b < B
        b = xp.minimum(b, B - 1)
        u = t - self._local_cu[b]                                      # row inside sequence
        c = xp.maximum(self._chunk[b], 1)
        ids = xp.asarray(np.asarray(self.chunk_ids(r), dtype=np.int64))
        seg = xp.minimum(u // c, ids.shape[0] - 1)
        p = ids[seg] * c + u % c                                       # global position
        valid = inside & (p < self._L[b])
        src = xp.clip(self._start[b] + p, 0, max(self.num_rows - 1, 0))
        res = (src, valid, xp.where(valid, p, -1))
        self._index[r] = res
        return res

    def valid(self, rank):
        """Bool `[local_rows]`: the rows of rank `rank`'s shard that hold a token."""
        return self._gather_index(rank)[1]

    def positions(self, rank):
        """int64 `[local_rows]`: global position of each local row in its sequence (-1: pad)."""
        return self._gather_index(rank)[2]

    # ----------------------------------------------------------------------------------------
    # Moving data
    # ----------------------------------------------------------------------------------------

    def shard(self, x, rank, *, axis=0, fill=0):
        """Rank `rank`'s rows of a global packed array `x` (`num_rows` rows along `axis`).

        Pad rows are filled with `fill` (0; use `-inf` for an lse). Returns the caller's array
        type; no host synchronisation.
        """
        origin = common_origin([("x", x)])
        xw = to_working(x, "x")
        xp = array_module(xw)
        part = self.on(xp)
        src, valid, _ = part._gather_index(rank)
        axis = _axis(axis, xw.ndim, "x")
        if xw.shape[axis] < self.num_rows:
            raise ValueError(f"x has {xw.shape[axis]} rows along axis {axis}; the partition "
                             f"was built for num_rows={self.num_rows}")
        if xw.shape[axis] == 0:
            shape = list(xw.shape)
            shape[axis] = self.local_rows
            return origin.wrap(xp.full(shape, fill, dtype=xw.dtype))
        taken = xp.take(xw, src, axis=axis)
        keep = valid.reshape([-1 if d == axis else 1 for d in range(xw.ndim)])
        return origin.wrap(xp.where(keep, taken, xp.asarray(fill, dtype=xw.dtype)))

    def unshard(self, shards, *, axis=0, fill=0, num_rows=None):
        """The global packed array from all ranks' shards (a sequence of `cp_size` arrays,
        indexed by rank). Rows that hold no token get `fill`. `num_rows` defaults to the
        partition's."""
        if len(shards) != self.cp_size:
            raise ValueError(f"unshard needs {self.cp_size} shards (one per rank), got "
                             f"{len(shards)}")
        origin = common_origin([(f"shards[{r}]", s) for r, s in enumerate(shards)])
        ws = [to_working(s, f"shards[{r}]") for r, s in enumerate(shards)]
        xp = array_module(ws[0])
        axis = _axis(axis, ws[0].ndim, "shards[0]")
        T = self.num_rows if num_rows is None else _int_arg("num_rows", num_rows, self.num_rows)
        for r, s in enumerate(ws):
            if s.shape[axis] != self.local_rows or s.shape != ws[0].shape:
                raise ValueError(f"shards[{r}] has shape {tuple(s.shape)}; expected "
                                 f"{self.local_rows} rows along axis {axis}, like shards[0]")
        part = self.on(xp)
        moved = [xp.moveaxis(s, axis, 0) for s in ws]
        # One extra row takes every pad row's write, so the scatter needs no boolean indexing.
        out = xp.full((T + 1,) + moved[0].shape[1:], fill, dtype=ws[0].dtype)
        for r, s in enumerate(moved):
            src, valid, _ = part._gather_index(r)
            out[xp.where(valid, src, T)] = s
        return origin.wrap(xp.moveaxis(out[:T], 0, axis))

    def fingerprint(self) -> str:
        """A short host string that differs when two ranks built different partitions
        (reads the metadata: a synchronising call for device metadata)."""
        h = zlib.crc32(np.ascontiguousarray(host_copy(self.cu_seqlens)).tobytes())
        if self.seq_offsets is not None:
            h = zlib.crc32(np.ascontiguousarray(host_copy(self.seq_offsets)).tobytes(), h)
        return (f"{self.scheme}/cp{self.cp_size}/B{self.batch}/T{self.num_rows}/"
                f"local{self.local_rows}/offsets={self.seq_offsets is not None}/crc{h:08x}")


def _axis(axis, ndim, name):
    if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)) or \
            not -ndim <= axis < ndim:
        raise ValueError(f"axis={axis!r} is out of range for {name} with {ndim} dims")
    return int(axis) % ndim
