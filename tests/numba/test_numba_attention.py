"""Numba attention kernels against the float64 reference, forward and gradients.

Each simulated case packs many adversarial features into one tiny batch (the simulator costs
about a millisecond per CUDA thread per launch): zero-length sequences first, in the middle and
last, length 1, lengths that are not tile multiples, padding gaps filled with garbage, GQA and
MQA, Lq != Lk, per-sequence masks mixing windows and alignments, softcap, and every dtype.
On a GPU the same tests run, plus `gpu`-marked ones at real sizes on CuPy arrays.
"""
import zlib

import numpy as np
import pytest

from numba import cuda   # a module global: the simulator swaps it inside kernels

import varlen
from varlen import Mask
from varlen.backends import Problem
from varlen.backends import _numba_kernels as K
from varlen.backends.numba_backend import BACKEND as NUMBA

from numba_testing import SIM, two_segments
from helpers import check_against_reference, covered_rows, make_batch


def _mixed_mask(B):
    """Per-sequence: causal, full, sliding(3) causal bottom-right, right-window 2, ..."""
    left = np.array([-1, -1, 3, 2, -1, 0][:B] + [-1] * max(0, B - 6), np.int32)
    right = np.array([0, -1, 0, 2, 0, -1][:B] + [0] * max(0, B - 6), np.int32)
    br = np.array([False, False, True, False, True, True][:B] + [False] * max(0, B - 6))
    return Mask(window_left=left, window_right=right, bottom_right=br)


CASES = {
    # id: (lengths_q, lengths_k, kwargs for make_batch, call kwargs)
    "B5-fp32-Hq4Hk2-D8-causal_br-gaps": (
        [0, 5, 19, 1, 0], [3, 17, 19, 2, 4],
        dict(Hq=4, Hk=2, D=8, dtype="float32", mask="causal_bottom_right", gaps=True), {}),
    "B6-fp16-Hq2Hk1-D16Dv8-mixed-softcap": (
        [7, 0, 18, 11, 1, 9], [9, 0, 21, 11, 3, 1],
        dict(Hq=2, Hk=1, D=16, Dv=8, dtype="float16", mask=_mixed_mask(6), scale=2.0),
        dict(softcap=3.0)),
    "B4-bf16-Hq2Hk2-D8-sliding-gaps-deterministic": (
        [17, 0, 1, 13], [17, 5, 1, 20],
        dict(Hq=2, Hk=2, D=8, dtype="bfloat16", mask=Mask(window_left=4, window_right=1),
             gaps=True), dict(deterministic=True)),
    # Lq > Lk bottom-right: the first Lq - Lk queries see no key (lse -inf, zero grads); a
    # sequence with queries and no keys; 40 rows = several tiles, so fully visible tiles too.
    "B3-fp32-Hq3Hk3-D8Dv16-causal_br-Lq>Lk": (
        [12, 40, 3], [4, 45, 0],
        dict(Hq=3, Hk=3, D=8, Dv=16, dtype="float32", mask="causal_bottom_right"), {}),
}


def fwd_bwd(batch, *, softcap=0.0, deterministic=False):
    kw = dict(**batch.layout, backend="numba", softcap=softcap)
    out, lse = varlen.attention_forward(batch.q, batch.k, batch.v, batch.cu_q, batch.cu_k, **kw)
    grads = varlen.attention_backward(batch.dout, batch.q, batch.k, batch.v, out, lse,
                                      batch.cu_q, batch.cu_k, **kw, deterministic=deterministic)
    return out, lse, grads


@pytest.mark.parametrize("case", list(CASES))
def test_parity_with_reference(case):
    lq, lk, bkw, ckw = CASES[case]
    rng = np.random.default_rng(zlib.crc32(case.encode()))
    batch = make_batch(rng, lq, lk, **bkw)
    softcap = ckw.get("softcap", 0.0)
    out, lse, grads = fwd_bwd(batch, softcap=softcap,
                              deterministic=ckw.get("deterministic", False))
    assert out.dtype == batch.q.dtype and lse.dtype == np.float32
    check_against_reference(batch, out, lse, grads, softcap=softcap, label=case)
    pad_q = ~covered_rows(batch, "q")
    pad_k = ~covered_rows(batch, "k")
    assert np.all(np.asarray(out, np.float64)[pad_q] == 0), "pad rows of out are not zero"
    assert np.all(np.isneginf(lse[:, pad_q])), "pad rows of lse are not -inf"
    for name, g, pad in zip(("dq", "dk", "dv"), grads, (pad_q, pad_k, pad_k)):
        assert np.all(np.asarray(g, np.float64)[pad] == 0), f"pad rows of {name} are not zero"


def test_explicit_plan_unequal_tiles_deterministic_is_bitwise_repeatable():
    """block_m != block_n through a reused plan; deterministic dQ gives identical bits twice
    and agrees with the atomic path to rounding."""
    rng = np.random.default_rng(7)
    batch = make_batch(rng, [1, 14, 0, 9], [6, 14, 3, 0], Hq=3, Hk=1, D=8, dtype="float32",
                       mask=Mask(window_left=np.array([-1, 5, 0, -1], np.int32),
                                 window_right=np.array([0, -1, 0, 1], np.int32),
                                 bottom_right=np.array([1, 0, 0, 1], np.int32)))
    plan = varlen.plan(batch.cu_q, batch.cu_k, mask=batch.mask, block_m=8, block_n=4)
    kw = dict(**batch.layout, backend="numba", plan=plan)
    out, lse = varlen.attention_forward(batch.q, batch.k, batch.v, batch.cu_q, batch.cu_k, **kw)
    args = (batch.dout, batch.q, batch.k, batch.v, out, lse, batch.cu_q, batch.cu_k)
    g1 = varlen.attention_backward(*args, **kw, deterministic=True)
    g2 = varlen.attention_backward(*args, **kw, deterministic=True)
    check_against_reference(batch, out, lse, g1, label="explicit plan")
    for name, a, b in zip(("dq", "dk", "dv"), g1, g2):
        assert a.tobytes() == b.tobytes(), f"deterministic {name} differs between two runs"
    g3 = varlen.attention_backward(*args, **kw, deterministic=False)
    for name, a, b in zip(("dq", "dk", "dv"), g1, g3):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=name)


def test_two_segments_per_sequence_match_numpy_backend():
    """The context-parallel shard layout (two segments per sequence at global positions, pad
    rows inside the chunks): the kernels walk the same plan as the NumPy backend."""
    from varlen.backends.numpy_backend import BACKEND as NUMPY
    from varlen.plan import build_plan
    rng = np.random.default_rng(21)
    L = np.array([13, 0, 7, 22], np.int32)
    q, k = two_segments(rng, L), two_segments(rng, L)
    mask = Mask(window_left=np.array([-1, 3, 4, -1], np.int32),
                window_right=np.array([0, 0, -1, 0], np.int32), bottom_right=False)
    plan = build_plan(q, k, mask, block_m=8, block_n=4)
    Hq, Hk, D = 2, 1, 8

    def data(T, H):
        return rng.standard_normal((T, H, D)).astype(np.float32)
    qa, ka, va, do = data(q.num_rows, Hq), data(k.num_rows, Hk), data(k.num_rows, Hk), \
        data(q.num_rows, Hq)
    kw = dict(softmax_scale=0.35, softcap=0.0)
    out, lse = NUMBA.forward(plan, qa, ka, va, **kw)
    grads = NUMBA.backward(plan, do, qa, ka, va, out, lse, **kw)
    f64 = [a.astype(np.float64) for a in (qa, ka, va, do)]
    out_r, lse_r = NUMPY.forward(plan, *f64[:3], **kw)
    grads_r = NUMPY.backward(plan, f64[3], *f64[:3], out_r, lse_r, **kw)
    assert np.array_equal(np.isneginf(lse), np.isneginf(lse_r)), "lse -inf pattern"
    fin = np.isfinite(lse_r)
    np.testing.assert_allclose(lse[fin], lse_r[fin], rtol=1e-5, atol=1e-5, err_msg="lse")
    for name, g, r in zip(("out", "dq", "dk", "dv"), (out, *grads), (out_r, *grads_r)):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-4 * np.abs(r).max(), err_msg=name)


def test_bf16_bit_conversions_match_ml_dtypes():
    """Every bf16 bit pattern widens exactly; float32 rounds to nearest-even (ties included)."""
    import ml_dtypes

    @cuda.jit
    def convert(bits, widened, f, rounded):
        start, step = cuda.grid(1), cuda.gridsize(1)
        for i in range(start, bits.shape[0], step):
            widened[i] = K.bf16_to_f32(bits[i])
        for i in range(start, f.shape[0], step):
            rounded[i] = K.f32_to_bf16(f[i])

    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    if SIM:
        bits = np.ascontiguousarray(bits[::16])
    rng = np.random.default_rng(0)
    u = rng.integers(0, 1 << 32, size=2048, dtype=np.uint64).astype(np.uint32)
    u[: 512] = (u[: 512] & np.uint32(0xFFFF0000)) | np.uint32(0x8000)          # exact ties
    f = np.concatenate([u.view(np.float32),
                        np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 3.4e38, 1e-45],
                                 np.float32)])
    widened = np.zeros(bits.shape, np.float32)
    rounded = np.zeros(f.shape, np.uint16)
    convert[2, 32](bits, widened, f, rounded)
    want = bits.view(ml_dtypes.bfloat16).astype(np.float32)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(widened), nan)
    assert np.array_equal(widened[~nan].view(np.uint32), want[~nan].view(np.uint32))
    with np.errstate(invalid="ignore"):
        want_r = f.astype(ml_dtypes.bfloat16)
    nan_r = np.isnan(f)
    assert np.isnan(rounded.view(ml_dtypes.bfloat16)[nan_r].astype(np.float32)).all()
    bad = np.flatnonzero(rounded[~nan_r] != want_r[~nan_r].view(np.uint16))
    assert bad.size == 0, f"rounding differs for {f[~nan_r][bad[:4]]}"


def test_default_blocks_fit_every_head_dim():
    for dtype in K.DTYPES:
        for D in (8, 16, 32, 64, 80, 96, 128, 192, 256):
            bm, bn = NUMBA.default_blocks(dtype, D)
            assert K.fits(dtype, D, D, bm, bn) is None, (dtype, D, bm, bn)


def test_errors_name_the_problem():
    rng = np.random.default_rng(2)
    batch = make_batch(rng, [3, 4], D=128, Hq=1, Hk=1, dtype="float16")
    plan = varlen.plan(batch.cu_q, batch.cu_k, block_m=64, block_n=64)
    with pytest.raises(ValueError, match="shared memory"):
        varlen.attention_forward(batch.q, batch.k, batch.v, batch.cu_q, batch.cu_k,
                                 backend="numba", plan=plan)
    if SIM:
        small = make_batch(rng, [3, 4], D=8, Hq=1, Hk=1, dtype="float32")
        host_plan = varlen.plan(small.cu_q, small.cu_k, block_m=8, block_n=8)
        dev = [cuda.to_device(a) for a in (small.q, small.k, small.v)]
        with pytest.raises(ValueError, match="plan"):
            NUMBA.forward(host_plan, *dev, softmax_scale=1.0, softcap=0.0)


def test_supports_reports_reasons():
    assert "float64" in NUMBA.supports(Problem("float64", 8, 8, on_device=False))
    assert "512" in NUMBA.supports(Problem("float16", 512, 8, on_device=False))
    if SIM:
        assert NUMBA.supports(Problem("float16", 64, 64, on_device=False)) is None
        assert "simulator" in NUMBA.supports(Problem("float16", 64, 64, on_device=True))


# --------------------------------------------------------------------------------------------
# GPU: real sizes on CuPy arrays, streams
# --------------------------------------------------------------------------------------------

GPU_CASES = {
    "B7-T2239-Hq8-Hk2-D64-fp16-mixed": (
        [1, 63, 0, 97, 113, 1023, 0], [1, 70, 5, 97, 113, 1025, 0],
        dict(Hq=8, Hk=2, D=64, dtype="float16", mask=_mixed_mask(7), gaps=True), {}),
    "B4-T2101-Hq4-Hk4-D128-bf16-causal-softcap": (
        [1025, 0, 63, 1013], [1025, 0, 63, 1013],
        dict(Hq=4, Hk=4, D=128, dtype="bfloat16", mask="causal"), dict(softcap=20.0)),
    "B3-T1200-Hq4-Hk1-D32Dv64-fp32-sliding-deterministic": (
        [600, 1, 599], [300, 1, 899],
        dict(Hq=4, Hk=1, D=32, Dv=64, dtype="float32",
             mask=Mask(window_left=128, window_right=0, bottom_right=True)),
        dict(deterministic=True)),
}


def _to_cupy(batch):
    import cupy as cp
    conv = (lambda a: cp.asarray(a.view(np.uint16)).view(a.dtype)) if batch.dtype == "bfloat16" \
        else cp.asarray
    return {n: conv(getattr(batch, n)) for n in ("q", "k", "v", "dout")}


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(GPU_CASES))
def test_gpu_parity_cupy(case):
    import cupy as cp
    lq, lk, bkw, ckw = GPU_CASES[case]
    rng = np.random.default_rng(1)
    batch = make_batch(rng, lq, lk, **bkw)
    d = _to_cupy(batch)
    lay = {k: (None if v is None else cp.asarray(v)) if k.startswith("seq") else v
           for k, v in batch.layout.items()}
    m = batch.mask
    if isinstance(m, Mask) and not m.is_uniform():
        lay["mask"] = Mask(*(cp.asarray(f) if isinstance(f, np.ndarray) else f
                             for f in m.fields()))
    softcap = ckw.get("softcap", 0.0)
    cu_q, cu_k = cp.asarray(batch.cu_q), cp.asarray(batch.cu_k)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        out, lse = varlen.attention_forward(d["q"], d["k"], d["v"], cu_q, cu_k, **lay,
                                            backend="numba", softcap=softcap)
        grads = varlen.attention_backward(d["dout"], d["q"], d["k"], d["v"], out, lse, cu_q,
                                          cu_k, **lay, backend="numba", softcap=softcap,
                                          deterministic=ckw.get("deterministic", False))
    assert isinstance(out, cp.ndarray) and all(isinstance(g, cp.ndarray) for g in grads)
    stream.synchronize()

    def host(a):
        return a.view(cp.uint16).get().view(a.dtype) if batch.dtype == "bfloat16" else a.get()
    check_against_reference(batch, host(out), lse.get(), [host(g) for g in grads],
                            softcap=softcap, label=case)


@pytest.mark.gpu
def test_gpu_torch_roundtrip():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    batch = make_batch(rng, [5, 0, 300, 77], [9, 4, 300, 70], Hq=4, Hk=2, D=64,
                       dtype="float16", mask="causal_bottom_right", gaps=True)
    t = {n: torch.from_numpy(getattr(batch, n)).cuda() for n in ("q", "k", "v", "dout")}
    cu_q, cu_k = torch.from_numpy(batch.cu_q).cuda(), torch.from_numpy(batch.cu_k).cuda()
    off = dict(seq_offsets_q=torch.from_numpy(batch.off_q).cuda(),
               seq_offsets_k=torch.from_numpy(batch.off_k).cuda())
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        out, lse = varlen.attention_forward(t["q"], t["k"], t["v"], cu_q, cu_k, **off,
                                            mask=batch.mask, backend="numba")
        grads = varlen.attention_backward(t["dout"], t["q"], t["k"], t["v"], out, lse, cu_q,
                                          cu_k, **off, mask=batch.mask, backend="numba")
    s.synchronize()
    assert out.is_cuda and out.dtype == torch.float16
    check_against_reference(batch, out.cpu().numpy(), lse.cpu().numpy(),
                            [g.cpu().numpy() for g in grads], label="torch")
