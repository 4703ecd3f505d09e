"""User functions in the Numba kernels: MaskMod and ScoreMod forward and backward, aux gradients.

The gallery's functions (`tests/mods_cases.py`) on tiny batches (zero-length and one-row
sequences, lengths off the tile size, tiles a mask_mod empties), against the float64 reference
with the dtype-aware tolerances of `varlen.testing`; rows a function leaves without a key; an
aux index out of range, raised at once for host data and by `check_device_errors()` for device
arrays. The same tests run in the simulator and on a GPU.
"""
import contextlib
import zlib

import numpy as np
import pytest

from numba import cuda   # a module global: the simulator swaps it inside kernels

import varlen
from varlen import MaskMod, ScoreMod, reference
from varlen.mods import Mods
from varlen.backends import _aux_fixed as FX
from varlen.backends import _numba_kernels as K
from varlen.backends import _numba_launch as L
from varlen.backends.numba_backend import BACKEND as NUMBA, plan_from_cu_seqlens, variant

from numba_testing import SIM
from helpers import (assert_close, assert_lse, covered_rows, make_batch, naive_same_dtype,
                     np_dtype)
from mods_cases import mask_cases, score_cases

HQ, HK, D = 2, 1, 16


def _by_id(cases, name):
    return None if name is None else dict(cases)[name]


# id: (lengths, dtype, mask_mod id, score_mod id, call keywords); block 4 x 4 where a
# mask_mod empties whole tiles of the built-in schedule (chunks of 5, documents).
CASES = {
    "B3-L5,0,17-fp32-prefix_lm-alibi-aux": ([5, 0, 17], "float32", "prefix-lm", "alibi",
                                            dict(aux_grads=True)),
    "B2-L17,1-fp16-segments-t5-aux-blk4": ([17, 1], "float16", "segments", "t5",
                                           dict(aux_grads=True, blocks=(4, 4))),
    "B2-L1,17-bf16-tree-relative_bias_bf16-aux": ([1, 17], "bfloat16", "tree", "relative-bias",
                                                  dict(aux_grads=True, aux_dtype="bfloat16")),
    "B3-L0,5,17-fp32-window&prefix-hide_first-softcap-deterministic": (
        [0, 5, 17], "float32", "window&prefix", "hide-first",
        dict(softcap=2.0, deterministic=True)),
    "B2-L17,5-fp32-chunked-soft_clip-blk4": ([17, 5], "float32", "chunked", "soft-clip",
                                             dict(blocks=(4, 4))),
    "B2-L5,17-fp16-sliding_global": ([5, 17], "float16", "sliding-global", None, {}),
    "B2-L17,0-fp32-causal-alibi-score_only": ([17, 0], "float32", None, "alibi",
                                              dict(mask="causal", aux_grads=True)),
    "B3-L0,17,5-fp16-relative_bias-aux-deterministic": (
        [0, 17, 5], "float16", None, "relative-bias",
        dict(mask="causal", aux_grads=True, deterministic=True)),
}


@pytest.fixture(autouse=True)
def _nan_fill():
    """Fresh buffers start as NaN (tests/conftest.py turns it on for the suite)."""
    before = varlen.set_nan_fill(True)
    yield
    varlen.set_nan_fill(before)


def _amax(a):
    a = np.abs(np.asarray(a, np.float64))
    return float(a.max()) if a.size else 0.0


def _check(label, batch, mods_kw, got, *, softmax_scale, softcap, grads=True):
    """Forward, gradients and aux gradients against `varlen.reference` (float64)."""
    out, lse = got[:2]
    kw = dict(**batch.layout, softmax_scale=softmax_scale, softcap=softcap,
              score_mod=mods_kw.get("score_mod"))
    ref_out, ref_lse = reference.attention_dense(batch.q, batch.k, batch.v, batch.cu_q,
                                                 batch.cu_k, **kw)
    naive = 0.0
    if batch.dtype != "float64":
        naive = _amax(naive_same_dtype(batch, softmax_scale, softcap,
                                       score_mod=kw["score_mod"]) - ref_out)
    assert_close(f"{label} out", out, ref_out, dtype=batch.dtype, naive_err=naive)
    assert_lse(f"{label} lse", lse, ref_lse, dtype=batch.dtype)
    if not grads:
        return
    aux_grads = mods_kw.get("aux_grads", False)
    ref = reference.attention_dense_backward(batch.dout, batch.q, batch.k, batch.v, batch.cu_q,
                                             batch.cu_k, **kw, aux_grads=aux_grads)
    magnitude = _amax(ref_out) * _amax(np.where(covered_rows(batch)[:, None, None],
                                                batch.dout.astype(np.float64), 0.0))
    rel = naive / max(_amax(ref_out), 1e-30)
    names, mine, want = ["dq", "dk", "dv"], list(got[2][:3]), list(ref[:3])
    assert len(got[2]) == 3 + aux_grads, f"{label}: {len(got[2])} gradients returned"
    if aux_grads:
        names += [f"daux{i}" for i in range(len(ref[3]))]
        mine += list(got[2][3])
        want += list(ref[3])
    # an aux gradient entry sums up to every pair of its head in float32, in the atomics' order:
    # its rounding grows as the square root of that count
    pairs = int(np.sum(np.diff(batch.cu_q) * np.diff(batch.cu_k))) * HQ
    for name, g, r in zip(names, mine, want):
        if r is None:
            assert g is None, f"{label} {name}: a gradient for an int or bool aux array"
            continue
        floor = 16.0
        if name.startswith("daux"):
            assert g.dtype == np.float32 and g.shape == r.shape, f"{label} {name}: {g.dtype}"
            floor = max(floor, 4.0 * np.sqrt(pairs))
        assert_close(f"{label} {name}", g, r, dtype=batch.dtype,
                     naive_err=rel * max(_amax(r), 1e-30), factor=3.0, floor=floor,
                     magnitude=magnitude)


def _run(batch, mods_kw, *, softcap=0.0, deterministic=False, plan=None):
    kw = dict(**batch.layout, backend="numba", softcap=softcap, plan=plan,
              score_mod=mods_kw.get("score_mod"))
    out, lse = varlen.attention_forward(batch.q, batch.k, batch.v, batch.cu_q, batch.cu_k, **kw)
    grads = varlen.attention_backward(batch.dout, batch.q, batch.k, batch.v, out, lse,
                                      batch.cu_q, batch.cu_k, **kw, deterministic=deterministic,
                                      aux_grads=mods_kw.get("aux_grads", False))
    return out, lse, grads


@pytest.mark.parametrize("case", list(CASES))
def test_gallery_matches_reference(case):
    lengths, dtype, mask_id, score_id, ckw = CASES[case]
    mask_mod = _by_id(mask_cases(lengths), mask_id)
    score_mod = _by_id(score_cases(HQ), score_id)
    if "aux_dtype" in ckw:
        dt = np_dtype(ckw["aux_dtype"])
        score_mod = ScoreMod(score_mod.fn, *(a.astype(dt) if a.dtype.kind == "f" else a
                                             for a in score_mod.aux))
    mask = ckw.get("mask", "full") if mask_mod is None else mask_mod
    rng = np.random.default_rng(zlib.crc32(case.encode()))
    batch = make_batch(rng, lengths, lengths, Hq=HQ, Hk=HK, D=D, dtype=dtype, mask=mask,
                       gaps=True)
    plan = None
    if "blocks" in ckw:
        bm, bn = ckw["blocks"]
        plan = varlen.plan(batch.cu_q, batch.cu_k, seq_offsets_q=batch.off_q,
                           seq_offsets_k=batch.off_k, num_rows_q=batch.q.shape[0],
                           num_rows_k=batch.k.shape[0], mask=mask, block_m=bm, block_n=bn,
                           backend="numba")
    mods_kw = dict(score_mod=score_mod, aux_grads=ckw.get("aux_grads", False))
    softcap = ckw.get("softcap", 0.0)
    deterministic = ckw.get("deterministic", False)
    out, lse, grads = _run(batch, mods_kw, softcap=softcap, deterministic=deterministic,
                           plan=plan)
    if deterministic:
        again = _run(batch, mods_kw, softcap=softcap, deterministic=True, plan=plan)[2]
        pairs = list(zip(("dq", "dk", "dv"), grads, again))
        if mods_kw["aux_grads"]:
            pairs += [(f"daux{i}", a, b) for i, (a, b) in enumerate(zip(grads[3], again[3]))
                      if a is not None]
        for name, a, b in pairs:
            assert a.tobytes() == b.tobytes(), f"deterministic {name} differs between two runs"
    assert out.dtype == batch.q.dtype and lse.dtype == np.float32
    _check(case, batch, mods_kw, (out, lse, grads), softmax_scale=1.0 / np.sqrt(D),
           softcap=softcap)
    pad_q, pad_k = ~covered_rows(batch, "q"), ~covered_rows(batch, "k")
    assert np.all(np.asarray(out, np.float64)[pad_q] == 0), "pad rows of out are not zero"
    for name, g, pad in zip(("dq", "dk", "dv"), grads, (pad_q, pad_k, pad_k)):
        assert np.all(np.asarray(g, np.float64)[pad] == 0), f"pad rows of {name} are not zero"


def test_rows_left_without_a_key():
    """A mask_mod that hides every key of a row, and a score_mod that sends every score of
    another row to -inf: out 0, lse -inf, zero gradients for those rows, as the reference."""
    rng = np.random.default_rng(5)
    mask = MaskMod(lambda b, q, k: (k <= q) & (q != 3))
    score = ScoreMod(lambda s, b, h, q, k: varlen.where((q == 1) | ((h == 1) & (q == 4)),
                                                        -np.inf, s))
    batch = make_batch(rng, [6, 1], [6, 1], Hq=HQ, Hk=HK, D=D, dtype="float32", mask=mask)
    out, lse, grads = _run(batch, dict(score_mod=score))
    _check("empty rows", batch, dict(score_mod=score), (out, lse, grads),
           softmax_scale=1.0 / np.sqrt(D), softcap=0.0)
    row = batch.cu_q[0] if batch.off_q is None else batch.off_q[0]
    for i, heads in ((1, (0, 1)), (3, (0, 1)), (4, (1,))):
        for h in heads:
            assert np.isneginf(lse[h, row + i]), f"lse of row {i}, head {h} is {lse[h, row + i]}"
            assert np.all(out[row + i, h] == 0), f"out of row {i}, head {h} is not zero"
            assert np.all(grads[0][row + i, h] == 0), f"dq of row {i}, head {h} is not zero"
    assert np.isfinite(lse[0, row + 4]), "head 0 of row 4 sees keys"


def test_non_finite_values_reach_only_the_pairs_a_score_mod_leaves():
    """A key the score_mod hides from every query (-inf) takes no part even with NaN and inf
    in its k and v rows; a NaN in a query row still makes that row (and the keys it sees)
    NaN: the NaN pattern and the finite values are the reference's."""
    rng = np.random.default_rng(7)
    score = ScoreMod(lambda s, b, h, q, k: varlen.where(k == 2, -np.inf, s))
    batch = make_batch(rng, [6, 3], [6, 3], Hq=HQ, Hk=HK, D=D, dtype="float32", mask="causal")
    sq = batch.cu_q[:-1] if batch.off_q is None else batch.off_q[:-1]
    sk = batch.cu_k[:-1] if batch.off_k is None else batch.off_k[:-1]
    batch.k[sk[0] + 2, :, 3] = np.nan
    batch.v[sk[0] + 2, :, 1] = np.inf
    batch.q[sq[1] + 1, 0, 5] = np.nan
    out, lse, grads = _run(batch, dict(score_mod=score))
    kw = dict(**batch.layout, score_mod=score, softmax_scale=1.0 / np.sqrt(D))
    ref = reference.attention_dense(batch.q, batch.k, batch.v, batch.cu_q, batch.cu_k, **kw)
    ref_grads = reference.attention_dense_backward(batch.dout, batch.q, batch.k, batch.v,
                                                   batch.cu_q, batch.cu_k, **kw, out=ref[0],
                                                   lse=ref[1])
    for name, g, r in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads),
                          (*ref, *ref_grads)):
        g = np.asarray(g, np.float64)
        assert np.array_equal(np.isnan(g), np.isnan(r)), (
            f"{name}: NaN at {np.argwhere(np.isnan(g) != np.isnan(r))[:4].tolist()} differs")
        fin = np.isfinite(r)
        np.testing.assert_allclose(g[fin], r[fin], rtol=1e-4, atol=1e-5, err_msg=name)
    assert np.isnan(lse[0, sq[1] + 1]) and not np.isnan(out[sq[0] + 3]).any()


def _index_cases():
    slopes = np.ones(HQ, np.float32)
    return {
        "score_mod": (None, ScoreMod(lambda s, b, h, q, k, m: s - m[h + 1] * abs(q - k),
                                     slopes)),
        "mask_mod": (MaskMod(lambda b, q, k, p: (k <= q) | (k < p[b + 1]),
                             np.array([1, 2], np.int32)), None),
    }


@pytest.mark.parametrize("role", ["score_mod", "mask_mod"])
def test_aux_index_out_of_range_raises_on_the_host(role):
    """Host data (run in the device and copied back): the kernels clamp the index and flag
    it; the call raises an IndexError naming the function, forward and backward."""
    mask, score = _index_cases()[role]
    rng = np.random.default_rng(9)
    batch = make_batch(rng, [5, 1], [5, 1], Hq=HQ, Hk=HK, D=D, dtype="float32",
                       mask=mask if mask is not None else "full")
    kw = dict(**batch.layout, backend="numba", score_mod=score)
    with pytest.raises(IndexError, match=f"{role} reads one of its aux arrays at an index out "
                                         f"of range"):
        varlen.attention_forward(batch.q, batch.k, batch.v, batch.cu_q, batch.cu_k, **kw)
    out = np.zeros_like(batch.dout)
    lse = np.zeros((HQ, batch.q.shape[0]), np.float32)
    with pytest.raises(IndexError, match=role):
        varlen.attention_backward(batch.dout, batch.q, batch.k, batch.v, out, lse, batch.cu_q,
                                  batch.cu_k, **kw)


def _drain_device_errors():
    with contextlib.suppress(ValueError):
        varlen.check_device_errors()


def test_aux_index_out_of_range_is_a_device_error():
    """Numba device arrays: nothing is read on the host; the flag reaches
    `varlen.check_device_errors()`, which names the function once; an index in range
    records nothing."""
    rng = np.random.default_rng(11)
    cu = np.array([0, 5, 6], np.int32)
    T = int(cu[-1])
    q, k, v = (cuda.to_device(rng.standard_normal((T, h, D)).astype(np.float32))
               for h in (HQ, HK, HK))
    plan = plan_from_cu_seqlens(cuda.to_device(cu), cuda.to_device(cu), num_rows_q=T,
                                num_rows_k=T, mask="causal", dtype="float32", head_dim=D)
    _drain_device_errors()
    for shift, bad in ((0, False), (1, True)):
        score = ScoreMod(lambda s, b, h, q, k, m, shift=shift: s - m[h + shift],
                         np.ones(HQ, np.float32))
        mods = Mods(score=score.with_aux([cuda.to_device(np.ones(HQ, np.float32))]))
        out, lse = NUMBA.forward(plan, q, k, v, softmax_scale=0.25, softcap=0.0, mods=mods)
        assert L.kind_of(out) == "numba"
        if not bad:
            varlen.check_device_errors()
            continue
        with pytest.raises(IndexError, match="score_mod reads one of its aux arrays at an "
                                             "index out of range"):
            varlen.check_device_errors()
        varlen.check_device_errors()


@pytest.mark.skipif(not SIM, reason="counts calls of a device function: the simulator only")
def test_mask_mod_is_evaluated_in_partial_tiles_only(monkeypatch):
    """The kernels classify each tile by the generated class code: an EMPTY tile is skipped and
    a FULL one runs without the mask_mod, so the mask_mod runs once per pair of the PARTIAL
    tiles (the host plan's classes, `Plan.tile_classes`), in the forward and in each pass of
    the backward; and the results match the reference."""
    import math
    from varlen.mods import PARTIAL
    from varlen.mods import codegen
    chunk = 8 + len(codegen._NUMBA_CACHE)      # a graph no earlier test compiled
    mask = MaskMod(lambda b, q, k: (k <= q) & (q // chunk == k // chunk))
    calls = []
    scope = {"math": math, "float32": np.float32}
    exec(codegen.python_source(mask.graph, "f", packed=True, float_type="float32"), scope)

    def counted(b, i, j, args):
        calls.append(1)
        return scope["f"](b, i, j, args)
    monkeypatch.setitem(codegen._NUMBA_CACHE, (mask.graph.digest, True, True, True),
                        cuda.jit(device=True)(counted))
    rng = np.random.default_rng(3)
    lengths = [3 * chunk + 2, 5]
    batch = make_batch(rng, lengths, lengths, Hq=1, Hk=1, D=D, dtype="float32", mask=mask)
    plan = varlen.plan(batch.cu_q, batch.cu_k, num_rows_q=batch.q.shape[0],
                       num_rows_k=batch.k.shape[0], mask=mask, block_m=4, block_n=4,
                       backend="numba")
    host = plan.to_host()
    start, classes = host.tile_classes("q")
    partial_pairs = 0
    for i in np.flatnonzero(host.q_tiles[:, 0] >= 0):
        b, rows = host.q_tiles[i, 0], host.q_tiles[i, 3]
        bg, en = host.q_sched[i, 0, 0], host.q_sched[i, 0, 3]
        for t in range(bg, en):
            if classes[start[i, 0] + t - bg] == PARTIAL:
                partial_pairs += rows * min(4, int(host.k.length[b, 0]) - 4 * t)
    kept = sum(int(host.q_sched[i, 0, 3] - host.q_sched[i, 0, 0])
               for i in np.flatnonzero(host.q_tiles[:, 0] >= 0))
    assert 0 < (classes == PARTIAL).sum() < kept / 2, "the case must hold EMPTY and FULL tiles"
    kw = dict(**batch.layout, backend="numba", plan=plan)
    out, lse = varlen.attention_forward(batch.q, batch.k, batch.v, batch.cu_q, batch.cu_k, **kw)
    assert len(calls) == partial_pairs, (len(calls), partial_pairs)
    calls.clear()
    grads = varlen.attention_backward(batch.dout, batch.q, batch.k, batch.v, out, lse,
                                      batch.cu_q, batch.cu_k, **kw, deterministic=True)
    assert len(calls) == 2 * partial_pairs, (len(calls), partial_pairs)   # dK/dV and dQ
    _check("partial only", batch, {}, (out, lse, grads), softmax_scale=1.0 / np.sqrt(D),
           softcap=0.0)


@pytest.mark.parametrize("deterministic", [True, False], ids=["fixed_point", "atomics"])
def test_nan_in_an_aux_entry_reaches_its_gradient(deterministic):
    """A NaN in a relative-bias entry that visible pairs read: the rows that read it are NaN,
    and so is every aux gradient entry those rows read (the reference's pattern: NaN exactly
    there), the other entries finite and matching; `deterministic=True` (fixed-point sums)
    and float32 atomics alike. Also a table entry no visible pair reads stays finite."""
    rng = np.random.default_rng(13)
    score = score_cases(HQ)[1][1]           # relative-bias: table[h, clip(q - k, -6, 6) + 6]
    table = score.aux[0].copy()
    table[1, 6 - 2] = np.nan                # head 1, q - k = -2: hidden by the causal mask
    table[0, 6 + 1] = np.nan                # head 0, q - k = 1: read by visible pairs
    score = ScoreMod(score.fn, table)
    batch = make_batch(rng, [5, 0, 3], [5, 0, 3], Hq=HQ, Hk=HK, D=D, dtype="float32",
                       mask="causal", gaps=True)
    out, lse, grads = _run(batch, dict(score_mod=score, aux_grads=True),
                           deterministic=deterministic)
    kw = dict(**batch.layout, score_mod=score, softmax_scale=1.0 / np.sqrt(D))
    ref = reference.attention_dense(batch.q, batch.k, batch.v, batch.cu_q, batch.cu_k, **kw)
    ref_grads = reference.attention_dense_backward(batch.dout, batch.q, batch.k, batch.v,
                                                   batch.cu_q, batch.cu_k, **kw, out=ref[0],
                                                   lse=ref[1], aux_grads=True)
    got, want = np.asarray(grads[3][0], np.float64), ref_grads[3][0]
    assert np.array_equal(np.isnan(got), np.isnan(want)), (
        f"NaN at {np.argwhere(np.isnan(got)).tolist()}, reference {np.argwhere(np.isnan(want))}")
    assert np.isnan(got[0, 6 + 1]) and not np.isnan(got[1]).any(), got
    fin = np.isfinite(want)
    np.testing.assert_allclose(got[fin], want[fin], rtol=1e-4, atol=1e-5)


def test_aux_grads_past_the_fixed_point_range_raise():
    """deterministic=True: a contribution of 2^39 or more (here d/dt = 1e30) leaves the range
    of the fixed-point sums: an OverflowError at once for host data, never a wrapped value."""
    rng = np.random.default_rng(19)
    score = ScoreMod(lambda s, b, h, q, k, t: s + 1e30 * t[h], np.zeros(HQ, np.float32))
    batch = make_batch(rng, [4], [4], Hq=HQ, Hk=HK, D=D, dtype="float32", mask="causal")
    with pytest.raises(OverflowError, match="fixed-point"):
        _run(batch, dict(score_mod=score, aux_grads=True), deterministic=True)


@cuda.jit
def _add_each(words, entry, values):
    """Thread t adds values[t] to entry entry[t] of the fixed-point words."""
    t = cuda.grid(1)
    if t < values.size and values[t] != 0:
        K.fixed_add(words, entry[t], values[t])


def test_fixed_point_sums_and_their_conversions():
    """The deterministic aux gradients' fixed point (`varlen.backends._aux_fixed`): sums of
    float32 contributions within 2^-49 per term of the float64 sum, in any order the same
    bits; NaN, +inf, -inf and both infinities as float addition gives them; the Numba
    conversion kernel and the array code (`to_float32`, CuPy's) agree bit for bit, and both
    flag an entry out of range."""
    rng = np.random.default_rng(23)
    finite = np.concatenate([rng.standard_normal(40) * 10.0 ** rng.integers(-12, 8, 40),
                             [3e-20, -1.5, 2.0 ** 38, 2.0 ** -49]]).astype(np.float32)
    cases = [finite, [1.0, np.nan, 2.0], [np.inf, 1.0], [-np.inf, -3.0], [np.inf, -np.inf],
             [2.0 ** 39, 1.0], [-(2.0 ** 30)] * 600, [0.0]]
    entry = np.concatenate([np.full(len(c), i) for i, c in enumerate(cases)]).astype(np.int64)
    values = np.concatenate(cases).astype(np.float32)
    results = []
    for order in (np.arange(values.size), rng.permutation(values.size)):
        words = np.zeros((len(cases), FX.WORDS), np.uint64)
        _add_each[-(-values.size // 64), 64](words, entry[order], values[order])
        out, err = np.full(len(cases), np.nan, np.float32), np.zeros(1, np.int32)
        K.aux_fixed_kernel[1, 32](words, out, err)
        array_out, array_err = FX.to_float32(np, words)
        assert out.tobytes() == array_out.tobytes(), (out, array_out)
        assert bool(err[0]) and bool(array_err), "an entry out of range is flagged"
        results.append(out)
    assert results[0].tobytes() == results[1].tobytes(), "the order changed the sums"
    out = results[0]
    exact = np.sum(finite.astype(np.float64))
    assert abs(out[0] - exact) <= finite.size * 2.0 ** -49 + abs(exact) * 2.0 ** -24, (
        out[0], exact)
    assert np.isnan(out[1]) and out[2] == np.inf and out[3] == -np.inf and np.isnan(out[4])
    assert np.isnan(out[5]), "a single contribution of 2^39 is out of range"
    assert np.isnan(out[6]), "600 contributions of -2^30 sum past the range"
    assert out[7] == 0.0


def test_variants_are_specialised_per_function():
    """One kernel per (variant, mask digest, score digest): equal functions share it."""
    from varlen.backends import _numba_kernels as K
    rng = np.random.default_rng(17)
    batch = make_batch(rng, [3], [3], Hq=HQ, Hk=HK, D=D, dtype="float32")
    plan = NUMBA.plan_from_cu_seqlens(batch.cu_q, batch.cu_k, None, None, 3, 3, "full",
                                      block_m=16, block_n=16)
    a, b = score_cases(HQ)[0][1], score_cases(HQ, seed=1)[0][1]
    c = score_cases(HQ)[1][1]
    var = [variant(plan, batch.q, batch.v, 0.0, Mods(score=s)) for s in (a, b, c)]
    assert var[0] == var[1] and hash(var[0]) == hash(var[1])
    assert var[0] != var[2] and var[0].fns.score == a.digest
    assert K.forward_kernel(var[0]) is K.forward_kernel(var[1])
    assert K.forward_kernel(var[0]) is not K.forward_kernel(var[2])
