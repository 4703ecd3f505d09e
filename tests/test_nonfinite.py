"""Non-finite values stay inside what a row may see (docs/semantics.md, "Non-finite values").

A NaN or inf reaches exactly the rows that see it: never a row of another sequence, a masked
position or a pad row, whatever the tile size; and where it does reach, the result is NaN, never
a quiet 0 or -inf. Patterns of non-finite rows are compared with the float64 reference, which
states the rule directly, over NaN / +inf / -inf in every input of forward and backward.
"""
import warnings

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


# --------------------------------------------------------------------------------------------
# Overflow (docs/semantics.md, "Overflow"): finite inputs past float32's range
# --------------------------------------------------------------------------------------------

F32_MAX = float(np.finfo(np.float32).max)
D_OVERFLOW = 16
# (id, q row, big key row, value rows): sequence 0's one query against its two keys, the big
# one (key 0) and an ordinary one; scale 1/4 at D = 16.
OVERFLOW_CASES = {
    # q . k = 16 * 1e38: past float32, the score 4e38 too, and lse with it (+inf in float32)
    "lse-past-float32": (np.full(D_OVERFLOW, 1e19), np.full(D_OVERFLOW, 1e19), None),
    # q . k = 1.2e39 past float32, the score 3e38 (and lse) inside it; s * log2(e) is not
    "product-past-float32": (np.full(D_OVERFLOW, 8.66e18), np.full(D_OVERFLOW, 8.66e18), None),
    # every term q_d k_d = +-4e38 past float32, their sum (the score) 0
    "terms-cancel": (np.tile([2e19, -2e19], D_OVERFLOW // 2), np.full(D_OVERFLOW, 2e19), None),
    # both keys' values 3e38 with equal scores: the output 3e38, twice it before the division
    "values-sum-past-float32": (np.zeros(D_OVERFLOW), np.zeros(D_OVERFLOW), 3e38),
}


def overflow_batch(case, dtype="float32"):
    """Sequence 0: one query, keys (big, ordinary), per `OVERFLOW_CASES[case]`; sequences 1
    and 2 ordinary (causal), which must come out as without the big values."""
    q_row, k_row, v_value = OVERFLOW_CASES[case]
    b = make_batch(np.random.default_rng(3), [1, 9, 5], [2, 9, 5], Hq=2, Hk=1, D=D_OVERFLOW,
                   dtype="float64", mask="causal_bottom_right")
    b.q[0, 0], b.k[0, 0] = q_row, k_row
    if v_value is not None:
        b.v[0:2, 0] = v_value
        b.k[1, 0] = k_row
    b.q, b.k, b.v, b.dout = (x.astype(dtype) for x in (b.q, b.k, b.v, b.dout))
    b.dtype = dtype
    return b


def _forward(b, backend):
    return varlen.attention_forward(b.q, b.k, b.v, b.cu_q, b.cu_k, **b.layout, backend=backend)


@pytest.mark.parametrize("backend", HOST_BACKENDS)
@pytest.mark.parametrize("case", OVERFLOW_CASES)
def test_scores_past_float32_give_the_reference(backend, case):
    """The host backends compute finite float32 inputs whose products leave float32's range
    as the float64 reference does: the output rounded to float32, lse too (+inf past its
    range), silently; never out 0 and lse -inf as if no key were visible."""
    b = overflow_batch(case)
    ref_out, ref_lse = b.ref_forward()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)     # no overflow warning either
        out, lse = _forward(b, backend)
    with np.errstate(over="ignore"):
        want_lse = ref_lse.astype(np.float32)      # +inf where past float32
    assert np.array_equal(np.isinf(lse), np.isinf(want_lse)), f"{case}: lse {lse[:, 0]}"
    fin = np.isfinite(want_lse)
    np.testing.assert_allclose(lse[fin], want_lse[fin], rtol=1e-5, atol=1e-5,
                               err_msg=f"{case}: lse")
    np.testing.assert_allclose(np.asarray(out, np.float64), ref_out, rtol=1e-5, atol=1e-5,
                               err_msg=f"{case}: out")


@pytest.mark.parametrize("case", OVERFLOW_CASES)
def test_cpu_backward_past_float32_is_the_numpy_backends(case):
    """Past float32's range the cpu backend's backward is the numpy backend's (NaN where the
    lse it is given is +inf, as rule 2 says), and the rows of other sequences are as without
    the big values."""
    b = overflow_batch(case)
    out, lse = _forward(b, "numpy")
    args = (b.dout, b.q, b.k, b.v, out, lse, b.cu_q, b.cu_k)
    with np.errstate(all="ignore"):                 # exp(s - lse) of the rows it reaches
        want = varlen.attention_backward(*args, **b.layout, backend="numpy")
        got = varlen.attention_backward(*args, **b.layout, backend="cpu")
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert np.array_equal(g, w, equal_nan=True), f"{case}: {name}"
    if np.isinf(lse[0, 0]):
        assert np.isnan(got[0][0, 0]).all() and np.isnan(got[1][:2]).any(axis=-1).all()
    ref = b.ref_backward()
    for name, g, r, first in zip(("dq", "dk", "dv"), got, ref, (1, 2, 2)):   # sequences 1, 2
        np.testing.assert_allclose(np.asarray(g[first:], np.float64), r[first:], rtol=2e-4,
                                   atol=2e-5, err_msg=f"{case}: {name}")
