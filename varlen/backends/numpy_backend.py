"""The NumPy backend: the reference semantics, tiled by the plan, float64 inside.

It walks the same tile schedule as the device kernels: for each query tile it gathers the key
tiles the schedule says to visit, evaluates the mask only on the partially masked ones, and
computes that tile's softmax over all its visible keys at once. Memory is bounded by one
`[Hq, block_m, Lk]` block, so a single 32k-token sequence never builds an `Lq x Lk` matrix.
A wrong schedule (a skipped tile that holds a visible key, a "full" tile that holds a masked
pair) gives a wrong result here, which is how the CPU tests check the schedule.
"""
from __future__ import annotations

import numpy as np

from .._array import empty
from ..masks import visible
from ..plan import Plan, TILE_POS, TILE_ROW, TILE_ROWS, TILE_SEQ

name = "numpy"
DTYPES = ("float16", "bfloat16", "float32", "float64")


def supports(*, dtype, head_dim, head_dim_v, on_device):
    if on_device:
        return "the numpy backend runs on the host; the arrays live on a CUDA device"
    return None


def default_blocks(dtype, head_dim):
    return 64, 64


def check_plan(plan: Plan):
    if not plan.on_host:
        return "its arrays live on a device; build it from host cu_seqlens for host data"
    return None


def _partners(seg, b: int, ranges, block: int):
    """Rows, global positions and partial-tile flags of the tiles a schedule row visits.

    `seg` holds the partner segments (keys for a query tile, queries for a key tile), `ranges`
    is that tile's `[m, 4]` schedule row. Returns None when every partner tile is skipped.
    """
    rows, pos, partial = [], [], []
    for m in range(ranges.shape[0]):
        begin, fbegin, fend, end = (int(x) for x in ranges[m])
        if begin == end:
            continue
        local = np.arange(begin * block, min(end * block, int(seg.length[b, m])))
        rows.append(int(seg.row[b, m]) + local)
        pos.append(int(seg.pos[b, m]) + local)
        tile = local // block
        partial.append((tile < fbegin) | (tile >= fend))
    if not rows:
        return None
    return np.concatenate(rows), np.concatenate(pos), np.concatenate(partial)


def _scores(plan: Plan, b: int, qt, kt, qpos, kpos, q_partial, k_partial, scale, softcap):
    """Scores `[Hk, G, nq, nk]` with the mask applied on partial tiles only.

    Also returns `tanh(s / softcap)` (for the softcap gradient) or None.
    """
    s = np.einsum("ikgd,jkd->kgij", qt, kt) * scale
    th = None
    if softcap > 0:
        th = np.tanh(s / softcap)
        s = softcap * th
    if q_partial.any() and k_partial.any():
        policy = (int(plan.q.seqlen[b]), int(plan.k.seqlen[b]), int(plan.window_left[b]),
                  int(plan.window_right[b]), int(plan.bottom_right[b]))
        block = np.ix_(q_partial, k_partial)
        vis = visible(qpos[q_partial][:, None], kpos[k_partial][None, :], *policy)
        sub = s[:, :, block[0], block[1]]
        s[:, :, block[0], block[1]] = np.where(vis, sub, -np.inf)
    return s, th


def _used(tiles):
    """Used tile slots, as (slot, sequence, first row, rows)."""
    for t in np.flatnonzero(tiles[:, TILE_SEQ] >= 0):
        yield int(t), int(tiles[t, TILE_SEQ]), int(tiles[t, TILE_ROW]), int(tiles[t, TILE_ROWS])


def _positions(tiles, t, n):
    return int(tiles[t, TILE_POS]) + np.arange(n)


def forward(plan: Plan, q, k, v, *, softmax_scale: float, softcap: float):
    """`out [Tq, Hq, Dv]` in q's dtype and `lse [Hq, Tq]` (float64 for float64, else float32)."""
    Tq, Hq, _ = q.shape
    Hk, Dv = k.shape[1], v.shape[2]
    G = Hq // Hk
    lse_dtype = np.float64 if q.dtype == np.float64 else np.float32
    out = empty(np, (Tq, Hq, Dv), q.dtype)
    lse = empty(np, (Hq, Tq), lse_dtype)
    # Rows outside every segment are padding: output 0, no visible key.
    pad = ~plan.q.covered()
    out[pad] = 0
    lse[:, pad] = -np.inf
    for t, b, r0, n in _used(plan.q_tiles):
        keys = _partners(plan.k, b, plan.q_sched[t], plan.block_n)
        if keys is None:
            out[r0:r0 + n] = 0
            lse[:, r0:r0 + n] = -np.inf
            continue
        cols, kpos, k_partial = keys
        qt = q[r0:r0 + n].astype(np.float64).reshape(n, Hk, G, -1)
        s, _ = _scores(plan, b, qt, k[cols].astype(np.float64), _positions(plan.q_tiles, t, n),
                       kpos, np.ones(n, bool), k_partial, softmax_scale, softcap)
        mx = s.max(axis=-1, keepdims=True)                            # [Hk, G, n, 1]
        dead = ~np.isfinite(mx)                                       # no visible key
        p = np.exp(s - np.where(dead, 0.0, mx))
        denom = np.where(dead, 1.0, p.sum(axis=-1, keepdims=True))
        o = np.einsum("kgij,jkd->ikgd", p / denom, v[cols].astype(np.float64))
        out[r0:r0 + n] = o.reshape(n, Hq, Dv).astype(q.dtype)
        row_lse = np.where(dead, -np.inf, mx + np.log(denom))[..., 0]    # [Hk, G, n]
        lse[:, r0:r0 + n] = row_lse.reshape(Hq, n)
    return out, lse


def _probs(s, row_lse):
    """P = exp(S - lse); rows with lse = -inf saw no key, so P = 0 (not NaN) there."""
    finite = np.isfinite(row_lse)
    return np.where(finite, np.exp(s - np.where(finite, row_lse, 0.0)), 0.0)


def backward(plan: Plan, dout, q, k, v, out, lse, *, softmax_scale: float, softcap: float,
             deterministic: bool = False):
    """`(dq, dk, dv)` in the input dtypes, as the kernels do it (FlashAttention-2, Alg. 2).

    dQ walks the query tiles (`q_sched`); dK and dV walk the key tiles (`k_sched`), so each
    output row is written exactly once. Always deterministic.
    """
    Tq, Hq, D = q.shape
    Tk, Hk, Dv = v.shape
    G = Hq // Hk
    f64 = np.float64
    # FA-2 preprocess: delta = rowsum(dO * O), [Hk, G, Tq].
    delta = np.einsum("ikgd,ikgd->kgi", dout.astype(f64).reshape(Tq, Hk, G, Dv),
                      out.astype(f64).reshape(Tq, Hk, G, Dv))
    lse64 = lse.astype(f64).reshape(Hk, G, Tq)

    def grads(b, qrows, qpos, q_partial, krows, kpos, k_partial):
        """P and dS `[Hk, G, nq, nk]` of a block of query rows against key rows."""
        nq = qrows.shape[0]
        qt = q[qrows].astype(f64).reshape(nq, Hk, G, D)
        dot = dout[qrows].astype(f64).reshape(nq, Hk, G, Dv)
        kt, vt = k[krows].astype(f64), v[krows].astype(f64)
        s, th = _scores(plan, b, qt, kt, qpos, kpos, q_partial, k_partial, softmax_scale,
                        softcap)
        p = _probs(s, lse64[:, :, qrows, None])
        ds = p * (np.einsum("ikgd,jkd->kgij", dot, vt) - delta[:, :, qrows, None])
        if th is not None:
            ds = ds * (1.0 - th * th)                                 # d/dx c*tanh(x/c)
        return qt, dot, kt, p, ds * softmax_scale

    dq = empty(np, q.shape, q.dtype)
    dq[~plan.q.covered()] = 0
    for t, b, r0, n in _used(plan.q_tiles):
        keys = _partners(plan.k, b, plan.q_sched[t], plan.block_n)
        if keys is None:
            dq[r0:r0 + n] = 0
            continue
        cols, kpos, k_partial = keys
        qrows = np.arange(r0, r0 + n)
        _, _, kt, _, ds = grads(b, qrows, _positions(plan.q_tiles, t, n), np.ones(n, bool),
                                cols, kpos, k_partial)
        dq[r0:r0 + n] = np.einsum("kgij,jkd->ikgd", ds, kt).reshape(n, Hq, D).astype(q.dtype)

    dk = empty(np, k.shape, k.dtype)
    dv = empty(np, v.shape, v.dtype)
    kpad = ~plan.k.covered()
    dk[kpad] = 0
    dv[kpad] = 0
    for t, b, c0, n in _used(plan.k_tiles):
        queries = _partners(plan.q, b, plan.k_sched[t], plan.block_m)
        if queries is None:
            dk[c0:c0 + n] = 0
            dv[c0:c0 + n] = 0
            continue
        qrows, qpos, q_partial = queries
        krows = np.arange(c0, c0 + n)
        qt, dot, _, p, ds = grads(b, qrows, qpos, q_partial, krows,
                                  _positions(plan.k_tiles, t, n), np.ones(n, bool))
        dk[c0:c0 + n] = np.einsum("kgij,ikgd->jkd", ds, qt).astype(k.dtype)
        dv[c0:c0 + n] = np.einsum("kgij,ikgd->jkd", p, dot).astype(v.dtype)
    return dq, dk, dv
