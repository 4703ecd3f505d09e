"""The sm_90a backward kernel (kernels_cuda/bwd_sm90.cuh) with its launcher: its NVRTC build for
sm_90a (registers, spills, shared memory) and its runs through the host emulation against the
float64 reference on small adversarial packed batches, one process per case (the emulation
replaces `cupy`)."""
from __future__ import annotations

import hashlib
import math
import os
import re
import shutil
import sys
import time

import numpy as np
import pytest

from helpers import assert_mutant_caught, needs_cxx, run_case_ok, run_mutated_case


# label -> case. Lengths keep the grids to a few CTAs: the emulation runs one OS thread per CUDA
# thread (256 or 384 per block here). `nan_in_pad`: every row outside a sequence holds NaN;
# `nan_k` / `nan_q` / `nan_dout`: (sequence, row inside it) of a NaN in k / q / dout (in q after
# the forward, so that out and lse of the row are finite).
CASES = {
    # zero-length sequences (the last one too), length 1, lengths off the tile, a pad gap with
    # NaN in it, causal; two query heads of one key head: four query chunks for the first key
    # tile of the long sequence (the two-stage ring wraps twice)
    "B4-fp16-D64-BN64-causal-gaps-nan": dict(
        lengths_q=[0, 1, 70, 0], lengths_k=[0, 1, 70, 0], Hq=2, Hk=1, D=64, dtype="float16",
        mask="causal", gaps=True, softcap=0.0, block_m=64, block_n=64, nan_in_pad=True),
    # per-sequence masks (full, causal, sliding window bottom-right), GQA 4:2, bf16
    "B3-bf16-D64-BN64-mixed-masks-gqa": dict(
        lengths_q=[5, 33, 17], lengths_k=[9, 33, 80], Hq=4, Hk=2, D=64, dtype="bfloat16",
        mask=("mixed",), gaps=True, softcap=0.0, block_m=64, block_n=64, nan_in_pad=True),
    # softcap, D = 128, a NaN in a key of sequence 1 that only its last query sees, and NaN in
    # a q row and a dout row of sequence 0 (a partial chunk): nothing else may turn NaN
    "B2-fp16-D128-BN64-softcap-nan-k-q-dout": dict(
        lengths_q=[20, 9], lengths_k=[65, 9], Hq=1, Hk=1, D=128, dtype="float16",
        mask="causal_bottom_right", gaps=False, softcap=5.0, block_m=64, block_n=64,
        nan_in_pad=False, nan_k=(1, 8), nan_q=(0, 3), nan_dout=(0, 5)),
    # two consumer warpgroups (BN = 128), D = 128, plan tiles of 128 queries (two chunks each),
    # GQA 2:1: four chunks per key tile
    "B2-bf16-D128-BN128-full-gqa": dict(
        lengths_q=[100, 3], lengths_k=[150, 2], Hq=2, Hk=1, D=128, dtype="bfloat16",
        mask="full", gaps=True, softcap=0.0, block_m=128, block_n=128, nan_in_pad=True),
    # BN = 128 with D = 64, causal bottom-right, a ragged last key tile
    "B2-bf16-D64-BN128-causal-gaps-nan": dict(
        lengths_q=[40, 90], lengths_k=[40, 150], Hq=1, Hk=1, D=64, dtype="bfloat16",
        mask="causal_bottom_right", gaps=True, softcap=0.0, block_m=64, block_n=128,
        nan_in_pad=True),
    # deterministic dQ: three key tiles meet each query tile of the long sequence (ranks 0-2,
    # sequence 1's tiles after sequence 0's slots), two consumer warpgroups hand each column
    # slice over, GQA 2:1 (the chunks of two query heads per key tile), a softcap
    "B3-fp16-D64-BN128-deterministic-gqa": dict(
        lengths_q=[30, 130, 0], lengths_k=[20, 300, 5], Hq=2, Hk=1, D=64, dtype="float16",
        mask="full", gaps=True, softcap=5.0, block_m=128, block_n=128, nan_in_pad=True,
        deterministic=True),
    # two consumer warpgroups at D = 128 (BN = 128) split dQ's columns, each over the dS of the
    # whole key tile (one reduction per dQ element and chunk), in the ordered mode: three key
    # tiles meet the long sequence's query tiles; a softcap, GQA 2:1, NaN in a key, a q row
    # and a dout row
    "B3-bf16-D128-BN128-deterministic-softcap-nan": dict(
        lengths_q=[30, 130, 0], lengths_k=[20, 300, 5], Hq=2, Hk=1, D=128, dtype="bfloat16",
        mask="full", gaps=True, softcap=5.0, block_m=128, block_n=128, nan_in_pad=False,
        nan_k=(1, 8), nan_q=(1, 40), nan_dout=(1, 50), deterministic=True),
    # deterministic dQ with one consumer warpgroup, D = 128, causal: ranks of a triangle
    "B2-bf16-D128-BN64-deterministic-causal": dict(
        lengths_q=[150, 7], lengths_k=[150, 70], Hq=1, Hk=1, D=128, dtype="bfloat16",
        mask="causal_bottom_right", gaps=False, softcap=0.0, block_m=64, block_n=64,
        nan_in_pad=False, deterministic=True),
    # D = 256: two consumer warpgroups share the 64 keys of a tile, each with half the columns
    # of dK, dV and dQ, in two query subtiles of 32 per chunk; lengths off the subtile (a chunk
    # of 20 rows: its second subtile empty), GQA 2:1, a softcap, NaN in the pad rows
    "B3-bf16-D256-softcap-gqa-nan": dict(
        lengths_q=[20, 0, 75], lengths_k=[70, 3, 40], Hq=2, Hk=1, D=256, dtype="bfloat16",
        mask="causal_bottom_right", gaps=True, softcap=5.0, block_m=64, block_n=64,
        nan_in_pad=True),
    # D = 256, deterministic: three key tiles meet the long sequence's query tiles, and NaN in
    # a key, a q row and a dout row
    "B2-fp16-D256-deterministic-nan": dict(
        lengths_q=[130, 9], lengths_k=[150, 9], Hq=1, Hk=1, D=256, dtype="float16",
        mask="full", gaps=False, softcap=0.0, block_m=64, block_n=64, nan_in_pad=False,
        nan_k=(1, 8), nan_q=(0, 40), nan_dout=(0, 50), deterministic=True),
}
QUICK = ["B4-fp16-D64-BN64-causal-gaps-nan"]


def _mask(spec, B):
    import varlen
    if spec != ("mixed",):
        return spec
    left = np.array([-1, -1, 7] * B, np.int32)[:B]
    right = np.array([-1, 0, 0] * B, np.int32)[:B]
    bottom = np.array([0, 0, 1] * B, np.int32)[:B]
    return varlen.Mask(window_left=left, window_right=right, bottom_right=bottom)


def _row(b, side, seq, i):
    """Packed row of position i of sequence `seq` on side "q" or "k"."""
    cu, off = (b.cu_q, b.off_q) if side == "q" else (b.cu_k, b.off_k)
    return int((cu if off is None else off)[seq]) + i


def run_case(label: str, device: bool = False) -> float:
    """Runs one case's backward (preprocess, the sm_90a dK/dV kernel, dQ conversion) through the
    emulation (on a Hopper GPU with `device`, float16 cases only); raises AssertionError on a
    mismatch. Returns the seconds the backward took."""
    import varlen
    import emulation.cupy as _cupy_emulation
    import emulation.sm90
    import varlen.backends.cupy.sm90 as _cupy_sm90_bwd
    from varlen.testing import assert_close, covered_rows, make_batch, naive_same_dtype
    c = dict(CASES[label])
    nan_in_pad = c.pop("nan_in_pad")
    deterministic = c.pop("deterministic", False)
    nan_k, nan_q, nan_dout = (c.pop(key, None) for key in ("nan_k", "nan_q", "nan_dout"))
    block_m, block_n = c["block_m"], c["block_n"]
    if not device:
        _cupy_emulation.install_fake_cupy(block_m)
        emulation.sm90.install()
    rng = np.random.default_rng(0)
    mask = _mask(c["mask"], len(c["lengths_q"]))
    b = make_batch(rng, c["lengths_q"], c["lengths_k"], Hq=c["Hq"], Hk=c["Hk"], D=c["D"],
                   dtype=c["dtype"], mask=mask, gaps=c["gaps"])
    if nan_in_pad:
        # a TMA box that reads rows outside the sequences must not let them reach a gradient
        rows_k, rows_q = covered_rows(b, "k"), covered_rows(b, "q")
        b.k[~rows_k] = np.nan
        b.v[~rows_k] = np.nan
        b.q[~rows_q] = np.nan
        b.dout[~rows_q] = np.nan
    if nan_k:
        b.k[_row(b, "k", *nan_k), 0, 3] = np.nan
    if nan_dout:
        b.dout[_row(b, "q", *nan_dout), 0, 7] = np.nan
    plan = varlen.plan(b.cu_q, b.cu_k, seq_offsets_q=b.off_q, seq_offsets_k=b.off_k,
                       mask=b.mask, num_rows_q=b.q.shape[0], num_rows_k=b.k.shape[0],
                       block_m=block_m, block_n=block_n)
    scale = 1.0 / math.sqrt(c["D"])
    kw = dict(softmax_scale=scale, softcap=c["softcap"])
    ref_out, ref_lse = b.ref_forward(**kw)
    if deterministic:
        ranks = _ranks(plan)
        assert ranks.max() >= 2, f"{label}: at most {ranks.max() + 1} key tiles per query tile"
    out = np.asarray(ref_out).astype(b.q.dtype)
    lse = np.asarray(ref_lse).astype(np.float32)
    if nan_q:
        # after the forward: out and lse of the row stay finite, only q tells
        b.q[_row(b, "q", *nan_q), 0, 11] = np.nan
    args = (b.dout, b.q, b.k, b.v, out, lse)
    if device:
        import cupy
        args = tuple(cupy.asarray(a) for a in args)
    t0 = time.perf_counter()
    grads = _cupy_sm90_bwd.backward(plan, *args, deterministic=deterministic, **kw)
    if device:
        cupy.cuda.Device().synchronize()
        grads = tuple(cupy.asnumpy(g) for g in grads)
    seconds = time.perf_counter() - t0
    # the gradients' bits, for the comparison between schedules
    digest = hashlib.sha256(b"".join(np.ascontiguousarray(g).tobytes() for g in grads))
    print("digest", label, digest.hexdigest()[:16], flush=True)
    # (the out and lse the backward is given carry a NaN of the forward to the query rows)
    ref_grads = [np.asarray(g) for g in b.ref_backward(out=out, lse=lse, **kw)]
    # the tolerances of check_against_reference: a same-dtype computation's error, relative to
    # each gradient's scale
    ok_out = np.isfinite(ref_out)
    naive = naive_same_dtype(b, **kw)
    naive_err = float(np.max(np.abs(naive - ref_out)[ok_out & np.isfinite(naive)], initial=0.0))
    amax_out = float(np.max(np.abs(ref_out[ok_out]), initial=0.0))
    dout_ok = np.where(covered_rows(b)[:, None, None] & np.isfinite(b.dout.astype(np.float64)),
                       b.dout.astype(np.float64), 0.0)
    magnitude = amax_out * float(np.max(np.abs(dout_ok), initial=0.0))
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads):
        got = np.asarray(got).astype(np.float64)
        bad = np.isnan(want)
        assert np.array_equal(np.isnan(got), bad), (
            f"{label} {name}: NaN pattern differs: {int(np.isnan(got).sum())} NaN, "
            f"{int(bad.sum())} expected, first wrong rows "
            f"{np.unique(np.argwhere(np.isnan(got) != bad)[:, 0])[:8]}")
        want0 = np.where(bad, 0.0, want)
        rel = naive_err / max(amax_out, 1e-30)
        assert_close(f"{label} {name}", np.where(bad, 0.0, got), want0, dtype=c["dtype"],
                     naive_err=rel * max(float(np.max(np.abs(want0), initial=0.0)), 1e-30),
                     factor=3.0, floor=16.0, magnitude=magnitude)
    return seconds


def _ranks(plan):
    """Key tiles per used query tile, minus one: the highest rank of an ordered dQ addition."""
    sched = np.asarray(plan.q_sched)
    used = np.asarray(plan.q_tiles)[:, 0] >= 0
    return (sched[..., 3] - sched[..., 0]).sum(-1)[used] - 1


def _run(label, env=None):
    return run_case_ok("test_sm90_backward", label, env)


@needs_cxx
@pytest.mark.parametrize("label", QUICK)
def test_sm90_backward_on_host_emulation_quick(label):
    _run(label)


@pytest.mark.slow
@needs_cxx
@pytest.mark.parametrize("label", [k for k in CASES if k not in QUICK])
def test_sm90_backward_on_host_emulation(label):
    _run(label)


@pytest.mark.gpu
@pytest.mark.parametrize("label", [k for k, c in CASES.items() if c["dtype"] == "float16"])
def test_sm90_backward_on_hopper(label):
    """The float16 cases on a Hopper GPU: the NVRTC cubin through CuPy, tensor maps from the
    driver, the preprocessing and conversion of the mma.sync module."""
    cupy = pytest.importorskip("cupy")
    pytest.importorskip("cuda.bindings.driver", reason="needs cuda-bindings (tensor maps)")
    if cupy.cuda.Device().compute_capability != "90":
        pytest.skip("needs an sm_90 GPU")
    run_case(label, device=True)


def _specs():
    from varlen.backends.cupy.sm90 import BwdSpec as BwdSm90Spec
    return [BwdSm90Spec(dt, d, bn, sc, ordered) for dt in ("float16", "bfloat16")
            for d in (64, 128, 256) for bn in ((64,) if d == 256 else (64, 128))
            for sc in (False, True) for ordered in (False, True)]


@pytest.mark.slow
@needs_cxx
def test_sm90_deterministic_backward_is_bitwise_repeatable():
    """The deterministic case gives the same bits under two more schedules (copies landing and
    wgmma operands read at seeded random points, threads free-running). Under these two seeds
    the case's gradients differ in atomic mode, and so they do without the hand-over between
    the two consumer warpgroups (each measured): the order in which the warpgroups add to a
    dQ element changes with the schedule. (The order between key tiles cannot vary in the
    emulation, which runs blocks one after the other; there a rank that waits for a later
    block stops the run.)"""
    label = "B3-fp16-D64-BN128-deterministic-gqa"
    digests = set()
    for seed in ("1", "3"):
        out = _run(label, dict(VARLEN_EMULATION_SCHEDULE="random", VARLEN_EMULATION_SEED=seed))
        digests.add(re.search(rf"digest {label} (\w+)", out).group(1))
    assert len(digests) == 1, f"{label}: the gradients differ between schedules: {digests}"


def test_sm90_backward_spec_rejects_what_the_kernel_does_not_take():
    from varlen.backends.cupy.sm90 import BwdSpec as BwdSm90Spec
    for bad in (dict(dtype="float32"), dict(head_dim=96), dict(head_dim=512),
                dict(head_dim=256, block_n=128), dict(block_n=32), dict(block_n=256)):
        kw = {**dict(dtype="bfloat16", head_dim=64, block_n=64, softcap=False), **bad}
        with pytest.raises(ValueError):
            BwdSm90Spec(**kw)


def test_sm90_backward_compiles_for_sm90a_within_budget():
    pytest.importorskip("cuda.bindings.nvrtc", reason="needs cuda-bindings (NVRTC)")
    from varlen.backends.cupy.sm90 import OPTIN_SMEM
    from varlen.backends.cupy.sm90 import compile_report
    report = compile_report(_specs())
    for name, u in report.items():
        print(f"{name}: {u['registers']} registers at entry, {u['threads']} threads, "
              f"{u['smem']} B shared, spills {u['spill_stores']}/{u['spill_loads']}")
        assert u["spill_stores"] == 0 and u["spill_loads"] == 0, f"{name} spills: {u}"
        assert u["registers"] * u["threads"] <= 65536, f"{name}: registers exceed an SM: {u}"
        assert u["smem"] + u["static_smem"] <= OPTIN_SMEM, f"{name}: shared memory {u}"
        assert not u["warnings"], f"{name}: ptxas warnings (setmaxnreg ignored?) {u['warnings']}"


def _tsan_env(**extra):
    import emulation.cupy as _cupy_emulation
    return dict(LD_PRELOAD=_cupy_emulation.tsan_runtime(), TSAN_OPTIONS=_cupy_emulation.TSAN_OPTIONS,
                VARLEN_EMULATION_RACE="1", OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", **extra)


@pytest.mark.slow
@needs_cxx
def test_sm90_backward_under_thread_sanitizer():
    """The quick case built with ThreadSanitizer, copies landing at random points: the mbarriers
    (kv_full, kv_ready, q_full, ready, empty) and the named barriers around the dS buffer must
    order every shared-memory access of the producer, the TMA copies and the consumers."""
    assert "ok" in _run(QUICK[0], _tsan_env())


@pytest.mark.slow
@needs_cxx
def test_sm90_backward_with_operands_read_at_issue():
    """Another schedule: TMA copies land, and wgmma reads its shared operands, at issue (the
    earliest moment), under ThreadSanitizer, on the two-warpgroup case with another seed."""
    assert "ok" in _run("B2-bf16-D64-BN128-causal-gaps-nan",
                        _tsan_env(VARLEN_EMULATION_SCHEDULE="issue", VARLEN_EMULATION_SEED="1"))


# Mutations of bwd_sm90.cuh that the cases above must catch: (old, new, case, what the failure
# says). Each is compiled from a mutated copy of the kernel sources (VARLEN_EMULATION_SOURCE_DIR).
MUTATIONS = {
    # K rows past the key tile (NaN padding) meet dS = 0 in dQ += dS K
    "no-key-row-zeroing": ("    if (t >= rows || bad) fill_row<Cfg, Cfg::BN>(s_k, t, 0u);",
                           "    if (bad) fill_row<Cfg, Cfg::BN>(s_k, t, 0u);",
                           QUICK[0], "dq: NaN pattern differs"),
    # Q rows past a query chunk (NaN padding) meet dS^T = 0 in dK += dS^T Q
    "no-query-row-zeroing": ("    if (t >= rows || bad_q) fill_row<Cfg, Cfg::BQ>(s_q, t, 0u);",
                             "    if (bad_q) fill_row<Cfg, Cfg::BQ>(s_q, t, 0u);",
                             QUICK[0], "dk: NaN pattern differs"),
    # a NaN in a dout row of a partial chunk must reach delta, hence exactly its pairs
    "no-delta-flag": ("    if (bad_q || bad_do) s_delta[t] = nan_f();", "",
                      "B2-fp16-D128-BN64-softcap-nan-k-q-dout", "NaN pattern differs"),
    # dS written without the 128B swizzle, which the descriptor of dQ's A assumes
    "no-ds-swizzle": ("(((2 * wg_warp + (w.lane / 8) % 2) ^ (ds_row % 8)) << 4)",
                      "((2 * wg_warp + (w.lane / 8) % 2) << 4)",
                      "B3-bf16-D64-BN64-mixed-masks-gqa", "dq: max abs error"),
    # the producer refills a stage the consumers still read: the barrier phases go wrong, which
    # the emulation reports either at an mbarrier or, once a consumer thread has run past its
    # warpgroup's last collective and returned, at that collective or at the exit of a warp
    # that skipped one the others met (seen under heavy load), or, with the two consumers' dS
    # barriers shared (dQ by columns), as a collective whose threads never all arrive (seen
    # once, in a CI run)
    "no-empty-wait": ("        sm90::mbar_wait(sm.empty(s), parity ^ 1u);\n", "",
                      "B2-bf16-D128-BN128-full-gqa",
                      ("mbarrier", "of the warp has exited", "threads of the warp starting at",
                       "exited without executing it")),
    # D = 256: the second query subtile's dS stored over the first's rows
    "ds-subtiles-overlap": ("sm90::stmatrix_x4_trans(p_ds_row + (col + j * 16) * ROW, ds_frag[j]);",
                            "sm90::stmatrix_x4_trans(p_ds_row + j * 16 * ROW, ds_frag[j]);",
                            "B3-bf16-D256-softcap-gqa-nan", "dq: NaN pattern differs"),
    # D = 256: the second warpgroup's dK columns stored over the first's
    "dk-columns-at-0": ("    dk_rows.p += col_box0 * Cfg::BOX_COLS;\n", "",
                        "B3-bf16-D256-softcap-gqa-nan", "dk: NaN pattern differs"),
    # D = 256: the second subtile's softmax with the lse2 and delta of the chunk's first rows
    "subtile-stats-at-row-0": ("ColStats{sm.lse2(s) + col, sm.delta(s) + col}",
                               "ColStats{sm.lse2(s), sm.delta(s)}",
                               "B3-bf16-D256-softcap-gqa-nan", "dq: NaN pattern differs"),
}


@pytest.mark.slow
@needs_cxx
@pytest.mark.parametrize("name", list(MUTATIONS))
def test_sm90_backward_mutation_is_caught(name, tmp_path):
    from varlen.kernels_cuda import SOURCE_DIR
    old, new, label, says = MUTATIONS[name]
    src = tmp_path / "kernels_cuda"
    shutil.copytree(SOURCE_DIR, src)
    path = src / "bwd_sm90.cuh"
    text = path.read_text()
    assert text.count(old) == 1, f"{name}: the mutated line is not in bwd_sm90.cuh once"
    path.write_text(text.replace(old, new))
    assert_mutant_caught(run_mutated_case("test_sm90_backward", label, src), name, label, says)


@needs_cxx
def test_sm90_backward_removed_ds_barrier_is_caught():
    """The warpgroup's barrier before it rewrites its dS buffer by stmatrix (the site of
    bwd_sm90.cuh the mutation sweep runs): without it a warp overwrites dS that another warp's
    dQ product read, with no barrier between the read's retirement and the write."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                    "scripts"))
    import emulation.mutations as emulation_mutations
    chosen = [s for s in emulation_mutations.sites()
              if s[0] == "bwd_sm90.cuh" and "named_bar_sync(ds_bar," in s[2]]
    assert len(chosen) == 2, f"the two dS barriers expected (kernel rewritten?): {chosen}"
    by, seconds = emulation_mutations.check(chosen[0], timeout=900)
    assert by is not None and "stmatrix" in by, (
        f"removing {emulation_mutations.site_id(chosen[0])}: {by or 'went unnoticed'}")


if __name__ == "__main__":
    # python tests/test_sm90_backward.py LABEL ...: the cases in this process, in the emulation
    # mode of the environment (emulation/mutations.py runs them on mutated kernels)
    for name in sys.argv[1:]:
        print("ok", name, f"{run_case(name):.1f} s", flush=True)
