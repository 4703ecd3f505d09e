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
