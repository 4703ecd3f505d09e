"""The CuPy tensor-core backend on a GPU: parity with the float64 reference, determinism,
graph capture. Skipped without a CUDA GPU (marker `gpu`).

Tolerances are STYLE.md's ratio tolerances (varlen.testing): the error against float64 may
be at most 2x (output) / 3x (gradients) the error of a naive same-dtype computation, plus a
rounding floor, with a relative-RMS and a max-abs check.
"""
from __future__ import annotations

import zlib

import numpy as np
import pytest

import varlen
from varlen import Mask

from helpers import check_against_reference, covered_rows, make_batch

pytestmark = pytest.mark.gpu

PER_SEQ = Mask(window_left=np.array([-1, 3, -1, 0, 5, -1, 40], np.int32),
               window_right=np.array([0, -1, -1, 0, 0, 2, -1], np.int32),
               bottom_right=np.array([0, 0, 1, 1, 0, 1, 1], np.int32))
MIXED = Mask.causal_where(np.array([True, False, True, False], bool))

# (id, lengths_q, lengths_k, Hq, Hk, mask, gaps, softcap)
CASES = [
    ("B7-zero-first-mid-last-causal", [0, 5, 1, 0, 63, 130, 0], None, 4, 4, "causal", False,
     0.0),
    ("B7-gqa4-perseq-gaps", [0, 9, 1, 200, 0, 97, 2], [4, 9, 3, 129, 1, 0, 300], 8, 2,
     PER_SEQ, True, 0.0),
    ("B3-mqa-causal_br-cross", [1, 97, 113], [30, 3, 1025], 4, 1, "causal_bottom_right", True,
     0.0),
    ("B2-softcap-full", [40, 257], [270, 1], 2, 2, "full", False, 5.0),
    ("B4-sliding-window", [64, 65, 1023, 1], None, 2, 1, Mask(window_left=100, window_right=0),
     True, 0.0),
    ("B4-mixed-causal-bidirectional", [128, 63, 500, 17], None, 4, 2, MIXED, False, 0.0),
    # Two visible keys per query: with one, P = 1 and the exact dQ is 0, so the relative
    # tolerance would leave no room for the rounding of dP - delta.
    ("B1-band-of-2", [300], None, 2, 2, Mask(window_left=1, window_right=0), False, 0.0),
    ("B2-long-full", [1025, 2048], None, 2, 2, "full", False, 0.0),
]
IDS = [c[0] for c in CASES]


def _device(a):
    """A NumPy array on the device; bfloat16 travels as its bit pattern."""
    import cupy as cp
    if a.dtype.kind == "V" or a.dtype.name == "bfloat16":
        return cp.asarray(a.view(np.uint16)).view(a.dtype)
    return cp.asarray(a)


def _host(a):
    import cupy as cp
    if a.dtype.name == "bfloat16":
        return cp.asnumpy(a.view(cp.uint16)).view(a.dtype)
    return cp.asnumpy(a)


def _run(b, *, softcap=0.0, deterministic=False, plan=None, backend="cupy"):
    dev = {n: _device(getattr(b, n)) for n in ("q", "k", "v", "dout")}
    cu = dict(cu_seqlens_q=_device(b.cu_q), cu_seqlens_k=_device(b.cu_k))
    lay = dict(seq_offsets_q=None if b.off_q is None else _device(b.off_q),
               seq_offsets_k=None if b.off_k is None else _device(b.off_k),
               mask=_device_mask(b.mask))
    out, lse = varlen.attention_forward(dev["q"], dev["k"], dev["v"], **cu, **lay,
                                        softcap=softcap, backend=backend, plan=plan)
    grads = varlen.attention_backward(dev["dout"], dev["q"], dev["k"], dev["v"], out, lse, **cu,
                                      **lay, softcap=softcap, backend=backend, plan=plan,
                                      deterministic=deterministic)
    return out, lse, grads


def _device_mask(mask):
    if isinstance(mask, Mask) and not mask.is_uniform():
        return Mask(*(f if np.ndim(f) == 0 else _device(np.asarray(f, np.int32))
                      for f in mask.fields()))
    return mask


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_matches_reference(case, D, dtype):
    name, lq, lk, Hq, Hk, mask, gaps, softcap = case
    rng = np.random.default_rng(zlib.crc32(f"{name}{D}{dtype}".encode()))
    b = make_batch(rng, lq, lk, Hq=Hq, Hk=Hk, D=D, dtype=dtype, mask=mask, gaps=gaps)
    out, lse, grads = _run(b, softcap=softcap)
    out, lse, grads = _host(out), _host(lse), [_host(g) for g in grads]
    assert out.dtype == b.q.dtype and lse.dtype == np.float32
    check_against_reference(b, out, lse, grads, softcap=softcap, label=f"{name}/D{D}/{dtype}")
    pad_q, pad_k = ~covered_rows(b, "q"), ~covered_rows(b, "k")
    assert (out.astype(np.float64)[pad_q] == 0).all(), "pad query rows: output not zero"
    assert np.isneginf(lse[:, pad_q]).all(), "pad query rows: lse not -inf"
    assert (grads[0].astype(np.float64)[pad_q] == 0).all(), "pad query rows: dq not zero"
    assert (grads[1].astype(np.float64)[pad_k] == 0).all(), "pad key rows: dk not zero"
    assert (grads[2].astype(np.float64)[pad_k] == 0).all(), "pad key rows: dv not zero"


@pytest.mark.parametrize("D, dtype", [(32, "bfloat16"), (96, "float16")], ids=["D32", "D96"])
def test_other_head_dims(D, dtype):
    rng = np.random.default_rng(D)
    b = make_batch(rng, [0, 130, 7, 64], [5, 100, 7, 200], Hq=4, Hk=2, D=D, dtype=dtype,
                   mask=PER_SEQ_4, gaps=True)
    for det in (False, True):
        out, lse, grads = _run(b, softcap=2.0, deterministic=det)
        check_against_reference(b, _host(out), _host(lse), [_host(g) for g in grads],
                                softcap=2.0, label=f"D{D}/{dtype} deterministic={det}")


PER_SEQ_4 = Mask(window_left=np.array([-1, 11, -1, -1], np.int32),
                 window_right=np.array([0, 0, -1, 3], np.int32),
                 bottom_right=np.array([0, 1, 1, 0], np.int32))


@pytest.mark.parametrize("block", [(64, 64), (128, 64)], ids=["BM64", "BM128"])
def test_both_tile_sizes(block):
    """Plans with either supported tile size give reference results (incl. the bwd query
    chunks that split a 128-row plan tile)."""
    import cupy as cp
    rng = np.random.default_rng(11)
    b = make_batch(rng, [1, 200, 129, 0, 64], [77, 190, 300, 5, 64], Hq=4, Hk=2, D=128,
                   dtype="bfloat16", mask=PER_SEQ_5, gaps=True)
    plan = varlen.plan(cp.asarray(b.cu_q), cp.asarray(b.cu_k), seq_offsets_q=cp.asarray(b.off_q),
                       seq_offsets_k=cp.asarray(b.off_k), mask=_device_mask(b.mask),
                       num_rows_q=b.q.shape[0], num_rows_k=b.k.shape[0], block_m=block[0],
                       block_n=block[1])
    for det in (False, True):
        out, lse, grads = _run(b, plan=plan, deterministic=det)
        check_against_reference(b, _host(out), _host(lse), [_host(g) for g in grads],
                                label=f"blocks {block} deterministic={det}")


PER_SEQ_5 = Mask(window_left=np.array([-1, 7, -1, -1, 0], np.int32),
                 window_right=np.array([0, -1, 0, -1, 0], np.int32),
                 bottom_right=np.array([1, 0, 0, 1, 0], np.int32))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_deterministic_backward_is_bitwise_repeatable(dtype):
    rng = np.random.default_rng(3)
    b = make_batch(rng, [300, 0, 513, 77], None, Hq=8, Hk=2, D=64, dtype=dtype,
                   mask="causal", gaps=True)
    runs = [[_host(g).view(np.uint16) for g in _run(b, deterministic=True)[2]] for _ in range(3)]
    for r in runs[1:]:
        for name, a, c in zip(("dq", "dk", "dv"), runs[0], r):
            assert np.array_equal(a, c), f"{name} differs between deterministic runs"
    # dK/dV have one writer per row even with atomic dQ; the two dQ paths agree closely.
    fast = [_host(g) for g in _run(b, deterministic=False)[2]]
    for name, a, c in zip(("dk", "dv"), runs[0][1:], fast[1:]):
        a64 = a.view(b.q.dtype).astype(np.float64)
        assert np.abs(a64 - c.astype(np.float64)).max() <= 2 ** -8 * np.abs(a64).max(), (
            f"{name} differs between the atomic-dQ and deterministic dK/dV kernels")
    dq_det = runs[0][0].view(b.q.dtype).astype(np.float64)
    dq_fast = fast[0].astype(np.float64)
    scale = np.abs(dq_det).max()
    assert np.abs(dq_det - dq_fast).max() <= 2 ** -6 * scale, "atomic and deterministic dQ"


def test_rejects_what_it_cannot_run():
    import cupy as cp
    q = cp.zeros((4, 2, 64), cp.float32)
    cu = cp.asarray([0, 4], cp.int32)
    with pytest.raises(ValueError, match="cupy"):
        varlen.attention_forward(q, q, q, cu, cu, backend="cupy")
    h = cp.zeros((4, 2, 80), cp.float16)
    with pytest.raises(ValueError, match="head_dim"):
        varlen.attention_forward(h, h, h, cu, cu, backend="cupy")
    q16 = cp.zeros((4, 2, 64), cp.float16)
    plan = varlen.plan(cu, cu, num_rows_q=4, num_rows_k=4, block_m=32, block_n=32)
    with pytest.raises(ValueError, match="tiles"):
        varlen.attention_forward(q16, q16, q16, cu, cu, backend="cupy", plan=plan)


# Same B and packed totals (same buffer shapes), different lengths and masks.
GRAPH_BATCHES = (([100, 0, 37, 200, 1], [120, 3, 37, 180, 1]),
                 ([1, 150, 137, 0, 50], [64, 64, 64, 100, 49]))
GRAPH_MASKS = ((np.array([-1, -1, 16, -1, 0], np.int32), np.array([0, -1, 0, 0, -1], np.int32),
                np.array([1, 0, 0, 1, 1], np.int32)),
               (np.array([8, -1, -1, 32, -1], np.int32), np.array([0, 0, -1, 0, 0], np.int32),
                np.array([0, 1, 1, 0, 0], np.int32)))


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic-dq", "deterministic"])
def test_graph_capture_replays_with_new_cu_seqlens(deterministic):
    """Plan building, forward and backward captured once; each replay reads the captured
    buffers' current contents (new lengths, masks and data) and gives that batch's result."""
    import cupy as cp
    rng = np.random.default_rng(5)
    batches = [make_batch(rng, lq, lk, Hq=4, Hk=2, D=128, dtype="bfloat16", mask=Mask(*m))
               for (lq, lk), m in zip(GRAPH_BATCHES, GRAPH_MASKS)]
    first = batches[0]
    names = ("q", "k", "v", "dout", "cu_q", "cu_k")
    buf = {n: _device(getattr(first, n)) for n in names}
    mbuf = [cp.asarray(f) for f in GRAPH_MASKS[0]]
    s = cp.cuda.Stream(non_blocking=True)
    kw = dict(softmax_scale=0.125, backend="cupy")

    def step():
        mask = Mask(*mbuf)
        out, lse = varlen.attention_forward(buf["q"], buf["k"], buf["v"], buf["cu_q"],
                                            buf["cu_k"], mask=mask, **kw)
        grads = varlen.attention_backward(buf["dout"], buf["q"], buf["k"], buf["v"], out, lse,
                                          buf["cu_q"], buf["cu_k"], mask=mask,
                                          deterministic=deterministic, **kw)
        return out, lse, grads

    with s:
        step()                       # compile and load every kernel outside the capture
    s.synchronize()
    with s:
        s.begin_capture()
        out, lse, grads = step()
        graph = s.end_capture()
    for batch, m in zip(batches, GRAPH_MASKS):
        with s:
            for n in names:
                src = getattr(batch, n)
                if src.dtype.itemsize == 2:      # copy float16/bfloat16 as bit patterns
                    buf[n].view(cp.uint16)[...] = cp.asarray(src.view(np.uint16))
                else:
                    buf[n][...] = cp.asarray(src)
            for dst, src in zip(mbuf, m):
                dst[...] = cp.asarray(src)
            graph.launch(stream=s)
        s.synchronize()
        check_against_reference(batch, _host(out), _host(lse), [_host(g) for g in grads],
                                softmax_scale=0.125, label="graph replay")


def test_runs_on_the_callers_stream():
    """Results are ordered on the current stream: a non-default stream needs no extra sync."""
    import cupy as cp
    rng = np.random.default_rng(9)
    b = make_batch(rng, [90, 33], None, Hq=2, Hk=2, D=64, dtype="float16", mask="causal")
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        out, lse, grads = _run(b)
        host = _host(out), _host(lse), [_host(g) for g in grads]
    check_against_reference(b, *host[:2], host[2], label="side stream")
