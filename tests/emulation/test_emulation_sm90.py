"""The Hopper primitives of kernels_cuda/sm90.cuh: their host emulation pinned against the PTX
ISA's layouts (their inline PTX assembled for sm_90a with NVRTC:
tests/compile/test_sm90_compile.py).

The harness (emulation/cuda/sm90_harness.cu) only moves data; every expectation here is written
out by hand from the ISA: the wgmma D and A register fragments, the descriptor's bit fields, the
TMA swizzle as (row, 16-byte chunk) permutations, a box with out-of-bounds rows, mbarrier phases
and transaction counts, and products against NumPy with values whose float32 sums are exact.
"""
from __future__ import annotations

import ctypes
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import emulation.cupy as _cupy_emulation

HERE = os.path.dirname(os.path.abspath(__file__))
HARNESS = os.path.join(_cupy_emulation.EMULATION_DIR, "sm90_harness.cu")
LANDING = _cupy_emulation.LANDING
SWIZZLE = {"none": 0, "32B": 1, "64B": 2, "128B": 3}        # CUtensorMapSwizzle
SWIZZLE_BYTES = {"none": 0, "32B": 32, "64B": 64, "128B": 128}
MODES = {"SS_KK": 0, "SS_KN": 1, "RS_K": 2, "RS_N": 3, "SS_MK": 4}
F_ACCUMULATE, F_PEEK, F_NO_FENCE, F_CLOBBER, F_WARP3_SKIPS, F_SETMAXNREG = 1, 2, 4, 8, 16, 32
F_GROUP_PER_STEP, F_NO_PROXY_FENCE, F_FLAG_HANDOFF = 64, 128, 256
F_WRITE_AFTER_FENCE, F_A_AFTER_FENCE, F_WARP3_EXITS = 512, 1024, 2048

P = ctypes.c_void_p
U32, U64, I32 = ctypes.c_uint, ctypes.c_ulonglong, ctypes.c_int


@pytest.fixture(scope="module")
def lib():
    lib = _cupy_emulation.build_harness(HARNESS)
    lib.sm90_configure.argtypes = [I32, U64]
    lib.sm90_make_desc.argtypes = [U32, U32, U32, U32]
    lib.sm90_make_desc.restype = U64
    lib.sm90_run_tma.argtypes = [P, I32, I32, P, P, P, I32, I32, P, P]
    lib.sm90_tensor_map_bytes.argtypes = [P, I32, I32, P, P, P, I32, I32, P]
    lib.sm90_run_mbar_phases.argtypes = [P, P, P]
    lib.sm90_run_named.argtypes = [I32, P, I32]
    lib.sm90_run_wgmma.argtypes = [I32, I32, I32, P, U32, P, U64, U64, U32, U32, I32, P, P, P,
                                   I32]
    lib.sm90_run_wgmma.restype = I32
    lib.sm90_run_stmatrix.argtypes = [P, U32, I32, P]
    lib.sm90_run_pipeline.argtypes = [P, P, I32, I32, P]
    lib.sm90_run_attention_tile.argtypes = [I32, P, P]
    lib.sm90_configure(LANDING["wait"], 0)
    return lib


def ptr(a):
    return a.ctypes.data if a is not None else None


# ---- expectations, written from the PTX ISA ---------------------------------------------------

def d_fragment(n):
    """(row, col) of register i of warpgroup thread t for wgmma m64nNk16 D (fp32): ISA figure
    "WGMMA .m64nNk16 register fragment layout for accumulator matrix D"."""
    t = np.arange(128)[:, None]
    i = np.arange(n // 2)[None, :]
    warp, group, tig = t // 32, (t % 32) // 4, t % 4
    row = 16 * warp + group + 8 * ((i % 4) // 2)
    col = 8 * (i // 4) + 2 * tig + (i % 2)
    return np.broadcast_to(row, (128, n // 2)), np.broadcast_to(col, (128, n // 2))


def a_fragment_regs(a16):
    """The A fragments of m64nNk16 from registers for one k16 step, [128 threads][4] uint32, from
    a [64, 16] array of 16-bit patterns: element a_j (j = 0..7) of thread t sits at row
    16 warp + group (+8 for j in 2, 3, 6, 7), column 2 tig + j % 2 (+8 for j >= 4); register
    j // 2, lower 16 bits for even j."""
    regs = np.zeros((128, 4), np.uint32)
    for t in range(128):
        warp, group, tig = t // 32, (t % 32) // 4, t % 4
        for j in range(8):
            row = 16 * warp + group + (8 if j in (2, 3, 6, 7) else 0)
            col = 2 * tig + j % 2 + (8 if j >= 4 else 0)
            regs[t, j // 2] |= np.uint32(a16[row, col]) << np.uint32(16 * (j % 2))
    return regs


def swizzled_chunk(row, chunk, swz):
    """16-byte chunk that chunk `chunk` of row `row` of a swizzle atom occupies: the ISA's
    swizzle patterns (rows of 32, 64 or 128 bytes; 8 rows an atom): 128B XORs the chunk with
    the row, 64B with the row pair, 32B with the row quadruple."""
    r = row % 8
    return {"none": chunk, "128B": chunk ^ r, "64B": chunk ^ (r // 2), "32B": chunk ^ (r // 4)}[swz]


def place(buf, base, mat16, major, swz, lbo, sbo):
    """Writes mat16 [MN, K] (16-bit patterns) into byte buffer `buf` at `base` in the wgmma
    canonical layout (ISA "Shared Memory Matrix Layout": K-major / MN-major, swizzle atoms of 8
    rows of S bytes; no swizzle: core matrices of 8 rows of 16 bytes), LBO/SBO in bytes."""
    mn_size, k_size = mat16.shape
    S = SWIZZLE_BYTES[swz]
    for mn in range(mn_size):
        for k in range(k_size):
            if major == "K" and S == 0:          # core matrix (mn / 8, k / 8), row mn % 8
                off = (mn // 8) * sbo + (k // 8) * lbo + (mn % 8) * 16 + (k % 8) * 2
            elif major == "K":                   # atom row mn % 8 holds S bytes of k
                chunk = swizzled_chunk(mn % 8, (2 * k) // 16, swz)
                off = (mn // 8) * sbo + (mn % 8) * S + chunk * 16 + (2 * k) % 16
            elif S == 0:                         # core matrix rows are k, 16 bytes of mn
                off = (mn // 8) * sbo + (k // 8) * lbo + (k % 8) * 16 + (mn % 8) * 2
            else:                                # atom row k % 8 holds S bytes of mn
                per_row = S // 2
                chunk = swizzled_chunk(k % 8, (2 * (mn % per_row)) // 16, swz)
                off = ((mn // per_row) * lbo + (k // 8) * sbo + (k % 8) * S + chunk * 16
                       + (2 * mn) % 16)
            buf[base + off: base + off + 2] = np.frombuffer(np.uint16(mat16[mn, k]).tobytes(),
                                                              np.uint8)


def desc(addr, lbo, sbo, swz):
    """Matrix descriptor, ISA "Matrix Descriptor Format": bits 0-13 addr >> 4, 16-29 LBO >> 4,
    32-45 SBO >> 4, 49-51 base offset (0), 62-63 swizzle (none 0, 128B 1, 64B 2, 32B 3)."""
    field = {"none": 0, "128B": 1, "64B": 2, "32B": 3}[swz]
    return ((addr & 0x3FFFF) >> 4) | ((lbo >> 4) << 16) | ((sbo >> 4) << 32) | (field << 62)


def exact_values(rng, shape, dtype):
    """Multiples of 1/4 in [-2, 2]: exact in fp16/bf16, and every product sum exact in fp32."""
    x = rng.integers(-8, 9, shape) / 4.0
    if dtype == "float16":
        return x.astype(np.float16).view(np.uint16), x
    bits = (x.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    return bits, x


# ---- descriptors ---------------------------------------------------------------------------------

@pytest.mark.parametrize("addr,lbo,sbo,swz,expected", [
    (0x0400, 16, 1024, "128B", (1 << 62) | (64 << 32) | (1 << 16) | 0x40),
    (0x0200, 0, 512, "64B", (2 << 62) | (32 << 32) | 0x20),
    (0x0100, 0, 256, "32B", (3 << 62) | (16 << 32) | 0x10),
    (0x2080, 128, 256, "none", (16 << 32) | (8 << 16) | 0x208),
    (0x41230, 4096, 8192, "128B", (1 << 62) | (512 << 32) | (256 << 16) | 0x123),
], ids=["128B", "64B", "32B", "none", "addr-18-bits"])
def test_descriptor_bit_fields(lib, addr, lbo, sbo, swz, expected):
    got = lib.sm90_make_desc(addr, lbo, sbo, SWIZZLE[swz])
    assert got == expected, f"descriptor {got:#018x}, expected {expected:#018x}"
    assert got == desc(addr, lbo, sbo, swz)


# ---- TMA -----------------------------------------------------------------------------------------

def run_tma(lib, g, box, coords, swz, nan_fill=False):
    rank = g.ndim
    dims = np.array(g.shape[::-1], np.uint64)                       # innermost first
    strides = np.array([g.strides[rank - 2 - i] for i in range(rank - 1)], np.uint64)
    box_a = np.array(box, np.uint32)
    co = np.array(coords, np.int32)
    nbytes = int(np.prod(box)) * g.itemsize
    out = np.full(nbytes, 0xAB, np.uint8)
    lib.sm90_run_tma(ptr(g), rank, g.itemsize, ptr(dims), ptr(strides), ptr(box_a),
                     SWIZZLE[swz], int(nan_fill), ptr(co), ptr(out))
    return out


@pytest.mark.parametrize("swz", ["none", "32B", "64B", "128B"])
@pytest.mark.parametrize("coords", [(8, 30), (32, -3)],
                         ids=["rows-past-end", "cols-past-end-rows-before-start"])
def test_tma_2d_box_swizzle_and_out_of_bounds(lib, swz, coords):
    S = SWIZZLE_BYTES[swz] or 64
    box = (S // 2, 16)                                  # (columns, rows) of fp16: rows of S bytes
    rows, cols = 40, S // 2 + 24
    g = np.arange(rows * cols, dtype=np.uint16).reshape(rows, cols) + 1
    g = np.ascontiguousarray(g)
    out = run_tma(lib, g, box, coords, swz)
    c0, c1 = coords
    row_bytes = box[0] * 2
    expected = np.zeros(len(out), np.uint8)
    for y in range(box[1]):
        for x in range(box[0]):
            gy, gx = c1 + y, c0 + x
            v = g[gy, gx] if 0 <= gy < rows and 0 <= gx < cols else 0   # zero fill, as the GPU
            chunk = swizzled_chunk(y, (2 * x) // 16, swz) if swz != "none" else (2 * x) // 16
            off = y * row_bytes + chunk * 16 + (2 * x) % 16
            expected[off:off + 2] = np.frombuffer(np.uint16(v).tobytes(), np.uint8)
    bad = np.flatnonzero(out != expected)
    assert bad.size == 0, (f"{swz} box at {coords}: {bad.size} bytes differ, first at byte "
                           f"{bad[0]}: {out[bad[0]]} vs {expected[bad[0]]}")


def test_tma_3d_box_out_of_bounds_and_nan_fill(lib):
    g = np.ascontiguousarray((np.arange(3 * 5 * 24, dtype=np.float32) + 1).reshape(3, 5, 24))
    box, coords = (8, 4, 2), (20, 3, 2)                  # x 20..27 of 24, y 3..6 of 5, z 2..3 of 3
    for nan_fill in (False, True):
        out = run_tma(lib, g, box, coords, "none", nan_fill).view(np.float32).reshape(2, 4, 8)
        for z in range(2):
            for y in range(4):
                for x in range(8):
                    gz, gy, gx = coords[2] + z, coords[1] + y, coords[0] + x
                    inside = gz < 3 and gy < 5 and gx < 24
                    got = out[z, y, x]
                    if inside:
                        assert got == g[gz, gy, gx], f"element ({z}, {y}, {x})"
                    elif nan_fill:
                        assert np.isnan(got), f"out-of-bounds ({z}, {y}, {x}) not NaN-filled"
                    else:
                        assert got == 0.0, f"out-of-bounds ({z}, {y}, {x}) not zero-filled"


@pytest.mark.parametrize("shape,box,swz,nan_fill", [((40, 88), (64, 16), "128B", False),
                                                    ((3, 5, 24), (8, 4, 2), "none", True)],
                         ids=["2d-128B", "3d-nan-fill"])
def test_python_tensor_map_matches_the_emulation(lib, shape, box, swz, nan_fill):
    """_cupy_emulation.tensor_map (the launchers' map under the emulation) has the bytes of
    sm90::make_tensor_map."""
    g = np.zeros(shape, np.float16 if len(shape) == 2 else np.float32)
    m = _cupy_emulation.tensor_map(g, box, SWIZZLE[swz], nan_fill)
    rank = g.ndim
    dims = np.array(g.shape[::-1], np.uint64)
    strides = np.array([g.strides[rank - 2 - i] for i in range(rank - 1)], np.uint64)
    c_bytes = np.zeros(128, np.uint8)
    lib.sm90_tensor_map_bytes(ptr(g), rank, g.itemsize, ptr(dims), ptr(strides),
                              ptr(np.array(box, np.uint32)), SWIZZLE[swz], int(nan_fill),
                              ptr(c_bytes))
    assert m.tobytes() == c_bytes.tobytes(), (m.tobytes().hex(), c_bytes.tobytes().hex())
    with pytest.raises(ValueError, match="swizzle"):
        _cupy_emulation.tensor_map(g, (box[0] // 2,) + tuple(box[1:]), SWIZZLE["128B"])


# ---- mbarrier ------------------------------------------------------------------------------------

@pytest.mark.parametrize("landing", ["wait", "issue", "random"])
def test_mbarrier_phases_and_transaction_bytes(lib, landing):
    lib.sm90_configure(LANDING[landing], 3)
    try:
        src = np.arange(64, dtype=np.uint8) * 3
        out = np.full(8, -1, np.int32)
        got = np.zeros(64, np.uint8)
        lib.sm90_run_mbar_phases(ptr(src), ptr(out), ptr(got))
    finally:
        lib.sm90_configure(LANDING["wait"], 0)
    # try_wait: phase 0 before arrivals; after them; phase 1 before its arrivals; with every
    # arrival in but 64 transaction bytes due; after the bulk copy; phase 2 (parity 0) open.
    assert out[:7].tolist() == [0, 1, 0, 0, 1, 0, 1], f"try_wait results {out[:7].tolist()}"
    assert np.array_equal(got, src), "bulk copy bytes"


def run_isolated(call, timeout_s="1", expect_fail=True):
    """Runs lib.<call> in a fresh process (the emulation aborts on a misuse); returns stderr."""
    code = ("import ctypes, sys\n"
            "import emulation.cupy as e\n"
            f"lib = e.build_harness({HARNESS!r})\n"
            f"lib.{call}\n")
    env = dict(os.environ, VARLEN_EMULATION_TIMEOUT=timeout_s)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=env)
    if expect_fail:
        assert proc.returncode != 0, f"{call} was not reported:\n{proc.stderr[-2000:]}"
    else:
        assert proc.returncode == 0, f"{call} failed:\n{proc.stderr[-2000:]}"
    return proc.stderr


def test_mbarrier_deadlock_is_reported_not_hung(lib):
    err = run_isolated("sm90_run_mbar_misuse(1)")
    assert "has not completed" in err and "128 transaction bytes expected" in err, err[-2000:]


def test_mbarrier_overwrite_is_reported(lib):
    err = run_isolated("sm90_run_mbar_misuse(2)")
    assert "was overwritten" in err, err[-2000:]


def test_mbarrier_init_without_fence_is_reported(lib):
    err = run_isolated("sm90_run_mbar_misuse(3)")
    assert "not followed by fence.mbarrier_init" in err, err[-2000:]


def test_mbarrier_use_not_ordered_after_its_init_is_reported(lib):
    """Thread 1 sees the init happened (a plain flag) but no barrier orders it after the init:
    the __syncthreads after the inits is missing."""
    err = run_isolated("sm90_run_mbar_misuse(4)")
    assert re.search(r"thread 1: mbarrier.arrive: the mbarrier at shared offset 0 was initialised "
                     r"by thread 0, and this thread has not synchronised", err), err[-2000:]


# ---- named barriers ------------------------------------------------------------------------------

@pytest.mark.parametrize("landing", ["wait", "random"])
def test_named_barriers_order_a_ping_pong(lib, landing):
    """bar.arrive does not wait, bar.sync waits for the announced count: two warpgroups hand a
    value back and forth through shared memory, each read ordered after the other's write."""
    lib.sm90_configure(LANDING[landing], 5)
    try:
        out = np.full(6, -1, np.int32)
        lib.sm90_run_named(6, ptr(out), 0)
    finally:
        lib.sm90_configure(LANDING["wait"], 0)
    want, last = [], 0
    for r in range(6):
        last = (r * 10 + last % 7) * 3 + 1
        want.append(last)
    assert out.tolist() == want


@pytest.mark.parametrize("misuse, message", [
    (1, "announces 128 threads, the phase began with 256"),
    (2, "128 of 256 threads arrived"),
    (3, "barrier id 0"),
    (4, "arrives twice in one phase"),
], ids=["count-mismatch", "deadlock", "id-0", "arrival-twice"])
def test_named_barrier_misuse_is_reported(lib, misuse, message):
    err = run_isolated(f"sm90_run_named(2, (ctypes.c_int * 2)(), {misuse})")
    assert message in err, err[-2000:]


# ---- wgmma ---------------------------------------------------------------------------------------

def wgmma_case(n, mode, swz, ksteps, dtype, rng):
    """Operands of one case: shared-memory image, descriptors, k-step advances, A fragments,
    and the [64, K] A and [K, n] B as float64."""
    K = 16 * ksteps
    a16, a = exact_values(rng, (64, K), dtype)
    b16, b = exact_values(rng, (K, n), dtype)
    S = SWIZZLE_BYTES[swz]
    buf = np.zeros(1 << 17, np.uint8)
    a_base, b_base = 0, 1 << 16
    a_regs = None
    if mode in ("SS_KK", "RS_K", "SS_KN", "RS_N"):
        # A [64, K] K-major
        if S == 0:
            a_lbo, a_sbo, a_step = 1024, 128, 2048           # k-halves 1 KiB apart, 8-row groups
            for j in range(ksteps):
                place(buf, a_base + j * a_step, a16[:, 16 * j:16 * j + 16], "K", swz, a_lbo, a_sbo)
        else:
            per_atom = S // 2                                 # k per atom row
            a_lbo, a_sbo, a_step = 0, 8 * S, 32
            for j0 in range(0, K, per_atom):                  # one atom column of 64 rows each
                place(buf, a_base + (j0 // per_atom) * 64 * S, a16[:, j0:j0 + per_atom], "K",
                      swz, a_lbo, a_sbo)
            if per_atom == 16:
                a_step = 64 * S
    else:
        # A [64, K] M-major ([K][64 m] stored): 64 m = 128 bytes, one atom per 8 k
        assert swz == "128B"
        a_lbo, a_sbo, a_step = 0, 1024, 2048
        place(buf, a_base, a16, "MN", swz, a_lbo, a_sbo)
    if mode in ("SS_KK", "RS_K", "SS_MK"):
        # B [K, n] K-major ([n][K] stored, like K in Q K^T)
        bt16 = np.ascontiguousarray(b16.T)
        if S == 0:
            b_lbo, b_sbo, b_step = 128, 256, n * 32
            for j in range(ksteps):
                place(buf, b_base + j * b_step, bt16[:, 16 * j:16 * j + 16], "K", swz, b_lbo,
                      b_sbo)
        else:
            per_atom = S // 2
            b_lbo, b_sbo, b_step = 0, 8 * S, 32
            for j0 in range(0, K, per_atom):
                place(buf, b_base + (j0 // per_atom) * n * S, bt16[:, j0:j0 + per_atom], "K",
                      swz, b_lbo, b_sbo)
            if per_atom == 16:
                b_step = n * S
    else:
        # B [K, n] N-major ([K][n] stored, like V in P V)
        bt16 = np.ascontiguousarray(b16.T)                    # [n][K] as place() wants [MN, K]
        if S == 0:
            b_lbo, b_sbo, b_step = (n // 8) * 128, 128, (n // 8) * 256
        else:
            b_lbo, b_sbo, b_step = K * S, 8 * S, 16 * S       # n atoms side by side, K rows each
        place(buf, b_base, bt16, "MN", swz, b_lbo, b_sbo)
    if mode in ("RS_K", "RS_N"):
        a_regs = np.ascontiguousarray(np.stack([a_fragment_regs(a16[:, 16 * j:16 * j + 16])
                                                for j in range(ksteps)]))
    return dict(smem=buf, desc_a=desc(a_base, a_lbo, a_sbo, swz),
                desc_b=desc(b_base, b_lbo, b_sbo, swz), a_step=a_step, b_step=b_step,
                a_regs=a_regs, a=a, b=b)


def run_wgmma(lib, n, mode, dtype, case, ksteps, flags=0, init=None):
    out = np.full((128, n // 2), np.nan, np.float32)
    probe = np.zeros(128, np.float32)
    init = np.zeros((128, n // 2), np.float32) if init is None else init
    rc = lib.sm90_run_wgmma(int(dtype == "bfloat16"), n, MODES[mode], ptr(case["smem"]),
                            case["smem"].size, ptr(case["a_regs"]), case["desc_a"],
                            case["desc_b"], case["a_step"], case["b_step"], ksteps, ptr(init),
                            ptr(out), ptr(probe), flags)
    assert rc == 0, f"no harness kernel for {dtype} N={n} {mode}"
    return out, probe


def to_matrix(frag, n):
    rows, cols = d_fragment(n)
    d = np.full((64, n), np.nan)
    d[rows, cols] = frag
    return d


WGMMA_CASES = [
    # (N, mode, swizzle, k-steps, dtype)
    (64, "SS_KK", "128B", 4, "float16"),
    (128, "SS_KK", "128B", 4, "bfloat16"),
    (256, "SS_KK", "128B", 1, "float16"),
    (32, "SS_KK", "128B", 4, "bfloat16"),
    (32, "RS_N", "128B", 2, "float16"),
    (64, "SS_KN", "128B", 4, "bfloat16"),
    (128, "SS_KN", "128B", 2, "float16"),
    (256, "SS_KN", "128B", 1, "bfloat16"),
    (64, "RS_K", "128B", 4, "float16"),
    (128, "RS_N", "128B", 4, "bfloat16"),
    (256, "RS_K", "128B", 2, "bfloat16"),
    (64, "SS_MK", "128B", 4, "float16"),
    (64, "SS_KK", "64B", 2, "bfloat16"),
    (64, "SS_KK", "32B", 2, "float16"),
    (64, "SS_KK", "none", 2, "float16"),
    (128, "SS_KN", "none", 2, "bfloat16"),
    (64, "RS_N", "64B", 2, "float16"),
]


@pytest.mark.parametrize("n,mode,swz,ksteps,dtype", WGMMA_CASES,
                         ids=[f"N{c[0]}-{c[1]}-{c[2]}-k{16 * c[3]}-{c[4]}" for c in WGMMA_CASES])
def test_wgmma_product_against_numpy(lib, n, mode, swz, ksteps, dtype):
    rng = np.random.default_rng(n + ksteps + len(mode) + len(swz))
    case = wgmma_case(n, mode, swz, ksteps, dtype, rng)
    out, _ = run_wgmma(lib, n, mode, dtype, case, ksteps)
    d = to_matrix(out, n)
    expected = case["a"] @ case["b"]                    # exact: multiples of 1/16, small sums
    bad = np.argwhere(d != expected)
    assert bad.size == 0, (f"{len(bad)} of {d.size} elements differ; first at (row, col) = "
                           f"{tuple(bad[0])}: {d[tuple(bad[0])]} vs {expected[tuple(bad[0])]}")


def test_wgmma_accumulates_onto_registers_and_setmaxnreg(lib):
    n, mode, dtype = 64, "RS_K", "float16"
    rng = np.random.default_rng(5)
    case = wgmma_case(n, mode, "128B", 2, dtype, rng)
    init = (rng.integers(-8, 9, (128, n // 2)) / 2.0).astype(np.float32)
    out, _ = run_wgmma(lib, n, mode, dtype, case, 2, F_ACCUMULATE | F_SETMAXNREG, init)
    expected = case["a"] @ case["b"] + to_matrix(init, n)
    assert np.array_equal(to_matrix(out, n), expected), "D = A B + C with C from registers"


def test_wgmma_accumulators_in_flight_read_as_nan(lib):
    case = wgmma_case(64, "SS_KK", "128B", 1, "float16", np.random.default_rng(0))
    out, probe = run_wgmma(lib, 64, "SS_KK", "float16", case, 1, F_PEEK)
    assert np.isnan(probe).all(), "an accumulator read between commit and wait must be poison"
    assert np.array_equal(to_matrix(out, 64), case["a"] @ case["b"])


def test_wgmma_groups_retire_in_order(lib):
    """One group per k-step, chained on the same accumulators: wait_group 1 retires the first,
    and the accumulators stay poison while the second is pending; wait_group 0 gives the sum."""
    case = wgmma_case(128, "SS_KN", "128B", 3, "float16", np.random.default_rng(2))
    out, probe = run_wgmma(lib, 128, "SS_KN", "float16", case, 3, F_GROUP_PER_STEP)
    assert np.isnan(probe).all(), "accumulators of a pending group readable after wait_group 1"
    assert np.array_equal(to_matrix(out, 128), case["a"] @ case["b"])


@pytest.mark.parametrize("landing", ["issue", "wait"])
def test_wgmma_shared_operands_read_per_landing_mode(lib, landing):
    """Operands overwritten between commit and wait: read at issue, the product is intact; read
    at the wait (the latest the ISA allows), it is the product of zeros, showing the hazard."""
    case = wgmma_case(64, "SS_KK", "128B", 2, "bfloat16", np.random.default_rng(1))
    lib.sm90_configure(LANDING[landing], 0)
    try:
        out, _ = run_wgmma(lib, 64, "SS_KK", "bfloat16", case, 2, F_CLOBBER)
    finally:
        lib.sm90_configure(LANDING["wait"], 0)
    expected = case["a"] @ case["b"] if landing == "issue" else np.zeros((64, 64))
    assert np.array_equal(to_matrix(out, 64), expected), f"landing {landing}"


def isolated_wgmma_call(flags, mode="SS_KK"):
    """A wgmma run with `flags` in a fresh process, from operands made there: shared memory of
    zeros, two k-steps of A fragments of distinct bits (RS modes)."""
    a_regs = "(ctypes.c_uint * 1024)(*range(1, 1025))" if mode.startswith("RS") else "None"
    return (f"sm90_run_wgmma(0, 64, {MODES[mode]}, (ctypes.c_ubyte * 32768)(), 32768, {a_regs}, "
            f"ctypes.c_ulonglong({desc(0, 0, 1024, '128B')}), "
            f"ctypes.c_ulonglong({desc(16384, 0, 1024, '128B')}), 32, 32, 2, "
            "(ctypes.c_float * 4096)(), (ctypes.c_float * 4096)(), (ctypes.c_float * 128)(), "
            f"{flags})")


def test_wgmma_without_fence_is_reported(lib):
    err = run_isolated(isolated_wgmma_call(F_NO_FENCE))
    assert "without a wgmma.fence" in err, err[-2000:]


def test_wgmma_accumulators_written_after_fence_are_reported(lib):
    """d[0] += 1 between the wgmma.fence and the first op: the ISA orders a register write
    before a wgmma's access to the same registers only through a wgmma.fence after it."""
    err = run_isolated(isolated_wgmma_call(F_WRITE_AFTER_FENCE))
    assert re.search(r"wgmma.mma_async \(.*\): its accumulators were written by this thread "
                     r"after its last wgmma.fence", err), err[-2000:]


def test_wgmma_a_fragment_written_after_fence_is_reported(lib):
    """Each k-step's A fragment loaded into the same registers after the fence: the second
    load is a write the fence does not order before the op that reads it."""
    err = run_isolated(isolated_wgmma_call(F_A_AFTER_FENCE, "RS_K"))
    assert re.search(r"wgmma.mma_async \(.*\): its A fragment registers were written by this "
                     r"thread after its last wgmma.fence", err), err[-2000:]


def test_wgmma_register_check_passes_the_isa_order(lib):
    """The same RS product with every A fragment written before the fence runs to the end."""
    run_isolated(isolated_wgmma_call(0, "RS_K"), expect_fail=False)


def test_wgmma_operand_stored_without_proxy_fence_is_reported(lib):
    """Operands written by plain stores, a barrier, no fence.proxy.async: the async proxy (the
    wgmma's operand reads) may not see them."""
    err = run_isolated(isolated_wgmma_call(F_NO_PROXY_FENCE))
    assert re.search(r"kernel sm90_wgmma, block \(0, 0\), thread \d+: wgmma.mma_async \(.*\) "
                     r"reads shared offset \d+ through the async proxy, and a generic-proxy "
                     r"write there .* not yet followed by fence.proxy.async", err), err[-2000:]


def test_wgmma_operand_fenced_but_not_synchronised_is_reported(lib):
    """Thread 0 stores and fences the operands and sets a plain flag; the other threads see the
    flag, so the stores happened, but no barrier orders them after thread 0's fence."""
    err = run_isolated(isolated_wgmma_call(F_FLAG_HANDOFF))
    assert re.search(r"thread (\d+): wgmma.mma_async \(.*\) reads shared offset \d+ through the "
                     r"async proxy: a generic-proxy write there was published by the "
                     r"fence.proxy.async of thread 0 .* has not synchronised", err), err[-2000:]


def test_wgmma_warp_missing_from_warpgroup_is_reported(lib):
    err = run_isolated(isolated_wgmma_call(F_WARP3_SKIPS))
    assert "disagree at a warpgroup collective" in err, err[-2000:]


def test_wgmma_warp_exiting_before_its_warpgroup_is_reported(lib):
    """Warp 3 returns before the wgmma.fence the other three execute. The four warps of a
    warpgroup do not wait for each other at a wgmma (.sync is per warp), so this is found
    without a deadlock, whichever side comes first: at warp 3's exit or at another warp's
    instruction."""
    err = run_isolated(isolated_wgmma_call(F_WARP3_EXITS))
    assert re.search(r"wgmma\.\w+ #\d+ \(.*\): warp 3 of the warpgroup exited without "
                     r"executing it, which warp [012] did", err), err[-2000:]


def round_to(x, dtype):
    """float64 -> nearest fp16 / bf16 (ties to even), as float64."""
    if dtype == "float16":
        return x.astype(np.float16).astype(np.float64)
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16 << 16
    return u.astype(np.uint32).view(np.float32).astype(np.float64)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_attention_tile_scores_to_registers_to_pv(lib, dtype):
    """O = round(Q K^T) V with the scores' D fragment reused as the A fragment of P V (the
    FlashAttention register path), K as B K-major and V as B N-major."""
    rng = np.random.default_rng(3)
    q16, q = exact_values(rng, (64, 64), dtype)
    k16, k = exact_values(rng, (64, 64), dtype)          # [keys][d]
    v16, v = exact_values(rng, (64, 64), dtype)          # [keys][d]
    buf = np.zeros(3 * 8192, np.uint8)
    place(buf, 0, q16, "K", "128B", 0, 1024)
    place(buf, 8192, k16, "K", "128B", 0, 1024)          # B[k = d][n = key] = K[key][d]
    place(buf, 16384, np.ascontiguousarray(v16.T), "MN", "128B", 8192, 1024)   # B = V, N-major
    out = np.full((128, 32), np.nan, np.float32)
    lib.sm90_run_attention_tile(int(dtype == "bfloat16"), ptr(buf), ptr(out))
    p = round_to(q @ k.T, dtype)                         # exact scores, rounded once
    expected = p @ v
    got = to_matrix(out, 64)
    bound = 1e-6 * (np.abs(p) @ np.abs(v)).max()
    err = np.abs(got - expected).max()
    assert err <= bound, f"{dtype}: max error {err:.3e} > {bound:.3e}"


# ---- stmatrix ------------------------------------------------------------------------------------

@pytest.mark.parametrize("trans", [False, True], ids=["plain", "trans"])
def test_stmatrix_layout(lib, trans):
    rng = np.random.default_rng(7)
    regs = rng.integers(0, 2 ** 32, (32, 4), dtype=np.uint64).astype(np.uint32)
    row_stride = 32                                       # rows 16 bytes apart from each other
    out = np.zeros(32 * row_stride, np.uint8)
    lib.sm90_run_stmatrix(ptr(regs), row_stride, int(trans), ptr(out))
    halves = regs.view(np.uint16).reshape(32, 4, 2)       # [lane][register][low, high]
    for i in range(4):
        for r in range(8):
            row = out[(8 * i + r) * row_stride:(8 * i + r) * row_stride + 16].view(np.uint16)
            for c in range(8):
                # ISA: register i of lane l holds M_i[l/4][2(l%4) + h]
                # (.trans: M_i[2(l%4) + h][l/4])
                lane, h = (4 * c + r // 2, r % 2) if trans else (4 * r + c // 2, c % 2)
                assert row[c] == halves[lane, i, h], f"matrix {i} element ({r}, {c})"


# ---- a warp-specialised TMA + mbarrier + wgmma pipeline ---------------------------------------

PIPELINE_KTILES = 5          # more tiles than the 2 stages: every stage is refilled


def pipeline_operands(seed, consumers=1):
    rng = np.random.default_rng(seed)
    a16, a = exact_values(rng, (64 * consumers, 64 * PIPELINE_KTILES), "float16")
    b16, b = exact_values(rng, (64, 64 * PIPELINE_KTILES), "float16")   # [n][k]: K-major B
    return a16, b16, a @ b.T


def pipeline_result(out, consumers):
    """[64 consumers, 64] from out[consumer][thread][32]."""
    return np.concatenate([to_matrix(out[c], 64) for c in range(consumers)])


@pytest.mark.parametrize("landing,consumers", [
    pytest.param("wait", 1, marks=pytest.mark.smoke), ("issue", 1), ("random", 1), ("wait", 2),
    ("random", 2)])
def test_warp_specialised_pipeline(lib, landing, consumers):
    a16, b16, expected = pipeline_operands(11, consumers)
    out = np.full((consumers, 128, 32), np.nan, np.float32)
    lib.sm90_configure(LANDING[landing], 5)
    try:
        lib.sm90_run_pipeline(ptr(a16), ptr(b16), PIPELINE_KTILES, consumers, ptr(out))
    finally:
        lib.sm90_configure(LANDING["wait"], 0)
    got = pipeline_result(out, consumers)
    assert np.array_equal(got, expected), f"pipeline, landing {landing}, {consumers} consumers"


def test_warp_specialised_pipeline_under_thread_sanitizer():
    """The same pipeline built with ThreadSanitizer: the mbarrier protocol orders every shared-
    memory access of producer, copies and consumers (a race would stop the run)."""
    code = f"""
import ctypes, sys
import numpy as np
sys.path.insert(0, {HERE!r})
from test_emulation_sm90 import pipeline_operands, pipeline_result, PIPELINE_KTILES, HARNESS
import emulation.cupy as e
import varlen.backends.cupy.compile as _cupy_compile  # noqa: E402
lib = e.build_harness(HARNESS, race=True)
lib.sm90_configure(2, 7)
a16, b16, expected = pipeline_operands(12, 2)
out = np.full((2, 128, 32), np.nan, np.float32)
lib.sm90_run_pipeline(a16.ctypes.data_as(ctypes.c_void_p), b16.ctypes.data_as(ctypes.c_void_p),
                      PIPELINE_KTILES, 2, out.ctypes.data_as(ctypes.c_void_p))
assert np.array_equal(pipeline_result(out, 2), expected), "pipeline under TSan"
print("pipeline ok")
"""
    # One BLAS thread: OpenBLAS's own threads (NumPy's reference product) are not under test.
    env = dict(os.environ, LD_PRELOAD=_cupy_emulation.tsan_runtime(),
               TSAN_OPTIONS=_cupy_emulation.TSAN_OPTIONS, OPENBLAS_NUM_THREADS="1",
               OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=600, env=env)
    assert proc.returncode == 0 and "pipeline ok" in proc.stdout, proc.stderr[-4000:]
