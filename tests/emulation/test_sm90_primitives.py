"""The Hopper primitives of kernels_cuda/sm90.cuh one at a time against the PTX ISA's layouts,
on two runners (emulation/sm90_primitives.py): the host emulation (tier `emulation`; also the
GPU runner's own code over a stand-in cupy that runs the emulation's kernels) and a Hopper GPU
through CuPy (`gpu`, skipped without an sm_90 GPU; scripts/gpu_check.sh's step
`primitives`). The same harness source, inputs and expectations on both: wgmma SS and RS for
each N (32 to 256), both majors and every swizzle, with descriptors made on the device from its
shared-memory base; TMA 2-D boxes for each swizzle with rows and columns out of bounds, 3-D
boxes with NaN fill and with packed heads (the forward's packed Q box through the launcher's
map layout, from a view); mbarrier phases and transaction bytes; a named-barrier ping-pong;
stmatrix and stmatrix.trans; one attention tile (scores to registers to P V); the
warp-specialised TMA + mbarrier + wgmma pipeline with one and two consumer warpgroups.

What only the emulation models (misuse reports, copy landing schedules, NaN accumulators in
flight, ThreadSanitizer) is tests/emulation/test_emulation_sm90.py's.
"""
from __future__ import annotations

import sys
import types

import numpy as np
import pytest

from emulation import sm90_primitives
from emulation.sm90_primitives import (F_ACCUMULATE, F_SETMAXNREG, KERNELS, SMEM_ALIGN,
                                       SWIZZLE_BYTES, WGMMA_CASES, CupyRunner, EmulationRunner,
                                       attention_tile_case, desc,
                                       pipeline_operands, pipeline_result, run_attention_tile,
                                       run_mbar_phases, run_named, run_pipeline, run_stmatrix,
                                       run_tma, run_wgmma, stmatrix_expected, tma_box_expected,
                                       to_matrix, wgmma_case)


class _StandInArray(np.ndarray):
    """A host array with CuPy's `data.ptr`."""

    @property
    def data(self):
        return types.SimpleNamespace(ptr=self.ctypes.data)


def cupy_stand_in(emulation: EmulationRunner, lowered: dict) -> types.ModuleType:
    """A `cupy` module whose RawModule runs the harness's kernels, looked up by their lowered
    names, through `emulation`, refusing what a GPU refuses: another grid, more than 48 KiB of
    dynamic shared memory without the opt-in."""
    kernel_of = {v: k for k, v in lowered.items()}

    class Function:
        def __init__(self, name):
            self.kernel, self.max_dynamic_shared_size_bytes = kernel_of[name], 0

        def __call__(self, grid, block, args, shared_mem=0):
            assert tuple(grid) == (1,) and len(block) == 1, (grid, block)
            assert shared_mem <= 48 * 1024 or shared_mem <= self.max_dynamic_shared_size_bytes, (
                f"{self.kernel}: {shared_mem} B of shared memory without the opt-in")
            emulation.launch(self.kernel, threads=block[0], smem=shared_mem, args=args)

    class RawModule:
        def __init__(self, path):
            assert path.endswith(".cubin"), path

        def get_function(self, name):
            return Function(name)

    fake = types.ModuleType("cupy")
    fake.RawModule = RawModule
    fake.asarray = lambda a: np.array(a).view(_StandInArray)
    fake.asnumpy = lambda a: np.array(a).view(np.ndarray)
    device = types.SimpleNamespace(synchronize=lambda: None)
    fake.cuda = types.SimpleNamespace(Device=lambda: device)
    return fake


@pytest.fixture(scope="module",
                params=["emulation", "cupy-stand-in", pytest.param("gpu", marks=pytest.mark.gpu)])
def runner(request):
    """Each test once per runner: the emulation build; the GPU runner's own code (arrays,
    lookups by lowered name, the shared-memory opt-in, launches) on a stand-in cupy whose
    kernels are the emulation's, the tensor maps the emulation's; then a GPU's (sm_90 only)."""
    if request.param == "emulation":
        yield EmulationRunner()
        return
    if request.param == "cupy-stand-in":
        emulation = EmulationRunner()
        lowered = {k: f"_lowered_{i}" for i, k in enumerate(KERNELS)}
        mp = pytest.MonkeyPatch()
        mp.setitem(sys.modules, "cupy", cupy_stand_in(emulation, lowered))
        mp.setattr(sm90_primitives, "harness_cubin", lambda: ("stand-in.cubin", lowered))
        mp.setattr(CupyRunner, "tensor_map", lambda self, a, box, swizzle, nan_fill=False:
                   emulation.tensor_map(a, box, swizzle, nan_fill))
        try:
            yield CupyRunner()
        finally:
            mp.undo()
        return
    cupy = pytest.importorskip("cupy")
    pytest.importorskip("cuda.bindings.nvrtc", reason="needs cuda-bindings (NVRTC, tensor maps)")
    if cupy.cuda.Device().compute_capability != "90":
        pytest.skip("needs an sm_90 GPU")
    yield CupyRunner()


def assert_bytes(label, got, want):
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, (f"{label}: {bad.size} of {want.size} bytes differ, first at byte "
                           f"{bad[0]}: {got[bad[0]]} vs {want[bad[0]]}")


# ---- TMA -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("swz", ["none", "32B", "64B", "128B"])
@pytest.mark.parametrize("coords", [(8, 30), (32, -3)],
                         ids=["rows-past-end", "cols-past-end-rows-before-start"])
def test_tma_2d_box_swizzle_and_out_of_bounds(runner, swz, coords):
    S = SWIZZLE_BYTES[swz] or 64
    box = (S // 2, 16)                          # (columns, rows) of 16 bits: rows of S bytes
    rows, cols = 40, S // 2 + 24
    g = np.ascontiguousarray(np.arange(rows * cols, dtype=np.uint16).reshape(rows, cols) + 1)
    out = run_tma(runner, runner.device(g), box, coords, swz)
    assert_bytes(f"{swz} box at {coords}", out, tma_box_expected(g, box, coords, swz))


def test_tma_3d_box_out_of_bounds_and_nan_fill(runner):
    g = np.ascontiguousarray((np.arange(3 * 5 * 24, dtype=np.float32) + 1).reshape(3, 5, 24))
    box, coords = (8, 4, 2), (20, 3, 2)                  # x 20..27 of 24, y 3..6 of 5, z 2..3 of 3
    for nan_fill in (False, True):
        got = run_tma(runner, runner.device(g), box, coords, "none", nan_fill).view(np.float32)
        want = tma_box_expected(g, box, coords, "none", nan_fill).view(np.float32)
        wrong = np.flatnonzero(np.isnan(got) != np.isnan(want))
        assert wrong.size == 0, f"{nan_fill=}: out-of-bounds elements {wrong}"
        assert np.array_equal(got[~np.isnan(want)], want[~np.isnan(want)]), f"{nan_fill=}"


@pytest.mark.parametrize("pack, h0", [(2, 2), (4, 2)], ids=["pack2", "pack4"])
def test_tma_3d_box_of_packed_heads(runner, pack, h0):
    """The forward's packed Q box (64 columns x `pack` heads x 64 / pack positions, 128B
    swizzle; fwd_sm90.cuh) of a [T, H, 64] fp16 view of heads 1..6 of 8, read where it lies
    (`sm90.map_layout`'s dims, strides and box): shared row r is position r / pack, head
    h0 + r % pack; the positions past T are zero."""
    from varlen.backends.cupy.sm90 import map_layout
    T, H, D = 37, 8, 64
    g = (np.arange(T * H * D) % 2048).astype(np.float16).reshape(T, H, D)
    view = g[:, 1:7]
    rows = 64 // pack
    box, coords = (D, pack, rows), (0, h0, 30)
    assert map_layout(view, rows, pack) == (view.shape[::-1], view.strides[::-1][1:], box)
    dev = runner.device(g)[:, 1:7]
    out = run_tma(runner, dev, box, coords, "128B")
    assert_bytes(f"pack {pack} box at {coords}", out, tma_box_expected(view, box, coords, "128B"))


# ---- mbarrier and named barriers ---------------------------------------------------------------

def test_mbarrier_phases_and_transaction_bytes(runner):
    """try_wait: phase 0 before arrivals; after them; phase 1 before its arrivals; with every
    arrival in but 64 transaction bytes due; after the bulk copy; phase 2 (parity 0) open."""
    src = np.arange(64, dtype=np.uint8) * 3
    out, got = run_mbar_phases(runner, src)
    assert out.tolist() == [0, 1, 0, 0, 1, 0, 1], f"try_wait results {out.tolist()}"
    assert np.array_equal(got, src), "bulk copy bytes"


def ping_pong_values(rounds):
    want, last = [], 0
    for r in range(rounds):
        last = (r * 10 + last % 7) * 3 + 1
        want.append(last)
    return want


def test_named_barriers_order_a_ping_pong(runner):
    """bar.arrive does not wait, bar.sync waits for the announced count: two warpgroups hand a
    value back and forth through shared memory, each read ordered after the other's write."""
    assert run_named(runner, 6).tolist() == ping_pong_values(6)


# ---- wgmma ---------------------------------------------------------------------------------------

def assert_device_descriptors(case, descs):
    """The descriptors the kernel made from its shared-memory base: 1024-byte aligned, and
    the ISA's fields of A's and B's offsets from it."""
    base = int(descs[2])
    assert base % SMEM_ALIGN == 0, f"shared base {base:#x} is not {SMEM_ALIGN}-byte aligned"
    for name, got, (off, lbo, sbo, _) in (("A", descs[0], case["a_layout"]),
                                          ("B", descs[1], case["b_layout"])):
        want = desc(base + off, lbo, sbo, case["swizzle"])
        assert int(got) == want, f"descriptor of {name}: {int(got):#018x}, expected {want:#018x}"


@pytest.mark.parametrize("n,mode,swz,ksteps,dtype", WGMMA_CASES,
                         ids=[f"N{c[0]}-{c[1]}-{c[2]}-k{16 * c[3]}-{c[4]}" for c in WGMMA_CASES])
def test_wgmma_product_against_numpy(runner, n, mode, swz, ksteps, dtype):
    rng = np.random.default_rng(n + ksteps + len(mode) + len(swz))
    case = wgmma_case(n, mode, swz, ksteps, dtype, rng)
    out, _, descs = run_wgmma(runner, n, mode, dtype, case, ksteps)
    assert_device_descriptors(case, descs)
    d = to_matrix(out, n)
    expected = case["a"] @ case["b"]                    # exact: multiples of 1/16, small sums
    bad = np.argwhere(d != expected)
    assert bad.size == 0, (f"{len(bad)} of {d.size} elements differ; first at (row, col) = "
                           f"{tuple(bad[0])}: {d[tuple(bad[0])]} vs {expected[tuple(bad[0])]}")


def test_wgmma_accumulates_onto_registers_and_setmaxnreg(runner):
    n, mode, dtype = 64, "RS_K", "float16"
    rng = np.random.default_rng(5)
    case = wgmma_case(n, mode, "128B", 2, dtype, rng)
    init = (rng.integers(-8, 9, (128, n // 2)) / 2.0).astype(np.float32)
    out, _, _ = run_wgmma(runner, n, mode, dtype, case, 2, F_ACCUMULATE | F_SETMAXNREG, init)
    expected = case["a"] @ case["b"] + to_matrix(init, n)
    assert np.array_equal(to_matrix(out, n), expected), "D = A B + C with C from registers"


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_attention_tile_scores_to_registers_to_pv(runner, dtype):
    """O = round(Q K^T) V with the scores' D fragment reused as the A fragment of P V (the
    FlashAttention register path), K as B K-major and V as B N-major."""
    buf, expected, bound = attention_tile_case(dtype, np.random.default_rng(3))
    got = to_matrix(run_attention_tile(runner, dtype, buf), 64)
    err = np.abs(got - expected).max()
    assert err <= bound, f"{dtype}: max error {err:.3e} > {bound:.3e}"


# ---- stmatrix ------------------------------------------------------------------------------------

@pytest.mark.parametrize("trans", [False, True], ids=["plain", "trans"])
def test_stmatrix_layout(runner, trans):
    rng = np.random.default_rng(7)
    regs = rng.integers(0, 2 ** 32, (32, 4), dtype=np.uint64).astype(np.uint32)
    row_stride = 32                                       # rows 16 bytes apart from each other
    out = run_stmatrix(runner, regs, row_stride, trans)
    got = out.reshape(32, row_stride)[:, :16].copy().view(np.uint16)
    want = stmatrix_expected(regs, row_stride, trans)
    bad = np.argwhere(got != want)
    assert bad.size == 0, f"{len(bad)} elements differ; first (row, column) {tuple(bad[0])}"


# ---- a warp-specialised TMA + mbarrier + wgmma pipeline ---------------------------------------

@pytest.mark.parametrize("consumers", [pytest.param(1, marks=pytest.mark.smoke), 2])
def test_warp_specialised_pipeline(runner, consumers):
    a16, b16, expected = pipeline_operands(11, consumers)
    got = pipeline_result(run_pipeline(runner, a16, b16, consumers), consumers)
    assert np.array_equal(got, expected), f"pipeline, {consumers} consumers"


def test_a_gpu_runner_refuses_the_misuses(runner):
    """The misuses the emulation reports (a warp skipping a wgmma, a wait no copy completes, a
    named-barrier deadlock) would hang a GPU: its runner refuses them before any launch."""
    from emulation.sm90_primitives import F_WARP3_SKIPS, misuse_wgmma, run_mbar_misuse
    if runner.reports_misuse:
        pytest.skip("the emulation reports them (tests/emulation/test_emulation_sm90.py)")
    for run in (lambda: misuse_wgmma(runner, F_WARP3_SKIPS), lambda: run_mbar_misuse(runner, 1),
                lambda: run_named(runner, 2, misuse=2)):
        with pytest.raises(ValueError, match="may hang"):
            run()
