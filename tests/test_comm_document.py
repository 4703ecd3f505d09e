"""The document scheme of `varlen.comm.partition`: placement, shards, and the three methods on
it (in-process ranks, and real `mpiexec` ranks through this file run as a worker:
tests/multiprocess/test_comm_mpi.py), with the ring's traffic: only split documents' rows, only
between the ranks that share them.

    mpiexec -n N python -m mpi4py tests/test_comm_document.py      # the worker
"""
import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE), str(_HERE.parent)]       # comm_workers, helpers, varlen

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import varlen  # noqa: E402
import varlen.comm as vc  # noqa: E402
from varlen import reference  # noqa: E402
from varlen.comm.partition import document_work  # noqa: E402

from comm_workers.cases import TOL, Case, _assert_close, _policy, make_global  # noqa: E402
from helpers import cases, covering  # noqa: E402

# (case, partition keywords): max_doc_len forces splits in these small batches.
DOC_CASES = [
    # Causal and bidirectional documents mixed, GQA, a zero-length document, lengths not
    # divisible by 2*cp; documents longer than 9 rows are split.
    (Case("mixed-policies-gqa", (5, 0, 13, 1, 8, 31, 3), Hq=4, Hk=2, D=16,
          mask=_policy(window_right=[0, -1, 0, -1, 0, 0, -1]), scheme="document"),
     dict(max_doc_len=9, mask="causal")),
    # Per-sequence sliding windows, Hk=3 (Ulysses replicates KV heads), the default threshold.
    (Case("sliding-windows", (17, 3, 9, 2, 40), Hq=12, Hk=3, D=8, scheme="document",
          mask=_policy(window_left=[4, 2, -1, 0, 7], window_right=[0, 1, 3, 0, 0])), {}),
    # Global rows with gaps (seq_offsets), causal, the last document empty.
    (Case("offsets-gaps", (11, 4, 0, 26, 6, 0), mask="causal", gaps=True, seed=3,
          scheme="document"), dict(max_doc_len=5)),
    # Cross attention, bottom-right: the key partition takes the query partition's placement.
    (Case("bottom-right-cross", (3, 19, 1, 0, 4), lengths_k=(7, 23, 4, 2, 1), Hq=4, Hk=1,
          mask=_policy(window_left=[-1, 3, -1, -1, 1], window_right=0,
                       bottom_right=[1, 1, 0, 1, 1]), scheme="document"),
     dict(max_doc_len=4)),
    # float32 data, a fixed capacity (static shapes): 1.5 times the mean rows per rank.
    (Case("float32-capacity", (9, 4, 1, 21), Hq=4, Hk=2, mask="causal", dtype="float32",
          scheme="document"), dict(max_doc_len=8, slack=1.5)),
]


def doc_partitions(case, g, cp, kw):
    kw = dict(kw)
    slack = kw.pop("slack", None)
    if slack is not None:
        kw["local_rows"] = int(np.ceil(slack * int(g["cu_q"][-1]) / cp)) + 1
    pq = vc.partition(g["cu_q"], cp, "document", seq_offsets=g["off_q"], num_rows=g["Tq"], **kw)
    if case.lengths_k is None:
        return pq, pq
    pk = vc.partition(g["cu_k"], cp, "document", seq_offsets=g["off_k"], num_rows=g["Tk"],
                      like=pq, **{k: v for k, v in kw.items() if k != "local_rows"})
    return pq, pk


def check_doc_case(group, case, kw, method):
    """One rank: forward and backward on the document partition against the shard of the
    single-process float64 reference; pad rows exactly zero (lse -inf)."""
    r, cp = group.rank, group.size
    g = group.allgather_object(make_global(case) if r == 0 else None)[0]
    pq, pk = doc_partitions(case, g, cp, kw)
    part = pq if pk is pq else (pq, pk)
    call = dict(mask=case.mask, method=method, backend=case.backend)
    q, dout = pq.shard(g["q"], r), pq.shard(g["dout"], r)
    k, v = pk.shard(g["k"], r), pk.shard(g["v"], r)
    out, lse = vc.attention_forward(q, k, v, part, group, **call)
    dq, dk, dv = vc.attention_backward(dout, q, k, v, out, lse, part, group, **call)
    layout = dict(seq_offsets_q=g["off_q"], seq_offsets_k=g["off_k"], mask=case.mask)
    ref_out, ref_lse = reference.attention_dense(g["q"], g["k"], g["v"], g["cu_q"], g["cu_k"],
                                                 **layout)
    ref_dq, ref_dk, ref_dv = reference.attention_dense_backward(
        g["dout"], g["q"], g["k"], g["v"], g["cu_q"], g["cu_k"], **layout)
    label = f"{case.id} cp={cp} {method} rank {r}"
    tol = TOL[case.dtype]
    _assert_close(f"{label} out", out, pq.shard(ref_out, r), tol)
    _assert_close(f"{label} lse", lse, pq.shard(ref_lse, r, axis=1, fill=-np.inf), tol)
    _assert_close(f"{label} dq", dq, pq.shard(ref_dq, r), tol)
    _assert_close(f"{label} dk", dk, pk.shard(ref_dk, r), tol)
    _assert_close(f"{label} dv", dv, pk.shard(ref_dv, r), tol)
    qpad, kpad = ~pq.valid(r), ~pk.valid(r)
    for name, a, pad in (("out", out, qpad), ("dq", dq, qpad), ("dk", dk, kpad),
                         ("dv", dv, kpad)):
        assert not np.asarray(a)[pad].any(), f"{label}: {name} is not zero on pad rows"
    assert np.isneginf(np.asarray(lse)[:, qpad]).all(), f"{label}: lse of pad rows is not -inf"


def _methods(case, cp):
    return [m for m in vc.METHODS if m != "ulysses" or case.Hq % cp == 0]


def _cu(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


# --------------------------------------------------------------------------------------------
# Placement and shards
# --------------------------------------------------------------------------------------------

LENGTHS = [(7,), (0,), (5, 0, 13, 1, 8, 31, 3, 0), (1, 1, 1, 1, 1, 64), (100, 3, 2)]


# every lengths, cp and split threshold; at the quick size every lengths and every cp under each
# threshold
PLACEMENTS = cases([pytest.param(lengths, cp, max_doc_len,
                                 id=f"L{'-'.join(map(str, lengths))}-{cp}-{max_doc_len}")
                    for max_doc_len in (None, 0, 6) for cp in (1, 2, 3, 4, 5)
                    for lengths in LENGTHS],
                   covering(lambda p: (p.values[0], p.values[2]),
                            lambda p: (p.values[1], p.values[2])))


@pytest.mark.parametrize("lengths, cp, max_doc_len", PLACEMENTS)
def test_every_token_on_exactly_one_rank(lengths, cp, max_doc_len):
    cu = _cu(lengths)
    part = vc.partition(cu, cp, "document", max_doc_len=max_doc_len)
    rows = np.arange(1, int(cu[-1]) + 1, dtype=np.float64)        # global row + 1: 0 is a pad
    shards = [part.shard(rows, r) for r in range(cp)]
    held = np.concatenate(shards)
    assert np.array_equal(np.sort(held[held > 0]), rows), "tokens lost or held twice"
    np.testing.assert_array_equal(part.unshard(shards), rows)
    for r, got in enumerate(shards):
        seg, pos, valid = part.segments(r), part.positions(r), part.valid(r)
        assert got.shape == (part.local_rows,) and not got[~valid].any(), "pads: zero, unread"
        want = np.zeros(part.local_rows)                 # what the segments say each row holds
        for b, m in zip(*np.nonzero(seg.length)):
            row, n, p = (int(a[b, m]) for a in (seg.row, seg.length, seg.pos))
            assert pos[row:row + n].tolist() == list(range(p, p + n)), (r, b, m)
            want[row:row + n] = cu[b] + p + 1 + np.arange(n)
        np.testing.assert_array_equal(got, want, err_msg=f"rank {r}: rows vs segments")
    for b, (n, grp) in enumerate(zip(lengths, part.groups)):
        holders = [r for r in range(cp) if part.segments(r).length[b].sum()]
        assert holders == (list(grp) if n else []), (b, holders, grp)
        if max_doc_len is not None and n <= max_doc_len:
            assert len(grp) == 1, f"document {b} of length {n} should be whole: {grp}"


def test_split_document_is_a_zigzag_over_its_group():
    part = vc.partition(_cu([4, 40, 3]), 4, "document", max_doc_len=8)
    assert [len(g) for g in part.groups] == [1, len(part.groups[1]), 1]
    grp = part.groups[1]
    assert len(grp) >= 2
    n = 2 * len(grp)
    ends = [i * 40 // n for i in range(n + 1)]
    for j, r in enumerate(grp):
        seg = part.segments(r)
        assert seg.pos[1].tolist() == [ends[j], ends[n - 1 - j]]
        assert seg.length[1].tolist() == [ends[j + 1] - ends[j], ends[n - j] - ends[n - 1 - j]]


def test_whole_documents_balance_causal_work():
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 300, size=60)
    part = vc.partition(_cu(lengths), 4, "document")
    work = np.zeros(4)
    pairs = document_work(lengths)
    for b, g in enumerate(part.groups):
        work[list(g)] += pairs[b] / len(g)
    assert work.max() / work.mean() <= 1.05, work
    assert sum(len(g) > 1 for g in part.groups) <= 4, part.groups


def test_capacity_is_respected_or_refused():
    cu = _cu([30, 30, 30, 2, 2])
    part = vc.partition(cu, 3, "document", local_rows=40)
    assert part.local_rows == 40 and max(part.rows_used) <= 40
    with pytest.raises(ValueError, match="local_rows=20 is too small"):
        vc.partition(cu, 3, "document", local_rows=20)
    with pytest.raises(ValueError, match="capacity"):
        vc.local_rows_bound(94, 5, 3, "document")


def test_work_of_each_mask():
    L = np.array([0, 1, 5, 8])
    dw = document_work
    assert dw(L, "full").tolist() == (L * L).tolist()
    assert dw(L, "causal").tolist() == (L * (L + 1) // 2).tolist()
    win = dw(L, varlen.Mask(window_left=2, window_right=0)).tolist()
    assert win == [0, 1, 5 + 4 + 3, 8 + 7 + 6]


def test_ring_rows_are_the_shared_documents_rows():
    part = vc.partition(_cu([3, 50, 2, 4, 60]), 4, "document", max_doc_len=10)
    for src in range(4):
        assert part.ring_count(src, src) == 0
        for dst in range(4):
            rows = part.ring_rows(src, dst)
            want = [t for b in range(part.batch) if src != dst and src in part.groups[b]
                    and dst in part.groups[b] and len(part.groups[b]) > 1
                    for m in range(2)
                    for t in range(int(part.segments(src).row[b, m]),
                                   int(part.segments(src).row[b, m] +
                                       part.segments(src).length[b, m]))]
            assert rows.tolist() == want, (src, dst)


def test_ring_route_is_every_ranks_ring_rows_in_one_table():
    part = vc.partition(_cu([3, 50, 2, 4, 60]), 4, "document", max_doc_len=10)
    for step in range(4):
        rows, counts = part.ring_route(step)
        assert rows.shape == (4, max(counts.max(), 0)) and rows.dtype == np.int64
        for r in range(4):
            dst = (r + step) % 4
            assert counts[r] == part.ring_count(r, dst), (step, r)
            assert rows[r, :counts[r]].tolist() == part.ring_rows(r, dst).tolist(), (step, r)
            assert (rows[r, counts[r]:] == part.local_rows).all(), "padding: a row past the shard"
    assert not part.ring_route(0)[1].any(), "step 0: a rank's own keys do not travel"


def test_cross_attention_needs_the_same_placement():
    pq = vc.partition(_cu([3, 40]), 2, "document", max_doc_len=5)
    pk = vc.partition(_cu([40, 3]), 2, "document", max_doc_len=5)
    with pytest.raises(ValueError, match="like=part_q"):
        vc.plan((pq, pk), 0, dtype="float64", head_dim=8, method="ring")
    with pytest.raises(ValueError, match="like="):
        vc.partition(_cu([3]), 2, "document", like=pq)


# --------------------------------------------------------------------------------------------
# Methods on the document partition
# --------------------------------------------------------------------------------------------

# every cp, case and method; at the quick size every case and method, and every cp
COMBOS = cases([pytest.param(case, kw, cp, method, id=f"cp{cp}-{case.id}-{method}")
                for cp in (1, 2, 3, 4) for case, kw in DOC_CASES
                for method in _methods(case, cp)],
               covering(lambda p: (p.values[0].id, p.values[3]), lambda p: p.values[2]))


@pytest.mark.parametrize("case, kw, cp, method", COMBOS)
def test_matches_single_process_reference(case, kw, cp, method):
    vc.local_group(cp).run(check_doc_case, case, kw, method)


def _record_sends(monkeypatch):
    sent = []
    orig = vc.P2P.post_send

    def post_send(self, x, peer):
        sent.append((self._group.rank, peer, self._tag, tuple(x.shape)))
        return orig(self, x, peer)
    monkeypatch.setattr(vc.P2P, "post_send", post_send)
    return sent


def _ring_once(part, lengths, cp):
    T = int(sum(lengths))
    rng = np.random.default_rng(0)
    q, k, v, dout = (rng.standard_normal((T, 2, 8)) for _ in range(4))

    def body(grp):
        r = grp.rank
        qs, ks, vs, ds = (part.shard(x, r) for x in (q, k, v, dout))
        out, lse = vc.attention_forward(qs, ks, vs, part, grp, mask="causal")
        vc.attention_backward(ds, qs, ks, vs, out, lse, part, grp, mask="causal")
    vc.local_group(cp).run(body)


def test_ring_sends_only_split_documents_to_their_sharers(monkeypatch):
    lengths = [3, 50, 2, 4, 60, 7]
    cp = 4
    part = vc.partition(_cu(lengths), cp, "document", max_doc_len=10)
    sent = _record_sends(monkeypatch)
    _ring_once(part, lengths, cp)
    # K/V: forward and backward, k and v each; dK/dV back: the rows received, k and v.
    for src in range(cp):
        for dst in range(cp):
            n = part.ring_count(src, dst)
            kv = [s for s in sent if s[:3] == (src, dst, 11)]
            back = [s for s in sent if s[:3] == (dst, src, 12)]
            if n == 0:
                assert not kv and not back, (src, dst, kv, back)
            else:
                assert sorted(s[3][0] for s in kv) == [n] * 4, (src, dst, kv)
                assert sorted(s[3][0] for s in back) == [n] * 2, (src, dst, back)
    # Each member of a split document's group sends its rows to every other member; the rows
    # of whole documents never travel.
    travelling = sum(n * (len(g) - 1) for n, g in zip(lengths, part.groups))
    assert sum(part.ring_count(s, d) for s in range(cp) for d in range(cp)) == travelling
    assert any(len(g) > 1 for g in part.groups) and any(len(g) == 1 for g in part.groups)


def test_ring_of_whole_documents_sends_nothing(monkeypatch):
    lengths = [9, 8, 7, 6, 5, 4]
    part = vc.partition(_cu(lengths), 3, "document", max_doc_len=100)
    assert all(len(g) == 1 for g in part.groups)
    sent = _record_sends(monkeypatch)
    _ring_once(part, lengths, 3)
    assert sent == []


def test_training_entry_point_takes_a_document_partition():
    torch = pytest.importorskip("torch")
    import varlen.torch as vt
    if not hasattr(vt, "context_parallel_attention"):
        pytest.skip("varlen.torch.context_parallel_attention is not available")
    lengths, cp = [5, 0, 13, 1, 8, 31, 3], 3
    cu = _cu(lengths)
    part = vc.partition(cu, cp, "document", max_doc_len=6)
    assert any(len(g) > 1 for g in part.groups)
    rng = np.random.default_rng(0)
    q, k, v, dout = (rng.standard_normal((int(cu[-1]), 4, 8)) for _ in range(4))
    want = reference.attention_dense(q, k, v, cu, cu, mask="causal")[0]
    want_dk = reference.attention_dense_backward(dout, q, k, v, cu, cu, mask="causal")[1]

    def body(grp):
        qs, ks, vs = (torch.tensor(part.shard(x, grp.rank), requires_grad=True)
                      for x in (q, k, v))
        out = vt.context_parallel_attention(qs, ks, vs, part, grp, mask="causal")
        (out * torch.tensor(part.shard(dout, grp.rank))).sum().backward()
        return out.detach().numpy(), ks.grad.numpy()
    res = vc.local_group(cp).run(body)
    np.testing.assert_allclose(part.unshard([o for o, _ in res]), want, atol=1e-12)
    np.testing.assert_allclose(part.unshard([g for _, g in res]), want_dk, atol=1e-12)


# --------------------------------------------------------------------------------------------
# Real mpiexec ranks (tests/multiprocess/test_comm_mpi.py): this file is the worker
# --------------------------------------------------------------------------------------------


def _worker():
    from mpi4py import MPI
    varlen.set_nan_fill(True)
    group = vc.init(MPI.COMM_WORLD, backend="mpi", timeout=120.0)
    checks = 0
    for case, kw in DOC_CASES:
        for method in _methods(case, group.size):
            check_doc_case(group, case, kw, method)
            checks += 1
    if group.rank == 0:
        print(f"OK document size={group.size} checks={checks}", flush=True)


if __name__ == "__main__":
    _worker()
