"""The NumPy backend: the reference semantics, tiled by the plan, float64 inside.

It walks the same tile schedule as the device kernels. For each tile it gathers the partner
tiles the schedule says to visit (key tiles for a query tile; query tiles for a key tile in the
dK/dV pass), evaluates the mask only on pairs inside partially masked tiles, and computes the
tile's softmax over all its visible keys at once. Tiles are processed in batches: sorted by how
many partner rows they visit and stacked (padded to the longest) until a batch holds
`_BLOCK_BUDGET` scores, so many short sequences cost a few large array operations while one long
sequence still never needs more than a `[Hq, block_m, Lk]` block, never an `Lq x Lk` matrix.

A wrong schedule (a skipped tile that holds a visible key, a "full" tile that holds a masked
pair) gives a wrong result here, which is how the CPU tests check the schedule.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .._array import alloc
from .._nonfinite import reached, split_finite
from ..masks import visible
from ..mods import EMPTY, PARTIAL, evaluate
from ..mods.evaluate import scatter_aux_grads
from ..plan import Plan, Segments, TILE_POS, TILE_ROW, TILE_ROWS, TILE_SEQ
from ._host import DTYPES, HostBackend, forward_buffers

__all__ = ["NumpyBackend", "BACKEND", "DTYPES"]

# Scores (float64) in one batch of tiles: 2^21 = 16 MiB. A single tile may exceed it (a long
# sequence's tile x Lk block); it then forms a batch of its own.
_BLOCK_BUDGET = 1 << 21



# --------------------------------------------------------------------------------------------
# Batches of tiles
# --------------------------------------------------------------------------------------------

@dataclass
class _Batch:
    """`n` tiles of one side with their partner rows, padded.

    own: `[n, I]` packed rows of the tiles (I = most rows of a tile in the batch), `own_pos`
    global positions,
    `own_ok` which are real rows; partner: `[n, J]` the same for the visited partner rows
    (J = most partner rows of any tile in the batch), `partial` whether a partner row lies in
    a partially masked partner tile; `seq` `[n]` the tiles' sequences.
    """

    seq: np.ndarray
    own: np.ndarray
    own_pos: np.ndarray
    own_ok: np.ndarray
    partner: np.ndarray
    partner_pos: np.ndarray
    partner_ok: np.ndarray
    partial: np.ndarray


def _partner_extent(tiles, sched, other: Segments, block: int):
    """Per tile and partner segment: first local partner row and number of rows visited."""
    b = np.maximum(tiles[:, TILE_SEQ], 0)
    begin, end = sched[..., 0].astype(np.int64), sched[..., 3].astype(np.int64)
    lo = begin * block
    count = np.maximum(np.minimum(end * block, other.length[b].astype(np.int64)) - lo, 0)
    return lo, count


def _batch(tiles, sched, other: Segments, block: int, sel, classes=None) -> _Batch:
    """Gather the tiles `sel` (slot indices) and their partner rows into one padded batch.

    Partner rows are laid out tile by tile, partner segment by segment, in schedule order; the
    construction is one vectorised pass (no loop over tiles or rows). With `classes`
    (`Plan.tile_classes`, when a mask_mod is given) a partner tile's class decides: rows of an
    EMPTY tile are left out (as padding), rows of a PARTIAL one are masked pair by pair.
    """
    t = tiles[sel]
    b = t[:, TILE_SEQ].astype(np.int64)
    n, m = len(sel), sched.shape[1]
    lo, count = _partner_extent(t, sched[sel], other, block)          # [n, m]
    J = int(count.sum(axis=1).max()) if n else 0
    # one entry per visited partner row: (pair p = tile * m + segment, offset o inside the pair)
    flat = count.reshape(-1)
    pair = np.repeat(np.arange(n * m), flat)
    o = np.arange(pair.size) - np.repeat(np.cumsum(flat) - flat, flat)
    tile = pair // m
    col = (np.cumsum(count, axis=1) - count).reshape(-1)[pair] + o    # column inside the tile
    local = lo.reshape(-1)[pair] + o                                  # row inside the segment
    seg_b, seg_m = b[tile], pair % m
    ranges = sched[sel].reshape(n * m, 4)[pair]
    partner = np.zeros((n, J), np.int64)
    partner_pos = np.zeros((n, J), np.int64)
    partner_ok = np.zeros((n, J), bool)
    partial = np.zeros((n, J), bool)
    partner[tile, col] = other.row[seg_b, seg_m].astype(np.int64) + local
    partner_pos[tile, col] = other.pos[seg_b, seg_m].astype(np.int64) + local
    partner_ok[tile, col] = True
    in_tile = local // block
    partial[tile, col] = (in_tile < ranges[:, 1]) | (in_tile >= ranges[:, 2])
    if classes is not None:
        start, cls = classes
        c = cls[start[sel].reshape(-1)[pair] + in_tile - ranges[:, 0]]
        partial[tile, col] = c == PARTIAL
        partner_ok[tile, col] = c != EMPTY
    i = np.arange(int(t[:, TILE_ROWS].max()) if n else 0)
    own_ok = i[None, :] < t[:, TILE_ROWS, None]
    own = np.where(own_ok, t[:, TILE_ROW, None].astype(np.int64) + i, 0)
    own_pos = t[:, TILE_POS, None].astype(np.int64) + i
    return _Batch(b, own, own_pos, own_ok, partner, partner_pos, partner_ok, partial)


def _batches(plan: Plan, side: str, heads: int):
    """Batches of the used tiles of `side` ("q": query tiles vs key rows, for the forward and
    dQ; "k": key tiles vs query rows, for dK/dV), each within the score budget."""
    if side == "q":
        tiles, sched, other, block = plan.q_tiles, plan.q_sched, plan.k, plan.block_n
    else:
        tiles, sched, other, block = plan.k_tiles, plan.k_sched, plan.q, plan.block_m
    classes = None if plan.mask_mod is None else plan.tile_classes(side)
    used = np.flatnonzero(tiles[:, TILE_SEQ] >= 0)
    _, count = _partner_extent(tiles[used], sched[used], other, block)
    width = count.sum(axis=1)
    rows = tiles[used, TILE_ROWS].astype(np.int64)
    order = np.lexsort((rows, width))                 # by partner rows, then own rows
    used, width, rows = used[order], width[order], rows[order]
    start = 0
    while start < used.size:
        # a batch [start, stop) is padded to its widest tile and its tallest tile
        tallest = np.maximum.accumulate(rows[start:])
        cost = np.arange(1, tallest.size + 1) * tallest * np.maximum(width[start:], 1) * heads
        fits = cost <= _BLOCK_BUDGET
        stop = start + max(1, int(np.argmin(fits)) if not fits.all() else fits.size)
        yield _batch(tiles, sched, other, block, used[start:stop], classes)
        start = stop


def _take(x, rows, ok):
    """`(x[rows] in float64, bad [n, R, H])`: rows that are not real are zeroed (a pad row may
    hold anything, NaN included, and is never read), non-finite values are zeroed and flagged
    (`_nonfinite.split_finite`)."""
    g = x[rows].astype(np.float64, copy=False)
    if not ok.all():
        g[~ok] = 0.0
    return split_finite(g, ok)


def _allowed(plan: Plan, bt: _Batch, side: str):
    """Bool `[n, I, J]` (query rows x key rows of each tile's block): the visible pairs.

    The mask predicate (and the plan's mask_mod) is evaluated only on pairs whose partner row
    lies in a partially masked tile; fully visible tiles take no mask arithmetic.
    """
    if side == "q":
        q_ok, k_ok, qpos, kpos = bt.own_ok, bt.partner_ok, bt.own_pos, bt.partner_pos
        pair_partial = bt.partial[:, None, :] & bt.own_ok[:, :, None]
    else:
        q_ok, k_ok, qpos, kpos = bt.partner_ok, bt.own_ok, bt.partner_pos, bt.own_pos
        pair_partial = bt.partial[:, :, None] & bt.own_ok[:, None, :]
    allowed = q_ok[:, :, None] & k_ok[:, None, :]
    n_i, i_i, j_i = np.nonzero(pair_partial & allowed)
    if n_i.size:
        b = bt.seq[n_i]
        view = plan.view()
        policy = (f[b].astype(np.int64) for f in (view.seqlen_q, view.seqlen_k,
                                                  view.window_left, view.window_right,
                                                  view.bottom_right))
        ok = visible(qpos[n_i, i_i], kpos[n_i, j_i], *policy)
        mod = plan.mask_mod
        if mod is not None:
            ok &= evaluate(mod.graph, {"b": b.astype(np.int64), "q_idx": qpos[n_i, i_i],
                                       "k_idx": kpos[n_i, j_i]}, mod.aux)
        allowed[n_i, i_i, j_i] = ok
    return allowed


def _positions(bt: _Batch, side: str, Hk: int, G: int):
    """The leaves of a score_mod over a batch's `[n, Hk, G, I, J]` scores (query rows x key
    rows): sequence, query head, query and key positions."""
    qpos, kpos = (bt.own_pos, bt.partner_pos) if side == "q" else (bt.partner_pos, bt.own_pos)
    h = np.arange(Hk)[:, None] * G + np.arange(G)
    return {"b": bt.seq.astype(np.int64)[:, None, None, None, None],
            "h": h.reshape(1, Hk, G, 1, 1),
            "q_idx": qpos[:, None, None, :, None], "k_idx": kpos[:, None, None, None, :]}


def _dropout_factor(dropout, bt: _Batch, side: str, Hk: int, G: int):
    """Float64 `[n, Hk, G, I, J]`: `1 / (1 - p)` where the pair is kept, 0 where dropped
    (`varlen.dropout`: the bits depend on positions only, never on the tiling)."""
    at = _positions(bt, side, Hk, G)
    keep = dropout.keep(at["b"], at["h"], at["q_idx"], at["k_idx"])
    return np.where(keep, dropout.scale, 0.0)


def _modified(s, allowed, score_mod, leaves):
    """`(score_mod(s) with hidden pairs at -inf, the pairs still visible)` (float64)."""
    s = evaluate(score_mod.graph, {**leaves, "score": s}, score_mod.aux)
    seen = allowed[:, None, None] & (s != -np.inf)
    return np.where(seen, s, -np.inf), seen


def _scores(allowed, qt, kt, scale, softcap):
    """Scores `[n, Hk, G, I, J]` from `qt [n, Hk, G, I, D]` and `kt [n, Hk, 1, J, D]`, with
    pairs that are not `allowed` at -inf, and `tanh(s / softcap)` for the softcap gradient."""
    s = (qt @ kt.swapaxes(-1, -2)) * scale
    th = None
    if softcap > 0:
        th = np.tanh(s / softcap)
        s = softcap * th
    return np.where(allowed[:, None, None], s, -np.inf), th


def _q_heads(x, Hk, G):
    """Gathered query-side rows `[n, I, Hq, d]` -> `[n, Hk, G, I, d]` (head h = kv head h // G)."""
    n, I, _, d = x.shape
    # contiguous, so matmul hands each [I, d] block to BLAS
    return np.ascontiguousarray(x.reshape(n, I, Hk, G, d).transpose(0, 2, 3, 1, 4))


def _k_heads(x):
    """Gathered key-side rows `[n, J, Hk, d]` -> `[n, Hk, 1, J, d]` (shared by a head group)."""
    return np.ascontiguousarray(x.transpose(0, 2, 1, 3))[:, :, None]


def _flags_q(bad, Hk, G):
    """Query-side flags `[n, I, Hq]` -> `[n, Hk, G, I]`."""
    n, I, _ = bad.shape
    return bad.reshape(n, I, Hk, G).transpose(0, 2, 3, 1)


def _flags_k(bad):
    """Key-side flags `[n, J, Hk]` -> `[n, Hk, 1, J]`."""
    return bad.transpose(0, 2, 1)[:, :, None]


def _to_rows(x):
    """`[n, Hk, G, I, d]` -> `[n, I, Hq, d]`."""
    n, Hk, G, I, d = x.shape
    return x.transpose(0, 3, 1, 2, 4).reshape(n, I, Hk * G, d)


# --------------------------------------------------------------------------------------------
# Forward and backward
# --------------------------------------------------------------------------------------------

def _forward_batch(plan, bt, q, k, v, Hk, G, scale, softcap, score_mod=None, dropout=None):
    """`(o [n, Hk, G, I, Dv], row_lse [n, Hk, G, I])` of one batch of query tiles."""
    (qg, q_bad), (kg, k_bad), (vg, v_bad) = (
        _take(x, rows, ok) for x, rows, ok in ((q, bt.own, bt.own_ok), (k, bt.partner,
                                              bt.partner_ok), (v, bt.partner, bt.partner_ok)))
    allowed = _allowed(plan, bt, "q")
    s, _ = _scores(allowed, _q_heads(qg, Hk, G), _k_heads(kg), scale, softcap)
    seen = allowed[:, None, None]                                     # pairs in the softmax
    if score_mod is not None:
        s, seen = _modified(s, allowed, score_mod, _positions(bt, "q", Hk, G))
    mx = s.max(axis=-1, keepdims=True, initial=-np.inf)              # [n, Hk, G, I, 1]
    dead = mx == -np.inf                                              # no visible key
    with np.errstate(invalid="ignore"):                               # a score_mod's +inf
        p = np.exp(s - np.where(dead, 0.0, mx))
    denom = np.where(dead, 1.0, p.sum(axis=-1, keepdims=True))
    p = p / denom
    if dropout is not None:                       # FlashAttention 2: (P * keep / (1-p)) V
        p = p * _dropout_factor(dropout, bt, "q", Hk, G)
    o = p @ _k_heads(vg)                                              # [n, Hk, G, I, Dv]
    row_lse = np.where(dead, -np.inf, mx + np.log(denom))[..., 0]     # [n, Hk, G, I]
    if q_bad.any() or k_bad.any() or v_bad.any():
        bad = reached(seen, _flags_q(q_bad, Hk, G), _flags_k(k_bad | v_bad))
        o[bad] = np.nan
        row_lse[bad] = np.nan
    return o, row_lse


def _forward(plan: Plan, q, k, v, *, softmax_scale: float, softcap: float, mods=None,
             dropout=None):
    """`out [Tq, Hq, Dv]` in q's dtype and `lse [Hq, Tq]` (float64 for float64, else float32)."""
    score_mod = None if mods is None else mods.score
    Hq, Hk, Dv = q.shape[1], k.shape[1], v.shape[2]
    out, lse = forward_buffers(plan, q, Dv, out_dtype=q.dtype,
                               lse_dtype=np.float64 if q.dtype == np.float64 else np.float32)
    for bt in _batches(plan, "q", Hq):
        n, I = bt.own.shape
        o, row_lse = _forward_batch(plan, bt, q, k, v, Hk, Hq // Hk, softmax_scale, softcap,
                                    score_mod, dropout)
        rows = bt.own[bt.own_ok]
        out[rows] = _to_rows(o)[bt.own_ok].astype(q.dtype)
        # an lse past float32's range rounds to +inf (docs/semantics.md, "Overflow")
        with np.errstate(over="ignore"):
            lse[:, rows] = row_lse.transpose(1, 2, 0, 3).reshape(Hq, n, I)[:, bt.own_ok]
    return out, lse


def _probs(s, row_lse):
    """P = exp(S - lse); rows with lse = -inf saw no key, so P = 0 (not NaN) there."""
    finite = np.isfinite(row_lse)
    return np.where(finite, np.exp(s - np.where(finite, row_lse, 0.0)), 0.0)


class _Grads:
    """Per batch of tiles: Q, dO `[n, Hk, G, I, d]`, K `[n, Hk, 1, J, D]`, P and scaled dS
    `[n, Hk, G, I, J]` (I query rows x J key rows per tile), and the non-finite flags of the
    query side (q, dout, out, lse) `[n, Hk, G, I]` and key side (k, v) `[n, Hk, 1, J]`."""

    def __init__(self, plan, bt, side, arrays, scale, softcap, mods=None, daux=None,
                 dropout=None):
        dout, q, k, v, delta, lse = arrays
        Hk, G = delta.shape[1:]
        if side == "q":
            qrows, q_ok, krows, k_ok = bt.own, bt.own_ok, bt.partner, bt.partner_ok
        else:
            qrows, q_ok, krows, k_ok = bt.partner, bt.partner_ok, bt.own, bt.own_ok
        (qg, q_bad), (dog, do_bad) = _take(q, qrows, q_ok), _take(dout, qrows, q_ok)
        (kg, k_bad), (vg, v_bad) = _take(k, krows, k_ok), _take(v, krows, k_ok)
        (row_delta, delta_bad), (row_lse, lse_bad) = (
            _take(a[..., None], qrows, q_ok) for a in (delta, lse))          # [n, I, Hk, G, 1]
        self.qt, self.dot = _q_heads(qg, Hk, G), _q_heads(dog, Hk, G)
        self.kt, vt = _k_heads(kg), _k_heads(vg)
        self.allowed = _allowed(plan, bt, side)
        s, th = _scores(self.allowed, self.qt, self.kt, scale, softcap)
        score_mod = None if mods is None else mods.score
        self.seen = self.allowed[:, None, None]                        # pairs in the softmax
        if score_mod is not None:
            leaves = _positions(bt, side, Hk, G)
            s_in = s
            s, seen = _modified(s, self.allowed, score_mod, leaves)
            self.seen = seen
        lse_q = np.where(lse_bad[..., None] | ~q_ok[..., None, None, None], -np.inf, row_lse)
        with np.errstate(invalid="ignore"):
            self.p = _probs(s, lse_q.transpose(0, 2, 3, 1, 4))
        dp = self.dot @ vt.swapaxes(-1, -2)
        # With dropout, out = (P * factor) V: dV takes P * factor, dP the factor; delta =
        # rowsum(dO * out) is still rowsum(P * dP) (FlashAttention 2's backward).
        self.pv = self.p
        if dropout is not None:
            factor = _dropout_factor(dropout, bt, side, Hk, G)
            self.pv = self.p * factor
            dp = dp * factor
        ds = self.p * (dp - row_delta.transpose(0, 2, 3, 1, 4))
        if score_mod is not None:
            if daux is not None:
                scatter_aux_grads(score_mod, leaves, ds, seen, daux)
            with np.errstate(all="ignore"):
                d_mod = evaluate(score_mod.d_score(), {**leaves, "score": s_in},
                                 score_mod.aux)
            ds = np.where(seen, ds * d_mod, 0.0)
        if th is not None:
            ds = ds * (1.0 - th * th)                                 # d/dx c*tanh(x/c)
        self.ds = ds * scale
        self.q_bad = _flags_q(q_bad | do_bad, Hk, G) | (delta_bad | lse_bad).transpose(0, 2, 3, 1)
        self.k_bad = _flags_k(k_bad | v_bad)

    def any_bad(self):
        return self.q_bad.any() or self.k_bad.any()


def _backward(plan: Plan, dout, q, k, v, out, lse, *, softmax_scale: float, softcap: float,
              deterministic: bool = False, mods=None, dropout=None):
    """`(dq, dk, dv)` in the input dtypes, as the kernels do it (FlashAttention-2, Alg. 2).

    dQ walks the query tiles (`q_sched`); dK and dV walk the key tiles (`k_sched`), so each
    output row is written exactly once. Always deterministic.
    """
    Tq, Hq, _ = q.shape
    Hk, Dv = k.shape[1], v.shape[2]
    G = Hq // Hk
    # FA-2 preprocess: delta = rowsum(dO * O) per query row and head, [Tq, Hk, G]; a
    # non-finite dO or O row makes its delta non-finite, which flags the row.
    delta = np.einsum("ikgd,ikgd->ikg",
                      dout.astype(np.float64, copy=False).reshape(Tq, Hk, G, Dv),
                      out.astype(np.float64, copy=False).reshape(Tq, Hk, G, Dv))
    arrays = (dout, q, k, v, delta, lse.astype(np.float64).T.reshape(Tq, Hk, G))
    dq = alloc(np, q.shape, q.dtype)
    dq[~plan.q.covered()] = 0
    daux = None
    if mods is not None and mods.aux_grads:
        daux = [np.zeros(a.shape) if kind == "float" else None
                for (kind, _, _), a in zip(mods.score.graph.aux, mods.score.aux)]
    for bt in _batches(plan, "q", Hq):
        # the query pass meets every visible pair once: the aux gradients are summed here
        g = _Grads(plan, bt, "q", arrays, softmax_scale, softcap, mods, daux, dropout)
        dq_t = g.ds @ g.kt                                            # [n, Hk, G, I, D]
        if g.any_bad():
            dq_t[reached(g.seen, g.q_bad, g.k_bad)] = np.nan
        dq[bt.own[bt.own_ok]] = _to_rows(dq_t)[bt.own_ok].astype(q.dtype)
    dk = alloc(np, k.shape, k.dtype)
    dv = alloc(np, v.shape, v.dtype)
    kpad = ~plan.k.covered()
    dk[kpad] = 0
    dv[kpad] = 0
    for bt in _batches(plan, "k", Hq):
        g = _Grads(plan, bt, "k", arrays, softmax_scale, softcap, mods, dropout=dropout)
        # GQA: a key head's gradient sums its group of query heads (axis 2)
        dk_t = (g.ds.swapaxes(-1, -2) @ g.qt).sum(axis=2)              # [n, Hk, J, D]
        dv_t = (g.pv.swapaxes(-1, -2) @ g.dot).sum(axis=2)
        if g.any_bad():
            # the transposed visibility: key j (rows) against the group's query rows
            bad = reached(g.seen.swapaxes(-1, -2), g.k_bad[..., 0, :][:, :, None],
                          g.q_bad).any(axis=2)                        # [n, Hk, J]
            dk_t[bad] = np.nan
            dv_t[bad] = np.nan
        rows = bt.own[bt.own_ok]
        dk[rows] = dk_t.transpose(0, 2, 1, 3)[bt.own_ok].astype(k.dtype)
        dv[rows] = dv_t.transpose(0, 2, 1, 3)[bt.own_ok].astype(v.dtype)
    if daux is not None:
        return dq, dk, dv, tuple(None if g is None else g.astype(np.float32) for g in daux)
    return dq, dk, dv


class NumpyBackend(HostBackend):
    """The host backend: float64 arithmetic over the plan's tile schedule."""

    name = "numpy"
    runs_mods = frozenset({"mask_mod", "score_mod", "aux_grads"})
    runs_dropout = True
    run_forward = staticmethod(_forward)
    run_backward = staticmethod(_backward)


BACKEND = NumpyBackend()
