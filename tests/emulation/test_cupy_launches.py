"""What a call of the CuPy backend launches and writes, on a CPU through the host emulation
(`emulation/cupy.py`): each case in its own process (the emulation replaces
`cupy`), run by this file's __main__.

* Pad rows are written by the kernels, with no fill before them (fresh buffers NaN-filled, so
  a row nobody writes shows): out 0 and lse -inf, dq, dk and dv 0 in gaps between sequences,
  before the first and after the last one (over more than one pad block's window),
  zero-length sequences first, in the middle and last, a sequence with queries and no keys and
  one with keys and no queries, GQA, both backward modes, against the float64 reference; and
  on segments out of row order (all-gathered context-parallel shards on both sides) against
  the NumPy backend on the same plan.
* Launches per call, memsets and fills counted: a forward is 1, each backward mode 3; calls
  without query rows, or with rows but no sequence, launch only what writes their outputs.
* No host read of device data in the forward or the backward (what lets a CUDA graph capture
  them): the stand-in cupy counts every `get()`, `asnumpy`, `item()`, conversion to a Python
  number or bool and iteration of its arrays.
"""
from __future__ import annotations

import math
import os
import re
import sys

import numpy as np
import pytest

from helpers import cases, emulate_script, needs_cxx


GARBAGE = 1e4                # what every pad row of the inputs holds


def _emulate(*case, timeout=900):
    return emulate_script(__file__, *case, timeout=timeout)


# --------------------------------------------------------------------------------------------
# Batches: sequences at given rows of longer arrays
# --------------------------------------------------------------------------------------------

# label: (lengths q, lengths k, first rows q, first rows k, Tq, Tk, Hq, Hk, D, dtype, mask,
# block_m). Sequence b occupies rows [first[b], first[b] + L[b]); every other row is padding.
LAYOUTS = {
    # zero-length sequences first, in the middle and last; sequence 0 has keys and no queries,
    # sequence 3 queries and no keys; pad rows before, between and after the sequences
    "B6-zero-first-middle-last-q-only-k-only-gqa-fp16-D64": (
        [0, 37, 0, 70, 5, 0], [3, 50, 0, 0, 64, 0], [2, 2, 41, 44, 120, 130],
        [1, 5, 60, 61, 63, 130], 140, 133, 4, 2, 64, "float16", "causal", 64),
    # query rows after the last sequence over three of the forward's pad blocks (4096 rows
    # each, two per grid column of the two heads: both coordinates of a pad block count); key
    # rows: a gap of 2930 rows between two sequences, a tail of 1180
    "B3-tail-past-pad-windows-fp16-D64": (
        [40, 0, 30], [50, 0, 20], [100, 140, 300], [0, 50, 3000], 8400, 4200, 2, 1, 64,
        "float16", "full", 64),
}


def _place(x, lengths, first, T):
    """The packed rows of `x` at rows `first` of an array of `T` rows of GARBAGE."""
    y = np.full((T, *x.shape[1:]), GARBAGE).astype(x.dtype)
    src = 0
    for n, r in zip(lengths, first):
        y[r:r + n] = x[src:src + n]
        src += n
    return y


def _batch(label, seed=0):
    """The `varlen.testing.Batch` of layout `label`, and its block_m."""
    from varlen.testing import Batch, make_batch
    Lq, Lk, first_q, first_k, Tq, Tk, Hq, Hk, D, dtype, mask, block_m = LAYOUTS[label]
    b = make_batch(np.random.default_rng(seed), Lq, Lk, Hq=Hq, Hk=Hk, D=D, dtype=dtype,
                   mask=mask)
    off_q = np.array([*first_q, first_q[-1] + Lq[-1]], np.int32)
    off_k = np.array([*first_k, first_k[-1] + Lk[-1]], np.int32)
    q, dout = (_place(x, Lq, first_q, Tq) for x in (b.q, b.dout))
    k, v = (_place(x, Lk, first_k, Tk) for x in (b.k, b.v))
    return Batch(q, k, v, b.cu_q, b.cu_k, off_q, off_k, mask, dtype, dout), block_m


def _plan(b, block_m):
    import varlen
    return varlen.plan(b.cu_q, b.cu_k, seq_offsets_q=b.off_q, seq_offsets_k=b.off_k,
                       mask=b.mask, num_rows_q=b.q.shape[0], num_rows_k=b.k.shape[0],
                       block_m=block_m, block_n=64)


def test_layouts_have_the_pad_rows_they_claim():
    from varlen.testing import covered_rows
    seen = set()
    for label in LAYOUTS:
        b, block_m = _batch(label)
        Lq, Lk = np.diff(b.cu_q), np.diff(b.cu_k)
        for side, off, L in (("q", b.off_q, Lq), ("k", b.off_k, Lk)):
            assert (np.diff(off) >= L).all(), f"{label}: {side} sequences overlap"
            rows = covered_rows(b, side)
            seen |= {f"{side} lead gap"} if not rows[0] else set()
            seen |= {f"{side} tail"} if not rows[-1] else set()
            starts = (np.diff(rows.astype(int)) == 1).sum()      # covered runs after a gap
            seen |= {f"{side} inner gap"} if starts > 1 else set()
        seen |= {"zero first"} if Lq[0] == 0 else set()
        seen |= {"zero last"} if Lq[-1] == 0 and Lk[-1] == 0 else set()
        seen |= {"zero middle"} if ((Lq[1:-1] == 0) & (Lk[1:-1] == 0)).any() else set()
        seen |= {"q only"} if ((Lq > 0) & (Lk == 0)).any() else set()
        seen |= {"k only"} if ((Lq == 0) & (Lk > 0)).any() else set()
        seen |= {"gqa"} if b.q.shape[1] > b.k.shape[1] else set()
        rows_q = covered_rows(b, "q")
        seen |= {"tail over three pad blocks"} if not rows_q[4096:].any() and \
            rows_q.shape[0] > 2 * 4096 else set()
    want = {"q lead gap", "k lead gap", "q tail", "k tail", "q inner gap", "k inner gap",
            "zero first", "zero last", "zero middle", "q only", "k only", "gqa",
            "tail over three pad blocks"}
    assert want <= seen, f"missing: {want - seen}"


def test_pad_block_rows_are_the_kernels():
    """The launcher sizes the pad blocks with the kernels' rows per thread."""
    import varlen.backends.cupy.mma as _cupy_mma
    from varlen.kernels_cuda import SOURCE_DIR
    with open(os.path.join(SOURCE_DIR, "tile_scheduler.cuh")) as f:
        m = re.search(r"constexpr int PAD_ROWS_PER_THREAD = (\d+);", f.read())
    assert m and int(m.group(1)) == _cupy_mma.PAD_ROWS_PER_THREAD, m


@pytest.mark.parametrize("rows, heads, threads, want", [
    (0, 1, 128, 0), (1, 1, 128, 1), (4096, 1, 128, 1), (4097, 1, 128, 2), (4097, 2, 128, 1),
    (9000, 2, 128, 2), (9000, 2, 256, 1), (2 ** 31 - 1, 1, 128, 2 ** 19)])
def test_pad_blocks_cover_every_row(rows, heads, threads, want):
    from varlen.backends.cupy.mma import PAD_ROWS_PER_THREAD, pad_blocks
    got = pad_blocks(rows, heads, threads)
    assert got == want, f"{rows=} {heads=} {threads=}: {got} pad blocks"
    assert got * heads * threads * PAD_ROWS_PER_THREAD >= rows, "rows left without a pad block"


# --------------------------------------------------------------------------------------------
# Tests (emulated)
# --------------------------------------------------------------------------------------------

@needs_cxx
@pytest.mark.parametrize("label", cases(LAYOUTS, [next(iter(LAYOUTS))]))
def test_kernels_write_every_pad_row(label):
    _emulate("pad-rows", label)


@needs_cxx
def test_pad_rows_of_segments_out_of_row_order():
    _emulate("unordered-segments")


@needs_cxx
def test_forward_one_launch_backward_three_no_host_read():
    _emulate("launches")


@needs_cxx
@pytest.mark.parametrize("what", ["no-rows", "no-query-rows", "no-sequence"])
def test_calls_without_rows_or_sequences(what):
    _emulate("empty", what)


# --------------------------------------------------------------------------------------------
# Emulated side: python tests/emulation/test_cupy_launches.py pad-rows LABEL | unordered-segments |
# launches | empty WHAT
# --------------------------------------------------------------------------------------------

def _step(b, plan, deterministic_modes=(False, True)):
    """Forward and the backward modes; yields (label, out, lse, grads) per mode."""
    from varlen.backends.cupy import BACKEND
    kw = dict(softmax_scale=1.0 / math.sqrt(b.q.shape[2]), softcap=0.0)
    out, lse = BACKEND.forward(plan, b.q, b.k, b.v, **kw)
    for det in deterministic_modes:
        grads = BACKEND.backward(plan, b.dout, b.q, b.k, b.v, out, lse, deterministic=det, **kw)
        yield f"deterministic={det}", out, lse, grads


def _case_pad_rows(label):
    import emulation.cupy as emu
    from varlen.testing import check_against_reference
    b, block_m = _batch(label)
    emu.install_fake_cupy(block_m)
    for mode, out, lse, grads in _step(b, _plan(b, block_m)):
        check_against_reference(b, out, lse, grads, label=f"{label} (emulated, {mode})")
    print(label, "ok")


def _case_unordered_segments():
    """Ulysses' plan: both sides all-gathered zigzag shards, whose segments are in sequence
    order, not row order (a sequence's chunks lie in every rank's block of rows), with the
    zigzag padding between them."""
    from varlen import comm
    import emulation.cupy as emu
    import varlen.backends.cupy as cupy_backend
    from varlen.plan import build_plan
    emu.install_fake_cupy(64)
    part = comm.partition(np.array([0, 37, 37, 90], np.int32), 2, "zigzag")
    segs = part.gathered_segments()
    rows = segs.row.reshape(-1)[segs.length.reshape(-1) > 0]
    assert (np.diff(rows) < 0).any(), "the segments are in row order"
    plan = build_plan(segs, segs, "causal", block_m=64, block_n=64)
    rng = np.random.default_rng(1)
    T, Hq, Hk, D = segs.num_rows, 2, 1, 64
    covered = segs.covered()
    assert not covered.all(), "no pad rows"
    q, dout = (rng.standard_normal((T, Hq, D)).astype(np.float16) for _ in range(2))
    k, v = (rng.standard_normal((T, Hk, D)).astype(np.float16) for _ in range(2))
    for x in (q, dout, k, v):
        x[~covered] = GARBAGE
    kw = dict(softmax_scale=1.0 / math.sqrt(D), softcap=0.0)
    want = emu.numpy_reference(plan, q, k, v, dout, **kw)
    backend = cupy_backend.BACKEND
    out, lse = backend.forward(plan, q, k, v, **kw)
    emu.assert_near("unordered segments", dict(out=out, lse=lse), want)
    for det in (False, True):
        got = dict(out=out, **dict(zip(("dq", "dk", "dv"), backend.backward(
            plan, dout, q, k, v, out, lse, deterministic=det, **kw))))
        emu.assert_near(f"unordered segments (deterministic={det})", got, want)
        for name, a in got.items():
            assert (a[~covered] == 0).all(), f"{name} (deterministic={det}): pad rows not 0"
    print("unordered segments ok")


def _case_launches():
    """Launches per call on a fused plan, memsets and fills counted, as a production call
    makes them (no NaN-filled test buffers), and no host read of the stand-in's arrays."""
    from varlen._array import set_nan_fill
    import emulation.cupy as emu
    import varlen.backends.cupy.plan as _cupy_plan
    label = "B6-zero-first-middle-last-q-only-k-only-gqa-fp16-D64"
    b, block_m = _batch(label)
    emu.install_fake_cupy(block_m)
    from varlen._setup import working_mask
    plan = _cupy_plan.plan_from_cu_seqlens(b.cu_q, b.cu_k, b.off_q, b.off_k, b.q.shape[0],
                                           b.k.shape[0], working_mask(b.mask, len(b.cu_q) - 1, np),
                                           block_m=block_m, block_n=64)
    with emu.watch_host_reads() as reads:        # the watch sees what it must see
        x = b.q.view(emu.DeviceArray)
        int(x[0, 0, 0]), float(x.max()), x.get(), bool(x[1, 1, 1] > 0)
    assert dict(reads) == {"int": 1, "float": 1, "get": 1, "bool": 1}, dict(reads)
    set_nan_fill(False)
    counts = {}
    device = [x.view(emu.DeviceArray) for x in (b.dout, b.q, b.k, b.v)]
    with emu.watch_host_reads() as reads:
        emu.launches.clear()
        out, lse = _forward(plan, *device[1:])
        counts["forward"] = dict(emu.launches)
        for det in (False, True):
            emu.launches.clear()
            _backward(plan, *device, out, lse, det)
            counts[f"backward deterministic={det}"] = dict(emu.launches)
    print("launches per call", counts)
    assert not reads, f"host reads of device data: {dict(reads)}"
    assert counts["forward"] == {_name(plan, "fwd"): 1}, counts["forward"]
    for det, roles in ((False, ("preprocess", "dkdv_atomic", "dq_convert")),
                       (True, ("preprocess", "dkdv_ordered", "dq_convert"))):
        got = counts[f"backward deterministic={det}"]
        assert got == {_name(plan, r, kind="bwd"): 1 for r in roles}, f"{det=}: {got}"


def _name(plan, role, kind="fwd"):
    from varlen.backends.cupy.mma import KernelSpec
    spec = KernelSpec(kind, "float16", 64, plan.block_m, plan.block_n, False)
    return spec.kernels()[role].name


def _forward(plan, q, k, v):
    from varlen.backends.cupy import BACKEND
    return BACKEND.forward(plan, q, k, v, softmax_scale=0.125, softcap=0.0)


def _backward(plan, dout, q, k, v, out, lse, deterministic):
    from varlen.backends.cupy import BACKEND
    return BACKEND.backward(plan, dout, q, k, v, out, lse, softmax_scale=0.125, softcap=0.0,
                            deterministic=deterministic)


def _case_empty(what):
    """no-rows: Tq = Tk = 0, nothing launched. no-query-rows: Tq = 0, Tk > 0, the forward
    launches nothing and a backward the preprocessing (dk, dv pad rows) and the dK/dV kernel
    (zeros everywhere). no-sequence: rows but every sequence empty (no tile), one launch of the
    forward and three per backward, all pad rows."""
    import varlen
    import emulation.cupy as emu
    emu.install_fake_cupy(64)
    Tq, Tk = {"no-rows": (0, 0), "no-query-rows": (0, 70), "no-sequence": (70, 4200)}[what]
    cu_q = np.zeros(3, np.int32)
    cu_k = np.array([0, 0, 33 if what == "no-query-rows" else 0], np.int32)
    rng = np.random.default_rng(2)
    q, dout = (rng.standard_normal((Tq, 2, 64)).astype(np.float16) for _ in range(2))
    k, v = (rng.standard_normal((Tk, 1, 64)).astype(np.float16) for _ in range(2))
    plan = varlen.plan(cu_q, cu_k, num_rows_q=Tq, num_rows_k=Tk, mask="causal", block_m=64,
                       block_n=64)
    emu.launches.clear()
    out, lse = _forward(plan, q, k, v)
    fwd = sum(n for name, n in emu.launches.items() if name != "fill")   # NaN fills: test mode
    assert fwd == (1 if Tq else 0), f"forward: {dict(emu.launches)}"
    assert (out == 0).all() and (lse == -np.inf).all(), "forward outputs"
    for det in (False, True):
        emu.launches.clear()
        grads = _backward(plan, dout, q, k, v, out, lse, det)
        got = sum(n for name, n in emu.launches.items() if name != "fill")
        want = 3 if Tq else (2 if Tk else 0)
        assert got == want, f"backward ({det=}): {dict(emu.launches)}"
        for name, g in zip(("dq", "dk", "dv"), grads):
            assert (g == 0).all(), f"{name} ({det=}) not 0"
    print(what, "ok")


def _main(argv):
    kind, *rest = argv
    {"pad-rows": _case_pad_rows, "unordered-segments": _case_unordered_segments,
     "launches": _case_launches, "empty": _case_empty}[kind](*rest)
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
