"""scripts/cp_balance.py: per-rank work from the partition alone."""
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "cp_balance.py"


@pytest.fixture(scope="module")
def cpb():
    spec = importlib.util.spec_from_file_location("cp_balance", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("window", [(-1, 0), (-1, -1), (5, 0)])
@pytest.mark.parametrize("scheme", ["zigzag", "contiguous", "document"])
def test_pairs_add_up_to_the_whole(cpb, window, scheme):
    lengths = np.array([7, 1, 0, 30, 12])
    r = cpb.analyse(lengths, 3, scheme, window, (4, 2, 8, 8, 2))
    left, right = window
    want = 0
    for L in lengths:
        i, j = np.meshgrid(np.arange(L), np.arange(L), indexing="ij")
        ok = np.ones_like(i, bool)
        if left >= 0:
            ok &= j >= i - left
        if right >= 0:
            ok &= j <= i + right
        want += int(ok.sum())
    assert sum(r["pairs_per_rank"]) == want


def test_quick_run_writes_png_and_json(cpb, tmp_path, capsys):
    out, js = tmp_path / "w", tmp_path / "w.json"
    assert cpb.main(["--tokens", "8192", "--mean", "512", "--cp", "2", "4", "--out", str(out),
                     "--json", str(js)]) == 0
    for cp in (2, 4):
        assert (out / f"cp_balance-cp{cp}.png").stat().st_size > 0
    res = json.loads(js.read_text())["results"]
    for rows in res.values():
        for cp in (2, 4):
            zig, con = (next(r for r in rows if r["cp"] == cp and r["scheme"] == s)
                        for s in ("zigzag", "contiguous"))
            assert zig["imbalance"] < con["imbalance"], (zig, con)   # causal: zigzag balances
            doc = next(r for r in rows if r["cp"] == cp and r["scheme"] == "document")
            assert doc["bytes_per_rank"]["ring"] <= zig["bytes_per_rank"]["ring"], (doc, zig)
    assert "ring MiB" in capsys.readouterr().out


@pytest.fixture(scope="module")
def issue_mixes(cpb):
    """The script's mixes for `--tokens 131072 --mean 4096` (seed 0, drawn in DISTS order)."""
    rng = np.random.default_rng(0)
    return {d: cpb.document_lengths(d, 131072, 4096, rng) for d in cpb.DISTS}


@pytest.mark.parametrize("dist", ["uniform", "long-tail", "one-long"])
@pytest.mark.parametrize("cp", [4, 8, 16])
def test_document_scheme_meets_its_targets(cpb, issue_mixes, dist, cp):
    # The documented targets (docs/context_parallel.md, "Document-aware partition"): causal,
    # Hq 32 / Hk 8, D 128, bf16.
    lengths = issue_mixes[dist]
    zig, doc = (cpb.analyse(lengths, cp, s, (-1, 0), (32, 8, 128, 128, 2))
                for s in ("zigzag", "document"))
    ring_doc, ring_zig = doc["bytes_per_rank"]["ring"], zig["bytes_per_rank"]["ring"]
    assert doc["imbalance"] <= 1.05, doc
    if dist == "one-long":
        assert ring_doc <= ring_zig, (ring_doc, ring_zig)
    else:
        assert ring_doc <= 0.2 * ring_zig, (ring_doc, ring_zig)
