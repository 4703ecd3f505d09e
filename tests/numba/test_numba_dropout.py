"""Attention dropout in the Numba kernels (the simulator on a CPU, the same tests on a GPU).

The keep set is checked exactly against `varlen.reference.dropout_keep` (an output that shows
each kept pair), forward and gradients against the float64 reference under the same keep set
(which the `numpy` and `cpu` backends draw too), in both dQ modes, with GQA, zero-length and
length-1 sequences, lengths off the 16-row simulator tiles, padding gaps, causal and window
masks, sinks and a ScoreMod; the same seed repeats bitwise and another seed or offset differs;
the device Philox against Random123's known answers and `varlen.dropout`'s rule.
"""
import numpy as np
import pytest

from numba import cuda   # a module global: the simulator swaps it inside kernels

import varlen
from varlen import Mask, ScoreMod
from varlen.dropout import keep_bits, make_dropout, philox4x32_10
from varlen.reference import dropout_keep, sequence_masks
from varlen.backends import Problem
from varlen.backends import _numba_kernels as K
from varlen.backends import _numba_launch as L
from varlen.backends.numba_backend import BACKEND as NUMBA

from helpers import check_against_reference, make_batch

SEED = 0x0123456789ABCDEF
# Random123 tests/kat_vectors, the "philox4x32 10" lines: counter[4], key[2] -> out[4].
KAT = [((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
       ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
       ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))]


@cuda.jit
def _philox_kernel(ctr, key, out):
    t = cuda.grid(1)
    if t < ctr.shape[0]:
        w = K.philox4x32_10(ctr[t, 0], ctr[t, 1], ctr[t, 2], ctr[t, 3], key[t, 0], key[t, 1])
        for i in range(4):
            out[t, i] = w[i]


@cuda.jit
def _factors_kernel(b, h, i, j, n, drop, by_keys, by_queries):
    """Row 0: dropout_keys of query i over keys j..j+n-1; row 1: dropout_queries of key j over
    queries i..i+n-1 (one thread)."""
    if cuda.grid(1) == 0:
        K.dropout_keys(by_keys, n, b, h, i, j, drop)
        K.dropout_queries(by_queries, n, b, h, i, j, drop)


def test_device_philox_known_answers():
    ctr = np.array([c for c, _, _ in KAT], np.uint32)
    key = np.array([k for _, k, _ in KAT], np.uint32)
    out = np.zeros((len(KAT), 4), np.uint32)
    _philox_kernel[1, len(KAT)](ctr, key, out)
    for t, (c, k, want) in enumerate(KAT):
        got = tuple(int(w) for w in out[t])
        assert got == want, f"device philox4x32_10({c}, {k}) = {[hex(w) for w in got]}"


@pytest.mark.parametrize("b, h, i, j, h0", [(0, 0, 0, 0, 0), (3, 5, 17, 6, 0),
                                             (2**20 + 1, 7, 2**31 - 9, 2**31 - 3, 0),
                                             (3, 1, 17, 6, 6)],
                         ids=["origin", "mid-lane", "large", "global-head"])
def test_device_factors_follow_the_rule(b, h, i, j, h0):
    """`dropout_keys` / `dropout_queries` give `scale` exactly where `varlen.dropout` keeps the
    pair (keys starting off a multiple of four, runs crossing draws), 0 elsewhere; a call whose
    local head 0 is global head `h0` (Ulysses under context parallelism) draws at `h0 + h`."""
    d = make_dropout(0.45, SEED, 9).for_heads(h0)
    n = 7
    rows = np.full((2, n), np.nan, np.float32)
    by_keys, by_queries = rows[0], rows[1]
    _factors_kernel[1, 1](np.int64(b), np.int64(h), np.int64(i), np.int64(j), np.int64(n),
                          L.dropout_args(d), by_keys, by_queries)
    scale = np.float32(d.scale)
    want_keys = np.where(keep_bits(d, b, h, i, j + np.arange(n)), scale, np.float32(0))
    want_queries = np.where(keep_bits(d, b, h, i + np.arange(n), j), scale, np.float32(0))
    assert np.array_equal(by_keys, want_keys), f"dropout_keys {by_keys} vs {want_keys}"
    assert np.array_equal(by_queries, want_queries), f"dropout_queries {by_queries} vs " \
                                                     f"{want_queries}"


def test_device_philox_is_the_host_rule():
    """The device words of random counters and keys are `varlen.dropout.philox4x32_10`'s."""
    rng = np.random.default_rng(1)
    ctr = rng.integers(0, 2**32, (5, 4), dtype=np.uint64).astype(np.uint32)
    key = rng.integers(0, 2**32, (5, 2), dtype=np.uint64).astype(np.uint32)
    out = np.zeros((5, 4), np.uint32)
    _philox_kernel[1, 5](ctr, key, out)
    want = np.stack(philox4x32_10(*ctr.T, *key.T), axis=1)
    assert np.array_equal(out, want), f"device words {out} vs {want}"


def test_backend_runs_dropout():
    problem = Problem("float32", 8, 8, False, dropout=make_dropout(0.1, 1))
    assert NUMBA.supports_dropout(problem) is None


def test_keep_set_is_the_reference_bitwise():
    """q = 0 (every visible key equally likely) and v one-hot at each key's position: out[i, h,
    j] != 0 exactly where query i keeps key j at head h. Lengths cross the 16-row tiles."""
    rng = np.random.default_rng(5)
    lq, lk, Hq, Hk = [0, 1, 19, 3], [5, 1, 19, 17], 4, 2
    bt = make_batch(rng, lq, lk, Hq=Hq, Hk=Hk, D=8, Dv=max(lk), dtype="float32", gaps=True)
    bt.q[...] = 0
    bt.v[...] = 0
    off_k = bt.cu_k if bt.off_k is None else bt.off_k
    for b, n in enumerate(lk):
        bt.v[off_k[b] + np.arange(n), :, np.arange(n)] = 1
    p = 0.37
    out, _ = varlen.attention_forward(bt.q, bt.k, bt.v, bt.cu_q, bt.cu_k, **bt.layout,
                                      backend="numba", dropout_p=p, seed=SEED, offset=3)
    keep = dropout_keep(bt.cu_q, bt.cu_k, Hq, p, SEED, offset=3)
    seen = sequence_masks(bt.cu_q, bt.cu_k, "full")
    off_q = bt.cu_q if bt.off_q is None else bt.off_q
    for b, (n_q, n_k) in enumerate(zip(lq, lk)):
        got = np.asarray(out[off_q[b]:off_q[b] + n_q, :, :n_k]).transpose(1, 0, 2) != 0
        want = keep[b] & seen[b][None]
        assert np.array_equal(got, want), (
            f"sequence {b} keeps {np.argwhere(got != want)[:5]} otherwise than dropout_keep")


def _window():
    return Mask(window_left=np.array([-1, 3, 0, -1], np.int32), window_right=0,
                bottom_right=np.array([False, True, True, False]))


def _bias():
    """A ScoreMod that hides pairs more than 6 apart and adds a per-head bias."""
    bias = np.array([0.5, -0.25, 1.0, 0.0], np.float32)
    return ScoreMod(lambda s, b, h, q, k, bias: varlen.where(abs(q - k) > 6, -np.inf,
                                                             s + bias[h]), bias)


# id: (lengths_q, lengths_k, make_batch keywords, call keywords, deterministic)
CASES = {
    "B4-fp32-Hq4Hk2-causal-gaps-atomic": (
        [0, 19, 1, 5], [3, 19, 1, 17], dict(Hq=4, Hk=2, D=8, dtype="float32", mask="causal",
                                            gaps=True), {}, False),
    "B4-bf16-Hq4Hk1-window_br-deterministic": (
        [5, 17, 1, 0], [9, 17, 2, 4], dict(Hq=4, Hk=1, D=8, dtype="bfloat16", mask=_window()),
        {}, True),
    "B3-fp16-Hq4Hk2-sinks-scoremod-atomic": (
        [17, 0, 3], [17, 2, 1], dict(Hq=4, Hk=2, D=8, Dv=4, dtype="float16", gaps=True),
        dict(sinks=np.array([0.3, -np.inf, 2.0, -1.0], np.float32), score_mod=_bias()), False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_forward_and_gradients_match_the_reference(case):
    lq, lk, batch_kw, call_kw, deterministic = CASES[case]
    rng = np.random.default_rng(7)
    bt = make_batch(rng, lq, lk, **batch_kw)
    drop = dict(dropout_p=0.3, seed=SEED, offset=2)
    kw = dict(**bt.layout, backend="numba", **drop, **call_kw)
    out, lse = varlen.attention_forward(bt.q, bt.k, bt.v, bt.cu_q, bt.cu_k, **kw)
    grads = varlen.attention_backward(bt.dout, bt.q, bt.k, bt.v, out, lse, bt.cu_q, bt.cu_k,
                                      **kw, deterministic=deterministic)
    check_against_reference(bt, out, lse, grads, label=f"numba {case}", **drop, **call_kw)


def test_seeds_repeat_and_differ():
    """The same seed gives bitwise the same output, lse and gradients (deterministic dQ);
    another seed or offset another output; dropout_p = 0 is the path without dropout; lse is
    that of the softmax without dropout."""
    rng = np.random.default_rng(2)
    bt = make_batch(rng, [6, 0, 9], [9, 3, 9], Hq=2, Hk=1, D=8, dtype="float32",
                    mask="causal", gaps=True)

    def run(forward_only=False, **kw):
        kw.update(bt.layout, backend="numba")
        out, lse = varlen.attention_forward(bt.q, bt.k, bt.v, bt.cu_q, bt.cu_k, **kw)
        if forward_only:
            return out, lse
        return out, lse, varlen.attention_backward(bt.dout, bt.q, bt.k, bt.v, out, lse,
                                                   bt.cu_q, bt.cu_k, **kw, deterministic=True)

    base = run(dropout_p=0.2, seed=SEED)
    again = run(dropout_p=0.2, seed=SEED)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), (*base[:2], *base[2]),
                          (*again[:2], *again[2])):
        assert np.array_equal(a, b, equal_nan=True), f"{name} differs with the same seed"
    for other in (dict(seed=SEED + 1), dict(seed=SEED, offset=1)):
        out = run(forward_only=True, dropout_p=0.2, **other)[0]
        assert not np.array_equal(out, base[0]), f"{other} gives the same output"
    plain = run()
    zero = run(dropout_p=0.0, seed=SEED)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), (*plain[:2], *plain[2]),
                          (*zero[:2], *zero[2])):
        assert np.array_equal(a, b, equal_nan=True), f"dropout_p=0 changes {name}"
    assert not np.array_equal(base[0], plain[0]), "dropout_p=0.2 changes nothing"
    assert np.array_equal(base[1], plain[1]), "lse is not that of the softmax without dropout"
