"""Communicators: the post -> commit -> wait cycle, collectives and abort (in-process group),
and the communicator factory. The MPI group runs the same rank code in test_comm_mpi.py."""
import subprocess
import sys
import time

import numpy as np
import pytest

import varlen.comm as vc
from varlen.comm import GroupAborted


def test_p2p_cycle_misuse_raises():
    g = vc.local_group(1)[0]
    ch = g.p2p()
    with pytest.raises(RuntimeError, match="nothing posted"):
        ch.commit()
    with pytest.raises(RuntimeError, match="without a committed batch"):
        ch.wait()
    buf = np.empty(3)
    ch.post_send(np.arange(3.0), 0)
    with pytest.raises(RuntimeError, match="never committed"):
        ch.wait()
    ch.post_recv(buf, 0)
    ch.commit()
    assert ch.in_flight
    with pytest.raises(RuntimeError, match="in flight"):
        ch.post_send(buf, 0)
    with pytest.raises(RuntimeError, match="in flight"):
        ch.commit()
    ch.wait()
    np.testing.assert_array_equal(buf, [0, 1, 2])
    with pytest.raises(ValueError, match="peer"):
        ch.post_send(buf, 1)
    with pytest.raises(ValueError, match="contiguous"):
        ch.post_recv(np.empty((3, 2))[:, 0], 0)


def _ring_shift(g):
    """Every rank sends two arrays to rank+1 on one channel, and its rank on another."""
    a, b = g.p2p(tag=0), g.p2p(tag=1)
    nxt, prv = (g.rank + 1) % g.size, (g.rank - 1) % g.size
    got = [np.empty(4), np.empty(2, np.int32), np.empty(1)]
    a.post_send(np.full(4, g.rank, float), nxt)
    a.post_send(np.full(2, 10 * g.rank, np.int32), nxt)
    a.post_recv(got[0], prv)
    a.post_recv(got[1], prv)
    b.post_send(np.array([-g.rank], float), nxt)
    b.post_recv(got[2], prv)
    b.commit()
    a.commit()                           # two channels in flight; order of waits is free
    a.wait()
    b.wait()
    return got


@pytest.mark.parametrize("n", [1, 2, 3])
def test_ring_exchange(n):
    for r, (x, y, z) in enumerate(vc.local_group(n).run(_ring_shift)):
        prv = (r - 1) % n
        assert (x == prv).all() and (y == 10 * prv).all() and z[0] == -prv


def test_collectives():
    def body(g):
        r, n = g.rank, g.size
        gathered = g.allgather(np.full((2,), r, np.float32))
        a2a = g.alltoall(np.arange(n)[:, None] * 100 + r + np.zeros((n, 3)))
        rs = g.reduce_scatter(np.ones((n, 2)) * (r + 1))
        objs = g.allgather_object({"rank": r})
        return gathered, a2a, rs, objs
    n = 3
    for r, (gathered, a2a, rs, objs) in enumerate(vc.local_group(n).run(body)):
        np.testing.assert_array_equal(gathered, np.repeat(np.arange(n), 2).reshape(n, 2))
        assert gathered.dtype == np.float32
        np.testing.assert_array_equal(a2a[:, 0], r * 100 + np.arange(n))   # from each src
        np.testing.assert_array_equal(rs, np.full(2, n * (n + 1) / 2))
        assert objs == [{"rank": s} for s in range(n)]


def test_abort_ends_every_rank_quickly():
    def body(g):
        if g.rank == 1:
            time.sleep(0.1)
            raise RuntimeError("boom on rank 1")
        buf = np.empty(1)                 # rank 0 waits for a message that never comes
        ch = g.p2p()
        ch.post_recv(buf, 1)
        ch.commit()
        ch.wait()
    t = time.perf_counter()
    with pytest.raises(RuntimeError, match="boom on rank 1"):
        vc.local_group(2).run(body)
    assert time.perf_counter() - t < 5


def test_abort_breaks_collectives_too():
    def body(g):
        if g.rank == 2:
            raise KeyError("rank 2 fails")
        try:
            g.allgather_object(g.rank)
        except GroupAborted:
            return "aborted"
    with pytest.raises(KeyError, match="rank 2 fails"):
        vc.local_group(3).run(body)


def test_stuck_rank_times_out():
    def body(g):
        if g.rank == 0:
            g.allgather_object(0)         # rank 1 never joins
    t = time.perf_counter()
    with pytest.raises(TimeoutError, match="rank 0 waited 0.5 s for rank 1 in a collective"):
        vc.local_group(2, timeout=0.5).run(body)
    assert time.perf_counter() - t < 5


def test_factory_errors():
    with pytest.raises(ValueError, match="n must be"):
        vc.local_group(0)
    with pytest.raises(ValueError, match="timeout must be a number of seconds > 0"):
        vc.local_group(2, timeout=0)
    with pytest.raises(ValueError, match="backend='gloo'"):
        vc.init(None, backend="gloo")
    with pytest.raises(TypeError, match="mpi4py communicator"):
        vc.init(object())


def test_nothing_heavy_imported_by_the_package():
    code = ("import sys, varlen.comm, varlen.comm.mpi_group, varlen.comm.nccl_group; "
            "heavy = [m for m in ('cupy', 'mpi4py', 'numba', 'torch') if m in sys.modules]; "
            "assert not heavy, heavy")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
