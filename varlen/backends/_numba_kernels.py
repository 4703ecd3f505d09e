"""Numba CUDA kernels: plan building, FlashAttention-2 forward and backward, small utilities.

Every kernel here runs unchanged on a GPU and in the Numba CUDA simulator, which shapes how
they are written (see `docs/numba_backend.md`):

* no warp intrinsics: reductions go through shared memory, or are avoided altogether by giving
  each thread one query (or key) row and its whole softmax state;
* no `numba.cuda.libdevice` calls (NaN in the simulator): only `math.*`;
* no bfloat16 type: bf16 data travels as `uint16` and is widened by a 16-bit shift, through a
  one-element local array reinterpreted with `.view` (a register move on the GPU);
* every `cuda.shared.array` on its own source line (the simulator keys them by line);
* barriers are reached by every thread of a block: loop bounds that contain a barrier are
  block-uniform, and per-thread work is predicated instead.

Attention kernels are specialised per `Variant` (dtype, head dims, tile sizes, softcap) by
factory functions whose closure constants become compile-time constants; the factories are
cached. Launches live in `numba_backend.py`.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
from numba import cuda, float32, int32, int64, uint16, uint32

from ..plan import TILE_POS, TILE_ROW, TILE_ROWS, TILE_SEG, TILE_SEQ

# Stands for an unbounded window edge in int64 position arithmetic (as in `varlen.plan`).
POS_INF = 1 << 40
# Threads of the single-block prefix-sum kernel (its shared scratch is sized by this).
SCAN_THREADS = 1024
# Static shared memory a kernel may use without an opt-in attribute.
SHARED_BYTES = 48 * 1024
DTYPES = ("float16", "bfloat16", "float32")
NEG_INF = np.float32(-np.inf)


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
# Utilities: fills, conversion
# --------------------------------------------------------------------------------------------

@cuda.jit
def fill(a, value):
    """a[:] = value over a 1-D array (grid-stride)."""
    start, step = cuda.grid(1), cuda.gridsize(1)
    for i in range(start, a.shape[0], step):
        a[i] = value


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
def segments_from_cu(cu, off, num_rows, row, length, pos, seqlen):
    """One segment per sequence: rows [off[b], off[b] + L[b]) clamped into [0, num_rows).

    `off` is `cu` itself when there are no separate offsets.
    """
    b = cuda.grid(1)
    if b >= seqlen.shape[0]:
        return
    L = int64(cu[b + 1]) - int64(cu[b])
    r = min(max(int64(off[b]), 0), num_rows)
    n = max(min(L, num_rows - r), 0)
    row[b, 0] = r
    length[b, 0] = n
    pos[b, 0] = 0
    seqlen[b] = L


@cuda.jit
def policy_arrays(src_left, src_right, src_br, use_left, use_right, use_br, val_left,
                  val_right, val_br, left, right, br):
    """int32 [B] policy fields, each from a per-sequence array (`use_*`) or a scalar `val_*`."""
    b = cuda.grid(1)
    if b >= left.shape[0]:
        return
    left[b] = int32(src_left[b]) if use_left else int32(val_left)
    right[b] = int32(src_right[b]) if use_right else int32(val_right)
    br[b] = int32(src_br[b]) if use_br else int32(val_br)


@cuda.jit
def tile_scan(length, block, ends):
    """ends[s] = sum_{u <= s} ceil(length[u] / block) over the flattened [B, m] segments.

    One block: each thread sums a chunk serially, thread 0 scans the chunk totals.
    """
    part = cuda.shared.array(SCAN_THREADS, int64)
    tid = cuda.threadIdx.x
    nthreads = cuda.blockDim.x
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


@cuda.jit
def tiles_and_schedule(ends, seg_row, seg_len, seg_pos, seg_seqlen, part_len, part_pos,
                       part_seqlen, win_left, win_right, bottom_right, block, part_block, is_k,
                       tiles, sched):
    """One thread per tile slot: its (seq, seg, row, rows, pos) and its partner-tile ranges.

    For query tiles (`is_k == 0`) the partners are key tiles: query i sees keys in
    [i + s - left, i + s + right]. For key tiles the partners are query tiles: key j is seen by
    queries in [j - s - right, j - s + left]. Both read `x + shift - a` and `x + shift + c`
    with shift = (partner seqlen - own seqlen) * bottom_right.
    """
    t = cuda.grid(1)
    if t >= tiles.shape[0]:
        return
    m = seg_row.shape[1]
    S = seg_row.shape[0] * m
    # searchsorted(ends, t, side="right"): the segment holding slot t
    lo = 0
    hi = S
    while lo < hi:
        mid = (lo + hi) // 2
        if ends[mid] <= t:
            lo = mid + 1
        else:
            hi = mid
    mp = sched.shape[1]
    if lo >= S:
        tiles[t, TILE_SEQ] = -1
        tiles[t, TILE_SEG] = -1
        tiles[t, TILE_ROW] = 0
        tiles[t, TILE_ROWS] = 0
        tiles[t, TILE_POS] = 0
        for i in range(mp):
            for f in range(4):
                sched[t, i, f] = 0
        return
    b = lo // m
    sg = lo - b * m
    L = int64(seg_len[b, sg])
    nt = (L + block - 1) // block
    offset = (t - (ends[lo] - nt)) * block
    tiles[t, TILE_SEQ] = b
    tiles[t, TILE_SEG] = sg
    tiles[t, TILE_ROW] = int64(seg_row[b, sg]) + offset
    tiles[t, TILE_ROWS] = min(int64(block), L - offset)
    tiles[t, TILE_POS] = int64(seg_pos[b, sg]) + offset
    p0 = int64(tiles[t, TILE_POS])
    p1 = p0 + int64(tiles[t, TILE_ROWS]) - 1
    left = int64(win_left[b])
    right = int64(win_right[b])
    shift = (int64(part_seqlen[b]) - int64(seg_seqlen[b])) * int64(bottom_right[b])
    a = right if is_k else left
    c = left if is_k else right
    lo0 = -POS_INF if a < 0 else p0 + shift - a
    lo1 = -POS_INF if a < 0 else p1 + shift - a
    hi0 = POS_INF if c < 0 else p0 + shift + c
    hi1 = POS_INF if c < 0 else p1 + shift + c
    for i in range(mp):
        ppos = int64(part_pos[b, i])
        n = int64(part_len[b, i])
        pnt = (n + part_block - 1) // part_block
        begin = _first_last_ge(lo0 - ppos, n, part_block, pnt)
        end = _count_first_le(hi1 - ppos, part_block, pnt)
        fbegin = _first_first_ge(lo1 - ppos, part_block, pnt)
        fend = _count_last_le(hi0 - ppos, n, part_block, pnt)
        if begin >= end:
            begin = 0
            end = 0
        fbegin = min(max(fbegin, begin), end)
        fend = min(max(fend, fbegin), end)
        if fbegin >= fend:
            fbegin = end
            fend = end
        sched[t, i, 0] = begin
        sched[t, i, 1] = fbegin
        sched[t, i, 2] = fend
        sched[t, i, 3] = end


# --------------------------------------------------------------------------------------------
# Attention kernels
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Variant:
    """One compiled specialisation of the attention kernels.

    Threads per block: `block_m` for the forward and dQ kernels (one query row each),
    `block_n` for dK/dV (one key row each). Tiles are staged in float32 shared memory.
    """

    dtype: str
    head_dim: int
    head_dim_v: int
    block_m: int
    block_n: int
    has_softcap: bool

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


@functools.lru_cache(maxsize=None)
def forward_kernel(var: Variant):
    """FlashAttention-2 forward (Alg. 1) over the plan's query tiles; grid (q tiles, Hq)."""
    BM, BN, D, DV = var.block_m, var.block_n, var.head_dim, var.head_dim_v
    HAS_SOFTCAP = var.has_softcap
    ld3, st3, _ = _io(var.dtype)

    def _forward(q, k, v, out, lse, q_tiles, q_sched, k_row, k_pos, k_len, q_seqlen,
                 k_seqlen, win_left, win_right, bottom_right, scale, softcap):
        # [BN, D] key tile
        k_s = cuda.shared.array((BN, D), float32)
        # [BN, DV] value tile
        v_s = cuda.shared.array((BN, DV), float32)
        # [D] this thread's query row, pre-scaled
        q_r = cuda.local.array(D, float32)
        # [DV] output accumulator
        acc = cuda.local.array(DV, float32)
        # [BN] scores of the current key tile
        s_r = cuda.local.array(BN, float32)
        i_t = cuda.blockIdx.x
        i_h = cuda.blockIdx.y
        tid = cuda.threadIdx.x
        b = q_tiles[i_t, TILE_SEQ]
        if b < 0:
            return
        i_kh = i_h // (q.shape[1] // k.shape[1])
        valid = tid < q_tiles[i_t, TILE_ROWS]
        row = int64(q_tiles[i_t, TILE_ROW]) + tid
        i_pos = int64(q_tiles[i_t, TILE_POS]) + tid
        left = int64(win_left[b])
        right = int64(win_right[b])
        shift = (int64(k_seqlen[b]) - int64(q_seqlen[b])) * int64(bottom_right[b])
        m_i = float32(NEG_INF)
        l_i = float32(0.0)
        for d in range(DV):
            acc[d] = 0.0
        if valid:
            for d in range(D):
                q_r[d] = ld3(q, row, i_h, d) * scale
        for i_seg in range(q_sched.shape[1]):
            begin = q_sched[i_t, i_seg, 0]
            fbegin = q_sched[i_t, i_seg, 1]
            fend = q_sched[i_t, i_seg, 2]
            end = q_sched[i_t, i_seg, 3]
            k_bos = int64(k_row[b, i_seg])
            k_pos0 = int64(k_pos[b, i_seg])
            k_n = int64(k_len[b, i_seg])
            for i_n in range(begin, end):
                n0 = int64(i_n) * BN
                n = min(int64(BN), k_n - n0)
                cuda.syncthreads()          # the previous tile is consumed
                for idx in range(tid, BN * D, BM):
                    r = idx // D
                    if r < n:
                        k_s[r, idx - r * D] = ld3(k, k_bos + n0 + r, i_kh, idx - r * D)
                for idx in range(tid, BN * DV, BM):
                    r = idx // DV
                    if r < n:
                        v_s[r, idx - r * DV] = ld3(v, k_bos + n0 + r, i_kh, idx - r * DV)
                cuda.syncthreads()
                if valid:
                    partial = i_n < fbegin or i_n >= fend
                    m_new = m_i
                    for j in range(n):
                        x = float32(0.0)
                        for d in range(D):
                            x += q_r[d] * k_s[j, d]
                        if HAS_SOFTCAP:
                            x = softcap * math.tanh(x / softcap)
                        if partial:
                            j_pos = k_pos0 + n0 + j
                            if not ((left < 0 or j_pos >= i_pos + shift - left) and
                                    (right < 0 or j_pos <= i_pos + shift + right)):
                                x = NEG_INF
                        s_r[j] = x
                        m_new = max(m_new, x)
                    if m_new > NEG_INF:
                        # Online softmax rescale (FlashAttention-2, Alg. 1, lines 9-10).
                        alpha = math.exp(m_i - m_new)
                        l_i = l_i * alpha
                        for d in range(DV):
                            acc[d] = acc[d] * alpha
                        for j in range(n):
                            p = math.exp(s_r[j] - m_new)
                            l_i += p
                            for d in range(DV):
                                acc[d] += p * v_s[j, d]
                        m_i = m_new
        if valid:
            if l_i > 0.0:
                inv = float32(1.0) / l_i
                for d in range(DV):
                    st3(out, row, i_h, d, acc[d] * inv)
                lse[i_h, row] = m_i + math.log(l_i)
            else:
                for d in range(DV):
                    st3(out, row, i_h, d, float32(0.0))
                lse[i_h, row] = NEG_INF
    return cuda.jit(_forward)


@functools.lru_cache(maxsize=None)
def dkdv_kernel(var: Variant, atomic_dq: bool):
    """FlashAttention-2 backward (Alg. 2) over the plan's key tiles; grid (k tiles, Hk).

    Each thread owns one key row and accumulates its dK and dV over every query head of its
    GQA group, so the group reduction needs no extra pass. With `atomic_dq`, the tile's dS is
    staged in shared memory and each thread reduces dS @ K for query rows and adds it to the
    float32 `dq_acc` with atomics.
    """
    BM, BN, D, DV = var.block_m, var.block_n, var.head_dim, var.head_dim_v
    HAS_SOFTCAP = var.has_softcap
    ATOMIC_DQ = atomic_dq
    DS_M = BM if atomic_dq else 1
    DS_N = BN + 1 if atomic_dq else 1         # +1: no bank conflicts on row reads
    ld3, st3, _ = _io(var.dtype)

    def _dkdv(q, k, v, dout, lse, delta, dq_acc, dk, dv, k_tiles, k_sched, q_row, q_pos,
              q_len, q_seqlen, k_seqlen, win_left, win_right, bottom_right, scale, softcap):
        # [BN, D] keys of this tile
        k_s = cuda.shared.array((BN, D), float32)
        # [BM, D] query tile
        q_s = cuda.shared.array((BM, D), float32)
        # [BM, DV] output-gradient tile
        do_s = cuda.shared.array((BM, DV), float32)
        # [BM] lse and delta of the query tile
        lse_s = cuda.shared.array(BM, float32)
        dl_s = cuda.shared.array(BM, float32)
        # [BM, BN] dS of the tile pair, for the dQ reduction
        ds_s = cuda.shared.array((DS_M, DS_N), float32)
        # [DV] this thread's value row; [D], [DV] gradient accumulators
        v_r = cuda.local.array(DV, float32)
        dk_r = cuda.local.array(D, float32)
        dv_r = cuda.local.array(DV, float32)
        i_t = cuda.blockIdx.x
        i_kh = cuda.blockIdx.y
        tid = cuda.threadIdx.x
        b = k_tiles[i_t, TILE_SEQ]
        if b < 0:
            return
        G = q.shape[1] // k.shape[1]
        bos = int64(k_tiles[i_t, TILE_ROW])
        cols = int64(k_tiles[i_t, TILE_ROWS])
        valid = tid < cols
        j_pos = int64(k_tiles[i_t, TILE_POS]) + tid
        left = int64(win_left[b])
        right = int64(win_right[b])
        shift = (int64(k_seqlen[b]) - int64(q_seqlen[b])) * int64(bottom_right[b])
        for idx in range(tid, BN * D, BN):
            r = idx // D
            if r < cols:
                k_s[r, idx - r * D] = ld3(k, bos + r, i_kh, idx - r * D)
        for d in range(D):
            dk_r[d] = 0.0
        for d in range(DV):
            dv_r[d] = 0.0
            v_r[d] = ld3(v, bos + tid, i_kh, d) if valid else float32(0.0)
        for g in range(G):
            i_h = i_kh * G + g
            for i_seg in range(k_sched.shape[1]):
                begin = k_sched[i_t, i_seg, 0]
                fbegin = k_sched[i_t, i_seg, 1]
                fend = k_sched[i_t, i_seg, 2]
                end = k_sched[i_t, i_seg, 3]
                q_bos = int64(q_row[b, i_seg])
                q_pos0 = int64(q_pos[b, i_seg])
                q_n = int64(q_len[b, i_seg])
                for i_m in range(begin, end):
                    m0 = int64(i_m) * BM
                    n = min(int64(BM), q_n - m0)
                    cuda.syncthreads()      # the previous query tile (and dS) is consumed
                    for idx in range(tid, BM * D, BN):
                        r = idx // D
                        if r < n:
                            q_s[r, idx - r * D] = ld3(q, q_bos + m0 + r, i_h, idx - r * D)
                    for idx in range(tid, BM * DV, BN):
                        r = idx // DV
                        if r < n:
                            do_s[r, idx - r * DV] = ld3(dout, q_bos + m0 + r, i_h, idx - r * DV)
                    for r in range(tid, n, BN):
                        lse_s[r] = lse[i_h, q_bos + m0 + r]
                        dl_s[r] = delta[i_h, q_bos + m0 + r]
                    cuda.syncthreads()
                    if valid:
                        partial = i_m < fbegin or i_m >= fend
                        for i in range(n):
                            lse_i = lse_s[i]
                            ds = float32(0.0)
                            vis = lse_i > NEG_INF
                            if vis and partial:
                                i_pos = q_pos0 + m0 + i
                                vis = ((left < 0 or j_pos >= i_pos + shift - left) and
                                       (right < 0 or j_pos <= i_pos + shift + right))
                            if vis:
                                x = float32(0.0)
                                for d in range(D):
                                    x += q_s[i, d] * k_s[tid, d]
                                x = x * scale
                                th = float32(0.0)
                                if HAS_SOFTCAP:
                                    th = math.tanh(x / softcap)
                                    x = softcap * th
                                p = math.exp(x - lse_i)
                                dp = float32(0.0)
                                for d in range(DV):
                                    dp += do_s[i, d] * v_r[d]
                                    dv_r[d] += p * do_s[i, d]
                                ds = p * (dp - dl_s[i])
                                if HAS_SOFTCAP:
                                    ds = ds * (float32(1.0) - th * th)   # d/dx c*tanh(x/c)
                                ds = ds * scale
                                for d in range(D):
                                    dk_r[d] += ds * q_s[i, d]
                            if ATOMIC_DQ:
                                ds_s[i, tid] = ds
                    if ATOMIC_DQ:
                        cuda.syncthreads()
                        # dQ[i] += dS[i, :] @ K, one query row per thread
                        for i in range(tid, n, BN):
                            for d in range(D):
                                x = float32(0.0)
                                for j in range(cols):
                                    x += ds_s[i, j] * k_s[j, d]
                                if x != 0.0:
                                    cuda.atomic.add(dq_acc, (q_bos + m0 + i, i_h, d), x)
        if valid:
            for d in range(D):
                st3(dk, bos + tid, i_kh, d, dk_r[d])
            for d in range(DV):
                st3(dv, bos + tid, i_kh, d, dv_r[d])
    return cuda.jit(_dkdv)


@functools.lru_cache(maxsize=None)
def dq_kernel(var: Variant):
    """Deterministic dQ over the plan's query tiles; grid (q tiles, Hq), one row per thread."""
    BM, BN, D, DV = var.block_m, var.block_n, var.head_dim, var.head_dim_v
    HAS_SOFTCAP = var.has_softcap
    ld3, st3, _ = _io(var.dtype)

    def _dq(q, k, v, dout, lse, delta, dq, q_tiles, q_sched, k_row, k_pos, k_len, q_seqlen,
            k_seqlen, win_left, win_right, bottom_right, scale, softcap):
        # [BN, D] key tile
        k_s = cuda.shared.array((BN, D), float32)
        # [BN, DV] value tile
        v_s = cuda.shared.array((BN, DV), float32)
        # [D] query row, [DV] output-gradient row, [D] dQ accumulator
        q_r = cuda.local.array(D, float32)
        do_r = cuda.local.array(DV, float32)
        dq_r = cuda.local.array(D, float32)
        i_t = cuda.blockIdx.x
        i_h = cuda.blockIdx.y
        tid = cuda.threadIdx.x
        b = q_tiles[i_t, TILE_SEQ]
        if b < 0:
            return
        i_kh = i_h // (q.shape[1] // k.shape[1])
        valid = tid < q_tiles[i_t, TILE_ROWS]
        row = int64(q_tiles[i_t, TILE_ROW]) + tid
        i_pos = int64(q_tiles[i_t, TILE_POS]) + tid
        left = int64(win_left[b])
        right = int64(win_right[b])
        shift = (int64(k_seqlen[b]) - int64(q_seqlen[b])) * int64(bottom_right[b])
        lse_i = float32(NEG_INF)
        dl_i = float32(0.0)
        for d in range(D):
            dq_r[d] = 0.0
            q_r[d] = 0.0
        for d in range(DV):
            do_r[d] = 0.0
        if valid:
            lse_i = lse[i_h, row]
            dl_i = delta[i_h, row]
            for d in range(D):
                q_r[d] = ld3(q, row, i_h, d)
            for d in range(DV):
                do_r[d] = ld3(dout, row, i_h, d)
        for i_seg in range(q_sched.shape[1]):
            begin = q_sched[i_t, i_seg, 0]
            fbegin = q_sched[i_t, i_seg, 1]
            fend = q_sched[i_t, i_seg, 2]
            end = q_sched[i_t, i_seg, 3]
            k_bos = int64(k_row[b, i_seg])
            k_pos0 = int64(k_pos[b, i_seg])
            k_n = int64(k_len[b, i_seg])
            for i_n in range(begin, end):
                n0 = int64(i_n) * BN
                n = min(int64(BN), k_n - n0)
                cuda.syncthreads()
                for idx in range(tid, BN * D, BM):
                    r = idx // D
                    if r < n:
                        k_s[r, idx - r * D] = ld3(k, k_bos + n0 + r, i_kh, idx - r * D)
                for idx in range(tid, BN * DV, BM):
                    r = idx // DV
                    if r < n:
                        v_s[r, idx - r * DV] = ld3(v, k_bos + n0 + r, i_kh, idx - r * DV)
                cuda.syncthreads()
                if valid and lse_i > NEG_INF:
                    partial = i_n < fbegin or i_n >= fend
                    for j in range(n):
                        if partial:
                            j_pos = k_pos0 + n0 + j
                            if not ((left < 0 or j_pos >= i_pos + shift - left) and
                                    (right < 0 or j_pos <= i_pos + shift + right)):
                                continue
                        x = float32(0.0)
                        for d in range(D):
                            x += q_r[d] * k_s[j, d]
                        x = x * scale
                        th = float32(0.0)
                        if HAS_SOFTCAP:
                            th = math.tanh(x / softcap)
                            x = softcap * th
                        p = math.exp(x - lse_i)
                        dp = float32(0.0)
                        for d in range(DV):
                            dp += do_r[d] * v_s[j, d]
                        ds = p * (dp - dl_i)
                        if HAS_SOFTCAP:
                            ds = ds * (float32(1.0) - th * th)
                        ds = ds * scale
                        for d in range(D):
                            dq_r[d] += ds * k_s[j, d]
        if valid:
            for d in range(D):
                st3(dq, row, i_h, d, dq_r[d])
    return cuda.jit(_dq)
