"""The shipped default kernel variants (bfloat16, every head dim, tiles (128, 64)) through the
host emulation, forward and both backward modes, against the float64 reference: one process per
case (the emulation replaces `cupy` in its process), so the cases can run in parallel.
Among them, a grid of more CTAs than the SMs of the GPU the emulation stands for, and blocks
that visit three or more partner tiles (the barrier that ends each loop step only matters
from the third)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from varlen.backends import _cupy_spec
from varlen.backends._emulation_cases import (DEFAULT_BLOCKS, EMULATED_SM_COUNT,
                                              default_variant_cases, grid_figures)

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
CASES = default_variant_cases()

RUNNER = """
import sys
from varlen.backends._cupy_emulation import run_case
from varlen.backends._emulation_cases import case
run_case(**case(sys.argv[1]))
print("ok", sys.argv[1])
"""


def test_cases_cover_the_shipped_defaults():
    assert {c["D"] for c in CASES} == set(_cupy_spec.HEAD_DIMS), "a shipped head dim is missing"
    assert all(c["dtype"] == "bfloat16" and c["block_m"] == DEFAULT_BLOCKS[0] for c in CASES)
    figures = [grid_figures(c) for c in CASES]
    assert max(max(f["q_ctas"], f["k_ctas"]) for f in figures) > EMULATED_SM_COUNT, (
        f"no case has more CTAs than the {EMULATED_SM_COUNT} SMs the emulation stands for")
    assert max(f["max_key_tiles"] for f in figures) >= 3, "no block visits 3 key tiles"
    assert max(f["max_query_tiles"] for f in figures) >= 2, (
        "no dK/dV block visits 2 query tiles (3 or more chunks)")


@pytest.mark.slow
@pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None,
                    reason="needs a C++20 compiler")
@pytest.mark.parametrize("label", [c["label"] for c in CASES])
def test_default_variant_on_host_emulation(label):
    proc = subprocess.run([sys.executable, "-c", RUNNER, label], capture_output=True,
                          text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, (f"{label} (host emulation):\n{proc.stdout[-3000:]}\n"
                                  f"{proc.stderr[-3000:]}")
