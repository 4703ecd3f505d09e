"""The CuPy kernels on a CPU-only machine: every variant compiles with NVRTC for sm_80 and sm_90
without register spills and within each architecture's shared memory, the plan kernels too,
the performance model's registers give the compiled kernels' occupancy, and the host's launch
sizes and struct layouts match the kernels'."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

import varlen.backends.cupy.launch as _cupy_launch
import varlen.backends.cupy.mma as _cupy_mma
import varlen.backends.cupy.traits as _cupy_traits
from varlen.backends.cupy.mma import KernelSpec

from helpers import ROOT
from test_cupy_mma import _perf_model

nvrtc = pytest.importorskip("cuda.bindings.nvrtc", reason="needs cuda-bindings (NVRTC)")
CXX = os.environ.get("CXX", "g++")
needs_cxx = pytest.mark.skipif(shutil.which(CXX) is None,
                               reason="needs a C++20 compiler (struct layouts)")


@pytest.fixture(scope="module")
def report():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "compile_kernels.py"),
                           "--json", "--arch", "sm_80", "--arch", "sm_90"], capture_output=True, text=True, timeout=600)
    assert proc.returncode in (0, 1), f"compile script failed:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout)


def test_every_variant_compiled_for_both_archs(report):
    have = {(r["kernel"], r["arch"]) for r in report}
    for spec in _cupy_mma.all_specs():
        for name in spec.name_expressions:
            for arch in _cupy_traits.ARCHS:
                assert (name, arch) in have, f"{spec.label}: {name} missing for {arch}"
    for r in report:
        assert set(r) >= {"kernel", "arch", "registers", "spill_bytes", "shared_bytes"}, r
        assert "fwd" in r["kernel"] or "bwd" in r["kernel"], f"unexpected kernel {r['kernel']}"


def test_no_spills(report):
    spilled = [f"{r['arch']} {r['kernel']}: {r['spill_bytes']} B" for r in report
               if r["spill_bytes"]]
    assert not spilled, "register spills:\n" + "\n".join(spilled)


def test_registers_fit(report):
    over = [r for r in report if not 0 < r["registers"] <= 255]
    assert not over, f"register counts out of range: {over}"


def test_shared_memory_budget(report):
    for r in report:
        budget = _cupy_traits.SMEM_BUDGET[r["arch"]]
        assert r["shared_bytes"] <= budget, (
            f"{r['arch']} {r['kernel']}: {r['shared_bytes']} B shared > budget {budget} B")


def test_report_gives_ctas_per_sm_for_h100_and_a100(report):
    from varlen.backends.cupy.compile import ctas_per_sm
    gpus = {"sm_80": "A100", "sm_90": "H100"}
    for r in report:
        want = ctas_per_sm(r["arch"], r["registers"], r["threads"], r["shared_bytes"])
        got = {k: r.get(k) for k in want}
        assert got == want, f"{r['arch']} {r['kernel']}: {got} != {want}"
        assert r["gpu"] == gpus[r["arch"]]
        assert r["ctas_per_sm"] >= 1, f"{r['arch']} {r['kernel']} cannot be resident"
    by_name = {(r["arch"], r["kernel"]): r for r in report}
    for spec in _cupy_mma.all_specs():
        for k in spec.kernels().values():
            assert by_name[("sm_90", k.name)]["threads"] == k.threads, k.name


def test_performance_model_registers_give_the_compiled_ctas(report):
    """The registers the model's dK/dV rows use give the CTAs per SM of the compiled kernels,
    and the backend's default tiles are the model's choice."""
    from varlen.backends.cupy.compile import ctas_per_sm
    from varlen.backends.cupy.traits import default_blocks as _default_blocks_for
    pm = _perf_model()
    by_name = {(r["arch"], r["kernel"]): r for r in report}
    for (D, block_n), regs in pm.DKDV_REGISTERS.items():
        name = KernelSpec("bwd", "bfloat16", D, 128, block_n, False).dkdv_name()
        for arch, reg in zip(("sm_80", "sm_90"), regs):
            design = pm.dkdv_design(D, block_n, arch)
            got = ctas_per_sm(arch, reg, design.threads, design.smem)["ctas_per_sm"]
            assert got == by_name[(arch, name)]["ctas_per_sm"], (
                f"{arch} {name}: the model's {reg} registers give {got} CTAs per SM, the "
                f"compiled kernel's {by_name[(arch, name)]['registers']} "
                f"{by_name[(arch, name)]['ctas_per_sm']}: update perf_model.DKDV_REGISTERS")
    chosen = pm.preferred_blocks(pm.tile_rows())
    for D in pm.TILE_HEAD_DIMS:
        assert _default_blocks_for(D) == chosen[D], D


def test_host_smem_matches_kernel_layout():
    """The host's dynamic shared-memory sizes equal the kernels' own layout constants."""
    from varlen.backends.cupy.compile import program_options
    lines = ['#include "varlen_attention.cu"']
    for s in _cupy_mma.all_specs():
        if s.kind == "fwd":
            lines.append(f"static_assert(2 * FwdConfig<{s.head_dim}, {s.block_m}, "
                         f"{s.fwd_block_n}, {s.fwd_chunk}, {s.fwd_stages}, {s.head_dim_v}>"
                         f"::SMEM_ELEMS == {s.fwd_smem()}, \"{s.label} fwd\");")
            continue
        cfg = (f"DkdvConfig<{s.head_dim}, {s.block_n}, {s.bwd_query_chunk}, true, "
               f"{s.head_dim_v}>")
        lines.append(f"static_assert(2 * {cfg}::T_ELEMS + 4 * {cfg}::F_ELEMS == "
                     f"{s.dkdv_smem()}, \"{s.label} dkdv\");")
    src = "\n".join(lines) + "\n"
    prog = nvrtc.nvrtcCreateProgram(src.encode(), b"check.cu", 0, [], [])[1]
    opts = program_options("sm_80")
    res = nvrtc.nvrtcCompileProgram(prog, len(opts), [o.encode() for o in opts])
    size = nvrtc.nvrtcGetProgramLogSize(prog)[1]
    log = b" " * size
    nvrtc.nvrtcGetProgramLog(prog, log)
    nvrtc.nvrtcDestroyProgram(prog)
    assert res[0] == nvrtc.nvrtcResult.NVRTC_SUCCESS, log.decode(errors="replace")[-3000:]


@needs_cxx
def test_struct_dtypes_match_the_c_structs(tmp_path):
    """The launchers' NumPy dtypes have the size, alignment and field offsets of the structs
    of kernels_cuda/plan_view.cuh and params.cuh (field by field, by name), and PlanView has
    KernelView's fields in order."""
    from varlen.kernels_cuda import SOURCE_DIR
    from varlen.plan import KernelView
    assert _cupy_launch.PLAN_VIEW_DTYPE.names == KernelView._fields
    lines = ["#include <cstddef>", "#include <cstdio>", '#include "params.cuh"',
             "int main() {"]
    for struct, dtype in _cupy_launch.STRUCT_DTYPES.items():
        c = f"varlen::{struct}"
        lines.append(f'    std::printf("{struct} %zu %zu\\n", sizeof({c}), alignof({c}));')
        lines += [f'    std::printf("{struct}.{f} %zu\\n", offsetof({c}, {f}));'
                  for f in dtype.names]
    src = tmp_path / "layout.cc"
    src.write_text("\n".join(lines + ["}"]) + "\n")
    exe = tmp_path / "layout"
    subprocess.run([CXX, "-std=c++17", f"-I{SOURCE_DIR}", str(src), "-o", str(exe)], check=True)
    c_layout = dict(line.split(" ", 1) for line in
                    subprocess.run([str(exe)], capture_output=True, text=True,
                                   check=True).stdout.splitlines())
    for struct, dtype in _cupy_launch.STRUCT_DTYPES.items():
        assert c_layout[struct] == f"{dtype.itemsize} {dtype.alignment}", (
            f"{struct}: C sizeof/alignof {c_layout[struct]}, NumPy dtype "
            f"{dtype.itemsize} {dtype.alignment}")
        for f in dtype.names:
            assert int(c_layout[f"{struct}.{f}"]) == dtype.fields[f][1], (
                f"{struct}.{f}: C offset {c_layout[f'{struct}.{f}']}, NumPy offset "
                f"{dtype.fields[f][1]}")


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_plan_kernels_compile_without_spills(arch):
    """The plan kernels (kernels_cuda/plan_build.cuh; tests/emulation/test_plan_device.py)."""
    import varlen.backends.cupy.compile as _cupy_compile
    from varlen.backends.cupy.plan import KERNELS
    _, usage = _cupy_compile.compile_names(KERNELS, arch)
    for name in KERNELS:
        assert usage[name]["spill_stores"] + usage[name]["spill_loads"] == 0, (name, usage)
