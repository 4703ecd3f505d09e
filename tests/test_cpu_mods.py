"""The `cpu` backend with user functions (mask_mod, score_mod, aux gradients) against the float64
reference: the gallery (tests/mods_cases.py) on adversarial batches in every dtype, forward and
backward; a read outside an aux array; rows a score_mod hides; thread-count invariance; and that
EMPTY tiles are skipped and FULL ones run without the function."""
import zlib

import numpy as np
import pytest

import varlen
from varlen import MaskMod, ScoreMod, reference

from helpers import (FLOOR_UNIT, assert_lse, cases, check_against_reference, covering,
                     covered_rows, make_batch)
from mods_cases import MASK_IDS, SCORE_IDS, mask_cases, score_cases

pytest.importorskip("numba")

from varlen.backends import _cpu_threads  # noqa: E402

DTYPES = ["float32", "bfloat16", "float16", "float64"]

# (id, lengths, Hq, Hk, D, gaps): zero-length sequences (the last too), length 1, lengths
# that are no tile multiple, GQA 4, padding gaps between sequences
BATCHES = [
    ("B6-gqa4-gaps", [200, 1, 0, 77, 130, 0], 4, 1, 32, True),
    ("B3-mha-D16", [65, 0, 300], 2, 2, 16, False),
]
BATCH_IDS = [b[0] for b in BATCHES]


def _batch(spec, dtype, mask="full"):
    name, lengths, Hq, Hk, D, gaps = spec
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    return make_batch(rng, lengths, Hq=Hq, Hk=Hk, D=D, dtype=dtype, mask=mask, gaps=gaps)


def _grid(ids):
    full = [pytest.param(i, d, s, id=f"{i}-{d}-{s[0]}") for i in ids for d in DTYPES
            for s in BATCHES]
    # quick: every function, every dtype and every batch at least once
    return cases(full, covering(lambda p: p.values[0], lambda p: p.values[1],
                                lambda p: p.values[2][0]))


def _mask(case_id, spec):
    return dict(mask_cases(spec[1]))[case_id]


# --------------------------------------------------------------------------------------------
# mask_mod: the gallery
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case_id, dtype, spec", _grid(MASK_IDS))
def test_masks_match_reference(case_id, dtype, spec):
    b = _batch(spec, dtype, _mask(case_id, spec))
    out, lse = varlen.attention_forward(b.q, b.k, b.v, b.cu_q, b.cu_k, **b.layout,
                                        backend="cpu")
    grads = varlen.attention_backward(b.dout, b.q, b.k, b.v, out, lse, b.cu_q, b.cu_k,
                                      **b.layout, backend="cpu")
    check_against_reference(b, out, lse, grads, label=f"{case_id}/{dtype}")
    pad = ~covered_rows(b, "q")
    assert (np.asarray(out, np.float64)[pad] == 0).all(), "pad rows of out"


# --------------------------------------------------------------------------------------------
# score_mod: the gallery, with aux gradients
# --------------------------------------------------------------------------------------------

def _check_scored(b, score_mod, out, lse, grads, label, softcap=0.0):
    """Forward, gradients and aux gradients against the reference, tolerances from a naive
    same-dtype computation's error (`varlen.testing.check_against_reference`)."""
    check_against_reference(b, out, lse, grads, softcap=softcap, score_mod=score_mod,
                            label=label)


def _run(b, **kw):
    out, lse = varlen.attention_forward(b.q, b.k, b.v, b.cu_q, b.cu_k, **b.layout,
                                        backend="cpu", **kw)
    grads = varlen.attention_backward(b.dout, b.q, b.k, b.v, out, lse, b.cu_q, b.cu_k,
                                      **b.layout, backend="cpu", aux_grads="score_mod" in kw,
                                      **kw)
    return out, lse, grads


@pytest.mark.parametrize("case_id, dtype, spec", _grid(SCORE_IDS))
def test_scores_match_reference(case_id, dtype, spec):
    b = _batch(spec, dtype)
    score_mod = dict(score_cases(spec[2]))[case_id]
    out, lse, grads = _run(b, score_mod=score_mod)
    _check_scored(b, score_mod, out, lse, grads, f"{case_id}/{dtype}")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mask_score_and_softcap_together(dtype):
    """A mask_mod, a score_mod with a float aux and a softcap in one call."""
    spec = BATCHES[0]
    b = _batch(spec, dtype, _mask("prefix-lm", spec))
    score_mod = dict(score_cases(spec[2]))["relative-bias"]
    out, lse, grads = _run(b, score_mod=score_mod, softcap=3.0)
    _check_scored(b, score_mod, out, lse, grads, f"mask+score+softcap/{dtype}", softcap=3.0)


# --------------------------------------------------------------------------------------------
# Errors and hidden rows
# --------------------------------------------------------------------------------------------

def test_aux_index_out_of_range_raises():
    b = _batch(BATCHES[0], "float32")
    B = len(b.cu_q) - 1
    prefix = np.full(B, 3, np.int32)
    bad_mask = MaskMod(lambda b, q, k, p: (k <= q) | (k < p[b + 2]), prefix)
    with pytest.raises(IndexError, match=r"mask_mod reads aux argument 0 \(shape \(6,\)\)"):
        varlen.attention_forward(b.q, b.k, b.v, b.cu_q, b.cu_k, seq_offsets_q=b.off_q,
                                 seq_offsets_k=b.off_k, mask=bad_mask, backend="cpu")
    table = np.ones(4, np.float32)
    bad_score = ScoreMod(lambda s, b, h, q, k, t: s + t[h + 1], table)
    with pytest.raises(IndexError, match=r"score_mod reads aux argument 0 \(shape \(4,\)\)"):
        _run(b, score_mod=bad_score)
    good = ScoreMod(lambda s, b, h, q, k, t: s + t[h], table)
    out, lse = varlen.attention_forward(b.q, b.k, b.v, b.cu_q, b.cu_k, **b.layout,
                                        score_mod=good, backend="cpu")
    with pytest.raises(IndexError, match="score_mod reads aux argument 0"):
        varlen.attention_backward(b.dout, b.q, b.k, b.v, out, lse, b.cu_q, b.cu_k, **b.layout,
                                  score_mod=bad_score, backend="cpu")


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_score_mod_hiding_whole_rows(dtype):
    """Rows whose every score the score_mod sends to -inf: output 0 and lse -inf as the
    reference has them; the backward's NaN pattern and values as the reference's."""
    b = _batch(BATCHES[0], dtype, "causal")
    hide = ScoreMod(lambda s, b, h, q, k: varlen.where(q % 7 == 3, -np.inf, s))
    out, lse = varlen.attention_forward(b.q, b.k, b.v, b.cu_q, b.cu_k, **b.layout,
                                        score_mod=hide, backend="cpu")
    lay = dict(seq_offsets_q=b.off_q, seq_offsets_k=b.off_k, mask="causal")
    ref_out, ref_lse = reference.attention_dense(b.q, b.k, b.v, b.cu_q, b.cu_k, **lay,
                                                 score_mod=hide)
    hidden = np.isneginf(ref_lse) & covered_rows(b, "q")[None, :]
    assert hidden.sum() > 10, "the case hides no row"
    assert np.isneginf(lse[hidden]).all(), "hidden rows' lse"
    assert (np.asarray(out, np.float64).transpose(1, 0, 2)[hidden] == 0).all(), "hidden rows"
    assert_lse(f"hide/{dtype} lse", lse, ref_lse, dtype=dtype)
    grads = varlen.attention_backward(b.dout, b.q, b.k, b.v, out, lse, b.cu_q, b.cu_k,
                                      **b.layout, score_mod=hide, backend="cpu")
    ref = reference.attention_dense_backward(b.dout, b.q, b.k, b.v, b.cu_q, b.cu_k, **lay,
                                             score_mod=hide, out=out, lse=lse)
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref):
        g = np.asarray(g, np.float64)
        assert np.array_equal(np.isnan(g), np.isnan(r)), f"{name}: NaN pattern"
        fin = ~np.isnan(r)
        assert np.abs(g[fin] - r[fin]).max(initial=0) <= 64 * FLOOR_UNIT[dtype] * max(
            np.abs(r[fin]).max(initial=0), 1.0), f"{name}: finite values"


# --------------------------------------------------------------------------------------------
# Thread counts; EMPTY and FULL tiles
# --------------------------------------------------------------------------------------------

def test_bitwise_identical_for_any_thread_count_with_mods():
    import numba
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("one Numba thread on this machine (NUMBA_NUM_THREADS=1)")
    rng = np.random.default_rng(5)
    lengths = [300, 1, 0, 129, 64, 700, 77, 2, 513]
    b = make_batch(rng, lengths, Hq=8, Hk=2, D=32, dtype="float32", gaps=True,
                   mask=_mask("prefix-lm", ("", lengths)))
    score_mod = dict(score_cases(8))["t5"]
    runs = []
    for threads in (1, min(numba.config.NUMBA_NUM_THREADS, 4)):
        old = numba.get_num_threads()
        numba.set_num_threads(threads)
        try:
            assert _cpu_threads.num_threads() == threads
            out, lse, grads = _run(b, score_mod=score_mod, softcap=2.0)
        finally:
            numba.set_num_threads(old)
        runs.append([np.asarray(a).view(np.uint8) for a in
                     (out, lse, *grads[:3], *[g for g in grads[3] if g is not None])])
    for name, x, y in zip(("out", "lse", "dq", "dk", "dv", "daux"), *runs):
        assert np.array_equal(x, y), f"{name} differs between 1 and several threads"


def test_tiles_the_masks_settle_give_what_the_built_in_masks_give():
    """Key tiles past 128 are EMPTY for the first function and every tile is FULL for the
    second (their aux reads stay inside the arrays, so the classes stand): bitwise the results
    of the same visibility written as built-in masks."""
    rng = np.random.default_rng(3)
    b = make_batch(rng, [500, 0, 300], Hq=4, Hk=2, D=16, dtype="float32", gaps=True)
    ones = np.ones(128, np.int32)
    first = MaskMod(lambda b, q, k, lim, a: (k < lim[0]) & (a[varlen.minimum(k, 127)] == 1) &
                    (k <= q), np.array([128], np.int32), ones)
    plain = MaskMod(lambda b, q, k: (k < 128) & (k <= q))
    full = MaskMod(lambda b, q, k, a: (q >= 0) | (a[varlen.minimum(k, 127)] == 1), ones)
    plan = varlen.plan(b.cu_q, b.cu_k, seq_offsets_q=b.off_q, seq_offsets_k=b.off_k,
                       mask=first, num_rows_q=b.q.shape[0], num_rows_k=b.k.shape[0],
                       backend="cpu")
    assert (plan.tile_classes("q")[1] == varlen.mods.EMPTY).any(), "no EMPTY tile to skip"
    lay = dict(seq_offsets_q=b.off_q, seq_offsets_k=b.off_k, backend="cpu")
    for mask, same in ((first, plain), (full, "full")):
        runs = []
        for m in (mask, same):
            out, lse = varlen.attention_forward(b.q, b.k, b.v, b.cu_q, b.cu_k, mask=m, **lay)
            grads = varlen.attention_backward(b.dout, b.q, b.k, b.v, out, lse, b.cu_q, b.cu_k,
                                              mask=m, **lay)
            runs.append([np.asarray(x) for x in (out, lse, *grads)])
        for name, x, y in zip(("out", "lse", "dq", "dk", "dv"), *runs):
            assert np.array_equal(x, y, equal_nan=True), f"{name}: {mask!r} vs {same!r}"


def test_a_read_outside_an_aux_array_is_an_index_error_in_any_tile():
    """A tile where an index may leave its array is evaluated pair by pair (never classified
    away), so the cpu backend raises where the reference raises."""
    rng = np.random.default_rng(3)
    b = make_batch(rng, [500, 0, 300], Hq=4, Hk=2, D=16, dtype="float32", gaps=True)
    ones = np.ones(128, np.int32)
    for mask in (MaskMod(lambda b, q, k, lim, a: (k < lim[0]) & (a[k] == 1) & (k <= q),
                         np.array([128], np.int32), ones),
                 MaskMod(lambda b, q, k, a: (q >= 0) | (a[k + 1000] == 1), ones)):
        lay = dict(seq_offsets_q=b.off_q, seq_offsets_k=b.off_k, mask=mask)
        with pytest.raises(IndexError):
            reference.attention_dense(b.q, b.k, b.v, b.cu_q, b.cu_k, **lay)
        with pytest.raises(IndexError, match="mask_mod reads aux argument"):
            varlen.attention_forward(b.q, b.k, b.v, b.cu_q, b.cu_k, backend="cpu", **lay)
