"""The NCCL group's logic on the CPU: `cupy.cuda.nccl` and the MPI bootstrap replaced by an
in-process stand-in that moves the bytes behind the raw pointers the group hands over.

The group's host side (an MPI group in production) is the in-process group of the stand-in.
What is checked: the unique id travels from rank 0, the device comes from the node-local rank,
sends and receives are issued inside a group with matching byte counts and pointers (ring,
all-gather, grouped all-to-all, reduce-scatter), and the attention methods give the reference
result through it. What is not: real NCCL, streams and devices (a GPU test does that).
"""
import ctypes
import sys
import threading
import types

import numpy as np
import pytest

import varlen.comm as vc
from varlen.comm import nccl_group
from varlen.comm.nccl_group import NcclGroup

from comm_workers.cases import cases_for, check_case, methods_for


class DevArray(np.ndarray):
    """A host array posing as a device array: `.data.ptr` is its address."""

    @property
    def data(self):
        return types.SimpleNamespace(ptr=self.__array_interface__["data"][0])


class _Stream:
    def __init__(self, ptr):
        self.ptr = ptr
        self.waited = []

    def record(self):
        return object()

    def wait_event(self, event):
        self.waited.append(event)


def _fake_cupy(ndev):
    current = _Stream(0)
    used = threading.local()

    class Device:
        def __init__(self, i):
            self.i = i

        def use(self):
            used.device = self.i
    cuda = types.SimpleNamespace(
        get_current_stream=lambda: current, Stream=lambda non_blocking=False: _Stream(1),
        Device=Device, runtime=types.SimpleNamespace(getDeviceCount=lambda: ndev))
    return types.SimpleNamespace(
        ndarray=np.ndarray, cuda=cuda,
        ascontiguousarray=lambda x: np.ascontiguousarray(x).view(DevArray),
        empty=lambda shape, dtype=float: np.empty(shape, dtype).view(DevArray),
        empty_like=lambda x: np.empty_like(x).view(DevArray)), used


class _FakeNccl(types.SimpleNamespace):
    """Just enough of cupy.cuda.nccl, for ranks that are threads of this process."""

    def __init__(self, n):
        super().__init__(available=True, NCCL_UINT8=np.uint8, NCCL_FLOAT16=np.float16,
                         NCCL_FLOAT32=np.float32, NCCL_FLOAT64=np.float64, NCCL_SUM="sum")
        self.world = vc.local_group(n)
        self.pending = threading.local()
        self.grouped_ops = []

    def get_unique_id(self):
        return bytes(range(128))

    def groupStart(self):
        self.pending.ops = []

    def groupEnd(self):
        ops, self.pending.ops = self.pending.ops, None
        self.grouped_ops.append(len(ops))
        for op in ops:                      # every send lands before any receive waits
            if op[0] == "send":
                op[1]._send(*op[2:])
        for op in ops:
            if op[0] == "recv":
                op[1]._recv(*op[2:])

    def NcclCommunicator(self, ndev, uid, rank):
        assert uid == self.get_unique_id() and ndev == len(self.world)
        return _FakeComm(self, self.world[rank])


class _FakeComm:
    def __init__(self, nccl, group):
        self.nccl, self.group = nccl, group

    def _queue(self, op):
        ops = getattr(self.nccl.pending, "ops", None)
        assert ops is not None, "point-to-point outside groupStart/groupEnd"
        ops.append(op)

    def send(self, ptr, count, dtype, peer, stream):
        assert dtype is np.uint8 and stream in (0, 1)    # current or the ring stream
        self._queue(("send", self, ptr, count, peer))

    def recv(self, ptr, count, dtype, peer, stream):
        self._queue(("recv", self, ptr, count, peer))

    def _send(self, ptr, count, peer):
        ch = self.group.p2p(tag=99)
        ch.post_send(np.frombuffer(ctypes.string_at(ptr, count), np.uint8), peer)
        ch.commit()
        ch.wait()

    def _recv(self, ptr, count, peer):
        buf = np.empty(count, np.uint8)
        ch = self.group.p2p(tag=99)
        ch.post_recv(buf, peer)
        ch.commit()
        ch.wait()
        ctypes.memmove(ptr, buf.ctypes.data, count)

    def allGather(self, sendptr, recvptr, count, dtype, stream):
        mine = ctypes.string_at(sendptr, count)
        data = b"".join(self.group.allgather_object(mine))
        ctypes.memmove(recvptr, data, len(data))

    def reduceScatter(self, sendptr, recvptr, count, dtype, op, stream):
        n, size = len(self.nccl.world), np.dtype(dtype).itemsize
        mine = np.frombuffer(ctypes.string_at(sendptr, n * count * size), dtype)
        total = sum(x.reshape(n, count)[self.group.rank]
                    for x in self.group.allgather_object(mine))
        ctypes.memmove(recvptr, np.ascontiguousarray(total).ctypes.data, count * size)


class _FakeMpiComm:
    """The mpi4py calls the NCCL group makes, over an in-process group."""

    def __init__(self, group):
        self.group = group

    def Get_size(self):
        return self.group.size

    def Get_rank(self):
        return self.group.rank

    def Split_type(self, kind):
        return types.SimpleNamespace(Get_rank=self.Get_rank, Get_size=self.Get_size,
                                     Free=lambda: None)



@pytest.fixture
def fake(monkeypatch):
    def install(n, ndev=None):
        nccl = _FakeNccl(n)
        cupy, used = _fake_cupy(n if ndev is None else ndev)
        cupy.cuda.nccl = nccl
        monkeypatch.setitem(sys.modules, "cupy", cupy)
        monkeypatch.setitem(sys.modules, "cupy.cuda", cupy.cuda)
        monkeypatch.setitem(sys.modules, "cupy.cuda.nccl", nccl)
        monkeypatch.setitem(sys.modules, "mpi4py",
                            types.SimpleNamespace(MPI=types.SimpleNamespace(COMM_TYPE_SHARED=1)))
        monkeypatch.setattr(nccl_group, "MpiGroup", lambda comm, timeout: comm.group)
        return nccl, used
    return install


@pytest.mark.parametrize("cp", [2, 3])
def test_attention_through_the_nccl_group(fake, cp):
    nccl, used = fake(cp)

    def body(g):
        group = NcclGroup(_FakeMpiComm(g))
        assert group.device == used.device == g.rank
        return [check_case(group, case, m) for case in cases_for(cp)[:3]
                for m in methods_for(case, cp)]
    for errs in nccl.world.run(body):
        assert max(errs) < 1e-12
    # The grouped all-to-all issues a send and a receive per peer in one group.
    assert max(nccl.grouped_ops) >= 2 * cp


def test_collectives_through_the_nccl_group(fake):
    nccl, _ = fake(3)

    def body(g):
        group = NcclGroup(_FakeMpiComm(g))
        r = g.rank
        gathered = group.allgather(np.full((2, 2), r, np.float32))
        a2a = group.alltoall(np.arange(3)[:, None] * 10.0 + r + np.zeros((3, 4)))
        rs = group.reduce_scatter(np.ones((3, 5)) * (r + 1))
        return gathered, a2a, rs
    for r, (gathered, a2a, rs) in enumerate(nccl.world.run(body)):
        np.testing.assert_array_equal(gathered[:, 0, 0], [0, 1, 2])
        np.testing.assert_array_equal(a2a[:, 0], 10 * r + np.arange(3))
        np.testing.assert_array_equal(rs, np.full(5, 6.0))


def test_more_ranks_than_gpus_is_refused(fake):
    nccl, _ = fake(2, ndev=1)

    def body(g):
        NcclGroup(_FakeMpiComm(g))
    with pytest.raises(RuntimeError, match="one GPU per rank"):
        nccl.world.run(body)


def test_host_arrays_are_refused(fake):
    nccl, _ = fake(1)

    def body(g):
        group = NcclGroup(_FakeMpiComm(g))
        group._cp.ndarray = DevArray          # now plain NumPy arrays are "host" arrays
        group.allgather(np.zeros(2))
    with pytest.raises(TypeError, match="use the mpi group for host data"):
        nccl.world.run(body)
