"""The deterministic backward of the CuPy kernels (`deterministic=True`): the dK/dV kernel adds
dQ itself, each query chunk's additions in the order of the key tiles' slots
(kernels_cuda/bwd_dq_ordered.cuh). On a CPU through the host emulation, each case in its own
process (the emulation replaces `cupy` there), run by this file's __main__.

* Bitwise repeatable: dq, dk and dv are equal bit for bit across runs and across emulation
  schedules (cp.async copies landing at seeded random points, warps one at a time in seeded
  orders), and equal to the atomic mode's (which the emulation runs in the same block order),
  on adversarial batches checked against the float64 reference: float16 and bfloat16, D = 64
  and 128, key tiles of 64 and of 128 (8 warps, query chunks of 64), GQA, per-sequence
  causal, bidirectional and windowed masks, zero- and one-row sequences, pad gaps holding
  NaN. NaN in the rows of another sequence changes no bit of the
  gradients of the others.
* The order: every wait of a block is satisfied by blocks of smaller linear index (the
  emulation runs blocks in that order and its spin-wait aborts when the value is not there
  yet: a wait on a later block, a deadlock risk on a GPU), and after the backward each counter
  holds the number of key tiles that meet its query tile, counted here from the plan's
  q_sched, and no other counter moved; also on context-parallel plans (two query segments per
  sequence, all-gathered keys: four key segments, out of row order).
* A wrong rank is caught: with the rank counted from the other end of the key tiles, the run
  aborts with the emulation's message naming the kernel, the block and the counter; so is a
  release before every warp has fenced its additions (the barrier removed).
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
import sys

import numpy as np
import pytest

from helpers import cases, emulate_script, mutated_sources, needs_cxx, run_mutated
import varlen.backends.cupy.launch as _cupy_launch  # noqa: E402

# What a fresh dq_order buffer holds here, so that a counter the preprocessing does not zero
# shows.
STALE = 0x5A5A5A5A

# label: (lengths q, lengths k, Hq, Hk, D, dtype, mask, block_m); masks by name or per
# sequence as (window_left, window_right, bottom_right) lists.
BATCHES = {
    "B7-perseq-gqa-fp16-D64": (
        [0, 1, 70, 130, 0, 33, 1], [3, 1, 64, 200, 5, 0, 1], 2, 1, 64, "float16",
        ([-1, -1, 20, -1, -1, 0, 5], [0, -1, 0, -1, 0, 0, 2], [0, 0, 1, 1, 0, 1, 0]), 64),
    "B4-causal_br-mqa-bf16-D128-BM128": (
        [1, 200, 0, 97], [30, 260, 4, 97], 2, 1, 128, "bfloat16", "causal_bottom_right", 128),
    "B4-perseq-gqa-fp16-D128-BN128": (
        [0, 1, 140, 9], [2, 1, 200, 0], 2, 1, 128, "float16",
        ([-1, 3, -1, 0], [0, -1, -1, 0], [0, 0, 1, 1]), 128),
}
# block_n of the batches whose plans do not take 64-key tiles.
BLOCK_N = {"B4-perseq-gqa-fp16-D128-BN128": 128}
# The sequence whose rows get NaN in the poisoned run of each batch.
POISONED = {"B7-perseq-gqa-fp16-D64": 2, "B4-causal_br-mqa-bf16-D128-BM128": 0,
            "B4-perseq-gqa-fp16-D128-BN128": 2}
# The emulation schedule of the run after the first (which has the default: copies land at their
# wait, warps free-running), by case: (landing of the copies, seed), warps one at a time in a
# seeded order. One per case, each case another, so that the file covers both landings and four
# seeds at one extra backward per case (an emulated backward under a schedule costs the most of
# this file's time).
SCHEDULES = {"B7-perseq-gqa-fp16-D64": ("random", 1),
             "B4-causal_br-mqa-bf16-D128-BM128": ("issue", 2),
             "B4-perseq-gqa-fp16-D128-BN128": ("random", 4), "cp": ("random", 3)}


@needs_cxx
@pytest.mark.parametrize("label", [
    pytest.param(label, marks=pytest.mark.smoke if label == "B7-perseq-gqa-fp16-D64" else ())
    for label in cases(BATCHES, ["B7-perseq-gqa-fp16-D64"])])
def test_bitwise_repeatable_across_runs_and_schedules(label):
    out = emulate_script(__file__, "repeat", label, timeout=1800)
    assert f"{label} ok" in out, out


@needs_cxx
def test_context_parallel_segments():
    out = emulate_script(__file__, "cp", timeout=1800)
    assert "cp ok" in out, out


def _run_mutated(tmp_path, right, wrong, env=None):
    """The first repeat case on kernel sources with `right` (once in bwd_dq_ordered.cuh)
    replaced by `wrong`: the finished process."""
    src = mutated_sources(tmp_path, "bwd_dq_ordered.cuh", right, wrong)
    return run_mutated([os.path.abspath(__file__), "repeat", "B7-perseq-gqa-fp16-D64", "once"],
                       src, env)


@needs_cxx
def test_poll_limit_names_the_counter_of_a_missing_release(tmp_path):
    """The leader never hands the turn on, the kernels built with a small poll limit
    (VARLEN_POLL_LIMIT, kernels_cuda/common.cuh): the next block's wait for its turn reaches
    the limit, prints the kernel's line, the block, the counter and the value it waits for,
    and traps; the launch fails (as on a GPU) and the process goes on to raise."""
    from varlen.kernels_cuda import SOURCE_DIR
    with open(os.path.join(SOURCE_DIR, "bwd_dkdv.cuh")) as f:
        line = next(i for i, text in enumerate(f, 1) if "order.acquire(c)" in text)
    proc = _run_mutated(tmp_path, "        if (leader) {\n            if constexpr (CARRY_RANK)",
                        "        if (false) {\n            if constexpr (CARRY_RANK)",
                        {"VARLEN_POLL_LIMIT": "1000"})
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, f"a missing release went unnoticed:\n{out[-2000:]}"
    says = (rf"varlen: poll limit: bwd_dkdv\.cuh:{line} \(.*\), block \(\d+, \d+\), thread 0: "
            r"counter dq_order \d+ still holds \d+, waiting for \d+, after 1000 polls; trap")
    assert re.search(says, out), out[-3000:]
    assert "LaunchError" in out and "which no earlier block provides" not in out, out[-3000:]


@needs_cxx
def test_wrong_rank_aborts_naming_block_and_counter(tmp_path):
    """The rank counted from the last key tile instead of the first: the first block of a
    query chunk met by several key tiles waits for a count no earlier block provides."""
    proc = _run_mutated(tmp_path, "return before + tile - s[seg * SCHED_FIELDS];",
                        "return before + s[seg * SCHED_FIELDS + 3] - 1 - tile;")
    assert proc.returncode != 0, f"a wrong rank went unnoticed:\n{proc.stdout[-2000:]}"
    assert ("kernel varlen_bwd_dkdv_ordered, block (" in proc.stderr
            and "spin-wait on dq_order counter" in proc.stderr), proc.stderr[-3000:]


@needs_cxx
def test_release_before_the_barrier_aborts(tmp_path):
    """Without the barrier between the fences and the release, warps one at a time in a seeded
    order let thread 0 hand the counter on before another warp has fenced its additions (seen
    at the release, or at the late fence)."""
    proc = _run_mutated(tmp_path, "        __threadfence();\n        barrier();\n",
                        "        __threadfence();\n",
                        {"VARLEN_EMULATION_SCHEDULE": "random", "VARLEN_EMULATION_SEED": "1"})
    assert proc.returncode != 0, f"a release before the barrier went unnoticed:\n{proc.stdout}"
    assert ("kernel varlen_bwd_dkdv_ordered, block (" in proc.stderr
            and ("release of a counter" in proc.stderr
                 or "after the block handed the counter on" in proc.stderr)), proc.stderr[-3000:]


# --------------------------------------------------------------------------------------------
# Emulated side: python tests/emulation/test_cupy_deterministic.py repeat LABEL [once] | cp
# --------------------------------------------------------------------------------------------

def _capture_dq_order():
    """Makes the launcher's dq_order buffers start as STALE and records them: the list."""
    import varlen.backends.cupy.mma as _cupy_mma
    seen = []
    alloc = _cupy_mma.alloc

    def recording(xp, shape, dtype, *args, **kw):
        a = alloc(xp, shape, dtype, *args, **kw)
        if np.dtype(dtype) == np.int32:
            a[...] = STALE
            seen.append(a)
        return a
    _cupy_mma.alloc = recording
    return seen


def _expected_dq_order(plan, Hq, bq):
    """The counters after a backward, from the plan's q_sched: for each query tile, at the first
    row of each of its chunks of `bq` rows, the number of key tiles that meet it (0 where none
    does); everywhere else 0. And the rows each query tile covers, by slot."""
    view = plan.view()
    tiles, sched = np.asarray(view.q_tiles), np.asarray(view.q_sched)
    counters = np.zeros((Hq, view.rows_q), np.int64)
    slot_of_row = {}
    for slot, (seq, _, row, rows, _) in enumerate(tiles):
        if seq < 0:
            continue
        meets = int((sched[slot, :, 3] - sched[slot, :, 0]).sum())
        counters[:, row:row + rows:bq] = meets
        slot_of_row[slot] = (row, rows)
    return counters, slot_of_row


def _check_dq_order(label, dq_order, plan, Hq, bq):
    counters, slot_of_row = _expected_dq_order(plan, Hq, bq)
    got = np.asarray(dq_order)
    assert got.shape == (Hq + 1, plan.view().rows_q), f"{label}: dq_order shape {got.shape}"
    bad = np.argwhere(got[:Hq] != counters)
    assert not len(bad), (f"{label}: {len(bad)} counters differ from the key tiles that meet "
                          f"their query tile, first (head, row) {tuple(bad[0])}: "
                          f"{got[tuple(bad[0])]} != {counters[tuple(bad[0])]}")
    assert (counters > 1).any(), f"{label}: no query chunk with two or more key tiles"
    for slot, (row, rows) in slot_of_row.items():
        assert (got[Hq, row:row + rows] == slot).all(), f"{label}: rows of query tile {slot}"


def _fresh_kernels():
    """Forget the compiled modules, so that the next launches read the emulation schedule of
    the environment again (the library itself stays loaded)."""
    _cupy_launch._modules.clear()


def _set_schedule(schedule, seed):
    os.environ["VARLEN_EMULATION_SCHEDULE"] = schedule
    os.environ["VARLEN_EMULATION_SEED"] = str(seed)
    _fresh_kernels()


def _batch(label, rng):
    import varlen
    from varlen.testing import make_batch
    Lq, Lk, Hq, Hk, D, dtype, mask, block_m = BATCHES[label]
    if not isinstance(mask, str):
        left, right, br = (np.array(x, np.int32) for x in mask)
        mask = varlen.Mask(window_left=left, window_right=right, bottom_right=br)
    return make_batch(rng, Lq, Lk, Hq=Hq, Hk=Hk, D=D, dtype=dtype, mask=mask, gaps=True,
                      garbage=np.nan), block_m


def _poisoned(b, seq):
    """`b` with NaN in every row of sequence `seq` of q, k, v and dout."""
    off_q, off_k = b.off_q, b.off_k
    rq = slice(int(off_q[seq]), int(off_q[seq]) + int(b.cu_q[seq + 1] - b.cu_q[seq]))
    rk = slice(int(off_k[seq]), int(off_k[seq]) + int(b.cu_k[seq + 1] - b.cu_k[seq]))
    q, k, v, dout = (x.copy() for x in (b.q, b.k, b.v, b.dout))
    for x, r in ((q, rq), (dout, rq), (k, rk), (v, rk)):
        x[r] = np.nan
    assert rq.stop > rq.start and rk.stop > rk.start, "the poisoned sequence has rows"
    return dataclasses.replace(b, q=q, k=k, v=v, dout=dout), rq, rk


def _equal(label, got, want, rows=slice(None)):
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        a, b = np.asarray(a)[rows[name] if isinstance(rows, dict) else rows], np.asarray(b)
        b = b[rows[name] if isinstance(rows, dict) else rows]
        assert a.tobytes() == b.tobytes(), (
            f"{label}: {name} differs in {int((a.view(np.uint16) != b.view(np.uint16)).sum())} "
            f"elements")


def _case_repeat(label, once=""):
    import varlen
    import emulation.cupy as emu
    from varlen.backends.cupy import BACKEND
    from varlen.testing import check_against_reference
    from varlen.backends.cupy.traits import tile_size
    b, block_m = _batch(label, np.random.default_rng(7))
    block_n = BLOCK_N.get(label, 64)
    emu.install_fake_cupy(block_m, block_n)
    seen = _capture_dq_order()
    plan = varlen.plan(b.cu_q, b.cu_k, seq_offsets_q=b.off_q, seq_offsets_k=b.off_k,
                       mask=b.mask, num_rows_q=b.q.shape[0], num_rows_k=b.k.shape[0],
                       block_m=block_m, block_n=block_n)
    kw = dict(softmax_scale=1.0 / math.sqrt(b.q.shape[2]), softcap=0.0)
    out, lse = BACKEND.forward(plan, b.q, b.k, b.v, **kw)

    def backward(batch, det):
        return BACKEND.backward(plan, batch.dout, batch.q, batch.k, batch.v, out, lse,
                                deterministic=det, **kw)
    first = backward(b, True)
    Hq, D = b.q.shape[1], b.q.shape[2]
    bq = tile_size("bwd", "mma", b.dtype, D, block_m, block_n).query_chunk
    assert len(seen) == 1, f"{label}: {len(seen)} int32 buffers, expected dq_order only"
    _check_dq_order(label, seen[0], plan, Hq, bq)
    if once:
        return
    check_against_reference(b, out, lse, first, label=f"{label} (deterministic)", **kw)
    schedule, seed = SCHEDULES[label]
    _set_schedule(schedule, seed)
    _equal(f"{label} again, schedule {schedule} seed {seed}", backward(b, True), first)
    _set_schedule("", 0)
    _equal(f"{label}: the atomic mode in the same block order", backward(b, False), first)
    assert len(seen) == 2, f"{label}: dq_order in the atomic mode"
    # NaN in one sequence leaves every bit of the others' gradients as it was.
    bad, rq, rk = _poisoned(b, POISONED[label])
    out_bad, lse_bad = BACKEND.forward(plan, bad.q, bad.k, bad.v, **kw)
    keep_q = np.ones(b.q.shape[0], bool)
    keep_k = np.ones(b.k.shape[0], bool)
    keep_q[rq], keep_k[rk] = False, False
    assert np.asarray(out_bad)[keep_q].tobytes() == np.asarray(out)[keep_q].tobytes()
    grads = BACKEND.backward(plan, bad.dout, bad.q, bad.k, bad.v, out_bad, lse_bad,
                             deterministic=True, **kw)
    _equal(f"{label}, NaN in sequence {POISONED[label]}", grads, first,
           {"dq": keep_q, "dk": keep_k, "dv": keep_k})
    print(label, "ok")


def _case_cp():
    """Zigzag context parallelism (cp = 2): each rank's plan against the all-gathered keys (two
    query and four key segments per sequence, the key segments out of row order), causal and
    per-sequence windows: the counters, repeatability across schedules and the atomic mode's
    bits, and agreement with the NumPy backend on the same plan."""
    import emulation.cupy as emu
    import varlen.backends.cupy as cupy_backend
    emu.install_fake_cupy(64)
    seen = _capture_dq_order()
    for rank, plan, q, k, v, dout in emu.cp_case_ranks(2, seed=5):
        Hq, D = q.shape[1:]
        kw = dict(softmax_scale=1.0 / math.sqrt(D), softcap=0.0)
        backend = cupy_backend.BACKEND
        out, lse = backend.forward(plan, q, k, v, **kw)
        seen.clear()
        first = backend.backward(plan, dout, q, k, v, out, lse, deterministic=True, **kw)
        _check_dq_order(f"rank {rank}", seen[0], plan, Hq, 64)
        schedule, seed = SCHEDULES["cp"]
        _set_schedule(schedule, seed)
        _equal(f"rank {rank}, schedule {schedule} seed {seed}",
               backend.backward(plan, dout, q, k, v, out, lse, deterministic=True, **kw), first)
        _set_schedule("", 0)
        _equal(f"rank {rank}: the atomic mode",
               backend.backward(plan, dout, q, k, v, out, lse, deterministic=False, **kw),
               first)
        emu.assert_near(f"rank {rank}", dict(zip(("dq", "dk", "dv"), first)),
                        emu.numpy_reference(plan, q, k, v, dout, **kw))
    print("cp ok")


CASES = {"repeat": _case_repeat, "cp": _case_cp}

if __name__ == "__main__":
    CASES[sys.argv[1]](*sys.argv[2:])
