"""Checking an attention backend against the float64 reference, for tests and for users.

    from varlen.testing import make_batch, check_against_reference
    b = make_batch(np.random.default_rng(0), [0, 70, 5], Hq=4, Hk=2, D=64, dtype="float16",
                   mask="causal", gaps=True)
    out, lse = my_forward(b.q, b.k, b.v, b.cu_q, b.cu_k, **b.layout)
    check_against_reference(b, out, lse, my_backward(...))     # AssertionError on a mismatch

`make_batch` builds adversarial packed batches (zero-length sequences, padding rows between
sequences filled with large garbage values, GQA); `check_against_reference` compares a
backend's output, lse and gradients with `varlen.reference`. Tolerances follow the dtype: a
backend's error against float64 must be within a small factor (2x output, 3x gradients) of a
naive same-dtype computation's error, plus a rounding floor; a relative-RMS check is paired
with a max-abs check, so one unwritten (NaN or zero) row cannot hide. NumPy only: device
results are copied to the host by the caller.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from . import reference
from ._array import bfloat16_dtype

__all__ = ["Batch", "make_batch", "check_against_reference", "assert_close", "assert_lse",
           "naive_same_dtype", "covered_rows", "np_dtype", "EPS", "FLOOR_UNIT"]

EPS = {"float16": 2.0 ** -11, "bfloat16": 2.0 ** -8, "float32": 2.0 ** -24, "float64": 2.0 ** -53}
# The rounding floor's unit. float64 results differ from the reference only by summation order,
# which over hundreds of terms costs a few hundred ulps.
FLOOR_UNIT = {**EPS, "float64": 2.0 ** -44}


def np_dtype(name):
    """The NumPy dtype of a dtype name; "bfloat16" is `ml_dtypes.bfloat16` (None without it)."""
    return bfloat16_dtype() if name == "bfloat16" else np.dtype(name)


@dataclass
class Batch:
    """A packed batch with its layout; arrays are NumPy in `dtype`, metadata int32.

    Attributes:
        q, dout: `[Tq, Hq, D]`; k, v: `[Tk, Hk, D]` (`Dv` for v). Padding rows hold garbage.
        cu_q, cu_k: `[B + 1]` cumulative sequence lengths.
        off_q, off_k: `[B + 1]` first packed row of each sequence, or None (rows follow cu).
        mask: anything `varlen.Mask` accepts ("full", "causal", a per-sequence Mask, ...).
        dtype: the name of the data dtype ("float16", "bfloat16", "float32", "float64").
        layout: the keyword arguments (seq_offsets_q/k, mask) of `varlen.attention_*`.
    """

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    cu_q: np.ndarray
    cu_k: np.ndarray
    off_q: np.ndarray | None = None
    off_k: np.ndarray | None = None
    mask: object = "full"
    dtype: str = "float64"
    dout: np.ndarray | None = None
    extra: dict = field(default_factory=dict)

    @property
    def layout(self):
        return dict(seq_offsets_q=self.off_q, seq_offsets_k=self.off_k, mask=self.mask)

    def ref_forward(self, **kw):
        return reference.attention_dense(self.q, self.k, self.v, self.cu_q, self.cu_k,
                                         **self.layout, **kw)

    def ref_backward(self, **kw):
        return reference.attention_dense_backward(self.dout, self.q, self.k, self.v, self.cu_q,
                                                  self.cu_k, **self.layout, **kw)


def _cu(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def _offsets(rng, lengths, gaps, lead):
    """Row offsets with random padding gaps (and a leading gap) between sequences."""
    gap = rng.integers(0, 4, size=len(lengths)) if gaps else np.zeros(len(lengths), int)
    starts = lead + np.concatenate([[0], np.cumsum(np.asarray(lengths) + gap)])
    return starts.astype(np.int32)


def make_batch(rng, lengths_q, lengths_k=None, *, Hq=4, Hk=2, D=16, Dv=None, dtype="float64",
               mask="full", gaps=False, scale=1.0, garbage=1e4) -> Batch:
    """A random packed batch of sequences of `lengths_q` queries and `lengths_k` keys.

    Args:
        rng: a `numpy.random.Generator`.
        lengths_q, lengths_k: per-sequence lengths (zeros allowed; `lengths_k` defaults to
            `lengths_q`).
        Hq, Hk, D, Dv: heads and head dims (`Dv` defaults to `D`); `Hq` a multiple of `Hk`.
        dtype: name of the data dtype.
        mask: the mask the batch is checked with (stored, not applied).
        gaps: place sequences at offsets with 0-3 padding rows before, between and after them.
        scale: standard deviation of the data.
        garbage: value of every padding row, so a backend that reads them as keys (or writes
            them) fails loudly.

    Returns: a `Batch` (data rounded to `dtype`, `dout` included).
    """
    lengths_k = lengths_q if lengths_k is None else lengths_k
    Dv = D if Dv is None else Dv
    cu_q, cu_k = _cu(lengths_q), _cu(lengths_k)
    lead = int(rng.integers(0, 3)) if gaps else 0
    off_q = _offsets(rng, lengths_q, gaps, lead) if gaps else None
    off_k = _offsets(rng, lengths_k, gaps, lead) if gaps else None
    Tq = int(off_q[-1] if gaps else cu_q[-1]) + (int(rng.integers(0, 3)) if gaps else 0)
    Tk = int(off_k[-1] if gaps else cu_k[-1]) + (int(rng.integers(0, 3)) if gaps else 0)
    dt = np_dtype(dtype)

    def data(T, H, d, rows):
        x = np.full((T, H, d), garbage)
        x[rows] = rng.standard_normal((int(rows.sum()), H, d)) * scale
        return x.astype(dt)

    rows_q = _covered(cu_q, off_q, Tq)
    rows_k = _covered(cu_k, off_k, Tk)
    q, k, v = data(Tq, Hq, D, rows_q), data(Tk, Hk, D, rows_k), data(Tk, Hk, Dv, rows_k)
    dout = data(Tq, Hq, Dv, rows_q)
    return Batch(q, k, v, cu_q, cu_k, off_q, off_k, mask, dtype, dout)


def _covered(cu, off, T):
    rows = np.zeros(T, bool)
    starts = cu[:-1] if off is None else off[:-1]
    for s, n in zip(starts, np.diff(cu)):
        rows[s:s + n] = True
    return rows


def covered_rows(batch: Batch, side="q"):
    """Bool `[T]`: the rows of the query (`side="q"`) or key array that belong to a sequence."""
    if side == "q":
        return _covered(batch.cu_q, batch.off_q, batch.q.shape[0])
    return _covered(batch.cu_k, batch.off_k, batch.k.shape[0])


def naive_same_dtype(batch: Batch, softmax_scale=None, softcap=0.0, *, mask=None,
                     score_mod=None, sinks=None, dropout_p=0.0, seed=None, offset=0):
    """Dense attention with every intermediate rounded to the batch dtype (fp32 accumulation):
    the error a straightforward same-dtype implementation makes.

    `mask` (default `batch.mask`): anything `varlen.Mask` accepts, a `MaskMod` or
    `Mask & MaskMod` included. `score_mod`: a `ScoreMod` applied to the (softcapped) scores,
    evaluated (`varlen.mods.evaluate`) in the working dtype (float32, float64 for a float64
    batch) and rounded to the batch dtype; a pair it sends to -inf is hidden. `sinks`: one
    more logit per query head in each row's softmax. `dropout_p`, `seed`, `offset`: dropout
    as `varlen.attention_forward` has it (the reference's keep set).
    """
    dt = np_dtype(batch.dtype)
    f64 = batch.dtype == "float64"
    rnd = (lambda a: a) if f64 else (lambda a: np.asarray(a).astype(dt).astype(np.float64))
    q, k, v = (x.astype(np.float64) for x in (batch.q, batch.k, batch.v))
    Hq, D = q.shape[1], q.shape[2]
    scale = 1.0 / np.sqrt(D) if softmax_scale is None else softmax_scale
    kx = np.repeat(k, Hq // k.shape[1], axis=1)
    vx = np.repeat(v, Hq // v.shape[1], axis=1)
    out = np.zeros((q.shape[0], Hq, v.shape[2]))
    masks = reference.sequence_masks(batch.cu_q, batch.cu_k, batch.mask if mask is None else mask)
    sq = batch.cu_q[:-1] if batch.off_q is None else batch.off_q[:-1]
    sk = batch.cu_k[:-1] if batch.off_k is None else batch.off_k[:-1]
    keep = (reference.dropout_keep(batch.cu_q, batch.cu_k, Hq, dropout_p, seed, offset)
            if dropout_p else None)
    for b, ok in enumerate(masks):
        rq = slice(sq[b], sq[b] + ok.shape[0])
        rk = slice(sk[b], sk[b] + ok.shape[1])
        s = rnd(np.einsum("ihd,jhd->hij", q[rq], kx[rk]).astype(np.float32) * scale)
        if softcap > 0:
            s = rnd(softcap * np.tanh(s / softcap))
        seen = np.broadcast_to(ok, s.shape)
        if score_mod is not None:
            from .mods import evaluate
            leaves = {"score": s, "b": np.int64(b), "h": np.arange(Hq)[:, None, None],
                      "q_idx": np.arange(ok.shape[0])[None, :, None],
                      "k_idx": np.arange(ok.shape[1])[None, None, :]}
            aux = tuple(reference._host(a) for a in score_mod.aux)
            s = rnd(evaluate(score_mod.graph, leaves, aux,
                             float_dtype=np.float64 if f64 else np.float32).astype(np.float64))
            seen = seen & (s != -np.inf)
        s = np.where(seen, s, -np.inf)
        p, z, _ = reference._softmax_terms(s, seen, sinks)
        sink_term = z - p.sum(2, keepdims=True)          # exp(sinks[h] - m); 0 without sinks
        p = rnd(p)
        z = p.sum(2, keepdims=True) + sink_term
        p = rnd(p / np.where(z > 0, z, 1))
        if keep is not None:
            p = rnd(p * keep[b] * (1.0 / (1.0 - dropout_p)))
        out[rq] = rnd(np.einsum("hij,jhd->ihd", p, vx[rk]))
    return out


def _amax(a):
    a = np.abs(np.asarray(a, dtype=np.float64))
    return float(a.max()) if a.size else 0.0


def assert_close(label, got, want, *, dtype, naive_err=0.0, factor=2.0, floor=8.0,
                 magnitude=0.0):
    """Max-abs error within `factor * naive_err + floor * eps * scale`, and RMS error within
    `(factor * naive_err / scale + 4 * floor * eps) * rms_scale`.

    `scale` is `max|want|` and `rms_scale` the reference's RMS; when the reference is
    negligible against `magnitude`, the natural size of the quantity (a gradient that cancels
    to zero), both are `magnitude`, so pure rounding noise is measured against it.
    """
    want = np.asarray(want, dtype=np.float64)
    assert np.shape(got) == want.shape, f"{label}: shape {np.shape(got)} != {want.shape}"
    got64 = np.asarray(got, dtype=np.float64)
    assert not np.isnan(got64).any(), (
        f"{label}: {int(np.isnan(got64).sum())} NaN values (an unwritten row?)")
    eps = FLOOR_UNIT[dtype]
    scale = _amax(want)
    rms_scale = float(np.sqrt(np.mean(want ** 2))) if want.size else 0.0
    if scale < 1e-3 * magnitude:
        scale = rms_scale = magnitude
    scale, rms_scale = max(scale, 1e-30), max(rms_scale, 1e-30)
    diff = np.abs(got64 - want)
    max_err = _amax(diff)
    rms = float(np.sqrt(np.mean(diff ** 2))) if diff.size else 0.0
    bound = factor * naive_err + floor * eps * scale
    assert max_err <= bound, (f"{label}: max abs error {max_err:.3e} > bound {bound:.3e} "
                              f"(naive {dtype} error {naive_err:.3e}, |ref| {scale:.3e})")
    rms_bound = (factor * naive_err / scale + 4 * floor * eps) * rms_scale
    assert rms <= rms_bound, (f"{label}: RMS error {rms:.3e} > {rms_bound:.3e} "
                              f"(reference RMS {rms_scale:.3e})")


def assert_lse(label, got, want, *, dtype):
    """lse: -inf exactly where the reference has it, close elsewhere."""
    got = np.asarray(got, dtype=np.float64)
    assert got.shape == want.shape, f"{label}: shape {got.shape} != {want.shape}"
    inf_ref = np.isneginf(want)
    assert np.array_equal(np.isneginf(got), inf_ref), (
        f"{label}: -inf pattern differs at {np.argwhere(np.isneginf(got) != inf_ref)[:5]}")
    fin = ~inf_ref
    if fin.any():
        err = _amax(got[fin] - want[fin])
        tol = (1e-12 if dtype == "float64" else 1e-5) * (1 + np.abs(want[fin]).max())
        assert err <= tol, f"{label}: max lse error {err:.3e} > {tol:.3e}"


def check_against_reference(batch: Batch, out, lse, grads=None, *, softmax_scale=None,
                            softcap=0.0, score_mod=None, sinks=None, label="", dropout_p=0.0,
                            seed=None, offset=0):
    """Assert that a backend's forward (and gradients) agree with the float64 reference.

    Args:
        batch: the `Batch` the results were computed from (its `mask` may hold a MaskMod).
        out: `[Tq, Hq, Dv]` output; lse: `[Hq, Tq]` natural-log log-sum-exp (-inf for rows
            without a visible key and for padding rows), host arrays in any float dtype.
        grads: `(dq, dk, dv)` for `batch.dout`, or None to check the forward only; with
            `sinks` then `dsinks`; with one more entry, the aux gradients of `score_mod` (one
            float32 array or None each).
        softmax_scale, softcap, score_mod, sinks: what the backend used (default scale
            `1/sqrt(D)`).
        dropout_p, seed, offset: the backend's dropout (the reference draws the same pairs).
        label: prefix of the assertion messages.

    Raises AssertionError naming the quantity, the error and the bound. Padding rows must be
    written as the reference has them (output and gradients 0).
    """
    kw = dict(softmax_scale=softmax_scale, softcap=softcap, score_mod=score_mod)
    if sinks is not None:
        kw["sinks"] = np.asarray(sinks, dtype=np.float64)
    if dropout_p:
        kw.update(dropout_p=dropout_p, seed=seed, offset=offset)
    ref_out, ref_lse = batch.ref_forward(**kw)
    naive = 0.0
    if batch.dtype != "float64":
        naive = _amax(naive_same_dtype(batch, **kw) - ref_out)
    assert_close(f"{label} out", out, ref_out, dtype=batch.dtype, naive_err=naive, factor=2.0)
    assert_lse(f"{label} lse", lse, ref_lse, dtype=batch.dtype)
    if grads is None:
        return
    aux_grads = len(grads) == (4 if sinks is None else 5)
    ref_grads = batch.ref_backward(**kw, aux_grads=aux_grads)
    # gradients are sums of dout-weighted products of the inputs: their natural size
    magnitude = _amax(ref_out) * _amax(np.where(covered_rows(batch)[:, None, None],
                                                batch.dout.astype(np.float64), 0.0))
    # Gradients of a same-dtype computation err about as much as its output, relative to the
    # gradient's own scale.
    rel = naive / max(_amax(ref_out), 1e-30)
    for name, g, r in zip(("dq", "dk", "dv"), grads[:3], ref_grads[:3]):
        assert_close(f"{label} {name}", g, r, dtype=batch.dtype,
                     naive_err=rel * max(_amax(r), 1e-30), factor=3.0, floor=16.0,
                     magnitude=magnitude)
    if sinks is not None:
        g, r = np.asarray(grads[3]), ref_grads[3]
        want = np.float64 if batch.dtype == "float64" else np.float32
        assert g.dtype == want and g.shape == r.shape, f"{label}: dsinks {g.dtype} {g.shape}"
        # a sum over every row of dout * out: its error against the sum of the terms' sizes
        assert_close(f"{label} dsinks", g, r, factor=3.0, floor=64.0,
                     dtype="float32" if batch.dtype != "float64" else "float64",
                     naive_err=rel * max(_amax(r), 1e-30),
                     magnitude=max(_amax(r), magnitude))
    if not aux_grads:
        return
    daux = grads[-1]
    ref_daux = ref_grads[-1]
    assert len(daux) == len(ref_daux), f"{label}: {len(daux)} aux gradients"
    for i, (g, r) in enumerate(zip(daux, ref_daux)):
        if r is None:
            assert g is None, f"{label}: aux {i} (not float) has a gradient"
            continue
        g = np.asarray(g)
        assert g.dtype == np.float32 and g.shape == r.shape, f"{label}: aux {i} {g.dtype}"
        # a sum over every visible pair, float32 whatever the inputs: its error against the
        # sum's size
        assert_close(f"{label} daux{i}", g, r, factor=3.0, floor=64.0,
                     dtype="float32" if batch.dtype == "float64" else batch.dtype,
                     naive_err=rel * max(_amax(r), 1e-30), magnitude=max(_amax(r), 1e-30))
