"""The LSE merge of partial attention results, on its own."""
import numpy as np
import pytest

from varlen.comm import merge_partial


def _partial(s, v, keys):
    """Attention of scores `s [H, T, N]` restricted to `keys` (bool [T, N] or [N])."""
    s = np.where(keys, s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    dead = ~np.isfinite(m)
    p = np.exp(s - np.where(dead, 0, m))
    z = p.sum(-1, keepdims=True)
    out = np.einsum("htn,nhd->thd", p / np.where(dead, 1, z), v)
    lse = np.where(dead, -np.inf, m + np.log(np.where(dead, 1, z)))[..., 0]
    return out, lse


@pytest.fixture
def data():
    rng = np.random.default_rng(0)
    H, T, N, D = 3, 5, 11, 4
    return rng.standard_normal((H, T, N)) * 3, rng.standard_normal((N, H, D))


def test_merge_of_disjoint_parts_is_the_whole(data):
    s, v = data
    split = np.random.default_rng(1).random(s.shape[-1]) < 0.5
    out, lse = merge_partial(*_partial(s, v, split), *_partial(s, v, ~split))
    want_out, want_lse = _partial(s, v, np.ones(s.shape[-1], bool))
    np.testing.assert_allclose(out, want_out, rtol=0, atol=1e-14)
    np.testing.assert_allclose(lse, want_lse, rtol=0, atol=1e-14)
    # Commutative.
    out2, lse2 = merge_partial(*_partial(s, v, ~split), *_partial(s, v, split))
    np.testing.assert_allclose(out2, out, rtol=0, atol=1e-15)


def test_parts_that_saw_nothing_never_make_nan(data):
    s, v = data
    T, N = s.shape[1], s.shape[2]
    a = np.zeros((T, N), bool)
    a[0] = True                               # query 0 sees every key in part a
    a[1, 3:] = True                           # query 1 sees keys 3.. in part a
    b = np.zeros((T, N), bool)
    b[1, :3] = True                           # and keys 0-2 in part b
    out, lse = merge_partial(*_partial(s, v, a), *_partial(s, v, b))
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    assert np.isneginf(lse[:, 2:]).all() and not out[2:].any()     # nothing anywhere
    np.testing.assert_allclose(out[0], _partial(s, v, a)[0][0], atol=1e-15)
    whole = _partial(s, v, a | b)
    np.testing.assert_allclose(out, whole[0], atol=1e-14)
    np.testing.assert_allclose(np.where(np.isinf(lse), 0, lse),
                               np.where(np.isinf(whole[1]), 0, whole[1]), atol=1e-14)


def test_both_minus_inf():
    out = np.zeros((2, 1, 3))
    lse = np.full((1, 2), -np.inf)
    o, l = merge_partial(out, lse, out, lse)
    assert np.isneginf(l).all() and not o.any() and not np.isnan(o).any()


@pytest.mark.parametrize("dtype, acc", [(np.float16, np.float32), (np.float32, np.float32),
                                        (np.float64, np.float64)])
def test_accumulates_in_float32_or_float64(data, dtype, acc):
    s, v = data
    split = np.arange(s.shape[-1]) % 2 == 0
    (oa, la), (ob, lb) = _partial(s, v, split), _partial(s, v, ~split)
    out, lse = merge_partial(oa.astype(dtype), la.astype(np.float32 if dtype != np.float64
                                                           else dtype),
                             ob.astype(dtype), lb.astype(np.float32 if dtype != np.float64
                                                         else dtype))
    assert out.dtype == acc and lse.dtype == acc


def test_large_lse_gap_is_stable():
    out_a, out_b = np.ones((1, 1, 2)), np.full((1, 1, 2), 5.0)
    o, l = merge_partial(out_a, np.array([[1000.0]]), out_b, np.array([[-1000.0]]))
    assert np.isfinite(o).all() and l[0, 0] == pytest.approx(1000.0)
    np.testing.assert_allclose(o, out_a)
