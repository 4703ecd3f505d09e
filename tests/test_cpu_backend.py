"""The `cpu` backend (Numba CPU kernels, BLAS tile products, threads) against the float64
reference, the NumPy backend on context-parallel plans, and itself across thread counts."""
import contextlib
import zlib

import numpy as np
import pytest

import varlen
from varlen import backends, reference
from varlen.masks import key_band, query_band, visible
from varlen.plan import Segments, build_plan

from helpers import (assert_close, check_against_reference, covered_rows, fwd_bwd, make_batch,
                     np_dtype)
from test_numpy_backend import CASES as NUMPY_CASES

pytest.importorskip("numba")

from varlen.backends import _cpu_kernels as K  # noqa: E402
from varlen.backends import _cpu_threads  # noqa: E402
from varlen.backends import cpu_backend  # noqa: E402

DTYPES = ["float32", "float16", "bfloat16", "float64"]

# (id, lengths_q, lengths_k, Hq, Hk, D, Dv, mask, gaps, softcap): the numpy backend's
# adversarial batches, then longer ones (several tiles, BLAS-sized products, odd head dims)
CASES = NUMPY_CASES + [
    ("B3-T1025-gqa2-D97-causal-softcap", [1025, 0, 63], None, 2, 1, 97, 33, "causal", True,
     3.0),
    ("B4-gqa8-D40-sliding-gaps", [300, 1, 0, 77], [290, 1, 5, 77], 8, 1, 40, 40,
     varlen.Mask(window_left=31, window_right=0, bottom_right=True), True, 0.0),
    ("B5-gqa2-D64-perseq-br", [200, 1, 130, 0, 64], [190, 7, 130, 2, 0], 4, 2, 64, 64,
     varlen.Mask(window_left=np.array([-1, -1, 50, 3, -1], np.int32),
                 window_right=np.array([0, -1, 0, 9, 0], np.int32),
                 bottom_right=np.array([1, 0, 1, 0, 1], np.int32)), True, 0.0),
]
IDS = [c[0] for c in CASES]


def _batch(case, dtype):
    _, lq, lk, Hq, Hk, D, Dv, mask, gaps, _ = case
    rng = np.random.default_rng(zlib.crc32(case[0].encode()))
    return make_batch(rng, lq, lk, Hq=Hq, Hk=Hk, D=D, Dv=Dv, dtype=dtype, mask=mask, gaps=gaps)


def _naive_grads(b, softcap):
    """Gradients of a same-dtype FlashAttention-2 computation: float32 arithmetic, the output
    rounded to the batch dtype, `delta = rowsum(dO * O)` reduced apart from the `dP = dO V^T`
    product (as FA-2's preprocessing does). Where a row sees one dominant key, `dP - delta`
    cancels, and what is left is rounding no float32 backward avoids."""
    f32 = np.float32
    q, k, v, do = (x.astype(f32) for x in (b.q, b.k, b.v, b.dout))
    Hq, Hk, D = q.shape[1], k.shape[1], q.shape[2]
    kx, vx = np.repeat(k, Hq // Hk, axis=1), np.repeat(v, Hq // Hk, axis=1)
    scale = f32(1 / np.sqrt(D))
    dq, dkx, dvx = np.zeros_like(q), np.zeros_like(kx), np.zeros_like(vx)
    sq = b.cu_q[:-1] if b.off_q is None else b.off_q[:-1]
    sk = b.cu_k[:-1] if b.off_k is None else b.off_k[:-1]
    for i, ok in enumerate(reference.sequence_masks(b.cu_q, b.cu_k, b.mask)):
        rq, rk = slice(sq[i], sq[i] + ok.shape[0]), slice(sk[i], sk[i] + ok.shape[1])
        raw = np.einsum("ihd,jhd->hij", q[rq], kx[rk]) * scale
        th = np.tanh(raw / f32(softcap)) if softcap > 0 else None
        s = np.where(ok, f32(softcap) * th if softcap > 0 else raw, -np.inf)
        mx = np.where(ok.any(1), s.max(2, initial=-np.inf), 0)[:, :, None]
        p = np.where(ok, np.exp(s - mx), 0)
        p = (p / np.maximum(p.sum(2, keepdims=True), 1e-30)).astype(f32)
        o = np.einsum("hij,jhd->ihd", p, vx[rk]).astype(np_dtype(b.dtype)).astype(f32)
        delta = (do[rq] * o).sum(-1).T[:, :, None]
        ds = p * (np.einsum("ihd,jhd->hij", do[rq], vx[rk]) - delta) * scale
        if softcap > 0:
            ds = ds * (1 - th * th)
        dq[rq] = np.einsum("hij,jhd->ihd", ds, kx[rk])
        dkx[rk] = np.einsum("hij,ihd->jhd", ds, q[rq])
        dvx[rk] = np.einsum("hij,ihd->jhd", p, do[rq])
    G = Hq // Hk
    return (dq, dkx.reshape(-1, Hk, G, D).sum(2),
            dvx.reshape(-1, Hk, G, vx.shape[2]).sum(2))


def _check_grads(b, grads, softcap, label):
    """Gradients within 3x a naive same-dtype backward's error (`_naive_grads`) plus a floor,
    measured against their natural size where the reference cancels to 0."""
    ref = b.ref_backward(softcap=softcap)
    naive = _naive_grads(b, softcap) if b.dtype != "float64" else [np.zeros(1)] * 3
    ref_out, _ = b.ref_forward(softcap=softcap)
    pad = covered_rows(b)[:, None, None]
    magnitude = np.abs(ref_out).max(initial=0) * np.abs(np.where(pad, b.dout.astype(float),
                                                                 0)).max(initial=0)
    for name, g, r, n in zip(("dq", "dk", "dv"), grads, ref, naive):
        err = float(np.abs(n - r).max(initial=0)) if b.dtype != "float64" else 0.0
        assert_close(f"{label} {name}", g, r, dtype=b.dtype, naive_err=err, factor=3.0,
                     floor=16.0, magnitude=magnitude)


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_backward_match_reference(case, dtype):
    softcap = case[-1]
    b = _batch(case, dtype)
    out, lse, grads = fwd_bwd(b, backend="cpu", softcap=softcap)
    assert out.dtype == b.q.dtype and all(g.dtype == b.q.dtype for g in grads)
    assert lse.dtype == (np.float64 if dtype == "float64" else np.float32)
    label = f"{case[0]}/{dtype}"
    check_against_reference(b, out, lse, softcap=softcap, label=label)
    _check_grads(b, grads, softcap, label)
    pad_q, pad_k = ~covered_rows(b, "q"), ~covered_rows(b, "k")
    assert (np.asarray(out, np.float64)[pad_q] == 0).all(), "pad rows of out"
    assert np.isneginf(lse[:, pad_q]).all(), "pad rows of lse"
    for name, g, pad in zip(("dq", "dk", "dv"), grads, (pad_q, pad_k, pad_k)):
        assert (np.asarray(g, np.float64)[pad] == 0).all(), f"pad rows of {name}"


def _random_segments(rng, B, m, max_len):
    """Context-parallel-like segments: m runs per sequence, holes in positions and rows."""
    lengths = rng.integers(0, max_len + 1, size=(B, m))
    pos = np.zeros((B, m), np.int64)
    row = np.zeros((B, m), np.int64)
    seqlen = np.zeros(B, np.int64)
    r0 = 0
    for b in range(B):
        p = 0
        for r in range(m):
            p += int(rng.integers(0, 9))
            pos[b, r] = p
            p += lengths[b, r]
            r0 += int(rng.integers(0, 3))
            row[b, r] = r0
            r0 += lengths[b, r]
        seqlen[b] = p + int(rng.integers(0, 3))
    return Segments(row.astype(np.int32), lengths.astype(np.int32), pos.astype(np.int32),
                    seqlen.astype(np.int32), int(r0 + 2))


@pytest.mark.parametrize("seed", range(6))
def test_segment_plans_match_numpy_backend(seed):
    """Plans with two segments per sequence (context-parallel shards), holes and per-sequence
    policies: the cpu backend agrees with the NumPy backend walking the same plan."""
    rng = np.random.default_rng(seed)
    B = int(rng.integers(1, 5))
    q_seg = _random_segments(rng, B, 2, 70)
    k_seg = _random_segments(rng, B, int(rng.choice([1, 2])), 90)
    mask = varlen.Mask(window_left=rng.choice([-1, 0, 5, 40], size=B).astype(np.int32),
                       window_right=rng.choice([-1, 0, 3], size=B).astype(np.int32),
                       bottom_right=rng.integers(0, 2, size=B).astype(np.int32))
    plan = build_plan(q_seg, k_seg, mask, block_m=int(rng.choice([8, 16, 64])),
                      block_n=int(rng.choice([8, 32, 64])))
    Hq, Hk, D = 4, 2, 16
    q = rng.standard_normal((q_seg.num_rows, Hq, D))
    k = rng.standard_normal((k_seg.num_rows, Hk, D))
    v = rng.standard_normal((k_seg.num_rows, Hk, D))
    dout = rng.standard_normal((q_seg.num_rows, Hq, D))
    ref, cpu = backends.get("numpy"), backends.get("cpu")
    kw = dict(softmax_scale=0.25, softcap=0.0)
    want = ref.forward(plan, q, k, v, **kw)
    want_g = ref.backward(plan, dout, q, k, v, *want, **kw)
    for dtype, tol in (("float64", 1e-12), ("float32", 2e-5)):
        x = [a.astype(dtype) for a in (q, k, v, dout)]
        out, lse = cpu.forward(plan, *x[:3], **kw)
        grads = cpu.backward(plan, x[3], *x[:3], out, lse, **kw)
        for name, got, exp in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads),
                                  (*want, *want_g)):
            finite = np.isfinite(exp)
            assert np.array_equal(finite, np.isfinite(got)), f"{dtype} {name}: -inf pattern"
            err = np.abs(np.asarray(got, np.float64)[finite] - exp[finite]).max(initial=0)
            scale = 1 + np.abs(exp[finite]).max(initial=0)
            assert err <= tol * scale, f"seed {seed} {dtype} {name}: error {err:.2e}"


@pytest.mark.parametrize("block", [(1, 1), (3, 5), (16, 8), (128, 128)])
def test_any_plan_tiles(block):
    """Plans passed in by the caller may have any tile sizes."""
    rng = np.random.default_rng(7)
    mask = varlen.Mask(window_left=np.array([2, -1, 5, -1], np.int32),
                       window_right=np.array([0, -1, 1, 0], np.int32),
                       bottom_right=np.array([1, 0, 0, 1], np.int32))
    b = make_batch(rng, [13, 0, 40, 7], [9, 2, 41, 7], Hq=4, Hk=2, D=8, dtype="float32",
                   mask=mask, gaps=True)
    plan = varlen.plan(b.cu_q, b.cu_k, seq_offsets_q=b.off_q, seq_offsets_k=b.off_k,
                       mask=b.mask, num_rows_q=b.q.shape[0], num_rows_k=b.k.shape[0],
                       block_m=block[0], block_n=block[1])
    out, lse, grads = fwd_bwd(b, backend="cpu", plan=plan)
    check_against_reference(b, out, lse, label=f"tiles {block}")
    _check_grads(b, grads, 0.0, f"tiles {block}")


def test_blas_and_loops_both_correct(monkeypatch):
    """Tile products go to BLAS or to the kernels' loops by size; force each path."""
    b = _batch(CASES[1], "float32")
    for blas_min in (1, 1 << 62):
        monkeypatch.setattr(cpu_backend, "BLAS_MIN", blas_min)
        out, lse, grads = fwd_bwd(b, backend="cpu", softcap=3.0)
        check_against_reference(b, out, lse, softcap=3.0, label=f"blas_min={blas_min}")
        _check_grads(b, grads, 3.0, f"blas_min={blas_min}")


def _many_items(dtype="float32"):
    rng = np.random.default_rng(11)
    lengths = [300, 1, 0, 129, 64, 1000, 77, 2, 513]
    return make_batch(rng, lengths, Hq=8, Hk=2, D=32, dtype=dtype, mask=varlen.Mask(
        window_left=np.array([-1, -1, -1, 40, -1, -1, 10, -1, -1], np.int32),
        window_right=np.array([0, 0, -1, 0, -1, 0, -1, 0, 5], np.int32)), gaps=True)


def _run_bits(b, threads, softcap=0.0):
    import numba
    old = numba.get_num_threads()
    numba.set_num_threads(threads)
    try:
        assert _cpu_threads.num_threads() == threads
        out, lse, grads = fwd_bwd(b, backend="cpu", softcap=softcap)
    finally:
        numba.set_num_threads(old)
    return [np.asarray(a).view(np.uint8) for a in (out, lse, *grads)]


def _spy_workers(monkeypatch) -> list:
    """The worker counts the backend's calls run on, recorded as they start."""
    seen, scope = [], _cpu_threads.worker_scope

    @contextlib.contextmanager
    def spy(items):
        with scope(items) as n:
            seen.append(n)
            yield n
    monkeypatch.setattr(_cpu_threads, "worker_scope", spy)
    return seen


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("nonfinite", [False, True], ids=["finite", "nan-key-row"])
def test_bitwise_identical_for_any_thread_count(dtype, nonfinite, monkeypatch):
    """1 and 2 (or more) workers give the same bits, forward and backward, NaN rows included;
    the second run really splits the work (the spy sees its workers)."""
    import numba
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("one Numba thread on this machine (NUMBA_NUM_THREADS=1)")
    b = _many_items(dtype)
    if nonfinite:
        b.k[int(b.off_k[5]) + 7, 1, 3] = np.nan          # a row of the 1000-key sequence
    workers = _spy_workers(monkeypatch)
    one = _run_bits(b, 1, softcap=2.0)
    assert set(workers) == {1}, f"one thread ran on {workers} workers"
    del workers[:]
    many = _run_bits(b, min(numba.config.NUMBA_NUM_THREADS, 4), softcap=2.0)
    assert min(workers) >= 2, f"several threads ran on {workers} workers"
    for name, x, y in zip(("out", "lse", "dq", "dk", "dv"), one, many):
        assert np.array_equal(x, y), f"{dtype}: {name} differs between 1 and several threads"


def _plan_of(b, block_m=64, block_n=128):
    return varlen.plan(b.cu_q, b.cu_k, **b.layout, num_rows_q=b.q.shape[0],
                       num_rows_k=b.k.shape[0], block_m=block_m, block_n=block_n)


@pytest.mark.parametrize("mask", ["causal", "full", "bottom-right"])
def test_backward_parts_cover_every_slot_and_row(mask):
    """A sequence holding most of the work is cut into parts (one key head: one item per part
    instead of one in all); the parts of each sequence cover its key slots once, in order; one
    part per sequence adds into dQ, and each other one gets its own rows of the partials, at
    least the query rows its slots reach."""
    m = varlen.Mask(window_right=0, bottom_right=True) if mask == "bottom-right" else mask
    b = make_batch(np.random.default_rng(3), [2000, 5, 0, 300], [2100, 5, 3, 300], Hq=4, Hk=1,
                   D=16, dtype="float32", mask=m, gaps=True)
    plan = _plan_of(b)
    G, BM = 4, plan.block_m
    items, parts = cpu_backend.backward_items(plan, 1, G)
    seq = parts[:, 0]
    assert (seq == 0).sum() == cpu_backend.MAX_PARTS          # 2000 x 2100 holds most work
    assert items.size == parts.shape[0]
    used = np.flatnonzero(plan.k_tiles[:, 0] >= 0)
    assert np.array_equal(np.concatenate([np.arange(a, z) for a, z in parts[:, 1:3]]), used)
    for s in np.unique(seq):
        assert (parts[seq == s, 3] == 0).sum() == 1           # one part adds into dQ
    partial = parts[parts[:, 3] == 1]
    rows = partial[:, 6] - partial[:, 5]
    starts = partial[:, 5] + partial[:, 4]
    assert np.array_equal(starts, np.cumsum(rows) - rows)     # disjoint blocks, in order
    for sq, a, z, _, _, r0, r1 in parts:
        reached = []
        for slot in range(a, z):
            for r in range(plan.q.per_seq):
                begin, _, _, end = plan.k_sched[slot, r]
                if end > begin:
                    row = int(plan.q.row[sq, r])
                    reached.append((row + begin * BM,
                                    row + min(end * BM, int(plan.q.length[sq, r]))))
        if reached:                     # exactly the rows reached (keys that reach none add none)
            assert (r0, r1) == (min(lo for lo, _ in reached) * G, max(hi for _, hi in reached) * G)
        else:
            assert r0 == r1


def test_split_backward_matches_unsplit_and_reference(monkeypatch):
    """One long causal document of one key head: its backward items are parts of its key
    tiles with dQ partials reduced afterwards. Against the float64 reference, against the
    same call with splitting off (one part per sequence), and bitwise across thread counts."""
    import numba
    b = make_batch(np.random.default_rng(5), [1500, 7], Hq=4, Hk=1, D=32, dtype="float32",
                   mask="causal", gaps=True)
    _, parts = cpu_backend.backward_items(_plan_of(b), 1, 4)
    assert (parts[:, 3] == 1).any()
    out, lse, grads = fwd_bwd(b, backend="cpu")
    _check_grads(b, grads, 0.0, "split")
    monkeypatch.setattr(cpu_backend, "MAX_PARTS", 1)
    _, whole = cpu_backend.backward_items(_plan_of(b), 1, 4)
    assert not (whole[:, 3] == 1).any()
    unsplit = fwd_bwd(b, backend="cpu")[2]
    for name, x, y in zip(("dq", "dk", "dv"), grads, unsplit):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6, err_msg=name)
    assert np.array_equal(grads[1], unsplit[1]) and np.array_equal(grads[2], unsplit[2])
    monkeypatch.undo()
    if numba.config.NUMBA_NUM_THREADS >= 2:
        one, two = _run_bits(b, 1), _run_bits(b, 2)
        for name, x, y in zip(("out", "lse", "dq", "dk", "dv"), one, two):
            assert np.array_equal(x, y), f"{name} differs between 1 and 2 threads"


def test_repeated_calls_bitwise_identical():
    b = _many_items()
    first = fwd_bwd(b, backend="cpu")
    again = fwd_bwd(b, backend="cpu")
    grads = varlen.attention_backward(b.dout, b.q, b.k, b.v, *first[:2], b.cu_q, b.cu_k,
                                      **b.layout, backend="cpu", deterministic=True)
    first = [np.asarray(a) for a in (*first[:2], *first[2])]
    again = [np.asarray(a) for a in (*again[:2], *grads)]
    for x, y in zip(first, again):
        assert np.array_equal(x.view(np.uint8), y.view(np.uint8))


def test_workspace_reused_and_never_returned():
    """The packed working arrays are kept for the next call of the same sizes (the same
    buffers, not new ones), never alias a returned array, and a second call leaves the first
    call's results as they were; a call on a kept workspace gives the bits of a fresh one."""
    ws = cpu_backend._workspace
    first_batch, second_batch = _many_items(), _many_items()
    rng = np.random.default_rng(7)
    for x in (second_batch.q, second_batch.k, second_batch.v, second_batch.dout):
        x[...] = rng.standard_normal(x.shape).astype(x.dtype)
    second_batch.k[int(second_batch.off_k[5]) + 7, 1, 3] = np.nan    # flags differ too
    cpu_backend.release_workspace()
    first = fwd_bwd(first_batch, backend="cpu")
    first = [np.asarray(a) for a in (*first[:2], *first[2])]
    kept = dict(ws.buffers)
    assert {"q", "k", "v", "q_flag", "dout", "delta", "lse2"} <= set(kept), sorted(kept)
    for name, buf in kept.items():
        for i, x in enumerate(first):
            assert not np.shares_memory(buf, x), f"result {i} aliases workspace {name!r}"
    saved = [x.copy() for x in first]
    second = fwd_bwd(second_batch, backend="cpu")
    second = [np.asarray(a) for a in (*second[:2], *second[2])]
    for name, buf in kept.items():
        assert ws.buffers[name] is buf, f"workspace {name!r} was allocated again"
    for i, (x, y) in enumerate(zip(first, saved)):
        assert np.array_equal(x.view(np.uint8), y.view(np.uint8)), f"result {i} changed"
    cpu_backend.release_workspace()
    fresh = fwd_bwd(second_batch, backend="cpu")
    fresh = [np.asarray(a) for a in (*fresh[:2], *fresh[2])]
    for i, (x, y) in enumerate(zip(second, fresh)):
        assert np.array_equal(x.view(np.uint8), y.view(np.uint8)), f"result {i}: kept != fresh"


def test_predicate_mirrors_masks():
    """The kernels' predicate (and the stacked-row band built on it) is masks.visible."""
    rng = np.random.default_rng(0)
    B, n = 6, 4000
    cu_q = np.concatenate([[0], np.cumsum(rng.integers(0, 40, B))]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(rng.integers(0, 40, B))]).astype(np.int32)
    mask = varlen.Mask(window_left=rng.choice([-1, 0, 3, 9], B).astype(np.int32),
                       window_right=rng.choice([-1, 0, 2], B).astype(np.int32),
                       bottom_right=rng.integers(0, 2, B).astype(np.int32))
    plan = varlen.plan(cu_q, cu_k, mask=mask)
    pv = cpu_backend._view(plan)
    b = rng.integers(0, B, n)
    i, j = rng.integers(-5, 50, n), rng.integers(-5, 50, n)
    want = visible(i, j, pv.seqlen_q[b], pv.seqlen_k[b], pv.window_left[b],
                   pv.window_right[b], pv.bottom_right[b])
    assert np.array_equal(K.visible_pairs(pv, i, j, b), want)
    # the bands: query i sees keys [lo, hi], key j is seen by queries [lo, hi]
    shift = (pv.seqlen_k[b].astype(np.int64) - pv.seqlen_q[b]) * pv.bottom_right[b]
    klo, khi = key_band(np, i, shift, pv.window_left[b], pv.window_right[b])
    qlo, qhi = query_band(np, j, shift, pv.window_left[b], pv.window_right[b])
    assert np.array_equal((j >= klo) & (j <= khi), want)
    assert np.array_equal((i >= qlo) & (i <= qhi), want)


def test_no_recompilation_across_calls():
    """One compiled signature per working dtype: float16, bfloat16 and float32 inputs, other
    shapes, masks and softcaps reuse the float32 kernels (those of calls without user functions
    or dropout, `md` and the last argument `dp` None, counted)."""
    from numba import types
    for dtype in ("float32", "float16", "bfloat16"):
        for case in CASES[:3]:
            fwd_bwd(_batch(case, dtype), backend="cpu", softcap=1.0 if dtype == "float16" else 0)
    for kernel in (K.forward, K.backward):
        f32 = [s for s in kernel.signatures
               if "float32" in str(s) and types.none in s[:-1] and s[-1] == types.none]
        assert len(f32) == 1, f"{kernel.__name__} compiled {len(f32)} float32 variants"


def test_threads_follow_the_usual_knobs(monkeypatch):
    import numba
    threadpoolctl = pytest.importorskip("threadpoolctl")
    n = numba.get_num_threads()
    with threadpoolctl.threadpool_limits(limits=1):
        assert _cpu_threads.num_threads() == 1
    assert _cpu_threads.num_threads() == n
    monkeypatch.delenv("NUMBA_NUM_THREADS", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert _cpu_threads.num_threads() == 1


def test_blas_held_single_threaded_only_inside_a_call():
    threadpoolctl = pytest.importorskip("threadpoolctl")
    if not K.BLAS_BOUND:
        pytest.skip("SciPy's BLAS is not available")
    blas = threadpoolctl.ThreadpoolController().select(user_api="blas")
    before = [lib["num_threads"] for lib in blas.info()]
    with _cpu_threads.blas_scope(True) as usable:
        assert usable
        with _cpu_threads.blas_scope(True):
            pass
        assert all(lib["num_threads"] == 1 for lib in blas.info())
    assert [lib["num_threads"] for lib in blas.info()] == before


def test_default_for_host_data():
    for dtype in ("float16", "bfloat16", "float32"):
        assert backends.explain(dtype=dtype, head_dim=64)[0] == ("cpu", None)
    assert backends.explain(dtype="float64", head_dim=64)[0] == ("numpy", None)
    assert dict(backends.explain(dtype="float32", head_dim=64, on_device=True))["cpu"]


def test_torch_and_jax_cpu_inputs_use_it():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(2)
    b = make_batch(rng, [33, 0, 70], Hq=4, Hk=2, D=16, dtype="float32", mask="causal")
    want, _ = varlen.attention_forward(b.q, b.k, b.v, b.cu_q, b.cu_k, mask="causal",
                                       backend="cpu")
    got, _ = varlen.attention_forward(*(torch.from_numpy(x) for x in (b.q, b.k, b.v)),
                                      torch.from_numpy(b.cu_q), torch.from_numpy(b.cu_k),
                                      mask="causal")
    assert isinstance(got, torch.Tensor)
    assert np.array_equal(got.numpy(), want)
    jnp = pytest.importorskip("jax.numpy")
    got, _ = varlen.attention_forward(*(jnp.asarray(x) for x in (b.q, b.k, b.v)), b.cu_q, b.cu_k,
                                      mask="causal")
    assert np.array_equal(np.asarray(got), want)


@pytest.mark.parametrize("tensor", ["q", "k", "v", "dout", "lse"])
def test_nonfinite_patterns_in_float32(tensor):
    """The float32 kernels follow the non-finite rules as the float64 ones do
    (tests/test_nonfinite.py runs the float64 sweep on every host backend)."""
    rng = np.random.default_rng(len(tensor))
    mask = varlen.Mask(window_left=np.array([-1, -1, 7, -1], np.int32),
                       window_right=np.array([0, -1, 0, 0], np.int32))
    b = make_batch(rng, [150, 70, 90, 1], Hq=4, Hk=2, D=8, dtype="float32", mask=mask,
                   gaps=True, garbage=np.nan)
    kw = dict(seq_offsets_q=b.off_q, seq_offsets_k=b.off_k, mask=mask)
    out, lse = varlen.attention_forward(b.q, b.k, b.v, b.cu_q, b.cu_k, backend="cpu", **kw)
    for value in (np.nan, np.inf, -np.inf):
        args = dict(q=b.q.copy(), k=b.k.copy(), v=b.v.copy(), dout=b.dout.copy(),
                    lse=lse.copy())
        src = args[tensor]
        row = int(rng.choice(np.flatnonzero(covered_rows(b, "k" if tensor in "kv" else "q"))))
        if tensor == "lse":
            src[0, row] = value
        else:
            src[row, 0, 0] = value
        got = varlen.attention_forward(args["q"], args["k"], args["v"], b.cu_q, b.cu_k,
                                       backend="cpu", **kw)
        want = reference.attention_dense(args["q"], args["k"], args["v"], b.cu_q, b.cu_k, **kw)
        for name, g, w in zip(("out", "lse"), got, want):
            assert np.array_equal(np.isnan(np.asarray(g, float)), np.isnan(w)), \
                f"{tensor}={value}: NaN pattern of {name}"
        grads = varlen.attention_backward(args["dout"], args["q"], args["k"], args["v"], out,
                                          args["lse"], b.cu_q, b.cu_k, backend="cpu", **kw)
        want = reference.attention_dense_backward(args["dout"], args["q"], args["k"],
                                                  args["v"], b.cu_q, b.cu_k, out=out,
                                                  lse=args["lse"], **kw)
        for name, g, w in zip(("dq", "dk", "dv"), grads, want):
            assert np.array_equal(np.isnan(np.asarray(g, float)), np.isnan(w)), \
                f"{tensor}={value}: NaN pattern of {name}"


def test_tile_products_use_the_openblas_wheel_when_installed():
    """With `scipy-openblas32` installed the kernels call its ?gemm (faster tile products than
    SciPy's older OpenBLAS), and the controller that holds BLAS at one thread inside a call
    sees that library."""
    wheel = pytest.importorskip("scipy_openblas32")
    pytest.importorskip("threadpoolctl")
    import ctypes
    import os
    import llvmlite.binding as llvm
    path = os.path.join(wheel.get_lib_dir(), wheel.get_library(fullname=True))
    lib = ctypes.CDLL(path)
    for dtype, name in (("float32", "scipy_sgemm_"), ("float64", "scipy_dgemm_")):
        want = ctypes.cast(getattr(lib, name), ctypes.c_void_p).value
        assert llvm.address_of_symbol(K.GEMM_SYMBOLS[dtype]) == want, dtype
    held = [lib.lib.filepath for lib in _cpu_threads._blas_libraries()]
    assert any(os.path.samefile(p, path) for p in held), held


def test_not_the_default_without_blas(monkeypatch):
    """Without SciPy's BLAS (or threadpoolctl to hold it at one thread) the backend's own loops
    are slower than the numpy backend: it runs by name but is not chosen by default."""
    monkeypatch.setattr(K, "BLAS_BOUND", False)
    names = dict(backends.explain(dtype="float32", head_dim=64))
    assert names["cpu"] and names["numpy"] is None
    b = make_batch(np.random.default_rng(0), [5, 9], Hq=2, Hk=1, D=8, dtype="float32")
    out, lse, grads = fwd_bwd(b, backend="cpu")
    check_against_reference(b, out, lse, label="no BLAS")
