"""The CuPy tensor-core backend on a GPU: parity with the float64 reference, determinism,
graph capture. Skipped without a CUDA GPU (marker `gpu`).

The backend is `--cupy-backend` (the `cupy_backend` fixture): `cupy`, the family, by default;
`cupy:sm90a` or `cupy:mma` for one implementation. A call the backend does not support (its
`supports()`, as xformers generates its tests from each op's) skips with the backend's reason.

Tolerances are STYLE.md's ratio tolerances (varlen.testing): the error against float64 may
be at most 2x (output) / 3x (gradients) the error of a naive same-dtype computation, plus a
rounding floor, with a relative-RMS and a max-abs check.
"""
from __future__ import annotations

import dataclasses
import os
import sys
import types
import zlib

import numpy as np
import pytest

import varlen
from varlen import Mask
from varlen.backends import Problem

from helpers import (GRAPH_BATCHES, GRAPH_MASKS, TESTS, check_against_reference, covered_rows,
                     make_batch)

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


def _require(backend, dtype, head_dim, head_dim_v=None):
    """Skip what `backend` does not support, forward and backward, with its reason."""
    call = Problem(dtype=dtype, head_dim=head_dim, head_dim_v=head_dim_v or head_dim,
                   on_device=True)
    why = varlen.backends.get(backend).supports(call) or varlen.backends.get(backend).supports(
        types.SimpleNamespace(**dataclasses.asdict(call), grads=()))
    if why:
        pytest.skip(f"{backend}: {why}")


def _run(b, backend, *, softcap=0.0, deterministic=False, plan=None, **dropout):
    """Forward and backward of batch `b` on the device through the public API; `dropout`:
    `dropout_p`, `seed`, `offset` of both."""
    _require(backend, b.dtype, b.q.shape[2], b.v.shape[2])
    dev = {n: _device(getattr(b, n)) for n in ("q", "k", "v", "dout")}
    cu = dict(cu_seqlens_q=_device(b.cu_q), cu_seqlens_k=_device(b.cu_k))
    lay = dict(seq_offsets_q=None if b.off_q is None else _device(b.off_q),
               seq_offsets_k=None if b.off_k is None else _device(b.off_k),
               mask=_device_mask(b.mask))
    out, lse = varlen.attention_forward(dev["q"], dev["k"], dev["v"], **cu, **lay,
                                        softcap=softcap, backend=backend, plan=plan, **dropout)
    grads = varlen.attention_backward(dev["dout"], dev["q"], dev["k"], dev["v"], out, lse, **cu,
                                      **lay, softcap=softcap, backend=backend, plan=plan,
                                      deterministic=deterministic, **dropout)
    return out, lse, grads


def _device_mask(mask):
    if isinstance(mask, Mask) and not mask.is_uniform():
        return Mask(*(f if np.ndim(f) == 0 else _device(np.asarray(f, np.int32))
                      for f in mask.fields()))
    return mask


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_matches_reference(case, D, dtype, cupy_backend):
    name, lq, lk, Hq, Hk, mask, gaps, softcap = case
    rng = np.random.default_rng(zlib.crc32(f"{name}{D}{dtype}".encode()))
    b = make_batch(rng, lq, lk, Hq=Hq, Hk=Hk, D=D, dtype=dtype, mask=mask, gaps=gaps)
    out, lse, grads = _run(b, cupy_backend, softcap=softcap)
    out, lse, grads = _host(out), _host(lse), [_host(g) for g in grads]
    assert out.dtype == b.q.dtype and lse.dtype == np.float32
    check_against_reference(b, out, lse, grads, softcap=softcap, label=f"{name}/D{D}/{dtype}")
    pad_q, pad_k = ~covered_rows(b, "q"), ~covered_rows(b, "k")
    assert (out.astype(np.float64)[pad_q] == 0).all(), "pad query rows: output not zero"
    assert np.isneginf(lse[:, pad_q]).all(), "pad query rows: lse not -inf"
    assert (grads[0].astype(np.float64)[pad_q] == 0).all(), "pad query rows: dq not zero"
    assert (grads[1].astype(np.float64)[pad_k] == 0).all(), "pad key rows: dk not zero"
    assert (grads[2].astype(np.float64)[pad_k] == 0).all(), "pad key rows: dv not zero"


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_dropout_parity(D, dtype, cupy_backend):
    """Attention dropout (docs/cupy_backend.md, "Dropout") on the GQA case with per-sequence
    windows and gaps: the reference draws the same keep set from the same seed; both dQ modes.
    An implementation that refuses dropout skips. (Run by gpu_check.sh's kernel_tests step;
    scripts/gpu_warm.py compiles its modules: D 64 and 128 at the default tiles.)"""
    from varlen.dropout import make_dropout
    drop = dict(dropout_p=0.25, seed=(3 << 33) + 17, offset=5)
    why = varlen.backends.get(cupy_backend).supports_dropout(
        Problem(dtype, D, D, True, dropout=make_dropout(**drop)))
    if why:
        pytest.skip(f"{cupy_backend}: {why}")
    name, lq, lk, Hq, Hk, mask, gaps, softcap = CASES[1]
    rng = np.random.default_rng(zlib.crc32(f"dropout{name}{D}{dtype}".encode()))
    b = make_batch(rng, lq, lk, Hq=Hq, Hk=Hk, D=D, dtype=dtype, mask=mask, gaps=gaps)
    for det in (False, True):
        out, lse, grads = _run(b, cupy_backend, softcap=softcap, deterministic=det, **drop)
        check_against_reference(b, _host(out), _host(lse), [_host(g) for g in grads],
                                softcap=softcap, label=f"dropout {name}/D{D}/{dtype}/det={det}",
                                **drop)


@pytest.mark.parametrize("D, dtype", [(32, "bfloat16"), (96, "float16")], ids=["D32", "D96"])
def test_other_head_dims(D, dtype, cupy_backend):
    rng = np.random.default_rng(D)
    b = make_batch(rng, [0, 130, 7, 64], [5, 100, 7, 200], Hq=4, Hk=2, D=D, dtype=dtype,
                   mask=PER_SEQ_4, gaps=True)
    for det in (False, True):
        out, lse, grads = _run(b, cupy_backend, softcap=2.0, deterministic=det)
        check_against_reference(b, _host(out), _host(lse), [_host(g) for g in grads],
                                softcap=2.0, label=f"D{D}/{dtype} deterministic={det}")


@pytest.mark.parametrize("D, Dv, dtype", [(192, 128, "bfloat16"), (128, 64, "float16")],
                         ids=["D192-Dv128", "D128-Dv64"])
def test_head_dim_v_below_head_dim(D, Dv, dtype, cupy_backend):
    """Multi-head latent attention's head dims: out and dv of Dv columns, both dQ modes."""
    rng = np.random.default_rng(D + Dv)
    b = make_batch(rng, [0, 130, 1, 64], [5, 100, 7, 200], Hq=4, Hk=2, D=D, Dv=Dv, dtype=dtype,
                   mask=PER_SEQ_4, gaps=True)
    for det in (False, True):
        out, lse, grads = _run(b, cupy_backend, softcap=2.0, deterministic=det)
        assert out.shape == (b.q.shape[0], 4, Dv) and grads[2].shape == b.v.shape
        check_against_reference(b, _host(out), _host(lse), [_host(g) for g in grads],
                                softcap=2.0, label=f"D{D}/Dv{Dv}/{dtype} deterministic={det}")


PER_SEQ_4 = Mask(window_left=np.array([-1, 11, -1, -1], np.int32),
                 window_right=np.array([0, 0, -1, 3], np.int32),
                 bottom_right=np.array([0, 1, 1, 0], np.int32))


@pytest.mark.parametrize("block", [(64, 64), (128, 64)], ids=["BM64", "BM128"])
def test_both_tile_sizes(block, cupy_backend):
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
        out, lse, grads = _run(b, cupy_backend, plan=plan, deterministic=det)
        check_against_reference(b, _host(out), _host(lse), [_host(g) for g in grads],
                                label=f"blocks {block} deterministic={det}")


PER_SEQ_5 = Mask(window_left=np.array([-1, 7, -1, -1, 0], np.int32),
                 window_right=np.array([0, -1, 0, -1, 0], np.int32),
                 bottom_right=np.array([1, 0, 0, 1, 0], np.int32))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_deterministic_backward_is_bitwise_repeatable(dtype, cupy_backend):
    rng = np.random.default_rng(3)
    b = make_batch(rng, [300, 0, 513, 77], None, Hq=8, Hk=2, D=64, dtype=dtype,
                   mask="causal", gaps=True)
    runs = [[_host(g).view(np.uint16) for g in _run(b, cupy_backend, deterministic=True)[2]]
            for _ in range(3)]
    for r in runs[1:]:
        for name, a, c in zip(("dq", "dk", "dv"), runs[0], r):
            assert np.array_equal(a, c), f"{name} differs between deterministic runs"
    # dK/dV have one writer per row even with atomic dQ; the two dQ paths agree closely.
    fast = [_host(g) for g in _run(b, cupy_backend, deterministic=False)[2]]
    for name, a, c in zip(("dk", "dv"), runs[0][1:], fast[1:]):
        a64 = a.view(b.q.dtype).astype(np.float64)
        assert np.abs(a64 - c.astype(np.float64)).max() <= 2 ** -8 * np.abs(a64).max(), (
            f"{name} differs between the atomic-dQ and deterministic dK/dV kernels")
    dq_det = runs[0][0].view(b.q.dtype).astype(np.float64)
    dq_fast = fast[0].astype(np.float64)
    scale = np.abs(dq_det).max()
    assert np.abs(dq_det - dq_fast).max() <= 2 ** -6 * scale, "atomic and deterministic dQ"


def _chunked_causal(b, q_idx, k_idx, chunk):
    return (q_idx // chunk[0] == k_idx // chunk[0]) & (k_idx <= q_idx)


def _first_tile(b, q_idx, k_idx):
    return (q_idx < 64) & (k_idx <= q_idx)


@pytest.mark.parametrize("mask_id", ["chunked", "first-tile"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_mask_mod_tile_classes(mask_id, dtype, cupy_backend):
    """A mask_mod whose classes empty most tiles (chunked causal, chunks of 128) or leave whole
    query tiles without a key ("first-tile": out 0, lse -inf there): the kernels classify their
    chunks on the device, skip the empty ones and leave the full ones unmasked (the sm_90a
    forward through its class tables, its backward through the producer's staged classes);
    forward and backward against the float64 reference, NaN in the padding rows. Not in
    scripts/gpu_check.sh (a mask_mod's modules compile for longer than its per-test
    timeout): `pytest -m gpu tests/gpu/test_cupy_gpu.py -k mask_mod --cupy-backend=...`."""
    from varlen.mods import Mods
    mask_mod = {"chunked": varlen.MaskMod(_chunked_causal, np.array([128], np.int32)),
                "first-tile": varlen.MaskMod(_first_tile)}[mask_id]
    on_device = (varlen.MaskMod(_chunked_causal, _device(np.array([128], np.int32)))
                 if mask_id == "chunked" else mask_mod)
    why = varlen.backends.get(cupy_backend).supports_mods(types.SimpleNamespace(
        mods=Mods(mask=on_device), grads=()))
    if why:
        pytest.skip(f"{cupy_backend}: {why}")
    b = make_batch(np.random.default_rng(9), [700, 0, 1, 130, 257], None, Hq=4, Hk=2, D=128,
                   dtype=dtype, mask=mask_mod, gaps=True, garbage=np.nan)
    _require(cupy_backend, dtype, 128)
    dev = {n: _device(getattr(b, n)) for n in ("q", "k", "v", "dout")}
    kw = dict(cu_seqlens_q=_device(b.cu_q), cu_seqlens_k=_device(b.cu_k),
              seq_offsets_q=_device(b.off_q), seq_offsets_k=_device(b.off_k), mask=on_device,
              backend=cupy_backend)
    out, lse = varlen.attention_forward(dev["q"], dev["k"], dev["v"], **kw)
    grads = varlen.attention_backward(dev["dout"], dev["q"], dev["k"], dev["v"], out, lse, **kw)
    check_against_reference(b, _host(out), _host(lse), tuple(_host(g) for g in grads),
                            label=f"{mask_id} {dtype} {cupy_backend}")
    varlen.check_device_errors()


def _slopes_and_table(score, b, h, q_idx, k_idx, slopes, table):
    """Learnable ALiBi slopes [Hq] and a relative-bias table [Hq, 2R + 1]."""
    R = (table.shape[1] - 1) // 2
    rel = varlen.minimum(varlen.maximum(q_idx - k_idx, -R), R) + R
    return score - slopes[h] * abs(q_idx - k_idx) + table[h, rel]


@pytest.mark.parametrize("dtype", ["bfloat16"])
def test_deterministic_aux_grads_are_bitwise_repeatable(dtype, cupy_backend):
    """deterministic=True with the gradients of learnable slopes and a bias table (64-bit
    fixed-point sums): bitwise equal over three runs, against the float64 reference, and
    close to the float32 atomics' sums (deterministic=False). Not in scripts/gpu_check.sh
    (its score_mod module compiles for longer than that script's per-test timeout)."""
    from varlen.mods import Mods
    rng = np.random.default_rng(5)
    Hq = 8
    aux = ((0.1 * rng.random(Hq)).astype(np.float32),
           (0.3 * rng.standard_normal((Hq, 33))).astype(np.float32))
    score = varlen.ScoreMod(_slopes_and_table, *aux)
    on_device = varlen.ScoreMod(_slopes_and_table, *(_device(a) for a in aux))
    why = varlen.backends.get(cupy_backend).supports_mods(types.SimpleNamespace(
        mods=Mods(score=on_device, aux_grads=True), grads=(), deterministic=True))
    if why:
        pytest.skip(f"{cupy_backend}: {why}")
    b = make_batch(rng, [300, 0, 513, 77], None, Hq=Hq, Hk=2, D=64, dtype=dtype,
                   mask="causal", gaps=True)
    _require(cupy_backend, dtype, 64)
    dev = {n: _device(getattr(b, n)) for n in ("q", "k", "v", "dout")}
    kw = dict(cu_seqlens_q=_device(b.cu_q), cu_seqlens_k=_device(b.cu_k),
              seq_offsets_q=_device(b.off_q), seq_offsets_k=_device(b.off_k), mask="causal",
              backend=cupy_backend, score_mod=on_device)
    out, lse = varlen.attention_forward(dev["q"], dev["k"], dev["v"], **kw)

    def backward(deterministic):
        dq, dk, dv, daux = varlen.attention_backward(
            dev["dout"], dev["q"], dev["k"], dev["v"], out, lse, **kw, aux_grads=True,
            deterministic=deterministic)
        return [_host(g) for g in (dq, dk, dv)], [_host(g) for g in daux]
    runs = [backward(True) for _ in range(3)]
    for grads, daux in runs[1:]:
        for name, x, y in zip(("dq", "dk", "dv", "dslopes", "dtable"), (*runs[0][0],
                              *runs[0][1]), (*grads, *daux)):
            assert x.tobytes() == y.tobytes(), f"{name} differs between deterministic runs"
    grads, daux = runs[0]
    check_against_reference(b, _host(out), _host(lse), (*grads, tuple(daux)), score_mod=score,
                            label=f"deterministic aux grads {dtype}")
    fast = backward(False)[1]
    for name, x, y in zip(("dslopes", "dtable"), daux, fast):
        x64, y64 = x.astype(np.float64), y.astype(np.float64)
        assert np.abs(x64 - y64).max() <= 2 ** -12 * np.abs(x64).max(), (
            f"{name}: fixed-point and float32 atomic sums differ")
    varlen.check_device_errors()


def test_rejects_what_it_cannot_run(cupy_backend):
    import cupy as cp
    q = cp.zeros((4, 2, 64), cp.float32)
    cu = cp.asarray([0, 4], cp.int32)
    with pytest.raises(ValueError, match="cupy"):
        varlen.attention_forward(q, q, q, cu, cu, backend=cupy_backend)
    h = cp.zeros((4, 2, 80), cp.float16)
    with pytest.raises(ValueError, match="head_dim"):
        varlen.attention_forward(h, h, h, cu, cu, backend=cupy_backend)
    q16 = cp.zeros((4, 2, 64), cp.float16)
    plan = varlen.plan(cu, cu, num_rows_q=4, num_rows_k=4, block_m=32, block_n=32)
    with pytest.raises(ValueError, match="tiles"):
        varlen.attention_forward(q16, q16, q16, cu, cu, backend=cupy_backend, plan=plan)


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic-dq", "deterministic"])
def test_graph_capture_replays_with_new_cu_seqlens(deterministic, cupy_backend):
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
    kw = dict(softmax_scale=0.125, backend=cupy_backend)

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


def test_runs_on_the_callers_stream(cupy_backend):
    """Results are ordered on the current stream: a non-default stream needs no extra sync."""
    import cupy as cp
    rng = np.random.default_rng(9)
    b = make_batch(rng, [90, 33], None, Hq=2, Hk=2, D=64, dtype="float16", mask="causal")
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        out, lse, grads = _run(b, cupy_backend)
        host = _host(out), _host(lse), [_host(g) for g in grads]
    check_against_reference(b, *host[:2], host[2], label="side stream")


# ---- what the GPU check (scripts/gpu_check.sh) adds: sanitizer case, scale, numerics ---------

def test_one_small_case_per_kernel(cupy_backend):
    """Forward, atomic-dQ and deterministic backward of one small batch at the shipped default
    (bf16, D=128, tiles (128, 64), 5 key tiles for the last query tile): every kernel once.
    The GPU check runs this test under compute-sanitizer; CuPy's memory pool is off meanwhile,
    so each array is its own allocation and an overrun is one the sanitizer sees."""
    import cupy as cp
    old = cp.get_default_memory_pool()
    cp.cuda.set_allocator(None)
    try:
        rng = np.random.default_rng(17)
        b = make_batch(rng, [300, 33], None, Hq=2, Hk=1, D=128, dtype="bfloat16",
                       mask="causal", gaps=True)
        for det in (False, True):
            out, lse, grads = _run(b, cupy_backend, deterministic=det)
            check_against_reference(b, _host(out), _host(lse), [_host(g) for g in grads],
                                    label=f"sanitizer case deterministic={det}")
    finally:
        cp.cuda.set_allocator(old.malloc)


def test_more_ctas_than_sms(cupy_backend):
    """Grids of several waves (4 x 1024 causal tokens, 8 query and 4 key heads: 256 query-tile
    CTAs and 256 key-tile CTAs against 132 SMs on an H100), many dK/dV blocks adding to the same
    dQ rows, heaviest tiles last."""
    import cupy as cp
    rng = np.random.default_rng(23)
    b = make_batch(rng, [1024] * 4, None, Hq=8, Hk=4, D=128, dtype="bfloat16", mask="causal")
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    assert 4 * (1024 // 128) * 8 > sms, "the grid fits in one wave on this GPU"
    for det in (False, True):
        out, lse, grads = _run(b, cupy_backend, deterministic=det)
        check_against_reference(b, _host(out), _host(lse), [_host(g) for g in grads],
                                label=f"multi-wave deterministic={det}")


def _rows_scaled(b, name, factor):
    """b.<name> with its sequence rows multiplied by `factor` (padding keeps its garbage)."""
    a = getattr(b, name)
    rows = covered_rows(b, "k" if name in ("k", "v") else "q")
    x = a.astype(np.float64)
    x[rows] *= factor
    setattr(b, name, x.astype(a.dtype))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("what", ["scores-1e2", "softcap-saturated", "dout-near-fp16-max"])
def test_large_magnitudes(what, dtype, cupy_backend):
    """|scores| of 1e2 to 1e3 (a near one-hot softmax), a softcap far into saturation, and dO
    near the float16 range; the tolerances are the usual ratio to a naive same-dtype error."""
    rng = np.random.default_rng(zlib.crc32(f"{what}{dtype}".encode()))
    b = make_batch(rng, [200, 77, 1], [260, 77, 5], Hq=4, Hk=2, D=128, dtype=dtype,
                   mask="causal_bottom_right", gaps=True)
    softcap = 0.0
    if what in ("scores-1e2", "softcap-saturated"):
        _rows_scaled(b, "q", 12.0)
        _rows_scaled(b, "k", 12.0)                   # scores ~ 144 x N(0, 1) after 1/sqrt(D)
        softcap = 20.0 if what == "softcap-saturated" else 0.0
    else:
        _rows_scaled(b, "dout", 1000.0)              # |dO| up to ~5e3, dP ~ 1e4 in fp32
    for det in (False, True):
        out, lse, grads = _run(b, cupy_backend, softcap=softcap, deterministic=det)
        grads = [_host(g) for g in grads]
        assert all(np.isfinite(g.astype(np.float64)).all() for g in grads), "overflow"
        check_against_reference(b, _host(out), _host(lse), grads, softcap=softcap,
                                label=f"{what}/{dtype} deterministic={det}")


def test_offsets_past_2_31_elements(cupy_backend):
    """A sequence at the end of packed arrays of 2**21 rows x 8 heads x 128 (2**31 elements
    each, 4 GiB in bf16): every address of its rows needs 64 bits."""
    import cupy as cp
    T, H, D, L = 2 ** 21, 8, 128, 300
    assert T * H * D >= 2 ** 31
    rng = np.random.default_rng(29)
    small = make_batch(rng, [L], None, Hq=H, Hk=H, D=D, dtype="bfloat16", mask="causal")
    start = T - L - 3
    garbage = int(np.array(1e4, small.q.dtype).view(np.uint16))    # as make_batch pads
    dev = {}
    for n in ("q", "k", "v", "dout"):
        a = cp.full((T, H, D), garbage, dtype=cp.uint16)
        a[start:start + L] = cp.asarray(getattr(small, n).view(np.uint16))
        dev[n] = a.view(small.q.dtype)
    cu = cp.asarray(np.array([0, L], np.int32))
    off = cp.asarray(np.array([start, start + L], np.int32))
    kw = dict(seq_offsets_q=off, seq_offsets_k=off, mask="causal", backend=cupy_backend)
    out, lse = varlen.attention_forward(dev["q"], dev["k"], dev["v"], cu, cu, **kw)
    for det in (False, True):
        grads = varlen.attention_backward(dev["dout"], dev["q"], dev["k"], dev["v"], out, lse,
                                          cu, cu, deterministic=det, **kw)
        rows = slice(start, start + L)
        check_against_reference(small, _host(out[rows]), _host(lse[:, rows]),
                                [_host(g[rows]) for g in grads],
                                label=f"rows past 2**31 elements deterministic={det}")
    del dev, out, lse, grads
    cp.get_default_memory_pool().free_all_blocks()


MMA_KERNEL = r"""
#include <cuda_bf16.h>
// One warp per 16x8 tile: D = A B + C by mma.sync.m16n8k16 (bf16 in, f32 accumulate), fragments
// as the PTX ISA lays them out; A [n][16][16] row-major, B [n][16][8] (k, n), C, D [n][16][8].
extern "C" __global__ void mma_tiles(const __nv_bfloat16* A, const __nv_bfloat16* B,
                                     const float* C, float* Dout) {
    const int tile = blockIdx.x, lane = threadIdx.x, g = lane / 4, t = lane % 4;
    const __nv_bfloat16* a = A + tile * 256;
    const __nv_bfloat16* b = B + tile * 128;
    auto pack = [](__nv_bfloat16 lo, __nv_bfloat16 hi) {
        return (unsigned)__bfloat16_as_ushort(lo) | ((unsigned)__bfloat16_as_ushort(hi) << 16);
    };
    unsigned ra[4], rb[2];
    ra[0] = pack(a[g * 16 + 2 * t], a[g * 16 + 2 * t + 1]);
    ra[1] = pack(a[(g + 8) * 16 + 2 * t], a[(g + 8) * 16 + 2 * t + 1]);
    ra[2] = pack(a[g * 16 + 2 * t + 8], a[g * 16 + 2 * t + 9]);
    ra[3] = pack(a[(g + 8) * 16 + 2 * t + 8], a[(g + 8) * 16 + 2 * t + 9]);
    rb[0] = pack(b[(2 * t) * 8 + g], b[(2 * t + 1) * 8 + g]);
    rb[1] = pack(b[(2 * t + 8) * 8 + g], b[(2 * t + 9) * 8 + g]);
    const float* c = C + tile * 128;
    float d[4] = {c[g * 8 + 2 * t], c[g * 8 + 2 * t + 1], c[(g + 8) * 8 + 2 * t],
                  c[(g + 8) * 8 + 2 * t + 1]};
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, "
                 "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(ra[0]), "r"(ra[1]), "r"(ra[2]), "r"(ra[3]), "r"(rb[0]), "r"(rb[1]));
    float* o = Dout + tile * 128;
    o[g * 8 + 2 * t] = d[0]; o[g * 8 + 2 * t + 1] = d[1];
    o[(g + 8) * 8 + 2 * t] = d[2]; o[(g + 8) * 8 + 2 * t + 1] = d[3];
}
extern "C" __global__ void special(const float* x, float* out, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) { out[3 * i] = exp2f(x[i]); out[3 * i + 1] = log2f(x[i] + 200.f);
                 out[3 * i + 2] = tanhf(x[i] / 16.f); }
}
"""


def test_tensor_cores_and_special_functions_match_the_emulation_model(tmp_path_factory):
    """The host emulation's arithmetic (kernels_cuda/host_emulation_math.cuh) against this GPU:
    mma.m16n8k16 bf16 -> f32 bit for bit with the tensor-core model (blocks of 16 on sm_90,
    8 on sm_80), and ex2/lg2/tanh under --use_fast_math within the PTX bounds the model uses."""
    import cupy as cp
    sys.path.insert(0, os.path.join(TESTS, "emulation"))
    import test_emulation_math as em
    from varlen.backends.cupy.compile import compile_options
    major = cp.cuda.Device().compute_capability[0]
    exe = em._build(tmp_path_factory, [f"VARLEN_EMU_MMA_BLOCK={16 if major >= 9 else 8}"])
    mod = cp.RawModule(code=MMA_KERNEL, options=tuple(o for o in compile_options()
                                                       if not o.startswith("-DVARLEN")))
    rng = np.random.default_rng(31)
    n = 512
    A = em.bf16_values(rng.standard_normal((n, 16, 16)))
    B = em.bf16_values(rng.standard_normal((n, 16, 8)))
    A[: n // 2] *= np.exp2(rng.integers(-20, 20, (n // 2, 16, 16))).astype(np.float32)
    C = (rng.standard_normal((n, 16, 8)) * 8).astype(np.float32)
    to_bits = lambda x: cp.asarray((x.view(np.uint32) >> 16).astype(np.uint16))   # noqa: E731
    out = cp.empty((n, 16, 8), cp.float32)
    mod.get_function("mma_tiles")((n,), (32,), (to_bits(A), to_bits(B), cp.asarray(C), out))
    gpu = cp.asnumpy(out)
    rows = np.concatenate([C.reshape(n, 16, 8, 1),
                           np.broadcast_to(A[:, :, None, :], (n, 16, 8, 16)),
                           np.broadcast_to(B.transpose(0, 2, 1)[:, None], (n, 16, 8, 16))], -1)
    model = em.run(exe, "mma", rows.reshape(-1, 33).ravel()).reshape(n, 16, 8)
    same = np.mean(gpu.view(np.uint32) == model.view(np.uint32))
    exact = (C.astype(np.float64) + np.einsum("nik,nkj->nij", A.astype(np.float64),
                                              B.astype(np.float64)))
    print(f"mma: {same:.4%} of elements bit-identical to the emulation's model; max |gpu - "
          f"exact| {np.abs(gpu - exact).max():.3e}, max |model - exact| "
          f"{np.abs(model - exact).max():.3e}")
    assert same >= 0.99, f"the tensor-core model matches only {same:.2%} of this GPU's results"
    x = rng.uniform(-100, 100, 100000).astype(np.float32)
    res = cp.empty(3 * x.size, cp.float32)
    mod.get_function("special")(((x.size + 255) // 256,), (256,), (cp.asarray(x), res,
                                                                    np.int32(x.size)))
    e2, l2, th = cp.asnumpy(res).reshape(-1, 3).T
    x64 = x.astype(np.float64)
    err_e2 = np.abs(e2 - np.exp2(x64)) / np.spacing(np.exp2(x64).astype(np.float32))
    arg = (x + np.float32(200)).astype(np.float64)
    err_l2 = np.abs(l2 - np.log2(arg)) / np.abs(np.log2(arg))
    t = np.tanh((x / np.float32(16)).astype(np.float64))
    err_th = np.abs(th - t) / np.maximum(np.abs(t), 1e-30)
    print(f"ex2 max {err_e2.max():.2f} ulp, lg2 max rel {err_l2.max():.2e}, tanh max rel "
          f"{err_th.max():.2e}")
    assert err_e2.max() <= 2.5, f"ex2.approx {err_e2.max():.2f} ulp: over the modelled 2 ulp"
    assert err_l2.max() <= 2.0 ** -22, "lg2.approx over the modelled 2^-22"
    assert err_th.max() <= 2.0 ** -11, "tanh.approx over the modelled 2^-11"
