"""Non-finite values stay inside what a row may see (docs/semantics.md, "Non-finite values").

A NaN or inf reaches exactly the rows that see it: never a row of another sequence, a masked
position or a pad row, whatever the tile size; and where it does reach, the result is NaN, never
a quiet 0 or -inf. Patterns of non-finite rows are compared with the float64 reference, which
states the rule directly, over NaN / +inf / -inf in every input of forward and backward.
"""
import numpy as np
import pytest

import varlen
from varlen import reference

from helpers import make_batch

HOST_BACKENDS = ["numpy", "cpu"]
VALUES = {"nan": np.nan, "+inf": np.inf, "-inf": -np.inf}


def _poison(a, row, head, value):
    a = a.copy()
    a[row, head, 0] = value
    return a


def _bad_rows(a):
    """Bool `[rows, heads]` of non-finite entries (lse `[H, T]` is transposed first)."""
    a = np.asarray(a, dtype=np.float64)
    return ~np.isfinite(a).all(axis=-1) if a.ndim == 3 else ~np.isfinite(a.T)


def _batch(seed=0):
    rng = np.random.default_rng(seed)
    # causal, full, empty, sliding window, length 1: the tile edges (64) fall inside sequences
    mask = varlen.Mask(window_left=np.array([-1, -1, -1, 7, -1], np.int32),
                       window_right=np.array([0, -1, 0, 0, 0], np.int32))
    return make_batch(rng, [150, 70, 0, 90, 1], Hq=4, Hk=2, D=8, mask=mask, gaps=True,
                      garbage=np.nan)


def test_issue_example_nan_in_v_reaches_only_later_queries():
    # causal L=300, NaN at v[150]: rows 150..299 are NaN, rows 0..149 untouched
    rng = np.random.default_rng(1)
    b = make_batch(rng, [300], Hq=2, Hk=1, D=8, mask="causal")
    v = _poison(b.v, 150, 0, np.nan)
    out, lse = varlen.attention_forward(b.q, b.k, v, b.cu_q, b.cu_k, mask="causal")
    bad = _bad_rows(out)[:, 0]
    assert not bad[:150].any(), f"rows {np.flatnonzero(bad[:150])} see no NaN but got one"
    assert bad[150:].all(), "rows 150..299 see v[150] and must be NaN"
    assert np.isnan(lse[0, 150:]).all() and np.isfinite(lse[0, :150]).all()
    # backward, NaN in dout[150]: dk/dv rows 0..150 (the keys query 150 sees), dq row 150
    out, lse = varlen.attention_forward(b.q, b.k, b.v, b.cu_q, b.cu_k, mask="causal")
    dq, dk, dv = varlen.attention_backward(_poison(b.dout, 150, 1, np.nan), b.q, b.k, b.v, out,
                                           lse, b.cu_q, b.cu_k, mask="causal")
    assert np.flatnonzero(_bad_rows(dq).any(axis=1)).tolist() == [150]
    for name, g in (("dk", dk), ("dv", dv)):
        rows = np.flatnonzero(_bad_rows(g)[:, 0])
        assert rows.tolist() == list(range(151)), f"{name}: NaN rows {rows}"


def _forward_patterns(b, backend, tensor, row, head, value):
    args = {"q": b.q, "k": b.k, "v": b.v}
    args[tensor] = _poison(args[tensor], row, head, value)
    kw = dict(seq_offsets_q=b.off_q, seq_offsets_k=b.off_k, mask=b.mask)
    got = varlen.attention_forward(args["q"], args["k"], args["v"], b.cu_q, b.cu_k,
                                   backend=backend, **kw)
    want = reference.attention_dense(args["q"], args["k"], args["v"], b.cu_q, b.cu_k, **kw)
    return got, want


def _sweep_positions(b, tensor, rng, n=4):
    T = getattr(b, {"lse": "q", "out": "q", "dout": "q"}.get(tensor, tensor)).shape[0]
    H = b.q.shape[1] if tensor in ("q", "out", "dout", "lse") else b.k.shape[1]
    return [(int(rng.integers(T)), int(rng.integers(H))) for _ in range(n)]


def _assert_same_pattern(label, got, want, values=True):
    """Same non-finite entries; with `values`, the finite ones agree too."""
    g, w = _bad_rows(got), _bad_rows(want)
    assert np.array_equal(g, w), (f"{label}: non-finite rows differ; only in the backend "
                                  f"{np.argwhere(g & ~w)[:5].tolist()}, only in the reference "
                                  f"{np.argwhere(w & ~g)[:5].tolist()}")
    if not values:
        return
    both = np.isfinite(np.asarray(got, np.float64)) & np.isfinite(want)
    err = np.abs(np.asarray(got, np.float64)[both] - want[both]).max(initial=0.0)
    assert err < 1e-9, f"{label}: finite entries differ from the reference by {err:.2e}"


@pytest.mark.parametrize("backend", HOST_BACKENDS)
@pytest.mark.parametrize("value", VALUES)
@pytest.mark.parametrize("tensor", ["q", "k", "v"])
def test_forward_pattern_matches_reference(backend, tensor, value):
    b = _batch()
    rng = np.random.default_rng(len(tensor) + len(value))
    for row, head in _sweep_positions(b, tensor, rng):
        (out, lse), (rout, rlse) = _forward_patterns(b, backend, tensor, row, head,
                                                     VALUES[value])
        label = f"{backend} {tensor}[{row}, {head}]={value}"
        _assert_same_pattern(f"{label} out", out, rout)
        _assert_same_pattern(f"{label} lse", lse, rlse)
        # a row that sees no key stays out 0, lse -inf whatever the others hold
        dead = np.isneginf(rlse)
        assert (np.asarray(lse)[dead] == -np.inf).all(), f"{label}: lse of key-less rows"


@pytest.mark.parametrize("backend", HOST_BACKENDS)
@pytest.mark.parametrize("value", VALUES)
@pytest.mark.parametrize("tensor", ["q", "k", "v", "dout", "out", "lse"])
def test_backward_pattern_matches_reference(backend, tensor, value):
    b = _batch(seed=2)
    kw = dict(seq_offsets_q=b.off_q, seq_offsets_k=b.off_k, mask=b.mask)
    out, lse = varlen.attention_forward(b.q, b.k, b.v, b.cu_q, b.cu_k, backend=backend, **kw)
    rng = np.random.default_rng(len(tensor) * 7 + len(value))
    for row, head in _sweep_positions(b, tensor, rng):
        args = {"q": b.q, "k": b.k, "v": b.v, "dout": b.dout, "out": out, "lse": lse}
        if tensor == "lse":
            args["lse"] = lse.copy()
            args["lse"][head, row] = VALUES[value]
        else:
            args[tensor] = _poison(args[tensor], row, head, VALUES[value])
        grads = varlen.attention_backward(args["dout"], args["q"], args["k"], args["v"],
                                          args["out"], args["lse"], b.cu_q, b.cu_k,
                                          backend=backend, **kw)
        want = reference.attention_dense_backward(args["dout"], args["q"], args["k"],
                                                  args["v"], b.cu_q, b.cu_k, out=args["out"],
                                                  lse=args["lse"], **kw)
        # out and lse were computed from the unpoisoned q, k, v, which the reference does not
        # see (it recomputes them): values agree only when the poison is in dout, out or lse
        consistent = tensor in ("dout", "out", "lse")
        for name, g, w in zip(("dq", "dk", "dv"), grads, want):
            _assert_same_pattern(f"{backend} {tensor}[{row}, {head}]={value} {name}", g, w,
                                 values=consistent)


def test_pad_rows_and_other_sequences_never_see_nonfinite():
    # every pad row of q, k, v holds NaN (make_batch garbage): nothing else may turn NaN
    b = _batch(seed=3)
    out, lse = varlen.attention_forward(b.q, b.k, b.v, b.cu_q, b.cu_k, **b.layout)
    grads = varlen.attention_backward(b.dout, b.q, b.k, b.v, out, lse, b.cu_q, b.cu_k,
                                      **b.layout)
    for name, a in (("out", out), ("lse", np.where(np.isneginf(lse), 0.0, lse)),
                    *zip(("dq", "dk", "dv"), grads)):
        assert np.isfinite(a).all(), f"{name}: a pad row's NaN leaked"
