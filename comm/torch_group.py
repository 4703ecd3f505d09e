"""The torch.distributed group: point-to-point and collectives of a `ProcessGroup`.

Gloo on a CPU machine, NCCL on GPUs: a job launched with `torchrun --nproc-per-node N` (or any
launcher that calls `torch.distributed.init_process_group`) runs context-parallel attention
over its default group, or over any sub-group of it.

Working arrays (NumPy, or CuPy on a GPU) travel as byte views wrapped as tensors without a copy
(`torch.from_numpy`, DLPack), so every dtype works, bfloat16 included. A channel's batch is one
`batch_isend_irecv`, so the ring's next K/V transfer runs while this step's kernel does; the
collectives are `all_gather`, `all_to_all_single` and `all_gather_object`. Waits are bounded
by the process group's own timeout (`init_process_group(timeout=...)`); `abort` reports the
error and ends this process, which ends the job under torchrun.
"""
from __future__ import annotations

import os
import sys
import weakref

import numpy as np

from varlen._array import array_module

from .group import Group, report_abort

__all__ = ["TorchGroup", "torch_group"]


def _bytes(x):
    """A flat uint8 tensor sharing `x`'s memory (x: a C-contiguous NumPy or CuPy array)."""
    import torch
    if isinstance(x, np.ndarray):
        return torch.from_numpy(x.reshape(-1).view(np.uint8))
    xp = array_module(x)
    return torch.from_dlpack(x.reshape(-1).view(xp.uint8))


class TorchGroup(Group):
    """One rank of a `torch.distributed` process group (use `torch_group(pg)`).

    `rank` and `size` are the rank and size within `pg`; peers are translated to global ranks
    for the point-to-point calls.
    """

    def __init__(self, process_group=None):
        import torch.distributed as dist
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised: call "
                               "torch.distributed.init_process_group(...) first (torchrun "
                               "sets up its environment)")
        self._dist = dist
        self.pg = process_group
        self.size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        if self.rank < 0:
            raise ValueError("this process is not a member of the given process group")
        self._global = [r if process_group is None else dist.get_global_rank(process_group, r)
                        for r in range(self.size)]

    # Point to point --------------------------------------------------------------------------

    def _start(self, ops, tag):
        dist = self._dist
        p2p, keep = [], []
        for kind, x, peer in ops:
            if kind == "send":
                x = array_module(x).ascontiguousarray(x)
                keep.append(x)                  # alive until the batch completes
            op = dist.isend if kind == "send" else dist.irecv
            p2p.append(dist.P2POp(op, _bytes(x), self._global[peer], group=self.pg, tag=tag))
        return dist.batch_isend_irecv(p2p), keep

    def _finish(self, handle):
        reqs, _ = handle
        for req in reqs:
            req.wait()

    # Collectives ----------------------------------------------------------------------------

    def _allgather(self, x):
        xp = array_module(x)
        x = xp.ascontiguousarray(x)
        out = xp.empty((self.size,) + tuple(x.shape), dtype=x.dtype)
        self._dist.all_gather([_bytes(out[r]) for r in range(self.size)], _bytes(x),
                              group=self.pg)
        return out

    def _alltoall(self, x):
        if x.shape[0] != self.size:
            raise ValueError(f"alltoall needs [size={self.size}, ...], got {tuple(x.shape)}")
        xp = array_module(x)
        x = xp.ascontiguousarray(x)
        out = xp.empty(tuple(x.shape), dtype=x.dtype)
        self._dist.all_to_all_single(_bytes(out), _bytes(x), group=self.pg)
        return out

    def allgather_object(self, obj) -> list:
        every = [None] * self.size
        self._dist.all_gather_object(every, obj, group=self.pg)
        return every

    def barrier(self):
        self._allgather(np.zeros(1, np.uint8))

    def gpus_per_node(self) -> int:
        import os
        return min(self.size, int(os.environ.get("LOCAL_WORLD_SIZE", self.size)))

    def _subgroup(self, groups, mine):
        # every rank makes every subgroup, in the same order (torch.distributed's rule)
        pgs = [self._dist.new_group([self._global[r] for r in g]) for g in groups]
        return TorchGroup(pgs[mine])

    def abort(self, error=None):
        # torch.distributed cannot wake a peer blocked in a transfer; ending this process
        # closes its connections, which fails the peers' transfers (and torchrun ends the job).
        report_abort(self.rank, error)
        sys.stdout.flush()
        os._exit(1)


_GROUPS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_DEFAULT: dict = {}


def torch_group(process_group=None) -> TorchGroup:
    """This rank's `TorchGroup` over `process_group` (None: the default group), made once per
    process group and reused."""
    if process_group is None:
        import torch.distributed as dist
        if not dist.is_available() or not dist.is_initialized():
            return TorchGroup(None)          # raises: torch.distributed is not initialised
        key = id(dist.distributed_c10d._get_default_group())
        if key not in _DEFAULT:
            _DEFAULT.clear()
            _DEFAULT[key] = TorchGroup(None)
        return _DEFAULT[key]
    group = _GROUPS.get(process_group)
    if group is None:
        group = _GROUPS[process_group] = TorchGroup(process_group)
    return group
