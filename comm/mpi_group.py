"""The MPI group: mpi4py on host buffers (or device buffers with a CUDA-aware MPI).

Data travels as raw bytes (`MPI.BYTE`), so every dtype works, bfloat16 included; only
`reduce_scatter` needs a typed buffer (the float32/float64 accumulators). Device (CuPy) arrays
are staged through host memory unless `cuda_aware=True` says the MPI takes device pointers
(the pip MPICH wheel does not). `abort` is `MPI_Abort`: it ends every rank of the job.
"""
from __future__ import annotations

import numpy as np

from varlen._array import array_module
from .group import Group, report_abort

__all__ = ["MpiGroup"]


def _is_host(x) -> bool:
    return isinstance(x, np.ndarray)


class MpiGroup(Group):
    """One rank of an mpi4py communicator (use `varlen.comm.init(comm, backend="mpi")`)."""

    def __init__(self, comm, *, cuda_aware: bool = False):
        from mpi4py import MPI
        self._MPI = MPI
        # A private duplicate: the caller's own messages can never match the ring's (a
        # collective call, like init itself).
        self.comm = comm.Dup()
        self.size = comm.Get_size()
        self.rank = comm.Get_rank()
        self.cuda_aware = bool(cuda_aware)

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

    # Point to point --------------------------------------------------------------------------

    def _start(self, ops, tag):
        MPI = self._MPI
        reqs, keep, bounce = [], [], []
        for kind, x, peer in ops:
            if kind == "send":
                data = self._outgoing(x)
                keep.append(data)                      # alive until Waitall
                reqs.append(self.comm.Isend([data, MPI.BYTE], dest=peer, tag=tag))
            else:
                land, dev = self._landing(x)
                reqs.append(self.comm.Irecv([land, MPI.BYTE], source=peer, tag=tag))
                if dev is not None:
                    bounce.append((land, dev))
        return reqs, keep, bounce

    def _finish(self, handle):
        reqs, _, bounce = handle
        self._MPI.Request.Waitall(reqs)
        for host, dev in bounce:
            dev.set(host.view(dev.dtype).reshape(dev.shape))

    # Collectives -----------------------------------------------------------------------------

    def _result(self, like, shape, dtype):
        """An output buffer and the bytes MPI writes into (a host bounce for staged arrays)."""
        if _is_host(like) or self.cuda_aware:
            xp = array_module(like)
            out = xp.empty(shape, dtype=dtype)
            return out, out.reshape(-1).view(xp.uint8)
        out = np.empty(shape, dtype=dtype)
        return out, out.reshape(-1).view(np.uint8)

    def _back(self, like, out):
        if _is_host(like) or self.cuda_aware:
            return out
        return array_module(like).asarray(out)

    def allgather(self, x):
        MPI = self._MPI
        data = self._outgoing(x)
        out, raw = self._result(x, (self.size,) + tuple(x.shape), x.dtype)
        self.comm.Allgather([data, MPI.BYTE], [raw, MPI.BYTE])
        return self._back(x, out)

    def alltoall(self, x):
        if x.shape[0] != self.size:
            raise ValueError(f"alltoall needs [size={self.size}, ...], got {tuple(x.shape)}")
        MPI = self._MPI
        data = self._outgoing(x)
        out, raw = self._result(x, tuple(x.shape), x.dtype)
        self.comm.Alltoall([data, MPI.BYTE], [raw, MPI.BYTE])
        return self._back(x, out)

    def reduce_scatter(self, x):
        if x.shape[0] != self.size:
            raise ValueError(f"reduce_scatter needs [size={self.size}, ...], got "
                             f"{tuple(x.shape)}")
        if np.dtype(x.dtype) not in (np.float32, np.float64):
            return super().reduce_scatter(x)
        MPI = self._MPI
        mpi_type = MPI.DOUBLE if np.dtype(x.dtype) == np.float64 else MPI.FLOAT
        host = _is_host(x) or not self.cuda_aware
        xp = np if host else array_module(x)
        send = np.ascontiguousarray(x if _is_host(x) else x.get()) if host else \
            xp.ascontiguousarray(x)
        out = xp.empty(tuple(x.shape[1:]), dtype=x.dtype)
        self.comm.Reduce_scatter_block([send, mpi_type], [out, mpi_type], op=MPI.SUM)
        return self._back(x, out)

    def allgather_object(self, obj) -> list:
        return self.comm.allgather(obj)

    def barrier(self):
        self.comm.Barrier()

    def abort(self, error=None):
        report_abort(self.rank, error)
        self.comm.Abort(1)
