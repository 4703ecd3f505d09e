"""scripts/compile_kernels.py reports the sm_90a variants like the others: one NVRTC build of
one variant, its registers, spills, shared bytes and CTAs per SM on an H100."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")

pytest.importorskip("cuda.bindings.nvrtc", reason="needs NVRTC (cuda-bindings)")


def test_an_sm90a_variant_is_reported_like_the_others():
    label = "bwd-sm90a-bfloat16-D64-BN64"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "compile_kernels.py"),
                           "--json", "--arch", "sm_90a", "--only", label],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = json.loads(proc.stdout)
    assert row["arch"] == "sm_90a" and row["kernel"].startswith("varlen_bwd_dkdv_sm90<")
    assert row["spill_bytes"] == 0 and 0 < row["registers"] <= 255
    assert 0 < row["shared_bytes"] <= row["shared_budget"]
    assert row["ctas_per_sm"] >= 1 and row["gpu"] == "H100"
    assert {"ctas_by_registers", "ctas_by_shared", "ctas_by_threads", "warnings"} <= set(row)
