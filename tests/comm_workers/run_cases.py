"""mpiexec worker: every context-parallel case on the MPI group, one rank per process.

    mpiexec -n N python -m mpi4py tests/comm_workers/run_cases.py cases
    mpiexec -n N python tests/comm_workers/run_cases.py fault      # must end, with an error

`cases` runs every case and method valid for N ranks, then checks that argument errors and
disagreeing partitions raise the same ValueError on every rank (no abort needed). `fault`
raises inside the attention kernel on rank 1 mid-ring: the group aborts and every rank ends.
"""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

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


def inject_fault(rank_to_fail, on_call):
    from varlen.backends import numpy_backend
    forward = numpy_backend.forward
    calls = [0]

    def failing(*a, **kw):
        calls[0] += 1
        if MPI.COMM_WORLD.rank == rank_to_fail and calls[0] == on_call:
            raise RuntimeError(f"injected fault on rank {rank_to_fail}")
        return forward(*a, **kw)
    numpy_backend.forward = failing


def main(mode):
    group = vc.init(MPI.COMM_WORLD, backend="mpi")
    t = time.perf_counter()
    if mode == "cases":
        n, worst = run_cases(group)
        expect_consistent_errors(group)
        if group.rank == 0:
            errs = " ".join(f"max_err_{dt}={e:.1e}" for dt, e in sorted(worst.items()))
            print(f"OK size={group.size} checks={n} {errs} "
                  f"time={time.perf_counter() - t:.1f}s", flush=True)
    elif mode == "fault":
        inject_fault(rank_to_fail=1, on_call=2)
        check_case(group, CASES[1], "ring")
        print(f"rank {group.rank}: UNREACHABLE", flush=True)
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "cases")
