"""The plan of CuPy arrays built by the two fused kernels of `kernels_cuda/plan_build.cuh`
(launched by `varlen/backends/cupy/plan.py`), on a CPU through the host emulation: each case
in its own process (the emulation replaces `cupy`), run by this file's __main__.

* The arrays equal those of `varlen.plan`'s NumPy array code exactly (every array of the
  kernel view, the row schedules `q_row_sched`/`k_row_sched` included: dtype, shape, every
  value; fresh integer buffers are poisoned, so an element no kernel writes shows) on
  adversarial batches: zero-length and length-1 sequences (the last one too), lengths off the
  tile sizes, padding gaps and a first offset > 0, per-sequence causal, full, windowed and
  bottom-right masks, q and k lengths that differ, more sequences than the scan block's threads
  and more tile slots than one tile block covers, `max_seqlen_*` given or not, `B = 0`, and
  given segments with two per sequence (a context-parallel shard).
* Errors: a sequence past its buffer (or before it), and one longer than `max_seqlen_*`, raise
  the NumPy code's message at once for host arrays, and on a device set the flag of that same
  message, which `varlen.check_device_errors()` raises later (no host read while building).
* Launches: `varlen.plan`, the cupy backend's setup hook and `build_plan` of device segments
  issue 2 kernel launches per plan (the array code: about 260 array operations). A whole
  step on the plan: the forward is 1 launch, each backward mode 3, memsets and fills counted
  (none: the kernels write the pad rows).
* The launcher's struct dtype has the C layout of `PlanBuildParams` (the kernels' NVRTC build
  for sm_80 and sm_90 without spills: tests/compile/test_cupy_compile.py).
* On a GPU (marker `gpu`): the same batches against the CuPy array code and the NumPy plan, and
  the errors through `check_device_errors()`.
"""
from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from helpers import cases, emulate_script, needs_cxx

CXX = os.environ.get("CXX", "g++")
POISON = 0x5A5A5A5A          # what a fresh integer buffer of the stand-in cupy holds


def _emulate(*case, timeout=300):
    return emulate_script(__file__, *case, timeout=timeout)


# --------------------------------------------------------------------------------------------
# Batches
# --------------------------------------------------------------------------------------------

# label: (lengths q, lengths k, gaps, mask, (block_m, block_n), max_seqlen given, threads)
# mask "mixed": per-sequence causal / full / windowed / bidirectional window, random
# bottom_right; threads (scan, tiles) of the launches, None: the shipped ones.
CASES = {
    "B6-zero-one-last0-mixed-64x64": ([0, 1, 65, 1, 130, 0], [1, 0, 64, 129, 3, 0], False,
                                      "mixed", (64, 64), False, (4, 4)),
    "B5-ragged-gaps-mixed-16x8-maxlen": ([63, 97, 1, 0, 113], [113, 1, 97, 5, 63], True,
                                         "mixed", (16, 8), True, (4, 8)),
    "B4-ragged-gaps-causal_br-128x64": ([200, 7, 0, 129], [3, 250, 64, 128], True,
                                        "causal_bottom_right", (128, 64), False, (2, 4)),
    "B3-same-lengths-causal-3x5": ([17, 33, 9], [17, 33, 9], True, "causal", (3, 5), True,
                                   (2, 2)),
    "B0-empty-batch-pad-rows": ([], [], True, "causal", (1, 2), False, (4, 4)),
    "B300-many-mixed-16x8-shipped-threads": ("many", "many", True, "mixed", (16, 8), False,
                                             None),
    "B40-many-mixed-4x4-maxlen-small-threads": ("many40", "many40", True, "mixed", (4, 4), True,
                                                (8, 8)),
}
# the smoke run's case: zero-length and one-row sequences (the last one empty), per-sequence
# masks, lengths off the tiles, several warps
SMOKE = "B6-zero-one-last0-mixed-64x64"
SEGMENT_CASES = ("CP2-zigzag-gathered", "CP3-zigzag-other-rank", "B3-m2-random")
ERROR_CASES = ("past-buffer-q", "before-buffer-k", "longer-than-max_seqlen-q",
               "longer-than-max_seqlen-k")


def _lengths(spec, rng):
    if spec == "many":
        return [int(x) for x in rng.integers(0, 13, 300)]
    if spec == "many40":
        return [int(x) for x in rng.integers(0, 23, 40)]
    return list(spec)


def _offsets(rng, lengths, gaps):
    """`[B+1]` row offsets: 0-3 pad rows before, between and after the sequences."""
    if not gaps:
        return None, int(sum(lengths))
    if not lengths:                  # an empty batch over a buffer of pad rows
        return np.array([7], np.int32), 13
    pads = rng.integers(0, 4, len(lengths) + 1)
    off = np.concatenate([[pads[0]], pads[0] + np.cumsum(np.asarray(lengths, np.int64)
                                                         + pads[1:])]).astype(np.int32)
    return off, int(off[-1]) + int(rng.integers(0, 3))


def _cu(lengths):
    return np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int32)


def _mask(kind, B, rng):
    import varlen
    from varlen._setup import working_mask
    if kind != "mixed":
        return working_mask(kind, B, np)
    pick = rng.integers(0, 4, B)
    left = np.where(pick == 2, rng.integers(0, 40, B), np.where(pick == 3, 5, -1))
    right = np.where(pick == 0, -1, np.where(pick == 3, rng.integers(0, 9, B), 0))
    m = varlen.Mask(window_left=left.astype(np.int32), window_right=right.astype(np.int32),
                    bottom_right=rng.integers(0, 2, B).astype(np.int32))
    return working_mask(m, B, np)


def _layout(label, seed=0):
    """(cu_q, cu_k, off_q, off_k, rows_q, rows_k, mask, blocks, max_seqlen_q, max_seqlen_k,
    threads) of case `label`."""
    Lq_spec, Lk_spec, gaps, mask, blocks, bounded, threads = CASES[label]
    rng = np.random.default_rng(seed)
    Lq, Lk = _lengths(Lq_spec, rng), _lengths(Lk_spec, rng)
    off_q, rows_q = _offsets(rng, Lq, gaps)
    off_k, rows_k = _offsets(rng, Lk, gaps)
    max_q = max(Lq, default=0) if bounded else None
    max_k = max(Lk, default=0) if bounded else None
    return (_cu(Lq), _cu(Lk), off_q, off_k, rows_q, rows_k, _mask(mask, len(Lq), rng), blocks,
            max_q, max_k, threads)


# --------------------------------------------------------------------------------------------
# Emulated side (this file's __main__): the stand-in cupy, the comparisons
# --------------------------------------------------------------------------------------------

def _install():
    """The stand-in cupy, with fresh integer buffers poisoned; returns the emulation module."""
    import emulation.cupy as emu
    fake = emu.install_fake_cupy(block_m=64)

    def empty(shape, dtype=np.float64):
        a = np.empty(shape, dtype)
        if a.dtype.kind in "iu":
            a.fill(np.array(POISON).astype(a.dtype))
        return a
    fake.empty = empty
    return emu


def _use_threads(threads):
    import varlen.backends.cupy.plan as _cupy_plan
    if threads is not None:
        _cupy_plan.SCAN_THREADS, _cupy_plan.TILE_THREADS = threads


def _plan_arrays(plan):
    """Every array of a plan by name, and its host sizes."""
    v = plan.view()
    arrays = dict(zip(v._fields[:v.NUM_ARRAYS], v[:v.NUM_ARRAYS]))
    sizes = dict(zip(v._fields[v.NUM_ARRAYS:], v[v.NUM_ARRAYS:]))
    return arrays, sizes


def _assert_same_plan(label, got, want):
    ga, gs = _plan_arrays(got)
    wa, ws = _plan_arrays(want)
    assert {"q_row_sched", "k_row_sched"} <= set(wa), f"{label}: no row schedule compared"
    assert gs == ws, f"{label}: sizes {gs} != {ws}"
    for name, w in wa.items():
        g = ga[name]
        assert isinstance(g, np.ndarray), f"{label}: {name} is {type(g).__name__}"
        assert (g.dtype, g.shape) == (w.dtype, w.shape), (
            f"{label}: {name} is {g.dtype}{g.shape}, the array code's {w.dtype}{w.shape}")
        bad = np.argwhere(g != w)
        assert bad.size == 0, (f"{label}: {name} differs at {len(bad)} entries, first "
                               f"{tuple(bad[0])}: {g[tuple(bad[0])]} != {w[tuple(bad[0])]}")


def _kernel_launches(launches) -> int:
    """Kernel launches among the stand-in cupy's counts (memsets are not kernels)."""
    return sum(n for name, n in launches.items() if name != "memset")


def _plan_module():
    return importlib.import_module("varlen.plan")


def _case_layout(label):
    """The fused builder against the array code on one batch, both from cu_seqlens."""
    import varlen.backends.cupy.plan as _cupy_plan
    emu = _install()
    cu_q, cu_k, off_q, off_k, rows_q, rows_k, mask, (bm, bn), mq, mk, threads = _layout(label)
    _use_threads(threads)
    P = _plan_module()
    want = P.plan_from_cu_seqlens(cu_q, cu_k, off_q, off_k, rows_q, rows_k, mask, block_m=bm,
                                  block_n=bn, max_seqlen_q=mq, max_seqlen_k=mk)
    emu.launches.clear()
    got = _cupy_plan.plan_from_cu_seqlens(cu_q, cu_k, off_q, off_k, rows_q, rows_k, mask,
                                          block_m=bm, block_n=bn, max_seqlen_q=mq,
                                          max_seqlen_k=mk)
    _assert_same_plan(label, got, want)
    assert _kernel_launches(emu.launches) <= 2, f"{label}: {dict(emu.launches)}"
    print(label, "slots", got.num_q_tiles, got.num_k_tiles, "launches", dict(emu.launches))


def _segments_case(label):
    """(query segments, key segments, mask, blocks) with several segments per sequence."""
    from varlen import comm
    from varlen.masks import Mask
    from varlen.plan import Segments
    rng = np.random.default_rng(3)
    if label.startswith("CP"):
        cp = int(label[2])
        cu = _cu([37, 0, 163, 1, 90])
        part = comm.partition(cu, cp, "zigzag")
        k_seg = part.gathered_segments() if cp == 2 else part.segments(0)
        q_seg, blocks = part.segments(cp - 1), (16, 8)
    else:
        B = 3
        length = rng.integers(0, 30, (B, 2)).astype(np.int32)
        seqlen = (length.sum(1) + rng.integers(0, 5, B)).astype(np.int32)
        pos = np.stack([np.zeros(B, np.int32), length[:, 0] + 2], 1).astype(np.int32)
        row = (np.cumsum(length.reshape(-1) + 3) - length.reshape(-1)).reshape(B, 2)
        q_seg = Segments(row.astype(np.int32), length, pos, seqlen, int(row.max()) + 40)
        k_seg = Segments(row.astype(np.int32), length, pos, seqlen, int(row.max()) + 40)
        blocks = (4, 8)
    B = q_seg.batch
    mask = Mask(window_left=np.array([-1, 3, 10, -1, 0][:B], np.int32),
                window_right=np.array([0, -1, 0, 5, 2][:B], np.int32),
                bottom_right=np.array([1, 0, 1, 0, 1][:B], np.int32))
    return q_seg, k_seg, mask, blocks


def _case_segments(label):
    """The fused builder of given segments (two or more per sequence) against the array code."""
    import varlen.backends.cupy.plan as _cupy_plan
    emu = _install()
    _use_threads((4, 4))
    q_seg, k_seg, mask, (bm, bn) = _segments_case(label)
    want = _plan_module().build_plan(q_seg, k_seg, mask, block_m=bm, block_n=bn)
    emu.launches.clear()
    got = _cupy_plan.build_plan(q_seg, k_seg, mask, block_m=bm, block_n=bn)
    assert got.q is q_seg and got.k is k_seg, f"{label}: the plan does not keep its segments"
    _assert_same_plan(label, got, want)
    assert _kernel_launches(emu.launches) == 2, f"{label}: {dict(emu.launches)}"
    print(label, "segments per sequence", q_seg.per_seq, k_seg.per_seq)


def _error_layout(label):
    """A layout the array code refuses (unvalidated device metadata would reach it)."""
    cu_q, cu_k = _cu([5, 70, 0, 9]), _cu([20, 3, 1, 64])
    off_q = off_k = None
    rows_q, rows_k, mq, mk = 84, 88, None, None
    if label == "past-buffer-q":
        rows_q = 80
    elif label == "before-buffer-k":
        off_k = np.array([-2, 20, 23, 24, 88], np.int32)
    elif label == "longer-than-max_seqlen-q":
        mq = 16
    else:
        mk = 10
    return cu_q, cu_k, off_q, off_k, rows_q, rows_k, mq, mk


def _case_error(label, where):
    """Host arrays: the array code's error at once. Device (`where == "device"`): the plan is
    built, and check_device_errors() raises that message."""
    from varlen import check_device_errors
    from varlen._setup import working_mask
    import varlen.backends.cupy.plan as _cupy_plan
    _install()
    _use_threads((2, 4))
    cu_q, cu_k, off_q, off_k, rows_q, rows_k, mq, mk = _error_layout(label)
    args = (cu_q, cu_k, off_q, off_k, rows_q, rows_k, working_mask("causal", 4, np))
    kw = dict(block_m=16, block_n=16, max_seqlen_q=mq, max_seqlen_k=mk)
    with pytest.raises(ValueError) as want:
        _plan_module().plan_from_cu_seqlens(*args, **kw)
    if where == "host":
        with pytest.raises(ValueError) as got:
            _cupy_plan.plan_from_cu_seqlens(*args, **kw)
        assert str(got.value) == str(want.value), f"{label}: {got.value!r} != {want.value!r}"
    else:
        _cupy_plan._on_host = lambda a: False           # flags of the device path
        check_device_errors()
        _cupy_plan.plan_from_cu_seqlens(*args, **kw)
        with pytest.raises(ValueError) as got:
            check_device_errors()
        assert str(got.value) == f"device metadata was invalid: {want.value}", (
            f"{label}: {got.value!r} does not report {want.value!r}")
        check_device_errors()                            # the check cleared the flags
    print(label, where, "->", want.value)


def _case_launches():
    """The CuPy backend's plan builders (from cu_seqlens, and of given segments) issue <= 2
    launches and write the plan of the array code; `varlen.plan` of host arrays and the array
    code itself launch nothing."""
    import varlen
    from varlen.backends import get
    emu = _install()
    _use_threads((4, 4))
    P = _plan_module()
    cu_q, cu_k, off_q, off_k, rows_q, rows_k, mask, (bm, bn), mq, mk, _ = _layout(
        "B5-ragged-gaps-mixed-16x8-maxlen")
    kw = dict(seq_offsets_q=off_q, seq_offsets_k=off_k, num_rows_q=rows_q, num_rows_k=rows_k,
              mask=mask, block_m=bm, block_n=bn, max_seqlen_q=mq, max_seqlen_k=mk)
    want = varlen.plan(cu_q, cu_k, **kw)               # host arrays: the array code
    assert not emu.launches, f"a host plan launched {dict(emu.launches)}"
    cupy_backend = get("cupy")
    counts = {}
    for name, build in [
            ("cupy backend, from cu_seqlens", lambda: cupy_backend.plan_from_cu_seqlens(
                cu_q, cu_k, off_q, off_k, rows_q, rows_k, mask, block_m=bm, block_n=bn,
                max_seqlen_q=mq, max_seqlen_k=mk)),
            ("cupy backend, of segments", lambda: cupy_backend.make_plan(
                want.q, want.k, mask, block_m=bm, block_n=bn, max_seqlen_q=mq,
                max_seqlen_k=mk))]:
        emu.launches.clear()
        got = build()
        counts[name] = dict(emu.launches)
        assert 1 <= _kernel_launches(emu.launches) <= 2, f"{name}: launches {counts[name]}"
        _assert_same_plan(name, got, want)
    emu.launches.clear()
    _assert_same_plan("arrays", P.build_plan(want.q, want.k, mask, block_m=bm, block_n=bn,
                                             max_seqlen_q=mq, max_seqlen_k=mk), want)
    assert not emu.launches, f"the array code launched {dict(emu.launches)}"
    print("launches per plan", counts)


def _case_step_launches():
    """Forward and both backward modes on a fused plan: launches per call, memsets and fills
    included, counted as a production call makes them (no NaN-filled test buffers)."""
    from varlen._array import set_nan_fill
    import varlen.backends.cupy.plan as _cupy_plan
    from varlen.backends.cupy import BACKEND
    from varlen.testing import make_batch
    emu = _install()
    rng = np.random.default_rng(5)
    b = make_batch(rng, [70, 1, 0, 33], [64, 5, 0, 90], Hq=2, Hk=1, D=64, dtype="float16",
                   mask="causal", gaps=True)
    plan = _cupy_plan.plan_from_cu_seqlens(b.cu_q, b.cu_k, b.off_q, b.off_k, b.q.shape[0],
                                           b.k.shape[0], _mask("causal", 4, rng), block_m=64,
                                           block_n=64)
    set_nan_fill(False)
    kw = dict(softmax_scale=0.125, softcap=0.0)
    emu.launches.clear()
    out, lse = BACKEND.forward(plan, b.q, b.k, b.v, **kw)
    counts = {"forward": dict(emu.launches)}
    assert sum(emu.launches.values()) == 1, f"forward: {counts['forward']}"
    for det in (False, True):
        emu.launches.clear()
        BACKEND.backward(plan, b.dout, b.q, b.k, b.v, out, lse, deterministic=det, **kw)
        counts[f"backward deterministic={det}"] = dict(emu.launches)
        assert sum(emu.launches.values()) == 3, f"backward ({det=}): {dict(emu.launches)}"
    print("launches per call", counts)


# --------------------------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------------------------

@needs_cxx
@pytest.mark.parametrize("label", [
    pytest.param(label, marks=pytest.mark.smoke if label == SMOKE else ())
    for label in cases(CASES, [SMOKE, "B0-empty-batch-pad-rows"])])
def test_fused_plan_equals_array_code(label):
    _emulate("layout", label)


@needs_cxx
@pytest.mark.parametrize("label", cases(["B40-many-mixed-4x4-maxlen-small-threads",
                                         "B300-many-mixed-16x8-shipped-threads"],
                                        ["B40-many-mixed-4x4-maxlen-small-threads"]))
def test_fused_plan_under_a_permuted_warp_schedule(label, monkeypatch):
    """Warps one at a time in a seeded order (the schedule that catches a removed barrier of
    the scan kernel, emulation/mutations.py): the same plan, with blocks of 8 threads
    (one partial warp, on which that schedule once waited for 32 lanes forever) and of the
    shipped sizes (several warps)."""
    monkeypatch.setenv("VARLEN_EMULATION_SCHEDULE", "random")
    monkeypatch.setenv("VARLEN_EMULATION_SEED", "1")
    _emulate("layout", label, timeout=180)


@needs_cxx
@pytest.mark.parametrize("label", cases(SEGMENT_CASES, SEGMENT_CASES[:1]))
def test_fused_plan_of_given_segments_equals_array_code(label):
    _emulate("segments", label)


@needs_cxx
@pytest.mark.parametrize("label, where", cases(
    [pytest.param(label, where, id=f"{label}-{where}") for where in ("host", "device")
     for label in ERROR_CASES], ["past-buffer-q-host", "longer-than-max_seqlen-k-device"]))
def test_fused_plan_reports_the_same_errors(label, where):
    _emulate("error", label, where)


@needs_cxx
def test_plan_takes_at_most_two_launches():
    _emulate("launches")


@needs_cxx
def test_forward_one_launch_backward_three():
    _emulate("step-launches")


def test_cases_are_adversarial():
    """The batches hold what the module docstring promises."""
    import varlen.backends.cupy.plan as _cupy_plan
    from varlen.plan import tile_bound
    seen = set()
    for label in CASES:
        cu_q, cu_k, off_q, _, rows_q, _, mask, (bm, _), mq, _, threads = _layout(label)
        scan, tiles = threads or (_cupy_plan.SCAN_THREADS, _cupy_plan.TILE_THREADS)
        L, B = np.diff(cu_q), len(cu_q) - 1
        seen |= {"empty batch"} if B == 0 else set()
        seen |= {"last empty"} if B and L[-1] == 0 else set()
        seen |= {"length 1"} if (L == 1).any() else set()
        seen |= {"lead gap"} if off_q is not None and off_q[0] > 0 else set()
        seen |= {"q != k"} if not np.array_equal(cu_q, cu_k) else set()
        seen |= {"max_seqlen" if mq is not None else "no max_seqlen"}
        seen |= {"ragged"} if (L % bm).any() else set()
        seen |= {"B > scan threads"} if B > scan else set()
        seen |= {"slots > tile threads"} if tile_bound(rows_q, B, bm, mq) > tiles else set()
        fields = [np.broadcast_to(f, B) for f in mask.fields()]
        for left, right, br in zip(*fields):
            seen.add(("causal" if (left, right) == (-1, 0) else "full" if (left, right) == (-1, -1)
                      else "window") + ("-br" if br else ""))
    want = {"empty batch", "last empty", "length 1", "lead gap", "q != k", "max_seqlen",
            "no max_seqlen", "ragged", "B > scan threads", "slots > tile threads", "causal",
            "full", "window", "causal-br", "window-br", "full-br"}
    assert want <= seen, f"missing: {want - seen}"


def test_struct_layout_matches_the_kernels():
    """PLAN_BUILD_DTYPE has the sizeof and offsetof of the C `PlanBuildParams`."""
    if shutil.which(CXX) is None:
        pytest.skip("needs a C++ compiler")
    import tempfile
    from varlen.backends.cupy.plan import PLAN_BUILD_DTYPE, PLAN_SIDE_DTYPE
    from emulation.cupy import EMULATION_DIR
    from varlen.kernels_cuda import SOURCE_DIR
    side = [f'std::printf("side %s %zu\\n", "{n}", offsetof(varlen::PlanSide, {n}));'
            for n in PLAN_SIDE_DTYPE.names]
    top = [f'std::printf("top %s %zu\\n", "{n}", offsetof(varlen::PlanBuildParams, {n}));'
           for n in PLAN_BUILD_DTYPE.names]
    src = ("#include <cstddef>\n#include <cstdio>\n#include \"plan_build.cuh\"\nint main() {\n"
           'std::printf("sizeof %zu %zu\\n", sizeof(varlen::PlanSide), '
           "sizeof(varlen::PlanBuildParams));\n" + "\n".join(side + top) + "\n}\n")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "layout.cpp")
        with open(path, "w") as f:
            f.write(src)
        subprocess.run([CXX, "-std=c++20", "-pthread", "-DVARLEN_HOST_EMULATION",
                        f"-I{SOURCE_DIR}", f"-I{EMULATION_DIR}", path, "-o",
                        os.path.join(d, "layout")], check=True)
        out = subprocess.run([os.path.join(d, "layout")], capture_output=True, text=True,
                             check=True).stdout.split("\n")
    sizes = out[0].split()
    assert (int(sizes[1]), int(sizes[2])) == (PLAN_SIDE_DTYPE.itemsize,
                                              PLAN_BUILD_DTYPE.itemsize), out[0]
    for line in out[1:]:
        if line:
            where, name, offset = line.split()
            dtype = PLAN_SIDE_DTYPE if where == "side" else PLAN_BUILD_DTYPE
            assert dtype.fields[name][1] == int(offset), f"{where}.{name}: C offset {offset}"


# --------------------------------------------------------------------------------------------
# On a GPU
# --------------------------------------------------------------------------------------------

def _on_device(cupy, args, mask):
    dev = [None if a is None or not isinstance(a, np.ndarray) else cupy.asarray(a)
           for a in args]
    from varlen.masks import Mask
    return dev, Mask(*(f if np.ndim(f) == 0 else cupy.asarray(f) for f in mask.fields()))


@pytest.mark.gpu
@pytest.mark.parametrize("label", list(CASES))
def test_fused_plan_on_gpu_equals_array_code(label, monkeypatch):
    cupy = pytest.importorskip("cupy")
    P = _plan_module()
    cu_q, cu_k, off_q, off_k, rows_q, rows_k, mask, (bm, bn), mq, mk, _ = _layout(label)
    (dq, dk, doq, dok), dmask = _on_device(cupy, (cu_q, cu_k, off_q, off_k), mask)
    kw = dict(block_m=bm, block_n=bn, max_seqlen_q=mq, max_seqlen_k=mk)
    got = P.plan_from_cu_seqlens(dq, dk, doq, dok, rows_q, rows_k, dmask, **kw)
    assert isinstance(got.q_tiles, cupy.ndarray)
    monkeypatch.setenv(P.PLAN_BUILDER_ENV, "arrays")
    arrays = P.plan_from_cu_seqlens(dq, dk, doq, dok, rows_q, rows_k, dmask, **kw)
    host = P.plan_from_cu_seqlens(cu_q, cu_k, off_q, off_k, rows_q, rows_k, mask, **kw)
    _assert_same_plan(f"{label} (CuPy array code)", got.to_host(), arrays.to_host())
    _assert_same_plan(f"{label} (NumPy)", got.to_host(), host)


@pytest.mark.gpu
@pytest.mark.parametrize("label", ERROR_CASES)
def test_fused_plan_on_gpu_defers_errors(label):
    cupy = pytest.importorskip("cupy")
    from varlen import check_device_errors
    from varlen._setup import working_mask
    P = _plan_module()
    cu_q, cu_k, off_q, off_k, rows_q, rows_k, mq, mk = _error_layout(label)
    kw = dict(block_m=16, block_n=16, max_seqlen_q=mq, max_seqlen_k=mk)
    mask = working_mask("causal", 4, np)
    with pytest.raises(ValueError) as want:
        P.plan_from_cu_seqlens(cu_q, cu_k, off_q, off_k, rows_q, rows_k, mask, **kw)
    (dq, dk, doq, dok), dmask = _on_device(cupy, (cu_q, cu_k, off_q, off_k), mask)
    check_device_errors()
    P.plan_from_cu_seqlens(dq, dk, doq, dok, rows_q, rows_k, dmask, **kw)
    with pytest.raises(ValueError) as got:
        check_device_errors()
    assert str(got.value) == f"device metadata was invalid: {want.value}"


# --------------------------------------------------------------------------------------------
# python tests/emulation/test_plan_device.py layout|segments LABEL, error LABEL host|device, launches,
# step-launches
# --------------------------------------------------------------------------------------------

def _main(argv):
    kind, *rest = argv
    {"layout": _case_layout, "segments": _case_segments, "error": _case_error,
     "launches": _case_launches, "step-launches": _case_step_launches}[kind](*rest)
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
