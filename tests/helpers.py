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
    """What `cases` matches a quick choice against: a pytest.param's id, else the item."""
    return item.id if isinstance(item, type(pytest.param(None))) else item


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

_CASE_RUNNER = """
import sys
sys.path[:0] = [{tests!r}, {emulation!r}]
from {module} import run_case
print("ok", sys.argv[1], f"{{run_case(sys.argv[1]):.1f}} s")
"""


# Exit status of an emulated case that cannot run on this machine (the test skips).
SKIP_STATUS = 77


def emulate_script(path: str, *case, timeout: int = 900) -> str:
    """Runs `case` of the test file `path`'s __main__ in a fresh process (the host emulation
    replaces `cupy` there), asserting that it passed; its output. A case that exits with
    SKIP_STATUS skips the test, with its last line of output as the reason."""
    proc = subprocess.run([sys.executable, os.path.abspath(path), *case], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT)
    if proc.returncode == SKIP_STATUS:
        pytest.skip(proc.stdout.strip().splitlines()[-1])
    assert proc.returncode == 0, (f"emulated case {' '.join(case)}:\n{proc.stdout[-3000:]}\n"
                                  f"{proc.stderr[-3000:]}")
    return proc.stdout


def run_case_process(module: str, label: str, env=None) -> subprocess.CompletedProcess:
    """`run_case(label)` of test module `module` in a fresh Python process (the host
    emulation replaces `cupy` there), `env` added to the environment; prints "ok LABEL".
    The caller asserts on the result."""
    return subprocess.run([sys.executable, "-c", _CASE_RUNNER.format(
        tests=TESTS, emulation=os.path.join(TESTS, "emulation"), module=module),
                           label], capture_output=True, text=True, timeout=1800, cwd=ROOT,
                          env={**os.environ, **(env or {})})


def run_case_ok(module: str, label: str, env=None) -> str:
    """`run_case_process`, asserting that the case passed; its output."""
    proc = run_case_process(module, label, env)
    assert proc.returncode == 0, (f"{label} (host emulation):\n{proc.stdout[-3000:]}\n"
                                  f"{proc.stderr[-3000:]}")
    return proc.stdout


def run_mutated_case(module: str, label: str, source_dir) -> subprocess.CompletedProcess:
    """`run_case_process` on kernel sources from `source_dir` (a mutated copy), with a short
    emulation timeout for a deadlock."""
    return run_case_process(module, label, {"VARLEN_EMULATION_SOURCE_DIR": str(source_dir),
                                            "VARLEN_EMULATION_TIMEOUT": "20"})


def assert_mutant_caught(proc: subprocess.CompletedProcess, name: str, label: str, says) -> None:
    """The mutated kernel `name` failed case `label`, saying `says` (a string, or a tuple of
    which one will do)."""
    assert proc.returncode != 0, f"{name}: the mutated kernel passed {label}"
    says = (says,) if isinstance(says, str) else says
    assert any(m in proc.stdout + proc.stderr for m in says), (
        f"{name}: failed otherwise:\n{proc.stderr[-2000:]}")
