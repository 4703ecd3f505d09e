"""Shared test helpers: adversarial packed batches and dtype-aware comparisons (from
`varlen.testing`), a forward-and-backward call through the public API, the size of the sweeps
(`cases`), and the runs of emulated cases in processes of their own.

Tolerances follow STYLE.md: a backend's error against the float64 reference must be within a
small factor (2x output, 3x gradients) of a naive same-dtype computation's error, plus a
rounding floor; a relative-RMS check is paired with a max-abs check, so one unwritten (NaN or
zero) row cannot hide.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import varlen
from varlen.testing import (EPS, FLOOR_UNIT, Batch, assert_close, assert_lse,  # noqa: F401
                            check_against_reference, covered_rows, make_batch, naive_same_dtype,
                            np_dtype)


# The size of the sweeps, as JAX's JAX_NUM_GENERATED_CASES: "quick" (the default) runs the part
# of each large parametrisation that its `cases` call keeps, adversarial cases included; "full"
# (CI: .ci/run) runs all of it.
CASES_SIZE = os.environ.get("VARLEN_TEST_CASES", "quick")
if CASES_SIZE not in ("quick", "full"):
    raise ValueError(f"VARLEN_TEST_CASES={CASES_SIZE!r}; expected 'quick' or 'full'")


def _key(item):
    """What `cases` matches a quick choice against: a pytest.param's id (or its value, or
    values, without one), else the item."""
    if not isinstance(item, type(pytest.param(None))):
        return item
    return item.id if item.id is not None else (
        item.values[0] if len(item.values) == 1 else item.values)


def cases(full, quick, size=None):
    """The parametrisation of a sweep at this run's size (`size`: "quick" or "full", default
    VARLEN_TEST_CASES): all of `full`, or the items of it that `quick` keeps: a predicate of an
    item, or a collection of items (pytest.param ids for params), each of which must be in
    `full`. In `full`'s order."""
    full = list(full)
    if (size or CASES_SIZE) == "full":
        return full
    if callable(quick):
        return [x for x in full if quick(x)]
    quick = list(quick)
    missing = [q for q in quick if q not in [_key(x) for x in full]]
    if missing:
        raise ValueError(f"quick cases {missing} are not among the full cases")
    return [x for x in full if _key(x) in quick]


def covering(*keys):
    """A predicate for `cases` that keeps, in order, each item showing a value of one of
    `keys` (functions of an item) that no kept item showed before: every value of every key
    appears at least once. The predicate remembers what it kept: make one per sweep."""
    seen = [set() for _ in keys]

    def keep(item):
        values = [key(item) for key in keys]
        new = [v not in s for v, s in zip(values, seen)]
        if any(new):
            for v, s in zip(values, seen):
                s.add(v)
        return any(new)
    return keep


# Batches for a CUDA graph captured once and replayed (tests/gpu/test_cupy_gpu.py,
# tests/numba/test_numba_graph.py): the same B and packed totals (the same buffer shapes),
# other lengths and per-sequence masks (window_left, window_right, bottom_right).
GRAPH_BATCHES = (([100, 0, 37, 200, 1], [120, 3, 37, 180, 1]),
                 ([1, 150, 137, 0, 50], [64, 64, 64, 100, 49]))
GRAPH_MASKS = tuple(tuple(np.array(f, np.int32) for f in m) for m in (
    ([-1, -1, 16, -1, 0], [0, -1, 0, 0, -1], [1, 0, 0, 1, 1]),
    ([8, -1, -1, 32, -1], [0, 0, -1, 0, 0], [0, 1, 1, 0, 0])))


def fwd_bwd(batch: Batch, backend="numpy", **kw):
    out, lse = varlen.attention_forward(batch.q, batch.k, batch.v, batch.cu_q, batch.cu_k,
                                        **batch.layout, backend=backend, **kw)
    grads = varlen.attention_backward(batch.dout, batch.q, batch.k, batch.v, out, lse,
                                      batch.cu_q, batch.cu_k, **batch.layout, backend=backend,
                                      **kw)
    return out, lse, grads


TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)

needs_cxx = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None,
                               reason="needs a C++20 compiler")

# Exit status of an emulated case that cannot run on this machine (the test skips).
SKIP_STATUS = 77
# The emulation's mode settings (emulation/cupy.py), which `run_emulated(clean=True)` drops;
# where it builds (VARLEN_EMULATION_DIR) and from which sources stay.
EMULATION_MODE = ("VARLEN_EMULATION_RACE", "VARLEN_EMULATION_SCHEDULE", "VARLEN_EMULATION_SEED",
                  "VARLEN_EMULATION_STRICT_BANKS", "VARLEN_EMULATION_TIMEOUT")


def run_emulated(args, env=None, *, timeout: int = 1800,
                 clean: bool = False) -> subprocess.CompletedProcess:
    """`python ARGS` in a fresh process from the repository root (the host emulation replaces
    `cupy` there), `env` added to the environment, without this process's emulation mode with
    `clean`. The caller asserts on the result."""
    base = {k: v for k, v in os.environ.items() if not (clean and k in EMULATION_MODE)}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env={**base, **(env or {})})


def emulate(args, env=None, *, timeout: int = 1800, clean: bool = False) -> str:
    """`run_emulated`, asserting that it passed; its output. A run that exits with SKIP_STATUS
    skips the test, with its last line of output as the reason."""
    proc = run_emulated(args, env, timeout=timeout, clean=clean)
    if proc.returncode == SKIP_STATUS:
        pytest.skip(proc.stdout.strip().splitlines()[-1])
    assert proc.returncode == 0, (f"emulated {' '.join(map(str, args))}:\n"
                                  f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc.stdout


def emulate_script(path: str, *case, timeout: int = 900) -> str:
    """`emulate` of `case` of the test file `path`'s __main__."""
    return emulate([os.path.abspath(path), *case], timeout=timeout)


def mutated_sources(tmp_path, name: str, old: str, new: str):
    """A copy of the kernel sources under `tmp_path` with the one `old` of kernel source `name`
    replaced by `new`: the folder, for VARLEN_EMULATION_SOURCE_DIR."""
    from varlen.kernels_cuda import SOURCE_DIR
    src = tmp_path / "kernels_cuda"
    shutil.copytree(SOURCE_DIR, src)
    path = src / name
    text = path.read_text()
    assert text.count(old) == 1, f"{old!r} is not in {name} once: update the mutation"
    path.write_text(text.replace(old, new))
    return src


def run_mutated(args, source_dir, env=None) -> subprocess.CompletedProcess:
    """`run_emulated` on the kernel sources of `source_dir` (a mutated copy), with a short
    emulation timeout for a deadlock."""
    return run_emulated(args, {"VARLEN_EMULATION_SOURCE_DIR": str(source_dir),
                               "VARLEN_EMULATION_TIMEOUT": "20", **(env or {})})


def assert_mutant_caught(proc: subprocess.CompletedProcess, name: str, label: str, says) -> None:
    """The mutated kernel `name` failed case `label`, saying `says` (a string, or a tuple of
    which one will do)."""
    assert proc.returncode != 0, f"{name}: the mutated kernel passed {label}"
    says = (says,) if isinstance(says, str) else says
    assert any(m in proc.stdout + proc.stderr for m in says), (
        f"{name}: failed otherwise:\n{proc.stderr[-2000:]}")


def nan_padded_batch(rng, lengths, Hq, Hk, gap, D=8, Dv=8):
    """float64 packed `(cu, off, q, k, v, do, rows)`: `gap` padding rows after each sequence
    (`off` its seq_offsets, None without gaps) holding NaN in q, k, v and do, so a backend that
    reads one fails loudly; `rows` the bool mask of the rows that belong to a sequence."""
    lengths = np.asarray(lengths)
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    off = np.concatenate([[0], np.cumsum(lengths + gap)]).astype(np.int32)
    T = int(off[-1])
    q, k, v, do = (rng.standard_normal((T, h, d)) for h, d in ((Hq, D), (Hk, D), (Hk, Dv),
                                                                 (Hq, Dv)))
    rows = np.zeros(T, bool)
    for b, n in enumerate(lengths):
        rows[off[b]:off[b] + n] = True
    for x in (q, k, v, do):
        x[~rows] = np.nan
    return cu, (off if gap else None), q, k, v, do, rows


def check_numpy_backend(q, k, v, do, cu, rows, **kw):
    """The `numpy` backend's forward, backward and aux gradients (NaN-filled fresh buffers)
    against `varlen.reference` on the rows of the sequences, float64 (`kw`: the calls'
    seq_offsets, mask, score_mod, softcap). lse -inf exactly where the reference has it; the
    aux gradients are float32 sums over the visible pairs, to float32 rounding of their size."""
    from varlen.reference import attention_dense, attention_dense_backward
    off = kw.pop("seq_offsets", None)
    kw = dict(seq_offsets_q=off, seq_offsets_k=off, **kw)
    aux = kw.get("score_mod") is not None
    o, l = attention_dense(q, k, v, cu, cu, **kw)
    want = attention_dense_backward(do, q, k, v, cu, cu, aux_grads=aux, **kw)
    prev = varlen.set_nan_fill(True)
    try:
        o2, l2 = varlen.attention_forward(q, k, v, cu, cu, backend="numpy", **kw)
        got = varlen.attention_backward(do, q, k, v, o2, l2, cu, cu, backend="numpy",
                                        aux_grads=aux, **kw)
    finally:
        varlen.set_nan_fill(prev)
    np.testing.assert_allclose(o2[rows], o[rows], atol=1e-12, err_msg="out")
    assert np.array_equal(np.isinf(l2[:, rows]), np.isinf(l[:, rows])), "rows with no key"
    np.testing.assert_allclose(np.where(np.isinf(l), 0, l2)[:, rows],
                               np.where(np.isinf(l), 0, l)[:, rows], atol=1e-12, err_msg="lse")
    for name, a, b in zip(("dq", "dk", "dv"), got[:3], want[:3]):
        np.testing.assert_allclose(a[rows], b[rows], atol=1e-11, err_msg=name)
    if aux:
        assert len(got[3]) == len(want[3]), f"{len(got[3])} aux gradients"
        for i, (a, b) in enumerate(zip(got[3], want[3])):
            assert (a is None) == (b is None), f"aux {i}: a gradient on one side only"
            if a is not None:
                assert a.dtype == np.float32 and a.shape == b.shape, f"aux {i}: {a.dtype}"
                scale = max(np.abs(b).max(), 1.0)
                np.testing.assert_allclose(a, b, rtol=2e-6, atol=2e-6 * scale,
                                           err_msg=f"daux {i}")
