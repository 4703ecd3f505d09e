"""MaskMod and ScoreMod through the public API: the reference and the NumPy backend against
dense evaluation, plans (tile classes, describe, reuse), and the errors a caller can meet."""
import numpy as np
import pytest

import varlen
from varlen import MaskMod, ScoreMod
from varlen.mods import EMPTY, FULL
from varlen.reference import attention_dense, sequence_masks

from helpers import cases, check_numpy_backend, nan_padded_batch
from mods_cases import mask_cases, score_cases

RNG = np.random.default_rng(3)

# (lengths, Hq, Hk, gap): zero-length first and last, length 1, not tile multiples, GQA 4
LAYOUTS = [([0, 1, 13, 70, 33, 0], 4, 1, 0), ([17, 5, 0, 41], 2, 2, 3), ([100], 4, 2, 0)]


def _ids():
    return [f"L{'-'.join(map(str, l))}-Hq{hq}-Hk{hk}-gap{g}" for l, hq, hk, g in LAYOUTS]


@pytest.mark.parametrize("layout", LAYOUTS, ids=_ids())
@pytest.mark.parametrize("mask_id", [m for m, _ in mask_cases([1])])
@pytest.mark.parametrize("score_id", cases([None] + [s for s, _ in score_cases(1)],
                                           [None, "alibi", "t5", "hide-first"]))
def test_numpy_backend_matches_the_reference(layout, mask_id, score_id):
    lengths, Hq, Hk, gap = layout
    cu, off, q, k, v, do, rows = nan_padded_batch(RNG, lengths, Hq, Hk, gap)
    mask = dict(mask_cases(lengths))[mask_id]
    score_mod = None if score_id is None else dict(score_cases(Hq))[score_id]
    check_numpy_backend(q, k, v, do, cu, rows, seq_offsets=off, mask=mask,
                        score_mod=score_mod, softcap=2.5 if score_id == "t5" else 0.0)


@pytest.mark.parametrize("mask_id", [m for m, _ in mask_cases([1])])
def test_tile_classes_agree_with_every_pair(mask_id):
    """EMPTY tiles hold no visible pair and FULL tiles only visible pairs, both sides (300
    keys in tiles of 8: runs of partner tiles are classified before single tiles)."""
    lengths = [0, 37, 1, 300]
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    mask = dict(mask_cases(lengths))[mask_id]
    dense = sequence_masks(cu, cu, mask)
    plan = varlen.plan(cu, cu, mask=mask, block_m=16, block_n=8)
    for side in ("q", "k"):
        start, cls = plan.tile_classes(side)
        tiles, sched, partner, block = ((plan.q_tiles, plan.q_sched, plan.k, plan.block_n)
                                        if side == "q" else
                                        (plan.k_tiles, plan.k_sched, plan.q, plan.block_m))
        for i, (b, _, _, rows, pos) in enumerate(tiles):
            if b < 0:
                continue
            begin, end = sched[i, 0, 0], sched[i, 0, 3]
            for t in range(begin, end):
                c = cls[start[i, 0] + t - begin]
                p0 = partner.pos[b, 0] + t * block
                p1 = min(p0 + block, partner.pos[b, 0] + partner.length[b, 0])
                blk = dense[b][pos:pos + rows, p0:p1] if side == "q" else \
                    dense[b][p0:p1, pos:pos + rows]
                if c == FULL:
                    assert blk.all(), f"{side} tile {i} partner {t}: FULL but masked pairs"
                if c == EMPTY:
                    assert not blk.any(), f"{side} tile {i} partner {t}: EMPTY but visible"


def test_describe_draws_the_skipped_tiles():
    cu = np.array([0, 256], np.int32)
    chunked = MaskMod(lambda b, q, k: (k <= q) & (q // 128 == k // 128))
    text = varlen.plan(cu, cu, mask=chunked, block_m=64, block_n=64).describe()
    rows = [line.strip() for line in text.splitlines()[2:6]]
    assert rows == ["░···", "█░··", "··░·", "··█░"], text
    assert "6 of 16 tile pairs computed" in text


def test_a_plan_is_reused_only_for_its_mask_mod():
    cu = np.array([0, 9, 20], np.int32)
    q = RNG.standard_normal((20, 2, 8)).astype(np.float32)
    causal = MaskMod(lambda b, i, j: j <= i)
    plan = varlen.plan(cu, cu, mask=causal)
    out = varlen.attention(q, q, q, cu, cu, mask=causal, plan=plan, backend="numpy")
    want = varlen.attention(q, q, q, cu, cu, mask="causal", backend="numpy")
    np.testing.assert_allclose(out, want, atol=1e-6)
    with pytest.raises(ValueError, match="another mask_mod"):
        varlen.attention(q, q, q, cu, cu, mask=MaskMod(lambda b, i, j: j < i), plan=plan,
                         backend="numpy")
    with pytest.raises(ValueError, match="another mask_mod"):
        varlen.attention(q, q, q, cu, cu, mask="causal", plan=plan, backend="numpy")
    prefix = MaskMod(lambda b, i, j, p: j < p[b], np.array([3, 4], np.int32))
    plan = varlen.plan(cu, cu, mask=prefix)
    other = prefix.with_aux([np.array([3, 5], np.int32)])
    with pytest.raises(ValueError, match="mask_mod"):
        varlen.attention(q, q, q, cu, cu, mask=other, plan=plan, backend="numpy")


def test_errors_name_the_argument():
    cu = np.array([0, 9, 20], np.int32)
    q = RNG.standard_normal((20, 2, 8)).astype(np.float32)
    short = MaskMod(lambda b, i, j, p: j < p[b + 1], np.array([3, 4], np.int32))
    with pytest.raises(IndexError, match=r"mask_mod reads aux argument 0 \(shape \(2,\)\)"):
        varlen.attention(q, q, q, cu, cu, mask=short, backend="numpy")
    table = ScoreMod(lambda s, b, h, i, j, t: s + t[h, i - j], np.zeros((2, 3), np.float32))
    with pytest.raises(IndexError, match="score_mod reads aux argument 0"):
        varlen.attention(q, q, q, cu, cu, score_mod=table, backend="numpy")
    with pytest.raises(TypeError, match="score_mod must be a varlen.ScoreMod"):
        varlen.attention(q, q, q, cu, cu, score_mod=lambda s, b, h, i, j: s)
    with pytest.raises(TypeError, match="a varlen.MaskMod, which this entry point"):
        varlen.dense_mask(cu, cu, 11, 11, mask=MaskMod(lambda b, i, j: j <= i))


def test_aux_arrays_come_from_the_data_s_framework():
    torch = pytest.importorskip("torch")
    cu = np.array([0, 9, 20], np.int32)
    q = RNG.standard_normal((20, 2, 8)).astype(np.float32)
    prefix = MaskMod(lambda b, i, j, p: j < p[b], torch.tensor([3, 4], dtype=torch.int32))
    with pytest.raises(TypeError, match="mask_mod aux argument 0 is a torch array but q is a "
                                        "numpy array"):
        varlen.attention(q, q, q, cu, cu, mask=prefix)


def test_backends_that_do_not_run_mods_say_so():
    problem = dict(dtype="float32", head_dim=64,
                   mods=varlen.mods.Mods(mask=MaskMod(lambda b, i, j: j <= i)))
    reasons = dict(varlen.backends.explain(**problem))
    assert reasons["numpy"] is None
    for name, why in reasons.items():
        backend = varlen.backends.get(name)
        if backend is not None and "mask_mod" not in backend.runs_mods and why is None:
            pytest.fail(f"{name} would be chosen for a mask_mod it does not run")


def test_a_score_mod_hiding_every_pair_gives_an_empty_row():
    cu = np.array([0, 4, 10], np.int32)
    q = RNG.standard_normal((10, 2, 8))
    hide = ScoreMod(lambda s, b, h, i, j: varlen.where((b == 1) & (i == 2), -np.inf, s))
    out, lse = varlen.attention_forward(q, q, q, cu, cu, score_mod=hide, backend="numpy")
    assert np.all(out[6] == 0) and np.all(lse[:, 6] == -np.inf)
    assert np.isfinite(lse[:, [0, 1, 2, 3, 4, 5, 7, 8, 9]]).all()
    dq, dk, dv = varlen.attention_backward(np.ones_like(q), q, q, q, out, lse, cu, cu,
                                           score_mod=hide, backend="numpy")
    assert np.all(dq[6] == 0) and np.isfinite(dq).all()


def test_a_score_mod_producing_nan_poisons_only_its_row():
    cu = np.array([0, 4, 10], np.int32)
    q = RNG.standard_normal((10, 2, 8))
    bad = ScoreMod(lambda s, b, h, i, j: varlen.where((b == 0) & (i == 1) & (j == 0),
                                                      np.nan, s))
    out, lse = varlen.attention_forward(q, q, q, cu, cu, score_mod=bad, backend="numpy")
    want, wl = attention_dense(q, q, q, cu, cu, score_mod=bad)
    assert np.isnan(out[1]).all() and np.isnan(lse[:, 1]).all()
    assert np.isnan(want[1]).all(), "the reference agrees"
    assert np.isfinite(np.delete(out, 1, axis=0)).all()
