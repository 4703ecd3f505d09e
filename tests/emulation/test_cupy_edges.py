"""The CuPy kernels at the edges, on a CPU: the real kernels through the host emulation
(`emulation/cupy.py`, each case in its own process, as the emulation replaces
`cupy`) against the float64 reference.

* Non-finite values (docs/semantics.md, "Non-finite values"): NaN, +inf and -inf in q, k, v
  (forward) and q, k, v, dout, out, lse (backward, both dQ modes) of a small batch whose tile
  edges fall inside a sequence, with padding gaps full of NaN and a second sequence, give the
  reference's pattern of non-finite (row, head) entries: nothing reaches a row that cannot see
  it, and every row that sees one is NaN.
* 64-bit addressing: one short sequence at the end of packed arrays of more than 2**31
  elements (sparse anonymous memory maps: only its rows are ever touched) is computed at the
  right addresses, forward and backward (dK/dV with atomic dQ, and with ordered dQ); the
  forward's pad blocks and the backward preprocessing write the rows no tile covers at
  element offsets past 2**31 and nothing else; and the forward kernel walks the last key
  chunks of a sequence of 2**31 - 1 keys (chunk counts without an int32 overflow, element
  offsets near 2**36).

(Device support, on stand-in device properties: tests/test_cupy_implementations.py.)
"""
from __future__ import annotations

import math
import mmap
import sys

import numpy as np
import pytest

import varlen.backends.cupy.launch as _cupy_launch

from helpers import SKIP_STATUS, cases, emulate_script, needs_cxx



def _emulate(*case, timeout=600):
    emulate_script(__file__, *case, timeout=timeout)


def _assert_finite_close(label, got, want, tol):
    """Entries finite in both agree within `tol` times the reference's magnitude (or 1)."""
    got = np.asarray(got, np.float64)
    both = np.isfinite(got) & np.isfinite(want)
    err = np.abs(got[both] - want[both]).max(initial=0.0)
    scale = max(1.0, np.abs(want[both]).max(initial=0.0))
    assert err <= tol * scale, f"{label}: finite entries differ by {err:.3e} (scale {scale:.3g})"


# --------------------------------------------------------------------------------------------
# Non-finite values: a value never leaves what can see it; where it is seen, it shows
# --------------------------------------------------------------------------------------------

FORWARD_TENSORS = ("q", "k", "v")
BACKWARD_TENSORS = ("q", "k", "v", "dout", "out", "lse")


@needs_cxx
@pytest.mark.parametrize("tensor, softcap", cases(
    [*(pytest.param(t, 0.0, id=t) for t in FORWARD_TENSORS),
     pytest.param("k", 5.0, id="k-softcap")], ["q", "k-softcap"]))
def test_nonfinite_forward_matches_reference_pattern(tensor, softcap):
    # under a softcap, tanh would turn an infinite score into a finite one: still NaN
    _emulate("nonfinite-forward", tensor, str(softcap))


@needs_cxx
@pytest.mark.parametrize("tensor", cases(BACKWARD_TENSORS, ["q", "out"]))
def test_nonfinite_backward_matches_reference_pattern(tensor):
    _emulate("nonfinite-backward", tensor)


@needs_cxx
@pytest.mark.parametrize("case, args", [("nonfinite-forward", ("v", "0.0")),
                                        ("nonfinite-backward", ("k",))], ids=["fwd-v", "bwd-k"])
def test_nonfinite_at_head_dim_v_below_head_dim(case, args):
    """D = 192, Dv = 128: a thread's V chunks are not its K chunks, so the NaN a non-finite V
    row hands to its K row (forward) and a K row to its V row (dK/dV) is written after a
    barrier; copies land at random points (a NaN written before another thread's copy landed
    would be lost, and its rows finite)."""
    from helpers import emulate
    emulate([__file__, case, *args, "192", "128"],
            {"VARLEN_EMULATION_SCHEDULE": "random", "VARLEN_EMULATION_SEED": "1"}, timeout=900)


def _nonfinite_batch(D=32, Dv=None):
    """fp16, D=32 (or `D` and `Dv`), GQA 4/2, tiles (64, 64). Sequence 0 (70 x 70, causal) has a
    tile edge at row 64 inside it: its diagonal chunks are partially masked, chunk 0 of its
    second query tile is fully visible, its last key chunk is ragged. Sequence 1 (9 x 12,
    sliding window) follows after a padding gap. Every padding row of q, k, v, dout holds
    NaN."""
    import varlen
    from helpers import make_batch
    mask = varlen.Mask(window_left=np.array([-1, 4], np.int32),
                       window_right=np.array([0, 2], np.int32))
    rng = np.random.default_rng(7)
    b = make_batch(rng, [70, 9], [70, 12], Hq=4, Hk=2, D=int(D),
                   Dv=None if Dv is None else int(Dv), dtype="float16", mask=mask,
                   gaps=True, garbage=np.nan)
    assert b.off_q[1] > b.off_q[0] + 70 or b.off_k[1] > b.off_k[0] + 70, "no padding gap"
    return b


def _positions(b, tensor):
    """Three (row, head, value) poisons at rows that test an edge each, in different heads so
    that their patterns stay apart."""
    q_side = tensor in ("q", "dout", "out", "lse")
    off = b.off_q if q_side else b.off_k
    if q_side:
        # a row of the first tile (keys after it in the same chunk are hidden from it), a row
        # past the tile edge, a row of the second sequence
        rows = (off[0] + 10, off[0] + 66, off[1] + 3)
        heads = (0, 2, 1)
    else:
        # a key hidden from the earlier queries of its chunk, the first key of the ragged last
        # chunk, a key of the second sequence
        rows = (off[0] + 20, off[0] + 64, off[1] + 5)
        heads = (0, 1, 1)
    return list(zip(map(int, rows), heads, (np.nan, np.inf, -np.inf)))


def _poisoned(arrays, tensor, positions):
    a = arrays[tensor].copy()
    for row, head, value in positions:
        if tensor == "lse":
            a[head, row] = value
        else:
            a[row, head, 0] = value
    return {**arrays, tensor: a}


def _emulated_plan(b):
    import varlen
    return varlen.plan(b.cu_q, b.cu_k, seq_offsets_q=b.off_q, seq_offsets_k=b.off_k,
                       mask=b.mask, num_rows_q=b.q.shape[0], num_rows_k=b.k.shape[0],
                       block_m=64, block_n=64)


def _case_nonfinite_forward(tensor, softcap, D=32, Dv=None):
    from test_nonfinite import _assert_same_pattern
    from varlen import reference
    from varlen.backends.cupy import BACKEND
    b = _nonfinite_batch(D, Dv)
    plan = _emulated_plan(b)
    scale, softcap = 1.0 / math.sqrt(b.q.shape[2]), float(softcap)
    args = _poisoned({"q": b.q, "k": b.k, "v": b.v}, tensor, _positions(b, tensor))
    out, lse = BACKEND.forward(plan, args["q"], args["k"], args["v"], softmax_scale=scale,
                               softcap=softcap)
    rout, rlse = reference.attention_dense(args["q"], args["k"], args["v"], b.cu_q, b.cu_k,
                                           softcap=softcap, **b.layout)
    label = f"forward (softcap={softcap}), {tensor} poisoned at {_positions(b, tensor)}"
    _assert_same_pattern(f"{label}: out", out, rout, values=False)
    _assert_same_pattern(f"{label}: lse", lse, rlse, values=False)
    assert np.array_equal(np.isneginf(lse), np.isneginf(rlse)), f"{label}: -inf lse rows"
    assert not np.isinf(np.asarray(out, np.float64)).any(), f"{label}: inf instead of NaN"
    _assert_finite_close(f"{label}: out", out, rout, 2e-2)
    _assert_finite_close(f"{label}: lse", lse, rlse, 2e-2)


def _case_nonfinite_backward(tensor, D=32, Dv=None):
    from test_nonfinite import _assert_same_pattern
    from varlen import reference
    from varlen.backends.cupy import BACKEND
    b = _nonfinite_batch(D, Dv)
    plan = _emulated_plan(b)
    scale = 1.0 / math.sqrt(b.q.shape[2])
    out, lse = BACKEND.forward(plan, b.q, b.k, b.v, softmax_scale=scale, softcap=0.0)
    clean = {"q": b.q, "k": b.k, "v": b.v, "dout": b.dout, "out": out, "lse": lse}
    a = _poisoned(clean, tensor, _positions(b, tensor))
    want = reference.attention_dense_backward(a["dout"], a["q"], a["k"], a["v"], b.cu_q, b.cu_k,
                                              out=a["out"], lse=a["lse"], **b.layout)
    for det in (False, True):
        grads = BACKEND.backward(plan, a["dout"], a["q"], a["k"], a["v"], a["out"], a["lse"],
                                 softmax_scale=scale, softcap=0.0, deterministic=det)
        for name, g, w in zip(("dq", "dk", "dv"), grads, want):
            label = (f"backward (deterministic={det}), {tensor} poisoned at "
                     f"{_positions(b, tensor)}: {name}")
            _assert_same_pattern(label, g, w, values=False)
            assert not np.isinf(np.asarray(g, np.float64)).any(), f"{label}: inf instead of NaN"
            if tensor in ("dout", "out", "lse"):      # out, lse consistent with q, k, v
                _assert_finite_close(label, g, w, 5e-2)


# --------------------------------------------------------------------------------------------
# 64-bit addressing
# --------------------------------------------------------------------------------------------

# Rows of q (Hq = 2, D = 64) and of k, v (Hk = 1): both past 2**31 elements.
LARGE_ROWS_Q = (1 << 24) + 256
LARGE_ROWS_K = (1 << 25) + 256
LARGE_LEN = 70                       # one causal sequence of 70 x 70, two tiles of 64
LARGE_PAD_ROWS = (1 << 21) + 256      # rows of 8 heads x 128: past 2**31 elements
MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)         # the Linux value


@needs_cxx
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sparse anonymous maps (Linux)")
def test_addresses_past_2_31_elements():
    assert LARGE_ROWS_Q * 2 * 64 > 2 ** 31 and LARGE_ROWS_K * 1 * 64 > 2 ** 31
    _emulate("large-offsets")


@needs_cxx
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sparse anonymous maps (Linux)")
def test_pad_rows_past_2_31_elements():
    _emulate("large-pad-offsets")


@needs_cxx
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sparse anonymous maps (Linux)")
def test_last_chunks_of_a_sequence_of_2_31_keys():
    _emulate("long-sequence")


def _sparse(shape, dtype):
    """A zero array of `shape` over anonymous memory that is reserved, not committed: untouched
    pages cost nothing."""
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    try:
        buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE)
    except OSError as e:
        print(f"cannot map {nbytes / 2 ** 30:.0f} GiB of address space here ({e})")
        sys.exit(SKIP_STATUS)
    return np.frombuffer(buf, dtype).reshape(shape)


def _case_large_offsets():
    import varlen
    from varlen import reference
    import varlen.backends.cupy.mma as _cupy_mma
    from varlen.backends.cupy.mma import spec_for
    Hq, Hk, D, L = 2, 1, 64, LARGE_LEN
    Tq, Tk = LARGE_ROWS_Q, LARGE_ROWS_K
    # the sequence ends 2 rows before the end of q and 1 before the end of k
    rq, rk = slice(Tq - L - 2, Tq - 2), slice(Tk - L - 1, Tk - 1)
    q, dout = _sparse((Tq, Hq, D), np.float16), _sparse((Tq, Hq, D), np.float16)
    k, v = _sparse((Tk, Hk, D), np.float16), _sparse((Tk, Hk, D), np.float16)
    rng = np.random.default_rng(3)
    for a, r in ((q, rq), (dout, rq), (k, rk), (v, rk)):
        a[r] = rng.standard_normal(a[r].shape).astype(np.float16)
    cu = np.array([0, L], np.int32)
    plan = varlen.plan(cu, cu, seq_offsets_q=np.array([rq.start, rq.stop], np.int32),
                       seq_offsets_k=np.array([rk.start, rk.stop], np.int32), mask="causal",
                       num_rows_q=Tq, num_rows_k=Tk, max_seqlen_q=L, max_seqlen_k=L,
                       block_m=64, block_n=64)
    assert plan.num_q_tiles == 2 and plan.num_k_tiles == 2, "the grid covers one sequence"
    scale = 1.0 / math.sqrt(D)
    f64 = [a[r].astype(np.float64) for a, r in ((q, rq), (k, rk), (v, rk), (dout, rq))]
    ref_out, ref_lse = reference.attention_dense(*f64[:3], cu, cu, mask="causal")
    ref_grads = reference.attention_dense_backward(f64[3], *f64[:3], cu, cu, mask="causal")

    # Every kernel launched on the sequence's tiles only: the forward's pad blocks (and the
    # preprocessing and the dQ conversion) write every other row of the arrays, which the
    # emulation cannot afford; _case_large_pad_offsets writes pad rows there.
    plan_arg = _cupy_launch.plan_view_arg(plan)
    call = _cupy_launch.call_params_arg(Hq, Hk, scale, 0.0)
    out = _sparse((Tq, Hq, D), np.float16)
    lse = np.full((Hq, Tq), np.nan, np.float32)
    _cupy_mma.module(spec_for(plan, q, kind="fwd", softcap=0.0)).launch(
        "fwd", grid=(plan.num_q_tiles, Hq),
        args=(_cupy_launch.fwd_params_arg(plan_arg, call, q=q, k=k, v=v, out=out, lse=lse),))
    _assert_finite_close("out rows past 2**31 elements", out[rq], ref_out, 2e-2)
    _assert_finite_close("lse", lse[:, rq], ref_lse, 2e-2)
    assert np.isfinite(out[rq]).all() and np.isfinite(lse[:, rq]).all(), "unwritten rows"
    for row in (0, Tq // 2, rq.start - 1, Tq - 1):      # pad rows, sampled
        assert np.isnan(lse[:, row]).all(), f"pad row {row} written by a tile block"

    spec = spec_for(plan, q, kind="bwd", softcap=0.0)
    module = _cupy_mma.module(spec)
    lse2, delta = np.zeros((Hq, Tq), np.float32), np.zeros((Hq, Tq), np.float32)
    lse2[:, rq] = lse[:, rq] * math.log2(math.e)
    delta[:, rq] = (out[rq].astype(np.float32) * dout[rq].astype(np.float32)).sum(-1).T
    dk, dv = np.zeros(k.shape, np.float16), np.zeros(v.shape, np.float16)
    dq_accum = np.zeros((Tq, Hq, D), np.float32)

    def params(dq_accum, dq_order):
        return _cupy_launch.bwd_params_arg(plan_arg, call, q=q, k=k, v=v, out=None, dout=dout,
                                           lse=None, lse2=lse2, delta=delta, dq_accum=dq_accum,
                                           dq_order=dq_order, dq=None, dk=dk, dv=dv)
    module.launch("dkdv_atomic", grid=(plan.num_k_tiles, Hk), args=(params(dq_accum, None),))
    # ordered dQ: the counters (zero) and the query tile slot of each row, as the
    # preprocessing writes them (kernels_cuda/bwd_dq_ordered.cuh)
    dq_order = _sparse((Hq + 1, Tq), np.int32)
    for slot, (_, _, row, rows, _) in enumerate(np.asarray(plan.q_tiles)):
        dq_order[Hq, row:row + rows] = slot
    dq_ordered = np.zeros((Tq, Hq, D), np.float32)
    module.launch("dkdv_ordered", grid=(plan.num_k_tiles, Hk),
                  args=(params(dq_ordered, dq_order),))
    for name, got, want in (("dq (atomic)", dq_accum[rq], ref_grads[0]),
                            ("dq (ordered)", dq_ordered[rq], ref_grads[0]),
                            ("dk", dk[rk], ref_grads[1]), ("dv", dv[rk], ref_grads[2])):
        assert np.isfinite(got).all(), f"{name}: unwritten rows"
        _assert_finite_close(f"{name} rows past 2**31 elements", got, want, 5e-2)
    for name, g, row in (("dq_accum", dq_accum, Tq - 1), ("dk", dk, Tk - 1), ("dv", dv, 0)):
        assert (g[row] == 0).all(), f"{name}: pad row {row} written"


def _case_large_pad_offsets():
    """The pad rows past 2**31 elements (8 heads of 128 over 2**21 + 256 rows), written by the
    forward kernel's pad blocks (out, lse) and by the backward preprocessing (dk, dv), every
    block of their grids launched. The plan is written by hand: its one tile slot is unused (no
    tile block runs) but claims every row except the last three, so those are the only pad
    rows; the row before them must stay as it was."""
    import varlen.backends.cupy.mma as _cupy_mma
    from emulation.cupy import install_fake_cupy
    from varlen.backends.cupy.mma import KernelSpec
    from varlen.plan import KernelView
    from varlen.testing import np_dtype
    install_fake_cupy(block_m=128)                # the default tiles' emulation build
    H, D, dt = 8, 128, np_dtype("bfloat16")
    T = LARGE_PAD_ROWS
    first_pad = T - 3
    assert first_pad * H * D > 2 ** 31

    def i32(*rows):
        return np.array(rows, np.int32)

    def hand_plan(rows_q, rows_k):
        tiles = i32([-1, 0, 0, first_pad, 0])
        view = KernelView(q_tiles=tiles, q_sched=np.zeros((1, 1, 4), np.int32), k_tiles=tiles,
                          k_sched=np.zeros((1, 1, 4), np.int32), q_row=i32([0]),
                          q_len=i32([0]), q_pos=i32([0]), k_row=i32([0]), k_len=i32([0]),
                          k_pos=i32([0]), seqlen_q=i32(0), seqlen_k=i32(0),
                          window_left=i32(-1), window_right=i32(-1), bottom_right=i32(0),
                          q_row_sched=np.zeros((1, 1, 5), np.int32),
                          k_row_sched=np.zeros((1, 1, 5), np.int32), batch=1, mq=1, mk=1,
                          num_q_tiles=1, num_k_tiles=1, block_m=128, block_n=64, rows_q=rows_q,
                          rows_k=rows_k)
        return _cupy_launch.plan_view_arg(type("HandPlan", (), {"view": lambda self: view})())
    call = _cupy_launch.call_params_arg(H, H, 1.0 / math.sqrt(D), 0.0)
    q = k = v = _sparse((T, H, D), dt)                              # never read
    out, dk, dv = (_sparse((T, H, D), dt) for _ in range(3))
    for a in (out, dk, dv):
        a[first_pad - 1:] = np.nan
    lse = np.full((H, T), np.nan, np.float32)
    fwd = _cupy_mma.module(KernelSpec("fwd", "bfloat16", D, 128, 64, False))
    fwd.launch("fwd", grid=_cupy_mma._tile_grid(fwd, "fwd", 1, T, H),
               args=(_cupy_launch.fwd_params_arg(hand_plan(T, 0), call, q=q, k=k, v=v, out=out,
                                                 lse=lse),))
    bwd = _cupy_mma.module(KernelSpec("bwd", "bfloat16", D, 128, 64, False))
    none = np.zeros((H, 1), np.float32)                             # no query rows
    blocks = -(-_cupy_mma._pad_windows(T) // bwd.kernels["preprocess"].threads)
    bwd.launch("preprocess", grid=(blocks,),
               args=(_cupy_launch.bwd_params_arg(
                   hand_plan(0, T), call, q=q, k=k, v=v, out=q, dout=q, lse=none, lse2=none,
                   delta=none, dq_accum=None, dq_order=None, dq=None, dk=dk, dv=dv),))
    for name, a in (("out", out), ("dk", dk), ("dv", dv)):
        a = a[first_pad - 1:].astype(np.float32)
        assert (a[1:] == 0).all(), f"{name}: pad rows past 2**31 elements not 0"
        assert np.isnan(a[0]).all(), f"{name}: the row before the pad rows written"
    assert (lse[:, first_pad:] == -np.inf).all(), "lse: pad rows not -inf"
    assert np.isnan(lse[:, :first_pad]).all(), "lse: rows of the (claimed) tile written"


def _case_long_sequence():
    """Queries 0..63 of a sequence of 64 queries and 2**31 - 1 keys, bottom-right causal with a
    window of 100 keys: the schedule lists its last three key chunks (the last one ragged),
    about 2**31 rows into k and v. The plan is written by hand (a real one would table 2**25
    key tiles) and the forward kernel launched on its one query tile."""
    import varlen
    from varlen import reference
    import varlen.backends.cupy.mma as _cupy_mma
    from varlen.backends.cupy.mma import KernelSpec
    from varlen.plan import KernelView, Segments, row_schedule
    Hq, Hk, D, Lq, left, bn = 2, 1, 32, 64, 100, 64
    Lk = 2 ** 31 - 1
    first = Lk - Lq - left                        # the first key query 0 sees
    k, v = _sparse((Lk, Hk, D), np.float16), _sparse((Lk, Hk, D), np.float16)
    rng = np.random.default_rng(5)
    q = rng.standard_normal((Lq, Hq, D)).astype(np.float16)
    for a in (k, v):
        a[first:] = rng.standard_normal(a[first:].shape).astype(np.float16)

    def i32(*rows):
        return np.array(rows, np.int32)
    tiles = (first // bn, -(-Lk // bn))           # [begin, end) key tiles, none fully visible
    q_tiles = i32([0, 0, 0, Lq, 0])
    q_sched = i32([tiles[0], tiles[0], tiles[0], tiles[1]]).reshape(1, 1, 4)
    # in rows: [first // bn * bn, Lk), the last chunk ending at row 2**31 - 1
    keys = Segments(i32([0]), i32([Lk]), i32([0]), i32(Lk), Lk)       # [B = 1, m = 1]
    q_row_sched = row_schedule(q_tiles, q_sched, keys, bn)
    assert q_row_sched[0, 0, 3] == Lk
    view = KernelView(q_tiles=q_tiles, q_sched=q_sched,
                      k_tiles=np.zeros((0, 5), np.int32), k_sched=np.zeros((0, 1, 4), np.int32),
                      q_row=i32([0]), q_len=i32([Lq]), q_pos=i32([0]),
                      k_row=i32([0]), k_len=i32([Lk]), k_pos=i32([0]),
                      seqlen_q=i32(Lq), seqlen_k=i32(Lk), window_left=i32(left),
                      window_right=i32(0), bottom_right=i32(1), q_row_sched=q_row_sched,
                      k_row_sched=np.zeros((0, 1, 5), np.int32), batch=1, mq=1, mk=1,
                      num_q_tiles=1, num_k_tiles=0, block_m=64, block_n=bn, rows_q=Lq, rows_k=Lk)
    plan = type("HandPlan", (), {"view": lambda self: view})()
    plan_arg = _cupy_launch.plan_view_arg(plan)
    scale = 1.0 / math.sqrt(D)
    out = np.zeros((Lq, Hq, D), np.float16)
    lse = np.full((Hq, Lq), -np.inf, np.float32)
    module = _cupy_mma.module(KernelSpec("fwd", "float16", D, 64, bn, False))
    call = _cupy_launch.call_params_arg(Hq, Hk, scale, 0.0)
    module.launch("fwd", grid=(1, Hq),
                  args=(_cupy_launch.fwd_params_arg(plan_arg, call, q=q, k=k, v=v, out=out,
                                                    lse=lse),))
    # the same attention on the keys [first, Lk): query i sees keys i .. i + left of them
    cu_q, cu_k = np.array([0, Lq], np.int32), np.array([0, Lk - first], np.int32)
    mask = varlen.Mask(window_left=left, window_right=0, bottom_right=True)
    ref_out, ref_lse = reference.attention_dense(q, k[first:], v[first:], cu_q, cu_k, mask=mask)
    assert np.isfinite(out).all() and np.isfinite(lse).all(), "rows left unwritten"
    _assert_finite_close("out of the last chunks of 2**31 - 1 keys", out, ref_out, 2e-2)
    _assert_finite_close("lse", lse, ref_lse, 2e-2)


# --------------------------------------------------------------------------------------------
# The emulated cases (python tests/emulation/test_cupy_edges.py CASE [ARG])
# --------------------------------------------------------------------------------------------

CASES = {"nonfinite-forward": _case_nonfinite_forward,
         "nonfinite-backward": _case_nonfinite_backward,
         "large-offsets": _case_large_offsets,
         "large-pad-offsets": _case_large_pad_offsets,
         "long-sequence": _case_long_sequence}


def _main(argv):
    from emulation.cupy import install_fake_cupy
    install_fake_cupy(block_m=64)
    CASES[argv[0]](*argv[1:])
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
