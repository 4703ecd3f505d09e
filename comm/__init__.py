"""Context parallelism for varlen attention (installed as `varlen.comm`).

    import varlen.comm as vc
    group = vc.init(MPI.COMM_WORLD, backend="nccl")          # or "mpi", or vc.local_group(n)
    part = vc.partition(cu_seqlens, group.size)              # zigzag, any lengths
    q_r, k_r, v_r = (part.shard(x, group.rank) for x in (q, k, v))
    steps = vc.plan(part, group.rank, mask="causal", dtype="bfloat16", head_dim=128)  # optional
    out_r, lse_r = vc.attention_forward(q_r, k_r, v_r, part, group, mask="causal", plan=steps)
    dq_r, dk_r, dv_r = vc.attention_backward(dout_r, q_r, k_r, v_r, out_r, lse_r, part, group,
                                             mask="causal", plan=steps)

See `docs/context_parallel.md`. mpi4py, CuPy and torch are imported only when a group needs
them; under torchrun, `torch_group()` is the default torch.distributed group.
"""
from .attention import METHODS, TWO_LEVEL_METHODS, attention_backward, attention_forward
from .chunked import CHUNK_SCHEMES, Partition, local_rows_bound
from .group import (DEFAULT_TIMEOUT, P2P, Group, GroupAborted, LocalGroup, LocalGroups, Traffic,
                    local_group)
from .merge import merge_partial
from .partition import SCHEMES, partition
from .plans import StepPlans, plan
from .torch_group import TorchGroup, torch_group

__all__ = ["partition", "Partition", "local_rows_bound", "plan", "StepPlans", "init",
           "local_group", "torch_group", "TorchGroup", "Group", "LocalGroup", "LocalGroups", "P2P",
           "GroupAborted", "Traffic", "attention_forward", "attention_backward", "merge_partial",
           "METHODS", "TWO_LEVEL_METHODS", "SCHEMES", "CHUNK_SCHEMES", "DEFAULT_TIMEOUT"]

BACKENDS = ("mpi", "nccl")


def init(mpi_comm=None, backend="mpi", **options) -> Group:
    """This rank's group over an mpi4py communicator (default `MPI.COMM_WORLD`).

    Args:
        mpi_comm: an `mpi4py.MPI.Comm`; its ranks become the context-parallel ranks.
        backend: `"mpi"` (mpi4py on host buffers; `cuda_aware=True` passes device buffers to
            a CUDA-aware MPI) or `"nccl"` (`cupy.cuda.nccl`, one GPU per rank chosen from the
            node-local rank unless `device=` is given; the unique id travels over MPI).
        timeout: seconds a rank waits on the host for a peer (default `DEFAULT_TIMEOUT`,
            60); a peer still missing then is named in the error that aborts the job.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not a known communicator backend; expected "
                         f"one of {', '.join(map(repr, BACKENDS))}")
    if mpi_comm is None:
        from mpi4py import MPI
        mpi_comm = MPI.COMM_WORLD
    if not hasattr(mpi_comm, "Get_size"):
        raise TypeError(f"mpi_comm must be an mpi4py communicator, got "
                        f"{type(mpi_comm).__name__}")
    if backend == "mpi":
        from .mpi_group import MpiGroup
        return MpiGroup(mpi_comm, **options)
    from .nccl_group import NcclGroup
    return NcclGroup(mpi_comm, **options)
