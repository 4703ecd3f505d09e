"""The kernel variants of tiles (128, 64) (bfloat16, every head dim up to 128)
through the host emulation, forward and both backward modes, against the float64 reference: one
process per case (the emulation replaces `cupy` in its process), so the cases can run in
parallel. Among them, a grid of more CTAs than the SMs of the GPU the emulation stands for, and
blocks that visit three or more partner tiles (the barrier that ends each loop step only
matters from the third). The head dims above 128 (tiles (64, 64) only: one m16 tile per warp
in the forward, dK/dV in two passes over halves of the head dim), the tiles (128, 128)
(dK/dV on 8 warps of 16 keys, query chunks of 64) and head_dim_v < head_dim (192 / 128,
128 / 64) run under the strict modes: warps one at a
time in a seeded order, copies landing at random points, a cp.async bank conflict fatal, no
ldmatrix bank conflict."""
from __future__ import annotations

import pytest

import varlen.backends.cupy.mma as _cupy_mma
import varlen.backends.cupy.traits as _cupy_traits
from emulation.cases import H100_SM_COUNT as EMULATED_SM_COUNT
from emulation.cases import (default_variant_cases, grid_figures, head_dim_v_cases,
                             wide_head_dim_cases, wide_key_tile_cases)
from varlen.backends.cupy.traits import DEFAULT_BLOCKS

from helpers import cases, emulate, needs_cxx

CASES = default_variant_cases()
WIDE_CASES = wide_head_dim_cases()
WIDE_KEY_CASES = wide_key_tile_cases()
HEAD_DIM_V_CASES = head_dim_v_cases()

RUNNER = """
import sys
from emulation.cupy import bank_counts, run_case
from emulation.cases import case
run_case(**case(sys.argv[1]))
ldsm, ldsm_conflicts, _, _ = bank_counts()
assert ldsm > 0 and ldsm_conflicts == 0, f"ldmatrix: {ldsm_conflicts} extra wavefronts"
print("ok", sys.argv[1])
"""
# The strict emulation modes (emulation/cupy.py), instead of the caller's.
STRICT_ENV = {"VARLEN_EMULATION_SCHEDULE": "random", "VARLEN_EMULATION_SEED": "3",
              "VARLEN_EMULATION_STRICT_BANKS": "1"}


def test_cases_cover_the_shipped_defaults():
    wide = {D for D in _cupy_traits.HEAD_DIMS if D > _cupy_traits.MAX_WIDE_HEAD_DIM}
    assert {c["D"] for c in CASES} == set(_cupy_traits.HEAD_DIMS) - wide, "a head dim is missing"
    assert all(c["dtype"] == "bfloat16" and c["block_m"] == DEFAULT_BLOCKS[0] for c in CASES)
    assert {c["D"] for c in WIDE_CASES} == wide and wide
    for D in wide:
        got = {(c["dtype"], c["softcap"] > 0) for c in WIDE_CASES if c["D"] == D}
        assert {dt for dt, _ in got} == set(_cupy_traits.DTYPES) and (True in {s for _, s in got})
    assert all(c["block_m"] == 64 and c["gaps"] for c in WIDE_CASES)
    figures = [grid_figures(c) for c in CASES]
    assert max(max(f["q_ctas"], f["k_ctas"]) for f in figures) > EMULATED_SM_COUNT, (
        f"no case has more CTAs than the {EMULATED_SM_COUNT} SMs of the GPU the emulation "
        f"stands for")
    assert max(f["max_key_tiles"] for f in figures) >= 3, "no block visits 3 key tiles"
    assert max(f["max_query_tiles"] for f in figures) >= 2, (
        "no dK/dV block visits 2 query tiles (3 or more chunks)")


def test_wide_key_tile_cases_are_adversarial():
    """The (128, 128) cases: both dtypes, D = 64 and 128, zero- and one-row sequences, a length
    that is no multiple of 128, NaN pad gaps, GQA, a per-sequence mask and a softcap, and a key
    tile whose dK/dV block takes more than 2 query chunks (in one query head)."""
    import numpy as np
    cases = WIDE_KEY_CASES
    assert all((c["block_m"], c["block_n"]) == (128, 128) for c in cases)
    assert all(_cupy_mma.KernelSpec("bwd", c["dtype"], c["D"], 128, 128, False)
               .bwd_query_chunk == 64 for c in cases)
    assert {c["dtype"] for c in cases} == set(_cupy_traits.DTYPES)
    assert {64, 128} <= {c["D"] for c in cases}
    lengths = [n for c in cases for n in (*c["lengths_q"], *c["lengths_k"])]
    assert 0 in lengths and 1 in lengths and any(n > 128 and n % 128 for n in lengths)
    assert all(c["gaps"] and np.isnan(c["garbage"]) for c in cases)
    assert any(c["Hq"] > c["Hk"] for c in cases) and any(c["softcap"] > 0 for c in cases)
    assert any(not isinstance(c["mask"], str) for c in cases)
    # two query tiles of 128 rows: the first 2 chunks of 64, the second 1 or 2
    assert max(grid_figures(c)["max_query_tiles"] for c in cases) >= 2, (
        "no dK/dV block takes more than 2 query chunks")


def _labels(cases_, quick):
    return cases([c["label"] for c in cases_], quick)


@needs_cxx
@pytest.mark.parametrize("label", _labels(CASES, ["B2-mqa-causal_br-bf16-D64-BM128"]))
def test_default_variant_on_host_emulation(label):
    assert f"ok {label}" in emulate(["-c", RUNNER, label], timeout=900)


def _run_strict(label):
    assert f"ok {label}" in emulate(["-c", RUNNER, label], STRICT_ENV, timeout=900, clean=True)


@needs_cxx
@pytest.mark.parametrize("label", _labels(WIDE_CASES, ["B5-gqa-perseq-gaps-fp16-D256"]))
def test_wide_head_dim_on_strict_host_emulation(label):
    _run_strict(label)


@needs_cxx
@pytest.mark.parametrize("label", _labels(WIDE_KEY_CASES, ["B3-causal_br-softcap-fp16-D64-BN128"]))
def test_wide_key_tiles_on_strict_host_emulation(label):
    _run_strict(label)


def test_head_dim_v_cases_are_adversarial():
    """head_dim_v < head_dim: 192 / 128 in both dtypes (one with a softcap), another pair of
    traits.HEAD_DIM_V_PAIRS, zero- and one-row sequences on both sides, lengths that are no
    multiple of a tile, pad gaps (NaN in one), GQA everywhere."""
    import numpy as np
    cases = HEAD_DIM_V_CASES
    pairs = {(c["D"], c["Dv"]) for c in cases}
    assert pairs == set(_cupy_traits.HEAD_DIM_V_PAIRS) and all(d > dv for d, dv in pairs)
    assert {c["dtype"] for c in cases if (c["D"], c["Dv"]) == (192, 128)} == set(
        _cupy_traits.DTYPES)
    assert any(c["softcap"] > 0 for c in cases)
    assert all(c["Hq"] > c["Hk"] and c["gaps"] for c in cases)
    assert any(np.isnan(c.get("garbage", 0.0)) for c in cases)
    for side in ("lengths_q", "lengths_k"):
        lengths = [n for c in cases for n in c[side]]
        assert 0 in lengths and 1 in lengths and any(n % 64 and n > 64 for n in lengths), side


@needs_cxx
@pytest.mark.parametrize("label", [c["label"] for c in HEAD_DIM_V_CASES])
def test_head_dim_v_on_host_emulation(label):
    """Forward and both backward modes at head_dim_v < head_dim against the float64 reference
    (out and dV of head_dim_v columns), under the strict modes."""
    _run_strict(label)
