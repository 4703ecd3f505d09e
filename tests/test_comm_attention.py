"""Context-parallel attention on in-process ranks: the same cases as the mpiexec workers,
every method and cp size, plus the ring's schedule, errors and faults."""
import threading
import time

import numpy as np
import pytest

import varlen
import varlen.comm as vc
from varlen import reference
from varlen.backends import Problem
from varlen.backends.numpy_backend import NumpyBackend

from comm_workers.cases import CASES, Case, cases_for, check_case, make_global, methods_for
from helpers import cases, covering

# every cp, case and method; at the quick size every case and method, and every cp
COMBOS = cases([pytest.param(case, cp, method, id=f"cp{cp}-{case.id}-{method}")
                for cp in (1, 2, 3, 4) for case in cases_for(cp)
                for method in methods_for(case, cp)],
               covering(lambda p: (p.values[0].id, p.values[2]), lambda p: p.values[1]))


@pytest.mark.parametrize("case, cp, method", COMBOS)
def test_matches_single_process_reference(case, cp, method):
    vc.local_group(cp).run(check_case, case, method)     # asserts on every rank


def _run_case(cp, case, method="ring", **over):
    """Run forward on all in-process ranks; returns per-rank (out, lse) and the partition."""
    g = make_global(case)
    part = vc.partition(g["cu_q"], cp, case.scheme, seq_offsets=g["off_q"], num_rows=g["Tq"])
    kw = dict(mask=case.mask, method=method, backend=case.backend, **over)

    def body(grp):
        q, k, v = (part.shard(g[x], grp.rank) for x in ("q", "k", "v"))
        return vc.attention_forward(q, k, v, part, grp, **kw)
    return vc.local_group(cp).run(body), part, g


def test_ring_skips_steps_with_nothing_visible(monkeypatch):
    # A window of one key (the diagonal): every query's only key is on its own rank, so each
    # rank runs step 0 only; the other cp - 1 steps have an empty schedule and are skipped.
    calls = []
    forward = NumpyBackend.forward
    monkeypatch.setattr(NumpyBackend, "forward",
                        lambda *a, **kw: calls.append(1) or forward(*a, **kw))
    case = Case("diagonal", (13, 7, 1), mask=varlen.Mask(window_left=0, window_right=0))
    cp = 4
    res, part, g = _run_case(cp, case)
    assert len(calls) == cp
    out = part.unshard([o for o, _ in res])
    np.testing.assert_allclose(out, reference.attention_dense(
        g["q"], g["k"], g["v"], g["cu_q"], g["cu_q"], mask=case.mask)[0], atol=1e-13)


def test_ring_posts_the_next_transfer_before_computing(monkeypatch):
    log = {}
    forward, commit, wait = NumpyBackend.forward, vc.P2P.commit, vc.P2P.wait

    def record(event, fn):
        def wrapped(*a, **kw):
            log.setdefault(threading.current_thread().name, []).append(event)
            return fn(*a, **kw)
        return wrapped
    monkeypatch.setattr(NumpyBackend, "forward", record("compute", forward))
    monkeypatch.setattr(vc.P2P, "commit", record("commit", commit))
    monkeypatch.setattr(vc.P2P, "wait", record("wait", wait))
    cp = 3
    _run_case(cp, Case("dense", (30, 17)))       # every step has visible keys
    for events in log.values():
        want = ["commit", "compute", "wait"] * (cp - 1) + ["compute"]
        assert events == want, events


def test_float32_inputs_merge_in_float32():
    case = CASES[1]
    g = make_global(case)
    part = vc.partition(g["cu_q"], 2)

    def body(grp):
        q, k, v = (part.shard(g[x], grp.rank).astype(np.float32) for x in ("q", "k", "v"))
        return vc.attention_forward(q, k, v, part, grp, mask=case.mask)
    res = vc.local_group(2).run(body)
    out = part.unshard([o for o, _ in res])
    lse = part.unshard([l for _, l in res], axis=1, fill=-np.inf)
    assert out.dtype == np.float32 and lse.dtype == np.float32
    ref_out, ref_lse = reference.attention_dense(g["q"], g["k"], g["v"], g["cu_q"], g["cu_q"],
                                                 mask=case.mask)
    np.testing.assert_allclose(out, ref_out, atol=2e-5)
    fin = np.isfinite(ref_lse)
    assert np.array_equal(np.isfinite(lse), fin)
    np.testing.assert_allclose(lse[fin], ref_lse[fin], atol=2e-5)


def test_torch_arrays_in_torch_arrays_out():
    torch = pytest.importorskip("torch")
    case = CASES[1]
    g = make_global(case)
    part = vc.partition(torch.from_numpy(g["cu_q"]), 2)

    def body(grp):
        q, k, v = (part.shard(torch.from_numpy(g[x]), grp.rank) for x in ("q", "k", "v"))
        out, lse = vc.attention_forward(q, k, v, part, grp, mask=case.mask)
        return q, out, lse
    for q, out, lse in vc.local_group(2).run(body):
        assert isinstance(q, torch.Tensor) and isinstance(out, torch.Tensor)
        assert isinstance(lse, torch.Tensor)


# --------------------------------------------------------------------------------------------
# Errors and faults
# --------------------------------------------------------------------------------------------

def _call_on_all(cp, case, edit, method="ring"):
    """Forward on every rank after `edit(rank, args)` changed one rank's arguments; returns
    each rank's exception."""
    g = make_global(case)
    part = vc.partition(g["cu_q"], cp)

    def body(grp):
        args = dict(q=part.shard(g["q"], grp.rank), k=part.shard(g["k"], grp.rank),
                    v=part.shard(g["v"], grp.rank), part=part, group=grp, method=method)
        edit(grp.rank, args)
        try:
            vc.attention_forward(**args)
        except Exception as e:     # noqa: BLE001
            return e
        return None
    return vc.local_group(cp).run(body)


def test_ulysses_needs_heads_divisible_by_cp():
    errs = _call_on_all(3, CASES[1], lambda r, a: None, method="ulysses")
    for e in errs:
        assert isinstance(e, ValueError) and "divisible by cp_size=3" in str(e), e


def test_an_argument_error_on_one_rank_is_raised_on_every_rank():
    def edit(r, a):
        if r == 1:
            a["q"] = a["q"][:-1]
    errs = _call_on_all(3, CASES[1], edit)
    assert "q has" in str(errs[1]) and "part.shard(q, rank)" in str(errs[1])
    for r in (0, 2):
        assert isinstance(errs[r], ValueError) and "rank 1 rejected its inputs" in str(errs[r])


def test_partitions_that_differ_across_ranks_are_detected():
    # Same sizes (so every local check passes), other lengths.
    other = vc.partition(np.cumsum([0, 8, 1, 13, 0, 5]).astype(np.int32), 2)

    def edit(r, a):
        if r == 1:
            a["part"] = other
    for e in _call_on_all(2, CASES[1], edit):
        assert isinstance(e, ValueError) and "disagree on query partition" in str(e), e


@pytest.mark.parametrize("edit, exc, match", [
    (lambda r, a: a.update(method="tree"), ValueError, "method='tree'"),
    (lambda r, a: a.update(part=vc.partition(np.array([0, 27], np.int32), 3)), ValueError,
     "group has 2 ranks but part was built for cp_size=3"),
    (lambda r, a: a.update(part="zigzag"), TypeError, "part must be"),
    (lambda r, a: a.update(k=a["k"][:, :, :4]), ValueError, "head dim"),
])
def test_errors_name_the_argument(edit, exc, match):
    for e in _call_on_all(2, CASES[1], edit):
        assert isinstance(e, exc) and e.args and __import__("re").search(match, str(e)), e


def test_group_must_be_a_group():
    part = vc.partition(np.array([0, 4], np.int32), 1)
    x = np.zeros((4, 1, 8))
    with pytest.raises(TypeError, match="group must be"):
        vc.attention_forward(x, x, x, part, object())


@pytest.mark.parametrize("method", vc.METHODS)
def test_fault_on_one_rank_ends_every_rank(monkeypatch, method):
    forward = NumpyBackend.forward

    def failing(*a, **kw):
        if threading.current_thread().name == "cp-rank-1":
            raise RuntimeError("injected fault on rank 1")
        return forward(*a, **kw)
    monkeypatch.setattr(NumpyBackend, "forward", failing)
    t = time.perf_counter()
    with pytest.raises(RuntimeError, match="injected fault on rank 1"):
        vc.local_group(2).run(check_case, CASES[1], method)
    assert time.perf_counter() - t < 10


# Validation is set per thread, so each in-process rank sets its own (in `edit`, which runs on
# the rank's thread), as each process does under mpiexec.

def test_argument_error_without_validation_is_raised_on_every_rank():
    def edit(r, a):
        varlen.set_validation(False)
        if r == 0:
            a["q"] = a["q"][:-1]
    t = time.perf_counter()
    errs = _call_on_all(2, CASES[1], edit)
    assert isinstance(errs[0], ValueError) and "part.shard(q, rank)" in str(errs[0])
    assert isinstance(errs[1], ValueError), errs[1]
    assert "rank 0 rejected its inputs" in str(errs[1])
    assert time.perf_counter() - t < 10


def test_validation_settings_that_differ_raise_on_every_rank():
    def edit(r, a):
        varlen.set_validation(r != 0)
    for e in _call_on_all(2, CASES[1], edit):
        assert isinstance(e, ValueError) and "disagree on validation" in str(e), e


@pytest.mark.parametrize("validation", [False, True])
def test_shards_with_other_dtypes_or_heads_are_detected(validation):
    # Rank 1's float32 shards with twice the heads hold as many bytes as rank 0's float64
    # ones: without the always-on agreement they would travel the ring and give garbage.
    def edit(r, a):
        varlen.set_validation(validation)
        if r == 1:
            for x in ("q", "k", "v"):
                a[x] = np.repeat(a[x], 2, axis=1).astype(np.float32)
    for e in _call_on_all(2, CASES[1], edit):
        assert isinstance(e, ValueError) and "disagree on dtypes, shapes" in str(e), e


def test_numba_backend_ring(monkeypatch):
    """A small float32 ring case on the Numba kernels (the CUDA simulator on a CPU)."""
    backend = varlen.backends.get("numba")
    if backend is None or backend.supports(Problem("float32", 8, 8, on_device=False)):
        pytest.skip("the numba backend cannot run host float32 here")
    from varlen.backends import numba_backend
    if numba_backend.simulated():
        # The simulator keeps its kernel context in a global, so two ranks' threads must not
        # launch at once; the communication stays concurrent.
        lock = threading.Lock()

        def serialised(fn):
            def call(*a, **kw):
                with lock:
                    return fn(*a, **kw)
            return call
        for name in ("make_plan", "forward", "backward"):
            monkeypatch.setattr(backend, name, serialised(getattr(backend, name)))
    case = Case("numba", (5, 3), Hq=2, Hk=1, D=8,
                mask=varlen.Mask(window_right=np.array([0, -1], np.int32)))
    g = make_global(case)
    part = vc.partition(g["cu_q"], 2)

    def body(grp):
        q, k, v, do = (part.shard(g[x], grp.rank).astype(np.float32)
                       for x in ("q", "k", "v", "dout"))
        kw = dict(mask=case.mask, backend="numba")
        out, lse = vc.attention_forward(q, k, v, part, grp, **kw)
        return (out, lse) + vc.attention_backward(do, q, k, v, out, lse, part, grp, **kw)
    res = vc.local_group(2).run(body)
    ref = reference.attention_dense(g["q"], g["k"], g["v"], g["cu_q"], g["cu_q"],
                                    mask=case.mask)[:1]
    ref += reference.attention_dense_backward(g["dout"], g["q"], g["k"], g["v"], g["cu_q"],
                                              g["cu_q"], mask=case.mask)
    for name, i, want in zip(("out", "dq", "dk", "dv"), (0, 2, 3, 4), ref):
        got = part.unshard([r[i] for r in res])
        err = float(np.abs(got - want).max())
        assert err < 1e-5 * max(1.0, float(np.abs(want).max())), f"numba {name}: {err:.2e}"


@pytest.mark.parametrize("method", vc.METHODS)
def test_spare_local_rows_are_padding(method):
    """`local_rows` above the need (the device default is an upper bound) adds pad rows."""
    case = CASES[1]
    g = make_global(case)
    exact = vc.partition(g["cu_q"], 2).local_rows
    part = vc.partition(g["cu_q"], 2, local_rows=exact + 3)

    def body(grp):
        q, k, v, do = (part.shard(g[x], grp.rank) for x in ("q", "k", "v", "dout"))
        out, lse = vc.attention_forward(q, k, v, part, grp, mask=case.mask, method=method)
        dq, dk, dv = vc.attention_backward(do, q, k, v, out, lse, part, grp, mask=case.mask,
                                           method=method)
        assert not out[exact:].any() and np.isneginf(lse[:, exact:]).all()
        assert not dq[exact:].any() and not dk[exact:].any() and not dv[exact:].any()
        return out, dk
    res = vc.local_group(2).run(body)
    ref_out, _ = reference.attention_dense(g["q"], g["k"], g["v"], g["cu_q"], g["cu_q"],
                                           mask=case.mask)
    ref_dk = reference.attention_dense_backward(g["dout"], g["q"], g["k"], g["v"], g["cu_q"],
                                                g["cu_q"], mask=case.mask)[1]
    np.testing.assert_allclose(part.unshard([o for o, _ in res]), ref_out, atol=1e-13)
    np.testing.assert_allclose(part.unshard([d for _, d in res]), ref_dk, atol=1e-13)
