"""Building the CUDA sources: the options of every build, NVRTC programs, the on-disk cubin
cache of the sm_90a kernels, and the ahead-of-time compile check (no GPU needed).

The mma.sync modules are built by CuPy's RawModule (`launch.Module`, CuPy picks the device's
architecture) with `compile_options()`. The sm_90a kernels need the `a` suffix CuPy would not
add: `cubin_path` builds them with NVRTC for sm_90a and keeps the cubin on disk. The compile
check builds to cubin (not PTX: a newer NVRTC emits PTX the driver may reject) for a given
architecture through `cuda.bindings.nvrtc`, and reads the register, spill and shared-memory
figures from the `-Xptxas=-v` log, and the CTAs per SM those allow on the GPU of each
architecture. Used by `scripts/compile_kernels.py` and the CI compile test.
"""
from __future__ import annotations

import hashlib
import os
import re
import tempfile
from collections import defaultdict
from typing import NamedTuple

from ...kernels_cuda import SOURCE_DIR
from .traits import ARCHS, SMEM_BUDGET

# Entry file of the CUDA sources (it includes every header in kernels_cuda/).
ENTRY_FILE = "varlen_attention.cu"
CACHE_ENV = "VARLEN_SM90A_CACHE"      # where sm_90a cubins are kept (default: under the temp dir)
POLL_LIMIT_ENV = "VARLEN_POLL_LIMIT"  # waits trap after that many polls (default 0: off)

_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '(\w+)'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers(?:, used (\d+) barriers)?(?:, (\d+) bytes smem)?")
_PROPS = re.compile(r"Function properties for (\S+)")


class SmLimits(NamedTuple):
    """What one SM holds (CUDA C++ Programming Guide, "Technical Specifications per Compute
    Capability": 8.0 for A100, 9.0 for H100/H200)."""

    gpu: str
    registers: int          # 32-bit registers per SM, in 4 partitions (one per SMSP)
    shared: int             # shared memory per SM, bytes
    threads: int            # resident threads per SM
    ctas: int               # resident CTAs per SM


SM_LIMITS = {"sm_80": SmLimits("A100", 65536, 164 * 1024, 2048, 32),
             "sm_90": SmLimits("H100", 65536, 228 * 1024, 2048, 32)}
REG_UNIT = 256              # registers are allocated per warp in units of 256 (8 per thread)
SMSPS = 4                   # a warp's registers come from its SM sub-partition's quarter
RESERVED_SMEM = 1024        # shared memory the system reserves per CTA (sm_80 and newer)


def ctas_per_sm(arch: str, registers: int, threads: int, shared_bytes: int) -> dict:
    """Resident CTAs per SM of a kernel on the GPU of `arch`: by registers (whole warps per SM
    sub-partition), by shared memory (+1 KiB reserved per CTA), by threads, and the least."""
    lim = SM_LIMITS[arch]
    warps = -(-threads // 32)
    per_warp = -(-registers * 32 // REG_UNIT) * REG_UNIT
    warps_by_regs = SMSPS * (lim.registers // SMSPS // per_warp)
    by_regs = warps_by_regs // warps
    by_smem = lim.shared // (shared_bytes + RESERVED_SMEM)
    by_threads = min(lim.threads // (32 * warps), lim.ctas)
    return {"gpu": lim.gpu, "ctas_by_registers": by_regs, "ctas_by_shared": by_smem,
            "ctas_by_threads": by_threads, "ctas_per_sm": min(by_regs, by_smem, by_threads)}


def _check(res, what):
    from cuda.bindings import nvrtc
    if res[0] != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise RuntimeError(f"NVRTC {what} failed: {nvrtc.nvrtcGetErrorString(res[0])[1].decode()}")
    return res[1] if len(res) == 2 else res[1:]


def parse_ptxas_log(log: str) -> dict:
    """{mangled name: {registers, spill_stores, spill_loads, static_smem}} of each kernel. A
    function the kernels call (`__noinline__`) has properties of its own: its spills are added
    to every kernel's (conservative: any of them may call it)."""
    out, cur, called, entry = {}, None, [0, 0], None
    for line in log.splitlines():
        if m := _ENTRY.search(line):
            entry = m[1]
            cur = out.setdefault(m[1], {"arch": m[2]})
        elif m := _PROPS.search(line):
            cur = out.get(entry) if m[1] == entry else None
            if cur is None:
                entry = None
        elif m := _FRAME.search(line):
            if cur is not None:
                cur.update(spill_stores=int(m[2]), spill_loads=int(m[3]))
            else:
                called[0] += int(m[2])
                called[1] += int(m[3])
        elif cur is not None and (m := _USED.search(line)):
            cur.update(registers=int(m[1]), static_smem=int(m[3] or 0))
    for u in out.values():
        u["spill_stores"] = u.get("spill_stores", 0) + called[0]
        u["spill_loads"] = u.get("spill_loads", 0) + called[1]
    return out


def program_options(arch: str) -> list:
    """NVRTC options of the check: the runtime's (`compile_options`), for `arch`,
    with ptxas' resource report."""
    return [f"--gpu-architecture={arch}", "--std=c++17", *compile_options(),
            "-Xptxas=-v"]


def build_program(names, arch: str, source: str | None = None):
    """One NVRTC program of the kernels named by `names` (template name expressions) for
    `arch` (sm_XX or sm_90a), from `source` (default `module_source()`; a call's mask_mod and
    score_mod come ahead of it: `mods.module_source`). Returns (cubin bytes, {name expression:
    lowered name}, log)."""
    from cuda.bindings import nvrtc
    source = module_source() if source is None else source
    prog = _check(nvrtc.nvrtcCreateProgram(source.encode(), b"varlen.cu", 0,
                                           [], []), "create")
    try:
        for name in names:
            _check(nvrtc.nvrtcAddNameExpression(prog, name.encode()), "add name expression")
        opts = program_options(arch)
        res = nvrtc.nvrtcCompileProgram(prog, len(opts), [o.encode() for o in opts])
        size = _check(nvrtc.nvrtcGetProgramLogSize(prog), "log size")
        log = b" " * size
        nvrtc.nvrtcGetProgramLog(prog, log)
        log = log.rstrip(b"\x00").decode(errors="replace")
        if res[0] != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise RuntimeError(f"compiling {len(names)} kernels for {arch} failed:\n{log}")
        lowered = {name: _check(nvrtc.nvrtcGetLoweredName(prog, name.encode()),
                                "lowered name").decode() for name in names}
        cubin = b" " * _check(nvrtc.nvrtcGetCUBINSize(prog), "cubin size")
        _check(nvrtc.nvrtcGetCUBIN(prog, cubin), "cubin")
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    return cubin, lowered, log


def compile_names(names, arch: str, source: str | None = None):
    """Compile the kernels named by `names` (template name expressions) for `arch` (sm_XX),
    from `source` (`build_program`'s).

    Returns (cubin bytes, {name expression: usage dict}).
    """
    cubin, lowered, log = build_program(names, arch, source)
    usage = parse_ptxas_log(log)
    return cubin, {name: usage[lowered[name]] for name in names}


def compile_groups(specs, archs=ARCHS):
    """Jobs of the compile check: one NVRTC program per (arch, dtype, head dim), each with
    the distinct kernels of those specs. Returns [(arch, names, {name: KernelLaunch})]."""
    groups = defaultdict(dict)
    seen = set()
    for s in specs:
        for kernel in s.kernels().values():
            if kernel.name not in seen:   # kernels shared by several specs compile once
                seen.add(kernel.name)
                groups[(s.dtype, s.head_dim)][kernel.name] = kernel
    return [(arch, tuple(kern), kern) for arch in archs for _, kern in sorted(groups.items())]


def run_group(job):
    """Compile one group; rows of the JSON report."""
    arch, names, launches = job
    _, usage = compile_names(names, arch)
    rows = []
    for name in names:
        u = usage[name]
        shared = u["static_smem"] + launches[name].smem
        rows.append({"kernel": name, "arch": arch, "registers": u["registers"],
                     "spill_bytes": u["spill_stores"] + u["spill_loads"],
                     "shared_bytes": shared, "shared_budget": SMEM_BUDGET[arch],
                     "threads": launches[name].threads,
                     **ctas_per_sm(arch, u["registers"], launches[name].threads, shared)})
    return rows


def source_files():
    return sorted(f for f in os.listdir(SOURCE_DIR) if f.endswith((".cuh", ".cu")))


def source_hash() -> str:
    """Hash of every CUDA source: part of the compile options, so the kernel cache (which
    does not hash included headers) never serves a stale binary."""
    h = hashlib.sha256()
    for name in source_files():
        h.update(name.encode())
        with open(os.path.join(SOURCE_DIR, name), "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:16]


def cuda_include_dirs():
    """CUDA headers (cuda_fp16.h, cuda_bf16.h): $CUDA_HOME/include, $CUDA_PATH/include, or
    the header directory of the nvidia-cuda-runtime wheel."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        root = os.environ.get(var)
        if root and os.path.isfile(os.path.join(root, "include", "cuda_fp16.h")):
            return (os.path.join(root, "include"),)
    try:
        from cuda.pathfinder import find_nvidia_header_directory
        found = find_nvidia_header_directory("cudart")
        if found:
            return (found,)
    except ImportError:
        pass
    return ("/usr/local/cuda/include",)


def poll_limit() -> int:
    """The poll limit of the kernels' waits (`VARLEN_POLL_LIMIT` in common.cuh): after that
    many polls of an mbarrier or the ordered-dQ counter a thread prints where it waited and
    traps. From $VARLEN_POLL_LIMIT (scripts/gpu_check.sh sets it); 0, the default, is off."""
    raw = os.environ.get(POLL_LIMIT_ENV, "").strip()
    if not raw:
        return 0
    n = int(raw) if raw.isdigit() else -1
    if not 0 <= n < 2**31 - 1:
        raise ValueError(f"{POLL_LIMIT_ENV}={raw!r}: expected 0 (off) or a poll count below "
                         "2**31")
    return n


def compile_options():
    """NVRTC options of every build of the kernels: the runtime's (CuPy adds -arch itself) and
    the compile check's (scripts/compile_kernels.py), so both find the same headers. A poll
    limit (`poll_limit`) is a define of its own, so CuPy's module cache and the sm_90a cubin
    cache key builds with and without it apart."""
    limit = poll_limit()
    return ("--use_fast_math", f"-I{SOURCE_DIR}", *(f"-I{d}" for d in cuda_include_dirs()),
            f"-DVARLEN_SOURCE_HASH=0x{source_hash()}",
            *((f"-D{POLL_LIMIT_ENV}={limit}",) if limit else ()))


def module_source() -> str:
    return f'#include "{ENTRY_FILE}"\n'


def cache_dir() -> str:
    """The folder of the sm_90a cubins: $VARLEN_SM90A_CACHE, else varlen_sm90a_cache in the
    temp dir."""
    return os.environ.get(CACHE_ENV) or os.path.join(tempfile.gettempdir(), "varlen_sm90a_cache")


def _write_atomically(path: str, data: bytes) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def cubin_path(name: str, arch: str = "sm_90a", source: str | None = None) -> tuple:
    """(path of the `arch` cubin holding kernel `name`, its lowered name), from `cache_dir()`:
    keyed by the name, NVRTC's version, the build options (which carry the hash of every
    kernel source, `source_hash`) and the module source (`build_program`'s `source`: it holds
    a call's generated mask_mod and score_mod), built by NVRTC when missing. Files are written
    under a temporary name and renamed, so processes building at once never read half a
    file."""
    from cuda.bindings import nvrtc
    _, major, minor = nvrtc.nvrtcVersion()
    extra = [] if source is None else [source]
    key = hashlib.sha256("\0".join([name, f"nvrtc {major}.{minor}", *program_options(arch),
                                    *extra]).encode()).hexdigest()[:32]
    folder = cache_dir()
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{key}.cubin")
    name_path = os.path.join(folder, f"{key}.name")
    if not (os.path.exists(path) and os.path.exists(name_path)):
        cubin, lowered, _ = build_program([name], arch, source)
        _write_atomically(name_path, lowered[name].encode())
        _write_atomically(path, cubin)
    with open(name_path) as f:
        return path, f.read()
