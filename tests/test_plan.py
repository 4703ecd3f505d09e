"""The tile schedule is exact: checked pair by pair against the visibility predicate."""
import numpy as np
import pytest

import varlen
from varlen.masks import visible
from varlen.plan import (Segments, TILE_FIELDS, TILE_POS, TILE_ROW, TILE_ROWS, TILE_SEQ,
                         build_plan, tile_bound)


def _tile_positions(seg: Segments, b, m, t, block):
    n = int(seg.length[b, m])
    lo = t * block
    return int(seg.pos[b, m]) + np.arange(lo, min(lo + block, n))


def _visibility(plan, b, qpos, kpos):
    return visible(qpos[:, None], kpos[None, :], int(plan.q.seqlen[b]), int(plan.k.seqlen[b]),
                   int(plan.window_left[b]), int(plan.window_right[b]),
                   int(plan.bottom_right[b]))


def _classify(vis):
    if not vis.any():
        return "skip"
    return "full" if vis.all() else "partial"


def check_schedule_exact(plan):
    """Every (query tile, key tile) pair: visited iff it holds a visible pair; in the full range
    iff all its pairs are visible. Same for the transposed schedule."""
    for tiles, sched, mine, other, bm, bn, forward in (
            (plan.q_tiles, plan.q_sched, plan.q, plan.k, plan.block_m, plan.block_n, True),
            (plan.k_tiles, plan.k_sched, plan.k, plan.q, plan.block_n, plan.block_m, False)):
        covered = 0
        for t in range(tiles.shape[0]):
            b, seg, row, rows, pos = (int(x) for x in tiles[t])
            if b < 0:
                assert rows == 0 and (sched[t] == 0).all(), f"unused slot {t} has a schedule"
                continue
            covered += rows
            assert 0 < rows <= bm
            my_pos = pos + np.arange(rows)
            for m in range(other.per_seq):
                begin, fbegin, fend, end = sched[t, m]
                assert begin <= fbegin <= fend <= end
                ntiles = -(-int(other.length[b, m]) // bn)
                assert end <= ntiles
                for u in range(ntiles):
                    partner = _tile_positions(other, b, m, u, bn)
                    vis = (_visibility(plan, b, my_pos, partner) if forward
                           else _visibility(plan, b, partner, my_pos))
                    want = _classify(vis)
                    got = ("skip" if not begin <= u < end else
                           "full" if fbegin <= u < fend else "partial")
                    assert got == want, (f"{'q' if forward else 'k'} tile {t} (seq {b}, rows "
                                         f"{row}+{rows}) vs tile {u} of segment {m}: "
                                         f"schedule says {got}, pairs say {want}")
        assert covered == int(mine.length.sum()), "tiles do not cover every segment row"


def _random_segments(rng, B, m, max_len, gaps):
    """Segments like a context-parallel shard: m runs per sequence at increasing positions."""
    lengths = rng.integers(0, max_len + 1, size=(B, m))
    seqlen = lengths.sum(1) + rng.integers(0, 3, size=B) * (m > 1)
    pos = np.zeros((B, m), np.int64)
    for b in range(B):
        # runs in increasing global order, possibly with holes between them
        p = 0
        for r in range(m):
            p += int(rng.integers(0, 2)) if m > 1 else 0
            pos[b, r] = p
            p += lengths[b, r]
        seqlen[b] = max(seqlen[b], p)
    row = np.zeros((B, m), np.int64)
    r0 = 0
    for b in range(B):
        for r in range(m):
            r0 += int(rng.integers(0, 3)) if gaps else 0
            row[b, r] = r0
            r0 += lengths[b, r]
    T = r0 + (2 if gaps else 0)
    return Segments(row.astype(np.int32), lengths.astype(np.int32), pos.astype(np.int32),
                    seqlen.astype(np.int32), T)


def _random_mask(rng, B):
    return varlen.Mask(window_left=rng.choice([-1, 0, 1, 3, 7], size=B).astype(np.int32),
                       window_right=rng.choice([-1, 0, 2, 5], size=B).astype(np.int32),
                       bottom_right=rng.integers(0, 2, size=B).astype(np.int32))


@pytest.mark.parametrize("seed", range(12))
def test_schedule_exact_random(seed):
    rng = np.random.default_rng(seed)
    B = int(rng.integers(1, 6))
    mq, mk = int(rng.choice([1, 2])), int(rng.choice([1, 2]))
    q = _random_segments(rng, B, mq, 23, gaps=seed % 2 == 0)
    k = _random_segments(rng, B, mk, 29, gaps=seed % 3 == 0)
    # bottom-right alignment reads both global lengths, so they must agree on what exists
    plan = build_plan(q, k, _random_mask(rng, B), block_m=int(rng.choice([1, 3, 4, 8])),
                      block_n=int(rng.choice([1, 2, 5, 8])))
    check_schedule_exact(plan)


@pytest.mark.parametrize("mask", ["full", "causal", "causal_bottom_right",
                                  varlen.Mask(window_left=4, window_right=0),
                                  varlen.Mask(window_left=0, window_right=0),
                                  varlen.Mask(window_left=2, window_right=3, bottom_right=True)],
                         ids=["full", "causal", "causal_br", "sliding4", "diag", "band_br"])
def test_schedule_exact_cu_seqlens(mask):
    cu_q = np.array([0, 0, 1, 9, 9, 26, 40], np.int32)
    cu_k = np.array([0, 3, 3, 20, 21, 30, 30], np.int32)
    plan = varlen.plan(cu_q, cu_k, mask=mask, block_m=4, block_n=8)
    check_schedule_exact(plan)


def test_tile_table_layout():
    cu = np.array([0, 5, 5, 13], np.int32)
    off = np.array([2, 9, 9, 20], np.int32)
    p = varlen.plan(cu, cu, seq_offsets_q=off, seq_offsets_k=off, block_m=4, block_n=4)
    used = p.q_tiles[p.q_tiles[:, TILE_SEQ] >= 0]
    assert used[:, TILE_SEQ].tolist() == [0, 0, 2, 2]
    assert used[:, TILE_FIELDS.index("seg")].tolist() == [0, 0, 0, 0]
    assert used[:, TILE_ROW].tolist() == [2, 6, 9, 13]
    assert used[:, TILE_ROWS].tolist() == [4, 1, 4, 4]
    assert used[:, TILE_POS].tolist() == [0, 4, 0, 4]
    assert p.num_q_tiles == tile_bound(20, 3, 4)


def test_tile_bound_respects_max_seqlen():
    cu = np.array([0, 5, 10, 15], np.int32)
    p = varlen.plan(cu, cu, max_seqlen_q=5, max_seqlen_k=5, block_m=4, block_n=4)
    assert p.num_q_tiles == 6     # 3 sequences x ceil(5/4)
    check_schedule_exact(p)


def test_causal_skips_upper_tiles():
    """One 64-row causal sequence in 16x16 tiles: 4 diagonal partial, 6 full, 6 skipped."""
    cu = np.array([0, 64], np.int32)
    p = varlen.plan(cu, cu, mask="causal", block_m=16, block_n=16)
    sched = p.q_sched[:4, 0]
    visited = (sched[:, 3] - sched[:, 0]).sum()
    full = (sched[:, 2] - sched[:, 1]).sum()
    assert (visited, full) == (10, 6)


def test_plan_reused_across_calls_and_head_counts():
    rng = np.random.default_rng(0)
    cu = np.array([0, 7, 20], np.int32)
    p = varlen.plan(cu, cu, mask="causal", block_m=4, block_n=4)
    for hq, hk in ((4, 4), (8, 2)):
        q = rng.standard_normal((20, hq, 8))
        k = rng.standard_normal((20, hk, 8))
        o1 = varlen.attention(q, k, k, cu, cu, mask="causal", plan=p)
        o2 = varlen.attention(q, k, k, cu, cu, mask="causal")
        np.testing.assert_allclose(o1, o2, rtol=0, atol=1e-13)


@pytest.mark.parametrize("validation", [True, False], ids=["validated", "unvalidated"])
def test_plan_mismatch_is_refused(validation):
    # a stale plan is caught by its fingerprint whether or not validation is on
    cu = np.array([0, 7, 20], np.int32)
    p = varlen.plan(cu, cu, mask="causal")
    q = np.zeros((20, 2, 8))
    old = varlen.set_validation(validation)
    try:
        with pytest.raises(ValueError, match="another mask.window_right"):
            varlen.attention(q, q, q, cu, cu, mask="full", plan=p)
        # same B and T, other lengths
        with pytest.raises(ValueError, match="another cu_seqlens_q"):
            varlen.attention(q, q, q, np.array([0, 8, 20], np.int32), cu, mask="causal", plan=p)
        with pytest.raises(ValueError, match="another cu_seqlens_k"):
            varlen.attention(q, q, q, cu, np.array([0, 7, 19], np.int32),
                             seq_offsets_k=cu, mask="causal", plan=p)
        with pytest.raises(TypeError, match="varlen.Plan"):
            varlen.attention(q, q, q, cu, cu, plan=object())
        # the same policy written per sequence, the default offsets written out: the same plan
        mask = varlen.Mask(window_right=np.zeros(2, np.int32))
        varlen.attention(q, q, q, cu, cu, seq_offsets_q=cu, mask=mask, plan=p)
    finally:
        varlen.set_validation(old)


def test_plan_needs_rows_for_device_metadata_only():
    cu = np.array([0, 3, 5], np.int32)
    p = varlen.plan(cu, cu)
    assert p.q.num_rows == 5 and p.k.num_rows == 5
    p = varlen.plan(cu, cu, num_rows_q=9, num_rows_k=6)
    assert p.q.num_rows == 9 and p.k.num_rows == 6


@pytest.mark.parametrize("validation", [True, False], ids=["validated", "unvalidated"])
def test_rows_never_dropped_silently(validation):
    # a max_seqlen bound below a real length, or a sequence past its buffer: the call fails
    # (the value checks when validating; the plan builder's own check otherwise)
    cu = np.array([0, 3, 200], np.int32)
    q = np.zeros((200, 2, 8))
    old = varlen.set_validation(validation)
    try:
        # 64-row tiles: 2 slots for a bound of 64, 4 tiles needed
        with pytest.raises(ValueError, match="max_seqlen_q"):
            varlen.attention(q, q, q, cu, cu, max_seqlen_q=64, max_seqlen_k=200)
        with pytest.raises(ValueError, match="exceeds|outside"):
            varlen.attention(q[:180], q, q, cu, cu)
    finally:
        varlen.set_validation(old)


def test_device_errors_are_recorded_then_raised():
    # the device path of the plan builder's check, with a stand-in device module (NumPy arrays
    # that are not `numpy` itself, so nothing is raised until checked)
    import types
    from varlen import _device_errors
    dev = types.SimpleNamespace(zeros=np.zeros, logical_or=np.logical_or,
                                cuda=types.SimpleNamespace(Device=lambda: types.SimpleNamespace(id=0)))
    varlen.check_device_errors()                              # nothing pending
    _device_errors.record(dev, np.array(False), "never set")
    _device_errors.record(dev, np.array(True), "rows were dropped")
    with pytest.raises(ValueError, match="rows were dropped") as e:
        varlen.check_device_errors()
    assert "never set" not in str(e.value)
    varlen.check_device_errors()                              # cleared by the check


# --------------------------------------------------------------------------------------------
# The row schedules (q_row_sched / k_row_sched): what the CUDA kernels' cursor walks
# --------------------------------------------------------------------------------------------

def _row_table_by_loops(tiles, sched, partner: Segments, block):
    """The row schedule from its definition, element by element: each partner-tile bound as a
    packed row clipped to its segment, and the segment's pos - row; zeros in unused slots."""
    num, m = sched.shape[:2]
    out = np.zeros((num, m, 5), np.int64)
    for t in range(num):
        b = int(tiles[t, TILE_SEQ])
        if b < 0:
            continue
        for i in range(m):
            row, n = int(partner.row[b, i]), int(partner.length[b, i])
            for f in range(4):
                out[t, i, f] = row + min(int(sched[t, i, f]) * block, n)
            out[t, i, 4] = int(partner.pos[b, i]) - row
    return out


def _walk_tiles(tiles, sched, partner: Segments, block, chunk, heads=1, with_seg=False):
    """The chunks of each tile as the kernels' cursor walked the tile schedule before the row
    schedule: tile indices times block / chunk, cut at the segment's last chunk, full when the
    chunk's tile is in the full range and the chunk has all its rows. `with_seg`: each chunk
    also names its partner segment."""
    assert block % chunk == 0
    ratio = block // chunk
    walks = []
    for t in range(tiles.shape[0]):
        b = int(tiles[t, TILE_SEQ])
        walk = []
        for h in range(heads if b >= 0 else 0):
            for i in range(sched.shape[1]):
                n = int(partner.length[b, i])
                c0, fb, fe, c1 = (int(x) * ratio for x in sched[t, i])
                for c in range(c0, min(c1, -(-n // chunk))):
                    rows = min(chunk, n - c * chunk)
                    walk.append((h, int(partner.row[b, i]) + c * chunk, rows,
                                 int(partner.pos[b, i]) + c * chunk,
                                 fb <= c < fe and rows == chunk) + ((i,) if with_seg else ()))
        walks.append(walk)
    return walks


def _walk_rows(table, chunk, heads=1):
    """The chunks of each tile as PartnerCursor<chunk> (kernels_cuda/tile_scheduler.cuh) walks
    the row schedule: from row_begin in steps of chunk, the last one cut at row_end."""
    walks = []
    for t in range(table.shape[0]):
        walk = []
        for h in range(heads):
            for rb, fb, fe, re, delta in (tuple(int(x) for x in r) for r in table[t]):
                row = rb
                while row < re:
                    walk.append((h, row, min(chunk, re - row), row + delta,
                                 row >= fb and row <= fe - chunk))
                    row += chunk
        walks.append(walk)
    return walks


def _walk_pairs(tiles, sched, partner: Segments, block):
    """The sm_90 forward's chunks of two key tiles as it walked the tile schedule: two
    consecutive tiles of a segment's range (full when both are), the last one alone (never
    full)."""
    walks = []
    for tile_walk in _walk_tiles(tiles, sched, partner, block, block, with_seg=True):
        walk, j = [], 0
        while j < len(tile_walk):
            h, row, rows, pos, full, seg = tile_walk[j]
            nxt = tile_walk[j + 1] if j + 1 < len(tile_walk) else None
            if nxt is not None and (nxt[0], nxt[5]) == (h, seg) and nxt[1] == row + block:
                walk.append((h, row, rows + nxt[2], pos, full and nxt[4]))
                j += 2
            else:
                walk.append((h, row, rows, pos, False))
                j += 1
        walks.append(walk)
    return walks


def _cp_plans():
    """Context-parallel plans (two segments per sequence, skipped segments, empty ranks' rows):
    zigzag shards against each other and against the gathered keys, and a document split."""
    from varlen import comm
    cu = np.array([0, 37, 37, 200, 201, 291], np.int32)
    plans = []
    for scheme, cp in (("zigzag", 2), ("zigzag", 3), ("document", 2)):
        part = comm.partition(cu, cp, scheme)
        for r in range(cp):
            for keys in (part.segments((r + 1) % cp), part.gathered_segments()):
                plans.append((f"{scheme}-cp{cp}-rank{r}",
                              build_plan(part.segments(r), keys, "causal", block_m=16,
                                         block_n=8)))
    return plans


def _adversarial_plans():
    rng = np.random.default_rng(7)
    plans = []
    for seed in range(6):
        B = int(rng.integers(1, 6))
        mq, mk = int(rng.choice([1, 2])), int(rng.choice([1, 2]))
        q = _random_segments(rng, B, mq, 23, gaps=seed % 2 == 0)
        k = _random_segments(rng, B, mk, 29, gaps=seed % 3 == 0)
        plans.append((f"random{seed}-m{mq}x{mk}",
                      build_plan(q, k, _random_mask(rng, B), block_m=int(rng.choice([4, 8])),
                                 block_n=int(rng.choice([4, 8])))))
    cu_q = np.array([0, 0, 1, 9, 9, 26, 40, 40], np.int32)
    cu_k = np.array([0, 3, 3, 20, 21, 30, 30, 30], np.int32)
    for mask in ("causal", varlen.Mask(window_left=2, window_right=3, bottom_right=True)):
        plans.append(("cu-zero-lengths", varlen.plan(cu_q, cu_k, mask=mask, block_m=4,
                                                     block_n=8)))
    return plans + _cp_plans()


PLANS = _adversarial_plans()


@pytest.mark.parametrize("label,plan", PLANS, ids=[label for label, _ in PLANS])
def test_row_schedule_values(label, plan):
    """Both row schedules against their definition from the tile schedules and segments; the
    batch holds what makes them interesting (skipped segments, ragged last tiles, empty
    segments, unused slots)."""
    for name, tiles, sched, partner, block in (
            ("q_row_sched", plan.q_tiles, plan.q_sched, plan.k, plan.block_n),
            ("k_row_sched", plan.k_tiles, plan.k_sched, plan.q, plan.block_m)):
        got = getattr(plan, name)
        assert (got.dtype, got.shape) == (np.int32, (*sched.shape[:2], 5)), (
            f"{label}: {name} is {got.dtype}{got.shape}")
        want = _row_table_by_loops(tiles, sched, partner, block)
        bad = np.argwhere(got != want)
        assert bad.size == 0, (f"{label}: {name} differs at {tuple(bad[0])}: "
                               f"{got[tuple(bad[0])]} != {want[tuple(bad[0])]}")
        used = tiles[:, TILE_SEQ] >= 0
        r = got[used]
        assert (r[..., 0] <= r[..., 3]).all(), f"{label}: {name} has a reversed range"
        assert (view := plan.view()) and getattr(view, name) is got


def test_row_schedule_plans_are_adversarial():
    """The plans above hold skipped and empty partner segments, ragged last tiles and
    unused slots, so the tests on them mean something."""
    skipped = empty = ragged = unused = 0
    for _, p in PLANS:
        for tiles, sched, partner, block in ((p.q_tiles, p.q_sched, p.k, p.block_n),
                                             (p.k_tiles, p.k_sched, p.q, p.block_m)):
            used = tiles[:, TILE_SEQ] >= 0
            skipped += int((sched[used][..., 0] == sched[used][..., 3]).sum())
            unused += int((~used).sum())
            empty += int((partner.length == 0).sum())
            ragged += int((partner.length % block != 0).sum())
    assert min(skipped, empty, ragged, unused) > 0, (skipped, empty, ragged, unused)
    assert any(p.q.per_seq == 2 for _, p in PLANS), "no context-parallel plan"


@pytest.mark.parametrize("label,plan", PLANS, ids=[label for label, _ in PLANS])
def test_row_cursor_walks_the_tile_schedule(label, plan):
    """The cursor over the row schedule visits the chunks the tile-schedule cursor visited,
    in the same order, with the same rows, positions and full flags, for every chunk size
    that divides the partner tile (and, several heads, for the dK/dV walk); chunks of two
    tiles are the sm_90 forward's pairs."""
    for tiles, sched, table, partner, block in (
            (plan.q_tiles, plan.q_sched, plan.q_row_sched, plan.k, plan.block_n),
            (plan.k_tiles, plan.k_sched, plan.k_row_sched, plan.q, plan.block_m)):
        for chunk in (c for c in (1, 2, 4, 8) if block % c == 0):
            for heads in (1, 3):
                assert _walk_rows(table, chunk, heads) == _walk_tiles(
                    tiles, sched, partner, block, chunk, heads), (
                    f"{label}: chunks of {chunk} over tiles of {block}, {heads} heads")
        assert _walk_rows(table, 2 * block) == _walk_pairs(tiles, sched, partner, block), (
            f"{label}: chunks of two tiles of {block}")
