"""The NCCL group: `cupy.cuda.nccl` for device data, mpi4py for the bootstrap and host data.

One rank per GPU: the device is chosen from the rank's node-local rank (an MPI
`COMM_TYPE_SHARED` split) before the communicator is created; rank 0's unique id is broadcast
over MPI. Transfers are raw bytes (`NCCL_UINT8`), so every dtype travels, bfloat16 included.

Streams: point-to-point batches run on the group's own stream, ordered after the caller's
current stream by an event at `commit`; `wait` makes the current stream wait on the batch's
completion event (a device-side wait, no host synchronisation), so compute overlaps the ring
transfers. Collectives run on the current stream. CuPy's `nccl` has no all-to-all: it is a
grouped send/recv, as in `cupyx.distributed`.

Host work (the unique id, the agreement at the start of each call, barriers, abort) goes
through an MPI group over the same ranks, with its timeout. NCCL transfers never block the host,
so they have none: a peer that is gone stalls the device, not the host.

Nothing here is imported until a group is created.
"""
from __future__ import annotations

import numpy as np

from .group import DEFAULT_TIMEOUT, Group, report_abort
from .mpi_group import MpiGroup

__all__ = ["NcclGroup"]


class NcclGroup(Group):
    """One rank of an NCCL communicator (use `varlen.comm.init(comm, backend="nccl")`)."""

    def __init__(self, mpi_comm, *, device=None, timeout: float = DEFAULT_TIMEOUT):
        import cupy
        from cupy.cuda import nccl
        if not getattr(nccl, "available", False):
            raise RuntimeError("cupy.cuda.nccl is not available: install the NCCL wheel for "
                               "your CUDA (nvidia-nccl-cu12 / nvidia-nccl-cu13)")
        from mpi4py import MPI
        self._cp, self._nccl = cupy, nccl
        self._host = MpiGroup(mpi_comm, timeout=timeout)     # host data, with timeouts
        self.size = mpi_comm.Get_size()
        self.rank = mpi_comm.Get_rank()
        node = mpi_comm.Split_type(MPI.COMM_TYPE_SHARED)
        local_rank, local_size = node.Get_rank(), node.Get_size()
        node.Free()
        ndev = cupy.cuda.runtime.getDeviceCount()
        if device is None:
            if local_size > ndev:
                raise RuntimeError(f"{local_size} ranks on this node but {ndev} GPUs: NCCL "
                                   f"needs one GPU per rank (use the MPI group to test more "
                                   f"ranks than GPUs)")
            device = local_rank
        self.device = int(device)
        cupy.cuda.Device(self.device).use()                  # before ncclCommInitRank
        uid = nccl.get_unique_id() if self.rank == 0 else None
        uid = self._host.allgather_object(uid)[0]
        self.comm = nccl.NcclCommunicator(self.size, uid, self.rank)
        self._stream = cupy.cuda.Stream(non_blocking=True)

    def _device_array(self, x, name):
        if not isinstance(x, self._cp.ndarray):
            raise TypeError(f"the nccl group moves CuPy (device) arrays; {name} is "
                            f"{type(x).__name__}: use the mpi group for host data")
        return self._cp.ascontiguousarray(x)

    # Point to point --------------------------------------------------------------------------

    def _start(self, ops, tag):
        cp, nccl = self._cp, self._nccl
        # Channels share the communicator; NCCL matches sends and receives by issue order,
        # which the symmetric rank code keeps the same on every rank, so `tag` is not needed.
        ready = cp.cuda.get_current_stream().record()
        self._stream.wait_event(ready)
        keep = []
        nccl.groupStart()
        try:
            for kind, x, peer in ops:
                buf = self._device_array(x, "a p2p buffer")
                keep.append(buf)
                if kind == "send":
                    self.comm.send(buf.data.ptr, buf.nbytes, nccl.NCCL_UINT8, peer,
                                   self._stream.ptr)
                else:
                    self.comm.recv(buf.data.ptr, buf.nbytes, nccl.NCCL_UINT8, peer,
                                   self._stream.ptr)
        finally:
            nccl.groupEnd()
        done = self._stream.record()
        return done, keep

    def _finish(self, handle):
        done, _ = handle
        self._cp.cuda.get_current_stream().wait_event(done)

    # Collectives -----------------------------------------------------------------------------

    def _allgather(self, x):
        cp, nccl = self._cp, self._nccl
        x = self._device_array(x, "x")
        out = cp.empty((self.size,) + x.shape, dtype=x.dtype)
        self.comm.allGather(x.data.ptr, out.data.ptr, x.nbytes, nccl.NCCL_UINT8,
                            cp.cuda.get_current_stream().ptr)
        return out

    def _alltoall(self, x):
        cp, nccl = self._cp, self._nccl
        x = self._device_array(x, "x")
        if x.shape[0] != self.size:
            raise ValueError(f"alltoall needs [size={self.size}, ...], got {tuple(x.shape)}")
        out = cp.empty_like(x)
        stream = cp.cuda.get_current_stream().ptr
        nbytes = x[0].nbytes
        nccl.groupStart()
        try:
            for peer in range(self.size):
                self.comm.send(x[peer].data.ptr, nbytes, nccl.NCCL_UINT8, peer, stream)
                self.comm.recv(out[peer].data.ptr, nbytes, nccl.NCCL_UINT8, peer, stream)
        finally:
            nccl.groupEnd()
        return out

    def _reduce_scatter(self, x):
        cp, nccl = self._cp, self._nccl
        x = self._device_array(x, "x")
        if x.shape[0] != self.size:
            raise ValueError(f"reduce_scatter needs [size={self.size}, ...], got "
                             f"{tuple(x.shape)}")
        types = {np.dtype(np.float32): nccl.NCCL_FLOAT32,
                 np.dtype(np.float64): nccl.NCCL_FLOAT64,
                 np.dtype(np.float16): nccl.NCCL_FLOAT16}
        if np.dtype(x.dtype) not in types:
            return super()._reduce_scatter(x)
        out = cp.empty(x.shape[1:], dtype=x.dtype)
        self.comm.reduceScatter(x.data.ptr, out.data.ptr, out.size, types[np.dtype(x.dtype)],
                                nccl.NCCL_SUM, cp.cuda.get_current_stream().ptr)
        return out

    def allgather_object(self, obj) -> list:
        return self._host.allgather_object(obj)

    def barrier(self):
        self._host.barrier()

    def gpus_per_node(self) -> int:
        return self._host.gpus_per_node()

    def _subgroup(self, groups, mine):
        sub = self._host.comm.Split(mine, groups[mine].index(self.rank))
        return NcclGroup(sub, device=self.device, timeout=self._host.timeout)

    def abort(self, error=None):
        report_abort(self.rank, error)
        try:
            self.comm.abort()                 # unblocks kernels waiting on peers
        finally:
            self._host.abort()                # MPI_Abort: ends every rank
