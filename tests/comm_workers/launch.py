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


def check_rank_shards(label: str, part, r: int, out, lse, grads, ref_out, ref_lse, ref_grads,
                      tol) -> None:
    """Rank `r`'s shards of out, lse and `grads` (dq, dk, dv[, dsinks]) against the
    single-process reference; its pad rows zero in out and the gradients, -inf in lse."""
    from cases import _assert_close
    _assert_close(f"{label} out", out, part.shard(ref_out, r), tol)
    _assert_close(f"{label} lse", lse, part.shard(ref_lse, r, axis=1, fill=-np.inf), tol)
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads):
        _assert_close(f"{label} {name}", got, part.shard(want, r), tol)
    if len(grads) > 3 and grads[3] is not None:
        _assert_close(f"{label} dsinks", grads[3], ref_grads[3], tol)
    pad = ~part.valid(r)
    assert np.isneginf(lse[:, pad]).all(), f"{label}: pad rows' lse is not -inf"
    for name, a in zip(("out", "dq", "dk", "dv"), (out, *grads[:3])):
        assert not a[pad].any(), f"{label}: {name} is not zero on pad rows"


def check_torch_shards(label: str, part, rank: int, out, inputs, t_sinks, ref_out, ref_grads,
                       tol, group=None) -> None:
    """A torch rank's shards of out and of the gradients of `inputs` (q, k, v), and the sinks'
    gradient summed over the ranks (`group`: None, the world), against the single-process
    reference `ref_out`, `ref_grads` (dq, dk, dv[, dsinks])."""
    import torch.distributed as dist
    from cases import _assert_close
    _assert_close(f"{label} out", out.detach(), part.shard(ref_out, rank), tol)
    for name, t, want in zip(("dq", "dk", "dv"), inputs, ref_grads):
        _assert_close(f"{label} {name}", t.grad, part.shard(want, rank), tol)
    if t_sinks is not None:
        total = t_sinks.grad.clone()
        dist.all_reduce(total, group=group)
        _assert_close(f"{label} dsinks", total, ref_grads[3], tol)


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
