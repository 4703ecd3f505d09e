"""docs/mods.md stays true (the rules it states)."""
import numpy as np
import pytest

import varlen
import varlen.mods
from varlen import MaskMod
from varlen.reference import attention_dense


def test_an_aux_index_outside_its_array_is_an_index_error_on_the_host():
    """The page's index rule: a tile where an index may leave its array is computed, never
    classified full or empty by the clamped entries (which skipped the error)."""
    cu = np.array([0, 200], np.int32)
    q = np.random.default_rng(0).standard_normal((200, 1, 8))
    everywhere = MaskMod(lambda b, i, j, t: t[i - j], np.ones(200, bool))  # j > i: t[-1]...
    above = MaskMod(lambda b, i, j, t: t[i - j + 63] & (j <= i), np.ones(263, bool))
    for mask in (everywhere, above):
        with pytest.raises(IndexError, match=r"mask_mod reads aux argument 0 .* at index \(-"):
            attention_dense(q, q, q, cu, cu, mask=mask)
        with pytest.raises(IndexError, match=r"mask_mod reads aux argument 0 .* at index \(-"):
            varlen.attention_forward(q, q, q, cu, cu, mask=mask, backend="numpy")
    in_range = MaskMod(lambda b, i, j, t: t[varlen.maximum(i - j, 0)] & (j <= i),
                       np.ones(200, bool))
    start, classes = varlen.plan(cu, cu, mask=in_range).tile_classes("q")
    assert (classes == varlen.mods.FULL).sum() == 6, "provably in range: classified as usual"


@pytest.mark.parametrize("value", [-np.inf, np.nan, np.inf], ids=["-inf", "nan", "+inf"])
def test_a_score_mod_s_non_finite_result(value):
    """-inf hides the pair (the row left with none: out 0, lse -inf); NaN and +inf: a NaN row.
    Only the row that has the pair changes, in the numpy backend as in the reference."""
    cu = np.array([0, 4, 10], np.int32)
    q = np.random.default_rng(1).standard_normal((10, 2, 8))
    row6 = varlen.ScoreMod(lambda s, b, h, i, j: varlen.where((b == 1) & (i == 2), value, s))
    for out, lse in (attention_dense(q, q, q, cu, cu, score_mod=row6),
                     varlen.attention_forward(q, q, q, cu, cu, score_mod=row6, backend="numpy")):
        if value == -np.inf:
            assert np.all(out[6] == 0) and np.all(lse[:, 6] == -np.inf)
        else:
            assert np.isnan(out[6]).all() and np.isnan(lse[:, 6]).all()
        others = np.delete(np.arange(10), 6)
        assert np.isfinite(out[others]).all() and np.isfinite(lse[:, others]).all()
