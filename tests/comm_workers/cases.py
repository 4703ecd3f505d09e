"""Context-parallel test cases, run on one rank of any group (in-process or MPI).

`check_case(group, case, method)` builds the global batch on rank 0 and broadcasts it,
partitions and shards it, runs `varlen.comm.attention_forward/backward`, and compares this
rank's shard of out, lse, dq, dk, dv with the shard of the single-process float64 reference.
Pad rows must be exactly zero (lse -inf).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

import varlen
import varlen.comm as vc
from varlen import reference

from helpers import Batch, covered_rows

TOL = {"float64": 1e-12, "float32": 2e-5}     # relative to max(1, |reference|)


@dataclass(frozen=True)
class Case:
    name: str
    lengths: tuple
    lengths_k: tuple | None = None       # cross attention: a second partition for keys
    Hq: int = 4
    Hk: int = 2
    D: int = 8
    mask: object = "full"
    softcap: float = 0.0
    softmax_scale: float | None = None
    gaps: bool = False                   # global rows with padding gaps (seq_offsets)
    scheme: str = "zigzag"
    cp_sizes: tuple = (1, 2, 3, 4)
    seed: int = 0
    backend: str = "numpy"
    dtype: str = "float64"
    extra: dict = field(default_factory=dict)

    @property
    def id(self):
        return self.name


def _policy(**fields):
    return varlen.Mask(**{k: np.asarray(v, np.int32) if isinstance(v, list) else v
                          for k, v in fields.items()})


CASES = [
    # seeds/000: one sequence of 7 on cp=2 (1 x4 then 2 x3, D=8), given as Transformer Engine
    # expects it: padded to 8 rows, the pad row holding 100, cu_seqlens [0, 7], offsets [0, 8].
    Case("seed000", (7,), Hq=1, Hk=1, D=8, cp_sizes=(2,), extra={"seed000": True}),
    # Causal and bidirectional sequences in one call, GQA, a zero-length sequence inside.
    Case("mixed-policies-gqa", (5, 0, 13, 1, 8), Hq=4, Hk=2, D=16,
         mask=_policy(window_right=[0, -1, 0, -1, 0])),
    # Per-sequence sliding windows (left, right), Hk=3 does not divide cp=2/4: Ulysses
    # replicates KV heads.
    Case("sliding-windows", (17, 3, 9, 2), Hq=12, Hk=3, D=8,
         mask=_policy(window_left=[4, 2, -1, 0], window_right=[0, 1, 3, 0])),
    # Cross attention, bottom-right causal with Lq != Lk (queries with no visible key), MQA.
    Case("bottom-right-cross", (3, 9, 1, 0, 4), lengths_k=(7, 9, 4, 2, 1), Hq=4, Hk=1,
         mask=_policy(window_left=[-1, 3, -1, -1, 1], window_right=0,
                      bottom_right=[1, 1, 0, 1, 1])),
    # Zero-length and length-1 sequences (the last one empty), softcap, custom scale.
    Case("zero-and-one", (0, 1, 1, 0, 6, 0), Hq=4, Hk=4, mask="causal", softcap=5.0,
         softmax_scale=0.3),
    # Global rows with gaps and a leading gap (seq_offsets), causal.
    Case("offsets-gaps", (11, 4, 0, 6), mask="causal", gaps=True, seed=3),
    # The contiguous scheme, full and causal mixed.
    Case("contiguous", (9, 2, 5), mask=_policy(window_right=[0, -1, 0]), scheme="contiguous"),
    # float32 data: float32 messages, float32 merge and dK/dV accumulators.
    Case("float32", (9, 4, 1), Hq=4, Hk=2, mask="causal", dtype="float32", cp_sizes=(2, 3, 4)),
]


def cases_for(cp: int):
    return [c for c in CASES if cp in c.cp_sizes]


def methods_for(case: Case, cp: int):
    return [m for m in vc.METHODS if m != "ulysses" or case.Hq % cp == 0]


# --------------------------------------------------------------------------------------------
# Global batches
# --------------------------------------------------------------------------------------------

def _cu(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def _layout(rng, lengths, gaps):
    """cu_seqlens, seq_offsets (or None) and the global row count."""
    cu = _cu(lengths)
    if not gaps:
        return cu, None, int(cu[-1])
    room = np.asarray(lengths) + rng.integers(0, 4, size=len(lengths))
    off = (2 + np.concatenate([[0], np.cumsum(room)])).astype(np.int32)
    return cu, off, int(off[-1]) + 1


def make_global(case: Case) -> dict:
    """The global inputs of a case: pad rows hold 1e4 (or 100 for seeds/000), never read."""
    rng = np.random.default_rng(case.seed)
    if case.extra.get("seed000"):
        x = np.concatenate([np.full(4, 1.0), np.full(3, 2.0), [100.0]])
        x = np.broadcast_to(x[:, None, None], (8, 1, 8)).copy()
        cu, off = np.array([0, 7], np.int32), np.array([0, 8], np.int32)
        dout = rng.standard_normal((8, 1, 8))
        dout[7] = 100.0
        return dict(q=x, k=x.copy(), v=x.copy(), dout=dout, cu_q=cu, cu_k=cu, off_q=off,
                    off_k=off, Tq=8, Tk=8)
    cu_q, off_q, Tq = _layout(rng, case.lengths, case.gaps)
    cu_k, off_k, Tk = (cu_q, off_q, Tq) if case.lengths_k is None else \
        _layout(rng, case.lengths_k, case.gaps)

    def data(T, H):
        return rng.standard_normal((T, H, case.D))
    b = Batch(q=data(Tq, case.Hq), k=data(Tk, case.Hk), v=data(Tk, case.Hk), cu_q=cu_q,
              cu_k=cu_k, off_q=off_q, off_k=off_k, dout=data(Tq, case.Hq))
    pad_q, pad_k = ~covered_rows(b, "q"), ~covered_rows(b, "k")
    for x, pad in ((b.q, pad_q), (b.dout, pad_q), (b.k, pad_k), (b.v, pad_k)):
        x[pad] = 1e4
    dt = np.dtype(case.dtype)
    return dict(q=b.q.astype(dt), k=b.k.astype(dt), v=b.v.astype(dt), dout=b.dout.astype(dt),
                cu_q=cu_q, cu_k=cu_k, off_q=off_q, off_k=off_k, Tq=Tq, Tk=Tk)


def partitions(case: Case, g: dict, cp: int):
    pq = vc.partition(g["cu_q"], cp, case.scheme, seq_offsets=g["off_q"], num_rows=g["Tq"])
    if case.lengths_k is None:
        return pq, pq
    pk = vc.partition(g["cu_k"], cp, case.scheme, seq_offsets=g["off_k"], num_rows=g["Tk"])
    return pq, pk


# --------------------------------------------------------------------------------------------
# One rank's check
# --------------------------------------------------------------------------------------------

def _assert_close(label, got, want, tol):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, f"{label}: shape {got.shape} != {want.shape}"
    assert not np.isnan(got).any(), f"{label}: NaN at {np.argwhere(np.isnan(got))[:4].tolist()}"
    inf = np.isneginf(want)
    assert np.array_equal(np.isneginf(got), inf), (
        f"{label}: -inf pattern differs at {np.argwhere(np.isneginf(got) != inf)[:4].tolist()}")
    if (~inf).any():
        err = float(np.abs(got[~inf] - want[~inf]).max())
        bound = tol * max(1.0, float(np.abs(want[~inf]).max()))
        assert err <= bound, f"{label}: max abs error {err:.3e} > {bound:.3e}"
        return err
    return 0.0


def check_case(group, case: Case, method: str) -> float:
    """Run one case on this rank; returns the largest error seen (asserts on failure)."""
    r, cp = group.rank, group.size
    g = group.allgather_object(make_global(case) if r == 0 else None)[0]   # rank 0's inputs
    pq, pk = partitions(case, g, cp)
    part = pq if pk is pq else (pq, pk)
    kw = dict(mask=case.mask, softmax_scale=case.softmax_scale, softcap=case.softcap,
              method=method, backend=case.backend)
    q, dout = pq.shard(g["q"], r), pq.shard(g["dout"], r)
    k, v = pk.shard(g["k"], r), pk.shard(g["v"], r)
    out, lse = vc.attention_forward(q, k, v, part, group, **kw)
    dq, dk, dv = vc.attention_backward(dout, q, k, v, out, lse, part, group, **kw)

    layout = dict(seq_offsets_q=g["off_q"], seq_offsets_k=g["off_k"], mask=case.mask,
                  softmax_scale=case.softmax_scale, softcap=case.softcap)
    ref_out, ref_lse = reference.attention_dense(g["q"], g["k"], g["v"], g["cu_q"], g["cu_k"],
                                                 **layout)
    ref_dq, ref_dk, ref_dv = reference.attention_dense_backward(
        g["dout"], g["q"], g["k"], g["v"], g["cu_q"], g["cu_k"], **layout)
    label = f"{case.id} cp={cp} {method} rank {r}"
    tol = TOL[case.dtype]
    for name, a in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert a.dtype == case.dtype, f"{label} {name}: dtype {a.dtype}"
    assert lse.dtype == case.dtype, f"{label} lse: dtype {lse.dtype}"
    err = max(
        _assert_close(f"{label} out", out, pq.shard(ref_out, r), tol),
        _assert_close(f"{label} lse", lse, pq.shard(ref_lse, r, axis=1, fill=-np.inf), tol),
        _assert_close(f"{label} dq", dq, pq.shard(ref_dq, r), tol),
        _assert_close(f"{label} dk", dk, pk.shard(ref_dk, r), tol),
        _assert_close(f"{label} dv", dv, pk.shard(ref_dv, r), tol))
    # Pad rows: exactly zero output and gradients, lse -inf.
    qpad, kpad = ~pq.valid(r), ~pk.valid(r)
    for name, a, pad in (("out", out, qpad), ("dq", dq, qpad), ("dk", dk, kpad),
                         ("dv", dv, kpad)):
        assert not np.asarray(a)[pad].any(), f"{label}: {name} is not zero on pad rows"
    assert np.isneginf(np.asarray(lse)[:, qpad]).all(), f"{label}: lse of pad rows is not -inf"
    if case.extra.get("seed000"):
        full = np.round(np.asarray(ref_out)[:7, 0, 0], 4)
        assert np.array_equal(full, [1.9269] * 4 + [1.9954] * 3), full
    return err
