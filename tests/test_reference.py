"""The float64 reference itself: against a per-query loop, and gradients by finite differences."""
import numpy as np
import pytest

import varlen
from varlen import reference
from varlen.masks import visible

from helpers import make_batch


def per_query_loop(q, k, v, cu_q, cu_k, mask, scale, softcap, off_q=None, off_k=None):
    """Attention one query row and head at a time, straight from the DESIGN.md predicate."""
    m = varlen.masks.as_mask(mask)
    B = len(cu_q) - 1
    field = lambda f, b: int(np.asarray(f)[b]) if np.ndim(f) else int(f)  # noqa: E731
    Hq, Hk = q.shape[1], k.shape[1]
    out = np.zeros((q.shape[0], Hq, v.shape[2]))
    lse = np.full((Hq, q.shape[0]), -np.inf)
    for b in range(B):
        lq, lk = cu_q[b + 1] - cu_q[b], cu_k[b + 1] - cu_k[b]
        sq = cu_q[b] if off_q is None else off_q[b]
        sk = cu_k[b] if off_k is None else off_k[b]
        left, right = field(m.window_left, b), field(m.window_right, b)
        br = field(m.bottom_right, b)
        for i in range(lq):
            keys = [j for j in range(lk) if visible(i, j, lq, lk, left, right, br)]
            if not keys:
                continue
            for h in range(Hq):
                kh = h // (Hq // Hk)
                sc = np.array([q[sq + i, h] @ k[sk + j, kh] * scale for j in keys])
                if softcap:
                    sc = softcap * np.tanh(sc / softcap)
                w = np.exp(sc - sc.max())
                out[sq + i, h] = (w[:, None] * v[[sk + j for j in keys], kh]).sum(0) / w.sum()
                lse[h, sq + i] = sc.max() + np.log(w.sum())
    return out, lse


CASES = [
    ("causal", [3, 0, 5, 1], None, 0.0),
    ("full", [4, 2, 0], [1, 5, 3], 0.0),
    ("causal_bottom_right", [2, 6, 1], [5, 3, 1], 0.0),
    (varlen.Mask(window_left=1, window_right=2), [7, 4], [6, 9], 2.5),
    (varlen.Mask(window_left=np.array([-1, 2, 0], np.int32),
                 window_right=np.array([0, -1, 1], np.int32),
                 bottom_right=np.array([0, 1, 1], np.int32)), [5, 4, 6], [3, 7, 6], 0.0),
]


@pytest.mark.parametrize("mask,lq,lk,softcap", CASES,
                         ids=["causal", "full-cross", "causal_br", "band-softcap", "per-seq"])
def test_reference_matches_per_query_loop(mask, lq, lk, softcap):
    rng = np.random.default_rng(0)
    b = make_batch(rng, lq, lk, Hq=4, Hk=2, D=8, Dv=6, mask=mask, gaps=True)
    out, lse = b.ref_forward(softcap=softcap)
    want_out, want_lse = per_query_loop(b.q, b.k, b.v, b.cu_q, b.cu_k, mask, 1 / np.sqrt(8),
                                        softcap, b.off_q, b.off_k)
    np.testing.assert_allclose(out, want_out, rtol=0, atol=1e-13)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    fin = np.isfinite(want_lse)
    np.testing.assert_allclose(lse[fin], want_lse[fin], rtol=0, atol=1e-13)


@pytest.mark.parametrize("mask,lq,lk,softcap", CASES,
                         ids=["causal", "full-cross", "causal_br", "band-softcap", "per-seq"])
def test_reference_gradients_finite_differences(mask, lq, lk, softcap):
    rng = np.random.default_rng(1)
    b = make_batch(rng, lq, lk, Hq=2, Hk=1, D=4, Dv=3, mask=mask, gaps=True, garbage=0.0)
    grads = b.ref_backward(softcap=softcap)

    def loss(q, k, v):
        out, _ = reference.attention_dense(q, k, v, b.cu_q, b.cu_k, **b.layout, softcap=softcap)
        return float((out * b.dout).sum())

    h = 1e-6
    args = [b.q.copy(), b.k.copy(), b.v.copy()]
    for a, g, name in zip(range(3), grads, ("dq", "dk", "dv")):
        idx = [tuple(rng.integers(0, s) for s in args[a].shape) for _ in range(12)]
        for ix in idx:
            plus = [x.copy() for x in args]
            minus = [x.copy() for x in args]
            plus[a][ix] += h
            minus[a][ix] -= h
            fd = (loss(*plus) - loss(*minus)) / (2 * h)
            assert abs(fd - g[ix]) < 1e-6 * (1 + abs(fd)), f"{name}{ix}: fd {fd} vs {g[ix]}"


def test_seed_000_full_attention_values():
    """seeds/000: length 7, values 1 x4 then 2 x3, D=8, full attention."""
    x = np.concatenate([np.full((4, 1, 8), 1.0), np.full((3, 1, 8), 2.0)])
    cu = np.array([0, 7], np.int32)
    out, _ = reference.attention_dense(x, x, x, cu, cu)
    assert np.round(out[:4], 4).tolist() == np.full((4, 1, 8), 1.9269).tolist()
    assert np.round(out[4:], 4).tolist() == np.full((3, 1, 8), 1.9954).tolist()


def test_fully_masked_rows_are_zero_not_nan():
    # window_right = -1, window_left = 0 with bottom-right and Lk < Lq: early queries see nothing
    cu_q, cu_k = np.array([0, 6], np.int32), np.array([0, 2], np.int32)
    q = np.ones((6, 1, 4))
    k = np.ones((2, 1, 4))
    out, lse = reference.attention_dense(q, k, k, cu_q, cu_k, mask="causal_bottom_right")
    assert np.isneginf(lse[0, :4]).all() and np.isfinite(lse[0, 4:]).all()
    assert (out[:4] == 0).all() and not np.isnan(out).any()
    dq, dk, dv = reference.attention_dense_backward(np.ones_like(out), q, k, k, cu_q, cu_k,
                                                    mask="causal_bottom_right")
    assert (dq[:4] == 0).all() and not np.isnan(dq).any()
