"""padding_mask / dense_mask: exhaustive equivalence with a naive per-sequence loop (seeds/004)."""
import itertools
from functools import lru_cache

import numpy as np
import pytest

import varlen
from varlen.masks import Mask, as_mask

POLICIES = {
    "full": (-1, -1, 0),
    "causal": (-1, 0, 0),
    "causal_br": (-1, 0, 1),
    "sliding2": (2, 0, 0),
    "band_br": (1, 1, 1),
    "anti": (0, -1, 0),
}


def _cu(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def naive_padding(lengths, max_seqlen):
    """The original per-sequence construction: one Python list per sequence."""
    return np.array([[False] * min(n, max_seqlen) + [True] * (max_seqlen - n)
                     for n in lengths], dtype=bool).reshape(len(lengths), max_seqlen)


@lru_cache(maxsize=None)
def naive_dense(lq, lk, sq, sk, left, right, br):
    """One sequence's `[sq, sk]` allowed-matrix by explicit loops over positions."""
    out = np.zeros((sq, sk), bool)
    s = lk - lq if br else 0
    for i in range(min(lq, sq)):
        for j in range(min(lk, sk)):
            out[i, j] = ((left < 0 or j >= i + s - left) and (right < 0 or j <= i + s + right))
    return out


@pytest.mark.parametrize("max_seqlen", range(1, 9))
def test_padding_mask_exhaustive(max_seqlen):
    rng = np.random.default_rng(max_seqlen)
    cases = 0
    for B in range(1, 5):
        for lengths in itertools.product(range(max_seqlen + 1), repeat=B):
            want = naive_padding(lengths, max_seqlen)
            cu = _cu(lengths)
            got = varlen.padding_mask(cu, max_seqlen)
            assert got.dtype == bool and got.shape == (B, max_seqlen)
            assert np.array_equal(got, want), (lengths, got, want)
            # an inference buffer sized for a larger batch: the tail is ignored
            tail = cu[-1] + np.cumsum(rng.integers(0, 5, size=int(rng.integers(1, 4))))
            longer = np.concatenate([cu, tail]).astype(np.int32)
            assert np.array_equal(varlen.padding_mask(longer, max_seqlen, batch_size=B), want)
            cases += 2
    assert cases == 2 * sum((max_seqlen + 1) ** b for b in range(1, 5))


def _check_dense_all(lq_all, lk_all, sq, sk, policy_of, longer=False, rng=None):
    """All length combinations as ONE packed batch (sequences are independent), compared with
    the naive per-sequence loop."""
    n, B = lq_all.shape
    lq, lk = lq_all.reshape(-1), lk_all.reshape(-1)
    pol = np.array([policy_of(i) for i in range(n * B)], np.int32)     # [n*B, 3]
    mask = Mask(window_left=pol[:, 0], window_right=pol[:, 1], bottom_right=pol[:, 2])
    cu_q, cu_k = _cu(lq), _cu(lk)
    got = varlen.dense_mask(cu_q, cu_k, sq, sk, mask=mask)
    assert got.shape == (n * B, sq, sk) and got.dtype == bool
    for s in range(n * B):
        want = naive_dense(int(lq[s]), int(lk[s]), sq, sk, *map(int, pol[s]))
        assert np.array_equal(got[s], want), (lq[s], lk[s], pol[s], got[s], want)
    if longer:
        # per batch of B with a longer buffer
        for c in range(0, n, max(1, n // 7)):
            rows = slice(c * B, (c + 1) * B)
            cq = np.concatenate([_cu(lq[rows]), [lq[rows].sum() + 3]]).astype(np.int32)
            ck = np.concatenate([_cu(lk[rows]), [lk[rows].sum() + 1]]).astype(np.int32)
            m = Mask(pol[rows, 0], pol[rows, 1], pol[rows, 2])
            sub = varlen.dense_mask(cq, ck, sq, sk, mask=m, batch_size=B)
            assert np.array_equal(sub, got[rows])


@pytest.mark.parametrize("max_seqlen", range(1, 9))
def test_dense_mask_self_exhaustive(max_seqlen):
    names = list(POLICIES)
    for B in range(1, 5):
        combos = np.array(list(itertools.product(range(max_seqlen + 1), repeat=B)), np.int32)
        for p, name in enumerate(names):
            # each policy over every combination, plus one mixed-policy pass
            _check_dense_all(combos, combos, max_seqlen, max_seqlen,
                             lambda i, pol=POLICIES[name]: pol, longer=(p == 0))
        _check_dense_all(combos, combos, max_seqlen, max_seqlen,
                         lambda i: POLICIES[names[i % len(names)]])


@pytest.mark.parametrize("max_q,max_k", list(itertools.product(range(1, 6), repeat=2)))
def test_dense_mask_cross_exhaustive(max_q, max_k):
    names = list(POLICIES)
    for B in range(1, 4):
        lq = itertools.product(range(max_q + 1), repeat=B)
        pairs = [(a, b) for a in lq for b in itertools.product(range(max_k + 1), repeat=B)]
        q_all = np.array([a for a, _ in pairs], np.int32)
        k_all = np.array([b for _, b in pairs], np.int32)
        _check_dense_all(q_all, k_all, max_q, max_k,
                         lambda i: POLICIES[names[i % len(names)]], longer=True)


def test_mask_names_and_constructors():
    assert as_mask("causal").fields() == (-1, 0, False)
    assert as_mask("causal_bottom_right").fields() == (-1, 0, True)
    m = Mask.causal_where(np.array([True, False, True]))
    assert m.window_right.tolist() == [0, -1, 0]
    with pytest.raises(ValueError, match="known mask name"):
        as_mask("causal_top_left")
    with pytest.raises(TypeError, match="mask must be"):
        as_mask(3)


def test_mask_scalars_are_checked_and_normalised():
    m = Mask(window_left=np.int64(5), window_right=np.array(0), bottom_right=1)
    assert m.fields() == (5, 0, True) and type(m.window_left) is int
    # negative windows, and windows no int32 position can reach, are unbounded
    assert Mask(window_left=-7, window_right=2**31).fields() == (-1, -1, False)
    assert Mask(window_left=2**31 - 1).window_left == 2**31 - 1


@pytest.mark.parametrize("kw,exc,match", [
    (dict(window_left=2.7), TypeError, r"mask.window_left must be an int .*got 2.7"),
    (dict(window_right=float("nan")), TypeError, r"mask.window_right must be an int .*got nan"),
    (dict(window_left=np.float32(1)), TypeError, r"mask.window_left must be an int"),
    (dict(window_left=np.array(1.5)), TypeError, r"mask.window_left must be int32 or bool"),
    (dict(window_left="3"), TypeError, r"mask.window_left must be an array"),
    (dict(bottom_right=2), ValueError, r"mask.bottom_right must be True or False \(or 0/1\)"),
    (dict(window_left=np.zeros((2, 2), np.int32)), ValueError,
     r"mask.window_left has shape \(2, 2\); expected a scalar or \[B\]"),
    (dict(bottom_right=np.zeros(2, np.float32)), TypeError,
     r"mask.bottom_right must be int32 or bool, got dtype float32"),
], ids=["float", "nan", "numpy-float", "0d-float", "string", "bottom-right-2", "2d", "float-array"])
def test_bad_mask_fields_are_refused_by_name(kw, exc, match):
    with pytest.raises(exc, match=match):
        Mask(**kw)


def test_mask_array_fields_are_checked_without_reading_them():
    torch = pytest.importorskip("torch")
    jax = pytest.importorskip("jax")
    assert Mask(window_left=torch.empty(3, dtype=torch.int64, device="meta")).parts()[1] == \
        (0, -1, 0)
    with pytest.raises(TypeError, match="mask.window_right must be int32 or bool"):
        Mask(window_right=torch.empty(3, device="meta"))
    shapes = jax.jit(lambda flags: jax.numpy.zeros(len(Mask(bottom_right=flags).parts()[0])))
    assert shapes(jax.numpy.asarray([True, False])).shape == (3,)


def test_parts_and_from_parts_round_trip():
    flags = np.array([True, False])
    m = Mask(window_left=3, window_right=flags, bottom_right=True)
    arrays, ints = m.parts()
    assert arrays[0] is None and arrays[1] is flags and arrays[2] is None
    assert ints == (3, 0, 1)
    back = Mask.from_parts(arrays, ints)
    assert back.window_left == 3 and back.window_right is flags and back.bottom_right is True


def test_dense_mask_torch_no_host_sync():
    torch = pytest.importorskip("torch")
    cu = torch.tensor([0, 3, 3, 7], dtype=torch.int32)
    mask = Mask.causal_where(torch.tensor([True, False, True]))
    got = varlen.dense_mask(cu, cu, 5, 5, mask=mask)
    want = varlen.dense_mask(cu.numpy(), cu.numpy(), 5, 5,
                             mask=Mask.causal_where(np.array([True, False, True])))
    assert isinstance(got, torch.Tensor) and np.array_equal(got.numpy(), want)
    pm = varlen.padding_mask(cu, 5)
    assert isinstance(pm, torch.Tensor)
    assert np.array_equal(pm.numpy(), varlen.padding_mask(cu.numpy(), 5))


def test_dense_mask_is_jittable_in_jax():
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    cu = jnp.array([0, 2, 6], dtype=jnp.int32)
    f = jax.jit(lambda c: varlen.dense_mask(c, c, 4, 4, mask="causal"))
    got = np.asarray(f(cu))
    want = varlen.dense_mask(np.asarray(cu), np.asarray(cu), 4, 4, mask="causal")
    assert np.array_equal(got, want)


def test_dense_mask_errors():
    cu = np.array([0, 2, 5], np.int32)
    with pytest.raises(ValueError, match=r"mask.window_left has shape \(3,\)"):
        varlen.dense_mask(cu, cu, 4, 4, mask=Mask(window_left=np.zeros(3, np.int32)))
    with pytest.raises(ValueError, match="cu_seqlens has 3 entries"):
        varlen.padding_mask(cu, 4, batch_size=3)
    with pytest.raises(ValueError, match="1-D"):
        varlen.padding_mask(cu.reshape(1, 3), 4)
