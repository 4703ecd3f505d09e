"""The NumPy backend (tiled, plan-walking) against the dense float64 reference."""
import tracemalloc
import zlib

import numpy as np
import pytest

import varlen

from helpers import check_against_reference, covered_rows, fwd_bwd, make_batch

PER_SEQ = varlen.Mask(window_left=np.array([-1, 3, -1, 0, 5, -1, 2], np.int32),
                      window_right=np.array([0, -1, -1, 0, 0, 2, -1], np.int32),
                      bottom_right=np.array([0, 0, 1, 1, 0, 1, 1], np.int32))

# (id, lengths_q, lengths_k, Hq, Hk, D, Dv, mask, gaps, softcap)
CASES = [
    ("B7-zero-first-mid-last-causal", [0, 5, 1, 0, 63, 17, 0], None, 4, 4, 16, 16,
     "causal", False, 0.0),
    ("B7-gqa4-perseq-gaps", [0, 9, 1, 70, 0, 33, 2], [4, 9, 3, 65, 1, 0, 2], 8, 2, 16, 8,
     PER_SEQ, True, 0.0),
    ("B3-T113-mqa-causal_br-cross", [1, 97, 15], [30, 3, 113], 4, 1, 8, 8,
     "causal_bottom_right", True, 0.0),
    ("B2-softcap-full", [40, 65], [70, 1], 2, 2, 16, 16, "full", False, 5.0),
    ("B4-sliding-window", [64, 65, 127, 1], None, 2, 1, 8, 8,
     varlen.Mask(window_left=16, window_right=0), True, 0.0),
    ("B1-diagonal-only", [67], None, 2, 2, 8, 8, varlen.Mask(window_left=0, window_right=0),
     False, 0.0),
]
IDS = [c[0] for c in CASES]


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("dtype", ["float64", "float32", "float16", "bfloat16"])
def test_forward_backward_match_reference(case, dtype):
    _, lq, lk, Hq, Hk, D, Dv, mask, gaps, softcap = case
    rng = np.random.default_rng(zlib.crc32(case[0].encode()))
    b = make_batch(rng, lq, lk, Hq=Hq, Hk=Hk, D=D, Dv=Dv, dtype=dtype, mask=mask, gaps=gaps)
    out, lse, grads = fwd_bwd(b, softcap=softcap)
    assert out.dtype == b.q.dtype and all(g.dtype == b.q.dtype for g in grads)
    assert lse.dtype == (np.float64 if dtype == "float64" else np.float32)
    check_against_reference(b, out, lse, grads, softcap=softcap, label=f"{case[0]}/{dtype}")
    # padding rows: output and gradients exactly zero, lse -inf
    pad_q, pad_k = ~covered_rows(b, "q"), ~covered_rows(b, "k")
    assert (np.asarray(out, np.float64)[pad_q] == 0).all()
    assert np.isneginf(lse[:, pad_q]).all()
    assert (np.asarray(grads[0], np.float64)[pad_q] == 0).all()
    assert (np.asarray(grads[1], np.float64)[pad_k] == 0).all()
    assert (np.asarray(grads[2], np.float64)[pad_k] == 0).all()


@pytest.mark.parametrize("block", [(1, 1), (3, 5), (16, 8), (128, 128)])
def test_result_independent_of_tiles(block):
    rng = np.random.default_rng(7)
    b = make_batch(rng, [13, 0, 40, 7], [9, 2, 41, 7], Hq=2, Hk=1, D=8, mask=PER_SEQ_4,
                   gaps=True)
    plan = varlen.plan(b.cu_q, b.cu_k, seq_offsets_q=b.off_q, seq_offsets_k=b.off_k,
                       mask=b.mask, num_rows_q=b.q.shape[0], num_rows_k=b.k.shape[0],
                       block_m=block[0], block_n=block[1])
    out, lse, grads = fwd_bwd(b, plan=plan)
    check_against_reference(b, out, lse, grads, label=f"tiles {block}")


PER_SEQ_4 = varlen.Mask(window_left=np.array([2, -1, 5, -1], np.int32),
                        window_right=np.array([0, -1, 1, 0], np.int32),
                        bottom_right=np.array([1, 0, 0, 1], np.int32))


def test_seed_003_mixed_policies_in_one_call():
    """`111aaa222bb3344cccc`: numbered sequences causal, lettered bidirectional, one call,
    equal to two single-policy calls that treat the other sequences as padding."""
    rng = np.random.default_rng(3)
    lengths = [3, 3, 3, 2, 2, 2, 4]
    causal = np.array([1, 0, 1, 0, 1, 1, 0], bool)
    b = make_batch(rng, lengths, Hq=2, Hk=2, D=8, mask=varlen.Mask.causal_where(causal))
    out, lse, grads = fwd_bwd(b)
    check_against_reference(b, out, lse, grads, label="seed 003")
    # the emulation suggested in the report: causal pass + full pass over padded layouts
    cu = b.cu_q
    starts = cu[:-1]
    total = np.zeros_like(out)
    for flag, name in ((True, "causal"), (False, "full")):
        sel = np.flatnonzero(causal == flag)
        sub_cu = np.concatenate([[0], np.cumsum(np.diff(cu)[sel])]).astype(np.int32)
        off = np.concatenate([starts[sel], [cu[-1]]]).astype(np.int32)
        o, _ = varlen.attention_forward(b.q, b.k, b.v, sub_cu, sub_cu, seq_offsets_q=off,
                                        seq_offsets_k=off, mask=name)
        total += o
    np.testing.assert_allclose(out, total, rtol=0, atol=1e-14)


def test_inputs_never_modified():
    rng = np.random.default_rng(0)
    b = make_batch(rng, [5, 0, 9], Hq=4, Hk=2, D=8, mask="causal", gaps=True)
    before = [x.copy() for x in (b.q, b.k, b.v, b.dout, b.cu_q, b.off_q)]
    fwd_bwd(b)
    for x, y in zip(before, (b.q, b.k, b.v, b.dout, b.cu_q, b.off_q)):
        assert np.array_equal(x, y)


def test_empty_batches():
    q = np.zeros((0, 2, 8))
    cu = np.zeros(1, np.int32)
    out, lse = varlen.attention_forward(q, q, q, cu, cu)
    assert out.shape == (0, 2, 8) and lse.shape == (2, 0)
    cu = np.zeros(4, np.int32)                          # three empty sequences, 5 pad rows
    q = np.ones((5, 2, 8))
    out, lse, grads = fwd_bwd(make_batch(np.random.default_rng(0), [0, 0, 0], Hq=2, Hk=2, D=8))
    assert out.shape == (0, 2, 8)
    out, lse = varlen.attention_forward(q, q, q, cu, cu)
    assert (out == 0).all() and np.isneginf(lse).all()


def test_long_sequence_memory_is_bounded():
    """One 32k-token causal sequence: peak memory stays at a tile x Lk block, never Lq x Lk."""
    T, H, D = 32768, 1, 8
    rng = np.random.default_rng(0)
    q = rng.standard_normal((T, H, D)).astype(np.float32)
    cu = np.array([0, T], np.int32)
    tracemalloc.start()
    try:
        out, lse = varlen.attention_forward(q, q, q, cu, cu, mask="causal")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    dense_bytes = T * T * 8
    assert peak < dense_bytes / 50, f"peak {peak / 2**20:.0f} MiB for a {T}-token sequence"
    assert np.isfinite(out).all() and np.isfinite(lse).all()
    # spot-check a few rows against a direct computation
    for i in (0, 1, 1000, T - 1):
        s = (q[: i + 1, 0].astype(np.float64) @ q[i, 0].astype(np.float64)) / np.sqrt(D)
        w = np.exp(s - s.max())
        want = (w[:, None] * q[: i + 1, 0]).sum(0) / w.sum()
        np.testing.assert_allclose(out[i, 0], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("garbage", [np.nan, np.inf])
def test_padding_rows_are_never_read(garbage):
    """Pad rows may hold anything, NaN and inf included; no output or gradient sees them."""
    rng = np.random.default_rng(5)
    b = make_batch(rng, [6, 0, 11, 1], [3, 2, 11, 4], Hq=4, Hk=2, D=8, mask=PER_SEQ_4,
                   gaps=True, garbage=garbage)
    out, lse, grads = fwd_bwd(b)
    check_against_reference(b, out, lse, grads, label=f"garbage={garbage}")


@pytest.mark.parametrize("name", ["numpy", "cpu"])
def test_host_backends_answer_alike(name):
    """Both host backends (one base class) decline device arrays and device plans, naming
    themselves, and accept every float dtype on the host."""
    from types import SimpleNamespace
    from varlen import backends
    from varlen.backends.base import Problem
    if name == "cpu":
        pytest.importorskip("numba")
    be = backends.get(name)
    on_device = Problem(dtype="float32", head_dim=64, head_dim_v=64, on_device=True)
    assert be.supports(on_device) == (f"the {name} backend runs on the host; the arrays live "
                                      "on a CUDA device")
    for dtype in ("float16", "bfloat16", "float32", "float64"):
        assert be.supports(Problem(dtype, 64, 64, False)) is None, dtype
    assert "int8" in be.supports(Problem("int8", 64, 64, False))
    cu = np.array([0, 5, 9], np.int32)
    assert be.check_plan(varlen.plan(cu, cu)) is None
    assert "device" in be.check_plan(SimpleNamespace(on_host=False))
