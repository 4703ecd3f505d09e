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
from .masks import as_mask, visible

__all__ = ["attention_dense", "attention_dense_backward", "sequence_masks"]


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
    """For each sequence `b`, the bool `[Lq, Lk]` matrix of visible pairs (a Python loop)."""
    B, lq, lk, _, _ = _layout(cu_seqlens_q, cu_seqlens_k, None, None)
    m = as_mask(mask)
    left, right, br = (_per_seq(f, B) for f in m.fields())
    out = []
    for b in range(B):
        i = np.arange(lq[b])[:, None]
        j = np.arange(lk[b])[None, :]
        out.append(visible(i, j, lq[b], lk[b], left[b], right[b], br[b]))
    return out


def _sequences(q, k, cu_q, cu_k, off_q, off_k, mask):
    B, lq, lk, sq, sk = _layout(cu_q, cu_k, off_q, off_k)
    masks = sequence_masks(cu_q, cu_k, mask)
    for b in range(B):
        yield (slice(sq[b], sq[b] + lq[b]), slice(sk[b], sk[b] + lk[b]), masks[b])


def _expand_kv(x, Hq):
    """`[T, Hk, d]` -> `[T, Hq, d]` by repeating each key head for its query group."""
    return np.repeat(x, Hq // x.shape[1], axis=1)


def attention_dense(q, k, v, cu_seqlens_q, cu_seqlens_k, *, seq_offsets_q=None,
                    seq_offsets_k=None, mask="full", softmax_scale=None, softcap=0.0):
    """Forward in float64: returns `(out [Tq, Hq, Dv], lse [Hq, Tq])`, both float64.

    Non-finite inputs follow `docs/semantics.md`: NaN out and lse for the rows they reach.
    """
    (q, q_bad), (k, k_bad), (v, v_bad) = (split_finite(np.asarray(x, dtype=np.float64))
                                          for x in (q, k, v))
    Tq, Hq, D = q.shape
    scale = 1.0 / np.sqrt(D) if softmax_scale is None else float(softmax_scale)
    kx, vx, kv_bad = _expand_kv(k, Hq), _expand_kv(v, Hq), _expand_kv(k_bad | v_bad, Hq)
    out = np.zeros((Tq, Hq, v.shape[2]))
    lse = np.full((Hq, Tq), -np.inf)
    for rq, rk, ok in _sequences(q, k, cu_seqlens_q, cu_seqlens_k, seq_offsets_q,
                                 seq_offsets_k, mask):
        s = np.einsum("ihd,jhd->hij", q[rq], kx[rk]) * scale
        if softcap > 0:
            s = softcap * np.tanh(s / softcap)
        s = np.where(ok, s, -np.inf)
        has = ok.any(axis=1)                                        # [Lq]
        mx = np.where(has, s.max(axis=2, initial=-np.inf), 0.0)[:, :, None]
        p = np.where(ok, np.exp(s - mx), 0.0)
        z = p.sum(axis=2, keepdims=True)
        z1 = np.where(z > 0, z, 1.0)
        out[rq] = np.einsum("hij,jhd->ihd", p / z1, vx[rk])
        lse[:, rq] = np.where(has, (mx + np.log(z1))[:, :, 0], -np.inf)
        bad = reached(ok, q_bad[rq].T, kv_bad[rk].T)                 # [Hq, Lq]
        out[rq] = np.where(bad.T[..., None], np.nan, out[rq])
        lse[:, rq] = np.where(bad, np.nan, lse[:, rq])
    return out, lse


def attention_dense_backward(dout, q, k, v, cu_seqlens_q, cu_seqlens_k, *, seq_offsets_q=None,
                             seq_offsets_k=None, mask="full", softmax_scale=None, softcap=0.0,
                             out=None, lse=None):
    """Gradients in float64 of `sum(out * dout)`: returns `(dq, dk, dv)`.

    Recomputes the forward itself; the analytic softmax backward, with the softcap chain rule.
    `out` and `lse` (what a backend's backward is given) are optional: their values are not
    used, but their non-finite entries reach the gradients as the rules of
    `docs/semantics.md` say, as those of `dout`, `q`, `k` and `v` do.
    """
    (dout, do_bad), (q, q_bad), (k, k_bad), (v, v_bad) = (
        split_finite(np.asarray(x, dtype=np.float64)) for x in (dout, q, k, v))
    Tq, Hq, D = q.shape
    Hk = k.shape[1]
    q_bad = q_bad | do_bad
    if out is not None:
        q_bad |= split_finite(np.asarray(out, dtype=np.float64))[1]
    if lse is not None:
        q_bad |= ~np.isfinite(np.asarray(lse, dtype=np.float64)).T
    scale = 1.0 / np.sqrt(D) if softmax_scale is None else float(softmax_scale)
    kx, vx, kv_bad = _expand_kv(k, Hq), _expand_kv(v, Hq), _expand_kv(k_bad | v_bad, Hq)
    dq = np.zeros_like(q)
    dkx = np.zeros_like(kx)
    dvx = np.zeros_like(vx)
    for rq, rk, ok in _sequences(q, k, cu_seqlens_q, cu_seqlens_k, seq_offsets_q,
                                 seq_offsets_k, mask):
        raw = np.einsum("ihd,jhd->hij", q[rq], kx[rk]) * scale
        s = softcap * np.tanh(raw / softcap) if softcap > 0 else raw
        s = np.where(ok, s, -np.inf)
        has = ok.any(axis=1)
        mx = np.where(has, s.max(axis=2, initial=-np.inf), 0.0)[:, :, None]
        p = np.where(ok, np.exp(s - mx), 0.0)
        z = p.sum(axis=2, keepdims=True)
        p = p / np.where(z > 0, z, 1.0)
        do = dout[rq]
        dvx[rk] += np.einsum("hij,ihd->jhd", p, do)
        dp = np.einsum("ihd,jhd->hij", do, vx[rk])
        ds = p * (dp - (p * dp).sum(axis=2, keepdims=True))
        if softcap > 0:
            ds = ds * (1.0 - np.tanh(raw / softcap) ** 2)
        ds = ds * scale
        dq[rq] += np.einsum("hij,jhd->ihd", ds, kx[rk])
        dkx[rk] += np.einsum("hij,ihd->jhd", ds, q[rq])
        bad_q = reached(ok, q_bad[rq].T, kv_bad[rk].T).T                # [Lq, Hq]
        bad_k = reached(ok.T, kv_bad[rk].T, q_bad[rq].T).T              # [Lk, Hq]
        dq[rq] = np.where(bad_q[..., None], np.nan, dq[rq])
        dkx[rk] = np.where(bad_k[..., None], np.nan, dkx[rk])
        dvx[rk] = np.where(bad_k[..., None], np.nan, dvx[rk])
    G = Hq // Hk
    dk = dkx.reshape(k.shape[0], Hk, G, D).sum(axis=2)
    dv = dvx.reshape(v.shape[0], Hk, G, v.shape[2]).sum(axis=2)
    return dq, dk, dv
