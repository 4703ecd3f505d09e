"""Non-finite values in the Numba kernels (docs/semantics.md, "Non-finite values").

NaN, +inf and -inf are placed in every input of the forward (q, k, v) and the backward (q, k,
v, dout, out, lse), one per sequence at positions next to tile edges (so what each reaches
stays apart), and the non-finite (row, head) entries of the results are compared with the
float64 reference and the NumPy backend; the finite entries agree with the NumPy backend.
Every padding row holds NaN, so each case also checks that padding never leaks. Tiles of 8
rows put tile edges inside the sequences, where a masked product `0 x NaN` would spread a
value to its whole tile.
"""
import functools

import numpy as np
import pytest

import varlen
from varlen import Mask, reference
from varlen.backends.numpy_backend import BACKEND as NUMPY

from helpers import make_batch
from test_nonfinite import (OVERFLOW_CASES, VALUES, _assert_same_pattern, _bad_rows, _poison,
                            overflow_batch)

BLOCKS = dict(block_m=8, block_n=8)
# Causal; bottom-right causal with Lq > Lk (queries 0..3 see no key); a bottom-right window
# (query i sees keys i+2 .. i+7).
MASK = Mask(window_left=np.array([-1, -1, 4], np.int32),
            window_right=np.array([0, 0, 1], np.int32),
            bottom_right=np.array([False, True, True]))
# (sequence, position inside it, head) of the poisoned rows, one per sequence: beside the tile
# edges at 8 and 16, a key only query 5 sees, a query that sees no key.
KEY_SIDE = ((0, 10, 0), (1, 1, 0), (2, 9, 0))
QUERY_SIDE = ((0, 10, 1), (1, 2, 0), (2, 9, 0))
QUERY_TENSORS = ("q", "dout", "out", "lse")
TENSORS = ("q", "k", "v", *QUERY_TENSORS[1:])


@functools.lru_cache(maxsize=None)
def _case():
    """The batch, its plan and the Numba forward of the clean inputs."""
    rng = np.random.default_rng(5)
    b = make_batch(rng, [20, 6, 13], [20, 2, 19], Hq=2, Hk=1, D=8, dtype="float32", mask=MASK,
                   gaps=True, garbage=np.nan)
    plan = varlen.plan(b.cu_q, b.cu_k, seq_offsets_q=b.off_q, seq_offsets_k=b.off_k, mask=MASK,
                       num_rows_q=b.q.shape[0], num_rows_k=b.k.shape[0], **BLOCKS)
    out, lse = varlen.attention_forward(b.q, b.k, b.v, b.cu_q, b.cu_k, **b.layout, plan=plan,
                                        backend="numba")
    return b, plan, out, lse


def _poisoned(b, arrays, tensor):
    """`(arrays with tensor poisoned, label)`: NaN, +inf and -inf at its side's positions,
    rotated per tensor so each value meets each kind of position (lse is `[H, T]`)."""
    arrays = dict(arrays)
    query_side = tensor in QUERY_TENSORS
    start = b.off_q if query_side else b.off_k
    names = list(VALUES)
    turn = TENSORS.index(tensor)
    labels = []
    for n, (seq, i, h) in enumerate(QUERY_SIDE if query_side else KEY_SIDE):
        row, value = int(start[seq]) + i, names[(n + turn) % len(names)]
        labels.append(f"{tensor}[{row}, {h}]={value}")
        if tensor == "lse":
            arrays["lse"] = arrays["lse"].copy()
            arrays["lse"][h, row] = VALUES[value]
        else:
            arrays[tensor] = _poison(arrays[tensor], row, h, VALUES[value])
    return arrays, " ".join(labels)


def _assert_finite_close(label, got, want):
    """Where both are finite (the patterns are checked apart), got agrees with want."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    both = np.isfinite(got) & np.isfinite(want)
    scale = max(np.abs(want[both]).max(initial=0.0), 1.0)
    err = np.abs(got[both] - want[both]).max(initial=0.0)
    assert err <= 1e-4 * scale, f"{label}: finite entries differ by {err:.2e}"


@pytest.mark.parametrize("tensor", TENSORS[:3])
def test_forward_pattern_matches_reference_and_numpy(tensor):
    b, plan, _, _ = _case()
    x, poison = _poisoned(b, {"q": b.q, "k": b.k, "v": b.v}, tensor)
    got = varlen.attention_forward(x["q"], x["k"], x["v"], b.cu_q, b.cu_k, **b.layout,
                                   plan=plan, backend="numba")
    want = reference.attention_dense(x["q"], x["k"], x["v"], b.cu_q, b.cu_k, **b.layout)
    host = NUMPY.forward(plan, x["q"], x["k"], x["v"], softmax_scale=8 ** -0.5, softcap=0.0)
    for name, g, w, h in zip(("out", "lse"), got, want, host):
        label = f"{poison}: {name}"
        _assert_same_pattern(f"{label} (reference)", g, w, values=False)
        _assert_same_pattern(f"{label} (numpy)", g, h, values=False)
        _assert_finite_close(label, g, h)
    assert np.array_equal(np.isneginf(got[1]), np.isneginf(want[1])), \
        f"{poison}: rows that see no key must keep lse -inf"


@pytest.mark.parametrize("tensor", TENSORS)
def test_backward_pattern_matches_reference_and_numpy(tensor):
    b, plan, out, lse = _case()
    x, poison = _poisoned(b, dict(q=b.q, k=b.k, v=b.v, dout=b.dout, out=out, lse=lse), tensor)
    args = [x[n] for n in ("dout", "q", "k", "v", "out", "lse")]
    # both dQ paths, for key- and query-side values: the atomic reduction of the dK/dV pass,
    # and the deterministic pass
    deterministic = tensor in ("v", "dout", "lse")
    got = varlen.attention_backward(*args, b.cu_q, b.cu_k, **b.layout, plan=plan,
                                    backend="numba", deterministic=deterministic)
    want = reference.attention_dense_backward(*args[:4], b.cu_q, b.cu_k, **b.layout,
                                              out=x["out"], lse=x["lse"])
    host = NUMPY.backward(plan, *args, softmax_scale=8 ** -0.5, softcap=0.0)
    for name, g, w, h in zip(("dq", "dk", "dv"), got, want, host):
        label = f"{poison}: {name} (deterministic={deterministic})"
        _assert_same_pattern(f"{label} (reference)", g, w, values=False)
        _assert_same_pattern(f"{label} (numpy)", g, h, values=False)
        _assert_finite_close(label, g, h)


@pytest.mark.parametrize("bm, bn, dtype", [(8, 8, "float16"), (16, 4, "bfloat16")],
                         ids=["bm8-bn8-fp16", "bm16-bn4-bf16"])
def test_reach_does_not_depend_on_tiles(bm, bn, dtype):
    """Causal L=20: NaN at v[10] reaches rows 10..19 of out and lse, NaN at dout[10] reaches
    dq row 10 and dk, dv rows 0..10, whatever the tiles (a causal L=300 with the NaN at 150,
    small)."""
    rng = np.random.default_rng(1)
    b = make_batch(rng, [20], Hq=2, Hk=1, D=8, dtype=dtype, mask="causal")
    plan = varlen.plan(b.cu_q, b.cu_k, mask="causal", block_m=bm, block_n=bn)
    kw = dict(mask="causal", plan=plan, backend="numba")
    out, lse = varlen.attention_forward(b.q, b.k, _poison(b.v, 10, 0, np.nan), b.cu_q, b.cu_k,
                                        **kw)
    for name, a in (("out", out), ("lse", lse)):
        rows = np.flatnonzero(_bad_rows(a).any(axis=1))
        assert rows.tolist() == list(range(10, 20)), f"{name}: NaN rows {rows}"
    out, lse = varlen.attention_forward(b.q, b.k, b.v, b.cu_q, b.cu_k, **kw)
    grads = varlen.attention_backward(_poison(b.dout, 10, 1, np.nan), b.q, b.k, b.v, out, lse,
                                      b.cu_q, b.cu_k, **kw)
    for name, g, want in zip(("dq", "dk", "dv"), grads, ([10], range(11), range(11))):
        rows = np.flatnonzero(_bad_rows(g).any(axis=1))
        assert rows.tolist() == list(want), f"{name}: NaN rows {rows}"


@pytest.mark.parametrize("case", OVERFLOW_CASES)
def test_scores_past_float32_make_the_row_nan(case):
    """docs/semantics.md, "Overflow": the kernels form scores and output sums in float32; a
    row of finite inputs whose score or sum leaves float32's range is NaN (out and lse), never
    0 and -inf as if it saw no key; other sequences are as without the big values."""
    b = overflow_batch(case)
    out, lse = varlen.attention_forward(b.q, b.k, b.v, b.cu_q, b.cu_k, **b.layout,
                                        backend="numba")
    ref_out, ref_lse = b.ref_forward()
    assert np.isnan(out[0, 0]).all() and np.isnan(lse[0, 0]), (
        f"{case}: row 0 head 0 gave out {out[0, 0, :3]}..., lse {lse[0, 0]}")
    for h in range(out.shape[1]):                   # every head of row 0: NaN or the reference
        if not np.isnan(lse[h, 0]):
            np.testing.assert_allclose(out[0, h], ref_out[0, h], rtol=1e-5,
                                       err_msg=f"{case}: head {h}")
    np.testing.assert_allclose(out[1:], ref_out[1:], rtol=1e-4, atol=1e-5, err_msg=case)
    np.testing.assert_allclose(lse[:, 1:], ref_lse[:, 1:], rtol=1e-5, atol=1e-5, err_msg=case)
