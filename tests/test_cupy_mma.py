"""The mma.sync implementation (`cupy:mma`) without a compiler: what its variants (`KernelSpec`)
accept and refuse, their names and cache keys, the tiles of each head dim, the hand-counted
occupancy and the performance model (docs/cupy_backend.md), and the backend's answers without a
GPU. Its NVRTC builds: tests/compile/test_cupy_compile.py; its runs through the host emulation:
tests/emulation/."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import numpy as np
import pytest

import varlen.backends.cupy.compile as _cupy_compile
import varlen.backends.cupy.mma as _cupy_mma
import varlen.backends.cupy.traits as _cupy_traits
from varlen.backends.cupy.mma import KernelSpec

from helpers import ROOT


def test_ctas_per_sm_from_registers_and_shared_memory():
    """Hand-counted occupancy (docs/cupy_backend.md, "Performance model"): registers are whole
    256-register units per warp out of each SM sub-partition's 16384, shared memory adds 1 KiB
    per CTA, against 228 KiB per SM on H100 and 164 KiB on A100."""
    from varlen.backends.cupy.compile import ctas_per_sm
    fwd = ctas_per_sm("sm_90", 170, 256, 104448)      # 176 regs x 8 warps: 2 warps per SMSP
    assert (fwd["gpu"], fwd["ctas_by_registers"], fwd["ctas_by_shared"], fwd["ctas_per_sm"]) \
        == ("H100", 1, 2, 1), fwd
    dkdv = ctas_per_sm("sm_80", 249, 128, 75264)
    assert (dkdv["gpu"], dkdv["ctas_by_registers"], dkdv["ctas_by_shared"]) == ("A100", 2, 2)
    assert ctas_per_sm("sm_80", 128, 128, 87040)["ctas_by_shared"] == 1
    assert ctas_per_sm("sm_90", 128, 128, 87040)["ctas_by_shared"] == 2
    assert ctas_per_sm("sm_90", 64, 128, 114 * 1024)["ctas_by_shared"] == 1   # + 1 KiB each
    # 200 registers: 6400 per warp, 2 warps in each quarter's 16384 (not 10 in the SM's 65536)
    assert ctas_per_sm("sm_90", 200, 64, 0)["ctas_by_registers"] == 4
    small = ctas_per_sm("sm_90", 16, 128, 0)
    assert small["ctas_by_threads"] == 16 and small["ctas_per_sm"] == 16, small


def test_performance_model_table_is_the_documented_one():
    """docs/cupy_backend.md, "Performance model", shows what scripts/perf_model.py prints."""
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "perf_model.py")],
                          capture_output=True, text=True, timeout=120, check=True)
    with open(os.path.join(ROOT, "docs", "cupy_backend.md")) as f:
        doc = f.read().split("## Performance model", 1)[-1]
    missing = [line for line in proc.stdout.splitlines() if line.strip() and line not in doc]
    assert not missing, "regenerate the table in docs/cupy_backend.md:\n" + "\n".join(missing)


def _perf_model():
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import perf_model
    return perf_model


def test_performance_model_dkdv_step_is_the_hand_counted_one():
    """The model's dK/dV step of the shipped kernel (perf_model.dkdv_design) counts, at D = 128
    and tiles (128, 64), what the hand-counted `bwd-current` design does."""
    pm = _perf_model()
    cur = next(d for d in pm.DESIGNS if d.name == "bwd-current")
    fields = ("pair", "gemms", "ldsm_bytes", "smem_write_bytes", "exps", "fp32_ops", "barriers",
              "threads", "smem", "flop")
    for arch in _cupy_traits.ARCHS:
        got = pm.dkdv_design(128, 64, arch)
        assert [getattr(got, f) for f in fields] == [getattr(cur, f) for f in fields], arch


@pytest.mark.parametrize("kw, match", [
    (dict(kind="fwd", dtype="float32"), "dtype"),
    (dict(kind="fwd", head_dim=80), "head_dim"),
    (dict(kind="bwd", block_m=32), "blocks"),
    (dict(kind="both"), "kind"),
    (dict(kind="fwd", softcap=1), "softcap"),
    (dict(kind="fwd", head_dim=256, block_m=128), r"head_dim=256: above 128 .* \(64, 64\)"),
    (dict(kind="bwd", head_dim=192, block_m=128), r"head_dim=192: above 128"),
    (dict(kind="bwd", head_dim=256, block_m=128, block_n=128),
     r"blocks \(128, 128\) .* head_dim=256: above 128 .* \(64, 64\)"),
    (dict(kind="fwd", block_m=64, block_n=128), r"blocks \(64, 128\) are not supported"),
], ids=["dtype", "head-dim", "blocks", "kind", "softcap-flag", "wide-fwd-128", "wide-bwd-128",
        "wide-bwd-128-128", "64-128"])
def test_spec_rejects_invalid(kw, match):
    base = dict(kind="fwd", dtype="float16", head_dim=64, block_m=64, block_n=64,
                softcap=False)
    with pytest.raises(ValueError, match=match):
        KernelSpec(**{**base, **kw})


def test_wide_head_dims_take_64_64_tiles():
    """Above D = 128 only (64, 64) compiles: the variants, the tiles chosen for an H100 and an
    A100, and the backend's default without a GPU."""
    from varlen.backends.cupy.traits import DeviceInfo
    from varlen.backends.cupy.mma import choose_blocks
    from varlen.backends.cupy import BACKEND
    wide = [D for D in _cupy_traits.HEAD_DIMS if D > 128]
    assert wide == [192, 256]
    for D in wide:
        assert {(s.block_m, s.block_n) for s in _cupy_mma.all_specs()
                if s.head_dim == D} == {(64, 64)}
        for device in (DeviceInfo((9, 0), 227 * 1024), DeviceInfo((8, 0), 163 * 1024)):
            for dtype in _cupy_traits.DTYPES:
                assert choose_blocks(device, dtype, D, (128, 64)) == (64, 64)
        with BACKEND.stand_in_device(DeviceInfo((9, 0), 227 * 1024)):
            assert BACKEND.default_blocks("bfloat16", D) == (64, 64)
    spec = KernelSpec("bwd", "float16", 256, 64, 64, False)
    assert (spec.bwd_query_chunk, spec.dkdv_parts) == (16, 2)
    assert KernelSpec("fwd", "float16", 256, 64, 64, False).fwd_chunk == 32


def test_128_key_tiles():
    """Tiles (128, 128), up to D = 128: the dK/dV kernel on 8 warps with query chunks of 64 in
    155 KiB at D = 128 (inside the A100's 163 KiB), the forward in the key chunks of (128, 64)
    (the same shared memory); on a 99 KiB GPU choose_blocks falls back to (128, 64) where
    (128, 128) does not fit, and keeps it where it does."""
    from varlen.backends.cupy.traits import DeviceInfo
    from varlen.backends.cupy.mma import choose_blocks
    assert (128, 128) in _cupy_traits.BLOCKS
    for D in (32, 64, 96, 128):
        bwd = KernelSpec("bwd", "bfloat16", D, 128, 128, False)
        assert (bwd.bwd_query_chunk, bwd.dkdv_threads, bwd.dkdv_parts) == (64, 256, 1)
        fwd, narrow = (KernelSpec("fwd", "bfloat16", D, 128, bn, False) for bn in (128, 64))
        assert (fwd.fwd_chunk, fwd.fwd_smem()) == (narrow.fwd_chunk, narrow.fwd_smem())
        assert bwd.dkdv_smem() <= _cupy_traits.SMEM_BUDGET["sm_80"]
    spec = KernelSpec("bwd", "bfloat16", 128, 128, 128, False)
    assert spec.dkdv_smem() == 158720
    assert spec.kernels()["dkdv_ordered"].name == (
        "varlen_bwd_dkdv<__nv_bfloat16, 128, 128, 64, false, true, true>")
    # the forward of 128-key tiles is the forward of 64-key tiles (the row schedule does not
    # depend on the key tile): one module, one kernel
    fwd = KernelSpec("fwd", "float16", 64, 128, 128, True)
    assert fwd.compiled() == KernelSpec("fwd", "float16", 64, 128, 64, True)
    assert fwd.name_expressions == fwd.compiled().name_expressions == (
        "varlen_fwd<__half, 64, 128, 64, true, 64, 3>",)
    assert KernelSpec("bwd", "float16", 64, 128, 128, True).compiled().block_n == 128
    small = DeviceInfo((8, 9), 99 * 1024)
    for D, want in ((32, (128, 128)), (64, (128, 128)), (96, (128, 64)), (128, (128, 64))):
        assert choose_blocks(small, "float16", D, (128, 128)) == want, D
    for device in (DeviceInfo((8, 0), 163 * 1024), DeviceInfo((9, 0), 227 * 1024)):
        assert choose_blocks(device, "bfloat16", 128, (128, 128)) == (128, 128)


def test_128_key_tile_forward_compiles_no_kernel_of_its_own():
    """Every spec's kernels are compiled, each once: the forwards of (128, 128) add none."""
    import varlen.backends.cupy.compile as _cupy_compile
    specs = _cupy_mma.all_specs()
    names = {(arch, n) for arch, group, _ in _cupy_compile.compile_groups(specs) for n in group}
    assert {(arch, n) for s in specs for n in s.name_expressions
            for arch in _cupy_traits.ARCHS} == names
    wide = [s for s in specs if s.kind == "fwd" and s.block_n == 128]
    assert wide and all(s.compiled() in specs for s in wide)
    # varlen_fwd<T, D, BM, BN, HAS_SOFTCAP, KN, STAGES>
    assert not [n for _, n in names if n.startswith("varlen_fwd<") and n.split(", ")[3] == "128"]


def test_spec_names_and_cache_key():
    a = KernelSpec("bwd", "bfloat16", 128, 128, 64, True)
    b = KernelSpec("bwd", "bfloat16", 128, 128, 64, True)
    assert a == b and hash(a) == hash(b)
    names = a.name_expressions
    assert names == ("varlen_bwd_preprocess<__nv_bfloat16, 128>",
                     "varlen_bwd_dkdv<__nv_bfloat16, 128, 64, 32, true, true>",
                     "varlen_bwd_dkdv<__nv_bfloat16, 128, 64, 32, true, true, true>",
                     "varlen_bwd_dq_convert<__nv_bfloat16, 128>")
    assert KernelSpec("fwd", "float16", 64, 64, 64, False).name_expressions == (
        "varlen_fwd<__half, 64, 64, 64, false, 64, 3>",)
    assert any(o.startswith("-DVARLEN_SOURCE_HASH=") for o in _cupy_compile.compile_options())


def test_dropout_variants_names_and_key():
    """Dropout is a variant of its own (the DROPOUT template argument, after DV), a key of the
    module cache; the kernels without it keep their names; the preprocessing and the dQ
    conversion are shared. Every variant has its dropout twin in `all_specs` (the compile
    tier checks them all)."""
    fwd = KernelSpec("fwd", "float16", 64, 128, 128, False, dropout=True)
    assert fwd.compiled() == KernelSpec("fwd", "float16", 64, 128, 64, False, dropout=True)
    assert fwd.name_expressions == ("varlen_fwd<__half, 64, 128, 64, false, 64, 3, 64, true>",)
    bwd = KernelSpec("bwd", "bfloat16", 192, 64, 64, True, None, 128, True)
    assert bwd.name_expressions == (
        "varlen_bwd_preprocess<__nv_bfloat16, 192, 128>",
        "varlen_bwd_dkdv<__nv_bfloat16, 192, 64, 32, true, true, false, 128, true>",
        "varlen_bwd_dkdv<__nv_bfloat16, 192, 64, 32, true, true, true, 128, true>",
        "varlen_bwd_dq_convert<__nv_bfloat16, 192>")
    assert bwd != KernelSpec("bwd", "bfloat16", 192, 64, 64, True, None, 128)
    assert bwd.label.endswith("-softcap-dropout")
    with pytest.raises(ValueError, match="dropout must be a bool"):
        KernelSpec("fwd", "float16", 64, 64, 64, False, dropout=1)
    specs = _cupy_mma.all_specs()
    plain = {dataclasses.replace(s, dropout=True) for s in specs if not s.dropout}
    assert plain == {s for s in specs if s.dropout}
    assert _cupy_mma.spec_for(type("P", (), {"block_m": 64, "block_n": 64})(),
                              np.zeros((1, 1, 64), np.float16), kind="fwd", softcap=0.0,
                              dropout=object()).dropout


def test_backend_interface_without_a_gpu():
    from varlen.backends import Problem
    import varlen.backends.cupy as cupy_backend
    cb = cupy_backend.BACKEND
    assert cb.name == "cupy"
    assert cb.default_eligible is False, "flip only after the GPU suite has passed"

    def supports(dtype, on_device=True, head_dim=128, head_dim_v=128):
        return cb.supports(Problem(dtype, head_dim, head_dim_v, on_device))
    why = supports("bfloat16")
    assert why is None or why.startswith(("CuPy is not importable", "no CUDA device")), why
    assert "host" in supports("bfloat16", on_device=False)
    assert "float32" in supports("float32")
    assert "head_dim=80" in supports("float16", head_dim=80, head_dim_v=80)
    assert "head_dim_v" in supports("float16", head_dim=64, head_dim_v=32)
    for D in _cupy_traits.HEAD_DIMS:
        assert tuple(cb.default_blocks("float16", D)) in _cupy_traits.BLOCKS
    import numpy as np
    import varlen
    cu = np.array([0, 5, 9], np.int32)
    assert "tiles" in cb.check_plan(varlen.plan(cu, cu, block_m=32, block_n=32))
    pytest.importorskip("cupy")
    assert "device" in cb.check_plan(varlen.plan(cu, cu, block_m=64, block_n=64))
