"""The sm_90a forward kernel (kernels_cuda/fwd_sm90.cuh): its NVRTC build for sm_90a (registers,
spills, shared memory) and its runs through the host emulation against the float64 reference on
small adversarial packed batches, one process per case (the emulation replaces `cupy`).

The kernel is persistent: the emulation's stand-in device has `EMULATED_SM_COUNT` (3) SMs, or
the `ctas` of a case, so each block loops over several (tile slot, head) work items; the cases
check that the launch had that many blocks."""
from __future__ import annotations

import math
import os
import shutil
import sys
import time

import numpy as np
import pytest

from helpers import assert_mutant_caught, needs_cxx, run_case_ok, run_mutated_case

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")

# label -> case. Lengths keep the work small: the emulation runs one OS thread per CUDA thread
# (256 or 384 per block here), block after block. `ctas`: the SMs of the stand-in device (one
# block each), EMULATED_SM_COUNT when absent.
CASES = {
    # zero-length sequences (the last one too), length 1, lengths off the tile, a pad gap with
    # NaN in it, causal
    "B4-fp16-D64-BM64-causal-gaps-nan": dict(
        lengths_q=[0, 1, 70, 0], lengths_k=[0, 1, 70, 0], Hq=2, Hk=1, D=64, dtype="float16",
        mask="causal", gaps=True, softcap=0.0, block_m=64, nan_in_pad=True),
    # per-sequence masks (full, causal, sliding window bottom-right), GQA 4:2, bf16
    "B3-bf16-D64-BM64-mixed-masks-gqa": dict(
        lengths_q=[5, 33, 17], lengths_k=[9, 33, 80], Hq=4, Hk=2, D=64, dtype="bfloat16",
        mask=("mixed",), gaps=True, softcap=0.0, block_m=64, nan_in_pad=True),
    # two consumer warpgroups, D = 128, three key tiles for one query tile (the ring wraps)
    "B2-bf16-D128-BM128-full-3tiles": dict(
        lengths_q=[3, 100], lengths_k=[150, 2], Hq=1, Hk=1, D=128, dtype="bfloat16",
        mask="full", gaps=True, softcap=0.0, block_m=128, nan_in_pad=True),
    # a NaN in a visible key of one sequence only, softcap, fp16 D = 128
    # (and as many blocks as work items: each block runs one, the grid a non-persistent one has)
    "B2-fp16-D128-BM64-softcap-nan-visible": dict(
        lengths_q=[20, 9], lengths_k=[65, 9], Hq=1, Hk=1, D=128, dtype="float16",
        mask="causal_bottom_right", gaps=False, softcap=5.0, block_m=64, nan_in_pad=False,
        nan_in_key=True, ctas=132),
    # key chunks of 128 (wgmma N = 128 for S), causal, a ragged last chunk
    "B2-bf16-D64-BM64-BN128-causal-gaps-nan": dict(
        lengths_q=[40, 90], lengths_k=[40, 150], Hq=1, Hk=1, D=64, dtype="bfloat16",
        mask="causal_bottom_right", gaps=True, softcap=0.0, block_m=64, block_n=128,
        nan_in_pad=True),
    # D = 256 (four boxes of 64 columns, wgmma N = 256 for P V), one consumer warpgroup
    "B3-fp16-D256-BM64-causal-gaps-nan": dict(
        lengths_q=[1, 0, 70], lengths_k=[1, 0, 70], Hq=2, Hk=1, D=256, dtype="float16",
        mask="causal", gaps=True, softcap=0.0, block_m=64, nan_in_pad=True),
    # the pipeline's prologue and epilogue: key chunks of 128 (pairs of the plan's 64-row key
    # tiles) numbering 1, 2, 3 and 6 per query tile, the last one a lone partial tile; two
    # consumer warpgroups in ping-pong; a query tile without keys; a NaN in the last key of a
    # sequence of its own (a partial chunk: the producer hands the NaN to the key's K row); a
    # tile whose last chunk is full (its V is waited for by the consumers alone)
    "B7-bf16-D64-BM128-chunks-1-2-3-6": dict(
        lengths_q=[3, 64, 129, 40, 0, 5, 10], lengths_k=[100, 200, 300, 700, 0, 70, 256],
        Hq=2, Hk=1, D=64, dtype="bfloat16", mask="full", gaps=True, softcap=0.0, block_m=128,
        nan_in_pad=True, nan_in_key=5),
    # sliding windows: in sequence 0 (20 keys back) the second chunk of a query tile is fully
    # masked for the first warpgroup's rows (P = 0 under a finite running max), the first
    # chunk for some rows of the second (their max stays -inf into the pipeline); sequence 1
    # (200 keys back, bottom-right) has three chunks, partial at both ends
    "B2-fp16-D64-BM128-window-masked-chunks": dict(
        lengths_q=[400, 30], lengths_k=[400, 290], Hq=1, Hk=1, D=64, dtype="float16",
        mask=("window",), gaps=True, softcap=0.0, block_m=128, nan_in_pad=True),
    # zero-length and length-1 sequences, GQA 2:1, a softcap, and a NaN in the one key of
    # sequence 1 (its query turns NaN, no other sequence does); D = 128, two warpgroups
    "B5-fp16-D128-BM128-gqa-softcap-nan-key": dict(
        lengths_q=[0, 1, 90, 140, 1], lengths_k=[0, 1, 300, 150, 0], Hq=2, Hk=1, D=128,
        dtype="float16", mask="causal_bottom_right", gaps=True, softcap=5.0, block_m=128,
        nan_in_pad=True, nan_in_key=True),
    # The persistent loop. Two blocks over 2 x 3 heads of tiles with 1, 3 and 2 key chunks
    # (pairs of 64-row tiles; the K/V ring's stages and phases run on across items, so items
    # of odd chunk counts wrap it mid-item), zero-length and length-1 sequences, a slot whose
    # tile has no keys, a gap after the last sequence (pad rows written by the blocks before
    # their items, NaN in every row outside a sequence), GQA 3:1 (a block's items alternate
    # over the heads of a slot: the next item's Q is another head's), mixed per-sequence masks,
    # two consumer warpgroups in ping-pong (the turn restarts per item)
    "P6-bf16-D64-BM128-2ctas-gqa-mixed": dict(
        lengths_q=[130, 1, 0, 70, 5, 40], lengths_k=[300, 1, 20, 150, 0, 200], Hq=3, Hk=1,
        D=64, dtype="bfloat16", mask=("mixed",), gaps=True, softcap=0.0, block_m=128,
        nan_in_pad=True, ctas=2),
    # one consumer warpgroup, D = 128 under a softcap, fp16, a NaN in a key of sequence 2 seen
    # by some of its queries, GQA 2:1, three blocks over 18 items (6 of unused slots)
    "P5-fp16-D128-BM64-3ctas-softcap-nan-key": dict(
        lengths_q=[100, 0, 64, 1, 90], lengths_k=[140, 3, 64, 1, 200], Hq=2, Hk=1, D=128,
        dtype="float16", mask="causal_bottom_right", gaps=True, softcap=5.0, block_m=64,
        nan_in_pad=True, nan_in_key=2, ctas=3),
    # D = 256 (chunks of 64 keys: 1 to 5 per tile), two blocks, GQA 2:1
    "P4-bf16-D256-BM64-2ctas-causal": dict(
        lengths_q=[130, 1, 0, 60], lengths_k=[250, 1, 0, 60], Hq=2, Hk=1, D=256,
        dtype="bfloat16", mask="causal_bottom_right", gaps=True, softcap=0.0, block_m=64,
        nan_in_pad=True, ctas=2),
    # GQA packing (`pack` query heads of one key head per position, the plan's query tiles
    # block_m / pack rows; "auto": the launcher's choice, `expect_pack`). Decoding-like: one to
    # three queries per sequence against up to 200 keys, GQA 8:2 packed by 4 (two consumer
    # warpgroups, 32 positions per tile), a zero-length sequence, NaN in every row outside a
    # sequence and in one visible key, bottom-right causal
    "G6-fp16-D64-BM128-pack4-decode-nan-key": dict(
        lengths_q=[1, 1, 0, 3, 2, 1], lengths_k=[50, 130, 0, 3, 200, 1], Hq=8, Hk=2, D=64,
        dtype="float16", mask="causal_bottom_right", gaps=True, softcap=0.0, block_m=128,
        nan_in_pad=True, nan_in_key=4, pack="auto", expect_pack=4),
    # packed by 2 at D = 128 (one consumer warpgroup, tiles of 32 positions: rows g and g + 8
    # 4 positions apart), per-sequence full / causal / sliding masks over sequences longer than
    # a tile, a softcap
    "G4-bf16-D128-BM64-pack2-mixed-softcap": dict(
        lengths_q=[5, 70, 17, 45], lengths_k=[9, 70, 80, 100], Hq=4, Hk=2, D=128,
        dtype="bfloat16", mask=("mixed",), gaps=True, softcap=5.0, block_m=64, nan_in_pad=True,
        pack=2),
    # packed by 8 (GQA 8:1, tiles of 16 positions: rows g and g + 8 one position apart), causal
    # top-left with sequences of 1 to 3 tiles, two blocks of the persistent loop
    "G4-bf16-D64-BM128-pack8-causal-2ctas": dict(
        lengths_q=[20, 7, 1, 40], lengths_k=[20, 7, 1, 40], Hq=8, Hk=1, D=64,
        dtype="bfloat16", mask="causal", gaps=True, softcap=0.0, block_m=128, nan_in_pad=True,
        pack=8, ctas=2),
}
# the pipeline's case: two warpgroups, 1 to 6 chunks, partial chunks with NaN in their boxes,
# 16 work items (2 of an unused slot) over 3 blocks
PIPELINE = "B7-bf16-D64-BM128-chunks-1-2-3-6"
# the persistent loop's case: 21 work items (3 of an unused slot) over 2 blocks
PERSISTENT = "P6-bf16-D64-BM128-2ctas-gqa-mixed"
PACKED = "G6-fp16-D64-BM128-pack4-decode-nan-key"
QUICK = ["B4-fp16-D64-BM64-causal-gaps-nan", PERSISTENT, PACKED]


def _mask(spec, B):
    import varlen
    if spec == ("window",):
        # sliding windows of 20 keys (top-left aligned) and 200 keys (bottom-right aligned)
        return varlen.Mask(window_left=np.array([20, 200] * B, np.int32)[:B],
                           window_right=np.zeros(B, np.int32),
                           bottom_right=np.array([0, 1] * B, np.int32)[:B])
    if spec != ("mixed",):
        return spec
    left = np.array([-1, -1, 7] * B, np.int32)[:B]
    right = np.array([-1, 0, 0] * B, np.int32)[:B]
    bottom = np.array([0, 0, 1] * B, np.int32)[:B]
    return varlen.Mask(window_left=left, window_right=right, bottom_right=bottom)


def run_case(label: str, device: bool = False) -> float:
    """Runs one case through the emulated sm_90a kernel (on a Hopper GPU with `device`, float16
    cases only); raises AssertionError on a mismatch. Returns the seconds the forward took."""
    import varlen
    import emulation.cupy as _cupy_emulation
    import emulation.sm90
    import varlen.backends.cupy.sm90 as _cupy_sm90
    from varlen.testing import assert_close, assert_lse, make_batch, naive_same_dtype
    c = dict(CASES[label])
    nan_in_pad, nan_in_key = c.pop("nan_in_pad"), c.pop("nan_in_key", False)
    block_m, block_n = c["block_m"], c.pop("block_n", 64)
    ctas = c.pop("ctas", emulation.sm90.EMULATED_SM_COUNT)
    pack, expect_pack = c.pop("pack", 1), c.pop("expect_pack", None)
    if not device:
        _cupy_emulation.install_fake_cupy(block_m)
        rt = emulation.sm90.EmulatedRuntime(sm_count=ctas)
        _cupy_sm90.use_runtime(rt)
    rng = np.random.default_rng(0)
    mask = _mask(c["mask"], len(c["lengths_q"]))
    b = make_batch(rng, c["lengths_q"], c["lengths_k"], Hq=c["Hq"], Hk=c["Hk"], D=c["D"],
                   dtype=c["dtype"], mask=mask, gaps=c["gaps"])
    if nan_in_pad:
        # every row outside a sequence (pad gaps, rows past the last one) holds NaN: a TMA box
        # that reads them must not let them reach a visible score or a P V product
        from varlen.testing import covered_rows
        rows_k = covered_rows(b, "k")
        b.k[~rows_k] = np.nan
        b.v[~rows_k] = np.nan
        b.q[~covered_rows(b, "q")] = np.nan
    if nan_in_key:
        # the last key of sequence 1 (or of the one named): only its queries that see it turn
        # NaN
        i = 1 if nan_in_key is True else nan_in_key
        start = int(b.cu_k[i] if b.off_k is None else b.off_k[i])
        last = start + int(b.cu_k[i + 1] - b.cu_k[i]) - 1
        b.v[last, 0, 3] = np.nan
    plan = varlen.plan(b.cu_q, b.cu_k, seq_offsets_q=b.off_q, seq_offsets_k=b.off_k,
                       mask=b.mask, num_rows_q=b.q.shape[0], num_rows_k=b.k.shape[0],
                       block_m=block_m, block_n=block_n)
    scale = 1.0 / math.sqrt(c["D"])
    q, k, v = b.q, b.k, b.v
    if device:
        import cupy
        q, k, v = cupy.asarray(q), cupy.asarray(k), cupy.asarray(v)
    t0 = time.perf_counter()
    chosen = None if pack == "auto" else pack
    if pack == "auto":
        pack = _cupy_sm90.pack_for(plan, q.shape[0], c["Hq"], c["Hk"], block_m)
        assert pack == expect_pack, (label, pack, expect_pack)
    out, lse = _cupy_sm90.forward(plan, q, k, v, softmax_scale=scale, softcap=c["softcap"],
                                  pack=chosen)
    if device:
        cupy.cuda.Device().synchronize()
        out, lse = cupy.asnumpy(out), cupy.asnumpy(lse)
    seconds = time.perf_counter() - t0
    if not device:
        # one launch of min(work items, SMs) blocks: with fewer SMs than items, blocks loop;
        # packed, over the plan of block_m / pack query rows, a work item per group of heads
        kplan = _cupy_sm90.packed_plan(plan, pack)
        assert kplan.block_m == block_m // pack, (label, kplan.block_m)
        items = kplan.num_q_tiles * (c["Hq"] // pack)
        assert rt.grids == [(max(1, min(items, ctas)), 1)], (label, rt.grids, items)
    want_out, want_lse = b.ref_forward(softmax_scale=scale, softcap=c["softcap"])
    want_out, want_lse = np.asarray(want_out), np.asarray(want_lse)
    got_out = np.asarray(out).astype(np.float64)
    got_lse = np.asarray(lse).astype(np.float64)
    # rows whose expected value is NaN must be NaN, the rest compared with the tolerances
    bad_out = np.isnan(want_out)
    bad_lse = np.isnan(want_lse)
    assert np.array_equal(np.isnan(got_out), bad_out), (
        f"{label}: NaN pattern of out differs: {int(np.isnan(got_out).sum())} NaN, "
        f"{int(bad_out.sum())} expected")
    assert np.array_equal(np.isnan(got_lse), bad_lse), (
        f"{label}: NaN pattern of lse differs: {int(np.isnan(got_lse).sum())} NaN, "
        f"{int(bad_lse.sum())} expected")
    naive_out = naive_same_dtype(b, softmax_scale=scale, softcap=c["softcap"])
    # (the naive computation lets a NaN value row reach the rows that hide it: 0 x NaN)
    naive_ok = np.isfinite(naive_out) & ~bad_out
    naive_err = float(np.max(np.abs(naive_out - want_out)[naive_ok], initial=0.0))
    assert_close(f"{label} out", np.where(bad_out, 0.0, got_out), np.where(bad_out, 0.0, want_out),
                 dtype=c["dtype"], naive_err=naive_err)
    assert_lse(f"{label} lse", np.where(bad_lse, 0.0, got_lse), np.where(bad_lse, 0.0, want_lse),
               dtype=c["dtype"])
    return seconds


def _run(label, env=None):
    return run_case_ok("test_sm90_forward", label, env)


@needs_cxx
@pytest.mark.parametrize("label", QUICK)
def test_sm90_forward_on_host_emulation_quick(label):
    _run(label)


@pytest.mark.slow
@needs_cxx
@pytest.mark.parametrize("label", [k for k in CASES if k not in QUICK])
def test_sm90_forward_on_host_emulation(label):
    _run(label)


def _specs():
    """The default key chunk (128 at D <= 128, 64 at D = 256) over plans of 64- and 128-row key
    tiles, every dtype, D, BM and softcap; chunks of 64 at D <= 128 for comparison; query heads
    packed by 2, 4 and 8 under a softcap."""
    from varlen.backends.cupy.sm90 import FwdSpec as Sm90Spec
    return ([Sm90Spec(dt, d, bm, 64, sc) for dt in ("float16", "bfloat16") for d in (64, 128)
             for bm in (64, 128) for sc in (False, True)] +
            [Sm90Spec("bfloat16", d, bm, 128, sc) for d in (64, 128) for bm in (64, 128)
             for sc in (False, True)] +
            [Sm90Spec(dt, 256, 64, 64, sc) for dt in ("float16", "bfloat16")
             for sc in (False, True)] +
            [Sm90Spec("bfloat16", 256, 64, 128, False)] +
            [Sm90Spec("bfloat16", d, bm, 64, False, key_chunk=64) for d in (64, 128)
             for bm in (64, 128)] +
            [Sm90Spec("bfloat16", d, bm, 64, True, pack=p) for d in (64, 128) for bm in (64, 128)
             for p in (2, 4, 8)] +
            [Sm90Spec("float16", 256, 64, 64, True, pack=2)])


def test_sm90_spec_rejects_what_the_kernel_does_not_take():
    from varlen.backends.cupy.sm90 import FwdSpec as Sm90Spec
    for bad in (dict(dtype="float32"), dict(head_dim=96), dict(block_m=32), dict(block_n=32),
                dict(head_dim=256, block_m=128),      # 259 KiB of shared memory
                dict(head_dim=256, key_chunk=128),    # 322 KiB
                dict(block_n=128, key_chunk=256), dict(key_chunk=32), dict(pack=3),
                dict(pack=16)):
        kw = {**dict(dtype="bfloat16", head_dim=64, block_m=64, block_n=64, softcap=False), **bad}
        with pytest.raises(ValueError):
            Sm90Spec(**kw)


def test_sm90_forward_compiles_for_sm90a_within_budget():
    pytest.importorskip("cuda.bindings.nvrtc", reason="needs cuda-bindings (NVRTC)")
    from varlen.backends.cupy.sm90 import OPTIN_SMEM, compile_report
    report = compile_report(_specs())
    for name, u in report.items():
        print(f"{name}: {u['registers']} registers at entry, {u['threads']} threads, "
              f"{u['smem']} B shared, spills {u['spill_stores']}/{u['spill_loads']}")
        assert u["spill_stores"] == 0 and u["spill_loads"] == 0, f"{name} spills: {u}"
        assert u["registers"] * u["threads"] <= 65536, f"{name}: registers exceed an SM: {u}"
        assert u["smem"] + u["static_smem"] <= OPTIN_SMEM, f"{name}: shared memory {u}"
        assert not u["warnings"], f"{name}: ptxas warnings (setmaxnreg ignored?) {u['warnings']}"


def test_sm90_gqa_packing_is_chosen_where_it_fills_the_tiles():
    """`choose_pack` doubles the heads packed per position while the estimated fill of the
    tiles' rows grows by PACK_GAIN: decoding (one query per sequence) packs as far as the group
    and MAX_PACK allow, long sequences not at all, lengths in between part way; `pack_for`
    refuses a pack that does not divide the group or the tile."""
    import types
    from varlen.backends.cupy.sm90 import MAX_PACK, choose_pack, pack_for, row_fill
    assert MAX_PACK == 8
    assert row_fill(64, 64, 128) == 1 / 128 and row_fill(0, 3, 128) == 1.0
    # 64 sequences of 128 rows: 64 + 64 x 127 / 256 = 95.75 tiles expected (lengths unknown)
    assert row_fill(64 * 128, 64, 128) == 64 * 128 / (95.75 * 128)
    assert row_fill(64 * 128, 64, 128) < row_fill(64 * 128, 64, 64) < 1
    for group, want in ((1, 1), (2, 2), (3, 1), (4, 4), (6, 2), (8, 8), (16, 8)):
        assert choose_pack(64, 64, group, 128) == want, (group, want)   # 64 one-row sequences
    assert choose_pack(64, 64, 8, 64) == 8
    # 8 sequences of mean length L, GQA 8:1, 128-row tiles: estimated fill by pack 1, 2, 4, 8
    assert choose_pack(8 * 8192, 8, 8, 128) == 1          # 0.99 -> 1.00
    assert choose_pack(8 * 1000, 8, 8, 128) == 1          # 0.94 -> 0.97: < 10 %
    assert choose_pack(8 * 300, 8, 8, 128) == 1           # 0.83 -> 0.91: 9.7 %
    assert choose_pack(8 * 200, 8, 8, 128) == 2           # 0.76 -> 0.86 -> 0.93: 7 %
    assert choose_pack(8 * 100, 8, 8, 128) == 4           # 0.61 -> 0.76 -> 0.87 -> 0.93: 7 %
    plan = types.SimpleNamespace(batch=64, q=types.SimpleNamespace(per_seq=1))
    assert pack_for(plan, 64, 8, 2, 128) == 4
    assert pack_for(plan, 64, 8, 2, 128, pack=2) == 2
    for bad in (3, 8, 16, 0):
        with pytest.raises(ValueError, match="packed per position"):
            pack_for(plan, 64, 8, 2, 128, pack=bad)


def test_sm90_cubins_are_kept_on_disk_between_processes(tmp_path, monkeypatch):
    """`cubin_path` builds a kernel's cubin once into the cache folder and serves it after that
    without NVRTC; other build options (a kernel source changed: they carry its hash) make
    another key. `warm` builds in worker processes; `dispatched_specs` lists every variant the
    backend can run under VARLEN_CUPY_PATH=sm90a with its default tiles, packs included."""
    pytest.importorskip("cuda.bindings.nvrtc", reason="needs cuda-bindings (NVRTC)")
    import varlen.backends.cupy.compile as _cupy_compile
    import varlen.backends.cupy.sm90 as _cupy_sm90
    from varlen.backends.cupy.compile import CACHE_ENV, cubin_path
    from varlen.backends.cupy.sm90 import FwdSpec as Sm90Spec, dispatched_specs
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    specs = dispatched_specs()
    names = [s.name for s in specs]
    assert len(names) == len(set(names)) == 72
    assert {s.pack for s in specs if isinstance(s, Sm90Spec)} == {1, 2, 4, 8}
    assert _cupy_sm90.warm(2, specs[:2]) == 2
    assert len(list(tmp_path.glob("*.cubin"))) == 2
    path, lowered = cubin_path(names[0])
    assert path.startswith(str(tmp_path)) and lowered.startswith("_Z15varlen_fwd_sm90")
    with open(path, "rb") as f:
        assert f.read(4) == b"\x7fELF"

    def no_build(*a, **k):
        raise AssertionError("built again")
    monkeypatch.setattr(_cupy_compile, "build_program", no_build)
    assert cubin_path(names[0]) == (path, lowered)
    options = _cupy_compile.program_options
    monkeypatch.setattr(_cupy_compile, "program_options", lambda arch: [*options(arch), "-DX"])
    with pytest.raises(AssertionError, match="built again"):
        cubin_path(names[0])


def test_sm90_tensor_map_arguments_are_what_the_driver_bindings_take():
    """The launcher's arguments of cuTensorMapEncodeTiled go through cuda-bindings' conversion
    (plain ints in its lists are a TypeError there); on this machine the call then stops only
    for want of a driver, on a GPU it returns a map."""
    cu = pytest.importorskip("cuda.bindings.driver", reason="needs cuda-bindings")
    import types
    from varlen.backends.cupy.sm90 import encode_args
    for dtype, heads, box_heads in (("float16", 8, 4), ("bfloat16", 2, 1)):
        a = types.SimpleNamespace(shape=(1000, heads, 128), dtype=types.SimpleNamespace(
            name=dtype, itemsize=2), data=types.SimpleNamespace(ptr=1 << 20))
        args = encode_args(a, 128 // box_heads, box_heads)
        assert [int(x) for x in args[3]] == [128, heads, 1000]
        assert [int(x) for x in args[4]] == [256, heads * 256]
        assert [int(x) for x in args[5]] == [64, box_heads, 128 // box_heads]
        try:
            err, _ = cu.cuTensorMapEncodeTiled(*args)
        except TypeError:
            raise
        except Exception as e:          # no driver library here
            assert "cuda" in str(e).lower(), e
        else:
            assert isinstance(err, cu.CUresult)


def test_sm90_persistent_grid_is_one_block_per_sm_at_most():
    """The persistent forward's grid: one block per work item up to one per SM, at least one
    (the blocks also write the pad rows); the emulation's stand-in device has few SMs, so that
    its blocks loop."""
    from emulation.sm90 import EMULATED_SM_COUNT, EmulatedRuntime
    from varlen.backends.cupy.sm90 import CTAS_PER_SM, persistent_grid
    assert CTAS_PER_SM == 1
    assert persistent_grid(0, 132) == 1
    assert persistent_grid(7, 132) == 7
    assert persistent_grid(5000, 132) == 132
    assert persistent_grid(5000, 132) * CTAS_PER_SM <= 132
    assert EmulatedRuntime().sm_count() == EMULATED_SM_COUNT <= 4
    assert EmulatedRuntime(sm_count=2).sm_count() == 2


def test_sm90_runtime_reads_the_sm_count_of_the_device_once(monkeypatch):
    """The GPU runtime sizes the persistent grid from the device's MultiProcessorCount, read
    once per device (CuPy's `Device.attributes` queries every attribute)."""
    import types
    from varlen.backends.cupy.sm90 import Runtime
    reads = []

    class Device:
        def __init__(self):
            self.id = 0

        @property
        def attributes(self):
            reads.append(self.id)
            return {"MultiProcessorCount": 132}

    monkeypatch.setitem(sys.modules, "cupy",
                        types.SimpleNamespace(cuda=types.SimpleNamespace(Device=Device)))
    rt = Runtime()
    assert rt.sm_count() == 132 and rt.sm_count() == 132
    assert reads == [0]


def test_sm90_key_chunk_is_128_where_it_fits():
    """Chunks of 128 keys by default at D 64 and 128 (pairs of the CuPy backend's 64-row key
    tiles), 64 at D 256, whose 128-key stages would not fit."""
    from varlen.backends.cupy.sm90 import OPTIN_SMEM, FwdSpec as Sm90Spec
    for d, bm in ((64, 64), (64, 128), (128, 64), (128, 128)):
        spec = Sm90Spec("bfloat16", d, bm, 64, False)
        assert spec.key_chunk == 128 and spec.smem <= OPTIN_SMEM, f"D{d} BM{bm}: {spec}"
    assert Sm90Spec("bfloat16", 256, 64, 64, False).key_chunk == 64
    with pytest.raises(ValueError, match="shared memory"):
        Sm90Spec("bfloat16", 256, 64, 64, False, key_chunk=128)


@pytest.mark.slow
@needs_cxx
@pytest.mark.parametrize("label", [QUICK[0], PIPELINE])
def test_sm90_forward_under_thread_sanitizer(label):
    """Built with ThreadSanitizer, copies landing and wgmma operands read at random points: the
    mbarrier protocol (q_full, k_full, v_full, ready, k_empty, v_empty) must order every
    shared-memory access of the producer warpgroup, the TMA copies and the consumers' wgmmas
    (a race stops the run)."""
    import emulation.cupy as _cupy_emulation
    env = dict(LD_PRELOAD=_cupy_emulation.tsan_runtime(), TSAN_OPTIONS=_cupy_emulation.TSAN_OPTIONS,
               VARLEN_EMULATION_RACE="1", OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    assert "ok" in _run(label, env)


@needs_cxx
@pytest.mark.parametrize("label, schedule, seed", [
    (PIPELINE, "random", "1"),
    pytest.param(PIPELINE, "issue", "0", marks=pytest.mark.slow),
    pytest.param(PIPELINE, "random", "2", marks=pytest.mark.slow),
    pytest.param(PERSISTENT, "issue", "0", marks=pytest.mark.slow),
    pytest.param(PERSISTENT, "random", "1", marks=pytest.mark.slow),
    pytest.param(PACKED, "random", "1", marks=pytest.mark.slow),
], ids=["random-1", "issue-0", "random-2", "persistent-issue-0", "persistent-random-1",
        "packed-random-1"])
def test_sm90_forward_under_landing_schedules(label, schedule, seed):
    """The pipeline's and the persistent loop's cases with TMA copies landing, and wgmma
    operands read, at issue or at seeded random points between issue and the wait that needs
    them (the default is the latest moment): a release or a wait out of place changes what a
    wgmma reads. (The one-warp-at-a-time schedule cannot run warpgroup collectives or mbarrier
    waits: docs/hopper.md, "What it does not model".)"""
    assert "ok" in _run(label, dict(VARLEN_EMULATION_SCHEDULE=schedule,
                                    VARLEN_EMULATION_SEED=seed))


# Mutations of fwd_sm90.cuh that the cases above must catch: (old, new, case, what the failure
# says). Each is compiled from a mutated copy of the kernel sources (VARLEN_EMULATION_SOURCE_DIR).
MUTATIONS = {
    "no-v-row-zeroing": ("        if (r < rows && !bad) continue;", "        continue;",
                         QUICK[0], "NaN pattern of out differs"),
    "no-mask": ("query_rows_mask<Cfg::PACK>(pol, tile.pos, w, c)",
                "query_rows_mask<Cfg::PACK>(pol, tile.pos, w, full_chunk(c))",
                "B3-bf16-D64-BM64-mixed-masks-gqa", "differs"),
    # GQA packing: a packed row's mask taken at position row (not row / pack), its output
    # written as an unpacked tile's
    "pack-mask-by-row": ("query_rows_mask<Cfg::PACK>(pol, tile.pos, w, c)",
                         "query_rows_mask<1>(pol, tile.pos, w, c)",
                         "G4-bf16-D128-BM64-pack2-mixed-softcap", "max abs error"),
    "pack-store-unpacked": ("tile_output<T, D, Cfg::PACK>(", "tile_output<T, D, 1>(", PACKED,
                            "differs"),
    # the producer refills a V stage the consumers still read: the barrier phases go wrong,
    # reported at an mbarrier, or as a deadlock of the ping-pong's turn when a consumer holding
    # the turn waits for a v_full phase that never comes (V is waited for inside the turn)
    "no-v-empty-wait": ("    sm90::mbar_wait(sm.v_empty(s), parity ^ 1u);\n", "",
                        PIPELINE, ("mbarrier", "(a deadlock?)")),
    "no-deferred-rescale": ("            rescale(acc_o, corr);\n", "", PIPELINE, "max abs error"),
    # the persistent loop: the next item's Q loaded over the one the consumers still read
    "no-q-empty-wait": ("            sm90::mbar_wait(sm.q_empty(), ring.q_parity() ^ 1u);\n", "",
                        PERSISTENT, "mbarrier"),
    # the ring restarted at stage 0, round 0 for every item (on both sides)
    "ring-reset-per-item": ("void next_item() { ++item; }",
                            "void next_item() { ++item; chunk = 0; }", PERSISTENT, "mbarrier"),
    # Q's phase taken as the first item's for every item (on both sides)
    "q-phase-reset-per-item": ("        return static_cast<uint32_t>(item) & 1u;",
                               "        return 0u;", PERSISTENT, "mbarrier"),
}


@pytest.mark.slow
@needs_cxx
@pytest.mark.parametrize("name", list(MUTATIONS))
def test_sm90_forward_mutation_is_caught(name, tmp_path):
    from varlen.kernels_cuda import SOURCE_DIR
    old, new, label, says = MUTATIONS[name]
    src = tmp_path / "kernels_cuda"
    shutil.copytree(SOURCE_DIR, src)
    path = src / "fwd_sm90.cuh"
    text = path.read_text()
    assert old in text, f"{name}: the mutated line is not in fwd_sm90.cuh"
    if name == "no-mask":
        text = text.replace("// One consumer warpgroup", "__device__ __forceinline__ Chunk "
                            "full_chunk(Chunk c) { c.full = true; return c; }\n\n"
                            "// One consumer warpgroup", 1)
    path.write_text(text.replace(old, new))
    assert_mutant_caught(run_mutated_case("test_sm90_forward", label, src), name, label, says)


# Representative synchronisation sites of fwd_sm90.cuh for CI, by what marks their call: the
# wait that retires S while P V stays in flight, the ping-pong's bar.sync, the producer's wait
# for a K stage's release, the fence that publishes the sanitised rows to the async proxy (an
# operand store no fence published), the consumers' wait for them (a wgmma reading a fenced
# store without having synchronised with the fence). The full sweep:
# emulation/mutations.py, or tests/test_emulation_strict.py with
# VARLEN_EMULATION_MUTATIONS=all.
CI_SITES = {"wgmma-wait-1": "wgmma_wait<1>", "pingpong-sync": "named_bar_sync",
            "k-empty-wait": "k_empty(s)", "proxy-fence": "fence_proxy_async",
            "ready-wait": "ready(n % STAGES)"}
# (the fence's check also has a harness test, tests/test_emulation_sm90.py: slow here)
SLOW_CI_SITES = {"proxy-fence"}


@needs_cxx
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_CI_SITES
                                  else n for n in CI_SITES])
def test_sm90_removed_synchronisation_is_caught(name):
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import emulation.mutations as emulation_mutations
    chosen = [s for s in emulation_mutations.sites()
              if s[0] == "fwd_sm90.cuh" and CI_SITES[name] in s[2]]
    assert len(chosen) == 1, f"{name}: one site expected (kernel rewritten?): {chosen}"
    by, seconds = emulation_mutations.check(chosen[0], timeout=900)
    assert by is not None, f"removing {emulation_mutations.site_id(chosen[0])} went unnoticed"


@pytest.mark.gpu
@pytest.mark.parametrize("label", [k for k, c in CASES.items() if c["dtype"] == "float16"])
def test_sm90_forward_on_hopper(label):
    """The float16 cases on a Hopper GPU: the NVRTC cubin through CuPy, tensor maps from the
    driver (bfloat16 needs the 16-bit-pattern path of the CuPy backend's adapters)."""
    cupy = pytest.importorskip("cupy")
    pytest.importorskip("cuda.bindings.driver", reason="needs cuda-bindings (tensor maps)")
    if cupy.cuda.Device().compute_capability != "90":
        pytest.skip("needs an sm_90 GPU")
    run_case(label, device=True)


if __name__ == "__main__":
    # python tests/test_sm90_forward.py LABEL ...: the cases in this process, in the emulation
    # mode of the environment (emulation/mutations.py runs them on mutated kernels)
    for name in sys.argv[1:]:
        print("ok", name, f"{run_case(name):.1f} s", flush=True)
