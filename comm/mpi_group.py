"""The MPI group: mpi4py on host buffers (or device buffers with a CUDA-aware MPI).

Data travels as raw bytes (`MPI.BYTE`), so every dtype works, bfloat16 included. Device (CuPy)
arrays are staged through host memory unless `cuda_aware=True` says the MPI takes device
pointers (the pip MPICH wheel does not).

Every wait has a timeout. Point-to-point batches and the collectives (built from nonblocking
sends and receives on a communicator of their own) are polled until they complete; after
`timeout` seconds the group names the ranks it is still waiting for and aborts. `abort` is
`MPI_Abort`: it ends every rank of the job.
"""
from __future__ import annotations

import os
import pickle
import sys
import time
from dataclasses import dataclass

import numpy as np

from varlen._array import array_module
from .group import DEFAULT_TIMEOUT, Group, check_timeout, report_abort

__all__ = ["MpiGroup"]

_MAX_PAUSE = 1e-3       # seconds between polls of a pending batch, at most
# Seconds between writing the report of an abort and MPI_Abort: mpiexec can end its output
# forwarding on the abort before it has read what the rank wrote just before (seen about once
# in twenty jobs whose peer had vanished, without this pause).
_REPORT_GRACE = 0.2


def _is_host(x) -> bool:
    return isinstance(x, np.ndarray)


@dataclass
class _Pending:
    """Posted MPI requests, the peer of each, what they are, and the buffers they need."""

    reqs: list
    peers: list
    what: str
    keep: list             # send buffers, alive until the requests complete
    bounce: list           # (host landing, device buffer) pairs to copy after completion


class MpiGroup(Group):
    """One rank of an mpi4py communicator (use `varlen.comm.init(comm, backend="mpi")`).

    `timeout` (seconds) bounds every wait for a peer; a rank still missing after it is named
    in the error that aborts the job.
    """

    def __init__(self, comm, *, cuda_aware: bool = False, timeout: float = DEFAULT_TIMEOUT):
        from mpi4py import MPI
        self._MPI = MPI
        self.timeout = check_timeout(timeout)
        self.size = comm.Get_size()
        self.rank = comm.Get_rank()
        self.cuda_aware = bool(cuda_aware)
        self._parent = comm                               # what abort ends
        # Private duplicates: the caller's own messages never match ours, and a channel's
        # never match a collective's.
        self.comm = self._dup(comm)
        self._coll = self._dup(comm)

    def _dup(self, comm):
        new, req = comm.Idup()
        self._wait(_Pending([req], [None], "varlen.comm.init (every rank must call it)", [],
                            []))
        return new

    # Byte views of what MPI reads and writes -------------------------------------------------

    def _outgoing(self, x):
        """A contiguous buffer MPI can read: host bytes, or device bytes if CUDA-aware."""
        if _is_host(x):
            return np.ascontiguousarray(x).reshape(-1).view(np.uint8)
        xp = array_module(x)
        if self.cuda_aware:
            return xp.ascontiguousarray(x).reshape(-1).view(xp.uint8)
        return np.ascontiguousarray(x.get()).reshape(-1).view(np.uint8)

    def _landing(self, buf):
        """Where MPI writes for `buf`: `buf`'s own bytes, or a host bounce buffer."""
        if _is_host(buf) or self.cuda_aware:
            xp = array_module(buf)
            return buf.reshape(-1).view(xp.uint8), None
        host = np.empty(buf.nbytes, np.uint8)
        return host, buf

    # Posting and waiting ---------------------------------------------------------------------

    def _post(self, comm, ops, tag, what) -> _Pending:
        MPI = self._MPI
        p = _Pending([], [], what, [], [])
        for kind, x, peer in ops:
            if kind == "send":
                data = self._outgoing(x)
                p.keep.append(data)
                p.reqs.append(comm.Isend([data, MPI.BYTE], dest=peer, tag=tag))
            else:
                land, dev = self._landing(x)
                p.reqs.append(comm.Irecv([land, MPI.BYTE], source=peer, tag=tag))
                if dev is not None:
                    p.bounce.append((land, dev))
            p.peers.append(peer)
        return p

    def _wait(self, p: _Pending):
        """Poll `p`'s requests until they complete; abort after `timeout` seconds."""
        Testall = self._MPI.Request.Testall
        deadline, pause = time.monotonic() + self.timeout, 0.0
        while not Testall(p.reqs):
            if time.monotonic() > deadline:
                self._timed_out(p)
            time.sleep(pause)
            pause = min(2 * pause or 1e-6, _MAX_PAUSE)
        for host, dev in p.bounce:
            dev.set(host.view(dev.dtype).reshape(dev.shape))

    def _timed_out(self, p: _Pending):
        missing = sorted({peer for req, peer in zip(p.reqs, p.peers)
                          if peer is not None and not req.Test()})
        who = (f"rank {', '.join(map(str, missing))}" if missing else
               "a rank that has not called it")
        err = TimeoutError(
            f"rank {self.rank} waited {self.timeout:g} s for {who} in {p.what}: it failed, "
            f"exited or is elsewhere in the program. Every rank stops (raise the timeout with "
            f"varlen.comm.init(..., timeout=seconds) if a step legitimately takes longer)")
        self.abort(err)
        raise err

    # Point to point --------------------------------------------------------------------------

    def _start(self, ops, tag):
        return self._post(self.comm, ops, tag, f"a transfer on channel {tag}")

    def _finish(self, handle):
        self._wait(handle)

    # Collectives: every rank sends to and receives from every other, tag 0 of `_coll` --------

    def _exchange(self, sends, recvs, what):
        """Send `sends[p]` to and receive into `recvs[p]` from every other rank `p`."""
        others = [p for p in range(self.size) if p != self.rank]
        ops = [("send", sends[p], p) for p in others] + [("recv", recvs[p], p) for p in others]
        if ops:
            self._wait(self._post(self._coll, ops, 0, what))

    def _allgather(self, x, *, what="allgather"):
        xp = array_module(x)
        out = xp.empty((self.size,) + tuple(x.shape), dtype=x.dtype)
        out[self.rank] = x
        data = self._outgoing(x)                          # one copy of x for every peer
        self._exchange([data] * self.size, out, what)
        return out

    def _alltoall(self, x):
        if x.shape[0] != self.size:
            raise ValueError(f"alltoall needs [size={self.size}, ...], got {tuple(x.shape)}")
        xp = array_module(x)
        out = xp.empty(tuple(x.shape), dtype=x.dtype)
        out[self.rank] = x[self.rank]
        self._exchange(x, out, "alltoall")
        return out

    def allgather_object(self, obj) -> list:
        data = np.frombuffer(pickle.dumps(obj), np.uint8)
        what = "allgather_object (the agreement at the start of a call)"
        sizes = self._allgather(np.array([data.size], np.int64), what=what)[:, 0]
        buf = np.zeros(int(sizes.max()), np.uint8)
        buf[:data.size] = data
        every = self._allgather(buf, what=what)
        return [pickle.loads(every[r, :int(n)].tobytes()) for r, n in enumerate(sizes)]

    def barrier(self):
        self._allgather(np.zeros(1, np.uint8), what="barrier")

    def gpus_per_node(self) -> int:
        n = self.__dict__.get("_node_size")
        if n is None:
            node = self.comm.Split_type(self._MPI.COMM_TYPE_SHARED)
            n = self._node_size = node.Get_size()
            node.Free()
        return n

    def _subgroup(self, groups, mine):
        sub = self.comm.Split(mine, groups[mine].index(self.rank))
        return MpiGroup(sub, cuda_aware=self.cuda_aware, timeout=self.timeout)

    def abort(self, error=None):
        report_abort(self.rank, error)
        time.sleep(_REPORT_GRACE)
        self._parent.Abort(1)
        # MPI_Abort does not return, unless the launcher's connection is gone already (a
        # peer vanished under `mpiexec -disable-auto-cleanup`): end this process regardless.
        sys.stdout.flush()
        os._exit(1)
