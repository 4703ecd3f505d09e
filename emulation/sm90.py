"""The sm_90a kernels' launches through the host emulation: `EmulatedRuntime` stands for the
GPU's `varlen.backends.cupy.sm90.Runtime` (`sm90.use_runtime(EmulatedRuntime())`): the kernel
compiled with g++, one OS thread per CUDA thread, its tensor maps made by the emulation's
`make_tensor_map`, on a stand-in device of `EMULATED_SM_COUNT` SMs. Use after
`emulation.cupy.install_fake_cupy` (host arrays)."""
from __future__ import annotations

import ctypes

import numpy as np

from varlen.backends.cupy import sm90

from .cupy import LANDING, OPTIN_SMEM, _build, _Kernel, _mode, check_launch, module_prelude

# The SMs of the stand-in device: few, so that its blocks loop over several work items each.
EMULATED_SM_COUNT = 3


def kernel_params(name: str, args, sizes) -> tuple:
    """The kernelParams of a launch of kernel `name` whose parameters have `sizes` bytes: an
    array of pointers, one to each argument's bytes (`_Kernel._bytes_of`: size-checked), the
    tensor maps copied to 64-byte aligned buffers (the parameter type is alignas(64)); and the
    buffers to keep alive until the launch returns."""
    assert len(args) == len(sizes), f"{name}: {len(args)} arguments for {len(sizes)} parameters"
    fake = _Kernel.__new__(_Kernel)
    fake.name = name
    values = [fake._bytes_of(i, a, size) for i, (a, size) in enumerate(zip(args, sizes))]
    addresses, keep = [], list(values)
    for v in values:
        addr, size = ctypes.addressof(v), ctypes.sizeof(v)
        if size == sm90.TENSOR_MAP_DTYPE.itemsize:
            buf = (ctypes.c_char * (size + 64))()
            keep.append(buf)
            addr = -(-ctypes.addressof(buf) // 64) * 64
            ctypes.memmove(addr, ctypes.addressof(v), size)
        addresses.append(addr)
    return (ctypes.c_void_p * len(addresses))(*addresses), keep


class EmulatedRuntime:
    """The same launches as `sm90.Runtime`, through the host emulation, for both kernels."""

    MAX_PARAMS = 16

    def __init__(self, sm_count: int = EMULATED_SM_COUNT):
        self._sm_count = sm_count
        self.grids = []                 # the grid of each launch, in order
        self._lib_any = None

    def sm_count(self) -> int:
        """The stand-in device's SMs: `EMULATED_SM_COUNT` unless the constructor was told."""
        return self._sm_count

    @staticmethod
    def _build_args(spec) -> tuple:
        """`emulation.cupy._build`'s (type, D, BM, BN, BQ, softcap) of the build holding the
        kernel of `spec`, and its tiles (the forward's key chunk) and head_dim_v."""
        softcap = "true" if spec.softcap else "false"
        if isinstance(spec, sm90.BwdSpec):
            return (spec.ctype, spec.head_dim, 64, spec.block_n, spec.query_chunk, softcap), {}
        bq = 32 if spec.head_dim > 64 else 64
        return ((spec.ctype, spec.head_dim, spec.block_m, spec.block_n, bq, softcap),
                dict(KN90=spec.key_chunk, DV=spec.head_dim_v))

    @staticmethod
    def entry(spec) -> bytes:
        """The kernel of `spec` in the emulation's sm90 table."""
        if isinstance(spec, sm90.BwdSpec):
            return sm90.BWD_KERNEL.encode() + (b"_ordered" if spec.ordered_dq else b"")
        key = sm90.FWD_KERNEL.encode()
        return key if spec.pack == 1 else key + b"_pack%d" % spec.pack

    def _lib(self, spec):
        args, tiles = self._build_args(spec)
        source = getattr(spec, "source", None)
        lib = _build(*args, **tiles, prelude=module_prelude(source) if source else "")
        # VARLEN_EMULATION_SCHEDULE picks when TMA copies land and wgmma operands are read
        # (seeded by VARLEN_EMULATION_SEED), with the threads free-running: warpgroup
        # collectives and mbarrier waits cannot run one warp at a time
        race, schedule, seed, strict_banks, _ = _mode()
        lib.emu_configure(ctypes.c_int(LANDING[schedule or ("random" if race else "wait")]),
                          ctypes.c_int(0), ctypes.c_ulonglong(seed), ctypes.c_int(strict_banks))
        return lib

    def prepare(self, spec):
        self._lib_any = self._lib(spec)

    def tensor_map(self, a, box_rows: int, box_heads: int = 1) -> np.ndarray:
        dims, strides, box = sm90.map_layout(a, box_rows, box_heads)
        arg = np.zeros((), sm90.TENSOR_MAP_DTYPE)
        self._lib_any.emu_sm90_tensor_map(
            ctypes.c_void_p(a.ctypes.data), ctypes.c_int(3), ctypes.c_int(a.dtype.itemsize),
            (ctypes.c_uint64 * 3)(*dims), (ctypes.c_uint64 * 2)(*strides),
            (ctypes.c_uint32 * 3)(*box), ctypes.c_int(3),          # CU_TENSOR_MAP_SWIZZLE_128B
            ctypes.c_void_p(arg.ctypes.data))
        return arg

    def launch(self, spec, *, grid, args):
        lib = self._lib(spec)
        key = self.entry(spec)
        sizes = (ctypes.c_size_t * self.MAX_PARAMS)()
        n = lib.emu_sm90_param_sizes(key, sizes)
        assert n == len(args), f"{spec.name}: {len(args)} arguments for {n} parameters"
        assert spec.smem <= OPTIN_SMEM, f"{spec.name}: {spec.smem} B of shared memory"
        params, keep = kernel_params(spec.name, args, sizes[:n])
        self.grids.append(tuple(grid))
        self._last_lib = lib
        self.last_spec = spec                 # the variant of the last launch
        lib.emu_sm90_tma_trace_clear()
        rc = lib.emu_sm90_launch(key, ctypes.c_uint(grid[0]), ctypes.c_uint(grid[1]),
                                 ctypes.c_uint(spec.threads), ctypes.c_size_t(spec.smem), params)
        check_launch(spec.name, rc)


    def tma_trace(self) -> np.ndarray:
        """The TMA loads of the last launch, in issue order: int64 rows (block x, block y,
        the map's global address, c0, c1, c2)."""
        lib = self._last_lib
        n = lib.emu_sm90_tma_trace(None, ctypes.c_size_t(0))
        out = np.zeros((n, 6), np.int64)
        lib.emu_sm90_tma_trace(ctypes.c_void_p(out.ctypes.data), ctypes.c_size_t(n))
        return out


def install(sm_count: int = EMULATED_SM_COUNT) -> EmulatedRuntime:
    """Route the sm_90a launches of this process through a fresh `EmulatedRuntime`."""
    rt = EmulatedRuntime(sm_count)
    sm90.use_runtime(rt)
    return rt
