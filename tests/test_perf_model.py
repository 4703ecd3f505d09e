"""scripts/perf_model.py's rows for the kernels as they ship: read from the variants and
kernels_cuda/fwd.cuh, they match what scripts/compile_kernels.py builds, and the comparison
with a measurement prints the model of the path that ran."""
from __future__ import annotations

import os
import re
import sys

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import compile_kernels  # noqa: E402
import perf_model  # noqa: E402
from varlen.backends.cupy import mma, sm90  # noqa: E402
from varlen.backends.cupy.traits import default_blocks  # noqa: E402


def _template_args(name: str) -> list:
    return [a.strip() for a in name[name.index("<") + 1:-1].split(",")]


def test_the_shipped_rows_are_what_compile_kernels_builds():
    """Each row's kernel is in compile_kernels.py's configuration (the mma.sync ones for sm_90,
    the sm_90a ones for sm_90a) with the row's threads and dynamic shared memory, and its key
    or query chunk and stages are the template's."""
    config = {(r["arch"], r["kernel"]): r for r in compile_kernels.configuration(
        mma.all_specs(), sm90.dispatched_specs())}
    rows = perf_model.shipped()
    assert {(r.path, r.kind, r.head_dim) for r in rows} == {
        (p, k, d) for p in ("mma", "sm90a") for k in ("fwd", "bwd") for d in (64, 128)}
    for r in rows:
        arch = "sm_90a" if r.path == "sm90a" else "sm_90"
        got = config[(arch, r.kernel)]
        assert (got["threads"], got["dynamic_smem"]) == (r.threads, r.smem), r.kernel
        args = _template_args(r.kernel)
        if r.path == "mma" and r.kind == "fwd":       # <T, D, BM, BN, softcap, KN, STAGES>
            assert (int(args[5]), int(args[6])) == (r.chunk, r.stages), r.kernel
        elif r.path == "sm90a" and r.kind == "fwd":   # <T, D, BM, BN, softcap, KN, PACK>
            assert int(args[5]) == r.chunk and r.warpgroups == int(args[2]) // 64
        else:                                          # <T, D, BN, BQ, ...>
            assert int(args[2]) == r.block_n and int(args[3]) == r.chunk, r.kernel
        assert (r.block_m, r.block_n) == default_blocks(r.head_dim)
        assert r.design is not None and r.design.threads == r.threads
        assert r.design.smem == r.smem


def test_the_rows_say_where_q_lives_and_how_many_warpgroups():
    by = {(r.path, r.kind, r.head_dim): r for r in perf_model.shipped()}
    assert by[("mma", "fwd", 64)].q_in == "registers"
    assert by[("mma", "fwd", 128)].q_in == "shared"     # KN = 32 and Q from shared memory
    assert by[("mma", "fwd", 128)].chunk == 32
    assert by[("sm90a", "fwd", 128)].warpgroups == 2 and by[("sm90a", "fwd", 128)].chunk == 128
    assert by[("sm90a", "bwd", 128)].warpgroups == sm90.BwdSpec("bfloat16", 128, 128,
                                                                 False).consumers
    assert by[("sm90a", "bwd", 64)].warpgroups == 1


def test_q_placement_is_read_from_the_kernel_header(tmp_path, monkeypatch):
    """Lowering FwdConfig's register budget in a copy of fwd.cuh moves Q of the D = 64 forward
    to shared memory in the model: the rule is the header's, not a copy."""
    text = open(perf_model.FWD_CUH).read()
    copy = tmp_path / "fwd.cuh"
    copy.write_text(re.sub(r"Q_BUDGET = \d+;", "Q_BUDGET = 100;", text))
    monkeypatch.setattr(perf_model, "FWD_CUH", str(copy))
    assert perf_model.shipped_mma("fwd", 64).q_in == "shared"
    copy.write_text(text.replace("MIN_BLOCKS", "MIN_BLOCKZ"))
    with pytest.raises(RuntimeError, match="update perf_model.fwd_traits"):
        perf_model.shipped_mma("fwd", 64)


def test_the_comparison_prints_the_model_of_the_path_that_ran():
    assert perf_model.measured_targets("cupy") == {"fwd": 350.0, "bwd": 250.0}
    assert perf_model.measured_targets("cupy:sm90a") == {"fwd": 600.0, "bwd": 450.0}
    sm90_fwd = round(perf_model.path_prediction("sm90a", "fwd"))
    mma_fwd = round(perf_model.path_prediction("mma", "fwd"))
    assert sm90_fwd != mma_fwd
    results = [{"workload": "uniform-L8192-full", "runners": {"cupy": {"fwd": {"tflops": 610.0}}}}]
    text = perf_model.comparison({"bf16_matmul_peak_tflops": 800.0, "cupy_backend": "cupy:sm90a",
                                  "results": results}, perf_model.table())
    assert "sm_90a kernels (model: sm90a rows)" in text
    assert re.search(rf"uniform-L8192-full\s+fwd\s+{sm90_fwd}\s+\d+\s+600\s+610", text), text
    text = perf_model.comparison({"bf16_matmul_peak_tflops": 800.0, "cupy_backend": "cupy",
                                  "results": results}, perf_model.table())
    assert re.search(rf"uniform-L8192-full\s+fwd\s+{mma_fwd}\s+\d+\s+350\s+610", text), text


def test_a_path_the_model_lacks_is_refused():
    with pytest.raises(ValueError, match="path='flash'.*paths mma, sm90a"):
        perf_model.path_prediction("flash", "fwd")
    with pytest.raises(ValueError, match="head dims"):
        perf_model.path_prediction("sm90a", "fwd", head_dim=96)


def test_compile_kernels_lists_the_sm90a_variants(capsys):
    """--list gives the configuration without compiling; --arch sm_90a selects only sm_90a."""
    assert compile_kernels.main(["--list", "--arch", "sm_90a", "--only",
                                 "bwd-sm90a-bfloat16-D128-*"]) == 0
    import json
    rows = json.loads(capsys.readouterr().out)
    assert {r["arch"] for r in rows} == {"sm_90a"} and len(rows) == 4
    assert all(r["kernel"].startswith("varlen_bwd_dkdv_sm90<__nv_bfloat16, 128, 128")
               for r in rows)
