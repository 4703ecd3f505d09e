"""Attention sinks under context parallelism, checked on one rank of any group.

`check_sinks(group, case, method, scheme)` builds the same global batch on every rank, shards
it, runs `varlen.comm.attention_forward/backward` with the case's sinks (and mask, and score
function), and compares this rank's shards of out, lse, dq, dk, dv with the float64
reference's (1e-12), `dsinks` (summed over the group, and each rank's share added up) with
the reference's, and the bytes each call moved with the traffic model's. As a script, one
rank of a job:

    mpiexec -n N python -m mpi4py tests/comm_workers/sinks_cp.py mpi    # every case, MPI group
    torchrun --nproc-per-node 2 tests/comm_workers/sinks_cp.py torch    # varlen.torch, gloo
    python tests/comm_workers/sinks_cp.py jax      # varlen.jax inside shard_map, 4 host devices
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from functools import partial

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.dirname(_HERE)]           # the tests' helpers and gallery

import numpy as np  # noqa: E402

import varlen  # noqa: E402
import varlen.comm as vc  # noqa: E402
from varlen import reference  # noqa: E402

import mods_cases as gallery  # noqa: E402
from cases import _assert_close  # noqa: E402
from launch import (check_rank_shards, check_torch_shards, global_batch,  # noqa: E402
                    jax_main, mpi_main, torch_main)
from varlen.comm.model import call_traffic  # noqa: E402

TOL = 1e-12                  # float64 data: out, lse, dq, dk, dv, dsinks
SCHEMES = ("zigzag", "document")


@dataclass(frozen=True)
class SinksCase:
    """A batch (lengths not divisible by 2*cp, zero-length and one-token sequences) with
    sinks, a built-in mask or a gallery MaskMod, and optionally a gallery ScoreMod; `Hq`
    divides by 4, so Ulysses runs on 2 and 4 ranks."""

    name: str
    lengths: tuple
    window: int | None = None       # a sliding causal window (built-in Mask); None: `mask_id`
    mask_id: str | None = None      # a `gallery.mask_cases` id
    score: str | None = None        # a `gallery.score_cases` id
    Hq: int = 4
    Hk: int = 2
    D: int = 8
    seed: int = 0

    @property
    def id(self):
        return self.name

    def functions(self):
        """`(mask, score_mod, sinks)`; host NumPy arrays."""
        if self.mask_id is None:
            mask = varlen.Mask(window_left=self.window, window_right=0)
        else:
            mask = dict(gallery.mask_cases(self.lengths, self.seed))[self.mask_id]
        score = None if self.score is None else dict(
            gallery.score_cases(self.Hq, self.seed))[self.score]
        # large enough that some rows' weight goes mostly to the sink, one head without
        sinks = np.random.default_rng(self.seed + 7).standard_normal(self.Hq) * 3.0
        sinks[-1] = -np.inf
        return mask, score, sinks


SINKS_CASES = [
    # a sliding window: rows of the first tokens see one key, a one-token sequence
    SinksCase("window", (0, 19, 1, 6, 0, 11), window=3),
    # chunked causal (most ring steps see nothing) with ALiBi, MQA
    SinksCase("chunked+alibi", (25, 3, 11), mask_id="chunked", score="alibi", Hk=1, seed=1),
]


def partition(cu, cp, scheme):
    if scheme == "document":
        return vc.partition(cu, cp, "document", max_doc_len=8)
    return vc.partition(cu, cp, scheme)


def reference_results(case: SinksCase, g: dict):
    mask, score, sinks = case.functions()
    kw = dict(mask=mask, score_mod=score, sinks=sinks)
    out, lse = reference.attention_dense(g["q"], g["k"], g["v"], g["cu"], g["cu"], **kw)
    grads = reference.attention_dense_backward(g["dout"], g["q"], g["k"], g["v"], g["cu"],
                                               g["cu"], **kw)
    return out, lse, grads


def check_sinks(group, case: SinksCase, method: str, scheme: str) -> None:
    """One rank's check (asserts)."""
    r, cp = group.rank, group.size
    g = global_batch(case)
    mask, score, sinks = case.functions()
    part = partition(g["cu"], cp, scheme)
    kw = dict(mask=mask, score_mod=score, method=method, sinks=sinks)
    q, k, v, dout = (part.shard(g[x], r) for x in ("q", "k", "v", "dout"))
    out, lse, fwd_bytes = vc.attention_forward(q, k, v, part, group, return_stats=True, **kw)
    dq, dk, dv, dsinks, bwd_bytes = vc.attention_backward(dout, q, k, v, out, lse, part, group,
                                                          return_stats=True, **kw)
    # the bytes exactly what the traffic model predicts
    for what, moved in (("forward", fwd_bytes), ("backward", bwd_bytes)):
        want = call_traffic(part, r, method, heads_q=case.Hq, heads_k=case.Hk,
                            head_dim=case.D, dtype="float64", backward=what == "backward",
                            sinks=True)
        assert moved == want, f"{case.id} {method} {what} rank {r}: {moved} != model {want}"
    share = vc.attention_backward(dout, q, k, v, out, lse, part, group, sinks_grad="rank",
                                  **kw)[3]
    ref_out, ref_lse, ref_grads = reference_results(case, g)
    label = f"{case.id} cp={cp} {scheme} {method} rank {r}"
    check_rank_shards(label, part, r, out, lse, (dq, dk, dv, dsinks), ref_out, ref_lse,
                      ref_grads, TOL)
    summed = group.allgather(np.asarray(share)).sum(axis=0)
    _assert_close(f"{label} dsinks shares", summed, ref_grads[3], TOL)


def combos(cp: int):
    return [(case, method, scheme) for case in SINKS_CASES for scheme in SCHEMES
            for method in vc.METHODS if method != "ulysses" or case.Hq % cp == 0]


# --------------------------------------------------------------------------------------------
# PyTorch: learnable sinks through varlen.torch.context_parallel_attention
# --------------------------------------------------------------------------------------------

def check_torch(group, case: SinksCase, method: str, scheme: str) -> None:
    """`varlen.torch.context_parallel_attention` with learnable sinks: out, dq, dk, dv shards
    and the sinks' gradient (each rank's share, summed over the group as a training step sums
    parameter gradients) against the reference."""
    import torch
    import torch.distributed as dist
    import varlen.torch as vt
    from varlen._torch_ops import _cp_group

    rank, cp = _cp_group(group).rank, _cp_group(group).size
    g = global_batch(case)
    mask, score, sinks = case.functions()
    if score is not None:
        score = varlen.ScoreMod(score.fn, *map(torch.as_tensor, score.aux))
    if not isinstance(mask, varlen.Mask):
        mask = varlen.MaskMod(mask.fn, *map(torch.as_tensor, mask.aux), base=mask.base)
    part = partition(g["cu"], cp, scheme)
    t_sinks = torch.tensor(sinks, requires_grad=True)
    q, k, v = (torch.tensor(part.shard(g[x], rank), requires_grad=True) for x in "qkv")
    out = vt.context_parallel_attention(q, k, v, part, group, mask=mask, score_mod=score,
                                        method=method, sinks=t_sinks)
    (out * torch.as_tensor(part.shard(g["dout"], rank))).sum().backward()
    ref_out, _, ref_grads = reference_results(case, g)
    label = f"torch {case.id} cp={cp} {scheme} {method} rank {rank}"
    check_torch_shards(label, part, rank, out, (q, k, v), t_sinks, ref_out, ref_grads, TOL,
                       group)


# --------------------------------------------------------------------------------------------
# JAX: varlen.jax.context_parallel_attention inside shard_map, replicated learnable sinks
# --------------------------------------------------------------------------------------------

def check_jax(case: SinksCase, cp: int, method: str, scheme: str) -> None:
    """Outputs and gradients (q, k, v and the sinks, entering the shard_map replicated) of the
    concatenated shards against the reference, under `jax.jit(jax.grad(...))`."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, PartitionSpec as P
    import varlen.jax as vj

    g = global_batch(case)
    mask, score, sinks = case.functions()
    part = partition(g["cu"], cp, scheme)
    mesh = Mesh(np.array(jax.devices()[:cp]), ("cp",))

    def sharded(x):
        return jnp.concatenate([part.shard(x, r) for r in range(cp)])

    def loss(q, k, v, s):
        def body(q, k, v, s):
            return vj.context_parallel_attention(q, k, v, part, axis_name="cp", mask=mask,
                                                 score_mod=score, method=method, sinks=s)
        f = jax.shard_map(body, mesh=mesh, in_specs=(P("cp"),) * 3 + (P(),),
                          out_specs=P("cp"))
        out = f(q, k, v, s)
        return jnp.sum(out * sharded(g["dout"])), out

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True))
    grads, out = grad(*(sharded(g[x]) for x in "qkv"), jnp.asarray(sinks))
    ref_out, _, ref_grads = reference_results(case, g)
    label = f"jax {case.id} cp={cp} {scheme} {method}"
    _assert_close(f"{label} out", out, sharded(ref_out), TOL)
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads):
        _assert_close(f"{label} {name}", got, sharded(want), TOL)
    _assert_close(f"{label} dsinks", grads[3], ref_grads[3], TOL)


def _jax_main():
    jax_main([partial(check_jax, case, cp, method, scheme) for cp, case, method, scheme in (
        (2, SINKS_CASES[0], "ring", "document"), (4, SINKS_CASES[0], "ulysses", "zigzag"),
        (4, SINKS_CASES[1], "ring", "zigzag"), (2, SINKS_CASES[1], "allgather", "document"))])


def _torch_main():
    torch_main([partial(check_torch, None, case, method, scheme)
                for method, scheme in (("ring", "document"), ("ulysses", "zigzag"))
                for case in SINKS_CASES])


if __name__ == "__main__":
    {"mpi": partial(mpi_main, "sinks", combos, check_sinks), "torch": _torch_main,
     "jax": _jax_main}[sys.argv[1]]()
