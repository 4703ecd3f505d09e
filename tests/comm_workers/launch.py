"""What the context-parallel workers share: the global batch of a case, and the three ways a
worker runs as a script (one rank of an MPI job, one rank under torchrun with gloo, or JAX
over host devices in one process), each printing the line its test looks for."""
from __future__ import annotations

import os

import numpy as np

import varlen
import varlen.comm as vc


def global_batch(case) -> dict:
    """`cu`, `q`, `dout` `[T, Hq, D]`, `k`, `v` `[T, Hk, D]` (float64) of a case with
    `lengths`, `Hq`, `Hk`, `D` and `seed`."""
    rng = np.random.default_rng(case.seed)
    cu = np.concatenate([[0], np.cumsum(case.lengths)]).astype(np.int32)
    T = int(cu[-1])
    q, dout = (rng.standard_normal((T, case.Hq, case.D)) for _ in range(2))
    k, v = (rng.standard_normal((T, case.Hk, case.D)) for _ in range(2))
    return dict(cu=cu, q=q, k=k, v=v, dout=dout)


def mpi_main(name: str, combos, check) -> None:
    """Every `check(group, *combo)` of `combos(size)` on this MPI rank; rank 0 prints
    `OK <name> size=N checks=M`."""
    from mpi4py import MPI
    varlen.set_nan_fill(True)
    group = vc.init(MPI.COMM_WORLD, backend="mpi")
    n = 0
    for combo in combos(group.size):
        check(group, *combo)
        n += 1
    if group.rank == 0:
        print(f"OK {name} size={group.size} checks={n}", flush=True)


def torch_main(checks) -> None:
    """Every `check()` of `checks` on this torchrun rank (gloo); prints `rank R ok`."""
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    varlen.set_nan_fill(True)
    try:
        for check in checks:
            check()
        dist.barrier()
        print(f"rank {dist.get_rank()} ok", flush=True)
    finally:
        dist.destroy_process_group()


def jax_main(checks, devices: int = 4) -> None:
    """Every `check()` of `checks` over `devices` host devices (float64); prints `OK jax
    checks=N`."""
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    import jax
    jax.config.update("jax_enable_x64", True)
    varlen.set_nan_fill(True)
    n = 0
    for check in checks:
        check()
        n += 1
    print(f"OK jax checks={n}", flush=True)
