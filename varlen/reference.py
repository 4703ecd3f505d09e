"""The float64 reference: dense, per sequence, straight from the semantics in DESIGN.md.

This is the spec every backend is measured against. It shares no code with the tiled paths:
no plan, no schedule, one `[Lq, Lk]` score matrix per sequence built from the visibility
predicate, and an analytic backward. Use it for small and medium batches (memory `Lq * Lk`
per sequence and head).

Conventions: `q [Tq, Hq, D]`, `k [Tk, Hk, D]`, `v [Tk, Hk, Dv]`, query head `h` reads key head
`h // (Hq // Hk)`; `lse [Hq, Tq]` natural log; rows outside every sequence (padding) get output
0, lse -inf and zero gradients; a query with no visible key gets output 0 and lse -inf.
Positions are local to each sequence.
"""
from __future__ import annotations

import numpy as np

from ._nonfinite import reached, split_finite
from .dropout import make_dropout
from .masks import visible
from .mods import evaluate, split_mask
from .mods.evaluate import scatter_aux_grads

__all__ = ["attention_dense", "attention_dense_backward", "sequence_masks", "dropout_keep"]


def _per_seq(field, B):
    a = np.asarray(field)
    return np.broadcast_to(a.astype(np.int64), (B,)) if a.ndim == 0 else a.astype(np.int64)


def _layout(cu_q, cu_k, off_q, off_k):
    cu_q = np.asarray(cu_q, dtype=np.int64)
    cu_k = np.asarray(cu_k, dtype=np.int64)
    B = len(cu_q) - 1
    lq, lk = np.diff(cu_q), np.diff(cu_k)
    start_q = cu_q[:B] if off_q is None else np.asarray(off_q, dtype=np.int64)[:B]
    start_k = cu_k[:B] if off_k is None else np.asarray(off_k, dtype=np.int64)[:B]
    return B, lq, lk, start_q, start_k


def sequence_masks(cu_seqlens_q, cu_seqlens_k, mask="full"):
    """For each sequence `b`, the bool `[Lq, Lk]` matrix of visible pairs (a Python loop).

    `mask` may hold a `MaskMod` (`Mask & MaskMod`): its function is evaluated on every pair.
    """
    B, lq, lk, _, _ = _layout(cu_seqlens_q, cu_seqlens_k, None, None)
    m, mod = split_mask(mask)
    left, right, br = (_per_seq(f, B) for f in m.fields())
    aux = () if mod is None else tuple(_host(a) for a in mod.aux)
    out = []
    for b in range(B):
        i = np.arange(lq[b])[:, None]
        j = np.arange(lk[b])[None, :]
        ok = visible(i, j, lq[b], lk[b], left[b], right[b], br[b])
        if mod is not None:
            ok = ok & evaluate(mod.graph, {"b": np.int64(b), "q_idx": i, "k_idx": j}, aux)
        out.append(ok)
    return out


def dropout_keep(cu_seqlens_q, cu_seqlens_k, heads, dropout_p, seed, offset=0):
    """For each sequence `b`, the bool `[heads, Lq, Lk]` keep set of dropout (a Python loop).

    Args:
        cu_seqlens_q, cu_seqlens_k: `[B+1]` cumulative lengths.
        heads: `Hq`, the number of query heads.
        dropout_p: the drop probability in [0, 1); seed: int in [0, 2**64) (may be None when
            `dropout_p == 0`); offset: int in [0, 2**32). As for `varlen.attention_forward`.

    Entry `[h, i, j]` is True where pair (query i, key j) of query head h is kept, whether or
    not the mask shows it: every backend drops exactly these (docs/semantics.md, "Dropout").
    """
    d = make_dropout(dropout_p, seed, offset)
    B, lq, lk, _, _ = _layout(cu_seqlens_q, cu_seqlens_k, None, None)
    out = []
    for b in range(B):
        shape = (heads, int(lq[b]), int(lk[b]))
        if d is None:
            out.append(np.ones(shape, bool))
            continue
        out.append(d.keep(b, np.arange(heads)[:, None, None], np.arange(lq[b])[None, :, None],
                          np.arange(lk[b])[None, None, :]))
    return out


def _dropout_factor(cu_q, cu_k, Hq, dropout_p, seed, offset):
    """Per sequence the float64 `[Hq, Lq, Lk]` factor of the probabilities: `keep / (1 - p)`
    (None per sequence without dropout)."""
    d = make_dropout(dropout_p, seed, offset)
    B = len(np.asarray(cu_q)) - 1
    if d is None:
        return [None] * B
    return [k * d.scale for k in dropout_keep(cu_q, cu_k, Hq, dropout_p, seed, offset)]


def _host(a):
    """A host NumPy copy of an aux array of any framework."""
    from ._array import host_copy
    return np.asarray(host_copy(a))


def _modified(score_mod, s, b, rq_len, rk_len):
    """`(score_mod(s), leaves)` over one sequence's `[Hq, Lq, Lk]` scores (float64)."""
    Hq = s.shape[0]
    leaves = {"score": s, "b": np.int64(b), "h": np.arange(Hq)[:, None, None],
              "q_idx": np.arange(rq_len)[None, :, None], "k_idx": np.arange(rk_len)[None, None, :]}
    aux = tuple(_host(a) for a in score_mod.aux)
    return evaluate(score_mod.graph, leaves, aux), leaves, aux


def _sequences(q, k, cu_q, cu_k, off_q, off_k, mask):
    B, lq, lk, sq, sk = _layout(cu_q, cu_k, off_q, off_k)
    masks = sequence_masks(cu_q, cu_k, mask)
    for b in range(B):
        yield (b, slice(sq[b], sq[b] + lq[b]), slice(sk[b], sk[b] + lk[b]), masks[b])


def _softmax_terms(s, seen, sinks):
    """`(p, z, m)` of one sequence's masked scores `s [Hq, Lq, Lk]`: unnormalised weights
    `exp(s - m)` of the visible pairs, their sum `z` with the sink's `exp(sinks[h] - m)` in
    (`[Hq, Lq, 1]`), and the shift `m` (the row's largest logit, 0 where there is none)."""
    top = np.where(seen.any(axis=-1), s.max(axis=2, initial=-np.inf), -np.inf)[:, :, None]
    sink = None
    if sinks is not None:
        sink = np.asarray(sinks, dtype=np.float64).reshape(-1, 1, 1)
        top = np.maximum(top, sink)
    mx = np.where(np.isneginf(top), 0.0, top)
    with np.errstate(invalid="ignore", over="ignore"):
        p = np.where(seen, np.exp(s - mx), 0.0)
        z = p.sum(axis=2, keepdims=True)
        if sink is not None:
            z = z + np.exp(sink - mx)
    return p, z, mx


def _expand_kv(x, Hq):
    """`[T, Hk, d]` -> `[T, Hq, d]` by repeating each key head for its query group."""
    return np.repeat(x, Hq // x.shape[1], axis=1)


def attention_dense(q, k, v, cu_seqlens_q, cu_seqlens_k, *, seq_offsets_q=None,
                    seq_offsets_k=None, mask="full", softmax_scale=None, softcap=0.0,
                    score_mod=None, sinks=None, dropout_p=0.0, seed=None, offset=0):
    """Forward in float64: returns `(out [Tq, Hq, Dv], lse [Hq, Tq])`, both float64.

    With `dropout_p > 0` (and a `seed`, `offset` as in `varlen.attention_forward`) the
    output is FlashAttention 2's `(P * keep / (1 - p)) @ V` with the keep set of
    `dropout_keep`; `lse` is that of the softmax without dropout.

    Non-finite inputs follow `docs/semantics.md`: NaN out and lse for the rows they reach.
    `mask` may be a `MaskMod` (or `Mask & MaskMod`); `score_mod` a `ScoreMod`, applied after
    the softcap; a pair it sends to -inf is hidden, and a row left without a pair has output 0
    and lse -inf. `sinks` (`[Hq]`): one more logit per query head in every row's softmax,
    with no value; such a row's lse is then `sinks[h]`.
    """
    (q, q_bad), (k, k_bad), (v, v_bad) = (split_finite(np.asarray(x, dtype=np.float64))
                                          for x in (q, k, v))
    Tq, Hq, D = q.shape
    scale = 1.0 / np.sqrt(D) if softmax_scale is None else float(softmax_scale)
    kx, vx, kv_bad = _expand_kv(k, Hq), _expand_kv(v, Hq), _expand_kv(k_bad | v_bad, Hq)
    out = np.zeros((Tq, Hq, v.shape[2]))
    lse = np.full((Hq, Tq), -np.inf)
    drop = _dropout_factor(cu_seqlens_q, cu_seqlens_k, Hq, dropout_p, seed, offset)
    for b, rq, rk, ok in _sequences(q, k, cu_seqlens_q, cu_seqlens_k, seq_offsets_q,
                                    seq_offsets_k, mask):
        s = np.einsum("ihd,jhd->hij", q[rq], kx[rk]) * scale
        if softcap > 0:
            s = softcap * np.tanh(s / softcap)
        seen = ok
        if score_mod is not None:
            s = _modified(score_mod, s, b, ok.shape[0], ok.shape[1])[0]
            seen = ok & (s != -np.inf)                              # [Hq, Lq, Lk]
        s = np.where(seen, s, -np.inf)
        p, z, mx = _softmax_terms(s, seen, sinks)
        z1 = np.where(z > 0, z, 1.0)
        pd = p / z1 if drop[b] is None else p / z1 * drop[b]
        out[rq] = np.einsum("hij,jhd->ihd", pd, vx[rk])
        lse[:, rq] = np.where(z > 0, mx + np.log(z1), -np.inf)[:, :, 0]
        bad = reached(seen, q_bad[rq].T, kv_bad[rk].T)               # [Hq, Lq]
        if score_mod is not None:                   # NaN or +inf at a visible pair
            bad = bad | (seen & ~np.isfinite(s)).any(axis=-1)
        out[rq] = np.where(bad.T[..., None], np.nan, out[rq])
        lse[:, rq] = np.where(bad, np.nan, lse[:, rq])
    return out, lse


def attention_dense_backward(dout, q, k, v, cu_seqlens_q, cu_seqlens_k, *, seq_offsets_q=None,
                             seq_offsets_k=None, mask="full", softmax_scale=None, softcap=0.0,
                             out=None, lse=None, score_mod=None, aux_grads=False,
                             sinks=None, dropout_p=0.0, seed=None, offset=0):
    """Gradients in float64 of `sum(out * dout)`: returns `(dq, dk, dv)`, then with `sinks`
    their gradient `dsinks [Hq]`, then with `aux_grads` per aux array of `score_mod` its
    gradient (float64, the aux's shape) if it is a float array, else None.

    Recomputes the forward itself; the analytic softmax backward, with the softcap chain rule;
    with dropout (`dropout_p`, `seed`, `offset` of the forward) through the same keep set.
    `out` and `lse` (what a backend's backward is given) are optional: their values are not
    used, but their non-finite entries reach the gradients as the rules of
    `docs/semantics.md` say, as those of `dout`, `q`, `k` and `v` do.
    """
    (dout, do_bad), (q, q_bad), (k, k_bad), (v, v_bad) = (
        split_finite(np.asarray(x, dtype=np.float64)) for x in (dout, q, k, v))
    Tq, Hq, D = q.shape
    Hk = k.shape[1]
    q_bad = q_bad | do_bad
    row_bad = do_bad.copy()                 # rows whose dout * out is not finite
    if out is not None:
        out_bad = split_finite(np.asarray(out, dtype=np.float64))[1]
        q_bad |= out_bad
        row_bad |= out_bad
    if lse is not None:
        q_bad |= ~np.isfinite(np.asarray(lse, dtype=np.float64)).T
    scale = 1.0 / np.sqrt(D) if softmax_scale is None else float(softmax_scale)
    kx, vx, kv_bad = _expand_kv(k, Hq), _expand_kv(v, Hq), _expand_kv(k_bad | v_bad, Hq)
    dq = np.zeros_like(q)
    dkx = np.zeros_like(kx)
    dvx = np.zeros_like(vx)
    dsinks = np.zeros(Hq)
    daux = [None if score_mod is None or kind != "float" else np.zeros(np.shape(a))
            for (kind, _, _), a in zip(() if score_mod is None else score_mod.graph.aux,
                                       () if score_mod is None else score_mod.aux)]
    drop = _dropout_factor(cu_seqlens_q, cu_seqlens_k, Hq, dropout_p, seed, offset)
    for b, rq, rk, ok in _sequences(q, k, cu_seqlens_q, cu_seqlens_k, seq_offsets_q,
                                    seq_offsets_k, mask):
        raw = np.einsum("ihd,jhd->hij", q[rq], kx[rk]) * scale
        s = softcap * np.tanh(raw / softcap) if softcap > 0 else raw
        seen = ok
        if score_mod is not None:
            s_in = s
            s, leaves, aux = _modified(score_mod, s_in, b, ok.shape[0], ok.shape[1])
            seen = ok & (s != -np.inf)
        s = np.where(seen, s, -np.inf)
        p, z, mx = _softmax_terms(s, seen, sinks)
        z1 = np.where(z > 0, z, 1.0)
        p = p / z1
        do = dout[rq]
        dp = np.einsum("ihd,jhd->hij", do, vx[rk])
        if drop[b] is not None:                 # out = (P * factor) V
            dvx[rk] += np.einsum("hij,ihd->jhd", p * drop[b], do)
            dp = dp * drop[b]
        else:
            dvx[rk] += np.einsum("hij,ihd->jhd", p, do)
        d_row = (p * dp).sum(axis=2, keepdims=True)                 # rowsum(dout * out)
        ds = p * (dp - d_row)
        if sinks is not None:               # the sink's probability times (0 - D)
            sink = np.asarray(sinks, dtype=np.float64).reshape(-1, 1, 1)
            dsinks -= (np.where(z > 0, np.exp(sink - mx) / z1, 0.0) * d_row)[:, :, 0].sum(1)
        if score_mod is not None:
            if aux_grads:
                scatter_aux_grads(score_mod.with_aux(aux), leaves, ds, seen, daux)
            with np.errstate(all="ignore"):
                d_mod = evaluate(score_mod.d_score(), {**leaves, "score": s_in}, aux)
            ds = np.where(seen, ds * d_mod, 0.0)
        if softcap > 0:
            ds = ds * (1.0 - np.tanh(raw / softcap) ** 2)
        ds = ds * scale
        dq[rq] += np.einsum("hij,jhd->ihd", ds, kx[rk])
        dkx[rk] += np.einsum("hij,ihd->jhd", ds, q[rq])
        bad_q = reached(seen, q_bad[rq].T, kv_bad[rk].T).T              # [Lq, Hq]
        bad_k = reached(np.swapaxes(seen, -1, -2), kv_bad[rk].T, q_bad[rq].T).T  # [Lk, Hq]
        dq[rq] = np.where(bad_q[..., None], np.nan, dq[rq])
        if sinks is not None:   # a NaN output row, or a non-finite dout or out row: NaN
            dsinks[(bad_q | row_bad[rq]).any(axis=0)] = np.nan
        dkx[rk] = np.where(bad_k[..., None], np.nan, dkx[rk])
        dvx[rk] = np.where(bad_k[..., None], np.nan, dvx[rk])
    G = Hq // Hk
    dk = dkx.reshape(k.shape[0], Hk, G, D).sum(axis=2)
    dv = dvx.reshape(v.shape[0], Hk, G, v.shape[2]).sum(axis=2)
    extra = (() if sinks is None else (dsinks,)) + ((tuple(daux),) if aux_grads else ())
    return (dq, dk, dv, *extra)
