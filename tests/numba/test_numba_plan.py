"""Device plans: the Numba plan kernels build exactly the arrays of the NumPy builder.

Random batches with zero-length sequences (first, middle, last), row offsets with padding
gaps, per-sequence masks (windows, alignment), Lq != Lk, and two segments per sequence (the
context-parallel shard layout). Compared field by field, slot count included. Rows a plan
would drop (a sequence past its buffer, more tiles than `max_seqlen` allows) fail clearly.
"""
import contextlib

import numpy as np
import pytest

import varlen
from varlen import Mask
from varlen.backends.numba_backend import BACKEND as NUMBA, plan_from_cu_seqlens
from varlen.plan import build_plan, segments_from_cu_seqlens

from numba_testing import two_segments
from helpers import make_batch

FIELDS = ("window_left", "window_right", "bottom_right", "q_tiles", "q_sched", "k_tiles",
          "k_sched", "q_row_sched", "k_row_sched")


def _lengths(rng, B, hi):
    L = rng.integers(0, hi, size=B)
    L[rng.integers(0, B)] = 0
    L[-1] = rng.choice([0, L[-1]])
    return L.astype(np.int32)


def _cu(L):
    return np.concatenate([[0], np.cumsum(L)]).astype(np.int32)


def _offsets(rng, L):
    gaps = rng.integers(0, 5, size=len(L))
    return (int(rng.integers(0, 4)) + np.concatenate([[0], np.cumsum(L + gaps)])).astype(np.int32)


def _mask(rng, B):
    return Mask(window_left=rng.choice([-1, 0, 3, 9], size=B).astype(np.int32),
                window_right=rng.choice([-1, 0, 2], size=B).astype(np.int32),
                bottom_right=rng.integers(0, 2, size=B).astype(bool))


def assert_same_plan(got, want, label):
    assert got.block_m == want.block_m and got.block_n == want.block_n, label
    for f in FIELDS:
        g, w = getattr(got, f), getattr(want, f)
        assert isinstance(g, np.ndarray), f"{label}: {f} is {type(g).__name__}"
        assert g.shape == w.shape, f"{label}: {f} shape {g.shape} != {w.shape}"
        assert g.dtype == w.dtype, f"{label}: {f} dtype {g.dtype} != {w.dtype}"
        bad = np.argwhere(g != w)
        assert bad.size == 0, f"{label}: {f} differs at {bad[:4].tolist()}: {g[tuple(bad[0])]} " \
                              f"!= {w[tuple(bad[0])]}"


@pytest.mark.parametrize("seed", range(4))
def test_plan_from_cu_seqlens_matches_numpy(seed):
    rng = np.random.default_rng(seed)
    B = int(rng.integers(1, 6))
    Lq, Lk = _lengths(rng, B, 30), _lengths(rng, B, 30)
    off_q = _offsets(rng, Lq) if seed % 2 else None
    off_k = _offsets(rng, Lk) if seed % 2 else None
    Tq = int((off_q if off_q is not None else _cu(Lq))[-1]) + int(rng.integers(0, 3))
    Tk = int((off_k if off_k is not None else _cu(Lk))[-1])
    mask = _mask(rng, B) if seed != 2 else "causal_bottom_right"
    bm, bn = [(8, 8), (16, 8), (8, 16), (4, 16)][seed]
    msq = int(Lq.max()) if seed == 3 else None
    got = plan_from_cu_seqlens(_cu(Lq), _cu(Lk), seq_offsets_q=off_q, seq_offsets_k=off_k,
                               num_rows_q=Tq, num_rows_k=Tk, mask=mask, block_m=bm,
                               block_n=bn, max_seqlen_q=msq)
    want = build_plan(segments_from_cu_seqlens(_cu(Lq), off_q, Tq),
                      segments_from_cu_seqlens(_cu(Lk), off_k, Tk), mask, block_m=bm,
                      block_n=bn, max_seqlen_q=msq)
    assert_same_plan(got, want, f"seed {seed}")
    for side in ("q", "k"):
        for f in ("row", "length", "pos", "seqlen"):
            g, w = getattr(getattr(got, side), f), getattr(getattr(want, side), f)
            assert np.array_equal(g, w), f"seed {seed}: {side}.{f} {g} != {w}"


@pytest.mark.parametrize("seed", range(3))
def test_make_plan_two_segments_matches_numpy(seed):
    rng = np.random.default_rng(100 + seed)
    B = int(rng.integers(1, 5))
    L = _lengths(rng, B, 40)
    q = two_segments(rng, L)
    Lk = L if seed != 1 else (L + rng.integers(0, 9, size=B)).astype(np.int32)
    k = two_segments(rng, Lk) if seed != 2 else segments_from_cu_seqlens(_cu(Lk), None,
                                                                           int(Lk.sum()))
    mask = _mask(rng, B) if seed else Mask(window_left=5, window_right=0, bottom_right=True)
    got = NUMBA.make_plan(q, k, mask, block_m=8, block_n=4)
    want = build_plan(q, k, mask, block_m=8, block_n=4)
    assert_same_plan(got, want, f"two segments, seed {seed}")


def test_many_sequences_two_segments_with_bounds():
    """S = 2B = 74 segments: the prefix-sum kernel's threads each sum a chunk; max_seqlen
    bounds shrink both tile tables."""
    rng = np.random.default_rng(7)
    L = rng.integers(0, 12, size=37).astype(np.int32)
    L[[0, 17, -1]] = 0
    q, k = two_segments(rng, L, cp=3), two_segments(rng, L, cp=3)
    mask = _mask(rng, 37)
    kw = dict(block_m=4, block_n=2, max_seqlen_q=4, max_seqlen_k=3)
    assert_same_plan(NUMBA.make_plan(q, k, mask, **kw), build_plan(q, k, mask, **kw), "B37")


# --------------------------------------------------------------------------------------------
# Rows a plan would drop are device errors, never silent
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("validate", [True, False], ids=["validation-on", "validation-off"])
def test_max_seqlen_too_small_fails_clearly(validate):
    """Sequences of 5 and 40 rows with max_seqlen_q=4: the tile table would hold 2 tiles of
    16 rows for 4. The call fails, from the value checks or, unvalidated, from the plan
    kernels' flag (raised at once for host data)."""
    rng = np.random.default_rng(3)
    b = make_batch(rng, [5, 40], Hq=1, Hk=1, D=8, dtype="float32")
    previous = varlen.set_validation(validate)
    try:
        with pytest.raises(ValueError, match="max_seqlen_q"):
            varlen.attention_forward(b.q, b.k, b.v, b.cu_q, b.cu_k, backend="numba",
                                     max_seqlen_q=4)
    finally:
        varlen.set_validation(previous)


def _drain_device_errors():
    with contextlib.suppress(ValueError):
        varlen.check_device_errors()


@pytest.mark.parametrize("where", ["host", "device"])
def test_dropped_rows_are_device_errors(where):
    """`plan_from_cu_seqlens` records a sequence past its buffer and more tiles than
    `max_seqlen` allows: raised at once for host arrays, by `check_device_errors()` (once)
    for Numba device arrays; a plan that drops nothing records nothing."""
    from numba import cuda
    cu = _cu(np.array([6, 0, 9], np.int32))
    put = cuda.to_device if where == "device" else np.asarray
    kw = dict(block_m=4, block_n=4)
    _drain_device_errors()
    plan_from_cu_seqlens(put(cu), put(cu), num_rows_q=15, num_rows_k=15, max_seqlen_k=9, **kw)
    varlen.check_device_errors()
    for bad, message in ((dict(num_rows_q=12, num_rows_k=15), "cu_seqlens_q/seq_offsets_q lies "
                          "outside the 12 rows"),
                         (dict(num_rows_q=15, num_rows_k=15, max_seqlen_k=4),
                          "longer than max_seqlen_k: the tile table has 3 slots")):
        if where == "host":
            with pytest.raises(ValueError, match=message):
                plan_from_cu_seqlens(cu, cu, **bad, **kw)
            continue
        plan_from_cu_seqlens(put(cu), put(cu), **bad, **kw)
        with pytest.raises(ValueError, match=message):
            varlen.check_device_errors()
        varlen.check_device_errors()
