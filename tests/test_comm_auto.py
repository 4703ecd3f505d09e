"""`method="auto"` (the cost model of `varlen.comm.model` choosing for the caller) and the
model's command line, `scripts/cp_model.py`, on a small batch."""
import json
import logging
import os
import subprocess
import sys

import numpy as np
import pytest

import varlen.comm as vc
from varlen.comm.model import PRESETS, choose

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LENGTHS = (100, 3000, 50, 900, 1)


def _batch():
    cu = np.concatenate([[0], np.cumsum(LENGTHS)]).astype(np.int32)
    rng = np.random.default_rng(0)
    T = int(cu[-1])
    q = rng.standard_normal((T, 8, 16)).astype(np.float32)
    k, v = (rng.standard_normal((T, 2, 16)).astype(np.float32) for _ in range(2))
    return cu, q, k, v


def test_auto_runs_what_the_model_chooses_and_says_so(caplog):
    cu, q, k, v = _batch()
    part = vc.partition(cu, 4)

    def body(g, method, u=None):
        r = g.rank
        return vc.attention_forward(*(part.shard(x, r) for x in (q, k, v)), part, g,
                                    mask="causal", method=method, ulysses_size=u,
                                    return_stats=True)
    with caplog.at_level(logging.INFO, logger="varlen.comm"):
        got = vc.local_group(4).run(body, "auto")
    choice = got[0][2]["auto"]
    assert choice == choose(part, heads_q=8, heads_k=2, head_dim=16, head_dim_v=16,
                            dtype="float32", mask="causal",
                            cluster=PRESETS["h100"].__class__(**{
                                **PRESETS["h100"].__dict__, "gpus_per_node": 4,
                                "name": "the H100 preset's links"}))
    assert f"method='auto' chose {choice['method']}" in caplog.text
    assert all(r[2]["auto"] == choice for r in got)
    want = vc.local_group(4).run(body, choice["method"], choice["ulysses_size"])
    for (o, l, _), (wo, wl, _) in zip(got, want):
        assert np.array_equal(o, wo) and np.array_equal(l, wl)


def test_auto_arguments():
    cu, q, k, v = _batch()
    part = vc.partition(cu, 2)

    def body(g, **kw):
        r = g.rank
        vc.attention_forward(*(part.shard(x, r) for x in (q, k, v)), part, g, method="auto",
                             **kw)
    with pytest.raises(ValueError, match="method='auto' chooses ulysses_size itself"):
        vc.local_group(2).run(body, ulysses_size=2)
    with pytest.raises(ValueError, match="cluster='a100' is not a preset"):
        vc.local_group(2).run(body, cluster="a100")
    vc.local_group(2).run(body, cluster="h200")


def test_cp_model_command_line(tmp_path):
    out = tmp_path / "m.json"
    run = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "cp_model.py"),
                          "--tokens", "8192", "--cp", "8", "16", "--heads", "16/4",
                          "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    names = {(r["method"], r["ulysses_size"], r["scheme"]) for r in result["rows"]}
    assert ("usp", 8, "zigzag") in names and ("ulysses", None, "document") in names
    assert (tmp_path / "m.png").stat().st_size > 0
    for cp in ("8", "16"):
        t = result["targets"][cp]
        assert t["chosen / lower bound"] >= 0.99          # never below the compute bound
    # usp(8) at cp 16: the ring crosses nodes only between the two groups
    t16 = result["targets"]["16"]
    assert t16["usp(8) / flat ring inter-node bytes per rank (zigzag)"] < 0.25
    assert "| 16 |" in run.stdout
