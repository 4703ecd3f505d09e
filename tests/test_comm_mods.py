"""MaskMod and ScoreMod under context parallelism on in-process ranks: the gallery cases of
`comm_workers/mods_cp.py` (sampled; all of them under mpiexec in tests/multiprocess), the
coordinates the functions see (global positions, the batch's sequence, the global head), the
step plans (empty steps skipped, the cache keyed by the mask_mod), the document partition's
work under a mask_mod, and the aux gradients summed over the ranks."""
import numpy as np
import pytest

import varlen
import varlen.comm as vc
from varlen import MaskMod, ScoreMod
from varlen.backends.numpy_backend import NumpyBackend
from varlen.comm.document import document_work

import mods_cases as gallery
from comm_workers.mods_cp import MODS_CASES, SCHEMES, ModsCase, check_mods, global_batch
from helpers import cases, covering

COMBOS = cases([pytest.param(case, cp, method, scheme,
                             id=f"cp{cp}-{case.id}-{scheme}-{method}")
                for cp in (2, 3, 4) for case in MODS_CASES for scheme in SCHEMES
                for method in vc.METHODS if method != "ulysses" or case.Hq % cp == 0],
               covering(lambda p: p.values[0].id, lambda p: p.values[1],
                        lambda p: (p.values[2], p.values[3])))


@pytest.mark.parametrize("case, cp, method, scheme", COMBOS)
def test_matches_single_process_reference(case, cp, method, scheme):
    vc.local_group(cp).run(check_mods, case, method, scheme)       # asserts on every rank


# --------------------------------------------------------------------------------------------
# Coordinates: what the kernels' segments say about each local row
# --------------------------------------------------------------------------------------------

def _partitions(cu, cp):
    yield "zigzag", vc.partition(cu, cp)
    yield "contiguous", vc.partition(cu, cp, "contiguous")
    yield "document", vc.partition(cu, cp, "document", max_doc_len=6)
    yield "document-chunked", vc.partition(
        cu, cp, "document", mask=MaskMod(gallery.chunked_causal, np.array([4], np.int32)))


def _check_segments(label, seg, code):
    """Every segment's rows of `code` (`1000 * b + position`, sharded) hold sequence `b` from
    position `seg.pos` on."""
    for b in range(seg.row.shape[0]):
        for s in range(seg.row.shape[1]):
            n, row, pos = int(seg.length[b, s]), int(seg.row[b, s]), int(seg.pos[b, s])
            want = 1000 * b + pos + np.arange(n)
            assert np.array_equal(code[row:row + n], want), (label, b, s)


@pytest.mark.parametrize("cp", [2, 3])
def test_segments_carry_the_batch_index_and_global_positions(cp):
    lengths = (0, 13, 7, 1, 22, 3, 0)
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    code = np.concatenate([1000 * b + np.arange(n) for b, n in enumerate(lengths)])
    for name, part in _partitions(cu, cp):
        shards = [part.shard(code, r, fill=-1) for r in range(cp)]
        for r in range(cp):
            _check_segments(f"{name} rank {r}", part.segments(r), shards[r])
        _check_segments(f"{name} gathered", part.gathered_segments(), np.concatenate(shards))
        if name.startswith("document"):
            for src in range(cp):
                for dst in range(cp):
                    buf = shards[src][part.ring_rows(src, dst)]
                    _check_segments(f"{name} ring {src}->{dst}", part.ring_segments(src, dst),
                                    buf)


def test_ulysses_score_functions_see_the_global_head():
    # a per-head bias on the first key: rank 1 of 2 holds heads 2 and 3 under Ulysses, and
    # would add w[0] and w[1] if it saw its local head numbers
    cu = np.array([0, 9, 13], np.int32)
    g = global_batch(ModsCase("heads", (9, 4), "causal", Hk=1))
    weight = np.array([0.0, 1.0, 2.0, 3.0])
    sm = ScoreMod(lambda s, b, h, q, k, w: s + varlen.where(k == 0, w[h], 0.0), weight)
    want, _ = varlen.reference.attention_dense(g["q"], g["k"], g["v"], cu, cu, mask="causal",
                                               score_mod=sm)
    part = vc.partition(cu, 2)

    def body(group):
        shards = (part.shard(g[x], group.rank) for x in "qkv")
        return vc.attention_forward(*shards, part, group, mask="causal", score_mod=sm,
                                    method="ulysses")[0]
    for r, out in enumerate(vc.local_group(2).run(body)):
        assert np.abs(out - part.shard(want, r)).max() < 1e-12, f"rank {r}"


def test_ulysses_numbers_heads_globally_on_every_backend():
    """Rank r runs heads [r * Hq / cp, ...): the score function's graph is rewritten to see
    them (`Mods.for_heads`), so a backend needs nothing of its own for it."""
    sm = ScoreMod(gallery.alibi, np.array([0.5, 0.25, 0.125, 0.0625]))
    moved = varlen.mods.Mods(score=sm).for_heads(2).score
    assert moved.digest != sm.digest and sm.with_head_offset(0) is sm
    leaves = dict(score=np.zeros((2, 2)), b=0, h=np.arange(2)[:, None], q_idx=3,
                  k_idx=np.arange(2))
    np.testing.assert_array_equal(
        varlen.mods.evaluate(moved.graph, leaves, moved.aux),
        varlen.mods.evaluate(sm.graph, {**leaves, "h": leaves["h"] + 2}, sm.aux))
    np.testing.assert_array_equal(
        varlen.mods.evaluate(moved.d_score(), leaves, moved.aux), 1.0)


# --------------------------------------------------------------------------------------------
# Step plans
# --------------------------------------------------------------------------------------------

def _diagonal(b, q_idx, k_idx):
    return k_idx == q_idx


def test_steps_whose_tiles_the_mask_mod_hides_are_not_launched(monkeypatch):
    cu = np.array([0, 40, 63], np.int32)
    part = vc.partition(cu, 2)
    mask = MaskMod(_diagonal)
    steps = [vc.plan(part, r, dtype="float64", head_dim=8, mask=mask) for r in range(2)]
    # zigzag: a rank's queries meet their own keys only in the step with its own K/V
    assert [s.busy for s in steps] == [(True, False), (True, False)]
    assert all(p.mask_mod is mask or p.mask_mod.digest == mask.digest
               for s in steps for p in s.plans)
    calls = []
    forward = NumpyBackend.forward
    monkeypatch.setattr(NumpyBackend, "forward",
                        lambda self, *a, **kw: calls.append(1) or forward(self, *a, **kw))
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((63, 2, 8)) for _ in range(3))

    def body(group):
        shards = (part.shard(x, group.rank) for x in (q, k, v))
        return vc.attention_forward(*shards, part, group, mask=mask, method="ring")[0]
    outs = vc.local_group(2).run(body)
    assert len(calls) == 2, f"{len(calls)} kernel calls for 2 ranks x 1 busy step"
    want, _ = varlen.reference.attention_dense(q, k, v, cu, cu, mask=mask)
    for r, out in enumerate(outs):
        assert np.abs(out - part.shard(want, r)).max() < 1e-12


def test_step_plan_cache_is_keyed_by_the_mask_mod():
    cu = np.array([0, 20, 31], np.int32)
    part = vc.partition(cu, 2)
    kw = dict(dtype="float64", head_dim=8)
    prefix = np.array([3, 5], np.int32)
    first = vc.plan(part, 0, mask=MaskMod(gallery.prefix_lm, prefix), **kw)
    assert vc.plan(part, 0, mask=MaskMod(gallery.prefix_lm, prefix.copy()), **kw) is first
    assert vc.plan(part, 0, mask=MaskMod(gallery.prefix_lm, prefix + 1), **kw) is not first
    assert vc.plan(part, 0, mask=MaskMod(gallery.causal), **kw) is not first
    assert vc.plan(part, 0, mask="causal", **kw) is not first
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((31, 2, 8)) for _ in range(3))

    def body(group):
        shards = (part.shard(x, group.rank) for x in (q, k, v))
        mine = vc.plan(part, group.rank, mask=MaskMod(gallery.prefix_lm, prefix), **kw)
        with pytest.raises(ValueError, match="mask_mod"):
            vc.attention_forward(*shards, part, group, plan=mine,
                                 mask=MaskMod(gallery.prefix_lm, prefix + 1))
    vc.local_group(2).run(body)


def test_ranks_with_other_mask_mod_values_all_raise():
    cu = np.array([0, 20, 31], np.int32)
    part = vc.partition(cu, 2)
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((31, 2, 8)) for _ in range(3))

    def body(group):
        prefix = np.array([3, 5 + group.rank], np.int32)
        shards = (part.shard(x, group.rank) for x in (q, k, v))
        with pytest.raises(ValueError, match="disagree on mask_mod and score_mod aux values"):
            vc.attention_forward(*shards, part, group, mask=MaskMod(gallery.prefix_lm, prefix))
    vc.local_group(2).run(body)


def test_aux_grads_must_be_a_known_value():
    part = vc.partition(np.array([0, 4], np.int32), 1)
    x = np.zeros((4, 1, 8))
    with pytest.raises(ValueError, match="aux_grads"):
        vc.attention_backward(x, x, x, x, x, np.zeros((1, 4)), part, vc.local_group(1)[0],
                              aux_grads="sum")


# --------------------------------------------------------------------------------------------
# The document partition's work under a mask_mod
# --------------------------------------------------------------------------------------------

def test_document_work_follows_the_mask_mods_tiles():
    L = np.array([0, 1, 5, 40, 300, 1000])
    causal = document_work(L, "causal")
    as_mod = document_work(L, MaskMod(gallery.causal))
    assert (np.abs(as_mod - causal) <= np.maximum(causal // 20, 4)).all(), (as_mod, causal)
    chunked = document_work(L, MaskMod(gallery.chunked_causal, np.array([32], np.int32)))
    assert (chunked <= as_mod).all()
    # a chunked document's work grows linearly: about L * 33 / 2 pairs, not L^2 / 2
    assert chunked[-1] < 3 * 1000 * 33 // 2 < causal[-1] // 10, chunked
    prefix = MaskMod(gallery.prefix_lm, np.array([0, 0, 0, 0, 300, 0], np.int32))
    assert document_work(L, prefix)[4] > 1.8 * as_mod[4]          # bidirectional: ~L^2


def test_document_balance_changes_with_the_mask_mod():
    # one long document and short ones, 2 ranks: causal work puts half of the long document
    # on each rank; chunked causal makes it cheap enough to stay whole
    lengths = (512,) + (64,) * 12
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    causal = vc.partition(cu, 2, "document", mask="causal")
    chunked = vc.partition(cu, 2, "document",
                           mask=MaskMod(gallery.chunked_causal, np.array([16], np.int32)))
    assert len(causal.groups[0]) == 2, causal.groups
    assert len(chunked.groups[0]) == 1, chunked.groups
    work = document_work(np.asarray(lengths), MaskMod(gallery.chunked_causal,
                                                      np.array([16], np.int32)))
    load = np.zeros(2)
    for w, g in zip(work, chunked.groups):
        load[list(g)] += w / len(g)
    assert load.max() / load.mean() <= 1.05, load
