"""Two-level context parallelism (`method="usp"`), checked on one rank of any group.

`check_usp(group, case, u, scheme)` builds the same global batch on every rank, shards it, runs
`varlen.comm.attention_forward/backward` with `method="usp", ulysses_size=u` (Ulysses inside
each group of u consecutive ranks, the ring across the groups) and compares this rank's shards
of out, lse, dq, dk, dv (and dsinks) with the float64 reference's (1e-12); the call's counted
bytes come in the levels the layout implies. As a script, one rank of a job:

    mpiexec -n N python -m mpi4py tests/comm_workers/usp_cp.py mpi   # every u dividing N
    torchrun --nproc-per-node 4 tests/comm_workers/usp_cp.py torch   # varlen.torch, gloo
    python tests/comm_workers/usp_cp.py jax      # varlen.jax, shard_map on a 2-D host mesh
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from functools import partial

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.dirname(_HERE)]           # the tests' helpers

import numpy as np  # noqa: E402

import varlen  # noqa: E402
import varlen.comm as vc  # noqa: E402
from varlen import reference  # noqa: E402

from cases import _assert_close  # noqa: E402
from launch import (check_rank_shards, check_torch_shards, global_batch,  # noqa: E402
                    jax_main, mpi_main, torch_main)
from varlen.comm.model import call_traffic  # noqa: E402

TOL = 1e-12
SCHEMES = ("zigzag", "document")


def _head_bias(score, b, h, q_idx, k_idx, w):
    """A per-head bias on the distance: wrong under usp if `h` were the local head."""
    return score - w[h] * abs(q_idx - k_idx)


@dataclass(frozen=True)
class UspCase:
    """A batch with lengths not divisible by 2*cp, empty and one-token sequences, a mask per
    sequence (causal, full, windows, bottom-right), 12 query heads (usp's u of 1, 2, 3, 4, 6
    divide them) over Hk key heads (replicated where u does not divide Hk)."""

    name: str
    lengths: tuple
    Hk: int = 2
    score: bool = False
    sinks: bool = False
    Hq: int = 12
    D: int = 8
    seed: int = 0

    @property
    def id(self):
        return self.name

    def mask(self):
        B = len(self.lengths)
        left = np.array([-1, -1, 3, 0, 5, -1, 2, -1][:B], np.int32)
        right = np.array([0, -1, 0, 0, 1, 0, 0, -1][:B], np.int32)
        br = np.array([False, False, True, False, False, True, False, False][:B])
        return varlen.Mask(window_left=left, window_right=right, bottom_right=br)

    def functions(self):
        """`(score_mod or None, sinks or None)`; host NumPy arrays."""
        rng = np.random.default_rng(self.seed + 3)
        score = varlen.ScoreMod(_head_bias, rng.uniform(0, 0.5, self.Hq)) if self.score \
            else None
        sinks = rng.standard_normal(self.Hq) * 2 if self.sinks else None
        return score, sinks


USP_CASES = [
    UspCase("mixed-masks-gqa", (0, 13, 7, 1, 22, 5, 0, 9)),
    UspCase("head-bias+sinks-mqa", (11, 0, 30, 2, 6), Hk=1, score=True, sinks=True, seed=1),
]


def partition(cu, cp, scheme):
    if scheme == "document":
        return vc.partition(cu, cp, "document", max_doc_len=8)
    return vc.partition(cu, cp, scheme)


def reference_results(case: UspCase, g: dict):
    score, sinks = case.functions()
    kw = dict(mask=case.mask(), score_mod=score, sinks=sinks)
    out, lse = reference.attention_dense(g["q"], g["k"], g["v"], g["cu"], g["cu"], **kw)
    grads = reference.attention_dense_backward(g["dout"], g["q"], g["k"], g["v"], g["cu"],
                                               g["cu"], **kw)
    return out, lse, grads


def check_usp(group, case: UspCase, u: int, scheme: str) -> None:
    """One rank's check (asserts)."""
    r, cp = group.rank, group.size
    g = global_batch(case)
    score, sinks = case.functions()
    part = partition(g["cu"], cp, scheme)
    kw = dict(mask=case.mask(), score_mod=score, sinks=sinks, method="usp", ulysses_size=u)
    q, k, v, dout = (part.shard(g[x], r) for x in ("q", "k", "v", "dout"))
    out, lse, fwd_bytes = vc.attention_forward(q, k, v, part, group, return_stats=True, **kw)
    *grads, bwd_bytes = vc.attention_backward(dout, q, k, v, out, lse, part, group,
                                              return_stats=True, **kw)
    ref_out, ref_lse, ref_grads = reference_results(case, g)
    label = f"{case.id} cp={cp} u={u} {scheme} rank {r}"
    check_rank_shards(label, part, r, out, lse, grads, ref_out, ref_lse, ref_grads, TOL)
    # all-to-alls inside the node when u > 1, the ring across nodes when there are several;
    # the bytes exactly what the traffic model predicts
    for what, moved in (("forward", fwd_bytes), ("backward", bwd_bytes)):
        assert ("intra" in moved) == (u > 1), f"{label}: {what} bytes {moved}"
        assert ("inter" in moved) == (cp // u > 1), f"{label}: {what} bytes {moved}"
        want = call_traffic(part, r, "usp", heads_q=case.Hq, heads_k=case.Hk, head_dim=case.D,
                            dtype="float64", backward=what == "backward", ulysses_size=u,
                            sinks=sinks is not None)
        assert moved == want, f"{label}: {what} moved {moved}, the model says {want}"


def divisors(n: int) -> list:
    return [u for u in range(1, n + 1) if n % u == 0 and 12 % u == 0]


def combos(cp: int):
    return [(case, u, scheme) for case in USP_CASES for u in divisors(cp) for scheme in SCHEMES]


# --------------------------------------------------------------------------------------------
# PyTorch: varlen.torch.context_parallel_attention with method="usp"
# --------------------------------------------------------------------------------------------

def check_torch(case: UspCase, u: int, scheme: str) -> None:
    import torch
    import torch.distributed as dist
    import varlen.torch as vt
    rank, cp = dist.get_rank(), dist.get_world_size()
    g = global_batch(case)
    score, sinks = case.functions()
    if score is not None:
        score = varlen.ScoreMod(score.fn, *map(torch.as_tensor, score.aux))
    part = partition(g["cu"], cp, scheme)
    t_sinks = None if sinks is None else torch.tensor(sinks, requires_grad=True)
    q, k, v = (torch.tensor(part.shard(g[x], rank), requires_grad=True) for x in "qkv")
    out = vt.context_parallel_attention(q, k, v, part, None, mask=case.mask(), score_mod=score,
                                        sinks=t_sinks, method="usp", ulysses_size=u)
    (out * torch.as_tensor(part.shard(g["dout"], rank))).sum().backward()
    ref_out, _, ref_grads = reference_results(case, g)
    label = f"torch {case.id} cp={cp} u={u} {scheme} rank {rank}"
    check_torch_shards(label, part, rank, out, (q, k, v), t_sinks, ref_out, ref_grads, TOL)


# --------------------------------------------------------------------------------------------
# JAX: varlen.jax.context_parallel_attention inside shard_map over a 2-D mesh
# --------------------------------------------------------------------------------------------

def check_jax(case: UspCase, cp: int, u: int, scheme: str) -> None:
    """Outputs and gradients (q, k, v, and the sinks and the score function's weights,
    replicated) of the concatenated shards against the reference, under
    `jax.jit(jax.grad(...))`, on a mesh ("ring", "node") of (cp / u, u) devices."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, PartitionSpec as P
    import varlen.jax as vj

    g = global_batch(case)
    score, sinks = case.functions()
    part = partition(g["cu"], cp, scheme)
    mesh = Mesh(np.array(jax.devices()[:cp]).reshape(cp // u, u), ("ring", "node"))
    rows = P(("ring", "node"))

    def sharded(x):
        return jnp.concatenate([part.shard(x, r) for r in range(cp)])

    def loss(q, k, v, w, s):
        def body(q, k, v, w, s):
            mod = None if w is None else varlen.ScoreMod(score.fn, w)
            return vj.context_parallel_attention(q, k, v, part, axis_name=("ring", "node"),
                                                 mask=case.mask(), score_mod=mod, sinks=s,
                                                 method="usp")
        f = jax.shard_map(body, mesh=mesh, in_specs=(rows,) * 3 + (P(), P()), out_specs=rows)
        out = f(q, k, v, w, s)
        return jnp.sum(out * sharded(g["dout"])), out

    w = None if score is None else jnp.asarray(score.aux[0])
    s = None if sinks is None else jnp.asarray(sinks)
    argnums = (0, 1, 2) + ((3, 4) if score is not None else ())
    grads, out = jax.jit(jax.grad(loss, argnums=argnums, has_aux=True))(
        *(sharded(g[x]) for x in "qkv"), w, s)
    ref_out, _, ref_grads = reference_results(case, g)
    label = f"jax {case.id} cp={cp} u={u} {scheme}"
    _assert_close(f"{label} out", out, sharded(ref_out), TOL)
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads):
        _assert_close(f"{label} {name}", got, sharded(want), TOL)
    if sinks is not None:
        _assert_close(f"{label} dsinks", grads[4], ref_grads[3], TOL)


def check_jax_stats(cp: int, method: str, u: int | None) -> None:
    """`stats=` of the JAX entry point: what each rank's forward and backward traces move,
    equal to the model's count (`call_traffic`, which equals `varlen.comm`'s counters) on the
    zigzag layout."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, PartitionSpec as P
    import varlen.jax as vj

    case = USP_CASES[0]
    g = global_batch(case)
    part = partition(g["cu"], cp, "zigzag")
    if method == "usp":
        mesh = Mesh(np.array(jax.devices()[:cp]).reshape(cp // u, u), ("ring", "node"))
        spec, axis = P(("ring", "node")), ("ring", "node")
    else:
        mesh, spec, axis = Mesh(np.array(jax.devices()[:cp]), ("cp",)), P("cp"), "cp"
    stats = []

    def loss(q, k, v):
        f = jax.shard_map(lambda q, k, v: vj.context_parallel_attention(
            q, k, v, part, axis_name=axis, mask=case.mask(), method=method, stats=stats),
            mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)
        return f(q, k, v).sum()
    jax.grad(loss, argnums=(0, 1, 2))(*(jnp.concatenate([part.shard(g[x], r)
                                                          for r in range(cp)]) for x in "qkv"))
    for call in ("forward", "backward"):
        got = [x for x in stats if x["call"] == call][0]["ranks"]
        for r in range(cp):
            want = call_traffic(part, r, method, heads_q=case.Hq, heads_k=case.Hk,
                                head_dim=case.D, dtype="float64", ulysses_size=u,
                                backward=call == "backward")
            assert got[r] == want, f"jax {method} {call} rank {r}: {got[r]} != {want}"


def _jax_main():
    jax_main([partial(check_jax, case, cp, u, scheme) for cp, u, case, scheme in (
        (4, 2, USP_CASES[0], "zigzag"), (8, 4, USP_CASES[1], "document"),
        (6, 3, USP_CASES[1], "zigzag"), (8, 2, USP_CASES[0], "document"))] +
             [partial(check_jax_stats, cp, method, u) for cp, method, u in (
                 (4, "ring", None), (4, "allgather", None), (4, "ulysses", None),
                 (8, "usp", 2))], devices=8)


def _torch_main():
    torch_main([partial(check_torch, case, u, scheme) for case in USP_CASES
                for u, scheme in ((2, "zigzag"), (2, "document"))])


if __name__ == "__main__":
    {"mpi": partial(mpi_main, "usp", combos, check_usp), "torch": _torch_main,
     "jax": _jax_main}[sys.argv[1]]()
