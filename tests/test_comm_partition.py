"""varlen.comm.partition: every scheme's shards for any lengths (shard/unshard, pads), the chunk
schemes' padded layouts and segments (the document scheme's own: tests/test_comm_document.py)."""
import numpy as np
import pytest

import varlen.comm as vc

from helpers import cases, covering

LENGTHS = [
    (7,),                       # seeds/000
    (0,),
    (1,),
    (1, 0, 2, 3),               # shorter than 2*cp
    (13, 0, 5, 1, 29, 0),       # not divisible, zero-length last
    (64, 63, 97),
]


def _cu(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def test_seed000_zigzag_layout():
    part = vc.partition(_cu([7]), 2)
    assert part.local_rows == 4
    assert part.padded_seqlens.tolist() == [8] and part.chunk.tolist() == [2]
    assert part.positions(0).tolist() == [0, 1, 6, -1]      # chunks 0 and 3; position 7 is pad
    assert part.positions(1).tolist() == [2, 3, 4, 5]       # chunks 1 and 2
    s0 = part.segments(0)
    assert s0.row.tolist() == [[0, 2]] and s0.pos.tolist() == [[0, 6]]
    assert s0.length.tolist() == [[2, 1]] and s0.seqlen.tolist() == [7]


def test_schemes_name_every_scheme_partition_takes():
    assert vc.SCHEMES == ("zigzag", "contiguous", "document")
    assert vc.CHUNK_SCHEMES == ("zigzag", "contiguous")
    with pytest.raises(ValueError, match="'zigzag', 'contiguous', 'document'"):
        vc.partition(_cu([7]), 2, "striped")


def _grid(schemes):
    """(lengths, cp, scheme) for every scheme, cp of 1 to 5 and lengths; at the quick size
    every lengths and every cp under each scheme."""
    grid = [pytest.param(lengths, cp, scheme, id=f"L{'-'.join(map(str, lengths))}-{cp}-{scheme}")
            for scheme in schemes for cp in (1, 2, 3, 4, 5) for lengths in LENGTHS]
    return cases(grid, covering(lambda p: (p.values[0], p.values[2]),
                                lambda p: (p.values[1], p.values[2])))


@pytest.mark.parametrize("lengths, cp, scheme", _grid(vc.SCHEMES))
def test_every_token_on_exactly_one_rank(lengths, cp, scheme):
    cu = _cu(lengths)
    part = vc.partition(cu, cp, scheme)
    T = int(cu[-1])
    x = np.arange(1, T + 1, dtype=np.float64)[:, None] * np.array([1.0, -1.0])
    shards = [part.shard(x, r) for r in range(cp)]
    seen = np.concatenate([s[part.valid(r), 0] for r, s in enumerate(shards)])
    assert sorted(seen.tolist()) == list(range(1, T + 1))
    for r, s in enumerate(shards):
        assert s.shape == (part.local_rows, 2)
        assert not s[~part.valid(r)].any(), "pad rows must be zero-filled"
    np.testing.assert_array_equal(part.unshard(shards), x)


@pytest.mark.parametrize("lengths, cp, scheme", _grid(vc.CHUNK_SCHEMES))
def test_chunk_schemes_pad_each_sequence_to_whole_chunks(lengths, cp, scheme):
    T = int(sum(lengths))
    part = vc.partition(_cu(lengths), cp, scheme)
    n = 2 * cp if scheme == "zigzag" else cp
    assert (part.padded_seqlens % n == 0).all()
    assert (part.padded_seqlens >= np.asarray(lengths)).all()
    assert (part.padded_seqlens - np.asarray(lengths) < n).all()
    assert part.local_rows == int(part.padded_seqlens.sum()) // cp
    assert part.local_rows <= vc.local_rows_bound(T, len(lengths), cp, scheme)


@pytest.mark.parametrize("cp", [2, 3])
def test_segments_match_positions(cp):
    part = vc.partition(_cu([13, 0, 5, 1, 29]), cp)
    for r in range(cp):
        seg, pos, valid = part.segments(r), part.positions(r), part.valid(r)
        chunks = part.chunk_ids(r)
        covered = np.zeros(part.local_rows, bool)
        for b in range(part.batch):
            for m, chunk in enumerate(chunks):
                row, n, p = (int(a[b, m]) for a in (seg.row, seg.length, seg.pos))
                assert p == chunk * int(part.chunk[b])
                assert pos[row:row + n].tolist() == list(range(p, p + n))
                covered[row:row + n] = True
        np.testing.assert_array_equal(covered, valid)


def test_transformer_engine_offsets():
    # seeds/000 as Transformer Engine expects it: padded to 8 rows, pad row holding 100.
    x = np.array([1, 1, 1, 1, 2, 2, 2, 100.0])
    part = vc.partition(_cu([7]), 2, seq_offsets=np.array([0, 8], np.int32))
    assert part.num_rows == 8 and part.local_rows == 4
    assert part.shard(x, 0).tolist() == [1, 1, 2, 0]
    assert part.shard(x, 1).tolist() == [1, 1, 2, 2]
    assert part.unshard([part.shard(x, r) for r in range(2)]).tolist() == [1] * 4 + [2] * 3 + [0]


def test_offsets_with_gaps_keep_the_room():
    cu = _cu([3, 0, 5])
    off = np.array([2, 9, 9, 20], np.int32)                 # a leading gap, rooms 7, 0, 11
    part = vc.partition(cu, 2, seq_offsets=off, num_rows=22)
    assert part.padded_seqlens.tolist() == [8, 0, 12]
    x = np.arange(22.0)
    shards = [part.shard(x, r) for r in range(2)]
    want = np.zeros(22)
    want[2:5], want[9:14] = x[2:5], x[9:14]
    np.testing.assert_array_equal(part.unshard(shards), want)


@pytest.mark.parametrize("scheme", vc.SCHEMES)
def test_unshard_takes_an_allgathered_stack(scheme):
    part = vc.partition(_cu([5, 0, 9]), 3, scheme)
    x = np.arange(14.0 * 2).reshape(14, 2)
    stacked = vc.local_group(3).run(lambda g: g.allgather(part.shard(x, g.rank)))[0]
    np.testing.assert_array_equal(part.unshard(stacked), x)


@pytest.mark.parametrize("scheme", vc.SCHEMES)
def test_lse_axis_and_fill(scheme):
    part = vc.partition(_cu([7]), 2, scheme)
    lse = np.arange(14.0).reshape(2, 7)
    for r in range(2):
        s = part.shard(lse, r, axis=1, fill=-np.inf)
        assert s.shape == (2, part.local_rows)
        assert np.isneginf(s[:, ~part.valid(r)]).all() and np.isfinite(s[:, part.valid(r)]).all()
    back = part.unshard([part.shard(lse, r, axis=1) for r in range(2)], axis=1)
    np.testing.assert_array_equal(back, lse)


def test_fingerprint_tells_partitions_apart():
    a = vc.partition(_cu([7, 3]), 2)
    assert a.fingerprint() == vc.partition(_cu([7, 3]), 2).fingerprint()
    assert a.fingerprint() != vc.partition(_cu([3, 7]), 2).fingerprint()
    assert a.fingerprint() != vc.partition(_cu([7, 3]), 2, "contiguous").fingerprint()


@pytest.mark.parametrize("call, match", [
    (lambda: vc.partition(_cu([7]), 0), "cp_size"),
    (lambda: vc.partition(_cu([7]), 2.0), "cp_size"),
    (lambda: vc.partition(_cu([7]), 2, "striped"), "scheme"),
    (lambda: vc.partition(np.array([0, 5, 3], np.int32), 2), "non-decreasing"),
    (lambda: vc.partition(np.array([1, 5], np.int32), 2), "start at 0"),
    (lambda: vc.partition(np.zeros(0, np.int32), 2), "empty"),
    (lambda: vc.partition(_cu([4, 4]), 2, seq_offsets=np.array([0, 3, 8], np.int32)),
     "too tight"),
    (lambda: vc.partition(_cu([4]), 2, seq_offsets=np.array([0, 4, 8], np.int32)),
     "seq_offsets has 3 entries"),
    (lambda: vc.partition(_cu([7]), 2, local_rows=3), "local_rows"),
    (lambda: vc.partition(_cu([7]), 2).shard(np.zeros(7), 2), "rank"),
    (lambda: vc.partition(_cu([7]), 2).shard(np.zeros(6), 0), "num_rows"),
    (lambda: vc.partition(_cu([7]), 2).unshard([np.zeros(4)]), "2 shards"),
])
def test_errors_name_the_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_float_cu_seqlens_is_a_type_error():
    with pytest.raises(TypeError, match="cu_seqlens must hold integers"):
        vc.partition(np.array([0, 5.0]), 2)


@pytest.mark.parametrize("scheme", vc.SCHEMES)
def test_a_host_partition_moves_to_the_data_module_once(scheme):
    import types
    fake = types.ModuleType("devicelike")          # stands in for CuPy: NumPy's functions
    fake.__dict__.update({k: getattr(np, k) for k in dir(np) if not k.startswith("__")})
    part = vc.partition(_cu([7, 3]), 2, scheme, seq_offsets=np.array([0, 8, 12], np.int32))
    twin = part.on(fake)
    assert twin is part.on(fake) and twin is not part and part.on(np) is part
    assert (twin.num_rows, twin.local_rows) == (part.num_rows, part.local_rows)
    for r in range(2):
        np.testing.assert_array_equal(twin.positions(r), part.positions(r))
