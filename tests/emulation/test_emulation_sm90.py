"""What only the host emulation of the Hopper primitives (kernels_cuda/sm90.cuh) models, on
the harness of emulation/sm90_primitives.py: the descriptor's bit fields and the tensor map's
bytes on the host, copies landing at issue, at the wait or at random, accumulators of a wgmma
in flight reading as NaN, the misuses it reports instead of hanging or computing garbage
(mbarriers, named barriers, wgmma fences, proxies and warpgroups), and the pipeline under
ThreadSanitizer. The primitives' results against the PTX ISA, on the emulation and on a GPU:
tests/emulation/test_sm90_primitives.py; their sm_90a assembly: tests/compile/test_sm90_compile.py.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest

import emulation.cupy as _cupy_emulation
from emulation.sm90_primitives import (F_A_AFTER_FENCE, F_CLOBBER, F_FLAG_HANDOFF,
                                       F_GROUP_PER_STEP, F_NO_FENCE, F_NO_PROXY_FENCE, F_PEEK,
                                       F_WARP3_EXITS, F_WARP3_SKIPS, F_WRITE_AFTER_FENCE, KERNELS,
                                       SWIZZLE, EmulationRunner, desc, pipeline_operands,
                                       pipeline_result, run_mbar_phases, run_named, run_pipeline,
                                       run_wgmma, to_matrix, wgmma_case)


@pytest.fixture(scope="module")
def runner():
    return EmulationRunner()


@pytest.fixture
def landing(runner):
    """Sets the runner's landing schedule for one test: landing(mode, seed)."""
    yield runner.configure
    runner.configure("wait")


def ptr(a):
    return a.ctypes.data if a is not None else None


def test_the_harness_table_is_what_nvrtc_builds(runner):
    """The kernels the emulation launches by name are the ones the GPU runner's NVRTC build
    holds (`KERNELS`), in order."""
    assert runner.kernels() == KERNELS


# ---- descriptors ---------------------------------------------------------------------------------

@pytest.mark.parametrize("addr,lbo,sbo,swz,expected", [
    (0x0400, 16, 1024, "128B", (1 << 62) | (64 << 32) | (1 << 16) | 0x40),
    (0x0200, 0, 512, "64B", (2 << 62) | (32 << 32) | 0x20),
    (0x0100, 0, 256, "32B", (3 << 62) | (16 << 32) | 0x10),
    (0x2080, 128, 256, "none", (16 << 32) | (8 << 16) | 0x208),
    (0x41230, 4096, 8192, "128B", (1 << 62) | (512 << 32) | (256 << 16) | 0x123),
], ids=["128B", "64B", "32B", "none", "addr-18-bits"])
def test_descriptor_bit_fields(runner, addr, lbo, sbo, swz, expected):
    got = runner.lib.sm90_make_desc(addr, lbo, sbo, SWIZZLE[swz])
    assert got == expected, f"descriptor {got:#018x}, expected {expected:#018x}"
    assert got == desc(addr, lbo, sbo, swz)


# ---- TMA -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape,box,swz,nan_fill", [((40, 88), (64, 16), "128B", False),
                                                    ((3, 5, 24), (8, 4, 2), "none", True)],
                         ids=["2d-128B", "3d-nan-fill"])
def test_python_tensor_map_matches_the_emulation(runner, shape, box, swz, nan_fill):
    """_cupy_emulation.tensor_map (the launchers' map under the emulation) has the bytes of
    sm90::make_tensor_map."""
    g = np.zeros(shape, np.float16 if len(shape) == 2 else np.float32)
    m = _cupy_emulation.tensor_map(g, box, SWIZZLE[swz], nan_fill)
    rank = g.ndim
    dims = np.array(g.shape[::-1], np.uint64)
    strides = np.array([g.strides[rank - 2 - i] for i in range(rank - 1)], np.uint64)
    c_bytes = np.zeros(128, np.uint8)
    runner.lib.sm90_tensor_map_bytes(ptr(g), rank, g.itemsize, ptr(dims), ptr(strides),
                              ptr(np.array(box, np.uint32)), SWIZZLE[swz], int(nan_fill),
                              ptr(c_bytes))
    assert m.tobytes() == c_bytes.tobytes(), (m.tobytes().hex(), c_bytes.tobytes().hex())
    with pytest.raises(ValueError, match="swizzle"):
        _cupy_emulation.tensor_map(g, (box[0] // 2,) + tuple(box[1:]), SWIZZLE["128B"])


# ---- mbarrier ------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["issue", "random"])
def test_mbarrier_phases_and_transaction_bytes_per_landing(runner, landing, mode):
    """The phases of test_sm90_primitives' test with the bulk copy landing at issue or at a
    random point before the wait."""
    landing(mode, 3)
    src = np.arange(64, dtype=np.uint8) * 3
    out, got = run_mbar_phases(runner, src)
    assert out.tolist() == [0, 1, 0, 0, 1, 0, 1], f"try_wait results {out.tolist()}"
    assert np.array_equal(got, src), "bulk copy bytes"


def run_isolated(call, timeout_s="1", expect_fail=True):
    """Runs `call` (Python, on an emulation runner `r`) in a fresh process (the emulation
    aborts on a misuse); returns stderr."""
    code = ("from emulation.sm90_primitives import *\n"
            "r = EmulationRunner()\n"
            f"{call}\n")
    env = dict(os.environ, VARLEN_EMULATION_TIMEOUT=timeout_s)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=env)
    if expect_fail:
        assert proc.returncode != 0, f"{call} was not reported:\n{proc.stderr[-2000:]}"
    else:
        assert proc.returncode == 0, f"{call} failed:\n{proc.stderr[-2000:]}"
    return proc.stderr


def test_mbarrier_deadlock_is_reported_not_hung():
    err = run_isolated("run_mbar_misuse(r, 1)")
    assert "has not completed" in err and "128 transaction bytes expected" in err, err[-2000:]


def test_mbarrier_overwrite_is_reported():
    err = run_isolated("run_mbar_misuse(r, 2)")
    assert "was overwritten" in err, err[-2000:]


def test_mbarrier_init_without_fence_is_reported():
    err = run_isolated("run_mbar_misuse(r, 3)")
    assert "not followed by fence.mbarrier_init" in err, err[-2000:]


def test_mbarrier_use_not_ordered_after_its_init_is_reported():
    """Thread 1 sees the init happened (a plain flag) but no barrier orders it after the init:
    the __syncthreads after the inits is missing."""
    err = run_isolated("run_mbar_misuse(r, 4)")
    assert re.search(r"thread 1: mbarrier.arrive: the mbarrier at shared offset 0 was initialised "
                     r"by thread 0, and this thread has not synchronised", err), err[-2000:]


# ---- named barriers ------------------------------------------------------------------------------

def test_named_barriers_order_a_ping_pong_under_random_landing(runner, landing):
    """test_sm90_primitives' ping-pong with the threads' accesses at seeded random points."""
    landing("random", 5)
    want, last = [], 0
    for r in range(6):
        last = (r * 10 + last % 7) * 3 + 1
        want.append(last)
    assert run_named(runner, 6).tolist() == want


@pytest.mark.parametrize("misuse, message", [
    (1, "announces 128 threads, the phase began with 256"),
    (2, "128 of 256 threads arrived"),
    (3, "barrier id 0"),
    (4, "arrives twice in one phase"),
], ids=["count-mismatch", "deadlock", "id-0", "arrival-twice"])
def test_named_barrier_misuse_is_reported(misuse, message):
    err = run_isolated(f"run_named(r, 2, {misuse})")
    assert message in err, err[-2000:]


# ---- wgmma ---------------------------------------------------------------------------------------

def test_wgmma_accumulators_in_flight_read_as_nan(runner):
    case = wgmma_case(64, "SS_KK", "128B", 1, "float16", np.random.default_rng(0))
    out, probe, _ = run_wgmma(runner, 64, "SS_KK", "float16", case, 1, F_PEEK)
    assert np.isnan(probe).all(), "an accumulator read between commit and wait must be poison"
    assert np.array_equal(to_matrix(out, 64), case["a"] @ case["b"])


def test_wgmma_groups_retire_in_order(runner):
    """One group per k-step, chained on the same accumulators: wait_group 1 retires the first,
    and the accumulators stay poison while the second is pending; wait_group 0 gives the sum."""
    case = wgmma_case(128, "SS_KN", "128B", 3, "float16", np.random.default_rng(2))
    out, probe, _ = run_wgmma(runner, 128, "SS_KN", "float16", case, 3, F_GROUP_PER_STEP)
    assert np.isnan(probe).all(), "accumulators of a pending group readable after wait_group 1"
    assert np.array_equal(to_matrix(out, 128), case["a"] @ case["b"])


@pytest.mark.parametrize("mode", ["issue", "wait"])
def test_wgmma_shared_operands_read_per_landing_mode(runner, landing, mode):
    """Operands overwritten between commit and wait: read at issue, the product is intact; read
    at the wait (the latest the ISA allows), it is the product of zeros, showing the hazard."""
    case = wgmma_case(64, "SS_KK", "128B", 2, "bfloat16", np.random.default_rng(1))
    landing(mode, 0)
    out, _, _ = run_wgmma(runner, 64, "SS_KK", "bfloat16", case, 2, F_CLOBBER)
    expected = case["a"] @ case["b"] if mode == "issue" else np.zeros((64, 64))
    assert np.array_equal(to_matrix(out, 64), expected), f"landing {mode}"


def isolated_wgmma_call(flags, mode="SS_KK"):
    """`misuse_wgmma` with `flags` (for `run_isolated`)."""
    return f"misuse_wgmma(r, {flags}, {mode!r})"


def test_wgmma_without_fence_is_reported():
    err = run_isolated(isolated_wgmma_call(F_NO_FENCE))
    assert "without a wgmma.fence" in err, err[-2000:]


def test_wgmma_accumulators_written_after_fence_are_reported():
    """d[0] += 1 between the wgmma.fence and the first op: the ISA orders a register write
    before a wgmma's access to the same registers only through a wgmma.fence after it."""
    err = run_isolated(isolated_wgmma_call(F_WRITE_AFTER_FENCE))
    assert re.search(r"wgmma.mma_async \(.*\): its accumulators were written by this thread "
                     r"after its last wgmma.fence", err), err[-2000:]


def test_wgmma_a_fragment_written_after_fence_is_reported():
    """Each k-step's A fragment loaded into the same registers after the fence: the second
    load is a write the fence does not order before the op that reads it."""
    err = run_isolated(isolated_wgmma_call(F_A_AFTER_FENCE, "RS_K"))
    assert re.search(r"wgmma.mma_async \(.*\): its A fragment registers were written by this "
                     r"thread after its last wgmma.fence", err), err[-2000:]


def test_wgmma_register_check_passes_the_isa_order():
    """The same RS product with every A fragment written before the fence runs to the end."""
    run_isolated(isolated_wgmma_call(0, "RS_K"), expect_fail=False)


def test_wgmma_operand_stored_without_proxy_fence_is_reported():
    """Operands written by plain stores, a barrier, no fence.proxy.async: the async proxy (the
    wgmma's operand reads) may not see them."""
    err = run_isolated(isolated_wgmma_call(F_NO_PROXY_FENCE))
    assert re.search(r"kernel sm90_wgmma<__half, 64, 0>, block \(0, 0\), thread \d+: "
                     r"wgmma.mma_async \(.*\) "
                     r"reads shared offset \d+ through the async proxy, and a generic-proxy "
                     r"write there .* not yet followed by fence.proxy.async", err), err[-2000:]


def test_wgmma_operand_fenced_but_not_synchronised_is_reported():
    """Thread 0 stores and fences the operands and sets a plain flag; the other threads see the
    flag, so the stores happened, but no barrier orders them after thread 0's fence."""
    err = run_isolated(isolated_wgmma_call(F_FLAG_HANDOFF))
    assert re.search(r"thread (\d+): wgmma.mma_async \(.*\) reads shared offset \d+ through the "
                     r"async proxy: a generic-proxy write there was published by the "
                     r"fence.proxy.async of thread 0 .* has not synchronised", err), err[-2000:]


def test_wgmma_warp_missing_from_warpgroup_is_reported():
    err = run_isolated(isolated_wgmma_call(F_WARP3_SKIPS))
    assert "disagree at a warpgroup collective" in err, err[-2000:]


def test_wgmma_warp_exiting_before_its_warpgroup_is_reported():
    """Warp 3 returns before the wgmma.fence the other three execute. The four warps of a
    warpgroup do not wait for each other at a wgmma (.sync is per warp), so this is found
    without a deadlock, whichever side comes first: at warp 3's exit or at another warp's
    instruction."""
    err = run_isolated(isolated_wgmma_call(F_WARP3_EXITS))
    assert re.search(r"wgmma\.\w+ #\d+ \(.*\): warp 3 of the warpgroup exited without "
                     r"executing it, which warp [012] did", err), err[-2000:]


# ---- a warp-specialised TMA + mbarrier + wgmma pipeline ---------------------------------------

@pytest.mark.parametrize("mode,consumers", [("issue", 1), ("random", 1), ("random", 2)])
def test_warp_specialised_pipeline_per_landing(runner, landing, mode, consumers):
    """test_sm90_primitives' pipeline with the TMA copies landing at issue or at random."""
    landing(mode, 5)
    a16, b16, expected = pipeline_operands(11, consumers)
    got = pipeline_result(run_pipeline(runner, a16, b16, consumers), consumers)
    assert np.array_equal(got, expected), f"pipeline, landing {mode}, {consumers} consumers"


def test_warp_specialised_pipeline_under_thread_sanitizer():
    """The same pipeline built with ThreadSanitizer: the mbarrier protocol orders every shared-
    memory access of producer, copies and consumers (a race would stop the run)."""
    code = """
import numpy as np
from emulation.sm90_primitives import (EmulationRunner, pipeline_operands, pipeline_result,
                                       run_pipeline)
r = EmulationRunner(race=True)
r.configure("random", 7)
a16, b16, expected = pipeline_operands(12, 2)
assert np.array_equal(pipeline_result(run_pipeline(r, a16, b16, 2), 2), expected), "under TSan"
print("pipeline ok")
"""
    # One BLAS thread: OpenBLAS's own threads (NumPy's reference product) are not under test.
    env = dict(os.environ, LD_PRELOAD=_cupy_emulation.tsan_runtime(),
               TSAN_OPTIONS=_cupy_emulation.TSAN_OPTIONS, OPENBLAS_NUM_THREADS="1",
               OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=600, env=env)
    assert proc.returncode == 0 and "pipeline ok" in proc.stdout, proc.stderr[-4000:]
