"""The Hopper primitives of kernels_cuda/sm90.cuh one at a time, in the host emulation and on a
Hopper GPU, from one description:

* the harness kernels, emulation/cuda/sm90_harness.cu: one source for the g++ build of the
  emulation and the NVRTC build for sm_90a (`KERNELS`: their names, the same in both);
* two runners with one interface (`device`, `host`, `tensor_map`, `launch`):
  `EmulationRunner` (the g++ build, host arrays, the emulation's tensor maps) and `CupyRunner`
  (the NVRTC cubin, kept on disk with the sm_90a kernels' cubins, CuPy arrays, tensor maps by
  the driver's `cuTensorMapEncodeTiled` through the launcher's own `sm90.tiled_args`);
* one `run_*` function per primitive: its kernel, arguments, threads and shared memory,
  whichever runner takes it;
* the expectations, written from the PTX ISA (fragment layouts, descriptor fields, canonical
  layouts, swizzles) and NumPy products with values whose float32 sums are exact.

tests/emulation/test_sm90_primitives.py holds the results of both runners to the expectations;
tests/emulation/test_emulation_sm90.py checks what only the emulation models (misuse reports,
copy landing schedules, NaN accumulators in flight, ThreadSanitizer).

    python -m emulation.sm90_primitives     # builds the sm_90a cubin into the cache
"""
from __future__ import annotations

import ctypes
import hashlib
import json
import os
import sys

import numpy as np

from .cupy import EMULATION_DIR, LANDING, build_harness, tensor_map as emulation_tensor_map

HARNESS = os.path.join(EMULATION_DIR, "sm90_harness.cu")
ARCH = "sm_90a"
WG_THREADS = 128
SMEM_ALIGN = 1024               # sm90_harness.cu's: every launch adds it as slack
SWIZZLE = {"none": 0, "32B": 1, "64B": 2, "128B": 3}        # CUtensorMapSwizzle
SWIZZLE_BYTES = {"none": 0, "32B": 32, "64B": 64, "128B": 128}
MODES = {"SS_KK": 0, "SS_KN": 1, "RS_K": 2, "RS_N": 3, "SS_MK": 4}     # sm90_harness.cu's WgMode
CTYPES = {"float16": "__half", "bfloat16": "__nv_bfloat16"}
# sm90_wgmma's flags (sm90_harness.cu's WG_*)
F_ACCUMULATE, F_PEEK, F_NO_FENCE, F_CLOBBER, F_WARP3_SKIPS, F_SETMAXNREG = 1, 2, 4, 8, 16, 32
F_GROUP_PER_STEP, F_NO_PROXY_FENCE, F_FLAG_HANDOFF = 64, 128, 256
F_WRITE_AFTER_FENCE, F_A_AFTER_FENCE, F_WARP3_EXITS = 512, 1024, 2048
# the flags of defined behaviour; the others are misuses or hazards that the emulation reports or
# shows, and that a GPU may hang on or answer at random (a runner without `reports_misuse`
# refuses them)
DEFINED_FLAGS = F_ACCUMULATE | F_SETMAXNREG | F_GROUP_PER_STEP
WG_MAX_KSTEPS = 8
# sm90_harness.cu's WgOperands
WG_OPERANDS_DTYPE = np.dtype([(name, np.uint32) for name in (
    "a_off", "a_lbo", "a_sbo", "a_step", "b_off", "b_lbo", "b_sbo", "b_step", "swizzle")]
    + [("ksteps", np.int32)], align=True)
PIPE_STAGES, PIPE_TILE, PIPE_MAX_CONSUMERS = 2, 64 * 64 * 2, 2
# the harness's setmaxnreg targets (WG_REGS_INC; PIPE_PRODUCER_REGS, PIPE_CONSUMER_REGS), which
# the registers a block starts with must hold (tests/compile/test_sm90_compile.py)
WG_REGS_INC, PIPE_PRODUCER_REGS, PIPE_CONSUMER_REGS = 240, 24, 240
PIPELINE_KTILES = 5             # more tiles than the 2 stages: every stage is refilled

# The harness kernels by their NVRTC name expressions: the emulation's table in order
KERNELS = (["sm90_tma_box", "sm90_mbar_phases", "sm90_mbar_misuse", "sm90_named_pingpong",
            "sm90_stmatrix", "sm90_pipeline"]
           + [f"sm90_attention_tile<{t}>" for t in CTYPES.values()]
           + [f"sm90_wgmma<{t}, {n}, {m}>" for t in CTYPES.values() for n in (32, 64, 128, 256)
              for m in MODES.values()])


# ---- the two runners ---------------------------------------------------------------------------

class EmulationRunner:
    """The harness through the host emulation (g++, one OS thread per CUDA thread): host arrays,
    the emulation's tensor maps, launches by name through the harness's table. `race`: the
    ThreadSanitizer build (the runtime preloaded)."""

    name = "emulation"
    reports_misuse = True           # a misuse aborts with a report, never hangs
    MAX_PARAMS = 16

    def __init__(self, race: bool = False):
        lib = build_harness(HARNESS, race=race)
        P, U32, U64, I32 = ctypes.c_void_p, ctypes.c_uint, ctypes.c_ulonglong, ctypes.c_int
        lib.sm90_kernel_name.argtypes, lib.sm90_kernel_name.restype = [I32], ctypes.c_char_p
        lib.sm90_param_sizes.argtypes = [ctypes.c_char_p, P]
        lib.sm90_launch.argtypes = [ctypes.c_char_p, U32, ctypes.c_size_t, P]
        lib.sm90_configure.argtypes = [I32, U64]
        lib.sm90_make_desc.argtypes, lib.sm90_make_desc.restype = [U32, U32, U32, U32], U64
        lib.sm90_tensor_map_bytes.argtypes = [P, I32, I32, P, P, P, I32, I32, P]
        self.lib = lib
        self.configure("wait")

    def configure(self, landing: str, seed: int = 0) -> None:
        """When copies land and wgmma operands are read (`emulation.cupy.LANDING`), seeded."""
        self.lib.sm90_configure(LANDING[landing], seed)

    def kernels(self) -> list:
        """The names of the harness's table."""
        names, i = [], 0
        while (name := self.lib.sm90_kernel_name(i)) is not None:
            names.append(name.decode())
            i += 1
        return names

    def device(self, a) -> np.ndarray:
        return np.array(a, copy=True)

    def host(self, a) -> np.ndarray:
        return np.asarray(a)

    def tensor_map(self, a, box, swizzle: int, nan_fill: bool = False) -> np.ndarray:
        return emulation_tensor_map(a, box, swizzle, nan_fill)

    def launch(self, kernel: str, *, threads: int, smem: int, args) -> None:
        from .cupy import check_launch
        from .sm90 import kernel_params
        key = kernel.encode()
        sizes = (ctypes.c_size_t * self.MAX_PARAMS)()
        n = self.lib.sm90_param_sizes(key, sizes)
        if n < 0:
            raise KeyError(f"{kernel}: not in the harness's table")
        params, keep = kernel_params(kernel, args, sizes[:n])
        check_launch(kernel, self.lib.sm90_launch(key, threads, smem, params))


class CupyRunner:
    """The harness on a Hopper GPU: the sm_90a cubin (`harness_cubin`) through CuPy, CuPy
    arrays, tensor maps by the driver; each launch synchronised, so a fault names it."""

    name = "gpu"
    reports_misuse = False          # a misuse may hang the GPU: refused before the launch

    def __init__(self):
        import cupy
        self._cupy = cupy
        path, self._lowered = harness_cubin()
        self._module = cupy.RawModule(path=path)
        self._functions = {}

    def device(self, a):
        return self._cupy.asarray(np.ascontiguousarray(a))

    def host(self, a) -> np.ndarray:
        return self._cupy.asnumpy(a)

    def tensor_map(self, a, box, swizzle: int, nan_fill: bool = False) -> np.ndarray:
        from varlen.backends.cupy.sm90 import encode_tensor_map
        return encode_tensor_map(map_args(a, box, swizzle, nan_fill))

    def launch(self, kernel: str, *, threads: int, smem: int, args) -> None:
        fn = self._functions.get(kernel)
        if fn is None:
            fn = self._functions[kernel] = self._module.get_function(self._lowered[kernel])
        if smem > fn.max_dynamic_shared_size_bytes:
            fn.max_dynamic_shared_size_bytes = smem
        fn((1,), (threads,), tuple(args), shared_mem=smem)
        self._cupy.cuda.Device().synchronize()


def map_args(a, box, swizzle: int, nan_fill: bool = False) -> tuple:
    """The launchers' `sm90.tiled_args` of the map of device array `a` (2 or 3 dims, the last
    contiguous; a view where it lies): its dims and byte strides innermost first, `box`."""
    from varlen.backends.cupy.sm90 import tiled_args
    return tiled_args(a.data.ptr, a.dtype, a.shape[::-1], a.strides[::-1][1:], box, swizzle,
                      nan_fill)


def harness_source() -> str:
    with open(HARNESS) as f:
        return f.read()


def build_harness_cubin():
    """NVRTC build of every harness kernel for sm_90a with the kernels' options
    (`compile.build_program`): (cubin, {kernel: lowered name}, ptxas log)."""
    from varlen.backends.cupy.compile import build_program
    templates = [k for k in KERNELS if "<" in k]
    cubin, lowered, log = build_program(templates, ARCH, harness_source())
    return cubin, {k: lowered.get(k, k) for k in KERNELS}, log


def harness_cubin() -> tuple:
    """(path of the harness's sm_90a cubin, {kernel: lowered name}), built once into the
    sm_90a kernels' cache folder (`compile.cache_dir`), keyed as their cubins are (NVRTC's
    version, the build options with the kernel sources' hash) and by the harness's source."""
    from cuda.bindings import nvrtc

    from varlen.backends.cupy.compile import cache_dir, program_options
    _, major, minor = nvrtc.nvrtcVersion()
    key = hashlib.sha256("\0".join([*KERNELS, f"nvrtc {major}.{minor}", *program_options(ARCH),
                                    harness_source()]).encode()).hexdigest()[:32]
    folder = cache_dir()
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"sm90_harness_{key}.cubin")
    names = os.path.join(folder, f"sm90_harness_{key}.json")
    if not (os.path.exists(path) and os.path.exists(names)):
        cubin, lowered, _ = build_harness_cubin()
        # written under a temporary name and renamed: processes building at once never read
        # half a file
        for target, data in ((names, json.dumps(lowered).encode()), (path, cubin)):
            tmp = f"{target}.{os.getpid()}.tmp"
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, target)
    with open(names) as f:
        return path, json.load(f)


# ---- each primitive's launch ------------------------------------------------------------------

def run_tma(r, dev, box, coords, swz: str, nan_fill: bool = False) -> np.ndarray:
    """The bytes of the TMA box `box` (innermost first) of `dev` (the runner's array of 2 or 3
    dims, a view read where it lies) at `coords` as sm90_tma_box lands it in shared memory."""
    tmap = r.tensor_map(dev, box, SWIZZLE[swz], nan_fill)
    nbytes = int(np.prod(box)) * dev.dtype.itemsize
    bar_off = -(-nbytes // 1024) * 1024
    out = r.device(np.full(nbytes, 0xAB, np.uint8))
    c = [int(x) for x in coords] + [0] * (3 - len(coords))
    r.launch("sm90_tma_box", threads=WG_THREADS, smem=bar_off + 16 + SMEM_ALIGN,
             args=(tmap, np.int32(dev.ndim), *(np.int32(x) for x in c), np.uint32(nbytes),
                   np.uint32(bar_off), out))
    return r.host(out)


def run_mbar_phases(r, src) -> tuple:
    """sm90_mbar_phases: (its seven observations, the 64 bytes bulk-copied from src)."""
    out = r.device(np.full(8, -1, np.int32))
    got = r.device(np.zeros(64, np.uint8))
    r.launch("sm90_mbar_phases", threads=64, smem=256 + SMEM_ALIGN,
             args=(r.device(src), out, got))
    return r.host(out)[:7], r.host(got)


def _refuse_misuse(r, what: str) -> None:
    if not r.reports_misuse:
        raise ValueError(f"{what}: a misuse only a runner that reports it runs (the "
                         f"emulation); the {r.name} runner may hang on it")


def run_named(r, rounds: int, misuse: int = 0) -> np.ndarray:
    """sm90_named_pingpong's value of each round (`misuse`: the emulation's reports)."""
    if misuse:
        _refuse_misuse(r, f"sm90_named_pingpong {misuse=}")
    out = r.device(np.full(max(rounds, 1), -1, np.int32))
    r.launch("sm90_named_pingpong", threads=2 * WG_THREADS, smem=64 + SMEM_ALIGN,
             args=(np.int32(rounds), out, np.int32(misuse)))
    return r.host(out)[:rounds]


def run_mbar_misuse(r, what: int) -> None:
    """sm90_mbar_misuse `what` (the emulation reports each; never on a GPU: it would hang)."""
    _refuse_misuse(r, f"sm90_mbar_misuse {what=}")
    r.launch("sm90_mbar_misuse", threads=32, smem=64 + SMEM_ALIGN,
             args=(np.int32(what), r.device(np.zeros(16, np.uint8))))


def wg_operands(case: dict, ksteps: int) -> np.ndarray:
    """The WgOperands struct of a `wgmma_case`."""
    from varlen.backends.cupy.launch import struct
    if ksteps > WG_MAX_KSTEPS:
        raise ValueError(f"{ksteps=}: the harness holds at most {WG_MAX_KSTEPS} k-steps")
    return struct(WG_OPERANDS_DTYPE, [*case["a_layout"], *case["b_layout"],
                                      SWIZZLE[case["swizzle"]], ksteps])


def run_wgmma(r, n: int, mode: str, dtype: str, case: dict, ksteps: int, flags: int = 0,
              init=None) -> tuple:
    """sm90_wgmma of `case` (`wgmma_case`): (out [128 threads][n / 2], probe [128], the
    descriptors of A and B it made and its shared base address)."""
    if flags & ~DEFINED_FLAGS:
        _refuse_misuse(r, f"sm90_wgmma flags {flags & ~DEFINED_FLAGS:#x}")
    smem = case["smem"]
    a_regs = case["a_regs"] if case["a_regs"] is not None else np.zeros((1, 128, 4), np.uint32)
    init = np.zeros((128, n // 2), np.float32) if init is None else init
    out = r.device(np.full((128, n // 2), np.nan, np.float32))
    probe = r.device(np.zeros(128, np.float32))
    descs = r.device(np.zeros(3, np.uint64))
    r.launch(f"sm90_wgmma<{CTYPES[dtype]}, {n}, {MODES[mode]}>", threads=WG_THREADS,
             smem=smem.size + 16 + SMEM_ALIGN,
             args=(r.device(smem), np.uint32(smem.size), r.device(a_regs),
                   wg_operands(case, ksteps), r.device(init), out, probe, descs,
                   np.int32(flags)))
    return r.host(out), r.host(probe), r.host(descs)


def run_stmatrix(r, regs, row_stride: int, trans: bool) -> np.ndarray:
    """The 32 rows of `row_stride` bytes that stmatrix.x4 (.trans) writes from regs[lane][4]."""
    out = r.device(np.zeros(32 * row_stride, np.uint8))
    r.launch("sm90_stmatrix", threads=32, smem=32 * row_stride + SMEM_ALIGN,
             args=(r.device(regs), np.uint32(row_stride), np.int32(trans), out))
    return r.host(out)


def run_pipeline(r, a16, b16, consumers: int) -> np.ndarray:
    """sm90_pipeline over a16 [64 consumers, 64 ktiles] and b16 [64, 64 ktiles] (16-bit
    patterns of fp16, K innermost): out [consumers][128 threads][32]."""
    if not 1 <= consumers <= PIPE_MAX_CONSUMERS:
        raise ValueError(f"{consumers=}: the pipeline's register split holds 1 to "
                         f"{PIPE_MAX_CONSUMERS} consumer warpgroups")
    ktiles = a16.shape[1] // 64
    a, b = r.device(a16), r.device(b16)
    maps = (r.tensor_map(a, (64, 64 * consumers), SWIZZLE["128B"]),
            r.tensor_map(b, (64, 64), SWIZZLE["128B"]))
    out = r.device(np.full((consumers, 128, 32), np.nan, np.float32))
    smem = PIPE_STAGES * (consumers + 1) * PIPE_TILE + 2 * PIPE_STAGES * 8 + SMEM_ALIGN
    r.launch("sm90_pipeline", threads=(1 + consumers) * WG_THREADS, smem=smem,
             args=(*maps, np.int32(ktiles), np.int32(consumers), out))
    return r.host(out)


def run_attention_tile(r, dtype: str, buf) -> np.ndarray:
    """sm90_attention_tile of the Q, K, V image `buf` (`attention_tile_case`): out [128][32]."""
    out = r.device(np.full((128, 32), np.nan, np.float32))
    r.launch(f"sm90_attention_tile<{CTYPES[dtype]}>", threads=WG_THREADS,
             smem=3 * 8192 + SMEM_ALIGN, args=(r.device(buf), out))
    return r.host(out)


def misuse_wgmma(r, flags: int, mode: str = "SS_KK") -> None:
    """A wgmma run with `flags` from operands made here (the emulation's misuse reports):
    shared memory of zeros, two k-steps of A fragments of distinct bits (RS modes)."""
    case = dict(smem=np.zeros(32768, np.uint8), swizzle="128B", a_layout=(0, 0, 1024, 32),
                b_layout=(16384, 0, 1024, 32),
                a_regs=np.arange(1, 1025, dtype=np.uint32).reshape(2, 128, 4)
                if mode.startswith("RS") else None)
    run_wgmma(r, 64, mode, "float16", case, 2, flags)


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


def to_matrix(frag, n):
    """[64, n] from a D fragment [128 threads][n / 2]."""
    rows, cols = d_fragment(n)
    d = np.full((64, n), np.nan)
    d[rows, cols] = frag
    return d


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
    """Multiples of 1/4 in [-2, 2]: exact in fp16/bf16, and every product sum exact in fp32.
    Returns (16-bit patterns, float64 values)."""
    x = rng.integers(-8, 9, shape) / 4.0
    if dtype == "float16":
        return x.astype(np.float16).view(np.uint16), x
    bits = (x.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    return bits, x


def round_to(x, dtype):
    """float64 -> nearest fp16 / bf16 (ties to even), as float64."""
    if dtype == "float16":
        return x.astype(np.float16).astype(np.float64)
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16 << 16
    return u.astype(np.uint32).view(np.float32).astype(np.float64)


def tma_box_expected(g, box, coords, swz, nan_fill=False) -> np.ndarray:
    """The bytes a TMA box of g (2 or 3 dims; `box` and `coords` innermost first) lands as:
    dense, innermost first, out-of-bounds elements zero (NaN with `nan_fill`), and each row of
    the box (its innermost dimension, exactly the swizzle's width when swizzled) with its 16-byte
    chunks permuted by the swizzle pattern of its row within the box."""
    rank = g.ndim
    box3 = list(box) + [1] * (3 - rank)
    c3 = list(coords) + [0] * (3 - rank)
    g3 = g.reshape((1,) * (3 - rank) + g.shape)
    e = g.itemsize
    row_bytes = box3[0] * e
    fill = np.array(np.nan if nan_fill else 0, g.dtype).tobytes()
    out = np.zeros(int(np.prod(box3)) * e, np.uint8)
    for z in range(box3[2]):
        for y in range(box3[1]):
            row = z * box3[1] + y
            for x in range(box3[0]):
                gz, gy, gx = c3[2] + z, c3[1] + y, c3[0] + x
                inside = all(0 <= p < s for p, s in zip((gz, gy, gx), g3.shape))
                value = g3[gz, gy, gx].tobytes() if inside else fill
                chunk = swizzled_chunk(row, (e * x) // 16, swz)
                off = row * row_bytes + chunk * 16 + (e * x) % 16
                out[off:off + e] = np.frombuffer(value, np.uint8)
    return out


def wgmma_case(n, mode, swz, ksteps, dtype, rng):
    """Operands of one case: shared-memory image `smem`, the layouts of A and B in it
    (`a_layout`, `b_layout`: offset, LBO, SBO, k-step advance, bytes), the A fragments
    `a_regs` (RS modes), and the [64, K] A and [K, n] B as float64."""
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
    return dict(smem=buf, swizzle=swz, a_layout=(a_base, a_lbo, a_sbo, a_step),
                b_layout=(b_base, b_lbo, b_sbo, b_step), a_regs=a_regs, a=a, b=b)


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


def attention_tile_case(dtype, rng):
    """(shared-memory image of Q, K, V [64, 64] each, 128B swizzle: Q and K K-major, V as B
    N-major; the expected O = round(Q K^T) V; the bound of its error)."""
    q16, q = exact_values(rng, (64, 64), dtype)
    k16, k = exact_values(rng, (64, 64), dtype)          # [keys][d]
    v16, v = exact_values(rng, (64, 64), dtype)          # [keys][d]
    buf = np.zeros(3 * 8192, np.uint8)
    place(buf, 0, q16, "K", "128B", 0, 1024)
    place(buf, 8192, k16, "K", "128B", 0, 1024)          # B[k = d][n = key] = K[key][d]
    place(buf, 16384, np.ascontiguousarray(v16.T), "MN", "128B", 8192, 1024)   # B = V, N-major
    p = round_to(q @ k.T, dtype)                         # exact scores, rounded once
    return buf, p @ v, 1e-6 * (np.abs(p) @ np.abs(v)).max()


def stmatrix_expected(regs, row_stride, trans) -> np.ndarray:
    """The 32 rows of 16 bytes stmatrix.x4 (.trans) writes from regs[lane][4] (row 8 i + r of
    matrix i at (8 i + r) row_stride bytes): ISA, register i of lane l holds M_i[l/4][2(l%4) + h]
    (.trans: M_i[2(l%4) + h][l/4])."""
    halves = regs.view(np.uint16).reshape(32, 4, 2)       # [lane][register][low, high]
    rows = np.zeros((32, 8), np.uint16)
    for i in range(4):
        for r in range(8):
            for c in range(8):
                lane, h = (4 * c + r // 2, r % 2) if trans else (4 * r + c // 2, c % 2)
                rows[8 * i + r, c] = halves[lane, i, h]
    return rows


def pipeline_operands(seed, consumers=1):
    """(A [64 consumers, 64 ktiles], B [64, 64 ktiles] as fp16 bit patterns (K innermost: B
    K-major), the expected A B^T)."""
    rng = np.random.default_rng(seed)
    a16, a = exact_values(rng, (64 * consumers, 64 * PIPELINE_KTILES), "float16")
    b16, b = exact_values(rng, (64, 64 * PIPELINE_KTILES), "float16")   # [n][k]: K-major B
    return a16, b16, a @ b.T


def pipeline_result(out, consumers):
    """[64 consumers, 64] from out[consumer][thread][32]."""
    return np.concatenate([to_matrix(out[c], 64) for c in range(consumers)])


if __name__ == "__main__":
    print(harness_cubin()[0])
    sys.exit(0)
