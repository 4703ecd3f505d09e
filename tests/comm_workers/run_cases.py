"""mpiexec worker: every context-parallel case on the MPI group, one rank per process.

    mpiexec -n N python -m mpi4py tests/comm_workers/run_cases.py cases
    mpiexec -n N python tests/comm_workers/run_cases.py MODE [TIMEOUT_S]   # the failure modes

`cases` runs every case and method valid for N ranks and the collectives, then checks that
argument errors and disagreeing partitions raise the same ValueError on every rank (no abort
needed). The failure modes, each of which must end every rank:

* `fault`: rank 1 raises inside the attention kernel mid-ring: the group aborts.
* `validation`: rank 0 has validation off, the others on: the same ValueError everywhere.
* `shapes`: validation off everywhere; rank 1 passes float32 shards with twice the heads (the
  same bytes as the others' float64 shards): the same ValueError everywhere.
* `late`: rank 1 raises before it calls attention: rank 0's wait times out naming rank 1.
* `vanish`: rank 1 ends with `os._exit(0)` mid-ring: rank 0's wait times out naming rank 1.
"""
import os
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.dirname(_HERE)]           # cases.py, and the tests' helpers.py

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

import varlen  # noqa: E402
import varlen.comm as vc  # noqa: E402
from cases import CASES, cases_for, check_case, make_global, methods_for  # noqa: E402

varlen.set_nan_fill(True)


def run_cases(group):
    n, worst = 0, {}
    for case in cases_for(group.size):
        for method in methods_for(case, group.size):
            err = check_case(group, case, method)
            worst[case.dtype] = max(worst.get(case.dtype, 0.0), err)
            n += 1
    return n, worst


def expect_consistent_errors(group):
    """Errors on one rank are raised, with the same message, on every rank."""
    case = CASES[1]
    g = make_global(case)
    r, cp = group.rank, group.size
    part = vc.partition(g["cu_q"], cp)
    q, k, v = (part.shard(g[x], r) for x in ("q", "k", "v"))
    bad_q = q[:-1] if r == cp - 1 else q
    try:
        vc.attention_forward(bad_q, k, v, part, group)
    except ValueError as e:
        assert f"rank {cp - 1} rejected its inputs" in str(e) or r == cp - 1, e
    else:
        raise AssertionError("a bad shape on one rank was not reported")
    other = vc.partition(np.array([0, 3, int(g["cu_q"][-1])], np.int32), cp)
    mine = other if r == cp - 1 else part
    try:
        vc.attention_forward(q, k, v, mine, group, method="allgather")
    except ValueError as e:
        assert "disagree" in str(e) or "rows" in str(e), e
    else:
        raise AssertionError("partitions that differ across ranks were not detected")


def inject_fault(rank_to_fail, on_call, fault=None):
    """Make the `on_call`-th forward kernel call on `rank_to_fail` call `fault` (default:
    raise a RuntimeError)."""
    from varlen.backends.numpy_backend import NumpyBackend
    forward = NumpyBackend.forward
    calls = [0]

    def failing(*a, **kw):
        calls[0] += 1
        if MPI.COMM_WORLD.rank == rank_to_fail and calls[0] == on_call:
            if fault is not None:
                fault()
            raise RuntimeError(f"injected fault on rank {rank_to_fail}")
        return forward(*a, **kw)
    NumpyBackend.forward = failing


def _shards(group):
    """This rank's shards of CASES[1] (every rank builds the same global batch itself)."""
    case = CASES[1]
    g = make_global(case)
    part = vc.partition(g["cu_q"], group.size)
    return part, case.mask, [part.shard(g[x], group.rank) for x in ("q", "k", "v")]


def expect_agreement(group, mode):
    """Ranks called differently all raise the same ValueError, whatever their validation."""
    part, mask, (q, k, v) = _shards(group)
    if mode == "validation":
        varlen.set_validation(group.rank != 0)
        want = "disagree on validation"
    else:
        varlen.set_validation(False)
        if group.rank == 1:        # the same bytes as the other ranks' shards
            q, k, v = (np.repeat(x, 2, axis=1).astype(np.float32) for x in (q, k, v))
        want = "disagree on dtypes, shapes"
    try:
        vc.attention_forward(q, k, v, part, group, mask=mask)
    except ValueError as e:
        assert want in str(e), e
    else:
        raise AssertionError(f"rank {group.rank}: {mode} that differ across ranks passed")
    print(f"rank {group.rank}: OK {mode}", flush=True)


def expect_collectives(group):
    r, n = group.rank, group.size
    assert (group.allgather(np.full(3, r, np.float32))[:, 0] == np.arange(n)).all()
    got = group.alltoall(np.arange(n)[:, None] * 10 + r + np.zeros((n, 2), np.int64))
    assert (got[:, 0] == 10 * r + np.arange(n)).all(), got
    assert (group.reduce_scatter(np.ones((n, 4)) * (r + 1)) == n * (n + 1) / 2).all()
    assert group.allgather_object({"rank": r, "pad": "x" * r * 100}) == [
        {"rank": s, "pad": "x" * s * 100} for s in range(n)]


def main(mode, timeout):
    # Start-up (imports, the group's own exchange) with the default timeout: a loaded machine
    # can start one rank seconds after another. `timeout` bounds the waits under test.
    group = vc.init(MPI.COMM_WORLD, backend="mpi")
    group.allgather_object(None)
    group.timeout = timeout
    t = time.perf_counter()
    if mode == "cases":
        n, worst = run_cases(group)
        expect_collectives(group)
        expect_consistent_errors(group)
        if group.rank == 0:
            errs = " ".join(f"max_err_{dt}={e:.1e}" for dt, e in sorted(worst.items()))
            print(f"OK size={group.size} checks={n} {errs} "
                  f"time={time.perf_counter() - t:.1f}s", flush=True)
    elif mode in ("validation", "shapes"):
        expect_agreement(group, mode)
    elif mode in ("fault", "vanish", "late"):
        if mode == "late" and group.rank == 1:
            raise RuntimeError("rank 1 fails before the call")
        inject_fault(rank_to_fail=1, on_call=2, fault=(lambda: os._exit(0)) if mode == "vanish"
                     else None)
        part, mask, (q, k, v) = _shards(group)
        for _ in range(2):                                 # two layers
            vc.attention_forward(q, k, v, part, group, mask=mask)
        print(f"rank {group.rank}: UNREACHABLE", flush=True)
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "cases",
         float(sys.argv[2]) if len(sys.argv) > 2 else 60.0)
