"""Mask and score functions under context parallelism, checked on one rank of any group.

`check_mods(group, case, method, scheme)` builds the same global batch on every rank, shards
it, runs `varlen.comm.attention_forward/backward` with the case's MaskMod and ScoreMod, and
compares this rank's shards of out, lse, dq, dk and dv with the shards of the single-process
float64 reference (1e-12), and the aux gradients, summed over the group, with the reference's
(float32, as the API returns them); each rank's share (`aux_grads="rank"`) must add up to the
same sum. As a script, one rank of a job:

    mpiexec -n N python -m mpi4py tests/comm_workers/mods_cp.py mpi     # every case, MPI group
    torchrun --nproc-per-node 2 tests/comm_workers/mods_cp.py torch     # varlen.torch, gloo
    python tests/comm_workers/mods_cp.py jax       # varlen.jax inside shard_map, 4 host devices
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
from launch import global_batch, jax_main, mpi_main, torch_main  # noqa: E402

TOL = 1e-12                  # float64 data: out, lse, dq, dk, dv
AUX_TOL = 2e-6               # aux gradients come back in float32 (relative to max |ref|)
SCHEMES = ("zigzag", "document")
DOC_SPLIT = 8                # the document scheme splits documents longer than this


@dataclass(frozen=True)
class ModsCase:
    """A batch (lengths not divisible by 2*cp, zero-length sequences) with a gallery mask and
    score function; `Hq` divides by 4, so Ulysses runs on 2 and 4 ranks."""

    name: str
    lengths: tuple
    mask: str                       # a `gallery.mask_cases` id
    score: str | None = None        # a `gallery.score_cases` id
    Hq: int = 4
    Hk: int = 2
    D: int = 8
    softcap: float = 0.0
    seed: int = 0

    @property
    def id(self):
        return self.name

    def functions(self):
        """`(mask, score_mod)` built for the batch (aux arrays: host NumPy)."""
        mask = dict(gallery.mask_cases(self.lengths, self.seed))[self.mask]
        score = None if self.score is None else dict(gallery.score_cases(self.Hq,
                                                                         self.seed))[self.score]
        return mask, score


MODS_CASES = [
    # per-sequence aux (prefix lengths), ALiBi's per-head slopes; empty first and last
    ModsCase("prefix-lm+alibi", (0, 13, 7, 1, 22, 0), "prefix-lm", "alibi"),
    # per-token aux (segments inside a document), a relative bias table per head, MQA
    ModsCase("segments+relative-bias", (9, 0, 30, 5), "segments", "relative-bias", Hk=1),
    # chunked causal: most ring steps of the long document see nothing
    ModsCase("chunked", (25, 3, 11), "chunked", Hk=4, seed=1),
    # a built-in window ANDed with a mask_mod, T5 buckets (int and float aux), softcap
    ModsCase("window&prefix+t5", (17, 2, 0, 12), "window&prefix", "t5", softcap=5.0, seed=2),
]


def partition(case: ModsCase, cu, cp, scheme, mask):
    if scheme == "document":
        # balanced by the mask_mod's work; long documents split so that rings exchange
        return vc.partition(cu, cp, "document", mask=mask, max_doc_len=DOC_SPLIT)
    return vc.partition(cu, cp, scheme)


def reference_results(case: ModsCase, g: dict):
    mask, score = case.functions()
    kw = dict(mask=mask, score_mod=score, softcap=case.softcap)
    out, lse = reference.attention_dense(g["q"], g["k"], g["v"], g["cu"], g["cu"], **kw)
    grads = reference.attention_dense_backward(g["dout"], g["q"], g["k"], g["v"], g["cu"],
                                               g["cu"], aux_grads=score is not None, **kw)
    return out, lse, grads


def check_mods(group, case: ModsCase, method: str, scheme: str) -> None:
    """One rank's check (asserts)."""
    r, cp = group.rank, group.size
    g = global_batch(case)
    mask, score = case.functions()
    part = partition(case, g["cu"], cp, scheme, mask)
    kw = dict(mask=mask, score_mod=score, softcap=case.softcap, method=method)
    q, k, v, dout = (part.shard(g[x], r) for x in ("q", "k", "v", "dout"))
    out, lse = vc.attention_forward(q, k, v, part, group, **kw)
    dq, dk, dv, *daux = vc.attention_backward(dout, q, k, v, out, lse, part, group,
                                              aux_grads=score is not None, **kw)
    ref_out, ref_lse, ref_grads = reference_results(case, g)
    label = f"{case.id} cp={cp} {scheme} {method} rank {r}"
    _assert_close(f"{label} out", out, part.shard(ref_out, r), TOL)
    _assert_close(f"{label} lse", lse, part.shard(ref_lse, r, axis=1, fill=-np.inf), TOL)
    for name, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv), ref_grads):
        _assert_close(f"{label} {name}", got, part.shard(want, r), TOL)
    pad = ~part.valid(r)
    for name, a in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert not a[pad].any(), f"{label}: {name} is not zero on pad rows"
    if score is None:
        return
    shares = vc.attention_backward(dout, q, k, v, out, lse, part, group, aux_grads="rank",
                                   **kw)[3]
    for i, (got, share, want) in enumerate(zip(daux[0], shares, ref_grads[3])):
        if want is None:
            assert got is None and share is None, f"{label}: aux {i} got a gradient"
            continue
        assert got.dtype == np.float32, f"{label}: aux {i} gradient is {got.dtype}"
        bound = AUX_TOL * max(1.0, float(np.abs(want).max()))
        err = float(np.abs(got - want).max())
        assert err <= bound, f"{label}: aux {i} gradient error {err:.2e} > {bound:.2e}"
        summed = group.allgather(share.astype(np.float64)).sum(axis=0)
        err = float(np.abs(summed - got).max())
        assert err <= bound, f"{label}: aux {i} shares add up to {err:.2e} off the sum"


def combos(cp: int):
    return [(case, method, scheme) for case in MODS_CASES for scheme in SCHEMES
            for method in vc.METHODS if method != "ulysses" or case.Hq % cp == 0]


# --------------------------------------------------------------------------------------------
# PyTorch: learnable aux tensors through varlen.torch.context_parallel_attention
# --------------------------------------------------------------------------------------------

def check_torch(group, case: ModsCase, method: str, scheme: str) -> None:
    """`varlen.torch.context_parallel_attention` with the case's functions, every float aux a
    learnable tensor: out, dq, dk, dv shards and the aux gradients (each rank's share, summed
    over the group as a training step sums parameter gradients) against the reference."""
    import torch
    import torch.distributed as dist
    import varlen.torch as vt
    from varlen._torch_ops import _cp_group

    rank, cp = _cp_group(group).rank, _cp_group(group).size
    g = global_batch(case)
    mask, score = case.functions()
    part = partition(case, g["cu"], cp, scheme, mask)
    t_mask = varlen.MaskMod(mask.fn, *map(torch.as_tensor, mask.aux), base=mask.base)
    aux = [torch.tensor(a, dtype=torch.float64, requires_grad=True)
           if np.issubdtype(a.dtype, np.floating) else torch.as_tensor(a) for a in score.aux]
    t_score = varlen.ScoreMod(score.fn, *aux)
    q, k, v = (torch.tensor(part.shard(g[x], rank), requires_grad=True) for x in "qkv")
    out = vt.context_parallel_attention(q, k, v, part, group, mask=t_mask, score_mod=t_score,
                                        softcap=case.softcap, method=method)
    (out * torch.as_tensor(part.shard(g["dout"], rank))).sum().backward()
    ref_out, _, ref_grads = reference_results(case, g)
    label = f"torch {case.id} cp={cp} {scheme} {method} rank {rank}"
    _assert_close(f"{label} out", out.detach(), part.shard(ref_out, rank), TOL)
    for name, t, want in zip(("dq", "dk", "dv"), (q, k, v), ref_grads):
        _assert_close(f"{label} {name}", t.grad, part.shard(want, rank), TOL)
    for i, (a, want) in enumerate(zip(aux, ref_grads[3])):
        if want is None:
            assert a.grad is None, f"{label}: int aux {i} got a gradient"
            continue
        total = a.grad.clone()
        dist.all_reduce(total, group=group)
        bound = AUX_TOL * max(1.0, float(np.abs(want).max()))
        err = float((total - torch.as_tensor(want)).abs().max())
        assert err <= bound, f"{label}: aux {i} gradient error {err:.2e} > {bound:.2e}"


# --------------------------------------------------------------------------------------------
# JAX: varlen.jax.context_parallel_attention inside shard_map, a learnable aux array
# --------------------------------------------------------------------------------------------

def check_jax(case: ModsCase, cp: int, method: str, scheme: str) -> None:
    """Outputs and gradients (q, k, v and every float aux, entering the shard_map replicated)
    of the concatenated shards against the reference, under `jax.jit(jax.grad(...))`."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, PartitionSpec as P
    import varlen.jax as vj

    g = global_batch(case)
    mask, score = case.functions()
    part = partition(case, g["cu"], cp, scheme, mask)
    mesh = Mesh(np.array(jax.devices()[:cp]), ("cp",))

    def sharded(x):
        return jnp.concatenate([part.shard(x, r) for r in range(cp)])

    def loss(q, k, v, aux):
        def body(q, k, v, aux):
            return vj.context_parallel_attention(
                q, k, v, part, axis_name="cp", mask=mask, softcap=case.softcap, method=method,
                score_mod=varlen.ScoreMod(score.fn, *aux))
        f = jax.shard_map(body, mesh=mesh, in_specs=(P("cp"),) * 3 + (P(),),
                          out_specs=P("cp"))
        out = f(q, k, v, aux)
        return jnp.sum(out * sharded(g["dout"])), out

    aux = tuple(jnp.asarray(a, jnp.float64) if np.issubdtype(a.dtype, np.floating)
                else jnp.asarray(a) for a in score.aux)
    floats = tuple(i for i, a in enumerate(score.aux) if np.issubdtype(a.dtype, np.floating))

    def loss_of(q, k, v, *fl):
        full = list(aux)
        for i, a in zip(floats, fl):
            full[i] = a
        return loss(q, k, v, tuple(full))
    grad = jax.jit(jax.grad(loss_of, argnums=tuple(range(3 + len(floats))), has_aux=True))
    grads, out = grad(*(sharded(g[x]) for x in "qkv"), *(aux[i] for i in floats))
    ref_out, _, ref_grads = reference_results(case, g)
    label = f"jax {case.id} cp={cp} {scheme} {method}"
    _assert_close(f"{label} out", out, sharded(ref_out), TOL)
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads):
        _assert_close(f"{label} {name}", got, sharded(want), TOL)
    for i, got in zip(floats, grads[3:]):
        want = ref_grads[3][i]
        bound = AUX_TOL * max(1.0, float(np.abs(want).max()))
        err = float(np.abs(np.asarray(got) - want).max())
        assert err <= bound, f"{label}: aux {i} gradient error {err:.2e} > {bound:.2e}"


def _jax_main():
    jax_main([partial(check_jax, case, cp, method, scheme) for cp, case, method, scheme in (
        (2, MODS_CASES[0], "ring", "document"), (4, MODS_CASES[0], "ulysses", "zigzag"),
        (4, MODS_CASES[1], "ring", "zigzag"), (2, MODS_CASES[1], "allgather", "document"),
        (4, MODS_CASES[3], "ring", "document"))])


def _torch_main():
    torch_main([partial(check_torch, None, case, method, scheme)
                for method, scheme in (("ring", "document"), ("ulysses", "zigzag"))
                for case in MODS_CASES[:2]])


if __name__ == "__main__":
    {"mpi": partial(mpi_main, "mods", combos, check_mods), "torch": _torch_main,
     "jax": _jax_main}[sys.argv[1]]()
