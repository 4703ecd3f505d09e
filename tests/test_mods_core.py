"""The expression graphs behind MaskMod and ScoreMod: tracing, evaluation, interval
classification (sound against every pair), derivatives (against finite differences) and the
generated Python source (the same values as the array evaluation)."""
import math

import numba
import numpy as np
import pytest

import varlen
from varlen.mods import (EMPTY, FULL, PARTIAL, MaskMod, ScoreMod, classify, evaluate)
from varlen.mods.codegen import numba_function, python_source

RNG = np.random.default_rng(7)
PREFIX = np.array([3, 0, 5, 9], np.int32)
SEG = RNG.integers(0, 3, size=64).astype(np.int32)
SEG.sort()
START = np.array([0, 16, 32, 48], np.int32)
SLOPES = np.array([0.5, 0.25, 0.125], np.float64)
TABLE = RNG.standard_normal((3, 9))


def _chunk(b, q, k):
    return (k <= q) & (q // 4 == k // 4)


MASKS = {
    "causal": MaskMod(lambda b, q, k: k <= q),
    "prefix-lm": MaskMod(lambda b, q, k, p: (k <= q) | (k < p[b]), PREFIX),
    "chunked": MaskMod(_chunk),
    "sliding+global": MaskMod(lambda b, q, k: ((k <= q) & (q - k < 3)) | (k < 2)),
    "segments": MaskMod(lambda b, q, k, seg, st: seg[st[b] + q] == seg[st[b] + k], SEG, START),
    "mod-xor": MaskMod(lambda b, q, k: ((q % 3) ^ (k % 3)) != 1),
    "where": MaskMod(lambda b, q, k: varlen.mods.where(q > 5, k <= q, k >= q)),
    "neg-abs": MaskMod(lambda b, q, k: abs(-(q - k)) <= varlen.mods.maximum(b, 2)),
}

SCORES = {
    "alibi": ScoreMod(lambda s, b, h, q, k, m: s - m[h] * abs(q - k), SLOPES),
    "softcap": ScoreMod(lambda s, b, h, q, k: 5.0 * np.tanh(s / 5.0)),
    "table": ScoreMod(lambda s, b, h, q, k, t: s + t[h, varlen.mods.minimum(
        varlen.mods.maximum(q - k, -4), 4) + 4], TABLE),
    "mixed": ScoreMod(lambda s, b, h, q, k: varlen.mods.where(
        s > 0, s * s / (1.0 + q), varlen.mods.exp(s) - 1.0) + varlen.mods.sqrt(1.0 + k)),
    "log": ScoreMod(lambda s, b, h, q, k: varlen.mods.log(1.0 + s * s) + s % 1.5),
}


def _grid(n=16, B=4, H=3):
    b, h, q, k = np.meshgrid(np.arange(B), np.arange(H), np.arange(n), np.arange(n),
                             indexing="ij")
    return b, h, q, k


@pytest.mark.parametrize("name", MASKS)
def test_classification_is_sound_on_every_box(name):
    """A FULL box holds only visible pairs, an EMPTY one none: checked pair by pair."""
    m = MASKS[name]
    b, _, q, k = _grid()
    dense = evaluate(m.graph, {"b": b[:, 0], "q_idx": q[:, 0], "k_idx": k[:, 0]}, m.aux)
    seen = {EMPTY: 0, FULL: 0, PARTIAL: 0}
    for bb in range(4):
        for q0 in range(0, 16, 3):
            for k0 in range(0, 16, 5):
                for w in (1, 2, 4):
                    q1, k1 = min(q0 + w, 15), min(k0 + w + 1, 15)
                    c = int(classify(m, bb, q0, q1, k0, k1))
                    block = dense[bb, q0:q1 + 1, k0:k1 + 1]
                    seen[c] += 1
                    if c == FULL:
                        assert block.all(), f"{name}: FULL box b{bb} q{q0}-{q1} k{k0}-{k1}"
                    if c == EMPTY:
                        assert not block.any(), f"{name}: EMPTY box b{bb} q{q0}-{q1} k{k0}-{k1}"
    if name in ("causal", "chunked", "prefix-lm"):
        assert seen[EMPTY] and seen[FULL], f"{name}: classification found nothing: {seen}"


def test_classification_is_exact_for_chunked_causal_tiles():
    """Tiles of 64 over chunks of 128: every tile off the diagonal chunk is EMPTY or FULL."""
    m = MaskMod(lambda b, q, k: (k <= q) & (q // 128 == k // 128))
    t = np.arange(8) * 64
    qq, kk = np.meshgrid(t, t, indexing="ij")
    c = classify(m, 0, qq, qq + 63, kk, kk + 63)
    expect = np.where((qq // 128 == kk // 128) & (kk < qq), FULL,
                      np.where(qq == kk, PARTIAL, EMPTY))
    np.testing.assert_array_equal(c, expect)


TREE = RNG.random((16, 16)) < 0.5                          # a 2-D table: runs off one row
LONG = np.repeat(np.arange(3, dtype=np.int64), 200)         # runs past RANGE_CAP entries
CLASS_MASKS = {**MASKS,
               "tree": MaskMod(lambda b, q, k, anc: anc[q, k] | (k == q), TREE),
               "long-runs": MaskMod(lambda b, q, k, s: s[q * 20] == s[k * 20], LONG),
               "float-aux": MaskMod(lambda b, q, k, w: w[b] * (q - k) >= 1.5, SLOPES),
               "outside": MaskMod(lambda b, q, k, p: k < p[q], PREFIX)}


def _class_functions(m):
    """The generated class code of `m` as plain Python and compiled by Numba."""
    from varlen.mods import class_graph
    g = class_graph(m.graph)
    scope = {"math": math}
    exec(python_source(g, "f"), scope)
    return scope["f"], numba_function(g)


@pytest.mark.parametrize("name", CLASS_MASKS)
def test_generated_class_code_is_sound_and_the_plan_s_class_where_runs_fit(name):
    """The class code the kernels run per tile (`class_graph`): every box it calls FULL holds
    only visible pairs, EMPTY none, a box an aux index may leave is PARTIAL; where each aux
    read is one run of at most RANGE_CAP entries it says what the host plan says, elsewhere
    PARTIAL or the plan's class. Plain Python and Numba agree."""
    from varlen.mods.evaluate import RANGE_CAP
    m = CLASS_MASKS[name]
    py, nb = _class_functions(m)
    b, _, q, k = (x[:, 0] for x in _grid())
    with np.errstate(all="ignore"):
        dense = evaluate(m.graph, {"b": b, "q_idx": q, "k_idx": k}, m.aux, check=False)
    err = np.zeros(1, np.int32)
    seen = set()
    for bb in range(4):
        for q0 in range(0, 16, 3):
            for k0 in range(0, 16, 5):
                for w in (0, 1, 4, 15):
                    q1, k1 = min(q0 + w, 15), min(k0 + w + 1, 15)
                    box = f"{name}: b{bb} q{q0}-{q1} k{k0}-{k1}"
                    c = py(bb, q0, q1, k0, k1, *m.aux, err)
                    assert nb(bb, q0, q1, k0, k1, *m.aux, err) == c, box
                    host = int(classify(m, bb, q0, q1, k0, k1))
                    block = dense[bb, q0:q1 + 1, k0:k1 + 1]
                    assert c != FULL or block.all(), box
                    assert c != EMPTY or not block.any(), box
                    assert c in (host, PARTIAL), box
                    fits = name not in ("tree", "long-runs") or (
                        name == "tree" and q0 == q1) or (
                        name == "long-runs" and 20 * max(q1 - q0, k1 - k0) < RANGE_CAP)
                    if fits:
                        assert c == host, box
                    seen.add(c)
    assert err[0] == 0, "class code flags nothing: a box it may read outside is PARTIAL"
    if name in ("causal", "chunked", "prefix-lm", "segments", "tree", "long-runs"):
        assert {EMPTY, FULL} <= seen, f"{name}: the class code found nothing: {seen}"


@pytest.mark.parametrize("name", MASKS)
def test_generated_python_matches_the_array_evaluation(name):
    m = MASKS[name]
    b, _, q, k = (x[:, 0] for x in _grid(10))
    want = evaluate(m.graph, {"b": b, "q_idx": q, "k_idx": k}, m.aux)
    scope = {"math": math}
    exec(python_source(m.graph, "f"), scope)
    err = np.zeros(1, np.int32)
    got = np.vectorize(lambda *a: scope["f"](*a, *m.aux, err))(b, q, k)
    np.testing.assert_array_equal(got, want)
    assert err[0] == 0


@pytest.mark.parametrize("name", SCORES)
def test_score_derivatives_match_finite_differences(name):
    sm = SCORES[name]
    b, h, q, k = _grid(6)
    s = RNG.uniform(-2, 2, size=q.shape)
    leaves = {"score": s, "b": b, "h": h, "q_idx": q, "k_idx": k}
    d = evaluate(sm.d_score(), leaves, sm.aux)
    eps = 1e-6
    fd = (evaluate(sm.graph, {**leaves, "score": s + eps}, sm.aux) -
          evaluate(sm.graph, {**leaves, "score": s - eps}, sm.aux)) / (2 * eps)
    np.testing.assert_allclose(d, fd, rtol=1e-5, atol=1e-6, err_msg=name)
    for load, dg in sm.d_aux():
        a = sm.aux[load.value]
        grad = np.zeros_like(a)
        idx = [np.broadcast_to(evaluate_index(i, leaves, sm), s.shape) for i in load.args]
        np.add.at(grad, tuple(idx), evaluate(dg, leaves, sm.aux) * np.ones_like(s))
        for flat in RNG.choice(a.size, size=min(4, a.size), replace=False):
            bumped = [x.copy() for x in sm.aux]
            bumped[load.value].reshape(-1)[flat] += eps
            lo = [x.copy() for x in sm.aux]
            lo[load.value].reshape(-1)[flat] -= eps
            fd = (evaluate(sm.graph, leaves, bumped) - evaluate(sm.graph, leaves, lo)).sum() / (
                2 * eps)
            assert grad.reshape(-1)[flat] == pytest.approx(fd, rel=1e-5, abs=1e-6), name


def evaluate_index(node, leaves, sm):
    from varlen.mods.graph import Graph
    return evaluate(Graph(node, sm.graph.leaves, sm.graph.aux, "index"), leaves, sm.aux)


@pytest.mark.parametrize("name", SCORES)
def test_numba_score_function_matches_the_array_evaluation(name):
    sm = SCORES[name]
    fn = numba_function(sm.graph)
    err = np.zeros(1, np.int32)
    b, h, q, k = (x.reshape(-1) for x in _grid(5))
    s = RNG.uniform(-2, 2, size=q.shape)
    want = evaluate(sm.graph, {"score": s, "b": b, "h": h, "q_idx": q, "k_idx": k}, sm.aux)
    got = np.array([fn(s[i], b[i], h[i], q[i], k[i], *sm.aux, err) for i in range(s.size)])
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", SCORES)
def test_float32_score_function_matches_the_array_evaluation_to_float32_rounding(name):
    """The float32 variant (what the CUDA kernels compile) computes in float32 throughout:
    Numba types its result float32 (nothing widened to float64 on the way), and its values
    are the float64 evaluation's to a few float32 roundings."""
    sm = SCORES[name]
    fn = numba_function(sm.graph, float32=True)
    err = np.zeros(1, np.int32)
    b, h, q, k = (x.reshape(-1) for x in _grid(5))
    s = RNG.uniform(-2, 2, size=q.shape).astype(np.float32)
    want = evaluate(sm.graph, {"score": s.astype(np.float64), "b": b, "h": h, "q_idx": q,
                               "k_idx": k}, sm.aux)
    got = np.array([fn(s[i], b[i], h[i], q[i], k[i], *sm.aux, err) for i in range(s.size)])
    assert [sig.return_type for sig in fn.nopython_signatures] == [numba.float32], name
    eps = np.finfo(np.float32).eps
    np.testing.assert_allclose(got, want, rtol=8 * eps, atol=8 * eps, err_msg=name)
    assert np.abs(got - want).max() > 0, f"{name}: the float32 variant gave float64 values"


def test_integer_division_by_zero_is_zero_everywhere():
    m = MaskMod(lambda b, q, k: (q // (k - 2)) + (q % (k - 2)) == 0)
    q, k = np.meshgrid(np.arange(5), np.arange(5), indexing="ij")
    got = evaluate(m.graph, {"b": 0, "q_idx": q, "k_idx": k}, ())
    assert got[3, 2] and got[0, 2], "x // 0 and x % 0 are 0"
    fn = numba_function(m.graph)
    for qq, kk in ((3, 2), (0, 2), (4, 1), (1, 4)):
        assert fn(0, qq, kk, np.zeros(1, np.int32)) == got[qq, kk], (qq, kk)


def test_floor_semantics_of_negative_operands():
    m = ScoreMod(lambda s, b, h, q, k: s + (q - k) // 3 + (q - k) % 3)
    q, k = np.meshgrid(np.arange(6), np.arange(6), indexing="ij")
    got = evaluate(m.graph, {"score": 0.0, "b": 0, "h": 0, "q_idx": q, "k_idx": k}, ())
    np.testing.assert_array_equal(got, (q - k) // 3 + (q - k) % 3)


# ------------------------------------------------------------------------------------------
# Errors
# ------------------------------------------------------------------------------------------

def test_python_control_flow_names_the_line():
    def bad(b, q, k):
        if q > k:                                   # the line the error names
            return True
        return k <= q
    with pytest.raises(TypeError, match=r"test_mods_core.py:\d+: if q > k:.*varlen.where"):
        MaskMod(bad)


@pytest.mark.parametrize("fn, match", [
    (lambda b, q, k: max(q, k) > 3, "Python bool"),
    (lambda b, q, k: (q > 1) and (k > 1), "Python bool"),
    (lambda b, q, k: q ** 2 > k, r"operation \*\*"),
    (lambda b, q, k: math.exp(q) > k, "float()"),
    (lambda b, q, k: np.sin(q) > k, "numpy.sin"),
    (lambda b, q, k: q - k, "must return a bool"),
], ids=["max", "and", "pow", "math-exp", "np-sin", "int-result"])
def test_unsupported_operations_name_themselves(fn, match):
    with pytest.raises(TypeError, match=match):
        MaskMod(fn)


def test_wrong_arity_names_the_signature():
    with pytest.raises(TypeError, match=r"mask_mod\(b, q_idx, k_idx, \*aux\) with 1 aux"):
        MaskMod(lambda b, q, k: k <= q, PREFIX)
    with pytest.raises(TypeError, match=r"score_mod\(score, b, h, q_idx, k_idx, \*aux\)"):
        ScoreMod(lambda s, q, k: s)


def test_bad_aux_arrays_are_named():
    with pytest.raises(TypeError, match="aux argument 0 has dtype complex128"):
        MaskMod(lambda b, q, k, a: a[b] > 0, np.zeros(3, complex))
    with pytest.raises(ValueError, match="aux argument 0 has shape"):
        MaskMod(lambda b, q, k, a: a[b] > 0, np.zeros(0, np.int32))
    with pytest.raises(TypeError, match="must be an array"):
        MaskMod(lambda b, q, k, a: a[b] > 0, [1, 2])
    with pytest.raises(TypeError, match="indexed with 1"):
        ScoreMod(lambda s, b, h, q, k, t: s + t[h], TABLE)
    with pytest.raises(TypeError, match="float expression"):
        ScoreMod(lambda s, b, h, q, k, m: s + m[h / 2], SLOPES)


def test_score_mod_results_are_checked():
    with pytest.raises(TypeError, match="got an int"):
        ScoreMod(lambda s, b, h, q, k: q - k)
    with pytest.raises(ValueError, match="constant inf"):
        ScoreMod(lambda s, b, h, q, k: math.inf)


def test_an_index_out_of_range_is_a_named_index_error_and_clamped_in_generated_code():
    m = MASKS["prefix-lm"]
    with pytest.raises(IndexError, match=r"aux argument 0 \(shape \(4,\)\) at index \(7,\)"):
        evaluate(m.graph, {"b": np.array([7]), "q_idx": 0, "k_idx": 0}, m.aux)
    fn = numba_function(m.graph)
    err = np.zeros(1, np.int32)
    assert fn(7, 0, 8, PREFIX, err) == (8 < PREFIX[-1]) and err[0] == 1


def test_combining_masks():
    causal = MaskMod(lambda b, q, k: k <= q)
    chunk = MaskMod(lambda b, q, k, c: q // c[0] == k // c[0], np.array([4]))
    both = causal & chunk
    q, k = np.meshgrid(np.arange(9), np.arange(9), indexing="ij")
    got = evaluate(both.graph, {"b": 0, "q_idx": q, "k_idx": k}, both.aux)
    np.testing.assert_array_equal(got, (k <= q) & (q // 4 == k // 4))
    windowed = varlen.Mask(window_left=2) & causal
    assert windowed.base.window_left == 2 and windowed.graph.digest == causal.graph.digest
    assert (causal & varlen.Mask(window_left=2)).base.window_left == 2


def test_equal_functions_have_equal_digests():
    a = MaskMod(lambda b, q, k: k <= q)
    b = MaskMod(lambda bb, qq, kk: kk <= qq)
    c = MaskMod(lambda b, q, k: k < q)
    assert a.digest == b.digest != c.digest
    i32 = MaskMod(lambda b, q, k, p: k < p[b], PREFIX)
    i64 = MaskMod(lambda b, q, k, p: k < p[b], PREFIX.astype(np.int64))
    assert i32.digest != i64.digest, "the aux dtype is part of the generated code"


def test_generated_cuda_narrows_only_integers_that_fit_32_bits():
    """Positions and int32 aux entries compute in 32 bits; a sum that may leave int32 (an
    offset plus a position, a product of positions) stays in 64."""
    from varlen.mods.codegen import cuda_source, int32_nodes
    seg = MASKS["segments"].graph
    src = cuda_source(seg, "f")
    assert "const int t0 = (int)b;" in src
    assert "const long long" in src, "start[b] + q_idx may pass 2**31: 64 bits"
    prod = MaskMod(lambda b, q, k: q * k > 5).graph
    narrow = int32_nodes(prod)
    assert {n.key() for n in prod.nodes() if n.op == "mul"}.isdisjoint(narrow)
    chunk = MaskMod(lambda b, q, k, c: q // c[0] == k // c[0], np.array([4], np.int32)).graph
    div = [n for n in chunk.nodes() if n.op == "floordiv"]
    assert all(n.key() in int32_nodes(chunk) for n in div), "q // c fits 32 bits: |q // c| <= |q|"
    wide = MaskMod(lambda b, q, k, c: q // c[0] == k, np.array([4], np.int64)).graph
    assert not any(n.key() in int32_nodes(wide) for n in wide.nodes() if n.op == "floordiv"), \
        "an int64 divisor is not cut to 32 bits"
    mod = MaskMod(lambda b, q, k, c: q % c[0] == 0, np.array([4], np.int64)).graph
    assert not any(n.key() in int32_nodes(mod) for n in mod.nodes() if n.op == "mod"), \
        "an int64 divisor may leave a 64-bit remainder"
